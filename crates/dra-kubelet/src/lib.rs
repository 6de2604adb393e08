//! The kubelet-facing side of a DRA driver: plugin registration and the DRAPlugin gRPC service
//! (v1 and v1beta1) over Unix sockets, generic over a [`Driver`]. Knows nothing about GPUs.
//!
//! Shape, as the kubelet sees it (KEP-4381 "DRA: structured parameters", kubelet plugin watcher):
//! - `<registrar-dir>/<driver>-reg.sock` serves `pluginregistration.Registration`; `GetInfo`
//!   answers type `DRAPlugin`, the driver name, the DRA socket path and the supported service
//!   versions (`v1.DRAPlugin`, then `v1beta1.DRAPlugin`), then `v1alpha1.DRAResourceHealth`
//!   when device health is served.
//! - `<plugin-dir>/dra.sock` serves `k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin` and its v1beta1 twin,
//!   and with [`PluginServer::with_health`] the `v1alpha1.DRAResourceHealth` stream ([`health`]).
//! - With an instance ID (rolling updates), both names carry it; see [`PluginSockets`].
//!
//! Transport-level failures on either socket (a stream the HTTP/2 layer resets, a rejected
//! header) are logged at warn with the socket and the request ([`transport`]).
//!
//! Per-claim results at the RPC boundary: a bad claim yields an error entry for that claim and
//! never fails the whole RPC.

mod calls;
pub mod client;
mod convert;
mod driver;
pub mod health;
pub mod pod_resources;
pub mod proto;
mod registration;
mod server;
mod service;
pub mod transport;

pub use calls::{CallObserver, CallRecord, Method};
pub use driver::{ClaimRef, Driver, PrepareResult, PreparedDevice, UnprepareResult};
pub use health::{DeviceHealth, HEALTH_SERVICE, HealthStatus};
pub use registration::RegistrationStatus;
pub use server::{
    DEFAULT_DRAIN_TIMEOUT, PluginServer, PluginSockets, SHUTDOWN_GRACE, ServeError,
    valid_instance_id,
};
pub use service::{DraPluginV1, DraPluginV1beta1};

/// The plugin type the kubelet's plugin watcher routes to its DRA manager
/// (k8s.io/kubelet/pkg/apis/pluginregistration/v1/constants.go).
pub const DRA_PLUGIN_TYPE: &str = "DRAPlugin";

/// The gRPC service versions we serve, in order of preference, as advertised in `GetInfo`.
/// The kubelet picks the first one it supports (pkg/kubelet/cm/dra/plugin, Kubernetes 1.34+).
pub const SUPPORTED_VERSIONS: [&str; 2] = ["v1.DRAPlugin", "v1beta1.DRAPlugin"];
