//! Start-up reconciliation of checkpoint, CDI specs and hardware.
//!
//! Order: load (or rebuild) the checkpoint; finish or roll back every claim that is not
//! `PrepareCompleted` (destroying the MIG devices its record lists); in partitionable mode,
//! destroy the MIG devices that no remaining claim records on the GPUs that publish placements
//! (orphans of a crash between their creation and the checkpoint write: the plugin owns every
//! MIG device there); regenerate missing CDI specs; remove CDI specs, MPS daemons and compute
//! modes no claim owns.
//!
//! A damaged checkpoint is rebuilt from the CDI specs, each claim checked against the API
//! server; a claim that cannot be checked (no answer) or planned is kept as its spec shows, with
//! the sharing the spec shows, so nothing its pods may use is taken for an orphan, and is
//! settled once the API server answers. A checkpoint written by a newer build (a downgrade) is
//! rebuilt the same way, and then nothing at all is taken for an orphan in that start.
//!
//! One claim whose step fails (a rollback, a CDI rewrite, an MPS restart, a time-slice reset)
//! never stops the start: the failure is logged, reported as a Warning event naming the claim,
//! counted ([`ClaimController::recovery_failures`]) and retried in the background with backoff
//! ([`RECOVERY_RETRY`]) while every other claim is served. A kubelet call for that claim runs
//! its step first and answers with its error while it fails. Orphans that cannot be removed are
//! logged and retried at the next start.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use dra_kubelet::ClaimRef;
use dra_plugin::lifecycle::Error as LifecycleError;
use tracing::{Instrument, info, warn};

use super::{ClaimController, ClaimError, Cluster, plan};
use crate::cdi::{ANNOTATION_NAME, ANNOTATION_NAMESPACE, ANNOTATION_UID};
use crate::checkpoint::{Checkpoint, ClaimRecord, ClaimState};
use crate::claim_config::Sharing;
use crate::hardware::{CreatedMig, Hardware, NodeDevice};

/// What start-up reconciliation did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// The checkpoint was damaged; why, and where it was moved.
    pub corrupt_checkpoint: Option<String>,
    /// Claims rebuilt from CDI specs and the API server after a damaged checkpoint.
    pub rebuilt: Vec<String>,
    /// Claims dropped because they were prepared in a previous boot.
    pub previous_boot: Vec<String>,
    /// Half-done prepares rolled back and half-done unprepares finished.
    pub rolled_back: Vec<String>,
    /// Completed claims whose missing or altered CDI spec was rewritten.
    pub regenerated: Vec<String>,
    /// CDI specs, temp files and MPS daemons no claim owns, removed.
    pub orphans_removed: Vec<String>,
    /// Completed claims whose MPS daemon was not running and was started again.
    pub mps_restarted: Vec<String>,
    /// MIG devices no claim owns on GPUs published as partitionable, destroyed (UUID, GPU,
    /// instance ids, profile and placement).
    pub mig_orphans_destroyed: Vec<String>,
    /// GPUs (by name) put back in the default compute mode: no recorded claim runs MPS on them
    /// (`claims/exclusive.rs`).
    pub compute_modes_restored: Vec<String>,
    /// Claims whose recovery step failed, with the error; retried in the background.
    pub failed: Vec<(String, String)>,
}

/// First and longest wait between retries of a claim's failed recovery step (doubling).
pub const RECOVERY_RETRY: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(300));

/// What a claim still needs from start-up recovery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pending {
    /// Roll back or finish unpreparing (a half-done record, or one of a previous boot).
    Release,
    /// A completed claim: its CDI spec rewritten where missing, its MPS daemon running.
    Complete,
}

impl<C: Cluster, H: Hardware> ClaimController<C, H> {
    pub(super) async fn recover(&self) -> Result<RecoveryReport, ClaimError> {
        let gpu = self.gpu();
        let node = ClaimRef {
            namespace: String::new(),
            name: format!("(node {})", gpu.config.node_name),
            uid: String::new(),
        };
        let mut report = RecoveryReport::default();
        let mut newer_checkpoint = false;
        let file = self.lifecycle.journal().file().clone();
        let loaded = tokio::task::spawn_blocking(move || file.load())
            .await
            .map_err(|join| {
                ClaimError::Lifecycle(LifecycleError::TaskFailed {
                    claim: node.clone(),
                    action: "loading the checkpoint",
                    message: join.to_string(),
                })
            })?;
        let loaded = match loaded {
            Ok(c) => c.unwrap_or_default(),
            Err(e) => {
                newer_checkpoint = matches!(e, crate::checkpoint::CheckpointError::TooNew { .. });
                let aside = self
                    .lifecycle
                    .journal()
                    .file()
                    .quarantine()
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
                gpu.cluster.warn("CheckpointRecovered", &message).await;
                report.corrupt_checkpoint = Some(message);
                let rebuilt = self.rebuild_from_disk().await;
                report.rebuilt = rebuilt.claims.keys().cloned().collect();
                rebuilt
            }
        };
        // Publish the loaded state so release_locked sees the records.
        self.lifecycle.journal().reset(loaded.clone()).await;

        let previous_boot = !loaded.boot_id.is_empty() && loaded.boot_id != gpu.config.boot_id;
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
                    if done.mps_restarted {
                        report.mps_restarted.push(uid.clone());
                    }
                }
                Err(e) => {
                    self.recovery_failed(&claim, pending, &e).await;
                    report.failed.push((uid.clone(), e.to_string()));
                }
            }
        }

        if newer_checkpoint {
            // Written by a newer build (a downgrade): what this build does not understand may
            // still be in use, so nothing is taken for an orphan in this start.
            warn!(
                "the checkpoint was written by a newer build: leaving every CDI spec, MPS \
                daemon, MIG device and compute mode as found; the next start reconciles them"
            );
        } else {
            self.remove_orphans(&node, &mut report).await;
        }

        let boot_id = gpu.config.boot_id.clone();
        self.lifecycle
            .update(&node, |c| {
                c.boot_id = boot_id;
                Ok(())
            })
            .await?;
        if report != RecoveryReport::default() {
            info!(?report, "reconciled claim state at start");
        }
        if !report.failed.is_empty() {
            self.spawn_recovery_retries();
        }
        Ok(report)
    }

    /// Removes what no recorded claim owns: MIG devices on partitionable GPUs, CDI specs and
    /// temp files, MPS daemons (keeping every daemon a recorded claim's spec mounts), and puts
    /// GPUs no recorded claim runs MPS on back in the default compute mode.
    async fn remove_orphans(&self, node: &ClaimRef, report: &mut RecoveryReport) {
        let gpu = self.gpu();
        report.mig_orphans_destroyed = self.destroy_mig_orphans().await;

        let (kept, share_daemons) = {
            let checkpoint = self.lifecycle.journal().records().await;
            let kept: Vec<String> = checkpoint.claims.keys().cloned().collect();
            let mut daemons = super::shares::needed_daemons(&checkpoint, None);
            // And every daemon a kept claim's CDI spec mounts: its containers may use it.
            let root = &gpu.config.mps.root;
            daemons.extend(
                checkpoint
                    .claims
                    .values()
                    .flat_map(|r| {
                        let spec = &r.cdi_spec;
                        spec.container_edits
                            .mounts
                            .iter()
                            .chain(spec.devices.iter().flat_map(|d| &d.container_edits.mounts))
                    })
                    .filter_map(|m| {
                        let rest = std::path::Path::new(&m.host_path).strip_prefix(root).ok()?;
                        Some(rest.components().next()?.as_os_str().to_str()?.to_owned())
                    }),
            );
            (kept, daemons)
        };
        let orphans = {
            let kept = kept.clone();
            self.lifecycle
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
                .await
        };
        match orphans {
            Ok(removed) => report.orphans_removed.extend(removed),
            Err(e) => {
                warn!(error = %e, "cannot list CDI specs for orphans; retried at the next start")
            }
        }

        if let Ok(dirs) = std::fs::read_dir(&gpu.config.mps.root) {
            for uid in dirs
                .flatten()
                .filter_map(|e| e.file_name().into_string().ok())
            {
                if !kept.contains(&uid) && !share_daemons.contains(&uid) {
                    let orphan = ClaimRef {
                        uid: uid.clone(),
                        ..node.clone()
                    };
                    match self.unshare(&orphan, &[]).await {
                        Ok(()) => report
                            .orphans_removed
                            .push(gpu.config.mps.claim_dir(&uid).display().to_string()),
                        Err(e) => warn!(claim = %uid, error = %e,
                            "stopping an orphaned MPS daemon failed; retried at the next start"),
                    }
                }
            }
        }

        // Memory limits the hook set for containers of claims not kept.
        if let Some(kernel) = &gpu.config.kernel_memory {
            let recorded = {
                let kernel = std::sync::Arc::clone(kernel);
                tokio::task::spawn_blocking(move || kernel.recorded_claims())
                    .await
                    .unwrap_or_default()
            };
            for uid in recorded.into_iter().filter(|u| !kept.contains(u)) {
                let orphan = ClaimRef {
                    uid: uid.clone(),
                    ..node.clone()
                };
                match self.clear_memory_limits(&orphan).await {
                    Ok(()) => report
                        .orphans_removed
                        .push(format!("memory limits of claim {uid}")),
                    Err(e) => warn!(claim = %uid, error = %e,
                        "clearing an orphaned claim's memory limits failed; retried at the next start"),
                }
            }
        }

        // MPS v3 namespaces of claims not kept, on the daemons kept.
        if gpu.config.kernel_memory.is_some() {
            let removed = self.remove_orphan_namespaces(&share_daemons, &kept).await;
            report.orphans_removed.extend(removed);
        }

        report.compute_modes_restored = self.restore_compute_modes(node).await;
    }

    /// Runs `pending` for `claim` under its lock. A claim whose record is gone meanwhile (the
    /// kubelet unprepared it) needs nothing more.
    pub(super) async fn recover_claim(
        &self,
        claim: &ClaimRef,
        pending: Pending,
    ) -> Result<Recovered, ClaimError> {
        let _guard = self.lifecycle.claim_lock(&claim.uid).lock_owned().await;
        self.recover_claim_locked(claim, pending).await
    }

    /// [`Self::recover_claim`] for a caller holding the claim's lock.
    pub(super) async fn recover_claim_locked(
        &self,
        claim: &ClaimRef,
        pending: Pending,
    ) -> Result<Recovered, ClaimError> {
        let mut done = Recovered::default();
        let Some(record) = self.lifecycle.record(&claim.uid).await else {
            return Ok(done);
        };
        if pending == Pending::Release || record.state != ClaimState::PrepareCompleted {
            self.lifecycle.release_locked(claim).await?;
            return Ok(done);
        }
        done.regenerated = self.ensure_spec(claim, &record).await?;
        // A daemon that died with the previous plugin process is started again so new
        // containers of the claim can use it (the daemons of its shares' devices once, for all
        // their shares); one that answers, or may, is kept.
        let claim_daemon_revived = self.revive_daemons(claim, &record.devices).await?;
        done.mps_restarted = claim_daemon_revived && plan::uses_mps(&record.devices);
        Ok(done)
    }

    /// Records that `claim`'s recovery step failed: logged, counted, and a Warning event about
    /// the node naming the claim (the plugin's RBAC creates events only about its Node).
    async fn recovery_failed(&self, claim: &ClaimRef, pending: Pending, e: &ClaimError) {
        let count = {
            let mut failing = super::lock(&self.gpu().recovery.failing);
            failing.insert(claim.uid.clone(), (claim.clone(), pending, e.to_string()));
            failing.len()
        };
        self.gpu().recovery.count.send_replace(count);
        warn!(claim = %claim, error = %e,
            "recovering this claim failed; serving the others and retrying it in the background");
        self.gpu()
            .cluster
            .warn(
                "ClaimRecoveryFailed",
                &format!(
                    "ResourceClaim {}/{} (uid {}): recovery at start failed, retrying: {e}",
                    claim.namespace, claim.name, claim.uid
                ),
            )
            .await;
    }

    /// `claim` needs no more recovery (its step succeeded, or it was unprepared).
    pub(super) fn recovery_resolved(&self, uid: &str) {
        let (removed, count) = {
            let mut failing = super::lock(&self.gpu().recovery.failing);
            let removed = failing.remove(uid).is_some();
            (removed, failing.len())
        };
        if removed {
            self.gpu().recovery.count.send_replace(count);
        }
    }

    /// The recovery step `uid` still needs, if its recovery failed.
    pub(super) fn recovery_pending(&self, uid: &str) -> Option<Pending> {
        super::lock(&self.gpu().recovery.failing)
            .get(uid)
            .map(|(_, p, _)| *p)
    }

    /// Retries every failed recovery step with backoff ([`RECOVERY_RETRY`]) until none is left
    /// or the controller quiesces.
    fn spawn_recovery_retries(&self) {
        let this = self.clone();
        let stop = self.gpu().recovery.stop.clone();
        let (mut delay, max) = RECOVERY_RETRY;
        self.lifecycle.background().spawn(
            async move {
                loop {
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(delay) => {}
                    }
                    let failing: Vec<(ClaimRef, Pending)> =
                        super::lock(&this.gpu().recovery.failing)
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
                                    super::lock(&this.gpu().recovery.failing).get_mut(&claim.uid)
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

    /// In partitionable mode: destroys every MIG device on a GPU that publishes placements (and
    /// has MIG enabled) that no claim in the checkpoint records. Failures are logged and left
    /// for the next start; a placement still taken fails its prepare with a clear error.
    async fn destroy_mig_orphans(&self) -> Vec<String> {
        let hardware = &self.gpu().hardware;
        let owned: BTreeSet<String> = self
            .lifecycle
            .journal()
            .records()
            .await
            .claims
            .values()
            .flat_map(|r| &r.devices)
            .filter_map(|d| d.mig.as_ref().map(|m| m.uuid.clone()))
            .collect();
        let mut gpus = BTreeMap::new();
        for d in self.catalogue().devices.values() {
            if let NodeDevice::MigPlacement { parent, .. } = d
                && parent.raw.mig_mode == gpu_inventory::backend::MigMode::Enabled
            {
                gpus.entry(parent.name.clone())
                    .or_insert_with(|| parent.clone());
            }
        }
        let mut destroyed = Vec::new();
        for gpu in gpus.values() {
            let found = match hardware.mig_devices(gpu) {
                Ok(found) => found,
                Err(e) => {
                    warn!(gpu = %gpu.name, error = %e, "listing MIG devices for orphans failed");
                    continue;
                }
            };
            for mig in found.iter().filter(|m| !owned.contains(&m.uuid)) {
                match hardware.destroy_mig(gpu, mig) {
                    Ok(()) => {
                        warn!(gpu = %gpu.name, mig = %mig,
                            "destroyed a MIG device no prepared claim owns (partitionable mode \
                             owns every MIG device on this GPU)");
                        destroyed.push(format!("{mig} on {}", gpu.name));
                    }
                    Err(e) => warn!(gpu = %gpu.name, mig = %mig, error = %e,
                        "destroying an orphaned MIG device failed; retried at the next start"),
                }
            }
        }
        destroyed
    }

    /// For a record rebuilt without the checkpoint: the MIG device now at each placement it
    /// holds is taken to be the one its prepare created, so it is kept and later destroyed.
    fn adopt_mig_devices(&self, devices: &mut [crate::checkpoint::RecordedDevice]) {
        for d in devices.iter_mut().filter(|d| d.mig.is_none()) {
            let Some(NodeDevice::MigPlacement {
                parent,
                profile_id,
                placement,
                ..
            }) = self.catalogue().get(&d.device_name).cloned()
            else {
                continue;
            };
            let found: Vec<CreatedMig> = match self.gpu().hardware.mig_devices(&parent) {
                Ok(found) => found,
                Err(e) => {
                    warn!(device = %d.device_name, error = %e, "cannot look up its MIG device");
                    continue;
                }
            };
            if let Some(m) = found.into_iter().find(|m| {
                m.profile_id == profile_id
                    && m.placement_start == placement.start
                    && m.placement_size == placement.size
            }) {
                d.uuid.clone_from(&m.uuid);
                d.mig = Some(m);
            }
        }
    }

    /// Rewrites a completed claim's CDI spec when it is missing or differs from the record.
    /// Records upgraded from checkpoint version 1 carry no spec; it is rebuilt from the devices.
    async fn ensure_spec(
        &self,
        claim: &ClaimRef,
        record: &ClaimRecord,
    ) -> Result<bool, ClaimError> {
        let gpu = self.gpu();
        let want = if record.cdi_spec.kind.is_empty() {
            let catalogue = self.catalogue();
            let used: Vec<_> = record
                .devices
                .iter()
                .filter_map(|d| catalogue.get(&d.device_name))
                .collect();
            let created = plan::created_migs(&record.devices);
            let mps = plan::MpsEdits::of(
                &gpu.config.mps,
                gpu.config.kernel_memory.as_deref(),
                &record.devices,
            );
            plan::spec(
                claim,
                &used,
                &created,
                &mps,
                &gpu.config.driver_edits,
                gpu.hardware.as_ref(),
                self.lifecycle.cdi(),
            )?
        } else {
            record.cdi_spec.clone()
        };
        let uid = claim.uid.clone();
        self.lifecycle
            .cdi_io(claim, move |cdi| {
                if cdi.read(&uid)?.as_ref() == Some(&want) {
                    return Ok(false);
                }
                cdi.write(&uid, &want).map(|_| true)
            })
            .await
    }

    /// The devices a spec exposes, for when the API server cannot say (request names unknown).
    /// The devices of `claim` as its CDI spec names them, for a claim that cannot be checked
    /// against the API server now. What sharing the spec shows is kept, so that nothing the
    /// claim's running containers use is stopped as an orphan: a device whose edits mount a
    /// GPU's share daemon (`<mps root>/<key>/pipe`) is recorded as a share with the limits of
    /// its edits (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`; the
    /// share ID is unknown), one that mounts the claim's own daemon as under MPS (its
    /// daemon-side limits unknown). Such a claim is settled against the API server once it
    /// answers ([`ClaimController::settle_unverified`]).
    fn devices_from_spec(
        &self,
        claim: &ClaimRef,
        spec: &crate::cdi::Spec,
    ) -> Vec<crate::checkpoint::RecordedDevice> {
        let gpu = self.gpu();
        let prefix = format!("{}-", claim.uid);
        let catalogue = self.catalogue();
        let mps = &gpu.config.mps;
        spec.devices
            .iter()
            .filter_map(|d| Some((d, d.name.strip_prefix(&prefix)?)))
            .filter_map(|(d, name)| Some((d, catalogue.get(name)?)))
            .map(|(cdi, d)| {
                let edits = &cdi.container_edits;
                let daemon = edits
                    .mounts
                    .iter()
                    .find(|m| m.container_path == crate::mps::CONTAINER_PIPE_DIR)
                    .map(|m| std::path::PathBuf::from(&m.host_path));
                let env = |name: &str| {
                    edits
                        .env
                        .iter()
                        .find_map(|e| e.strip_prefix(name)?.strip_prefix('='))
                };
                let share_key = super::shares::daemon_key(d.visible_id());
                let (mut sharing, mut share) = (None, None);
                if daemon.as_deref() == Some(mps.pipe_dir(&claim.uid).as_path()) {
                    sharing = Some(Sharing::Mps(crate::claim_config::MpsLimits::default()));
                } else if daemon
                    .as_deref()
                    .is_some_and(|p| p.starts_with(mps.pipe_dir(&share_key)))
                {
                    // The daemon's pipe directory, or (MPS v3) the share's namespace in it.
                    share = Some(crate::checkpoint::RecordedShare {
                        id: String::new(),
                        memory_bytes: env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
                            .and_then(|v| v.strip_prefix("0=")?.strip_suffix('M')?.parse().ok())
                            .map_or(0, |mib: u64| mib << 20),
                        compute_percent: env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
                            .and_then(|v| v.parse().ok())
                            .unwrap_or(0),
                        whole: false,
                    });
                }
                crate::checkpoint::RecordedDevice {
                    request_names: Vec::new(),
                    pool_name: gpu.config.node_name.clone(),
                    device_name: d.name().to_owned(),
                    cdi_device_ids: vec![self.lifecycle.cdi().device_id(&claim.uid, d.name())],
                    uuid: d.visible_id().to_owned(),
                    admin_access: false,
                    sharing,
                    mig: None,
                    share,
                }
            })
            .collect()
    }

    /// After a damaged checkpoint: every CDI spec of ours names its claim; keep those whose claim
    /// still exists with that UID and an allocation of our devices, as completed. Specs whose
    /// claim cannot be looked up now are kept too (the periodic stale-claim check retries).
    async fn rebuild_from_disk(&self) -> Checkpoint {
        let gpu = self.gpu();
        let mut claims = BTreeMap::new();
        let files = match self.lifecycle.cdi().list() {
            Ok(f) => f,
            Err(e) => {
                warn!(error = %e, "cannot list CDI specs; starting with no prepared claims");
                return Checkpoint::default();
            }
        };
        for (uid, _) in files {
            let Some(uid) = uid else { continue };
            let Ok(Some(spec)) = self.lifecycle.cdi().read(&uid) else {
                continue;
            };
            let get = |k: &str| spec.annotations.get(k).cloned().unwrap_or_default();
            let claim = ClaimRef {
                namespace: get(ANNOTATION_NAMESPACE),
                name: get(ANNOTATION_NAME),
                uid: get(ANNOTATION_UID),
            };
            if claim.uid != uid || claim.name.is_empty() {
                continue;
            }
            let mut devices = match gpu.cluster.get_claim(&claim.namespace, &claim.name).await {
                Ok(Some(rc)) => match plan::plan(&claim, &rc, &self.plan_context()) {
                    Ok(p) => p.devices,
                    // Its pods may still run: keep what the spec shows; the stale-claim check
                    // unprepares it once its claim is gone or replaced.
                    Err(e) => {
                        warn!(claim = %claim, error = %e,
                            "cannot plan a recovered claim; keeping it as its CDI spec shows");
                        self.devices_from_spec(&claim, &spec)
                    }
                },
                Ok(None) => continue,
                Err(e) => {
                    warn!(claim = %claim, error = %e,
                        "cannot check a recovered claim; keeping it as its CDI spec shows until the API server answers");
                    super::lock(&gpu.recovery.unverified).insert(uid.clone());
                    self.devices_from_spec(&claim, &spec)
                }
            };
            self.adopt_mig_devices(&mut devices);
            claims.insert(
                uid.clone(),
                ClaimRecord {
                    namespace: claim.namespace.clone(),
                    name: claim.name.clone(),
                    state: ClaimState::PrepareCompleted,
                    devices,
                    cdi_spec_path: self.lifecycle.cdi().spec_path(&uid),
                    cdi_spec: spec,
                },
            );
        }
        Checkpoint {
            boot_id: gpu.config.boot_id.clone(),
            claims,
        }
    }
}

/// What one claim's recovery step did.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Recovered {
    /// Its CDI spec was missing or altered and was rewritten.
    pub(super) regenerated: bool,
    /// Its MPS daemon was not running and was started.
    pub(super) mps_restarted: bool,
}

impl<C: Cluster, H: Hardware> ClaimController<C, H> {
    /// Settles claim `uid`, rebuilt from its CDI spec alone at start (the API server did not
    /// answer), now that its ResourceClaim `rc` is known: its record takes the devices, sharing
    /// and shares of the plan, so its unprepare undoes exactly what it holds. Nothing is
    /// stopped or restarted: the daemons it uses were kept. A plan that fails leaves the
    /// record as the spec showed it (logged).
    pub(super) async fn settle_unverified(
        &self,
        uid: &str,
        rc: &k8s_openapi::api::resource::v1::ResourceClaim,
    ) {
        if !super::lock(&self.gpu().recovery.unverified).contains(uid) {
            return;
        }
        let _guard = self.lifecycle.claim_lock(uid).lock_owned().await;
        let Some(record) = self.lifecycle.record(uid).await else {
            super::lock(&self.gpu().recovery.unverified).remove(uid);
            return;
        };
        let claim = ClaimRef {
            namespace: record.namespace.clone(),
            name: record.name.clone(),
            uid: uid.to_owned(),
        };
        match plan::plan(&claim, rc, &self.plan_context()) {
            Ok(mut p) => {
                self.adopt_mig_devices(&mut p.devices);
                let devices = p.devices;
                let key = uid.to_owned();
                let settled = self
                    .lifecycle
                    .update(&claim, move |c| {
                        if let Some(r) = c.claims.get_mut(&key) {
                            r.devices = devices;
                        }
                        Ok(())
                    })
                    .await;
                match settled {
                    Ok(()) => {
                        info!(claim = %uid, "settled a claim rebuilt from its CDI spec");
                        super::lock(&self.gpu().recovery.unverified).remove(uid);
                    }
                    Err(e) => warn!(claim = %uid, error = %e,
                        "settling a claim rebuilt from its CDI spec failed; retrying"),
                }
            }
            Err(e) => {
                warn!(claim = %uid, error = %e,
                    "cannot plan a claim rebuilt from its CDI spec; keeping it as the spec shows");
                super::lock(&self.gpu().recovery.unverified).remove(uid);
            }
        }
    }
}
