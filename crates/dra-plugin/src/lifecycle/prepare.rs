//! Prepare of one claim, under its lock ([`Lifecycle::prepare_claim`] takes it).

use dra_kubelet::{ClaimRef, PreparedDevice};
use tracing::info;

use super::{Driver, Error, Lifecycle, Planned};
use crate::failpoint;
use crate::record::{ClaimRecord, ClaimState, Records};

/// Why a prepare failed, and whether what it made is to be undone.
pub(super) enum Failure<E> {
    /// Roll the claim back: the attempt may have made something.
    Undo(E),
    /// Leave the claim as it is: it was prepared before and its recovery step failed.
    Keep(E),
}

impl<D: Driver> Lifecycle<D> {
    /// Answers a claim already prepared, or prepares it from a clean slate. With the devices,
    /// whether the claim was prepared before this call (answered from its record).
    pub(super) async fn prepare_locked(
        &self,
        claim: &ClaimRef,
    ) -> Result<(Vec<PreparedDevice>, bool), Failure<D::Error>> {
        let existing = self.records().await.claims.get(&claim.uid).map(|r| {
            (
                r.state,
                r.devices.iter().map(D::prepared_device).collect::<Vec<_>>(),
            )
        });
        match existing {
            Some((ClaimState::PrepareCompleted, devices)) => {
                // A claim whose recovery at start failed: the kubelet gets its step's error
                // until the step succeeds (a record to release is released and prepared again).
                match self.resume(claim).await {
                    Ok(true) => return Ok((devices, true)),
                    Ok(false) => {
                        self.release_locked(claim).await.map_err(Failure::Undo)?;
                    }
                    Err(e) => {
                        return Err(Failure::Keep(
                            Error::Recovery {
                                claim: claim.clone(),
                                source: Box::new(e),
                            }
                            .into(),
                        ));
                    }
                }
            }
            // A crashed or abandoned attempt: start from a clean slate.
            Some(_) => self.release_locked(claim).await.map_err(Failure::Undo)?,
            None => {}
        }
        let devices = self.prepare_new(claim).await.map_err(Failure::Undo)?;
        Ok((devices, false))
    }

    /// Plan, record, device step, configuration, CDI spec, completion.
    async fn prepare_new(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, D::Error> {
        let driver = self.driver();
        let Planned {
            devices,
            spec,
            two_phase,
            plan,
        } = driver.plan(self, claim).await?;

        failpoint::hit("prepare/before-started-checkpoint");
        let answer: Vec<PreparedDevice> = devices.iter().map(D::prepared_device).collect();
        // The lifecycle names the claim in its spec (recovery finds claims by these), so no
        // driver has to.
        let stamped = |mut spec: crate::cdi::Spec| {
            self.cdi().stamp(&mut spec, claim);
            spec
        };
        let record = ClaimRecord {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            state: ClaimState::PrepareStarted,
            devices,
            cdi_spec_path: self.cdi().spec_path(&claim.uid),
            cdi_spec: spec.map(stamped).unwrap_or_default(),
        };
        let reserve = |c: &mut Records<D::Device>| {
            driver.check_conflicts(claim, c, &record.devices)?;
            c.claims.insert(claim.uid.clone(), record);
            Ok(())
        };
        // Two phases only where prepare changes the node: a crash then leaves a durable record
        // of what may exist, for start-up to undo. A claim whose prepare only checks its
        // devices needs no such record: a crash before `PrepareCompleted` leaves at most its
        // CDI spec, which names the claim, and start-up removes it as an orphan. Its record is
        // staged (other claims see the devices taken) and goes to disk with
        // `PrepareCompleted`: one durable write fewer.
        if two_phase {
            self.update(claim, reserve).await?;
        } else {
            self.stage(reserve).await?;
        }
        failpoint::hit("prepare/after-started-checkpoint");

        let prepared = driver.prepare_devices(self, claim, plan).await?;
        failpoint::hit("prepare/after-hardware");
        driver.configure(self, claim, &prepared.devices).await?;
        failpoint::hit("prepare/after-sharing");

        let uid = claim.uid.clone();
        let spec = stamped(prepared.spec);
        let write_spec = self.cdi_io(claim, move |cdi| cdi.write(&uid, &spec));
        if two_phase {
            write_spec.await?;
            failpoint::hit("prepare/after-cdi-write");
            self.set_state(claim, ClaimState::PrepareCompleted).await?;
        } else {
            // Without node changes the two writes are independent, so they run at once: a
            // crash with only the record durable leaves a completed claim whose spec start-up
            // rewrites from the record; one with only the spec leaves an orphan spec that
            // start-up removes. The kubelet hears of success only when the record is durable
            // (the spec is never synced, see the module docs).
            let (written, completed) = tokio::join!(
                write_spec,
                self.set_state(claim, ClaimState::PrepareCompleted)
            );
            written?;
            failpoint::hit("prepare/after-cdi-write");
            completed?;
        }
        failpoint::hit("prepare/after-completed-checkpoint");
        info!(claim = %claim, devices = answer.len(), "prepared");
        Ok(answer)
    }
}
