//! A member's NVLink fabric flapping under a ComputeDomain (issue 43, "fabric state flapping
//! between IN_PROGRESS and COMPLETED"): the GPU plugin withdraws a node's clique from its
//! channel while the GPUs' fabric registration is in progress again (and puts it back on
//! COMPLETED: `crates/gpu-kubelet-plugin/tests/fabric.rs`). Here a paper node's channel slice
//! is rewritten the same way, with the controller, a real API server and the paper kubelet of
//! `cd_support`:
//!
//! - clique withdrawn: the domain is NotReady with condition and Warning event
//!   `FabricNotReady` naming the node, which keeps its clique and index (no lost membership, the
//!   nodes file unchanged, so no daemon restarts); the other member stays Ready;
//! - clique back: Ready again, every index as before;
//! - another clique (a re-partition): a `CliqueChanged` event, and the node moves to that
//!   clique's nodes file, first there.

mod cd_support;

use anyhow::ensure;
use cd_support::*;
use drust_e2e::ControlPlaneOptions;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

/// Sets (or with `None` removes) the clique of `node`'s channel device, as the plugin
/// republishes it.
async fn set_clique(client: &kube::Client, node: &str, clique: Option<&str>) -> anyhow::Result<()> {
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let mut attributes = json!({"type": {"string": "imex-channel"}, "channel": {"int": 0}});
    if let Some(c) = clique {
        attributes["nvlinkClique"] = json!({"string": c});
    }
    let slice = slices.get(&format!("{node}-imex")).await?;
    let generation = slice.spec.pool.generation + 1;
    let patch = json!({"spec": {
        "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
        "devices": [{
            "name": CHANNEL,
            "allowMultipleAllocations": true,
            "attributes": attributes,
            "bindingConditions": ["IMEXDaemonReady"],
            "bindingFailureConditions": ["IMEXDaemonFailed"],
        }],
    }});
    slices
        .patch(
            &format!("{node}-imex"),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;
    Ok(())
}

async fn nodes_file(client: &kube::Client, uid: &str, clique: &str) -> anyhow::Result<String> {
    let cm = Api::<ConfigMap>::namespaced(client.clone(), SYSTEM)
        .get(&format!("imex-{uid}"))
        .await?;
    Ok(cm
        .data
        .unwrap_or_default()
        .get(&format!("nodes.{clique}.cfg"))
        .cloned()
        .unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_members_fabric_flapping_keeps_its_clique_and_index_and_says_so() -> anyhow::Result<()> {
    let (cp, client) = start(ControlPlaneOptions::default()).await?;
    let dir = tempfile::tempdir()?;
    let nodes: Vec<String> = (0..2).map(|i| format!("tray-{i}")).collect();
    paper_nodes(&cp, &client, &nodes, |_| Some(CLIQUE_A)).await?;
    let _kubelet = PaperKubelet::start(&client);
    let _controller = Controller::start(&cp, "drust", dir.path())?;
    let cd = create_domain(&client, "job", "job-channel", 2).await?;
    let uid = cd.uid().unwrap_or_default();
    for (i, n) in nodes.iter().enumerate() {
        allocated_claim(&client, &format!("c{i}"), &uid, n).await?;
    }
    let before =
        members(&wait_status(&client, "job", "job Ready", |s| s["status"] == "Ready").await?);
    let file_before = nodes_file(&client, &uid, CLIQUE_A).await?;

    // Registration in progress again on tray-1: its channel publishes no clique.
    set_clique(&client, "tray-1", None).await?;
    let pending = wait_status(&client, "job", "FabricNotReady on tray-1", |s| {
        s["status"] == "NotReady"
            && s["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "FabricNotReady")
    })
    .await?;
    let during = members(&pending);
    ensure!(
        during["tray-1"].0 == before["tray-1"].0
            && during["tray-1"].1 == CLIQUE_A
            && during["tray-1"].3 == "NotReady"
            && during["tray-0"] == before["tray-0"],
        "tray-1 keeps clique and index, tray-0 untouched: {before:?} -> {during:?}"
    );
    ensure!(
        nodes_file(&client, &uid, CLIQUE_A).await? == file_before,
        "the nodes file unchanged"
    );
    let events = wait_warning(&client, "job", "FabricNotReady").await?;
    ensure!(
        events.iter().any(|e| e.contains("node tray-1")
            && e.contains(&format!(
                "keeps clique {CLIQUE_A} and index {}",
                before["tray-1"].0
            ))),
        "{events:?}"
    );

    // COMPLETED again, same clique: Ready, every index as before.
    set_clique(&client, "tray-1", Some(CLIQUE_A)).await?;
    let back = members(
        &wait_status(&client, "job", "Ready again", |s| {
            s["status"] == "Ready"
                && !s["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["type"] == "FabricNotReady")
        })
        .await?,
    );
    for n in &nodes {
        ensure!(
            back[n].0 == before[n].0 && back[n].1 == CLIQUE_A,
            "{before:?} -> {back:?}"
        );
    }

    // Re-partitioned into another clique: a real move, said in an event.
    set_clique(&client, "tray-1", Some(CLIQUE_B)).await?;
    let moved = members(
        &wait_status(&client, "job", "tray-1 in clique B", |s| {
            members(s).get("tray-1").is_some_and(|m| m.1 == CLIQUE_B)
        })
        .await?,
    );
    ensure!(moved["tray-1"].0 == 0, "first of clique B: {moved:?}");
    let events = wait_warning(&client, "job", "CliqueChanged").await?;
    ensure!(
        events
            .iter()
            .any(|e| e.contains("node tray-1") && e.contains(CLIQUE_B)),
        "{events:?}"
    );
    Ok(())
}

/// The Warning events of reason `reason` on domain `name`, once there is one.
async fn wait_warning(
    client: &kube::Client,
    name: &str,
    reason: &str,
) -> anyhow::Result<Vec<String>> {
    drust_e2e::wait::until(&format!("a {reason} event"), TIMEOUT, || async {
        let found = warnings(client, name, reason).await?;
        Ok((!found.is_empty()).then_some(found))
    })
    .await
    .map_err(anyhow::Error::msg)
}
