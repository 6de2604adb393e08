//! Shares of a device allocated through consumable capacity (KEP-5075; fractional GPUs,
//! [`gpu_inventory::shares`]): each claim's share is prepared on its own, under one MPS control
//! daemon per GPU (or MIG device) that serves every share on it.
//!
//! - The daemon of a device is keyed by its UUID, lower-cased ([`daemon_key`]): its directories
//!   are `<mps root>/<key>/{pipe,log,shm}` and, with daemon Pods, its Pod is
//!   `mps-control-daemon-<key>`. It starts without default limits; its ceiling follows.
//! - It is started by the first share's prepare and stopped by the last share's unprepare, both
//!   under the GPU's lock, deciding from the checkpoint (which holds every claim being prepared
//!   or prepared): a share being prepared while the last other one is unprepared either finds
//!   the daemon running or starts it after the stop; shares being unprepared need no daemon, so
//!   the last two unprepared at once stop it.
//! - Each share's containers get their own limits through their CDI device's edits
//!   ([`crate::mps::MpsControl::share_edits`]): the pinned device memory limit from
//!   `consumedCapacity.memory` and the active thread percentage from `computePercent`.
//! - The daemon starts root's MPS server at once (`start_server -uid 0`), so that on the GPU in
//!   `EXCLUSIVE_PROCESS` the server holds the one context before any client connects.
//! - The daemon holds a server-side ceiling no client can raise ([`ceiling`],
//!   [`crate::mps::MpsControl::set_ceiling`]): the largest share's memory and the largest
//!   thread percentage among the device's shares (100 when one reserved none), set at every
//!   share's prepare before its containers start and lowered when a share goes. Legacy MPS runs
//!   one server for all shares of a GPU, so this is the strongest server-side limit it allows:
//!   a tenant that raises its own variables gets at most the largest share, not the GPU.
//! - At the `kernel` level (the controller has [`crate::memory_limits::KernelMemory`]) the
//!   daemon runs on MPS v3 instead: no ceiling and no `start_server`; each share gets its own
//!   namespace with its limits (set at its prepare, deleted at its unprepare; all recorded
//!   shares' namespaces set again when a dead daemon is started again), and its containers
//!   reach only that namespace's socket ([`crate::mps::MpsControl::namespace_edits`]).
//!   Start-up deletes the namespaces of claims it does not keep.
//! - A share holding the whole device (a request without capacity) runs without MPS.
//! - Start-up keeps the daemons of recorded shares (and starts a lost one again); a daemon no
//!   share needs is stopped as an orphan.

use std::collections::BTreeSet;

use dra_kubelet::ClaimRef;
use tracing::info;

use super::error::ClaimError;
use super::{ClaimController, Cluster};
use crate::checkpoint::{Checkpoint, ClaimState, RecordedDevice, RecordedShare};
use crate::hardware::Hardware;
use crate::mps::{Liveness, Protocol};
use gpu_inventory::backend::ComputeMode;

/// The MPS daemon key of the device with `uuid` (a GPU or MIG UUID): lower-cased, so it is a
/// valid Pod name and label value.
pub(crate) fn daemon_key(uuid: &str) -> String {
    uuid.to_ascii_lowercase()
}

/// The devices among `devices` whose share runs under their device's MPS daemon.
pub(crate) fn mps_shares(devices: &[RecordedDevice]) -> impl Iterator<Item = &RecordedDevice> {
    devices
        .iter()
        .filter(|d| d.share.as_ref().is_some_and(|s| s.uses_mps()))
}

/// The daemon keys the shares recorded in `checkpoint` need, leaving out claim `except`. A claim
/// being unprepared (`UnprepareStarted`) needs none: the kubelet unprepares once the claim's
/// containers are gone, and two last shares unprepared at once must not each keep the daemon
/// for the other.
pub(crate) fn needed_daemons(checkpoint: &Checkpoint, except: Option<&str>) -> BTreeSet<String> {
    checkpoint
        .claims
        .iter()
        .filter(|(uid, r)| Some(uid.as_str()) != except && r.state != ClaimState::UnprepareStarted)
        .flat_map(|(_, r)| mps_shares(&r.devices).map(|d| daemon_key(&d.uuid)))
        .collect()
}

/// The server-side ceiling of daemon `key` for `shares` (the shares recorded on its device):
/// the largest memory in MiB (rounded down) and the largest thread percentage, 100 when a share
/// reserved none (it runs uncapped). `None` without shares.
pub(crate) fn ceiling<'r>(
    shares: impl IntoIterator<Item = &'r RecordedShare>,
) -> Option<crate::mps::Ceiling> {
    let mut found: Option<crate::mps::Ceiling> = None;
    for s in shares {
        let threads = if s.compute_percent == 0 {
            100
        } else {
            s.compute_percent.min(100)
        };
        let c = found.get_or_insert(crate::mps::Ceiling {
            pinned_mib: 0,
            active_thread_percentage: 0,
        });
        c.pinned_mib = c.pinned_mib.max(s.memory_bytes >> 20);
        c.active_thread_percentage = c.active_thread_percentage.max(threads);
    }
    found
}

/// The shares recorded in `checkpoint` under daemon `key` (leaving out claim `except` and
/// claims being unprepared), with `extra` (a claim's own, perhaps not yet recorded).
fn shares_of<'r>(
    checkpoint: &'r Checkpoint,
    key: &str,
    except: &str,
    extra: Option<&'r RecordedShare>,
) -> Vec<&'r RecordedShare> {
    claims_on(checkpoint, key, except)
        .into_iter()
        .map(|(_, s)| s)
        .chain(extra)
        .collect()
}

/// The claims with a share recorded in `checkpoint` under daemon `key` (leaving out claim
/// `except` and claims being unprepared): UID and share.
fn claims_on<'r>(
    checkpoint: &'r Checkpoint,
    key: &str,
    except: &str,
) -> Vec<(&'r str, &'r RecordedShare)> {
    checkpoint
        .claims
        .iter()
        .filter(|(uid, r)| uid.as_str() != except && r.state != ClaimState::UnprepareStarted)
        .flat_map(|(uid, r)| mps_shares(&r.devices).map(move |d| (uid.as_str(), d)))
        .filter(|(_, d)| daemon_key(&d.uuid) == key)
        .filter_map(|(uid, d)| Some((uid, d.share.as_ref()?)))
        .collect()
}

/// A share's MPS v3 namespace limits: its memory (whole MiB, rounded down) and its thread
/// percentage (none when it reserved no compute).
fn namespace_limits(share: &RecordedShare) -> crate::mps::NamespaceLimits {
    crate::mps::NamespaceLimits {
        pinned_mib: (share.memory_bytes >> 20).max(1),
        active_thread_percentage: (share.compute_percent > 0)
            .then(|| share.compute_percent.min(100)),
    }
}

/// Refuses the shares among a claim's planned `devices` (with their sharing resolved; the index
/// of each in the allocation's `results` in `result_index`) that this driver cannot prepare,
/// naming the result:
/// - a share smaller than its device with a sharing config (TimeSlicing, MPS): a second,
///   conflicting source of limits, which are per GPU, not per share (a share holding the whole
///   device is exclusive and takes configs as any device does);
/// - shares of two devices, or a share beside a device under the claim's own MPS daemon: a
///   container reaches one MPS daemon (one pipe directory).
///
/// # Errors
/// [`ClaimError::Share`] for the first such result.
pub(crate) fn check(
    claim: &ClaimRef,
    devices: &[RecordedDevice],
    result_index: &[usize],
) -> Result<(), ClaimError> {
    let refuse = |i: usize, problem: String| ClaimError::Share {
        claim: claim.clone(),
        index: result_index.get(i).copied().unwrap_or(i),
        device: devices[i].device_name.clone(),
        problem,
    };
    let mut shares = devices
        .iter()
        .enumerate()
        .filter(|(_, d)| d.share.as_ref().is_some_and(RecordedShare::uses_mps));
    let Some((first, _)) = shares.next() else {
        return Ok(());
    };
    if let Some((i, _)) = std::iter::once((first, &devices[first]))
        .chain(shares.clone())
        .find(|(_, d)| d.sharing.is_some())
    {
        return Err(refuse(
            i,
            "shareID is set and consumedCapacity is less than the whole device (a share, \
             limited by its consumedCapacity), but a sharing config (TimeSlicing or MPS) also \
             applies to it: remove the config (a share's memory and compute come from its \
             capacity requests), or request the whole device"
                .into(),
        ));
    }
    if let Some((second, _)) = shares.next() {
        return Err(refuse(
            second,
            format!(
                "this claim already holds a share of device {:?}: a claim may hold shares of \
                 one device only, since a container can reach one MPS daemon",
                devices[first].device_name
            ),
        ));
    }
    if super::plan::uses_mps(devices) {
        return Err(refuse(
            first,
            "a share runs under its device's MPS daemon, and another device of this claim is \
             configured for MPS with the claim's own daemon: a container can reach one MPS \
             daemon"
                .into(),
        ));
    }
    Ok(())
}

impl<C: Cluster, H: Hardware> ClaimController<C, H> {
    /// Makes sure the MPS daemon of every device `devices` hold a share of is running: started
    /// (without default limits) when confirmed dead, under each device's GPU lock, and sets its
    /// ceiling for the shares it now serves ([`ceiling`]). One whose
    /// state cannot be told (a slow answer) is left alone and fails the call, to be retried:
    /// quitting it would cut every running share of the GPU off its daemon. Returns whether one
    /// was started.
    pub(super) async fn start_share_daemons(
        &self,
        claim: &ClaimRef,
        devices: &[RecordedDevice],
    ) -> Result<bool, ClaimError> {
        let mut started = false;
        for d in mps_shares(devices) {
            let key = daemon_key(&d.uuid);
            let _guard = self.share_lock(&d.device_name).await;
            let mps = &self.gpu().config.mps;
            let mps_error = |source| ClaimError::Mps {
                claim: claim.clone(),
                source,
            };
            let v3 = self.gpu().config.kernel_memory.is_some();
            let wanted = if v3 { Protocol::V3 } else { Protocol::Legacy };
            match mps.liveness(&key).await {
                Liveness::Answering => {
                    // A daemon of the other protocol serves shares prepared before the level
                    // changed: it keeps them, and this share waits (retried) until it is gone.
                    let running = mps
                        .protocol(&key)
                        .await
                        .map_err(mps_error)?
                        .unwrap_or(Protocol::Legacy);
                    if running != wanted {
                        return Err(mps_error(crate::mps::MpsError::ProtocolMismatch {
                            pipe_dir: mps.pipe_dir(&key),
                            running,
                            wanted,
                        }));
                    }
                    if !v3 {
                        self.set_ceiling(claim, &key, d.share.as_ref(), None)
                            .await?;
                    } else if let Some(share) = &d.share {
                        self.set_namespace(claim, &key, &claim.uid, share).await?;
                    }
                    continue;
                }
                Liveness::Dead => {}
                Liveness::Unknown(problem) => {
                    return Err(mps_error(crate::mps::MpsError::Unresponsive {
                        pipe_dir: mps.pipe_dir(&key),
                        problem,
                    }));
                }
            }
            let served = [crate::mps::MpsDevice {
                uuid: d.uuid.clone(),
                pinned_memory_limit_bytes: None,
            }];
            // No CUDA process may bypass the daemon ([`super::exclusive`]).
            self.compute_mode_locked(claim, &d.device_name, ComputeMode::ExclusiveProcess)
                .await?;
            let start = if v3 {
                mps.start_v3(&key, &d.uuid).await
            } else {
                mps.start(&key, &served, None).await
            };
            if let Err(e) = start {
                if let Err(e) = self
                    .compute_mode_locked(claim, &d.device_name, ComputeMode::Default)
                    .await
                {
                    tracing::warn!(claim = %claim, error = %e,
                        "restoring the GPU's compute mode after a failed daemon start failed");
                }
                return Err(mps_error(e));
            }
            started = true;
            info!(claim = %claim, device = %d.device_name, daemon = %key, v3,
                "started the device's MPS daemon");
            if v3 {
                self.set_all_namespaces(claim, &key, d.share.as_ref())
                    .await?;
                continue;
            }
            self.set_ceiling(claim, &key, d.share.as_ref(), None)
                .await?;
            // Root's server at once, with the ceiling as its defaults, so that it holds the
            // GPU's one context before any client comes. Best effort: without it MPS starts
            // the server at the first client's connection, as it always did.
            if let Err(e) = mps.start_server(&key, 0).await {
                tracing::warn!(claim = %claim, daemon = %key, error = %e,
                    "starting the device's MPS server ahead of its clients failed; a process \
                     that bypasses MPS may take the GPU until the first client connects");
            }
        }
        Ok(started)
    }

    /// Stops the MPS daemon of every device `devices` hold a share of that no other claim's
    /// share needs any more. Under each device's GPU lock.
    pub(super) async fn stop_share_daemons(
        &self,
        claim: &ClaimRef,
        devices: &[RecordedDevice],
    ) -> Result<(), ClaimError> {
        for d in mps_shares(devices) {
            let key = daemon_key(&d.uuid);
            let _guard = self.share_lock(&d.device_name).await;
            let needed =
                needed_daemons(&*self.lifecycle.journal().records().await, Some(&claim.uid));
            // The daemon's own protocol decides (it may predate the node's level).
            let v3_daemon = matches!(
                self.gpu().config.mps.protocol(&key).await,
                Ok(Some(Protocol::V3))
            );
            if needed.contains(&key) && v3_daemon {
                // The share's namespace goes with it; the daemon serves the others.
                let name = crate::mps::namespace_name(&claim.uid);
                self.gpu()
                    .config
                    .mps
                    .delete_namespace(&key, &name)
                    .await
                    .map_err(|source| ClaimError::Mps {
                        claim: claim.clone(),
                        source,
                    })?;
                info!(claim = %claim, daemon = %key, namespace = %name,
                    "deleted the share's MPS namespace");
                continue;
            }
            if needed.contains(&key) {
                // The others' ceiling, for clients connecting from now on; the share going
                // needs none, so a failure only leaves the higher ceiling.
                if let Err(e) = self.set_ceiling(claim, &key, None, Some(&claim.uid)).await {
                    tracing::warn!(claim = %claim, daemon = %key, error = %e,
                        "lowering the daemon's ceiling after a share left failed");
                }
                continue;
            }
            // The mode first: a crash before the stop leaves the daemon, an orphan at start-up.
            self.compute_mode_locked(claim, &d.device_name, ComputeMode::Default)
                .await?;
            self.gpu()
                .config
                .mps
                .stop(&key)
                .await
                .map_err(|source| ClaimError::Mps {
                    claim: claim.clone(),
                    source,
                })?;
            info!(claim = %claim, device = %d.device_name, daemon = %key,
                "stopped the device's MPS daemon with its last share");
        }
        Ok(())
    }

    /// Sets daemon `key`'s ceiling ([`ceiling`]) for the shares recorded on it, leaving out
    /// claim `except` and adding `extra`; under the GPU's lock (the caller's).
    async fn set_ceiling(
        &self,
        claim: &ClaimRef,
        key: &str,
        extra: Option<&RecordedShare>,
        except: Option<&str>,
    ) -> Result<(), ClaimError> {
        let ceiling = {
            let checkpoint = self.lifecycle.journal().records().await;
            ceiling(shares_of(&checkpoint, key, except.unwrap_or(""), extra))
        };
        let Some(ceiling) = ceiling else {
            return Ok(());
        };
        self.gpu()
            .config
            .mps
            .set_ceiling(key, ceiling)
            .await
            .map_err(|source| ClaimError::Mps {
                claim: claim.clone(),
                source,
            })?;
        info!(claim = %claim, daemon = %key, %ceiling, "set the device's MPS ceiling");
        Ok(())
    }

    /// Makes the MPS v3 namespace of claim `uid`'s `share` on daemon `key` hold the share's
    /// limits ([`crate::mps::MpsControl::set_namespace`]); under the GPU's lock (the caller's).
    async fn set_namespace(
        &self,
        claim: &ClaimRef,
        key: &str,
        uid: &str,
        share: &RecordedShare,
    ) -> Result<(), ClaimError> {
        let mps_error = |source| ClaimError::Mps {
            claim: claim.clone(),
            source,
        };
        let name = crate::mps::namespace_name(uid);
        let limits = namespace_limits(share);
        self.gpu()
            .config
            .mps
            .set_namespace(key, &name, limits)
            .await
            .map_err(mps_error)?;
        info!(claim = %claim, daemon = %key, namespace = %name, ?limits,
            "set the share's MPS namespace");
        Ok(())
    }

    /// After daemon `key` started (again): the namespaces of every share recorded on it and of
    /// `claim`'s own `share`, so that the running shares' containers find theirs again where
    /// they have it mounted. Another claim's failure is logged (its own revival retries it);
    /// `claim`'s fails the call.
    async fn set_all_namespaces(
        &self,
        claim: &ClaimRef,
        key: &str,
        share: Option<&RecordedShare>,
    ) -> Result<(), ClaimError> {
        let others: Vec<(String, RecordedShare)> = {
            let checkpoint = self.lifecycle.journal().records().await;
            claims_on(&checkpoint, key, &claim.uid)
                .into_iter()
                .map(|(uid, s)| (uid.to_owned(), s.clone()))
                .collect()
        };
        for (uid, s) in &others {
            if let Err(e) = self.set_namespace(claim, key, uid, s).await {
                tracing::warn!(claim = %uid, daemon = %key, error = %e,
                    "restoring a share's MPS namespace after its daemon started failed; \
                     retried when that claim's daemon is checked");
            }
        }
        match share {
            Some(s) => self.set_namespace(claim, key, &claim.uid, s).await,
            None => Ok(()),
        }
    }

    /// Deletes the MPS v3 namespaces on the share daemons `keys` that no claim in `kept` owns
    /// (a claim unprepared while the plugin was down). Returns what was deleted, as
    /// `<daemon>/<namespace>`; failures are logged and retried at the next start.
    pub(super) async fn remove_orphan_namespaces(
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
            if mps.liveness(key).await != Liveness::Answering
                || !matches!(mps.protocol(key).await, Ok(Some(Protocol::V3)))
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
                    .find(|(_, d)| daemon_key(d.visible_id()) == *key)
                    .map_or_else(|| key.clone(), |(name, _)| name.clone())
            };
            for (name, _) in names.into_iter().filter(|(n, _)| !owned.contains(n)) {
                let _guard = self.share_lock(&device).await;
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

    /// The lock of the GPU behind device `name` (the device itself when unknown), taken before
    /// a share daemon is started or stopped.
    async fn share_lock(&self, name: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let gpu = self
            .catalogue()
            .get(name)
            .map_or_else(|| name.to_owned(), |d| d.gpu().name.clone());
        self.gpu_lock(&gpu).lock_owned().await
    }
}
