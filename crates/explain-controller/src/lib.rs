//! The explain controller: for every pod the scheduler marked Unschedulable that has DRA claims,
//! why its claims fit on no node ([`dra_allocator::explain`]), recorded as a Warning event on the
//! pod, where `kubectl describe pod` shows it.
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

/// The event's reason (`kubectl describe pod` column Reason).
pub const REASON: &str = "CannotAllocateDevices";
/// The event's action.
pub const ACTION: &str = "ExplainPending";
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
}

/// Counters of what the controller did.
#[derive(Debug, Default)]
pub struct Counters {
    /// Reconcile calls.
    pub reconciles: AtomicU64,
    /// Explanations computed.
    pub explained: AtomicU64,
    /// Events created.
    pub published: AtomicU64,
    /// Explanations not published because they were published already.
    pub deduplicated: AtomicU64,
    /// Reconcile errors.
    pub errors: AtomicU64,
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
    /// Per pod UID: the note last published and when.
    published: Mutex<HashMap<String, (String, Instant)>>,
    /// What the controller did so far.
    pub counters: Counters,
}

/// Runs the controller until `shutdown` resolves (or a termination signal).
///
/// # Errors
/// When a cache never fills (its watcher task ended).
pub async fn run(
    client: Client,
    settings: Settings,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) -> anyhow::Result<Arc<Context>> {
    let claims = cache::<ResourceClaim>(&client);
    let slices = cache::<ResourceSlice>(&client);
    let classes = cache::<DeviceClass>(&client);
    let nodes = cache::<Node>(&client);
    for (what, ready) in [
        ("resourceclaims", claims.wait_until_ready().await),
        ("resourceslices", slices.wait_until_ready().await),
        ("deviceclasses", classes.wait_until_ready().await),
        ("nodes", nodes.wait_until_ready().await),
    ] {
        ready.map_err(|e| anyhow::anyhow!("the {what} cache: {e}"))?;
    }
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
        published: Mutex::new(HashMap::new()),
        counters: Counters::default(),
    });
    let pods: Api<Pod> = Api::all(client);
    // Only pods not bound to a node: those are the ones a scheduler may have given up on.
    Controller::new(pods, watcher::Config::default().fields("spec.nodeName="))
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

/// A reflector cache of every `K`, fed by its own task.
fn cache<K>(client: &Client) -> Store<K>
where
    K: Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let (reader, writer) = reflector::store();
    let stream = reflector::reflector(
        writer,
        watcher(Api::<K>::all(client.clone()), watcher::Config::default()),
    )
    .default_backoff()
    .for_each(|_| futures::future::ready(()));
    tokio::spawn(stream);
    reader
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
    ctx.counters.reconciles.fetch_add(1, Ordering::Relaxed);
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
    let objects = dra_allocator::pod::objects_for_claims(
        &pod_ref,
        &namespace,
        &names,
        claims.iter().map(Arc::as_ref),
        owned(&ctx.nodes),
        owned(&ctx.classes),
        owned(&ctx.slices),
    );
    let objects = match objects {
        Ok(o) => o,
        // A claim the pod names is not in the cache yet.
        Err(_) => return Ok(Action::requeue(ctx.settings.resync)),
    };
    let report = tokio::task::spawn_blocking(move || {
        dra_allocator::explain(&objects, &dra_allocator::Options::default())
    })
    .await
    .map_err(|e| Error::Explain {
        pod: pod_ref.clone(),
        reason: e.to_string(),
    })?;
    ctx.counters.explained.fetch_add(1, Ordering::Relaxed);
    if report.fitting().next().is_some() || report.nodes.is_empty() {
        // It fits now (or there are no nodes): nothing to tell; the scheduler retries.
        return Ok(Action::requeue(ctx.settings.resync));
    }
    let note = note(&report);
    if !ctx.should_publish(&uid, &note) {
        ctx.counters.deduplicated.fetch_add(1, Ordering::Relaxed);
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
    ctx.counters.published.fetch_add(1, Ordering::Relaxed);
    ctx.remember(uid, note);
    tracing::info!(pod = %pod_ref, "explained");
    Ok(Action::requeue(ctx.settings.resync))
}

fn error_policy(pod: Arc<Pod>, error: &Error, ctx: Arc<Context>) -> Action {
    ctx.counters.errors.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(pod = %dra_allocator::pod::pod_ref(&pod), %error, "reconcile failed; retrying");
    Action::requeue(Duration::from_secs(15))
}

fn owned<K: Clone + Resource<DynamicType = ()> + 'static>(store: &Store<K>) -> Vec<K> {
    store.state().iter().map(|k| K::clone(k)).collect()
}

impl Context {
    fn should_publish(&self, uid: &str, note: &str) -> bool {
        let published = self
            .published
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        !published
            .get(uid)
            .is_some_and(|(last, at)| last == note && at.elapsed() < self.settings.republish_after)
    }

    fn remember(&self, uid: String, note: String) {
        let mut published = self
            .published
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Pods deleted while pending leave entries: drop those not refreshed for a while.
        let horizon = self.settings.republish_after.saturating_mul(2);
        published.retain(|_, (_, at)| at.elapsed() < horizon);
        published.insert(uid, (note, Instant::now()));
    }

    fn forget(&self, uid: &str) {
        self.published
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(uid);
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
