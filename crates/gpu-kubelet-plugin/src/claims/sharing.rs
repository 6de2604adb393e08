//! Sharing of a claim's devices, applied after the hardware step and undone before it
//! ([`dra_plugin::lifecycle::Driver::configure`], [`dra_plugin::lifecycle::Driver::unconfigure`]):
//! time slices, the claim's own MPS daemon (its GPUs in `EXCLUSIVE_PROCESS`), and its shares'
//! devices' daemons (`shares.rs`); the `kernel` level's memory limits; and starting again the
//! daemons of prepared claims that died.

use std::sync::Arc;

use dra_kubelet::ClaimRef;
use dra_plugin::lifecycle::Error as LifecycleError;
use gpu_inventory::backend::ComputeMode;
use tokio::sync::OwnedMutexGuard;
use tracing::{info, warn};

use super::{ClaimController, ClaimError, Cluster, plan, shares};
use crate::checkpoint::{ClaimState, RecordedDevice};
use crate::claim_config::{Sharing, TimeSlice};
use crate::hardware::Hardware;

impl<C: Cluster, H: Hardware> ClaimController<C, H> {
    /// Applies the sharing of `devices`: their GPUs' time slices, and the claim's MPS daemon
    /// for the devices configured for MPS (in device order, which is the daemon's ordinal order).
    pub(super) async fn share(
        &self,
        claim: &ClaimRef,
        devices: &[RecordedDevice],
    ) -> Result<(), ClaimError> {
        let slices: Vec<(String, TimeSlice)> = devices
            .iter()
            .filter_map(|d| match d.sharing {
                Some(Sharing::TimeSlicing { interval }) => Some((d.device_name.clone(), interval)),
                _ => None,
            })
            .collect();
        self.set_time_slices(claim, slices).await?;
        let (served, percentage) = claim_daemon_devices(devices);
        if !served.is_empty() {
            self.start_claim_daemon(claim, devices, &served, percentage)
                .await?;
        }
        // Shares (consumable capacity): their devices' daemons, shared with other claims.
        self.start_share_daemons(claim, devices).await.map(drop)
    }

    /// Starts again the MPS daemons of prepared `devices` that are confirmed dead
    /// ([`crate::mps::Liveness::Dead`]): the claim's own (under the claim's lock, which the
    /// caller holds) and its shares' devices' (each re-checked under its GPU's lock). A daemon
    /// that answers, or whose state cannot be told (a slow answer on a busy node), is left
    /// alone; the latter fails the call, to be retried. Directories stay as they are, so the
    /// bind mounts of running containers reach the new daemon. Returns whether one was started.
    pub(super) async fn revive_daemons(
        &self,
        claim: &ClaimRef,
        devices: &[RecordedDevice],
    ) -> Result<bool, ClaimError> {
        let mps = &self.gpu().config.mps;
        let mps_error = |source| ClaimError::Mps {
            claim: claim.clone(),
            source,
        };
        let mut started = false;
        let (served, percentage) = claim_daemon_devices(devices);
        if !served.is_empty() {
            match mps.liveness(&claim.uid).await {
                crate::mps::Liveness::Answering => {}
                crate::mps::Liveness::Dead => {
                    self.start_claim_daemon(claim, devices, &served, percentage)
                        .await?;
                    started = true;
                }
                crate::mps::Liveness::Unknown(problem) => {
                    return Err(mps_error(crate::mps::MpsError::Unresponsive {
                        pipe_dir: mps.pipe_dir(&claim.uid),
                        problem,
                    }));
                }
            }
        }
        Ok(self.start_share_daemons(claim, devices).await? || started)
    }

    /// Starts the claim's own MPS daemon for `served` (its MPS devices), with their full GPUs
    /// in `EXCLUSIVE_PROCESS` first ([`super::exclusive`]); on failure the modes are restored.
    async fn start_claim_daemon(
        &self,
        claim: &ClaimRef,
        devices: &[RecordedDevice],
        served: &[crate::mps::MpsDevice],
        percentage: Option<u32>,
    ) -> Result<(), ClaimError> {
        let names = mps_device_names(devices);
        let mut result = Ok(());
        for name in &names {
            result = self
                .compute_mode(claim, name, ComputeMode::ExclusiveProcess)
                .await;
            if result.is_err() {
                break;
            }
        }
        if result.is_ok() {
            result = self
                .gpu()
                .config
                .mps
                .start(&claim.uid, served, percentage)
                .await
                .map_err(|source| ClaimError::Mps {
                    claim: claim.clone(),
                    source,
                });
        }
        if result.is_err() {
            for name in &names {
                if let Err(e) = self.compute_mode(claim, name, ComputeMode::Default).await {
                    warn!(claim = %claim, error = %e, "restoring a GPU's compute mode failed");
                }
            }
        }
        result
    }

    /// Undoes [`Self::share`]: stops the claim's MPS daemon (if any is running), the daemons of
    /// its shares' devices that no other share needs, and puts time-sliced GPUs back to the
    /// default slice. Safe when nothing was applied.
    pub(super) async fn unshare(
        &self,
        claim: &ClaimRef,
        devices: &[RecordedDevice],
    ) -> Result<(), ClaimError> {
        // The containers are gone: their limits first, while the records say where.
        self.clear_memory_limits(claim).await?;
        self.stop_share_daemons(claim, devices).await?;
        // The modes first: a crash before the stop leaves the daemon, an orphan at start-up.
        for name in mps_device_names(devices) {
            self.compute_mode(claim, &name, ComputeMode::Default)
                .await?;
        }
        self.gpu()
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

    /// Clears the memory limits the `kernel` level's hook set for `claim`'s containers
    /// ([`crate::memory_limits::KernelMemory::clear_claim`]); nothing at the `mps` level.
    pub(super) async fn clear_memory_limits(&self, claim: &ClaimRef) -> Result<(), ClaimError> {
        let Some(kernel) = self.gpu().config.kernel_memory.clone() else {
            return Ok(());
        };
        let hardware = Arc::clone(&self.gpu().hardware);
        let uid = claim.uid.clone();
        let cleared =
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
                })?;
        if cleared > 0 {
            info!(claim = %claim, cleared, "cleared the share containers' GPU memory limits");
        }
        Ok(())
    }

    /// Sets each named device's GPU time slice, under the GPU locks.
    async fn set_time_slices(
        &self,
        claim: &ClaimRef,
        slices: Vec<(String, TimeSlice)>,
    ) -> Result<(), ClaimError> {
        for (name, slice) in slices {
            let Some(device) = self.catalogue().get(&name).cloned() else {
                continue;
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
                })?,
                Err(e) => {
                    return Err(ClaimError::Lifecycle(LifecycleError::TaskFailed {
                        claim: claim.clone(),
                        action: "time-slice setting",
                        message: format!("device {name}: {e}"),
                    }));
                }
            }
        }
        Ok(())
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
                    crate::mps::Liveness::Answering => {}
                    crate::mps::Liveness::Dead => dead = true,
                    // A slow answer is no evidence of death: never quit or replace on it.
                    crate::mps::Liveness::Unknown(problem) => {
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
                Ok(true) => {
                    warn!(claim = %claim, "the claim's MPS daemon had stopped answering; started it again");
                    restarted.push(uid);
                }
                Ok(false) => {}
                Err(e) => warn!(claim = %claim, error = %e,
                    "restarting the claim's MPS daemon failed; retrying at the next check"),
            }
        }
        restarted
    }
}

/// The names of the devices under the claim's own MPS daemon.
pub(super) fn mps_device_names(devices: &[RecordedDevice]) -> Vec<String> {
    devices
        .iter()
        .filter(|d| matches!(d.sharing, Some(Sharing::Mps(_))))
        .map(|d| d.device_name.clone())
        .collect()
}

/// The devices of the claim's own MPS daemon (those an MPS sharing config covers, in device
/// order, which is the daemon's ordinal order), each with its pinned limit, and the daemon's
/// thread percentage (the config resolution refuses claims whose requests disagree on it).
fn claim_daemon_devices(devices: &[RecordedDevice]) -> (Vec<crate::mps::MpsDevice>, Option<u32>) {
    let mut percentage = None;
    let served = devices
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
    (served, percentage)
}
