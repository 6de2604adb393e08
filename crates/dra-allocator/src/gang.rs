//! A group of pods placed on one snapshot of the cluster: a Job's pods, or a gang (a PodGroup
//! with `schedulingPolicy.gang.minCount`), optionally inside one topology domain and with
//! claims that the whole group shares.
//!
//! What kube-scheduler v1.36.3 does with a PodGroup, and what [`place`] does in its place:
//!
//! - **One snapshot, pods in order** (`pkg/scheduler/schedule_one_podgroup.go`,
//!   `podGroupSchedulingDefaultAlgorithm`): each pod runs Filter and Score on the snapshot,
//!   is assumed (its claims' allocations held as in-flight), and the next pod sees them. A pod
//!   that fits nowhere is skipped and the next one is tried; the group succeeds when the
//!   GangScheduling plugin's Permit sees `minCount` pods assumed
//!   (`framework/plugins/gangscheduling/gangscheduling.go`), and then every assumed pod binds.
//!   Otherwise every assumption is reverted: nothing is placed. The plugin's error on any node
//!   (a CEL runtime error, the filter timeout) fails the pod's attempt and stops the cycle,
//!   even where another node fits. [`place`] does the same, with
//!   one difference: where the scheduler scores the feasible nodes and picks the best (for
//!   pods that differ only in DRA claims, every feasible node scores alike and it picks at
//!   random), [`place`] takes the first feasible node in input order. For identical pods
//!   whose devices belong to one node each, that choice does not change how many pods fit:
//!   each node takes pods one after the other with the same device choices whatever the
//!   order. With claims the group shares, it can: see [`FirstPodNodes`].
//! - **Device choices** are the allocator's, pod by pod, first solution wins; the scheduler
//!   never revisits the devices it gave an earlier pod of the group
//!   (kubernetes/kubernetes#138765), so a gang can fail where another choice of devices fits.
//!   [`place`] answers that question separately: [`Capacity`] allocates several pods' claims
//!   together on each node (the allocator backtracks over all of their devices at once).
//! - **Gang quorum** (`GangScheduling`'s PreEnqueue): fewer pods than `minCount` never enter
//!   the scheduling queue ([`GroupPlacement::waiting_for_pods`]).
//! - **Topology** (KEP-5732, `framework/plugins/topologyaware/topology_placement.go`,
//!   `podGroupSchedulingPlacementAlgorithm`): with `schedulingConstraints.topology[0].key`, one
//!   placement per value of that node label (nodes without the label are in none); the default
//!   algorithm runs on each; among the placements where the quorum is met the scheduler takes
//!   the highest score: PodGroupPodsCount (more pods placed is better) plus NodeResourcesFit's
//!   MostAllocated over CPU and memory, then at random. [`place`] takes the most pods placed,
//!   then the first domain by name, and lists the ties ([`GroupPlacement::ties`]).
//! - **Claims of the group** (KEP-5729, `dynamicresources.go`): a PodGroup's
//!   `spec.resourceClaims` (or one ResourceClaim every pod names) is allocated once, for the
//!   first pod placed; later pods reuse that pending allocation, and its node selector bounds
//!   every pod. kube-scheduler v1.36.3 does not apply that bound to the pending allocation
//!   within the group's cycle (kubernetes/kubernetes#140087, fixed by #140089 after v1.36.3):
//!   [`place`] applies it, as the KEP and the fix do.
//!
//! Not modelled: other plugins (CPU, memory, node affinity, taints of Nodes), preemption
//! (workload-aware or not), Pods already scheduled for the group, several topology levels,
//! and the scheduler sampling a share of a large cluster's nodes (`percentageOfNodesToScore`:
//! [`place`] filters every node, so an error on a node the scheduler would not have sampled
//! still stops the group here).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Instant;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{
    AllocationResult, ResourceClaim, ResourceClaimSpec, ResourceClaimStatus, ResourceSlice,
};
use serde::Serialize;

use crate::explain::{ExplainReport, NodeExplanation};
use crate::node_selector::node_matches;
use crate::scheduler::node_verdict;
use crate::{
    AllocateError, AllocatedState, Allocator, ClaimAllocation, Error, Features, Interrupt, Objects,
    Options,
};

/// How many other nodes the first pod could go to are tried when the group's claims make the
/// outcome depend on it ([`FirstPodNodes`]).
pub const MAX_FIRST_NODES: usize = 64;

/// One pod of the group.
#[derive(Debug, Clone)]
pub struct GroupPod {
    /// Its name, for the answer.
    pub name: String,
    /// Its own claims (one per ResourceClaimTemplate), without `status.allocation`.
    pub claims: Vec<ResourceClaim>,
}

/// What to place.
#[derive(Debug, Clone, Default)]
pub struct Group {
    /// The pods, in the order the scheduler takes them (for the pods of one Job: the order
    /// they were created in; the scheduler sorts by priority, then first attempt).
    pub pods: Vec<GroupPod>,
    /// Claims every pod uses, allocated once for the group: `PodGroup.spec.resourceClaims`
    /// (KEP-5729), or a ResourceClaim every pod names. Without `status.allocation` they are
    /// allocated with the first pod placed; with one, their node selector bounds every pod.
    pub shared: Vec<ResourceClaim>,
    /// A gang's `minCount`: all or nothing. `None`: pods are placed one by one, and those that
    /// fit stay placed (a plain Job, or a PodGroup with the `basic` policy).
    pub min_count: Option<usize>,
    /// `schedulingConstraints.topology[0].key`: every pod in nodes sharing this label's value.
    pub topology_key: Option<String>,
    /// Whether the pods belong to a PodGroup, scheduled in one cycle (a gang or a topology key
    /// implies one); `false`: pods scheduled one at a time, each seeing the ones before bound.
    /// The placement is the same; only what the answer says of upstream's bugs differs.
    pub pod_group: bool,
}

/// One placed pod.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PodPlacement {
    /// 1 for the first pod.
    pub pod: usize,
    /// The pod's name.
    pub name: String,
    /// The node.
    pub node: String,
    /// Its devices, `driver/pool/device`, over all of its own claims.
    pub devices: Vec<String>,
    /// Its own claims' allocations.
    pub claims: Vec<ClaimAllocation>,
}

/// The first pod of a domain that fits on none of its nodes.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Blocked {
    /// 1 for the first pod.
    pub pod: usize,
    /// The pod's name.
    pub name: String,
    /// The scheduler's error that failed the pod's attempt and stopped the group's cycle
    /// (`node NAME: ...`: a CEL runtime error, the filter timeout), where there was one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Why, node by node, on the snapshot with the pods before it placed.
    pub report: ExplainReport,
}

/// Whether the pods fit when their devices are chosen together, node by node: the most pods
/// (up to the group's size) that some choice of devices holds.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Capacity {
    /// How many pods fit together, up to the group's size.
    pub pods: usize,
    /// Per node, how many of them (nodes with none left out), for the first nodes that
    /// reach [`Capacity::pods`].
    pub per_node: BTreeMap<String, usize>,
    /// Whether the count is exact: `false` where devices are offered to several nodes (they
    /// are counted for each) or a search ran out of time (counted as not fitting).
    pub exact: bool,
}

/// Where the outcome depends on the node of the first pod (it allocates the group's claims,
/// whose node selector then bounds every pod): the scheduler picks that node by score, not
/// by what it leaves for the others.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct FirstPodNodes {
    /// Nodes where the first pod fits, tried (at most [`MAX_FIRST_NODES`] + 1).
    pub checked: usize,
    /// Nodes where the first pod fits, in all.
    pub candidates: usize,
    /// First nodes from which the group reaches what it needs.
    pub fits_from: Vec<String>,
    /// First nodes from which it does not, with the pods placed.
    pub short_from: BTreeMap<String, usize>,
}

/// The group in one topology domain (or in the whole cluster).
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Domain {
    /// The label's value; `None` without a topology key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Its nodes, in input order.
    pub nodes: Vec<String>,
    /// Pods the scheduler's order places here.
    pub placed: usize,
    /// Whether that is enough (`minCount` for a gang, every pod otherwise).
    pub fits: bool,
    /// The pods placed, in order.
    pub pods: Vec<PodPlacement>,
    /// The group's claims, as allocated with the first pod.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub shared_claims: Vec<ClaimAllocation>,
    /// The first pod that fits nowhere here.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub blocked: Option<Blocked>,
    /// Pods after [`Domain::blocked`] not placed either (1-based).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unplaced: Vec<usize>,
    /// Devices chosen together; `None` for pods that are not all alike.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capacity: Option<Capacity>,
    /// Where the node of the first pod decides.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_pod_nodes: Option<FirstPodNodes>,
}

/// Something the answer depends on, or where the scheduler may differ.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Flag {
    /// `waitingForPods`, `greedyMissesPlacement`, `dependsOnFirstNode`, `tieBetweenDomains`,
    /// `notExact` or `sharedClaimNodeSelector` (`dractl simulate` adds `workloadWithJob`).
    pub code: &'static str,
    /// What it means, in a sentence.
    pub message: String,
}

/// The answer.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct GroupPlacement {
    /// Pods in the group.
    pub pods: usize,
    /// Pods that must fit: `minCount` for a gang, every pod otherwise.
    pub required: usize,
    /// Whether it is a gang (all or nothing).
    pub gang: bool,
    /// The topology key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topology_key: Option<String>,
    /// Whether the scheduler's order places [`GroupPlacement::required`] pods.
    pub fits: bool,
    /// A gang of fewer pods than `minCount`: the scheduler waits for more and tries nothing.
    pub waiting_for_pods: bool,
    /// The domain chosen (with a topology key).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    /// What would be placed: nothing for a gang short of `minCount`.
    pub placed: Vec<PodPlacement>,
    /// The group's claims, as allocated with the first pod placed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub shared_claims: Vec<ClaimAllocation>,
    /// Other domains as good as the chosen one (the scheduler picks by CPU and memory, then
    /// at random).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ties: Vec<String>,
    /// Every domain, by name (one, unnamed, without a topology key).
    pub domains: Vec<Domain>,
    /// Nodes without the topology label: in no domain.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unlabeled_nodes: Vec<String>,
    /// Whether some choice of devices places [`GroupPlacement::required`] pods; `None` where
    /// not checked (pods not all alike).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub placement_exists: Option<bool>,
    /// What the answer depends on.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub flags: Vec<Flag>,
}

/// How long one search for several pods' devices chosen together may take ([`Capacity`]):
/// such a search may try every permutation of devices before it says no
/// (kubernetes/kubernetes#131730); one that runs out of time counts as not fitting and makes
/// the capacity inexact.
pub const JOINT_SEARCH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Places `group` on the cluster of `objects` (its Nodes, DeviceClasses, ResourceSlices and
/// allocated ResourceClaims; claims without `status.allocation` are left out): see the module
/// documentation for what is modelled. `options.node` is not used; `options.timeout` bounds
/// each node's search.
///
/// # Errors
/// [`Error::InvalidQuantity`] for a slice or allocated claim with a malformed quantity.
pub fn place(objects: &Objects, group: &Group, options: &Options) -> Result<GroupPlacement, Error> {
    place_with(objects, group, options, JOINT_SEARCH_TIMEOUT)
}

/// [`place`], with another time limit for each search of devices chosen together (the
/// smaller of it and `options.timeout`, where that is not zero).
///
/// # Errors
/// As [`place`].
pub fn place_with(
    objects: &Objects,
    group: &Group,
    options: &Options,
    joint_timeout: std::time::Duration,
) -> Result<GroupPlacement, Error> {
    let features = Features {
        distinct_attribute_per_device: options.fix_distinct_attribute,
        ..Features::V1_36
    };
    let mut base = AllocatedState::from_claims(
        objects.claims.iter().filter(|c| crate::is_allocated(c)),
        features.consumable_capacity,
    )?;
    for claim in &group.shared {
        let listed = objects.claims.iter().any(|c| {
            crate::is_allocated(c)
                && c.metadata.name == claim.metadata.name
                && c.metadata.namespace == claim.metadata.namespace
        });
        if !listed {
            base.add_claim(claim, features.consumable_capacity)?;
        }
    }
    let scopes = Scopes::new(&objects.slices);
    let placer = Placer {
        objects,
        group,
        options,
        features,
        base,
        scopes: &scopes,
        joint_timeout: if options.timeout.is_zero() {
            joint_timeout
        } else {
            joint_timeout.min(options.timeout)
        },
        homogeneous: group
            .pods
            .windows(2)
            .all(|w| specs(&w[0].claims) == specs(&w[1].claims)),
    };
    placer.place()
}

fn specs(claims: &[ResourceClaim]) -> Vec<&ResourceClaimSpec> {
    claims.iter().map(|c| &c.spec).collect()
}

/// Per node, the slices its search can see: its own, those offered to several nodes (no node
/// name) and counter sets, and every slice of the pools these belong to (so that a pool is as
/// complete as in the full list).
struct Scopes {
    by_node: HashMap<String, Vec<ResourceSlice>>,
    /// The scope of a node without slices of its own.
    common: Vec<ResourceSlice>,
    /// Pools in every node's scope.
    common_pools: HashSet<(String, String)>,
    /// Per node-local pool, the nodes whose scope holds it.
    pool_nodes: HashMap<(String, String), Vec<String>>,
    /// Whether some devices are offered to several nodes.
    multi_node: bool,
}

fn pool_key(s: &ResourceSlice) -> (String, String) {
    (s.spec.driver.clone(), s.spec.pool.name.clone())
}

impl Scopes {
    fn new(slices: &[ResourceSlice]) -> Scopes {
        let node_of = |s: &ResourceSlice| s.spec.node_name.clone().filter(|n| !n.is_empty());
        let counters = |s: &ResourceSlice| {
            s.spec
                .shared_counters
                .as_ref()
                .is_some_and(|c| !c.is_empty())
        };
        let multi_node = slices.iter().any(|s| node_of(s).is_none());
        let common_pools: HashSet<(String, String)> = slices
            .iter()
            .filter(|s| node_of(s).is_none() || counters(s))
            .map(pool_key)
            .collect();
        let common: Vec<ResourceSlice> = slices
            .iter()
            .filter(|s| common_pools.contains(&pool_key(s)))
            .cloned()
            .collect();
        let mut own_pools: HashMap<String, HashSet<(String, String)>> = HashMap::new();
        for s in slices {
            if let Some(node) = node_of(s)
                && !common_pools.contains(&pool_key(s))
            {
                own_pools.entry(node).or_default().insert(pool_key(s));
            }
        }
        let mut pool_nodes: HashMap<(String, String), Vec<String>> = HashMap::new();
        let mut by_node = HashMap::new();
        for (node, pools) in own_pools {
            let mut scope = common.clone();
            scope.extend(
                slices
                    .iter()
                    .filter(|s| pools.contains(&pool_key(s)))
                    .cloned(),
            );
            for p in pools {
                pool_nodes.entry(p).or_default().push(node.clone());
            }
            by_node.insert(node, scope);
        }
        Scopes {
            by_node,
            common,
            common_pools,
            pool_nodes,
            multi_node,
        }
    }

    fn of(&self, node: &str) -> &[ResourceSlice] {
        self.by_node.get(node).map_or(&self.common, Vec::as_slice)
    }

    /// The nodes whose scope holds a device of these allocations; `None`: every node.
    fn touched(&self, allocations: &[AllocationResult]) -> Option<HashSet<String>> {
        let mut nodes = HashSet::new();
        for r in allocations
            .iter()
            .filter_map(|a| a.devices.as_ref())
            .flat_map(|d| d.results.iter().flatten())
        {
            let key = (r.driver.clone(), r.pool.clone());
            if self.common_pools.contains(&key) {
                return None;
            }
            nodes.extend(self.pool_nodes.get(&key).into_iter().flatten().cloned());
        }
        Some(nodes)
    }
}

/// One node's allocators, built lazily from one state and dropped where an allocation changes
/// what they see.
struct Allocators<'a> {
    scopes: &'a Scopes,
    objects: &'a Objects,
    features: Features,
    built: HashMap<String, Allocator<'a>>,
}

impl<'a> Allocators<'a> {
    fn get(&mut self, state: &AllocatedState, node: &str) -> Result<&Allocator<'a>, Error> {
        if !self.built.contains_key(node) {
            let allocator = Allocator::new(
                self.features,
                state,
                &self.objects.classes,
                self.scopes.of(node),
            )?;
            self.built.insert(node.to_owned(), allocator);
        }
        Ok(&self.built[node])
    }

    /// Forgets the allocators that `allocations` change; `true` when all were dropped.
    fn invalidate(&mut self, allocations: &[AllocationResult]) -> bool {
        match self.scopes.touched(allocations) {
            None => {
                self.built.clear();
                true
            }
            Some(nodes) => {
                for n in nodes {
                    self.built.remove(&n);
                }
                false
            }
        }
    }
}

/// The greedy run in one domain.
struct Run {
    pods: Vec<PodPlacement>,
    shared: Vec<ClaimAllocation>,
    blocked: Option<Blocked>,
    unplaced: Vec<usize>,
    /// The node of the first pod placed.
    first_node: Option<String>,
}

struct Placer<'a> {
    objects: &'a Objects,
    group: &'a Group,
    options: &'a Options,
    features: Features,
    base: AllocatedState,
    scopes: &'a Scopes,
    joint_timeout: std::time::Duration,
    homogeneous: bool,
}

fn node_name(n: &Node) -> &str {
    n.metadata.name.as_deref().unwrap_or("")
}

fn claim_ref(c: &ResourceClaim) -> String {
    format!(
        "{}/{}",
        c.metadata.namespace.as_deref().unwrap_or(""),
        c.metadata.name.as_deref().unwrap_or("")
    )
}

/// `claim` with `allocation` as its status.
fn allocated(claim: &ResourceClaim, allocation: AllocationResult) -> ResourceClaim {
    let mut c = claim.clone();
    c.status = Some(ResourceClaimStatus {
        allocation: Some(allocation),
        ..Default::default()
    });
    c
}

fn devices(claims: &[ClaimAllocation]) -> Vec<String> {
    claims
        .iter()
        .filter_map(|c| c.allocation.devices.as_ref())
        .flat_map(|d| d.results.iter().flatten())
        .map(|r| format!("{}/{}/{}", r.driver, r.pool, r.device))
        .collect()
}

impl Placer<'_> {
    fn required(&self) -> usize {
        self.group.min_count.unwrap_or(self.group.pods.len())
    }

    fn interrupt(&self) -> Interrupt<'static> {
        Interrupt {
            deadline: (!self.options.timeout.is_zero())
                .then(|| Instant::now().checked_add(self.options.timeout))
                .flatten(),
            cancel: None,
        }
    }

    /// For a search of devices chosen together.
    fn joint_interrupt(&self) -> Interrupt<'static> {
        Interrupt {
            deadline: (!self.joint_timeout.is_zero())
                .then(|| Instant::now().checked_add(self.joint_timeout))
                .flatten(),
            cancel: None,
        }
    }

    fn place(&self) -> Result<GroupPlacement, Error> {
        let group = self.group;
        let required = self.required();
        let mut answer = GroupPlacement {
            pods: group.pods.len(),
            required,
            gang: group.min_count.is_some(),
            topology_key: group.topology_key.clone(),
            fits: false,
            waiting_for_pods: false,
            domain: None,
            placed: Vec::new(),
            shared_claims: Vec::new(),
            ties: Vec::new(),
            domains: Vec::new(),
            unlabeled_nodes: Vec::new(),
            placement_exists: None,
            flags: Vec::new(),
        };
        if let Some(min) = group.min_count
            && group.pods.len() < min
        {
            answer.waiting_for_pods = true;
            answer.flags.push(Flag {
                code: "waitingForPods",
                message: format!(
                    "the gang has {} pods and minCount {min}: the scheduler keeps its pods out \
                     of the queue until {min} exist (GangScheduling's PreEnqueue) and tries \
                     nothing",
                    group.pods.len()
                ),
            });
            return Ok(answer);
        }
        // The placements (KEP-5732): one per value of the label, or every node.
        let mut domains: Vec<(Option<String>, Vec<&Node>)> = Vec::new();
        match &group.topology_key {
            None => domains.push((None, self.objects.nodes.iter().collect())),
            Some(key) => {
                let mut by_value: BTreeMap<String, Vec<&Node>> = BTreeMap::new();
                for n in &self.objects.nodes {
                    match n.metadata.labels.as_ref().and_then(|l| l.get(key)) {
                        Some(v) => by_value.entry(v.clone()).or_default().push(n),
                        None => answer.unlabeled_nodes.push(node_name(n).to_owned()),
                    }
                }
                domains.extend(by_value.into_iter().map(|(v, n)| (Some(v), n)));
            }
        }
        let mut timed_out = false;
        for (name, nodes) in &domains {
            let run = self.run(nodes, None, true)?;
            let placed = run.pods.len();
            let fits = placed >= required && required > 0;
            let capacity = if self.homogeneous && !group.pods.is_empty() {
                let (c, t) = self.capacity(nodes)?;
                timed_out |= t;
                Some(c)
            } else {
                None
            };
            let first_pod_nodes = match &run.first_node {
                Some(first) if group.shared.iter().any(|c| !crate::is_allocated(c)) => {
                    Some(self.first_pod_nodes(nodes, first, placed)?)
                }
                _ => None,
            };
            answer.domains.push(Domain {
                name: name.clone(),
                nodes: nodes.iter().map(|n| node_name(n).to_owned()).collect(),
                placed,
                fits,
                pods: run.pods,
                shared_claims: run.shared,
                blocked: run.blocked,
                unplaced: run.unplaced,
                capacity,
                first_pod_nodes,
            });
        }
        self.choose(&mut answer);
        self.flag(&mut answer, timed_out);
        Ok(answer)
    }

    /// The domain the scheduler would take, and what is placed.
    fn choose(&self, answer: &mut GroupPlacement) {
        let gang = answer.gang;
        // Where the group's cycle succeeds: the quorum for a gang, one pod otherwise.
        let quorum = if gang { answer.required } else { 1 };
        let best = answer
            .domains
            .iter()
            .enumerate()
            .filter(|(_, d)| d.placed >= quorum && d.placed > 0)
            .max_by(|(i, a), (j, b)| a.placed.cmp(&b.placed).then(j.cmp(i)))
            .map(|(i, d)| (i, d.placed));
        let Some((chosen, placed)) = best else {
            return;
        };
        let d = &answer.domains[chosen];
        answer.fits = d.fits;
        answer.placed = d.pods.clone();
        answer.shared_claims = d.shared_claims.clone();
        answer.domain = d.name.clone();
        answer.ties = answer
            .domains
            .iter()
            .enumerate()
            .filter(|(i, o)| *i != chosen && o.placed == placed)
            .filter_map(|(_, o)| o.name.clone())
            .collect();
    }

    fn flag(&self, answer: &mut GroupPlacement, timed_out: bool) {
        let required = answer.required;
        let capacities: Vec<&Capacity> = answer
            .domains
            .iter()
            .filter_map(|d| d.capacity.as_ref())
            .collect();
        if capacities.len() == answer.domains.len() && !capacities.is_empty() {
            let exists = capacities.iter().any(|c| c.pods >= required);
            answer.placement_exists = Some(exists);
            if exists && !answer.fits {
                let domains: Vec<String> = answer
                    .domains
                    .iter()
                    .filter(|d| d.capacity.as_ref().is_some_and(|c| c.pods >= required))
                    .map(|d| d.name.clone().unwrap_or_else(|| "the cluster".into()))
                    .collect();
                answer.flags.push(Flag {
                    code: "greedyMissesPlacement",
                    message: format!(
                        "{required} pods fit in {} with other devices chosen, but the scheduler \
                         allocates each pod's devices in turn and does not revisit them \
                         (kubernetes/kubernetes#138765)",
                        domains.join(", ")
                    ),
                });
            }
            if capacities.iter().any(|c| !c.exact) {
                answer.flags.push(Flag {
                    code: "notExact",
                    message: if timed_out {
                        "a search for devices chosen together ran out of time: placementExists \
                         counts it as not fitting"
                            .into()
                    } else {
                        "some devices are offered to several nodes: devices chosen together \
                         are counted for each node, so placementExists may be too hopeful"
                            .into()
                    },
                });
            }
        }
        for d in &answer.domains {
            if let Some(f) = &d.first_pod_nodes
                && !f.fits_from.is_empty()
                && !f.short_from.is_empty()
            {
                let within = d
                    .name
                    .as_ref()
                    .map(|n| format!(" in {n}"))
                    .unwrap_or_default();
                answer.flags.push(Flag {
                    code: "dependsOnFirstNode",
                    message: format!(
                        "the group's claims go with the first pod, and their node bounds every \
                         pod{within}: the group fits when the first pod lands on {} but not on \
                         {}; the scheduler picks that node by score, not by what it leaves",
                        f.fits_from.join(", "),
                        f.short_from.keys().cloned().collect::<Vec<_>>().join(", ")
                    ),
                });
            }
        }
        if answer.ties.len() > 1 || (!answer.ties.is_empty() && answer.domain.is_some()) {
            answer.flags.push(Flag {
                code: "tieBetweenDomains",
                message: format!(
                    "{} place as many pods as {}: the scheduler picks by NodeResourcesFit's \
                     MostAllocated score over CPU and memory, which dractl does not read, then \
                     at random",
                    answer.ties.join(", "),
                    answer.domain.as_deref().unwrap_or("")
                ),
            });
        }
        let cycle = self.group.pod_group
            || self.group.min_count.is_some()
            || self.group.topology_key.is_some();
        if cycle
            && self.group.pods.len() > 1
            && self.group.shared.iter().any(|c| !crate::is_allocated(c))
        {
            answer.flags.push(Flag {
                code: "sharedClaimNodeSelector",
                message: "kube-scheduler v1.36.3 does not bound the later pods of a PodGroup \
                          cycle by the node selector of a shared claim allocated in that cycle \
                          (kubernetes/kubernetes#140087, fixed by #140089 after v1.36.3): it \
                          can bind them to nodes that cannot reach the claim's devices; this \
                          answer applies the bound"
                    .into(),
            });
        }
    }

    /// The scheduler's order in one domain: pod after pod, each on the first node (input
    /// order) where its claims fit, with what the pods before it took held. `first` forces the
    /// first pod's node. `explain`: why the first pod that fits nowhere does not.
    fn run(&self, nodes: &[&Node], first: Option<&str>, explain: bool) -> Result<Run, Error> {
        let consumable = self.features.consumable_capacity;
        let mut state = self.base.clone();
        let mut allocators = Allocators {
            scopes: self.scopes,
            objects: self.objects,
            features: self.features,
            built: HashMap::new(),
        };
        let mut shared: Vec<ResourceClaim> = self.group.shared.clone();
        let mut run = Run {
            pods: Vec::new(),
            shared: Vec::new(),
            blocked: None,
            unplaced: Vec::new(),
            first_node: None,
        };
        // Claims that fit nowhere on this snapshot; and for the claims being placed, each
        // node's verdict, kept until a pod lands in that node's scope (a node's snapshot
        // changes only then).
        let mut failed: Vec<Vec<ResourceClaimSpec>> = Vec::new();
        let mut known: (Vec<ResourceClaimSpec>, HashMap<String, NodeExplanation>) =
            (Vec::new(), HashMap::new());
        for (i, pod) in self.group.pods.iter().enumerate() {
            let pending: Vec<usize> = (0..shared.len())
                .filter(|&k| !crate::is_allocated(&shared[k]))
                .collect();
            let to_allocate: Vec<&ResourceClaim> = pod
                .claims
                .iter()
                .chain(pending.iter().map(|&k| &shared[k]))
                .collect();
            let key: Vec<ResourceClaimSpec> = to_allocate.iter().map(|c| c.spec.clone()).collect();
            if failed.contains(&key) {
                run.unplaced.push(i + 1);
                continue;
            }
            if known.0 != key {
                known = (key.clone(), HashMap::new());
            }
            let bounds: Vec<&ResourceClaim> =
                shared.iter().filter(|c| crate::is_allocated(c)).collect();
            // Every node the pod may use is filtered, as the scheduler filters them all (in a
            // cluster small enough not to be sampled): an error on any one of them, a CEL
            // runtime error or the filter timeout, fails the pod's attempt and stops the
            // group's cycle, even where another node fits.
            let mut fit: Option<(&Node, Vec<ClaimAllocation>)> = None;
            let mut fatal = None;
            for &node in nodes {
                let name = node_name(node);
                if (i == 0 && first.is_some_and(|f| f != name))
                    || bound_excludes(&bounds, node).is_some()
                {
                    continue;
                }
                if !known.1.contains_key(name) {
                    let allocator = allocators.get(&state, name)?;
                    let verdict = node_verdict(
                        allocator,
                        node,
                        &self.objects.classes,
                        &to_allocate,
                        self.options,
                        false,
                    );
                    known.1.insert(name.to_owned(), verdict);
                }
                let verdict = &known.1[name];
                if let Some(e) = &verdict.error {
                    fatal = Some(format!("node {name}: {e}"));
                    break;
                }
                if verdict.fits && fit.is_none() {
                    fit = Some((node, verdict.claims.clone()));
                }
            }
            if fatal.is_some() {
                fit = None;
            }
            let Some((node, claims)) = fit else {
                if run.blocked.is_none() && (explain || fatal.is_some()) {
                    run.blocked = Some(Blocked {
                        pod: i + 1,
                        name: pod.name.clone(),
                        error: fatal.clone(),
                        report: self.explain(
                            &mut allocators,
                            &state,
                            nodes,
                            first,
                            i,
                            &bounds,
                            &to_allocate,
                        )?,
                    });
                }
                if fatal.is_some() {
                    run.unplaced.extend(i + 1..=self.group.pods.len());
                    break;
                }
                failed.push(key);
                run.unplaced.push(i + 1);
                continue;
            };
            let name = node_name(node).to_owned();
            let results: Vec<AllocationResult> =
                claims.iter().map(|c| c.allocation.clone()).collect();
            let own = pod.claims.len();
            for (claim, allocation) in to_allocate.iter().zip(&results) {
                state.add_claim(&allocated(claim, allocation.clone()), consumable)?;
            }
            for (k, allocation) in pending.iter().zip(results.iter().skip(own)) {
                shared[*k] = allocated(&shared[*k], allocation.clone());
            }
            run.shared.extend(claims.iter().skip(own).cloned());
            let own_claims: Vec<ClaimAllocation> = claims.into_iter().take(own).collect();
            if allocators.invalidate(&results) {
                known.1.clear();
            } else if let Some(touched) = self.scopes.touched(&results) {
                for n in touched {
                    known.1.remove(&n);
                }
            }
            if run.first_node.is_none() {
                run.first_node = Some(name.clone());
            }
            run.pods.push(PodPlacement {
                pod: i + 1,
                name: pod.name.clone(),
                node: name,
                devices: devices(&own_claims),
                claims: own_claims,
            });
        }
        Ok(run)
    }

    /// Why pod `i` fits on none of `nodes`.
    #[allow(clippy::too_many_arguments)]
    fn explain(
        &self,
        allocators: &mut Allocators<'_>,
        state: &AllocatedState,
        nodes: &[&Node],
        first: Option<&str>,
        i: usize,
        bounds: &[&ResourceClaim],
        to_allocate: &[&ResourceClaim],
    ) -> Result<ExplainReport, Error> {
        let mut report = ExplainReport { nodes: Vec::new() };
        for &node in nodes {
            let name = node_name(node);
            if i == 0 && first.is_some_and(|f| f != name) {
                continue;
            }
            if let Some(claim) = bound_excludes(bounds, node) {
                report.nodes.push(NodeExplanation {
                    name: name.to_owned(),
                    fits: false,
                    claims: Vec::new(),
                    reason: Some(format!(
                        "resourceclaim not available on the node: the group's claim {} is \
                         allocated on other nodes",
                        claim_ref(claim)
                    )),
                    explanation: None,
                    error: None,
                });
                continue;
            }
            let allocator = allocators.get(state, name)?;
            report.nodes.push(node_verdict(
                allocator,
                node,
                &self.objects.classes,
                to_allocate,
                self.options,
                true,
            ));
        }
        Ok(report)
    }

    /// Devices chosen together: per node, the most pods whose claims the allocator fits at
    /// once (with the group's claims where they are still to allocate), summed over the
    /// domain, up to the group's size. Returns whether a search ran out of time.
    fn capacity(&self, nodes: &[&Node]) -> Result<(Capacity, bool), Error> {
        let n = self.group.pods.len();
        let mut allocators = Allocators {
            scopes: self.scopes,
            objects: self.objects,
            features: self.features,
            built: HashMap::new(),
        };
        let mut timed_out = false;
        let pending: Vec<&ResourceClaim> = self
            .group
            .shared
            .iter()
            .filter(|c| !crate::is_allocated(c))
            .collect();
        let bounds: Vec<&ResourceClaim> = self
            .group
            .shared
            .iter()
            .filter(|c| crate::is_allocated(c))
            .collect();
        let allowed: Vec<&Node> = nodes
            .iter()
            .copied()
            .filter(|node| bound_excludes(&bounds, node).is_none())
            .collect();
        let best = if pending.is_empty() {
            let (total, per_node) =
                self.sum_capacity(&mut allocators, &self.base, &allowed, n, &mut timed_out)?;
            (total, per_node)
        } else {
            // The group's claims go with some node's pods; their node selector then bounds
            // the rest. Try each node as the one that holds them.
            let mut best: (usize, BTreeMap<String, usize>) = (0, BTreeMap::new());
            for &node in &allowed {
                let name = node_name(node);
                let allocator = allocators.get(&self.base, name)?;
                let Some((k, shared_alloc)) =
                    self.most_on(allocator, &self.base, node, &pending, n, &mut timed_out)
                else {
                    continue;
                };
                let mut state = self.base.clone();
                let mut new_bounds: Vec<ResourceClaim> = Vec::new();
                for (claim, allocation) in pending.iter().zip(shared_alloc) {
                    let c = allocated(claim, allocation);
                    state.add_claim(&c, self.features.consumable_capacity)?;
                    new_bounds.push(c);
                }
                let all_bounds: Vec<&ResourceClaim> =
                    bounds.iter().copied().chain(new_bounds.iter()).collect();
                let others: Vec<&Node> = allowed
                    .iter()
                    .copied()
                    .filter(|m| node_name(m) != name && bound_excludes(&all_bounds, m).is_none())
                    .collect();
                let mut scoped = Allocators {
                    scopes: self.scopes,
                    objects: self.objects,
                    features: self.features,
                    built: HashMap::new(),
                };
                let (rest, mut per_node) = self.sum_capacity(
                    &mut scoped,
                    &state,
                    &others,
                    n.saturating_sub(k),
                    &mut timed_out,
                )?;
                if k > 0 {
                    per_node.insert(name.to_owned(), k);
                }
                if k + rest > best.0 || best.1.is_empty() && k + rest == 0 {
                    best = (k + rest, per_node);
                }
                if best.0 >= n {
                    break;
                }
            }
            best
        };
        Ok((
            Capacity {
                pods: best.0.min(n),
                per_node: best.1,
                exact: !self.scopes.multi_node && !timed_out,
            },
            timed_out,
        ))
    }

    /// Per node of `nodes`, the most pods that fit together, until `want` are counted.
    fn sum_capacity(
        &self,
        allocators: &mut Allocators<'_>,
        state: &AllocatedState,
        nodes: &[&Node],
        want: usize,
        timed_out: &mut bool,
    ) -> Result<(usize, BTreeMap<String, usize>), Error> {
        let mut total = 0;
        let mut per_node = BTreeMap::new();
        for &node in nodes {
            if total >= want {
                break;
            }
            let name = node_name(node);
            let allocator = allocators.get(state, name)?;
            if let Some((k, _)) = self.most_on(allocator, state, node, &[], want - total, timed_out)
                && k > 0
            {
                per_node.insert(name.to_owned(), k);
                total += k;
            }
        }
        Ok((total, per_node))
    }

    /// The most pods (up to `cap`) whose claims fit on `node` together with `extra`, and
    /// `extra`'s allocations then; `None` when `extra` alone does not fit.
    #[allow(clippy::too_many_arguments)]
    fn most_on(
        &self,
        allocator: &Allocator<'_>,
        state: &AllocatedState,
        node: &Node,
        extra: &[&ResourceClaim],
        cap: usize,
        timed_out: &mut bool,
    ) -> Option<(usize, Vec<AllocationResult>)> {
        let mut try_k = |k: usize| -> Option<Vec<AllocationResult>> {
            let claims: Vec<&ResourceClaim> = self.group.pods[..k]
                .iter()
                .flat_map(|p| &p.claims)
                .chain(extra.iter().copied())
                .collect();
            if claims.is_empty() {
                return Some(Vec::new());
            }
            match allocator.allocate(node, &claims, self.joint_interrupt()) {
                Ok(Some(a)) => Some(
                    a[a.len() - extra.len()..]
                        .iter()
                        .map(|x| x.to_api())
                        .collect(),
                ),
                Ok(None) => None,
                Err(AllocateError::TimedOut) => {
                    *timed_out = true;
                    None
                }
                Err(_) => None,
            }
        };
        let mut best = (0, try_k(0)?);
        // Where the node's free devices bound the count, try that many at once: a search
        // that fits usually takes no step back, one that does not may try every permutation.
        let bound = self.upper_bound(state, node, extra);
        let cap = bound.map_or(cap, |b| b.min(cap));
        if bound.is_some()
            && cap > 0
            && let Some(a) = try_k(cap)
        {
            return Some((cap, a));
        }
        // Gallop, then bisect: whether k pods fit together only shrinks as k grows.
        let mut hi = None;
        let mut k = 1;
        while k <= cap {
            match try_k(k) {
                Some(a) => {
                    best = (k, a);
                    k *= 2;
                }
                None => {
                    hi = Some(k);
                    break;
                }
            }
        }
        let mut hi = hi.unwrap_or(cap + 1);
        let mut lo = best.0;
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            match try_k(mid) {
                Some(a) => {
                    best = (mid, a);
                    lo = mid;
                }
                None => hi = mid,
            }
        }
        Some(best)
    }

    /// At most how many pods fit on `node` besides `extra`: its free devices over the devices
    /// a pod takes; `None` where that says nothing (shareable devices, `All`).
    fn upper_bound(
        &self,
        state: &AllocatedState,
        node: &Node,
        extra: &[&ResourceClaim],
    ) -> Option<usize> {
        let per_pod = devices_needed(&self.group.pods.first()?.claims)?;
        if per_pod == 0 {
            return None;
        }
        let extra: usize = devices_needed(extra.iter().copied())?;
        let name = node_name(node);
        let mut free = 0usize;
        for s in self.scopes.of(name) {
            let on = s.spec.node_name.as_deref().filter(|n| !n.is_empty());
            if on.is_some_and(|n| n != name) {
                continue;
            }
            for d in s.spec.devices.iter().flatten() {
                if d.allow_multiple_allocations == Some(true) {
                    return None;
                }
                let id = crate::DeviceId::new(&s.spec.driver, &s.spec.pool.name, &d.name);
                if !state.is_device_allocated(&id) {
                    free += 1;
                }
            }
        }
        Some(free.saturating_sub(extra) / per_pod)
    }

    /// The scheduler's order from each node where the first pod (with the group's claims)
    /// fits, up to [`MAX_FIRST_NODES`] besides the one the greedy run took.
    fn first_pod_nodes(
        &self,
        nodes: &[&Node],
        taken: &str,
        placed: usize,
    ) -> Result<FirstPodNodes, Error> {
        let required = self.required();
        let mut answer = FirstPodNodes {
            checked: 1,
            candidates: 0,
            fits_from: Vec::new(),
            short_from: BTreeMap::new(),
        };
        let record = |answer: &mut FirstPodNodes, node: &str, placed: usize| {
            if placed >= required {
                answer.fits_from.push(node.to_owned());
            } else {
                answer.short_from.insert(node.to_owned(), placed);
            }
        };
        record(&mut answer, taken, placed);
        let Some(pod) = self.group.pods.first() else {
            return Ok(answer);
        };
        let mut allocators = Allocators {
            scopes: self.scopes,
            objects: self.objects,
            features: self.features,
            built: HashMap::new(),
        };
        let first_claims: Vec<&ResourceClaim> = pod
            .claims
            .iter()
            .chain(self.group.shared.iter().filter(|c| !crate::is_allocated(c)))
            .collect();
        let bounds: Vec<&ResourceClaim> = self
            .group
            .shared
            .iter()
            .filter(|c| crate::is_allocated(c))
            .collect();
        for &node in nodes {
            let name = node_name(node);
            if bound_excludes(&bounds, node).is_some() {
                continue;
            }
            let allocator = allocators.get(&self.base, name)?;
            let fits = matches!(
                allocator.allocate(node, &first_claims, self.interrupt()),
                Ok(Some(_))
            );
            if !fits {
                continue;
            }
            answer.candidates += 1;
            if name == taken || answer.checked > MAX_FIRST_NODES {
                continue;
            }
            answer.checked += 1;
            let run = self.run(nodes, Some(name), false)?;
            record(&mut answer, name, run.pods.len());
        }
        Ok(answer)
    }
}

/// Devices the claims take at least (a `firstAvailable` request its smallest subrequest,
/// admin access none); `None` for a request of `All` devices.
fn devices_needed<'c>(claims: impl IntoIterator<Item = &'c ResourceClaim>) -> Option<usize> {
    let count = |mode: Option<&String>, count: Option<i64>, admin: Option<bool>| {
        if mode.is_some_and(|m| m == "All") {
            None
        } else if admin == Some(true) {
            Some(0)
        } else {
            Some(usize::try_from(count.unwrap_or(1)).unwrap_or(0))
        }
    };
    let mut total = 0;
    for claim in claims {
        for r in claim
            .spec
            .devices
            .iter()
            .flat_map(|d| d.requests.iter().flatten())
        {
            total += match (&r.exactly, &r.first_available) {
                (Some(e), _) => count(e.allocation_mode.as_ref(), e.count, e.admin_access)?,
                (None, Some(subs)) => subs
                    .iter()
                    .map(|s| count(s.allocation_mode.as_ref(), s.count, None))
                    .collect::<Option<Vec<usize>>>()?
                    .into_iter()
                    .min()
                    .unwrap_or(0),
                (None, None) => 0,
            };
        }
    }
    Some(total)
}

/// The first claim among `bounds` (allocated) whose allocation's node selector excludes
/// `node`.
fn bound_excludes<'c>(bounds: &[&'c ResourceClaim], node: &Node) -> Option<&'c ResourceClaim> {
    bounds.iter().copied().find(|c| {
        let selector = c
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.node_selector.as_ref());
        selector.is_some_and(|s| !node_matches(node, "", false, Some(s)).unwrap_or(false))
    })
}

#[cfg(test)]
mod tests;
