//! The plugin's error: why it could not start or why it stopped, one variant per step, each
//! keeping its cause.

use crate::claims::ClaimError;
use crate::http::HttpError;
use crate::instance::InstanceError;

/// The plugin could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The topology file could not be used.
    #[error("loading the fake topology")]
    Topology(#[from] gpu_inventory::TopologyError),
    /// NVML could not be loaded.
    #[error("opening the GPU backend")]
    Backend(#[from] gpu_inventory::BackendError),
    /// Discovery failed.
    #[error("discovering GPUs")]
    Discovery(#[from] gpu_inventory::DiscoveryError),
    /// No usable Kubernetes client configuration.
    #[error("building the Kubernetes client ({origin}): {message}")]
    KubeConfig {
        /// The kubeconfig path or `in-cluster`.
        origin: String,
        /// The cause.
        message: String,
    },
    /// The claim state could not be reconciled at start.
    #[error("reconciling prepared claims at start")]
    Claims(#[from] ClaimError),
    /// The boot ID could not be read.
    #[error("reading the boot ID from {path}: {source}")]
    BootId {
        /// The file.
        path: std::path::PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The kubelet sockets could not be served.
    #[error("serving the kubelet")]
    Serve(#[from] dra_kubelet::ServeError),
    /// Writing `--dry-run` output failed.
    #[error("writing dry-run output: {0}")]
    Output(String),
    /// `--instance-id` cannot be part of a file name.
    #[error(
        "instance ID {0:?} (--instance-id, POD_UID): must be 1-128 ASCII letters, digits, '-', \
         '_' or '.', not starting with '.' (it becomes part of the socket file names)"
    )]
    InstanceId(String),
    /// The active lock could not be taken.
    #[error("taking the active lock")]
    Instance(#[from] InstanceError),
    /// The HTTP endpoint could not start.
    #[error("starting the HTTP endpoint")]
    Http(#[from] HttpError),
    /// A state file or directory could not be made owner-only.
    #[error("restricting {path} to its owner: {source}")]
    Secure {
        /// The file or directory.
        path: std::path::PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A task of the plugin ended abnormally.
    #[error("{task} ended abnormally: {message}")]
    TaskFailed {
        /// Which task.
        task: &'static str,
        /// The panic or cancellation.
        message: String,
    },
}
