//! The ComputeDomain controller (`crates/compute-domain`, issue 43) against a real control
//! plane with kube-scheduler (binding conditions on: beta and on by default in 1.36), paper
//! nodes publishing one IMEX channel each as the contract with the GPU plugin says, and the
//! test playing the kubelet for the IMEX daemon Pods.

mod cd_support;

use std::collections::BTreeSet;

use anyhow::ensure;
use cd_support::*;
use drust_e2e::ControlPlaneOptions;
use drust_e2e::wait::until;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

fn names(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

async fn daemon_pods(client: &Client, uid: &str) -> Result<Vec<Pod>, String> {
    Api::<Pod>::namespaced(client.clone(), SYSTEM)
        .list(&ListParams::default().labels(&format!("{DOMAIN_UID_LABEL}={uid}")))
        .await
        .map(|l| l.items)
        .map_err(|e| e.to_string())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_template_is_created_owned_and_a_foreign_one_is_never_overwritten() -> anyhow::Result<()>
{
    let (cp, client) = start(ControlPlaneOptions::default()).await?;
    let dir = tempfile::tempdir()?;
    let _controller = Controller::start(&cp, "drust", dir.path())?;
    let cd = create_domain(&client, "train", "train-channel", 0).await?;
    let uid = cd.uid().unwrap_or_default();
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), WORK);
    let t = until("template train-channel", TIMEOUT, || async {
        templates
            .get_opt("train-channel")
            .await
            .map_err(|e| e.to_string())
    })
    .await?;
    let t = serde_json::to_value(&t)?;
    ensure!(
        t["metadata"]["ownerReferences"][0]["uid"] == json!(uid),
        "{t}"
    );
    ensure!(
        t["spec"]["metadata"]["labels"][DOMAIN_UID_LABEL] == json!(uid),
        "{t}"
    );
    let devices = &t["spec"]["spec"]["devices"];
    ensure!(devices["requests"][0]["exactly"]["deviceClassName"] == "imex-channel.drust.dev");
    ensure!(devices["requests"][0]["exactly"]["count"] == 1);
    let p = &devices["config"][0]["opaque"]["parameters"];
    ensure!(
        p["kind"] == "ComputeDomainChannelConfig" && p["domainID"] == json!(uid),
        "{p}"
    );
    ensure!(p["apiVersion"] == "gpu.drust.dev/v1alpha1", "{p}");
    // The finalizer is on.
    until("the finalizer on train", TIMEOUT, || async {
        let cd = domain_api(&client, WORK)
            .get("train")
            .await
            .map_err(|e| e.to_string())?;
        Ok(cd
            .finalizers()
            .iter()
            .any(|f| f == "compute.drust.dev/controller")
            .then_some(()))
    })
    .await?;

    // The spec is immutable: a renamed template would orphan the claims made from this one.
    let rename = json!({"spec": {"channel": {"resourceClaimTemplate": {"name": "other"}}}});
    match domain_api(&client, WORK)
        .patch(
            "train",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&rename),
        )
        .await
    {
        Err(kube::Error::Api(e)) if e.code == 422 && e.message.contains("immutable") => {}
        other => anyhow::bail!("the spec changed: {other:?}"),
    }

    // A template that someone else owns.
    let foreign: ResourceClaimTemplate = serde_json::from_value(json!({
        "metadata": {"name": "taken", "namespace": WORK},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu.drust.dev"}}]}}},
    }))?;
    let foreign = templates.create(&PostParams::default(), &foreign).await?;
    create_domain(&client, "thief", "taken", 0).await?;
    let status = wait_status(
        &client,
        "thief",
        "thief's TemplateConflict condition",
        |s| {
            s["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "TemplateConflict" && c["status"] == "True")
        },
    )
    .await?;
    ensure!(status["status"] == "NotReady", "{status}");
    let events = until("a TemplateConflict Warning on thief", TIMEOUT, || async {
        let w = warnings(&client, "thief", "TemplateConflict").await?;
        Ok((!w.is_empty()).then_some(w))
    })
    .await?;
    ensure!(events[0].contains("work/taken"), "{events:?}");
    let after = templates.get("taken").await?;
    ensure!(
        after.resource_version() == foreign.resource_version()
            && after.owner_references().is_empty(),
        "the foreign template was changed: {after:?}"
    );

    // Deleting the domain: the finalizer goes once the daemon objects are gone.
    domain_api(&client, WORK)
        .delete("train", &DeleteParams::default())
        .await?;
    until("train deleted", TIMEOUT, || async {
        let gone = domain_api(&client, WORK)
            .get_opt("train")
            .await
            .map_err(|e| e.to_string())?
            .is_none();
        Ok(gone.then_some(()))
    })
    .await?;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), SYSTEM);
    ensure!(cms.get_opt(&format!("imex-{uid}")).await?.is_none());
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pod_waits_in_prebind_until_its_daemon_is_ready_then_binds() -> anyhow::Result<()> {
    let (cp, client) = start(ControlPlaneOptions::default()).await?;
    let dir = tempfile::tempdir()?;
    let nodes = names("tray", 2);
    paper_nodes(&cp, &client, &nodes, |_| Some(CLIQUE_A)).await?;
    let kubelet = PaperKubelet::start(&client);
    kubelet
        .rules
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .hold
        .insert("tray-0".into());
    let controller = Controller::start(&cp, "drust", dir.path())?;
    let cd = create_domain(&client, "job", "job-channel", 0).await?;
    let uid = cd.uid().unwrap_or_default();
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), WORK);
    until("template job-channel", TIMEOUT, || async {
        templates
            .get_opt("job-channel")
            .await
            .map_err(|e| e.to_string())
    })
    .await?;
    create_pod(&client, "worker", "job-channel", Some("tray-0")).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), WORK);
    // The scheduler allocated the claim on tray-0, the controller started a daemon there, and
    // the daemon is not Ready: the pod must not be bound.
    until("a daemon Pod for tray-0", TIMEOUT, || async {
        let p = daemon_pods(&client, &uid).await?;
        Ok(p.iter()
            .any(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some("tray-0"))
            .then_some(()))
    })
    .await?;
    let status = wait_status(&client, "job", "tray-0 listed NotReady", |s| {
        members(s).get("tray-0").is_some_and(|m| m.3 == "NotReady")
    })
    .await?;
    ensure!(status["status"] == "NotReady", "{status}");
    // The scheduler says it waits for the binding conditions.
    until("the BindingConditionsPending event", TIMEOUT, || async {
        let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(client.clone(), WORK);
        let l = events
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        Ok(l.items
            .iter()
            .any(|e| {
                e.reason.as_deref() == Some("BindingConditionsPending")
                    && e.involved_object.name.as_deref() == Some("worker")
            })
            .then_some(()))
    })
    .await?;
    let pod = pods.get("worker").await?;
    ensure!(
        pod.spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .is_none(),
        "bound before its daemon was Ready: {pod:?}"
    );
    // The daemon becomes Ready: the pod binds to tray-0.
    kubelet
        .rules
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .hold
        .clear();
    let node = until("worker bound", TIMEOUT, || async {
        let p = pods.get("worker").await.map_err(|e| e.to_string())?;
        Ok(p.spec.and_then(|s| s.node_name))
    })
    .await;
    let node = match node {
        Ok(n) => n,
        Err(e) => anyhow::bail!("{e}\ncontroller log:\n{}", controller.log_text()),
    };
    ensure!(node == "tray-0", "bound to {node}");
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), WORK);
    let claim = claims
        .list(&ListParams::default().labels(&format!("{DOMAIN_UID_LABEL}={uid}")))
        .await?
        .items
        .into_iter()
        .next()
        .ok_or_else(|| anyhow::anyhow!("no claim"))?;
    let ready = channel_condition(&claim, "IMEXDaemonReady");
    ensure!(ready.as_ref().is_some_and(|c| c.0 == "True"), "{ready:?}");
    let status = wait_status(&client, "job", "job Ready", |s| s["status"] == "Ready").await?;
    let m = members(&status);
    ensure!(
        m.len() == 1 && m["tray-0"].0 == 0 && m["tray-0"].1 == CLIQUE_A,
        "{status}"
    );
    // The daemon's config: imexd.cfg and the clique's nodes file with tray-0's daemon IP.
    let cm = Api::<ConfigMap>::namespaced(client.clone(), SYSTEM)
        .get(&format!("imex-{uid}"))
        .await?;
    let data = cm.data.unwrap_or_default();
    ensure!(
        data.get("imexd.cfg")
            .is_some_and(|c| c.contains("IMEX_NODE_CONFIG_FILE="))
    );
    let nodes_file = data
        .get(&format!("nodes.{CLIQUE_A}.cfg"))
        .cloned()
        .unwrap_or_default();
    ensure!(
        nodes_file == format!("{}\n", m["tray-0"].2),
        "{nodes_file:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_pod_deleted_and_recreated_keeps_its_index() -> anyhow::Result<()> {
    let (cp, client) = start(ControlPlaneOptions::default()).await?;
    let dir = tempfile::tempdir()?;
    let nodes = names("tray", 3);
    paper_nodes(&cp, &client, &nodes, |_| Some(CLIQUE_A)).await?;
    let _kubelet = PaperKubelet::start(&client);
    let _controller = Controller::start(&cp, "drust", dir.path())?;
    let cd = create_domain(&client, "job", "job-channel", 3).await?;
    let uid = cd.uid().unwrap_or_default();
    for (i, n) in nodes.iter().enumerate() {
        allocated_claim(&client, &format!("c{i}"), &uid, n).await?;
    }
    let before =
        members(&wait_status(&client, "job", "job Ready", |s| s["status"] == "Ready").await?);
    let indices: BTreeSet<i64> = before.values().map(|m| m.0).collect();
    ensure!(indices == BTreeSet::from([0, 1, 2]), "{before:?}");
    // The daemon on tray-1 is deleted (node drain, eviction, a crash of the Pod).
    let victim = daemon_pods(&client, &uid)
        .await
        .map_err(anyhow::Error::msg)?
        .into_iter()
        .find(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some("tray-1"))
        .ok_or_else(|| anyhow::anyhow!("no daemon on tray-1"))?;
    let old_uid = victim.uid().unwrap_or_default();
    Api::<Pod>::namespaced(client.clone(), SYSTEM)
        .delete(&victim.name_any(), &DeleteParams::default().grace_period(0))
        .await?;
    // Recreated (a new Pod, a new IP), Ready again, same index for everyone.
    let after = wait_status(&client, "job", "tray-1 back with a new IP", |s| {
        let m = members(s);
        s["status"] == "Ready" && m.get("tray-1").is_some_and(|n| n.2 != before["tray-1"].2)
    })
    .await?;
    let after = members(&after);
    for n in &nodes {
        ensure!(after[n].0 == before[n].0, "{n}: {before:?} -> {after:?}");
    }
    let recreated = daemon_pods(&client, &uid)
        .await
        .map_err(anyhow::Error::msg)?;
    ensure!(recreated.len() == 3, "{} daemon Pods", recreated.len());
    ensure!(
        recreated
            .iter()
            .all(|p| p.uid().unwrap_or_default() != old_uid)
    );
    // The nodes file has the new IP on tray-1's line.
    let cm = Api::<ConfigMap>::namespaced(client.clone(), SYSTEM)
        .get(&format!("imex-{uid}"))
        .await?;
    let file = cm.data.unwrap_or_default()[&format!("nodes.{CLIQUE_A}.cfg")].clone();
    let lines: Vec<&str> = file.lines().collect();
    ensure!(
        lines.get(after["tray-1"].0 as usize) == Some(&after["tray-1"].2.as_str()),
        "{file}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_controller_sigkilled_mid_update_and_restarted_loses_nothing() -> anyhow::Result<()> {
    let (cp, client) = start(ControlPlaneOptions::default()).await?;
    let dir = tempfile::tempdir()?;
    let nodes = names("tray", 16);
    paper_nodes(&cp, &client, &nodes, |_| Some(CLIQUE_A)).await?;
    let _kubelet = PaperKubelet::start(&client);
    let mut controller = Controller::start(&cp, "drust", dir.path())?;
    let cd = create_domain(&client, "job", "job-channel", 16).await?;
    let uid = cd.uid().unwrap_or_default();
    for (i, n) in nodes.iter().take(8).enumerate() {
        allocated_claim(&client, &format!("c{i}"), &uid, n).await?;
    }
    let first =
        members(&wait_status(&client, "job", "8 members", |s| members(s).len() == 8).await?);
    // The second half joins; the controller dies in the middle of it.
    let joins = nodes.iter().enumerate().skip(8).map(|(i, n)| {
        let client = client.clone();
        let uid = uid.clone();
        let n = n.clone();
        async move { allocated_claim(&client, &format!("c{i}"), &uid, &n).await }
    });
    let joining = tokio::spawn(futures::future::join_all(joins));
    controller.kill();
    for r in joining.await? {
        r?;
    }
    let _restarted = Controller::start(&cp, "drust", dir.path())?;
    let status = wait_status(&client, "job", "16 members, Ready", |s| {
        members(s).len() == 16 && s["status"] == "Ready"
    })
    .await?;
    let all = members(&status);
    for (n, m) in &first {
        ensure!(all[n].0 == m.0, "{n} renumbered: {m:?} -> {:?}", all[n]);
    }
    let indices: BTreeSet<i64> = all.values().map(|m| m.0).collect();
    ensure!(indices == (0..16).collect(), "{all:?}");
    let pods = daemon_pods(&client, &uid)
        .await
        .map_err(anyhow::Error::msg)?;
    ensure!(pods.len() == 16, "{} daemon Pods", pods.len());
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), WORK);
    until("every claim IMEXDaemonReady", TIMEOUT, || async {
        let l = claims
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        let ready = l
            .items
            .iter()
            .filter(|c| channel_condition(c, "IMEXDaemonReady").is_some_and(|c| c.0 == "True"))
            .count();
        if ready == 16 {
            Ok(Some(()))
        } else {
            Err(format!("{ready} of 16"))
        }
    })
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_domain_on_a_held_clique_gets_imex_daemon_failed_and_an_event()
-> anyhow::Result<()> {
    let (cp, client) = start(ControlPlaneOptions::default()).await?;
    let dir = tempfile::tempdir()?;
    let nodes = names("tray", 3);
    // tray-0 and tray-1 share clique A; tray-2 is in clique B.
    paper_nodes(&cp, &client, &nodes, |i| {
        Some(if i < 2 { CLIQUE_A } else { CLIQUE_B })
    })
    .await?;
    let _kubelet = PaperKubelet::start(&client);
    let _controller = Controller::start(&cp, "drust", dir.path())?;
    let first = create_domain(&client, "first", "first-channel", 0).await?;
    allocated_claim(
        &client,
        "first-0",
        &first.uid().unwrap_or_default(),
        "tray-0",
    )
    .await?;
    wait_status(&client, "first", "first Ready", |s| s["status"] == "Ready").await?;
    let second = create_domain(&client, "second", "second-channel", 0).await?;
    let second_uid = second.uid().unwrap_or_default();
    allocated_claim(&client, "second-1", &second_uid, "tray-1").await?;
    allocated_claim(&client, "second-2", &second_uid, "tray-2").await?;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), WORK);
    let failed = until("second-1 IMEXDaemonFailed", TIMEOUT, || async {
        let c = claims.get("second-1").await.map_err(|e| e.to_string())?;
        Ok(channel_condition(&c, "IMEXDaemonFailed"))
    })
    .await?;
    ensure!(
        failed.0 == "True" && failed.1 == "CliqueInUse",
        "{failed:?}"
    );
    ensure!(failed.2.contains("work/first"), "{failed:?}");
    let events = until("a CliqueInUse Warning on second", TIMEOUT, || async {
        let w = warnings(&client, "second", "CliqueInUse").await?;
        Ok((!w.is_empty()).then_some(w))
    })
    .await?;
    ensure!(
        events[0].contains("tray-1") && events[0].contains(CLIQUE_A),
        "{events:?}"
    );
    // tray-2 (another clique) serves second; no daemon of second on tray-1.
    let status = wait_status(&client, "second", "second Ready on tray-2", |s| {
        members(s).get("tray-2").is_some_and(|m| m.3 == "Ready")
    })
    .await?;
    ensure!(!members(&status).contains_key("tray-1"), "{status}");
    let pods = daemon_pods(&client, &second_uid)
        .await
        .map_err(anyhow::Error::msg)?;
    ensure!(
        pods.iter()
            .all(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) != Some("tray-1")),
        "a second IMEX daemon on tray-1"
    );
    let c = claims.get("second-2").await?;
    ensure!(channel_condition(&c, "IMEXDaemonReady").is_some_and(|c| c.0 == "True"));
    let first_status = domain_status(&client, "first")
        .await
        .map_err(anyhow::Error::msg)?;
    ensure!(members(&first_status).len() == 1, "{first_status}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_that_cannot_start_shows_in_status_claim_and_event() -> anyhow::Result<()> {
    let (cp, client) = start(ControlPlaneOptions::default()).await?;
    let dir = tempfile::tempdir()?;
    let nodes = names("tray", 2);
    paper_nodes(&cp, &client, &nodes, |_| Some(CLIQUE_A)).await?;
    let kubelet = PaperKubelet::start(&client);
    kubelet
        .rules
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .crash
        .insert("tray-1".into());
    let _controller = Controller::start(&cp, "drust", dir.path())?;
    let cd = create_domain(&client, "job", "job-channel", 0).await?;
    let uid = cd.uid().unwrap_or_default();
    allocated_claim(&client, "c0", &uid, "tray-0").await?;
    allocated_claim(&client, "c1", &uid, "tray-1").await?;
    let status = wait_status(
        &client,
        "job",
        "a DaemonFailed condition naming tray-1",
        |s| {
            s["conditions"].as_array().into_iter().flatten().any(|c| {
                c["type"] == "DaemonFailed"
                    && c["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("tray-1") && m.contains("CrashLoopBackOff"))
            })
        },
    )
    .await?;
    ensure!(status["status"] == "NotReady", "{status}");
    let m = members(&status);
    ensure!(m["tray-1"].3 == "NotReady", "{status}");
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), WORK);
    let failed = until("c1 IMEXDaemonFailed", TIMEOUT, || async {
        let c = claims.get("c1").await.map_err(|e| e.to_string())?;
        Ok(channel_condition(&c, "IMEXDaemonFailed"))
    })
    .await?;
    ensure!(
        failed.0 == "True" && failed.2.contains("NV_ERR_IN_USE"),
        "{failed:?}"
    );
    let events = until("a DaemonNotStarting Warning", TIMEOUT, || async {
        let w = warnings(&client, "job", "DaemonNotStarting").await?;
        Ok((!w.is_empty()).then_some(w))
    })
    .await?;
    ensure!(events[0].contains("tray-1"), "{events:?}");
    // tray-0's claim is unaffected.
    let c0 = until("c0 IMEXDaemonReady", TIMEOUT, || async {
        let c = claims.get("c0").await.map_err(|e| e.to_string())?;
        Ok(channel_condition(&c, "IMEXDaemonReady"))
    })
    .await?;
    ensure!(c0.0 == "True", "{c0:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn nvidia_compatibility_mode_serves_resource_nvidia_com_compute_domains() -> anyhow::Result<()>
{
    let (cp, client) = start(ControlPlaneOptions::default()).await?;
    let dir = tempfile::tempdir()?;
    let nodes = names("tray", 2);
    paper_nodes(&cp, &client, &nodes, |_| Some(CLIQUE_A)).await?;
    let _kubelet = PaperKubelet::start(&client);
    let controller = Controller::start(&cp, "nvidia", dir.path())?;
    create_domain(&client, "ignored", "ignored-channel", 0).await?;
    // NVIDIA's documented shape (numNodes omitted: deprecated and optional).
    let api = nvidia_domain_api(&client, WORK);
    let cd: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain",
        "metadata": {"name": "imex-channel-injection", "namespace": WORK},
        "spec": {"channel": {"resourceClaimTemplate": {"name": "imex-channel-0"}}},
    }))?;
    let cd = api.create(&PostParams::default(), &cd).await?;
    let uid = cd.uid().unwrap_or_default();
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), WORK);
    let t = until("template imex-channel-0", TIMEOUT, || async {
        templates
            .get_opt("imex-channel-0")
            .await
            .map_err(|e| e.to_string())
    })
    .await?;
    let t = serde_json::to_value(&t)?;
    let p = &t["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"];
    ensure!(p["apiVersion"] == "resource.nvidia.com/v1beta1", "{p}");
    ensure!(
        p["kind"] == "ComputeDomainChannelConfig" && p["domainID"] == json!(uid),
        "{p}"
    );
    ensure!(
        t["metadata"]["ownerReferences"][0]["apiVersion"] == "resource.nvidia.com/v1beta1",
        "{t}"
    );
    create_pod(&client, "worker", "imex-channel-0", None).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), WORK);
    until("worker bound", TIMEOUT, || async {
        let p = pods.get("worker").await.map_err(|e| e.to_string())?;
        Ok(p.spec.and_then(|s| s.node_name))
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e}\ncontroller log:\n{}", controller.log_text()))?;
    let status = until("the NVIDIA domain Ready", TIMEOUT, || async {
        let cd = api
            .get("imex-channel-injection")
            .await
            .map_err(|e| e.to_string())?;
        let s = cd.data["status"].clone();
        if s["status"] == "Ready" {
            Ok(Some(s))
        } else {
            Err(s.to_string())
        }
    })
    .await?;
    let m = members(&status);
    ensure!(
        m.len() == 1 && m.values().all(|n| n.0 == 0 && n.1 == CLIQUE_A),
        "{status}"
    );
    // drust's API is not served by this controller: the drust domain created before the
    // NVIDIA one, which the controller has since served, got nothing.
    ensure!(templates.get_opt("ignored-channel").await?.is_none());
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_node_leaving_mid_job_frees_its_index_and_daemon_and_nothing_else() -> anyhow::Result<()>
{
    let (cp, client) = start(ControlPlaneOptions::default()).await?;
    let dir = tempfile::tempdir()?;
    let nodes = names("tray", 4);
    paper_nodes(&cp, &client, &nodes, |_| Some(CLIQUE_A)).await?;
    let _kubelet = PaperKubelet::start(&client);
    let _controller = Controller::start(&cp, "drust", dir.path())?;
    let cd = create_domain(&client, "job", "job-channel", 0).await?;
    let uid = cd.uid().unwrap_or_default();
    for (i, node) in nodes.iter().take(3).enumerate() {
        allocated_claim(&client, &format!("c{i}"), &uid, node).await?;
    }
    let before = members(
        &wait_status(&client, "job", "3 members Ready", |s| {
            members(s).len() == 3 && s["status"] == "Ready"
        })
        .await?,
    );
    // tray-1's claim goes (its pods ended, the claim was deallocated and deleted).
    Api::<ResourceClaim>::namespaced(client.clone(), WORK)
        .delete("c1", &DeleteParams::default())
        .await?;
    let after = members(
        &wait_status(&client, "job", "tray-1 gone", |s| {
            !members(s).contains_key("tray-1") && members(s).len() == 2
        })
        .await?,
    );
    for n in ["tray-0", "tray-2"] {
        ensure!(after[n].0 == before[n].0, "{n}: {before:?} -> {after:?}");
    }
    until("tray-1's daemon deleted", TIMEOUT, || async {
        let pods = daemon_pods(&client, &uid).await?;
        let on_tray_1 = pods.iter().any(|p| {
            p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some("tray-1")
                && p.metadata.deletion_timestamp.is_none()
        });
        Ok((!on_tray_1 && pods.len() >= 2).then_some(()))
    })
    .await?;
    // A new node takes the freed index; the others keep theirs.
    allocated_claim(&client, "c3", &uid, "tray-3").await?;
    let last = members(
        &wait_status(&client, "job", "tray-3 listed", |s| {
            members(s).contains_key("tray-3") && s["status"] == "Ready"
        })
        .await?,
    );
    ensure!(
        last["tray-3"].0 == before["tray-1"].0,
        "{before:?} -> {last:?}"
    );
    for n in ["tray-0", "tray-2"] {
        ensure!(last[n].0 == before[n].0, "{n}: {before:?} -> {last:?}");
    }
    Ok(())
}
