//! What the journal keeps per claim: how far its prepare got, the devices as the driver recorded
//! them, and its CDI spec. Generic over the driver's device record `D`, which the core stores and
//! hands back without reading it.
//!
//! JSON shape (camelCase): `{"bootId":"…","claims":{"<uid>":{"namespace":…,"name":…,
//! "state":"PrepareCompleted","devices":[<D>…],"cdiSpecPath":…,"cdiSpec":{…}}}}`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::cdi::Spec;

/// How far prepare got for a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClaimState {
    /// Prepare began: whatever the record lists may exist and must be rolled back if the
    /// prepare does not complete.
    PrepareStarted,
    /// Prepare completed; the kubelet has (or will get) the devices.
    PrepareCompleted,
    /// Unprepare (or a rollback) began: finish it.
    UnprepareStarted,
}

/// Everything recorded for one claim; `D` is the driver's record of one device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimRecord<D> {
    /// Namespace of the ResourceClaim.
    pub namespace: String,
    /// Name of the ResourceClaim.
    pub name: String,
    /// Prepare phase.
    pub state: ClaimState,
    /// The devices, as the driver recorded them.
    pub devices: Vec<D>,
    /// The CDI spec file created for the claim.
    pub cdi_spec_path: PathBuf,
    /// Its content, to regenerate it if it goes missing (e.g. a CDI dir on tmpfs).
    pub cdi_spec: Spec,
}

/// The journal's content: every claim's record and the boot they were prepared in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Records<D> {
    /// `/proc/sys/kernel/random/boot_id` when the claims were prepared; empty when unknown.
    #[serde(default)]
    pub boot_id: String,
    /// Claims by UID.
    #[serde(default = "BTreeMap::new")]
    pub claims: BTreeMap<String, ClaimRecord<D>>,
}

impl<D> Default for Records<D> {
    fn default() -> Self {
        Self {
            boot_id: String::new(),
            claims: BTreeMap::new(),
        }
    }
}
