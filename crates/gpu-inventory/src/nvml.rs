//! The real backend: NVML through `nvml-wrapper`, loaded at run time.
//!
//! The library is always compiled in; `libnvidia-ml.so.1` is opened only by
//! [`NvmlBackend::load`], which fails with [`BackendError::LoadNvml`] on machines without the
//! NVIDIA driver, so one binary serves GPU nodes and tests alike.

use std::ffi::OsStr;
use std::path::PathBuf;

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::Brand;
use nvml_wrapper::error::NvmlError;

use crate::backend::{BackendError, GpuBackend, RawGpu, SystemInfo};

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

    /// NUMA node from sysfs (`/sys/bus/pci/devices/<bdf>/numa_node`) for drivers whose NVML lacks
    /// `nvmlDeviceGetNumaNodeId`; `-1` there means no NUMA affinity.
    fn sysfs_numa_node(&self, nvml_bus_id: &str) -> Option<u32> {
        let bdf = crate::model::standard_pci_bus_id(nvml_bus_id)?;
        let path = self
            .sysfs_root
            .join("bus/pci/devices")
            .join(bdf)
            .join("numa_node");
        std::fs::read_to_string(path)
            .ok()?
            .trim()
            .parse::<i64>()
            .ok()?
            .try_into()
            .ok()
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
            pci_bus_id: pci.bus_id,
            numa_node,
            // NVLink discovery arrives with the topology work (issue 4).
            nvlinks: Vec::new(),
        })
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
