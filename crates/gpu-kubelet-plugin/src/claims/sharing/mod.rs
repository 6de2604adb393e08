//! Sharing of a claim's devices, applied after the hardware step and undone before it
//! ([`dra_plugin::lifecycle::Driver::configure`], [`dra_plugin::lifecycle::Driver::unconfigure`]).
//! Each way of sharing is one [`Strategy`], in its own module:
//!
//! | strategy | applies | undoes |
//! |---|---|---|
//! | [`time_slicing`] | each TimeSlicing-configured device's GPU time slice | the default slice |
//! | [`claim_daemon`] | the claim's MPS daemon, its full GPUs in `EXCLUSIVE_PROCESS` first | modes back to `DEFAULT`, then the daemon stopped |
//! | [`shares`] | the daemon of each device the claim holds a share of, its ceiling or namespace | the share's part; the daemon with the device's last share |
//! | [`kernel_limits`] | nothing (the hook sets them as containers start) | the memory limits set for the claim's containers |
//!
//! [`Strategies::order`] applies them first to last and undoes them last to first, so each undo
//! meets what its apply left: the memory limits, set last (by the containers), go first, while
//! the records still say where; the daemons go before the time slices of the same GPUs. A
//! failed apply leaves part applied and the lifecycle undoes it all; every undo is safe when
//! nothing (or part) was applied, and when repeated after a failure.
//!
//! The strategies reach the node through two small ports: [`Node`] (GPU locks, compute modes,
//! time slices, memory limits, the claim records), implemented by the controller, and
//! [`Daemons`] (MPS control daemons), implemented by [`MpsControl`]. Their unit tests drive each
//! strategy against `testing::Recorder`, one fake of both ports that logs every action in order.

pub(crate) mod claim_daemon;
pub(crate) mod kernel_limits;
pub(crate) mod shares;
#[cfg(test)]
mod testing;
pub(crate) mod time_slicing;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

use dra_kubelet::ClaimRef;
use dra_plugin::lifecycle::Error as LifecycleError;
use futures::future::BoxFuture;
use gpu_inventory::backend::ComputeMode;
use tokio::sync::OwnedMutexGuard;
use tracing::warn;

use super::{ClaimController, ClaimError, Cluster, plan};
use crate::checkpoint::{Checkpoint, ClaimState, RecordedDevice};
use crate::claim_config::TimeSlice;
use crate::hardware::Hardware;
use crate::mps::{Ceiling, Liveness, MpsControl, MpsDevice, MpsError, NamespaceLimits, Protocol};

/// One way of sharing a claim's devices. Object-safe, so the order is a plain list.
pub(crate) trait Strategy: Sync {
    /// Its name, for logs and tests.
    fn name(&self) -> &'static str;

    /// Applies it to the claim's `devices` (as prepared). A failure may leave part applied: the
    /// lifecycle then undoes every strategy.
    fn apply<'a>(
        &'a self,
        claim: &'a ClaimRef,
        devices: &'a [RecordedDevice],
    ) -> BoxFuture<'a, Result<(), ClaimError>>;

    /// Undoes [`Self::apply`]; safe when nothing, or part, was applied, and when repeated.
    fn undo<'a>(
        &'a self,
        claim: &'a ClaimRef,
        devices: &'a [RecordedDevice],
    ) -> BoxFuture<'a, Result<(), ClaimError>>;

    /// For a prepared claim: starts again what it applied that has died (an MPS daemon), leaving
    /// alone what answers or may. Returns whether it started something. Default: nothing dies.
    fn revive<'a>(
        &'a self,
        _claim: &'a ClaimRef,
        _devices: &'a [RecordedDevice],
    ) -> BoxFuture<'a, Result<bool, ClaimError>> {
        Box::pin(async { Ok(false) })
    }
}

/// Applies `order` first to last; stops at the first failure.
pub(crate) async fn apply_all(
    order: &[&dyn Strategy],
    claim: &ClaimRef,
    devices: &[RecordedDevice],
) -> Result<(), ClaimError> {
    for s in order {
        s.apply(claim, devices).await?;
    }
    Ok(())
}

/// Undoes `order` last to first; stops at the first failure (the claim's record stays, and the
/// unprepare or rollback is retried from the start: every undo may be repeated).
pub(crate) async fn undo_all(
    order: &[&dyn Strategy],
    claim: &ClaimRef,
    devices: &[RecordedDevice],
) -> Result<(), ClaimError> {
    for s in order.iter().rev() {
        s.undo(claim, devices).await?;
    }
    Ok(())
}

/// Revives `order` first to last; stops at the first failure. Returns the names of the
/// strategies that started something.
pub(crate) async fn revive_all(
    order: &[&dyn Strategy],
    claim: &ClaimRef,
    devices: &[RecordedDevice],
) -> Result<Vec<&'static str>, ClaimError> {
    let mut revived = Vec::new();
    for s in order {
        if s.revive(claim, devices).await? {
            revived.push(s.name());
        }
    }
    Ok(revived)
}

/// What the strategies act on besides MPS daemons. Hardware actions on one GPU never overlap:
/// each holds its GPU's lock.
pub(crate) trait Node: Sync {
    /// Takes the lock of the GPU behind device `name` (the name itself when unknown).
    fn lock_gpu(&self, name: &str) -> impl Future<Output = OwnedMutexGuard<()>> + Send;

    /// Sets the compute mode of device `name`'s GPU when the device is a full GPU; nothing for
    /// a MIG device or an unknown one (`claims/exclusive.rs`). The caller holds the GPU's lock.
    ///
    /// # Errors
    /// [`ClaimError::Hardware`] from NVML.
    fn set_compute_mode(
        &self,
        claim: &ClaimRef,
        name: &str,
        mode: ComputeMode,
    ) -> impl Future<Output = Result<(), ClaimError>> + Send;

    /// Sets device `name`'s GPU time slice, under the GPU's lock (taken here and held until
    /// the action ends, even if the caller stops waiting); nothing for an unknown device.
    ///
    /// # Errors
    /// [`ClaimError::Hardware`] from NVML.
    fn set_time_slice(
        &self,
        claim: &ClaimRef,
        name: &str,
        slice: TimeSlice,
    ) -> impl Future<Output = Result<(), ClaimError>> + Send;

    /// Clears the memory limits the `kernel` level's hook set for `claim`'s containers; how
    /// many. Zero at the `mps` level.
    ///
    /// # Errors
    /// [`ClaimError::Hardware`] when a limit cannot be cleared.
    fn clear_memory_limits(
        &self,
        claim: &ClaimRef,
    ) -> impl Future<Output = Result<usize, ClaimError>> + Send;

    /// `read` over the claim records (every claim being prepared, prepared or being
    /// unprepared).
    fn with_records<T: Send>(
        &self,
        read: impl FnOnce(&Checkpoint) -> T + Send,
    ) -> impl Future<Output = T> + Send;
}

/// MPS control daemons, each under its key (a claim UID, or a device's [`shares::daemon_key`]);
/// [`MpsControl`]'s methods of the same names.
pub(crate) trait Daemons: Sync {
    /// Whether daemon `key` answers.
    fn liveness(&self, key: &str) -> impl Future<Output = Liveness> + Send;
    /// The protocol daemon `key` speaks (`None`: no daemon recorded one).
    fn protocol(
        &self,
        key: &str,
    ) -> impl Future<Output = Result<Option<Protocol>, MpsError>> + Send;
    /// Starts legacy daemon `key` for `served`, with the default thread `percentage`.
    fn start(
        &self,
        key: &str,
        served: &[MpsDevice],
        percentage: Option<u32>,
    ) -> impl Future<Output = Result<(), MpsError>> + Send;
    /// Starts MPS v3 daemon `key` for the device `uuid`.
    fn start_v3(&self, key: &str, uuid: &str) -> impl Future<Output = Result<(), MpsError>> + Send;
    /// Starts daemon `key`'s server for Linux user `server_uid` ahead of its clients.
    fn start_server(
        &self,
        key: &str,
        server_uid: u32,
    ) -> impl Future<Output = Result<(), MpsError>> + Send;
    /// Sets daemon `key`'s server-side ceiling.
    fn set_ceiling(
        &self,
        key: &str,
        ceiling: Ceiling,
    ) -> impl Future<Output = Result<(), MpsError>> + Send;
    /// Makes namespace `name` on v3 daemon `key` hold `limits`.
    fn set_namespace(
        &self,
        key: &str,
        name: &str,
        limits: NamespaceLimits,
    ) -> impl Future<Output = Result<(), MpsError>> + Send;
    /// Deletes namespace `name` on v3 daemon `key`.
    fn delete_namespace(
        &self,
        key: &str,
        name: &str,
    ) -> impl Future<Output = Result<(), MpsError>> + Send;
    /// Stops daemon `key` (if any) and removes its directories.
    fn stop(&self, key: &str) -> impl Future<Output = Result<(), MpsError>> + Send;
    /// Daemon `key`'s pipe directory (for errors).
    fn pipe_dir(&self, key: &str) -> PathBuf;
}

impl Daemons for MpsControl {
    fn liveness(&self, key: &str) -> impl Future<Output = Liveness> + Send {
        MpsControl::liveness(self, key)
    }
    fn protocol(
        &self,
        key: &str,
    ) -> impl Future<Output = Result<Option<Protocol>, MpsError>> + Send {
        MpsControl::protocol(self, key)
    }
    fn start(
        &self,
        key: &str,
        served: &[MpsDevice],
        percentage: Option<u32>,
    ) -> impl Future<Output = Result<(), MpsError>> + Send {
        MpsControl::start(self, key, served, percentage)
    }
    fn start_v3(&self, key: &str, uuid: &str) -> impl Future<Output = Result<(), MpsError>> + Send {
        MpsControl::start_v3(self, key, uuid)
    }
    fn start_server(
        &self,
        key: &str,
        server_uid: u32,
    ) -> impl Future<Output = Result<(), MpsError>> + Send {
        MpsControl::start_server(self, key, server_uid)
    }
    fn set_ceiling(
        &self,
        key: &str,
        ceiling: Ceiling,
    ) -> impl Future<Output = Result<(), MpsError>> + Send {
        MpsControl::set_ceiling(self, key, ceiling)
    }
    fn set_namespace(
        &self,
        key: &str,
        name: &str,
        limits: NamespaceLimits,
    ) -> impl Future<Output = Result<(), MpsError>> + Send {
        MpsControl::set_namespace(self, key, name, limits)
    }
    fn delete_namespace(
        &self,
        key: &str,
        name: &str,
    ) -> impl Future<Output = Result<(), MpsError>> + Send {
        MpsControl::delete_namespace(self, key, name)
    }
    fn stop(&self, key: &str) -> impl Future<Output = Result<(), MpsError>> + Send {
        MpsControl::stop(self, key)
    }
    fn pipe_dir(&self, key: &str) -> PathBuf {
        MpsControl::pipe_dir(self, key)
    }
}

/// The strategies of one node, each borrowing the ports.
pub(crate) struct Strategies<'a, N, D> {
    time_slicing: time_slicing::TimeSlicing<'a, N>,
    claim_daemon: claim_daemon::ClaimDaemon<'a, N, D>,
    shares: shares::ShareDaemons<'a, N, D>,
    kernel_limits: kernel_limits::KernelLimits<'a, N>,
}

impl<'a, N: Node, D: Daemons> Strategies<'a, N, D> {
    /// The strategies over `node` and `daemons`; shares' daemons speak MPS v3 when `v3` (the
    /// `kernel` enforcement level).
    pub(crate) fn new(node: &'a N, daemons: &'a D, v3: bool) -> Self {
        Self {
            time_slicing: time_slicing::TimeSlicing::new(node),
            claim_daemon: claim_daemon::ClaimDaemon::new(node, daemons),
            shares: shares::ShareDaemons::new(node, daemons, v3),
            kernel_limits: kernel_limits::KernelLimits::new(node),
        }
    }

    /// The order of application (undone in reverse): see the module docs.
    pub(crate) fn order(&self) -> [&dyn Strategy; 4] {
        [
            &self.time_slicing,
            &self.claim_daemon,
            &self.shares,
            &self.kernel_limits,
        ]
    }
}

impl<C: Cluster, H: Hardware> ClaimController<C, H> {
    /// This node's strategies, over the controller and its MPS daemons.
    fn strategies(&self) -> Strategies<'_, Self, MpsControl> {
        let config = &self.gpu().config;
        Strategies::new(self, &config.mps, config.kernel_memory.is_some())
    }

    /// Applies the sharing of `devices` ([`Strategies::order`]).
    pub(super) async fn share(
        &self,
        claim: &ClaimRef,
        devices: &[RecordedDevice],
    ) -> Result<(), ClaimError> {
        apply_all(&self.strategies().order(), claim, devices).await
    }

    /// Undoes [`Self::share`], last strategy first. Safe when nothing was applied: start-up
    /// calls it with no devices for an orphaned daemon's key, which stops that daemon.
    pub(super) async fn unshare(
        &self,
        claim: &ClaimRef,
        devices: &[RecordedDevice],
    ) -> Result<(), ClaimError> {
        undo_all(&self.strategies().order(), claim, devices).await
    }

    /// Starts again the MPS daemons of prepared `devices` that are confirmed dead (the claim's
    /// own, under the claim's lock, which the caller holds; its shares' devices', each
    /// re-checked under its GPU's lock). Returns the names of the strategies that started one.
    pub(super) async fn revive_daemons(
        &self,
        claim: &ClaimRef,
        devices: &[RecordedDevice],
    ) -> Result<Vec<&'static str>, ClaimError> {
        revive_all(&self.strategies().order(), claim, devices).await
    }

    /// Starts again the MPS daemons of completed claims that no longer answer (a daemon that
    /// crashed, or one that lived in the container of a previous instance which has since gone
    /// away after a handover), so the claim's next containers find a server. Running clients of
    /// a dead daemon are not helped by this. Each claim is handled under its lock; failures are
    /// logged and retried at the next call. Returns the UIDs whose daemon was started.
    pub async fn restart_dead_daemons(&self) -> Vec<String> {
        let mut mps_claims = self.lifecycle.completed_records().await;
        mps_claims.retain(|(_, r)| {
            plan::uses_mps(&r.devices) || shares::mps_shares(&r.devices).next().is_some()
        });
        let mut restarted = Vec::new();
        for (uid, r) in mps_claims {
            let share_daemons: Vec<String> = shares::mps_shares(&r.devices)
                .map(|d| shares::daemon_key(&d.uuid))
                .collect();
            let mut dead = false;
            for key in plan::uses_mps(&r.devices)
                .then_some(&uid)
                .into_iter()
                .chain(&share_daemons)
            {
                match self.gpu().config.mps.liveness(key).await {
                    Liveness::Answering => {}
                    Liveness::Dead => dead = true,
                    // A slow answer is no evidence of death: never quit or replace on it.
                    Liveness::Unknown(problem) => {
                        warn!(claim = %uid, daemon = %key, %problem,
                            "MPS daemon check: no clear answer; leaving the daemon be");
                    }
                }
            }
            if !dead {
                continue;
            }
            let claim = ClaimRef {
                namespace: r.namespace,
                name: r.name,
                uid: uid.clone(),
            };
            let _guard = self.lifecycle.claim_lock(&uid).lock_owned().await;
            // Unprepared meanwhile: nothing to restart.
            let Some(record) = self.lifecycle.record(&uid).await else {
                continue;
            };
            if record.state != ClaimState::PrepareCompleted {
                continue;
            }
            // Re-checked under the locks: only a daemon still dead is started.
            match self.revive_daemons(&claim, &record.devices).await {
                Ok(revived) if !revived.is_empty() => {
                    warn!(claim = %claim, ?revived,
                        "the claim's MPS daemon had stopped answering; started it again");
                    restarted.push(uid);
                }
                Ok(_) => {}
                Err(e) => warn!(claim = %claim, error = %e,
                    "restarting the claim's MPS daemon failed; retrying at the next check"),
            }
        }
        restarted
    }
}

/// The controller is the strategies' [`Node`]: its GPU locks, hardware and records.
impl<C: Cluster, H: Hardware> Node for ClaimController<C, H> {
    async fn lock_gpu(&self, name: &str) -> OwnedMutexGuard<()> {
        let gpu = self
            .catalogue()
            .get(name)
            .map_or_else(|| name.to_owned(), |d| d.gpu().name.clone());
        self.gpu_lock(&gpu).lock_owned().await
    }

    async fn set_compute_mode(
        &self,
        claim: &ClaimRef,
        name: &str,
        mode: ComputeMode,
    ) -> Result<(), ClaimError> {
        self.compute_mode_locked(claim, name, mode).await
    }

    async fn set_time_slice(
        &self,
        claim: &ClaimRef,
        name: &str,
        slice: TimeSlice,
    ) -> Result<(), ClaimError> {
        let Some(device) = self.catalogue().get(name).cloned() else {
            return Ok(());
        };
        let guard = self.gpu_lock(&device.gpu().name).lock_owned().await;
        let hw = Arc::clone(&self.gpu().hardware);
        // Tracked: the action runs on even if the caller stops waiting.
        let result = self
            .lifecycle
            .background()
            .spawn_blocking(move || {
                let _guard: OwnedMutexGuard<()> = guard;
                hw.set_time_slice(&device, slice)
            })
            .await;
        match result {
            Ok(r) => r.map_err(|source| ClaimError::Hardware {
                claim: claim.clone(),
                source,
            }),
            Err(e) => Err(ClaimError::Lifecycle(LifecycleError::TaskFailed {
                claim: claim.clone(),
                action: "time-slice setting",
                message: format!("device {name}: {e}"),
            })),
        }
    }

    async fn clear_memory_limits(&self, claim: &ClaimRef) -> Result<usize, ClaimError> {
        let Some(kernel) = self.gpu().config.kernel_memory.clone() else {
            return Ok(0);
        };
        let hardware = Arc::clone(&self.gpu().hardware);
        let uid = claim.uid.clone();
        tokio::task::spawn_blocking(move || kernel.clear_claim(hardware.as_ref(), &uid))
            .await
            .map_err(|e| {
                ClaimError::Lifecycle(LifecycleError::TaskFailed {
                    claim: claim.clone(),
                    action: "clearing memory limits",
                    message: e.to_string(),
                })
            })?
            .map_err(|source| ClaimError::Hardware {
                claim: claim.clone(),
                source,
            })
    }

    async fn with_records<T: Send>(&self, read: impl FnOnce(&Checkpoint) -> T + Send) -> T {
        read(&*self.lifecycle.journal().records().await)
    }
}

/// A daemon failure of `claim`.
fn mps_error(claim: &ClaimRef) -> impl Fn(MpsError) -> ClaimError + '_ {
    move |source| ClaimError::Mps {
        claim: claim.clone(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{Recorder, claim};
    use super::*;

    /// A strategy that logs each call into one shared log, failing where told.
    struct Logged<'a> {
        name: &'static str,
        log: &'a std::sync::Mutex<Vec<String>>,
        fail: Option<&'static str>,
    }

    impl Logged<'_> {
        fn call(&self, what: &str) -> Result<bool, ClaimError> {
            self.log
                .lock()
                .unwrap()
                .push(format!("{what} {}", self.name));
            if self.fail == Some(what) {
                return Err(ClaimError::Lifecycle(LifecycleError::TaskFailed {
                    claim: claim("c"),
                    action: "test",
                    message: format!("{what} {} fails", self.name),
                }));
            }
            Ok(what == "revive")
        }
    }

    impl Strategy for Logged<'_> {
        fn name(&self) -> &'static str {
            self.name
        }
        fn apply<'a>(
            &'a self,
            _: &'a ClaimRef,
            _: &'a [RecordedDevice],
        ) -> BoxFuture<'a, Result<(), ClaimError>> {
            Box::pin(async move { self.call("apply").map(drop) })
        }
        fn undo<'a>(
            &'a self,
            _: &'a ClaimRef,
            _: &'a [RecordedDevice],
        ) -> BoxFuture<'a, Result<(), ClaimError>> {
            Box::pin(async move { self.call("undo").map(drop) })
        }
        fn revive<'a>(
            &'a self,
            _: &'a ClaimRef,
            _: &'a [RecordedDevice],
        ) -> BoxFuture<'a, Result<bool, ClaimError>> {
            Box::pin(async move { self.call("revive") })
        }
    }

    fn logged<'a>(
        log: &'a std::sync::Mutex<Vec<String>>,
        fail: Option<(&'static str, &'static str)>,
    ) -> [Logged<'a>; 3] {
        ["a", "b", "c"].map(|name| Logged {
            name,
            log,
            fail: fail.filter(|(n, _)| *n == name).map(|(_, what)| what),
        })
    }

    #[tokio::test]
    async fn applied_in_order_undone_in_reverse() {
        let log = std::sync::Mutex::default();
        let [a, b, c] = logged(&log, None);
        let order: [&dyn Strategy; 3] = [&a, &b, &c];
        apply_all(&order, &claim("c"), &[]).await.unwrap();
        undo_all(&order, &claim("c"), &[]).await.unwrap();
        let revived = revive_all(&order, &claim("c"), &[]).await.unwrap();
        assert_eq!(
            *log.lock().unwrap(),
            [
                "apply a", "apply b", "apply c", "undo c", "undo b", "undo a", "revive a",
                "revive b", "revive c"
            ]
        );
        assert_eq!(revived, ["a", "b", "c"]);
    }

    #[tokio::test]
    async fn a_failure_stops_the_walk() {
        let log = std::sync::Mutex::default();
        let [a, b, c] = logged(&log, Some(("b", "apply")));
        let order: [&dyn Strategy; 3] = [&a, &b, &c];
        assert!(apply_all(&order, &claim("c"), &[]).await.is_err());
        assert_eq!(*log.lock().unwrap(), ["apply a", "apply b"]);

        let log = std::sync::Mutex::default();
        let [a, b, c] = logged(&log, Some(("b", "undo")));
        let order: [&dyn Strategy; 3] = [&a, &b, &c];
        assert!(undo_all(&order, &claim("c"), &[]).await.is_err());
        // What b and a hold stays recorded, for the retried unprepare.
        assert_eq!(*log.lock().unwrap(), ["undo c", "undo b"]);
    }

    /// The node's order, end to end against the recording fake: a claim with a time-sliced GPU
    /// and an MPS GPU; its undo reverses its apply, with the memory limits first.
    #[tokio::test]
    async fn the_node_order_against_the_recorder() {
        let rec = Recorder::new(true);
        let devices = [
            testing::time_sliced("gpu-0"),
            testing::mps_device("gpu-1", Some(50)),
        ];
        let strategies = Strategies::new(&rec, &rec, true);
        apply_all(&strategies.order(), &claim("c"), &devices)
            .await
            .unwrap();
        assert_eq!(
            rec.take(),
            [
                "slice gpu-0 Short",
                "lock gpu-1",
                "mode gpu-1 ExclusiveProcess",
                "start c [uuid-gpu-1] 50%",
            ]
        );
        undo_all(&strategies.order(), &claim("c"), &devices)
            .await
            .unwrap();
        assert_eq!(
            rec.take(),
            [
                "clear limits c",
                "lock gpu-1",
                "mode gpu-1 Default",
                "stop c",
                "slice gpu-0 Default",
            ]
        );
    }
}
