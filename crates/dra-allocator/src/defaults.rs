//! The API server's defaults for the objects the allocator reads.
//!
//! upstream: `pkg/apis/resource/v1/defaults.go` and its generated `zz_generated.defaults.go`
//! (k8s.io/kubernetes v1.36.3): allocation mode `ExactCount` with count 1, toleration operator
//! `Equal`, a taint's `timeAdded`, a node allocatable mapping's multiplier `1`. Claims without a
//! namespace get `default`, as kubectl sends them.

use k8s_openapi::api::resource::v1::{DeviceToleration, ResourceClaim, ResourceSlice};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

use crate::Objects;

/// Applies the defaults in place; fields already set are kept.
pub fn apply_defaults(objects: &mut Objects) {
    for claim in &mut objects.claims {
        default_claim(claim);
    }
    for slice in &mut objects.slices {
        default_slice(slice);
    }
}

fn default_mode(mode: &mut Option<String>, count: &mut Option<i64>) {
    if mode.as_deref().unwrap_or("").is_empty() {
        *mode = Some("ExactCount".into());
    }
    if mode.as_deref() == Some("ExactCount") && count.unwrap_or(0) == 0 {
        *count = Some(1);
    }
}

/// The operator defaults to `Equal`; an empty key, value or effect is absent, as the API server
/// stores it (Go's `omitempty` strings), so results copy tolerations as upstream's do.
fn default_tolerations(tolerations: Option<&mut Vec<DeviceToleration>>) {
    for t in tolerations.into_iter().flatten() {
        if t.operator.as_deref().unwrap_or("").is_empty() {
            t.operator = Some("Equal".into());
        }
        for field in [&mut t.key, &mut t.value, &mut t.effect] {
            if field.as_deref() == Some("") {
                *field = None;
            }
        }
    }
}

/// `SetObjectDefaults_ResourceClaim`.
pub(crate) fn default_claim(claim: &mut ResourceClaim) {
    if claim.metadata.namespace.as_deref().unwrap_or("").is_empty() {
        claim.metadata.namespace = Some("default".into());
    }
    let requests = claim
        .spec
        .devices
        .as_mut()
        .and_then(|d| d.requests.as_mut());
    for request in requests.into_iter().flatten() {
        if let Some(exactly) = request.exactly.as_mut() {
            default_mode(&mut exactly.allocation_mode, &mut exactly.count);
            default_tolerations(exactly.tolerations.as_mut());
        }
        for sub in request.first_available.iter_mut().flatten() {
            default_mode(&mut sub.allocation_mode, &mut sub.count);
            default_tolerations(sub.tolerations.as_mut());
        }
    }
    let results = claim
        .status
        .as_mut()
        .and_then(|s| s.allocation.as_mut())
        .and_then(|a| a.devices.as_mut())
        .and_then(|d| d.results.as_mut());
    for result in results.into_iter().flatten() {
        default_tolerations(result.tolerations.as_mut());
    }
}

/// `SetObjectDefaults_ResourceSlice`.
pub(crate) fn default_slice(slice: &mut ResourceSlice) {
    // `time.Now().Truncate(time.Second)`.
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(0));
    let now = Timestamp::from_second(seconds).unwrap_or(Timestamp::UNIX_EPOCH);
    for device in slice.spec.devices.iter_mut().flatten() {
        for mapping in device
            .node_allocatable_resource_mappings
            .iter_mut()
            .flat_map(|m| m.values_mut())
        {
            if mapping.allocation_multiplier.is_none() {
                mapping.allocation_multiplier = Some(Quantity("1".into()));
            }
        }
        for taint in device.taints.iter_mut().flatten() {
            if taint.time_added.is_none() {
                taint.time_added = Some(Time(now));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn requests_default_to_one_device_and_tolerations_to_equal() {
        let mut objects = Objects {
            claims: vec![
                serde_json::from_value(json!({
                    "metadata": {"name": "c"},
                    "spec": {"devices": {"requests": [
                        {"name": "a", "exactly": {"deviceClassName": "x",
                            "tolerations": [{"key": "k"}]}},
                        {"name": "b", "exactly": {"deviceClassName": "x", "allocationMode": "All"}},
                        {"name": "c", "firstAvailable": [{"name": "s", "deviceClassName": "x", "count": 2}]}
                    ]}}
                }))
                .unwrap(),
            ],
            ..Objects::default()
        };
        apply_defaults(&mut objects);
        let claim = &objects.claims[0];
        assert_eq!(claim.metadata.namespace.as_deref(), Some("default"));
        let requests = claim
            .spec
            .devices
            .as_ref()
            .unwrap()
            .requests
            .as_ref()
            .unwrap();
        let a = requests[0].exactly.as_ref().unwrap();
        assert_eq!(
            (a.allocation_mode.as_deref(), a.count),
            (Some("ExactCount"), Some(1))
        );
        assert_eq!(
            a.tolerations.as_ref().unwrap()[0].operator.as_deref(),
            Some("Equal")
        );
        let b = requests[1].exactly.as_ref().unwrap();
        assert_eq!((b.allocation_mode.as_deref(), b.count), (Some("All"), None));
        let s = &requests[2].first_available.as_ref().unwrap()[0];
        assert_eq!(
            (s.allocation_mode.as_deref(), s.count),
            (Some("ExactCount"), Some(2))
        );
    }
}
