//! The scheduler's side: PreFilter's checks, the allocated state, and Filter node by node.
//!
//! upstream: `pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go`
//! (`PreFilter`, `validateDeviceClass`, `Filter`) and `allocateddevices.go`, as
//! `tests/gotools/cmd/allocoracle` runs them on offline objects.

use std::time::Instant;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};

use crate::model::claim_ref;
use crate::{
    AllocateError, AllocatedState, Allocator, ClaimAllocation, False, Features, Interrupt,
    NodeReport, Objects, Options, Report, True,
};

/// What the plugin decides for the pod whose claims are `objects.claims` without
/// `status.allocation`, on every node (or only `options.node`; an unknown name gives no
/// entries).
pub fn allocate(objects: &Objects, options: &Options) -> Report {
    let nodes: Vec<&Node> = objects
        .nodes
        .iter()
        .filter(|n| {
            options
                .node
                .as_deref()
                .is_none_or(|want| n.metadata.name.as_deref() == Some(want))
        })
        .collect();
    let name = |n: &Node| n.metadata.name.clone().unwrap_or_default();
    let every = |f: &dyn Fn(String) -> NodeReport| Report {
        nodes: nodes.iter().map(|n| f(name(n))).collect(),
    };
    let to_allocate = objects.to_allocate();
    if to_allocate.is_empty() {
        // Nothing to allocate: the plugin skips the pod, every node fits.
        return every(&|name| NodeReport::Allocated {
            name,
            allocated: True,
            claims: Vec::new(),
        });
    }
    let features = Features {
        distinct_attribute_per_device: options.fix_distinct_attribute,
        ..Features::V1_36
    };
    match pre_filter(&objects.classes, &to_allocate) {
        Verdict::Ok => {}
        Verdict::Unschedulable(reason) => {
            return every(&|name| NodeReport::NotAllocated {
                name,
                allocated: False,
                reason: reason.clone(),
            });
        }
        Verdict::Error(error) => {
            return every(&|name| NodeReport::Error {
                name,
                error: error.clone(),
            });
        }
    }
    let allocator = AllocatedState::from_claims(&objects.claims, features.consumable_capacity)
        .and_then(|state| Allocator::new(features, &state, &objects.classes, &objects.slices));
    let allocator = match allocator {
        Ok(a) => a,
        Err(e) => {
            return every(&|name| NodeReport::Error {
                name,
                error: e.to_string(),
            });
        }
    };
    let mut report = Report {
        nodes: Vec::with_capacity(nodes.len()),
    };
    // The pod's claims are validated once, not once per node.
    let pod = allocator.pod(&to_allocate);
    for node in nodes {
        let node_name = name(node);
        let deadline = (!options.timeout.is_zero())
            .then(|| Instant::now().checked_add(options.timeout))
            .flatten();
        let interrupt = Interrupt {
            deadline,
            cancel: None,
        };
        let entry = match allocator.allocate_pod(node, &pod, interrupt) {
            Ok(Some(results)) => NodeReport::Allocated {
                name: node_name,
                allocated: True,
                claims: to_allocate
                    .iter()
                    .zip(results)
                    .map(|(claim, allocation)| ClaimAllocation {
                        namespace: claim.metadata.namespace.clone().unwrap_or_default(),
                        name: claim.metadata.name.clone().unwrap_or_default(),
                        allocation: allocation.to_api(),
                    })
                    .collect(),
            },
            Ok(None) => NodeReport::NotAllocated {
                name: node_name,
                allocated: False,
                reason: "cannot allocate all claims".into(),
            },
            Err(AllocateError::TimedOut) => NodeReport::Error {
                error: format!("node {node_name}: timed out trying to allocate devices"),
                name: node_name,
            },
            Err(AllocateError::Cancelled) => NodeReport::NotAllocated {
                name: node_name,
                allocated: False,
                reason: "asked by caller to stop allocating devices: context canceled".into(),
            },
            Err(AllocateError::FailedOnNode(reason)) => NodeReport::NotAllocated {
                name: node_name,
                allocated: False,
                reason,
            },
            Err(AllocateError::Fatal(error)) => NodeReport::Error {
                name: node_name,
                error,
            },
        };
        report.nodes.push(entry);
    }
    report
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
