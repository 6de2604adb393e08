//! Start-up reconciliation of checkpoint, CDI specs and hardware.
//!
//! Order: load (or rebuild) the checkpoint; finish or roll back every claim that is not
//! `PrepareCompleted` (destroying the MIG devices its record lists); in partitionable mode,
//! destroy the MIG devices that no remaining claim records on the GPUs that publish placements
//! (orphans of a crash between their creation and the checkpoint write: the plugin owns every
//! MIG device there); regenerate missing CDI specs; remove CDI specs no claim owns.

use std::collections::{BTreeMap, BTreeSet};

use dra_kubelet::ClaimRef;
use tracing::{info, warn};

use super::{ClaimController, ClaimError, Cluster, plan};
use crate::cdi::{ANNOTATION_NAME, ANNOTATION_NAMESPACE, ANNOTATION_UID};
use crate::checkpoint::{Checkpoint, ClaimRecord, ClaimState};
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
}

impl<C: Cluster, H: Hardware> ClaimController<C, H> {
    pub(super) async fn recover(&self) -> Result<RecoveryReport, ClaimError> {
        let inner = &self.inner;
        let node = ClaimRef {
            namespace: String::new(),
            name: format!("(node {})", inner.config.node_name),
            uid: String::new(),
        };
        let mut report = RecoveryReport::default();
        let loaded = match inner.checkpoint_file.load() {
            Ok(c) => c.unwrap_or_default(),
            Err(e) => {
                let aside = inner
                    .checkpoint_file
                    .quarantine()
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|q| format!("(could not move it aside: {q})"));
                let message = format!(
                    "{e}; moved to {aside}; rebuilding prepared claims from CDI specs and the API server"
                );
                inner.cluster.warn("CheckpointRecovered", &message).await;
                report.corrupt_checkpoint = Some(message);
                let rebuilt = self.rebuild_from_disk().await;
                report.rebuilt = rebuilt.claims.keys().cloned().collect();
                rebuilt
            }
        };
        // Publish the loaded state so release_locked sees the records.
        *inner.checkpoint.lock().await = loaded.clone();
        super::lock(&inner.commit).durable_state = loaded.clone();

        let previous_boot = !loaded.boot_id.is_empty() && loaded.boot_id != inner.config.boot_id;
        for (uid, record) in &loaded.claims {
            let claim = ClaimRef {
                namespace: record.namespace.clone(),
                name: record.name.clone(),
                uid: uid.clone(),
            };
            if previous_boot {
                self.release_locked(&claim).await?;
                report.previous_boot.push(uid.clone());
            } else if record.state != ClaimState::PrepareCompleted {
                self.release_locked(&claim).await?;
                report.rolled_back.push(uid.clone());
            } else {
                if self.ensure_spec(&claim, record)? {
                    report.regenerated.push(uid.clone());
                }
                if plan::uses_mps(&record.devices) && !inner.config.mps.is_running(uid).await {
                    // The daemon died with the previous plugin process: start it again so new
                    // containers of the claim can use it.
                    self.share(&claim, &record.devices).await?;
                    report.mps_restarted.push(uid.clone());
                }
            }
        }

        report.mig_orphans_destroyed = self.destroy_mig_orphans().await;

        let kept: Vec<String> = inner
            .checkpoint
            .lock()
            .await
            .claims
            .keys()
            .cloned()
            .collect();
        let files = inner.cdi.list().map_err(|source| ClaimError::Cdi {
            claim: node.clone(),
            source,
        })?;
        for (uid, path) in files {
            if uid.is_none_or(|u| !kept.contains(&u)) {
                inner
                    .cdi
                    .remove_path(&path)
                    .map_err(|source| ClaimError::Cdi {
                        claim: node.clone(),
                        source,
                    })?;
                report.orphans_removed.push(path.display().to_string());
            }
        }

        if let Ok(dirs) = std::fs::read_dir(&inner.config.mps.root) {
            for uid in dirs
                .flatten()
                .filter_map(|e| e.file_name().into_string().ok())
            {
                if !kept.contains(&uid) {
                    let orphan = ClaimRef {
                        uid: uid.clone(),
                        ..node.clone()
                    };
                    self.unshare(&orphan, &[]).await?;
                    report
                        .orphans_removed
                        .push(inner.config.mps.claim_dir(&uid).display().to_string());
                }
            }
        }

        let boot_id = inner.config.boot_id.clone();
        self.update(&node, |c| {
            c.boot_id = boot_id;
            Ok(())
        })
        .await?;
        if report != RecoveryReport::default() {
            info!(?report, "reconciled claim state at start");
        }
        Ok(report)
    }

    /// In partitionable mode: destroys every MIG device on a GPU that publishes placements (and
    /// has MIG enabled) that no claim in the checkpoint records. Failures are logged and left
    /// for the next start; a placement still taken fails its prepare with a clear error.
    async fn destroy_mig_orphans(&self) -> Vec<String> {
        let inner = &self.inner;
        let owned: BTreeSet<String> = inner
            .checkpoint
            .lock()
            .await
            .claims
            .values()
            .flat_map(|r| &r.devices)
            .filter_map(|d| d.mig.as_ref().map(|m| m.uuid.clone()))
            .collect();
        let mut gpus = BTreeMap::new();
        for d in inner.devices.values() {
            if let NodeDevice::MigPlacement { parent, .. } = d
                && parent.raw.mig_mode == gpu_inventory::backend::MigMode::Enabled
            {
                gpus.entry(parent.name.clone())
                    .or_insert_with(|| parent.clone());
            }
        }
        let mut destroyed = Vec::new();
        for gpu in gpus.values() {
            let found = match inner.hardware.mig_devices(gpu) {
                Ok(found) => found,
                Err(e) => {
                    warn!(gpu = %gpu.name, error = %e, "listing MIG devices for orphans failed");
                    continue;
                }
            };
            for mig in found.iter().filter(|m| !owned.contains(&m.uuid)) {
                match inner.hardware.destroy_mig(gpu, mig) {
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
            }) = self.inner.devices.get(&d.device_name)
            else {
                continue;
            };
            let found: Vec<CreatedMig> = match self.inner.hardware.mig_devices(parent) {
                Ok(found) => found,
                Err(e) => {
                    warn!(device = %d.device_name, error = %e, "cannot look up its MIG device");
                    continue;
                }
            };
            if let Some(m) = found.into_iter().find(|m| {
                m.profile_id == *profile_id
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
    fn ensure_spec(&self, claim: &ClaimRef, record: &ClaimRecord) -> Result<bool, ClaimError> {
        let inner = &self.inner;
        let want = if record.cdi_spec.kind.is_empty() {
            let used: Vec<_> = record
                .devices
                .iter()
                .filter_map(|d| inner.devices.get(&d.device_name))
                .collect();
            let created = plan::created_migs(&record.devices);
            let mps = plan::uses_mps(&record.devices).then_some(&inner.config.mps);
            plan::spec(
                claim,
                &used,
                &created,
                mps,
                &inner.config.driver_edits,
                inner.hardware.as_ref(),
                &inner.cdi,
            )?
        } else {
            record.cdi_spec.clone()
        };
        let cdi_err = |source| ClaimError::Cdi {
            claim: claim.clone(),
            source,
        };
        if inner.cdi.read(&claim.uid).map_err(cdi_err)?.as_ref() == Some(&want) {
            return Ok(false);
        }
        inner.cdi.write(&claim.uid, &want).map_err(cdi_err)?;
        Ok(true)
    }

    /// The devices a spec exposes, for when the API server cannot say (request names unknown).
    fn devices_from_spec(
        &self,
        claim: &ClaimRef,
        spec: &crate::cdi::Spec,
    ) -> Vec<crate::checkpoint::RecordedDevice> {
        let inner = &self.inner;
        let prefix = format!("{}-", claim.uid);
        spec.devices
            .iter()
            .filter_map(|d| d.name.strip_prefix(&prefix))
            .filter_map(|name| inner.devices.get(name))
            .map(|d| crate::checkpoint::RecordedDevice {
                request_names: Vec::new(),
                pool_name: inner.config.node_name.clone(),
                device_name: d.name().to_owned(),
                cdi_device_ids: vec![inner.cdi.device_id(&claim.uid, d.name())],
                uuid: d.visible_id().to_owned(),
                admin_access: false,
                sharing: None,
                mig: None,
            })
            .collect()
    }

    /// After a damaged checkpoint: every CDI spec of ours names its claim; keep those whose claim
    /// still exists with that UID and an allocation of our devices, as completed. Specs whose
    /// claim cannot be looked up now are kept too (the periodic stale-claim check retries).
    async fn rebuild_from_disk(&self) -> Checkpoint {
        let inner = &self.inner;
        let mut claims = BTreeMap::new();
        let files = match inner.cdi.list() {
            Ok(f) => f,
            Err(e) => {
                warn!(error = %e, "cannot list CDI specs; starting with no prepared claims");
                return Checkpoint::default();
            }
        };
        for (uid, _) in files {
            let Some(uid) = uid else { continue };
            let Ok(Some(spec)) = inner.cdi.read(&uid) else {
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
            let mut devices = match inner.cluster.get_claim(&claim.namespace, &claim.name).await {
                Ok(Some(rc)) => match plan::plan(&claim, &rc, &self.plan_context()) {
                    Ok(p) => p.devices,
                    Err(_) => continue,
                },
                Ok(None) => continue,
                Err(e) => {
                    warn!(claim = %claim, error = %e, "cannot check a recovered claim; keeping its CDI spec");
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
                    cdi_spec_path: inner.cdi.spec_path(&uid),
                    cdi_spec: spec,
                },
            );
        }
        Checkpoint {
            boot_id: inner.config.boot_id.clone(),
            claims,
        }
    }
}
