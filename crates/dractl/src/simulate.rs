//! `dractl simulate`: how many more pods with the given claim templates fit, on which nodes,
//! and what stops the next one ([`simulate`]); or whether a job of N pods, a gang, fits, where,
//! and what blocks it ([`simulate_job`], over [`dra_allocator::gang`]).
//!
//! Pods are placed one after the other, each on the first node (in input order) where the
//! allocator ([`dra_allocator::allocate`], the scheduler's own rules) fits its claims; its
//! allocations then count as in use for the next pod. A real scheduler scores nodes and may
//! spread pods, so where a pod lands can differ; the count is that of a first-fit packing.
//! When a pod no longer fits (or `--count` is reached), the next pod's explanation
//! ([`dra_allocator::explain()`]) says what ran out first, node by node.

use std::collections::BTreeMap;

use dra_allocator::explain::ExplainReport;
use dra_allocator::gang::{Flag, Group, GroupPlacement, GroupPod};
use dra_allocator::{NodeReport, Objects, Options};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimStatus};
use serde::Serialize;
use serde_json::Value;

use crate::objects::{InputError, Location, Reader};
use crate::podgroup::{ClaimSource, PodGroup};
use crate::workload::JobManifest;

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
    let mut docs = Vec::new();
    for file in files {
        // Every stream kubectl reads, `List`s expanded (`crate::objects::documents`).
        let text = crate::objects::read_input(file)?;
        for (location, value) in crate::objects::documents(file, &text)? {
            match value.get("kind").and_then(Value::as_str) {
                Some("ResourceClaimTemplate" | "ResourceClaim") => docs.push((location, value)),
                other => {
                    return Err(InputError::general(format!(
                        "{location}: kind {other:?}: expected a ResourceClaimTemplate or ResourceClaim"
                    )));
                }
            }
        }
    }
    if docs.is_empty() {
        return Err(InputError::general(
            "--claim-template: no ResourceClaimTemplate or ResourceClaim in the files",
        ));
    }
    read_claims(docs)
}

/// ResourceClaimTemplates (as the claims they make, named after the template) and
/// ResourceClaims, read and validated as `dractl allocate` reads claims, then defaulted as the
/// API server stores them (allocationMode, count, toleration operator).
pub(crate) fn read_claims(docs: Vec<(Location, Value)>) -> Result<Vec<ResourceClaim>, InputError> {
    let mut reader = Reader::new();
    for (location, value) in docs {
        let claim = if value.get("kind").and_then(Value::as_str) == Some("ResourceClaimTemplate") {
            serde_json::json!({
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {
                    "name": value.pointer("/metadata/name").cloned().unwrap_or(Value::Null),
                    "namespace": value.pointer("/metadata/namespace").cloned()
                        .unwrap_or_else(|| Value::from("default")),
                },
                "spec": value.pointer("/spec/spec").cloned().unwrap_or(Value::Null),
            })
        } else {
            value
        };
        reader.read_value(location, claim)?;
    }
    let mut objects = Objects {
        nodes: Vec::new(),
        classes: Vec::new(),
        slices: Vec::new(),
        claims: reader.finish().claims,
    };
    dra_allocator::apply_defaults(&mut objects);
    Ok(objects.claims)
}

/// What `--pod-group` files hold: the PodGroup, and the ResourceClaimTemplates and
/// ResourceClaims beside it (its claims may name them).
#[derive(Debug, Clone)]
pub struct PodGroupInput {
    /// The PodGroup.
    pub pod_group: PodGroup,
    /// ResourceClaimTemplates in the files, as the claims they make.
    pub templates: Vec<ResourceClaim>,
    /// ResourceClaims in the files.
    pub claims: Vec<ResourceClaim>,
}

/// Reads `--pod-group` files: exactly one PodGroup ([`crate::podgroup`]), plus any
/// ResourceClaimTemplates and ResourceClaims its claims name; Workloads are skipped.
///
/// # Errors
/// An [`InputError`] naming the file, document, object and field.
pub fn read_pod_group(files: &[String]) -> Result<PodGroupInput, InputError> {
    let mut groups = Vec::new();
    let mut templates = Vec::new();
    let mut claims = Vec::new();
    for file in files {
        let text = crate::objects::read_input(file)?;
        for (location, value) in crate::objects::documents(file, &text)? {
            match value.get("kind").and_then(Value::as_str) {
                Some("PodGroup") => groups.push(crate::podgroup::parse(location, &value)?),
                Some("ResourceClaimTemplate") => templates.push((location, value)),
                Some("ResourceClaim") => claims.push((location, value)),
                Some("Workload") => {}
                other => {
                    return Err(InputError::general(format!(
                        "{location}: kind {other:?}: expected a PodGroup, or the \
                         ResourceClaimTemplates and ResourceClaims it names"
                    )));
                }
            }
        }
    }
    let pod_group = match groups.len() {
        1 => groups.remove(0),
        0 => return Err(InputError::general("--pod-group: no PodGroup in the files")),
        n => {
            return Err(InputError::general(format!(
                "--pod-group: {n} PodGroups in the files ({}): simulate one at a time",
                groups
                    .iter()
                    .map(PodGroup::object)
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
    };
    Ok(PodGroupInput {
        pod_group,
        templates: read_claims(templates)?,
        claims: read_claims(claims)?,
    })
}

/// A job to place: its pods, and whether they are a gang.
#[derive(Debug, Clone, Default)]
pub struct Job {
    /// Pods (`--count`); without it, the gang's `minCount`.
    pub count: Option<usize>,
    /// `--gang`: all or nothing, `minCount` = the pods.
    pub gang: bool,
    /// `--min-count`: a gang of this `minCount`.
    pub min_count: Option<usize>,
    /// `--topology-key`.
    pub topology_key: Option<String>,
}

/// [`simulate_job`]'s answer.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct JobSimulation {
    /// The PodGroup, `namespace/name`, when one was given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_group: Option<String>,
    /// Where the pods go, or why not ([`dra_allocator::gang`]).
    #[serde(flatten)]
    pub placement: GroupPlacement,
    /// Unallocated claims in the cluster input, left out (they belong to other pending pods).
    pub ignored_pending_claims: usize,
}

/// Places a job's pods on the cluster ([`dra_allocator::gang::place`]): `job.count` pods (or
/// the Job's `parallelism`, or the gang's `minCount`), each with one claim per template, plus
/// the claims shared by all (a PodGroup's, and those the Job's pods name directly).
///
/// The pods' own templates are those the Job's pod template names (looked up in its files and
/// `templates`), or without a Job every template of `templates` that the PodGroup does not
/// claim. A PodGroup claim naming a template finds it in the PodGroup's files, the Job's or
/// `templates`; one naming a ResourceClaim finds it in those files or the cluster's claims. A
/// pod claim that matches a PodGroup claim (same name and source) is the PodGroup's.
///
/// # Errors
/// An [`InputError`] naming the object and field: no pod count, no claims at all, a template or
/// claim that is nowhere, a Job whose `schedulingGroup` names another PodGroup than the one
/// given, or a slice or claim with a malformed quantity.
pub fn simulate_job(
    mut cluster: Objects,
    mut templates: Vec<ResourceClaim>,
    pod_group: Option<PodGroupInput>,
    manifest: Option<JobManifest>,
    job: &Job,
    options: &Options,
) -> Result<JobSimulation, InputError> {
    let mut shared: Vec<ResourceClaim> = Vec::new();
    let (mut min_count, mut topology_key) = (job.min_count, job.topology_key.clone());
    let mut pod_prefix = "pod".to_owned();
    let mut group_name = None;
    let mut count = job.count;
    // Every template a PodGroup claim may name besides its own files'.
    let mut store = templates.clone();
    // A Job's (or JobSet's) pods by role: name prefix, pods, their own templates.
    let mut roles: Vec<(String, usize, Vec<ResourceClaim>, &[String])> = Vec::new();
    if let Some(m) = &manifest {
        pod_prefix.clone_from(&m.name);
        if count.is_some() && m.roles.len() > 1 {
            return Err(m.error(
                "spec.replicatedJobs",
                "--count: a JobSet's pods are its replicated jobs' replicas x parallelism",
            ));
        }
        count = count.or(Some(m.pods()));
        let group = pod_group.as_ref().map(|p| &p.pod_group);
        match (&m.pod_group, group) {
            (Some(want), Some(g)) if *want != g.name || m.namespace != g.namespace => {
                return Err(m.error(
                    "spec.template.spec.schedulingGroup.podGroupName",
                    format!(
                        "{want:?}: the --pod-group file holds {} instead",
                        g.object()
                    ),
                ));
            }
            (Some(want), None) => {
                return Err(m.error(
                    "spec.template.spec.schedulingGroup.podGroupName",
                    format!(
                        "{want:?}: give PodGroup {}/{want} with --pod-group",
                        m.namespace
                    ),
                ));
            }
            _ => {}
        }
        let same = |c: &ResourceClaim, name: &str| {
            c.metadata.name.as_deref() == Some(name)
                && c.metadata.namespace.as_deref().unwrap_or("default") == m.namespace
        };
        for role in &m.roles {
            let mut per_pod = Vec::new();
            for c in &role.claims {
                let groups = group.is_some_and(|g| {
                    g.claims
                        .iter()
                        .any(|x| x.name == c.name && x.source == c.source)
                });
                if groups {
                    continue;
                }
                match &c.source {
                    ClaimSource::Template(t) => {
                        let found = m
                            .templates
                            .iter()
                            .chain(&templates)
                            .find(|x| same(x, t))
                            .cloned();
                        match found {
                            Some(x) => per_pod.push(x),
                            None => {
                                return Err(m.error(
                                    &format!("{}.resourceClaimTemplateName", c.field),
                                    format!(
                                        "ResourceClaimTemplate {}/{t} is in neither the --job nor \
                                     the --claim-template files",
                                        m.namespace
                                    ),
                                ));
                            }
                        }
                    }
                    ClaimSource::Claim(n) => {
                        let found = m.named.iter().find(|x| same(x, n)).cloned().or_else(|| {
                            let i = cluster.claims.iter().position(|x| same(x, n))?;
                            Some(cluster.claims.remove(i))
                        });
                        match found {
                            Some(x) => shared.push(x),
                            None => {
                                return Err(m.error(
                                    &format!("{}.resourceClaimName", c.field),
                                    format!(
                                        "ResourceClaim {}/{n} is in neither the --job files nor \
                                     the cluster (a live cluster's unallocated claims are not \
                                     read: put it in the --job files)",
                                        m.namespace
                                    ),
                                ));
                            }
                        }
                    }
                }
            }
            let pods = if m.roles.len() == 1 {
                count.unwrap_or(role.count)
            } else {
                role.count
            };
            roles.push((role.name.clone(), pods, per_pod, &role.pod_names));
        }
        store.extend(m.templates.iter().cloned());
        templates.clear();
    }
    if let Some(input) = &pod_group {
        let pg = &input.pod_group;
        min_count = min_count.or(pg.min_count);
        topology_key = topology_key.or_else(|| pg.topology_key.clone());
        if manifest.is_none() {
            pod_prefix.clone_from(&pg.name);
        }
        group_name = Some(format!("{}/{}", pg.namespace, pg.name));
        let same = |c: &ResourceClaim, name: &str| {
            c.metadata.name.as_deref() == Some(name)
                && c.metadata.namespace.as_deref().unwrap_or("default") == pg.namespace
        };
        for claim in &pg.claims {
            match &claim.source {
                ClaimSource::Template(t) => {
                    let template = input
                        .templates
                        .iter()
                        .chain(&store)
                        .find(|c| same(c, t))
                        .cloned()
                        .ok_or_else(|| {
                            pg.error(
                                &format!("{}.resourceClaimTemplateName", claim.field),
                                format!(
                                    "ResourceClaimTemplate {}/{t} is in neither the \
                                     --pod-group nor the --claim-template (or --job) files",
                                    pg.namespace
                                ),
                            )
                        })?;
                    if manifest.is_none() {
                        // Without a Job, a template the PodGroup claims is no pod's own.
                        templates.retain(|c| !same(c, t));
                    }
                    let mut c = template;
                    c.metadata.name = Some(format!("{}-{}-simulated", pg.name, claim.name));
                    shared.push(c);
                }
                ClaimSource::Claim(n) => {
                    let found = input
                        .claims
                        .iter()
                        .chain(manifest.iter().flat_map(|m| &m.named))
                        .find(|c| same(c, n))
                        .cloned()
                        .or_else(|| {
                            let i = cluster.claims.iter().position(|c| same(c, n))?;
                            Some(cluster.claims.remove(i))
                        });
                    match found {
                        Some(c) => shared.push(c),
                        None => {
                            return Err(pg.error(
                                &format!("{}.resourceClaimName", claim.field),
                                format!(
                                    "ResourceClaim {}/{n} is in neither the --pod-group files \
                                     nor the cluster (a live cluster's unallocated claims are \
                                     not read: put it in the --pod-group files)",
                                    pg.namespace
                                ),
                            ));
                        }
                    }
                }
            }
        }
    }
    if job.gang && min_count.is_none() {
        min_count = count;
    }
    let count = count.or(min_count).ok_or_else(|| {
        InputError::general(
            "--count: how many pods? (or a Job's parallelism, --job; or a gang's minCount: \
             --min-count, --pod-group)",
        )
    })?;
    if manifest.is_none() {
        roles.push((pod_prefix, count, templates, &[]));
    }
    if roles.iter().all(|(_, _, t, _)| t.is_empty()) && shared.is_empty() {
        return Err(InputError::general(
            "--claim-template: the pods have no claims (every template is the PodGroup's)",
        ));
    }
    let before = cluster.claims.len();
    cluster.claims.retain(dra_allocator::is_allocated);
    let ignored_pending_claims = before - cluster.claims.len();
    let mut pods = Vec::new();
    for (prefix, count, templates, names) in &roles {
        for i in 1..=*count {
            let n = pods.len() + 1;
            pods.push(GroupPod {
                name: names
                    .get(i - 1)
                    .cloned()
                    .unwrap_or_else(|| format!("{prefix}-{i}")),
                claims: templates
                    .iter()
                    .map(|t| {
                        let mut claim = t.clone();
                        let name = t.metadata.name.as_deref().unwrap_or("claim");
                        claim.metadata.name = Some(format!("simulated-{n}-{name}"));
                        claim
                    })
                    .collect(),
            });
        }
    }
    let group = Group {
        pods,
        shared,
        min_count,
        topology_key,
        pod_group: group_name.is_some(),
    };
    let mut placement = dra_allocator::gang::place(&cluster, &group, options)
        .map_err(|e| InputError::general(e.to_string()))?;
    if let Some(m) = &manifest
        && group.min_count.is_none()
    {
        for role in m.roles.iter().filter(|r| r.gang_with_gate) {
            let message = if m.kind == "Job" {
                format!(
                    "Job {}/{} is Indexed with completions = parallelism = {}: under the \
                     WorkloadWithJob gate (alpha in Kubernetes 1.36) the Job controller makes it \
                     a gang of minCount {}; --gang simulates that",
                    m.namespace, m.name, role.parallelism, role.parallelism
                )
            } else {
                format!(
                    "{}: the Jobs of replicated job {:?} are Indexed with completions = \
                     parallelism = {}: under the WorkloadWithJob gate (alpha in Kubernetes 1.36) \
                     the Job controller makes each a gang of minCount {} of its own (not one \
                     gang of the JobSet: for that, a PodGroup the pods name)",
                    m.object(),
                    role.name,
                    role.parallelism,
                    role.parallelism
                )
            };
            placement.flags.push(Flag {
                code: "workloadWithJob",
                message,
            });
        }
    }
    Ok(JobSimulation {
        pod_group: group_name,
        placement,
        ignored_pending_claims,
    })
}

/// A device for text: `device` where its pool is named after the node (as drust's are),
/// else `pool/device`.
fn short_device(node: &str, id: &str) -> String {
    let mut parts = id.splitn(3, '/');
    let (_, pool, device) = (parts.next(), parts.next(), parts.next());
    match (pool, device) {
        (Some(p), Some(d)) if p == node => d.to_owned(),
        (Some(p), Some(d)) => format!("{p}/{d}"),
        _ => id.to_owned(),
    }
}

fn plural(n: usize, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

/// The grouped reasons of an explanation, one line each, indented.
fn reasons(out: &mut String, report: &ExplainReport, indent: &str) {
    use std::fmt::Write as _;
    for group in report.groups() {
        if let Some(reason) = group.reason {
            let nodes = if group.nodes.len() <= 3 {
                format!(
                    "{} ({})",
                    plural(group.nodes.len(), "node"),
                    group.nodes.join(", ")
                )
            } else {
                plural(group.nodes.len(), "node")
            };
            let what = if group.error { "error" } else { "does not fit" };
            let _ = writeln!(out, "{indent}{nodes}, {what}: {reason}");
        }
    }
}

/// The human report of a job.
pub fn job_text(s: &JobSimulation) -> String {
    use std::fmt::Write as _;
    let p = &s.placement;
    let mut out = String::new();
    let mut what = if p.gang {
        format!(
            "A gang of {} (minCount {})",
            plural(p.pods, "pod"),
            p.required
        )
    } else {
        format!("A job of {}", plural(p.pods, "pod"))
    };
    if let Some(g) = &s.pod_group {
        what = format!("PodGroup {g}: {}", what.replacen('A', "a", 1));
    }
    if let Some(key) = &p.topology_key {
        let _ = write!(what, " in one domain of {key}");
    }
    let headline = if p.waiting_for_pods {
        format!(
            "{what}: does not fit: the scheduler waits for {} to exist and tries nothing.",
            plural(p.required, "pod")
        )
    } else if p.fits {
        match &p.domain {
            Some(d) => format!("{what}: fits, in {d}."),
            None => format!("{what}: fits."),
        }
    } else if p.gang {
        format!("{what}: does not fit; nothing is placed.")
    } else {
        format!(
            "{what}: does not fit: {} of {} fit{}.",
            p.placed.len(),
            plural(p.pods, "pod"),
            p.domain
                .as_ref()
                .map(|d| format!(" (in {d})"))
                .unwrap_or_default()
        )
    };
    let _ = writeln!(out, "{headline}");
    for pod in &p.placed {
        let devices: Vec<String> = pod
            .devices
            .iter()
            .map(|d| short_device(&pod.node, d))
            .collect();
        let _ = writeln!(
            out,
            "  {} on {}: {}",
            pod.name,
            pod.node,
            if devices.is_empty() {
                "no devices".to_owned()
            } else {
                devices.join(", ")
            }
        );
    }
    for c in &p.shared_claims {
        let results: Vec<String> = c
            .allocation
            .devices
            .iter()
            .flat_map(|d| d.results.iter().flatten())
            .map(|r| format!("{}/{}/{}", r.driver, r.pool, r.device))
            .collect();
        let _ = writeln!(
            out,
            "  the group's claim {}/{}: {}",
            c.namespace,
            c.name,
            results.join(", ")
        );
    }
    if !p.placed.is_empty() {
        let mut per_node: BTreeMap<&str, usize> = BTreeMap::new();
        for pod in &p.placed {
            *per_node.entry(pod.node.as_str()).or_default() += 1;
        }
        let per: Vec<String> = per_node.iter().map(|(n, k)| format!("{n}: {k}")).collect();
        let _ = writeln!(out, "Per node: {}.", per.join(", "));
    }
    if !p.unlabeled_nodes.is_empty() {
        let names = if p.unlabeled_nodes.len() <= 5 {
            format!(" ({})", p.unlabeled_nodes.join(", "))
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "{} without the label {} in no domain{names}.",
            plural(p.unlabeled_nodes.len(), "node"),
            p.topology_key.as_deref().unwrap_or("")
        );
    }
    // Where the scheduler's order stopped, per domain (every domain but the chosen one when
    // the job fits).
    for d in &p.domains {
        let chosen = p.fits && d.name == p.domain;
        let Some(b) = &d.blocked else { continue };
        if chosen && !p.gang && d.placed == p.pods {
            continue;
        }
        let place = match &d.name {
            Some(n) => format!(
                "{} {n} ({}): {} of {} fit; ",
                if p.fits { "Also tried" } else { "In" },
                plural(d.nodes.len(), "node"),
                d.placed,
                plural(p.pods, "pod")
            ),
            None => String::new(),
        };
        let _ = writeln!(out);
        match &b.error {
            Some(e) => {
                let _ = writeln!(
                    out,
                    "{place}{}'s attempt fails with the scheduler's error, which stops the group: {e}",
                    b.name
                );
            }
            None => {
                let _ = writeln!(out, "{place}{} fits on no node:", b.name);
                reasons(&mut out, &b.report, "  ");
            }
        }
    }
    if p.placement_exists == Some(false) && !p.waiting_for_pods {
        let most: Vec<String> = p
            .domains
            .iter()
            .filter_map(|d| {
                let c = d.capacity.as_ref()?;
                Some(match &d.name {
                    Some(n) => format!("{} in {n}", c.pods),
                    None => c.pods.to_string(),
                })
            })
            .collect();
        let _ = writeln!(
            out,
            "\nNo choice of devices does better: with devices chosen together, at most {} fit.",
            most.join(", ")
        );
    }
    let notes: Vec<&Flag> = p
        .flags
        .iter()
        .filter(|f| f.code != "waitingForPods")
        .collect();
    if !notes.is_empty() {
        let _ = writeln!(out);
        for f in notes {
            let _ = writeln!(out, "Note ({}): {}.", f.code, f.message);
        }
    }
    if s.ignored_pending_claims > 0 {
        let _ = writeln!(
            out,
            "({} unallocated claims in the input were left out: they belong to other pending pods.)",
            s.ignored_pending_claims
        );
    }
    out
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
