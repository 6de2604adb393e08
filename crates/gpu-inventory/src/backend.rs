//! The hardware seam: NVML-shaped queries answered by NVML itself or by a fake.

use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use crate::fabric::{FabricAnswer, FabricInfo, FabricState};
use crate::health::{HealthEvent, RecoveryProbe};

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
    /// Total framebuffer memory in bytes (`nvmlDeviceGetMemoryInfo_v2`.total).
    pub memory_total_bytes: u64,
    /// Framebuffer bytes the driver reserves for itself (`nvmlDeviceGetMemoryInfo_v2`.reserved:
    /// 480 MiB on an H100 80GB with driver 580); no CUDA context can allocate them. Absent in
    /// topology files written before it was recorded: 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub memory_reserved_bytes: u64,
    /// Streaming multiprocessors: `nvmlDeviceGetAttributes_v2`.multiprocessorCount where NVML
    /// answers it, else `nvmlDeviceGetNumGpuCores` / cores per multiprocessor of the compute
    /// capability; `0` when unknown (no `multiprocessors` capacity is published then).
    pub multiprocessor_count: u32,
    /// PCI bus ID in NVML's form `dddddddd:bb:dd.f` (`nvmlDeviceGetPciInfo_v3`.busId).
    pub pci_bus_id: String,
    /// NUMA node of the GPU's PCI device (`nvmlDeviceGetNumaNodeId`, else sysfs `numa_node`);
    /// `None` on single-node machines where the kernel reports -1.
    pub numa_node: Option<u32>,
    /// PCIe root complex of the GPU in upstream's `pci<domain>:<bus>` form, e.g. `pci0000:17`:
    /// the first component of the sysfs path `/sys/bus/pci/devices/<bdf>` resolves to
    /// (k8s.io/dynamic-resource-allocation/deviceattribute, `GetPCIeRootAttributeByPCIBusID`).
    /// `None` when sysfs has no answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie_root: Option<String>,
    /// Active NVLinks grouped by remote end; consumed by NVLink domain discovery
    /// ([`crate::nvlink`]). Inactive links are not listed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nvlinks: Vec<NvLinkGroup>,
    /// Current MIG mode (`nvmlDeviceGetMigMode`, current half).
    #[serde(default)]
    pub mig_mode: MigMode,
    /// GPU instance profiles this GPU supports, with their possible placements
    /// (`nvmlDeviceGetGpuInstanceProfileInfo` for every profile id,
    /// `nvmlDeviceGetGpuInstancePossiblePlacements_v2`). Empty unless MIG-capable.
    /// A topology file may leave it out: the fake backend then serves the built-in table for the
    /// product ([`crate::mig_tables`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig_profiles: Vec<MigProfile>,
    /// Existing MIG devices (`nvmlDeviceGetMaxMigDeviceCount`,
    /// `nvmlDeviceGetMigDeviceHandleByIndex`); empty unless MIG mode is enabled.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig_devices: Vec<RawMigDevice>,
    /// Multi-node NVLink fabric registration and health (`nvmlDeviceGetGpuFabricInfoV` v3, else
    /// v2, else `nvmlDeviceGetGpuFabricInfo`: [`crate::fabric::negotiate`]); `None` where the
    /// GPU answers NOT_SUPPORTED or the call failed (then `fabric_error` says why).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fabric: Option<FabricInfo>,
    /// Why the fabric call failed (an error other than NOT_SUPPORTED, or an answer this
    /// version cannot read); a topology file sets it to inject that failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fabric_error: Option<String>,
}

impl RawGpu {
    /// The bytes a CUDA process can allocate: total less the driver's reserve. What drust
    /// publishes as the GPU's `memory` capacity, so that shares adding up to it all fit (CUDA
    /// itself reports this total: PyTorch's "total capacity 79.18 GiB" on the H100 80GB of
    /// `tests/gpu/fixtures/h100-580.159.04`, 81559 MiB less 480 MiB reserved).
    pub fn usable_memory_bytes(&self) -> u64 {
        self.memory_total_bytes
            .saturating_sub(self.memory_reserved_bytes)
    }

    /// The fabric answer as a whole (what [`GpuBackend::fabric`] answers).
    pub fn fabric_answer(&self) -> FabricAnswer {
        FabricAnswer {
            info: self.fabric.clone(),
            error: self.fabric_error.clone(),
        }
    }
}

/// MIG mode of a GPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum MigMode {
    /// The GPU cannot do MIG (`nvmlDeviceGetMigMode` answers NOT_SUPPORTED).
    #[default]
    Unsupported,
    /// MIG-capable, currently off: the GPU is used whole.
    Disabled,
    /// MIG is on: only MIG devices can run work.
    Enabled,
}

/// The compute mode of a GPU (`nvmlComputeMode_t`): how many CUDA contexts may run on it.
/// `EXCLUSIVE_THREAD` is gone from drivers since CUDA 8 and not modelled.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ComputeMode {
    /// Any number of contexts (`NVML_COMPUTEMODE_DEFAULT`, 0).
    #[default]
    Default,
    /// No context at all (`NVML_COMPUTEMODE_PROHIBITED`, 2).
    Prohibited,
    /// One context, of one process (`NVML_COMPUTEMODE_EXCLUSIVE_PROCESS`, 3): with an MPS server
    /// holding it, a CUDA process that bypasses MPS gets no context instead of the whole GPU
    /// (NVIDIA's MPS guide, "Provisioning Sequence").
    ExclusiveProcess,
}

/// Per-cgroup GPU memory limits of one GPU (NVML `nvmlSetMemoryLimits_v1_t`), in bytes: what
/// the driver's memory partitioning enforces for every process of a cgroup, whatever the
/// processes' own environment says (NVIDIA's MPS guide, release 615, "MPS v3 Memory
/// Partitioning"; NVML API reference, `nvmlDeviceSetMemoryLimits_v1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MemoryLimits {
    /// Memory guaranteed to the cgroup before allocations may fail under pressure.
    pub soft_bytes: u64,
    /// The most the cgroup's processes may allocate together; beyond it allocation fails.
    pub hard_bytes: u64,
}

impl MemoryLimits {
    /// No limit: what NVML's documentation says clears them (soft 0, hard
    /// `NVML_DEVICE_MEMORY_LIMIT_MAX`, the largest `unsigned long long`).
    pub const CLEARED: Self = Self {
        soft_bytes: 0,
        hard_bytes: u64::MAX,
    };

    /// A share of `bytes`: guaranteed and capped at the same amount.
    pub fn share(bytes: u64) -> Self {
        Self {
            soft_bytes: bytes,
            hard_bytes: bytes,
        }
    }
}

/// The first driver branch with per-cgroup memory limits (`nvmlDeviceSetMemoryLimits_v1`) and
/// MPS v3 (NVIDIA's MPS guide, release 615).
pub const MEMORY_PARTITIONING_DRIVER_MAJOR: u32 = 615;

/// Whether driver version `version` (as NVML reports it, `615.12.03`) is of a branch with
/// memory partitioning ([`MEMORY_PARTITIONING_DRIVER_MAJOR`]); `false` when it cannot be read.
pub fn driver_has_memory_partitioning(version: &str) -> bool {
    version
        .split('.')
        .next()
        .and_then(|major| major.trim().parse::<u32>().ok())
        .is_some_and(|major| major >= MEMORY_PARTITIONING_DRIVER_MAJOR)
}

/// One GPU instance profile (`nvmlGpuInstanceProfileInfo_t`) and where it can be placed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MigProfile {
    /// The GPU instance profile ID (`nvmlGpuInstanceProfileInfo_t.id`, what `nvidia-smi mig
    /// -lgip` prints, e.g. 19 for `1g.10gb` on an A100 80GB): what placement queries, GPU
    /// instance creation and existing instances (`nvmlGpuInstanceGetInfo`.profileId) use.
    pub id: u32,
    /// The `NVML_GPU_INSTANCE_PROFILE_*` value the profile was queried as (0 = 1 slice,
    /// 7 = 1 slice rev. 1 (`+me`), 9 = 1 slice rev. 2, ...): which variant it is. Not the ID:
    /// on an H200 profile 0 has ID 19 (`tests/gpu/fixtures/h200-580.159.04`).
    pub profile: u32,
    /// Compute (GPC) slices, the `N` of `Ng.` (`sliceCount`).
    pub slice_count: u32,
    /// How many instances of this profile fit on an empty GPU (`instanceCount`).
    pub instance_count: u32,
    /// Streaming multiprocessors (`multiprocessorCount`).
    pub multiprocessor_count: u32,
    /// Copy engines (`copyEngineCount`).
    pub copy_engine_count: u32,
    /// Video decoders (`decoderCount`).
    pub decoder_count: u32,
    /// Video encoders (`encoderCount`).
    pub encoder_count: u32,
    /// JPEG engines (`jpegCount`).
    pub jpeg_count: u32,
    /// Optical flow accelerators (`ofaCount`).
    pub ofa_count: u32,
    /// Framebuffer memory in MiB (`memorySizeMB`, which NVML counts in MiB).
    pub memory_size_mib: u64,
    /// Possible placements on an empty GPU, in memory slices.
    pub placements: Vec<MigPlacement>,
}

/// Where a GPU instance sits: memory slices `start..start + size` (`nvmlGpuInstancePlacement_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigPlacement {
    /// First memory slice.
    pub start: u32,
    /// Number of memory slices.
    pub size: u32,
}

/// What the claim lifecycle checks before it acts on a GPU ([`GpuBackend::gpu_state`]): which
/// GPU sits at an index now, and its MIG devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuState {
    /// `nvmlDeviceGetUUID`.
    pub uuid: String,
    /// `/dev/nvidia<minor>` (`nvmlDeviceGetMinorNumber`).
    pub minor: u32,
    /// The MIG devices that exist now; empty unless MIG mode is enabled.
    pub mig_devices: Vec<RawMigDevice>,
}

impl From<RawGpu> for GpuState {
    fn from(g: RawGpu) -> GpuState {
        GpuState {
            uuid: g.uuid,
            minor: g.minor,
            mig_devices: g.mig_devices,
        }
    }
}

/// One existing MIG device: a compute instance inside a GPU instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawMigDevice {
    /// `MIG-xxxxxxxx-...` (`nvmlDeviceGetUUID` on the MIG handle).
    pub uuid: String,
    /// GPU instance id (`nvmlDeviceGetGpuInstanceId`).
    pub gpu_instance_id: u32,
    /// Compute instance id within the GPU instance (`nvmlDeviceGetComputeInstanceId`).
    #[serde(default)]
    pub compute_instance_id: u32,
    /// The GPU instance's profile id (`nvmlGpuInstanceGetInfo`.profileId).
    pub profile_id: u32,
    /// The GPU instance's placement (`nvmlGpuInstanceGetInfo`.placement).
    pub placement: MigPlacement,
    /// What the MIG handle reports (`nvmlDeviceGetAttributes_v2`, `nvmlDeviceGetMemoryInfo`).
    /// A topology file may leave it out: the fake then answers with the profile's values.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attributes: Option<MigAttributes>,
}

/// A MIG device's resources as NVML reports them on the MIG handle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MigAttributes {
    /// Framebuffer bytes (`nvmlDeviceGetMemoryInfo`.total).
    pub memory_total_bytes: u64,
    /// Streaming multiprocessors of the compute instance (`multiprocessorCount`).
    pub multiprocessor_count: u32,
    /// `sharedCopyEngineCount`.
    pub copy_engine_count: u32,
    /// `sharedDecoderCount`.
    pub decoder_count: u32,
    /// `sharedEncoderCount`.
    pub encoder_count: u32,
    /// `sharedJpegCount`.
    pub jpeg_count: u32,
    /// `sharedOfaCount`.
    pub ofa_count: u32,
    /// Compute slices of the GPU instance (`gpuInstanceSliceCount`).
    pub gpu_instance_slice_count: u32,
    /// Compute slices of this compute instance (`computeInstanceSliceCount`).
    pub compute_instance_slice_count: u32,
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
    /// A GPU setting could not be applied.
    #[error("{call} for GPU {index}: {message}")]
    Action {
        /// The action.
        call: &'static str,
        /// The GPU's enumeration index.
        index: u32,
        /// What went wrong.
        message: String,
    },
    /// An injected health event file could not be used (fake backend); it was set aside.
    #[error("health event file {path}: {problem}")]
    EventFile {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong with it, naming the field.
        problem: String,
    },
    /// Setting up or waiting for NVML health events failed.
    #[error("NVML health events ({call}): {message}")]
    Events {
        /// The NVML function.
        call: &'static str,
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
    /// The backend cannot do this (e.g. MIG management on a backend without it).
    #[error("{call} for GPU {index}: not supported by this GPU backend")]
    Unsupported {
        /// The operation.
        call: &'static str,
        /// The GPU's enumeration index.
        index: u32,
    },
    /// The fake backend's state file could not be read or written.
    #[error("fake GPU state {path}: {message}")]
    FakeState {
        /// The file.
        path: std::path::PathBuf,
        /// What went wrong.
        message: String,
    },
}

/// What one GPU is doing, as NVML tells it at one moment ([`GpuBackend::usage`]).
///
/// JSON (camelCase) is also the format of the usage files the fake backend and the mock
/// `libnvidia-ml` serve (`usage/<index>.json`): a missing file is an idle GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuUsage {
    /// Percent (0..=100) of the last sample period in which a kernel ran on the GPU
    /// (`nvmlDeviceGetUtilizationRates`, `gpu`; DCGM's `DCGM_FI_DEV_GPU_UTIL`). `None` where
    /// NVML has no figure: a GPU in MIG mode answers NOT_SUPPORTED.
    #[serde(default)]
    pub sm_percent: Option<u32>,
    /// Percent (0..=100) of the last sample period in which device memory was read or written
    /// (`nvmlDeviceGetUtilizationRates`, `memory`; `DCGM_FI_DEV_MEM_COPY_UTIL`). `None` as for
    /// `sm_percent`.
    #[serde(default)]
    pub memory_percent: Option<u32>,
    /// Device memory in use, bytes (`nvmlDeviceGetMemoryInfo_v2`, `used`).
    #[serde(default)]
    pub memory_used_bytes: u64,
    /// The processes holding a compute context on the GPU
    /// (`nvmlDeviceGetComputeRunningProcesses_v3`; MPS clients included).
    #[serde(default)]
    pub processes: Vec<ProcessUsage>,
    /// On a GPU in MIG mode, each GPU instance's activity where the GPU has GPM (GPU
    /// Performance Monitoring, Hopper and later): what NVML gives no whole-GPU figure for.
    #[serde(default)]
    pub mig: Vec<MigUsage>,
}

/// One GPU instance's activity between two samples ([`GpuUsage::mig`]), from GPM
/// (`nvmlGpmMigSampleGet`, `nvmlGpmMetricsGet`): the first sample of an instance has no
/// figures (GPM compares two).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigUsage {
    /// The GPU instance.
    pub gpu_instance_id: u32,
    /// Percent (0..=100) of the time its SMs were busy (`NVML_GPM_METRIC_SM_UTIL`).
    #[serde(default)]
    pub sm_percent: Option<u32>,
    /// Percent (0..=100) of its memory bandwidth used (`NVML_GPM_METRIC_DRAM_BW_UTIL`).
    #[serde(default)]
    pub memory_percent: Option<u32>,
}

impl GpuUsage {
    /// A GPU doing nothing: 0 % SM and memory activity, no memory used, no process.
    pub fn idle() -> Self {
        Self {
            sm_percent: Some(0),
            memory_percent: Some(0),
            ..Self::default()
        }
    }
}

/// One process on a GPU ([`GpuUsage::processes`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProcessUsage {
    /// Its PID, in the node's (the host's) PID namespace.
    pub pid: u32,
    /// Device memory it uses, bytes; `None` where NVML cannot tell (e.g. without the
    /// privilege to see other users' processes).
    #[serde(default)]
    pub used_memory_bytes: Option<u64>,
    /// On a GPU in MIG mode: the GPU instance it runs in.
    #[serde(default)]
    pub gpu_instance_id: Option<u32>,
    /// On a GPU in MIG mode: the compute instance it runs in.
    #[serde(default)]
    pub compute_instance_id: Option<u32>,
    /// Its SM utilization, percent (0..=100), since the previous query of the GPU
    /// (`nvmlDeviceGetProcessUtilization`, `smUtil`, the mean of its samples; 0 for a process
    /// without samples, which NVML returns only for processes that computed). `None` where
    /// NVML has no per-process figures (MIG mode, NOT_SUPPORTED). Under MPS, NVML may count a
    /// client's work to the MPS server's process.
    #[serde(default)]
    pub sm_percent: Option<u32>,
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

    /// The identity and MIG devices of the GPU at `index` now: the few queries prepare and
    /// unprepare need, where [`GpuBackend::gpu`] also walks every MIG profile and placement.
    /// The default answers from [`GpuBackend::gpu`].
    ///
    /// # Errors
    /// [`BackendError`] when a query for that GPU fails.
    fn gpu_state(&self, index: u32) -> Result<GpuState, BackendError> {
        self.gpu(index).map(GpuState::from)
    }

    /// The fabric answer of the GPU at `index` now: registration state, cluster, clique and
    /// health, or why the call failed. One NVML call, so it can be watched between discoveries
    /// (the node plugin polls it while registration is pending). The default answers from
    /// [`GpuBackend::gpu`].
    ///
    /// # Errors
    /// [`BackendError`] when the GPU itself cannot be queried (a failing fabric call is an
    /// answer: [`FabricAnswer::error`]).
    fn fabric(&self, index: u32) -> Result<FabricAnswer, BackendError> {
        self.gpu(index).map(|g| g.fabric_answer())
    }

    /// Sets the compute time slice of the GPU at `index` to `value`, in the encoding of
    /// `nvidia-smi compute-policy --set-timeslice` (0 default, 1 short, 2 medium, 3 long).
    ///
    /// # Errors
    /// [`BackendError`] when the setting cannot be applied; by default, always
    /// ([`BackendError::Unsupported`]).
    fn set_compute_time_slice(&self, index: u32, value: u8) -> Result<(), BackendError> {
        let _ = value;
        Err(BackendError::Unsupported {
            call: "set_compute_time_slice",
            index,
        })
    }

    /// The compute mode of the GPU at `index` (`nvmlDeviceGetComputeMode`).
    ///
    /// # Errors
    /// [`BackendError`] when it cannot be read; by default, always
    /// ([`BackendError::Unsupported`]).
    fn compute_mode(&self, index: u32) -> Result<ComputeMode, BackendError> {
        Err(BackendError::Unsupported {
            call: "compute_mode",
            index,
        })
    }

    /// Sets the compute mode of the GPU at `index` (`nvmlDeviceSetComputeMode`; root). It
    /// lasts until the next driver load or GPU reset.
    ///
    /// # Errors
    /// [`BackendError`] when it cannot be set; by default, always
    /// ([`BackendError::Unsupported`]).
    fn set_compute_mode(&self, index: u32, mode: ComputeMode) -> Result<(), BackendError> {
        let _ = mode;
        Err(BackendError::Unsupported {
            call: "set_compute_mode",
            index,
        })
    }

    /// Whether this backend can set per-cgroup memory limits ([`GpuBackend::set_memory_limits`]):
    /// for NVML, the library has `nvmlDeviceSetMemoryLimits_v1` and the driver is of a branch
    /// with memory partitioning ([`driver_has_memory_partitioning`]). The default says no.
    ///
    /// # Errors
    /// [`BackendError`] when the driver version cannot be read.
    fn memory_partitioning(&self) -> Result<bool, BackendError> {
        Ok(false)
    }

    /// Sets the memory limits on GPU `index` of the cgroup whose directory is `cgroup` (a full
    /// path under the cgroup v2 mount, e.g. `/sys/fs/cgroup/kubepods.slice/...`); with
    /// [`MemoryLimits::CLEARED`], clears them. Full GPUs only: NVML refuses MIG handles.
    ///
    /// # Errors
    /// [`BackendError::Action`] when the driver refuses; by default
    /// [`BackendError::Unsupported`].
    fn set_memory_limits(
        &self,
        index: u32,
        cgroup: &std::path::Path,
        limits: MemoryLimits,
    ) -> Result<(), BackendError> {
        let _ = (cgroup, limits);
        Err(BackendError::Unsupported {
            call: "set_memory_limits",
            index,
        })
    }

    /// The enumeration index of the GPU whose UUID is `uuid`. The default asks every GPU.
    ///
    /// # Errors
    /// [`BackendError::Query`] when no GPU has it or a query fails.
    fn index_of(&self, uuid: &str) -> Result<u32, BackendError> {
        for index in 0..self.device_count()? {
            if self.gpu_state(index)?.uuid == uuid {
                return Ok(index);
            }
        }
        Err(BackendError::Query {
            call: "nvmlDeviceGetHandleByUUID",
            index: u32::MAX,
            message: format!("no GPU has UUID {uuid}"),
        })
    }

    /// Creates a MIG device on the GPU at `index`: a GPU instance of profile `profile_id` at
    /// `placement` (`nvmlDeviceCreateGpuInstanceWithPlacement`), then one compute instance
    /// spanning it (`nvmlGpuInstanceCreateComputeInstance` with the compute instance profile of
    /// the same slice count). Returns the new device as [`GpuBackend::gpu`] will list it. The
    /// GPU must have MIG enabled and the placement must be free; nothing is left behind when
    /// this fails.
    ///
    /// # Errors
    /// [`BackendError::Unsupported`] by default; [`BackendError::Query`] with NVML's answer
    /// (e.g. `Insufficient Resources` for a taken placement) or [`BackendError::Injected`].
    fn create_mig_device(
        &self,
        index: u32,
        profile_id: u32,
        placement: MigPlacement,
    ) -> Result<RawMigDevice, BackendError> {
        let _ = (profile_id, placement);
        Err(BackendError::Unsupported {
            call: "create_mig_device",
            index,
        })
    }

    /// Destroys the MIG device with these instance ids on the GPU at `index`: the compute
    /// instance (`nvmlComputeInstanceDestroy`), then its GPU instance (`nvmlGpuInstanceDestroy`).
    /// Returns `false` when there was no such GPU instance (already destroyed), so callers can
    /// repeat it safely.
    ///
    /// # Errors
    /// [`BackendError::Unsupported`] by default; [`BackendError::Query`] with NVML's answer
    /// (e.g. `In use by another client` while a process runs on it) or
    /// [`BackendError::Injected`].
    fn destroy_mig_device(
        &self,
        index: u32,
        gpu_instance_id: u32,
        compute_instance_id: u32,
    ) -> Result<bool, BackendError> {
        let _ = (gpu_instance_id, compute_instance_id);
        Err(BackendError::Unsupported {
            call: "destroy_mig_device",
            index,
        })
    }

    /// Blocks the calling thread for at most `timeout` until a GPU reports a health event, and
    /// returns it; `Ok(None)` when none came. Call it from a blocking thread.
    ///
    /// The default reports nothing: it sleeps for `timeout` and returns `Ok(None)`.
    ///
    /// # Errors
    /// [`BackendError`] when events cannot be set up or waited for; the caller may retry.
    fn wait_health_event(&self, timeout: Duration) -> Result<Option<HealthEvent>, BackendError> {
        std::thread::sleep(timeout);
        Ok(None)
    }

    /// The set of GPUs changed (re-discovery found one more, or one fewer): the next
    /// [`GpuBackend::wait_health_event`] watches the GPUs there are then. Events already
    /// received are kept. Blocking.
    ///
    /// The default does nothing (the default wait reports nothing).
    fn rewatch_health_events(&self) {}

    /// What the GPU at `index` is doing now: utilization, memory used and its processes
    /// ([`GpuUsage`]). Read-only and blocking; it needs no GPU lock.
    ///
    /// The default cannot tell ([`BackendError::Unsupported`]).
    ///
    /// # Errors
    /// [`BackendError`] when a query fails (a GPU without utilization figures is not an error:
    /// its percentages are `None`).
    fn usage(&self, index: u32) -> Result<GpuUsage, BackendError> {
        Err(BackendError::Unsupported {
            call: "usage",
            index,
        })
    }

    /// Whether the GPU `gpu_uuid`, which reported errors, looks usable again. Blocking.
    ///
    /// The default cannot tell ([`RecoveryProbe::Unsupported`]).
    ///
    /// # Errors
    /// [`BackendError`] when the probe itself fails.
    fn probe_recovery(&self, gpu_uuid: &str) -> Result<RecoveryProbe, BackendError> {
        let _ = gpu_uuid;
        Ok(RecoveryProbe::Unsupported)
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}
