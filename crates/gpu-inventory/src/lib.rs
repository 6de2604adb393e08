//! GPU discovery behind [`GpuBackend`] (NVML, or a fake topology file) and the device model we
//! publish as DRA ResourceSlices.
//!
//! Flow: a backend answers NVML-shaped queries ([`backend`]); [`discover`] turns the answers into
//! an [`Inventory`] of [`Gpu`]s and [`MigDevice`]s with normalized values ([`model`], [`mig`],
//! [`nvlink`], [`naming`]); [`Inventory::pool`] gives the devices and counter sets of one node's
//! pool; [`slices`] lays them out as `resource.k8s.io/v1` ResourceSlices and [`validate`] checks
//! them against the API server's rules.
//!
//! # Where each published value comes from
//!
//! | attribute / capacity | source |
//! |---|---|
//! | `type` | `gpu` for a whole GPU; `mig` for a MIG device or placement |
//! | `uuid` | `nvmlDeviceGetUUID` (the GPU, or the MIG device handle) |
//! | `productName` | `nvmlDeviceGetName` |
//! | `brand` | `nvmlDeviceGetBrand` |
//! | `architecture` | `nvmlDeviceGetArchitecture` |
//! | `cudaComputeCapability` | `nvmlDeviceGetCudaComputeCapability` (as `major.minor.0`) |
//! | `driverVersion` | `nvmlSystemGetDriverVersion`, leading zeros dropped (`580.159.04` -> `580.159.4`) |
//! | `cudaDriverVersion` | `nvmlSystemGetCudaDriverVersion_v2` (`12080` -> `12.8.0`) |
//! | `index` | `nvmlDeviceGetIndex` (enumeration order; not used for names) |
//! | `minor` | `nvmlDeviceGetMinorNumber` |
//! | `resource.kubernetes.io/pciBusID` | `nvmlDeviceGetPciInfo_v3`.busId, as `dddd:bb:dd.f` |
//! | `resource.kubernetes.io/pcieRoot` | sysfs: the `pci<domain>:<bus>` the link `/sys/bus/pci/devices/<bdf>` resolves under ([`sysfs::pcie_root`]) |
//! | `resource.kubernetes.io/numaNode` | `nvmlDeviceGetNumaNodeId`, else sysfs `numa_node` |
//! | `nvlinkDomain` | `nvmlDeviceGetNvLinkState`, `nvmlDeviceGetNvLinkRemotePciInfo_v2`, `nvmlDeviceGetNvLinkRemoteDeviceType` per link, joined as in [`nvlink`] |
//! | `nvlinkClique` | `nvmlDeviceGetGpuFabricInfoV` (struct v3, else v2, else `nvmlDeviceGetGpuFabricInfo`; [`fabric`]): `<clusterUuid>.<cliqueId>`, only in state COMPLETED with status SUCCESS and a non-zero cluster UUID, whatever the health mask and summary |
//! | `memory` (bytes) | `nvmlDeviceGetMemoryInfo`.total (GPU or MIG handle); placements: profile `memorySizeMB` x 2^20 |
//! | `multiprocessors` | `nvmlDeviceGetAttributes_v2`.multiprocessorCount; placements: profile `multiprocessorCount` |
//! | MIG `profile` | `nvmlDeviceGetGpuInstanceProfileInfo` (slice count, memory) named as in [`mig::profile_name`] |
//! | MIG `placementStart`/`placementSize` | `nvmlDeviceGetGpuInstanceId` + `nvmlDeviceGetGpuInstanceById` + `nvmlGpuInstanceGetInfo`; placements: `nvmlDeviceGetGpuInstancePossiblePlacements_v2` |
//! | MIG `gpuInstanceId`/`computeInstanceId` | `nvmlDeviceGetGpuInstanceId`, `nvmlDeviceGetComputeInstanceId` |
//! | MIG `parentUUID`/`parentIndex`/`parentMinor` and product attributes | the parent GPU's values above |
//! | MIG `copyEngines`, `decoders`, `encoders`, `jpegEngines`, `ofaEngines` | `nvmlDeviceGetAttributes_v2` shared*Count on the MIG handle; placements: the profile's counts |
//! | MIG mode | `nvmlDeviceGetMigMode` (current) |
//! | existing MIG devices | `nvmlDeviceGetMaxMigDeviceCount`, `nvmlDeviceGetMigDeviceHandleByIndex` |
//!
//! Health events (XID, ECC, GPU lost) come from [`GpuBackend::wait_health_event`] ([`health`]).
//!
//! IMEX channels, the device type published beside the GPUs for multi-node NVLink jobs:
//! [`imex`].
//!
//! Device names: [`naming`]. NVLink domains: [`nvlink`]. Multi-node NVLink fabrics (registration,
//! cliques, health mask and summary): [`fabric`]. Partitionable MIG model: [`mig`].

pub mod backend;
pub mod fabric;
pub mod fake;
pub mod health;
pub mod imex;
pub mod mig;
pub mod mig_tables;
pub mod model;
pub mod naming;
pub mod nvlink;
pub mod nvml;
pub mod shares;
pub mod slices;
pub mod sysfs;
pub mod validate;
pub mod yaml;

pub use backend::{
    BackendError, GpuBackend, GpuState, GpuUsage, MemoryLimits, MigUsage, ProcessUsage, RawGpu,
    SystemInfo,
};
pub use fake::{FakeBackend, Topology, TopologyError};
pub use health::{HealthEvent, HealthEventKind, RecoveryProbe};
pub use mig::MigDevice;
pub use model::{DiscoveryError, Gpu, Inventory, MigStrategy, discover, discover_with};
pub use naming::Naming;
pub use nvml::NvmlBackend;
pub use slices::Pool;
