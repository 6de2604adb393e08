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
use crate::checkpoint::Checkpoint;
use crate::claim_config::Sharing;
use crate::hardware::{Hardware, NodeDevice};

/// The full GPUs (by GPU name) on which the claims recorded in `checkpoint` run an MPS daemon:
/// a claim's own (an MPS sharing config) or a share's.
pub(crate) fn gpus_under_mps(
    checkpoint: &Checkpoint,
    catalogue: &super::Catalogue,
) -> BTreeSet<String> {
    checkpoint
        .claims
        .values()
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
            let hw = Arc::clone(&self.gpu().hardware);
            let gpu = d.gpu().clone();
            let mode = self
                .lifecycle
                .background()
                .spawn_blocking(move || hw.compute_mode(&gpu))
                .await;
            match mode {
                // Only the mode this plugin sets: an administrator's PROHIBITED stays.
                Ok(Ok(ComputeMode::ExclusiveProcess)) => {}
                Ok(Ok(_)) => continue,
                Ok(Err(e)) => {
                    warn!(device = d.name(), error = %e, "cannot read the GPU's compute mode");
                    continue;
                }
                Err(e) => {
                    warn!(device = d.name(), error = %e, "reading the compute mode failed");
                    continue;
                }
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
