//! Issue 32's first slice on a real API server: who holds GPUs without using them.
//!
//! The plugin runs on the fake DGX H100 with usage sampling every second and a 3-second idle
//! window. Two claims, each on its own GPU and reserved for its own pod, are prepared through
//! the kubelet's own client. The fake backend's usage files say GPU 0 computes (its process in
//! the first pod) and GPU 1 only holds 20 GiB for the second pod's process; the processes'
//! cgroups (a fake `/proc`) name their pods the way the kubelet's cgroup driver does. Then, from
//! the outside: `/metrics` carries DCGM exporter's series with the right pod and claim labels,
//! the idle claim is flagged and the busy one is not, `/usage` says the same as JSON, and the
//! idle claim (only it) gets a `GPUIdle` condition on its device status naming its claim,
//! device and memory (the explain controller relays it to the pod: its own tests); when the
//! idle pod starts computing, its claim is busy again and the mark goes.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use drust_e2e::claims::{allocated_claim, idle_mark, pod_using};
use drust_e2e::http::{get, sample};
use drust_e2e::kubelet::Kubelet;
use drust_e2e::manifests::repo_path;
use drust_e2e::plugin::NodePlugin;
use drust_e2e::wait::until;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::resource::v1::ResourceSlice;

const DRIVER: &str = "gpu.drust.dev";
const NODE: &str = "node-usage";
const TIMEOUT: Duration = Duration::from_secs(60);
const CONTAINER: &str = "4f1c9a0e2b7d4c6a8e1f3b5d7c9e0a2b4d6f8a0c2e4b6d8f0a1c3e5b7d9f1a3c";

/// Writes `<dir>/<name>` under a temporary name and renames it, so a reader never sees half.
fn write(dir: &Path, name: &str, text: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, dir.join(name))?;
    Ok(())
}

/// GPU `index`'s usage: `sm` percent, one process `pid` holding `mib`.
fn usage(state: &Path, index: u32, sm: u32, pid: u32, mib: u64) -> anyhow::Result<()> {
    let json = serde_json::json!({
        "smPercent": sm, "memoryPercent": 0, "memoryUsedBytes": mib << 20,
        "processes": [{"pid": pid, "usedMemoryBytes": mib << 20}],
    });
    write(
        &state.join("usage"),
        &format!("{index}.json"),
        &json.to_string(),
    )
}

#[tokio::test]
async fn the_idle_claim_is_flagged_with_its_pod_and_the_busy_one_is_not() -> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let client = cp.client().await?;
    cp.register_node(NODE, &[]).await?;
    let proc_dir = tempfile::tempdir()?;
    let http = drust_e2e::ports::free_port()?;
    let topology = repo_path("examples/topologies/dgx-h100.yaml");
    let mut plugin = NodePlugin::start_with(&cp, DRIVER, NODE, &topology, |c| {
        c.http_address = Some(([127, 0, 0, 1], http).into());
        c.usage = Some(drust_e2e::plugin::fast_usage(
            proc_dir.path(),
            Duration::from_secs(3),
            true,
        ));
    })?;
    let slices = plugin.wait_ready(&client, TIMEOUT).await?;
    let state = plugin.fake_state_dir()?;
    let mut devices: Vec<(String, String)> = slices
        .iter()
        .flat_map(|s: &ResourceSlice| s.spec.devices.clone().unwrap_or_default())
        .map(|d| {
            let index = d
                .attributes
                .as_ref()
                .and_then(|a| a.get("index"))
                .and_then(|a| a.int)
                .unwrap_or(-1);
            (index.to_string(), d.name)
        })
        .collect();
    devices.sort();
    let gpu = |index: &str| {
        devices
            .iter()
            .find(|(i, _)| i == index)
            .map(|(_, n)| n.clone())
            .context("GPU by index")
    };
    let (gpu0, gpu1) = (gpu("0")?, gpu("1")?);

    let train =
        allocated_claim(&client, "train", DRIVER, NODE, std::slice::from_ref(&gpu0)).await?;
    let notebook = allocated_claim(
        &client,
        "notebook",
        DRIVER,
        NODE,
        std::slice::from_ref(&gpu1),
    )
    .await?;
    let busy_pod = pod_using(&client, "trainer-0", "train", NODE).await?;
    let idle_pod = pod_using(&client, "jupyter-0", "notebook", NODE).await?;

    // What the GPUs do and whose processes they run.
    usage(&state, 0, 85, 4001, 30_000)?;
    usage(&state, 1, 0, 4002, 20_480)?;
    for (pid, pod) in [(4001, &busy_pod), (4002, &idle_pod)] {
        let cgroup = format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{CONTAINER}.scope\n",
            pod.replace('-', "_")
        );
        write(&proc_dir.path().join(pid.to_string()), "cgroup", &cgroup)?;
    }
    let (kubelet, _) = Kubelet::register(&plugin.registration_socket()).await?;
    let answer = kubelet.prepare_v1(&[&train, &notebook]).await?;
    anyhow::ensure!(
        answer.claims.values().all(|c| c.error.is_empty()),
        "prepared: {answer:?}"
    );

    let idle = r#"drust_claim_idle{namespace="default",claim="notebook",claim_uid="#;
    let metrics = until("the notebook claim flagged idle", TIMEOUT, || async {
        let (status, body) = get(http, "/metrics").await.map_err(|e| e.to_string())?;
        let flagged = body
            .lines()
            .any(|l| l.starts_with(idle) && l.ends_with(" 1"));
        if status == 200 && flagged {
            return Ok(Some(body));
        }
        let (_, usage) = get(http, "/usage").await.map_err(|e| e.to_string())?;
        Err(format!("/usage: {usage}"))
    })
    .await?;
    let line = |prefix: &str| -> Option<&str> { metrics.lines().find(|l| l.starts_with(prefix)) };
    // The busy claim is not idle.
    let busy = line(r#"drust_claim_idle{namespace="default",claim="train","#)
        .context("train's idle line")?;
    anyhow::ensure!(busy.ends_with(" 0"), "{busy}");
    // DCGM exporter's series, labelled with the pod and claim using the device.
    let util = metrics
        .lines()
        .find(|l| l.starts_with("DCGM_FI_DEV_GPU_UTIL{gpu=\"0\""))
        .context("GPU 0's utilization")?;
    for label in [
        "device=\"nvidia0\"",
        "Hostname=\"node-usage\"",
        "namespace=\"default\"",
        "pod=\"trainer-0\"",
        "claim=\"train\"",
        &format!("dra_device=\"{gpu0}\""),
    ] {
        anyhow::ensure!(util.contains(label), "{label} missing in {util}");
    }
    anyhow::ensure!(util.ends_with(" 85"), "{util}");
    let fb = metrics
        .lines()
        .find(|l| l.starts_with("DCGM_FI_DEV_FB_USED{gpu=\"1\"") && l.contains("pod=\"jupyter-0\""))
        .context("GPU 1's memory used, labelled with the notebook's pod")?;
    anyhow::ensure!(fb.ends_with(" 20480"), "{fb}");
    let container = metrics
        .lines()
        .find(|l| {
            l.starts_with("drust_container_gpu_memory_bytes{")
                && l.contains("pod=\"jupyter-0\"")
                && l.contains(&format!("container_id=\"{CONTAINER}\""))
        })
        .context("the notebook container's memory")?;
    anyhow::ensure!(
        container.ends_with(&format!(" {}", 20_480u64 << 20)),
        "{container}"
    );

    // The same as JSON, for dractl top.
    let (_, body) = get(http, "/usage").await?;
    let report: serde_json::Value = serde_json::from_str(&body)?;
    let claims = report["claims"].as_array().context("claims")?;
    let by_name = |name: &str| claims.iter().find(|c| c["name"] == name).cloned();
    let nb = by_name("notebook").context("notebook in /usage")?;
    anyhow::ensure!(
        nb["idle"] == true
            && nb["pods"][0]["name"] == "jupyter-0"
            && nb["idleSeconds"].as_u64() >= Some(3),
        "{nb}"
    );
    anyhow::ensure!(by_name("train").context("train")?["idle"] == false);

    // The idle claim is marked on its device status (`kubectl describe resourceclaim`; the
    // explain controller relays it to the pod); the busy claim never is.
    let note = until("a GPUIdle mark on the notebook claim", TIMEOUT, || async {
        idle_mark(&client, "default", "notebook", DRIVER)
            .await
            .map_err(|e| e.to_string())
    })
    .await?;
    anyhow::ensure!(
        note.contains("ResourceClaim default/notebook holds")
            && note.contains(&gpu1)
            && note.contains("20480 MiB"),
        "{note}"
    );
    let on_busy = idle_mark(&client, "default", "train", DRIVER).await?;
    anyhow::ensure!(on_busy.is_none(), "the busy claim was marked: {on_busy:?}");

    // The notebook starts computing: busy again, no longer idle.
    usage(&state, 1, 60, 4002, 20_480)?;
    until("the notebook claim busy again", TIMEOUT, || async {
        let (_, body) = get(http, "/metrics").await.map_err(|e| e.to_string())?;
        Ok(body
            .lines()
            .any(|l| l.starts_with(idle) && l.ends_with(" 0"))
            .then_some(()))
    })
    .await?;
    until("the notebook's mark gone", TIMEOUT, || async {
        let mark = idle_mark(&client, "default", "notebook", DRIVER)
            .await
            .map_err(|e| e.to_string())?;
        Ok(mark.is_none().then_some(()))
    })
    .await?;
    anyhow::ensure!(sample(&metrics, "drust_usage_gpus_failing") == Some(0.0));
    Ok(())
}
