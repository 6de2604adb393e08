//! The `kernel` enforcement level's memory limits (`crate::memory_limits`): the CDI hook sets
//! them as each container of a share starts, after the prepare, so there is nothing to apply;
//! undo clears those set for the claim's containers (the containers are gone by then), first
//! of all the strategies. Nothing at the `mps` level.

use dra_kubelet::ClaimRef;
use futures::future::BoxFuture;
use tracing::info;

use super::{Node, Strategy};
use crate::checkpoint::RecordedDevice;
use crate::claims::ClaimError;

/// The memory-limits strategy over `N`.
pub(crate) struct KernelLimits<'a, N> {
    node: &'a N,
}

impl<'a, N: Node> KernelLimits<'a, N> {
    /// The limits on `node`.
    pub(crate) fn new(node: &'a N) -> Self {
        Self { node }
    }
}

impl<N: Node> Strategy for KernelLimits<'_, N> {
    fn name(&self) -> &'static str {
        "memory limits"
    }

    fn apply<'a>(
        &'a self,
        _: &'a ClaimRef,
        _: &'a [RecordedDevice],
    ) -> BoxFuture<'a, Result<(), ClaimError>> {
        Box::pin(async { Ok(()) })
    }

    /// Clears them whatever the devices: start-up calls it for an orphan's UID alone.
    fn undo<'a>(
        &'a self,
        claim: &'a ClaimRef,
        _: &'a [RecordedDevice],
    ) -> BoxFuture<'a, Result<(), ClaimError>> {
        Box::pin(async move {
            let cleared = self.node.clear_memory_limits(claim).await?;
            if cleared > 0 {
                info!(claim = %claim, cleared, "cleared the share containers' GPU memory limits");
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{Recorder, claim};
    use super::*;

    #[tokio::test]
    async fn only_undo_acts_and_for_any_claim() {
        let rec = Recorder::new(true);
        let s = KernelLimits::new(&rec);
        s.apply(&claim("c"), &[]).await.unwrap();
        assert!(rec.take().is_empty());
        s.undo(&claim("c"), &[]).await.unwrap();
        assert_eq!(rec.take(), ["clear limits c"]);
        rec.fail("clear limits d");
        assert!(s.undo(&claim("d"), &[]).await.is_err());
    }
}
