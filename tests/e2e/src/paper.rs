//! Paper nodes without plugin processes, as upstream's `test/integration/scheduler_perf` makes
//! them: a Node object ([`ControlPlane::register_node`]) and the ResourceSlices drust's plugin
//! would publish for it, created directly by the test. The slices are the plugin's own output:
//! the `gpu-kubelet-plugin --dry-run` snapshots of `crates/gpu-kubelet-plugin/tests/snapshots`
//! (checked against the binary by its `dry_run` test), with the node's name put in place of
//! the snapshot's `gpu-node-0`. Cheap enough for a thousand nodes; nothing prepares what the
//! scheduler binds there ([`crate::cluster`] has paper nodes whose plugin publishes instead).
//!
//! ```no_run
//! # async fn example(cp: &drust_e2e::ControlPlane) -> Result<(), drust_e2e::paper::PaperError> {
//! use drust_e2e::paper::{PaperNode, create};
//!
//! let nodes = vec![PaperNode::new("paper-0", "dgx-h100").label("rack", "a")];
//! create(cp, &nodes, 16).await?;
//! # Ok(())
//! # }
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::Api;
use kube::api::PostParams;
use serde::Deserialize as _;

use crate::ControlPlane;
use crate::manifests::repo_path;

/// Where the plugin's dry-run snapshots are, relative to the repository root.
pub const SNAPSHOTS: &str = "crates/gpu-kubelet-plugin/tests/snapshots";

/// The node name the snapshots were taken for.
const SNAPSHOT_NODE: &str = "gpu-node-0";

/// Making paper nodes failed.
#[derive(Debug, thiserror::Error)]
pub enum PaperError {
    /// A snapshot could not be read.
    #[error("reading {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A snapshot document is not a ResourceSlice.
    #[error("{path}: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// Why.
        source: serde_yaml_ng::Error,
    },
    /// Registering a Node failed.
    #[error("registering node {node}")]
    Node {
        /// The node.
        node: String,
        /// Why.
        source: Box<crate::Error>,
    },
    /// Creating a slice failed.
    #[error("creating the slices of node {node}")]
    Slice {
        /// The node.
        node: String,
        /// Why.
        source: kube::Error,
    },
    /// No client for the control plane.
    #[error("control plane client")]
    Client(#[source] Box<crate::Error>),
}

/// One paper node: its name, labels and the snapshot its slices come from.
#[derive(Debug, Clone)]
pub struct PaperNode {
    /// The Node's name, also its pool's.
    pub name: String,
    /// Node labels besides `kubernetes.io/hostname` and `kubernetes.io/os`.
    pub labels: BTreeMap<String, String>,
    /// A snapshot of [`SNAPSHOTS`] without `.yaml`, such as `dgx-h100`.
    pub topology: String,
}

impl PaperNode {
    /// A node named `name` with the slices of snapshot `topology`, no labels.
    pub fn new(name: &str, topology: &str) -> Self {
        PaperNode {
            name: name.to_owned(),
            labels: BTreeMap::new(),
            topology: topology.to_owned(),
        }
    }

    /// Adds node label `key=value`.
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.to_owned(), value.to_owned());
        self
    }
}

/// The slices the plugin publishes on `node` for snapshot `topology` (`dgx-h100`: 8 H100s,
/// `pcie-l40s`: 4 L40S, ...): the snapshot with `node` as the node name, the pool name and in
/// `generateName`.
///
/// # Errors
/// [`PaperError::Read`] or [`PaperError::Parse`].
pub fn slices(topology: &str, node: &str) -> Result<Vec<ResourceSlice>, PaperError> {
    let path = repo_path(&format!("{SNAPSHOTS}/{topology}.yaml"));
    let text = std::fs::read_to_string(&path).map_err(|source| PaperError::Read {
        path: path.clone(),
        source,
    })?;
    let text = text.replace(SNAPSHOT_NODE, node);
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| {
            ResourceSlice::deserialize(doc).map_err(|source| PaperError::Parse {
                path: path.clone(),
                source,
            })
        })
        .collect()
}

/// Registers every node of `nodes` and then creates their slices, `concurrency` requests at
/// a time (nodes first, all of them, then slices).
///
/// # Errors
/// The first [`PaperError`]; nodes and slices made before it stay.
pub async fn create(
    cp: &ControlPlane,
    nodes: &[PaperNode],
    concurrency: usize,
) -> Result<(), PaperError> {
    let client = cp
        .client()
        .await
        .map_err(|e| PaperError::Client(Box::new(e)))?;
    let concurrency = concurrency.max(1);
    futures::stream::iter(nodes)
        .map(|n| async move {
            let labels: Vec<(&str, &str)> = n
                .labels
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            cp.register_node(&n.name, &labels)
                .await
                .map(drop)
                .map_err(|source| PaperError::Node {
                    node: n.name.clone(),
                    source: Box::new(source),
                })
        })
        .buffer_unordered(concurrency)
        .try_collect::<()>()
        .await?;
    let mut all = Vec::new();
    for n in nodes {
        all.extend(
            slices(&n.topology, &n.name)?
                .into_iter()
                .map(|s| (&n.name, s)),
        );
    }
    let api: Api<ResourceSlice> = Api::all(client);
    futures::stream::iter(all)
        .map(|(node, slice)| {
            let api = api.clone();
            async move {
                api.create(&PostParams::default(), &slice)
                    .await
                    .map(drop)
                    .map_err(|source| PaperError::Slice {
                        node: node.clone(),
                        source,
                    })
            }
        })
        .buffer_unordered(concurrency)
        .try_collect::<()>()
        .await
}
