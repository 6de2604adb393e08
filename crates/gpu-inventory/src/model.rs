//! The device model: discovered GPUs with normalized values, and their ResourceSlice form.
//!
//! Attribute vocabulary follows NVIDIA's DRA driver (k8s-dra-driver-gpu), so a claim written for
//! it selects the same GPUs here when the driver name is the same: `type`, `uuid`, `productName`,
//! `brand`, `architecture`, `cudaComputeCapability`, `driverVersion`, `cudaDriverVersion`,
//! `index`, `minor`; plus the standard `resource.kubernetes.io/pciBusID`,
//! `resource.kubernetes.io/pcieRoot` (k8s.io/dynamic-resource-allocation/deviceattribute) and
//! `resource.kubernetes.io/numaNode`, and our topology attributes `nvlinkDomain` ([`crate::nvlink`])
//! and `nvlinkClique`. The crate docs list the NVML call behind each attribute.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{Device, DeviceAttribute, DeviceCapacity};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use tracing::warn;

use crate::backend::{BackendError, GpuBackend, MigMode, RawGpu};
use crate::fabric::FabricInfo;
use crate::mig::{self, MigDevice};
use crate::naming;
use crate::nvlink::nvlink_domains;
use crate::slices::Pool;

/// Prefix of the attributes Kubernetes standardizes across drivers.
pub const STANDARD_PREFIX: &str = "resource.kubernetes.io/";

/// Discovery failed.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// The backend failed.
    #[error("querying the GPU backend")]
    Backend(#[from] BackendError),
    /// A value NVML returned cannot be published as its attribute type.
    #[error("GPU {uuid}: field {field} value {value:?} {problem}")]
    BadValue {
        /// The GPU (or `system` for node-wide values).
        uuid: String,
        /// The attribute or NVML field.
        field: &'static str,
        /// The value as NVML gave it.
        value: String,
        /// Why it is unusable.
        problem: &'static str,
    },
    /// Two GPUs would publish the same device name.
    #[error("GPUs {first} and {second} both map to device name {name}")]
    DuplicateName {
        /// The name.
        name: String,
        /// One GPU's UUID.
        first: String,
        /// The other's.
        second: String,
    },
}

/// How MIG-capable GPUs are published.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MigStrategy {
    /// GPUs with MIG enabled publish their existing MIG devices instead of themselves; other GPUs
    /// publish themselves.
    #[default]
    Existing,
    /// KEP-4815 partitionable devices: every GPU with MIG enabled and a MIG profile table
    /// publishes a counter set and every possible MIG placement consuming its share, so the
    /// scheduler can choose any valid partition; the plugin creates the MIG device at prepare.
    /// Other GPUs (MIG disabled or unsupported) publish themselves, whole. Exactly what prepare
    /// can honour: MIG devices can only be created with MIG mode on, and with MIG mode on the
    /// whole GPU runs no CUDA work.
    Partitionable,
}

/// Everything discovered on one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inventory {
    /// Full GPUs, in NVML enumeration order (also those with MIG enabled, whose whole-GPU device
    /// is then not published under [`MigStrategy::Existing`]).
    pub gpus: Vec<Gpu>,
    /// Existing MIG devices of GPUs with MIG enabled, parent by parent.
    pub mig_devices: Vec<MigDevice>,
    /// GPUs NVML enumerates but could not describe (e.g. fallen off the bus), by NVML index, with
    /// the error. They are left out of the published pool until they answer again.
    pub unavailable: Vec<(u32, String)>,
}

/// One full GPU with values normalized for publication.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// Device name within the pool (a DNS label) derived from the PCI bus ID, e.g.
    /// `gpu-0000-18-00-0` ([`naming::gpu_device_name`]).
    pub name: String,
    /// NVML's answers.
    pub raw: RawGpu,
    /// Kernel driver version as semver, leading zeros removed: `570.124.06` becomes `570.124.6`.
    pub driver_version: String,
    /// CUDA driver version as semver, e.g. `12.8.0`.
    pub cuda_driver_version: String,
    /// PCI bus ID in extended BDF form `dddd:bb:dd.f` (lowercase), when the domain fits 4 hex digits.
    pub pci_bus_id: Option<String>,
    /// The naming scheme the inventory was discovered with.
    pub naming: naming::Naming,
    /// The NVLink domain ([`crate::nvlink`]); `None` without NVLink peers.
    pub nvlink_domain: Option<String>,
    /// `<clusterUuid>.<cliqueId>` of a multi-node NVLink fabric whose registration completed with
    /// success ([`FabricInfo::clique`]), whatever its health: an unhealthy fabric keeps its
    /// clique (the node plugin taints the GPU instead).
    pub nvlink_clique: Option<String>,
}

/// Queries `backend` for every GPU and normalizes the answers. A GPU whose queries fail is
/// reported in [`Inventory::unavailable`] and left out, so a lost GPU does not take the node's
/// other GPUs with it.
///
/// # Errors
/// [`DiscoveryError`] when a node-wide query fails or a value cannot be published.
pub fn discover(backend: &dyn GpuBackend) -> Result<Inventory, DiscoveryError> {
    discover_with(backend, naming::Naming::Drust)
}

/// [`discover`], naming devices with `naming` ([`naming::Naming::Nvidia`]: NVIDIA compatibility
/// mode).
///
/// # Errors
/// As [`discover`].
pub fn discover_with(
    backend: &dyn GpuBackend,
    naming: naming::Naming,
) -> Result<Inventory, DiscoveryError> {
    let system = backend.system()?;
    let driver_version =
        semver_from_dotted(&system.driver_version).ok_or_else(|| DiscoveryError::BadValue {
            uuid: "system".into(),
            field: "driverVersion",
            value: system.driver_version.clone(),
            problem: "is not a dotted numeric version",
        })?;
    let cuda = system.cuda_driver_version;
    if cuda <= 0 {
        return Err(DiscoveryError::BadValue {
            uuid: "system".into(),
            field: "cudaDriverVersion",
            value: cuda.to_string(),
            problem: "must be positive",
        });
    }
    let cuda_driver_version = format!("{}.{}.0", cuda / 1000, (cuda % 1000) / 10);
    let mut raws = Vec::new();
    let mut unavailable = Vec::new();
    for i in 0..backend.device_count()? {
        match backend.gpu(i) {
            Ok(raw) => raws.push(raw),
            Err(e) => {
                warn!(index = i, error = %e, "GPU unavailable; leaving it out of the pool");
                unavailable.push((i, e.to_string()));
            }
        }
    }
    let domains = nvlink_domains(&raws.iter().collect::<Vec<_>>());
    let mut names: BTreeMap<String, String> = BTreeMap::new();
    let mut gpus = Vec::with_capacity(raws.len());
    for (raw, nvlink_domain) in raws.into_iter().zip(domains) {
        let name = match naming {
            naming::Naming::Drust => naming::gpu_device_name(&raw),
            naming::Naming::Nvidia => naming::nvidia_gpu_device_name(&raw),
        };
        if let Some(first) = names.insert(name.clone(), raw.uuid.clone()) {
            return Err(DiscoveryError::DuplicateName {
                name,
                first,
                second: raw.uuid,
            });
        }
        let nvlink_clique = raw.fabric.as_ref().and_then(FabricInfo::clique);
        gpus.push(Gpu {
            name,
            naming,
            pci_bus_id: standard_pci_bus_id(&raw.pci_bus_id),
            driver_version: driver_version.clone(),
            cuda_driver_version: cuda_driver_version.clone(),
            nvlink_domain,
            nvlink_clique,
            raw,
        });
    }
    let mig_devices = gpus
        .iter()
        .filter(|g| g.raw.mig_mode == MigMode::Enabled)
        .flat_map(mig::existing_devices)
        .collect();
    Ok(Inventory {
        gpus,
        mig_devices,
        unavailable,
    })
}

impl Inventory {
    /// The devices (and counter sets) this node publishes under `strategy`, in a stable order:
    /// GPU by GPU in enumeration order, a GPU's MIG devices by profile and placement.
    pub fn pool(&self, strategy: MigStrategy) -> Pool {
        let mut pool = Pool::default();
        for gpu in &self.gpus {
            let enabled = gpu.raw.mig_mode == MigMode::Enabled;
            match strategy {
                MigStrategy::Partitionable if enabled && !gpu.raw.mig_profiles.is_empty() => {
                    let (counters, devices) = mig::partitionable(gpu);
                    pool.counter_sets.push(counters);
                    pool.devices.extend(devices);
                }
                _ if enabled => pool.devices.extend(
                    self.mig_devices
                        .iter()
                        .filter(|m| m.parent == gpu.name)
                        .map(|m| m.device(gpu)),
                ),
                _ => pool.devices.push(gpu.device()),
            }
        }
        pool
    }
}

/// `570.124.06` -> `570.124.6`, `575.51` -> `575.51.0`. `None` unless 1-3 numeric parts.
pub fn semver_from_dotted(v: &str) -> Option<String> {
    let parts: Vec<u64> = v
        .trim()
        .split('.')
        .map(|p| {
            if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
                None
            } else {
                p.parse().ok()
            }
        })
        .collect::<Option<_>>()?;
    match parts.as_slice() {
        [a] => Some(format!("{a}.0.0")),
        [a, b] => Some(format!("{a}.{b}.0")),
        [a, b, c] => Some(format!("{a}.{b}.{c}")),
        _ => None,
    }
}

/// NVML's `00000000:18:00.0` -> `0000:18:00.0`, the form upstream's `GetPCIBusIDAttribute`
/// accepts (deviceattribute/pci_linux.go). `None` when the domain needs more than 4 hex digits.
pub fn standard_pci_bus_id(nvml: &str) -> Option<String> {
    let lower = nvml.trim().to_ascii_lowercase();
    let (domain, rest) = lower.split_once(':')?;
    let domain = u32::from_str_radix(domain, 16).ok()?;
    let id = format!("{domain:04x}:{rest}");
    let b = id.as_bytes();
    let hex = |r: std::ops::Range<usize>| {
        b.get(r)
            .is_some_and(|s| s.iter().all(u8::is_ascii_hexdigit))
    };
    let well_formed = b.len() == 12
        && hex(0..4)
        && b[4] == b':'
        && hex(5..7)
        && b[7] == b':'
        && hex(8..10)
        && b[10] == b'.'
        && hex(11..12);
    well_formed.then_some(id)
}

/// Bytes as the canonical Kubernetes quantity the API server would store: upstream's
/// `resource.NewQuantity(bytes, resource.BinarySI).String()` (`k8s.io/apimachinery`
/// `pkg/api/resource/quantity.go`), through [`k8s_quantity`]: the largest binary suffix that
/// divides exactly (`81559Mi`), a plain integer otherwise, and below 1024 the decimal form
/// upstream switches to (`1000` is `1k`). Beyond `i64::MAX` bytes (no GPU has them), the
/// plain integer.
pub fn bytes_quantity(bytes: u64) -> Quantity {
    match i64::try_from(bytes) {
        Ok(v) => Quantity(
            k8s_quantity::Quantity::new(v, k8s_quantity::Format::BinarySi).canonical_string(),
        ),
        Err(_) => Quantity(bytes.to_string()),
    }
}

pub(crate) fn string(v: impl Into<String>) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(v.into()),
        ..Default::default()
    }
}

pub(crate) fn int(v: impl Into<i64>) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(v.into()),
        ..Default::default()
    }
}

pub(crate) fn version(v: impl Into<String>) -> DeviceAttribute {
    DeviceAttribute {
        version: Some(v.into()),
        ..Default::default()
    }
}

pub(crate) fn capacity(value: Quantity) -> DeviceCapacity {
    DeviceCapacity {
        value,
        ..Default::default()
    }
}

pub(crate) fn count(n: u32) -> DeviceCapacity {
    capacity(Quantity(n.to_string()))
}

impl Gpu {
    /// Where the GPU sits: `resource.kubernetes.io/pciBusID`, `pcieRoot` and `numaNode`, each when
    /// known. MIG devices of the GPU share them.
    pub fn location_attributes(&self) -> BTreeMap<String, DeviceAttribute> {
        let mut attributes = BTreeMap::new();
        if let Some(bus) = &self.pci_bus_id {
            attributes.insert(format!("{STANDARD_PREFIX}pciBusID"), string(bus));
        }
        if let Some(root) = &self.raw.pcie_root {
            attributes.insert(format!("{STANDARD_PREFIX}pcieRoot"), string(root));
        }
        if let Some(numa) = self.raw.numa_node {
            attributes.insert(format!("{STANDARD_PREFIX}numaNode"), int(numa));
        }
        attributes
    }

    /// The attributes a MIG device inherits from its parent: `productName`, `brand`,
    /// `architecture`, `cudaComputeCapability`, `driverVersion`, `cudaDriverVersion`, plus
    /// `parentUUID`, `parentIndex`, `parentMinor` and the location attributes.
    pub fn parent_attributes(&self) -> BTreeMap<String, DeviceAttribute> {
        let r = &self.raw;
        let mut attributes = BTreeMap::from([
            ("productName".to_owned(), string(&r.name)),
            ("brand".to_owned(), string(&r.brand)),
            ("architecture".to_owned(), string(self.architecture())),
            (
                "cudaComputeCapability".to_owned(),
                version(self.compute_capability()),
            ),
            ("driverVersion".to_owned(), version(&self.driver_version)),
            (
                "cudaDriverVersion".to_owned(),
                version(&self.cuda_driver_version),
            ),
            ("parentUUID".to_owned(), string(&r.uuid)),
            ("parentIndex".to_owned(), int(r.index)),
            ("parentMinor".to_owned(), int(r.minor)),
        ]);
        attributes.extend(self.location_attributes());
        attributes
    }

    /// NVML's architecture name; in NVIDIA compatibility mode as NVIDIA's driver spells it
    /// (go-nvlib's `GetArchitectureAsString`: `Ada Lovelace` where NVML's enum says Ada).
    fn architecture(&self) -> &str {
        match (self.naming, self.raw.architecture.as_str()) {
            (naming::Naming::Nvidia, "Ada") => "Ada Lovelace",
            (_, a) => a,
        }
    }

    fn compute_capability(&self) -> String {
        format!(
            "{}.{}.0",
            self.raw.cuda_compute_capability_major, self.raw.cuda_compute_capability_minor
        )
    }

    /// The `resource.k8s.io/v1` Device published for this GPU. Bare attribute names belong to
    /// the driver's domain. Capacities: `memory` (bytes), `multiprocessors` (count).
    pub fn device(&self) -> Device {
        let r = &self.raw;
        let mut attributes = BTreeMap::from([
            ("type".to_owned(), string("gpu")),
            ("uuid".to_owned(), string(&r.uuid)),
            ("productName".to_owned(), string(&r.name)),
            ("brand".to_owned(), string(&r.brand)),
            ("architecture".to_owned(), string(self.architecture())),
            (
                "cudaComputeCapability".to_owned(),
                version(self.compute_capability()),
            ),
            ("driverVersion".to_owned(), version(&self.driver_version)),
            (
                "cudaDriverVersion".to_owned(),
                version(&self.cuda_driver_version),
            ),
            ("index".to_owned(), int(r.index)),
            ("minor".to_owned(), int(r.minor)),
        ]);
        attributes.extend(self.location_attributes());
        if let Some(domain) = &self.nvlink_domain {
            attributes.insert("nvlinkDomain".to_owned(), string(domain));
        }
        if let Some(clique) = &self.nvlink_clique {
            attributes.insert("nvlinkClique".to_owned(), string(clique));
        }
        let mut capacities = BTreeMap::from([(
            "memory".to_owned(),
            // What CUDA can allocate, not the framebuffer's size (see `usable_memory_bytes`).
            capacity(bytes_quantity(r.usable_memory_bytes())),
        )]);
        // 0: the backend could not tell (see `NvmlBackend`'s multiprocessor count).
        if r.multiprocessor_count > 0 {
            capacities.insert("multiprocessors".to_owned(), count(r.multiprocessor_count));
        }
        Device {
            name: self.name.clone(),
            attributes: Some(attributes),
            capacity: Some(capacities),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvidia_driver_versions_become_valid_semver() {
        for (input, want) in [
            ("570.124.06", Some("570.124.6")),
            ("550.54.15", Some("550.54.15")),
            ("575.51", Some("575.51.0")),
            ("580", Some("580.0.0")),
            ("1.2.3.4", None),
            ("570.x.1", None),
            ("", None),
            ("-1.0.0", None),
        ] {
            assert_eq!(semver_from_dotted(input).as_deref(), want, "{input}");
        }
    }

    #[test]
    fn pci_bus_ids_take_the_standard_four_digit_domain_form() {
        for (input, want) in [
            ("00000000:18:00.0", Some("0000:18:00.0")),
            ("00000001:DB:00.0", Some("0001:db:00.0")),
            ("00010000:01:00.0", None),
            ("garbage", None),
        ] {
            assert_eq!(standard_pci_bus_id(input).as_deref(), want, "{input}");
        }
    }

    #[test]
    fn memory_quantities_are_canonical() {
        for (bytes, want) in [
            (85_520_809_984, "81559Mi"),
            (80 << 30, "80Gi"),
            (1024, "1Ki"),
            // Upstream writes a BinarySI value below 1024 in DecimalSI.
            (1000, "1k"),
            (1023, "1023"),
            (1536, "1536"),
            (0, "0"),
        ] {
            assert_eq!(bytes_quantity(bytes).0, want, "{bytes}");
        }
    }
}
