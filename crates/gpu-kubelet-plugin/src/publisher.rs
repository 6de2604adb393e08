//! Publishing this node's pool as ResourceSlices with server-side apply.
//!
//! Generation rule (KEP-4381, k8s.io/api/resource/v1 `ResourcePool.generation`): the scheduler
//! only trusts slices of a pool's highest generation, so when content changes every slice is
//! re-applied with `generation + 1` and slices no longer needed are deleted. When the desired
//! slices equal what the API server holds, nothing is written. Before anything is written the
//! desired slices are checked against the API server's rules ([`gpu_inventory::validate`]), so a
//! pool the server would reject (or accept only in part) is never half-published.

use gpu_inventory::Pool;
use gpu_inventory::slices::{NODE_LABEL, pool_slices};
use gpu_inventory::validate::{InvalidSlice, validate_pool};
use k8s_openapi::Resource;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{Device, ResourceSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::{Api, Client};
use tracing::{info, warn};

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
    /// Applying a slice failed.
    #[error("applying ResourceSlice {name}: {source}")]
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

/// Publishes one node's pool for one driver.
#[derive(Clone)]
pub struct SlicePublisher {
    client: Client,
    driver: String,
    node: String,
}

impl SlicePublisher {
    /// A publisher for `driver`'s pool on `node` (pool name = node name).
    pub fn new(client: Client, driver: &str, node: &str) -> Self {
        Self {
            client,
            driver: driver.to_owned(),
            node: node.to_owned(),
        }
    }

    /// The field manager of our server-side applies.
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

    /// Makes the API server hold exactly `pool` (devices and counter sets) as this node's pool,
    /// split into slices as [`pool_slices`] lays them out.
    ///
    /// # Errors
    /// [`PublishError::Invalid`] before any write when a slice would break an API rule;
    /// otherwise [`PublishError`] naming the object whose read or write failed.
    pub async fn publish_pool(&self, pool: &Pool) -> Result<PublishOutcome, PublishError> {
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
        let existing = api
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
        if let Some(generation) = current
            && same_slices(&existing, &desired(generation))
        {
            return Ok(PublishOutcome::Unchanged { generation });
        }

        let generation = current.map_or(1, |g| g + 1);
        let slices = desired(generation);
        let params = PatchParams::apply(&self.field_manager()).force();
        for s in &slices {
            let name = s.metadata.name.clone().unwrap_or_default();
            api.patch(&name, &params, &Patch::Apply(s))
                .await
                .map_err(|source| PublishError::Apply {
                    name: name.clone(),
                    source,
                })?;
        }
        let mut deleted = 0;
        for stale in existing
            .iter()
            .filter_map(|s| s.metadata.name.as_deref())
            .filter(|n| {
                !slices
                    .iter()
                    .any(|s| s.metadata.name.as_deref() == Some(*n))
            })
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

/// Whether the server's slices are exactly the desired ones (by name, spec, owner and label).
fn same_slices(existing: &[ResourceSlice], desired: &[ResourceSlice]) -> bool {
    existing.len() == desired.len()
        && desired.iter().all(|d| {
            existing.iter().any(|e| {
                e.metadata.name == d.metadata.name
                    && e.spec == d.spec
                    && e.metadata.owner_references == d.metadata.owner_references
                    && e.metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get(NODE_LABEL))
                        .is_some_and(|n| *n == d.spec.node_name.clone().unwrap_or_default())
            })
        })
}

/// Re-discovery: every `interval`, calls `discover` (on a blocking thread; NVML calls block) and
/// republishes when the pool differs from the last one published. Publishing compares with the
/// API server too, so a slice edited or deleted behind our back is restored at the next tick,
/// and an unchanged pool writes nothing. Failures are logged and retried at the next tick.
/// Abort the returned task to stop.
pub fn spawn_rediscovery<E, F>(
    publisher: SlicePublisher,
    interval: std::time::Duration,
    published: Pool,
    discover: F,
) -> tokio::task::JoinHandle<()>
where
    E: std::fmt::Display + Send + 'static,
    F: Fn() -> Result<Pool, E> + Send + Sync + 'static,
{
    let discover = std::sync::Arc::new(discover);
    tokio::spawn(async move {
        let mut last = published;
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let d = std::sync::Arc::clone(&discover);
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
            match publisher.publish_pool(&pool).await {
                Ok(PublishOutcome::Unchanged { .. }) => {}
                Ok(outcome) => info!(?outcome, "republished ResourceSlices"),
                Err(e) => {
                    warn!(error = %e, "republishing ResourceSlices failed; retrying next tick");
                    continue;
                }
            }
            last = pool;
        }
    })
}
