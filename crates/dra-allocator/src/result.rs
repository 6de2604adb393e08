//! The AllocationResult of one claim: device results, configuration and node selector.
//!
//! upstream: `structured/internal/incubating/allocator_incubating.go`, the end of `Allocate`
//! (results, class and claim configs) and `createNodeSelector`.

use std::sync::Arc;

use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};
use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceAllocationConfiguration, DeviceAllocationResult, DeviceClass,
    DeviceRequestAllocationResult, DeviceToleration, ResourceClaim,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as ApiQuantity;

use crate::Features;
use crate::allocator::{AllocateError, ClaimData, DeviceResult};
use crate::model::SliceData;

/// Per request of the claim: the (selected sub)request as (parent request, name) and its class.
type Selected<'c> = Option<(Option<&'c str>, &'c str, &'c DeviceClass)>;

fn non_empty<T>(v: Vec<T>) -> Option<Vec<T>> {
    (!v.is_empty()).then_some(v)
}

/// One claim's allocation on one node, as the search found it: the device of each request,
/// borrowing names and configuration from the allocator's inputs.
///
/// Upstream's `Allocate` returns `AllocationResult`s whose strings are shared with the slices
/// and claims (Go strings are immutable); in Rust the API object owns copies, so it is built
/// when asked for ([`Allocation::to_api`]), not for every node the search tries. Everything
/// that can fail was checked when the allocation was made.
#[derive(Debug, Clone)]
pub struct Allocation<'s> {
    pub(crate) claims: Arc<Vec<ClaimData<'s>>>,
    /// Which claim of `claims`.
    pub(crate) claim: usize,
    /// Per request, the subrequest picked (its index; 0 without subrequests).
    pub(crate) picked: Vec<usize>,
    pub(crate) results: Vec<DeviceResult<'s>>,
    pub(crate) slices: &'s [SliceData<'s>],
    pub(crate) node_selection: NodeSelection<'s>,
    pub(crate) node_name: &'s str,
    pub(crate) features: Features,
}

impl Allocation<'_> {
    /// The claim this allocation is for.
    pub fn claim(&self) -> Option<&ResourceClaim> {
        self.claims.get(self.claim).map(|c| c.obj)
    }

    /// The allocated devices as `(request, driver, pool, device)`, in result order; `request`
    /// is `parent/subrequest` for a subrequest of `firstAvailable`.
    pub fn devices(&self) -> impl Iterator<Item = (String, &str, &str, &str)> + '_ {
        self.results.iter().filter_map(|r| {
            let slice = self.slices.get(r.slice)?;
            let device = slice.devices.get(r.device)?;
            let name = slice
                .names
                .get(device.name_at.clone())
                .unwrap_or(device.name);
            Some((request_name(r), slice.driver, slice.pool, name))
        })
    }

    /// The claim's `status.allocation` as the scheduler writes it (without
    /// `allocationTimestamp`).
    pub fn to_api(&self) -> AllocationResult {
        let Some(claim_data) = self.claims.get(self.claim) else {
            return AllocationResult::default();
        };
        let claim = claim_data.obj;
        let pick = |ri: usize| self.picked.get(ri).copied().unwrap_or(0);
        let selected: Vec<Selected<'_>> = claim_data
            .requests
            .iter()
            .enumerate()
            .map(|(ri, slot)| {
                slot.subs
                    .get(if slot.has_subrequests { pick(ri) } else { 0 })
                    .map(|rd| (rd.parent, rd.name, rd.class))
            })
            .collect();
        let sub_names: Vec<Option<&str>> = claim_data
            .requests
            .iter()
            .enumerate()
            .map(|(ri, slot)| {
                slot.has_subrequests
                    .then(|| slot.subs.get(pick(ri)).map(|rd| rd.name))
                    .flatten()
            })
            .collect();
        build(
            claim,
            self.slices,
            &self.results,
            &selected,
            &sub_names,
            self.node_selection.to_api(self.node_name),
            self.features,
        )
    }
}

fn request_name(r: &DeviceResult<'_>) -> String {
    match r.parent {
        Some(p) => format!("{p}/{}", r.request),
        None => r.request.to_string(),
    }
}

/// Builds the claim's AllocationResult.
fn build(
    claim: &ResourceClaim,
    slices: &[SliceData<'_>],
    results: &[DeviceResult<'_>],
    selected: &[Selected<'_>],
    sub_names: &[Option<&str>],
    node_selector: Option<NodeSelector>,
    features: Features,
) -> AllocationResult {
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
        let mut out = DeviceRequestAllocationResult {
            request: request_name(r),
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
            consumed_capacity: r.consumed.as_ref().map(|c| {
                c.iter()
                    .map(|(k, v)| (k.clone(), ApiQuantity(v.canonical_string())))
                    .collect()
            }),
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

    AllocationResult {
        allocation_timestamp: None,
        devices: Some(DeviceAllocationResult {
            config: non_empty(config),
            results: non_empty(device_results),
        }),
        node_selector,
    }
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

/// Where a claim's devices can be used (`createNodeSelector`), decided with the allocation and
/// turned into a NodeSelector when the API object is built.
#[derive(Debug, Clone)]
pub(crate) enum NodeSelection<'s> {
    /// Any node: no device is tied to one.
    Anywhere,
    /// The node itself: some device is local to it or binds to it.
    ThisNode,
    /// The single terms of the slices' (or devices') node selectors, in result order.
    Terms(Vec<&'s NodeSelectorTerm>),
}

impl NodeSelection<'_> {
    /// `createNodeSelector`: the node itself when any device is local to it or binds to it,
    /// else the union of the slices' (or devices') single-term selectors, else none.
    ///
    /// # Errors
    /// A slice node selector with more than one term (API validation forbids those).
    pub(crate) fn of<'s>(
        claim: &ResourceClaim,
        slices: &'s [SliceData<'s>],
        results: &[DeviceResult<'_>],
    ) -> Result<NodeSelection<'s>, AllocateError> {
        let mut terms = Vec::new();
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
                return Ok(NodeSelection::ThisNode);
            }
            let Some(selector) = selector else { continue };
            match selector.node_selector_terms.as_slice() {
                [] => {}
                [term] => terms.push(term),
                more => {
                    return Err(AllocateError::Fatal(format!(
                        "create NodeSelector for claim {}: unsupported ResourceSlice.NodeSelector with {} terms",
                        claim.metadata.name.as_deref().unwrap_or(""),
                        more.len()
                    )));
                }
            }
        }
        Ok(if terms.is_empty() {
            NodeSelection::Anywhere
        } else {
            NodeSelection::Terms(terms)
        })
    }

    fn to_api(&self, node_name: &str) -> Option<NodeSelector> {
        let terms = match self {
            NodeSelection::Anywhere => return None,
            NodeSelection::ThisNode => {
                return Some(NodeSelector {
                    node_selector_terms: vec![NodeSelectorTerm {
                        match_fields: Some(vec![NodeSelectorRequirement {
                            key: "metadata.name".into(),
                            operator: "In".into(),
                            values: Some(vec![node_name.to_string()]),
                        }]),
                        match_expressions: None,
                    }],
                });
            }
            NodeSelection::Terms(terms) => terms,
        };
        let mut fields: Vec<NodeSelectorRequirement> = Vec::new();
        let mut exprs: Vec<NodeSelectorRequirement> = Vec::new();
        for term in terms {
            add_new(
                term.match_fields.as_deref().unwrap_or_default(),
                &mut fields,
            );
            add_new(
                term.match_expressions.as_deref().unwrap_or_default(),
                &mut exprs,
            );
        }
        if fields.is_empty() && exprs.is_empty() {
            return None;
        }
        Some(NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm {
                match_fields: non_empty(fields),
                match_expressions: non_empty(exprs),
            }],
        })
    }
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
