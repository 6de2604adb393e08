//! What a driver implements for the lifecycle ([`Driver`]), and what it hands back
//! ([`Planned`], [`Prepared`]).

use std::collections::BTreeSet;
use std::fmt::Debug;
use std::future::Future;

use dra_kubelet::{ClaimRef, PreparedDevice};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{Error, Lifecycle};
use crate::cdi::Spec;
use crate::checkpoint::Format;
use crate::record::{ClaimRecord, Records};

/// What a driver does for the lifecycle: plan a claim, prepare and configure its devices, and
/// undo both. The lifecycle calls the per-claim methods at named points (module docs) under the
/// claim's lock (a kubelet call's also within its deadline; start-up's have none); a prepare
/// that fails is rolled back with what the record says: through [`Driver::unconfigure`] and
/// [`Driver::unprepare_devices`] when [`Driver::changes_node`] says the record is two-phase,
/// through [`Driver::unprepare_devices`] alone otherwise, so a driver whose
/// [`Driver::configure`] changes anything must say so in [`Driver::changes_node`].
/// [`Driver::rebuild_claim`] and [`Driver::remove_orphans`] run at start-up, before any call.
///
/// Every method gets the [`Lifecycle`] it runs in, for the records ([`Lifecycle::update`],
/// [`Lifecycle::records`]) and the background work tracker.
pub trait Driver: Send + Sync + Sized + 'static {
    /// The driver's record of one prepared device, stored in the journal and handed back at
    /// unprepare and after a restart; the lifecycle never reads into it.
    type Device: Clone + PartialEq + Debug + Serialize + DeserializeOwned + Send + Sync + 'static;
    /// The journal's file format: its version history ([`Format`]).
    type Format: Format<Data = Records<Self::Device>> + Send + Sync + 'static;
    /// The per-claim error reported to the kubelet; it wraps the lifecycle's own ([`Error`]).
    type Error: std::error::Error + From<Error> + Send + Sync + 'static;
    /// What planning hands to the device step.
    type Plan: Send + 'static;
    /// What the driver's orphan removal reports ([`Driver::remove_orphans`]).
    type Orphans: Default + Debug + Send;

    /// Reads the claim (its allocation and configuration) and plans its prepare.
    fn plan(
        &self,
        lifecycle: &Lifecycle<Self>,
        claim: &ClaimRef,
    ) -> impl Future<Output = Result<Planned<Self>, Self::Error>> + Send;

    /// Refuses `devices` where the records already give one of them to another claim
    /// (called while the records are locked, just before the claim's are added). Default: a
    /// device (pool and name, [`Driver::prepared_device`]) belongs to at most one claim.
    ///
    /// # Errors
    /// The driver's conflict error, naming the claim, the device and its holder (default
    /// [`Error::DeviceInUse`]).
    fn check_conflicts(
        &self,
        claim: &ClaimRef,
        records: &Records<Self::Device>,
        devices: &[Self::Device],
    ) -> Result<(), Self::Error> {
        for d in devices {
            let want = Self::prepared_device(d);
            let holder = records.claims.iter().find(|(uid, r)| {
                **uid != claim.uid
                    && r.devices.iter().any(|o| {
                        let o = Self::prepared_device(o);
                        o.pool_name == want.pool_name && o.device_name == want.device_name
                    })
            });
            if let Some((uid, r)) = holder {
                return Err(Error::DeviceInUse {
                    claim: claim.clone(),
                    pool: want.pool_name,
                    device: want.device_name,
                    holder: format!("{}/{} (uid {uid})", r.namespace, r.name),
                }
                .into());
            }
        }
        Ok(())
    }

    /// The device step of prepare. What it makes that must be undone it records first
    /// ([`Lifecycle::update`] on the claim's record), so that a failure or a crash undoes
    /// exactly that. Returns the devices as prepared and the claim's CDI spec.
    fn prepare_devices(
        &self,
        lifecycle: &Lifecycle<Self>,
        claim: &ClaimRef,
        plan: Self::Plan,
    ) -> impl Future<Output = Result<Prepared<Self::Device>, Self::Error>> + Send;

    /// Applies the configuration of the prepared devices (sharing, settings) after the device
    /// step; undone by [`Driver::unconfigure`]. Default: nothing to configure.
    fn configure(
        &self,
        _lifecycle: &Lifecycle<Self>,
        _claim: &ClaimRef,
        _devices: &[Self::Device],
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        async { Ok(()) }
    }

    /// Whether undoing these recorded devices changes the node: decides whether unprepare
    /// writes `UnprepareStarted` first (two phases) or removes the record in one write.
    fn changes_node(&self, devices: &[Self::Device]) -> bool;

    /// Undoes [`Driver::configure`] (two-phase unprepare only). Must be safe when nothing, or
    /// only part, was applied. Default: nothing to undo.
    fn unconfigure(
        &self,
        _lifecycle: &Lifecycle<Self>,
        _claim: &ClaimRef,
        _devices: &[Self::Device],
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        async { Ok(()) }
    }

    /// Undoes the device step for the recorded claim. `two_phase` is
    /// [`Driver::changes_node`] of its devices; when false no `UnprepareStarted` is written
    /// first (the record and the CDI spec are removed right after this returns), so the undo
    /// must be idempotent.
    fn unprepare_devices(
        &self,
        lifecycle: &Lifecycle<Self>,
        claim: &ClaimRef,
        record: &ClaimRecord<Self::Device>,
        two_phase: bool,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// What the kubelet is told of a recorded device.
    fn prepared_device(device: &Self::Device) -> PreparedDevice;

    /// A completed claim found at start-up: brings back what it needs that did not survive
    /// the restart (a helper process, a setting); `Ok(true)` when something was brought back.
    /// A failure is retried in the background; the claim stays prepared meanwhile. Default:
    /// nothing to bring back.
    fn revive(
        &self,
        _lifecycle: &Lifecycle<Self>,
        _claim: &ClaimRef,
        _record: &ClaimRecord<Self::Device>,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send {
        async { Ok(false) }
    }

    /// The CDI spec of a completed record that carries none (written by an older format), to
    /// rewrite at start-up. Default: the record's (empty) spec.
    ///
    /// # Errors
    /// The driver's error when the spec cannot be computed; retried in the background.
    fn spec_of(
        &self,
        _lifecycle: &Lifecycle<Self>,
        _claim: &ClaimRef,
        record: &ClaimRecord<Self::Device>,
    ) -> Result<Spec, Self::Error> {
        Ok(record.cdi_spec.clone())
    }

    /// After a damaged checkpoint: the devices of `claim`, whose CDI spec `spec` was found on
    /// disk, to record it as prepared; `None` to drop it (the claim no longer exists). A claim
    /// whose pods may still run must be kept.
    fn rebuild_claim(
        &self,
        lifecycle: &Lifecycle<Self>,
        claim: &ClaimRef,
        spec: &Spec,
    ) -> impl Future<Output = Option<Vec<Self::Device>>> + Send;

    /// At start-up, after every claim is recovered: removes what the driver made for claims
    /// not in `kept` (by UID), logging what it cannot remove (retried at the next start).
    /// Skipped when the checkpoint was written by a newer build.
    fn remove_orphans(
        &self,
        lifecycle: &Lifecycle<Self>,
        kept: &BTreeSet<String>,
    ) -> impl Future<Output = Self::Orphans> + Send;

    /// Whether the prepared claim `claim` still exists in the API server with its UID, for the
    /// stale-claim check ([`Lifecycle::unprepare_stale`]): `Ok(false)` unprepares it (its pod is
    /// gone and the kubelet missed it, e.g. while the plugin was down); an error keeps it, to be
    /// checked again. Default: `Ok(true)`, no stale-claim check.
    fn claim_exists(
        &self,
        _lifecycle: &Lifecycle<Self>,
        _claim: &ClaimRef,
    ) -> impl Future<Output = Result<bool, String>> + Send {
        async { Ok(true) }
    }

    /// Reports a start-up problem to the cluster (a Warning event); `reason` is one word
    /// (`CheckpointRecovered`, `ClaimRecoveryFailed`). Default: the log only.
    fn warn(&self, reason: &str, message: &str) -> impl Future<Output = ()> + Send {
        let _ = (reason, message);
        async {}
    }
}

/// A claim's plan ([`Driver::plan`]).
pub struct Planned<D: Driver> {
    /// The devices to record, as the kubelet will be told of them.
    pub devices: Vec<D::Device>,
    /// The CDI spec, when known before the device step (it is recorded with `PrepareStarted`).
    pub spec: Option<Spec>,
    /// Whether prepare changes the node, so the record is durable before the device step.
    pub two_phase: bool,
    /// What the device step needs.
    pub plan: D::Plan,
}

/// The device step's result ([`Driver::prepare_devices`]).
#[derive(Debug)]
pub struct Prepared<Device> {
    /// The devices as prepared (what [`Driver::configure`] works on).
    pub devices: Vec<Device>,
    /// The claim's CDI spec.
    pub spec: Spec,
}
