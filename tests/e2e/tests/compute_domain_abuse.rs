//! A tenant trying to join another namespace's ComputeDomain (issue 43, "tenants share nothing
//! they do not need"): in its own namespace it makes a channel claim carrying the domain's UID
//! label (all the controller keys on) and has it allocated on a node of the domain's clique.
//! The controller reads a domain's claims in the domain's namespace only, so that claim gets no
//! binding condition (its pod would stay in the scheduler's PreBind until it gives up) and its
//! node does not become a member; the domain's own claim, made after it, is served.

mod cd_support;

use anyhow::ensure;
use cd_support::*;
use drust_e2e::ControlPlaneOptions;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use serde_json::json;

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_in_another_namespace_with_the_domains_label_is_never_served() -> anyhow::Result<()>
{
    let (cp, client) = start(ControlPlaneOptions::default()).await?;
    let dir = tempfile::tempdir()?;
    let nodes: Vec<String> = (0..2).map(|i| format!("tray-{i}")).collect();
    paper_nodes(&cp, &client, &nodes, |_| Some(CLIQUE_A)).await?;
    let _kubelet = PaperKubelet::start(&client);
    let _controller = Controller::start(&cp, "drust", dir.path())?;
    let cd = create_domain(&client, "job", "job-channel", 0).await?;
    let uid = cd.uid().unwrap_or_default();
    let tenant: Namespace = serde_json::from_value(json!({"metadata": {"name": "tenant-b"}}))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &tenant)
        .await?;
    // The forged claim first, then the domain's own: the reconcile that serves the second
    // lists claims after both exist.
    allocated_claim_in(&client, "tenant-b", "forged", &uid, "tray-1").await?;
    allocated_claim(&client, "own", &uid, "tray-0").await?;
    let status = wait_status(&client, "job", "job Ready", |s| s["status"] == "Ready").await?;
    let own = Api::<ResourceClaim>::namespaced(client.clone(), WORK)
        .get("own")
        .await?;
    ensure!(
        channel_condition(&own, "IMEXDaemonReady").is_some_and(|c| c.0 == "True"),
        "the domain's own claim is served"
    );
    let m = members(&status);
    ensure!(
        m.len() == 1 && m.contains_key("tray-0"),
        "tray-1 (the forged claim's node) is no member: {m:?}"
    );
    let forged = Api::<ResourceClaim>::namespaced(client.clone(), "tenant-b")
        .get("forged")
        .await?;
    ensure!(
        channel_condition(&forged, "IMEXDaemonReady").is_none()
            && channel_condition(&forged, "IMEXDaemonFailed").is_none(),
        "the forged claim got no binding condition: {:?}",
        forged.status
    );
    Ok(())
}
