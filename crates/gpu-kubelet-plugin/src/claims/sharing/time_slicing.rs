//! Time-slicing: each device whose sharing config is `TimeSlicing` gets its GPU's time slice set
//! (`nvidia-smi compute-policy --set-timeslice`, [`crate::hardware::Hardware::set_time_slice`])
//! after the hardware step; undo puts it back to the driver's default. The slice belongs to
//! the GPU and stays set across plugin restarts, so nothing is revived.

use dra_kubelet::ClaimRef;
use futures::future::BoxFuture;

use super::{Node, Strategy};
use crate::checkpoint::RecordedDevice;
use crate::claim_config::{Sharing, TimeSlice};
use crate::claims::ClaimError;

/// The time-slicing strategy over `N`.
pub(crate) struct TimeSlicing<'a, N> {
    node: &'a N,
}

impl<'a, N: Node> TimeSlicing<'a, N> {
    /// Time-slicing on `node`.
    pub(crate) fn new(node: &'a N) -> Self {
        Self { node }
    }

    /// Sets the slice of each of `devices` configured for time-slicing: its own interval, or
    /// `to` when given.
    async fn set(
        &self,
        claim: &ClaimRef,
        devices: &[RecordedDevice],
        to: Option<TimeSlice>,
    ) -> Result<(), ClaimError> {
        for d in devices {
            if let Some(Sharing::TimeSlicing { interval }) = d.sharing {
                self.node
                    .set_time_slice(claim, &d.device_name, to.unwrap_or(interval))
                    .await?;
            }
        }
        Ok(())
    }
}

impl<N: Node> Strategy for TimeSlicing<'_, N> {
    fn name(&self) -> &'static str {
        "time slicing"
    }

    fn apply<'a>(
        &'a self,
        claim: &'a ClaimRef,
        devices: &'a [RecordedDevice],
    ) -> BoxFuture<'a, Result<(), ClaimError>> {
        Box::pin(self.set(claim, devices, None))
    }

    fn undo<'a>(
        &'a self,
        claim: &'a ClaimRef,
        devices: &'a [RecordedDevice],
    ) -> BoxFuture<'a, Result<(), ClaimError>> {
        Box::pin(self.set(claim, devices, Some(TimeSlice::Default)))
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{Recorder, claim, mps_device, time_sliced};
    use super::*;

    #[tokio::test]
    async fn sets_the_configured_slices_and_restores_the_default() {
        let rec = Recorder::new(false);
        let devices = [
            time_sliced("gpu-0"),
            mps_device("gpu-1", None),
            time_sliced("gpu-2"),
        ];
        let s = TimeSlicing::new(&rec);
        s.apply(&claim("c"), &devices).await.unwrap();
        assert_eq!(rec.take(), ["slice gpu-0 Short", "slice gpu-2 Short"]);
        s.undo(&claim("c"), &devices).await.unwrap();
        assert_eq!(rec.take(), ["slice gpu-0 Default", "slice gpu-2 Default"]);
        assert!(!s.revive(&claim("c"), &devices).await.unwrap());
        assert!(rec.take().is_empty());
    }

    #[tokio::test]
    async fn a_failed_slice_stops_and_names_the_claim() {
        let rec = Recorder::new(false);
        rec.fail("slice gpu-0 Short");
        let devices = [time_sliced("gpu-0"), time_sliced("gpu-2")];
        let e = TimeSlicing::new(&rec)
            .apply(&claim("c"), &devices)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("ns/c"), "{e}");
        assert_eq!(rec.take(), ["slice gpu-0 Short"]);
    }

    #[tokio::test]
    async fn nothing_without_time_slicing() {
        let rec = Recorder::new(false);
        let s = TimeSlicing::new(&rec);
        s.apply(&claim("c"), &[mps_device("gpu-1", None)])
            .await
            .unwrap();
        s.undo(&claim("c"), &[]).await.unwrap();
        assert!(rec.take().is_empty());
    }
}
