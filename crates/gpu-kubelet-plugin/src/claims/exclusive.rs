//! No bypass of MPS: a full GPU that hosts an MPS daemon (a GPU's share daemon, or a claim's own
//! daemon) is in compute mode `EXCLUSIVE_PROCESS` while the daemon runs, and back in `DEFAULT`
//! once it is gone.
//!
//! Why: a CUDA process that cannot reach an MPS control daemon (it unset
//! `CUDA_MPS_PIPE_DIRECTORY`, or pointed it elsewhere) runs without MPS, on the whole GPU, with
//! none of its share's limits. In `EXCLUSIVE_PROCESS` the GPU admits one context, the MPS
//! server's, so such a process gets no context at all (NVIDIA's MPS guide, "Provisioning
//! Sequence"; `nvmlDeviceSetComputeMode`).
//!
//! - Set before the daemon starts, under the GPU's lock; restored to `DEFAULT` before the
//!   daemon that needed it is stopped (a crash in between leaves the daemon's directory, which
//!   start-up treats as an orphan), and by start-up for every full GPU no recorded claim runs
//!   MPS on and that is in `EXCLUSIVE_PROCESS` ([`ClaimController::restore_compute_modes`]); an
//!   administrator's `PROHIBITED` is left alone.
//! - MIG devices are left alone: the compute mode belongs to the parent GPU, whose other MIG
//!   devices run other claims' processes, which `EXCLUSIVE_PROCESS` would limit to one each.
//!   A share of a MIG device is bounded by the MIG device itself (its memory and engines), not
//!   by its share's limits, against a tenant that bypasses MPS (README, "Shares").

use std::collections::BTreeSet;
use std::sync::Arc;

use dra_kubelet::ClaimRef;
use dra_plugin::lifecycle::Error as LifecycleError;
use gpu_inventory::backend::ComputeMode;
use tracing::warn;

use super::error::ClaimError;
use super::{ClaimController, Cluster};
use crate::checkpoint::{Checkpoint, ClaimRecord, ClaimState};
use crate::claim_config::Sharing;
use crate::hardware::{Hardware, NodeDevice};

/// The full GPUs (by GPU name) on which the claims recorded in `checkpoint` run an MPS daemon:
/// a claim's own (an MPS sharing config) or a share's.
pub(crate) fn gpus_under_mps(
    checkpoint: &Checkpoint,
    catalogue: &super::Catalogue,
) -> BTreeSet<String> {
    gpus_under_mps_of(checkpoint.claims.values(), catalogue)
}

/// [`gpus_under_mps`] of the prepared claims alone (`PrepareCompleted`): the GPUs whose daemon
/// runs now and must, whatever happens to the claims being prepared or unprepared.
fn gpus_under_prepared_mps(
    checkpoint: &Checkpoint,
    catalogue: &super::Catalogue,
) -> BTreeSet<String> {
    gpus_under_mps_of(
        checkpoint
            .claims
            .values()
            .filter(|r| r.state == ClaimState::PrepareCompleted),
        catalogue,
    )
}

fn gpus_under_mps_of<'r>(
    records: impl Iterator<Item = &'r ClaimRecord>,
    catalogue: &super::Catalogue,
) -> BTreeSet<String> {
    records
        .flat_map(|r| &r.devices)
        .filter(|d| {
            matches!(d.sharing, Some(Sharing::Mps(_)))
                || d.share.as_ref().is_some_and(|s| s.uses_mps())
        })
        .filter_map(|d| catalogue.get(&d.device_name))
        .filter(|n| !n.is_mig())
        .map(|n| n.gpu().name.clone())
        .collect()
}

impl<C: Cluster, H: Hardware> ClaimController<C, H> {
    /// Sets the compute mode of the GPU of device `name` to `mode` when the device is a full
    /// GPU (see the module docs); nothing for a MIG device or an unknown one. For a caller
    /// holding the GPU's lock. Runs on the blocking pool (NVML).
    pub(super) async fn compute_mode_locked(
        &self,
        claim: &ClaimRef,
        name: &str,
        mode: ComputeMode,
    ) -> Result<(), ClaimError> {
        let Some(device) = self.catalogue().get(name).cloned() else {
            return Ok(());
        };
        if device.is_mig() {
            return Ok(());
        }
        let hw = Arc::clone(&self.gpu().hardware);
        let gpu = device.gpu().clone();
        match self
            .lifecycle
            .background()
            .spawn_blocking(move || hw.set_compute_mode(&gpu, mode))
            .await
        {
            Ok(r) => r.map_err(|source| ClaimError::Hardware {
                claim: claim.clone(),
                source,
            }),
            Err(e) => Err(ClaimError::Lifecycle(LifecycleError::TaskFailed {
                claim: claim.clone(),
                action: "compute-mode setting",
                message: format!("device {name}: {e}"),
            })),
        }
    }

    /// The compute mode of full GPU `d`, read on the blocking pool (NVML); `None` when it
    /// cannot be read (logged).
    async fn read_compute_mode(&self, d: &NodeDevice) -> Option<ComputeMode> {
        let hw = Arc::clone(&self.gpu().hardware);
        let gpu = d.gpu().clone();
        match self
            .lifecycle
            .background()
            .spawn_blocking(move || hw.compute_mode(&gpu))
            .await
        {
            Ok(Ok(mode)) => Some(mode),
            Ok(Err(e)) => {
                warn!(device = d.name(), error = %e, "cannot read the GPU's compute mode");
                None
            }
            Err(e) => {
                warn!(device = d.name(), error = %e, "reading the compute mode failed");
                None
            }
        }
    }

    /// The periodic check: puts back in [`ComputeMode::ExclusiveProcess`] every full GPU that a
    /// prepared claim runs an MPS daemon on and that left that mode behind the plugin's back (a
    /// GPU reset, `nvidia-smi -c`): else a process of any tenant could bypass the daemon and
    /// take the whole GPU. Each GPU under its lock, re-checked there against the records (a
    /// claim being unprepared may have just stopped the daemon). Failures are logged and tried
    /// again at the next check. Returns the GPUs put right.
    pub async fn reassert_compute_modes(&self) -> Vec<String> {
        let catalogue = self.catalogue();
        let node = ClaimRef {
            namespace: String::new(),
            name: "compute-mode check".into(),
            uid: String::new(),
        };
        let wanted =
            gpus_under_prepared_mps(&*self.lifecycle.journal().records().await, &catalogue);
        let mut put_right = Vec::new();
        for name in wanted {
            let Some(d) = catalogue
                .devices
                .values()
                .find(|d| !d.is_mig() && d.gpu().name == name)
                .cloned()
            else {
                continue;
            };
            let _guard = self.gpu_lock(&name).lock_owned().await;
            let still =
                gpus_under_prepared_mps(&*self.lifecycle.journal().records().await, &catalogue)
                    .contains(&name);
            if !still {
                continue;
            }
            match self.read_compute_mode(&d).await {
                None | Some(ComputeMode::ExclusiveProcess) => continue,
                Some(found) => {
                    warn!(device = %name, ?found,
                        "a GPU hosting an MPS daemon left EXCLUSIVE_PROCESS behind the plugin's \
                         back; setting it again");
                }
            }
            match self
                .compute_mode_locked(&node, d.name(), ComputeMode::ExclusiveProcess)
                .await
            {
                Ok(()) => put_right.push(name),
                Err(e) => warn!(device = d.name(), error = %e,
                    "setting EXCLUSIVE_PROCESS again failed; retried at the next check"),
            }
        }
        put_right
    }

    /// Start-up: puts every full GPU no recorded claim runs MPS on back in
    /// [`ComputeMode::Default`] if it is in [`ComputeMode::ExclusiveProcess`], the mode this
    /// plugin sets (left by a crash between a daemon's stop and the restore, or by a previous
    /// plugin); another mode (an administrator's `PROHIBITED`) is left alone. Failures are
    /// logged; the next start tries again. Returns the GPUs restored.
    pub(super) async fn restore_compute_modes(&self, node: &ClaimRef) -> Vec<String> {
        let catalogue = self.catalogue();
        let needed = gpus_under_mps(&*self.lifecycle.journal().records().await, &catalogue);
        let gpus: Vec<NodeDevice> = catalogue
            .devices
            .values()
            .filter(|d| !d.is_mig() && !needed.contains(&d.gpu().name))
            .cloned()
            .collect();
        let mut restored = Vec::new();
        for d in gpus {
            let _guard = self.gpu_lock(&d.gpu().name).lock_owned().await;
            // Only the mode this plugin sets: an administrator's PROHIBITED stays.
            if self.read_compute_mode(&d).await != Some(ComputeMode::ExclusiveProcess) {
                continue;
            }
            match self
                .compute_mode_locked(node, d.name(), ComputeMode::Default)
                .await
            {
                Ok(()) => restored.push(d.gpu().name.clone()),
                Err(e) => warn!(device = d.name(), error = %e,
                    "restoring the GPU's default compute mode failed; retried at the next start"),
            }
        }
        restored
    }
}
