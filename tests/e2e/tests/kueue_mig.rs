//! Kueue's quota for MIG through partitionable counters, on a real node: the fake PCIe node of
//! two A100 80GB with MIG on and no MIG device yet (`examples/topologies/pcie-a100-mig.yaml`),
//! published with `--mig-strategy=partitionable` (every placement a device that consumes its
//! GPU's counter set), and Kueue's release manager with `examples/kueue/kueue-config.yaml`,
//! which maps `mig.drust.dev` to `drust.dev/mig-memory` by the `memory` counter:
//! - the ClusterQueue `training` of `examples/kueue/queues.yaml`, its MIG quota lowered to 20Gi;
//!   Jobs of `examples/kueue/mig.yaml` (one `1g.10gb` each) are charged the placement's `memory`
//!   counter, 9728Mi (Kueue v0.19.2: the largest value over the devices the request matches,
//!   times the count; every `1g.10gb` consumes the same);
//! - two such Jobs run, the plugin creating a MIG device at each claim's allocated placement
//!   (the fake backend's state) which the container gets; the third waits in Kueue with no pod
//!   (1024Mi of quota left, 9728Mi needed);
//! - a request for any MIG device is charged as the largest placement (a `7g.80gb`, 81152Mi),
//!   more than the whole quota: Kueue's message says so;
//! - when the first Job finishes its MIG device is destroyed, the third is admitted and runs on a
//!   MIG device of its own, and once all are done no MIG device is left.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, ensure};
use drust_e2e::host::{BinaryHost, PluginProcess, stop};
use drust_e2e::kueue::{
    self, Kueue, held_job, job_pods, resource_usage, wait_job_pod_running, wait_workload,
};
use drust_e2e::manifests::{apply_file, apply_yaml, documents_where, repo_path};
use drust_e2e::node::{Node, NodeOptions};
use drust_e2e::node_pods::{seen, succeeded, terminated_message, wait_pod_done};
use drust_e2e::wait::until;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use gpu_inventory::backend::RawMigDevice;
use gpu_inventory::fake::mig::MigState;
use gpu_kubelet_plugin::claims::device_env;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{Device, ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{ListParams, PostParams};

const DRIVER: &str = "gpu.drust.dev";
const NODE: &str = "gpu-node-0";
const NAMESPACE: &str = "default";
const TIMEOUT: Duration = Duration::from_secs(120);
const TOPOLOGY: &str = "examples/topologies/pcie-a100-mig.yaml";
const EXAMPLE: &str = "examples/kueue/mig.yaml";
/// The ClusterQueue's MIG memory in this test: two `1g.10gb` (9728Mi each), not three.
const MIG_QUOTA: &str = "20Gi";
/// What a `1g.10gb` placement of an A100 80GB consumes of its GPU's `memory` counter.
const CHARGE_1G: &str = "9728Mi";
/// ... and a `7g.80gb`, the largest.
const CHARGE_7G: &str = "81152Mi";

#[tokio::test]
#[allow(clippy::too_many_lines)] // one scenario, step by step
async fn kueue_charges_partitionable_mig_by_its_memory_counter_and_queues_what_exceeds_the_quota()
-> anyhow::Result<()> {
    let began = std::time::Instant::now();
    let mut options = ControlPlaneOptions::default();
    options.apiserver_args.extend(kueue::apiserver_args());
    let cp = ControlPlane::start(options).await?;
    let client = cp.client().await?;
    let node = Node::start(&cp, NODE, NodeOptions::default()).await?;
    let topology = repo_path(TOPOLOGY);
    let host = BinaryHost::new(
        "drust-kueue-mig-",
        cp.kubeconfig_path(),
        &topology,
        DRIVER,
        NODE,
    )?
    .on_node(&node);
    host.make_device_nodes()?;
    let plugin = PluginProcess(
        host.command(&host.root().join("plugin.log"), None)?
            .arg("--fake-state-dir")
            .arg(host.state_dir())
            .args(["--mig-strategy", "partitionable"])
            .spawn()
            .context("spawning gpu-kubelet-plugin")?,
    );
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    // Every placement of both GPUs, and their two counter sets.
    let devices = until("the MIG placements published", TIMEOUT, || async {
        let published = slices
            .list(&ListParams::default().fields(&format!("spec.nodeName={NODE}")))
            .await
            .map_err(|e| e.to_string())?;
        let all = slices
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        let counter_sets = all
            .items
            .iter()
            .filter(|s| s.spec.pool.name == NODE)
            .flat_map(|s| s.spec.shared_counters.iter().flatten())
            .count();
        let devices: BTreeMap<String, Device> = published
            .items
            .into_iter()
            .flat_map(|s| s.spec.devices.unwrap_or_default())
            .map(|d| (d.name.clone(), d))
            .collect();
        let consuming = devices
            .values()
            .filter(|d| d.consumes_counters.is_some())
            .count();
        if counter_sets == 2 && consuming > 0 && consuming == devices.len() {
            Ok(Some(devices))
        } else {
            Err(format!(
                "{counter_sets} counter sets, {consuming} of {} devices consume counters",
                devices.len()
            ))
        }
    })
    .await?;
    apply_file(&client, &repo_path("deploy/deviceclasses/mig.yaml")).await?;

    let kueue = Kueue::start(&cp, &repo_path("examples/kueue/kueue-config.yaml")).await?;
    eprintln!(
        "[{:?}] kueue {} started in {:?}",
        began.elapsed(),
        kueue.version(),
        kueue.startup()
    );
    let queues_file = repo_path("examples/kueue/queues.yaml");
    apply_yaml(
        &client,
        &with_mig_quota(&std::fs::read_to_string(&queues_file)?, MIG_QUOTA)?,
        &queues_file,
    )
    .await?;
    drust_e2e::kueue::wait_cluster_queue_active(&client, "training", TIMEOUT).await?;
    let example = std::fs::read_to_string(repo_path(EXAMPLE))?;
    apply_yaml(
        &client,
        &documents_where(&example, |d| d["kind"] == "ResourceClaimTemplate")?,
        &repo_path(EXAMPLE),
    )
    .await?;

    let release = host.root().join("release");
    std::fs::create_dir_all(&release)?;
    let state = host.state_dir();
    let jobs: Api<Job> = Api::namespaced(client.clone(), NAMESPACE);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NAMESPACE);

    // Two 1g.10gb Jobs: within the quota, each charged its placement's memory, each running on
    // a MIG device created for it.
    let mut running = Vec::new();
    for name in ["notebook-a", "notebook-b"] {
        let job = jobs
            .create(
                &PostParams::default(),
                &held_job(&example, "notebook", name, &release)?,
            )
            .await?;
        let (workload, _) =
            wait_workload(&client, &job, "Admitted", TIMEOUT, |c| c.status == "True")
                .await
                .with_context(|| kueue.log_tail())?;
        let usage = resource_usage(&workload);
        eprintln!("{name}: admitted, charged {usage:?}");
        ensure!(
            usage
                .values()
                .any(|u| u.get("drust.dev/mig-memory").map(String::as_str) == Some(CHARGE_1G)),
            "{name} is charged {CHARGE_1G} of drust.dev/mig-memory: {usage:?}"
        );
        let pod = wait_job_pod_running(&pods, name, &node, TIMEOUT).await?;
        let (device, mig) = created_mig_device(&claims, &pod, &devices, &state).await?;
        eprintln!("{name}: {device} -> MIG device {} created", mig.uuid);
        running.push((name, pod, device, mig));
    }
    ensure!(
        running[0].3.uuid != running[1].3.uuid,
        "two MIG devices, one per Job"
    );

    // The third waits in Kueue: 1024Mi of 20Gi left.
    let third = jobs
        .create(
            &PostParams::default(),
            &held_job(&example, "notebook", "notebook-c", &release)?,
        )
        .await?;
    let (_, why) = wait_workload(&client, &third, "QuotaReserved", TIMEOUT, |c| {
        c.status == "False" && c.message.contains("insufficient unused quota")
    })
    .await
    .with_context(|| kueue.log_tail())?;
    eprintln!("notebook-c waits in Kueue: {}: {}", why.reason, why.message);
    ensure!(
        why.message.contains(
            "insufficient unused quota for drust.dev/mig-memory in flavor drust-gpus, 8704Mi more needed"
        ),
        "the wait names the MIG quota and what is missing (9728Mi - 1024Mi): {why:?}"
    );
    ensure!(
        job_pods(&pods, "notebook-c").await?.is_empty(),
        "no pod exists for notebook-c while it waits"
    );

    // Any MIG device: charged as the largest placement the request matches, a 7g.80gb.
    apply_yaml(
        &client,
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\n\
         metadata: {name: any-mig, namespace: default}\n\
         spec: {spec: {devices: {requests: [{name: mig, exactly: \
         {deviceClassName: mig.drust.dev}}]}}}\n",
        Path::new("any-mig template"),
    )
    .await?;
    let mut any = held_job(&example, "notebook", "any-mig", &release)?;
    if let Some(spec) = any
        .spec
        .as_mut()
        .and_then(|s| s.template.spec.as_mut())
        .and_then(|s| s.resource_claims.as_mut())
        .and_then(|c| c.first_mut())
    {
        spec.resource_claim_template_name = Some("any-mig".to_owned());
    }
    let any = jobs.create(&PostParams::default(), &any).await?;
    let (_, why) = wait_workload(&client, &any, "QuotaReserved", TIMEOUT, |c| {
        c.status == "False" && c.message.contains("drust.dev/mig-memory")
    })
    .await
    .with_context(|| kueue.log_tail())?;
    eprintln!("any-mig: {}: {}", why.reason, why.message);
    ensure!(
        why.message.contains(&format!(
            "current podset request ({CHARGE_7G}) > maximum capacity ({MIG_QUOTA})"
        )),
        "a request for any MIG device is charged as a 7g.80gb: {why:?}"
    );
    jobs.delete("any-mig", &Default::default()).await?;

    // notebook-a finishes: its MIG device goes, and notebook-c runs on one of its own.
    let (name_a, pod_a, device_a, mig_a) = running.remove(0);
    std::fs::write(release.join(name_a), "")?;
    check_done(&pods, &pod_a, &node, &device_a, &mig_a).await?;
    until(
        &format!("{name_a}'s MIG device destroyed"),
        TIMEOUT,
        || async {
            let left = mig_devices(&state).map_err(|e| e.to_string())?;
            if left.iter().any(|(_, m)| m.uuid == mig_a.uuid) {
                Err(format!("{left:?}"))
            } else {
                Ok(Some(()))
            }
        },
    )
    .await?;
    wait_workload(&client, &third, "Admitted", TIMEOUT, |c| c.status == "True").await?;
    let pod_c = wait_job_pod_running(&pods, "notebook-c", &node, TIMEOUT).await?;
    let (device_c, mig_c) = created_mig_device(&claims, &pod_c, &devices, &state).await?;
    eprintln!(
        "notebook-c: {device_c} -> MIG device {} created",
        mig_c.uuid
    );
    running.push(("notebook-c", pod_c, device_c, mig_c));

    for (name, pod, device, mig) in running {
        std::fs::write(release.join(name), "")?;
        check_done(&pods, &pod, &node, &device, &mig).await?;
    }
    until("no MIG device left", TIMEOUT, || async {
        let left = mig_devices(&state).map_err(|e| e.to_string())?;
        if left.is_empty() {
            Ok(Some(()))
        } else {
            Err(format!("{left:?}"))
        }
    })
    .await?;
    eprintln!("[{:?}] done", began.elapsed());

    kueue.stop().await?;
    stop(plugin).await?;
    node.stop().await?;
    cp.stop().await?;
    Ok(())
}

/// `queues` (the text of `examples/kueue/queues.yaml`) with the `drust.dev/mig-memory` quota of
/// its ClusterQueue set to `quota`.
fn with_mig_quota(queues: &str, quota: &str) -> anyhow::Result<String> {
    let mut out = Vec::new();
    let mut set = false;
    for doc in serde_yaml_ng::Deserializer::from_str(queues) {
        let mut v = <serde_yaml_ng::Value as serde::Deserialize>::deserialize(doc)?;
        if v["kind"] == "ClusterQueue" {
            for group in v["spec"]["resourceGroups"]
                .as_sequence_mut()
                .into_iter()
                .flatten()
            {
                for flavor in group["flavors"].as_sequence_mut().into_iter().flatten() {
                    for r in flavor["resources"].as_sequence_mut().into_iter().flatten() {
                        if r["name"] == "drust.dev/mig-memory" {
                            r["nominalQuota"] = quota.into();
                            set = true;
                        }
                    }
                }
            }
        }
        out.push(serde_yaml_ng::to_string(&v)?);
    }
    ensure!(set, "queues.yaml has no drust.dev/mig-memory quota");
    Ok(out.join("---\n"))
}

/// Every MIG device the fake backend holds, with its parent GPU's UUID.
fn mig_devices(state: &Path) -> anyhow::Result<Vec<(String, RawMigDevice)>> {
    let state = MigState::load(&state.join("mig.json"))?;
    Ok(state
        .gpus
        .into_iter()
        .flat_map(|(gpu, devices)| devices.into_iter().map(move |d| (gpu.clone(), d)))
        .collect())
}

/// The placement allocated to `pod`'s claim (one `1g.10gb` of this node's pool, as the API
/// server stores the allocation) and the MIG device the plugin created there: on the
/// placement's parent GPU, at its start, of its size.
async fn created_mig_device(
    claims: &Api<ResourceClaim>,
    pod: &Pod,
    published: &BTreeMap<String, Device>,
    state: &Path,
) -> anyhow::Result<(String, RawMigDevice)> {
    let claim_name = drust_e2e::node_pods::pod_claim_name(pod)?;
    let claim = claims.get(&claim_name).await?;
    let results = drust_e2e::claims::allocation_results(&claim)
        .with_context(|| format!("claim {claim_name} is allocated"))?;
    ensure!(
        results.len() == 1 && results[0].driver == DRIVER && results[0].pool == NODE,
        "claim {claim_name}: one device of {DRIVER} on {NODE}: {results:?}"
    );
    let device = results[0].device.clone();
    let attributes = published
        .get(&device)
        .and_then(|d| d.attributes.as_ref())
        .with_context(|| format!("{device} is published"))?;
    let text = |k: &str| attributes.get(k).and_then(|a| a.string.clone());
    let int = |k: &str| attributes.get(k).and_then(|a| a.int);
    ensure!(
        text("profile").as_deref() == Some("1g.10gb"),
        "{device} is a 1g.10gb placement: {attributes:?}"
    );
    let parent = text("parentUUID").context("parentUUID")?;
    let (start, size) = (
        int("placementStart").context("placementStart")?,
        int("placementSize").context("placementSize")?,
    );
    let created = mig_devices(state)?;
    let mig = created
        .into_iter()
        .find(|(gpu, m)| {
            *gpu == parent
                && i64::from(m.placement.start) == start
                && i64::from(m.placement.size) == size
        })
        .map(|(_, m)| m)
        .with_context(|| format!("no MIG device at {device} (GPU {parent}, start {start})"))?;
    Ok((device, mig))
}

/// `pod` completed successfully, and its container got the MIG device `mig` as `device`.
async fn check_done(
    pods: &Api<Pod>,
    pod: &Pod,
    node: &Node,
    device: &str,
    mig: &RawMigDevice,
) -> anyhow::Result<()> {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let done = wait_pod_done(pods, &name, node).await?;
    let log = terminated_message(&done, "main").unwrap_or_default();
    ensure!(succeeded(&done), "{name} failed: {:?}\n{log}", done.status);
    let (nodes, env) = seen(&log);
    let want = device_env(device, &mig.uuid);
    ensure!(
        env.contains(&want),
        "{name}'s container got {want}: {env:?} {nodes:?}"
    );
    Ok(())
}
