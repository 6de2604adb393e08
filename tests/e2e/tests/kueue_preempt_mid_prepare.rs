//! A pod preempted by Kueue while drust is still preparing its claim: nothing stays prepared.
//!
//! On a real node (fake DGX H100, 8 GPUs) with Kueue and `examples/kueue/preemption.yaml`'s
//! ClusterQueue (quota 8 GPUs, preemption of lower priority), the plugin runs with its
//! `prepare/after-hardware` failpoint held ([`dra_plugin::failpoint`], `hold=<file>`): the first
//! prepare stops after its device step, before its CDI spec and checkpoint record, until the
//! test creates the file. Then:
//! - a low-priority Job of two GPUs is admitted, its pod bound, its claim allocated, and its
//!   prepare held (the plugin says so in its log);
//! - a high-priority Job of all 8 GPUs makes Kueue evict the low Job: its Workload is
//!   `Evicted`, the Job suspended, and its pod deleted while the kubelet's prepare call is in
//!   flight;
//! - the prepare goes on (the test creates the file) and completes; the kubelet, killing the
//!   pod, unprepares the claim: its CDI spec and checkpoint record go, the plugin logs the
//!   unprepare of that claim, and the claim is deleted;
//! - the high Job's pod runs with all eight GPUs, the two the low claim held among them.
//!
//! Every step waits for a state the API server or the node shows; the failpoint holds until the
//! test has seen the pod's deletion, so the kill always lands mid-prepare.

use std::time::Duration;

use anyhow::{Context, ensure};
use drust_e2e::host::{BinaryHost, PluginProcess, stop};
use drust_e2e::kueue::{self, Kueue, condition, held_job, job_pods, wait_workload};
use drust_e2e::manifests::{apply_file, apply_yaml, documents_where, repo_path};
use drust_e2e::node::{Node, NodeOptions};
use drust_e2e::node_pods::wait_pod_done;
use drust_e2e::wait::until;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{ListParams, PostParams};

const DRIVER: &str = "gpu.drust.dev";
const NODE: &str = "gpu-node-0";
const NAMESPACE: &str = "default";
/// Every wait. Generous: Kueue, the kubelet and the plugin on a loaded 2-core machine.
const TIMEOUT: Duration = Duration::from_secs(180);
const EXAMPLE: &str = "examples/kueue/preemption.yaml";
/// The step the first prepare stops at: its GPUs checked, nothing of it durable yet.
const FAILPOINT: &str = "prepare/after-hardware";

#[tokio::test]
async fn a_pod_preempted_while_its_claim_is_being_prepared_leaves_nothing_prepared()
-> anyhow::Result<()> {
    let began = std::time::Instant::now();
    let mut options = ControlPlaneOptions::default();
    options.apiserver_args.extend(kueue::apiserver_args());
    let cp = ControlPlane::start(options).await?;
    let client = cp.client().await?;
    let node = Node::start(&cp, NODE, NodeOptions::default()).await?;
    let topology = repo_path("examples/topologies/dgx-h100.yaml");
    let host = BinaryHost::new("drust-kpm-", cp.kubeconfig_path(), &topology, DRIVER, NODE)?
        .on_node(&node);
    host.make_device_nodes()?;
    let go_on = host.root().join("go-on");
    let plugin_log = host.root().join("plugin.log");
    let plugin = PluginProcess(
        host.command(
            &plugin_log,
            Some(&format!("{FAILPOINT}:hold={}", go_on.display())),
        )?
        .spawn()
        .context("spawning gpu-kubelet-plugin")?,
    );
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    until("the node's ResourceSlices", TIMEOUT, || async {
        let published = slices
            .list(&ListParams::default().fields(&format!("spec.nodeName={NODE}")))
            .await
            .map_err(|e| e.to_string())?;
        Ok((!published.items.is_empty()).then_some(()))
    })
    .await?;
    apply_file(&client, &repo_path("deploy/deviceclasses/gpu.yaml")).await?;
    let job_example = std::fs::read_to_string(repo_path("examples/kueue/job.yaml"))?;
    apply_yaml(
        &client,
        &documents_where(&job_example, |d| d["kind"] == "ResourceClaimTemplate")?,
        &repo_path("examples/kueue/job.yaml"),
    )
    .await?;

    let kueue = Kueue::start(&cp, &repo_path("examples/kueue/kueue-config.yaml")).await?;
    apply_file(&client, &repo_path("examples/kueue/queues.yaml")).await?;
    let example = std::fs::read_to_string(repo_path(EXAMPLE))?;
    apply_yaml(
        &client,
        &documents_where(&example, |d| d["kind"] != "Job")?,
        &repo_path(EXAMPLE),
    )
    .await?;
    kueue::wait_cluster_queue_active(&client, "dgx", TIMEOUT).await?;
    eprintln!("[{:?}] node, plugin and Kueue up", began.elapsed());

    let release = host.root().join("release");
    std::fs::create_dir_all(&release)?;
    let jobs: Api<Job> = Api::namespaced(client.clone(), NAMESPACE);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NAMESPACE);

    // The low Job: job.yaml's two-GPU Job in the example's queue, at low priority.
    let mut low = held_job(&job_example, "train", "low", &release)?;
    let labels = low.metadata.labels.get_or_insert_default();
    labels.insert(kueue::QUEUE_LABEL.to_owned(), "dgx".to_owned());
    labels.insert("kueue.x-k8s.io/priority-class".to_owned(), "low".to_owned());
    let low = jobs.create(&PostParams::default(), &low).await?;
    wait_workload(&client, &low, "Admitted", TIMEOUT, |c| c.status == "True")
        .await
        .with_context(|| kueue.log_tail())?;
    let low_pod = until("the low Job's pod bound", TIMEOUT, || async {
        let found = job_pods(&pods, "low").await.map_err(|e| e.to_string())?;
        Ok(found.into_iter().find(|p| {
            p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(NODE)
                && p.status
                    .as_ref()
                    .and_then(|s| s.resource_claim_statuses.as_ref())
                    .is_some_and(|c| !c.is_empty())
        }))
    })
    .await?;
    let low_pod_name = low_pod.metadata.name.clone().unwrap_or_default();
    let claim_name = drust_e2e::node_pods::pod_claim_name(&low_pod)?;
    let claim = claims.get(&claim_name).await?;
    let claim_uid = claim.metadata.uid.clone().unwrap_or_default();
    let low_devices: Vec<String> = drust_e2e::claims::allocation_results(&claim)
        .context("the low claim is allocated")?
        .iter()
        .map(|r| r.device.clone())
        .collect();
    until(
        "the low claim's prepare held at the failpoint",
        TIMEOUT,
        || async {
            let log = std::fs::read_to_string(&plugin_log).map_err(|e| e.to_string())?;
            Ok(log
                .lines()
                .any(|l| l.contains("failpoint armed: holding"))
                .then_some(()))
        },
    )
    .await?;
    ensure!(
        !host.claim_spec(&claim_uid).exists(),
        "the held prepare has written no CDI spec yet"
    );
    eprintln!(
        "[{:?}] low's pod {low_pod_name} bound, claim {claim_name} ({low_devices:?}) held mid-prepare",
        began.elapsed()
    );

    // The high Job: Kueue evicts the low one, whose pod is deleted mid-prepare.
    let urgent = jobs
        .create(
            &PostParams::default(),
            &held_job(&example, "urgent", "urgent", &release)?,
        )
        .await?;
    let (_, evicted) = wait_workload(&client, &low, "Evicted", TIMEOUT, |c| c.status == "True")
        .await
        .with_context(|| kueue.log_tail())?;
    eprintln!("low evicted: {}: {}", evicted.reason, evicted.message);
    until("the low pod deleted", TIMEOUT, || async {
        let pod = pods
            .get_opt(&low_pod_name)
            .await
            .map_err(|e| e.to_string())?;
        Ok(pod
            .is_none_or(|p| p.metadata.deletion_timestamp.is_some())
            .then_some(()))
    })
    .await?;
    ensure!(
        !host.claim_spec(&claim_uid).exists(),
        "the prepare is still held when the pod is deleted"
    );
    eprintln!(
        "[{:?}] low's pod deleted mid-prepare; the prepare goes on",
        began.elapsed()
    );
    std::fs::write(&go_on, "")?;

    // Nothing of the low claim stays prepared, and the high Job gets every GPU.
    let has_line = |pred: &dyn Fn(&str) -> bool| -> Result<bool, String> {
        let log = std::fs::read_to_string(&plugin_log).map_err(|e| e.to_string())?;
        Ok(log.lines().any(pred))
    };
    until("the held prepare released", TIMEOUT, || async {
        Ok(has_line(&|l| l.contains("failpoint released"))?.then_some(()))
    })
    .await?;
    until("the low claim unprepared", TIMEOUT, || async {
        let unprepared = has_line(&|l| {
            l.contains(" unprepared") && (l.contains(&claim_uid) || l.contains(&claim_name))
        })?;
        let spec = host.claim_spec(&claim_uid).exists();
        let record = host.has_record(&claim_uid).map_err(|e| e.to_string())?;
        Ok((unprepared && !spec && !record).then_some(()))
    })
    .await
    .with_context(|| plugin_tail(&plugin_log))?;
    for line in std::fs::read_to_string(&plugin_log)?
        .lines()
        .filter(|l| l.contains(&claim_name) || l.contains(&claim_uid) || l.contains("failpoint"))
    {
        eprintln!("plugin: {line}");
    }
    until("the low claim deleted", TIMEOUT, || async {
        Ok(claims
            .get_opt(&claim_name)
            .await
            .map_err(|e| e.to_string())?
            .is_none()
            .then_some(()))
    })
    .await?;
    wait_workload(&client, &urgent, "Admitted", TIMEOUT, |c| {
        c.status == "True"
    })
    .await?;
    let urgent_pod = kueue::wait_job_pod_running(&pods, "urgent", &node, TIMEOUT).await?;
    let urgent_claim = claims
        .get(&drust_e2e::node_pods::pod_claim_name(&urgent_pod)?)
        .await?;
    let urgent_devices: Vec<String> = drust_e2e::claims::allocation_results(&urgent_claim)
        .context("the urgent claim is allocated")?
        .iter()
        .map(|r| r.device.clone())
        .collect();
    ensure!(
        urgent_devices.len() == 8 && low_devices.iter().all(|d| urgent_devices.contains(d)),
        "urgent holds all eight GPUs, low's {low_devices:?} among them: {urgent_devices:?}"
    );
    let low_workload = kueue::workload_of(
        &client,
        NAMESPACE,
        &low.metadata.uid.clone().unwrap_or_default(),
    )
    .await?
    .context("low's Workload")?;
    ensure!(
        condition(&low_workload, "Admitted").is_none_or(|c| c.status != "True"),
        "low waits in Kueue while urgent runs"
    );
    std::fs::write(release.join("urgent"), "")?;
    wait_pod_done(
        &pods,
        &urgent_pod.metadata.name.clone().unwrap_or_default(),
        &node,
    )
    .await?;
    eprintln!("[{:?}] done", began.elapsed());
    kueue.stop().await?;
    stop(plugin).await?;
    node.stop().await?;
    cp.stop().await?;
    Ok(())
}

/// The last lines of the plugin's log, for failure messages.
fn plugin_tail(log: &std::path::Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}
