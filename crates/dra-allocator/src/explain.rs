//! Why a pod's claims do not fit on a node: the funnel of each request, from the devices the
//! node offers down to the constraint, and which stage left too few.
//!
//! Upstream's scheduler only says "cannot allocate all claims" (its allocator returns no
//! reason; kubernetes/kubernetes#137528 tried to name the failing selector and was not
//! merged). An [`Explanation`] is computed by the search that decided the node
//! ([`crate::Allocator::explain_pod`]), with the same checks in the same order, right after it
//! found no solution, so it never contradicts the answer.
//!
//! The stages of a request (upstream's checks, `structured/internal/incubating/
//! allocator_incubating.go`): devices of the node's complete, valid pools (`GatherPools`;
//! per-device node selection and binding conditions as `isSelectable`), the class's CEL
//! selectors, the request's, not allocated to another claim (`allocatedDevices`), every
//! NoSchedule/NoExecute taint tolerated (KEP-5055), counters (KEP-4815) and capacity
//! (KEP-5075) still available, and the claim's `matchAttribute`/`distinctAttribute`
//! constraints.

use serde::Serialize;

use crate::ClaimAllocation;

/// A stage of a request's funnel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Stage {
    /// Devices of the node's usable pools that the node may use.
    Offered,
    /// Left after the DeviceClass's selectors.
    ClassSelectors,
    /// Left after the request's own selectors.
    RequestSelectors,
    /// Not allocated to another claim.
    NotInUse,
    /// Every NoSchedule and NoExecute taint tolerated by the request.
    TaintsTolerated,
    /// Counters (partitionable devices) and consumable capacity still available.
    CountersAndCapacity,
    /// The claim's constraints on this request: the most devices that share one value
    /// (`matchAttribute`) or that have distinct values (`distinctAttribute`).
    Constraint,
    /// Enough devices pass every stage one by one, but the search finds no set of them that
    /// can be allocated together: they draw on the same counters or capacity, or the
    /// constraints between them exclude every combination. Never listed in `stages`; only
    /// named in `blockedAt`.
    Combination,
}

impl Stage {
    /// What the stage leaves, in words ("match the class's selectors").
    pub fn describe(self) -> &'static str {
        match self {
            Stage::Offered => "offered by the node",
            Stage::ClassSelectors => "match the class's selectors",
            Stage::RequestSelectors => "match the request's selectors",
            Stage::NotInUse => "are not allocated to other claims",
            Stage::TaintsTolerated => "have no untolerated taint",
            Stage::CountersAndCapacity => "have counters and capacity left",
            Stage::Constraint => "satisfy the claim's constraints",
            Stage::Combination => "can be allocated together",
        }
    }
}

/// What one stage of a funnel did.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StageResult {
    /// The stage.
    pub stage: Stage,
    /// Devices left after it.
    pub left: usize,
    /// Devices it removed.
    pub removed: usize,
    /// Up to [`EXAMPLES`] of the removed devices, as `pool/device` (with the taint, for
    /// taints).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub examples: Vec<String>,
    /// For selector stages: each selector that removed devices, with how many.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub selectors: Vec<SelectorEffect>,
    /// Errors met at this stage (a CEL runtime error on a device, a node selector that does
    /// not parse); the device counts as removed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<String>,
}

/// How many devices one selector removed.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SelectorEffect {
    /// The CEL expression.
    pub expression: String,
    /// Devices it removed (each device counts for the first selector that rejects it).
    pub removed: usize,
}

/// How many devices a request needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Needed {
    /// `ExactCount`.
    Count(usize),
    /// `All`: every device that matches the selectors (this many), and at least one.
    All(usize),
}

impl Needed {
    /// The number of devices.
    pub fn devices(self) -> usize {
        match self {
            Needed::Count(n) => n,
            Needed::All(n) => n.max(1),
        }
    }
}

/// The values of a constraint's attribute among a request's remaining devices.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AttributeValues {
    /// `matchAttribute` or `distinctAttribute`.
    pub constraint: &'static str,
    /// The qualified attribute name.
    pub attribute: String,
    /// Each value seen, with its number of devices, in first-seen order.
    pub values: Vec<ValueCount>,
    /// Devices without the attribute (or without a single value).
    pub without: usize,
}

/// One attribute value and how many devices have it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ValueCount {
    /// The value as text.
    pub value: String,
    /// Devices with it.
    pub devices: usize,
}

/// One request (or subrequest of `firstAvailable`) of a claim, stage by stage.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestFunnel {
    /// The claim, `namespace/name`.
    pub claim: String,
    /// The request, `request` or `request/subrequest`.
    pub request: String,
    /// Its DeviceClass.
    pub device_class: String,
    /// How many devices it needs.
    pub needed: Needed,
    /// The stages, in order, each with the devices left.
    pub stages: Vec<StageResult>,
    /// The first stage that left fewer devices than needed; `None` when the request fits
    /// on its own.
    pub blocked_at: Option<Stage>,
    /// The attribute values of each constraint on this request.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub constraints: Vec<AttributeValues>,
    /// The devices left at the end, as `pool/device` (up to 32).
    #[serde(skip)]
    pub(crate) candidates: Vec<String>,
}

/// Requests that each fit alone but want the same devices.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Competition {
    /// The requests, as `claim request`.
    pub requests: Vec<String>,
    /// Devices they need together.
    pub needed: usize,
    /// Devices any of them could use.
    pub available: usize,
    /// Up to [`EXAMPLES`] devices they share.
    pub shared: Vec<String>,
}

/// A pool the search skipped on this node.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SkippedPool {
    /// `driver/pool`.
    pub pool: String,
    /// Why: "incomplete" (not all slices of its newest generation are there) or "invalid".
    pub reason: &'static str,
}

/// Why a pod's claims do not fit on one node.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Explanation {
    /// One sentence: the first blocked request and its stage, or which requests compete.
    /// Free of node names, so that nodes with the same reason can be grouped.
    pub reason: String,
    /// Pools the search could not use.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub skipped_pools: Vec<SkippedPool>,
    /// Every request and subrequest, in claim and request order.
    pub requests: Vec<RequestFunnel>,
    /// When every request fits alone: the requests that want the same devices.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub competition: Vec<Competition>,
}

/// How many device names a stage lists.
pub const EXAMPLES: usize = 3;

impl RequestFunnel {
    /// The stage's result, if the funnel got that far.
    pub fn stage(&self, stage: Stage) -> Option<&StageResult> {
        self.stages.iter().find(|s| s.stage == stage)
    }

    /// Why the request is blocked, in one sentence without node names; `None` if it fits.
    pub fn blocked_reason(&self) -> Option<String> {
        let stage = self.blocked_at?;
        if stage == Stage::Combination {
            let n = self.needed.devices();
            let left = self.stages.last().map_or(0, |s| s.left);
            return Some(format!(
                "{left} devices pass every check one by one, but no {n} of them can be allocated together (shared counters or capacity, or the claim's constraints between them)"
            ));
        }
        let at = self.stage(stage)?;
        let before = self
            .stages
            .iter()
            .take_while(|s| s.stage != stage)
            .last()
            .map_or(0, |s| s.left);
        let needed = match self.needed {
            Needed::Count(n) => format!("needs {n}"),
            Needed::All(0) => "needs all matching devices, and at least one".into(),
            Needed::All(n) => format!("needs all {n} matching devices"),
        };
        let devices = |n: usize| {
            if n == 1 {
                "1 device".to_string()
            } else {
                format!("{n} devices")
            }
        };
        let mut text = match stage {
            Stage::Offered => format!(
                "the node offers {} (usable pools), the request {needed}",
                devices(at.left)
            ),
            Stage::Constraint => {
                let what = self
                    .constraints
                    .iter()
                    .map(|c| {
                        let values = c
                            .values
                            .iter()
                            .take(8)
                            .map(|v| format!("{} has {}", v.value, v.devices))
                            .collect::<Vec<_>>()
                            .join(", ");
                        let more = c.values.len().saturating_sub(8);
                        let more = if more > 0 {
                            format!(" and {more} more values")
                        } else {
                            String::new()
                        };
                        let values = if values.is_empty() {
                            "no device has it".to_string()
                        } else {
                            values
                        };
                        let one = if c.constraint == "matchAttribute" {
                            "in one value"
                        } else {
                            "with distinct values"
                        };
                        format!(
                            "{} {}: {values}{more}; the request {needed} {one}",
                            c.constraint, c.attribute
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("; ");
                format!("of {} available, {what}", devices(before))
            }
            _ => format!(
                "{} of {} {}, the request {needed}",
                at.left,
                devices(before),
                stage.describe()
            ),
        };
        if !at.selectors.is_empty() {
            let by = at
                .selectors
                .iter()
                .map(|s| format!("`{}` removed {}", s.expression, s.removed))
                .collect::<Vec<_>>()
                .join(", ");
            text.push_str(&format!(" ({by})"));
        }
        // What a taint or a capacity looks like on one device the stage removed: the taint, or
        // what is left of which capacity (`memory: 3735Mi of 81559Mi left, ...`).
        if matches!(stage, Stage::TaintsTolerated | Stage::CountersAndCapacity)
            && let Some(example) = at.examples.first()
        {
            text.push_str(&format!("; e.g. {example}"));
        }
        if let Some(e) = at.errors.first() {
            text.push_str(&format!("; error: {e}"));
        }
        Some(text)
    }
}

impl Explanation {
    /// The requests (with their subrequests) in order, as `(claim, request, funnels)`.
    pub fn by_request(&self) -> Vec<(&str, &str, Vec<&RequestFunnel>)> {
        let mut out: Vec<(&str, &str, Vec<&RequestFunnel>)> = Vec::new();
        for f in &self.requests {
            let base = f.request.split('/').next().unwrap_or("");
            match out.last_mut() {
                Some((claim, request, funnels)) if *claim == f.claim && *request == base => {
                    funnels.push(f)
                }
                _ => out.push((&f.claim, base, vec![f])),
            }
        }
        out
    }
}

/// [`crate::explain`]'s answer: one entry per node, in input order.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ExplainReport {
    /// The nodes.
    pub nodes: Vec<NodeExplanation>,
}

/// One node: fits (with the allocations), does not fit (with the reason and, where the search
/// decided, its explanation), or an error.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodeExplanation {
    /// The node name.
    pub name: String,
    /// Whether the pod's claims fit.
    pub fits: bool,
    /// Where they fit: one allocation per claim.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub claims: Vec<ClaimAllocation>,
    /// Where they do not: why, in one sentence (the explanation's, or the plugin's own
    /// reason where it decided before any search).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The search's explanation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub explanation: Option<Explanation>,
    /// The plugin's error for this node (an input problem, the filter timeout).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Nodes with the same outcome.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Group<'r> {
    /// The reason or error they share; `None` for nodes where the claims fit.
    pub reason: Option<&'r str>,
    /// Whether it is an error.
    pub error: bool,
    /// The nodes, in input order.
    pub nodes: Vec<&'r str>,
}

impl ExplainReport {
    /// The nodes where the claims fit.
    pub fn fitting(&self) -> impl Iterator<Item = &NodeExplanation> {
        self.nodes.iter().filter(|n| n.fits)
    }

    /// Nodes grouped by outcome: those that fit first, then each reason and error in order of
    /// first appearance.
    pub fn groups(&self) -> Vec<Group<'_>> {
        let mut groups: Vec<Group<'_>> = Vec::new();
        for n in &self.nodes {
            let (reason, error) = if n.fits {
                (None, false)
            } else if let Some(e) = &n.error {
                (Some(e.as_str()), true)
            } else {
                (n.reason.as_deref(), false)
            };
            match groups
                .iter_mut()
                .find(|g| g.reason == reason && g.error == error)
            {
                Some(g) => g.nodes.push(&n.name),
                None => groups.push(Group {
                    reason,
                    error,
                    nodes: vec![&n.name],
                }),
            }
        }
        groups.sort_by_key(|g| g.reason.is_some());
        groups
    }
}
