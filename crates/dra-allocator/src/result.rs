//! The AllocationResult of one claim: device results, configuration and node selector.
//!
//! upstream: `structured/internal/incubating/allocator_incubating.go`, the end of `Allocate`
//! (results, class and claim configs) and `createNodeSelector`.

use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};
use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceAllocationConfiguration, DeviceAllocationResult, DeviceClass,
    DeviceRequestAllocationResult, DeviceToleration, ResourceClaim,
};

use crate::Features;
use crate::allocator::{AllocateError, DeviceResult};
use crate::model::SliceData;

/// Per request of the claim: the (selected sub)request as (parent request, name) and its class.
pub(crate) type Selected<'c> = Option<(Option<&'c str>, &'c str, &'c DeviceClass)>;

fn non_empty<T>(v: Vec<T>) -> Option<Vec<T>> {
    (!v.is_empty()).then_some(v)
}

/// Builds the claim's AllocationResult.
///
/// # Errors
/// A slice node selector with more than one term (API validation forbids those).
pub(crate) fn build(
    claim: &ResourceClaim,
    slices: &[SliceData<'_>],
    results: &[DeviceResult<'_>],
    selected: &[Selected<'_>],
    sub_names: &[Option<&str>],
    node_name: &str,
    features: Features,
) -> Result<AllocationResult, AllocateError> {
    let spec = claim.spec.devices.as_ref();
    let requests = spec.and_then(|d| d.requests.as_deref()).unwrap_or_default();

    let mut device_results = Vec::with_capacity(results.len());
    for r in results {
        let Some(slice) = slices.get(r.slice) else {
            continue;
        };
        let Some(device) = slice.devices.get(r.device) else {
            continue;
        };
        let name = match r.parent {
            Some(p) => format!("{p}/{}", r.request),
            None => r.request.to_string(),
        };
        let mut out = DeviceRequestAllocationResult {
            request: name,
            driver: slice.driver.to_string(),
            pool: slice.pool.to_string(),
            device: slice
                .names
                .get(device.name_at.clone())
                .unwrap_or(device.name)
                .to_string(),
            admin_access: r.admin.then_some(true),
            tolerations: non_empty(tolerations(claim, r.request, r.parent).to_vec()),
            share_id: r.share_id.clone(),
            consumed_capacity: r
                .consumed
                .as_ref()
                .map(|c| c.iter().map(|(k, v)| (k.clone(), v.to_api())).collect()),
            ..Default::default()
        };
        // The flags spare reading the API object of every device (cold memory) to find none.
        if features.device_binding_and_status && device.has_binding_conditions {
            out.binding_conditions = device.obj.binding_conditions.clone().and_then(non_empty);
        }
        if features.device_binding_and_status && device.has_binding_failure_conditions {
            out.binding_failure_conditions = device
                .obj
                .binding_failure_conditions
                .clone()
                .and_then(non_empty);
        }
        device_results.push(out);
    }

    // Class configs, each class once, naming every request that uses the class.
    let mut config: Vec<DeviceAllocationConfiguration> = Vec::new();
    // A claim names few classes: a list beats a map.
    let mut class_ranges: Vec<(&str, (usize, usize))> = Vec::new();
    for &(parent, name, class) in selected.iter().flatten() {
        // Made only for a class with configuration: most have none.
        let full_name = || match parent {
            Some(p) => format!("{p}/{name}"),
            None => name.to_string(),
        };
        let class_name = class.metadata.name.as_deref().unwrap_or("");
        if let Some(&(_, (start, end))) = class_ranges.iter().find(|(c, _)| *c == class_name) {
            for c in config.get_mut(start..end).into_iter().flatten() {
                c.requests.get_or_insert_with(Vec::new).push(full_name());
            }
            continue;
        }
        let start = config.len();
        for c in class.spec.config.iter().flatten() {
            config.push(DeviceAllocationConfiguration {
                source: "FromClass".into(),
                requests: Some(vec![full_name()]),
                opaque: c.opaque.clone(),
            });
        }
        class_ranges.push((class_name, (start, config.len())));
    }
    // Claim configs: once per request (or selected subrequest) they name, as upstream does.
    for c in spec.and_then(|d| d.config.as_deref()).unwrap_or_default() {
        let names = c.requests.as_deref().unwrap_or_default();
        let entry = || DeviceAllocationConfiguration {
            source: "FromClaim".into(),
            requests: non_empty(names.to_vec()),
            opaque: c.opaque.clone(),
        };
        if names.is_empty() {
            config.push(entry());
            continue;
        }
        for (i, request) in requests.iter().enumerate() {
            if names.contains(&request.name) {
                config.push(entry());
                continue;
            }
            if let Some(Some(sub)) = sub_names.get(i)
                && names.contains(&format!("{}/{sub}", request.name))
            {
                config.push(entry());
            }
        }
    }

    let node_selector = node_selector(claim, slices, results, node_name)?;
    Ok(AllocationResult {
        allocation_timestamp: None,
        devices: Some(DeviceAllocationResult {
            config: non_empty(config),
            results: non_empty(device_results),
        }),
        node_selector,
    })
}

/// `lookupRequest(claim).tolerations()`.
fn tolerations<'c>(
    claim: &'c ResourceClaim,
    request: &str,
    parent: Option<&str>,
) -> &'c [DeviceToleration] {
    let requests = claim
        .spec
        .devices
        .as_ref()
        .and_then(|d| d.requests.as_deref())
        .unwrap_or_default();
    let Some(r) = requests
        .iter()
        .find(|r| r.name == parent.unwrap_or(request))
    else {
        return &[];
    };
    if parent.is_none() {
        return r
            .exactly
            .as_ref()
            .and_then(|e| e.tolerations.as_deref())
            .unwrap_or_default();
    }
    r.first_available
        .iter()
        .flatten()
        .find(|s| s.name == request)
        .and_then(|s| s.tolerations.as_deref())
        .unwrap_or_default()
}

/// `createNodeSelector`: the node itself when any device is local to it or binds to it,
/// else the union of the slices' (or devices') single-term selectors, else none.
fn node_selector(
    claim: &ResourceClaim,
    slices: &[SliceData<'_>],
    results: &[DeviceResult<'_>],
    node_name: &str,
) -> Result<Option<NodeSelector>, AllocateError> {
    let mut fields: Vec<NodeSelectorRequirement> = Vec::new();
    let mut exprs: Vec<NodeSelectorRequirement> = Vec::new();
    for r in results {
        let Some(slice) = slices.get(r.slice) else {
            continue;
        };
        let Some(device) = slice.devices.get(r.device) else {
            continue;
        };
        let (name, selector) = if slice.per_device_node_selection {
            (
                device.obj.node_name.as_deref(),
                device.obj.node_selector.as_ref(),
            )
        } else {
            (slice.node_name, slice.node_selector)
        };
        if name.is_some() || device.obj.binds_to_node == Some(true) {
            return Ok(Some(NodeSelector {
                node_selector_terms: vec![NodeSelectorTerm {
                    match_fields: Some(vec![NodeSelectorRequirement {
                        key: "metadata.name".into(),
                        operator: "In".into(),
                        values: Some(vec![node_name.to_string()]),
                    }]),
                    match_expressions: None,
                }],
            }));
        }
        let Some(selector) = selector else { continue };
        match selector.node_selector_terms.as_slice() {
            [] => {}
            [term] => {
                add_new(
                    term.match_fields.as_deref().unwrap_or_default(),
                    &mut fields,
                );
                add_new(
                    term.match_expressions.as_deref().unwrap_or_default(),
                    &mut exprs,
                );
            }
            terms => {
                return Err(AllocateError::Fatal(format!(
                    "create NodeSelector for claim {}: unsupported ResourceSlice.NodeSelector with {} terms",
                    claim.metadata.name.as_deref().unwrap_or(""),
                    terms.len()
                )));
            }
        }
    }
    if fields.is_empty() && exprs.is_empty() {
        return Ok(None);
    }
    Ok(Some(NodeSelector {
        node_selector_terms: vec![NodeSelectorTerm {
            match_fields: non_empty(fields),
            match_expressions: non_empty(exprs),
        }],
    }))
}

/// `addNewNodeSelectorRequirements`: requirements not already there (same key, operator and
/// set of values).
fn add_new(from: &[NodeSelectorRequirement], to: &mut Vec<NodeSelectorRequirement>) {
    for r in from {
        let values = |r: &NodeSelectorRequirement| {
            let mut v: Vec<String> = r.values.clone().unwrap_or_default();
            v.sort();
            v.dedup();
            v
        };
        let want = values(r);
        if !to
            .iter()
            .any(|e| e.key == r.key && e.operator == r.operator && values(e) == want)
        {
            to.push(r.clone());
        }
    }
}
