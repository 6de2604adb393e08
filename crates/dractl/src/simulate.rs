//! `dractl simulate`: how many more pods with the given claim templates fit, on which nodes,
//! and what stops the next one.
//!
//! Pods are placed one after the other, each on the first node (in input order) where the
//! allocator ([`dra_allocator::allocate`], the scheduler's own rules) fits its claims; its
//! allocations then count as in use for the next pod. A real scheduler scores nodes and may
//! spread pods, so where a pod lands can differ; the count is that of a first-fit packing.
//! When a pod no longer fits (or `--count` is reached), the next pod's explanation
//! ([`dra_allocator::explain()`]) says what ran out first, node by node.

use std::collections::BTreeMap;

use dra_allocator::explain::ExplainReport;
use dra_allocator::{NodeReport, Objects, Options};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimStatus};
use serde::Serialize;
use serde_json::Value;

use crate::objects::{InputError, Reader};

/// Most pods simulated when `--count` is not given.
pub const MAX_PODS: usize = 10_000;

/// One simulated pod.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Placement {
    /// 1 for the first pod.
    pub pod: usize,
    /// Where it fits.
    pub node: String,
    /// Its devices, `driver/pool/device`.
    pub devices: Vec<String>,
}

/// The answer.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Simulation {
    /// Pods that fit, in order.
    pub placed: Vec<Placement>,
    /// Per node, how many of them.
    pub per_node: BTreeMap<String, usize>,
    /// `--count`, if given.
    pub requested: Option<usize>,
    /// Why the simulation stopped: `count` (all requested pods fit), `full` (the next does not
    /// fit), `noDevices` (the claims take no device, so any number fits) or `limit`.
    pub stopped: &'static str,
    /// Unallocated claims in the cluster input, left out (they belong to other pending pods).
    pub ignored_pending_claims: usize,
    /// For `full`: why the next pod fits nowhere.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next: Option<ExplainReport>,
}

/// The pod's claims from ResourceClaimTemplates (or ResourceClaims) in `files`, read and
/// validated as `dractl allocate` reads claims.
///
/// # Errors
/// An [`InputError`] naming the file and document, also when the files hold no template.
pub fn templates(files: &[String]) -> Result<Vec<ResourceClaim>, InputError> {
    let mut reader = Reader::new();
    let mut found = 0;
    for file in files {
        // Every stream kubectl reads, `List`s expanded (`crate::objects::documents`).
        let text = crate::objects::read_input(file)?;
        for (location, value) in crate::objects::documents(file, &text)? {
            let claim = match value.get("kind").and_then(Value::as_str) {
                Some("ResourceClaimTemplate") => serde_json::json!({
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceClaim",
                    "metadata": {
                        "name": value.pointer("/metadata/name").cloned().unwrap_or(Value::Null),
                        "namespace": value.pointer("/metadata/namespace").cloned()
                            .unwrap_or_else(|| Value::from("default")),
                    },
                    "spec": value.pointer("/spec/spec").cloned().unwrap_or(Value::Null),
                }),
                Some("ResourceClaim") => value,
                other => {
                    return Err(InputError::general(format!(
                        "{location}: kind {other:?}: expected a ResourceClaimTemplate or ResourceClaim"
                    )));
                }
            };
            found += 1;
            reader.read_value(location, claim)?;
        }
    }
    if found == 0 {
        return Err(InputError::general(
            "--claim-template: no ResourceClaimTemplate or ResourceClaim in the files",
        ));
    }
    // Defaulted as the API server stores claims (allocationMode, count, toleration operator).
    let mut objects = Objects {
        nodes: Vec::new(),
        classes: Vec::new(),
        slices: Vec::new(),
        claims: reader.finish().claims,
    };
    dra_allocator::apply_defaults(&mut objects);
    Ok(objects.claims)
}

/// Places pods with one claim per template until one does not fit, `count` fit, or
/// [`MAX_PODS`].
pub fn simulate(
    mut cluster: Objects,
    templates: &[ResourceClaim],
    count: Option<usize>,
    options: &Options,
) -> Simulation {
    let before = cluster.claims.len();
    cluster.claims.retain(dra_allocator::is_allocated);
    let ignored_pending_claims = before - cluster.claims.len();
    let mut simulation = Simulation {
        placed: Vec::new(),
        per_node: BTreeMap::new(),
        requested: count,
        stopped: "limit",
        ignored_pending_claims,
        next: None,
    };
    let limit = count.unwrap_or(MAX_PODS);
    for pod in 1..=limit {
        let claims: Vec<ResourceClaim> = templates
            .iter()
            .map(|t| {
                let mut claim = t.clone();
                let name = t.metadata.name.as_deref().unwrap_or("claim");
                claim.metadata.name = Some(format!("simulated-{pod}-{name}"));
                claim
            })
            .collect();
        let base = cluster.claims.len();
        cluster.claims.extend(claims);
        let report = dra_allocator::allocate(&cluster, options);
        let fit = report.nodes.into_iter().find_map(|n| match n {
            NodeReport::Allocated { name, claims, .. } => Some((name, claims)),
            _ => None,
        });
        let Some((node, allocations)) = fit else {
            simulation.stopped = "full";
            simulation.next = Some(dra_allocator::explain(&cluster, options));
            return simulation;
        };
        let mut devices = Vec::new();
        for (claim, allocation) in cluster.claims[base..].iter_mut().zip(allocations) {
            for r in allocation
                .allocation
                .devices
                .iter()
                .flat_map(|d| d.results.iter().flatten())
            {
                devices.push(format!("{}/{}/{}", r.driver, r.pool, r.device));
            }
            claim.status = Some(ResourceClaimStatus {
                allocation: Some(allocation.allocation),
                ..Default::default()
            });
        }
        *simulation.per_node.entry(node.clone()).or_default() += 1;
        let no_devices = devices.is_empty();
        simulation.placed.push(Placement { pod, node, devices });
        if no_devices {
            simulation.stopped = "noDevices";
            return simulation;
        }
    }
    if count.is_some() {
        simulation.stopped = "count";
    }
    simulation
}

/// The human report.
pub fn text(s: &Simulation) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let n = s.placed.len();
    let pods = |n: usize| {
        if n == 1 {
            "1 pod".into()
        } else {
            format!("{n} pods")
        }
    };
    let line = match (s.stopped, s.requested) {
        ("count", Some(c)) => format!("All {} fit.", pods(c)),
        ("noDevices", _) => {
            "The claims take no devices: any number of pods fits as far as DRA is concerned.".into()
        }
        ("limit", _) => format!("{} fit (the simulation stops at {MAX_PODS}).", pods(n)),
        (_, Some(c)) => format!("Only {} of the {} fit.", n, pods(c)),
        _ => match n {
            0 => "No more pods fit.".into(),
            1 => "1 more pod fits.".into(),
            n => format!("{n} more pods fit."),
        },
    };
    let _ = writeln!(out, "{line}");
    if !s.per_node.is_empty() {
        let per: Vec<String> = s
            .per_node
            .iter()
            .map(|(node, k)| format!("{node}: {k}"))
            .collect();
        let _ = writeln!(out, "Per node: {}.", per.join(", "));
    }
    if s.ignored_pending_claims > 0 {
        let _ = writeln!(
            out,
            "({} unallocated claims in the input were left out: they belong to other pending pods.)",
            s.ignored_pending_claims
        );
    }
    if let Some(next) = &s.next {
        let _ = writeln!(out, "\nThe next pod does not fit:");
        for group in next.groups() {
            if let Some(reason) = group.reason {
                let nodes = if group.nodes.len() == 1 {
                    "1 node".to_string()
                } else {
                    format!("{} nodes", group.nodes.len())
                };
                let what = if group.error { "error" } else { "does not fit" };
                let _ = writeln!(out, "  {nodes}, {what}: {reason}");
            }
        }
    }
    out
}
