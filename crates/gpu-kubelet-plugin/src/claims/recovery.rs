//! The GPU driver's part of start-up reconciliation ([`dra_plugin::lifecycle::Lifecycle::recover`]
//! does the rest: load or rebuild the checkpoint, finish or roll back half-done claims, rewrite
//! missing CDI specs, remove orphaned specs, retry failed claims in the background).
//!
//! Here: in partitionable mode, destroy the MIG devices that no remaining claim records on the
//! GPUs that publish placements (orphans of a crash between their creation and the checkpoint
//! write: the plugin owns every MIG device there); start again the MPS daemons of completed
//! claims; remove MPS daemons, memory limits, MPS namespaces and compute modes no claim owns.
//!
//! A damaged checkpoint is rebuilt from the CDI specs, each claim checked against the API
//! server; a claim that cannot be checked (no answer) or planned is kept as its spec shows, with
//! the sharing the spec shows, so nothing its pods may use is taken for an orphan, and is
//! settled once the API server answers.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

use dra_kubelet::ClaimRef;
use tracing::{info, warn};

use super::{ClaimController, ClaimError, Cluster, plan};
use crate::checkpoint::{ClaimRecord, RecordedDevice};
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

impl<C: Cluster, H: Hardware> ClaimController<C, H> {
    /// Reconciles the checkpoint, the CDI specs and the GPUs at start ([`dra_plugin::lifecycle::Lifecycle::recover`]
    /// with this driver's steps).
    pub(super) async fn recover(&self) -> Result<RecoveryReport, ClaimError> {
        let core = self.lifecycle.recover().await?;
        let orphans = core.driver;
        let mut orphans_removed = core.orphans_removed;
        orphans_removed.extend(orphans.removed);
        let report = RecoveryReport {
            corrupt_checkpoint: core.corrupt_checkpoint,
            rebuilt: core.rebuilt,
            previous_boot: core.previous_boot,
            rolled_back: core.rolled_back,
            regenerated: core.regenerated,
            orphans_removed,
            mps_restarted: core.revived,
            mig_orphans_destroyed: orphans.mig_destroyed,
            compute_modes_restored: orphans.compute_modes_restored,
            failed: core.failed,
        };
        if report != RecoveryReport::default() {
            info!(?report, "reconciled claim state at start");
        }
        Ok(report)
    }

    /// Removes what no recorded claim (`kept`, by UID) owns: MIG devices on partitionable
    /// GPUs, MPS daemons (keeping every daemon a recorded claim's spec mounts), memory limits
    /// and MPS namespaces, and puts GPUs no recorded claim runs MPS on back in the default
    /// compute mode. CDI specs are the lifecycle's.
    pub(super) async fn remove_orphans(&self, kept: &BTreeSet<String>) -> Orphans {
        let gpu = self.gpu();
        let node = ClaimRef {
            namespace: String::new(),
            name: format!("(node {})", gpu.config.node_name),
            uid: String::new(),
        };
        let mut report = Orphans {
            mig_destroyed: self.destroy_mig_orphans().await,
            ..Orphans::default()
        };

        let kept: Vec<String> = kept.iter().cloned().collect();
        let share_daemons = {
            let checkpoint = self.lifecycle.records().await;
            let mut daemons = super::shares::needed_daemons(&checkpoint, None);
            // And every daemon a kept claim's CDI spec mounts: its containers may use it.
            let root = &gpu.config.mps.root;
            daemons.extend(
                checkpoint
                    .claims
                    .values()
                    .flat_map(|r| r.cdi_spec.all_edits().flat_map(|e| &e.mounts))
                    .filter_map(|m| {
                        let rest = std::path::Path::new(&m.host_path).strip_prefix(root).ok()?;
                        Some(rest.components().next()?.as_os_str().to_str()?.to_owned())
                    }),
            );
            daemons
        };

        // The directory listing blocks on a slow disk: on the blocking pool.
        let root = gpu.config.mps.root.clone();
        let listed = self
            .lifecycle
            .background()
            .spawn_blocking(move || {
                std::fs::read_dir(root).map(|dirs| {
                    dirs.flatten()
                        .filter_map(|e| e.file_name().into_string().ok())
                        .collect::<Vec<String>>()
                })
            })
            .await;
        if let Ok(Ok(dirs)) = listed {
            for uid in dirs {
                if !kept.contains(&uid) && !share_daemons.contains(&uid) {
                    let orphan = ClaimRef {
                        uid: uid.clone(),
                        ..node.clone()
                    };
                    match self.unshare(&orphan, &[]).await {
                        Ok(()) => report
                            .removed
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
                match super::sharing::Node::clear_memory_limits(self, &orphan).await {
                    Ok(_) => report.removed.push(format!("memory limits of claim {uid}")),
                    Err(e) => warn!(claim = %uid, error = %e,
                        "clearing an orphaned claim's memory limits failed; retried at the next start"),
                }
            }
        }

        // What the claim-user hook recorded for claims not kept.
        if let Some(users) = &gpu.config.claim_users {
            let recorded = {
                let users = std::sync::Arc::clone(users);
                tokio::task::spawn_blocking(move || users.recorded_claims())
                    .await
                    .unwrap_or_default()
            };
            for uid in recorded.into_iter().filter(|u| !kept.contains(u)) {
                let orphan = ClaimRef {
                    uid: uid.clone(),
                    ..node.clone()
                };
                match self.forget_users(&orphan).await {
                    Ok(()) => report.removed.push(format!("user records of claim {uid}")),
                    Err(e) => warn!(claim = %uid, error = %e,
                        "removing an orphaned claim's user records failed; retried at the next start"),
                }
            }
        }

        // Device metadata files of claims not kept.
        if let Some(writer) = &gpu.config.device_metadata {
            let keep: BTreeSet<(String, String)> = {
                let checkpoint = self.lifecycle.records().await;
                checkpoint
                    .claims
                    .iter()
                    .filter(|(uid, _)| kept.contains(*uid))
                    .map(|(_, r)| (r.namespace.clone(), r.name.clone()))
                    .collect()
            };
            let writer = std::sync::Arc::clone(writer);
            let removed = self
                .lifecycle
                .background()
                .spawn_blocking(move || {
                    let mut removed = Vec::new();
                    for (namespace, name) in writer.recorded_claims() {
                        if keep.contains(&(namespace.clone(), name.clone())) {
                            continue;
                        }
                        match writer.clear(&namespace, &name) {
                            Ok(()) => removed.push(format!("device metadata of claim {namespace}/{name}")),
                            Err(e) => warn!(claim = %format!("{namespace}/{name}"), error = %e,
                                "removing an orphaned claim's device metadata failed; retried at the next start"),
                        }
                    }
                    removed
                })
                .await
                .unwrap_or_default();
            report.removed.extend(removed);
        }

        // Installed hooks neither this plugin's nor named by a kept claim's spec (a previous
        // version's, once its last claim is gone).
        let own_hook = gpu
            .config
            .kernel_memory
            .as_ref()
            .map(|k| k.hook_path().to_owned())
            .or_else(|| {
                gpu.config
                    .claim_users
                    .as_ref()
                    .map(|u| u.hook_path().to_owned())
            });
        if let Some(keep) = own_hook {
            let named: BTreeSet<String> = {
                let checkpoint = self.lifecycle.records().await;
                checkpoint
                    .claims
                    .values()
                    .flat_map(|r| r.cdi_spec.all_edits().flat_map(|e| &e.hooks))
                    .map(|h| h.path.clone())
                    .collect()
            };
            let removed = self
                .lifecycle
                .background()
                .spawn_blocking(move || {
                    let dir = keep.parent().map(Path::to_owned).unwrap_or_default();
                    crate::memory_limits::remove_unused_hooks(&dir, &keep, &named)
                })
                .await
                .unwrap_or_default();
            report.removed.extend(removed);
        }

        // MPS v3 namespaces of claims not kept, on the daemons kept.
        if gpu.config.kernel_memory.is_some() {
            let removed = self.remove_orphan_namespaces(&share_daemons, &kept).await;
            report.removed.extend(removed);
        }

        report.compute_modes_restored = self.restore_compute_modes(&node).await;
        report
    }

    /// Deletes the MPS v3 namespaces on the share daemons `keys` that no claim in `kept` owns
    /// (a claim unprepared while the plugin was down). Returns what was deleted, as
    /// `<daemon>/<namespace>`; failures are logged and retried at the next start.
    async fn remove_orphan_namespaces(
        &self,
        keys: &BTreeSet<String>,
        kept: &[String],
    ) -> Vec<String> {
        let mps = &self.gpu().config.mps;
        let owned: BTreeSet<String> = kept
            .iter()
            .map(|uid| crate::mps::namespace_name(uid))
            .collect();
        let mut removed = Vec::new();
        for key in keys {
            if mps.liveness(key).await != crate::mps::Liveness::Answering
                || !matches!(mps.protocol(key).await, Ok(Some(crate::mps::Protocol::V3)))
            {
                continue;
            }
            let names = match mps.namespaces(key).await {
                Ok(names) => names,
                Err(e) => {
                    tracing::warn!(daemon = %key, error = %e,
                        "listing a share daemon's MPS namespaces failed; retried at the next start");
                    continue;
                }
            };
            let device = {
                let catalogue = self.catalogue();
                catalogue
                    .devices
                    .iter()
                    .chain(&catalogue.retired)
                    .find(|(_, d)| super::shares::daemon_key(d.visible_id()) == *key)
                    .map_or_else(|| key.clone(), |(name, _)| name.clone())
            };
            for (name, _) in names.into_iter().filter(|(n, _)| !owned.contains(n)) {
                let _guard = super::sharing::Node::lock_gpu(self, &device).await;
                // Re-checked under the lock: a claim prepared meanwhile owns its namespace.
                let owner = self
                    .lifecycle
                    .records()
                    .await
                    .claims
                    .keys()
                    .any(|uid| crate::mps::namespace_name(uid) == name);
                if owner {
                    continue;
                }
                match mps.delete_namespace(key, &name).await {
                    Ok(()) => removed.push(format!("{key}/{name}")),
                    Err(e) => tracing::warn!(daemon = %key, namespace = %name, error = %e,
                        "deleting an orphaned MPS namespace failed; retried at the next start"),
                }
            }
        }
        removed
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
        // NVML: on the blocking pool, all GPUs in one task.
        let hardware = Arc::clone(hardware);
        let work = move || {
            let mut destroyed = Vec::new();
            for gpu in gpus.values() {
                destroy_orphans_of(hardware.as_ref(), gpu, &owned, &mut destroyed);
            }
            destroyed
        };
        match self.lifecycle.background().spawn_blocking(work).await {
            Ok(destroyed) => destroyed,
            Err(e) => {
                warn!(error = %e, "destroying orphaned MIG devices failed; retried at the next start");
                Vec::new()
            }
        }
    }

    /// For a record rebuilt without the checkpoint: the MIG device now at each placement it
    /// holds is taken to be the one its prepare created, so it is kept and later destroyed.
    /// NVML's lookups run on the blocking pool.
    async fn adopt_mig_devices(&self, devices: &mut [crate::checkpoint::RecordedDevice]) {
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
            let hardware = Arc::clone(&self.gpu().hardware);
            let looked_up = self
                .lifecycle
                .background()
                .spawn_blocking(move || hardware.mig_devices(&parent))
                .await;
            let found: Vec<CreatedMig> = match looked_up {
                Ok(Ok(found)) => found,
                Ok(Err(e)) => {
                    warn!(device = %d.device_name, error = %e, "cannot look up its MIG device");
                    continue;
                }
                Err(e) => {
                    warn!(device = %d.device_name, error = %e, "looking up its MIG device failed");
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

    /// The CDI spec of a record upgraded from checkpoint version 1, which carries none: built
    /// from its devices.
    pub(super) fn spec_of(
        &self,
        claim: &ClaimRef,
        record: &ClaimRecord,
    ) -> Result<crate::cdi::Spec, ClaimError> {
        let catalogue = self.catalogue();
        let used: Vec<_> = record
            .devices
            .iter()
            .filter_map(|d| catalogue.get(&d.device_name))
            .collect();
        let created = plan::created_migs(&record.devices);
        self.spec(claim, &used, &created, &record.devices, &[])
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
                    imex_channel: None,
                }
            })
            .chain(spec.devices.iter().filter_map(|d| {
                // An IMEX channel, as its spec made it (the domain is the claim's, unknown here).
                let name = d.name.strip_prefix(&prefix)?;
                let channel = gpu_inventory::imex::channel_of(name)?;
                let node = d.container_edits.device_nodes.first()?;
                Some(crate::checkpoint::RecordedDevice {
                    request_names: Vec::new(),
                    pool_name: gpu.config.node_name.clone(),
                    device_name: name.to_owned(),
                    cdi_device_ids: vec![self.lifecycle.cdi().device_id(&claim.uid, name)],
                    uuid: String::new(),
                    admin_access: false,
                    sharing: None,
                    mig: None,
                    share: None,
                    imex_channel: Some(crate::checkpoint::RecordedChannel {
                        channel,
                        major: u32::try_from(node.major?).ok()?,
                        domain_id: String::new(),
                        share_id: None,
                    }),
                })
            }))
            .collect()
    }

    /// After a damaged checkpoint, the devices of `claim` whose CDI spec `spec` was found:
    /// kept when the claim still exists with an allocation of our devices, and when it cannot
    /// be looked up now (the periodic stale-claim check retries); `None` when it is gone.
    pub(super) async fn rebuild_claim(
        &self,
        claim: &ClaimRef,
        spec: &crate::cdi::Spec,
    ) -> Option<Vec<RecordedDevice>> {
        let gpu = self.gpu();
        let mut devices = match gpu.cluster.get_claim(&claim.namespace, &claim.name).await {
            Ok(Some(rc)) => match plan::plan(claim, &rc, &self.plan_context()) {
                Ok(p) => p.devices,
                // Its pods may still run: keep what the spec shows; the stale-claim check
                // unprepares it once its claim is gone or replaced.
                Err(e) => {
                    warn!(claim = %claim, error = %e,
                        "cannot plan a recovered claim; keeping it as its CDI spec shows");
                    self.devices_from_spec(claim, spec)
                }
            },
            Ok(None) => return None,
            Err(e) => {
                warn!(claim = %claim, error = %e,
                    "cannot check a recovered claim; keeping it as its CDI spec shows until the API server answers");
                super::lock(&gpu.unverified).insert(claim.uid.clone());
                self.devices_from_spec(claim, spec)
            }
        };
        self.adopt_mig_devices(&mut devices).await;
        Some(devices)
    }
}

/// Destroys the MIG devices on `gpu` not in `owned` (by UUID), adding each to `destroyed`;
/// failures are logged. Blocking (NVML).
fn destroy_orphans_of<H: Hardware>(
    hardware: &H,
    gpu: &gpu_inventory::Gpu,
    owned: &BTreeSet<String>,
    destroyed: &mut Vec<String>,
) {
    let found = match hardware.mig_devices(gpu) {
        Ok(found) => found,
        Err(e) => {
            warn!(gpu = %gpu.name, error = %e, "listing MIG devices for orphans failed");
            return;
        }
    };
    for mig in found.iter().filter(|m| !owned.contains(&m.uuid)) {
        match hardware.destroy_mig(gpu, mig) {
            Ok(()) => {
                warn!(gpu = %gpu.name, mig = %mig,
                    "destroyed a MIG device no prepared claim owns (partitionable mode owns \
                     every MIG device on this GPU)");
                destroyed.push(format!("{mig} on {}", gpu.name));
            }
            Err(e) => warn!(gpu = %gpu.name, mig = %mig, error = %e,
                "destroying an orphaned MIG device failed; retried at the next start"),
        }
    }
}

/// What the GPU driver's orphan removal did ([`ClaimController::remove_orphans`]).
#[derive(Debug, Default)]
pub(crate) struct Orphans {
    /// MIG devices destroyed.
    pub(crate) mig_destroyed: Vec<String>,
    /// MPS daemons, memory limits and namespaces removed.
    pub(crate) removed: Vec<String>,
    /// GPUs put back in the default compute mode.
    pub(crate) compute_modes_restored: Vec<String>,
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
        if !super::lock(&self.gpu().unverified).contains(uid) {
            return;
        }
        let _guard = self.lifecycle.claim_lock(uid).lock_owned().await;
        let Some(record) = self.lifecycle.record(uid).await else {
            super::lock(&self.gpu().unverified).remove(uid);
            return;
        };
        let claim = ClaimRef {
            namespace: record.namespace.clone(),
            name: record.name.clone(),
            uid: uid.to_owned(),
        };
        match plan::plan(&claim, rc, &self.plan_context()) {
            Ok(mut p) => {
                self.adopt_mig_devices(&mut p.devices).await;
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
                        super::lock(&self.gpu().unverified).remove(uid);
                    }
                    Err(e) => warn!(claim = %uid, error = %e,
                        "settling a claim rebuilt from its CDI spec failed; retrying"),
                }
            }
            Err(e) => {
                warn!(claim = %uid, error = %e,
                    "cannot plan a claim rebuilt from its CDI spec; keeping it as the spec shows");
                super::lock(&self.gpu().unverified).remove(uid);
            }
        }
    }
}
