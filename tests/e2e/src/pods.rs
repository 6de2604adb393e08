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

/// What stands between `pod` and a node, for an error message: its conditions, its claims'
/// allocation and reservations, and every pool's ResourceSlices (generation, slices published
/// of the count announced, devices). Errors while looking are part of the text.
pub async fn diagnose(client: &kube::Client, namespace: &str, pod: &str) -> String {
    use k8s_openapi::api::resource::v1::ResourceSlice;
    let mut out = Vec::new();
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    match pods.get(pod).await {
        Ok(p) => {
            for c in p.status.and_then(|s| s.conditions).unwrap_or_default() {
                out.push(format!(
                    "pod {pod} condition {}={}: {} {}",
                    c.type_,
                    c.status,
                    c.reason.unwrap_or_default(),
                    c.message.unwrap_or_default()
                ));
            }
        }
        Err(e) => out.push(format!("pod {pod}: {e}")),
    }
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), namespace);
    match claims.list(&kube::api::ListParams::default()).await {
        Ok(list) => {
            for c in list.items {
                let status = c.status.unwrap_or_default();
                out.push(format!(
                    "claim {}: allocated {}, reserved for {:?}",
                    c.metadata.name.unwrap_or_default(),
                    status.allocation.is_some(),
                    status
                        .reserved_for
                        .unwrap_or_default()
                        .iter()
                        .map(|r| r.name.clone())
                        .collect::<Vec<_>>()
                ));
            }
        }
        Err(e) => out.push(format!("claims: {e}")),
    }
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    match slices.list(&kube::api::ListParams::default()).await {
        Ok(list) => {
            for s in list.items {
                out.push(format!(
                    "slice {} pool {}/{} generation {} of {} slices, {} devices, counter sets {}",
                    s.metadata.name.unwrap_or_default(),
                    s.spec.driver,
                    s.spec.pool.name,
                    s.spec.pool.generation,
                    s.spec.pool.resource_slice_count,
                    s.spec.devices.map_or(0, |d| d.len()),
                    s.spec.shared_counters.map_or(0, |c| c.len())
                ));
            }
        }
        Err(e) => out.push(format!("slices: {e}")),
    }
    out.join("\n")
}
