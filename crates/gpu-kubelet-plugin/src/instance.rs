//! This plugin as one of the two instances a rolling update runs side by side on a node: the
//! handover of [`dra_plugin::handover`] (the active lock, the gate holding the kubelet's calls
//! until this instance is active), with the gate's outcomes counted in the plugin's metrics.

use std::sync::Arc;

use dra_kubelet::Method;
use dra_plugin::handover::{self, GateObserver};

pub use dra_plugin::handover::{
    ActiveLock, InstanceError, KUBELET_CALL_TIMEOUT, LOCK_FILE, LOCK_POLL, Role, handover_wait,
};

use crate::claims::{ClaimController, ClaimError, Cluster};
use crate::hardware::Hardware;
use crate::metrics::Metrics;

/// The [`dra_kubelet::Driver`] the kubelet talks to: the claim controller behind the handover
/// gate.
pub type Gate<C, H> = handover::Gate<ClaimController<C, H>, GateMetrics>;

/// Opens the [`Gate`] with the controller once this instance is active.
pub type Activation<C, H> = handover::Activation<ClaimController<C, H>>;

/// A claim call's error as the kubelet gets it.
pub type GateError = handover::GateError<ClaimError>;

/// The metric label of a gate's failure (`drust_claim_errors_total{reason}`).
pub fn reason(e: &GateError) -> &'static str {
    match e {
        handover::GateError::NotActive { .. } => "not-active",
        handover::GateError::Claim(e) => e.reason(),
    }
}

/// Counts each call's outcome in the plugin's metrics: the prepared-claim gauges after a call
/// the controller answered, one error per failed claim.
pub struct GateMetrics(pub Arc<Metrics>);

impl<C: Cluster, H: Hardware> GateObserver<ClaimController<C, H>> for GateMetrics {
    async fn answered(
        &self,
        active: Option<&ClaimController<C, H>>,
        method: Method,
        failures: &[&GateError],
    ) {
        if let Some(controller) = active {
            let (claims, devices) = controller.prepared_summary().await;
            self.0.set_prepared(claims, devices);
        }
        for e in failures {
            self.0.claim_failed(method, reason(e));
        }
    }
}
