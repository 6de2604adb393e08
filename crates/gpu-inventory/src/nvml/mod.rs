//! The real backend: NVML through `nvml-wrapper`, loaded at run time.
//!
//! The library is always compiled in; `libnvidia-ml.so.1` is opened only by
//! [`NvmlBackend::load`], which fails with [`BackendError::LoadNvml`] on machines without the
//! NVIDIA driver, so one binary serves GPU nodes and tests alike.
//!
//! Four NVML calls go through [`ffi`] instead of `nvml-wrapper` 0.13, which lacks them or gets
//! them wrong: `nvmlDeviceGetNvLinkRemoteDeviceType` (the wrapper returns `Unknown` always),
//! `nvmlDeviceGetGpuInstancePossiblePlacements_v2` (the wrapper returns an empty list),
//! `nvmlDeviceGetGpuInstanceId` + `nvmlDeviceGetGpuInstanceById` + `nvmlGpuInstanceGetInfo`
//! (not wrapped), `nvmlDeviceGetGpuFabricInfoV` (not wrapped), and MIG creation and
//! destruction (`nvmlDeviceCreateGpuInstanceWithPlacement`,
//! `nvmlGpuInstanceGetComputeInstanceProfileInfo`, `nvmlGpuInstanceCreateComputeInstance`,
//! `nvmlDeviceGetGpuInstanceById`, `nvmlGpuInstanceGetComputeInstanceById`,
//! `nvmlComputeInstanceDestroy`, `nvmlGpuInstanceDestroy`; not wrapped).

mod ffi;

use std::ffi::OsStr;
use std::path::PathBuf;

use nvml_wrapper::enum_wrappers::device::Brand;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};

use crate::backend::{
    BackendError, GpuBackend, MigAttributes, MigMode, MigPlacement, MigProfile, NvLinkGroup,
    RawGpu, RawMigDevice, SystemInfo,
};
use crate::mig_tables::PROFILE_COUNT;

/// The soname the NVIDIA driver installs (the unversioned `.so` ships only with dev packages).
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

/// NVML, initialized.
pub struct NvmlBackend {
    nvml: Nvml,
    sysfs_root: PathBuf,
}

impl std::fmt::Debug for NvmlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlBackend")
            .field("sysfs_root", &self.sysfs_root)
            .finish_non_exhaustive()
    }
}

impl NvmlBackend {
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
        Ok(Self { nvml, sysfs_root })
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
        for id in 0..PROFILE_COUNT {
            // NOT_SUPPORTED / INVALID_ARGUMENT: this GPU has no such profile.
            let Ok(info) = d.profile_info(id) else {
                continue;
            };
            let placements = ffi::possible_placements(&self.nvml, d, info.id).map_err(query(
                "nvmlDeviceGetGpuInstancePossiblePlacements_v2",
                index,
            ))?;
            profiles.push(MigProfile {
                id: info.id,
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
            memory_total_bytes: d
                .memory_info()
                .map_err(query("nvmlDeviceGetMemoryInfo", index))?
                .total,
            multiprocessor_count: d
                .attributes()
                .map_err(query("nvmlDeviceGetAttributes_v2", index))?
                .multiprocessor_count,
            pcie_root: self.sysfs_pcie_root(&pci.bus_id),
            pci_bus_id: pci.bus_id,
            numa_node,
            nvlinks: self.nvlinks(&d),
            mig_mode,
            mig_profiles,
            mig_devices,
            fabric: ffi::fabric_info(&self.nvml, &d),
        })
    }

    /// NVML has no call for the compute time slice; `nvidia-smi compute-policy` (from the driver
    /// root, on `PATH`) sets it, as NVIDIA's own DRA driver does.
    fn set_compute_time_slice(&self, index: u32, value: u8) -> Result<(), BackendError> {
        let fail = |message: String| BackendError::Action {
            call: "nvidia-smi compute-policy --set-timeslice",
            index,
            message,
        };
        let out = std::process::Command::new("nvidia-smi")
            .args(["compute-policy", "-i", &index.to_string()])
            .arg(format!("--set-timeslice={value}"))
            .output()
            .map_err(|e| fail(e.to_string()))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(fail(format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )))
        }
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
        let slices = d
            .profile_info(profile_id)
            .map_err(query("nvmlDeviceGetGpuInstanceProfileInfo", index))?
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
