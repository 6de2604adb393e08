//! The scheduler's side: PreFilter's checks, the allocated state, and Filter node by node.
//!
//! upstream: `pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go`
//! (`PreFilter`, `validateDeviceClass`, `Filter`) and `allocateddevices.go`, as
//! `tests/gotools/cmd/allocoracle` runs them on offline objects.

use std::time::Instant;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};

use crate::explain::{ExplainReport, Explanation, NodeExplanation};
use crate::model::claim_ref;
use crate::{
    AllocateError, AllocatedState, Allocator, ClaimAllocation, Decision, False, Features,
    Interrupt, NodeReport, Objects, Options, Report, True,
};

/// What the plugin decides for the pod whose claims are `objects.claims` without
/// `status.allocation`, on every node (or only `options.node`; an unknown name gives no
/// entries).
pub fn allocate(objects: &Objects, options: &Options) -> Report {
    Report {
        nodes: filter(objects, options, false)
            .into_iter()
            .map(|(name, outcome)| match outcome {
                Outcome::Fits(claims) => NodeReport::Allocated {
                    name,
                    allocated: True,
                    claims,
                },
                Outcome::DoesNotFit { reason, .. } => NodeReport::NotAllocated {
                    name,
                    allocated: False,
                    reason,
                },
                Outcome::Error(error) => NodeReport::Error { name, error },
            })
            .collect(),
    }
}

/// [`allocate`], with an [`Explanation`] for every node where the claims do not fit
/// because no combination of devices does (not where the plugin rejects the pod before the
/// search, e.g. for a DeviceClass that does not exist: that reason is given alone).
pub fn explain(objects: &Objects, options: &Options) -> ExplainReport {
    explain_report(filter(objects, options, true))
}

fn explain_report(outcomes: Vec<(String, Outcome)>) -> ExplainReport {
    ExplainReport {
        nodes: outcomes
            .into_iter()
            .map(|(name, outcome)| match outcome {
                Outcome::Fits(claims) => NodeExplanation {
                    name,
                    fits: true,
                    claims,
                    reason: None,
                    explanation: None,
                    error: None,
                },
                Outcome::DoesNotFit {
                    reason,
                    explanation,
                } => NodeExplanation {
                    name,
                    fits: false,
                    claims: Vec::new(),
                    reason: Some(explanation.as_ref().map_or(reason, |e| e.reason.clone())),
                    explanation: explanation.map(|e| *e),
                    error: None,
                },
                Outcome::Error(error) => NodeExplanation {
                    name,
                    fits: false,
                    claims: Vec::new(),
                    reason: None,
                    explanation: None,
                    error: Some(error),
                },
            })
            .collect(),
    }
}

/// One node's outcome.
enum Outcome {
    Fits(Vec<ClaimAllocation>),
    /// The plugin's reason, and with `explain` where the search decided, why.
    DoesNotFit {
        reason: String,
        explanation: Option<Box<Explanation>>,
    },
    Error(String),
}

/// The nodes to answer for: every node, or only `options.node`.
fn selected_nodes<'n>(nodes: &'n [Node], options: &Options) -> Vec<&'n Node> {
    nodes
        .iter()
        .filter(|n| {
            options
                .node
                .as_deref()
                .is_none_or(|want| n.metadata.name.as_deref() == Some(want))
        })
        .collect()
}

/// PreFilter once, then Filter for each node.
fn filter(objects: &Objects, options: &Options, explain: bool) -> Vec<(String, Outcome)> {
    let nodes = selected_nodes(&objects.nodes, options);
    let name = |n: &Node| n.metadata.name.clone().unwrap_or_default();
    let every = |f: &dyn Fn() -> Outcome| nodes.iter().map(|n| (name(n), f())).collect();
    let to_allocate = objects.to_allocate();
    if to_allocate.is_empty() {
        // Nothing to allocate: the plugin skips the pod, every node fits.
        return every(&|| Outcome::Fits(Vec::new()));
    }
    let features = Features {
        distinct_attribute_per_device: options.fix_distinct_attribute,
        ..Features::V1_36
    };
    match pre_filter(&objects.classes, &to_allocate) {
        Verdict::Ok => {}
        Verdict::Unschedulable(reason) => {
            return every(&|| Outcome::DoesNotFit {
                reason: reason.clone(),
                explanation: None,
            });
        }
        Verdict::Error(error) => return every(&|| Outcome::Error(error.clone())),
    }
    let allocator = AllocatedState::from_claims(&objects.claims, features.consumable_capacity)
        .and_then(|state| Allocator::new(features, &state, &objects.classes, &objects.slices));
    let allocator = match allocator {
        Ok(a) => a,
        Err(e) => return every(&|| Outcome::Error(e.to_string())),
    };
    filter_with(&allocator, &nodes, &to_allocate, options, explain)
}

/// [`explain`] with an allocator built already for the cluster's slices, classes and
/// allocated claims (one allocator for many pods, as long as the cluster does not change):
/// `claims` are the pod's claims to allocate, `nodes` and `classes` the cluster's.
///
/// The allocator must have been built with the features [`explain`] uses
/// ([`crate::Features::V1_36`], the distinctAttribute fix as in `options`).
pub fn explain_with(
    allocator: &Allocator<'_>,
    nodes: &[Node],
    classes: &[DeviceClass],
    claims: &[&ResourceClaim],
    options: &Options,
) -> ExplainReport {
    let nodes = selected_nodes(nodes, options);
    let name = |n: &Node| n.metadata.name.clone().unwrap_or_default();
    let outcomes: Vec<(String, Outcome)> = if claims.is_empty() {
        nodes
            .iter()
            .map(|n| (name(n), Outcome::Fits(Vec::new())))
            .collect()
    } else {
        match pre_filter(classes, claims) {
            Verdict::Ok => filter_with(allocator, &nodes, claims, options, true),
            Verdict::Unschedulable(reason) => nodes
                .iter()
                .map(|n| {
                    (
                        name(n),
                        Outcome::DoesNotFit {
                            reason: reason.clone(),
                            explanation: None,
                        },
                    )
                })
                .collect(),
            Verdict::Error(error) => nodes
                .iter()
                .map(|n| (name(n), Outcome::Error(error.clone())))
                .collect(),
        }
    };
    explain_report(outcomes)
}

/// One node's verdict for a pod's claims, with an allocator built for (at least) that node's
/// slices: PreFilter's DeviceClass check, then Filter; with `explain`, why where they do not
/// fit. For [`crate::gang`], which keeps one allocator per node.
pub(crate) fn node_verdict(
    allocator: &Allocator<'_>,
    node: &Node,
    classes: &[DeviceClass],
    claims: &[&ResourceClaim],
    options: &Options,
    explain: bool,
) -> NodeExplanation {
    let name = node.metadata.name.clone().unwrap_or_default();
    let outcome = if claims.is_empty() {
        Outcome::Fits(Vec::new())
    } else {
        match pre_filter(classes, claims) {
            Verdict::Ok => filter_with(allocator, &[node], claims, options, explain)
                .pop()
                .map_or(Outcome::Fits(Vec::new()), |(_, o)| o),
            Verdict::Unschedulable(reason) => Outcome::DoesNotFit {
                reason,
                explanation: None,
            },
            Verdict::Error(error) => Outcome::Error(error),
        }
    };
    explain_report(vec![(name, outcome)])
        .nodes
        .pop()
        .unwrap_or_else(|| NodeExplanation {
            name: String::new(),
            fits: false,
            claims: Vec::new(),
            reason: None,
            explanation: None,
            error: Some("no verdict".into()),
        })
}

/// Filter for each node with a built allocator.
fn filter_with(
    allocator: &Allocator<'_>,
    nodes: &[&Node],
    to_allocate: &[&ResourceClaim],
    options: &Options,
    explain: bool,
) -> Vec<(String, Outcome)> {
    let name = |n: &Node| n.metadata.name.clone().unwrap_or_default();
    // The pod's claims are validated once, not once per node.
    let pod = allocator.pod(to_allocate);
    let mut outcomes = Vec::with_capacity(nodes.len());
    for &node in nodes {
        let node_name = name(node);
        let deadline = (!options.timeout.is_zero())
            .then(|| Instant::now().checked_add(options.timeout))
            .flatten();
        let interrupt = Interrupt {
            deadline,
            cancel: None,
        };
        let decision = if explain {
            allocator.explain_pod(node, &pod, interrupt)
        } else {
            allocator
                .allocate_pod(node, &pod, interrupt)
                .map(|a| a.map_or_else(|| Decision::DoesNotFit(Box::default()), Decision::Fits))
        };
        let outcome = match decision {
            Ok(Decision::Fits(results)) => Outcome::Fits(
                to_allocate
                    .iter()
                    .zip(results)
                    .map(|(claim, allocation)| ClaimAllocation {
                        namespace: claim.metadata.namespace.clone().unwrap_or_default(),
                        name: claim.metadata.name.clone().unwrap_or_default(),
                        allocation: allocation.to_api(),
                    })
                    .collect(),
            ),
            Ok(Decision::DoesNotFit(explanation)) => Outcome::DoesNotFit {
                reason: "cannot allocate all claims".into(),
                explanation: explain.then_some(explanation),
            },
            Err(AllocateError::TimedOut) => Outcome::Error(format!(
                "node {node_name}: timed out trying to allocate devices"
            )),
            Err(AllocateError::Cancelled) => Outcome::DoesNotFit {
                reason: "asked by caller to stop allocating devices: context canceled".into(),
                explanation: None,
            },
            Err(AllocateError::FailedOnNode(reason)) => Outcome::DoesNotFit {
                reason,
                explanation: None,
            },
            Err(AllocateError::Fatal(error)) => Outcome::Error(error),
        };
        outcomes.push((node_name, outcome));
    }
    outcomes
}

enum Verdict {
    Ok,
    Unschedulable(String),
    Error(String),
}

/// PreFilter: every request (and subrequest) names an existing DeviceClass.
fn pre_filter(classes: &[DeviceClass], claims: &[&ResourceClaim]) -> Verdict {
    let check = |class: &str, request: &str| {
        if class.is_empty() {
            return Verdict::Error(format!("request {request}: unsupported request type"));
        }
        if !classes
            .iter()
            .any(|c| c.metadata.name.as_deref() == Some(class))
        {
            return Verdict::Unschedulable(format!(
                "request {request}: device class {class} does not exist"
            ));
        }
        Verdict::Ok
    };
    for claim in claims {
        let requests = claim
            .spec
            .devices
            .as_ref()
            .and_then(|d| d.requests.as_deref())
            .unwrap_or_default();
        for request in requests {
            let subs = request.first_available.as_deref().unwrap_or_default();
            if let Some(exactly) = &request.exactly {
                match check(&exactly.device_class_name, &request.name) {
                    Verdict::Ok => {}
                    other => return other,
                }
            } else if !subs.is_empty() {
                for sub in subs {
                    match check(
                        &sub.device_class_name,
                        &format!("{}/{}", request.name, sub.name),
                    ) {
                        Verdict::Ok => {}
                        other => return other,
                    }
                }
            } else {
                return Verdict::Unschedulable(format!(
                    "resource claim {}, request {}: unknown request type",
                    claim_ref(claim),
                    request.name
                ));
            }
        }
    }
    Verdict::Ok
}
