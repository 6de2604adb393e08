//! Mechanical checks of `dra_allocator::explain` on a scenario: the explanation agrees with
//! the allocator's answer node by node, its funnels are consistent, and what it claims about a
//! request alone holds when that request is allocated alone:
//!
//! - a request it names as blocked at a stage does not fit on that node as the pod's only
//!   request (with the claim's constraints on it when the stage is the constraint);
//! - when it says every request fits alone, each of them (the subrequest it chose) does.

use std::collections::BTreeMap;

use dra_allocator::explain::{NodeExplanation, RequestFunnel, Stage};
use dra_allocator::{AllocatedState, Allocator, Features, Interrupt, NodeReport, Objects};
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::Value;

/// What the checks covered.
#[derive(Debug, Default)]
pub struct Tally {
    /// Explanations checked.
    pub explanations: usize,
    /// Blocked requests, by stage, each re-allocated alone.
    pub blocked: BTreeMap<String, usize>,
    /// "Fits alone" requests re-allocated alone.
    pub fits_alone: usize,
    /// Explanations that name competing requests.
    pub competition: usize,
}

/// The scenario's objects as `dractl allocate` reads and defaults them.
fn objects(id: &str, scenario: &[Value]) -> Result<Objects, String> {
    dractl::allocate::objects(super::read(id, scenario)?, &super::untimed())
        .map_err(|e| e.to_string())
}

/// Problems found (empty when consistent); counts go to `tally`.
pub fn check(id: &str, scenario: &[Value], tally: &mut Tally) -> Vec<String> {
    let objects = match objects(id, scenario) {
        Ok(o) => o,
        Err(e) => return vec![format!("explain: reading the scenario: {e}")],
    };
    let options = super::untimed();
    let allocated = dra_allocator::allocate(&objects, &options);
    let explained = dra_allocator::explain(&objects, &options);
    // One allocator for every request allocated alone: the same slices and claims in use.
    // (None where it cannot be built: then every node is an error, with nothing explained.)
    let allocator = AllocatedState::from_claims(&objects.claims, true)
        .and_then(|state| {
            Allocator::new(Features::V1_36, &state, &objects.classes, &objects.slices)
        })
        .ok();
    let mut problems = Vec::new();
    if allocated.nodes.len() != explained.nodes.len() {
        return vec![format!(
            "explain: {} nodes explained, {} allocated",
            explained.nodes.len(),
            allocated.nodes.len()
        )];
    }
    for (a, e) in allocated.nodes.iter().zip(&explained.nodes) {
        let agrees = match a {
            NodeReport::Allocated { name, claims, .. } => {
                // Share IDs are random: compared by presence.
                let normalized = |c: &Vec<dra_allocator::ClaimAllocation>| {
                    let mut v = serde_json::to_value(c).unwrap_or_default();
                    blank_share_ids(&mut v);
                    v
                };
                e.fits && &e.name == name && normalized(&e.claims) == normalized(claims)
            }
            NodeReport::NotAllocated { name, reason, .. } => {
                !e.fits
                    && &e.name == name
                    && e.error.is_none()
                    && (e.explanation.is_some() || e.reason.as_ref() == Some(reason))
            }
            NodeReport::Error { name, error } => {
                !e.fits && &e.name == name && e.error.as_ref() == Some(error)
            }
        };
        if !agrees {
            problems.push(format!(
                "explain: node {}: the explanation's outcome differs from allocate's",
                e.name
            ));
            continue;
        }
        match (&e.explanation, &allocator) {
            (Some(_), Some(allocator)) => {
                problems.extend(check_node(&objects, allocator, e, tally))
            }
            (Some(_), None) => problems.push(format!(
                "explain: node {}: an explanation where no allocator can be built",
                e.name
            )),
            (None, _) => {}
        }
    }
    problems
}

fn blank_share_ids(v: &mut Value) {
    match v {
        Value::Object(m) => {
            for (k, x) in m.iter_mut() {
                if k == "shareID" {
                    *x = Value::Bool(true);
                } else {
                    blank_share_ids(x);
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(blank_share_ids),
        _ => {}
    }
}

fn check_node(
    objects: &Objects,
    allocator: &Allocator<'_>,
    node: &NodeExplanation,
    tally: &mut Tally,
) -> Vec<String> {
    let Some(explanation) = &node.explanation else {
        return Vec::new();
    };
    tally.explanations += 1;
    let mut problems = Vec::new();
    let at = |what: String| format!("explain: node {}: {what}", node.name);
    if explanation.reason.is_empty() {
        problems.push(at("empty reason".into()));
    }
    for f in &explanation.requests {
        // Stages only ever remove devices, and the named stage is the first short one.
        let mut previous = usize::MAX;
        for s in &f.stages {
            if s.left > previous {
                problems.push(at(format!(
                    "{}: stage {:?} adds devices",
                    f.request, s.stage
                )));
            }
            previous = s.left;
        }
        let first_short = f
            .stages
            .iter()
            .find(|s| s.left < f.needed.devices())
            .map(|s| s.stage);
        // Beyond a short stage: no combination of devices alone, or an error alone at the
        // stage that recorded it.
        let explained_otherwise = first_short.is_none()
            && (f.blocked_at == Some(Stage::Combination)
                || f.blocked_at
                    .and_then(|b| f.stage(b))
                    .is_some_and(|s| !s.errors.is_empty()));
        if first_short != f.blocked_at && !explained_otherwise {
            problems.push(at(format!(
                "{}: blocked at {:?}, first short stage {first_short:?}",
                f.request, f.blocked_at
            )));
        }
    }
    let mut blocked_request = false;
    for (claim, request, funnels) in explanation.by_request() {
        let blocked = funnels.iter().all(|f| f.blocked_at.is_some());
        if !blocked {
            continue;
        }
        // The reason names the first blocked request; later ones are checked all the same.
        if !blocked_request
            && !explanation
                .reason
                .starts_with(&format!("claim {claim}, request {request}:"))
        {
            problems.push(at(format!(
                "the first blocked request is {claim} {request}, the reason says {:?}",
                explanation.reason
            )));
        }
        blocked_request = true;
        for f in funnels {
            let Some(stage) = f.blocked_at else { continue };
            *tally.blocked.entry(format!("{stage:?}")).or_default() += 1;
            // A short stage holds without the constraints (they only remove more); a request
            // blocked beyond every stage was found so by a search with them.
            let short = f.stage(stage).is_some_and(|s| s.left < f.needed.devices());
            let constraints = stage == Stage::Constraint || !short;
            match alone(objects, allocator, &node.name, f, constraints) {
                Ok(false) => {}
                Ok(true) => problems.push(at(format!(
                    "claim {claim}, request {}: blocked at {stage:?}, but it fits alone",
                    f.request
                ))),
                Err(e) => problems.push(at(e)),
            }
        }
    }
    if !blocked_request {
        if !explanation.reason.starts_with("every request fits alone") {
            problems.push(at(format!(
                "no request is blocked, but the reason is {:?}",
                explanation.reason
            )));
        }
        if !explanation.competition.is_empty() {
            tally.competition += 1;
        }
        for (_, _, funnels) in explanation.by_request() {
            let Some(f) = funnels.iter().find(|f| f.blocked_at.is_none()) else {
                continue;
            };
            tally.fits_alone += 1;
            match alone(objects, allocator, &node.name, f, true) {
                Ok(true) => {}
                Ok(false) => problems.push(at(format!(
                    "claim {}, request {}: said to fit alone, but does not",
                    f.claim, f.request
                ))),
                Err(e) => problems.push(at(e)),
            }
        }
    }
    problems
}

/// Whether the funnel's (sub)request, as the pod's only request, fits on the node; with
/// `constraints`, the claim's constraints that cover it stay on it.
fn alone(
    objects: &Objects,
    allocator: &Allocator<'_>,
    node: &str,
    f: &RequestFunnel,
    constraints: bool,
) -> Result<bool, String> {
    let (namespace, name) = f.claim.split_once('/').unwrap_or(("", &f.claim));
    let Some(claim) = objects.to_allocate().into_iter().find(|c| {
        c.metadata.namespace.as_deref().unwrap_or("") == namespace
            && c.metadata.name.as_deref() == Some(name)
    }) else {
        return Err(format!("claim {} not found", f.claim));
    };
    let (base, sub) = match f.request.split_once('/') {
        Some((b, s)) => (b, Some(s)),
        None => (f.request.as_str(), None),
    };
    let mut single: ResourceClaim = claim.clone();
    let Some(devices) = single.spec.devices.as_mut() else {
        return Err(format!("claim {} has no requests", f.claim));
    };
    let Some(mut request) = devices
        .requests
        .iter()
        .flatten()
        .find(|r| r.name == base)
        .cloned()
    else {
        return Err(format!("claim {}: request {base} not found", f.claim));
    };
    if let Some(sub) = sub {
        request.first_available = request
            .first_available
            .map(|subs| subs.into_iter().filter(|s| s.name == sub).collect());
    }
    devices.requests = Some(vec![request]);
    devices.config = None;
    devices.constraints = if constraints {
        Some(
            devices
                .constraints
                .iter()
                .flatten()
                .filter(|c| {
                    let names = c.requests.as_deref().unwrap_or_default();
                    names.is_empty()
                        || names
                            .iter()
                            .any(|n| n == base || sub.is_some_and(|s| *n == format!("{base}/{s}")))
                })
                .cloned()
                .map(|mut c| {
                    c.requests = None;
                    c
                })
                .collect(),
        )
    } else {
        None
    };
    let node = objects
        .nodes
        .iter()
        .find(|n| n.metadata.name.as_deref() == Some(node))
        .ok_or_else(|| format!("node {node} not found"))?;
    Ok(matches!(
        allocator.allocate(node, &[&single], Interrupt::default()),
        Ok(Some(_))
    ))
}
