//! The GPU driver at the lifecycle's named points ([`dra_plugin::lifecycle::Driver`]): each
//! step in the order a claim's prepare, then its unprepare, passes it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use dra_kubelet::{ClaimRef, PreparedDevice};
use dra_plugin::cdi::Spec;
use dra_plugin::lifecycle::{self, Lifecycle, Planned, Prepared};

use super::recovery::Orphans;

use super::{ClaimController, ClaimError, Cluster, DeviceAction, Gpu, check_conflicts, plan};
use crate::checkpoint::{Checkpoint, ClaimRecord, GpuFormat, RecordedDevice};
use crate::hardware::{CreatedMig, Hardware, NodeDevice};

impl<C: Cluster, H: Hardware> lifecycle::Driver for Gpu<C, H> {
    type Device = RecordedDevice;
    type Format = GpuFormat;
    type Error = ClaimError;
    type Plan = plan::Plan;
    type Orphans = Orphans;

    async fn plan(
        &self,
        lifecycle: &Lifecycle<Self>,
        claim: &ClaimRef,
    ) -> Result<Planned<Self>, ClaimError> {
        ClaimController::of(lifecycle).plan_claim(claim).await
    }

    fn check_conflicts(
        &self,
        claim: &ClaimRef,
        records: &Checkpoint,
        devices: &[RecordedDevice],
    ) -> Result<(), ClaimError> {
        check_conflicts(records, claim, devices)
    }

    async fn prepare_devices(
        &self,
        lifecycle: &Lifecycle<Self>,
        claim: &ClaimRef,
        plan: plan::Plan,
    ) -> Result<Prepared<RecordedDevice>, ClaimError> {
        ClaimController::of(lifecycle)
            .prepare_hardware(claim, plan)
            .await
    }

    async fn configure(
        &self,
        lifecycle: &Lifecycle<Self>,
        claim: &ClaimRef,
        devices: &[RecordedDevice],
    ) -> Result<(), ClaimError> {
        ClaimController::of(lifecycle).share(claim, devices).await
    }

    fn changes_node(&self, devices: &[RecordedDevice]) -> bool {
        let catalogue = self.catalogue();
        // Borrowed, not cloned: a GPU carries its MIG tables and links.
        let used = devices.iter().filter_map(|d| catalogue.get(&d.device_name));
        plan::changes_hardware(devices, used)
    }

    async fn unconfigure(
        &self,
        lifecycle: &Lifecycle<Self>,
        claim: &ClaimRef,
        devices: &[RecordedDevice],
    ) -> Result<(), ClaimError> {
        ClaimController::of(lifecycle).unshare(claim, devices).await
    }

    async fn unprepare_devices(
        &self,
        lifecycle: &Lifecycle<Self>,
        claim: &ClaimRef,
        record: &ClaimRecord,
        two_phase: bool,
    ) -> Result<(), ClaimError> {
        // Both paths: what the claim-user hook recorded and the device metadata go with the
        // claim.
        let controller = ClaimController::of(lifecycle);
        controller.forget_users(claim).await?;
        controller.forget_metadata(claim).await?;
        if !two_phase {
            // Only checks to undo: skipped unless a device says otherwise.
            let catalogue = ClaimController::of(lifecycle).catalogue();
            let created = plan::created_migs(&record.devices);
            let needed = record
                .devices
                .iter()
                .filter_map(|d| catalogue.get(&d.device_name))
                .any(|d| self.hardware.undo_needed(d, created.get(d.name())));
            if !needed {
                return Ok(());
            }
        }
        ClaimController::of(lifecycle)
            .unprepare_hardware(claim, record)
            .await
    }

    fn prepared_device(device: &RecordedDevice) -> PreparedDevice {
        PreparedDevice::from(device)
    }

    /// Starts again the MPS daemons of a completed claim that died with the previous plugin
    /// process, so new containers of the claim can use them (the daemons of its shares'
    /// devices once, for all their shares); one that answers, or may, is kept. Reports only
    /// the claim's own daemon.
    async fn revive(
        &self,
        lifecycle: &Lifecycle<Self>,
        claim: &ClaimRef,
        record: &ClaimRecord,
    ) -> Result<bool, ClaimError> {
        let revived = ClaimController::of(lifecycle)
            .revive_daemons(claim, &record.devices)
            .await?;
        Ok(revived.contains(&super::sharing::claim_daemon::NAME))
    }

    fn spec_of(
        &self,
        lifecycle: &Lifecycle<Self>,
        claim: &ClaimRef,
        record: &ClaimRecord,
    ) -> Result<Spec, ClaimError> {
        ClaimController::of(lifecycle).spec_of(claim, record)
    }

    async fn rebuild_claim(
        &self,
        lifecycle: &Lifecycle<Self>,
        claim: &ClaimRef,
        spec: &Spec,
    ) -> Option<Vec<RecordedDevice>> {
        ClaimController::of(lifecycle)
            .rebuild_claim(claim, spec)
            .await
    }

    async fn remove_orphans(
        &self,
        lifecycle: &Lifecycle<Self>,
        kept: &BTreeSet<String>,
    ) -> Orphans {
        ClaimController::of(lifecycle).remove_orphans(kept).await
    }

    /// Looks the claim up; one rebuilt from its CDI spec alone at start is settled against it
    /// ([`ClaimController::settle_unverified`]).
    async fn claim_exists(
        &self,
        lifecycle: &Lifecycle<Self>,
        claim: &ClaimRef,
    ) -> Result<bool, String> {
        match self.cluster.get_claim(&claim.namespace, &claim.name).await {
            Ok(Some(rc)) if rc.metadata.uid.as_deref() == Some(claim.uid.as_str()) => {
                ClaimController::of(lifecycle)
                    .settle_unverified(&claim.uid, &rc)
                    .await;
                Ok(true)
            }
            Ok(_) => Ok(false),
            Err(e) => Err(e.to_string()),
        }
    }

    /// A Warning event about the node (the plugin's RBAC creates events only about its Node).
    async fn warn(&self, reason: &str, message: &str) {
        self.cluster.warn(reason, message).await;
    }
}

impl<C: Cluster, H: Hardware> ClaimController<C, H> {
    /// The CDI spec of `claim` on `used` (the devices of `devices`, as recorded), with the MIG
    /// devices it `created` and its MPS edits ([`plan::spec`]).
    pub(super) fn spec(
        &self,
        claim: &ClaimRef,
        used: &[&NodeDevice],
        created: &BTreeMap<String, CreatedMig>,
        devices: &[RecordedDevice],
        claim_hooks: &[crate::cdi::Hook],
    ) -> Result<Spec, ClaimError> {
        let gpu = self.gpu();
        let mps = plan::MpsEdits::of(
            &gpu.config.mps,
            gpu.config.kernel_memory.as_deref(),
            devices,
        );
        let mut spec = plan::spec(
            claim,
            used,
            created,
            &mps,
            &plan::claim_edits(&gpu.config.driver_edits, claim_hooks),
            gpu.hardware.as_ref(),
            self.lifecycle.cdi(),
        )?;
        plan::add_channels(&mut spec, claim, devices);
        Ok(spec)
    }

    /// Writes the device metadata files of `metadata` on a blocking thread; a claim whose files
    /// cannot be named gets none (its spec mounts none either: [`plan::add_metadata_mounts`]).
    async fn write_metadata(
        &self,
        claim: &ClaimRef,
        writer: &crate::device_metadata::DeviceMetadata,
        metadata: &plan::MetadataPlan,
        created: &BTreeMap<String, CreatedMig>,
    ) -> Result<(), ClaimError> {
        let Ok(files) = metadata.files(writer, created) else {
            return Ok(());
        };
        on_blocking_thread(claim, "writing the claim's device metadata", move || {
            crate::device_metadata::DeviceMetadata::write(&files)
                .map_err(|(path, e)| format!("{}: {e}", path.display()))
        })
        .await
    }

    /// Removes the device metadata files of `claim` ([`crate::device_metadata`]).
    pub(super) async fn forget_metadata(&self, claim: &ClaimRef) -> Result<(), ClaimError> {
        let Some(writer) = self.gpu().config.device_metadata.clone() else {
            return Ok(());
        };
        let (namespace, name) = (claim.namespace.clone(), claim.name.clone());
        on_blocking_thread(claim, "removing the claim's device metadata", move || {
            writer.clear(&namespace, &name).map_err(|e| e.to_string())
        })
        .await
    }

    /// Removes what the claim-user hook recorded of `claim`'s containers
    /// ([`crate::claim_users::ClaimUsers::clear`]).
    pub(super) async fn forget_users(&self, claim: &ClaimRef) -> Result<(), ClaimError> {
        let Some(users) = self.gpu().config.claim_users.clone() else {
            return Ok(());
        };
        let uid = claim.uid.clone();
        on_blocking_thread(claim, "removing the claim's user records", move || {
            users.clear(&uid).map_err(|e| e.to_string())
        })
        .await
    }

    /// Reads the claim from the API server and plans its devices, sharing and CDI spec.
    async fn plan_claim(&self, claim: &ClaimRef) -> Result<Planned<Gpu<C, H>>, ClaimError> {
        let rc = self
            .gpu()
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
        Ok(Planned {
            devices: plan.all_devices(),
            spec: plan.spec.clone(),
            // Two phases only where prepare changes the hardware (creates a MIG device, sets a
            // GPU's sharing).
            two_phase: plan::changes_hardware(&plan.devices, &plan.used),
            plan,
        })
    }

    /// The hardware step: prepares each device under its GPU's lock, records the MIG devices
    /// it created (durable before anything else: from then on a failure or a crash destroys
    /// exactly these; a crash before leaves orphans for start-up), then computes the CDI spec
    /// where it needed them.
    async fn prepare_hardware(
        &self,
        claim: &ClaimRef,
        plan: plan::Plan,
    ) -> Result<Prepared<RecordedDevice>, ClaimError> {
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
        let writer = self.gpu().config.device_metadata.clone();
        let all = plan.all_devices();
        let spec = match plan.spec {
            Some(spec) => Ok(spec),
            None => {
                let used: Vec<&NodeDevice> = plan.used.iter().collect();
                self.spec(claim, &used, &created, &all, &plan.claim_hooks)
                    .map(|mut spec| {
                        plan::add_metadata_mounts(
                            &mut spec,
                            claim,
                            writer.as_deref(),
                            plan.metadata.as_ref(),
                        );
                        spec
                    })
            }
        };
        // The device metadata files the spec mounts, before the spec is written.
        if let (Some(writer), Some(metadata), Ok(_)) = (&writer, &plan.metadata, &spec) {
            self.write_metadata(claim, writer, metadata, &created)
                .await?;
        }
        // The devices as prepared: a created MIG device is reached by its own UUID.
        let mut devices = all;
        for d in &mut devices {
            if let Some(m) = created.get(&d.device_name) {
                d.uuid.clone_from(&m.uuid);
                d.mig = Some(m.clone());
            }
        }
        if !created.is_empty() {
            let record_spec = spec.as_ref().ok().cloned();
            self.lifecycle
                .update(claim, |c| {
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
        Ok(Prepared {
            devices,
            spec: spec?,
        })
    }
}

/// Runs `work` (file I/O) on a blocking thread; its failure, or the task's, is `claim`'s
/// [`dra_plugin::lifecycle::Error::TaskFailed`] naming `action`.
async fn on_blocking_thread(
    claim: &ClaimRef,
    action: &'static str,
    work: impl FnOnce() -> Result<(), String> + Send + 'static,
) -> Result<(), ClaimError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r)
        .map_err(|message| {
            ClaimError::Lifecycle(dra_plugin::lifecycle::Error::TaskFailed {
                claim: claim.clone(),
                action,
                message,
            })
        })
}
