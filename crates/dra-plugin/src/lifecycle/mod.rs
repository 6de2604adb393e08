//! The claim lifecycle: prepare and unprepare for the kubelet, crash-safe and concurrent, over a
//! [`Driver`] that does the device work.
//!
//! A claim whose prepare changes the node (the driver's [`Planned::two_phase`]) is prepared in
//! two phases; each arrow is a durable journal write ([`crate::journal`]):
//!
//! ```text
//! prepare:   -> PrepareStarted -> Driver::prepare_devices [its own records] -> Driver::configure
//!            -> CDI spec -> PrepareCompleted
//! unprepare: -> UnprepareStarted -> remove CDI spec -> Driver::unconfigure
//!            -> Driver::unprepare_devices -> (record removed)
//! ```
//!
//! A claim whose prepare only checks its devices has nothing for a record to undo, so it skips
//! both `...Started` writes: prepare stages its record in memory (its devices reserved against
//! other claims), runs the device step, then writes the CDI spec and `PrepareCompleted` at once;
//! unprepare runs the driver's (idempotent) undo, then removes the record durably and the spec at
//! once. Every crash in between leaves an orphan spec or a completed record without its spec,
//! both of which start-up reconciles.
//!
//! CDI specs are written atomically but not synced: the record holds each spec, and the kubelet
//! hears of a prepare only once `PrepareCompleted` is durable, so the record alone decides and
//! start-up rewrites a spec a crash lost.
//!
//! Concurrency: one lock per claim, taken within the call's deadline; the journal's mutex is
//! held only while a change is staged. Every call has a deadline ([`Lifecycle::new`]); a call
//! that misses it answers the kubelet with an error and leaves the rollback to a background
//! task that holds the claim's lock, so a retry waits for a clean state. The work of a call runs
//! as its own task, never dropped half-way, so what a device step makes is always recorded and
//! the rollback undoes it.
//!
//! Start-up ([`Lifecycle::recover`]) finishes or rolls back every record a crash left, rewrites
//! the missing CDI specs of completed claims and removes the specs no record claims (see
//! `recovery.rs`).
//!
//! Failpoints ([`crate::failpoint::LIFECYCLE`]) mark each step.

mod driver;
mod error;
mod prepare;
mod recovery;
mod unprepare;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use dra_kubelet::{ClaimRef, PrepareResult, PreparedDevice, UnprepareResult};
use tokio::sync::{Mutex, MutexGuard};
use tokio_util::task::TaskTracker;
use tracing::Instrument;

pub use driver::{Driver, Planned, Prepared};
pub use error::Error;
pub use recovery::{RECOVERY_RETRY, RecoveryReport};

use crate::cdi::{CdiError, CdiWriter};
use crate::checkpoint::SlotFile;
use crate::journal::{Journal, UpdateError};
use crate::record::{ClaimRecord, ClaimState, Records};

/// A lifecycle's fixed settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Deadline of one prepare or unprepare (well below the kubelet's 45 s).
    pub timeout: Duration,
    /// This node's name, for messages about start-up work.
    pub node_name: String,
    /// This boot's ID (`/proc/sys/kernel/random/boot_id`): claims recorded in another boot are
    /// released at start-up.
    pub boot_id: String,
}

/// Prepares and unprepares claims for one driver on one node. Cheap to clone.
pub struct Lifecycle<D: Driver> {
    inner: Arc<Inner<D>>,
}

impl<D: Driver> Clone for Lifecycle<D> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

struct Inner<D: Driver> {
    driver: D,
    settings: Settings,
    /// Claims whose start-up recovery failed, retried in the background.
    retries: recovery::Retries,
    claim_locks: std::sync::Mutex<HashMap<String, Arc<Mutex<()>>>>,
    cdi: CdiWriter,
    /// The claims' records: staged in memory, made durable by group commit.
    journal: Arc<Journal<D::Format>>,
    /// Work that outlives the kubelet's call (rollbacks, unprepares); see [`Lifecycle::quiesce`].
    background: TaskTracker,
}

impl<D: Driver> Lifecycle<D> {
    /// A lifecycle for `driver` with an empty journal over `checkpoint` ([`Lifecycle::recover`]
    /// loads it) and CDI specs written by `cdi`.
    pub fn new(
        driver: D,
        checkpoint: SlotFile<D::Format>,
        cdi: CdiWriter,
        settings: Settings,
    ) -> Self {
        let background = TaskTracker::new();
        Self {
            inner: Arc::new(Inner {
                driver,
                settings,
                retries: recovery::Retries::default(),
                claim_locks: std::sync::Mutex::default(),
                cdi,
                journal: Arc::new(Journal::new(checkpoint, background.clone())),
                background,
            }),
        }
    }

    /// The driver.
    pub fn driver(&self) -> &D {
        &self.inner.driver
    }

    /// The journal of the claims' records.
    pub fn journal(&self) -> &Arc<Journal<D::Format>> {
        &self.inner.journal
    }

    /// The CDI spec writer.
    pub fn cdi(&self) -> &CdiWriter {
        &self.inner.cdi
    }

    /// The tracker of work that outlives a call; [`Lifecycle::quiesce`] waits for it.
    pub fn background(&self) -> &TaskTracker {
        &self.inner.background
    }

    /// The lifecycle's settings.
    pub fn settings(&self) -> &Settings {
        &self.inner.settings
    }

    /// The records as staged, locked: other claims' changes wait while it is held.
    pub async fn records(&self) -> MutexGuard<'_, Records<D::Device>> {
        self.inner.journal.records().await
    }

    /// The claim's record as staged, if any.
    pub async fn record(&self, uid: &str) -> Option<ClaimRecord<D::Device>> {
        self.records().await.claims.get(uid).cloned()
    }

    /// The records of completed claims as staged, by UID.
    pub async fn completed_records(&self) -> Vec<(String, ClaimRecord<D::Device>)> {
        self.records()
            .await
            .claims
            .iter()
            .filter(|(_, r)| r.state == ClaimState::PrepareCompleted)
            .map(|(u, r)| (u.clone(), r.clone()))
            .collect()
    }

    /// The UIDs of the claims whose prepare completed.
    pub async fn prepared_claims(&self) -> Vec<String> {
        self.records()
            .await
            .claims
            .iter()
            .filter(|(_, r)| r.state == ClaimState::PrepareCompleted)
            .map(|(uid, _)| uid.clone())
            .collect()
    }

    /// `(claims, devices)`: how many claims are prepared and how many devices they hold.
    pub async fn prepared_summary(&self) -> (usize, usize) {
        self.records()
            .await
            .claims
            .values()
            .filter(|r| r.state == ClaimState::PrepareCompleted)
            .fold((0, 0), |(c, d), r| (c + 1, d + r.devices.len()))
    }

    /// Waits until no work started by this lifecycle is still running: calls must have
    /// returned already; this waits for the rollbacks and unprepares they left running in the
    /// background, and stops the recovery retries. Call before handing the node's state to
    /// another instance.
    pub async fn quiesce(&self) {
        self.inner.retries.stop.cancel();
        self.inner.background.close();
        self.inner.background.wait().await;
    }

    /// The lock of claim `uid`: every change to a claim's record and devices holds it.
    pub fn claim_lock(&self, uid: &str) -> Arc<Mutex<()>> {
        let mut locks = self
            .inner
            .claim_locks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Drop locks nobody holds, so the map stays as small as the set of active claims.
        locks.retain(|_, l| Arc::strong_count(l) > 1);
        Arc::clone(locks.entry(uid.to_owned()).or_default())
    }

    /// Applies `change` to the records and returns once it is durable ([`Journal::update`]);
    /// a failed store is an [`Error::Checkpoint`] about `claim`.
    ///
    /// # Errors
    /// What `change` returns, or the failed store.
    pub async fn update<R>(
        &self,
        claim: &ClaimRef,
        change: impl FnOnce(&mut Records<D::Device>) -> Result<R, D::Error>,
    ) -> Result<R, D::Error> {
        self.inner
            .journal
            .update(change)
            .await
            .map_err(|e| match e {
                UpdateError::Change(e) => e,
                UpdateError::Commit(source) => Error::Checkpoint {
                    claim: claim.clone(),
                    source,
                }
                .into(),
            })
    }

    /// Stages `change` for the next group commit ([`Journal::stage`]).
    ///
    /// # Errors
    /// What `change` returns; nothing is staged then.
    pub async fn stage<R>(
        &self,
        change: impl FnOnce(&mut Records<D::Device>) -> Result<R, D::Error>,
    ) -> Result<(R, u64), D::Error> {
        self.inner.journal.stage(change).await
    }

    /// Durably moves `claim`'s record (if any) to `state`.
    async fn set_state(&self, claim: &ClaimRef, state: ClaimState) -> Result<(), D::Error> {
        self.update(claim, |c| {
            if let Some(r) = c.claims.get_mut(&claim.uid) {
                r.state = state;
            }
            Ok(())
        })
        .await
    }

    /// Runs blocking CDI file work (write, remove: fsyncs on a slow disk) on the blocking
    /// pool, never on an async worker.
    ///
    /// # Errors
    /// [`Error::Cdi`] from the work, [`Error::TaskFailed`] when its thread failed.
    pub async fn cdi_io<T: Send + 'static>(
        &self,
        claim: &ClaimRef,
        work: impl FnOnce(&CdiWriter) -> Result<T, CdiError> + Send + 'static,
    ) -> Result<T, D::Error> {
        let cdi = self.inner.cdi.clone();
        match tokio::task::spawn_blocking(move || work(&cdi)).await {
            Ok(r) => r.map_err(|source| {
                Error::Cdi {
                    claim: claim.clone(),
                    source,
                }
                .into()
            }),
            Err(join) => Err(Error::TaskFailed {
                claim: claim.clone(),
                action: "CDI file work",
                message: join.to_string(),
            }
            .into()),
        }
    }

    /// Prepares one claim within the deadline; on failure what the attempt made is rolled
    /// back (in the background when the deadline passed).
    ///
    /// # Errors
    /// The driver's error, or the lifecycle's ([`Error`]) wrapped in it.
    #[tracing::instrument(name = "prepare", skip_all,
        fields(uid = %claim.uid, namespace = %claim.namespace, name = %claim.name))]
    pub async fn prepare_claim(&self, claim: ClaimRef) -> Result<Vec<PreparedDevice>, D::Error> {
        let timeout = self.inner.settings.timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        let missed = |claim: &ClaimRef| -> D::Error {
            Error::Deadline {
                claim: claim.clone(),
                action: "prepare",
                timeout_ms: timeout.as_millis(),
            }
            .into()
        };
        let guard = tokio::time::timeout_at(deadline, self.claim_lock(&claim.uid).lock_owned())
            .await
            .map_err(|_| missed(&claim))?;
        // The attempt runs as its own task, never dropped half-way: what its device step
        // creates is always recorded, so the rollback destroys it.
        let mut work = {
            let this = self.clone();
            let c = claim.clone();
            self.inner
                .background
                .spawn(async move { this.prepare_locked(&c).await }.in_current_span())
        };
        let failed = match tokio::time::timeout_at(deadline, &mut work).await {
            Ok(Ok(Ok((devices, _)))) => return Ok(devices),
            // A claim prepared before whose recovery step fails stays prepared: its containers
            // may be running.
            Ok(Ok(Err(prepare::Failure::Keep(e)))) => return Err(e),
            Ok(Ok(Err(prepare::Failure::Undo(e)))) => e,
            Ok(Err(e)) => Error::TaskFailed {
                claim: claim.clone(),
                action: "prepare",
                message: e.to_string(),
            }
            .into(),
            Err(_) => {
                let this = self.clone();
                let c = claim.clone();
                self.inner.background.spawn(
                    async move {
                        let _guard = guard;
                        // Let the attempt finish first; then undo whatever it got to. A claim
                        // prepared before this call stays prepared (its containers may be
                        // running): the attempt answered from its record or ran its recovery.
                        let outcome = work.await;
                        let before = matches!(
                            outcome,
                            Ok(Ok((_, true))) | Ok(Err(prepare::Failure::Keep(_)))
                        );
                        if before {
                            return;
                        }
                        if let Err(e) = this.release_locked(&c).await {
                            tracing::warn!(claim = %c, error = %e, "rollback after a missed deadline failed");
                        }
                    }
                    .in_current_span(),
                );
                return Err(missed(&claim));
            }
        };
        // Undo what this attempt made (a claim that was never started has nothing) as its own
        // task holding the claim's lock, as a missed deadline's rollback runs: awaited until the
        // deadline, then left to finish in the background. Never dropped half-way with the
        // kubelet's call (a driver's tool killed mid-command), and never past the deadline:
        // the kubelet gets the failure, and its retry waits for the lock.
        let rollback = {
            let this = self.clone();
            let c = claim.clone();
            self.inner.background.spawn(
                async move {
                    let _guard = guard;
                    if let Err(e) = this.release_locked(&c).await {
                        tracing::warn!(claim = %c, error = %e, "rollback after a failed prepare failed");
                    }
                }
                .in_current_span(),
            )
        };
        if tokio::time::timeout_at(deadline, rollback).await.is_err() {
            tracing::warn!(claim = %claim,
                "the rollback of a failed prepare runs past the deadline; finishing it in the background");
        }
        Err(failed)
    }

    /// Unprepares one claim within the deadline; the work runs to completion even when the
    /// deadline passes.
    ///
    /// # Errors
    /// The driver's error, or the lifecycle's ([`Error`]) wrapped in it.
    #[tracing::instrument(name = "unprepare", skip_all,
        fields(uid = %claim.uid, namespace = %claim.namespace, name = %claim.name))]
    pub async fn unprepare_claim(&self, claim: ClaimRef) -> Result<(), D::Error> {
        let timeout = self.inner.settings.timeout;
        let missed = || -> D::Error {
            Error::Deadline {
                claim: claim.clone(),
                action: "unprepare",
                timeout_ms: timeout.as_millis(),
            }
            .into()
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
            Ok(Err(e)) => Err(Error::TaskFailed {
                claim: claim.clone(),
                action: "unprepare",
                message: e.to_string(),
            }
            .into()),
            Err(_) => Err(missed()),
        }
    }
}

impl<D: Driver> Lifecycle<D> {
    /// Unprepares the completed claims that no longer exist in the API server or whose UID
    /// changed ([`Driver::claim_exists`]): the kubelet missed them, e.g. a pod deleted while
    /// the plugin was down. A claim whose check fails is kept. Returns the UIDs unprepared. Run
    /// it periodically.
    pub async fn unprepare_stale(&self) -> Vec<String> {
        let mut released = Vec::new();
        for (uid, r) in self.completed_records().await {
            let claim = ClaimRef {
                namespace: r.namespace,
                name: r.name,
                uid: uid.clone(),
            };
            match self.driver().claim_exists(self, &claim).await {
                Ok(true) => continue,
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(claim = %claim, error = %e, "stale-claim check: lookup failed; keeping it");
                    continue;
                }
            }
            match self.unprepare_claim(claim.clone()).await {
                Ok(()) => {
                    tracing::info!(claim = %claim, "unprepared a claim that no longer exists");
                    released.push(uid);
                }
                Err(e) => {
                    tracing::warn!(claim = %claim, error = %e, "unpreparing a stale claim failed");
                }
            }
        }
        released
    }
}

impl<D: Driver> dra_kubelet::Driver for Lifecycle<D> {
    type Error = D::Error;

    async fn prepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, PrepareResult<D::Error>> {
        let uids: Vec<String> = claims.iter().map(|c| c.uid.clone()).collect();
        let results =
            futures::future::join_all(claims.into_iter().map(|c| self.prepare_claim(c))).await;
        uids.into_iter().zip(results).collect()
    }

    async fn unprepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> BTreeMap<String, UnprepareResult<D::Error>> {
        let uids: Vec<String> = claims.iter().map(|c| c.uid.clone()).collect();
        let results =
            futures::future::join_all(claims.into_iter().map(|c| self.unprepare_claim(c))).await;
        uids.into_iter().zip(results).collect()
    }
}
