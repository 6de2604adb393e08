//! Issue 6's features together on a real control plane: `examples/mps-on-mig` (one claim, two
//! pods) on the fake DGX A100 in partitionable mode with health monitoring on. The real scheduler
//! allocates a `1g.10gb` placement; prepare through the kubelet API creates the MIG device there,
//! starts the claim's MPS control daemon on the new MIG UUID with the configured limits, and
//! writes a CDI spec that reaches both. A health event on the parent GPU taints its devices in
//! the ResourceSlice while the claim stays prepared; recovery removes the taint; unprepare stops
//! the daemon and destroys the MIG device.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use drust_e2e::claims::allocation_results;
use drust_e2e::kubelet::{Kubelet, v1_claim};
use drust_e2e::manifests::{apply_file, repo_path};
use drust_e2e::plugin::NodePlugin;
use drust_e2e::wait::until;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use gpu_inventory::fake::mig::MigState;
use gpu_inventory::{HealthEvent, HealthEventKind, MigStrategy};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::ListParams;

const DRIVER: &str = "gpu.drust.dev";
const NODE: &str = "node-mps-on-mig";
const TIMEOUT: Duration = Duration::from_secs(60);
const TAINT_KEY: &str = "gpu.drust.dev/unhealthy";

/// Every device of our pool with its taint of ours (value, effect), if any.
async fn taints(client: &kube::Client) -> Result<Vec<(String, Option<(String, String)>)>, String> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let selector = format!("spec.nodeName={NODE},spec.driver={DRIVER}");
    let slices = api
        .list(&ListParams::default().fields(&selector))
        .await
        .map_err(|e| e.to_string())?
        .items;
    let newest = slices.iter().map(|s| s.spec.pool.generation).max();
    Ok(slices
        .iter()
        .filter(|s| Some(s.spec.pool.generation) == newest)
        .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
        .map(|d| {
            let ours = d
                .taints
                .iter()
                .flatten()
                .find(|t| t.key == TAINT_KEY)
                .map(|t| (t.value.clone().unwrap_or_default(), t.effect.clone()));
            (d.name, ours)
        })
        .collect())
}

fn parent_of(device: &str) -> &str {
    device.split("-mig-").next().unwrap_or(device)
}

#[tokio::test]
async fn a_claim_shares_a_dynamic_mig_device_through_mps_while_health_is_monitored()
-> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let client = cp.client().await?;
    cp.register_node(NODE, &[]).await?;
    let topology = repo_path("examples/topologies/dgx-a100-mig.yaml");
    let mut plugin = NodePlugin::start_with(&cp, DRIVER, NODE, &topology, |c| {
        c.mig_strategy = MigStrategy::Partitionable;
        c.health_monitoring = true;
    })?;
    plugin.wait_ready(&client, TIMEOUT).await?;
    let state = plugin.fake_state_dir()?;
    let (cdi_root, mps_root) = (
        plugin.config().cdi_root.clone(),
        plugin.config().mps_root.clone(),
    );

    // 1. Both pods of the example share one claim, allocated to a 1g.10gb placement.
    apply_file(&client, &repo_path("deploy/deviceclasses/mig.yaml")).await?;
    apply_file(&client, &repo_path("examples/mps-on-mig/mps-on-mig.yaml")).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let (_, claim) =
        drust_e2e::pods::bound_with_claim(&pods, &claims, "mps-client-a", TIMEOUT).await?;
    drust_e2e::pods::bound_with_claim(&pods, &claims, "mps-client-b", TIMEOUT).await?;
    let uid = claim.metadata.uid.clone().context("claim uid")?;
    let device = allocation_results(&claim)
        .and_then(|r| r.first())
        .map(|r| r.device.clone())
        .context("claim not allocated")?;
    ensure!(device.contains("-mig-1g-10gb-"), "allocated {device}");
    let gpu_name = parent_of(&device).to_owned();

    // 2. Prepare: the MIG device is created, the MPS daemon serves it with the limits.
    let (kubelet, _) = Kubelet::register(&plugin.registration_socket()).await?;
    let started = Instant::now();
    let answer = kubelet.prepare_v1(&[&claim]).await?;
    let took = started.elapsed();
    let a = &answer.claims[&uid];
    ensure!(a.error.is_empty(), "prepare: {}", a.error);
    eprintln!("prepare (create MIG 1g.10gb + start MPS daemon, fake backend): {took:?}");
    let created: Vec<(String, String)> = MigState::load(&state.join("mig.json"))?
        .gpus
        .into_iter()
        .flat_map(|(gpu, devices)| devices.into_iter().map(move |d| (gpu.clone(), d.uuid)))
        .collect();
    ensure!(created.len() == 1, "created MIG devices: {created:?}");
    let (parent_uuid, mig_uuid) = created[0].clone();
    let log = std::fs::read_to_string(mps_root.join(&uid).join("log/control.log"))
        .context("the claim's MPS daemon log")?;
    for want in [
        format!("CUDA_VISIBLE_DEVICES={mig_uuid}"),
        "set_default_active_thread_percentage 50".to_owned(),
        "set_default_device_pinned_mem_limit 0 4096M".to_owned(),
    ] {
        ensure!(log.contains(&want), "MPS daemon log lacks {want:?}:\n{log}");
    }
    let spec: serde_json::Value = serde_json::from_slice(&std::fs::read(
        cdi_root.join(format!("{DRIVER}-claim_{uid}.json")),
    )?)?;
    // The daemon's edits are the MIG device's own (the request's), not claim-wide.
    let env_of = |edits: &serde_json::Value| -> anyhow::Result<Vec<String>> {
        Ok(edits["env"]
            .as_array()
            .context("env")?
            .iter()
            .filter_map(|e| e.as_str().map(str::to_owned))
            .collect())
    };
    let claim_env = env_of(&spec["containerEdits"])?;
    let edits = &spec["devices"][0]["containerEdits"];
    ensure!(
        claim_env.iter().any(|e| e == "NVIDIA_VISIBLE_DEVICES=void")
            && !claim_env.iter().any(|e| e.starts_with("CUDA_MPS"))
            && env_of(edits)?
                .iter()
                .any(|e| e == "CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps"),
        "{spec}"
    );
    ensure!(
        spec["devices"][0]["containerEdits"]["env"][0]
            == gpu_kubelet_plugin::claims::device_env(&device, &mig_uuid),
        "{spec}"
    );
    ensure!(
        edits["mounts"][0]["hostPath"] == mps_root.join(&uid).join("pipe").display().to_string(),
        "{edits}"
    );

    // 3. A fault on the parent GPU taints its devices; the prepared claim and its daemon stay.
    let healthy = taints(&client).await.map_err(anyhow::Error::msg)?;
    ensure!(healthy.iter().all(|(_, t)| t.is_none()), "{healthy:?}");
    let injected = Instant::now();
    plugin.inject_health_event(
        1,
        &HealthEvent {
            gpu_uuid: parent_uuid.clone(),
            kind: HealthEventKind::Xid { code: 94 },
        },
    )?;
    let tainted = until("NoSchedule taint on the claim's GPU", TIMEOUT, || {
        let client = client.clone();
        let gpu_name = gpu_name.clone();
        async move {
            let t = taints(&client).await?;
            let on_gpu: Vec<_> = t.iter().filter(|(d, _)| parent_of(d) == gpu_name).collect();
            let done = !on_gpu.is_empty()
                && on_gpu.iter().all(|(_, t)| {
                    t.as_ref()
                        .is_some_and(|(v, e)| v == "xid-94" && e == "NoSchedule")
                })
                && t.iter()
                    .filter(|(d, _)| parent_of(d) != gpu_name)
                    .all(|(_, t)| t.is_none());
            Ok(done.then_some(t)).map_err(|e: String| e)
        }
    })
    .await?;
    eprintln!(
        "XID 94 on the MPS claim's GPU -> taint on its {} devices after {} ms",
        tainted
            .iter()
            .filter(|(d, _)| parent_of(d) == gpu_name)
            .count(),
        injected.elapsed().as_millis()
    );
    let again = kubelet.prepare_v1(&[&claim]).await?;
    ensure!(
        again.claims[&uid].error.is_empty(),
        "{}",
        again.claims[&uid].error
    );
    ensure!(
        daemon_answers(&plugin.config().mps_control_binary, &mps_root.join(&uid)),
        "the MPS daemon keeps serving while the GPU is tainted"
    );
    plugin.inject_health_event(
        2,
        &HealthEvent {
            gpu_uuid: parent_uuid.clone(),
            kind: HealthEventKind::Recovered,
        },
    )?;
    until("taints removed after recovery", TIMEOUT, || {
        let client = client.clone();
        async move {
            let t = taints(&client).await?;
            Ok(t.iter().all(|(_, t)| t.is_none()).then_some(()))
        }
    })
    .await?;

    // 4. Unprepare: daemon stopped, MIG device destroyed, nothing left.
    let r = kubelet.unprepare_v1(vec![v1_claim(&claim)]).await?;
    ensure!(r.claims[&uid].error.is_empty(), "{}", r.claims[&uid].error);
    ensure!(!mps_root.join(&uid).exists(), "MPS directories removed");
    let left = MigState::load(&state.join("mig.json"))?;
    ensure!(
        left.gpus.values().all(Vec::is_empty),
        "MIG devices left: {:?}",
        left.gpus
    );
    ensure!(
        !cdi_root.join(format!("{DRIVER}-claim_{uid}.json")).exists(),
        "CDI spec removed"
    );
    plugin.stop().await?;
    Ok(())
}

/// Whether the MPS control daemon under `claim_dir` answers a control command.
fn daemon_answers(binary: &Path, claim_dir: &Path) -> bool {
    use std::io::Write;
    std::process::Command::new(binary)
        .env("CUDA_MPS_PIPE_DIRECTORY", claim_dir.join("pipe"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .and_then(|mut child| {
            if let Some(mut stdin) = child.stdin.take() {
                stdin.write_all(b"get_server_list\n")?;
            }
            child.wait()
        })
        .is_ok_and(|s| s.success())
}
