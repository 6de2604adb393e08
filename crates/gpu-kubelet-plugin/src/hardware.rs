//! Hardware actions at prepare and unprepare, per device, behind [`Hardware`].
//!
//! For whole GPUs and existing MIG devices, preparing is checking: the GPU at the published index
//! still has the published UUID and minor (so the wrong GPU is never injected), an existing MIG
//! device still exists with the same instance ids, and every device node the container needs
//! exists. Later issues add real actions here (creating MIG instances, sharing).
//!
//! MIG devices are reached through capability nodes: `/dev/nvidia-caps/nvidia-cap<m>` for the GPU
//! instance and for the compute instance, where `<m>` comes from the driver's table
//! `/proc/driver/nvidia-caps/mig-minors` (lines `gpu<minor>/gi<id>/access <m>` and
//! `gpu<minor>/gi<id>/ci<id>/access <m>`), as NVIDIA's container toolkit reads it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpu_inventory::{Gpu, GpuBackend, Inventory, MigDevice, MigStrategy};

use crate::claim_config::TimeSlice;

/// A device of this node that a claim can be allocated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeDevice {
    /// A whole GPU.
    Gpu(Gpu),
    /// A MIG device that exists on the GPU.
    Mig {
        /// The GPU it lives on.
        parent: Gpu,
        /// The MIG device.
        mig: MigDevice,
    },
    /// A MIG placement published in partitionable mode, to be created at prepare.
    MigPlacement {
        /// The GPU it would live on.
        parent: Gpu,
        /// Its device name.
        name: String,
    },
}

impl NodeDevice {
    /// The device name in the pool.
    pub fn name(&self) -> &str {
        match self {
            Self::Gpu(g) => &g.name,
            Self::Mig { mig, .. } => &mig.name,
            Self::MigPlacement { name, .. } => name,
        }
    }

    /// The physical GPU.
    pub fn gpu(&self) -> &Gpu {
        match self {
            Self::Gpu(g) | Self::Mig { parent: g, .. } | Self::MigPlacement { parent: g, .. } => g,
        }
    }

    /// Whether a container gets a MIG device (existing or to be created) rather than a whole GPU.
    pub fn is_mig(&self) -> bool {
        !matches!(self, Self::Gpu(_))
    }

    /// Device memory in bytes: the GPU's, or the MIG device's.
    pub fn memory_bytes(&self) -> u64 {
        match self {
            Self::Mig { mig, .. } => mig.memory_bytes,
            other => other.gpu().raw.memory_total_bytes,
        }
    }

    /// What `NVIDIA_VISIBLE_DEVICES` names: the GPU or MIG UUID.
    pub fn visible_id(&self) -> &str {
        match self {
            Self::Mig { mig, .. } => mig.uuid.as_deref().unwrap_or_default(),
            other => &other.gpu().raw.uuid,
        }
    }
}

/// Every device `inventory` publishes under `strategy`, by name: whole GPUs, existing MIG devices,
/// and partitionable MIG placements.
pub fn node_devices(inventory: &Inventory, strategy: MigStrategy) -> BTreeMap<String, NodeDevice> {
    let by_name: BTreeMap<&str, &Gpu> = inventory
        .gpus
        .iter()
        .map(|g| (g.name.as_str(), g))
        .collect();
    let by_uuid: BTreeMap<&str, &Gpu> = inventory
        .gpus
        .iter()
        .map(|g| (g.raw.uuid.as_str(), g))
        .collect();
    let mut out = BTreeMap::new();
    for g in &inventory.gpus {
        out.insert(g.name.clone(), NodeDevice::Gpu(g.clone()));
    }
    for m in &inventory.mig_devices {
        if let Some(parent) = by_name.get(m.parent.as_str()) {
            out.insert(
                m.name.clone(),
                NodeDevice::Mig {
                    parent: (*parent).clone(),
                    mig: m.clone(),
                },
            );
        }
    }
    for d in inventory.pool(strategy).devices {
        if out.contains_key(&d.name) {
            continue;
        }
        let parent = d
            .attributes
            .as_ref()
            .and_then(|a| a.get("parentUUID"))
            .and_then(|a| a.string.as_deref())
            .and_then(|u| by_uuid.get(u));
        if let Some(parent) = parent {
            out.insert(
                d.name.clone(),
                NodeDevice::MigPlacement {
                    parent: (*parent).clone(),
                    name: d.name.clone(),
                },
            );
        }
    }
    out
}

/// The device nodes every GPU container needs besides its `/dev/nvidia<minor>`.
pub const CONTROL_DEVICE_NODES: [&str; 3] =
    ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"];

/// `/dev/nvidia<minor>`.
pub fn gpu_device_node(minor: u32) -> String {
    format!("/dev/nvidia{minor}")
}

/// A hardware action failed.
#[derive(Debug, thiserror::Error)]
pub enum HardwareError {
    /// The GPU could not be queried.
    #[error("device {device}: querying the GPU: {source}")]
    Query {
        /// The device name.
        device: String,
        /// The cause.
        source: gpu_inventory::BackendError,
    },
    /// The GPU now at the published index is not the published one.
    #[error(
        "device {device}: published as {published} (minor {published_minor}) but the GPU at \
         index {index} is {found} (minor {found_minor}); refusing to inject the wrong GPU"
    )]
    WrongGpu {
        /// The device name.
        device: String,
        /// NVML index.
        index: u32,
        /// Published UUID.
        published: String,
        /// Published minor.
        published_minor: u32,
        /// UUID found now.
        found: String,
        /// Minor found now.
        found_minor: u32,
    },
    /// A device node the container needs does not exist.
    #[error("device {device}: device node {path} does not exist (looked under {dev_root})")]
    MissingDeviceNode {
        /// The device name.
        device: String,
        /// The node, as the container sees it.
        path: String,
        /// The device root it was looked up under.
        dev_root: PathBuf,
    },
    /// The MIG device is gone or changed since it was published.
    #[error(
        "device {device}: MIG device {uuid} no longer exists on GPU {parent} with the published instance ids"
    )]
    MigGone {
        /// The device name.
        device: String,
        /// The MIG UUID.
        uuid: String,
        /// The parent GPU's UUID.
        parent: String,
    },
    /// The driver's MIG capability table lacks the instance.
    #[error("device {device}: no capability minor for {key} in {table}")]
    MigCapability {
        /// The device name.
        device: String,
        /// The `gpu<m>/gi<i>[/ci<c>]/access` key.
        key: String,
        /// The table read.
        table: PathBuf,
    },
    /// The device is a MIG placement that prepare would have to create.
    #[error(
        "device {device}: creating MIG instances at prepare (partitionable mode) is not supported \
         by this version; use existing MIG devices"
    )]
    MigNotCreated {
        /// The device name.
        device: String,
    },
    /// A GPU setting (sharing) could not be applied or undone.
    #[error("device {device}: {action}: {source}")]
    Setting {
        /// The device name.
        device: String,
        /// What was being set.
        action: &'static str,
        /// The cause.
        source: gpu_inventory::BackendError,
    },
    /// A fault injected by a test.
    #[error("device {device}: {message}")]
    Injected {
        /// The device name.
        device: String,
        /// What the test said.
        message: String,
    },
}

/// What prepare and unprepare do to a device. `prepare`/`unprepare` block (NVML is
/// synchronous); callers run them on blocking threads, one at a time per physical GPU.
pub trait Hardware: Send + Sync + 'static {
    /// The device nodes (besides [`CONTROL_DEVICE_NODES`]) a container needs for `device`, as
    /// paths inside the container. The default is the GPU's `/dev/nvidia<minor>`.
    ///
    /// # Errors
    /// [`HardwareError`] when they cannot be determined.
    fn device_nodes(&self, device: &NodeDevice) -> Result<Vec<String>, HardwareError> {
        Ok(vec![gpu_device_node(device.gpu().raw.minor)])
    }
    /// Readies `device` for a container.
    ///
    /// # Errors
    /// [`HardwareError`] when the device is not what was published or cannot be readied.
    fn prepare(&self, device: &NodeDevice) -> Result<(), HardwareError>;
    /// Undoes [`Hardware::prepare`]; must succeed when nothing was done.
    ///
    /// # Errors
    /// [`HardwareError`] when the undo fails.
    fn unprepare(&self, device: &NodeDevice) -> Result<(), HardwareError>;

    /// Sets the compute time slice of `device`'s GPU (time-slicing; undone with
    /// [`TimeSlice::Default`]).
    ///
    /// # Errors
    /// [`HardwareError::Setting`] when it cannot be set; by default, always.
    fn set_time_slice(&self, device: &NodeDevice, slice: TimeSlice) -> Result<(), HardwareError> {
        let _ = slice;
        Err(HardwareError::Setting {
            device: device.name().to_owned(),
            action: "setting the compute time slice",
            source: gpu_inventory::BackendError::Unsupported {
                call: "set_compute_time_slice",
                index: device.gpu().raw.index,
            },
        })
    }
}

/// Hardware actions through a [`GpuBackend`], with device nodes under `dev_root` and the
/// driver's tables under `proc_root`.
pub struct BackendHardware {
    backend: Arc<dyn GpuBackend>,
    dev_root: PathBuf,
    proc_root: PathBuf,
}

impl BackendHardware {
    /// Checks against `backend`; device nodes are looked up under `dev_root` (`/` on a node,
    /// the host's root mount in a container, a temp dir in tests) and the MIG capability table
    /// under `proc_root` (`/proc`).
    pub fn new(
        backend: Arc<dyn GpuBackend>,
        dev_root: impl Into<PathBuf>,
        proc_root: impl Into<PathBuf>,
    ) -> Self {
        Self {
            backend,
            dev_root: dev_root.into(),
            proc_root: proc_root.into(),
        }
    }

    fn mig_minor(&self, device: &str, key: &str) -> Result<u32, HardwareError> {
        let table = self.proc_root.join("driver/nvidia-caps/mig-minors");
        let missing = || HardwareError::MigCapability {
            device: device.to_owned(),
            key: key.to_owned(),
            table: table.clone(),
        };
        let text = std::fs::read_to_string(&table).map_err(|_| missing())?;
        text.lines()
            .filter_map(|l| l.split_once(' '))
            .find(|(k, _)| *k == key)
            .and_then(|(_, m)| m.trim().parse().ok())
            .ok_or_else(missing)
    }

    fn check_node(&self, device: &str, node: &str) -> Result<(), HardwareError> {
        let on_host = self
            .dev_root
            .join(Path::new(node).strip_prefix("/").unwrap_or(Path::new(node)));
        if on_host.exists() {
            Ok(())
        } else {
            Err(HardwareError::MissingDeviceNode {
                device: device.to_owned(),
                path: node.to_owned(),
                dev_root: self.dev_root.clone(),
            })
        }
    }
}

impl Hardware for BackendHardware {
    fn device_nodes(&self, device: &NodeDevice) -> Result<Vec<String>, HardwareError> {
        let gpu = device.gpu();
        let mut nodes = vec![gpu_device_node(gpu.raw.minor)];
        match device {
            NodeDevice::Gpu(_) => {}
            NodeDevice::MigPlacement { name, .. } => {
                return Err(HardwareError::MigNotCreated {
                    device: name.clone(),
                });
            }
            NodeDevice::Mig { mig, .. } => {
                let Some((gi, ci)) = mig.instance_ids else {
                    return Err(HardwareError::MigNotCreated {
                        device: mig.name.clone(),
                    });
                };
                let minor = gpu.raw.minor;
                for key in [
                    format!("gpu{minor}/gi{gi}/access"),
                    format!("gpu{minor}/gi{gi}/ci{ci}/access"),
                ] {
                    let m = self.mig_minor(&mig.name, &key)?;
                    nodes.push(format!("/dev/nvidia-caps/nvidia-cap{m}"));
                }
            }
        }
        Ok(nodes)
    }

    fn prepare(&self, device: &NodeDevice) -> Result<(), HardwareError> {
        let gpu = device.gpu();
        let now = self
            .backend
            .gpu(gpu.raw.index)
            .map_err(|source| HardwareError::Query {
                device: device.name().to_owned(),
                source,
            })?;
        if now.uuid != gpu.raw.uuid || now.minor != gpu.raw.minor {
            return Err(HardwareError::WrongGpu {
                device: device.name().to_owned(),
                index: gpu.raw.index,
                published: gpu.raw.uuid.clone(),
                published_minor: gpu.raw.minor,
                found: now.uuid,
                found_minor: now.minor,
            });
        }
        if let NodeDevice::Mig { mig, .. } = device {
            let uuid = mig.uuid.clone().unwrap_or_default();
            let still_there = now.mig_devices.iter().any(|m| {
                m.uuid == uuid
                    && Some((m.gpu_instance_id, m.compute_instance_id)) == mig.instance_ids
            });
            if !still_there {
                return Err(HardwareError::MigGone {
                    device: mig.name.clone(),
                    uuid,
                    parent: gpu.raw.uuid.clone(),
                });
            }
        }
        for node in self.device_nodes(device)? {
            self.check_node(device.name(), &node)?;
        }
        for node in CONTROL_DEVICE_NODES {
            self.check_node(device.name(), node)?;
        }
        Ok(())
    }

    fn unprepare(&self, _device: &NodeDevice) -> Result<(), HardwareError> {
        Ok(())
    }

    fn set_time_slice(&self, device: &NodeDevice, slice: TimeSlice) -> Result<(), HardwareError> {
        self.backend
            .set_compute_time_slice(device.gpu().raw.index, slice.nvidia_smi_value())
            .map_err(|source| HardwareError::Setting {
                device: device.name().to_owned(),
                action: "setting the compute time slice",
                source,
            })
    }
}
