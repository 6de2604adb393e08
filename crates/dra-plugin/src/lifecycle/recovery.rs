//! Start-up reconciliation of the journal, the CDI specs and the driver's state
//! ([`Lifecycle::recover`]).
//!
//! Order: load the checkpoint (or rebuild it from the CDI specs, [`Driver::rebuild_claim`]);
//! finish or roll back every claim that is not `PrepareCompleted`, and every claim of a previous
//! boot (the kubelet prepares those again); rewrite the missing or altered CDI specs of completed
//! claims and bring back what they need ([`Driver::revive`]); remove CDI specs no claim owns,
//! then the driver's own orphans ([`Driver::remove_orphans`]).
//!
//! A damaged checkpoint is moved aside and rebuilt, with a warning ([`Driver::warn`]); it never
//! stops the start. One written by a newer build (a downgrade) is rebuilt the same way, and then
//! nothing at all is taken for an orphan in that start: what this build does not understand
//! may still be in use.
//!
//! One claim whose step fails never stops the start: the failure is logged, reported (a
//! warning naming the claim), counted ([`Lifecycle::recovery_failures`]) and retried in the
//! background with backoff ([`RECOVERY_RETRY`]) while every other claim is served. A kubelet
//! call for that claim runs its step first and answers with its error while it fails (the claim
//! stays prepared: its containers may be running).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use dra_kubelet::ClaimRef;
use tracing::{Instrument, info, warn};

use super::{Driver, Error, Lifecycle};
use crate::checkpoint::CheckpointError;
use crate::record::{ClaimRecord, ClaimState, Records};

/// First and longest wait between retries of a claim's failed recovery step (doubling).
pub const RECOVERY_RETRY: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(300));

/// What start-up reconciliation did; `O` is what the driver's orphan removal reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport<O> {
    /// The checkpoint was damaged or too new; why, and where it was moved.
    pub corrupt_checkpoint: Option<String>,
    /// The checkpoint was written by a newer build: nothing was taken for an orphan.
    pub newer_checkpoint: bool,
    /// Claims rebuilt from CDI specs after a damaged checkpoint.
    pub rebuilt: Vec<String>,
    /// Claims dropped because they were prepared in a previous boot.
    pub previous_boot: Vec<String>,
    /// Half-done prepares rolled back and half-done unprepares finished.
    pub rolled_back: Vec<String>,
    /// Completed claims whose missing or altered CDI spec was rewritten.
    pub regenerated: Vec<String>,
    /// Completed claims the driver brought something back for ([`Driver::revive`]).
    pub revived: Vec<String>,
    /// CDI specs (and temp files) no claim owns, removed.
    pub orphans_removed: Vec<String>,
    /// The driver's orphan removal ([`Driver::remove_orphans`]); default when skipped.
    pub driver: O,
    /// Claims whose recovery step failed, with the error; retried in the background.
    pub failed: Vec<(String, String)>,
}

/// What a claim still needs from start-up recovery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pending {
    /// Roll back or finish unpreparing (a half-done record, or one of a previous boot).
    Release,
    /// A completed claim: its CDI spec rewritten where missing, the driver's revive step.
    Complete,
}

/// Claims whose start-up recovery step failed, retried in the background.
pub(super) struct Retries {
    /// By UID: the claim, the step it needs, the last error.
    failing: std::sync::Mutex<BTreeMap<String, (ClaimRef, Pending, String)>>,
    /// How many there are, for the metric.
    count: tokio::sync::watch::Sender<usize>,
    /// Stops the retries ([`Lifecycle::quiesce`]).
    pub(super) stop: tokio_util::sync::CancellationToken,
}

impl Default for Retries {
    fn default() -> Self {
        Self {
            failing: std::sync::Mutex::default(),
            count: tokio::sync::watch::Sender::new(0),
            stop: tokio_util::sync::CancellationToken::new(),
        }
    }
}

/// What one claim's recovery step did.
#[derive(Debug, Clone, Copy, Default)]
struct Recovered {
    regenerated: bool,
    revived: bool,
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl<D: Driver> Lifecycle<D> {
    /// Reconciles the journal with the CDI specs and the driver's state (module docs). Call
    /// once, before serving the kubelet.
    ///
    /// # Errors
    /// Only when the reconciled state cannot be written back; a damaged or unreadable
    /// checkpoint is recovered, not an error.
    pub async fn recover(&self) -> Result<RecoveryReport<D::Orphans>, D::Error> {
        let node = self.node();
        let mut report = RecoveryReport::<D::Orphans>::default();
        let file = self.journal().file().clone();
        let loaded = tokio::task::spawn_blocking(move || file.load())
            .await
            .map_err(|join| Error::TaskFailed {
                claim: node.clone(),
                action: "loading the checkpoint",
                message: join.to_string(),
            })?;
        let loaded = match loaded {
            Ok(c) => c.unwrap_or_default(),
            Err(e) => {
                report.newer_checkpoint = matches!(e, CheckpointError::TooNew { .. });
                let file = self.journal().file().clone();
                let aside = tokio::task::spawn_blocking(move || file.quarantine())
                    .await
                    .map_err(|join| Error::TaskFailed {
                        claim: node.clone(),
                        action: "moving the checkpoint aside",
                        message: join.to_string(),
                    })?
                    .map(|moved| {
                        moved
                            .iter()
                            .map(|p| p.display().to_string())
                            .collect::<Vec<_>>()
                            .join(" and ")
                    })
                    .unwrap_or_else(|q| format!("(could not move it aside: {q})"));
                let message = format!(
                    "{e}; moved to {aside}; rebuilding prepared claims from CDI specs and the API server"
                );
                self.driver().warn("CheckpointRecovered", &message).await;
                report.corrupt_checkpoint = Some(message);
                // The boot the specs were written in: the last start's, if one is recorded.
                let file = self.journal().file().clone();
                let written_in = tokio::task::spawn_blocking(move || file.read_boot_marker())
                    .await
                    .ok()
                    .flatten();
                let rebuilt = self.rebuild_from_specs(written_in).await;
                report.rebuilt = rebuilt.claims.keys().cloned().collect();
                rebuilt
            }
        };
        // Publish the loaded state so release_locked sees the records.
        self.journal().reset(loaded.clone()).await;

        let boot_id = &self.inner.settings.boot_id;
        let previous_boot = !loaded.boot_id.is_empty() && loaded.boot_id != *boot_id;
        for (uid, record) in &loaded.claims {
            let claim = ClaimRef {
                namespace: record.namespace.clone(),
                name: record.name.clone(),
                uid: uid.clone(),
            };
            let pending = if previous_boot || record.state != ClaimState::PrepareCompleted {
                Pending::Release
            } else {
                Pending::Complete
            };
            match self.recover_claim(&claim, pending).await {
                Ok(done) => {
                    if pending == Pending::Release {
                        if previous_boot {
                            report.previous_boot.push(uid.clone());
                        } else {
                            report.rolled_back.push(uid.clone());
                        }
                    }
                    if done.regenerated {
                        report.regenerated.push(uid.clone());
                    }
                    if done.revived {
                        report.revived.push(uid.clone());
                    }
                }
                Err(e) => {
                    self.recovery_failed(&claim, pending, &e).await;
                    report.failed.push((uid.clone(), e.to_string()));
                }
            }
        }

        if report.newer_checkpoint {
            warn!(
                "the checkpoint was written by a newer build: leaving every CDI spec and the \
                driver's state as found; the next start reconciles them"
            );
        } else {
            let kept: BTreeSet<String> = self.records().await.claims.keys().cloned().collect();
            report.orphans_removed = self.remove_orphan_specs(&node, &kept).await;
            report.driver = self.driver().remove_orphans(self, &kept).await;
        }

        let boot_id = boot_id.clone();
        let marker = boot_id.clone();
        self.update(&node, |c| {
            c.boot_id = boot_id;
            Ok(())
        })
        .await?;
        // Before any prepare of this boot can write a spec: from now on a rebuild knows the
        // specs on disk may be this boot's.
        let file = self.journal().file().clone();
        match tokio::task::spawn_blocking(move || file.write_boot_marker(&marker)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => warn!(error = %e,
                "cannot record this boot beside the checkpoint; a later rebuild from CDI specs \
                 will not tell this boot's specs from a previous one's"),
            Err(e) => warn!(error = %e, "recording this boot beside the checkpoint failed"),
        }
        if !report.failed.is_empty() {
            self.spawn_recovery_retries();
        }
        Ok(report)
    }

    /// Who start-up work is about, in errors that name no claim.
    fn node(&self) -> ClaimRef {
        ClaimRef {
            namespace: String::new(),
            name: format!("(node {})", self.inner.settings.node_name),
            uid: String::new(),
        }
    }

    /// Removes the CDI specs (and temp files) of claims not in `kept`.
    async fn remove_orphan_specs(&self, node: &ClaimRef, kept: &BTreeSet<String>) -> Vec<String> {
        let kept = kept.clone();
        let orphans = self
            .cdi_io(node, move |cdi| {
                let mut removed = Vec::new();
                for (uid, path) in cdi.list()? {
                    if uid.is_none_or(|u| !kept.contains(&u)) {
                        match cdi.remove_path(&path) {
                            Ok(()) => removed.push(path.display().to_string()),
                            Err(e) => warn!(path = %path.display(), error = %e,
                                "removing an orphaned CDI spec failed; retried at the next start"),
                        }
                    }
                }
                Ok(removed)
            })
            .await;
        orphans.unwrap_or_else(|e| {
            warn!(error = %e, "cannot list CDI specs for orphans; retried at the next start");
            Vec::new()
        })
    }

    /// Runs `pending` for `claim` under its lock. A claim whose record is gone meanwhile (the
    /// kubelet unprepared it) needs nothing more.
    async fn recover_claim(
        &self,
        claim: &ClaimRef,
        pending: Pending,
    ) -> Result<Recovered, D::Error> {
        let _guard = self.claim_lock(&claim.uid).lock_owned().await;
        self.recover_claim_locked(claim, pending).await
    }

    /// [`Self::recover_claim`] for a caller holding the claim's lock.
    async fn recover_claim_locked(
        &self,
        claim: &ClaimRef,
        pending: Pending,
    ) -> Result<Recovered, D::Error> {
        let mut done = Recovered::default();
        let Some(record) = self.record(&claim.uid).await else {
            return Ok(done);
        };
        if pending == Pending::Release || record.state != ClaimState::PrepareCompleted {
            self.release_locked(claim).await?;
            return Ok(done);
        }
        done.regenerated = self.ensure_spec(claim, &record).await?;
        done.revived = self.driver().revive(self, claim, &record).await?;
        Ok(done)
    }

    /// A prepare of a completed claim whose recovery failed runs the step first
    /// ([`super::prepare`]): `Ok(true)` to answer with the record, `Ok(false)` to release
    /// and prepare again.
    pub(super) async fn resume(&self, claim: &ClaimRef) -> Result<bool, D::Error> {
        match self.recovery_pending(&claim.uid) {
            None => Ok(true),
            Some(Pending::Release) => Ok(false),
            Some(pending) => {
                self.recover_claim_locked(claim, pending).await?;
                self.recovery_resolved(&claim.uid);
                Ok(true)
            }
        }
    }

    /// Rewrites a completed claim's CDI spec when it is missing or differs from the record.
    /// A record that carries no spec (an older format) gets the driver's
    /// ([`Driver::spec_of`]).
    async fn ensure_spec(
        &self,
        claim: &ClaimRef,
        record: &ClaimRecord<D::Device>,
    ) -> Result<bool, D::Error> {
        let want = if record.cdi_spec.kind.is_empty() {
            let mut spec = self.driver().spec_of(self, claim, record)?;
            self.cdi().stamp(&mut spec, claim);
            spec
        } else {
            record.cdi_spec.clone()
        };
        let uid = claim.uid.clone();
        self.cdi_io(claim, move |cdi| {
            if cdi.read(&uid)?.as_ref() == Some(&want) {
                return Ok(false);
            }
            cdi.write(&uid, &want).map(|_| true)
        })
        .await
    }

    /// After a damaged checkpoint: every CDI spec of ours names its claim; the driver decides
    /// which to keep, as completed, and with which devices ([`Driver::rebuild_claim`]). The
    /// records are stamped with the boot the specs were `written_in` (the last start's, from
    /// [`SlotFile::write_boot_marker`](crate::checkpoint::SlotFile::write_boot_marker)): claims
    /// of a previous boot are then released as any previous boot's are, never revived (their
    /// specs may name device instances a new boot reuses). Unknown (no marker: a first start,
    /// or an older build): this boot, as before.
    async fn rebuild_from_specs(&self, written_in: Option<String>) -> Records<D::Device> {
        let mut claims = BTreeMap::new();
        // Every spec of ours with its claim UID, read on the blocking pool.
        let specs = self
            .cdi_io(&self.node(), |cdi| {
                let mut specs = Vec::new();
                for (uid, _) in cdi.list()? {
                    let Some(uid) = uid else { continue };
                    if let Ok(Some(spec)) = cdi.read(&uid) {
                        specs.push((uid, spec));
                    }
                }
                Ok(specs)
            })
            .await;
        let specs = match specs {
            Ok(specs) => specs,
            Err(e) => {
                warn!(error = %e, "cannot list CDI specs; starting with no prepared claims");
                return Records::default();
            }
        };
        let named: Vec<(String, ClaimRef, _)> = specs
            .into_iter()
            .filter_map(|(uid, spec)| {
                let claim = self.cdi().claim_of(&spec)?;
                (claim.uid == uid).then_some((uid, claim, spec))
            })
            .collect();
        // All at once: each may wait on the API server up to the driver's deadline, and one
        // unanswering server must not delay start-up once per claim.
        let rebuilt = futures::future::join_all(
            named
                .iter()
                .map(|(_, claim, spec)| self.driver().rebuild_claim(self, claim, spec)),
        )
        .await;
        for ((uid, claim, spec), devices) in named.into_iter().zip(rebuilt) {
            let Some(devices) = devices else {
                continue;
            };
            claims.insert(
                uid.clone(),
                ClaimRecord {
                    namespace: claim.namespace.clone(),
                    name: claim.name.clone(),
                    state: ClaimState::PrepareCompleted,
                    devices,
                    cdi_spec_path: self.cdi().spec_path(&uid),
                    cdi_spec: spec,
                },
            );
        }
        Records {
            boot_id: written_in.unwrap_or_else(|| self.inner.settings.boot_id.clone()),
            claims,
        }
    }

    /// How many claims' start-up recovery is failing (retried in the background), as it
    /// changes.
    pub fn recovery_failures(&self) -> tokio::sync::watch::Receiver<usize> {
        self.inner.retries.count.subscribe()
    }

    /// Records that `claim`'s recovery step failed: logged, counted, and reported
    /// ([`Driver::warn`]) naming the claim.
    async fn recovery_failed(&self, claim: &ClaimRef, pending: Pending, e: &D::Error) {
        let count = {
            let mut failing = lock(&self.inner.retries.failing);
            failing.insert(claim.uid.clone(), (claim.clone(), pending, e.to_string()));
            failing.len()
        };
        self.inner.retries.count.send_replace(count);
        warn!(claim = %claim, error = %e,
            "recovering this claim failed; serving the others and retrying it in the background");
        self.driver()
            .warn(
                "ClaimRecoveryFailed",
                &format!(
                    "ResourceClaim {}/{} (uid {}): recovery at start failed, retrying: {e}",
                    claim.namespace, claim.name, claim.uid
                ),
            )
            .await;
    }

    /// `uid` needs no more recovery (its step succeeded, or it was unprepared).
    pub(super) fn recovery_resolved(&self, uid: &str) {
        let (removed, count) = {
            let mut failing = lock(&self.inner.retries.failing);
            let removed = failing.remove(uid).is_some();
            (removed, failing.len())
        };
        if removed {
            self.inner.retries.count.send_replace(count);
        }
    }

    /// The recovery step `uid` still needs, if its recovery failed.
    fn recovery_pending(&self, uid: &str) -> Option<Pending> {
        lock(&self.inner.retries.failing)
            .get(uid)
            .map(|(_, p, _)| *p)
    }

    /// Retries every failed recovery step with backoff ([`RECOVERY_RETRY`]) until none is left
    /// or the lifecycle quiesces.
    fn spawn_recovery_retries(&self) {
        let this = self.clone();
        let stop = self.inner.retries.stop.clone();
        let (mut delay, max) = RECOVERY_RETRY;
        self.background().spawn(
            async move {
                loop {
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(delay) => {}
                    }
                    let failing: Vec<(ClaimRef, Pending)> = lock(&this.inner.retries.failing)
                        .values()
                        .map(|(c, p, _)| (c.clone(), *p))
                        .collect();
                    if failing.is_empty() {
                        return;
                    }
                    for (claim, pending) in failing {
                        if stop.is_cancelled() {
                            return;
                        }
                        match this.recover_claim(&claim, pending).await {
                            Ok(_) => {
                                info!(claim = %claim, "recovered the claim on retry");
                                this.recovery_resolved(&claim.uid);
                            }
                            Err(e) => {
                                warn!(claim = %claim, error = %e, retry_in = ?delay.saturating_mul(2).min(max),
                                    "recovering the claim failed again");
                                if let Some(entry) =
                                    lock(&this.inner.retries.failing).get_mut(&claim.uid)
                                {
                                    entry.2 = e.to_string();
                                }
                            }
                        }
                    }
                    delay = delay.saturating_mul(2).min(max);
                }
            }
            .in_current_span(),
        );
    }
}
