//! A pod's claims among the cluster's, as the scheduler's DynamicResources plugin gathers them
//! for one pod (`pkg/scheduler/framework/plugins/dynamicresources`, PreFilter): the claims the
//! pod names, directly or generated from its templates (`status.resourceClaimStatuses`, filled
//! by the resourceclaim controller), and every allocated claim as devices in use.

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};

use crate::Objects;

/// Why a pod's claims cannot be gathered (yet).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PodClaimsError {
    /// The claim for a template entry has not been created yet; the scheduler waits too.
    #[error("pod {pod}: the ResourceClaim for its entry {entry:?} does not exist yet")]
    NotCreated {
        /// `namespace/name` of the pod.
        pod: String,
        /// The entry of `spec.resourceClaims`.
        entry: String,
    },
    /// A claim the pod names is not in the cluster.
    #[error("pod {pod}: ResourceClaim {namespace}/{claim} not found")]
    NotFound {
        /// `namespace/name` of the pod.
        pod: String,
        /// The claim's namespace (the pod's).
        namespace: String,
        /// The claim's name.
        claim: String,
    },
}

/// The names of a pod's ResourceClaims in `spec.resourceClaims` order.
///
/// # Errors
/// [`PodClaimsError::NotCreated`] for a template entry without its generated claim.
pub fn claim_names(pod: &Pod) -> Result<Vec<String>, PodClaimsError> {
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_deref())
        .unwrap_or_default();
    let mut names = Vec::new();
    for entry in pod
        .spec
        .as_ref()
        .and_then(|s| s.resource_claims.as_deref())
        .unwrap_or_default()
    {
        if let Some(claim) = &entry.resource_claim_name {
            names.push(claim.clone());
            continue;
        }
        match statuses
            .iter()
            .find(|s| s.name == entry.name)
            .and_then(|s| s.resource_claim_name.clone())
        {
            Some(claim) => names.push(claim),
            None => {
                return Err(PodClaimsError::NotCreated {
                    pod: pod_ref(pod),
                    entry: entry.name.clone(),
                });
            }
        }
    }
    Ok(names)
}

/// The objects to allocate the claims `names` of namespace `namespace` with: those claims
/// (the unallocated ones are the pod's to allocate), every other allocated claim as in use,
/// and the cluster's nodes, classes and slices; defaulted ([`crate::apply_defaults`]).
///
/// # Errors
/// [`PodClaimsError::NotFound`] for a name without a claim; `pod` names the pod in it.
pub fn objects_for_claims<'c>(
    pod: &str,
    namespace: &str,
    names: &[String],
    claims: impl IntoIterator<Item = &'c ResourceClaim> + Clone,
    nodes: Vec<Node>,
    classes: Vec<DeviceClass>,
    slices: Vec<ResourceSlice>,
) -> Result<Objects, PodClaimsError> {
    let mine = |c: &ResourceClaim| {
        c.metadata.namespace.as_deref() == Some(namespace)
            && c.metadata
                .name
                .as_deref()
                .is_some_and(|n| names.iter().any(|m| m == n))
    };
    let mut selected: Vec<ResourceClaim> = claims
        .clone()
        .into_iter()
        .filter(|c| crate::is_allocated(c) && !mine(c))
        .cloned()
        .collect();
    for name in names {
        let claim = claims
            .clone()
            .into_iter()
            .find(|c| {
                c.metadata.namespace.as_deref() == Some(namespace)
                    && c.metadata.name.as_deref() == Some(name.as_str())
            })
            .ok_or_else(|| PodClaimsError::NotFound {
                pod: pod.to_owned(),
                namespace: namespace.to_owned(),
                claim: name.clone(),
            })?;
        selected.push(claim.clone());
    }
    let mut objects = Objects {
        nodes,
        classes,
        slices,
        claims: selected,
    };
    crate::apply_defaults(&mut objects);
    Ok(objects)
}

/// `namespace/name`.
pub fn pod_ref(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or(""),
        pod.metadata.name.as_deref().unwrap_or("")
    )
}
