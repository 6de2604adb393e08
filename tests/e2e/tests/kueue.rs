//! Kueue in front of drust, as a user runs it ([`drust_e2e::kueue`]: the release's manager with
//! its chart's CRDs, webhooks and RBAC), on a real node with the fake DGX H100 (8 GPUs), with
//! `examples/kueue/` applied as it is:
//! - a plain `batch/v1` Job with the queue label comes back suspended from its create: Kueue's
//!   mutating webhook, reached through its Service, did that;
//! - the ClusterQueue's quota is 4 of `drust.dev/gpu`: two Jobs of 2 GPUs each are admitted,
//!   charged 2 each, and their pods run with the GPUs the scheduler allocated (the claims the API
//!   server stores, and the device nodes and variables each container saw);
//! - a third Job waits in Kueue, with 4 GPUs of the node free: its Workload has no quota
//!   reserved and says why, the Job stays suspended and no pod exists; when the first Job
//!   finishes, it is admitted and runs;
//! - what Kueue refuses for drust claims, each with the message Kueue gives (printed, and
//!   checked by its key phrase): a DeviceClass missing from `deviceClassMappings` (the
//!   `hopper-or-newer` example's), a claim named directly (`resourceClaimName`), `firstAvailable`,
//!   `allocationMode: All`; and what it ignores: a constraint no two GPUs meet is admitted and
//!   charged, and its pod stays Unschedulable;
//! - shares (the plugin restarted with `--consumable-capacity`): a share of
//!   `gpu-share.drust.dev` is refused, "0 device(s) match", with 8 shareable GPUs published
//!   (Kueue evaluates the class's `device.allowMultipleAllocations` on devices without that
//!   field); through the workaround class of `examples/kueue/shares.yaml`, two 20Gi shares are
//!   admitted, charged 20Gi each of `drust.dev/gpu-memory` (quota 40Gi), and run as 20Gi shares;
//!   the third waits in Kueue with no pod.
//!
//! Jobs finish when the test says so: each container waits for a file named after its Job in a
//! hostPath directory, so no verdict depends on how long a step takes.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, ensure};
use drust_e2e::host::{BinaryHost, PluginProcess, stop};
use drust_e2e::kueue::{self, Kueue, condition, job_pods, resource_usage};
use drust_e2e::manifests::{apply_file, apply_yaml, documents_where, repo_path};
use drust_e2e::node::{Node, NodeOptions};
use drust_e2e::node_pods::{seen, succeeded, terminated_message, wait_pod_done, whole_gpus_view};
use drust_e2e::wait::until;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{DynamicObject, ListParams, PostParams};

const DRIVER: &str = "gpu.drust.dev";
/// The fake driver for the shares' MPS daemon (the topology's version).
const DRIVER_VERSION: &str = "570.124.06";
const NODE: &str = "gpu-node-0";
const NAMESPACE: &str = "default";
/// Every wait: Kueue admits within a second or two; the pods start in a few.
const TIMEOUT: Duration = Duration::from_secs(120);
/// The Job example; its ResourceClaimTemplate asks for 2 H100s.
const JOB_EXAMPLE: &str = "examples/kueue/job.yaml";

#[tokio::test]
async fn kueue_admits_drust_gpu_jobs_within_quota_queues_the_next_and_refuses_what_it_cannot_count()
-> anyhow::Result<()> {
    let began = std::time::Instant::now();
    let mut options = ControlPlaneOptions::default();
    options.apiserver_args.extend(kueue::apiserver_args());
    let cp = ControlPlane::start(options).await?;
    let client = cp.client().await?;
    let node = Node::start(&cp, NODE, NodeOptions::default()).await?;
    let topology = repo_path("examples/topologies/dgx-h100.yaml");
    let host = BinaryHost::new(
        "drust-kueue-",
        cp.kubeconfig_path(),
        &topology,
        DRIVER,
        NODE,
    )?
    .on_node(&node);
    host.make_device_nodes()?;
    let plugin = PluginProcess(
        host.command(&host.root().join("plugin.log"), None)?
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
    for class in ["gpu", "gpu-extended", "gpu-share", "mig"] {
        apply_file(
            &client,
            &repo_path(&format!("deploy/deviceclasses/{class}.yaml")),
        )
        .await?;
    }

    let kueue = Kueue::start(&cp, &repo_path("examples/kueue/kueue-config.yaml")).await?;
    eprintln!(
        "[{:?}] kueue {} started in {:?}",
        began.elapsed(),
        kueue.version(),
        kueue.startup()
    );
    apply_file(&client, &repo_path("examples/kueue/queues.yaml")).await?;
    kueue::wait_cluster_queue_active(&client, "training", TIMEOUT).await?;

    let example = std::fs::read_to_string(repo_path(JOB_EXAMPLE))?;
    apply_yaml(
        &client,
        &documents_where(&example, |d| d["kind"] == "ResourceClaimTemplate")?,
        &repo_path(JOB_EXAMPLE),
    )
    .await?;
    let release = host.root().join("release");
    std::fs::create_dir_all(&release)?;
    let jobs: Api<Job> = Api::namespaced(client.clone(), NAMESPACE);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NAMESPACE);

    // A plain Job, created without `suspend`, comes back suspended: Kueue's webhook.
    let mut admitted = Vec::new();
    for name in ["train-a", "train-b"] {
        let job = example_job(&example, name, &release, None)?;
        ensure!(
            job.spec.as_ref().and_then(|s| s.suspend).is_none(),
            "the Job as sent leaves suspend unset"
        );
        let created = jobs.create(&PostParams::default(), &job).await?;
        ensure!(
            created.spec.as_ref().and_then(|s| s.suspend) == Some(true),
            "Kueue's webhook suspends {name} on create: {:?}",
            created.spec
        );
        let workload = wait_workload(&client, &created, "Admitted", |c| c.status == "True")
            .await
            .with_context(|| kueue.log_tail())?;
        let usage = resource_usage(&workload.0);
        eprintln!("{name}: admitted, charged {usage:?}");
        ensure!(
            usage
                .values()
                .any(|u| u.get("drust.dev/gpu").map(String::as_str) == Some("2")),
            "{name} is charged 2 of drust.dev/gpu: {usage:?}"
        );
        let pod = wait_job_pod_running(&pods, name, &node).await?;
        let devices = allocated_gpus(&claims, &pod).await?;
        ensure!(devices.len() == 2, "{name} holds 2 GPUs: {devices:?}");
        admitted.push((name, pod, devices));
    }
    ensure!(
        admitted[0].2.is_disjoint(&admitted[1].2),
        "two Jobs, four different GPUs: {:?} and {:?}",
        admitted[0].2,
        admitted[1].2
    );

    // The quota is used up (4 of 4) while 4 of the node's 8 GPUs are free: the third Job waits
    // in Kueue, suspended, with no pod, and its Workload says why.
    let third = jobs
        .create(
            &PostParams::default(),
            &example_job(&example, "train-c", &release, None)?,
        )
        .await?;
    let (waiting, why) = wait_workload(&client, &third, "QuotaReserved", |c| {
        c.status == "False" && c.message.contains("insufficient unused quota")
    })
    .await?;
    eprintln!("train-c waits in Kueue: {}: {}", why.reason, why.message);
    ensure!(
        why.message.contains("drust.dev/gpu"),
        "the wait names the GPU quota: {why:?}"
    );
    ensure!(
        condition(&waiting, "Admitted").is_none_or(|c| c.status != "True"),
        "train-c is not admitted"
    );
    let job = jobs.get("train-c").await?;
    ensure!(
        job.spec.as_ref().and_then(|s| s.suspend) == Some(true),
        "train-c stays suspended"
    );
    ensure!(
        job_pods(&pods, "train-c").await?.is_empty(),
        "no pod exists for train-c while it waits"
    );

    // train-a finishes: its quota comes back, and train-c is admitted and runs.
    std::fs::write(release.join("train-a"), "")?;
    let (name_a, pod_a, devices_a) = admitted.remove(0);
    let done_a = wait_pod_done(&pods, &pod_name(&pod_a), &node).await?;
    check_container_saw(&done_a, name_a, &devices_a, &topology)?;
    wait_workload(&client, &third, "Admitted", |c| c.status == "True").await?;
    let pod_c = wait_job_pod_running(&pods, "train-c", &node).await?;
    let devices_c = allocated_gpus(&claims, &pod_c).await?;
    ensure!(devices_c.len() == 2, "train-c holds 2 GPUs: {devices_c:?}");
    let (name_b, pod_b, devices_b) = admitted.remove(0);
    ensure!(
        devices_c.is_disjoint(&devices_b),
        "train-c's GPUs {devices_c:?} are not train-b's {devices_b:?}"
    );
    for (name, pod, devices) in [(name_b, pod_b, devices_b), ("train-c", pod_c, devices_c)] {
        std::fs::write(release.join(name), "")?;
        let done = wait_pod_done(&pods, &pod_name(&pod), &node).await?;
        check_container_saw(&done, name, &devices, &topology)?;
    }

    eprintln!("[{:?}] quota checks done", began.elapsed());
    // What Kueue refuses: each Job stays suspended with no pod, and its Workload gets no quota,
    // with Kueue's reason.
    let refusals = refused_cases(&client).await?;
    for (name, pod_claim, expected) in refusals {
        let job = example_job(&example, name, &release, Some(pod_claim))?;
        let created = jobs.create(&PostParams::default(), &job).await?;
        let (_, why) = wait_workload(&client, &created, "QuotaReserved", |c| {
            c.status == "False" && !c.message.contains("insufficient unused quota")
        })
        .await
        .with_context(|| kueue.log_tail())?;
        eprintln!("{name}: {}: {}", why.reason, why.message);
        ensure!(
            why.message.contains(expected),
            "{name}: Kueue's message contains {expected:?}: {why:?}"
        );
        ensure!(
            jobs.get(name).await?.spec.and_then(|s| s.suspend) == Some(true)
                && job_pods(&pods, name).await?.is_empty(),
            "{name} stays suspended with no pod"
        );
    }

    // What Kueue ignores: constraints. Two GPUs that must share a UUID (no two do) are
    // admitted and charged, and the scheduler cannot place the pod: the quota is held by a
    // pod that never runs.
    apply_yaml(
        &client,
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\n\
         metadata: {name: two-gpus-one-uuid, namespace: default}\n\
         spec: {spec: {devices: {requests: [{name: gpus, exactly: \
         {deviceClassName: gpu.drust.dev, count: 2}}], \
         constraints: [{matchAttribute: gpu.drust.dev/uuid}]}}}\n",
        Path::new("two-gpus-one-uuid template"),
    )
    .await?;
    let ignored = jobs
        .create(
            &PostParams::default(),
            &example_job(
                &example,
                "ignored-constraint",
                &release,
                Some(serde_json::json!({"resourceClaimTemplateName": "two-gpus-one-uuid"})),
            )?,
        )
        .await?;
    let (workload, _) =
        wait_workload(&client, &ignored, "Admitted", |c| c.status == "True").await?;
    eprintln!(
        "ignored-constraint: admitted, charged {:?}",
        resource_usage(&workload)
    );
    let pod = until(
        "the unschedulable pod of ignored-constraint",
        TIMEOUT,
        || async {
            let found = job_pods(&pods, "ignored-constraint")
                .await
                .map_err(|e| e.to_string())?;
            let unschedulable = found.into_iter().find(|p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| {
                        c.iter().any(|c| {
                            c.type_ == "PodScheduled"
                                && c.status == "False"
                                && c.reason.as_deref() == Some("Unschedulable")
                        })
                    })
            });
            Ok(unschedulable)
        },
    )
    .await?;
    let scheduled = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "PodScheduled"))
        .and_then(|c| c.message.clone())
        .unwrap_or_default();
    eprintln!("ignored-constraint: the pod is Unschedulable: {scheduled}");
    jobs.delete("ignored-constraint", &Default::default())
        .await?;
    eprintln!("[{:?}] refusals done", began.elapsed());
    // Shares: the plugin publishes every GPU with consumable capacity, MPS enforcing the shares
    // (the fake control tool, as in real_node.rs).
    stop(plugin).await?;
    host.make_driver_root(DRIVER_VERSION)?;
    std::fs::copy(
        drust_fakes::mps_control(),
        host.driver_root().join("usr/bin/nvidia-cuda-mps-control"),
    )?;
    let plugin = PluginProcess(
        host.command(&host.root().join("plugin.log"), None)?
            .args(["--consumable-capacity", "true", "--mps-control-binary"])
            .arg(drust_fakes::mps_control())
            .spawn()
            .context("spawning gpu-kubelet-plugin")?,
    );
    until("the 8 GPUs published for sharing", TIMEOUT, || async {
        let published = slices
            .list(&ListParams::default().fields(&format!("spec.nodeName={NODE}")))
            .await
            .map_err(|e| e.to_string())?;
        let shareable = published
            .items
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .filter(|d| d.allow_multiple_allocations == Some(true))
            .count();
        match shareable {
            8 => Ok(Some(())),
            n => Err(format!("{n} devices allow multiple allocations")),
        }
    })
    .await?;

    // The workaround class of examples/kueue/shares.yaml: shares charged by memory, 40Gi of
    // quota, so two 20Gi shares run and the third waits.
    let shares_example = "examples/kueue/shares.yaml";
    let shares_text = std::fs::read_to_string(repo_path(shares_example))?;
    apply_yaml(
        &client,
        &documents_where(&shares_text, |d| d["kind"] != "Job")?,
        &repo_path(shares_example),
    )
    .await?;
    for name in ["share-a", "share-b"] {
        let created = jobs
            .create(
                &PostParams::default(),
                &example_job(&shares_text, name, &release, None)?,
            )
            .await?;
        let (workload, _) = wait_workload(&client, &created, "Admitted", |c| c.status == "True")
            .await
            .with_context(|| kueue.log_tail())?;
        let usage = resource_usage(&workload);
        eprintln!("{name}: admitted, charged {usage:?}");
        ensure!(
            usage
                .values()
                .any(|u| u.get("drust.dev/gpu-memory").map(String::as_str) == Some("20Gi")),
            "{name} is charged 20Gi of drust.dev/gpu-memory: {usage:?}"
        );
        let pod = wait_job_pod_running(&pods, name, &node).await?;
        let claim = claims
            .get(&drust_e2e::node_pods::pod_claim_name(&pod)?)
            .await?;
        let results = drust_e2e::claims::allocation_results(&claim).context("allocated")?;
        let memory = results
            .first()
            .and_then(|r| r.consumed_capacity.as_ref())
            .and_then(|c| c.get("memory"))
            .map(|q| q.0.clone());
        ensure!(
            results.len() == 1
                && results[0].share_id.is_some()
                && memory.as_deref() == Some("20Gi"),
            "{name}'s claim is a 20Gi share of one GPU: {results:?}"
        );
    }
    let third = jobs
        .create(
            &PostParams::default(),
            &example_job(&shares_text, "share-c", &release, None)?,
        )
        .await?;
    let (_, why) = wait_workload(&client, &third, "QuotaReserved", |c| {
        c.status == "False" && c.message.contains("insufficient unused quota")
    })
    .await?;
    eprintln!("share-c waits in Kueue: {}", why.message);
    ensure!(
        why.message.contains("drust.dev/gpu-memory"),
        "the wait names the memory quota: {why:?}"
    );
    ensure!(
        job_pods(&pods, "share-c").await?.is_empty(),
        "no pod exists for share-c while it waits"
    );

    // gpu-share.drust.dev: refused, with 8 shareable H100s published and two shares of them
    // admitted and running through the workaround class, whose selector differs only in not
    // testing allowMultipleAllocations.
    let fractional = "examples/fractional-gpus/h100-20gi.yaml";
    let text = std::fs::read_to_string(repo_path(fractional))?;
    apply_yaml(
        &client,
        &documents_where(&text, |d| d["kind"] == "ResourceClaimTemplate")?,
        &repo_path(fractional),
    )
    .await?;
    let refused = jobs
        .create(
            &PostParams::default(),
            &example_job(
                &example,
                "refused-share",
                &release,
                Some(serde_json::json!({"resourceClaimTemplateName": "h100-20gi"})),
            )?,
        )
        .await?;
    let (_, why) = wait_workload(&client, &refused, "QuotaReserved", |c| {
        c.status == "False" && !c.message.contains("insufficient unused quota")
    })
    .await?;
    eprintln!("refused-share: {}: {}", why.reason, why.message);
    ensure!(
        why.message
            .contains("DeviceClass gpu-share.drust.dev: 0 device(s) match"),
        "Kueue matches no device of gpu-share.drust.dev: {why:?}"
    );

    eprintln!("[{:?}] shares done", began.elapsed());
    kueue.stop().await?;
    stop(plugin).await?;
    node.stop().await?;
    cp.stop().await?;
    Ok(())
}

/// The example's Job ([`kueue::held_job`]: held until `<release>/<name>` exists) renamed
/// `name`; with `claim`, its pod claim is that instead of the example's template.
fn example_job(
    example: &str,
    name: &str,
    release: &Path,
    claim: Option<serde_json::Value>,
) -> anyhow::Result<Job> {
    let text = documents_where(example, |d| d["kind"] == "Job")?;
    let doc: serde_json::Value = serde_yaml_ng::from_str(&text)?;
    let original = doc["metadata"]["name"].as_str().context("the Job's name")?;
    let job = kueue::held_job(example, original, name, release)?;
    let Some(claim) = claim else {
        return Ok(job);
    };
    let mut job = serde_json::to_value(job)?;
    let spec = &mut job["spec"]["template"]["spec"];
    let mut claim = claim;
    claim["name"] = spec["containers"][0]["resources"]["claims"][0]["name"].clone();
    spec["resourceClaims"] = serde_json::json!([claim]);
    Ok(serde_json::from_value(job)?)
}

/// The refused cases: Job name, its pod claim, and the phrase Kueue's message must hold.
/// Applies the objects they name, from the examples where one exists.
async fn refused_cases(
    client: &kube::Client,
) -> anyhow::Result<Vec<(&'static str, serde_json::Value, &'static str)>> {
    let apply_kinds = async |file: &str, kinds: &[&str]| -> anyhow::Result<()> {
        let text = std::fs::read_to_string(repo_path(file))?;
        let picked = documents_where(&text, |d| {
            kinds.iter().any(|k| d["kind"].as_str() == Some(k))
        })?;
        apply_yaml(client, &picked, &repo_path(file)).await?;
        Ok(())
    };
    // An admin's DeviceClass that the Configuration does not map.
    apply_kinds(
        "examples/hopper-or-newer/hopper-or-newer.yaml",
        &["DeviceClass", "ResourceClaimTemplate"],
    )
    .await?;
    // A claim shared by name.
    apply_kinds("examples/gpu-sharing/gpu-sharing.yaml", &["ResourceClaim"]).await?;
    // firstAvailable.
    apply_kinds(
        "examples/h100-else-a100/h100-else-a100.yaml",
        &["ResourceClaimTemplate"],
    )
    .await?;
    // Every GPU of the node (no example asks for that).
    apply_yaml(
        client,
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\n\
         metadata: {name: all-gpus, namespace: default}\n\
         spec: {spec: {devices: {requests: [{name: gpus, exactly: \
         {deviceClassName: gpu.drust.dev, allocationMode: All}}]}}}\n",
        Path::new("all-gpus template"),
    )
    .await?;
    let template = |t: &str| serde_json::json!({"resourceClaimTemplateName": t});
    Ok(vec![
        (
            "refused-unmapped-class",
            template("one-hopper-or-newer"),
            "DeviceClass hopper-or-newer.drust.dev is not mapped",
        ),
        (
            "refused-claim-by-name",
            serde_json::json!({"resourceClaimName": "shared-gpu"}),
            "does not support use of resource claims",
        ),
        (
            "refused-first-available",
            template("h100-else-a100"),
            "FirstAvailable device selection is not supported",
        ),
        (
            "refused-allocation-mode-all",
            template("all-gpus"),
            "AllocationMode 'All' is not supported",
        ),
    ])
}

fn pod_name(pod: &Pod) -> String {
    pod.metadata.name.clone().unwrap_or_default()
}

/// Waits for Job `name`'s pod to exist, then to run on `node`.
async fn wait_job_pod_running(pods: &Api<Pod>, name: &str, node: &Node) -> anyhow::Result<Pod> {
    kueue::wait_job_pod_running(pods, name, node, TIMEOUT).await
}

/// Waits until the Workload of `job` has condition `type_` matching `ok` ([`TIMEOUT`]).
async fn wait_workload(
    client: &kube::Client,
    job: &Job,
    type_: &str,
    ok: impl Fn(&kueue::Condition) -> bool,
) -> anyhow::Result<(DynamicObject, kueue::Condition)> {
    kueue::wait_workload(client, job, type_, TIMEOUT, ok).await
}

/// The devices allocated to `pod`'s claim, as the API server stores the allocation (all from
/// this node's pool of the driver).
async fn allocated_gpus(
    claims: &Api<ResourceClaim>,
    pod: &Pod,
) -> anyhow::Result<BTreeSet<String>> {
    let claim_name = drust_e2e::node_pods::pod_claim_name(pod)?;
    let claim = claims.get(&claim_name).await?;
    let results = drust_e2e::claims::allocation_results(&claim)
        .with_context(|| format!("claim {claim_name} is allocated"))?;
    for r in results {
        ensure!(
            r.driver == DRIVER && r.pool == NODE,
            "claim {claim_name}: a device of {DRIVER} on {NODE}: {r:?}"
        );
    }
    Ok(results.iter().map(|r| r.device.clone()).collect())
}

/// `pod` (completed) succeeded, and its container saw exactly the device nodes of `devices` and
/// the control nodes, and each device's variable.
fn check_container_saw(
    pod: &Pod,
    job: &str,
    devices: &BTreeSet<String>,
    topology: &Path,
) -> anyhow::Result<()> {
    let log = terminated_message(pod, "train").unwrap_or_default();
    ensure!(
        succeeded(pod),
        "{job}'s pod failed: {:?}\n{log}",
        pod.status
    );
    let gpus = drust_e2e::plugin::fake_gpus(topology).map_err(anyhow::Error::msg)?;
    let (want_nodes, want_env) = whole_gpus_view(&gpus, devices)?;
    let (nodes, env) = seen(&log);
    eprintln!("{job} saw {nodes:?}");
    ensure!(
        nodes == want_nodes,
        "{job}: device nodes {nodes:?}, want {want_nodes:?}"
    );
    ensure!(
        env == want_env,
        "{job}: environment {env:?}, want {want_env:?}"
    );
    Ok(())
}
