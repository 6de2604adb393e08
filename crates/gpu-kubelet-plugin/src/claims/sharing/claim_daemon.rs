//! A claim's own MPS daemon: the devices an MPS sharing config covers are served by one
//! control daemon keyed by the claim's UID, with the config's limits as its defaults
//! ([`crate::mps::MpsControl::start`]). Its full GPUs are put in `EXCLUSIVE_PROCESS` before it
//! starts, so no process bypasses it (`claims/exclusive.rs`), and back in `DEFAULT` before it
//! stops: a crash in between leaves the daemon, which start-up stops as an orphan. A daemon
//! that died while the claim is prepared is started again ([`Strategy::revive`]).

use dra_kubelet::ClaimRef;
use futures::future::BoxFuture;
use gpu_inventory::backend::ComputeMode;
use tracing::warn;

use super::{Daemons, Node, Strategy, mps_error};
use crate::checkpoint::RecordedDevice;
use crate::claim_config::Sharing;
use crate::claims::ClaimError;
use crate::mps::{Liveness, MpsDevice, MpsError};

/// The claim-daemon strategy over `N` and `D`.
pub(crate) struct ClaimDaemon<'a, N, D> {
    node: &'a N,
    daemons: &'a D,
}

/// Its name (what [`super::revive_all`] reports when it started the daemon again).
pub(crate) const NAME: &str = "claim MPS daemon";

/// The names of the devices under the claim's own MPS daemon.
pub(crate) fn device_names(devices: &[RecordedDevice]) -> Vec<&str> {
    devices
        .iter()
        .filter(|d| matches!(d.sharing, Some(Sharing::Mps(_))))
        .map(|d| d.device_name.as_str())
        .collect()
}

/// The devices of the claim's own MPS daemon (those an MPS sharing config covers, in device
/// order, which is the daemon's ordinal order), each with its pinned limit, and the daemon's
/// thread percentage (the config resolution refuses claims whose requests disagree on it).
fn served(devices: &[RecordedDevice]) -> (Vec<MpsDevice>, Option<u32>) {
    let mut percentage = None;
    let served = devices
        .iter()
        .filter_map(|d| match &d.sharing {
            Some(Sharing::Mps(limits)) => {
                percentage = limits.active_thread_percentage;
                Some(MpsDevice {
                    uuid: d.uuid.clone(),
                    pinned_memory_limit_bytes: limits.pinned_memory_limit_bytes,
                })
            }
            _ => None,
        })
        .collect();
    (served, percentage)
}

impl<'a, N: Node, D: Daemons> ClaimDaemon<'a, N, D> {
    /// The claim daemons of `node`, run by `daemons`.
    pub(crate) fn new(node: &'a N, daemons: &'a D) -> Self {
        Self { node, daemons }
    }

    /// Sets the compute mode of each of `names`' GPUs, each under its lock.
    async fn modes(
        &self,
        claim: &ClaimRef,
        names: &[&str],
        mode: ComputeMode,
    ) -> Result<(), ClaimError> {
        for name in names {
            let _guard = self.node.lock_gpu(name).await;
            self.node.set_compute_mode(claim, name, mode).await?;
        }
        Ok(())
    }

    /// Starts the daemon for `served`, its GPUs in `EXCLUSIVE_PROCESS` first; on failure the
    /// modes are restored (best effort: start-up restores any left).
    async fn start(
        &self,
        claim: &ClaimRef,
        devices: &[RecordedDevice],
        served: &[MpsDevice],
        percentage: Option<u32>,
    ) -> Result<(), ClaimError> {
        let names = device_names(devices);
        let mut result = self
            .modes(claim, &names, ComputeMode::ExclusiveProcess)
            .await;
        if result.is_ok() {
            result = self
                .daemons
                .start(&claim.uid, served, percentage)
                .await
                .map_err(mps_error(claim));
        }
        if result.is_err() {
            for name in &names {
                let _guard = self.node.lock_gpu(name).await;
                if let Err(e) = self
                    .node
                    .set_compute_mode(claim, name, ComputeMode::Default)
                    .await
                {
                    warn!(claim = %claim, error = %e, "restoring a GPU's compute mode failed");
                }
            }
        }
        result
    }
}

impl<N: Node, D: Daemons> Strategy for ClaimDaemon<'_, N, D> {
    fn name(&self) -> &'static str {
        NAME
    }

    fn apply<'a>(
        &'a self,
        claim: &'a ClaimRef,
        devices: &'a [RecordedDevice],
    ) -> BoxFuture<'a, Result<(), ClaimError>> {
        Box::pin(async move {
            let (served, percentage) = served(devices);
            if served.is_empty() {
                return Ok(());
            }
            self.start(claim, devices, &served, percentage).await
        })
    }

    /// The modes back to `DEFAULT`, then the daemon stopped. The stop is asked whatever the
    /// devices say (an absent daemon is no work): start-up stops an orphaned daemon this way,
    /// by its key alone.
    fn undo<'a>(
        &'a self,
        claim: &'a ClaimRef,
        devices: &'a [RecordedDevice],
    ) -> BoxFuture<'a, Result<(), ClaimError>> {
        Box::pin(async move {
            self.modes(claim, &device_names(devices), ComputeMode::Default)
                .await?;
            self.daemons
                .stop(&claim.uid)
                .await
                .map_err(mps_error(claim))
        })
    }

    /// Starts the daemon again only when it is confirmed dead; one whose state cannot be told
    /// (a slow answer on a busy node) is left alone and fails the call, to be retried. The
    /// directories stay, so running containers' bind mounts reach the new daemon.
    fn revive<'a>(
        &'a self,
        claim: &'a ClaimRef,
        devices: &'a [RecordedDevice],
    ) -> BoxFuture<'a, Result<bool, ClaimError>> {
        Box::pin(async move {
            let (served, percentage) = served(devices);
            if served.is_empty() {
                return Ok(false);
            }
            match self.daemons.liveness(&claim.uid).await {
                Liveness::Answering => Ok(false),
                Liveness::Dead => {
                    self.start(claim, devices, &served, percentage).await?;
                    Ok(true)
                }
                Liveness::Unknown(problem) => Err(mps_error(claim)(MpsError::Unresponsive {
                    pipe_dir: self.daemons.pipe_dir(&claim.uid),
                    problem,
                })),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{Recorder, claim, mps_device, time_sliced};
    use super::*;

    #[tokio::test]
    async fn modes_before_the_start_and_before_the_stop() {
        let rec = Recorder::new(false);
        let devices = [
            mps_device("gpu-0", Some(30)),
            time_sliced("gpu-1"),
            mps_device("gpu-2", Some(30)),
        ];
        let s = ClaimDaemon::new(&rec, &rec);
        s.apply(&claim("c"), &devices).await.unwrap();
        assert_eq!(
            rec.take(),
            [
                "lock gpu-0",
                "mode gpu-0 ExclusiveProcess",
                "lock gpu-2",
                "mode gpu-2 ExclusiveProcess",
                "start c [uuid-gpu-0 uuid-gpu-2] 30%",
            ]
        );
        s.undo(&claim("c"), &devices).await.unwrap();
        assert_eq!(
            rec.take(),
            [
                "lock gpu-0",
                "mode gpu-0 Default",
                "lock gpu-2",
                "mode gpu-2 Default",
                "stop c",
            ]
        );
    }

    #[tokio::test]
    async fn a_failed_start_restores_the_modes() {
        let rec = Recorder::new(false);
        rec.fail("start c [uuid-gpu-0] -");
        let e = ClaimDaemon::new(&rec, &rec)
            .apply(&claim("c"), &[mps_device("gpu-0", None)])
            .await
            .unwrap_err();
        assert!(matches!(e, ClaimError::Mps { .. }), "{e}");
        assert_eq!(
            rec.take(),
            [
                "lock gpu-0",
                "mode gpu-0 ExclusiveProcess",
                "start c [uuid-gpu-0] -",
                "lock gpu-0",
                "mode gpu-0 Default",
            ]
        );
    }

    #[tokio::test]
    async fn a_failed_mode_starts_no_daemon() {
        let rec = Recorder::new(false);
        rec.fail("mode gpu-2 ExclusiveProcess");
        let devices = [mps_device("gpu-0", None), mps_device("gpu-2", None)];
        ClaimDaemon::new(&rec, &rec)
            .apply(&claim("c"), &devices)
            .await
            .unwrap_err();
        let log = rec.take();
        assert!(!log.iter().any(|l| l.starts_with("start")), "{log:?}");
        assert_eq!(log.last().unwrap(), "mode gpu-2 Default");
    }

    #[tokio::test]
    async fn undo_without_mps_still_stops_the_key() {
        // Start-up's orphaned daemon: its key, no devices.
        let rec = Recorder::new(false);
        ClaimDaemon::new(&rec, &rec)
            .undo(&claim("orphan"), &[])
            .await
            .unwrap();
        assert_eq!(rec.take(), ["stop orphan"]);
    }

    #[tokio::test]
    async fn revives_only_a_daemon_confirmed_dead() {
        let rec = Recorder::new(false);
        let devices = [mps_device("gpu-0", None)];
        let s = ClaimDaemon::new(&rec, &rec);
        // Never started: dead, so started.
        assert!(s.revive(&claim("c"), &devices).await.unwrap());
        assert_eq!(rec.take().last().unwrap(), "start c [uuid-gpu-0] -");
        // Now it answers: left alone.
        assert!(!s.revive(&claim("c"), &devices).await.unwrap());
        assert_eq!(rec.take(), ["liveness c"]);
        // No clear answer: neither quit nor replaced, and the call fails to be retried.
        rec.set_liveness("c", Liveness::Unknown("timed out".into()));
        let e = s.revive(&claim("c"), &devices).await.unwrap_err();
        assert!(e.to_string().contains("timed out"), "{e}");
        assert_eq!(rec.take(), ["liveness c"]);
        // A claim without MPS has no daemon to check.
        assert!(
            !s.revive(&claim("d"), &[time_sliced("gpu-1")])
                .await
                .unwrap()
        );
        assert!(rec.take().is_empty());
    }
}
