//! The GPU driver's side of the claim lifecycle ([`dra_plugin::lifecycle`], which owns the
//! records, locks, deadlines, rollback and CDI files): planning a claim's GPUs, the hardware
//! step, sharing, and start-up recovery.
//!
//! Dynamic MIG (partitionable mode): the hardware step creates the MIG device of each allocated
//! placement; what it created is written to the checkpoint (`devices[].mig`) before the CDI
//! spec, which is computed only then (the new device's capability nodes and UUID). A failure
//! destroys what the record lists; unprepare destroys exactly that. A crash between creation and
//! that write leaves a MIG device no record owns: in partitionable mode the plugin owns every
//! MIG device on the GPUs it publishes placements for, and start-up recovery destroys those no
//! prepared claim records, logging each.
//!
//! A crash anywhere leaves a record saying what may exist; [`ClaimController::start`] finishes
//! or rolls back every record that is not `PrepareCompleted`, regenerates missing CDI specs of
//! completed claims, removes CDI specs no record claims, and drops claims of a previous boot
//! (the kubelet prepares them again). A damaged checkpoint is set aside and rebuilt from the CDI
//! specs on disk and the API server, with a Warning event; it never stops the plugin.
//!
//! Concurrency: besides the lifecycle's claim locks, hardware actions on one physical GPU never
//! overlap (one lock per GPU, taken in name order, so two claims never deadlock); they run on
//! blocking threads holding it.

mod cluster;
mod driver;
mod error;
mod exclusive;
mod plan;
mod recovery;
mod sharing;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use dra_kubelet::{ClaimRef, Driver, PrepareResult, UnprepareResult};
use tokio::sync::Mutex;

pub use crate::config::DEFAULT_API_TIMEOUT;
pub use cluster::{Cluster, KubeCluster};
pub use error::ClaimError;
pub use plan::{DEVICE_ENV_PREFIX, device_env};
pub use recovery::RecoveryReport;
use sharing::shares;

use crate::cdi::CdiWriter;
use crate::checkpoint::{Checkpoint, CheckpointFile, ClaimRecord, RecordedDevice};
use crate::hardware::{Hardware, NodeDevice};
use crate::mps::MpsControl;
use dra_plugin::lifecycle::{Error as LifecycleError, Lifecycle, Settings};

/// A hardware action on one device, run on a blocking thread.
type DeviceAction<H, T> =
    Arc<dyn Fn(&H, &NodeDevice) -> Result<T, crate::hardware::HardwareError> + Send + Sync>;

pub use crate::config::DEFAULT_TIMEOUT;

/// The controller's fixed settings.
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// DRA driver name.
    pub driver_name: String,
    /// This node's name, also the pool name.
    pub node_name: String,
    /// Deadline of one claim's prepare or unprepare.
    pub timeout: Duration,
    /// This boot's ID (`/proc/sys/kernel/random/boot_id`).
    pub boot_id: String,
    /// Whether claims may configure sharing (`--sharing`).
    pub sharing: bool,
    /// How per-claim MPS daemons run.
    pub mps: MpsControl,
    /// Spec-level CDI edits every claim gets: the driver's files and hooks
    /// ([`crate::driver_files::DriverFiles::container_edits`]); empty for none.
    pub driver_edits: crate::cdi::ContainerEdits,
    /// The `kernel` enforcement level's memory limits, where the node has it
    /// ([`crate::memory_limits::KernelMemory::detect`]); `None`: the `mps` level.
    pub kernel_memory: Option<Arc<crate::memory_limits::KernelMemory>>,
    /// The hook recording the pods of claims reserved for no pod
    /// ([`crate::claim_users::ClaimUsers`]); `None` when it could not be installed.
    pub claim_users: Option<Arc<crate::claim_users::ClaimUsers>>,
    /// Where device metadata files (KEP-5304) are written; `None`: none are
    /// ([`crate::device_metadata`]).
    pub device_metadata: Option<Arc<crate::device_metadata::DeviceMetadata>>,
    /// The IMEX channels this node publishes ([`gpu_inventory::imex`]); `None`: none, and a
    /// claim for one is refused.
    pub imex: Option<gpu_inventory::imex::ImexChannels>,
}

/// Prepares and unprepares claims for one driver on one node: the lifecycle
/// ([`dra_plugin::lifecycle::Lifecycle`]) over the GPU driver. Cheap to clone.
pub struct ClaimController<C: Cluster, H: Hardware> {
    lifecycle: Lifecycle<Gpu<C, H>>,
}

impl<C: Cluster, H: Hardware> Clone for ClaimController<C, H> {
    fn clone(&self) -> Self {
        Self {
            lifecycle: self.lifecycle.clone(),
        }
    }
}

/// The devices claims are prepared on, as of the newest inventory
/// ([`ClaimController::set_devices`]).
#[derive(Debug, Default)]
pub(crate) struct Catalogue {
    /// Published now: new claims may be prepared on these.
    pub(crate) devices: BTreeMap<String, NodeDevice>,
    /// Published once, gone at a later re-discovery (a GPU fallen off the bus, a MIG device
    /// re-partitioned away). Refused for new claims, kept so that the claims prepared on them
    /// are unprepared as they were made. Device names derive from hardware positions (PCI bus
    /// ID, MIG profile and placement), so this set stays bounded.
    pub(crate) retired: BTreeMap<String, NodeDevice>,
}

impl Catalogue {
    /// The device named `name`, published or retired.
    pub(crate) fn get(&self, name: &str) -> Option<&NodeDevice> {
        self.devices.get(name).or_else(|| self.retired.get(name))
    }
}

/// The GPU driver ([`dra_plugin::lifecycle::Driver`]): its state besides the lifecycle's.
pub(crate) struct Gpu<C, H> {
    cluster: C,
    hardware: Arc<H>,
    config: ControllerConfig,
    /// Swapped whole by [`ClaimController::set_devices`]; a prepare works on the snapshot it
    /// planned with.
    catalogue: std::sync::RwLock<Arc<Catalogue>>,
    /// One lock per physical GPU: hardware actions on a GPU never overlap. GPUs are added as
    /// they appear and never removed (a lock may be held across a re-discovery).
    gpu_locks: std::sync::Mutex<BTreeMap<String, Arc<Mutex<()>>>>,
    /// Claims rebuilt from their CDI spec alone (the API server did not answer at start), by
    /// UID: their records are settled by the next stale-claim check that reaches it.
    unverified: std::sync::Mutex<BTreeSet<String>>,
}

impl<C, H> Gpu<C, H> {
    /// The current catalogue.
    fn catalogue(&self) -> Arc<Catalogue> {
        Arc::clone(
            &self
                .catalogue
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

/// A poisoned lock only means a panicking thread held it; the bookkeeping is still consistent
/// because every critical section is panic-free.
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl<C: Cluster, H: Hardware> ClaimController<C, H> {
    /// Starts the controller for `devices` (see [`crate::hardware::node_devices`]): loads the checkpoint and reconciles it
    /// with the CDI specs on disk, the hardware and, if the checkpoint is damaged, the API server.
    ///
    /// # Errors
    /// [`ClaimError`] only when the reconciled state cannot be written back; a damaged or
    /// unreadable checkpoint is recovered, not an error.
    pub async fn start(
        cluster: C,
        hardware: Arc<H>,
        config: ControllerConfig,
        devices: impl IntoIterator<Item = NodeDevice>,
        cdi: CdiWriter,
        checkpoint_file: CheckpointFile,
    ) -> Result<(Self, RecoveryReport), ClaimError> {
        let settings = Settings {
            timeout: config.timeout,
            node_name: config.node_name.clone(),
            boot_id: config.boot_id.clone(),
        };
        let gpu = Gpu {
            cluster,
            hardware,
            config,
            catalogue: std::sync::RwLock::default(),
            gpu_locks: std::sync::Mutex::default(),
            unverified: std::sync::Mutex::default(),
        };
        let controller = Self {
            lifecycle: Lifecycle::new(gpu, checkpoint_file, cdi, settings),
        };
        controller.set_devices(devices);
        let report = controller.recover().await?;
        Ok((controller, report))
    }

    /// Follows a new inventory: from now on claims are prepared on `devices` (see
    /// [`crate::hardware::node_devices`]) and nothing else. A device no longer among them is
    /// refused for new claims ([`ClaimError::DeviceGone`]); claims already prepared on it stay
    /// prepared and are unprepared as usual. Call before publishing the inventory, so that the
    /// scheduler never sees a device that prepare would refuse. Returns the names added and
    /// removed.
    pub fn set_devices(
        &self,
        devices: impl IntoIterator<Item = NodeDevice>,
    ) -> (Vec<String>, Vec<String>) {
        let devices: BTreeMap<String, NodeDevice> = devices
            .into_iter()
            .map(|d| (d.name().to_owned(), d))
            .collect();
        {
            let mut locks = lock(&self.gpu().gpu_locks);
            for d in devices.values() {
                locks.entry(d.gpu().name.clone()).or_default();
            }
        }
        let mut current = self
            .gpu()
            .catalogue
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let added: Vec<String> = devices
            .keys()
            .filter(|n| !current.devices.contains_key(*n))
            .cloned()
            .collect();
        let removed: Vec<String> = current
            .devices
            .keys()
            .filter(|n| !devices.contains_key(*n))
            .cloned()
            .collect();
        if added.is_empty() && removed.is_empty() && current.devices == devices {
            return (added, removed);
        }
        let mut retired = current.retired.clone();
        retired.extend(
            current
                .devices
                .iter()
                .filter(|(n, _)| !devices.contains_key(*n))
                .map(|(n, d)| (n.clone(), d.clone())),
        );
        retired.retain(|n, _| !devices.contains_key(n));
        *current = Arc::new(Catalogue { devices, retired });
        (added, removed)
    }

    /// The current catalogue.
    fn catalogue(&self) -> Arc<Catalogue> {
        self.gpu().catalogue()
    }

    /// The lock of physical GPU `gpu`.
    fn gpu_lock(&self, gpu: &str) -> Arc<Mutex<()>> {
        Arc::clone(
            lock(&self.gpu().gpu_locks)
                .entry(gpu.to_owned())
                .or_default(),
        )
    }

    /// How many claims' start-up recovery is failing (retried in the background), as it
    /// changes.
    pub fn recovery_failures(&self) -> tokio::sync::watch::Receiver<usize> {
        self.lifecycle.recovery_failures()
    }

    /// The UIDs of the claims whose prepare completed.
    pub async fn prepared_claims(&self) -> Vec<String> {
        self.lifecycle.prepared_claims().await
    }

    /// `(claims, devices)`: how many claims are prepared and how many devices they hold.
    pub async fn prepared_summary(&self) -> (usize, usize) {
        self.lifecycle.prepared_summary().await
    }

    /// Waits until no work started by this controller is still running: calls must have
    /// returned already; this stops the recovery retries and waits for the rollbacks and
    /// unprepares they left running in the background ([`Lifecycle::quiesce`]). Call before
    /// handing the node's state to another instance.
    pub async fn quiesce(&self) {
        self.lifecycle.quiesce().await;
    }

    /// What the usage sampler (`usage`) joins: every device by name, published or
    /// retired, and the prepared claims without their CDI specs (the sampler has no use for
    /// them, and copying them under the journal's lock would hold prepares back).
    pub async fn usage_view(&self) -> (BTreeMap<String, NodeDevice>, Vec<(String, ClaimRecord)>) {
        let catalogue = self.catalogue();
        let devices = catalogue
            .retired
            .iter()
            .chain(&catalogue.devices)
            .map(|(n, d)| (n.clone(), d.clone()))
            .collect();
        let claims = self
            .lifecycle
            .records()
            .await
            .claims
            .iter()
            .filter(|(_, r)| r.state == crate::checkpoint::ClaimState::PrepareCompleted)
            .map(|(uid, r)| {
                let record = ClaimRecord {
                    namespace: r.namespace.clone(),
                    name: r.name.clone(),
                    state: r.state,
                    devices: r.devices.clone(),
                    cdi_spec_path: std::path::PathBuf::new(),
                    cdi_spec: Default::default(),
                };
                (uid.clone(), record)
            })
            .collect();
        (devices, claims)
    }

    /// The API server, as the controller reads it.
    pub fn cluster(&self) -> &C {
        &self.gpu().cluster
    }

    /// The GPU driver's state.
    fn gpu(&self) -> &Gpu<C, H> {
        self.lifecycle.driver()
    }

    /// The controller of `lifecycle` (what the lifecycle hands to the driver's methods).
    fn of(lifecycle: &Lifecycle<Gpu<C, H>>) -> Self {
        Self {
            lifecycle: lifecycle.clone(),
        }
    }

    /// The devices of `names`, grouped by physical GPU in GPU-name order (the lock order).
    fn by_gpu<'a>(
        &self,
        names: impl IntoIterator<Item = &'a str>,
    ) -> Vec<(String, Vec<NodeDevice>)> {
        let mut groups: BTreeMap<String, Vec<NodeDevice>> = BTreeMap::new();
        let catalogue = self.catalogue();
        for n in names {
            if let Some(d) = catalogue.get(n) {
                let group = groups.entry(d.gpu().name.clone()).or_default();
                if !group.iter().any(|g| g.name() == d.name()) {
                    group.push(d.clone());
                }
            }
        }
        groups.into_iter().collect()
    }

    /// Runs `action` for every device in `names` on one blocking thread: GPU by GPU in name
    /// order (so two claims never deadlock), holding each GPU's lock while its devices' actions
    /// run. Stops at the first failure. Returns what each device's action gave, for the devices
    /// that succeeded, with the outcome, so a caller can record what was made even when a later
    /// device failed.
    async fn on_devices<'a, T: Send + 'static>(
        &self,
        claim: &ClaimRef,
        names: impl IntoIterator<Item = &'a str>,
        action: DeviceAction<H, T>,
    ) -> (Vec<(String, T)>, Result<(), ClaimError>) {
        let groups: Vec<(Arc<Mutex<()>>, String, Vec<NodeDevice>)> = self
            .by_gpu(names)
            .into_iter()
            .map(|(gpu, devices)| (self.gpu_lock(&gpu), gpu, devices))
            .collect();
        if groups.is_empty() {
            return (Vec::new(), Ok(()));
        }
        enum Failed {
            Hardware(crate::hardware::HardwareError),
            Panic(String),
        }
        let hw = Arc::clone(&self.gpu().hardware);
        // Tracked: the actions run on even if the caller stops waiting. One thread for the
        // claim's GPUs: a hop per GPU would cost more than the checks themselves.
        let result = self
            .lifecycle
            .background()
            .spawn_blocking(move || {
                let mut ok = Vec::new();
                for (lock, gpu, devices) in groups {
                    let _guard = lock.blocking_lock_owned();
                    for d in &devices {
                        // A panicking action fails the claim like an error, keeping what the
                        // devices before it made, so the rollback undoes that too.
                        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            action(&hw, d)
                        }));
                        match r {
                            Ok(Ok(t)) => ok.push((d.name().to_owned(), t)),
                            Ok(Err(e)) => return (ok, Err(Failed::Hardware(e))),
                            Err(_) => return (ok, Err(Failed::Panic(gpu))),
                        }
                    }
                }
                (ok, Ok(()))
            })
            .await;
        match result {
            Ok((done, Ok(()))) => (done, Ok(())),
            Ok((done, Err(Failed::Hardware(source)))) => (
                done,
                Err(ClaimError::Hardware {
                    claim: claim.clone(),
                    source,
                }),
            ),
            Ok((done, Err(Failed::Panic(gpu)))) => (
                done,
                Err(ClaimError::Lifecycle(LifecycleError::TaskFailed {
                    claim: claim.clone(),
                    action: "hardware action",
                    message: format!("GPU {gpu}: the action panicked"),
                })),
            ),
            // The thread itself failed (cannot happen short of a runtime shutdown).
            Err(e) => (
                Vec::new(),
                Err(ClaimError::Lifecycle(LifecycleError::TaskFailed {
                    claim: claim.clone(),
                    action: "hardware action",
                    message: e.to_string(),
                })),
            ),
        }
    }

    /// Undoes the hardware step for `record`'s devices, destroying the MIG devices it lists.
    async fn unprepare_hardware(
        &self,
        claim: &ClaimRef,
        record: &ClaimRecord,
    ) -> Result<(), ClaimError> {
        let created = plan::created_migs(&record.devices);
        let undo: DeviceAction<H, ()> =
            Arc::new(move |hw: &H, d: &NodeDevice| hw.unprepare(d, created.get(d.name())));
        self.on_devices(
            claim,
            record.devices.iter().map(|d| d.device_name.as_str()),
            undo,
        )
        .await
        .1
    }

    fn plan_context(&self) -> plan::PlanContext<'_> {
        let gpu = self.gpu();
        plan::PlanContext {
            driver: &gpu.config.driver_name,
            pool: &gpu.config.node_name,
            catalogue: self.catalogue(),
            hardware: gpu.hardware.as_ref(),
            cdi: self.lifecycle.cdi(),
            sharing: gpu.config.sharing,
            mps: &gpu.config.mps,
            kernel_memory: gpu.config.kernel_memory.as_deref(),
            claim_users: gpu.config.claim_users.as_deref(),
            device_metadata: gpu.config.device_metadata.as_deref(),
            driver_edits: &gpu.config.driver_edits,
            imex: gpu.config.imex,
        }
    }

    /// The claim-user hook's records, where it is installed ([`crate::claim_users`]).
    pub fn claim_users(&self) -> Option<Arc<crate::claim_users::ClaimUsers>> {
        self.gpu().config.claim_users.clone()
    }

    /// Unprepares completed claims that no longer exist in the API server or whose UID
    /// changed ([`Lifecycle::unprepare_stale`]); claims rebuilt from their CDI spec alone are
    /// settled on the way. Returns the UIDs unprepared.
    pub async fn unprepare_stale(&self) -> Vec<String> {
        self.lifecycle.unprepare_stale().await
    }
}

/// Refuses a device held by another claim unless one of the two allocations has admin access
/// (admin access does not count against exclusivity; KEP-5018) or both are shares of it
/// (consumable capacity, KEP-5075: the scheduler accounts for what each share consumes).
fn check_conflicts(
    c: &Checkpoint,
    claim: &ClaimRef,
    devices: &[RecordedDevice],
) -> Result<(), ClaimError> {
    for (index, d) in devices.iter().enumerate() {
        // An IMEX channel allows multiple allocations: every claim of the node's
        // ComputeDomain holds it.
        if d.admin_access || d.imex_channel.is_some() {
            continue;
        }
        let shared = d.share.is_some();
        let holder = c.claims.iter().find(|(uid, r)| {
            *uid != &claim.uid
                && r.devices.iter().any(|o| {
                    o.device_name == d.device_name
                        && o.pool_name == d.pool_name
                        && !o.admin_access
                        && !(shared && o.share.is_some())
                })
        });
        if let Some((uid, r)) = holder {
            return Err(ClaimError::DeviceInUse {
                claim: claim.clone(),
                index,
                device: d.device_name.clone(),
                holder: format!("{}/{} (uid {uid})", r.namespace, r.name),
            });
        }
    }
    Ok(())
}

impl<C: Cluster, H: Hardware> Driver for ClaimController<C, H> {
    type Error = ClaimError;

    async fn prepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, PrepareResult<ClaimError>> {
        self.lifecycle.prepare(claims).await
    }

    async fn unprepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> BTreeMap<String, UnprepareResult<ClaimError>> {
        self.lifecycle.unprepare(claims).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::ClaimState;
    use crate::hardware::{CreatedMig, HardwareError};
    use crate::storage::{Fs, RealFs};

    struct NoCluster;

    impl Cluster for NoCluster {
        async fn get_claim(
            &self,
            _: &str,
            _: &str,
        ) -> Result<Option<k8s_openapi::api::resource::v1::ResourceClaim>, kube::Error> {
            Ok(None)
        }
        async fn warn(&self, _: &str, _: &str) {}
    }

    struct NoHardware;

    impl Hardware for NoHardware {
        fn prepare(&self, _: &NodeDevice) -> Result<Option<CreatedMig>, HardwareError> {
            Ok(None)
        }
        fn unprepare(&self, _: &NodeDevice, _: Option<&CreatedMig>) -> Result<(), HardwareError> {
            Ok(())
        }
        fn set_compute_mode(
            &self,
            _: &gpu_inventory::Gpu,
            _: gpu_inventory::backend::ComputeMode,
        ) -> Result<(), HardwareError> {
            Ok(())
        }
    }

    /// A checkpoint write whose fsync takes a while.
    #[derive(Debug)]
    struct SlowSync;

    impl Fs for SlowSync {
        fn read(&self, p: &std::path::Path) -> std::io::Result<Vec<u8>> {
            RealFs.read(p)
        }
        fn write(&self, p: &std::path::Path, b: &[u8]) -> std::io::Result<()> {
            RealFs.write(p, b)
        }
        fn overwrite(&self, p: &std::path::Path, b: &[u8]) -> std::io::Result<()> {
            RealFs.overwrite(p, b)
        }
        fn sync_file(&self, p: &std::path::Path) -> std::io::Result<()> {
            std::thread::sleep(Duration::from_millis(200));
            RealFs.sync_file(p)
        }
        fn rename(&self, from: &std::path::Path, to: &std::path::Path) -> std::io::Result<()> {
            RealFs.rename(from, to)
        }
        fn sync_dir(&self, d: &std::path::Path) -> std::io::Result<()> {
            RealFs.sync_dir(d)
        }
        fn remove(&self, p: &std::path::Path) -> std::io::Result<()> {
            RealFs.remove(p)
        }
        fn list(&self, d: &std::path::Path) -> std::io::Result<Vec<std::path::PathBuf>> {
            RealFs.list(d)
        }
        fn create_dir_all(&self, d: &std::path::Path) -> std::io::Result<()> {
            RealFs.create_dir_all(d)
        }
    }

    fn claim(uid: &str) -> ClaimRef {
        ClaimRef {
            namespace: "ns".into(),
            name: uid.into(),
            uid: uid.into(),
        }
    }

    fn record(name: &str) -> ClaimRecord {
        ClaimRecord {
            namespace: "ns".into(),
            name: name.into(),
            state: ClaimState::PrepareCompleted,
            devices: Vec::new(),
            cdi_spec_path: std::path::PathBuf::new(),
            cdi_spec: crate::cdi::Spec::default(),
        }
    }

    /// A caller of the group commit dropped right after it started the store (a cancelled
    /// request) used to leave `writing` set forever: every later checkpoint change, so every
    /// prepare and unprepare on the node, waited for a store that would never end. The store
    /// is now a task of its own: the next change goes through, and the dropped caller's change
    /// is durable too.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_checkpoint_update_never_wedges_the_group_commit() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("checkpoint.json");
        let (controller, _) = ClaimController::start(
            NoCluster,
            Arc::new(NoHardware),
            ControllerConfig {
                driver_name: "gpu.example.com".into(),
                node_name: "node-a".into(),
                timeout: Duration::from_secs(5),
                boot_id: "boot-1".into(),
                sharing: false,
                mps: MpsControl {
                    binary: "/nonexistent".into(),
                    root: dir.path().join("mps"),
                    start_timeout: Duration::from_secs(1),
                    pods: None,
                },
                driver_edits: Default::default(),
                kernel_memory: None,
                claim_users: None,
                device_metadata: None,
                imex: None,
            },
            Vec::new(),
            CdiWriter::new(Arc::new(RealFs), dir.path().join("cdi"), "gpu.example.com"),
            CheckpointFile::new(Arc::new(SlowSync), &path),
        )
        .await
        .expect("start");

        // Polled once (it stages its change and starts the store), then dropped.
        let (u1, u2) = (claim("u1"), claim("u2"));
        let dropped = controller.lifecycle.update(&u1, |c| {
            c.claims.insert("u1".into(), record("first"));
            Ok(())
        });
        assert!(
            tokio::time::timeout(Duration::ZERO, dropped).await.is_err(),
            "the store takes 200 ms; the first poll cannot finish it"
        );

        let next = controller.lifecycle.update(&u2, |c| {
            c.claims.insert("u2".into(), record("second"));
            Ok(())
        });
        tokio::time::timeout(Duration::from_secs(60), next)
            .await
            .expect("the group commit is not wedged")
            .expect("stored");
        let stored = CheckpointFile::new(Arc::new(RealFs), &path)
            .load()
            .expect("readable")
            .expect("written");
        assert_eq!(
            stored.claims.keys().map(String::as_str).collect::<Vec<_>>(),
            ["u1", "u2"],
            "both changes are durable"
        );
    }
}
