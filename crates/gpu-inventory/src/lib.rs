//! GPU discovery behind [`GpuBackend`] (NVML, or a fake topology file) and the device model we
//! publish as DRA ResourceSlices.
//!
//! Flow: a backend answers NVML-shaped queries ([`backend`]); [`discover`] turns the answers into
//! an [`Inventory`] of [`Gpu`]s with normalized values ([`model`]); [`slices`] lays the devices out
//! as `resource.k8s.io/v1` ResourceSlices for one node's pool.

pub mod backend;
pub mod fake;
pub mod model;
pub mod nvml;
pub mod slices;

pub use backend::{BackendError, GpuBackend, RawGpu, SystemInfo};
pub use fake::{FakeBackend, Topology, TopologyError};
pub use model::{DiscoveryError, Gpu, Inventory, discover};
pub use nvml::NvmlBackend;
