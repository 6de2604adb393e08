//! `dractl simulate` for gangs checked against the real scheduler (issue 42): kube-scheduler
//! v1.36.3 with workload-aware scheduling ([`ControlPlaneOptions::workload_aware`]) over paper
//! nodes whose ResourceSlices the test creates directly ([`drust_e2e::paper`]: the plugin's own
//! dry-run output for the fake DGX H100, PCIe L40S, paired-NVLink and GB200 tray topologies).
//!
//! The nodes are split into sets (node label `simsched.drust.dev/set`), some nodes in racks
//! (`simsched.drust.dev/rack`, a few without). Each round generates one gang per set (seeded:
//! the seed is printed): pods of one ResourceClaimTemplate (1, 2, 4 or 8 GPUs, 2 GPUs of one
//! NVLink domain, 4 of one NUMA node, or any GPU plus one of NUMA node 0, where choosing
//! devices pod by pod misses placements), `minCount`, a topology constraint on the rack or
//! none, and fills the set's nodes with allocated claims of random devices. For each gang:
//!
//! - `dractl simulate` (the library: the gang's Workload, PodGroup and template read as `-f`
//!   files are, the cluster read live as `dractl` reads it, limited to the set's nodes) answers
//!   whether the scheduler's order places `minCount` pods: its greedy verdict, which is meant
//!   to mirror the scheduler (not whether some placement exists, kubernetes/kubernetes#138765);
//! - the same Workload, pods (with a node selector on the set: gangs of one round run side by
//!   side on disjoint nodes) and PodGroup go to the real scheduler. Its verdict is the
//!   PodGroup's `PodGroupScheduled` condition, which the PodGroup cycle sets once per attempt
//!   (`pkg/scheduler/schedule_one_podgroup.go`, `submitPodGroupAlgorithmResult`): `True` when
//!   `minCount` pods passed Permit, `False` with reason `Unschedulable` when not. The verdict
//!   is read once the pods have settled ([`verdict`]): for `True`, every pod bound, or at
//!   least `minCount` and the others refused on their own with no allocation (none about to
//!   bind); for `False`, every pod `PodScheduled=False` and none bound. Neither counts while a
//!   pod's message is one of the scheduler's waits for an object it has not seen yet (a claim
//!   not created, a pod group, an allocation in flight): that attempt is retried on the
//!   object's event, and the later answer is the verdict. No verdict comes from a timeout.
//!
//! The verdicts must agree; where both place the gang, both placements must be valid: every
//! pod on a node of the set, its claim's devices on that node's pool, as many as the template
//! asks, sharing the constrained attribute, none in use by another pod or a filling claim; at
//! least `minCount` pods, all in one rack under the constraint; and as many pods as simulate
//! places. (Under a topology constraint `minCount` is the gang's size: see [`generate`].)
//!
//! To keep the scheduler's view as fresh as the test's: a round's filling claims are created
//! after the last round's claims are gone (one informer, in order), before the first round a
//! probe pod per node is bound there (every Node and slice seen), and a round is cleaned up
//! pending pods first (see there). About 50 s warm on two cores.
//!
//! `DRUST_SIMSCHED_SEED` (default 1) and `DRUST_SIMSCHED_ROUNDS` (default 11, 20 gangs each)
//! make other runs.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use drust_e2e::manifests::{apply_file, apply_yaml, repo_path};
use drust_e2e::paper::{self, PaperNode};
use drust_e2e::wait::until;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use k8s_openapi::api::scheduling::v1alpha2::{PodGroup, Workload};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use support::scenarios::Rng;

const NS: &str = "default";
const DRIVER: &str = "gpu.drust.dev";
const SET_LABEL: &str = "simsched.drust.dev/set";
const RACK_LABEL: &str = "simsched.drust.dev/rack";
const ROUND_LABEL: &str = "simsched.drust.dev/round";
const GANG_LABEL: &str = "simsched.drust.dev/gang";
const SETS: usize = 20;
const MAX_PODS: usize = 16;
/// A guard against a hung control plane, never a verdict.
const WAIT: Duration = Duration::from_secs(40);

/// The snapshots nodes are made of, with their GPUs.
const TOPOLOGIES: [(&str, usize); 4] = [
    ("dgx-h100", 8),
    ("pcie-l40s", 4),
    ("paired-nvlink-bridges", 8),
    ("gb200-nvl-tray", 4),
];

/// One ResourceClaimTemplate: its name, GPUs, and the attribute they must share; or, with
/// `numa0`, one GPU of any kind and one of NUMA node 0, two requests whose first choice
/// (a GPU of NUMA node 0, first in the slice) starves the second: device choices made pod by
/// pod then place fewer pods than exist (kubernetes/kubernetes#138765).
struct Shape {
    template: &'static str,
    gpus: usize,
    same: Option<&'static str>,
    numa0: bool,
}

const NUMA: &str = "resource.kubernetes.io/numaNode";

const SHAPES: [Shape; 7] = [
    Shape {
        template: "one-gpu",
        gpus: 1,
        same: None,
        numa0: false,
    },
    Shape {
        template: "two-gpus",
        gpus: 2,
        same: None,
        numa0: false,
    },
    Shape {
        template: "four-gpus",
        gpus: 4,
        same: None,
        numa0: false,
    },
    Shape {
        template: "eight-gpus",
        gpus: 8,
        same: None,
        numa0: false,
    },
    Shape {
        template: "nvlink-pair",
        gpus: 2,
        same: Some("gpu.drust.dev/nvlinkDomain"),
        numa0: false,
    },
    Shape {
        template: "numa-four",
        gpus: 4,
        same: Some(NUMA),
        numa0: false,
    },
    Shape {
        template: "any-and-numa0",
        gpus: 2,
        same: None,
        numa0: true,
    },
];

fn template_yaml(s: &Shape) -> String {
    if s.numa0 {
        return format!(
            "apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: {}, namespace: {NS}}}
spec:
  spec:
    devices:
      requests:
        - {{name: any, exactly: {{deviceClassName: gpu.drust.dev, allocationMode: ExactCount, count: 1}}}}
        - name: numa0
          exactly:
            deviceClassName: gpu.drust.dev
            allocationMode: ExactCount
            count: 1
            selectors: [{{cel: {{expression: 'device.attributes[\"resource.kubernetes.io\"].numaNode == 0'}}}}]
",
            s.template
        );
    }
    let constraint = s.same.map_or_else(String::new, |a| {
        format!("      constraints: [{{requests: [gpus], matchAttribute: \"{a}\"}}]\n")
    });
    format!(
        "apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: {}, namespace: {NS}}}
spec:
  spec:
    devices:
      requests:
        - {{name: gpus, exactly: {{deviceClassName: gpu.drust.dev, allocationMode: ExactCount, count: {}}}}}
{constraint}",
        s.template, s.gpus
    )
}

/// A node as the checks see it: labels, and its devices' attributes (qualified names, values
/// as text) in slice order.
struct NodeModel {
    set: usize,
    rack: Option<String>,
    devices: Vec<(String, BTreeMap<String, String>)>,
}

fn attribute_text(v: &Value) -> String {
    ["int", "string", "bool", "version"]
        .iter()
        .find_map(|k| v.get(*k).map(Value::to_string))
        .unwrap_or_default()
}

fn model(slices: &[ResourceSlice]) -> anyhow::Result<Vec<(String, BTreeMap<String, String>)>> {
    let mut devices = Vec::new();
    for slice in slices {
        let slice = serde_json::to_value(slice)?;
        for d in slice["spec"]["devices"].as_array().into_iter().flatten() {
            let attributes = d["attributes"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(k, v)| {
                    let name = if k.contains('/') {
                        k.clone()
                    } else {
                        format!("{DRIVER}/{k}")
                    };
                    (name, attribute_text(v))
                })
                .collect();
            devices.push((
                d["name"].as_str().unwrap_or_default().to_owned(),
                attributes,
            ));
        }
    }
    Ok(devices)
}

/// One generated gang.
struct Gang {
    name: String,
    set: usize,
    shape: &'static Shape,
    pods: usize,
    min_count: usize,
    topology: bool,
}

impl Gang {
    fn describe(&self) -> String {
        format!(
            "{} (set {}): {} pods of {}, minCount {}{}",
            self.name,
            self.set,
            self.pods,
            self.shape.template,
            self.min_count,
            if self.topology { ", by rack" } else { "" }
        )
    }

    fn workload(&self) -> String {
        format!(
            "apiVersion: scheduling.k8s.io/v1alpha2
kind: Workload
metadata: {{name: {n}, namespace: {NS}, labels: {{{ROUND_LABEL}: r}}}}
spec:
  podGroupTemplates:
    - name: workers
      schedulingPolicy: {{gang: {{minCount: {m}}}}}
",
            n = self.name,
            m = self.min_count
        )
    }

    fn pod_group(&self) -> String {
        let constraints = if self.topology {
            format!("  schedulingConstraints:\n    topology: [{{key: {RACK_LABEL}}}]\n")
        } else {
            String::new()
        };
        format!(
            "apiVersion: scheduling.k8s.io/v1alpha2
kind: PodGroup
metadata: {{name: {n}, namespace: {NS}, labels: {{{ROUND_LABEL}: r}}}}
spec:
  podGroupTemplateRef: {{workload: {{workloadName: {n}, podGroupTemplateName: workers}}}}
  schedulingPolicy: {{gang: {{minCount: {m}}}}}
{constraints}",
            n = self.name,
            m = self.min_count
        )
    }

    fn pod(&self, i: usize) -> anyhow::Result<Pod> {
        Ok(serde_json::from_value(json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": format!("{}-{i}", self.name), "namespace": NS,
                "labels": {ROUND_LABEL: "r", GANG_LABEL: self.name}},
            "spec": {
                "schedulingGroup": {"podGroupName": self.name},
                "nodeSelector": {SET_LABEL: self.set.to_string()},
                "terminationGracePeriodSeconds": 0,
                "containers": [{"name": "worker", "image": "registry.k8s.io/pause:3.10",
                    "resources": {"claims": [{"name": "gpus"}]}}],
                "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": self.shape.template}],
            },
        }))?)
    }
}

/// Pods of `shape` that fit `free` devices of one node (for `numa0`, with devices chosen
/// together: the gang's size is drawn around it).
fn node_capacity(shape: &Shape, free: &[&BTreeMap<String, String>]) -> usize {
    if shape.numa0 {
        let numa0 = free
            .iter()
            .filter(|d| d.get(NUMA).map(String::as_str) == Some("0"))
            .count();
        return (free.len() / 2).min(numa0);
    }
    match shape.same {
        None => free.len() / shape.gpus,
        Some(attribute) => {
            let mut groups: BTreeMap<&str, usize> = BTreeMap::new();
            for d in free {
                if let Some(v) = d.get(attribute) {
                    *groups.entry(v).or_default() += 1;
                }
            }
            groups.values().map(|n| n / shape.gpus).sum()
        }
    }
}

/// Each node's devices in use by the round's filling claims.
type Fill = BTreeMap<String, BTreeSet<String>>;

/// One round's gang for `set`, and the devices filled on its nodes.
fn generate(
    rng: &mut Rng,
    name: String,
    set: usize,
    nodes: &BTreeMap<String, NodeModel>,
    fill: &mut Fill,
) -> Gang {
    let shape = rng.pick(&SHAPES);
    let mut per_domain: BTreeMap<Option<String>, usize> = BTreeMap::new();
    for (node, m) in nodes.iter().filter(|(_, m)| m.set == set) {
        let n = m.devices.len();
        let taken: BTreeSet<String> = if rng.chance(0.5) {
            let k = rng.range(1, n);
            let mut names: Vec<String> = m.devices.iter().map(|(d, _)| d.clone()).collect();
            for i in 0..k {
                let j = i + rng.below(n - i);
                names.swap(i, j);
            }
            names.into_iter().take(k).collect()
        } else {
            BTreeSet::new()
        };
        let free: Vec<&BTreeMap<String, String>> = m
            .devices
            .iter()
            .filter(|(d, _)| !taken.contains(d))
            .map(|(_, a)| a)
            .collect();
        *per_domain.entry(m.rack.clone()).or_default() += node_capacity(shape, &free);
        if !taken.is_empty() {
            fill.insert(node.clone(), taken);
        }
    }
    let topology = rng.chance(0.4);
    let capacity = if topology {
        per_domain
            .iter()
            .filter(|(rack, _)| rack.is_some())
            .map(|(_, n)| *n)
            .max()
            .unwrap_or(0)
    } else {
        per_domain.values().sum()
    };
    let pods = (capacity + rng.below(5))
        .saturating_sub(2)
        .clamp(1, MAX_PODS);
    // Under a topology constraint the whole gang is its quorum: with a smaller `minCount`
    // the scheduler starts the gang's cycle as soon as that many pods exist (GangScheduling's
    // PreEnqueue), picks a rack for them (by score, at random among equals) and keeps later
    // pods there (`topology_placement.go`, the scheduled pods' domain), so how many it places
    // would depend on how fast the pods were created.
    let min_count = if topology || rng.chance(0.6) {
        pods
    } else {
        rng.range(1, pods)
    };
    Gang {
        name,
        set,
        shape,
        pods,
        min_count,
        topology,
    }
}

/// A placement to check: per pod, its node and devices (`pool`, `device`).
type Placed = Vec<(String, Vec<(String, String)>)>;

/// Whether `placed` is a valid placement of `gang` on `nodes` with `fill` in use.
fn check_placement(
    gang: &Gang,
    placed: &Placed,
    nodes: &BTreeMap<String, NodeModel>,
    fill: &Fill,
) -> Result<(), String> {
    if placed.len() < gang.min_count {
        return Err(format!(
            "{} pods placed, minCount {}",
            placed.len(),
            gang.min_count
        ));
    }
    let mut used: BTreeSet<(String, String)> = fill
        .iter()
        .flat_map(|(n, ds)| ds.iter().map(|d| (n.clone(), d.clone())))
        .collect();
    let mut racks = BTreeSet::new();
    for (node, devices) in placed {
        let m = nodes
            .get(node)
            .filter(|m| m.set == gang.set)
            .ok_or_else(|| format!("node {node} is not in set {}", gang.set))?;
        racks.insert(m.rack.clone());
        if devices.len() != gang.shape.gpus {
            return Err(format!("{} devices on {node}: {devices:?}", devices.len()));
        }
        let mut values = BTreeSet::new();
        let mut numa0 = false;
        for (pool, device) in devices {
            if pool != node {
                return Err(format!("device {pool}/{device} for a pod on {node}"));
            }
            let attributes = m
                .devices
                .iter()
                .find(|(d, _)| d == device)
                .map(|(_, a)| a)
                .ok_or_else(|| format!("no device {device} on {node}"))?;
            if let Some(a) = gang.shape.same {
                values.insert(attributes.get(a).cloned());
            }
            numa0 |= attributes.get(NUMA).map(String::as_str) == Some("0");
            if !used.insert((pool.clone(), device.clone())) {
                return Err(format!("device {pool}/{device} given twice"));
            }
        }
        if gang.shape.numa0 && !numa0 {
            return Err(format!("no device of NUMA node 0 on {node}: {devices:?}"));
        }
        if gang.shape.same.is_some() && (values.len() != 1 || values.contains(&None)) {
            return Err(format!(
                "devices on {node} do not share the attribute: {values:?}"
            ));
        }
    }
    if gang.topology && (racks.len() > 1 || racks.contains(&None)) {
        return Err(format!("pods across racks {racks:?}"));
    }
    Ok(())
}

/// What the scheduler did with a gang.
struct Verdict {
    fits: bool,
    /// Per bound pod: its node and its claim's name.
    bound: Vec<(String, String)>,
    why: String,
}

/// Messages of attempts that waited for an object the scheduler had not seen yet: the pod is
/// retried on that object's event (`dynamicresources.go` PreFilter, `resourceclaim.Name`,
/// `gangscheduling.go` PreEnqueue).
const NOT_SEEN_YET: [&str; 4] = [
    "not created yet",
    "not found",
    "in the process of being allocated",
    "to appear in scheduling queue",
];

fn pod_scheduled_false(pod: &Pod) -> Option<String> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")
        .map(|c| c.message.clone().unwrap_or_default())
}

fn node_of(pod: &Pod) -> Option<String> {
    pod.spec.as_ref().and_then(|s| s.node_name.clone())
}

fn claim_of(pod: &Pod) -> Option<String> {
    pod.status
        .as_ref()?
        .resource_claim_statuses
        .as_ref()?
        .first()?
        .resource_claim_name
        .clone()
}

/// Whether `message` is a pod's own rejection in a scheduling cycle: no node fits it (the
/// scheduler's `FitError`, `schedule_one.go`).
fn no_node_fits(message: &str) -> bool {
    message.starts_with("0/") && message.contains("nodes are available")
}

/// The verdict on `gang` from its pods, its PodGroup and the names of the allocated claims;
/// `Err` says why there is none yet.
///
/// - `PodGroupScheduled=True`: a cycle placed `minCount` pods, and each of them binds (a
///   binding that fails is retried). Settled once every pod is bound, or at least `minCount`
///   are and each other one was rejected on its own (no node fits it) and holds no
///   allocation (a pod about to bind has its claim allocated first, in PreBind).
/// - `PodGroupScheduled=False`, reason `Unschedulable`: settled once every pod has
///   `PodScheduled=False`, none is bound and no claim of theirs is allocated. An attempt may
///   take only the pods already in the active queue (`podGroupInfoForPod`; seen: 125 of 128)
///   and fail for want of the rest; the next takes them all. With `minCount` = the gang's
///   size, a pod missing from the failed attempt has no message until the next one refuses
///   it, so a later success is never read as a refusal. With a smaller `minCount`, pods the
///   successful attempt leaves out get their message while the ones it placed still carry
///   the failed attempt's: for the moment before the first of them binds (its claim is
///   allocated in PreBind, before) the gang looks refused; the end of the round reads every
///   refusal again ([`recheck_refusals`]).
///
/// Neither is settled while a pod's message says the scheduler has not seen an object yet
/// ([`NOT_SEEN_YET`]): that attempt is retried on the object's event.
fn verdict(
    gang: &Gang,
    pods: &[&Pod],
    group: Option<&PodGroup>,
    allocated: &BTreeSet<String>,
) -> anyhow::Result<Result<Verdict, String>> {
    let Some(condition) = group
        .and_then(|g| g.status.as_ref())
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "PodGroupScheduled"))
    else {
        return Ok(Err("no PodGroupScheduled condition".to_owned()));
    };
    if pods.len() != gang.pods {
        return Ok(Err(format!("{} of {} pods", pods.len(), gang.pods)));
    }
    let messages: Vec<Option<String>> = pods.iter().map(|p| pod_scheduled_false(p)).collect();
    let unbound = || {
        pods.iter()
            .zip(&messages)
            .filter(|(p, _)| node_of(p).is_none())
            .map(|(p, m)| {
                format!(
                    "{}: {}",
                    p.metadata.name.as_deref().unwrap_or_default(),
                    m.as_deref().unwrap_or("no message")
                )
            })
            .collect::<Vec<_>>()
            .join(" | ")
    };
    let bound: Vec<(String, String)> = pods
        .iter()
        .filter_map(|p| Some((node_of(p)?, claim_of(p)?)))
        .collect();
    let waits = messages
        .iter()
        .flatten()
        .any(|m| NOT_SEEN_YET.iter().any(|w| m.contains(w)));
    if waits {
        return Ok(Err(format!("waiting for objects: {}", unbound())));
    }
    let unsettled = |what: &str| {
        Ok(Err(format!(
            "PodGroupScheduled={}, {} bound; {what}: {}",
            condition.status,
            bound.len(),
            unbound()
        )))
    };
    match (condition.status.as_str(), condition.reason.as_str()) {
        ("True", _) => {
            if bound.len() != pods.iter().filter(|p| node_of(p).is_some()).count() {
                return unsettled("a bound pod names no claim");
            }
            let rest_refused = pods.iter().zip(&messages).all(|(p, m)| {
                node_of(p).is_some()
                    || (m.as_deref().is_some_and(no_node_fits)
                        && claim_of(p).is_some_and(|c| !allocated.contains(&c)))
            });
            if bound.len() == gang.pods || (bound.len() >= gang.min_count && rest_refused) {
                Ok(Ok(Verdict {
                    fits: true,
                    why: unbound(),
                    bound,
                }))
            } else {
                unsettled("binding")
            }
        }
        ("False", "Unschedulable") => {
            let held = pods
                .iter()
                .any(|p| claim_of(p).is_some_and(|c| allocated.contains(&c)));
            if messages.iter().all(Option::is_some) && bound.is_empty() && !held {
                Ok(Ok(Verdict {
                    fits: false,
                    bound: Vec::new(),
                    why: unbound(),
                }))
            } else {
                unsettled("not every pod refused")
            }
        }
        (status, reason) => bail!(
            "gang {}: PodGroupScheduled={status} ({reason}): {}",
            gang.name,
            condition.message
        ),
    }
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulate_agrees_with_the_scheduler_on_generated_gangs() -> anyhow::Result<()> {
    let seed = env_u64("DRUST_SIMSCHED_SEED", 1);
    let rounds = env_u64("DRUST_SIMSCHED_ROUNDS", 11) as usize;
    eprintln!("seed {seed} (DRUST_SIMSCHED_SEED), {rounds} rounds of {SETS} gangs");
    // As upstream's scheduler_perf does, client rate limits well above what a round needs
    // (the defaults, 20 requests a second for the controller manager, pace its claim
    // controller); they change how fast answers come, not what they are.
    let mut options = ControlPlaneOptions::workload_aware();
    let fast = [
        "--kube-api-qps=1000".to_owned(),
        "--kube-api-burst=2000".to_owned(),
    ];
    options.controller_manager_args.extend(fast.clone());
    options.scheduler_args.extend(fast);
    let cp = ControlPlane::start(options).await?;
    let result = run(&cp, seed, rounds).await;
    if result.is_err() {
        eprintln!("control plane logs in {}", cp.temp_dir().display());
    }
    cp.stop().await?;
    result
}

async fn run(cp: &ControlPlane, seed: u64, rounds: usize) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut rng = Rng::new(seed);
    let client = cp.client().await?;
    apply_file(&client, &repo_path("deploy/deviceclasses/gpu.yaml")).await?;
    for s in &SHAPES {
        apply_yaml(&client, &template_yaml(s), Path::new(s.template)).await?;
    }

    // The nodes: sets of 2 to 5, in one or two racks, one node in ten without a rack.
    let mut paper_nodes = Vec::new();
    let mut nodes: BTreeMap<String, NodeModel> = BTreeMap::new();
    for set in 0..SETS {
        let racks = rng.range(1, 2);
        for i in 0..rng.range(2, 5) {
            let (topology, _) = *rng.pick(&TOPOLOGIES);
            let name = format!("s{set:02}-n{i}");
            let mut node = PaperNode::new(&name, topology).label(SET_LABEL, &set.to_string());
            let rack = (!rng.chance(0.1)).then(|| format!("s{set:02}-r{}", rng.below(racks)));
            if let Some(r) = &rack {
                node = node.label(RACK_LABEL, r);
            }
            nodes.insert(
                name.clone(),
                NodeModel {
                    set,
                    rack,
                    devices: model(&paper::slices(topology, &name)?)?,
                },
            );
            paper_nodes.push(node);
        }
    }
    paper::create(cp, &paper_nodes, 8).await?;
    eprintln!(
        "{} paper nodes with {} GPUs in {} sets",
        nodes.len(),
        nodes.values().map(|m| m.devices.len()).sum::<usize>(),
        SETS
    );
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NS);
    let groups: Api<PodGroup> = Api::namespaced(client.clone(), NS);
    let workloads: Api<Workload> = Api::namespaced(client.clone(), NS);
    probe_every_node(&pods, &claims, &nodes).await?;
    eprintln!(
        "every node seen by the scheduler after {:?}",
        started.elapsed()
    );

    let dir = tempfile::tempdir()?;
    let connection = dractl::live::Connection {
        kubeconfig: Some(cp.kubeconfig_path().to_owned()),
        context: None,
    };
    let mut mismatches = Vec::new();
    let (mut fit, mut refused, mut compared, mut by_rack, mut greedy_misses) = (0, 0, 0, 0, 0);
    for round in 0..rounds {
        let round_start = Instant::now();
        let mut fill = Fill::new();
        let gangs: Vec<Gang> = (0..SETS)
            .map(|set| {
                generate(
                    &mut rng,
                    format!("g{round:02}-{set:02}"),
                    set,
                    &nodes,
                    &mut fill,
                )
            })
            .collect();
        for (node, devices) in &fill {
            create_fill(&claims, node, devices).await?;
        }

        // dractl simulate on the cluster as it is now, each gang on its own set.
        let cluster = dractl::live::load_cluster(&connection)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut simulated = Vec::new();
        for gang in &gangs {
            let group_file = dir.path().join(format!("{}.yaml", gang.name));
            std::fs::write(
                &group_file,
                format!("{}---\n{}", gang.workload(), gang.pod_group()),
            )?;
            let template_file = dir.path().join(format!("{}-template.yaml", gang.name));
            std::fs::write(&template_file, template_yaml(gang.shape))?;
            let group = dractl::simulate::read_pod_group(&[group_file.display().to_string()])?;
            let templates = dractl::simulate::templates(&[template_file.display().to_string()])?;
            let mut objects = cluster.clone();
            let set = gang.set.to_string();
            objects.nodes.retain(|n| {
                n.metadata.labels.as_ref().and_then(|l| l.get(SET_LABEL)) == Some(&set)
            });
            objects.slices.retain(|s| {
                s.spec
                    .node_name
                    .as_ref()
                    .is_some_and(|n| nodes.get(n).is_some_and(|m| m.set == gang.set))
            });
            let job = dractl::simulate::Job {
                count: Some(gang.pods),
                ..Default::default()
            };
            let answer = dractl::simulate::simulate_job(
                objects,
                templates,
                Some(group),
                None,
                &job,
                &dra_allocator::Options::default(),
            )?;
            simulated.push(answer);
        }

        // The real scheduler: each gang's Workload, PodGroup and pods, as a user submits them
        // (the controller manager makes a pod's claims only once its PodGroup exists).
        for gang in &gangs {
            workloads
                .create(
                    &PostParams::default(),
                    &serde_yaml_ng::from_str(&gang.workload())?,
                )
                .await?;
            groups
                .create(
                    &PostParams::default(),
                    &serde_yaml_ng::from_str(&gang.pod_group())?,
                )
                .await?;
            for i in 0..gang.pods {
                pods.create(&PostParams::default(), &gang.pod(i)?).await?;
            }
        }
        let submitted = round_start.elapsed();
        let verdicts: Vec<Verdict> = until("every gang's verdict", WAIT, || async {
            let list = pods
                .list(&ListParams::default().labels(&format!("{ROUND_LABEL}=r")))
                .await
                .map_err(|e| e.to_string())?;
            let group_list = groups
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?;
            let allocated: BTreeSet<String> = claims
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?
                .items
                .into_iter()
                .filter(dra_allocator::is_allocated)
                .filter_map(|c| c.metadata.name)
                .collect();
            let mut out = Vec::new();
            let mut waiting = Vec::new();
            for gang in &gangs {
                let mine: Vec<&Pod> = list
                    .items
                    .iter()
                    .filter(|p| {
                        p.metadata.labels.as_ref().and_then(|l| l.get(GANG_LABEL))
                            == Some(&gang.name)
                    })
                    .collect();
                let group = group_list
                    .items
                    .iter()
                    .find(|g| g.metadata.name.as_deref() == Some(&gang.name));
                match verdict(gang, &mine, group, &allocated) {
                    Ok(Ok(v)) => out.push(v),
                    Ok(Err(why)) => waiting.push(format!("{}: {why}", gang.describe())),
                    // A scheduler error: no verdict will come.
                    Err(e) => return Ok(Some(Err(e))),
                }
            }
            if waiting.is_empty() {
                Ok(Some(Ok(out)))
            } else {
                Err(waiting.join("\n"))
            }
        })
        .await??;

        // Compare, and check both placements.
        let claim_list = claims.list(&ListParams::default()).await?.items;
        let devices_of = |claim: &str| -> Vec<(String, String)> {
            claim_list
                .iter()
                .find(|c| c.metadata.name.as_deref() == Some(claim))
                .and_then(|c| {
                    c.status
                        .as_ref()?
                        .allocation
                        .as_ref()?
                        .devices
                        .as_ref()?
                        .results
                        .clone()
                })
                .unwrap_or_default()
                .into_iter()
                .map(|r| (r.pool, r.device))
                .collect()
        };
        for ((gang, sim), sched) in gangs.iter().zip(&simulated).zip(&verdicts) {
            compared += 1;
            let p = &sim.placement;
            by_rack += usize::from(gang.topology);
            greedy_misses += usize::from(!p.fits && p.placement_exists == Some(true));
            if sched.fits {
                fit += 1;
            } else {
                refused += 1;
            }
            eprintln!(
                "  {}: simulate fits={} placed {}; scheduler fits={} bound {}",
                gang.describe(),
                p.fits,
                p.placed.len(),
                sched.fits,
                sched.bound.len()
            );
            if p.fits != sched.fits {
                mismatches.push(format!(
                    "{}: simulate says fits={} (placed {}, placementExists {:?}, flags {:?}), \
                     the scheduler fits={} ({})\n{}",
                    gang.describe(),
                    p.fits,
                    p.placed.len(),
                    p.placement_exists,
                    p.flags.iter().map(|f| f.code).collect::<Vec<_>>(),
                    sched.fits,
                    sched.why,
                    dractl::simulate::job_text(sim)
                ));
                continue;
            }
            if !sched.fits {
                continue;
            }
            let theirs: Placed = sched
                .bound
                .iter()
                .map(|(node, claim)| (node.clone(), devices_of(claim)))
                .collect();
            let ours: Placed = p
                .placed
                .iter()
                .map(|pp| {
                    let devices = pp
                        .devices
                        .iter()
                        .filter_map(|d| {
                            let mut parts = d.splitn(3, '/');
                            let (_, pool, device) = (parts.next()?, parts.next()?, parts.next()?);
                            Some((pool.to_owned(), device.to_owned()))
                        })
                        .collect();
                    (pp.node.clone(), devices)
                })
                .collect();
            if let Err(e) = check_placement(gang, &theirs, &nodes, &fill) {
                mismatches.push(format!(
                    "{}: the scheduler's placement: {e} ({})",
                    gang.describe(),
                    sched.why
                ));
            }
            if let Err(e) = check_placement(gang, &ours, &nodes, &fill) {
                mismatches.push(format!("{}: simulate's placement: {e}", gang.describe()));
            }
            // Pods created after the gang's first cycle (its `minCount` pods existed) go
            // through later ones; without a topology constraint each node still takes the
            // same pods with the same devices, in any order, so the count is the same.
            if theirs.len() != ours.len() {
                mismatches.push(format!(
                    "{}: the scheduler bound {} pods, simulate places {}",
                    gang.describe(),
                    theirs.len(),
                    ours.len()
                ));
            }
        }

        recheck_refusals(&gangs, &verdicts, &pods, &claims).await?;
        let judged = round_start.elapsed();
        // Clean up: the round's pods, groups and filling claims; wait until no claim is left.
        let round_pods = ListParams::default().labels(&format!("{ROUND_LABEL}=r"));
        let now = DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        };
        // Pending pods first: a pending pod would take the devices that bound ones free, and
        // one deleted while it binds can leave its claim's allocation behind in the
        // scheduler's cache (PreBind finds the claim gone).
        let pending = ListParams::default()
            .labels(&format!("{ROUND_LABEL}=r"))
            .fields("spec.nodeName=");
        pods.delete_collection(&now, &pending).await?;
        until("the round's pending pods gone", WAIT, || async {
            let left = pods.list(&pending).await.map_err(|e| e.to_string())?;
            Ok(left.items.is_empty().then_some(()))
        })
        .await?;
        pods.delete_collection(&now, &round_pods).await?;
        groups.delete_collection(&now, &round_pods).await?;
        workloads.delete_collection(&now, &round_pods).await?;
        claims
            .delete_collection(
                &now,
                &ListParams::default().labels(&format!("{ROUND_LABEL}=fill")),
            )
            .await?;
        until("the round's claims gone", WAIT, || async {
            let left = claims
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?;
            Ok(left.items.is_empty().then_some(()))
        })
        .await?;
        until("the round's pods gone", WAIT, || async {
            let left = pods
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?;
            Ok(left.items.is_empty().then_some(()))
        })
        .await?;
        eprintln!(
            "round {round}: {} gangs, {} fit; submitted at {submitted:?}, verdicts at \
             {judged:?}, cleaned up at {:?}",
            gangs.len(),
            verdicts.iter().filter(|v| v.fits).count(),
            round_start.elapsed()
        );
    }
    eprintln!(
        "{compared} gangs compared ({fit} fit, {refused} refused; {by_rack} by rack; \
         {greedy_misses} refused where another choice of devices fits) in {:?}; seed {seed}",
        started.elapsed()
    );
    ensure!(
        fit > 0 && refused > 0,
        "the generator gave {fit} gangs that fit and {refused} that do not: both are needed"
    );
    ensure!(
        mismatches.is_empty(),
        "{} disagreements (seed {seed}):\n{}",
        mismatches.len(),
        mismatches.join("\n\n")
    );
    Ok(())
}

/// Fails where a gang read as refused has since had a pod bound or a claim allocated (see
/// [`verdict`]): the read was too early, and the comparison with it void.
async fn recheck_refusals(
    gangs: &[Gang],
    verdicts: &[Verdict],
    pods: &Api<Pod>,
    claims: &Api<ResourceClaim>,
) -> anyhow::Result<()> {
    let list = pods
        .list(&ListParams::default().labels(&format!("{ROUND_LABEL}=r")))
        .await?
        .items;
    let allocated: BTreeSet<String> = claims
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(dra_allocator::is_allocated)
        .filter_map(|c| c.metadata.name)
        .collect();
    for (gang, v) in gangs.iter().zip(verdicts) {
        if v.fits {
            continue;
        }
        let moved = list.iter().any(|p| {
            p.metadata.labels.as_ref().and_then(|l| l.get(GANG_LABEL)) == Some(&gang.name)
                && (node_of(p).is_some() || claim_of(p).is_some_and(|c| allocated.contains(&c)))
        });
        ensure!(
            !moved,
            "{}: read as refused, then placed: the refusal was read too early",
            gang.describe()
        );
    }
    Ok(())
}

/// An allocated claim holding `devices` of `node`, as a pod's claim left behind would.
async fn create_fill(
    claims: &Api<ResourceClaim>,
    node: &str,
    devices: &BTreeSet<String>,
) -> anyhow::Result<()> {
    let name = format!("fill-{node}");
    let claim: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS, "labels": {ROUND_LABEL: "fill"}},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
            "deviceClassName": "gpu.drust.dev", "allocationMode": "ExactCount",
            "count": devices.len()}}]}},
    }))?;
    claims.create(&PostParams::default(), &claim).await?;
    let results: Vec<Value> = devices
        .iter()
        .map(|d| json!({"request": "gpus", "driver": DRIVER, "pool": node, "device": d}))
        .collect();
    let status = json!({"status": {"allocation": {
        "devices": {"results": results},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
    }}});
    claims
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(status))
        .await
        .with_context(|| format!("allocating {name}"))?;
    Ok(())
}

/// Binds one pod with a one-GPU claim to each node (a node selector on its hostname), then
/// deletes them: once every one is bound, the scheduler has seen every Node and slice.
async fn probe_every_node(
    pods: &Api<Pod>,
    claims: &Api<ResourceClaim>,
    nodes: &BTreeMap<String, NodeModel>,
) -> anyhow::Result<()> {
    for node in nodes.keys() {
        let pod: Pod = serde_json::from_value(json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": format!("probe-{node}"), "namespace": NS,
                "labels": {ROUND_LABEL: "probe"}},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "terminationGracePeriodSeconds": 0,
                "containers": [{"name": "probe", "image": "registry.k8s.io/pause:3.10",
                    "resources": {"claims": [{"name": "gpu"}]}}],
                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
            },
        }))?;
        pods.create(&PostParams::default(), &pod).await?;
    }
    let probes = ListParams::default().labels(&format!("{ROUND_LABEL}=probe"));
    until("a probe pod bound on every node", WAIT, || async {
        let list = pods.list(&probes).await.map_err(|e| e.to_string())?;
        let bound = list.items.iter().filter(|p| node_of(p).is_some()).count();
        if bound == nodes.len() {
            Ok(Some(()))
        } else {
            Err(format!("{bound} of {} bound", nodes.len()))
        }
    })
    .await?;
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    pods.delete_collection(&now, &probes).await?;
    until("the probes' claims gone", WAIT, || async {
        let left = claims
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        Ok(left.items.is_empty().then_some(()))
    })
    .await?;
    until("the probes gone", WAIT, || async {
        let left = pods
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        Ok(left.items.is_empty().then_some(()))
    })
    .await?;
    Ok(())
}
