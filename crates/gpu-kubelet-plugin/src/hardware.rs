//! Hardware actions at prepare and unprepare, per device, behind [`Hardware`].
//!
//! For whole GPUs and existing MIG devices, preparing is checking: the GPU at the published index
//! still has the published UUID and minor (so the wrong GPU is never injected), an existing MIG
//! device still exists with the same instance ids, and every device node the container needs
//! exists.
//!
//! A partitionable MIG placement ([`NodeDevice::MigPlacement`]) is created at prepare: a GPU
//! instance of the placement's profile at its memory slices and a compute instance spanning it
//! ([`gpu_inventory::GpuBackend::create_mig_device`]). Prepare returns what it created
//! ([`CreatedMig`]); the claim controller records that in the checkpoint before anything else
//! happens, and unprepare destroys exactly the recorded device (an already destroyed one is
//! success). In partitionable mode the plugin owns every MIG device on the GPUs it publishes
//! placements for: at start, devices no prepared claim records are destroyed as orphans of a
//! crash between creation and the checkpoint write (the claim controller's recovery).
//!
//! MIG devices are reached through capability nodes: `/dev/nvidia-caps/nvidia-cap<m>` for the GPU
//! instance and for the compute instance, where `<m>` comes from the driver's table
//! `/proc/driver/nvidia-caps/mig-minors` (lines `gpu<minor>/gi<id>/access <m>` and
//! `gpu<minor>/gi<id>/ci<id>/access <m>`), as NVIDIA's container toolkit reads it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpu_inventory::backend::{ComputeMode, MigPlacement, RawMigDevice};
use gpu_inventory::{Gpu, GpuBackend, Inventory, MemoryLimits, MigDevice, MigStrategy};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::failpoint;

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
        /// Profile name, e.g. `1g.10gb`.
        profile: String,
        /// NVML GPU instance profile id.
        profile_id: u32,
        /// Memory slices it occupies.
        placement: MigPlacement,
    },
}

/// A MIG device that prepare created for a claim, as recorded in the checkpoint
/// (`devices[].mig`), so that unprepare and start-up recovery destroy exactly it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CreatedMig {
    /// UUID of the GPU it lives on.
    pub parent_uuid: String,
    /// `MIG-...`, what `nvidia-smi -L` shows and the CDI spec names.
    pub uuid: String,
    /// NVML GPU instance profile id.
    pub profile_id: u32,
    /// First memory slice.
    pub placement_start: u32,
    /// Memory slices.
    pub placement_size: u32,
    /// GPU instance id.
    pub gpu_instance_id: u32,
    /// Compute instance id within the GPU instance.
    pub compute_instance_id: u32,
}

impl CreatedMig {
    /// The record of `raw` on the GPU `parent_uuid`.
    pub fn new(parent_uuid: &str, raw: &RawMigDevice) -> Self {
        Self {
            parent_uuid: parent_uuid.to_owned(),
            uuid: raw.uuid.clone(),
            profile_id: raw.profile_id,
            placement_start: raw.placement.start,
            placement_size: raw.placement.size,
            gpu_instance_id: raw.gpu_instance_id,
            compute_instance_id: raw.compute_instance_id,
        }
    }
}

impl std::fmt::Display for CreatedMig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (GPU instance {}, compute instance {}, profile {}, memory slices {}..{})",
            self.uuid,
            self.gpu_instance_id,
            self.compute_instance_id,
            self.profile_id,
            self.placement_start,
            self.placement_start + self.placement_size
        )
    }
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
            Self::Gpu(g) => g.raw.usable_memory_bytes(),
            Self::Mig { mig, .. } => mig.memory_bytes,
            // The profile's memory (NVML counts it in MiB); the whole GPU if the profile is
            // unknown, which only makes the config check more lenient.
            Self::MigPlacement {
                parent, profile_id, ..
            } => parent
                .raw
                .mig_profiles
                .iter()
                .find(|p| p.id == *profile_id)
                .map_or(parent.raw.memory_total_bytes, |p| p.memory_size_mib << 20),
        }
    }

    /// What the CDI spec names the device by: the GPU or MIG UUID.
    pub fn visible_id(&self) -> &str {
        match self {
            Self::Mig { mig, .. } => mig.uuid.as_deref().unwrap_or_default(),
            other => &other.gpu().raw.uuid,
        }
    }
}

/// Every device `inventory` publishes under `strategy`, by name, and nothing else: whole GPUs,
/// existing MIG devices, and partitionable MIG placements, exactly the devices of
/// [`Inventory::pool`], so prepare refuses what is not published. On a GPU published as
/// partitionable, every MIG name is a placement, also where a MIG device exists now (it shares
/// the placement's name): the plugin creates and destroys the devices there.
pub fn node_devices(inventory: &Inventory, strategy: MigStrategy) -> BTreeMap<String, NodeDevice> {
    let gpus: BTreeMap<&str, &Gpu> = inventory
        .gpus
        .iter()
        .map(|g| (g.name.as_str(), g))
        .collect();
    let by_uuid: BTreeMap<&str, &Gpu> = inventory
        .gpus
        .iter()
        .map(|g| (g.raw.uuid.as_str(), g))
        .collect();
    let pool = inventory.pool(strategy);
    let partitioned: BTreeSet<&str> = pool.counter_sets.iter().map(|c| c.name.as_str()).collect();
    let existing: BTreeMap<&str, &gpu_inventory::MigDevice> = inventory
        .mig_devices
        .iter()
        .filter(|m| !partitioned.contains(m.parent.as_str()))
        .map(|m| (m.name.as_str(), m))
        .collect();
    let mut out = BTreeMap::new();
    for d in &pool.devices {
        let device = if let Some(g) = gpus.get(d.name.as_str()) {
            Some(NodeDevice::Gpu((*g).clone()))
        } else if let Some(m) = existing.get(d.name.as_str()) {
            gpus.get(m.parent.as_str()).map(|parent| NodeDevice::Mig {
                parent: (*parent).clone(),
                mig: (*m).clone(),
            })
        } else {
            d.attributes
                .as_ref()
                .and_then(|a| a.get("parentUUID"))
                .and_then(|a| a.string.as_deref())
                .and_then(|u| by_uuid.get(u))
                .and_then(|parent| {
                    gpu_inventory::mig::placements(parent)
                        .into_iter()
                        .find(|p| p.name == d.name)
                        .map(|p| NodeDevice::MigPlacement {
                            parent: (*parent).clone(),
                            name: d.name.clone(),
                            profile: p.profile,
                            profile_id: p.profile_id,
                            placement: p.placement,
                        })
                })
        };
        if let Some(device) = device {
            out.insert(d.name.clone(), device);
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
    /// A MIG placement's device nodes were asked for before its MIG device was created.
    #[error("device {device}: the MIG device of this placement has not been created")]
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
    /// Creating the MIG device of a placement failed; nothing was left behind.
    #[error(
        "device {device}: creating MIG device {profile} (profile id {profile_id}) at memory \
         slices {start}..{end} on GPU {parent}: {source}"
    )]
    CreateMig {
        /// The device name.
        device: String,
        /// Profile name.
        profile: String,
        /// NVML profile id.
        profile_id: u32,
        /// First memory slice.
        start: u32,
        /// One past the last memory slice.
        end: u32,
        /// The parent GPU's UUID.
        parent: String,
        /// The cause.
        source: gpu_inventory::BackendError,
    },
    /// Destroying a MIG device failed; it still exists.
    #[error("device {device}: destroying MIG device {mig} on GPU {parent}: {source}")]
    DestroyMig {
        /// The device name.
        device: String,
        /// The MIG device.
        mig: Box<CreatedMig>,
        /// The parent GPU's UUID.
        parent: String,
        /// The cause.
        source: gpu_inventory::BackendError,
    },
    /// A memory-limit record of the `kernel` level could not be read or removed
    /// (`memory_limits`).
    #[error("claim {claim}: memory-limit record {path}: {source}")]
    LimitRecord {
        /// The claim's UID.
        claim: String,
        /// The record or its directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
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
    /// paths inside the container; `created` is what [`Hardware::prepare`] created for it. The
    /// default is the GPU's `/dev/nvidia<minor>`.
    ///
    /// # Errors
    /// [`HardwareError`] when they cannot be determined.
    fn device_nodes(
        &self,
        device: &NodeDevice,
        created: Option<&CreatedMig>,
    ) -> Result<Vec<String>, HardwareError> {
        let _ = created;
        Ok(vec![gpu_device_node(device.gpu().raw.minor)])
    }
    /// Where the device node `node` (a path inside the container, e.g. `/dev/nvidia0`) is on
    /// the host, when that is not the same path: the CDI spec's `hostPath`, from which the
    /// runtime takes the node's type and numbers. The default is `None` (the same path).
    fn host_path(&self, node: &str) -> Option<String> {
        let _ = node;
        None
    }
    /// Readies `device` for a container; returns the MIG device it created, if any. On error
    /// nothing it created is left behind (a crash in between is for start-up recovery).
    ///
    /// # Errors
    /// [`HardwareError`] when the device is not what was published or cannot be readied.
    fn prepare(&self, device: &NodeDevice) -> Result<Option<CreatedMig>, HardwareError>;
    /// Undoes [`Hardware::prepare`], destroying `created` if given; must succeed when nothing
    /// was done or it was undone before.
    ///
    /// # Errors
    /// [`HardwareError`] when the undo fails.
    fn unprepare(
        &self,
        device: &NodeDevice,
        created: Option<&CreatedMig>,
    ) -> Result<(), HardwareError>;

    /// Whether [`Hardware::unprepare`] has anything to undo for `device`, prepared (with
    /// `created` if its prepare made a MIG device). When it says no for every device of a
    /// claim, unprepare skips the call. The default says yes.
    fn undo_needed(&self, device: &NodeDevice, created: Option<&CreatedMig>) -> bool {
        let _ = (device, created);
        true
    }

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

    /// The compute mode of `gpu` now. The default says [`ComputeMode::Default`].
    ///
    /// # Errors
    /// [`HardwareError`] when it cannot be read.
    fn compute_mode(&self, gpu: &Gpu) -> Result<ComputeMode, HardwareError> {
        let _ = gpu;
        Ok(ComputeMode::Default)
    }

    /// Sets the compute mode of `gpu`: [`ComputeMode::ExclusiveProcess`] while it hosts an MPS
    /// daemon, so no CUDA process can bypass MPS, [`ComputeMode::Default`] after.
    ///
    /// # Errors
    /// [`HardwareError::Setting`] when it cannot be set; by default, always.
    fn set_compute_mode(&self, gpu: &Gpu, mode: ComputeMode) -> Result<(), HardwareError> {
        let _ = mode;
        Err(HardwareError::Setting {
            device: gpu.name.clone(),
            action: "setting the compute mode",
            source: gpu_inventory::BackendError::Unsupported {
                call: "set_compute_mode",
                index: gpu.raw.index,
            },
        })
    }

    /// Sets (or with [`MemoryLimits::CLEARED`], clears) the memory limits on the GPU whose UUID
    /// is `gpu_uuid` of the cgroup directory `cgroup` (`memory_limits`).
    ///
    /// # Errors
    /// [`HardwareError::Setting`] when they cannot be set; by default, always.
    fn set_memory_limits(
        &self,
        gpu_uuid: &str,
        cgroup: &std::path::Path,
        limits: MemoryLimits,
    ) -> Result<(), HardwareError> {
        let _ = (cgroup, limits);
        Err(HardwareError::Setting {
            device: gpu_uuid.to_owned(),
            action: "setting a memory limit",
            source: gpu_inventory::BackendError::Unsupported {
                call: "set_memory_limits",
                index: u32::MAX,
            },
        })
    }

    /// The MIG devices on `gpu` now, for start-up reconciliation in partitionable mode. The
    /// default knows of none.
    ///
    /// # Errors
    /// [`HardwareError`] when the GPU cannot be queried.
    fn mig_devices(&self, gpu: &Gpu) -> Result<Vec<CreatedMig>, HardwareError> {
        let _ = gpu;
        Ok(Vec::new())
    }
    /// Destroys a MIG device on `gpu` that no claim owns (found by [`Hardware::mig_devices`]).
    ///
    /// # Errors
    /// [`HardwareError`] when it cannot be destroyed.
    fn destroy_mig(&self, gpu: &Gpu, mig: &CreatedMig) -> Result<(), HardwareError> {
        let _ = (gpu, mig);
        Ok(())
    }
}

/// Hardware actions through a [`GpuBackend`], with device nodes under `dev_root` and the
/// driver's tables under `proc_root`.
pub struct BackendHardware {
    backend: Arc<dyn GpuBackend>,
    dev_root: PathBuf,
    /// The same root as the container runtime on the host sees it, which CDI specs name.
    host_dev_root: PathBuf,
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
        let dev_root = dev_root.into();
        Self {
            backend,
            host_dev_root: dev_root.clone(),
            dev_root,
            proc_root: proc_root.into(),
        }
    }

    /// Where `dev_root` is on the host when this process sees it elsewhere (a container that
    /// mounts the host's `/dev` at `/host/dev`: `dev_root` `/host`, `host_dev_root` `/`). CDI
    /// specs name device nodes under `host_dev_root`, since the container runtime reads them
    /// on the host. Default: `dev_root`.
    #[must_use]
    pub fn with_host_dev_root(mut self, host_dev_root: impl Into<PathBuf>) -> Self {
        self.host_dev_root = host_dev_root.into();
        self
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

impl BackendHardware {
    /// The GPU as the backend sees it now, refusing another GPU at the published index.
    fn current(&self, device: &str, gpu: &Gpu) -> Result<gpu_inventory::GpuState, HardwareError> {
        let now = self
            .backend
            .gpu_state(gpu.raw.index)
            .map_err(|source| HardwareError::Query {
                device: device.to_owned(),
                source,
            })?;
        if now.uuid != gpu.raw.uuid || now.minor != gpu.raw.minor {
            return Err(HardwareError::WrongGpu {
                device: device.to_owned(),
                index: gpu.raw.index,
                published: gpu.raw.uuid.clone(),
                published_minor: gpu.raw.minor,
                found: now.uuid,
                found_minor: now.minor,
            });
        }
        Ok(now)
    }

    /// Creates the MIG device of a placement and checks its device nodes; destroys it again
    /// when they are missing.
    fn create(
        &self,
        device: &NodeDevice,
        profile: &str,
        profile_id: u32,
        placement: MigPlacement,
    ) -> Result<CreatedMig, HardwareError> {
        let gpu = device.gpu();
        failpoint::hit("prepare/before-mig-create");
        let raw = self
            .backend
            .create_mig_device(gpu.raw.index, profile_id, placement)
            .map_err(|source| HardwareError::CreateMig {
                device: device.name().to_owned(),
                profile: profile.to_owned(),
                profile_id,
                start: placement.start,
                end: placement.start + placement.size,
                parent: gpu.raw.uuid.clone(),
                source,
            })?;
        let created = CreatedMig::new(&gpu.raw.uuid, &raw);
        failpoint::hit("prepare/after-mig-create");
        let nodes = self.device_nodes(device, Some(&created)).and_then(|nodes| {
            nodes
                .iter()
                .map(String::as_str)
                .chain(CONTROL_DEVICE_NODES)
                .try_for_each(|n| self.check_node(device.name(), n))
        });
        if let Err(e) = nodes {
            if let Err(undo) = self.destroy(device.name(), gpu, &created) {
                warn!(device = device.name(), mig = %created, error = %undo,
                    "destroying a MIG device whose device nodes are missing failed; it is \
                     reclaimed at the next start");
            }
            return Err(e);
        }
        Ok(created)
    }

    /// Destroys `mig` if it still exists on `gpu` (matched by UUID, so a device created later
    /// with the same instance ids is never touched).
    fn destroy(&self, device: &str, gpu: &Gpu, mig: &CreatedMig) -> Result<(), HardwareError> {
        let now = self.current(device, gpu)?;
        let Some(m) = now.mig_devices.iter().find(|m| m.uuid == mig.uuid) else {
            return Ok(());
        };
        self.backend
            .destroy_mig_device(gpu.raw.index, m.gpu_instance_id, m.compute_instance_id)
            .map(|_| ())
            .map_err(|source| HardwareError::DestroyMig {
                device: device.to_owned(),
                mig: Box::new(mig.clone()),
                parent: gpu.raw.uuid.clone(),
                source,
            })
    }

    fn capability_nodes(
        &self,
        device: &str,
        minor: u32,
        gi: u32,
        ci: u32,
    ) -> Result<Vec<String>, HardwareError> {
        [
            format!("gpu{minor}/gi{gi}/access"),
            format!("gpu{minor}/gi{gi}/ci{ci}/access"),
        ]
        .iter()
        .map(|key| {
            self.mig_minor(device, key)
                .map(|m| format!("/dev/nvidia-caps/nvidia-cap{m}"))
        })
        .collect()
    }
}

impl Hardware for BackendHardware {
    /// Under a host device root other than `/` (a test host), the node's path below it.
    fn host_path(&self, node: &str) -> Option<String> {
        (self.host_dev_root != Path::new("/")).then(|| {
            self.host_dev_root
                .join(Path::new(node).strip_prefix("/").unwrap_or(Path::new(node)))
                .display()
                .to_string()
        })
    }
    fn device_nodes(
        &self,
        device: &NodeDevice,
        created: Option<&CreatedMig>,
    ) -> Result<Vec<String>, HardwareError> {
        let gpu = device.gpu();
        let minor = gpu.raw.minor;
        let mut nodes = vec![gpu_device_node(minor)];
        match device {
            NodeDevice::Gpu(_) => {}
            NodeDevice::MigPlacement { name, .. } => {
                let Some(c) = created else {
                    return Err(HardwareError::MigNotCreated {
                        device: name.clone(),
                    });
                };
                nodes.extend(self.capability_nodes(
                    name,
                    minor,
                    c.gpu_instance_id,
                    c.compute_instance_id,
                )?);
            }
            NodeDevice::Mig { mig, .. } => {
                let Some((gi, ci)) = mig.instance_ids else {
                    return Err(HardwareError::MigNotCreated {
                        device: mig.name.clone(),
                    });
                };
                nodes.extend(self.capability_nodes(&mig.name, minor, gi, ci)?);
            }
        }
        Ok(nodes)
    }

    fn prepare(&self, device: &NodeDevice) -> Result<Option<CreatedMig>, HardwareError> {
        let now = self.current(device.name(), device.gpu())?;
        if let NodeDevice::MigPlacement {
            profile,
            profile_id,
            placement,
            ..
        } = device
        {
            return self
                .create(device, profile, *profile_id, *placement)
                .map(Some);
        }
        let gpu = device.gpu();
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
        for node in self.device_nodes(device, None)? {
            self.check_node(device.name(), &node)?;
        }
        for node in CONTROL_DEVICE_NODES {
            self.check_node(device.name(), node)?;
        }
        Ok(None)
    }

    /// Only a MIG device made at prepare is undone; every other prepare only checks.
    fn undo_needed(&self, _device: &NodeDevice, created: Option<&CreatedMig>) -> bool {
        created.is_some()
    }

    fn unprepare(
        &self,
        device: &NodeDevice,
        created: Option<&CreatedMig>,
    ) -> Result<(), HardwareError> {
        let Some(mig) = created else { return Ok(()) };
        self.destroy(device.name(), device.gpu(), mig)?;
        failpoint::hit("unprepare/after-mig-destroy");
        Ok(())
    }

    fn mig_devices(&self, gpu: &Gpu) -> Result<Vec<CreatedMig>, HardwareError> {
        let now = self.current(&gpu.name, gpu)?;
        Ok(now
            .mig_devices
            .iter()
            .map(|m| CreatedMig::new(&gpu.raw.uuid, m))
            .collect())
    }

    fn destroy_mig(&self, gpu: &Gpu, mig: &CreatedMig) -> Result<(), HardwareError> {
        self.destroy(&gpu.name, gpu, mig)
    }

    fn compute_mode(&self, gpu: &Gpu) -> Result<ComputeMode, HardwareError> {
        self.current(&gpu.name, gpu)?;
        self.backend
            .compute_mode(gpu.raw.index)
            .map_err(|source| HardwareError::Query {
                device: gpu.name.clone(),
                source,
            })
    }

    fn set_compute_mode(&self, gpu: &Gpu, mode: ComputeMode) -> Result<(), HardwareError> {
        // Never another GPU's mode; a GPU that is gone has no mode left to restore.
        if let Err(e) = self.current(&gpu.name, gpu) {
            if mode == ComputeMode::Default {
                warn!(device = gpu.name, error = %e,
                    "the GPU is not where it was discovered; no compute mode to restore");
                return Ok(());
            }
            return Err(e);
        }
        self.backend
            .set_compute_mode(gpu.raw.index, mode)
            .map_err(|source| HardwareError::Setting {
                device: gpu.name.clone(),
                action: "setting the compute mode",
                source,
            })?;
        // A GPU-wide setting: say when it changes.
        info!(device = gpu.name, ?mode, "set the GPU's compute mode");
        Ok(())
    }

    fn set_memory_limits(
        &self,
        gpu_uuid: &str,
        cgroup: &std::path::Path,
        limits: MemoryLimits,
    ) -> Result<(), HardwareError> {
        let setting = |source| HardwareError::Setting {
            device: gpu_uuid.to_owned(),
            action: "setting a memory limit",
            source,
        };
        let index = self.backend.index_of(gpu_uuid).map_err(setting)?;
        self.backend
            .set_memory_limits(index, cgroup, limits)
            .map_err(setting)
    }

    fn set_time_slice(&self, device: &NodeDevice, slice: TimeSlice) -> Result<(), HardwareError> {
        // The index is where the GPU was at discovery; never set another GPU's slice. A GPU
        // that is gone has no slice left to reset, and its claim's unprepare must not wedge.
        if let Err(e) = self.current(device.name(), device.gpu()) {
            if slice == TimeSlice::Default {
                warn!(device = device.name(), error = %e,
                    "the GPU is not where it was discovered; no time slice to reset");
                return Ok(());
            }
            return Err(e);
        }
        self.backend
            .set_compute_time_slice(device.gpu().raw.index, slice.nvidia_smi_value())
            .map_err(|source| HardwareError::Setting {
                device: device.name().to_owned(),
                action: "setting the compute time slice",
                source,
            })?;
        // A GPU-wide setting other workloads feel: say when it changes.
        info!(
            device = device.name(),
            ?slice,
            "set the GPU's compute time slice"
        );
        Ok(())
    }
}
