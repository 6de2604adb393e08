//! The real backend: NVML through `nvml-wrapper`, loaded at run time.
//!
//! The library is always compiled in; `libnvidia-ml.so.1` is opened only by
//! [`NvmlBackend::load`], which fails with [`BackendError::LoadNvml`] on machines without the
//! NVIDIA driver, so one binary serves GPU nodes and tests alike.
//!
//! Some NVML calls go through the private module `ffi` instead of `nvml-wrapper` 0.13, which
//! lacks them or gets them wrong: `nvmlDeviceGetNvLinkRemoteDeviceType` (the wrapper returns `Unknown` always),
//! `nvmlDeviceGetGpuInstancePossiblePlacements_v2` (the wrapper returns an empty list),
//! `nvmlDeviceGetGpuInstanceId` + `nvmlDeviceGetGpuInstanceById` + `nvmlGpuInstanceGetInfo`
//! (not wrapped), `nvmlDeviceGetGpuFabricInfoV` and `nvmlDeviceGetGpuFabricInfo` (not wrapped;
//! struct versions 3, 2, 1 as the driver accepts them, [`crate::fabric::negotiate`]), and MIG creation and
//! destruction (`nvmlDeviceCreateGpuInstanceWithPlacement`,
//! `nvmlGpuInstanceGetComputeInstanceProfileInfo`, `nvmlGpuInstanceCreateComputeInstance`,
//! `nvmlDeviceGetGpuInstanceById`, `nvmlGpuInstanceGetComputeInstanceById`,
//! `nvmlComputeInstanceDestroy`, `nvmlGpuInstanceDestroy`; not wrapped), and per-cgroup memory
//! limits (`nvmlDeviceSetMemoryLimits_v1`, r615+, newer than nvml-wrapper-sys 0.10's function
//! table, looked up with `libloading` in the library NVML was loaded from). Health events use
//! raw event sets too (`ffi::EventWatch`): nvml-wrapper's `EventSet` borrows the `Nvml` it came from and
//! so cannot be kept beside it.
//!
//! # Health events
//!
//! The first [`GpuBackend::wait_health_event`] (and the first after
//! [`GpuBackend::rewatch_health_events`]) registers every GPU for
//! `nvmlEventTypeXidCriticalError` and `nvmlEventTypeDoubleBitEccError` (as far as each GPU
//! supports them; a GPU that cannot be registered is logged and not watched). Single-bit ECC
//! errors are corrected by the hardware and not reported. When waiting fails with
//! `NVML_ERROR_GPU_IS_LOST`, every watched GPU is asked for its UUID and each one that answers
//! GPU_IS_LOST is reported as [`HealthEventKind::GpuLost`].
//!
//! [`GpuBackend::probe_recovery`] says a GPU is healthy when NVML finds it by UUID and answers a
//! PCI info query, no page retirement is pending (`nvmlDeviceGetRetiredPagesPendingStatus`) and
//! no row remapping is pending or failed (`nvmlDeviceGetRemappedRows`): the conditions NVIDIA's
//! memory error management guides name as cleared by a GPU reset.

mod ffi;

use std::collections::VecDeque;
use std::ffi::OsStr;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use nvml_wrapper::enum_wrappers::device::Brand;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};

use crate::backend::{
    BackendError, ComputeMode, FabricAnswer, GpuBackend, GpuState, GpuUsage, MemoryLimits,
    MigAttributes, MigMode, MigPlacement, MigProfile, MigUsage, NvLinkGroup, ProcessUsage, RawGpu,
    RawMigDevice, SystemInfo,
};
use crate::health::{HealthEvent, HealthEventKind, RecoveryProbe};
use crate::mig_tables::PROFILE_COUNT;

/// The soname the NVIDIA driver installs (the unversioned `.so` ships only with dev packages).
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

/// The event state of [`NvmlBackend`]: the registered event set and events found but not yet
/// returned.
#[derive(Default)]
struct Events {
    watch: Option<ffi::EventWatch>,
    pending: VecDeque<HealthEvent>,
}

/// NVML, initialized.
pub struct NvmlBackend {
    // Declared before `nvml`: the event set must be freed while the library is loaded.
    events: Mutex<Events>,
    /// By GPU index: when its per-process utilization was last read, microseconds since the
    /// Unix epoch (NVML's `lastSeenTimeStamp`).
    process_samples_read: Mutex<std::collections::BTreeMap<u32, u64>>,
    /// By (GPU index, GPU instance): the last GPM sample taken of a MIG instance, the earlier
    /// of the two the next figures compare. Freed when the instance is gone or on drop.
    gpm_samples: ffi::GpmSamples,
    nvml: Nvml,
    /// `nvmlDeviceSetMemoryLimits_v1`, where the library has it (r615 and later).
    memory_limits: Option<ffi::MemoryLimitsEntry>,
    sysfs_root: PathBuf,
    tool_timeout: Duration,
}

impl Drop for NvmlBackend {
    fn drop(&mut self) {
        self.gpm_samples.free_all(&self.nvml);
    }
}

impl std::fmt::Debug for NvmlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlBackend")
            .field("sysfs_root", &self.sysfs_root)
            .finish_non_exhaustive()
    }
}

impl NvmlBackend {
    /// Each GPU instance's activity on GPU `d` (`index`) in MIG mode, from GPM: the figures
    /// between the instance's previous sample (kept in `gpm_samples`) and one taken now. Empty
    /// when MIG is off or the GPU has no GPM (before Hopper; a library without the calls).
    fn mig_usage(&self, d: &Device<'_>, index: u32) -> Result<Vec<MigUsage>, BackendError> {
        use nvml_wrapper::enums::gpm::GpmMetricId;
        let enabled = d
            .mig_mode()
            .is_ok_and(|m| m.current == nvml_wrapper_sys::bindings::NVML_DEVICE_MIG_ENABLE);
        if !enabled {
            return Ok(Vec::new());
        }
        match d.gpm_support() {
            Ok(true) => {}
            Ok(false) | Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)) => {
                return Ok(Vec::new());
            }
            Err(e) => return Err(query("nvmlGpmQueryDeviceSupport", index)(e)),
        }
        let mut instances: Vec<u32> = self
            .mig_devices(d, index)?
            .iter()
            .map(|m| m.gpu_instance_id)
            .collect();
        instances.sort_unstable();
        instances.dedup();
        self.gpm_samples.retain(&self.nvml, index, &instances);
        let mut usage = Vec::new();
        for gi in instances {
            let now = d
                .gpm_mig_sample(gi)
                .map_err(query("nvmlGpmMigSampleGet", index))?;
            let before = self.gpm_samples.take(&self.nvml, (index, gi));
            let mut u = MigUsage {
                gpu_instance_id: gi,
                ..MigUsage::default()
            };
            if let Some(before) = before {
                let figures = nvml_wrapper::gpm::gpm_metrics_get(
                    &self.nvml,
                    &before,
                    &now,
                    &[GpmMetricId::SmUtil, GpmMetricId::DramBwUtil],
                )
                .map_err(query("nvmlGpmMetricsGet", index))?;
                let percent = |i: usize| {
                    let value = figures.get(i)?.as_ref().ok()?.value;
                    // A percentage: rounded into 0..=100 (NaN: no figure).
                    (!value.is_nan()).then(|| {
                        let clamped = value.clamp(0.0, 100.0).round();
                        (0..=100u32)
                            .find(|p| f64::from(*p) >= clamped)
                            .unwrap_or(100)
                    })
                };
                u.sm_percent = percent(0);
                u.memory_percent = percent(1);
            }
            self.gpm_samples.keep(&self.nvml, (index, gi), now);
            usage.push(u);
        }
        Ok(usage)
    }

    /// Mean SM utilization of each process with samples on GPU `d` (`index`) since the last
    /// read (the first read: the last 10 s); `None` where NVML has no per-process figures.
    fn process_sm_percent(
        &self,
        d: &Device<'_>,
        index: u32,
    ) -> Result<Option<std::collections::BTreeMap<u32, u32>>, BackendError> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |t| u64::try_from(t.as_micros()).unwrap_or(u64::MAX));
        let since = {
            let mut read = self
                .process_samples_read
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            read.insert(index, now)
                .unwrap_or_else(|| now.saturating_sub(10_000_000))
        };
        let samples = match d.process_utilization_stats(since) {
            Ok(samples) => samples,
            // No process computed since then.
            Err(NvmlError::NotFound) => Vec::new(),
            Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)) => return Ok(None),
            Err(e) => return Err(query("nvmlDeviceGetProcessUtilization", index)(e)),
        };
        let mut sums: std::collections::BTreeMap<u32, (u64, u64)> = Default::default();
        for s in samples {
            let (total, n) = sums.entry(s.pid).or_default();
            *total += u64::from(s.sm_util.min(100));
            *n += 1;
        }
        Ok(Some(
            sums.into_iter()
                .map(|(pid, (total, n))| (pid, u32::try_from(total / n).unwrap_or(100)))
                .collect(),
        ))
    }

    /// Loads and initializes NVML from `library` (default [`DEFAULT_LIBRARY`]), reading the
    /// values NVML lacks under `sysfs_root` (default `/sys`).
    ///
    /// # Errors
    /// [`BackendError::LoadNvml`] when the library is missing or `nvmlInit_v2` fails.
    pub fn load(library: Option<&OsStr>, sysfs_root: PathBuf) -> Result<Self, BackendError> {
        let library = library.unwrap_or(OsStr::new(DEFAULT_LIBRARY));
        let nvml =
            Nvml::builder()
                .lib_path(library)
                .init()
                .map_err(|e| BackendError::LoadNvml {
                    library: library.to_string_lossy().into_owned(),
                    message: e.to_string(),
                })?;
        Ok(Self {
            events: Mutex::new(Events::default()),
            process_samples_read: Mutex::default(),
            gpm_samples: ffi::GpmSamples::default(),
            nvml,
            memory_limits: ffi::MemoryLimitsEntry::find(library),
            sysfs_root,
            tool_timeout: TOOL_TIMEOUT,
        })
    }

    /// Kills `nvidia-smi` after `timeout` instead of [`TOOL_TIMEOUT`]. The plugin passes its
    /// claim deadline, so a hung tool never holds a GPU's lock longer than one claim may take.
    #[must_use]
    pub fn with_tool_timeout(mut self, timeout: Duration) -> Self {
        self.tool_timeout = timeout;
        self
    }

    /// Registers every GPU for the health events we watch.
    fn watch_events(&self) -> Result<ffi::EventWatch, BackendError> {
        let events = |call: &'static str| {
            move |e: NvmlError| BackendError::Events {
                call,
                message: e.to_string(),
            }
        };
        let count = self
            .nvml
            .device_count()
            .map_err(events("nvmlDeviceGetCount_v2"))?;
        let mut gpus = Vec::new();
        for index in 0..count {
            let d = self
                .nvml
                .device_by_index(index)
                .map_err(events("nvmlDeviceGetHandleByIndex_v2"))?;
            let uuid = d.uuid().map_err(events("nvmlDeviceGetUUID"))?;
            gpus.push((d, uuid));
        }
        let types = u64::from(nvml_wrapper_sys::bindings::nvmlEventTypeXidCriticalError)
            | u64::from(nvml_wrapper_sys::bindings::nvmlEventTypeDoubleBitEccError);
        let (watch, skipped) =
            ffi::watch_events(&self.nvml, &gpus, types).map_err(events("nvmlEventSetCreate"))?;
        for (uuid, e) in skipped {
            tracing::warn!(gpu = %uuid, error = %e, "cannot watch health events of this GPU");
        }
        Ok(watch)
    }

    /// After `NVML_ERROR_GPU_IS_LOST`: which watched GPUs are lost.
    fn lost_gpus(&self, watch: &ffi::EventWatch) -> Vec<HealthEvent> {
        watch
            .uuids()
            .filter(|uuid| {
                matches!(
                    self.nvml.device_by_uuid(*uuid).and_then(|d| d.uuid()),
                    Err(NvmlError::GpuLost)
                )
            })
            .map(|uuid| HealthEvent {
                gpu_uuid: uuid.to_owned(),
                kind: HealthEventKind::GpuLost,
            })
            .collect()
    }

    /// NUMA node from sysfs for drivers whose NVML lacks `nvmlDeviceGetNumaNodeId`.
    fn sysfs_numa_node(&self, nvml_bus_id: &str) -> Option<u32> {
        let bdf = crate::model::standard_pci_bus_id(nvml_bus_id)?;
        crate::sysfs::numa_node(&self.sysfs_root, &bdf)
    }

    /// The PCIe root complex from sysfs; `None` (logged) when sysfs cannot say.
    fn sysfs_pcie_root(&self, nvml_bus_id: &str) -> Option<String> {
        let bdf = crate::model::standard_pci_bus_id(nvml_bus_id)?;
        crate::sysfs::pcie_root(&self.sysfs_root, &bdf)
            .map_err(|e| tracing::debug!(error = %e, "no pcieRoot"))
            .ok()
    }

    /// Active NVLinks grouped by remote end. Links that are inactive or not present (NVML answers
    /// NOT_SUPPORTED / INVALID_ARGUMENT past the last link) are skipped.
    fn nvlinks(&self, d: &Device<'_>) -> Vec<NvLinkGroup> {
        let mut groups: Vec<NvLinkGroup> = Vec::new();
        for link in 0..nvml_wrapper_sys::bindings::NVML_NVLINK_MAX_LINKS {
            let l = d.link_wrapper_for(link);
            if !l.is_active().unwrap_or(false) {
                continue;
            }
            let Ok(remote) = l.remote_pci_info() else {
                continue;
            };
            let Ok(Some(kind)) = ffi::nvlink_remote_device_type(&self.nvml, d, link) else {
                continue;
            };
            match groups
                .iter_mut()
                .find(|g| g.remote_pci_bus_id == remote.bus_id && g.remote_device_type == kind)
            {
                Some(g) => g.links += 1,
                None => groups.push(NvLinkGroup {
                    links: 1,
                    remote_pci_bus_id: remote.bus_id,
                    remote_device_type: kind,
                }),
            }
        }
        groups
    }

    /// Every GPU instance profile the GPU supports, with its possible placements.
    fn mig_profiles(&self, d: &Device<'_>, index: u32) -> Result<Vec<MigProfile>, BackendError> {
        let mut profiles = Vec::new();
        for profile in 0..PROFILE_COUNT {
            // NOT_SUPPORTED / INVALID_ARGUMENT: this GPU has no such profile.
            let Ok(info) = d.profile_info(profile) else {
                continue;
            };
            let placements = ffi::possible_placements(&self.nvml, d, info.id).map_err(query(
                "nvmlDeviceGetGpuInstancePossiblePlacements_v2",
                index,
            ))?;
            profiles.push(MigProfile {
                id: info.id,
                profile,
                slice_count: info.slice_count,
                instance_count: info.instance_count,
                multiprocessor_count: info.multiprocessor_count,
                copy_engine_count: info.copy_engine_count,
                decoder_count: info.decoder_count,
                encoder_count: info.encoder_count,
                jpeg_count: info.jpeg_count,
                ofa_count: info.ofa_count,
                memory_size_mib: info.memory_size_mb,
                placements,
            });
        }
        Ok(profiles)
    }

    /// The existing MIG devices of a GPU with MIG enabled.
    fn mig_devices(&self, d: &Device<'_>, index: u32) -> Result<Vec<RawMigDevice>, BackendError> {
        let max = d
            .mig_device_count()
            .map_err(query("nvmlDeviceGetMaxMigDeviceCount", index))?;
        let mut devices = Vec::new();
        for i in 0..max {
            // NOT_FOUND: no MIG device at this index (indices are sparse).
            let Ok(m) = d.mig_device_by_index(i) else {
                continue;
            };
            let attrs = m
                .attributes()
                .map_err(query("nvmlDeviceGetAttributes_v2", index))?;
            let info = ffi::gpu_instance_info(&self.nvml, d, &m)
                .map_err(query("nvmlGpuInstanceGetInfo", index))?;
            devices.push(RawMigDevice {
                uuid: m.uuid().map_err(query("nvmlDeviceGetUUID", index))?,
                gpu_instance_id: info.gpu_instance_id,
                compute_instance_id: info.compute_instance_id,
                profile_id: info.profile_id,
                placement: info.placement,
                attributes: Some(MigAttributes {
                    memory_total_bytes: m
                        .memory_info()
                        .map_err(query("nvmlDeviceGetMemoryInfo", index))?
                        .total,
                    multiprocessor_count: attrs.multiprocessor_count,
                    copy_engine_count: attrs.shared_copy_engine_count,
                    decoder_count: attrs.shared_decoder_count,
                    encoder_count: attrs.shared_encoder_count,
                    jpeg_count: attrs.shared_jpeg_count,
                    ofa_count: attrs.shared_ofa_count,
                    gpu_instance_slice_count: attrs.gpu_instance_slice_count,
                    compute_instance_slice_count: attrs.compute_instance_slice_count,
                }),
            });
        }
        Ok(devices)
    }
}

fn query(call: &'static str, index: u32) -> impl Fn(NvmlError) -> BackendError {
    move |e| BackendError::Query {
        call,
        index,
        message: e.to_string(),
    }
}

/// Brand names as NVIDIA's DRA driver publishes them.
fn brand_name(b: Brand) -> &'static str {
    match b {
        Brand::Unknown => "Unknown",
        Brand::Quadro => "Quadro",
        Brand::Tesla => "Tesla",
        Brand::NVS => "NVS",
        Brand::GRID => "Grid",
        Brand::GeForce => "GeForce",
        Brand::Titan => "Titan",
        Brand::VApps => "NvidiaVApps",
        Brand::VPC => "NvidiaVPC",
        Brand::VCS => "NvidiaVCS",
        Brand::VWS => "NvidiaVWS",
        Brand::CloudGaming => "NvidiaCloudGaming",
        Brand::VGaming => "NvidiaVGaming",
        Brand::QuadroRTX => "QuadroRTX",
        Brand::NvidiaRTX => "NvidiaRTX",
        Brand::Nvidia => "Nvidia",
        Brand::GeForceRTX => "GeForceRTX",
        Brand::TitanRTX => "TitanRTX",
    }
}

impl GpuBackend for NvmlBackend {
    fn system(&self) -> Result<SystemInfo, BackendError> {
        Ok(SystemInfo {
            driver_version: self
                .nvml
                .sys_driver_version()
                .map_err(query("nvmlSystemGetDriverVersion", u32::MAX))?,
            cuda_driver_version: self
                .nvml
                .sys_cuda_driver_version()
                .map_err(query("nvmlSystemGetCudaDriverVersion_v2", u32::MAX))?,
        })
    }

    fn device_count(&self) -> Result<u32, BackendError> {
        self.nvml
            .device_count()
            .map_err(query("nvmlDeviceGetCount_v2", u32::MAX))
    }

    fn fabric(&self, index: u32) -> Result<FabricAnswer, BackendError> {
        let d = self
            .nvml
            .device_by_index(index)
            .map_err(query("nvmlDeviceGetHandleByIndex_v2", index))?;
        Ok(FabricAnswer::of(ffi::fabric_info(&self.nvml, &d)))
    }

    fn gpu_state(&self, index: u32) -> Result<GpuState, BackendError> {
        let d = self
            .nvml
            .device_by_index(index)
            .map_err(query("nvmlDeviceGetHandleByIndex_v2", index))?;
        // NOT_SUPPORTED: not MIG-capable, so no MIG devices.
        let mig_enabled = d
            .mig_mode()
            .is_ok_and(|m| m.current == nvml_wrapper_sys::bindings::NVML_DEVICE_MIG_ENABLE);
        Ok(GpuState {
            uuid: d.uuid().map_err(query("nvmlDeviceGetUUID", index))?,
            minor: d
                .minor_number()
                .map_err(query("nvmlDeviceGetMinorNumber", index))?,
            mig_devices: if mig_enabled {
                self.mig_devices(&d, index)?
            } else {
                Vec::new()
            },
        })
    }

    fn usage(&self, index: u32) -> Result<GpuUsage, BackendError> {
        let d = self
            .nvml
            .device_by_index(index)
            .map_err(query("nvmlDeviceGetHandleByIndex_v2", index))?;
        let (sm_percent, memory_percent) = match d.utilization_rates() {
            Ok(u) => (Some(u.gpu.min(100)), Some(u.memory.min(100))),
            // A GPU in MIG mode has no whole-GPU figures.
            Err(NvmlError::NotSupported) => (None, None),
            Err(e) => return Err(query("nvmlDeviceGetUtilizationRates", index)(e)),
        };
        let memory_used_bytes = d
            .memory_info()
            .map_err(query("nvmlDeviceGetMemoryInfo_v2", index))?
            .used;
        let mut listed = d
            .running_compute_processes()
            .map_err(query("nvmlDeviceGetComputeRunningProcesses_v3", index))?;
        // MPS clients, where NVML lists them apart from the server (a driver without the call,
        // or a GPU without MPS support, has none to add).
        match d.mps_running_compute_processes() {
            Ok(mps) => {
                for p in mps {
                    if !listed.iter().any(|l| l.pid == p.pid) {
                        listed.push(p);
                    }
                }
            }
            Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)) => {}
            Err(e) => {
                return Err(query("nvmlDeviceGetMPSComputeRunningProcesses_v3", index)(
                    e,
                ));
            }
        }
        let busy = self.process_sm_percent(&d, index)?;
        let processes = listed
            .into_iter()
            .map(|p| ProcessUsage {
                pid: p.pid,
                used_memory_bytes: match p.used_gpu_memory {
                    UsedGpuMemory::Used(bytes) => Some(bytes),
                    UsedGpuMemory::Unavailable => None,
                },
                gpu_instance_id: p.gpu_instance_id,
                compute_instance_id: p.compute_instance_id,
                sm_percent: busy.as_ref().map(|b| b.get(&p.pid).copied().unwrap_or(0)),
            })
            .collect();
        let mig = if sm_percent.is_none() {
            self.mig_usage(&d, index)?
        } else {
            Vec::new()
        };
        Ok(GpuUsage {
            sm_percent,
            memory_percent,
            memory_used_bytes,
            processes,
            mig,
        })
    }

    fn gpu(&self, index: u32) -> Result<RawGpu, BackendError> {
        let d = self
            .nvml
            .device_by_index(index)
            .map_err(query("nvmlDeviceGetHandleByIndex_v2", index))?;
        let cc = d
            .cuda_compute_capability()
            .map_err(query("nvmlDeviceGetCudaComputeCapability", index))?;
        let pci = d
            .pci_info()
            .map_err(query("nvmlDeviceGetPciInfo_v3", index))?;
        let numa_node = match d.numa_node_id() {
            Ok(n) => Some(n),
            Err(_) => self.sysfs_numa_node(&pci.bus_id),
        };
        // NOT_SUPPORTED: not MIG-capable.
        let mig_mode = match d.mig_mode() {
            Ok(m) if m.current == nvml_wrapper_sys::bindings::NVML_DEVICE_MIG_ENABLE => {
                MigMode::Enabled
            }
            Ok(_) => MigMode::Disabled,
            Err(_) => MigMode::Unsupported,
        };
        let mig_profiles = match mig_mode {
            MigMode::Unsupported => Vec::new(),
            _ => self.mig_profiles(&d, index)?,
        };
        let mig_devices = match mig_mode {
            MigMode::Enabled => self.mig_devices(&d, index)?,
            _ => Vec::new(),
        };
        let memory = d
            .memory_info()
            .map_err(query("nvmlDeviceGetMemoryInfo_v2", index))?;
        let fabric = FabricAnswer::of(ffi::fabric_info(&self.nvml, &d));
        Ok(RawGpu {
            index,
            minor: d
                .minor_number()
                .map_err(query("nvmlDeviceGetMinorNumber", index))?,
            uuid: d.uuid().map_err(query("nvmlDeviceGetUUID", index))?,
            name: d.name().map_err(query("nvmlDeviceGetName", index))?,
            brand: brand_name(d.brand().map_err(query("nvmlDeviceGetBrand", index))?).to_owned(),
            architecture: d
                .architecture()
                .map_err(query("nvmlDeviceGetArchitecture", index))?
                .to_string(),
            cuda_compute_capability_major: u32::try_from(cc.major).unwrap_or_default(),
            cuda_compute_capability_minor: u32::try_from(cc.minor).unwrap_or_default(),
            memory_total_bytes: memory.total,
            memory_reserved_bytes: memory.reserved,
            multiprocessor_count: multiprocessors(&d, index, cc.major, cc.minor)?,
            pcie_root: self.sysfs_pcie_root(&pci.bus_id),
            pci_bus_id: pci.bus_id,
            numa_node,
            nvlinks: self.nvlinks(&d),
            mig_mode,
            mig_profiles,
            mig_devices,
            fabric: fabric.info,
            fabric_error: fabric.error,
        })
    }

    /// NVML has no call for the compute time slice; `nvidia-smi compute-policy` (from the driver
    /// root, on `PATH`) sets it, as NVIDIA's own DRA driver does, killed after the tool timeout
    /// ([`TOOL_TIMEOUT`] unless [`NvmlBackend::with_tool_timeout`] set another).
    fn set_compute_time_slice(&self, index: u32, value: u8) -> Result<(), BackendError> {
        set_time_slice_with(OsStr::new("nvidia-smi"), index, value, self.tool_timeout)
    }

    fn compute_mode(&self, index: u32) -> Result<ComputeMode, BackendError> {
        use nvml_wrapper::enum_wrappers::device::ComputeMode as Nvml;
        let mode = self
            .nvml
            .device_by_index(index)
            .and_then(|d| d.compute_mode())
            .map_err(query("nvmlDeviceGetComputeMode", index))?;
        Ok(match mode {
            Nvml::Default => ComputeMode::Default,
            Nvml::Prohibited => ComputeMode::Prohibited,
            Nvml::ExclusiveProcess => ComputeMode::ExclusiveProcess,
            // Gone from drivers since CUDA 8; it admits one context as well.
            Nvml::ExclusiveThread => ComputeMode::ExclusiveProcess,
        })
    }

    fn set_compute_mode(&self, index: u32, mode: ComputeMode) -> Result<(), BackendError> {
        use nvml_wrapper::enum_wrappers::device::ComputeMode as Nvml;
        let mut d = self
            .nvml
            .device_by_index(index)
            .map_err(query("nvmlDeviceGetHandleByIndex_v2", index))?;
        d.set_compute_mode(match mode {
            ComputeMode::Default => Nvml::Default,
            ComputeMode::Prohibited => Nvml::Prohibited,
            ComputeMode::ExclusiveProcess => Nvml::ExclusiveProcess,
        })
        .map_err(|e| BackendError::Action {
            call: "nvmlDeviceSetComputeMode",
            index,
            message: e.to_string(),
        })
    }

    fn memory_partitioning(&self) -> Result<bool, BackendError> {
        Ok(self.memory_limits.is_some()
            && crate::backend::driver_has_memory_partitioning(&self.system()?.driver_version))
    }

    fn set_memory_limits(
        &self,
        index: u32,
        cgroup: &std::path::Path,
        limits: MemoryLimits,
    ) -> Result<(), BackendError> {
        const CALL: &str = "nvmlDeviceSetMemoryLimits_v1";
        let entry = self
            .memory_limits
            .as_ref()
            .ok_or(BackendError::Unsupported { call: CALL, index })?;
        let path = std::ffi::CString::new(cgroup.as_os_str().as_encoded_bytes()).map_err(|_| {
            BackendError::Action {
                call: CALL,
                index,
                message: format!("cgroup path {} has a NUL byte", cgroup.display()),
            }
        })?;
        let d = self
            .nvml
            .device_by_index(index)
            .map_err(query("nvmlDeviceGetHandleByIndex_v2", index))?;
        entry
            .set(&d, &path, limits.soft_bytes, limits.hard_bytes)
            .map_err(|e| BackendError::Action {
                call: CALL,
                index,
                message: format!("cgroup {}: {e}", cgroup.display()),
            })
    }

    fn index_of(&self, uuid: &str) -> Result<u32, BackendError> {
        self.nvml
            .device_by_uuid(uuid)
            .and_then(|d| d.index())
            .map_err(|e| BackendError::Query {
                call: "nvmlDeviceGetHandleByUUID",
                index: u32::MAX,
                message: format!("{uuid}: {e}"),
            })
    }

    fn create_mig_device(
        &self,
        index: u32,
        profile_id: u32,
        placement: MigPlacement,
    ) -> Result<RawMigDevice, BackendError> {
        let d = self
            .nvml
            .device_by_index(index)
            .map_err(query("nvmlDeviceGetHandleByIndex_v2", index))?;
        // `profile_id` is the profile's ID (what creation takes); nvmlDeviceGetGpuInstance
        // ProfileInfo takes the NVML_GPU_INSTANCE_PROFILE_* value, so look the ID up (on an
        // H200, ID 19 is profile 0: tests/gpu/fixtures/h200-580.159.04).
        let slices = (0..PROFILE_COUNT)
            .filter_map(|p| d.profile_info(p).ok())
            .find(|info| info.id == profile_id)
            .ok_or_else(|| BackendError::Query {
                call: "nvmlDeviceGetGpuInstanceProfileInfo",
                index,
                message: format!("no GPU instance profile has ID {profile_id}"),
            })?
            .slice_count;
        let (gi, ci) = ffi::create_mig(&self.nvml, &d, profile_id, placement, slices)
            .map_err(query("nvmlDeviceCreateGpuInstanceWithPlacement", index))?;
        self.mig_devices(&d, index)?
            .into_iter()
            .find(|m| m.gpu_instance_id == gi && m.compute_instance_id == ci)
            .ok_or_else(|| BackendError::Query {
                call: "nvmlDeviceGetMigDeviceHandleByIndex",
                index,
                message: format!("created GPU instance {gi} compute instance {ci} is not listed"),
            })
    }

    fn destroy_mig_device(
        &self,
        index: u32,
        gpu_instance_id: u32,
        compute_instance_id: u32,
    ) -> Result<bool, BackendError> {
        let d = self
            .nvml
            .device_by_index(index)
            .map_err(query("nvmlDeviceGetHandleByIndex_v2", index))?;
        ffi::destroy_mig(&self.nvml, &d, gpu_instance_id, compute_instance_id)
            .map_err(query("nvmlGpuInstanceDestroy", index))
    }

    fn rewatch_health_events(&self) {
        // Dropping the event set frees it; the next wait registers the GPUs there are now.
        self.events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .watch = None;
    }

    fn wait_health_event(&self, timeout: Duration) -> Result<Option<HealthEvent>, BackendError> {
        let mut events = self
            .events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(e) = events.pending.pop_front() {
            return Ok(Some(e));
        }
        if events.watch.is_none() {
            events.watch = Some(self.watch_events()?);
        }
        let Some(watch) = events.watch.as_ref() else {
            return Ok(None);
        };
        let timeout_ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        match ffi::wait_event(&self.nvml, watch, timeout_ms) {
            Ok(None) => Ok(None),
            Ok(Some(raw)) => {
                let Some(gpu_uuid) = raw.uuid else {
                    return Ok(None);
                };
                let kind = if raw.event_type
                    & u64::from(nvml_wrapper_sys::bindings::nvmlEventTypeXidCriticalError)
                    != 0
                {
                    HealthEventKind::Xid { code: raw.data }
                } else if raw.event_type
                    & u64::from(nvml_wrapper_sys::bindings::nvmlEventTypeDoubleBitEccError)
                    != 0
                {
                    HealthEventKind::DoubleBitEcc
                } else {
                    return Ok(None);
                };
                Ok(Some(HealthEvent { gpu_uuid, kind }))
            }
            Err(NvmlError::GpuLost) => {
                let lost = self.lost_gpus(watch);
                events.pending.extend(lost);
                let first = events.pending.pop_front();
                if first.is_none() {
                    // Nobody answers GPU_IS_LOST for itself: do not spin on the failing wait.
                    drop(events);
                    std::thread::sleep(timeout);
                }
                Ok(first)
            }
            Err(e) => Err(BackendError::Events {
                call: "nvmlEventSetWait_v2",
                message: e.to_string(),
            }),
        }
    }

    fn probe_recovery(&self, gpu_uuid: &str) -> Result<RecoveryProbe, BackendError> {
        let d = match self.nvml.device_by_uuid(gpu_uuid) {
            Ok(d) => d,
            Err(e) => return Ok(RecoveryProbe::Unhealthy(format!("not reachable: {e}"))),
        };
        if let Err(e) = d.pci_info() {
            return Ok(RecoveryProbe::Unhealthy(format!(
                "PCI info query fails: {e}"
            )));
        }
        if let Ok(true) = d.are_pages_pending_retired() {
            return Ok(RecoveryProbe::Unhealthy(
                "page retirement pending until reset".into(),
            ));
        }
        match ffi::remapped_rows(&self.nvml, &d) {
            Ok((true, _)) => Ok(RecoveryProbe::Unhealthy(
                "row remapping pending until reset".into(),
            )),
            Ok((_, true)) => Ok(RecoveryProbe::Unhealthy("row remapping failed".into())),
            // NOT_SUPPORTED before Ampere: nothing to wait for.
            _ => Ok(RecoveryProbe::Healthy),
        }
    }
}

/// How long `nvidia-smi` may run before it is killed and its action fails: a wedged driver can
/// hang it, and the claim's GPU lock is held meanwhile. Well below the kubelet's 45 s.
pub const TOOL_TIMEOUT: Duration = Duration::from_secs(10);

/// `program compute-policy -i <index> --set-timeslice=<value>`, killed after `timeout`.
///
/// # Errors
/// [`BackendError::Action`] when the tool cannot start, exits unsuccessfully (with its stderr) or
/// does not exit within `timeout` (it is killed and reaped first).
fn set_time_slice_with(
    program: &OsStr,
    index: u32,
    value: u8,
    timeout: Duration,
) -> Result<(), BackendError> {
    use std::io::Read;
    use wait_timeout::ChildExt;
    let fail = |message: String| BackendError::Action {
        call: "nvidia-smi compute-policy --set-timeslice",
        index,
        message,
    };
    let mut child = std::process::Command::new(program)
        .args(["compute-policy", "-i", &index.to_string()])
        .arg(format!("--set-timeslice={value}"))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| fail(format!("{}: {e}", program.to_string_lossy())))?;
    let status = match child.wait_timeout(timeout) {
        Ok(Some(status)) => status,
        Ok(None) => {
            let _ = child.kill();
            let _ = child.wait();
            return Err(fail(format!(
                "no answer within {} ms; killed",
                timeout.as_millis()
            )));
        }
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            return Err(fail(e.to_string()));
        }
    };
    if status.success() {
        return Ok(());
    }
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        let _ = pipe.read_to_string(&mut stderr);
    }
    Err(fail(format!("{status}: {}", stderr.trim())))
}

/// Streaming multiprocessors of a full GPU.
///
/// `nvmlDeviceGetAttributes_v2` answers only for MIG device handles: on a full GPU it returns
/// NOT_SUPPORTED (seen on an H200 with driver 580.159.04, `tests/gpu/fixtures/`). There the count
/// is the GPU's CUDA cores (`nvmlDeviceGetNumGpuCores`) divided by the cores per multiprocessor
/// of its compute capability ([`cores_per_multiprocessor`]). `0` when neither answers: the
/// `multiprocessors` capacity is then left out of the GPU's published capacities.
///
/// # Errors
/// [`BackendError::Query`] when either call fails with anything but NOT_SUPPORTED.
fn multiprocessors(
    d: &Device<'_>,
    index: u32,
    cc_major: i32,
    cc_minor: i32,
) -> Result<u32, BackendError> {
    match d.attributes() {
        Ok(a) => return Ok(a.multiprocessor_count),
        Err(NvmlError::NotSupported) => {}
        Err(e) => return Err(query("nvmlDeviceGetAttributes_v2", index)(e)),
    }
    let cores = match d.num_cores() {
        Ok(cores) => cores,
        Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)) => return Ok(0),
        Err(e) => return Err(query("nvmlDeviceGetNumGpuCores", index)(e)),
    };
    Ok(cores_per_multiprocessor(cc_major, cc_minor).map_or(0, |per| cores / per))
}

/// CUDA cores per streaming multiprocessor by compute capability, as NVIDIA documents them
/// (CUDA C++ Programming Guide, "Compute Capabilities": arithmetic instruction throughput, FP32
/// lanes per SM). `None` for a capability not listed.
pub fn cores_per_multiprocessor(major: i32, minor: i32) -> Option<u32> {
    match (major, minor) {
        (6, 0) | (7, _) | (8, 0) => Some(64),
        (6, 1 | 2) | (8, 6..=9) | (9, 0) | (10..=12, _) => Some(128),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multiprocessors_from_cuda_cores_match_the_published_sm_counts() {
        // (compute capability, CUDA cores, SMs) of GPUs NVIDIA lists both for.
        for (cc, cores, sms) in [
            ((7, 0), 5120, 80),    // V100
            ((7, 5), 2560, 40),    // T4
            ((8, 0), 6912, 108),   // A100
            ((8, 6), 10752, 84),   // RTX A6000
            ((8, 9), 7424, 58),    // L4
            ((8, 9), 18176, 142),  // L40S
            ((9, 0), 16896, 132),  // H100 SXM, H200
            ((10, 0), 18944, 148), // B200
        ] {
            assert_eq!(
                cores_per_multiprocessor(cc.0, cc.1).map(|p| cores / p),
                Some(sms),
                "{cc:?}"
            );
        }
        assert_eq!(cores_per_multiprocessor(5, 2), None);
    }

    #[test]
    fn a_missing_library_is_a_clear_error_not_a_panic() {
        let err = NvmlBackend::load(
            Some(OsStr::new("/nonexistent/libnvidia-ml.so.1")),
            PathBuf::from("/sys"),
        )
        .expect_err("no NVML here");
        let msg = err.to_string();
        assert!(msg.contains("/nonexistent/libnvidia-ml.so.1"), "{msg}");
        assert!(msg.contains("--fake-topology"), "{msg}");
    }

    /// A script standing in for `nvidia-smi`, with `body` as its shell code.
    fn tool(dir: &std::path::Path, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join("nvidia-smi");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    #[test]
    fn a_hung_nvidia_smi_is_killed_and_fails_its_time_slice_action_within_the_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("pid");
        // The tool never answers (it sleeps an hour): an answer at all is the timeout's.
        let hung = tool(
            dir.path(),
            &format!("echo $$ > {}; exec sleep 3600", pid_file.display()),
        );
        let err = set_time_slice_with(hung.as_os_str(), 2, 1, Duration::from_millis(300))
            .expect_err("a hung tool fails");
        let msg = err.to_string();
        assert!(msg.contains("no answer within 300 ms"), "{msg}");
        assert!(msg.contains("compute-policy"), "{msg}");
        // Killed and reaped, not left behind. (No PID file: killed before its first command.)
        if let Ok(pid) = std::fs::read_to_string(&pid_file) {
            let proc = PathBuf::from(format!("/proc/{}", pid.trim()));
            assert!(!proc.exists(), "the hung tool (pid {pid}) is still there");
        }
    }

    #[test]
    fn nvidia_smi_time_slice_arguments_and_failures_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let args = dir.path().join("args");
        let ok = tool(dir.path(), &format!("echo \"$@\" > {}", args.display()));
        set_time_slice_with(ok.as_os_str(), 3, 2, TOOL_TIMEOUT).expect("succeeds");
        assert_eq!(
            std::fs::read_to_string(&args).unwrap().trim(),
            "compute-policy -i 3 --set-timeslice=2"
        );
        let failing = tool(dir.path(), "echo 'Insufficient Permissions' >&2; exit 4");
        let msg = set_time_slice_with(failing.as_os_str(), 0, 1, TOOL_TIMEOUT)
            .expect_err("fails")
            .to_string();
        assert!(msg.contains("Insufficient Permissions"), "{msg}");
        let missing =
            set_time_slice_with(OsStr::new("/nonexistent/nvidia-smi"), 0, 1, TOOL_TIMEOUT)
                .expect_err("no tool")
                .to_string();
        assert!(missing.contains("/nonexistent/nvidia-smi"), "{missing}");
    }
}
