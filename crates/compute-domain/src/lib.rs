//! The ComputeDomain controller: per ComputeDomain, the workload's channel claim template, one
//! IMEX daemon Pod per member node with its `imexd.cfg` and nodes file, the membership with
//! stable indices in the domain's status, and the `IMEXDaemonReady` / `IMEXDaemonFailed`
//! binding conditions (KEP-5007) of the channel claims, which hold the workload's pods in the
//! scheduler's PreBind until their node's daemon is Ready.
//!
//! Shape: kube-runtime's [`Controller`] over the domains of one API ([`crd::Domain`]: NVIDIA's
//! `resource.nvidia.com/v1beta1` or drust's `compute.drust.dev/v1alpha1`), also woken by the
//! domains' channel claims (label [`imex::DOMAIN_UID_LABEL`]), daemon Pods, and the
//! ResourceSlices of member nodes (a clique published, withdrawn or changed); a reconcile
//! function and an error policy. The controller is the only writer of a domain's status
//! (server-side apply, one field manager, reconciles of one domain never overlap), so no
//! membership update is lost when many nodes join at once (NVIDIA #1050) and there is no
//! conflict storm (NVIDIA #816).
//!
//! One node serves one domain at a time, and one clique serves one domain (NVIDIA #892: two
//! IMEX ensembles in one NVLink partition break memory import): a claim of a second domain
//! allocated on a node or clique another domain holds gets `IMEXDaemonFailed`, so the
//! scheduler places it again, and the domain a Warning event. Holdings are rebuilt from the
//! domains' statuses at start.
//!
//! A member whose channel stops publishing a clique (its GPUs' fabric registration in
//! progress again, or an unhealthy fabric: the GPU plugin withdraws the clique and taints the
//! GPUs) keeps its clique and index, so its peers' nodes files do not change, and is not Ready,
//! with condition and Warning event [`FABRIC_NOT_READY`], until the clique is back; a member
//! whose channel publishes another clique moves there ([`CLIQUE_CHANGED`]).
//!
//! RBAC (deploy/helm/drust/templates/compute-domain-controller.yaml): the domains and their
//! status; ResourceClaimTemplates (create, get); ResourceClaims (list, watch) and their status
//! (patch, with `arbitrary-node:patch` on `resourceclaims/driver` for `gpu.drust.dev`);
//! ResourceSlices (list, watch); Pods and ConfigMaps in its own namespace; events.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, ListParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};

mod children;
pub mod crd;
mod holdings;
pub mod imex;
pub mod membership;
mod reconcile;
pub mod supervisor;

pub use children::build_template;
use holdings::Holder;
pub use reconcile::reconcile;

use crd::Domain;
use imex::{DOMAIN_UID_LABEL, DaemonSettings};

/// The finalizer on every domain: its daemon Pods and ConfigMap live in another namespace.
pub const FINALIZER: &str = "compute.drust.dev/controller";
/// The DeviceClass of IMEX channels (the contract with the GPU plugin).
pub const CHANNEL_CLASS: &str = "imex-channel.drust.dev";
/// The request name in the template.
pub const CHANNEL_REQUEST: &str = "channel";
/// The binding condition the scheduler waits for.
pub const READY_CONDITION: &str = "IMEXDaemonReady";
/// The binding failure condition that makes the scheduler place the claim again.
pub const FAILED_CONDITION: &str = "IMEXDaemonFailed";
/// The domain condition (and event reason) of a template name taken by another object.
pub const TEMPLATE_CONFLICT: &str = "TemplateConflict";
/// The domain condition of a member whose daemon cannot start, or a node or clique held by
/// another domain.
pub const DAEMON_FAILED: &str = "DaemonFailed";
/// The event reason of a claim placed on a node or clique another domain holds.
pub const CLIQUE_IN_USE: &str = "CliqueInUse";
/// The domain condition (and event reason) of a member whose channel publishes no clique any
/// more (its GPUs' fabric registration went back to in progress, or failed): it keeps its
/// clique and index, and is not Ready until the clique is back.
pub const FABRIC_NOT_READY: &str = "FabricNotReady";
/// The event reason of a member whose channel publishes another clique (Fabric Manager
/// re-partitioned): it moves to that clique's nodes file with an index there.
pub const CLIQUE_CHANGED: &str = "CliqueChanged";

/// How the controller behaves.
#[derive(Debug, Clone)]
pub struct Settings {
    /// How daemon Pods and ConfigMaps are made, and where.
    pub daemon: DaemonSettings,
    /// Who reports the events.
    pub reporter: Reporter,
    /// The server-side apply field manager.
    pub field_manager: String,
    /// Reconcile every domain again after this long.
    pub resync: Duration,
    /// The deadline of each API call.
    pub api_timeout: Duration,
    /// Domains reconciled at once.
    pub concurrency: u16,
}

/// Why a reconcile failed (the error policy retries it).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An API call failed or ran out of time.
    #[error("{action} {object}: {problem}")]
    Api {
        /// What was attempted (`create`, `patch status of`...).
        action: &'static str,
        /// `kind namespace/name`.
        object: String,
        /// Why.
        problem: String,
    },
    /// An object could not be built from the domain (bad input).
    #[error("domain {domain}: {problem}")]
    Build {
        /// `namespace/name`.
        domain: String,
        /// Why.
        problem: String,
    },
}

/// What reconcile reads and remembers.
pub struct Context<D: Domain> {
    pub(crate) client: Client,
    pub(crate) slices: Store<ResourceSlice>,
    pub(crate) settings: Settings,
    pub(crate) recorder: Recorder,
    /// Node (`node:<name>`) and clique (`clique:<id>`) → the domain holding it.
    pub(crate) holdings: Mutex<BTreeMap<String, Holder>>,
    /// Events already published: (domain UID, reason, note).
    pub(crate) published: Mutex<HashSet<(String, String, String)>>,
    _domain: std::marker::PhantomData<fn() -> D>,
}

/// One call with the settings' deadline, its error naming the action and object.
pub(crate) async fn call<T>(
    timeout: Duration,
    action: &'static str,
    object: impl FnOnce() -> String,
    fut: impl Future<Output = Result<T, kube::Error>>,
) -> Result<T, Error> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Error::Api {
            action,
            object: object(),
            problem: e.to_string(),
        }),
        Err(_) => Err(Error::Api {
            action,
            object: object(),
            problem: format!("no answer within {} ms", timeout.as_millis()),
        }),
    }
}

pub(crate) fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

/// Runs the controller for domains of type `D` until `shutdown` resolves.
///
/// # Errors
/// When a cache never fills or the domains cannot be listed at start.
pub async fn run<D: Domain>(
    client: Client,
    settings: Settings,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) -> anyhow::Result<()> {
    let ns = settings.daemon.namespace.clone();
    let (slices, slice_writer) = reflector::store();
    tokio::spawn(
        reflector::reflector(
            slice_writer,
            watcher(
                Api::<ResourceSlice>::all(client.clone()),
                watcher::Config::default().fields(&format!("spec.driver={}", membership::DRIVER)),
            ),
        )
        .default_backoff()
        .for_each(|_| futures::future::ready(())),
    );
    let recorder = Recorder::new(client.clone(), settings.reporter.clone());
    let context = Arc::new(Context::<D> {
        client: client.clone(),
        slices: slices.clone(),
        recorder,
        holdings: Mutex::new(BTreeMap::new()),
        published: Mutex::new(HashSet::new()),
        settings,
        _domain: std::marker::PhantomData,
    });
    // Who holds what, from the statuses, before any reconcile takes anything.
    let existing = tokio::time::timeout(
        context.settings.api_timeout,
        Api::<D>::all(client.clone()).list(&ListParams::default()),
    )
    .await
    .map_err(|_| anyhow::anyhow!("listing the ComputeDomains: no answer"))?
    .map_err(|e| anyhow::anyhow!("listing the ComputeDomains: {e}"))?;
    context.seed(&existing.items);
    slices
        .wait_until_ready()
        .await
        .map_err(|e| anyhow::anyhow!("the resourceslices cache: {e}"))?;
    let controller = Controller::new(Api::<D>::all(client), watcher::Config::default());
    let domains = controller.store();
    let by_uid = move |uid: Option<String>| -> Option<ObjectRef<D>> {
        let uid = uid?;
        domains
            .state()
            .iter()
            .find(|d| d.meta().uid.as_deref() == Some(uid.as_str()))
            .map(|d| ObjectRef::from_obj(d.as_ref()))
    };
    let by_uid_pods = by_uid.clone();
    // A slice changing (a clique published, withdrawn or changed) wakes the domains with a
    // member on its node, instead of waiting for the resync.
    let members_store = controller.store();
    let on_node = move |slice: ResourceSlice| -> Vec<ObjectRef<D>> {
        let Some(node) = slice.spec.node_name.clone() else {
            return Vec::new();
        };
        members_store
            .state()
            .iter()
            .filter(|d| {
                d.domain_status()
                    .is_some_and(|s| s.nodes.iter().any(|n| n.name == node))
            })
            .map(|d| ObjectRef::from_obj(d.as_ref()))
            .collect()
    };
    tracing::info!(namespace = %ns, "ComputeDomain controller started");
    controller
        .watches(
            Api::<ResourceClaim>::all(context.client.clone()),
            watcher::Config::default().labels(DOMAIN_UID_LABEL),
            move |c: ResourceClaim| by_uid(c.labels().get(DOMAIN_UID_LABEL).cloned()),
        )
        .watches(
            Api::<Pod>::namespaced(context.client.clone(), &ns),
            watcher::Config::default().labels(&format!(
                "app.kubernetes.io/managed-by={}",
                imex::MANAGED_BY
            )),
            move |p: Pod| by_uid_pods(p.labels().get(DOMAIN_UID_LABEL).cloned()),
        )
        .watches(
            Api::<ResourceSlice>::all(context.client.clone()),
            watcher::Config::default().fields(&format!("spec.driver={}", membership::DRIVER)),
            on_node,
        )
        .with_config(
            kube::runtime::controller::Config::default()
                .concurrency(context.settings.concurrency)
                // Many nodes joining at once: one reconcile for a burst of claim updates.
                .debounce(Duration::from_millis(200)),
        )
        .graceful_shutdown_on(shutdown)
        .run(reconcile::<D>, error_policy::<D>, context)
        .for_each(|outcome| async move {
            if let Err(e) = outcome {
                tracing::debug!(error = %e, "reconcile");
            }
        })
        .await;
    Ok(())
}

/// Retry a failed reconcile after a few seconds.
pub fn error_policy<D: Domain>(domain: Arc<D>, error: &Error, _ctx: Arc<Context<D>>) -> Action {
    tracing::warn!(domain = %domain.name_any(), %error, "reconcile failed");
    Action::requeue(Duration::from_secs(2))
}
