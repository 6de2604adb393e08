//! The explain controller: for every pod the scheduler marked Unschedulable that has DRA claims,
//! why its claims fit on no node ([`dra_allocator::explain`]), recorded as a Warning event on the
//! pod, where `kubectl describe pod` shows it. And for every claim the scheduler allocated in a
//! way drust's kubelet plugin refuses to prepare ([`gpu_inventory::shares::prepare_refusal`]:
//! two shares smaller than a GPU), a Warning event [`REFUSED_REASON`] on the claim and on each
//! pod it is reserved for, before they wait at prepare forever ([`watch_refusals`]). And the
//! kubelet plugins' `GPUIdle` marks on claims relayed to the claims' pods ([`relay_idle`]).
//!
//! Shape: kube-runtime's [`Controller`] over pods not yet bound (`spec.nodeName=`), a reconcile
//! function and an error policy. ResourceClaims, ResourceSlices, DeviceClasses and Nodes come
//! from reflector caches (watched once, never listed per pod). Each pending pod is explained
//! again every `resync` while it stays pending.
//!
//! Writes are bounded: a pod gets a new event only when its explanation changes or after
//! `republish_after`; all events go through one token bucket (`events_per_second`, `burst`).
//! The explanation is computed off the async workers (`spawn_blocking`).
//!
//! RBAC (deploy/helm/drust/templates/explain-controller.yaml): `list`/`watch` pods,
//! resourceclaims, resourceslices, deviceclasses and nodes; `create` events.k8s.io events.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use dra_allocator::explain::ExplainReport;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::Api;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};

pub mod status;
pub use status::Status;

/// The event's reason (`kubectl describe pod` column Reason).
pub const REASON: &str = "CannotAllocateDevices";
/// The event's action.
pub const ACTION: &str = "ExplainPending";
/// The reason of the event on a claim (and its pods) allocated as the plugin will not prepare.
pub const REFUSED_REASON: &str = "DevicesWillNotBePrepared";
/// The reason of the event relayed from a plugin's `GPUIdle` mark on a claim, and the mark's
/// condition type (`gpu_kubelet_plugin::usage::idle_status::REASON`).
pub const IDLE_REASON: &str = "GPUIdle";
/// The action of that event.
pub const IDLE_ACTION: &str = "RelayIdle";
/// The most bytes of an event note the API server accepts.
pub const NOTE_LIMIT: usize = 1024;

/// How the controller behaves.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Explain a pending pod again after this long.
    pub resync: Duration,
    /// Publish an unchanged explanation again after this long.
    pub republish_after: Duration,
    /// Events per second over all pods.
    pub events_per_second: f64,
    /// Events allowed at once before the rate applies.
    pub burst: u32,
    /// Who reports the events.
    pub reporter: Reporter,
    /// The DRA drivers whose `GPUIdle` device-status conditions are relayed to the claims'
    /// pods ([`relay_idle`]); empty: none.
    pub idle_drivers: Vec<String>,
}

/// Why a reconcile failed (the error policy retries it).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Publishing the event failed.
    #[error("publishing the event on pod {pod}: {source}")]
    Publish {
        /// `namespace/name`.
        pod: String,
        /// The API error.
        source: kube::Error,
    },
    /// The explanation could not be computed.
    #[error("explaining pod {pod}: {reason}")]
    Explain {
        /// `namespace/name`.
        pod: String,
        /// Why.
        reason: String,
    },
}

/// A token bucket: `rate` tokens per second, at most `burst` saved.
#[derive(Debug)]
struct Bucket {
    rate: f64,
    burst: f64,
    state: tokio::sync::Mutex<(f64, tokio::time::Instant)>,
}

impl Bucket {
    fn new(rate: f64, burst: u32) -> Bucket {
        let burst = f64::from(burst.max(1));
        Bucket {
            rate: rate.max(0.001),
            burst,
            state: tokio::sync::Mutex::new((burst, tokio::time::Instant::now())),
        }
    }

    /// Waits for a token. Waiters queue on the mutex, so they are served in turn.
    async fn take(&self) {
        let mut state = self.state.lock().await;
        loop {
            let now = tokio::time::Instant::now();
            let (tokens, last) = *state;
            let tokens =
                (tokens + now.duration_since(last).as_secs_f64() * self.rate).min(self.burst);
            if tokens >= 1.0 {
                *state = (tokens - 1.0, now);
                return;
            }
            *state = (tokens, now);
            tokio::time::sleep(Duration::from_secs_f64((1.0 - tokens) / self.rate)).await;
        }
    }
}

/// What reconcile reads and remembers.
pub struct Context {
    client: Client,
    claims: Store<ResourceClaim>,
    slices: Store<ResourceSlice>,
    classes: Store<DeviceClass>,
    nodes: Store<Node>,
    settings: Settings,
    bucket: Bucket,
    /// Bumped by every change of the caches that can change an explanation.
    generation: Arc<AtomicU64>,
    /// The snapshot of the caches at a generation.
    snapshot: tokio::sync::Mutex<Option<(u64, Arc<Snapshot>)>>,
    /// Per pod UID: what its last explanation was computed from, the note, and when it was
    /// published.
    published: Mutex<HashMap<String, Published>>,
    /// What the controller did so far, and whether it is ready.
    pub status: Arc<Status>,
}

/// The cluster as the caches hold it (Nodes, DeviceClasses, ResourceSlices, allocated
/// ResourceClaims), with the allocator built from it: shared by every pod explained until the
/// caches change.
struct Cluster {
    nodes: Vec<Node>,
    classes: Vec<DeviceClass>,
    slices: Vec<ResourceSlice>,
    claims: Vec<ResourceClaim>,
}

self_cell::self_cell!(
    struct Snapshot {
        owner: Cluster,
        // The allocator's caches (mutexes) make it invariant in the lifetime.
        #[not_covariant]
        dependent: Built,
    }
);

/// The allocator for a [`Cluster`], or why it cannot be built (every pod then gets that
/// error).
type Built<'a> = Result<dra_allocator::Allocator<'a>, String>;

fn snapshot(cluster: Cluster) -> Snapshot {
    Snapshot::new(cluster, |c| {
        dra_allocator::AllocatedState::from_claims(&c.claims, true)
            .and_then(|state| {
                dra_allocator::Allocator::new(
                    dra_allocator::Features::V1_36,
                    &state,
                    &c.classes,
                    &c.slices,
                )
            })
            .map_err(|e| e.to_string())
    })
}

/// Reconciles running at once.
const CONCURRENCY: u16 = 4;

/// What was published for a pod.
#[derive(Debug, Clone)]
struct Published {
    /// The cache generation and the pod's claims' resource versions it was computed from.
    inputs: (u64, Vec<String>),
    note: String,
    at: Instant,
}

/// Runs the controller until `shutdown` resolves (or a termination signal).
///
/// # Errors
/// When a cache never fills (its watcher task ended).
pub async fn run(
    client: Client,
    settings: Settings,
    status: Arc<Status>,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) -> anyhow::Result<Arc<Context>> {
    let generation = Arc::new(AtomicU64::new(0));
    let claims = claim_cache(&client, &generation);
    let slices = cache::<ResourceSlice>(&client, &generation);
    let classes = cache::<DeviceClass>(&client, &generation);
    let nodes = node_cache(&client, &generation);
    for (what, ready) in [
        ("resourceclaims", claims.wait_until_ready().await),
        ("resourceslices", slices.wait_until_ready().await),
        ("deviceclasses", classes.wait_until_ready().await),
        ("nodes", nodes.wait_until_ready().await),
    ] {
        ready.map_err(|e| anyhow::anyhow!("the {what} cache: {e}"))?;
    }
    status.caches_ready.set(1);
    tracing::info!("caches ready");
    let bucket = Bucket::new(settings.events_per_second, settings.burst);
    let context = Arc::new(Context {
        client: client.clone(),
        claims,
        slices,
        classes,
        nodes,
        settings,
        bucket,
        generation,
        snapshot: tokio::sync::Mutex::new(None),
        published: Mutex::new(HashMap::new()),
        status,
    });
    tokio::spawn(watch_refusals(Arc::clone(&context)));
    if !context.settings.idle_drivers.is_empty() {
        tokio::spawn(relay_idle(Arc::clone(&context)));
    }
    let pods: Api<Pod> = Api::all(client);
    // Only pods not bound to a node: those are the ones a scheduler may have given up on.
    Controller::new(pods, watcher::Config::default().fields("spec.nodeName="))
        // Each explanation holds a copy of the cluster: a few at a time bound the memory.
        .with_config(kube::runtime::controller::Config::default().concurrency(CONCURRENCY))
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, Arc::clone(&context))
        .for_each(|outcome| async move {
            if let Err(e) = outcome {
                tracing::debug!(error = %e, "reconcile");
            }
        })
        .await;
    Ok(context)
}

/// What a reflector cache can hold.
trait Cached:
    Resource<DynamicType = ()>
    + Clone
    + std::fmt::Debug
    + serde::de::DeserializeOwned
    + Send
    + Sync
    + 'static
{
}

impl<K> Cached for K where
    K: Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static
{
}

/// A reflector cache of every `K`, fed by its own task; the watch events `relevant` accepts
/// bump `generation`.
fn cache_with<K: Cached>(
    client: &Client,
    generation: &Arc<AtomicU64>,
    mut relevant: impl FnMut(&watcher::Event<K>) -> bool + Send + 'static,
) -> Store<K> {
    let (reader, writer) = reflector::store();
    let generation = Arc::clone(generation);
    let stream = reflector::reflector(
        writer,
        watcher(Api::<K>::all(client.clone()), watcher::Config::default()),
    )
    .default_backoff()
    .for_each(move |event| {
        if event.as_ref().is_ok_and(&mut relevant) {
            generation.fetch_add(1, Ordering::Relaxed);
        }
        futures::future::ready(())
    });
    tokio::spawn(stream);
    reader
}

/// A cache where every change counts.
fn cache<K: Cached>(client: &Client, generation: &Arc<AtomicU64>) -> Store<K> {
    cache_with(client, generation, |_| true)
}

/// The ResourceClaim cache. Only claims that are or were allocated bump `generation`: the
/// snapshot holds allocated claims only, and pending claims come and go with every pending
/// pod (a pod's own claims are read from the cache at each explanation).
fn claim_cache(client: &Client, generation: &Arc<AtomicU64>) -> Store<ResourceClaim> {
    // Per claim UID: whether it was allocated when last seen.
    let mut seen: HashMap<String, bool> = HashMap::new();
    cache_with(
        client,
        generation,
        move |event: &watcher::Event<ResourceClaim>| match event {
            watcher::Event::Apply(c) | watcher::Event::InitApply(c) => {
                let now = dra_allocator::is_allocated(c);
                let before = seen.insert(c.uid().unwrap_or_default(), now);
                now || before == Some(true)
            }
            watcher::Event::Delete(c) => {
                seen.remove(&c.uid().unwrap_or_default()) == Some(true)
                    || dra_allocator::is_allocated(c)
            }
            // A relist: anything may have changed.
            watcher::Event::Init | watcher::Event::InitDone => true,
        },
    )
}

/// The Node cache. Only a change of name or labels (what node selectors read) bumps
/// `generation`: Nodes change status all the time, which would make every pending pod's
/// explanation look stale.
fn node_cache(client: &Client, generation: &Arc<AtomicU64>) -> Store<Node> {
    // Per node name: its labels when last seen.
    let mut seen: HashMap<String, std::collections::BTreeMap<String, String>> = HashMap::new();
    cache_with(
        client,
        generation,
        move |event: &watcher::Event<Node>| match event {
            watcher::Event::Apply(n) | watcher::Event::InitApply(n) => {
                let labels = n.metadata.labels.clone().unwrap_or_default();
                seen.insert(n.name_any(), labels.clone()) != Some(labels)
            }
            watcher::Event::Delete(n) => seen.remove(&n.name_any()).is_some(),
            watcher::Event::Init | watcher::Event::InitDone => true,
        },
    )
}

/// Whether the scheduler reported the pod unschedulable (`PodScheduled=False`,
/// reason `Unschedulable`).
pub fn unschedulable(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| {
            c.type_ == "PodScheduled"
                && c.status == "False"
                && c.reason.as_deref() == Some("Unschedulable")
        })
}

async fn reconcile(pod: Arc<Pod>, ctx: Arc<Context>) -> Result<Action, Error> {
    ctx.status.reconciles.inc();
    let uid = pod.uid().unwrap_or_default();
    let has_claims = pod
        .spec
        .as_ref()
        .and_then(|s| s.resource_claims.as_ref())
        .is_some_and(|c| !c.is_empty());
    let bound = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_ref())
        .is_some();
    if !has_claims || bound || pod.metadata.deletion_timestamp.is_some() {
        ctx.forget(&uid);
        return Ok(Action::await_change());
    }
    if !unschedulable(&pod) {
        // The scheduler has not given up (yet); its status update triggers us again.
        return Ok(Action::await_change());
    }
    let pod_ref = dra_allocator::pod::pod_ref(&pod);
    let names = match dra_allocator::pod::claim_names(&pod) {
        Ok(names) => names,
        // The resourceclaim controller has not created a claim yet.
        Err(_) => return Ok(Action::requeue(ctx.settings.resync)),
    };
    let namespace = pod.namespace().unwrap_or_default();
    let claims = ctx.claims.state();
    // Read before the caches, so a change racing with this explanation makes the next one run.
    let generation = ctx.generation.load(Ordering::Relaxed);
    let versions: Vec<String> = names
        .iter()
        .map(|n| {
            claims
                .iter()
                .find(|c| {
                    c.metadata.namespace.as_deref() == Some(namespace.as_str())
                        && c.metadata.name.as_deref() == Some(n.as_str())
                })
                .and_then(|c| c.metadata.resource_version.clone())
                .unwrap_or_default()
        })
        .collect();
    let inputs = (generation, versions);
    if ctx.unchanged(&uid, &inputs) {
        ctx.status.deduplicated.inc();
        return Ok(Action::requeue(ctx.settings.resync));
    }
    // The pod's claims, defaulted as the allocator expects.
    let mut mine = dra_allocator::Objects {
        nodes: Vec::new(),
        classes: Vec::new(),
        slices: Vec::new(),
        claims: Vec::new(),
    };
    for name in &names {
        match claims.iter().find(|c| {
            c.metadata.namespace.as_deref() == Some(namespace.as_str())
                && c.metadata.name.as_deref() == Some(name.as_str())
        }) {
            Some(c) => mine.claims.push(ResourceClaim::clone(c)),
            // A claim the pod names is not in the cache yet.
            None => return Ok(Action::requeue(ctx.settings.resync)),
        }
    }
    dra_allocator::apply_defaults(&mut mine);
    let snapshot = ctx
        .snapshot(generation)
        .await
        .map_err(|reason| Error::Explain {
            pod: pod_ref.clone(),
            reason,
        })?;
    let report = tokio::task::spawn_blocking(move || {
        let to_allocate = mine.to_allocate();
        snapshot.with_dependent(|cluster, built| match built {
            Ok(allocator) => Ok(dra_allocator::explain_with(
                allocator,
                &cluster.nodes,
                &cluster.classes,
                &to_allocate,
                &dra_allocator::Options::default(),
            )),
            Err(e) => Err(e.clone()),
        })
    })
    .await
    .map_err(|e| e.to_string())
    .and_then(|r| r)
    .map_err(|reason| Error::Explain {
        pod: pod_ref.clone(),
        reason,
    })?;
    ctx.status.explained.inc();
    if report.fitting().next().is_some() || report.nodes.is_empty() {
        // It fits now (or there are no nodes): nothing to tell; the scheduler retries.
        return Ok(Action::requeue(ctx.settings.resync));
    }
    let note = note(&report);
    if !ctx.should_publish(&uid, &note) {
        ctx.status.deduplicated.inc();
        ctx.refresh(&uid, inputs);
        return Ok(Action::requeue(ctx.settings.resync));
    }
    ctx.bucket.take().await;
    let event = Event {
        type_: EventType::Warning,
        reason: REASON.into(),
        note: Some(note.clone()),
        action: ACTION.into(),
        secondary: None,
    };
    // A recorder per event: each changed explanation is a new event (the recorder's own cache
    // would fold it into the previous one, keeping the old note).
    Recorder::new(ctx.client.clone(), ctx.settings.reporter.clone())
        .publish(&event, &pod.object_ref(&()))
        .await
        .map_err(|source| Error::Publish {
            pod: pod_ref.clone(),
            source,
        })?;
    ctx.status.published.inc();
    ctx.remember(uid, inputs, note);
    tracing::info!(pod = %pod_ref, "explained");
    Ok(Action::requeue(ctx.settings.resync))
}

/// Every `resync`, each allocated claim in the cache whose allocation the node plugin will
/// refuse at prepare ([`gpu_inventory::shares::prepare_refusal`]) gets a Warning event
/// [`REFUSED_REASON`], and so does each pod in its `status.reservedFor`: the scheduler has
/// placed them, so no Unschedulable explanation will ever name it. Once per allocation (and
/// again after `republish_after`), through the same token bucket as every event.
async fn watch_refusals(ctx: Arc<Context>) {
    loop {
        let slices = ctx.slices.state();
        // One pass over the slices per round.
        let devices = gpu_inventory::shares::devices_by_name(slices.iter().map(|s| &**s));
        for claim in ctx.claims.state() {
            let Some(results) = claim
                .status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .and_then(|a| a.devices.as_ref())
                .and_then(|d| d.results.as_deref())
            else {
                continue;
            };
            // Only a claim with two shares can be refused.
            if results.iter().filter(|r| r.share_id.is_some()).count() < 2 {
                continue;
            }
            let device = |r: &k8s_openapi::api::resource::v1::DeviceRequestAllocationResult| {
                devices
                    .get(&(r.driver.as_str(), r.pool.as_str(), r.device.as_str()))
                    .copied()
            };
            let Some(refusal) = gpu_inventory::shares::prepare_refusal(results, device) else {
                continue;
            };
            let namespace = claim.namespace().unwrap_or_default();
            let note: String = format!(
                "Claim {namespace}/{} is allocated, but {refusal}.",
                claim.name_any()
            )
            .chars()
            .take(NOTE_LIMIT)
            .collect();
            let key = format!("claim:{}", claim.uid().unwrap_or_default());
            if !ctx.should_publish(&key, &note) {
                ctx.status.deduplicated.inc();
                continue;
            }
            let mut regarding = vec![claim.object_ref(&())];
            regarding.extend(reserved_pods(&claim));
            let published = ctx
                .publish_all(&regarding, REFUSED_REASON, ACTION, &note, &key)
                .await;
            if published {
                tracing::info!(claim = %format!("{namespace}/{}", claim.name_any()), "refusal published");
                ctx.remember(key, (0, Vec::new()), note);
            }
        }
        tokio::time::sleep(ctx.settings.resync).await;
    }
}

/// The pods `claim` is reserved for, as event subjects.
fn reserved_pods(claim: &ResourceClaim) -> Vec<k8s_openapi::api::core::v1::ObjectReference> {
    let namespace = claim.namespace().unwrap_or_default();
    claim
        .status
        .iter()
        .flat_map(|s| s.reserved_for.iter().flatten())
        .filter(|r| r.resource == "pods" && r.api_group.as_deref().unwrap_or("").is_empty())
        .map(|r| k8s_openapi::api::core::v1::ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(r.name.clone()),
            namespace: Some(namespace.clone()),
            uid: Some(r.uid.clone()),
            ..Default::default()
        })
        .collect()
}

/// The `GPUIdle` condition (status `True`) of `claim`'s device-status entries of one of
/// `drivers`, if any: its message. The API server lets only the kubelet plugin of the claim's
/// node write such an entry (`DRAResourceClaimGranularStatusAuthorization`).
pub fn idle_message<'c>(claim: &'c ResourceClaim, drivers: &[String]) -> Option<&'c str> {
    claim
        .status
        .as_ref()?
        .devices
        .iter()
        .flatten()
        .filter(|d| drivers.contains(&d.driver))
        .flat_map(|d| d.conditions.iter().flatten())
        .find(|c| c.type_ == IDLE_REASON && c.status == "True")
        .map(|c| c.message.as_str())
}

/// Relays the kubelet plugins' `GPUIdle` marks on claims (a condition on the claim's device
/// status, which only the plugin of the claim's node may write) to each pod the claim is
/// reserved for, as a Warning event [`IDLE_REASON`]: the pod's `kubectl describe` tells its
/// user, while the plugins themselves write no event about a pod. Deduplicated by the mark's
/// message (it carries the idle time), every `resync`.
async fn relay_idle(ctx: Arc<Context>) {
    loop {
        for claim in ctx.claims.state() {
            let Some(message) = idle_message(&claim, &ctx.settings.idle_drivers) else {
                continue;
            };
            let note: String = message.chars().take(NOTE_LIMIT).collect();
            let key = format!("idle:{}", claim.uid().unwrap_or_default());
            if !ctx.should_publish(&key, &note) {
                ctx.status.deduplicated.inc();
                continue;
            }
            let pods = reserved_pods(&claim);
            if ctx
                .publish_all(&pods, IDLE_REASON, IDLE_ACTION, &note, &key)
                .await
            {
                ctx.remember(key, (0, Vec::new()), note);
            }
        }
        tokio::time::sleep(ctx.settings.resync).await;
    }
}

fn error_policy(pod: Arc<Pod>, error: &Error, ctx: Arc<Context>) -> Action {
    ctx.status.errors.inc();
    tracing::warn!(pod = %dra_allocator::pod::pod_ref(&pod), %error, "reconcile failed; retrying");
    Action::requeue(Duration::from_secs(15))
}

fn owned<K: Clone + Resource<DynamicType = ()> + 'static>(store: &Store<K>) -> Vec<K> {
    store.state().iter().map(|k| K::clone(k)).collect()
}

impl Context {
    /// The snapshot at `generation` (or later), built off the async workers when the caches
    /// changed since the last one.
    async fn snapshot(&self, generation: u64) -> Result<Arc<Snapshot>, String> {
        let mut current = self.snapshot.lock().await;
        if let Some((at, snapshot)) = current.as_ref()
            && *at >= generation
        {
            return Ok(Arc::clone(snapshot));
        }
        let cluster = Cluster {
            nodes: owned(&self.nodes),
            classes: owned(&self.classes),
            slices: owned(&self.slices),
            claims: self
                .claims
                .state()
                .iter()
                .filter(|c| dra_allocator::is_allocated(c))
                .map(|c| ResourceClaim::clone(c))
                .collect(),
        };
        let snapshot = tokio::task::spawn_blocking(move || {
            let mut cluster = cluster;
            let mut objects = dra_allocator::Objects {
                nodes: std::mem::take(&mut cluster.nodes),
                classes: std::mem::take(&mut cluster.classes),
                slices: std::mem::take(&mut cluster.slices),
                claims: std::mem::take(&mut cluster.claims),
            };
            dra_allocator::apply_defaults(&mut objects);
            Arc::new(snapshot(Cluster {
                nodes: objects.nodes,
                classes: objects.classes,
                slices: objects.slices,
                claims: objects.claims,
            }))
        })
        .await
        .map_err(|e| e.to_string())?;
        *current = Some((generation, Arc::clone(&snapshot)));
        Ok(snapshot)
    }

    fn published(&self) -> std::sync::MutexGuard<'_, HashMap<String, Published>> {
        self.published
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the pod's last explanation was computed from these inputs and is not due for
    /// publishing again.
    fn unchanged(&self, uid: &str, inputs: &(u64, Vec<String>)) -> bool {
        self.published()
            .get(uid)
            .is_some_and(|p| &p.inputs == inputs && p.at.elapsed() < self.settings.republish_after)
    }

    /// Publishes one Warning event (`reason`, `action`, `note`) about each of `objects`, each
    /// through the token bucket; whether all went out (failures are logged under `key`).
    async fn publish_all(
        &self,
        objects: &[k8s_openapi::api::core::v1::ObjectReference],
        reason: &str,
        action: &str,
        note: &str,
        key: &str,
    ) -> bool {
        let mut published = true;
        for object in objects {
            self.bucket.take().await;
            let event = Event {
                type_: EventType::Warning,
                reason: reason.into(),
                note: Some(note.to_owned()),
                action: action.into(),
                secondary: None,
            };
            match Recorder::new(self.client.clone(), self.settings.reporter.clone())
                .publish(&event, object)
                .await
            {
                Ok(()) => {
                    self.status.published.inc();
                }
                Err(e) => {
                    published = false;
                    self.status.errors.inc();
                    tracing::warn!(key, error = %e, reason, "publishing an event failed; retrying");
                }
            }
        }
        published
    }

    fn should_publish(&self, uid: &str, note: &str) -> bool {
        !self
            .published()
            .get(uid)
            .is_some_and(|p| p.note == note && p.at.elapsed() < self.settings.republish_after)
    }

    /// The same note from new inputs: remember the inputs, keep the publication time.
    fn refresh(&self, uid: &str, inputs: (u64, Vec<String>)) {
        if let Some(p) = self.published().get_mut(uid) {
            p.inputs = inputs;
        }
    }

    fn remember(&self, uid: String, inputs: (u64, Vec<String>), note: String) {
        let mut published = self.published();
        // Pods deleted while pending leave entries: drop those not refreshed for a while.
        let horizon = self.settings.republish_after.saturating_mul(2);
        published.retain(|_, p| p.at.elapsed() < horizon);
        published.insert(
            uid,
            Published {
                inputs,
                note,
                at: Instant::now(),
            },
        );
    }

    fn forget(&self, uid: &str) {
        self.published().remove(uid);
    }
}

/// The event note: the verdict and each group of nodes with its reason, cut to
/// [`NOTE_LIMIT`] bytes.
pub fn note(report: &ExplainReport) -> String {
    let total = report.nodes.len();
    let mut note = format!(
        "DRA claims fit on none of {total} node{} (dractl explain pod for details).",
        if total == 1 { "" } else { "s" }
    );
    for group in report.groups() {
        let Some(reason) = group.reason else {
            continue;
        };
        let mut names: Vec<&str> = group.nodes.iter().take(3).copied().collect();
        if group.nodes.len() > 3 {
            names.push("...");
        }
        note.push_str(&format!(
            " {} node{} ({}): {}{reason}.",
            group.nodes.len(),
            if group.nodes.len() == 1 { "" } else { "s" },
            names.join(", "),
            if group.error { "error: " } else { "" },
        ));
    }
    if note.len() > NOTE_LIMIT {
        let mut end = NOTE_LIMIT - 3;
        while !note.is_char_boundary(end) {
            end -= 1;
        }
        note.truncate(end);
        note.push_str("...");
    }
    note
}

#[cfg(test)]
mod tests {
    use super::*;
    use dra_allocator::explain::NodeExplanation;

    fn pending(name: &str, reason: &str) -> NodeExplanation {
        NodeExplanation {
            name: name.into(),
            fits: false,
            claims: Vec::new(),
            reason: Some(reason.into()),
            explanation: None,
            error: None,
        }
    }

    #[test]
    fn the_note_groups_nodes_by_reason_and_fits_the_api_limit() {
        let report = ExplainReport {
            nodes: vec![
                pending("a", "claim ns/c, request gpu: too few"),
                pending("b", "claim ns/c, request gpu: too few"),
                pending("c", "claim ns/c, request gpu: in use"),
            ],
        };
        assert_eq!(
            note(&report),
            "DRA claims fit on none of 3 nodes (dractl explain pod for details). 2 nodes (a, b): claim ns/c, request gpu: too few. 1 node (c): claim ns/c, request gpu: in use."
        );
        // Long reasons with multi-byte characters are cut at a character boundary.
        let long = ExplainReport {
            nodes: (0..40)
                .map(|i| {
                    pending(
                        &format!("node-{i}"),
                        &format!("reason {i} – {}", "é".repeat(40)),
                    )
                })
                .collect(),
        };
        let cut = note(&long);
        assert!(cut.len() <= NOTE_LIMIT, "{}", cut.len());
        assert!(cut.ends_with("..."));
    }

    #[tokio::test(start_paused = true)]
    async fn the_bucket_lets_a_burst_through_then_paces() {
        let bucket = Bucket::new(2.0, 3);
        let start = tokio::time::Instant::now();
        for _ in 0..3 {
            bucket.take().await;
        }
        assert_eq!(start.elapsed(), Duration::ZERO);
        for _ in 0..4 {
            bucket.take().await;
        }
        // Four more at two per second.
        let waited = start.elapsed().as_secs_f64();
        assert!((1.9..2.2).contains(&waited), "{waited}");
    }
}
