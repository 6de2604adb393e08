//! The search: claims → requests → devices, depth first, first solution wins.
//!
//! upstream: `structured/internal/incubating/allocator_incubating.go` (`NewAllocator`,
//! `Allocate`, `validateDeviceRequest`, `allocateOne`, `isSelectable`, `selectorsMatch`,
//! `allocateDevice`, `rollbackDevice`, `checkAvailableCounters`, `taintPreventsAllocation`);
//! KEP-4381 (structured parameters), KEP-4816 (prioritized list), KEP-5055 (device taints),
//! KEP-5004/5075 (admin access, consumable capacity), KEP-4815 (partitionable devices),
//! KEP-5007 (binding conditions).
//!
//! The order of pools, slices and devices, the order candidates are tried in, and every check
//! are upstream's, so the first solution found is upstream's. What differs is bookkeeping:
//! devices are addressed by position instead of by name, and selectors are compiled once.

use std::collections::BTreeMap;

use foldhash::{HashMap, HashMapExt};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use dra_cel::{
    CompileError, CompiledExpression, DeviceError, DeviceView, EvalError, EvalOptions, MatchError,
};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{
    DeviceClass, DeviceRequest, DeviceSelector, DeviceToleration, ResourceClaim, ResourceSlice,
};
use k8s_quantity::Quantity;

use crate::capacity::{self, Requests};
use crate::constraints::Constraint;
use crate::explain::Explanation;
use crate::model::{
    AllocatedState, ConsumedCapacity, Counters, DeviceData, DeviceId, SliceData, claim_ref,
    parse_quantity,
};
use crate::node_selector::node_matches;
use crate::pools::{Pool, PoolCache, gather_pools};
use crate::result::{Allocation, NodeSelection};

mod funnel;
use crate::{Error, Features};

/// `resourceapi.AllocationResultsMaxSize`: devices per claim.
pub const ALLOCATION_RESULTS_MAX_SIZE: i64 = 32;

/// Why [`Allocator::allocate`] gave no answer for a node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocateError {
    /// The deadline passed first; the search was abandoned, nothing is known about the node.
    #[error("timed out trying to allocate devices")]
    TimedOut,
    /// The caller cancelled the search.
    #[error("allocation cancelled")]
    Cancelled,
    /// A problem with the claims, classes or slices that upstream reports as an error for the
    /// whole scheduling attempt (a CEL error, a constraint that cannot be satisfied in `All`
    /// mode, too many devices...). The message is upstream's.
    #[error("{0}")]
    Fatal(String),
    /// A problem that only concerns this node (upstream's `ErrFailedAllocationOnNode`): the
    /// scheduler reports it as the node's unschedulable reason.
    #[error("{0}")]
    FailedOnNode(String),
}

/// When to give up on a search.
#[derive(Debug, Clone, Copy, Default)]
pub struct Interrupt<'c> {
    /// Give up at this instant ([`AllocateError::TimedOut`]).
    pub deadline: Option<Instant>,
    /// Give up when this becomes true ([`AllocateError::Cancelled`]).
    pub cancel: Option<&'c AtomicBool>,
}

/// What the search decided for a node ([`Allocator::explain_pod`]).
#[derive(Debug)]
pub enum Decision<'s> {
    /// The claims fit: one allocation per claim, in claim order.
    Fits(Vec<Allocation<'s>>),
    /// They do not fit, and why.
    DoesNotFit(Box<Explanation>),
}

/// [`Decision`], with the explanation only where it was asked for.
enum Outcome<'s> {
    Fits(Vec<Allocation<'s>>),
    DoesNotFit(Option<Box<Explanation>>),
}

/// What in the allocated state concerns one device: two bytes, so that the flags of a node's
/// devices share a cache line or two (the search reads them for every device it passes).
#[derive(Debug, Default)]
struct DeviceFlags {
    /// Allocated exclusively.
    dedicated: bool,
    /// `IsDeviceAllocated`: its counters are consumed.
    counts_allocated: bool,
}

/// Compiled selectors by expression; compile errors are kept so that they surface where a
/// selector is evaluated, as upstream's lazily compiling cache does.
type CelCache = HashMap<String, Compiled>;

/// What selectors read of a device: its attribute table and driver, for selectors answered
/// without the evaluator ([`crate::attributes::compare`], valid at the allocator's cost limit),
/// and the device itself, whose CEL view is built only where the evaluator runs (the view
/// reads parts of the device record the table spares the search).
#[derive(Clone, Copy)]
struct SelectorInput<'t, 'v> {
    attributes: crate::attributes::Attributes<'t, 'v>,
    driver: &'t str,
    device: &'t DeviceData<'v>,
}

impl<'t> SelectorInput<'t, '_> {
    /// The device as the evaluator sees it, or why it cannot.
    fn view(&self) -> Result<DeviceView<'t>, DeviceError> {
        match &self.device.view_error {
            None => Ok(DeviceView::checked_with_driver(
                &self.device.cel,
                self.driver,
                false,
            )),
            Some(e) => Err((**e).clone()),
        }
    }
}

const _: () = assert!(dra_cel::MAX_COST >= dra_cel::SHORTCUT_COST_BOUND);

/// A selector's compiled expression, or why it does not compile.
type Compiled = Result<Arc<CompiledExpression>, CompileError>;

/// What decides whether a device can serve one (sub)request: its class's selectors, then its
/// own, each compiled once per pod (compile errors surface only when a device is checked, as
/// upstream compiles lazily in `isSelectable`).
#[derive(Debug)]
struct Selectors<'s> {
    class: &'s DeviceClass,
    class_cel: Vec<Option<Compiled>>,
    request_cel: Vec<Option<Compiled>>,
}

/// An allocator for one set of slices, classes and allocated devices; reusable for many nodes
/// and thread-safe, like upstream's `Allocator`.
#[derive(Debug)]
pub struct Allocator<'a> {
    features: Features,
    classes: HashMap<&'a str, &'a DeviceClass>,
    slices: Vec<SliceData<'a>>,
    /// Per node name, its own slices: a range of `node_slices`.
    on_node: HashMap<&'a str, std::ops::Range<usize>>,
    node_slices: Vec<usize>,
    shared: Vec<usize>,
    /// Every slice of each (driver, pool), in input order: upstream's `checkSlicesInPool`
    /// scans all slices for each pool it finds incomplete, for every node.
    by_pool: HashMap<(&'a str, &'a str), Vec<usize>>,
    /// Index of each slice's first device in `flags`.
    offsets: Vec<usize>,
    flags: Vec<DeviceFlags>,
    /// Capacity consumed by shares, per device (by index in `flags`) that has any.
    aggregated: HashMap<usize, ConsumedCapacity>,
    compiler: dra_cel::Compiler,
    cel: Mutex<CelCache>,
    /// Available counters per pool *name* (upstream keys them so, across drivers), computed
    /// the first time a pool's counters are needed and then kept for later nodes.
    available_counters: Mutex<HashMap<String, Arc<BTreeMap<String, Counters>>>>,
    /// Pools that any node may see, built for the first node that saw them.
    pools: PoolCache<'a>,
    invocations: AtomicU64,
    /// The hash seed of each call's maps, made once (a fresh seed per map costs more than a
    /// small search).
    hasher: foldhash::fast::RandomState,
}

impl<'a> Allocator<'a> {
    /// Reads the slices and classes (`NewAllocator`). Slices without a node name, or with
    /// counter sets, are candidates for every node; the others only for their node.
    ///
    /// # Errors
    /// [`Error::UnsupportedFeatures`] for list-type attributes (upstream's experimental
    /// variant), [`Error::InvalidQuantity`] for a capacity or counter that is not a quantity.
    pub fn new(
        features: Features,
        allocated: &AllocatedState,
        classes: &'a [DeviceClass],
        slices: &'a [ResourceSlice],
    ) -> Result<Allocator<'a>, Error> {
        if features.list_type_attributes {
            return Err(Error::UnsupportedFeatures(
                "DRAListTypeAttributes needs upstream's experimental allocator".into(),
            ));
        }
        let mut class_map = HashMap::new();
        for class in classes {
            class_map.insert(class.metadata.name.as_deref().unwrap_or(""), class);
        }
        let mut data = Vec::with_capacity(slices.len());
        let mut on_node: HashMap<&'a str, Vec<usize>> = HashMap::new();
        let mut shared = Vec::new();
        let mut by_pool: HashMap<(&'a str, &'a str), Vec<usize>> = HashMap::new();
        let mut offsets = Vec::with_capacity(slices.len());
        let mut flags = Vec::new();
        let mut aggregated = HashMap::new();
        // Each driver's name is read from one place, the first slice naming it: every node's
        // search compares it (class selectors, constraints), so it stays in cache instead of
        // being one more cold line per slice.
        let mut drivers: HashMap<&'a str, &'a str> = HashMap::new();
        for (i, slice) in slices.iter().enumerate() {
            let mut d = SliceData::new(slice)?;
            d.driver = drivers.entry(d.driver).or_insert(d.driver);
            let node = d.node_name.unwrap_or("");
            if node.is_empty() || d.has_shared_counters() {
                shared.push(i);
            } else {
                on_node.entry(node).or_default().push(i);
            }
            by_pool.entry((d.driver, d.pool)).or_default().push(i);
            offsets.push(flags.len());
            for dev in &d.devices {
                let id = DeviceId::new(d.driver, d.pool, dev.name);
                if let Some(consumed) = allocated.aggregated_capacity.get(&id) {
                    aggregated.insert(flags.len(), consumed.clone());
                }
                flags.push(DeviceFlags {
                    dedicated: allocated.allocated_devices.contains(&id),
                    counts_allocated: allocated.is_device_allocated(&id),
                });
            }
            data.push(d);
        }
        let mut node_slices = Vec::with_capacity(data.len());
        let on_node = on_node
            .into_iter()
            .map(|(node, slices)| {
                let start = node_slices.len();
                node_slices.extend(slices);
                (node, start..node_slices.len())
            })
            .collect();
        Ok(Allocator {
            features,
            classes: class_map,
            slices: data,
            on_node,
            node_slices,
            shared,
            by_pool,
            offsets,
            flags,
            aggregated,
            compiler: dra_cel::Compiler::new(
                dra_cel::Features {
                    consumable_capacity: features.consumable_capacity,
                    list_type_attributes: false,
                },
                dra_cel::Environment::Stored,
            ),
            cel: Mutex::new(HashMap::new()),
            available_counters: Mutex::new(HashMap::new()),
            pools: Mutex::new(HashMap::new()),
            invocations: AtomicU64::new(0),
            hasher: foldhash::fast::RandomState::default(),
        })
    }

    /// How many times the search stepped (upstream's `NumAllocateOneInvocations`), over all
    /// calls so far.
    pub fn steps(&self) -> u64 {
        self.invocations.load(AtomicOrdering::Relaxed)
    }

    /// Allocates `claims` together for `node` (`Allocator.Allocate`): `Ok(Some(allocations))`
    /// with one [`Allocation`] per claim in claim order (borrowing from the inputs, as upstream's
    /// results share their strings; [`Allocation::to_api`] makes the `AllocationResult`),
    /// `Ok(None)` when they do not fit (incomplete pools included).
    ///
    /// # Errors
    /// [`AllocateError`]: a fatal input problem, a node-only failure, or an interruption (never
    /// a wrong answer).
    pub fn allocate<'s>(
        &'s self,
        node: &'s Node,
        claims: &[&'s ResourceClaim],
        interrupt: Interrupt<'_>,
    ) -> Result<Option<Vec<Allocation<'s>>>, AllocateError> {
        self.allocate_pod(node, &self.pod(claims), interrupt)
    }

    /// Validates a pod's claims once for all of its nodes: every request, the per-claim device
    /// limit and the constraints, which upstream checks again in every `Allocate` call. The
    /// outcome, errors included, is what each node's call would find; only a request for `All`
    /// devices depends on the node's pools, and such a pod is validated per node instead.
    pub fn pod<'s>(&'s self, claims: &[&'s ResourceClaim]) -> Pod<'s> {
        let kobjs: Arc<Vec<String>> = Arc::new(claims.iter().map(|c| claim_ref(c)).collect());
        let prepared = (!claims.iter().any(|c| wants_all(c))).then(|| {
            let mut search = Search::new(
                self,
                &NO_NODE,
                Arc::clone(&kobjs),
                Vec::new(),
                Interrupt::default(),
            );
            search
                .prepare(claims)
                .map(|()| (search.claims, search.constraints))
        });
        Pod {
            claims: claims.to_vec(),
            kobjs,
            prepared,
        }
    }

    /// [`Allocator::allocate`] for a pod validated with [`Allocator::pod`]: the same answer,
    /// without validating its claims again.
    ///
    /// # Errors
    /// As [`Allocator::allocate`].
    pub fn allocate_pod<'s>(
        &'s self,
        node: &'s Node,
        pod: &Pod<'s>,
        interrupt: Interrupt<'_>,
    ) -> Result<Option<Vec<Allocation<'s>>>, AllocateError> {
        Ok(match self.decide(node, pod, interrupt, false)? {
            Outcome::Fits(allocations) => Some(allocations),
            Outcome::DoesNotFit(_) => None,
        })
    }

    /// [`Allocator::allocate_pod`], and where the claims do not fit, why
    /// ([`crate::explain`]): computed by the same search right after it found no solution.
    ///
    /// # Errors
    /// As [`Allocator::allocate`].
    pub fn explain_pod<'s>(
        &'s self,
        node: &'s Node,
        pod: &Pod<'s>,
        interrupt: Interrupt<'_>,
    ) -> Result<Decision<'s>, AllocateError> {
        Ok(match self.decide(node, pod, interrupt, true)? {
            Outcome::Fits(allocations) => Decision::Fits(allocations),
            Outcome::DoesNotFit(explanation) => {
                Decision::DoesNotFit(explanation.unwrap_or_default())
            }
        })
    }

    fn decide<'s>(
        &'s self,
        node: &'s Node,
        pod: &Pod<'s>,
        interrupt: Interrupt<'_>,
        explain: bool,
    ) -> Result<Outcome<'s>, AllocateError> {
        // The search recurses once per device; deep searches get a large stack of their own.
        let depth: usize = pod
            .claims
            .iter()
            .map(|c| {
                let requests = c
                    .spec
                    .devices
                    .as_ref()
                    .and_then(|d| d.requests.as_ref())
                    .map_or(0, Vec::len);
                requests * (ALLOCATION_RESULTS_MAX_SIZE as usize + 2) + 1
            })
            .sum();
        if depth < 200 {
            return self.allocate_here(node, pod, interrupt, explain);
        }
        std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("dra-allocate".into())
                .stack_size(depth.saturating_mul(4096).clamp(8 << 20, 1 << 30))
                .spawn_scoped(scope, || self.allocate_here(node, pod, interrupt, explain))
                .map_err(|e| AllocateError::Fatal(format!("starting the search: {e}")))?
                .join()
                .unwrap_or_else(|_| Err(AllocateError::Fatal("the search failed".into())))
        })
    }

    fn allocate_here<'s>(
        &'s self,
        node: &'s Node,
        pod: &Pod<'s>,
        interrupt: Interrupt<'_>,
        explain: bool,
    ) -> Result<Outcome<'s>, AllocateError> {
        let node_name = node.metadata.name.as_deref().unwrap_or("");
        let own = self
            .on_node
            .get(node_name)
            .and_then(|r| self.node_slices.get(r.clone()))
            .unwrap_or_default();
        self.start_loading(own);
        let for_node = own.iter().chain(&self.shared).copied();
        let pools = gather_pools(
            &self.slices,
            &self.by_pool,
            for_node,
            node,
            self.features,
            &self.pools,
        )
        .map_err(|e| AllocateError::Fatal(format!("gather pool information: {e}")))?;
        let mut search = Search::new(self, node, Arc::clone(&pod.kobjs), pools, interrupt);
        match &pod.prepared {
            Some(Ok((claims, constraints))) => {
                search.claims = Arc::clone(claims);
                search.constraints.clone_from(constraints);
            }
            Some(Err(e)) => return Err(e.clone()),
            None => search.prepare(&pod.claims)?,
        }
        let outcome = search.run();
        self.invocations
            .fetch_add(search.steps, AtomicOrdering::Relaxed);
        Ok(match outcome? {
            Some(allocations) => Outcome::Fits(allocations),
            None => Outcome::DoesNotFit(explain.then(|| Box::new(search.explain()))),
        })
    }

    /// Starts loading, all at once, what the search of a node will read of its own slices: the
    /// record and attributes of each device not in use (of the first 16 devices of its first
    /// four slices). A node's data is usually cold in memory (the search visits every node
    /// once); loads issued together wait for memory together instead of one after the other
    /// as the search reaches each device. Nothing consumes the values.
    fn start_loading(&self, own: &[usize]) {
        for &i in own.iter().take(4) {
            let Some(slice) = self.slices.get(i) else {
                continue;
            };
            std::hint::black_box(slice.driver.as_bytes().first());
            std::hint::black_box(slice.pool.as_bytes().first());
            std::hint::black_box(slice.names.as_bytes().first());
            let offset = self.offsets.get(i).copied().unwrap_or(0);
            for (d, device) in slice.devices.iter().enumerate().take(16) {
                if self.flags.get(offset + d).is_some_and(|f| f.dedicated) {
                    continue;
                }
                slice
                    .attributes
                    .device(device.attributes.clone())
                    .start_loading();
            }
        }
    }

    /// The compiled selector, compiling it on first use.
    fn compiled(&self, expression: &str) -> Result<Arc<CompiledExpression>, CompileError> {
        let mut cache = self.cel.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = cache.get(expression) {
            return c.clone();
        }
        let compiled = self.compiler.compile(expression).map(Arc::new);
        cache.insert(expression.to_string(), compiled.clone());
        compiled
    }

    /// A device by slice and position.
    fn device(&self, slice: usize, device: usize) -> Option<(&SliceData<'a>, &DeviceData<'a>)> {
        let s = self.slices.get(slice)?;
        Some((s, s.devices.get(device)?))
    }

    fn flat(&self, slice: usize, device: usize) -> usize {
        self.offsets.get(slice).copied().unwrap_or(0) + device
    }
}

/// Steps of the search (`allocateOne` calls) before [`Search::enough_candidates`] bounds it.
/// The bound never changes an answer, only when it starts cutting.
const BOUND_AFTER_STEPS: u64 = 16;

/// Search steps after which selector answers are remembered per device and request.
const MEMO_AFTER_STEPS: u64 = 16;

/// Why the recursion stops early.
enum Stop {
    /// `errAllocationResultMaxSizeExceeded`: a claim would get more than 32 devices.
    MaxSize,
    /// Anything else ends the search.
    Error(AllocateError),
}

impl From<AllocateError> for Stop {
    fn from(e: AllocateError) -> Stop {
        Stop::Error(e)
    }
}

type Step<T> = Result<T, Stop>;

/// A device by pool, slice (index into the allocator's slices) and position.
#[derive(Clone, Copy, Debug)]
struct DevRef {
    pool: usize,
    slice: usize,
    device: usize,
    flat: usize,
}

/// Where the search is: claim, request, subrequest, device of the request.
#[derive(Clone, Copy, Debug, Default)]
struct Indices {
    claim: usize,
    request: usize,
    sub: usize,
    device: usize,
}

/// Where to continue looking for candidates: pool, slice within the pool, device.
#[derive(Clone, Copy, Debug, Default)]
struct Location {
    pool: usize,
    slice: usize,
    device: usize,
}

/// A request or subrequest, validated (`requestData`).
#[derive(Debug, Clone)]
pub(crate) struct RequestData<'s> {
    pub(crate) name: &'s str,
    /// The request holding this subrequest.
    pub(crate) parent: Option<&'s str>,
    pub(crate) class: &'s DeviceClass,
    all_mode: bool,
    num_devices: i64,
    admin: bool,
    selectors: Arc<Selectors<'s>>,
    tolerations: &'s [DeviceToleration],
    capacity: Option<Requests>,
    all_devices: Vec<DevRef>,
}

/// A request of a claim: one entry, or one per subrequest.
#[derive(Debug)]
pub(crate) struct RequestSlot<'s> {
    pub(crate) subs: Vec<RequestData<'s>>,
    pub(crate) has_subrequests: bool,
}

#[derive(Debug)]
pub(crate) struct ClaimData<'s> {
    pub(crate) obj: &'s ResourceClaim,
    kobj: String,
    pub(crate) requests: Vec<RequestSlot<'s>>,
}

/// One allocated device (`internalDeviceResult`).
#[derive(Debug, Clone)]
pub(crate) struct DeviceResult<'s> {
    pub request: &'s str,
    pub parent: Option<&'s str>,
    pub slice: usize,
    pub device: usize,
    pub share_id: Option<String>,
    pub consumed: Option<BTreeMap<String, Quantity>>,
    pub admin: bool,
}

/// What `allocateDevice` changed, for `rollbackDevice`.
#[derive(Debug, Default)]
struct Rollback {
    counters_reserved: bool,
    constraints_added: usize,
    device_marked: bool,
    capacity_inserted: bool,
    capacity_entry_existed: bool,
    result_added: bool,
    previous_results: usize,
    consumed: Option<ConsumedCapacity>,
}

/// One `Allocate` call.
struct Search<'s, 'a, 'i> {
    alloc: &'s Allocator<'a>,
    node: &'s Node,
    /// The pod's claims, validated ([`Search::prepare`]).
    claims: Arc<Vec<ClaimData<'s>>>,
    /// The subrequest picked, per claim and request (once the search succeeded).
    selected: Vec<Vec<usize>>,
    /// `klog.KObj` of every claim, for messages (also during validation).
    kobjs: Arc<Vec<String>>,
    pools: Vec<Arc<Pool<'a>>>,
    interrupt: Interrupt<'i>,
    /// `deviceMatchesRequest`: (device, claim, request, subrequest) → selectable.
    matches: HashMap<(usize, usize, usize, usize), bool>,
    constraints: Vec<Vec<Constraint<'s>>>,
    /// Counters consumed by devices being allocated, per pool name.
    consumed_counters: HashMap<String, BTreeMap<String, Counters>>,
    /// This call's copies of the allocator's available counters.
    available: HashMap<String, Arc<BTreeMap<String, Counters>>>,
    /// (device, claim) for each device being allocated, in the order added: a list, as a
    /// search holds a few dozen devices at most (32 per claim) and a map cost more per node.
    allocating_devices: Vec<(usize, usize)>,
    /// Device → capacity being allocated from it.
    allocating_capacity: HashMap<usize, ConsumedCapacity>,
    results: Vec<Vec<DeviceResult<'s>>>,
    steps: u64,
}

fn fatal<T>(msg: String) -> Result<T, AllocateError> {
    Err(AllocateError::Fatal(msg))
}

/// The node a pod's claims are validated against once for all nodes ([`Allocator::pod`]):
/// validation without `All` requests reads no node.
static NO_NODE: std::sync::LazyLock<Node> = std::sync::LazyLock::new(Node::default);

/// Whether a request or subrequest of the claim asks for `All` devices.
fn wants_all(claim: &ResourceClaim) -> bool {
    let all = |mode: Option<&String>| mode.is_some_and(|m| m == "All");
    claim
        .spec
        .devices
        .as_ref()
        .and_then(|d| d.requests.as_deref())
        .unwrap_or_default()
        .iter()
        .any(|r| {
            r.exactly
                .as_ref()
                .is_some_and(|e| all(e.allocation_mode.as_ref()))
                || r.first_available
                    .iter()
                    .flatten()
                    .any(|s| all(s.allocation_mode.as_ref()))
        })
}

/// A pod's claims, validated once for all of its nodes ([`Allocator::pod`]).
#[derive(Debug)]
pub struct Pod<'s> {
    claims: Vec<&'s ResourceClaim>,
    kobjs: Arc<Vec<String>>,
    /// The validated claims and their constraints, or the error every node would meet; `None`
    /// when validation depends on the node (a request for `All` devices).
    prepared: Option<PreparedClaims<'s>>,
}

type PreparedClaims<'s> =
    Result<(Arc<Vec<ClaimData<'s>>>, Vec<Vec<Constraint<'s>>>), AllocateError>;

impl<'s, 'a: 's, 'i> Search<'s, 'a, 'i> {
    fn new(
        alloc: &'s Allocator<'a>,
        node: &'s Node,
        kobjs: Arc<Vec<String>>,
        pools: Vec<Arc<Pool<'a>>>,
        interrupt: Interrupt<'i>,
    ) -> Search<'s, 'a, 'i> {
        Search {
            alloc,
            node,
            claims: Arc::default(),
            selected: Vec::new(),
            constraints: Vec::with_capacity(kobjs.len()),
            kobjs,
            pools,
            interrupt,
            matches: HashMap::with_hasher(alloc.hasher),
            consumed_counters: HashMap::with_hasher(alloc.hasher),
            available: HashMap::with_hasher(alloc.hasher),
            allocating_devices: Vec::new(),
            allocating_capacity: HashMap::with_hasher(alloc.hasher),
            results: Vec::new(),
            steps: 0,
        }
    }

    fn run(&mut self) -> Result<Option<Vec<Allocation<'s>>>, AllocateError> {
        self.results = vec![Vec::new(); self.claims.len()];
        self.selected = self
            .claims
            .iter()
            .map(|c| vec![0; c.requests.len()])
            .collect();
        // With one request the search has nothing to backtrack over: the bound inside it is
        // enough, and counting every candidate first would only cost time.
        let requests: usize = self.claims.iter().map(|c| c.requests.len()).sum();
        if requests > 1 && self.some_request_cannot_be_met() {
            return self.none_fits();
        }
        match self.allocate_one(Indices::default(), false, Location::default()) {
            Ok(true) => {}
            // Only a subrequest loop or the next claim absorbs this; upstream returns it as is.
            Err(Stop::MaxSize) => {
                return Err(AllocateError::Fatal("allocation max size exceeded".into()));
            }
            Ok(false) => return self.none_fits(),
            Err(Stop::Error(e)) => return Err(e),
        }
        let node_name = self.node.metadata.name.as_deref().unwrap_or("");
        let slices: &'s [SliceData<'s>] = &self.alloc.slices;
        let results = std::mem::take(&mut self.results);
        let picked = std::mem::take(&mut self.selected);
        let mut out = Vec::with_capacity(self.claims.len());
        for (ci, (results, picked)) in results.into_iter().zip(picked).enumerate() {
            let Some(claim) = self.claims.get(ci) else {
                continue;
            };
            let node_selection = NodeSelection::of(claim.obj, slices, &results)?;
            out.push(Allocation {
                claims: Arc::clone(&self.claims),
                claim: ci,
                picked,
                results,
                slices,
                node_selection,
                node_name,
                features: self.alloc.features,
            });
        }
        Ok(Some(out))
    }

    /// What the search answers when it finds no solution.
    fn none_fits(&self) -> Result<Option<Vec<Allocation<'s>>>, AllocateError> {
        if self.pools.iter().any(|p| p.invalid) {
            return Err(AllocateError::FailedOnNode(
                "invalid resource pools were encountered".into(),
            ));
        }
        Ok(None)
    }

    /// Not upstream's: whether the search must fail because one request, taken in search order,
    /// has fewer candidates than devices even with nothing else allocated, while no request up
    /// to it meets an error on any device. Upstream then explores every combination of the
    /// requests before it (kubernetes/kubernetes#131730) and ends with no solution; errors it
    /// could meet on the way are the ones ruled out here (selector and node-selection errors on
    /// those requests' devices; requests in `All` mode and with subrequests end the check, as
    /// their errors and size limits depend on the search).
    fn some_request_cannot_be_met(&mut self) -> bool {
        for claim in 0..self.claims.len() {
            let n_requests = self.claims.get(claim).map_or(0, |c| c.requests.len());
            for request in 0..n_requests {
                let Some(slot) = self.claims.get(claim).and_then(|c| c.requests.get(request))
                else {
                    return false;
                };
                let Some(rd) = slot.subs.first() else {
                    return false;
                };
                if slot.has_subrequests || rd.all_mode {
                    return false;
                }
                let (needed, admin, selectors) =
                    (rd.num_devices, rd.admin, Arc::clone(&rd.selectors));
                let r = Indices {
                    claim,
                    request,
                    ..Indices::default()
                };
                let found = self.count_candidates(
                    r,
                    (claim, request, 0),
                    &selectors,
                    admin,
                    Location::default(),
                    None,
                );
                match found {
                    None => return false,
                    Some(found) if found < needed => return true,
                    Some(_) => {}
                }
            }
        }
        false
    }

    fn check_interrupt(&self) -> Result<(), AllocateError> {
        if let Some(cancel) = self.interrupt.cancel
            && cancel.load(AtomicOrdering::Relaxed)
        {
            return Err(AllocateError::Cancelled);
        }
        if let Some(deadline) = self.interrupt.deadline
            && Instant::now() >= deadline
        {
            return Err(AllocateError::TimedOut);
        }
        Ok(())
    }

    /// The pre-pass of `Allocate`: validate every request, size `All` requests, check the
    /// per-claim device limit, build constraints.
    fn prepare(&mut self, claims: &[&'s ResourceClaim]) -> Result<(), AllocateError> {
        let features = self.alloc.features;
        let mut prepared = Vec::with_capacity(claims.len());
        for (ci, &claim) in claims.iter().enumerate() {
            let kobj = claim_ref(claim);
            let spec = claim.spec.devices.as_ref();
            let requests: &'s [DeviceRequest] =
                spec.and_then(|d| d.requests.as_deref()).unwrap_or_default();
            let mut min_devices: i64 = 0;
            let mut slots = Vec::with_capacity(requests.len());
            for (ri, request) in requests.iter().enumerate() {
                let subs = request.first_available.as_deref().unwrap_or_default();
                let has_subs = !subs.is_empty();
                if !features.prioritized_list && has_subs {
                    return fatal(format!(
                        "claim {kobj}, request {}: has subrequests, but the DRAPrioritizedList feature is disabled",
                        request.name
                    ));
                }
                if !features.consumable_capacity {
                    if request
                        .exactly
                        .as_ref()
                        .is_some_and(|e| e.capacity.is_some())
                    {
                        return fatal(format!(
                            "claim {kobj}, request {}: has capacity requests, but the DRAConsumableCapacity feature is disabled",
                            request.name
                        ));
                    }
                    if let Some(sub) = subs.iter().find(|s| s.capacity.is_some()) {
                        return fatal(format!(
                            "claim {kobj}, subrequest {}: has capacity requests, but the DRAConsumableCapacity feature is disabled",
                            sub.name
                        ));
                    }
                }
                if has_subs {
                    let mut min = i64::MAX;
                    let mut datas = Vec::with_capacity(subs.len());
                    for (si, sub) in subs.iter().enumerate() {
                        let rd = self.validate(
                            ci,
                            &kobj,
                            (ri, si),
                            Accessor {
                                name: &sub.name,
                                parent: Some(&request.name),
                                class_name: &sub.device_class_name,
                                mode: sub.allocation_mode.as_deref(),
                                count: sub.count,
                                admin: None,
                                selectors: sub.selectors.as_deref().unwrap_or_default(),
                                tolerations: sub.tolerations.as_deref().unwrap_or_default(),
                                capacity: sub.capacity.as_ref().and_then(|c| c.requests.as_ref()),
                            },
                        )?;
                        min = min.min(rd.num_devices);
                        datas.push(rd);
                    }
                    min_devices = min_devices.saturating_add(min);
                    slots.push(RequestSlot {
                        subs: datas,
                        has_subrequests: true,
                    });
                } else {
                    let Some(exactly) = &request.exactly else {
                        return fatal(format!(
                            "claim {kobj}, request {}: unknown request type",
                            request.name
                        ));
                    };
                    let rd = self.validate(
                        ci,
                        &kobj,
                        (ri, 0),
                        Accessor {
                            name: &request.name,
                            parent: None,
                            class_name: &exactly.device_class_name,
                            mode: exactly.allocation_mode.as_deref(),
                            count: exactly.count,
                            admin: exactly.admin_access,
                            selectors: exactly.selectors.as_deref().unwrap_or_default(),
                            tolerations: exactly.tolerations.as_deref().unwrap_or_default(),
                            capacity: exactly.capacity.as_ref().and_then(|c| c.requests.as_ref()),
                        },
                    )?;
                    min_devices = min_devices.saturating_add(rd.num_devices);
                    slots.push(RequestSlot {
                        subs: vec![rd],
                        has_subrequests: false,
                    });
                }
            }
            if min_devices > ALLOCATION_RESULTS_MAX_SIZE {
                return fatal(format!(
                    "claim {kobj}: number of requested devices {min_devices} exceeds the claim limit of {ALLOCATION_RESULTS_MAX_SIZE}"
                ));
            }
            let mut constraints = Vec::new();
            for (i, c) in spec
                .and_then(|d| d.constraints.as_deref())
                .unwrap_or_default()
                .iter()
                .enumerate()
            {
                let requests = c.requests.as_deref().unwrap_or_default();
                if let Some(attr) = &c.match_attribute {
                    constraints.push(Constraint::matching(attr, requests));
                } else if let Some(attr) = &c.distinct_attribute {
                    constraints.push(Constraint::distinct(
                        attr,
                        requests,
                        features.distinct_attribute_per_device,
                    ));
                } else {
                    return fatal(format!(
                        "claim {kobj}, constraint #{i}: empty constraint (unsupported constraint type?)"
                    ));
                }
            }
            self.constraints.push(constraints);
            prepared.push(ClaimData {
                obj: claim,
                kobj,
                requests: slots,
            });
        }
        self.claims = Arc::new(prepared);
        // Upstream starts the search with a fresh selector cache.
        self.matches.clear();
        Ok(())
    }

    /// `validateDeviceRequest`.
    fn validate(
        &mut self,
        claim_index: usize,
        kobj: &str,
        (request_index, sub_index): (usize, usize),
        r: Accessor<'s>,
    ) -> Result<RequestData<'s>, AllocateError> {
        for (i, s) in r.selectors.iter().enumerate() {
            if s.cel.is_none() {
                return fatal(format!(
                    "claim {kobj}, request {}, selector #{i}: CEL expression empty (unsupported selector type?)",
                    r.name
                ));
            }
        }
        if !self.alloc.features.admin_access && r.admin.is_some() {
            return fatal(format!(
                "claim {kobj}, request {}: admin access is requested, but the feature is disabled",
                r.name
            ));
        }
        if r.class_name.is_empty() {
            return fatal(format!(
                "claim {kobj}, request {}: missing device class name (unsupported request type?)",
                r.name
            ));
        }
        let Some(&class) = self.alloc.classes.get(r.class_name) else {
            return fatal(format!(
                "claim {kobj}, request {}: could not retrieve device class {}: deviceclass.resource.k8s.io \"{}\" not found",
                r.name, r.class_name, r.class_name
            ));
        };
        let mut capacity = None;
        if let Some(requests) = r.capacity {
            let mut parsed = Requests::new();
            for (name, q) in requests {
                let value = parse_quantity(&q.0).map_err(|e| {
                    AllocateError::Fatal(format!(
                        "claim {kobj}, request {}: capacity request {name} {:?}: {e}",
                        r.name, q.0
                    ))
                })?;
                parsed.insert(name.clone(), value);
            }
            capacity = Some(parsed);
        }
        let compile = |selectors: &[DeviceSelector]| -> Vec<Option<Compiled>> {
            selectors
                .iter()
                .map(|s| s.cel.as_ref().map(|c| self.alloc.compiled(&c.expression)))
                .collect()
        };
        let class_selectors = class.spec.selectors.as_deref().unwrap_or_default();
        let selectors = Arc::new(Selectors {
            class,
            class_cel: compile(class_selectors),
            request_cel: compile(r.selectors),
        });
        let mut rd = RequestData {
            name: r.name,
            parent: r.parent,
            class,
            all_mode: false,
            num_devices: 0,
            admin: r.admin == Some(true),
            selectors: Arc::clone(&selectors),
            tolerations: r.tolerations,
            capacity,
            all_devices: Vec::new(),
        };
        match r.mode.unwrap_or("") {
            "ExactCount" => rd.num_devices = r.count.unwrap_or(0),
            "All" => {
                rd.all_mode = true;
                let key = (claim_index, request_index, sub_index);
                for pool_index in 0..self.pools.len() {
                    let Some(pool) = self.pools.get(pool_index) else {
                        continue;
                    };
                    if pool.incomplete {
                        return fatal(format!(
                            "claim {kobj}, request {}: asks for all devices, but resource pool {} is currently being updated",
                            r.name,
                            pool.id()
                        ));
                    }
                    if pool.invalid {
                        return fatal(format!(
                            "claim {kobj}, request {}: asks for all devices, but resource pool {} is currently invalid",
                            r.name,
                            pool.id()
                        ));
                    }
                    let slices = pool.slices.clone();
                    for slice in slices {
                        let n = self.alloc.slices.get(slice).map_or(0, |s| s.devices.len());
                        for device in 0..n {
                            let dev = DevRef {
                                pool: pool_index,
                                slice,
                                device,
                                flat: self.alloc.flat(slice, device),
                            };
                            let selectable =
                                self.is_selectable(key, &selectors, dev)
                                    .map_err(|s| match s {
                                        Stop::Error(e) => e,
                                        Stop::MaxSize => {
                                            AllocateError::Fatal("internal error".into())
                                        }
                                    })?;
                            if !selectable {
                                continue;
                            }
                            if self.alloc.features.consumable_capacity
                                && self.capacity_fits(rd.capacity.as_ref(), dev) != Ok(true)
                            {
                                continue;
                            }
                            rd.all_devices.push(dev);
                        }
                    }
                }
                rd.num_devices = rd.all_devices.len() as i64;
            }
            other => {
                return fatal(format!(
                    "claim {kobj}, request {}: unsupported count mode {other}",
                    r.name
                ));
            }
        }
        Ok(rd)
    }

    /// `allocateOne`.
    fn allocate_one(&mut self, r: Indices, allocate_sub: bool, start: Location) -> Step<bool> {
        self.steps += 1;
        self.check_interrupt()?;
        let Some(claim) = self.claims.get(r.claim) else {
            // Every claim is done: the first solution wins.
            return Ok(true);
        };
        let Some(slot) = claim.requests.get(r.request) else {
            let next = Indices {
                claim: r.claim + 1,
                ..Indices::default()
            };
            return match self.allocate_one(next, false, Location::default()) {
                // Another claim needing fewer devices may succeed after changes further up.
                Err(Stop::MaxSize) => Ok(false),
                other => other,
            };
        };
        if !allocate_sub && slot.has_subrequests {
            let n = slot.subs.len();
            let mut all_exceeded = true;
            for sub in 0..n {
                match self.allocate_one(Indices { sub, ..r }, true, Location::default()) {
                    Err(Stop::MaxSize) => continue,
                    Err(e) => return Err(e),
                    Ok(true) => {
                        if let Some(selected) = self
                            .selected
                            .get_mut(r.claim)
                            .and_then(|c| c.get_mut(r.request))
                        {
                            *selected = sub;
                        }
                        return Ok(true);
                    }
                    Ok(false) => all_exceeded = false,
                }
            }
            return if all_exceeded {
                Err(Stop::MaxSize)
            } else {
                Ok(false)
            };
        }
        let Some(rd) = slot.subs.get(r.sub) else {
            return Ok(false);
        };
        let (all_mode, num_devices, admin) = (rd.all_mode, rd.num_devices, rd.admin);
        let selectors = Arc::clone(&rd.selectors);
        if all_mode && rd.all_devices.is_empty() {
            return Ok(false);
        }
        if r.device as i64 >= num_devices {
            let next = Indices {
                claim: r.claim,
                request: r.request + 1,
                ..Indices::default()
            };
            return self.allocate_one(next, false, Location::default());
        }
        let allocated = self.results.get(r.claim).map_or(0, Vec::len) as i64;
        if allocated + num_devices - r.device as i64 > ALLOCATION_RESULTS_MAX_SIZE {
            return Err(Stop::MaxSize);
        }
        let next = Indices {
            device: r.device + 1,
            ..r
        };
        if all_mode {
            let Some(&dev) = rd.all_devices.get(r.device) else {
                return Ok(false);
            };
            let Some(undo) = self.allocate_device(r, dev, true)? else {
                // "All" devices are needed: without this one there is no solution.
                return Ok(false);
            };
            let done = self.allocate_one(next, allocate_sub, Location::default());
            if !matches!(done, Ok(true)) {
                self.rollback(r, dev, undo);
            }
            return done;
        }
        let key = (r.claim, r.request, r.sub);
        let needed = num_devices - r.device as i64;
        // The bound only pays where the search has to backtrack: an ordinary search finds its
        // answer in a handful of steps, and counting candidates first would double its work.
        // Once the search is that long, the bound is checked on entry and again each time a
        // device failed here, for the devices after it, so levels entered before it started
        // cutting are cut too.
        let bounded = |this: &Self| needed >= 2 && this.steps > BOUND_AFTER_STEPS;
        if bounded(self) && !self.enough_candidates(r, key, &selectors, admin, start, needed) {
            return Ok(false);
        }
        let mut at = start;
        while let Some((dev, from)) = self.device_from(at) {
            at = from;
            if self.taken(dev.flat, r.claim, admin) {
                continue;
            }
            if !self.is_selectable(key, &selectors, dev)? {
                continue;
            }
            if self.alloc.features.consumable_capacity {
                let capacity = self.request(r).and_then(|rd| rd.capacity.as_ref());
                if self.capacity_fits(capacity, dev) != Ok(true) {
                    continue;
                }
            }
            let Some(undo) = self.allocate_device(r, dev, false)? else {
                continue;
            };
            match self.allocate_one(next, allocate_sub, from) {
                Ok(true) => return Ok(true),
                Ok(false) => {
                    self.rollback(r, dev, undo);
                    if bounded(self)
                        && !self.enough_candidates(r, key, &selectors, admin, from, needed)
                    {
                        return Ok(false);
                    }
                }
                Err(e) => {
                    self.rollback(r, dev, undo);
                    return Err(e);
                }
            }
        }
        Ok(false)
    }

    /// Whether the device is out of reach for this claim's request before any other check:
    /// in use (or being allocated), or for admin access, already being allocated to this claim.
    fn taken(&self, flat: usize, claim: usize, admin: bool) -> bool {
        if admin {
            self.allocating_for_claim(flat, claim)
        } else {
            self.in_use(flat)
        }
    }

    /// The first device at or after `at` in search order (pools, their slices, their devices;
    /// incomplete and invalid pools skipped), with the place after it.
    fn device_from(&self, at: Location) -> Option<(DevRef, Location)> {
        let mut at = at;
        loop {
            let pool = self.pools.get(at.pool)?;
            let next_pool = Location {
                pool: at.pool + 1,
                ..Location::default()
            };
            if pool.incomplete || pool.invalid {
                at = next_pool;
                continue;
            }
            let Some(&slice) = pool.slices.get(at.slice) else {
                at = next_pool;
                continue;
            };
            if at.device >= self.alloc.slices.get(slice).map_or(0, |s| s.devices.len()) {
                at = Location {
                    slice: at.slice + 1,
                    device: 0,
                    ..at
                };
                continue;
            }
            let dev = DevRef {
                pool: at.pool,
                slice,
                device: at.device,
                flat: self.alloc.flat(slice, at.device),
            };
            return Some((
                dev,
                Location {
                    device: at.device + 1,
                    ..at
                },
            ));
        }
    }

    /// Whether at least `needed` devices from `start` on could each join request `r` as things
    /// stand, tried with the loop's own checks ([`Search::allocate_device`] and a rollback).
    ///
    /// Not upstream's: a bound that keeps its answers while cutting its exponential searches
    /// (kubernetes/kubernetes#131730). Every check only gets stricter deeper in the search
    /// (devices get used, counters and capacity consumed, constraint values fixed), so with
    /// fewer candidates than devices still needed the subtree holds no solution, and upstream's
    /// search of it ends in `false` without other effects. Any error answers `true`: the search
    /// then meets it where upstream does. The claim's constraints are restored from a copy
    /// after each try, because upstream's `distinctAttribute` removal is not an exact undo;
    /// for the same reason a claim with such a constraint is not bounded (answer `true`).
    fn enough_candidates(
        &mut self,
        r: Indices,
        key: (usize, usize, usize),
        selectors: &Selectors<'s>,
        admin: bool,
        start: Location,
        needed: i64,
    ) -> bool {
        // Deeper in the search such a constraint may accept what it refuses now.
        if self
            .constraints
            .get(r.claim)
            .is_some_and(|cs| cs.iter().any(Constraint::loosens_on_removal))
        {
            return true;
        }
        self.count_candidates(r, key, selectors, admin, start, Some(needed))
            .is_none_or(|found| found >= needed)
    }

    /// How many devices from `start` on could each join request `r` as things stand (counting
    /// stops at `stop_at`); `None` when a check fails with an error.
    fn count_candidates(
        &mut self,
        r: Indices,
        key: (usize, usize, usize),
        selectors: &Selectors<'s>,
        admin: bool,
        start: Location,
        stop_at: Option<i64>,
    ) -> Option<i64> {
        let saved = self.constraints.get(r.claim).cloned().unwrap_or_default();
        let mut found = 0i64;
        let mut at = start;
        while let Some((dev, from)) = self.device_from(at) {
            at = from;
            if self.taken(dev.flat, r.claim, admin) {
                continue;
            }
            match self.is_selectable(key, selectors, dev) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(_) => return None,
            }
            let joined = match self.allocate_device(r, dev, false) {
                Ok(Some(undo)) => {
                    self.rollback(r, dev, undo);
                    Some(true)
                }
                Ok(None) => Some(false),
                Err(_) => None,
            };
            if let Some(cs) = self.constraints.get_mut(r.claim) {
                cs.clone_from(&saved);
            }
            if joined? {
                found += 1;
                if stop_at.is_some_and(|n| found >= n) {
                    return Some(found);
                }
            }
        }
        Some(found)
    }

    fn request(&self, r: Indices) -> Option<&RequestData<'s>> {
        self.claims
            .get(r.claim)?
            .requests
            .get(r.request)?
            .subs
            .get(r.sub)
    }

    fn in_use(&self, flat: usize) -> bool {
        self.alloc.flags.get(flat).is_some_and(|f| f.dedicated)
            || self.allocating_devices.iter().any(|&(d, _)| d == flat)
    }

    fn allocating_for_claim(&self, flat: usize, claim: usize) -> bool {
        self.allocating_devices.contains(&(flat, claim))
    }

    fn capacity_in_use(&self, flat: usize) -> bool {
        (!self.alloc.aggregated.is_empty() && self.alloc.aggregated.contains_key(&flat))
            || (!self.allocating_capacity.is_empty()
                && self.allocating_capacity.contains_key(&flat))
    }

    /// `allocator.CmpRequestOverCapacity`.
    fn capacity_fits(&self, requests: Option<&Requests>, dev: DevRef) -> Result<bool, ()> {
        let Some((_, device)) = self.alloc.device(dev.slice, dev.device) else {
            return Err(());
        };
        // Nothing requested, nothing of it allocated or being allocated, no policy: each
        // capacity consumes exactly itself and fits (what `capacity::fits` answers), decided
        // without reading the capacities.
        if requests.is_none_or(BTreeMap::is_empty)
            && !device.capacity_policy
            && !self.capacity_in_use(dev.flat)
        {
            return Ok(true);
        }
        capacity::fits(
            self.alloc.aggregated.get(&dev.flat),
            requests,
            &device.capacity,
            self.allocating_capacity.get(&dev.flat),
        )
    }

    /// Why [`Self::capacity_fits`] says no, in words ([`capacity::shortfall`]).
    fn capacity_shortfall(&self, requests: Option<&Requests>, dev: DevRef) -> Option<String> {
        let (_, device) = self.alloc.device(dev.slice, dev.device)?;
        capacity::shortfall(
            self.alloc.aggregated.get(&dev.flat),
            requests,
            &device.capacity,
            self.allocating_capacity.get(&dev.flat),
        )
    }

    /// `isSelectable`: class selectors, request selectors, per-device node selection; cached.
    fn is_selectable(
        &mut self,
        (claim, request, sub): (usize, usize, usize),
        selectors: &Selectors<'s>,
        dev: DevRef,
    ) -> Step<bool> {
        let alloc = self.alloc;
        let Some((slice, device)) = alloc.device(dev.slice, dev.device) else {
            return Ok(false);
        };
        if !alloc.features.device_binding_and_status && device.has_binding_conditions {
            return Ok(false);
        }
        let key = (dev.flat, claim, request, sub);
        if let Some(&m) = self.matches.get(&key) {
            return Ok(m);
        }
        let input = SelectorInput {
            attributes: slice.attributes.device(device.attributes.clone()),
            driver: slice.driver,
            device,
        };
        input.attributes.start_loading();
        let result =
            self.selectors_match(claim, input, Some(selectors.class), &selectors.class_cel)?
                && self.selectors_match(claim, input, None, &selectors.request_cel)?
                && (!slice.per_device_node_selection
                    || node_matches(
                        self.node,
                        device.obj.node_name.as_deref().unwrap_or(""),
                        device.obj.all_nodes.unwrap_or(false),
                        device.obj.node_selector.as_ref(),
                    )
                    .map_err(AllocateError::Fatal)?);
        // Selector answers are kept once the search is long enough to come back to devices
        // (backtracking); a short search checks each device once, and the map would only cost
        // it an allocation. Answers are the same either way: selectors are pure.
        if self.steps > MEMO_AFTER_STEPS {
            self.matches.insert(key, result);
        }
        Ok(result)
    }

    /// `selectorsMatch`.
    fn selectors_match(
        &self,
        claim: usize,
        input: SelectorInput<'_, '_>,
        class: Option<&DeviceClass>,
        selectors: &[Option<Compiled>],
    ) -> Step<bool> {
        let owner = || match class {
            Some(c) => format!("class {}", c.metadata.name.as_deref().unwrap_or("")),
            None => format!("claim {}", self.kobjs.get(claim).map_or("", String::as_str)),
        };
        for (i, compiled) in selectors.iter().enumerate() {
            let Some(compiled) = compiled else {
                return Err(AllocateError::Fatal(format!(
                    "{}: selector #{i}: CEL expression empty (unsupported selector type?)",
                    owner()
                ))
                .into());
            };
            let compiled = match compiled {
                Ok(c) => c,
                Err(e) => {
                    return Err(AllocateError::Fatal(format!(
                        "{}: selector #{i}: CEL compile error: {e}",
                        owner()
                    ))
                    .into());
                }
            };
            match self.selector_matches(compiled, input) {
                Ok(true) => {}
                Ok(false) => return Ok(false),
                Err(MatchError::Eval(EvalError::Interrupted)) => {
                    return Err(AllocateError::TimedOut.into());
                }
                Err(e) => {
                    return Err(AllocateError::Fatal(format!(
                        "{}: selector #{i}: CEL runtime error: {e}",
                        owner()
                    ))
                    .into());
                }
            }
        }
        Ok(true)
    }

    /// One selector on one device, as upstream's `selectorsMatch` evaluates it.
    fn selector_matches(
        &self,
        compiled: &CompiledExpression,
        input: SelectorInput<'_, '_>,
    ) -> Result<bool, MatchError> {
        let options = EvalOptions {
            cost_limit: dra_cel::MAX_COST,
            deadline: self.interrupt.deadline,
        };
        // A device the evaluator cannot see fails every selector, table or not.
        if let Some(e) = &input.device.view_error {
            Err(MatchError::Device((**e).clone()))
        } else if let Some(driver) = compiled.driver_comparison() {
            Ok(driver == input.driver)
        } else {
            match compiled
                .attribute_comparison()
                .and_then(|c| crate::attributes::compare(input.attributes, input.driver, &c))
            {
                Some(answer) => Ok(answer),
                None => input
                    .view()
                    .map_err(MatchError::Device)
                    .and_then(|view| compiled.matches_view(&view, options)),
            }
        }
    }

    /// `allocateDevice`: `Some(undo)` when the device was taken.
    fn allocate_device(&mut self, r: Indices, dev: DevRef, must: bool) -> Step<Option<Rollback>> {
        let alloc = self.alloc;
        let features = alloc.features;
        let Some((slice, device)) = alloc.device(dev.slice, dev.device) else {
            return Ok(None);
        };
        let Some(rd) = self.request(r) else {
            return Ok(None);
        };
        let (admin, request_name, parent) = (rd.admin, rd.name, rd.parent);
        let allow_multiple = features.consumable_capacity && device.allow_multiple;
        if !allow_multiple && admin && self.allocating_for_claim(dev.flat, r.claim) {
            return Ok(None);
        }
        if !admin && self.in_use(dev.flat) {
            return Ok(None);
        }
        // The slice's flag spares reading the device's list where no device of it has one.
        let consumes = slice.consumes_counters && !device.consumes_counters.is_empty();
        if !features.partitionable_devices && consumes {
            return Ok(None);
        }
        let skip_counters = allow_multiple && self.capacity_in_use(dev.flat);
        let mut undo = Rollback {
            previous_results: self.results.get(r.claim).map_or(0, Vec::len),
            ..Rollback::default()
        };
        if !skip_counters && consumes {
            if !self.reserve_counters(dev) {
                return Ok(None);
            }
            undo.counters_reserved = true;
        }
        let (base, sub) = match parent {
            Some(p) => (p, Some(request_name)),
            None => (request_name, None),
        };
        if features.device_taints && self.taint_prevents(device, r) {
            self.rollback(r, dev, undo);
            return Ok(None);
        }
        let n_constraints = self.constraints.get(r.claim).map_or(0, Vec::len);
        for i in 0..n_constraints {
            let ok = self
                .constraints
                .get_mut(r.claim)
                .and_then(|cs| cs.get_mut(i))
                .is_none_or(|c| {
                    let attributes = slice.attributes.device(device.attributes.clone());
                    c.add(base, sub, attributes, slice.driver)
                });
            if !ok {
                self.rollback(r, dev, undo);
                if must {
                    let kobj = self.claims.get(r.claim).map_or("", |c| c.kobj.as_str());
                    return Err(AllocateError::Fatal(format!(
                        "claim {kobj}, request {request_name}: cannot add device {}/{}/{} because a claim constraint would not be satisfied",
                        slice.driver, slice.pool, device.name
                    ))
                    .into());
                }
                return Ok(None);
            }
            undo.constraints_added += 1;
        }
        if !allow_multiple {
            self.allocating_devices.push((dev.flat, r.claim));
            undo.device_marked = true;
        }
        let mut consumed = None;
        let mut share_id = None;
        if features.consumable_capacity {
            let requests = self.request(r).and_then(|rd| rd.capacity.as_ref());
            if self.capacity_fits(requests, dev) != Ok(true) {
                self.rollback(r, dev, undo);
                return Ok(None);
            }
            if allow_multiple {
                let amounts = capacity::consumed_from_request(requests, &device.capacity);
                // A random (version 4) UUID, as upstream's `GenerateShareID`.
                share_id = Some(uuid::Uuid::new_v4().to_string());
                undo.capacity_entry_existed = self.allocating_capacity.contains_key(&dev.flat);
                capacity::insert(
                    self.allocating_capacity.entry(dev.flat).or_default(),
                    &amounts,
                );
                undo.capacity_inserted = true;
                undo.consumed = Some(amounts.clone());
                if !amounts.is_empty() {
                    consumed = Some(amounts);
                }
            }
        }
        if let Some(results) = self.results.get_mut(r.claim) {
            results.push(DeviceResult {
                request: request_name,
                parent,
                slice: dev.slice,
                device: dev.device,
                share_id,
                consumed,
                admin,
            });
            undo.result_added = true;
        }
        Ok(Some(undo))
    }

    /// `rollbackDevice`.
    fn rollback(&mut self, r: Indices, dev: DevRef, undo: Rollback) {
        if undo.result_added
            && let Some(results) = self.results.get_mut(r.claim)
        {
            results.truncate(undo.previous_results);
        }
        if undo.capacity_inserted {
            if let Some(consumed) = &undo.consumed
                && let Some(entry) = self.allocating_capacity.get_mut(&dev.flat)
                && capacity::remove(entry, consumed)
            {
                self.allocating_capacity.remove(&dev.flat);
            }
            if undo.capacity_entry_existed {
                self.allocating_capacity.entry(dev.flat).or_default();
            }
        }
        if undo.device_marked {
            self.allocating_devices
                .retain(|&entry| entry != (dev.flat, r.claim));
        }
        if undo.constraints_added > 0 {
            let (base, sub) = match self.request(r) {
                Some(rd) => match rd.parent {
                    Some(p) => (p, Some(rd.name)),
                    None => (rd.name, None),
                },
                None => ("", None),
            };
            if let Some(cs) = self.constraints.get_mut(r.claim) {
                for i in (0..undo.constraints_added).rev() {
                    if let Some(c) = cs.get_mut(i) {
                        c.remove(base, sub);
                    }
                }
            }
        }
        if undo.counters_reserved {
            self.release_counters(dev);
        }
    }

    /// `taintPreventsAllocation`: a NoSchedule or NoExecute taint no toleration matches.
    fn taint_prevents(&self, device: &DeviceData<'_>, r: Indices) -> bool {
        let tolerations = self.request(r).map_or(&[][..], |rd| rd.tolerations);
        device.taints.iter().any(|taint| {
            matches!(taint.effect.as_str(), "NoExecute" | "NoSchedule")
                && !tolerations.iter().any(|t| tolerates(t, taint))
        })
    }

    /// `checkAvailableCounters`: reserves the device's counters if they are all available.
    fn reserve_counters(&mut self, dev: DevRef) -> bool {
        let alloc = self.alloc;
        let Some((_, device)) = alloc.device(dev.slice, dev.device) else {
            return false;
        };
        let Some(pool) = self.pools.get(dev.pool) else {
            return false;
        };
        let pool_name = pool.pool.to_string();
        let available = match self.available.get(&pool_name) {
            Some(a) => Arc::clone(a),
            None => {
                let a = alloc.available_counters_for(pool);
                self.available.insert(pool_name.clone(), Arc::clone(&a));
                a
            }
        };
        let consumed = self.consumed_counters.entry(pool_name).or_default();
        for (set, counters) in &device.consumes_counters {
            let entry = consumed.entry(set.clone()).or_default();
            for (name, value) in counters {
                match entry.get_mut(name) {
                    Some(c) => *c = c.saturating_add(value),
                    None => {
                        entry.insert(name.clone(), value.clone());
                    }
                }
            }
        }
        let zero = Quantity::from_int(0);
        for (set, counters) in available.iter() {
            let used = consumed.get(set);
            for (name, value) in counters {
                let c = used.and_then(|u| u.get(name)).unwrap_or(&zero);
                if value.compare(c) == std::cmp::Ordering::Less {
                    self.release_counters(dev);
                    return false;
                }
            }
        }
        true
    }

    /// `deallocateCountersForDevice`.
    fn release_counters(&mut self, dev: DevRef) {
        let Some((_, device)) = self.alloc.device(dev.slice, dev.device) else {
            return;
        };
        let Some(pool) = self.pools.get(dev.pool) else {
            return;
        };
        let Some(consumed) = self.consumed_counters.get_mut(pool.pool) else {
            return;
        };
        for (set, counters) in &device.consumes_counters {
            let Some(entry) = consumed.get_mut(set) else {
                continue;
            };
            for (name, value) in counters {
                let c = entry
                    .entry(name.clone())
                    .or_insert_with(|| Quantity::from_int(0));
                *c = c.sub_or_self(value);
            }
        }
    }
}

impl Allocator<'_> {
    /// The counters of a pool left by allocated devices, computed once per pool name.
    fn available_counters_for(&self, pool: &Pool<'_>) -> Arc<BTreeMap<String, Counters>> {
        let mut cache = self
            .available_counters
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(a) = cache.get(pool.pool) {
            return Arc::clone(a);
        }
        let mut available = pool.counter_sets.clone();
        for &slice in pool.slices.iter().chain(&pool.not_targeting) {
            let Some(s) = self.slices.get(slice) else {
                continue;
            };
            for (i, d) in s.devices.iter().enumerate() {
                if !self
                    .flags
                    .get(self.flat(slice, i))
                    .is_some_and(|f| f.counts_allocated)
                {
                    continue;
                }
                for (set, counters) in &d.consumes_counters {
                    let Some(avail) = available.get_mut(set) else {
                        continue;
                    };
                    for (name, value) in counters {
                        if let Some(a) = avail.get_mut(name) {
                            *a = a.sub_or_zero(value);
                        }
                    }
                }
            }
        }
        let available = Arc::new(available);
        cache.insert(pool.pool.to_string(), Arc::clone(&available));
        available
    }
}

/// `resourceclaim.ToleratesTaint`.
fn tolerates(t: &DeviceToleration, taint: &k8s_openapi::api::resource::v1::DeviceTaint) -> bool {
    let effect = t.effect.as_deref().unwrap_or("");
    if !effect.is_empty() && effect != taint.effect {
        return false;
    }
    let key = t.key.as_deref().unwrap_or("");
    if !key.is_empty() && key != taint.key {
        return false;
    }
    match t.operator.as_deref().unwrap_or("") {
        "" | "Equal" => t.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or(""),
        "Exists" => true,
        _ => false,
    }
}

/// The parts of a request or subrequest that validation reads (`requestAccessor`).
struct Accessor<'s> {
    name: &'s str,
    parent: Option<&'s str>,
    class_name: &'s str,
    mode: Option<&'s str>,
    count: Option<i64>,
    admin: Option<bool>,
    selectors: &'s [DeviceSelector],
    tolerations: &'s [DeviceToleration],
    capacity: Option<&'s BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>,
}
