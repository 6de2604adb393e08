//! `dractl allocate`: which devices kube-scheduler v1.36 would allocate to a pod's claims on
//! each node, offline, from objects as `kubectl get -o yaml` prints them.
//!
//! The input is read and checked by [`crate::objects`], defaulted like the API server does
//! ([`dra_allocator::apply_defaults`]) and allocated by [`dra_allocator::allocate`]. The output is
//! the allocator's [`Report`]: as JSON (one object), YAML, or a table for people.

use std::fmt::Write as _;

use dra_allocator::{NodeReport, Objects, Report};

use crate::objects::{InputError, Inputs};

/// How to allocate: only one node, the time allowed per node, upstream fixes.
pub use dra_allocator::Options;

/// Output formats of `-o`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// One JSON object, `{"nodes": [...]}`.
    Json,
    /// The same content as YAML.
    Yaml,
    /// A table for people: one line per node, one per device chosen.
    Table,
}

/// Defaults the objects and allocates the pod's claims (those without `status.allocation`) on
/// each node.
///
/// # Errors
/// An [`InputError`] when `--node` names a node that is not in the input.
pub fn allocate(inputs: Inputs, options: &Options) -> Result<Report, InputError> {
    let objects = objects(inputs, options)?;
    Ok(dra_allocator::allocate(&objects, options))
}

/// The inputs as the allocator takes them, defaulted like the API server does.
///
/// # Errors
/// An [`InputError`] when `--node` names a node that is not in the input.
pub fn objects(inputs: Inputs, options: &Options) -> Result<Objects, InputError> {
    if let Some(node) = &options.node
        && !inputs
            .nodes
            .iter()
            .any(|n| n.metadata.name.as_deref() == Some(node))
    {
        return Err(InputError::general(format!(
            "node {node:?} is not in the input"
        )));
    }
    let mut objects = Objects {
        nodes: inputs.nodes,
        classes: inputs.classes,
        slices: inputs.slices,
        claims: inputs.claims,
    };
    dra_allocator::apply_defaults(&mut objects);
    Ok(objects)
}

/// Renders a report in the given format (JSON and YAML end with a newline).
///
/// # Errors
/// Serialization failures (not expected for reports).
pub fn render(report: &Report, format: Format) -> Result<String, String> {
    match format {
        Format::Json => serde_json::to_string(report)
            .map(|s| s + "\n")
            .map_err(|e| e.to_string()),
        Format::Yaml => gpu_inventory::yaml::to_string(report),
        Format::Table => Ok(table(report)),
    }
}

/// One line per node (`NODE  VERDICT`), then per claim and result
/// `  namespace/claim  request -> driver/pool/device` (with `[admin]`, `[shared]`).
pub fn table(report: &Report) -> String {
    let width = report
        .nodes
        .iter()
        .map(|n| node_name(n).len())
        .max()
        .unwrap_or(4)
        .max(4);
    let mut out = String::new();
    let _ = writeln!(out, "{:width$}  RESULT", "NODE");
    for node in &report.nodes {
        match node {
            NodeReport::Allocated { name, claims, .. } => {
                let _ = writeln!(out, "{name:width$}  allocated");
                for claim in claims {
                    let results = claim
                        .allocation
                        .devices
                        .as_ref()
                        .and_then(|d| d.results.as_deref())
                        .unwrap_or(&[]);
                    if results.is_empty() {
                        let _ = writeln!(out, "  {}/{}  (no devices)", claim.namespace, claim.name);
                    }
                    for r in results {
                        let mut flags = String::new();
                        if r.admin_access == Some(true) {
                            flags.push_str(" [admin]");
                        }
                        if r.share_id.is_some() {
                            flags.push_str(" [shared]");
                        }
                        let _ = writeln!(
                            out,
                            "  {}/{}  {} -> {}/{}/{}{flags}",
                            claim.namespace, claim.name, r.request, r.driver, r.pool, r.device
                        );
                    }
                }
            }
            NodeReport::NotAllocated { name, reason, .. } => {
                let _ = writeln!(out, "{name:width$}  does not fit: {reason}");
            }
            NodeReport::Error { name, error } => {
                let _ = writeln!(out, "{name:width$}  error: {error}");
            }
        }
    }
    out
}

fn node_name(n: &NodeReport) -> &str {
    match n {
        NodeReport::Allocated { name, .. }
        | NodeReport::NotAllocated { name, .. }
        | NodeReport::Error { name, .. } => name,
    }
}
