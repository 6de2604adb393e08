//! Unprepare (or rollback) of one claim, under its lock.

use dra_kubelet::ClaimRef;
use tracing::info;

use super::{Driver, Lifecycle};
use crate::failpoint;
use crate::record::ClaimState;

impl<D: Driver> Lifecycle<D> {
    /// Unprepares or rolls back `claim` from whatever state its record is in; a claim without
    /// a record has at most an orphan CDI spec, which is removed. The caller holds the claim's
    /// lock ([`Lifecycle::claim_lock`]).
    ///
    /// # Errors
    /// The first step that fails; the record stays, so the next call (or start-up) finishes.
    pub async fn release_locked(&self, claim: &ClaimRef) -> Result<(), D::Error> {
        let driver = self.driver();
        let uid = claim.uid.clone();
        let Some(record) = self.record(&claim.uid).await else {
            // Nothing recorded; a spec without a record is an orphan of a crash.
            return self.cdi_io(claim, move |cdi| cdi.remove(&uid)).await;
        };
        failpoint::hit("unprepare/before-started-checkpoint");
        if !driver.changes_node(&record.devices) {
            // Nothing on the node to undo (the driver's undo is a check, idempotent): the record
            // goes in one durable write; a crash before the CDI spec is removed leaves an orphan
            // spec that start-up removes. The failpoints mark the same steps as the two-phase
            // path.
            failpoint::hit("unprepare/after-started-checkpoint");
            driver
                .unprepare_devices(self, claim, &record, false)
                .await?;
            // Independent, so at once: a crash with only the spec gone leaves a completed claim
            // whose spec start-up rewrites (the kubelet, unanswered, unprepares it again); one
            // with only the record gone leaves an orphan spec that start-up removes.
            let (removed, unlinked) = tokio::join!(
                self.update(claim, |c| {
                    c.claims.remove(&claim.uid);
                    Ok(())
                }),
                self.cdi_io(claim, move |cdi| cdi.remove(&uid))
            );
            removed?;
            unlinked?;
            failpoint::hit("unprepare/after-cdi-remove");
            failpoint::hit("unprepare/after-hardware");
            failpoint::hit("unprepare/after-checkpoint");
            self.recovery_resolved(&claim.uid);
            info!(claim = %claim, "unprepared");
            return Ok(());
        }
        self.set_state(claim, ClaimState::UnprepareStarted).await?;
        failpoint::hit("unprepare/after-started-checkpoint");
        self.cdi_io(claim, move |cdi| cdi.remove(&uid)).await?;
        failpoint::hit("unprepare/after-cdi-remove");
        driver.unconfigure(self, claim, &record.devices).await?;
        driver.unprepare_devices(self, claim, &record, true).await?;
        failpoint::hit("unprepare/after-hardware");
        self.update(claim, |c| {
            c.claims.remove(&claim.uid);
            Ok(())
        })
        .await?;
        failpoint::hit("unprepare/after-checkpoint");
        self.recovery_resolved(&claim.uid);
        info!(claim = %claim, "unprepared");
        Ok(())
    }
}
