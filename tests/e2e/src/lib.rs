//! End-to-end test harness: a real etcd, kube-apiserver, kube-controller-manager and
//! kube-scheduler on loopback, started per test and torn down with it.
//!
//! The binaries come from `tests/scripts/build-controlplane.sh`, which builds them once from the
//! Go modules pinned in `tests/gotools/go.mod` (Kubernetes v1.36.3), or with `DRUST_K8S=1.37`
//! those of `tests/gotools/k8s137/go.mod` (v1.37.2; [`kubernetes::KubernetesVersion`]), into
//! `~/.cache/drust`. A cold machine spends about 15-25 minutes there on the first test; later
//! runs reuse the cache.
//!
//! A control plane is heavy (four processes, a few hundred MiB): keep one per test function and
//! one test function per file, so cargo runs them as separate processes.
//!
//! ```no_run
//! # async fn example() -> Result<(), drust_e2e::Error> {
//! use drust_e2e::{ControlPlane, ControlPlaneOptions};
//!
//! let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
//! cp.register_node("node-a", &[("gpu", "true")]).await?;
//! let client = cp.client().await?;
//! // ... create objects with `client`, watch the real scheduler and controllers act on them ...
//! # drop(client);
//! cp.stop().await?;
//! # Ok(())
//! # }
//! ```
//!
//! Environment: `DRUST_KEEP_CONTROLPLANE=1` keeps the temporary directory (certificates,
//! kubeconfigs, etcd data, one log file per component) and prints where it is.

pub mod binary;
pub mod claims;
pub mod cluster;
mod controlplane;
pub mod driver_root;
pub mod helm;
pub mod host;
pub mod http;
pub mod images;
pub mod kubelet;
pub mod kubernetes;
pub mod kueue;
pub mod manifests;
pub mod node;
pub mod node_pods;
pub mod paper;
pub mod plugin;
pub mod pods;
pub mod ports;
pub mod procstat;
pub mod prometheus;
pub mod rbac;
pub mod registry;
pub mod scripts;
pub mod wait;
pub mod workloads;

pub use controlplane::{
    CERTIFICATE_USER, Component, ControlPlane, ControlPlaneOptions, Error, KEEP_ENV, StartTimings,
    die_with_parent, host_address,
};
