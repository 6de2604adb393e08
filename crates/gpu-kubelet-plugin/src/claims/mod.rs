//! The claim controller: prepare and unprepare for the kubelet, crash-safe and concurrent.
//!
//! Lifecycle of a claim (each arrow is a durable checkpoint write, see [`crate::checkpoint`]):
//!
//! ```text
//! prepare:   -> PrepareStarted -> hardware, per device [-> created MIG devices] -> CDI spec
//!            -> PrepareCompleted
//! unprepare: -> UnprepareStarted -> remove CDI spec -> hardware undo -> (record removed)
//! ```
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
//! Concurrency: claims lock only their own devices (in name order, so two claims never
//! deadlock); the checkpoint mutex is held only while a write is in flight; hardware actions run
//! on blocking threads holding their device's lock. Every call has a deadline; a call that
//! misses it answers the kubelet with an error and leaves the rollback to a background task that
//! holds the claim's lock, so a retry waits for a clean state.

mod cluster;
mod error;
mod plan;
mod recovery;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use dra_kubelet::{ClaimRef, Driver, PrepareResult, PreparedDevice, UnprepareResult};
use tokio::sync::{Mutex, OwnedMutexGuard};
use tokio_util::task::TaskTracker;
use tracing::{Instrument, info, warn};

pub use cluster::{Cluster, KubeCluster};
pub use error::ClaimError;
pub use plan::{DEVICE_ENV_PREFIX, device_env};
pub use recovery::RecoveryReport;

use crate::cdi::CdiWriter;
use crate::checkpoint::{Checkpoint, CheckpointFile, ClaimRecord, ClaimState, RecordedDevice};
use crate::claim_config::{Sharing, TimeSlice};
use crate::failpoint;
use crate::hardware::{CreatedMig, Hardware, NodeDevice};
use crate::mps::MpsControl;

/// A hardware action on one device, run on a blocking thread.
type DeviceAction<H, T> =
    Arc<dyn Fn(&H, &NodeDevice) -> Result<T, crate::hardware::HardwareError> + Send + Sync>;

/// Default deadline of one prepare or unprepare, well below the kubelet's 45 s.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

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
}

/// Prepares and unprepares claims for one driver on one node. Cheap to clone.
pub struct ClaimController<C, H> {
    inner: Arc<Inner<C, H>>,
}

impl<C, H> Clone for ClaimController<C, H> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

struct Inner<C, H> {
    cluster: C,
    hardware: Arc<H>,
    config: ControllerConfig,
    devices: BTreeMap<String, NodeDevice>,
    /// One lock per physical GPU: hardware actions on a GPU never overlap.
    gpu_locks: BTreeMap<String, Arc<Mutex<()>>>,
    claim_locks: std::sync::Mutex<HashMap<String, Arc<Mutex<()>>>>,
    cdi: CdiWriter,
    checkpoint_file: CheckpointFile,
    /// The checkpoint as staged: durable plus changes waiting for the next group commit.
    checkpoint: Mutex<Checkpoint>,
    commit: std::sync::Mutex<Commit>,
    committed: tokio::sync::Notify,
    /// Work that outlives the kubelet's call (rollbacks, unprepares); see [`ClaimController::quiesce`].
    background: TaskTracker,
}

/// Group-commit bookkeeping: changes are numbered (epochs) as they are staged.
#[derive(Default)]
struct Commit {
    /// Epoch of the last staged change.
    staged: u64,
    /// Every change up to this epoch is durable.
    durable: u64,
    /// The checkpoint as last stored.
    durable_state: Checkpoint,
    /// A store is in flight.
    writing: bool,
    /// Epoch ranges `(after, through]` whose store failed, with the error.
    failed: Vec<(u64, u64, String)>,
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
        let devices: BTreeMap<String, NodeDevice> = devices
            .into_iter()
            .map(|d| (d.name().to_owned(), d))
            .collect();
        let gpu_locks = devices
            .values()
            .map(|d| (d.gpu().name.clone(), Arc::default()))
            .collect();
        let controller = Self {
            inner: Arc::new(Inner {
                cluster,
                hardware,
                config,
                devices,
                gpu_locks,
                claim_locks: std::sync::Mutex::default(),
                cdi,
                checkpoint_file,
                checkpoint: Mutex::new(Checkpoint::default()),
                commit: std::sync::Mutex::default(),
                committed: tokio::sync::Notify::new(),
                background: TaskTracker::new(),
            }),
        };
        let report = controller.recover().await?;
        Ok((controller, report))
    }

    /// The UIDs of the claims whose prepare completed.
    pub async fn prepared_claims(&self) -> Vec<String> {
        self.inner
            .checkpoint
            .lock()
            .await
            .claims
            .iter()
            .filter(|(_, r)| r.state == ClaimState::PrepareCompleted)
            .map(|(uid, _)| uid.clone())
            .collect()
    }

    /// `(claims, devices)`: how many claims are prepared and how many devices they hold.
    pub async fn prepared_summary(&self) -> (usize, usize) {
        let checkpoint = self.inner.checkpoint.lock().await;
        checkpoint
            .claims
            .values()
            .filter(|r| r.state == ClaimState::PrepareCompleted)
            .fold((0, 0), |(c, d), r| (c + 1, d + r.devices.len()))
    }

    /// Waits until no work started by this controller is still running: calls must have
    /// returned already; this waits for the rollbacks and unprepares they left running in the
    /// background. Call before handing the node's state to another instance.
    pub async fn quiesce(&self) {
        self.inner.background.close();
        self.inner.background.wait().await;
    }

    fn claim_lock(&self, uid: &str) -> Arc<Mutex<()>> {
        let mut locks = self
            .inner
            .claim_locks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Drop locks nobody holds, so the map stays as small as the set of active claims.
        locks.retain(|_, l| Arc::strong_count(l) > 1);
        Arc::clone(locks.entry(uid.to_owned()).or_default())
    }

    /// Applies `change` to the checkpoint and returns once the result is durable.
    ///
    /// Group commit: changes of concurrent claims are staged on the in-memory checkpoint; the
    /// first caller to find no write in flight writes everything staged so far in one atomic
    /// store, the others wait for it. A failed store fails every change it carried (and any
    /// staged on top of them) and puts the in-memory checkpoint back to the durable one.
    async fn update<R>(
        &self,
        claim: &ClaimRef,
        change: impl FnOnce(&mut Checkpoint) -> Result<R, ClaimError>,
    ) -> Result<R, ClaimError> {
        let inner = &self.inner;
        let (r, epoch) = {
            let mut pending = inner.checkpoint.lock().await;
            let mut next = pending.clone();
            let r = change(&mut next)?;
            let mut c = lock(&inner.commit);
            if next != *pending {
                *pending = next;
                c.staged += 1;
            }
            // An unchanged checkpoint still waits for what is staged before it: the caller may
            // rely on state that another claim staged.
            (r, c.staged)
        };
        loop {
            let committed = inner.committed.notified();
            tokio::pin!(committed);
            committed.as_mut().enable();
            enum Next {
                Failed(String),
                Done,
                Wait,
                Write,
            }
            let next = {
                let mut c = lock(&inner.commit);
                if let Some((_, _, message)) = c
                    .failed
                    .iter()
                    .find(|(lo, hi, _)| *lo < epoch && epoch <= *hi)
                {
                    Next::Failed(message.clone())
                } else if c.durable >= epoch {
                    Next::Done
                } else if c.writing {
                    Next::Wait
                } else {
                    c.writing = true;
                    Next::Write
                }
            };
            match next {
                Next::Failed(message) => {
                    return Err(ClaimError::Checkpoint {
                        claim: claim.clone(),
                        source: crate::checkpoint::CheckpointError::Write {
                            path: inner.checkpoint_file.path().to_owned(),
                            source: std::io::Error::other(message),
                        },
                    });
                }
                Next::Done => return Ok(r),
                Next::Wait => {
                    committed.await;
                    continue;
                }
                Next::Write => {}
            }
            // This caller writes for everyone staged so far. Let the other ready claims stage
            // their changes first, so one store carries them all.
            tokio::task::yield_now().await;
            let (snapshot, target) = {
                let pending = inner.checkpoint.lock().await;
                let target = lock(&inner.commit).staged;
                (pending.clone(), target)
            };
            let stored = inner.checkpoint_file.store(&snapshot);
            match stored {
                Ok(()) => {
                    let mut c = lock(&inner.commit);
                    c.durable = target;
                    c.durable_state = snapshot;
                    c.writing = false;
                }
                Err(e) => {
                    let mut pending = inner.checkpoint.lock().await;
                    let mut c = lock(&inner.commit);
                    *pending = c.durable_state.clone();
                    let range = (c.durable, c.staged, e.to_string());
                    c.failed.push(range);
                    c.writing = false;
                }
            }
            inner.committed.notify_waiters();
        }
    }

    /// Durably moves `claim`'s record (if any) to `state`.
    async fn set_state(&self, claim: &ClaimRef, state: ClaimState) -> Result<(), ClaimError> {
        self.update(claim, |c| {
            if let Some(r) = c.claims.get_mut(&claim.uid) {
                r.state = state;
            }
            Ok(())
        })
        .await
    }

    /// The devices of `names`, grouped by physical GPU in GPU-name order (the lock order).
    fn by_gpu<'a>(
        &self,
        names: impl IntoIterator<Item = &'a str>,
    ) -> Vec<(String, Vec<NodeDevice>)> {
        let mut groups: BTreeMap<String, Vec<NodeDevice>> = BTreeMap::new();
        for n in names {
            if let Some(d) = self.inner.devices.get(n) {
                let group = groups.entry(d.gpu().name.clone()).or_default();
                if !group.iter().any(|g| g.name() == d.name()) {
                    group.push(d.clone());
                }
            }
        }
        groups.into_iter().collect()
    }

    /// Runs `action` for every device in `names`: GPU by GPU in name order (so two claims never
    /// deadlock), each GPU's devices on a blocking thread that holds the GPU's lock until the
    /// action ends. Stops at the first failure. Returns what each device's action gave, for the
    /// devices that succeeded, with the outcome, so a caller can record what was made even when
    /// a later device failed.
    async fn on_devices<'a, T: Send + 'static>(
        &self,
        claim: &ClaimRef,
        names: impl IntoIterator<Item = &'a str>,
        action: DeviceAction<H, T>,
    ) -> (Vec<(String, T)>, Result<(), ClaimError>) {
        let mut done = Vec::new();
        for (gpu, devices) in self.by_gpu(names) {
            let Some(lock) = self.inner.gpu_locks.get(&gpu) else {
                continue;
            };
            let guard = Arc::clone(lock).lock_owned().await;
            let hw = Arc::clone(&self.inner.hardware);
            let action = Arc::clone(&action);
            // Tracked: the action runs on even if the caller stops waiting.
            let result = self
                .inner
                .background
                .spawn_blocking(move || {
                    let _guard: OwnedMutexGuard<()> = guard;
                    let mut ok = Vec::new();
                    for d in &devices {
                        match action(&hw, d) {
                            Ok(t) => ok.push((d.name().to_owned(), t)),
                            Err(e) => return (ok, Err(e)),
                        }
                    }
                    (ok, Ok(()))
                })
                .await;
            match result {
                Ok((ok, r)) => {
                    done.extend(ok);
                    if let Err(source) = r {
                        let e = ClaimError::Hardware {
                            claim: claim.clone(),
                            source,
                        };
                        return (done, Err(e));
                    }
                }
                // The action panicked; fail the claim so what it started is rolled back.
                Err(e) => {
                    let e = ClaimError::TaskFailed {
                        claim: claim.clone(),
                        action: "hardware action",
                        message: format!("GPU {gpu}: {e}"),
                    };
                    return (done, Err(e));
                }
            }
        }
        (done, Ok(()))
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
        let inner = &self.inner;
        plan::PlanContext {
            driver: &inner.config.driver_name,
            pool: &inner.config.node_name,
            catalogue: &inner.devices,
            hardware: inner.hardware.as_ref(),
            cdi: &inner.cdi,
            sharing: inner.config.sharing,
            mps: &inner.config.mps,
            driver_edits: &inner.config.driver_edits,
        }
    }

    /// Applies the sharing of `devices`: their GPUs' time slices, and the claim's MPS daemon
    /// for the devices configured for MPS (in device order, which is the daemon's ordinal order).
    async fn share(&self, claim: &ClaimRef, devices: &[RecordedDevice]) -> Result<(), ClaimError> {
        let slices: Vec<(String, TimeSlice)> = devices
            .iter()
            .filter_map(|d| match d.sharing {
                Some(Sharing::TimeSlicing { interval }) => Some((d.device_name.clone(), interval)),
                _ => None,
            })
            .collect();
        self.set_time_slices(claim, slices).await?;
        // One daemon for the claim's MPS devices: one thread percentage (the config resolution
        // refuses claims whose requests disagree on it), each device its own pinned limit.
        let mut percentage = None;
        let served: Vec<crate::mps::MpsDevice> = devices
            .iter()
            .filter_map(|d| match &d.sharing {
                Some(Sharing::Mps(limits)) => {
                    percentage = limits.active_thread_percentage;
                    Some(crate::mps::MpsDevice {
                        uuid: d.uuid.clone(),
                        pinned_memory_limit_bytes: limits.pinned_memory_limit_bytes,
                    })
                }
                _ => None,
            })
            .collect();
        if !served.is_empty() {
            self.inner
                .config
                .mps
                .start(&claim.uid, &served, percentage)
                .await
                .map_err(|source| ClaimError::Mps {
                    claim: claim.clone(),
                    source,
                })?;
        }
        Ok(())
    }

    /// Undoes [`Self::share`]: stops the claim's MPS daemon (if any is running) and puts
    /// time-sliced GPUs back to the default slice. Safe when nothing was applied.
    async fn unshare(
        &self,
        claim: &ClaimRef,
        devices: &[RecordedDevice],
    ) -> Result<(), ClaimError> {
        self.inner
            .config
            .mps
            .stop(&claim.uid)
            .await
            .map_err(|source| ClaimError::Mps {
                claim: claim.clone(),
                source,
            })?;
        let slices = devices
            .iter()
            .filter(|d| matches!(d.sharing, Some(Sharing::TimeSlicing { .. })))
            .map(|d| (d.device_name.clone(), TimeSlice::Default))
            .collect();
        self.set_time_slices(claim, slices).await
    }

    /// Sets each named device's GPU time slice, under the GPU locks.
    async fn set_time_slices(
        &self,
        claim: &ClaimRef,
        slices: Vec<(String, TimeSlice)>,
    ) -> Result<(), ClaimError> {
        for (name, slice) in slices {
            let Some(device) = self.inner.devices.get(&name).cloned() else {
                continue;
            };
            let Some(lock) = self.inner.gpu_locks.get(&device.gpu().name) else {
                continue;
            };
            let guard = Arc::clone(lock).lock_owned().await;
            let hw = Arc::clone(&self.inner.hardware);
            // Tracked: the action runs on even if the caller stops waiting.
            let result = self
                .inner
                .background
                .spawn_blocking(move || {
                    let _guard: OwnedMutexGuard<()> = guard;
                    hw.set_time_slice(&device, slice)
                })
                .await;
            match result {
                Ok(r) => r.map_err(|source| ClaimError::Hardware {
                    claim: claim.clone(),
                    source,
                })?,
                Err(e) => {
                    return Err(ClaimError::TaskFailed {
                        claim: claim.clone(),
                        action: "time-slice setting",
                        message: format!("device {name}: {e}"),
                    });
                }
            }
        }
        Ok(())
    }

    #[tracing::instrument(name = "prepare", skip_all,
        fields(uid = %claim.uid, namespace = %claim.namespace, name = %claim.name))]
    async fn prepare_claim(&self, claim: ClaimRef) -> Result<Vec<PreparedDevice>, ClaimError> {
        let timeout = self.inner.config.timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        let missed = |claim: &ClaimRef| ClaimError::Deadline {
            claim: claim.clone(),
            action: "prepare",
            timeout_ms: timeout.as_millis(),
        };
        let guard = tokio::time::timeout_at(deadline, self.claim_lock(&claim.uid).lock_owned())
            .await
            .map_err(|_| missed(&claim))?;
        // The attempt runs as its own task, never dropped half-way: what its hardware step
        // creates is always recorded, so the rollback destroys it.
        let mut work = {
            let this = self.clone();
            let c = claim.clone();
            self.inner
                .background
                .spawn(async move { this.prepare_locked(&c).await }.in_current_span())
        };
        let failed = match tokio::time::timeout_at(deadline, &mut work).await {
            Ok(Ok(Ok(devices))) => return Ok(devices),
            Ok(Ok(Err(e))) => e,
            Ok(Err(e)) => ClaimError::TaskFailed {
                claim: claim.clone(),
                action: "prepare",
                message: e.to_string(),
            },
            Err(_) => {
                let this = self.clone();
                let c = claim.clone();
                self.inner.background.spawn(
                    async move {
                        let _guard = guard;
                        // Let the attempt finish first; then undo whatever it got to.
                        let _ = work.await;
                        if let Err(e) = this.release_locked(&c).await {
                            warn!(claim = %c, error = %e, "rollback after a missed deadline failed");
                        }
                    }
                    .in_current_span(),
                );
                return Err(missed(&claim));
            }
        };
        // Undo what this attempt made; a claim that was never started has nothing.
        if let Err(rollback) = self.release_locked(&claim).await {
            warn!(claim = %claim, error = %rollback, "rollback after a failed prepare failed");
        }
        Err(failed)
    }

    async fn prepare_locked(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, ClaimError> {
        let existing = self
            .inner
            .checkpoint
            .lock()
            .await
            .claims
            .get(&claim.uid)
            .map(|r| {
                (
                    r.state,
                    r.devices.iter().map(PreparedDevice::from).collect(),
                )
            });
        match existing {
            Some((ClaimState::PrepareCompleted, devices)) => return Ok(devices),
            // A crashed or abandoned attempt: start from a clean slate.
            Some(_) => self.release_locked(claim).await?,
            None => {}
        }

        let inner = &self.inner;
        let rc = inner
            .cluster
            .get_claim(&claim.namespace, &claim.name)
            .await
            .map_err(|source| ClaimError::Fetch {
                claim: claim.clone(),
                source,
            })?
            .ok_or_else(|| ClaimError::NotFound {
                claim: claim.clone(),
            })?;
        let plan = plan::plan(claim, &rc, &self.plan_context())?;

        failpoint::hit("prepare/before-started-checkpoint");
        let record = ClaimRecord {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            state: ClaimState::PrepareStarted,
            devices: plan.devices.clone(),
            cdi_spec_path: inner.cdi.spec_path(&claim.uid),
            cdi_spec: plan.spec.clone().unwrap_or_default(),
        };
        self.update(claim, |c| {
            check_conflicts(c, claim, &record)?;
            c.claims.insert(claim.uid.clone(), record);
            Ok(())
        })
        .await?;
        failpoint::hit("prepare/after-started-checkpoint");

        let prepare: DeviceAction<H, Option<CreatedMig>> =
            Arc::new(|hw: &H, d: &NodeDevice| hw.prepare(d));
        let (made, outcome) = self
            .on_devices(
                claim,
                plan.devices.iter().map(|d| d.device_name.as_str()),
                prepare,
            )
            .await;
        let created: BTreeMap<String, CreatedMig> = made
            .into_iter()
            .filter_map(|(name, c)| c.map(|c| (name, c)))
            .collect();
        let spec = match plan.spec {
            Some(spec) => Ok(spec),
            None => {
                let used: Vec<&NodeDevice> = plan.used.iter().collect();
                let mps = plan::uses_mps(&plan.devices).then_some(&inner.config.mps);
                plan::spec(
                    claim,
                    &used,
                    &created,
                    mps,
                    &inner.config.driver_edits,
                    inner.hardware.as_ref(),
                    &inner.cdi,
                )
            }
        };
        // The devices as prepared: a created MIG device is reached by its own UUID.
        let mut devices = plan.devices.clone();
        for d in &mut devices {
            if let Some(m) = created.get(&d.device_name) {
                d.uuid.clone_from(&m.uuid);
                d.mig = Some(m.clone());
            }
        }
        if !created.is_empty() {
            // Durable before anything else: from here on, a failure or a crash destroys exactly
            // these MIG devices (a crash before this point leaves orphans for start-up).
            let record_spec = spec.as_ref().ok().cloned();
            self.update(claim, |c| {
                if let Some(r) = c.claims.get_mut(&claim.uid) {
                    for d in &mut r.devices {
                        if let Some(m) = created.get(&d.device_name) {
                            d.uuid.clone_from(&m.uuid);
                            d.mig = Some(m.clone());
                        }
                    }
                    if let Some(spec) = record_spec {
                        r.cdi_spec = spec;
                    }
                }
                Ok(())
            })
            .await?;
        }
        outcome?;
        let spec = spec?;
        failpoint::hit("prepare/after-hardware");
        self.share(claim, &devices).await?;
        failpoint::hit("prepare/after-sharing");

        inner
            .cdi
            .write(&claim.uid, &spec)
            .map_err(|source| ClaimError::Cdi {
                claim: claim.clone(),
                source,
            })?;
        failpoint::hit("prepare/after-cdi-write");

        self.set_state(claim, ClaimState::PrepareCompleted).await?;
        failpoint::hit("prepare/after-completed-checkpoint");
        info!(claim = %claim, devices = plan.devices.len(), "prepared");
        Ok(plan.devices.iter().map(PreparedDevice::from).collect())
    }

    #[tracing::instrument(name = "unprepare", skip_all,
        fields(uid = %claim.uid, namespace = %claim.namespace, name = %claim.name))]
    async fn unprepare_claim(&self, claim: ClaimRef) -> Result<(), ClaimError> {
        let timeout = self.inner.config.timeout;
        let missed = || ClaimError::Deadline {
            claim: claim.clone(),
            action: "unprepare",
            timeout_ms: timeout.as_millis(),
        };
        let deadline = tokio::time::Instant::now() + timeout;
        let guard = tokio::time::timeout_at(deadline, self.claim_lock(&claim.uid).lock_owned())
            .await
            .map_err(|_| missed())?;
        let work = {
            let this = self.clone();
            let claim = claim.clone();
            // Unprepare runs to completion even if the kubelet stops waiting: a half-done
            // unprepare is still recorded and finished on restart, but finishing now is better.
            self.inner.background.spawn(
                async move {
                    let _guard = guard;
                    this.release_locked(&claim).await
                }
                .in_current_span(),
            )
        };
        match tokio::time::timeout_at(deadline, work).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => Err(ClaimError::TaskFailed {
                claim: claim.clone(),
                action: "unprepare",
                message: e.to_string(),
            }),
            Err(_) => Err(missed()),
        }
    }

    /// Unprepares or rolls back `claim` from whatever state it is in. Caller holds its lock.
    async fn release_locked(&self, claim: &ClaimRef) -> Result<(), ClaimError> {
        let inner = &self.inner;
        let record = inner
            .checkpoint
            .lock()
            .await
            .claims
            .get(&claim.uid)
            .cloned();
        let Some(record) = record else {
            // Nothing recorded; a spec without a record is an orphan of a crash.
            return inner
                .cdi
                .remove(&claim.uid)
                .map_err(|source| ClaimError::Cdi {
                    claim: claim.clone(),
                    source,
                });
        };
        failpoint::hit("unprepare/before-started-checkpoint");
        self.set_state(claim, ClaimState::UnprepareStarted).await?;
        failpoint::hit("unprepare/after-started-checkpoint");
        inner
            .cdi
            .remove(&claim.uid)
            .map_err(|source| ClaimError::Cdi {
                claim: claim.clone(),
                source,
            })?;
        failpoint::hit("unprepare/after-cdi-remove");
        self.unshare(claim, &record.devices).await?;
        self.unprepare_hardware(claim, &record).await?;
        failpoint::hit("unprepare/after-hardware");
        self.update(claim, |c| {
            c.claims.remove(&claim.uid);
            Ok(())
        })
        .await?;
        failpoint::hit("unprepare/after-checkpoint");
        info!(claim = %claim, "unprepared");
        Ok(())
    }

    /// Unprepares completed claims that no longer exist in the API server or whose UID
    /// changed (the kubelet missed them, e.g. a pod deleted while the plugin was down).
    /// Claims whose lookup fails are left alone. Returns the UIDs unprepared.
    pub async fn unprepare_stale(&self) -> Vec<String> {
        let records: Vec<(String, ClaimRecord)> = self
            .inner
            .checkpoint
            .lock()
            .await
            .claims
            .iter()
            .filter(|(_, r)| r.state == ClaimState::PrepareCompleted)
            .map(|(u, r)| (u.clone(), r.clone()))
            .collect();
        let mut released = Vec::new();
        for (uid, r) in records {
            let gone = match self.inner.cluster.get_claim(&r.namespace, &r.name).await {
                Ok(None) => true,
                Ok(Some(rc)) => rc.metadata.uid.as_deref() != Some(uid.as_str()),
                Err(e) => {
                    warn!(claim = %uid, error = %e, "stale-claim check: lookup failed; keeping it");
                    false
                }
            };
            if gone {
                let claim = ClaimRef {
                    namespace: r.namespace,
                    name: r.name,
                    uid: uid.clone(),
                };
                match self.unprepare_claim(claim.clone()).await {
                    Ok(()) => {
                        info!(claim = %claim, "unprepared a claim that no longer exists");
                        released.push(uid);
                    }
                    Err(e) => warn!(claim = %claim, error = %e, "unpreparing a stale claim failed"),
                }
            }
        }
        released
    }
}

/// Refuses a device held by another claim unless one of the two allocations has admin access
/// (admin access does not count against exclusivity; KEP-5018).
fn check_conflicts(
    c: &Checkpoint,
    claim: &ClaimRef,
    record: &ClaimRecord,
) -> Result<(), ClaimError> {
    for (index, d) in record.devices.iter().enumerate() {
        if d.admin_access {
            continue;
        }
        let holder = c.claims.iter().find(|(uid, r)| {
            *uid != &claim.uid
                && r.devices.iter().any(|o| {
                    o.device_name == d.device_name && o.pool_name == d.pool_name && !o.admin_access
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
        let uids: Vec<String> = claims.iter().map(|c| c.uid.clone()).collect();
        let results =
            futures::future::join_all(claims.into_iter().map(|c| self.prepare_claim(c))).await;
        uids.into_iter().zip(results).collect()
    }

    async fn unprepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> BTreeMap<String, UnprepareResult<ClaimError>> {
        let uids: Vec<String> = claims.iter().map(|c| c.uid.clone()).collect();
        let results =
            futures::future::join_all(claims.into_iter().map(|c| self.unprepare_claim(c))).await;
        uids.into_iter().zip(results).collect()
    }
}
