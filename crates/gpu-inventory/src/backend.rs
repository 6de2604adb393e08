//! The hardware seam: NVML-shaped queries answered by NVML itself or by a fake.

use serde::{Deserialize, Serialize};

/// Node-wide facts, from `nvmlSystemGetDriverVersion` and `nvmlSystemGetCudaDriverVersion_v2`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SystemInfo {
    /// Kernel driver version exactly as NVML reports it, e.g. `570.124.06` (may have leading zeros).
    pub driver_version: String,
    /// CUDA driver API version as NVML encodes it: `major * 1000 + minor * 10`, e.g. 12080 = 12.8.
    pub cuda_driver_version: i32,
}

/// One full GPU as NVML describes it. Field docs name the NVML call each value comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawGpu {
    /// NVML enumeration index (`nvmlDeviceGetIndex`); not stable across reboots.
    pub index: u32,
    /// `/dev/nvidia<minor>` (`nvmlDeviceGetMinorNumber`).
    pub minor: u32,
    /// `GPU-xxxxxxxx-...` (`nvmlDeviceGetUUID`).
    pub uuid: String,
    /// Marketing name, e.g. `NVIDIA H100 80GB HBM3` (`nvmlDeviceGetName`).
    pub name: String,
    /// Brand, e.g. `Nvidia`, `Tesla` (`nvmlDeviceGetBrand`).
    pub brand: String,
    /// Architecture, e.g. `Hopper` (`nvmlDeviceGetArchitecture`).
    pub architecture: String,
    /// CUDA compute capability major (`nvmlDeviceGetCudaComputeCapability`).
    pub cuda_compute_capability_major: u32,
    /// CUDA compute capability minor (`nvmlDeviceGetCudaComputeCapability`).
    pub cuda_compute_capability_minor: u32,
    /// Total framebuffer memory in bytes (`nvmlDeviceGetMemoryInfo`.total).
    pub memory_total_bytes: u64,
    /// Streaming multiprocessors (`nvmlDeviceGetAttributes_v2`.multiprocessorCount).
    pub multiprocessor_count: u32,
    /// PCI bus ID in NVML's form `dddddddd:bb:dd.f` (`nvmlDeviceGetPciInfo_v3`.busId).
    pub pci_bus_id: String,
    /// NUMA node of the GPU's PCI device (`nvmlDeviceGetNumaNodeId`, else sysfs `numa_node`);
    /// `None` on single-node machines where the kernel reports -1.
    pub numa_node: Option<u32>,
    /// NVLinks as `(link count, remote)` groups; consumed by NVLink domain discovery.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nvlinks: Vec<NvLinkGroup>,
}

/// A group of active NVLinks of one GPU that lead to the same remote PCI device
/// (`nvmlDeviceGetNvLinkState`, `nvmlDeviceGetNvLinkRemotePciInfo_v2`,
/// `nvmlDeviceGetNvLinkRemoteDeviceType`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NvLinkGroup {
    /// Number of links in the group.
    pub links: u32,
    /// PCI bus ID of the remote end.
    pub remote_pci_bus_id: String,
    /// What the remote end is.
    pub remote_device_type: NvLinkRemote,
}

/// The remote end of an NVLink (`nvmlIntNvLinkDeviceType_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum NvLinkRemote {
    /// Another GPU (direct link or bridge).
    Gpu,
    /// An IBM NPU.
    Ibmnpu,
    /// An NVSwitch.
    Switch,
}

/// A backend query failed.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The NVML library could not be loaded or initialized.
    #[error(
        "loading NVML ({library}): {message}; is the NVIDIA driver installed and libnvidia-ml.so.1 \
         on the library path (or use --fake-topology)?"
    )]
    LoadNvml {
        /// The library name or path tried.
        library: String,
        /// NVML's own error text.
        message: String,
    },
    /// An NVML query failed.
    #[error("NVML {call} for GPU {index}: {message}")]
    Query {
        /// The NVML function.
        call: &'static str,
        /// The GPU's enumeration index (`u32::MAX` for system-wide calls).
        index: u32,
        /// NVML's error text.
        message: String,
    },
    /// A fake backend was told to fail this query.
    #[error("injected fault: {call} for GPU {index}")]
    Injected {
        /// The query.
        call: &'static str,
        /// The GPU's enumeration index.
        index: u32,
    },
}

/// NVML-shaped hardware queries. Implementations: [`crate::NvmlBackend`] (the real library,
/// loaded at run time) and [`crate::FakeBackend`] (a topology file).
pub trait GpuBackend: Send + Sync {
    /// Node-wide driver facts.
    ///
    /// # Errors
    /// [`BackendError`] when NVML fails.
    fn system(&self) -> Result<SystemInfo, BackendError>;

    /// Number of full GPUs NVML enumerates (`nvmlDeviceGetCount_v2`).
    ///
    /// # Errors
    /// [`BackendError`] when NVML fails.
    fn device_count(&self) -> Result<u32, BackendError>;

    /// Everything we publish about the GPU at `index` (`0..device_count()`).
    ///
    /// # Errors
    /// [`BackendError`] when any query for that GPU fails.
    fn gpu(&self, index: u32) -> Result<RawGpu, BackendError>;
}
