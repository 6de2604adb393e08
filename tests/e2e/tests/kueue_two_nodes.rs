//! Kueue's quota over two real nodes, and Kueue going down and coming back
//! ([`drust_e2e::cluster`], [`drust_e2e::kueue`]).
//!
//! Two real nodes of 4 L40S each, `examples/kueue/` applied with the ClusterQueue's
//! `drust.dev/gpu` quota raised to 8 (both nodes' GPUs). Each Job runs two pods of two GPUs.
//! What the API server stores is the verdict throughout:
//! - two Jobs are admitted, charged 4 each, and their four pods run: two on each node (no node
//!   has room for a third), every claim allocated from its pod's node, eight different GPUs,
//!   each container seeing exactly its two;
//! - a third Job waits in Kueue: its Workload says the `drust.dev/gpu` quota is used up, it stays
//!   suspended and has no pod;
//! - Kueue's manager stops (its pod gone, as in an outage): a Job created now is refused by the
//!   API server, naming Kueue's webhook, so nothing half-exists; the first Job finishes and frees
//!   its GPUs, and the third still waits, suspended with no pod (nobody admits it), while the
//!   second runs on;
//! - Kueue comes back: the second Job's pods are the same pods, never restarted, its Workload
//!   still admitted; the third Job is admitted and runs on the GPUs the first freed; the Job
//!   refused during the outage, submitted again, waits for quota, and runs when the second
//!   finishes.
//!
//! Jobs finish when the test says so ([`kueue::held_job`]), so no verdict depends on how long a
//! step takes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, ensure};
use drust_e2e::cluster::{Cluster, ClusterOptions, DRIVER, NodeGroup};
use drust_e2e::kueue::{self, Kueue, condition, held_job, job_pods, resource_usage, wait_workload};
use drust_e2e::manifests::{apply_yaml, repo_path};
use drust_e2e::node_pods::{
    seen, succeeded, terminated_message, wait_pod_done, wait_running, whole_gpus_view,
};
use drust_e2e::plugin::fake_gpus;
use drust_e2e::wait::until;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use kube::api::PostParams;

const L40S: &str = "examples/topologies/pcie-l40s.yaml";
const NAMESPACE: &str = "default";
/// Every wait. Generous: two kubelets and Kueue on a loaded 2-core machine.
const TIMEOUT: Duration = Duration::from_secs(180);
const JOB_EXAMPLE: &str = "examples/kueue/job.yaml";
/// Two GPUs of any product (the nodes have L40S; the example's template asks for H100s).
const TEMPLATE: &str = "apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\n\
    metadata: {name: two-gpus, namespace: default}\n\
    spec: {spec: {devices: {requests: [{name: gpus, exactly: \
    {deviceClassName: gpu.drust.dev, count: 2}}]}}}\n";
/// The quota: every GPU of both nodes.
const QUOTA: i64 = 8;

#[tokio::test]
async fn kueue_quota_spans_two_nodes_and_queued_jobs_survive_kueue_going_down() -> anyhow::Result<()>
{
    let began = std::time::Instant::now();
    let mut options = ClusterOptions::default().real(NodeGroup::new("gpu-node-", 2, L40S));
    options
        .control_plane
        .apiserver_args
        .extend(kueue::apiserver_args());
    let cluster = Cluster::start(options).await?;
    let client = cluster.client().clone();
    let mut kueue =
        Kueue::start(cluster.cp(), &repo_path("examples/kueue/kueue-config.yaml")).await?;
    eprintln!(
        "[{:?}] cluster and kueue {} up",
        began.elapsed(),
        kueue.version()
    );

    let queues = "examples/kueue/queues.yaml";
    apply_yaml(
        &client,
        &with_gpu_quota(&std::fs::read_to_string(repo_path(queues))?, QUOTA)?,
        &repo_path(queues),
    )
    .await?;
    kueue::wait_cluster_queue_active(&client, "training", TIMEOUT).await?;
    apply_yaml(&client, TEMPLATE, Path::new("two-gpus template")).await?;

    let example = std::fs::read_to_string(repo_path(JOB_EXAMPLE))?;
    let release = tempfile::Builder::new()
        .prefix("drust-kueue-release-")
        .tempdir()?;
    let job = |name: &str| two_pod_job(&example, name, release.path());
    let jobs: Api<Job> = Api::namespaced(client.clone(), NAMESPACE);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NAMESPACE);
    let gpus = fake_gpus(&repo_path(L40S)).map_err(anyhow::Error::msg)?;

    // Within quota: 4 + 4 of 8. Four pods of two GPUs fill both 4-GPU nodes.
    let mut running = BTreeMap::new();
    for name in ["train-a", "train-b"] {
        let created = jobs.create(&PostParams::default(), &job(name)?).await?;
        let (workload, _) = wait_workload(&client, &created, "Admitted", TIMEOUT, |c| {
            c.status == "True"
        })
        .await
        .with_context(|| kueue.log_tail())?;
        let usage = resource_usage(&workload);
        eprintln!("{name}: admitted, charged {usage:?}");
        ensure!(
            usage
                .values()
                .any(|u| u.get("drust.dev/gpu").map(String::as_str) == Some("4")),
            "{name} is charged 4 of drust.dev/gpu: {usage:?}"
        );
        running.insert(
            name,
            wait_job_running(&cluster, &pods, &claims, name).await?,
        );
    }
    let mut per_node: BTreeMap<&str, usize> = BTreeMap::new();
    let mut all_devices = BTreeSet::new();
    for placed in running.values().flatten() {
        *per_node.entry(placed.node.as_str()).or_default() += 1;
        for d in &placed.devices {
            ensure!(
                all_devices.insert((placed.node.clone(), d.clone())),
                "GPU {d} of {} held twice",
                placed.node
            );
        }
    }
    eprintln!("pods per node: {per_node:?}");
    ensure!(
        per_node == BTreeMap::from([("gpu-node-0", 2), ("gpu-node-1", 2)]),
        "two pods on each node: {per_node:?}"
    );

    // Over quota: the third Job waits in Kueue, with no pod.
    let third = jobs
        .create(&PostParams::default(), &job("train-c")?)
        .await?;
    let (_, why) = wait_workload(&client, &third, "QuotaReserved", TIMEOUT, |c| {
        c.status == "False" && c.message.contains("insufficient unused quota")
    })
    .await?;
    eprintln!("train-c waits in Kueue: {}", why.message);
    ensure!(
        why.message.contains("drust.dev/gpu"),
        "the wait names the GPU quota: {why:?}"
    );
    ensure_waiting(&client, &jobs, &pods, &third).await?;

    // Kueue down.
    kueue.stop_manager().await?;
    eprintln!("[{:?}] kueue's manager stopped", began.elapsed());
    let refused = jobs
        .create(&PostParams::default(), &job("train-d")?)
        .await
        .err()
        .context("a Job created while Kueue is down is refused")?;
    eprintln!("train-d while Kueue is down: {refused}");
    ensure!(
        refused.to_string().contains("failed calling webhook")
            && refused.to_string().contains("kueue"),
        "the refusal names Kueue's webhook: {refused}"
    );
    ensure!(
        jobs.get_opt("train-d").await?.is_none(),
        "nothing of train-d exists"
    );
    std::fs::write(release.path().join("train-a"), "")?;
    let train_a = running.remove("train-a").unwrap_or_default();
    let freed: BTreeSet<(String, String)> = train_a.iter().flat_map(Placed::gpus).collect();
    for placed in train_a {
        let done = wait_pod_done(&pods, &placed.pod, cluster_node(&cluster, &placed.node)?).await?;
        check_container_saw(&done, &placed, &gpus)?;
    }
    eprintln!("train-a finished while Kueue is down");
    ensure_waiting(&client, &jobs, &pods, &third).await?;
    let before: Vec<(String, Option<String>)> = running["train-b"]
        .iter()
        .map(|p| (p.pod.clone(), p.uid.clone()))
        .collect();

    // Kueue back: nothing lost, the queue moves.
    kueue.restart(cluster.cp()).await?;
    eprintln!("[{:?}] kueue's manager back", began.elapsed());
    let b = jobs.get("train-b").await?;
    wait_workload(&client, &b, "Admitted", TIMEOUT, |c| c.status == "True").await?;
    for (pod, uid) in &before {
        let now = pods.get(pod).await?;
        let restarts: i32 = now
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .map(|c| c.iter().map(|c| c.restart_count).sum())
            .unwrap_or_default();
        ensure!(
            now.metadata.uid == *uid
                && now.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                && restarts == 0,
            "train-b's pod {pod} runs on, unrestarted: {:?}",
            now.status
        );
    }
    wait_workload(&client, &third, "Admitted", TIMEOUT, |c| c.status == "True")
        .await
        .with_context(|| kueue.log_tail())?;
    let c_pods = wait_job_running(&cluster, &pods, &claims, "train-c").await?;
    eprintln!("train-c runs after Kueue's return: {c_pods:?}");
    let taken: BTreeSet<(String, String)> = c_pods.iter().flat_map(Placed::gpus).collect();
    ensure!(
        taken == freed,
        "train-c holds the GPUs train-a freed: {taken:?}, freed {freed:?}"
    );
    running.insert("train-c", c_pods);
    let fourth = jobs
        .create(&PostParams::default(), &job("train-d")?)
        .await?;
    wait_workload(&client, &fourth, "QuotaReserved", TIMEOUT, |c| {
        c.status == "False" && c.message.contains("insufficient unused quota")
    })
    .await?;
    ensure_waiting(&client, &jobs, &pods, &fourth).await?;

    std::fs::write(release.path().join("train-b"), "")?;
    for placed in running.remove("train-b").unwrap_or_default() {
        let done = wait_pod_done(&pods, &placed.pod, cluster_node(&cluster, &placed.node)?).await?;
        check_container_saw(&done, &placed, &gpus)?;
    }
    wait_workload(&client, &fourth, "Admitted", TIMEOUT, |c| {
        c.status == "True"
    })
    .await?;
    running.insert(
        "train-d",
        wait_job_running(&cluster, &pods, &claims, "train-d").await?,
    );
    for (name, placed) in std::mem::take(&mut running) {
        std::fs::write(release.path().join(name), "")?;
        for p in placed {
            let done = wait_pod_done(&pods, &p.pod, cluster_node(&cluster, &p.node)?).await?;
            check_container_saw(&done, &p, &gpus)?;
        }
    }
    eprintln!("[{:?}] all Jobs done", began.elapsed());
    kueue.stop().await?;
    cluster.stop().await?;
    Ok(())
}

/// `queues` (the text of `examples/kueue/queues.yaml`) with the ClusterQueue's
/// `drust.dev/gpu` nominal quota set to `quota`.
fn with_gpu_quota(queues: &str, quota: i64) -> anyhow::Result<String> {
    let mut out = Vec::new();
    let mut set = false;
    for doc in queues.split("\n---\n") {
        let mut value: serde_yaml_ng::Value = serde_yaml_ng::from_str(doc)?;
        if value["kind"] == "ClusterQueue" {
            for group in value["spec"]["resourceGroups"]
                .as_sequence_mut()
                .into_iter()
                .flatten()
            {
                for flavor in group["flavors"].as_sequence_mut().into_iter().flatten() {
                    for resource in flavor["resources"].as_sequence_mut().into_iter().flatten() {
                        if resource["name"] == "drust.dev/gpu" {
                            resource["nominalQuota"] = quota.into();
                            set = true;
                        }
                    }
                }
            }
        }
        out.push(serde_yaml_ng::to_string(&value)?);
    }
    ensure!(set, "the ClusterQueue has a drust.dev/gpu quota");
    Ok(out.join("---\n"))
}

/// The example's Job named `name`: two pods at once (parallelism = completions = 2), each with
/// a claim of the `two-gpus` template, held until the test releases it.
fn two_pod_job(example: &str, name: &str, release: &Path) -> anyhow::Result<Job> {
    let mut job = held_job(example, "train", name, release)?;
    let spec = job.spec.as_mut().context("the Job's spec")?;
    spec.parallelism = Some(2);
    spec.completions = Some(2);
    let pod = spec.template.spec.as_mut().context("the pod template")?;
    for claim in pod.resource_claims.iter_mut().flatten() {
        claim.resource_claim_template_name = Some("two-gpus".to_owned());
    }
    Ok(job)
}

/// A pod of a Job, running on a node with GPUs allocated.
#[derive(Debug, Clone)]
struct Placed {
    pod: String,
    uid: Option<String>,
    node: String,
    devices: BTreeSet<String>,
}

impl Placed {
    /// The pod's GPUs as (node, device).
    fn gpus(&self) -> impl Iterator<Item = (String, String)> + '_ {
        self.devices.iter().map(|d| (self.node.clone(), d.clone()))
    }
}

/// Waits for both pods of Job `name` to exist, be bound and run; returns where each runs and the
/// GPUs its claim holds (every result from that node's pool).
async fn wait_job_running(
    cluster: &Cluster,
    pods: &Api<Pod>,
    claims: &Api<ResourceClaim>,
    name: &str,
) -> anyhow::Result<Vec<Placed>> {
    let bound = until(&format!("both pods of {name} bound"), TIMEOUT, || async {
        let found = job_pods(pods, name).await.map_err(|e| e.to_string())?;
        let bound: Vec<Pod> = found
            .into_iter()
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some())
            .collect();
        Ok((bound.len() == 2).then_some(bound))
    })
    .await?;
    let mut placed = Vec::new();
    for pod in bound {
        let pod_name = pod.metadata.name.clone().unwrap_or_default();
        let node = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        let pod = wait_running(pods, &pod_name, cluster_node(cluster, &node)?).await?;
        let claim_name = drust_e2e::node_pods::pod_claim_name(&pod)?;
        let claim = claims.get(&claim_name).await?;
        let results = drust_e2e::claims::allocation_results(&claim)
            .with_context(|| format!("claim {claim_name} is allocated"))?;
        ensure!(
            results.len() == 2 && results.iter().all(|r| r.driver == DRIVER && r.pool == node),
            "claim {claim_name}: two GPUs of {node}'s pool: {results:?}"
        );
        placed.push(Placed {
            pod: pod_name,
            uid: pod.metadata.uid.clone(),
            node,
            devices: results.iter().map(|r| r.device.clone()).collect(),
        });
    }
    Ok(placed)
}

/// The real node `name` of the cluster.
fn cluster_node<'a>(cluster: &'a Cluster, name: &str) -> anyhow::Result<&'a drust_e2e::node::Node> {
    Ok(cluster
        .real(name)
        .with_context(|| format!("{name} is a real node"))?
        .node())
}

/// `job` waits in Kueue: not admitted, suspended, no pod.
async fn ensure_waiting(
    client: &kube::Client,
    jobs: &Api<Job>,
    pods: &Api<Pod>,
    job: &Job,
) -> anyhow::Result<()> {
    let name = job.metadata.name.clone().unwrap_or_default();
    let uid = job.metadata.uid.clone().unwrap_or_default();
    let workload = kueue::workload_of(client, NAMESPACE, &uid)
        .await?
        .with_context(|| format!("{name}'s Workload"))?;
    ensure!(
        condition(&workload, "Admitted").is_none_or(|c| c.status != "True"),
        "{name} is not admitted"
    );
    ensure!(
        jobs.get(&name).await?.spec.and_then(|s| s.suspend) == Some(true),
        "{name} stays suspended"
    );
    ensure!(
        job_pods(pods, &name).await?.is_empty(),
        "no pod exists for {name} while it waits"
    );
    Ok(())
}

/// `pod` (completed) succeeded and its container saw exactly its GPUs' device nodes (besides the
/// control nodes) and their variables.
fn check_container_saw(
    pod: &Pod,
    placed: &Placed,
    gpus: &[gpu_inventory::Gpu],
) -> anyhow::Result<()> {
    let log = terminated_message(pod, "train").unwrap_or_default();
    ensure!(
        succeeded(pod),
        "{}'s pod failed: {:?}\n{log}",
        placed.pod,
        pod.status
    );
    let want = whole_gpus_view(gpus, &placed.devices)?;
    let saw = seen(&log);
    ensure!(
        saw == want,
        "{} on {}: saw {saw:?}, want {want:?}",
        placed.pod,
        placed.node
    );
    Ok(())
}
