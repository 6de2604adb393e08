//! Waiting on what the real scheduler and controller-manager do to a pod.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;

use crate::wait::{WaitError, until};

/// Waiting on a pod failed.
#[derive(Debug, thiserror::Error)]
pub enum PodError {
    /// It did not get there in time.
    #[error(transparent)]
    Wait(#[from] WaitError),
    /// The pod names no ResourceClaim (neither in its status nor its spec).
    #[error("pod {pod} names no ResourceClaim")]
    NoClaim {
        /// The pod.
        pod: String,
    },
    /// Reading the claim failed.
    #[error("reading ResourceClaim {claim} of pod {pod}: {source}")]
    GetClaim {
        /// The pod.
        pod: String,
        /// The claim.
        claim: String,
        /// The cause.
        source: kube::Error,
    },
}

/// Waits until `pod` is bound to a node, then returns it and its first ResourceClaim (the one the
/// controller-manager created from a template, or a directly named one).
///
/// # Errors
/// [`PodError`] when it is not bound within `timeout` or names no readable claim.
pub async fn bound_with_claim(
    pods: &Api<Pod>,
    claims: &Api<ResourceClaim>,
    pod: &str,
    timeout: Duration,
) -> Result<(Pod, ResourceClaim), PodError> {
    let bound = until(&format!("pod {pod} bound"), timeout, || async {
        let p = pods.get(pod).await.map_err(|e| e.to_string())?;
        let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
        Ok(node.map(|_| p))
    })
    .await?;
    let claim_name = bound
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .and_then(|s| s.first())
        .and_then(|s| s.resource_claim_name.clone())
        .or_else(|| {
            bound
                .spec
                .as_ref()?
                .resource_claims
                .as_ref()?
                .first()?
                .resource_claim_name
                .clone()
        })
        .ok_or_else(|| PodError::NoClaim { pod: pod.into() })?;
    let claim = claims
        .get(&claim_name)
        .await
        .map_err(|source| PodError::GetClaim {
            pod: pod.into(),
            claim: claim_name,
            source,
        })?;
    Ok((bound, claim))
}

/// Waits until the scheduler reports `pod` unschedulable (`PodScheduled=False`) and returns the
/// condition's reason and message. A pod that gets bound instead is reported as not yet seen.
///
/// # Errors
/// [`PodError::Wait`] after `timeout`.
pub async fn unschedulable(
    pods: &Api<Pod>,
    pod: &str,
    timeout: Duration,
) -> Result<(String, String), PodError> {
    Ok(until(
        &format!("{pod} reported unschedulable"),
        timeout,
        || async {
            let p = pods.get(pod).await.map_err(|e| e.to_string())?;
            if p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some() {
                return Err("pod was bound".into());
            }
            let cond = p
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .into_iter()
                .find(|c| c.type_ == "PodScheduled" && c.status == "False");
            Ok(cond.map(|c| (c.reason.unwrap_or_default(), c.message.unwrap_or_default())))
        },
    )
    .await?)
}
