//! Reading a live cluster for `dractl explain pod|claim NAMESPACE/NAME`: the pod's (or the
//! claim's) unallocated ResourceClaims as the pod's claims, every allocated claim as in use, and
//! the cluster's Nodes, DeviceClasses and ResourceSlices, as the scheduler sees them.
//!
//! Read-only. The RBAC it needs (a ClusterRole): `get` on `pods` (for `explain pod`), `get` and
//! `list` on `resourceclaims.resource.k8s.io`, `list` on `nodes`, `deviceclasses` and
//! `resourceslices` (the last two in `resource.k8s.io`). `deploy/rbac/dractl-explain.yaml` has
//! it.
//!
//! What the scheduler's other plugins decide (node affinity, resources, taints of the Node) is
//! not considered: the explanation is about devices.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{Api, ListParams};

/// Time allowed for each API call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// What to explain.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Target {
    /// A pod: its ResourceClaims (named, or generated from its templates).
    Pod,
    /// One ResourceClaim, as the only claim of a pod.
    Claim,
}

/// Why the cluster could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LiveError {
    /// `NAMESPACE/NAME` was not given as such.
    #[error("{0:?}: expected NAMESPACE/NAME")]
    Name(String),
    /// No usable kubeconfig.
    #[error("kubeconfig: {0}")]
    Config(String),
    /// An API call failed or timed out.
    #[error("{what}: {error}")]
    Api {
        /// What was read.
        what: String,
        /// Why it failed.
        error: String,
    },
    /// The pod's claims cannot be gathered (not created yet, not found).
    #[error(transparent)]
    Claims(dra_allocator::pod::PodClaimsError),
    /// No bearer token to show the node plugins (`dractl top`).
    #[error("{0}")]
    Token(String),
    /// Every node plugin refused the caller (`dractl top`).
    #[error("{0}")]
    Refused(String),
}

/// Where to find the cluster: a kubeconfig file and context (as kubectl's flags), else the
/// usual places (`KUBECONFIG`, `~/.kube/config`, in-cluster).
#[derive(Clone, Debug, Default)]
pub struct Connection {
    /// `--kubeconfig`.
    pub kubeconfig: Option<std::path::PathBuf>,
    /// `--context`.
    pub context: Option<String>,
}

/// The objects to explain the target with.
pub async fn load(
    connection: &Connection,
    target: Target,
    name: &str,
) -> Result<dra_allocator::Objects, LiveError> {
    let (namespace, name) = name
        .split_once('/')
        .filter(|(ns, n)| !ns.is_empty() && !n.is_empty())
        .ok_or_else(|| LiveError::Name(name.to_owned()))?;
    let client = client(connection).await?;
    let claim_names: Vec<String> = match target {
        Target::Claim => vec![name.to_owned()],
        Target::Pod => {
            let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
            let pod = call(&format!("get pod {namespace}/{name}"), pods.get(name)).await?;
            dra_allocator::pod::claim_names(&pod).map_err(LiveError::Claims)?
        }
    };
    let claims: Api<ResourceClaim> = Api::all(client.clone());
    let nodes: Api<Node> = Api::all(client.clone());
    let classes: Api<DeviceClass> = Api::all(client.clone());
    let slices: Api<ResourceSlice> = Api::all(client);
    let lp = ListParams::default();
    let all_claims = call("list resourceclaims", claims.list(&lp)).await?;
    dra_allocator::pod::objects_for_claims(
        &format!("{namespace}/{name}"),
        namespace,
        &claim_names,
        &all_claims.items,
        call("list nodes", nodes.list(&lp)).await?.items,
        call("list deviceclasses", classes.list(&lp)).await?.items,
        call("list resourceslices", slices.list(&lp)).await?.items,
    )
    .map_err(LiveError::Claims)
}

/// The cluster as the scheduler sees it, without a pod: Nodes, DeviceClasses,
/// ResourceSlices and the allocated ResourceClaims (for `dractl simulate`).
pub async fn load_cluster(connection: &Connection) -> Result<dra_allocator::Objects, LiveError> {
    let client = client(connection).await?;
    let lp = ListParams::default();
    let claims: Api<ResourceClaim> = Api::all(client.clone());
    let nodes: Api<Node> = Api::all(client.clone());
    let classes: Api<DeviceClass> = Api::all(client.clone());
    let slices: Api<ResourceSlice> = Api::all(client);
    let mut objects = dra_allocator::Objects {
        nodes: call("list nodes", nodes.list(&lp)).await?.items,
        classes: call("list deviceclasses", classes.list(&lp)).await?.items,
        slices: call("list resourceslices", slices.list(&lp)).await?.items,
        claims: call("list resourceclaims", claims.list(&lp))
            .await?
            .items
            .into_iter()
            .filter(dra_allocator::is_allocated)
            .collect(),
    };
    dra_allocator::apply_defaults(&mut objects);
    Ok(objects)
}

pub(crate) async fn client(connection: &Connection) -> Result<kube::Client, LiveError> {
    client_for(config(connection).await?)
}

/// The client configuration `connection` names, with [`CALL_TIMEOUT`] as its connect and read
/// timeouts.
pub(crate) async fn config(connection: &Connection) -> Result<kube::Config, LiveError> {
    let mut config = if connection.kubeconfig.is_none() && connection.context.is_none() {
        kube::Config::infer()
            .await
            .map_err(|e| LiveError::Config(e.to_string()))?
    } else {
        let options = kube::config::KubeConfigOptions {
            context: connection.context.clone(),
            ..Default::default()
        };
        let kubeconfig = match &connection.kubeconfig {
            Some(path) => kube::config::Kubeconfig::read_from(path)
                .map_err(|e| LiveError::Config(format!("{}: {e}", path.display())))?,
            None => {
                kube::config::Kubeconfig::read().map_err(|e| LiveError::Config(e.to_string()))?
            }
        };
        kube::Config::from_custom_kubeconfig(kubeconfig, &options)
            .await
            .map_err(|e| LiveError::Config(e.to_string()))?
    };
    config.connect_timeout = Some(CALL_TIMEOUT);
    config.read_timeout = Some(CALL_TIMEOUT);
    Ok(config)
}

pub(crate) fn client_for(config: kube::Config) -> Result<kube::Client, LiveError> {
    kube::Client::try_from(config).map_err(|e| LiveError::Config(e.to_string()))
}

pub(crate) async fn call<T>(
    what: &str,
    future: impl Future<Output = Result<T, kube::Error>>,
) -> Result<T, LiveError> {
    match tokio::time::timeout(CALL_TIMEOUT, future).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(LiveError::Api {
            what: what.to_owned(),
            error: e.to_string(),
        }),
        Err(_) => Err(LiveError::Api {
            what: what.to_owned(),
            error: format!("no answer within {CALL_TIMEOUT:?}"),
        }),
    }
}
