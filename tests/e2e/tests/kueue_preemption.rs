//! Kueue's preemption by priority over drust's claims, on a real node (the fake DGX H100 on a
//! driver of the r615 branch, 8 GPUs, shared with `--consumable-capacity`: the `kernel` level,
//! whose shares have an MPS v3 daemon, a namespace and a memory limit), with Kueue's release
//! manager and `examples/kueue/preemption.yaml` as it is:
//! - the low-priority Job `sweep` is admitted (charged 2 of `drust.dev/gpu` and 20Gi of
//!   `drust.dev/gpu-memory`) and runs: two whole GPUs in one container, a 20Gi share of a third
//!   in the other. Everything drust keeps for its claims is checked to exist: each claim's CDI
//!   spec and checkpoint record, the share's MPS daemon (its directory and process), its v3
//!   namespace, and its memory-limit record and the limit on the container's cgroup;
//! - the high-priority Job `urgent` asks for all 8 GPUs, which the ClusterQueue's quota (8) has
//!   room for only without `sweep`: Kueue evicts `sweep` (its Workload's `Evicted` and
//!   `Preempted` conditions, with Kueue's message naming `urgent`'s Workload), its pod goes, and
//!   its claims are deallocated and unprepared: no claim left in the API, no CDI spec, no
//!   checkpoint record, no MPS daemon (directory or process), no namespace, no memory-limit
//!   record for either;
//! - `urgent` is admitted and runs with the 8 GPUs, the low Job's three among them (its claim's
//!   allocation as the API server stores it, and the device nodes its container saw): the node
//!   has no other GPUs, so it ran only because every device `sweep` held was deallocated;
//! - `sweep` waits in Kueue meanwhile, and runs again, with new claims, once `urgent` is done;
//! - Kueue preempts for quota, not devices: a low Job holding only a share (charged
//!   `drust.dev/gpu-memory`) is not evicted for a second high Job of all 8 GPUs, which is
//!   admitted and whose pod stays Unschedulable until the share's Job is done.
//!
//! Containers end when the test says so (a file in a hostPath directory) or at SIGTERM.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, ensure};
use drust_e2e::host::{BinaryHost, PluginProcess, stop};
use drust_e2e::kueue::{
    self, Kueue, condition, held_job, job_pods, resource_usage, wait_job_pod_running, wait_workload,
};
use drust_e2e::manifests::{apply_file, apply_yaml, documents_where, repo_path};
use drust_e2e::node::{Node, NodeOptions};
use drust_e2e::node_pods::{seen, succeeded, terminated_message, wait_pod_done};
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
/// Every wait: Kueue admits and preempts within a second or two; pods start and stop in a few.
const TIMEOUT: Duration = Duration::from_secs(120);
const EXAMPLE: &str = "examples/kueue/preemption.yaml";

/// A claim generated for a Job's pod, as the API server stores it.
#[derive(Debug)]
struct HeldClaim {
    /// The pod's name for it (`spec.resourceClaims[].name`).
    pod_claim: String,
    name: String,
    uid: String,
    devices: BTreeSet<String>,
    /// `consumedCapacity.memory` of each device: on shareable GPUs every allocation has one (a
    /// whole GPU consumes the default, all of its memory).
    memory: Vec<String>,
}

#[tokio::test]
#[allow(clippy::too_many_lines)] // one scenario, step by step
async fn kueue_preempts_a_low_priority_job_and_drust_unprepares_its_gpus_and_share_for_the_high_one()
-> anyhow::Result<()> {
    let began = std::time::Instant::now();
    let cgroup_root = drust_e2e::host::cgroup2_mount()
        .context("a cgroup v2 hierarchy is mounted (the `kernel` level needs one)")?;
    let mut options = ControlPlaneOptions::default();
    options.apiserver_args.extend(kueue::apiserver_args());
    let cp = ControlPlane::start(options).await?;
    let client = cp.client().await?;
    let node = Node::start(&cp, NODE, NodeOptions::default()).await?;
    let scratch = tempfile::tempdir()?;
    let topology = scratch.path().join("dgx-h100-r615.yaml");
    drust_e2e::host::write_r615_topology(&topology)?;
    // Short: the share daemon (outside a Pod here) binds its namespace sockets under the host
    // root, and a socket path has at most 107 bytes.
    let host =
        BinaryHost::new("drust-kp-", cp.kubeconfig_path(), &topology, DRIVER, NODE)?.on_node(&node);
    host.make_device_nodes()?;
    let plugin = PluginProcess(
        host.command(&host.root().join("plugin.log"), None)?
            .arg("--fake-state-dir")
            .arg(host.state_dir())
            .args(["--consumable-capacity", "true", "--mps-control-binary"])
            .arg(drust_fakes::mps_control())
            .arg("--cgroup-root")
            .arg(&cgroup_root)
            .spawn()
            .context("spawning gpu-kubelet-plugin")?,
    );
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    until(
        "8 GPUs published as kernel-level shares",
        TIMEOUT,
        || async {
            let published = slices
                .list(&ListParams::default().fields(&format!("spec.nodeName={NODE}")))
                .await
                .map_err(|e| e.to_string())?;
            let kernel = published
                .items
                .iter()
                .flat_map(|s| s.spec.devices.iter().flatten())
                .filter(|d| {
                    d.allow_multiple_allocations == Some(true)
                        && d.attributes
                            .as_ref()
                            .and_then(|a| a.get("shareEnforcement"))
                            .and_then(|a| a.string.as_deref())
                            == Some("kernel")
                })
                .count();
            match kernel {
                8 => Ok(Some(())),
                n => Err(format!("{n} kernel-level shareable devices")),
            }
        },
    )
    .await?;
    apply_file(&client, &repo_path("deploy/deviceclasses/gpu.yaml")).await?;
    // The templates the example's Jobs name: job.yaml's two H100s, shares.yaml's 20Gi share
    // (and its DeviceClass).
    for (file, kinds) in [
        ("examples/kueue/job.yaml", &["ResourceClaimTemplate"][..]),
        (
            "examples/kueue/shares.yaml",
            &["DeviceClass", "ResourceClaimTemplate"][..],
        ),
    ] {
        let text = std::fs::read_to_string(repo_path(file))?;
        let picked = documents_where(&text, |d| {
            kinds.iter().any(|k| d["kind"].as_str() == Some(k))
        })?;
        apply_yaml(&client, &picked, &repo_path(file)).await?;
    }

    let kueue = Kueue::start(&cp, &repo_path("examples/kueue/kueue-config.yaml")).await?;
    eprintln!(
        "[{:?}] kueue {} started in {:?}",
        began.elapsed(),
        kueue.version(),
        kueue.startup()
    );
    // The ResourceFlavor of queues.yaml, then the example's priority classes, ClusterQueue,
    // LocalQueue and template.
    apply_file(&client, &repo_path("examples/kueue/queues.yaml")).await?;
    let example = std::fs::read_to_string(repo_path(EXAMPLE))?;
    apply_yaml(
        &client,
        &documents_where(&example, |d| d["kind"] != "Job")?,
        &repo_path(EXAMPLE),
    )
    .await?;
    drust_e2e::kueue::wait_cluster_queue_active(&client, "dgx", TIMEOUT).await?;

    let release = host.root().join("release");
    std::fs::create_dir_all(&release)?;
    let jobs: Api<Job> = Api::namespaced(client.clone(), NAMESPACE);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NAMESPACE);

    // The low-priority Job runs: two whole GPUs and a share.
    let sweep = jobs
        .create(
            &PostParams::default(),
            &held_job(&example, "sweep", "sweep", &release)?,
        )
        .await?;
    let (workload, _) = wait_workload(&client, &sweep, "Admitted", TIMEOUT, |c| c.status == "True")
        .await
        .with_context(|| kueue.log_tail())?;
    let usage = resource_usage(&workload);
    eprintln!("sweep (low): admitted, charged {usage:?}");
    let charged = |resource: &str| {
        usage
            .values()
            .find_map(|u| u.get(resource))
            .cloned()
            .unwrap_or_default()
    };
    ensure!(
        charged("drust.dev/gpu") == "2" && charged("drust.dev/gpu-memory") == "20Gi",
        "sweep is charged 2 GPUs and 20Gi of shares: {usage:?}"
    );
    let low_pod = wait_job_pod_running(&pods, "sweep", &node, TIMEOUT).await?;
    let low_pod_name = low_pod.metadata.name.clone().unwrap_or_default();
    let held = held_claims(&claims, &low_pod).await?;
    let share = held
        .iter()
        .find(|c| c.pod_claim == "share")
        .context("the share's claim")?;
    let whole = held
        .iter()
        .find(|c| c.pod_claim == "gpus")
        .context("the GPUs' claim")?;
    ensure!(
        whole.devices.len() == 2
            && share.devices.len() == 1
            && share.memory == ["20Gi"]
            && whole.devices.is_disjoint(&share.devices),
        "two whole GPUs and a 20Gi share of a third: {held:?}"
    );
    let low_devices: BTreeSet<String> = held.iter().flat_map(|c| c.devices.clone()).collect();

    // What drust keeps for them while they run.
    let mps = host.root().join("mps");
    let records = host.plugin_dir().join("memory-limits");
    for c in &held {
        ensure!(
            host.claim_spec(&c.uid).exists() && host.has_record(&c.uid)?,
            "claim {} is prepared: CDI spec and checkpoint record",
            c.name
        );
    }
    let daemons = daemon_dirs(&mps);
    ensure!(
        daemons.len() == 1,
        "one MPS daemon, for the share's GPU: {daemons:?}"
    );
    let daemon = daemons.into_iter().next().context("the daemon")?;
    let namespace = mps
        .join(&daemon)
        .join("pipe")
        .join(gpu_kubelet_plugin::mps::V3_SERVER)
        .join(gpu_kubelet_plugin::mps::namespace_name(&share.uid));
    let daemon_pid = until("the share daemon's namespace and pid", TIMEOUT, || async {
        let log = std::fs::read_to_string(mps.join(&daemon).join("log/control.log"))
            .map_err(|e| e.to_string())?;
        Ok(namespace.is_dir().then(|| daemon_pid(&log)).flatten())
    })
    .await?;
    ensure!(
        alive(daemon_pid),
        "the share's MPS daemon runs (pid {daemon_pid})"
    );
    // The CDI hook records the share's limit as the container starts.
    let record = records.join(&share.uid);
    until("the share's memory-limit record", TIMEOUT, || async {
        Ok(record.is_dir().then_some(()))
    })
    .await?;
    let limits = gpu_inventory::FakeBackend::from_file(&topology)?
        .with_state_dir(host.state_dir())
        .memory_limits();
    ensure!(
        !limits.is_empty(),
        "the share's memory limit is set on its cgroups"
    );
    eprintln!(
        "[{:?}] sweep runs: GPUs {:?}, share of {:?} (daemon {daemon}, pid {daemon_pid}, \
         namespace {}, {} cgroup limits)",
        began.elapsed(),
        whole.devices,
        share.devices,
        namespace.display(),
        limits.len()
    );

    // The high-priority Job: Kueue evicts sweep to make room.
    let urgent = jobs
        .create(
            &PostParams::default(),
            &held_job(&example, "urgent", "urgent", &release)?,
        )
        .await?;
    let (evicted, why) = wait_workload(&client, &sweep, "Evicted", TIMEOUT, |c| c.status == "True")
        .await
        .with_context(|| kueue.log_tail())?;
    eprintln!("sweep: Evicted: {}: {}", why.reason, why.message);
    let preempted = condition(&evicted, "Preempted");
    eprintln!("sweep: Preempted: {preempted:?}");
    let urgent_workload = until("urgent's Workload", TIMEOUT, || async {
        kueue::workload_of(
            &client,
            NAMESPACE,
            urgent.metadata.uid.as_deref().unwrap_or_default(),
        )
        .await
        .map_err(|e| e.to_string())
    })
    .await?;
    let urgent_workload_uid = urgent_workload.metadata.uid.clone().unwrap_or_default();
    ensure!(
        why.reason == "Preempted"
            && why.message.contains(&format!(
                "accommodate a workload (UID: {urgent_workload_uid}"
            ))
            && why.message.contains("prioritization in the ClusterQueue"),
        "sweep was evicted for urgent's Workload {urgent_workload_uid}: {why:?}"
    );
    ensure!(
        preempted.is_some_and(|c| c.status == "True" && c.reason == "InClusterQueue"),
        "sweep's Preempted condition"
    );
    ensure!(
        jobs.get("sweep").await?.spec.and_then(|s| s.suspend) == Some(true),
        "Kueue suspended sweep"
    );

    // The evicted pod goes, its claims are deallocated and deleted, and drust unprepared them:
    // nothing of theirs is left on the node.
    until("sweep's pod gone", TIMEOUT, || async {
        match pods.get_opt(&low_pod_name).await {
            Ok(None) => Ok(Some(())),
            Ok(Some(p)) => Err(format!("{:?}", p.status.and_then(|s| s.phase))),
            Err(e) => Err(e.to_string()),
        }
    })
    .await?;
    // A generated claim goes with its pod: the resourceclaim controller deletes it, and its
    // finalizer holds it until it is no longer allocated.
    for c in &held {
        until(
            &format!("claim {} deallocated and deleted", c.name),
            TIMEOUT,
            || async {
                match claims.get_opt(&c.name).await {
                    Ok(None) => Ok(Some(())),
                    Ok(Some(claim)) => Err(format!(
                        "still there (deletion {:?}): {:?}",
                        claim.metadata.deletion_timestamp, claim.status
                    )),
                    Err(e) => Err(e.to_string()),
                }
            },
        )
        .await?;
    }
    until("sweep's claims unprepared on the node", TIMEOUT, || async {
        let mut left = Vec::new();
        for c in &held {
            if host.claim_spec(&c.uid).exists() {
                left.push(format!("{}: CDI spec", c.name));
            }
            if host.has_record(&c.uid).map_err(|e| e.to_string())? {
                left.push(format!("{}: checkpoint record", c.name));
            }
        }
        if mps.join(&daemon).exists() {
            left.push(format!("MPS daemon directory {daemon}"));
        }
        if namespace.exists() {
            left.push(format!("MPS namespace {}", namespace.display()));
        }
        if alive(daemon_pid) {
            left.push(format!("MPS daemon process {daemon_pid}"));
        }
        if record.exists() {
            left.push(format!("memory-limit record {}", record.display()));
        }
        if left.is_empty() {
            Ok(Some(()))
        } else {
            Err(left.join(", "))
        }
    })
    .await
    .with_context(|| node.log_tail())?;
    ensure!(
        daemon_dirs(&mps).is_empty(),
        "no MPS daemon at all: {:?}",
        daemon_dirs(&mps)
    );
    eprintln!(
        "[{:?}] sweep's claims unprepared: no CDI spec, checkpoint record, MPS daemon, \
         namespace or memory-limit record left",
        began.elapsed()
    );

    // urgent runs on the whole node, the GPUs sweep held among them.
    let (workload, _) = wait_workload(&client, &urgent, "Admitted", TIMEOUT, |c| {
        c.status == "True"
    })
    .await
    .with_context(|| kueue.log_tail())?;
    let usage = resource_usage(&workload);
    eprintln!("urgent (high): admitted, charged {usage:?}");
    ensure!(
        usage
            .values()
            .any(|u| u.get("drust.dev/gpu").map(String::as_str) == Some("8")),
        "urgent is charged 8 GPUs: {usage:?}"
    );
    let high_pod = wait_job_pod_running(&pods, "urgent", &node, TIMEOUT).await?;
    let high = held_claims(&claims, &high_pod).await?;
    let high_devices: BTreeSet<String> = high.iter().flat_map(|c| c.devices.clone()).collect();
    let gpus: BTreeSet<String> = drust_e2e::plugin::fake_gpus(&topology)
        .map_err(anyhow::Error::msg)?
        .into_iter()
        .map(|g| g.name)
        .collect();
    ensure!(
        high_devices == gpus,
        "urgent holds every GPU of the node: {high:?}"
    );
    ensure!(
        low_devices.is_subset(&high_devices),
        "urgent got the GPUs sweep held ({low_devices:?}): {high_devices:?}"
    );
    eprintln!("urgent got {high_devices:?}, sweep's {low_devices:?} among them");

    // sweep waits in Kueue meanwhile, with no pod.
    let (_, waiting) = wait_workload(&client, &sweep, "QuotaReserved", TIMEOUT, |c| {
        c.status == "False"
    })
    .await?;
    eprintln!(
        "sweep waits in Kueue: {}: {}",
        waiting.reason, waiting.message
    );
    ensure!(
        job_pods(&pods, "sweep").await?.is_empty(),
        "no pod of sweep while urgent runs"
    );

    std::fs::write(release.join("urgent"), "")?;
    let done = wait_pod_done(
        &pods,
        high_pod.metadata.name.as_deref().unwrap_or_default(),
        &node,
    )
    .await?;
    let log = terminated_message(&done, "train").unwrap_or_default();
    ensure!(succeeded(&done), "urgent failed: {:?}\n{log}", done.status);
    let (nodes, _) = seen(&log);
    let gpu_nodes = nodes
        .iter()
        .filter(|n| {
            n.strip_prefix("/dev/nvidia")
                .and_then(|r| r.split(' ').next())
                .is_some_and(|m| m.parse::<u32>().is_ok())
        })
        .count();
    ensure!(gpu_nodes == 8, "urgent's container saw 8 GPUs: {nodes:?}");

    // With urgent done, sweep is admitted again and runs with new claims.
    wait_workload(&client, &sweep, "Admitted", TIMEOUT, |c| c.status == "True").await?;
    let again = wait_job_pod_running(&pods, "sweep", &node, TIMEOUT).await?;
    let again_claims = held_claims(&claims, &again).await?;
    ensure!(
        again_claims
            .iter()
            .all(|c| held.iter().all(|h| h.uid != c.uid)),
        "sweep runs again on new claims: {again_claims:?}"
    );
    eprintln!("[{:?}] sweep runs again: {again_claims:?}", began.elapsed());
    std::fs::write(release.join("sweep"), "")?;
    let done = wait_pod_done(
        &pods,
        again.metadata.name.as_deref().unwrap_or_default(),
        &node,
    )
    .await?;
    ensure!(succeeded(&done), "sweep failed: {:?}", done.status);

    // Kueue preempts for quota, not for devices: a low Job charged only a share's memory is not
    // evicted for a high Job that needs the share's GPU. The high Job is admitted (its 8 GPUs
    // fit the quota) and its pod waits for the scheduler until the share is gone.
    let shares_example = std::fs::read_to_string(repo_path("examples/kueue/shares.yaml"))?;
    let mut tune = held_job(&shares_example, "fine-tune", "tune", &release)?;
    let labels = tune.metadata.labels.get_or_insert_default();
    labels.insert(kueue::QUEUE_LABEL.to_owned(), "dgx".to_owned());
    labels.insert("kueue.x-k8s.io/priority-class".to_owned(), "low".to_owned());
    let tune = jobs.create(&PostParams::default(), &tune).await?;
    wait_workload(&client, &tune, "Admitted", TIMEOUT, |c| c.status == "True").await?;
    let tune_pod = wait_job_pod_running(&pods, "tune", &node, TIMEOUT).await?;
    let urgent = jobs
        .create(
            &PostParams::default(),
            &held_job(&example, "urgent", "urgent-2", &release)?,
        )
        .await?;
    wait_workload(&client, &urgent, "Admitted", TIMEOUT, |c| {
        c.status == "True"
    })
    .await?;
    let pending = until("urgent-2's pod Unschedulable", TIMEOUT, || async {
        let found = job_pods(&pods, "urgent-2")
            .await
            .map_err(|e| e.to_string())?;
        Ok(found.into_iter().find_map(|p| {
            p.status?
                .conditions?
                .into_iter()
                .find(|c| {
                    c.type_ == "PodScheduled"
                        && c.status == "False"
                        && c.reason.as_deref() == Some("Unschedulable")
                })?
                .message
        }))
    })
    .await?;
    eprintln!("urgent-2: admitted beside the share, its pod Unschedulable: {pending}");
    let (tune_workload, _) =
        wait_workload(&client, &tune, "Admitted", TIMEOUT, |c| c.status == "True").await?;
    ensure!(
        condition(&tune_workload, "Evicted").is_none_or(|c| c.status != "True"),
        "the share's Job is not preempted"
    );
    std::fs::write(release.join("tune"), "")?;
    let done = wait_pod_done(
        &pods,
        tune_pod.metadata.name.as_deref().unwrap_or_default(),
        &node,
    )
    .await?;
    ensure!(succeeded(&done), "tune failed: {:?}", done.status);
    let urgent_pod = wait_job_pod_running(&pods, "urgent-2", &node, TIMEOUT).await?;
    eprintln!("[{:?}] the share done, urgent-2 runs", began.elapsed());
    std::fs::write(release.join("urgent-2"), "")?;
    let done = wait_pod_done(
        &pods,
        urgent_pod.metadata.name.as_deref().unwrap_or_default(),
        &node,
    )
    .await?;
    ensure!(succeeded(&done), "urgent-2 failed: {:?}", done.status);

    kueue.stop().await?;
    stop(plugin).await?;
    node.stop().await?;
    cp.stop().await?;
    Ok(())
}

/// The claims generated for `pod`, each with its UID, allocated devices (all from this node's
/// pool of the driver) and the memory each consumes.
async fn held_claims(claims: &Api<ResourceClaim>, pod: &Pod) -> anyhow::Result<Vec<HeldClaim>> {
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.clone())
        .unwrap_or_default();
    let mut out = Vec::new();
    for status in statuses {
        let name = status
            .resource_claim_name
            .with_context(|| format!("the claim generated for {}", status.name))?;
        let claim = claims.get(&name).await?;
        let results = drust_e2e::claims::allocation_results(&claim)
            .with_context(|| format!("claim {name} is allocated"))?;
        for r in results {
            ensure!(
                r.driver == DRIVER && r.pool == NODE,
                "claim {name}: a device of {DRIVER} on {NODE}: {r:?}"
            );
        }
        out.push(HeldClaim {
            uid: claim.metadata.uid.clone().unwrap_or_default(),
            devices: results.iter().map(|r| r.device.clone()).collect(),
            memory: results
                .iter()
                .filter_map(|r| r.consumed_capacity.as_ref()?.get("memory"))
                .map(|q| q.0.clone())
                .collect(),
            pod_claim: status.name,
            name,
        });
    }
    Ok(out)
}

/// The MPS daemon directories under the plugin's MPS root.
fn daemon_dirs(mps_root: &Path) -> BTreeSet<String> {
    std::fs::read_dir(mps_root)
        .map(|d| {
            d.flatten()
                .filter(|e| e.path().is_dir())
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The daemon's pid from its `control.log` (the fake control tool's first line: `start
/// CUDA_VISIBLE_DEVICES=... pid=N`).
fn daemon_pid(log: &str) -> Option<u32> {
    log.lines()
        .find_map(|l| {
            l.strip_prefix("start ")?
                .split_whitespace()
                .find_map(|w| w.strip_prefix("pid="))
        })
        .and_then(|p| p.parse().ok())
}

/// Whether process `pid` runs (exists and is not a zombie).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next())
            .is_some_and(|state| state != 'Z')
    })
}
