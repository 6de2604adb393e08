//! The Node label naming this node's multi-node NVLink clique (`--node-clique-label`), so that
//! a gang's topology constraint (`PodGroup.spec.schedulingConstraints.topology[].key`,
//! KEP-5732) or a pod's node affinity can keep a job inside one NVLink fabric. NVIDIA's GPU
//! feature discovery publishes the same value as `nvidia.com/gpu.clique`.
//!
//! - The value is the clique every GPU of the node that has one reports
//!   (`<clusterUuid>.<cliqueId>`, [`gpu_inventory::Gpu::nvlink_clique`]). No GPU in a clique:
//!   the label is removed. GPUs in different cliques: the label is removed and a warning says
//!   which, since no one value is true of the node.
//! - It follows every rediscovered inventory, so a clique that Fabric Manager re-partitions is
//!   relabelled; a failed write is tried again (1 s, doubling to [`RETRY_CAP`]), each call
//!   within the API deadline. Nothing else of the Node is touched: a JSON merge patch of the one
//!   label, after a read that shows it differs.
//! - The chart grants `patch` on nodes only with this option, and its admission policy lets the
//!   plugin's token change that one label on its own node alone, to a clique's value.

use std::time::Duration;

use gpu_inventory::Inventory;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use tokio::sync::watch;
use tracing::{info, warn};

/// The longest wait between two tries of a label write.
pub const RETRY_CAP: Duration = Duration::from_secs(60);

/// The clique this node's GPUs report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeClique {
    /// No GPU is registered in a multi-node clique.
    None,
    /// Every GPU that is reports this one.
    One(String),
    /// GPUs report different cliques (sorted, each once).
    Several(Vec<String>),
}

impl NodeClique {
    /// The clique of `inventory`'s GPUs.
    pub fn of(inventory: &Inventory) -> Self {
        let cliques: std::collections::BTreeSet<&str> = inventory
            .gpus
            .iter()
            .filter_map(|g| g.nvlink_clique.as_deref())
            .collect();
        match cliques.len() {
            0 => Self::None,
            1 => Self::One(cliques.into_iter().next().unwrap_or_default().to_owned()),
            _ => Self::Several(cliques.into_iter().map(str::to_owned).collect()),
        }
    }

    /// The label's value: the one clique, when it is a valid label value.
    fn value(&self) -> Option<&str> {
        match self {
            Self::One(c) if label_value(c) => Some(c),
            _ => None,
        }
    }
}

/// Whether `v` is a valid label value (`IsValidLabelValue`, `k8s.io/apimachinery`
/// `pkg/util/validation/validation.go`): at most 63 characters, alphanumerics, `-`, `_`, `.`,
/// beginning and ending with an alphanumeric.
pub fn label_value(v: &str) -> bool {
    let b = v.as_bytes();
    b.len() <= 63
        && (b.is_empty()
            || (b[0].is_ascii_alphanumeric()
                && b[b.len() - 1].is_ascii_alphanumeric()
                && b.iter()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))))
}

/// Keeps label `key` of Node `node` equal to the clique `cliques` holds, until the task is
/// dropped or aborted; each API call within `timeout`.
pub async fn run(
    client: kube::Client,
    node: String,
    key: String,
    timeout: Duration,
    mut cliques: watch::Receiver<NodeClique>,
) {
    let nodes: Api<Node> = Api::all(client);
    loop {
        let clique = cliques.borrow_and_update().clone();
        if let NodeClique::Several(all) = &clique {
            warn!(label = %key, cliques = ?all, "this node's GPUs are in different NVLink \
                cliques: the node is not labelled with any");
        }
        if let NodeClique::One(c) = &clique
            && !label_value(c)
        {
            warn!(label = %key, clique = %c, "the clique is not a valid label value: the node is \
                not labelled with it");
        }
        let want = clique.value().map(str::to_owned);
        let mut delay = Duration::from_secs(1);
        loop {
            match apply(&nodes, &node, &key, want.as_deref(), timeout).await {
                Ok(changed) => {
                    if changed {
                        info!(label = %key, value = ?want, "labelled the node with its NVLink clique");
                    }
                    break;
                }
                Err(e) => {
                    warn!(label = %key, error = %e, retry_in = ?delay,
                        "labelling the node with its NVLink clique failed");
                    // A new clique while waiting is taken at once.
                    if tokio::time::timeout(delay, cliques.changed()).await.is_ok() {
                        break;
                    }
                    delay = (delay * 2).min(RETRY_CAP);
                }
            }
        }
        if *cliques.borrow() != clique {
            continue;
        }
        if cliques.changed().await.is_err() {
            return;
        }
    }
}

/// Sets (or with `None` removes) label `key` of `node` when it differs; whether it wrote.
async fn apply(
    nodes: &Api<Node>,
    node: &str,
    key: &str,
    want: Option<&str>,
    timeout: Duration,
) -> Result<bool, String> {
    let current = tokio::time::timeout(timeout, nodes.get(node))
        .await
        .map_err(|_| format!("reading Node {node}: no answer within {timeout:?}"))?
        .map_err(|e| format!("reading Node {node}: {e}"))?;
    let has = current
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(key))
        .map(String::as_str);
    if has == want {
        return Ok(false);
    }
    let patch = serde_json::json!({"metadata": {"labels": {key: want}}});
    tokio::time::timeout(
        timeout,
        nodes.patch(node, &PatchParams::default(), &Patch::Merge(&patch)),
    )
    .await
    .map_err(|_| format!("patching Node {node}: no answer within {timeout:?}"))?
    .map_err(|e| format!("patching Node {node}'s label {key}: {e}"))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inventory(cliques: &[Option<&str>]) -> Inventory {
        let backend = gpu_inventory::FakeBackend::from_file(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../examples/topologies/dgx-h100.yaml"
        ))
        .unwrap();
        let mut inventory = gpu_inventory::discover(&backend).unwrap();
        for (gpu, clique) in inventory.gpus.iter_mut().zip(cliques) {
            gpu.nvlink_clique = clique.map(str::to_owned);
        }
        inventory
    }

    #[test]
    fn the_node_has_a_clique_only_when_its_gpus_agree() {
        let c = "0a1b2c3d-0000-4000-8000-00000000beef.7";
        assert_eq!(NodeClique::of(&inventory(&[])), NodeClique::None);
        assert_eq!(
            NodeClique::of(&inventory(&[Some(c), None, Some(c)])),
            NodeClique::One(c.into())
        );
        assert_eq!(
            NodeClique::of(&inventory(&[Some(c), Some("x.1")])),
            NodeClique::Several(vec![c.into(), "x.1".into()])
        );
        assert_eq!(NodeClique::One(c.into()).value(), Some(c));
        assert_eq!(NodeClique::Several(vec![c.into()]).value(), None);
        assert_eq!(
            NodeClique::One(format!("{c}-{}", "a".repeat(30))).value(),
            None
        );
    }

    #[test]
    fn label_values_follow_upstream() {
        for ok in ["", "a", "a.b-c_d", &"a".repeat(63)] {
            assert!(label_value(ok), "{ok}");
        }
        for bad in ["-a", "a-", "a b", "a/b", &"a".repeat(64)] {
            assert!(!label_value(bad), "{bad}");
        }
    }
}
