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
//!   daemon runs on MPS v3 instead: no ceiling, and root's server is started with the daemon by
//!   `server create` (the v3 form of `start_server`; a start whose server is not listed
//!   fails); each share gets its own
//!   namespace with its limits (set at its prepare, deleted at its unprepare; all recorded
//!   shares' namespaces set again when a dead daemon is started again), and its containers
//!   reach only that namespace's socket ([`crate::mps::MpsControl::namespace_edits`]).
//!   Start-up deletes the namespaces of claims it does not keep.
//! - A share holding the whole device (a request without capacity) runs without MPS.
//! - Start-up keeps the daemons of recorded shares (and starts a lost one again); a daemon no
//!   share needs is stopped as an orphan.

use std::collections::BTreeSet;

use dra_kubelet::ClaimRef;
use futures::future::BoxFuture;
use gpu_inventory::backend::ComputeMode;
use tracing::{info, warn};

use super::{Daemons, Node, Strategy, mps_error};
use crate::checkpoint::{Checkpoint, ClaimState, RecordedDevice, RecordedShare};
use crate::claims::ClaimError;
use crate::mps::{Liveness, MpsDevice, MpsError, Protocol};

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
pub(crate) fn claims_on<'r>(
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
    if crate::claims::plan::uses_mps(devices) {
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

/// The shares strategy over `N` and `D`: the daemons of the devices a claim holds shares of.
pub(crate) struct ShareDaemons<'a, N, D> {
    node: &'a N,
    daemons: &'a D,
    /// The `kernel` level: daemons speak MPS v3, each share its own namespace.
    v3: bool,
}

impl<'a, N: Node, D: Daemons> ShareDaemons<'a, N, D> {
    /// The share daemons of `node`, run by `daemons`, MPS v3 ones when `v3`.
    pub(crate) fn new(node: &'a N, daemons: &'a D, v3: bool) -> Self {
        Self { node, daemons, v3 }
    }

    /// Makes sure the MPS daemon of every device `devices` hold a share of is running: started
    /// (without default limits) when confirmed dead, under each device's GPU lock, and sets its
    /// ceiling for the shares it now serves ([`ceiling`]), or the share's namespace. One whose
    /// state cannot be told (a slow answer) is left alone and fails the call, to be retried:
    /// quitting it would cut every running share of the GPU off its daemon. Returns whether one
    /// was started.
    ///
    /// A daemon of the other protocol (the node's level changed since it started) keeps the
    /// shares prepared under it: for a claim already `prepared` (revived at start-up, or
    /// prepared again by the kubelet) its per-share work is that daemon's (the ceiling, or the
    /// share's namespace), as its containers' CDI edits are; a new share waits for it to go
    /// ([`MpsError::ProtocolMismatch`]).
    async fn ensure(
        &self,
        claim: &ClaimRef,
        devices: &[RecordedDevice],
        prepared: bool,
    ) -> Result<bool, ClaimError> {
        let mut started = false;
        for d in mps_shares(devices) {
            let key = daemon_key(&d.uuid);
            let _guard = self.node.lock_gpu(&d.device_name).await;
            let wanted = if self.v3 {
                Protocol::V3
            } else {
                Protocol::Legacy
            };
            match self.daemons.liveness(&key).await {
                Liveness::Answering => {
                    // A daemon of the other protocol serves shares prepared before the level
                    // changed: it keeps them, and this share waits (retried) until it is gone.
                    let running = self
                        .daemons
                        .protocol(&key)
                        .await
                        .map_err(mps_error(claim))?
                        .unwrap_or(Protocol::Legacy);
                    if running != wanted && !prepared {
                        return Err(mps_error(claim)(MpsError::ProtocolMismatch {
                            pipe_dir: self.daemons.pipe_dir(&key),
                            running,
                            wanted,
                        }));
                    }
                    // Whichever branch: the mode may have been reset behind the plugin's back
                    // (a GPU reset, `nvidia-smi -c`, a failed stop of the last share's undo),
                    // and this share's containers must not be able to bypass the daemon.
                    self.node
                        .set_compute_mode(claim, &d.device_name, ComputeMode::ExclusiveProcess)
                        .await?;
                    if running == Protocol::Legacy {
                        self.set_ceiling(claim, &key, d.share.as_ref(), None)
                            .await?;
                    } else if let Some(share) = &d.share {
                        self.set_namespace(claim, &key, &claim.uid, share).await?;
                    }
                    continue;
                }
                Liveness::Dead => {}
                Liveness::Unknown(problem) => {
                    return Err(mps_error(claim)(MpsError::Unresponsive {
                        pipe_dir: self.daemons.pipe_dir(&key),
                        problem,
                    }));
                }
            }
            // No CUDA process may bypass the daemon (`claims/exclusive.rs`).
            self.node
                .set_compute_mode(claim, &d.device_name, ComputeMode::ExclusiveProcess)
                .await?;
            let start = if self.v3 {
                self.daemons.start_v3(&key, &d.uuid).await
            } else {
                let served = [MpsDevice {
                    uuid: d.uuid.clone(),
                    pinned_memory_limit_bytes: None,
                }];
                self.daemons.start(&key, &served, None).await
            };
            if let Err(e) = start {
                if let Err(e) = self
                    .node
                    .set_compute_mode(claim, &d.device_name, ComputeMode::Default)
                    .await
                {
                    warn!(claim = %claim, error = %e,
                        "restoring the GPU's compute mode after a failed daemon start failed");
                }
                return Err(mps_error(claim)(e));
            }
            started = true;
            info!(claim = %claim, device = %d.device_name, daemon = %key, v3 = self.v3,
                "started the device's MPS daemon");
            if self.v3 {
                // No `start_server` here: `start_v3` already started root's server ahead of any
                // client, with `server create drust --uid=0` (NVIDIA's MPS guide, release 615,
                // "Explicitly starting an MPS server": the v3 form of `start_server -uid`), and
                // failed the start unless `server list` then names it.
                self.set_all_namespaces(claim, &key, d.share.as_ref())
                    .await?;
                continue;
            }
            self.set_ceiling(claim, &key, d.share.as_ref(), None)
                .await?;
            // Root's server at once, with the ceiling as its defaults, so that it holds the
            // GPU's one context before any client comes. Best effort: without it MPS starts
            // the server at the first client's connection, as it always did.
            if let Err(e) = self.daemons.start_server(&key, 0).await {
                warn!(claim = %claim, daemon = %key, error = %e,
                    "starting the device's MPS server ahead of its clients failed; a process \
                     that bypasses MPS may take the GPU until the first client connects");
            }
        }
        Ok(started)
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
        let except = except.unwrap_or("");
        let extra = extra.cloned();
        let ceiling = self
            .node
            .with_records(|c| ceiling(shares_of(c, key, except, extra.as_ref())))
            .await;
        let Some(ceiling) = ceiling else {
            return Ok(());
        };
        self.daemons
            .set_ceiling(key, ceiling)
            .await
            .map_err(mps_error(claim))?;
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
        let name = crate::mps::namespace_name(uid);
        let limits = namespace_limits(share);
        self.daemons
            .set_namespace(key, &name, limits)
            .await
            .map_err(mps_error(claim))?;
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
        let others: Vec<(String, RecordedShare)> = self
            .node
            .with_records(|c| {
                claims_on(c, key, &claim.uid)
                    .into_iter()
                    .map(|(uid, s)| (uid.to_owned(), s.clone()))
                    .collect()
            })
            .await;
        for (uid, s) in &others {
            if let Err(e) = self.set_namespace(claim, key, uid, s).await {
                warn!(claim = %uid, daemon = %key, error = %e,
                    "restoring a share's MPS namespace after its daemon started failed; \
                     retried when that claim's daemon is checked");
            }
        }
        match share {
            Some(s) => self.set_namespace(claim, key, &claim.uid, s).await,
            None => Ok(()),
        }
    }
}

impl<N: Node, D: Daemons> Strategy for ShareDaemons<'_, N, D> {
    fn name(&self) -> &'static str {
        "share MPS daemons"
    }

    fn apply<'a>(
        &'a self,
        claim: &'a ClaimRef,
        devices: &'a [RecordedDevice],
    ) -> BoxFuture<'a, Result<(), ClaimError>> {
        Box::pin(async move { self.ensure(claim, devices, false).await.map(drop) })
    }

    /// Stops the MPS daemon of every device `devices` hold a share of that no other claim's
    /// share needs any more (its GPU's mode back to `DEFAULT` first); where others still need
    /// it, deletes this share's namespace (v3) or lowers the ceiling to theirs. Under each
    /// device's GPU lock, deciding from the records.
    fn undo<'a>(
        &'a self,
        claim: &'a ClaimRef,
        devices: &'a [RecordedDevice],
    ) -> BoxFuture<'a, Result<(), ClaimError>> {
        Box::pin(async move {
            for d in mps_shares(devices) {
                let key = daemon_key(&d.uuid);
                let _guard = self.node.lock_gpu(&d.device_name).await;
                let needed = self
                    .node
                    .with_records(|c| needed_daemons(c, Some(&claim.uid)).contains(&key))
                    .await;
                // The daemon's own protocol decides (it may predate the node's level).
                let v3_daemon = matches!(self.daemons.protocol(&key).await, Ok(Some(Protocol::V3)));
                if needed && v3_daemon {
                    // The share's namespace goes with it; the daemon serves the others.
                    let name = crate::mps::namespace_name(&claim.uid);
                    self.daemons
                        .delete_namespace(&key, &name)
                        .await
                        .map_err(mps_error(claim))?;
                    info!(claim = %claim, daemon = %key, namespace = %name,
                        "deleted the share's MPS namespace");
                    continue;
                }
                if needed {
                    // The others' ceiling, for clients connecting from now on; the share going
                    // needs none, so a failure only leaves the higher ceiling.
                    if let Err(e) = self.set_ceiling(claim, &key, None, Some(&claim.uid)).await {
                        warn!(claim = %claim, daemon = %key, error = %e,
                            "lowering the daemon's ceiling after a share left failed");
                    }
                    continue;
                }
                // The mode first: a crash before the stop leaves the daemon, an orphan at start-up.
                self.node
                    .set_compute_mode(claim, &d.device_name, ComputeMode::Default)
                    .await?;
                if let Err(e) = self.daemons.stop(&key).await {
                    // The daemon may still serve (a share prepared next finds it answering):
                    // the GPU goes back to EXCLUSIVE_PROCESS so nothing bypasses it meanwhile.
                    if let Err(m) = self
                        .node
                        .set_compute_mode(claim, &d.device_name, ComputeMode::ExclusiveProcess)
                        .await
                    {
                        warn!(claim = %claim, daemon = %key, error = %m,
                            "putting the GPU back in EXCLUSIVE_PROCESS after a failed daemon stop \
                             failed; the next share's prepare sets it");
                    }
                    return Err(mps_error(claim)(e));
                }
                info!(claim = %claim, device = %d.device_name, daemon = %key,
                    "stopped the device's MPS daemon with its last share");
            }
            Ok(())
        })
    }

    /// [`Self::apply`] again: a dead daemon is started (with every recorded share's namespace
    /// or the ceiling); an answering one keeps its clients.
    fn revive<'a>(
        &'a self,
        claim: &'a ClaimRef,
        devices: &'a [RecordedDevice],
    ) -> BoxFuture<'a, Result<bool, ClaimError>> {
        Box::pin(self.ensure(claim, devices, true))
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{Recorder, claim, share_of};
    use super::*;

    /// Claim `uid` being prepared with `devices`, recorded as the lifecycle records it before
    /// the strategies run.
    fn preparing(rec: &Recorder, uid: &str, devices: &[RecordedDevice]) {
        rec.record(uid, ClaimState::PrepareStarted, devices);
    }

    #[tokio::test]
    async fn the_first_share_starts_the_daemon_and_the_last_stops_it() {
        let rec = Recorder::new(false);
        let s = ShareDaemons::new(&rec, &rec, false);
        let a = [share_of("gpu-0", 1024, 25)];
        let b = [share_of("gpu-0", 4096, 50)];

        preparing(&rec, "a", &a);
        s.apply(&claim("a"), &a).await.unwrap();
        assert_eq!(
            rec.take(),
            [
                "lock gpu-0",
                "liveness uuid-gpu-0",
                "mode gpu-0 ExclusiveProcess",
                "start uuid-gpu-0 [uuid-gpu-0] -",
                "ceiling uuid-gpu-0 1024M pinned, 25% threads",
                "server uuid-gpu-0 uid 0",
            ]
        );
        rec.record("a", ClaimState::PrepareCompleted, &a);

        // The second share finds it answering: the ceiling grows to the larger share.
        preparing(&rec, "b", &b);
        s.apply(&claim("b"), &b).await.unwrap();
        assert_eq!(
            rec.take(),
            [
                "lock gpu-0",
                "liveness uuid-gpu-0",
                "mode gpu-0 ExclusiveProcess",
                "ceiling uuid-gpu-0 4096M pinned, 50% threads",
            ]
        );
        rec.record("b", ClaimState::PrepareCompleted, &b);

        // The larger share goes: the daemon stays for the other, its ceiling lowered.
        rec.record("b", ClaimState::UnprepareStarted, &b);
        s.undo(&claim("b"), &b).await.unwrap();
        assert_eq!(
            rec.take(),
            ["lock gpu-0", "ceiling uuid-gpu-0 1024M pinned, 25% threads"]
        );
        rec.forget("b");

        // The last share goes: the mode first, then the daemon.
        rec.record("a", ClaimState::UnprepareStarted, &a);
        s.undo(&claim("a"), &a).await.unwrap();
        assert_eq!(
            rec.take(),
            ["lock gpu-0", "mode gpu-0 Default", "stop uuid-gpu-0"]
        );
    }

    /// Issue 41, defect 1: the last share's daemon fails to stop (its `quit` timed out) after
    /// the mode went back to DEFAULT. The GPU is put back in EXCLUSIVE_PROCESS at once, and the
    /// next share, finding the daemon answering, sets the mode again all the same (it may have
    /// been reset behind the plugin's back).
    #[tokio::test]
    async fn a_daemon_that_outlives_its_last_share_keeps_its_gpu_exclusive() {
        let rec = Recorder::new(false);
        let s = ShareDaemons::new(&rec, &rec, false);
        let a = [share_of("gpu-0", 1024, 0)];
        preparing(&rec, "a", &a);
        s.apply(&claim("a"), &a).await.unwrap();
        rec.record("a", ClaimState::UnprepareStarted, &a);
        rec.take();
        rec.fail("stop uuid-gpu-0");
        s.undo(&claim("a"), &a).await.unwrap_err();
        assert_eq!(
            rec.take(),
            [
                "lock gpu-0",
                "mode gpu-0 Default",
                "stop uuid-gpu-0",
                "mode gpu-0 ExclusiveProcess",
            ]
        );
        rec.forget("a");

        let b = [share_of("gpu-0", 2048, 0)];
        preparing(&rec, "b", &b);
        s.apply(&claim("b"), &b).await.unwrap();
        assert_eq!(
            rec.take(),
            [
                "lock gpu-0",
                "liveness uuid-gpu-0",
                "mode gpu-0 ExclusiveProcess",
                "ceiling uuid-gpu-0 2048M pinned, 100% threads",
            ]
        );
    }

    #[tokio::test]
    async fn two_last_shares_unprepared_together_both_release_it() {
        let rec = Recorder::new(false);
        let s = ShareDaemons::new(&rec, &rec, false);
        let a = [share_of("gpu-0", 1024, 0)];
        let b = [share_of("gpu-0", 2048, 0)];
        rec.record("a", ClaimState::UnprepareStarted, &a);
        rec.record("b", ClaimState::UnprepareStarted, &b);
        s.undo(&claim("a"), &a).await.unwrap();
        // Neither keeps the daemon for the other: the first undo stops it.
        assert_eq!(
            rec.take(),
            ["lock gpu-0", "mode gpu-0 Default", "stop uuid-gpu-0"]
        );
    }

    #[tokio::test]
    async fn a_daemon_that_may_be_alive_is_never_replaced() {
        let rec = Recorder::new(false);
        rec.set_liveness("uuid-gpu-0", Liveness::Unknown("no answer in 5 s".into()));
        let a = [share_of("gpu-0", 1024, 0)];
        preparing(&rec, "a", &a);
        let e = ShareDaemons::new(&rec, &rec, false)
            .apply(&claim("a"), &a)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("no answer in 5 s"), "{e}");
        assert_eq!(rec.take(), ["lock gpu-0", "liveness uuid-gpu-0"]);
    }

    #[tokio::test]
    async fn a_daemon_of_the_other_protocol_keeps_its_shares() {
        let rec = Recorder::new(true);
        // A legacy daemon from before the node's level became `kernel`.
        ShareDaemons::new(&rec, &rec, false)
            .apply(&claim("old"), &[share_of("gpu-0", 1024, 0)])
            .await
            .unwrap();
        rec.take();
        let e = ShareDaemons::new(&rec, &rec, true)
            .apply(&claim("new"), &[share_of("gpu-0", 1024, 0)])
            .await
            .unwrap_err();
        assert!(matches!(
            e,
            ClaimError::Mps {
                source: MpsError::ProtocolMismatch { .. },
                ..
            }
        ));
        assert_eq!(rec.take(), ["lock gpu-0", "liveness uuid-gpu-0"]);
    }

    /// Issue 41, defect 3: after the node's level changed, a share prepared under the old
    /// level's daemon is revived (at start-up, or prepared again by the kubelet) through that
    /// daemon, as its containers' edits are; only a new share waits.
    #[tokio::test]
    async fn a_share_prepared_before_the_level_changed_revives_through_its_daemon() {
        let rec = Recorder::new(true);
        let old = [share_of("gpu-0", 1024, 0)];
        preparing(&rec, "old", &old);
        ShareDaemons::new(&rec, &rec, false)
            .apply(&claim("old"), &old)
            .await
            .unwrap();
        rec.record("old", ClaimState::PrepareCompleted, &old);
        rec.take();
        let v3 = ShareDaemons::new(&rec, &rec, true);
        assert!(!v3.revive(&claim("old"), &old).await.unwrap());
        assert_eq!(
            rec.take(),
            [
                "lock gpu-0",
                "liveness uuid-gpu-0",
                "mode gpu-0 ExclusiveProcess",
                "ceiling uuid-gpu-0 1024M pinned, 100% threads",
            ]
        );
        let new = [share_of("gpu-0", 2048, 0)];
        preparing(&rec, "new", &new);
        assert!(matches!(
            v3.apply(&claim("new"), &new).await.unwrap_err(),
            ClaimError::Mps {
                source: MpsError::ProtocolMismatch { .. },
                ..
            }
        ));
    }

    #[tokio::test]
    async fn a_failed_start_restores_the_mode() {
        let rec = Recorder::new(false);
        rec.fail("start uuid-gpu-0 [uuid-gpu-0] -");
        let a = [share_of("gpu-0", 1024, 0)];
        preparing(&rec, "a", &a);
        ShareDaemons::new(&rec, &rec, false)
            .apply(&claim("a"), &a)
            .await
            .unwrap_err();
        assert_eq!(
            rec.take(),
            [
                "lock gpu-0",
                "liveness uuid-gpu-0",
                "mode gpu-0 ExclusiveProcess",
                "start uuid-gpu-0 [uuid-gpu-0] -",
                "mode gpu-0 Default",
            ]
        );
    }

    /// MPS v3: each share its own namespace; a daemon started again gets every recorded
    /// share's namespace back; a share leaving deletes only its own.
    #[tokio::test]
    async fn v3_namespaces() {
        let rec = Recorder::new(true);
        let s = ShareDaemons::new(&rec, &rec, true);
        let a = [share_of("gpu-0", 1024, 25)];
        let b = [share_of("gpu-0", 2048, 0)];
        let ns = crate::mps::namespace_name;

        rec.record("a", ClaimState::PrepareCompleted, &a);
        preparing(&rec, "b", &b);
        // The daemon died with the plugin: b's prepare starts it and restores a's namespace.
        s.apply(&claim("b"), &b).await.unwrap();
        assert_eq!(
            rec.take(),
            [
                "lock gpu-0".to_owned(),
                "liveness uuid-gpu-0".to_owned(),
                "mode gpu-0 ExclusiveProcess".to_owned(),
                "start v3 uuid-gpu-0 uuid-gpu-0".to_owned(),
                format!("namespace uuid-gpu-0 {} 1024M 25%", ns("a")),
                format!("namespace uuid-gpu-0 {} 2048M -", ns("b")),
            ]
        );
        rec.record("b", ClaimState::PrepareCompleted, &b);

        rec.record("a", ClaimState::UnprepareStarted, &a);
        s.undo(&claim("a"), &a).await.unwrap();
        assert_eq!(
            rec.take(),
            [
                "lock gpu-0".to_owned(),
                format!("delete namespace uuid-gpu-0 {}", ns("a")),
            ]
        );
        rec.forget("a");

        // Revive of a prepared share whose daemon answers: its namespace set again, no start.
        assert!(!s.revive(&claim("b"), &b).await.unwrap());
        assert_eq!(
            rec.take(),
            [
                "lock gpu-0".to_owned(),
                "liveness uuid-gpu-0".to_owned(),
                "mode gpu-0 ExclusiveProcess".to_owned(),
                format!("namespace uuid-gpu-0 {} 2048M -", ns("b")),
            ]
        );
    }

    #[tokio::test]
    async fn a_whole_device_share_runs_without_mps() {
        let rec = Recorder::new(false);
        let mut whole = share_of("gpu-0", 81920, 100);
        if let Some(s) = &mut whole.share {
            s.whole = true;
        }
        let s = ShareDaemons::new(&rec, &rec, false);
        s.apply(&claim("a"), std::slice::from_ref(&whole))
            .await
            .unwrap();
        s.undo(&claim("a"), std::slice::from_ref(&whole))
            .await
            .unwrap();
        assert!(rec.take().is_empty());
    }
}
