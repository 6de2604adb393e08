//! `dractl explain`: why a pod's claims do not fit, node by node, offline from the same files
//! as `dractl allocate` ([`dra_allocator::explain()`]).
//!
//! Human output first: a verdict line, then the nodes grouped by reason, each group with the
//! funnel of its first node (devices left at each stage, what removed them). `-o json` is the
//! [`ExplainReport`] as one object.

use std::fmt::Write as _;

use dra_allocator::explain::{ExplainReport, Explanation, Needed, NodeExplanation, Stage};

use crate::objects::{InputError, Inputs};

pub use dra_allocator::Options;

/// Output formats of `-o`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// For people: a verdict, then nodes grouped by reason with a funnel each.
    Text,
    /// One JSON object, `{"nodes": [...]}`.
    Json,
    /// The same content as YAML.
    Yaml,
}

/// How many node names a group lists.
const NODE_NAMES: usize = 8;

/// Defaults the objects and explains, per node, whether the pod's claims fit.
///
/// # Errors
/// An [`InputError`] when `--node` names a node that is not in the input.
pub fn explain(inputs: Inputs, options: &Options) -> Result<ExplainReport, InputError> {
    let objects = crate::allocate::objects(inputs, options)?;
    Ok(explain_objects(&objects, options).0)
}

/// [`dra_allocator::explain()`] of defaulted `objects`, then the node plugin's own refusals: a
/// node where the claims fit only with an allocation the plugin will not prepare
/// ([`gpu_inventory::shares::prepare_refusal`]) does not fit, with that reason. Also returns
/// those refusals, by node.
pub fn explain_objects(
    objects: &dra_allocator::Objects,
    options: &Options,
) -> (ExplainReport, Vec<(String, String)>) {
    let mut report = dra_allocator::explain(objects, options);
    let devices = gpu_inventory::shares::devices_by_name(&objects.slices);
    let device = |r: &k8s_openapi::api::resource::v1::DeviceRequestAllocationResult| {
        devices
            .get(&(r.driver.as_str(), r.pool.as_str(), r.device.as_str()))
            .copied()
    };
    let mut refusals = Vec::new();
    for node in report.nodes.iter_mut().filter(|n| n.fits) {
        let refusal = node.claims.iter().find_map(|c| {
            let results = c.allocation.devices.as_ref()?.results.as_deref()?;
            let why = gpu_inventory::shares::prepare_refusal(results, device)?;
            Some(format!(
                "claim {}/{} is allocated here, but {why}",
                c.namespace, c.name
            ))
        });
        if let Some(reason) = refusal {
            node.fits = false;
            node.claims.clear();
            refusals.push((node.name.clone(), reason.clone()));
            node.reason = Some(reason);
        }
    }
    (report, refusals)
}

/// Renders a report (every format ends with a newline).
///
/// # Errors
/// Serialization failures (not expected for reports).
pub fn render(report: &ExplainReport, format: Format) -> Result<String, String> {
    match format {
        Format::Json => serde_json::to_string(report)
            .map(|s| s + "\n")
            .map_err(|e| e.to_string()),
        Format::Yaml => gpu_inventory::yaml::to_string(report),
        Format::Text => Ok(text(report)),
    }
}

fn node_list(nodes: &[&str]) -> String {
    let mut list = nodes
        .iter()
        .take(NODE_NAMES)
        .copied()
        .collect::<Vec<_>>()
        .join(", ");
    if nodes.len() > NODE_NAMES {
        let _ = write!(list, ", ... ({} more)", nodes.len() - NODE_NAMES);
    }
    list
}

fn plural(n: usize, one: &str) -> String {
    if n == 1 {
        format!("1 {one}")
    } else {
        format!("{n} {one}s")
    }
}

/// The human report.
pub fn text(report: &ExplainReport) -> String {
    let mut out = String::new();
    let total = report.nodes.len();
    let fitting: Vec<&str> = report.fitting().map(|n| n.name.as_str()).collect();
    if total == 0 {
        out.push_str("No nodes in the input.\n");
        return out;
    }
    if fitting.is_empty() {
        let _ = writeln!(
            out,
            "Does not fit: the pod's claims fit on no node ({} checked).",
            plural(total, "node")
        );
    } else {
        let _ = writeln!(
            out,
            "Fits on {} of {}: {}.",
            fitting.len(),
            plural(total, "node"),
            node_list(&fitting)
        );
    }
    for group in report.groups() {
        let Some(reason) = group.reason else {
            continue;
        };
        out.push('\n');
        let what = if group.error { "error" } else { "does not fit" };
        let _ = writeln!(
            out,
            "{} ({}), {what}: {reason}",
            plural(group.nodes.len(), "node"),
            node_list(&group.nodes)
        );
        let first = report
            .nodes
            .iter()
            .find(|n| group.nodes.first() == Some(&n.name.as_str()));
        if let Some(NodeExplanation {
            name,
            explanation: Some(e),
            ..
        }) = first
        {
            funnels(&mut out, name, e, group.nodes.len() > 1);
        }
    }
    out
}

fn funnels(out: &mut String, node: &str, e: &Explanation, for_group: bool) {
    if for_group {
        let _ = writeln!(out, "  on {node}:");
    }
    for p in &e.skipped_pools {
        let _ = writeln!(out, "  pool {} skipped: {}", p.pool, p.reason);
    }
    for f in &e.requests {
        let needed = match f.needed {
            Needed::Count(n) => format!("needs {n}"),
            Needed::All(n) => format!("needs all ({n})"),
        };
        let verdict = match f.blocked_at {
            Some(_) => "blocked",
            None => "fits alone",
        };
        let _ = writeln!(
            out,
            "  claim {}, request {} (class {}, {needed}): {verdict}",
            f.claim, f.request, f.device_class
        );
        for s in &f.stages {
            let _ = write!(out, "    {:>4}  {}", s.left, s.stage.describe());
            let mut notes = Vec::new();
            for sel in &s.selectors {
                notes.push(format!("`{}` removed {}", sel.expression, sel.removed));
            }
            if !s.examples.is_empty() && s.stage != Stage::Constraint {
                notes.push(format!("removed: {}", s.examples.join(", ")));
            }
            for err in &s.errors {
                notes.push(format!("error: {err}"));
            }
            if !notes.is_empty() {
                let _ = write!(out, " ({})", notes.join("; "));
            }
            if f.blocked_at == Some(s.stage) {
                out.push_str("  <- too few\n");
                // The later stages only repeat the shortage.
                break;
            }
            out.push('\n');
        }
        for c in &f.constraints {
            let values: Vec<String> = c
                .values
                .iter()
                .map(|v| format!("{} has {}", v.value, v.devices))
                .collect();
            let without = if c.without > 0 {
                format!(", {} without it", c.without)
            } else {
                String::new()
            };
            let _ = writeln!(
                out,
                "          {} {}: {}{without}",
                c.constraint,
                c.attribute,
                if values.is_empty() {
                    "no values".to_string()
                } else {
                    values.join(", ")
                }
            );
        }
    }
    for c in &e.competition {
        let _ = writeln!(
            out,
            "  {} compete: {} needed, {} usable, both want {}",
            c.requests.join(" and "),
            c.needed,
            c.available,
            c.shared.join(", ")
        );
    }
}
