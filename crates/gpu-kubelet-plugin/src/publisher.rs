//! Publishing this node's pool as ResourceSlices.
//!
//! Slices are created with a `generateName` as upstream's resourceslice controller names them
//! ([`gpu_inventory::slices::slice_name_prefix`]), so any node name fits, and updated in place
//! by a full replace (PUT with the read `resourceVersion`): every field we no longer want goes,
//! and a concurrent writer makes the write fail and the publish retry instead of being
//! overwritten. Slices of earlier versions (named `<node>-<driver>-<i>`) are updated in place too.
//!
//! Generation rule (KEP-4381, k8s.io/api/resource/v1 `ResourcePool.generation`): the scheduler
//! only trusts slices of a pool's highest generation, so when content changes every slice is
//! re-applied with `generation + 1` and slices no longer needed are deleted. When the desired
//! slices equal what the API server holds, nothing is written. Before anything is written the
//! desired slices are checked against the API server's rules ([`gpu_inventory::validate`]), so a
//! pool the server would reject (or accept only in part) is never half-published.
//!
//! Device taints (from [`crate::health`]) are part of what is published: the publisher keeps the
//! wanted pool and the wanted taints, and every publish, whoever triggers it (start-up,
//! re-discovery, a health change), writes the pool with the latest taints applied. Publishes are
//! serialized and each reads the wanted state only once it holds the lock, so the last one to
//! finish always wrote the latest state. Health changes are republished by
//! [`spawn_taint_publisher`], which retries failed writes with exponential backoff ([`Backoff`]).

use std::collections::BTreeMap;
use std::fmt::Display;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpu_inventory::Pool;
use gpu_inventory::slices::pool_slices;
use gpu_inventory::validate::{InvalidSlice, validate_pool};
use k8s_openapi::Resource;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{Device, DeviceTaint, ResourceSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::health::{GpuHealthMap, apply_taints, taints};

/// What a publish did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PublishOutcome {
    /// The API server already held exactly these slices.
    Unchanged {
        /// The pool generation in place.
        generation: i64,
    },
    /// Slices were applied (and stale ones deleted) at a new generation.
    Applied {
        /// The new pool generation.
        generation: i64,
        /// Slices applied.
        applied: usize,
        /// Stale slices deleted.
        deleted: usize,
    },
}

/// Publishing failed.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The Node object could not be read (it owns our slices).
    #[error("reading Node {node}: {source}")]
    GetNode {
        /// The node.
        node: String,
        /// The cause.
        source: kube::Error,
    },
    /// Listing our existing slices failed.
    #[error("listing ResourceSlices of driver {driver} on node {node}: {source}")]
    List {
        /// The driver.
        driver: String,
        /// The node.
        node: String,
        /// The cause.
        source: kube::Error,
    },
    /// Creating or replacing a slice failed.
    #[error("writing ResourceSlice {name}: {source}")]
    Apply {
        /// The slice.
        name: String,
        /// The cause.
        source: kube::Error,
    },
    /// The desired slices break an API rule; nothing was written.
    #[error("refusing to publish an invalid pool: {0}")]
    Invalid(#[from] InvalidSlice),
    /// Deleting a stale slice failed.
    #[error("deleting stale ResourceSlice {name}: {source}")]
    Delete {
        /// The slice.
        name: String,
        /// The cause.
        source: kube::Error,
    },
}

/// Publishes one node's pool for one driver. Clones share the wanted state and the write lock.
#[derive(Clone)]
pub struct SlicePublisher {
    client: Client,
    driver: String,
    node: String,
    shared: Arc<Shared>,
}

/// What every clone of a publisher shares.
struct Shared {
    /// Held for a whole publish, so publishes never interleave; what the last write stored.
    write: tokio::sync::Mutex<Stored>,
    /// The pool last handed to [`SlicePublisher::publish_pool`], without taints.
    wanted: watch::Sender<Pool>,
    /// Our taints by physical GPU UUID.
    taints: Mutex<BTreeMap<String, DeviceTaint>>,
}

impl SlicePublisher {
    /// A publisher for `driver`'s pool on `node` (pool name = node name).
    pub fn new(client: Client, driver: &str, node: &str) -> Self {
        Self {
            client,
            driver: driver.to_owned(),
            node: node.to_owned(),
            shared: Arc::new(Shared {
                write: tokio::sync::Mutex::new(Stored::default()),
                wanted: watch::Sender::new(Pool::default()),
                taints: Mutex::new(BTreeMap::new()),
            }),
        }
    }

    /// Follows the wanted pool (untainted), as last handed to [`SlicePublisher::publish_pool`].
    pub fn wanted_pool(&self) -> watch::Receiver<Pool> {
        self.shared.wanted.subscribe()
    }

    /// Sets the taints every later publish applies, by physical GPU UUID (see
    /// [`crate::health::apply_taints`]); returns whether they changed.
    pub fn set_taints(&self, taints: BTreeMap<String, DeviceTaint>) -> bool {
        let mut current = self
            .shared
            .taints
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let changed = *current != taints;
        *current = taints;
        changed
    }

    /// Publishes the wanted pool with the current taints.
    ///
    /// # Errors
    /// As [`SlicePublisher::publish_pool`].
    pub async fn republish(&self) -> Result<PublishOutcome, PublishError> {
        let mut stored = self.shared.write.lock().await;
        let pool = {
            let taints = self
                .shared
                .taints
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            apply_taints(&self.driver, &self.shared.wanted.borrow(), &taints)
        };
        self.write_pool(&pool, &mut stored).await
    }

    /// The field manager of our writes.
    pub fn field_manager(&self) -> String {
        format!("{}/kubelet-plugin", self.driver)
    }

    /// Makes the API server hold exactly `devices` (no counter sets) in this node's pool.
    ///
    /// # Errors
    /// [`PublishError`] naming the object whose read or write failed.
    pub async fn publish(&self, devices: &[Device]) -> Result<PublishOutcome, PublishError> {
        self.publish_pool(&Pool::from(devices.to_vec())).await
    }

    /// Makes `pool` (devices and counter sets) the wanted pool and makes the API server hold it,
    /// with the current taints applied, split into slices as [`pool_slices`] lays them out.
    ///
    /// # Errors
    /// [`PublishError::Invalid`] before any write when a slice would break an API rule;
    /// otherwise [`PublishError`] naming the object whose read or write failed.
    pub async fn publish_pool(&self, pool: &Pool) -> Result<PublishOutcome, PublishError> {
        self.shared.wanted.send_replace(pool.clone());
        self.republish().await
    }

    /// Writes exactly `pool`; the caller holds the write lock, whose [`Stored`] this updates.
    async fn write_pool(
        &self,
        pool: &Pool,
        stored: &mut Stored,
    ) -> Result<PublishOutcome, PublishError> {
        validate_pool(&pool_slices(&self.driver, &self.node, 1, pool))?;
        let node = Api::<Node>::all(self.client.clone())
            .get(&self.node)
            .await
            .map_err(|source| PublishError::GetNode {
                node: self.node.clone(),
                source,
            })?;
        let owner = OwnerReference {
            api_version: Node::API_VERSION.to_owned(),
            kind: Node::KIND.to_owned(),
            name: self.node.clone(),
            uid: node.metadata.uid.unwrap_or_default(),
            controller: Some(true),
            ..Default::default()
        };

        let api = Api::<ResourceSlice>::all(self.client.clone());
        let mut existing = api
            .list(&ListParams::default().fields(&format!(
                "spec.nodeName={},spec.driver={}",
                self.node, self.driver
            )))
            .await
            .map_err(|source| PublishError::List {
                driver: self.driver.clone(),
                node: self.node.clone(),
                source,
            })?
            .items;
        existing.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        let current = existing
            .iter()
            .filter(|s| s.spec.pool.name == self.node)
            .map(|s| s.spec.pool.generation)
            .max();

        let desired = |generation| {
            let mut slices = pool_slices(&self.driver, &self.node, generation, pool);
            for s in &mut slices {
                s.metadata.owner_references = Some(vec![owner.clone()]);
            }
            slices
        };
        if let Some(generation) = current {
            let wanted = desired(generation);
            if same_slices(&existing, &wanted) || stored.holds(&wanted, &existing) {
                return Ok(PublishOutcome::Unchanged { generation });
            }
        }

        let generation = current.map_or(1, |g| g + 1);
        let slices = desired(generation);
        let params = PostParams {
            field_manager: Some(self.field_manager()),
            ..Default::default()
        };
        // Slice i replaces the i-th existing one (by name), or is created; the rest are stale.
        let mut kept = Vec::with_capacity(slices.len());
        for (i, s) in slices.iter().enumerate() {
            let written = match existing.get(i) {
                Some(old) => {
                    let name = old.metadata.name.clone().unwrap_or_default();
                    let mut new = s.clone();
                    new.metadata.name = Some(name.clone());
                    new.metadata.generate_name = None;
                    new.metadata.resource_version = old.metadata.resource_version.clone();
                    api.replace(&name, &params, &new)
                        .await
                        .map_err(|source| (name, source))
                }
                None => api.create(&params, s).await.map_err(|source| {
                    (s.metadata.generate_name.clone().unwrap_or_default(), source)
                }),
            };
            kept.push(written.map_err(|(name, source)| PublishError::Apply { name, source })?);
        }
        stored.remember(&slices, &kept);
        let mut deleted = 0;
        for stale in existing
            .iter()
            .skip(slices.len())
            .filter_map(|s| s.metadata.name.as_deref())
        {
            match api.delete(stale, &DeleteParams::default()).await {
                Ok(_) => deleted += 1,
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(source) => {
                    return Err(PublishError::Delete {
                        name: stale.to_owned(),
                        source,
                    });
                }
            }
        }
        info!(node = %self.node, generation, slices = slices.len(), deleted, "published ResourceSlices");
        Ok(PublishOutcome::Applied {
            generation,
            applied: slices.len(),
            deleted,
        })
    }
}

/// What the API server kept of our last write. A server with a DRA feature gate off drops that
/// gate's fields (device taints, counters, binding conditions, ...) from what it stores, so its
/// slices never equal ours; comparing with what it kept of the same wanted slices stops a new
/// generation being written every rediscovery interval. The first such drop is logged once per
/// set of fields.
#[derive(Default)]
pub(crate) struct Stored {
    /// The specs and owners last written (generation zeroed), and what the server stored.
    last: Option<(Vec<SliceContent>, Vec<SliceContent>)>,
    /// Dropped-field sets already logged.
    warned: std::collections::BTreeSet<Vec<String>>,
}

/// What a comparison looks at: the spec (pool generation zeroed) and the owners.
type SliceContent = (
    k8s_openapi::api::resource::v1::ResourceSliceSpec,
    Option<Vec<OwnerReference>>,
);

fn content(slices: &[ResourceSlice]) -> Vec<SliceContent> {
    slices
        .iter()
        .map(|s| {
            let mut spec = s.spec.clone();
            spec.pool.generation = 0;
            (spec, s.metadata.owner_references.clone())
        })
        .collect()
}

impl Stored {
    /// Whether the server holds exactly what it kept when `wanted` was last written.
    fn holds(&self, wanted: &[ResourceSlice], existing: &[ResourceSlice]) -> bool {
        self.last.as_ref().is_some_and(|(written, kept)| {
            *written == content(wanted) && same_multiset(content(existing), kept)
        })
    }

    /// Records a write and what the server returned for it; logs fields it dropped.
    fn remember(&mut self, written: &[ResourceSlice], returned: &[ResourceSlice]) {
        let mut dropped = Vec::new();
        for (w, r) in written.iter().zip(returned) {
            if let (Ok(w), Ok(r)) = (serde_json::to_value(&w.spec), serde_json::to_value(&r.spec)) {
                dropped_fields("spec", &w, &r, &mut dropped);
            }
        }
        dropped.sort();
        dropped.dedup();
        if !dropped.is_empty() && self.warned.insert(dropped.clone()) {
            warn!(fields = ?dropped,
                "the API server dropped fields of our ResourceSlices (a DRA feature gate is off?); \
                 publishing what it keeps, not republishing for them");
        }
        self.last = Some((content(written), content(returned)));
    }
}

/// Paths (`spec.devices[].consumesCounters`) present in `written` but not in `stored`.
fn dropped_fields(
    path: &str,
    written: &serde_json::Value,
    stored: &serde_json::Value,
    out: &mut Vec<String>,
) {
    use serde_json::Value;
    match (written, stored) {
        (Value::Object(w), Value::Object(s)) => {
            for (k, v) in w {
                let at = format!("{path}.{k}");
                match s.get(k) {
                    None if !v.is_null() => out.push(at),
                    Some(sv) => dropped_fields(&at, v, sv, out),
                    None => {}
                }
            }
        }
        (Value::Array(w), Value::Array(s)) => {
            for (v, sv) in w.iter().zip(s) {
                dropped_fields(&format!("{path}[]"), v, sv, out);
            }
        }
        _ => {}
    }
}

/// Whether the server's slices are exactly the desired ones: as many, and each desired slice's
/// spec and owner held by a distinct existing slice (names differ: the server chose them).
fn same_slices(existing: &[ResourceSlice], desired: &[ResourceSlice]) -> bool {
    let with_owner = |s: &ResourceSlice| (s.spec.clone(), s.metadata.owner_references.clone());
    let desired: Vec<SliceContent> = desired.iter().map(with_owner).collect();
    same_multiset(existing.iter().map(with_owner).collect(), &desired)
}

/// Whether `a` and `b` hold the same items, as many times each, in any order.
fn same_multiset<T: PartialEq>(mut a: Vec<T>, b: &[T]) -> bool {
    a.len() == b.len()
        && b.iter().all(|x| {
            a.iter()
                .position(|y| y == x)
                .map(|i| a.swap_remove(i))
                .is_some()
        })
}

/// Re-discovery: every `interval`, and at once whenever `wake` is notified (the fabric watch,
/// [`crate::fabric::watch`], does when a GPU's fabric answer changed), calls `discover` (on a
/// blocking thread; NVML calls block) and republishes when the pool differs from the last one
/// published. Publishing compares with the API server too, so a slice edited or deleted behind
/// our back is restored at the next tick, and an unchanged pool writes nothing. Failures are
/// logged and retried at the next tick. Abort the returned task to stop.
pub fn spawn_rediscovery<E, F>(
    publisher: SlicePublisher,
    interval: std::time::Duration,
    wake: Arc<tokio::sync::Notify>,
    published: Pool,
    discover: F,
) -> tokio::task::JoinHandle<()>
where
    E: std::fmt::Display + Send + 'static,
    F: Fn() -> Result<Pool, E> + Send + Sync + 'static,
{
    tokio::spawn(rediscovery(
        interval,
        wake,
        published,
        discover,
        move |pool| {
            let publisher = publisher.clone();
            async move { publisher.publish_pool(&pool).await }
        },
    ))
}

/// The loop of [`spawn_rediscovery`], with the publish as a function (`publish`), so that it
/// can be driven without an API server.
pub async fn rediscovery<E, F, P, Fut, PE>(
    interval: std::time::Duration,
    wake: Arc<tokio::sync::Notify>,
    published: Pool,
    discover: F,
    mut publish: P,
) where
    E: std::fmt::Display + Send + 'static,
    F: Fn() -> Result<Pool, E> + Send + Sync + 'static,
    P: FnMut(Pool) -> Fut,
    Fut: Future<Output = Result<PublishOutcome, PE>>,
    PE: Display,
{
    let discover = Arc::new(discover);
    let mut last = published;
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = wake.notified() => {}
        }
        let d = Arc::clone(&discover);
        let pool = match tokio::task::spawn_blocking(move || d()).await {
            Ok(Ok(pool)) => pool,
            Ok(Err(e)) => {
                warn!(error = %e, "re-discovering GPUs failed; keeping the published pool");
                continue;
            }
            Err(e) => {
                warn!(error = %e, "re-discovery task failed");
                continue;
            }
        };
        if pool != last {
            info!(
                devices = pool.devices.len(),
                counter_sets = pool.counter_sets.len(),
                "GPU inventory changed"
            );
        }
        match publish(pool.clone()).await {
            Ok(PublishOutcome::Unchanged { .. }) => {}
            Ok(outcome) => info!(?outcome, "republished ResourceSlices"),
            Err(e) => {
                warn!(error = %e, "republishing ResourceSlices failed; retrying next tick");
                continue;
            }
        }
        last = pool;
    }
}

/// Exponential backoff: `initial`, doubling up to `max`; [`Backoff::reset`] after a success.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    /// Starts at `initial`, doubling up to `max`.
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            next: initial,
        }
    }

    /// The delay before the next retry; each call doubles the following one, up to `max`.
    pub fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        d
    }

    /// Back to `initial`.
    pub fn reset(&mut self) {
        self.next = self.initial;
    }
}

impl Default for Backoff {
    /// 200 ms doubling to 30 s.
    fn default() -> Self {
        Self::new(Duration::from_millis(200), Duration::from_secs(30))
    }
}

/// Publishes the latest value of `wanted` with `publish`: once at start, then on every change;
/// a failure is retried after the [`Backoff`] delay, or at once when a newer value arrives (the
/// latest wanted state wins; intermediate values may be skipped, never reordered). Returns when
/// the sender is gone.
pub async fn publish_latest<S, F, Fut, E>(
    mut wanted: watch::Receiver<S>,
    mut backoff: Backoff,
    mut publish: F,
) where
    S: Clone,
    F: FnMut(S) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: Display,
{
    wanted.mark_changed();
    let mut retry: Option<tokio::time::Instant> = None;
    loop {
        let retry_at = retry;
        tokio::select! {
            changed = wanted.changed() => if changed.is_err() { return },
            () = async {
                match retry_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            } => {}
        }
        let state = wanted.borrow_and_update().clone();
        match publish(state).await {
            Ok(()) => {
                backoff.reset();
                retry = None;
            }
            Err(e) => {
                let delay = backoff.next_delay();
                warn!(error = %e, retry_in = ?delay, "publishing device taints failed; retrying");
                retry = Some(tokio::time::Instant::now() + delay);
            }
        }
    }
}

/// Republishes the pool whenever GPU health changes, with the taints of `health` applied
/// ([`publish_latest`] with the default [`Backoff`]). Abort the returned task to stop.
pub fn spawn_taint_publisher(
    publisher: SlicePublisher,
    health: watch::Receiver<GpuHealthMap>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(publish_latest(health, Backoff::default(), move |gpus| {
        let publisher = publisher.clone();
        async move {
            let wanted = taints(&publisher.driver, &gpus);
            publisher.set_taints(wanted);
            match publisher.republish().await {
                Ok(outcome) => {
                    info!(?outcome, "published device taints");
                    Ok(())
                }
                Err(e) => Err(e),
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_wake_rediscovers_and_publishes_at_once_without_waiting_for_the_interval() {
        let wake = Arc::new(tokio::sync::Notify::new());
        let discovered = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let (tx, mut published) = tokio::sync::mpsc::unbounded_channel::<Pool>();
        let task = {
            let discovered = Arc::clone(&discovered);
            tokio::spawn(rediscovery(
                Duration::from_secs(3600),
                Arc::clone(&wake),
                Pool::default(),
                move || {
                    let n = discovered.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                    Ok::<_, String>(Pool::from(vec![Device {
                        name: format!("gpu-{n}"),
                        ..Default::default()
                    }]))
                },
                move |pool| {
                    let tx = tx.clone();
                    async move {
                        tx.send(pool).map_err(|e| e.to_string())?;
                        Ok::<_, String>(PublishOutcome::Unchanged { generation: 1 })
                    }
                },
            ))
        };
        // Nothing before a wake: the interval is an hour away.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(discovered.load(std::sync::atomic::Ordering::SeqCst), 0);
        for n in 1..=2 {
            wake.notify_one();
            let pool = tokio::time::timeout(Duration::from_secs(10), published.recv())
                .await
                .expect("published after the wake")
                .expect("loop alive");
            assert_eq!(pool.devices[0].name, format!("gpu-{n}"));
        }
        task.abort();
    }

    #[test]
    fn backoff_doubles_up_to_its_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(500));
        let delays: Vec<_> = (0..5).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(delays, [100, 200, 400, 500, 500]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(100));
    }

    #[tokio::test]
    async fn failed_publishes_are_retried_and_the_latest_state_wins() {
        let attempts = Arc::new(Mutex::new(Vec::<u32>::new()));
        let (tx, rx) = watch::channel(1u32);
        let task = {
            let attempts = Arc::clone(&attempts);
            tokio::spawn(publish_latest(
                rx,
                Backoff::new(Duration::from_millis(5), Duration::from_millis(20)),
                move |state| {
                    let attempts = Arc::clone(&attempts);
                    async move {
                        let mut a = attempts.lock().unwrap();
                        a.push(state);
                        // The API server refuses the first three writes.
                        if a.len() <= 3 {
                            Err(format!("API server unavailable (attempt {})", a.len()))
                        } else {
                            Ok(())
                        }
                    }
                },
            ))
        };
        // A newer state arrives once the first has failed.
        tokio::time::timeout(Duration::from_secs(10), async {
            while attempts.lock().unwrap().is_empty() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("first attempt");
        tx.send_replace(2);
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if attempts.lock().unwrap().len() >= 4 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("retried until success");
        let seen = attempts.lock().unwrap().clone();
        assert_eq!(seen.first(), Some(&1), "{seen:?}");
        assert_eq!(
            seen.last(),
            Some(&2),
            "the last (successful) write is the latest state: {seen:?}"
        );
        // After the success nothing more is written until the state changes again.
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(attempts.lock().unwrap().len(), 4);
        tx.send_replace(3);
        tokio::time::timeout(Duration::from_secs(10), async {
            while attempts.lock().unwrap().last() != Some(&3) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the next change is published");
        drop(tx);
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("ends when the sender is gone")
            .expect("no panic");
    }
}
