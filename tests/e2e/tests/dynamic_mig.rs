//! Dynamic MIG on a real control plane: on the fake DGX A100 in partitionable mode, a claim for
//! a `1g.10gb` placement is allocated by the real scheduler and prepared through the kubelet
//! API, which creates the MIG device at the allocated placement (fake state) and hands the
//! runtime a CDI spec with its capability nodes; unprepare destroys it. An injected creation
//! failure gives the kubelet a clear per-claim error and leaves nothing behind. Then the real
//! binary is SIGKILLed at every step of a dynamic MIG prepare and unprepare (DRA_PLUGIN_FAILPOINT),
//! including between creating the MIG device and recording it: every restart ends with either
//! the claim prepared once with exactly one MIG device, or nothing at all (orphans destroyed).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use drust_e2e::claims::{allocated_claim, allocation_results};
use drust_e2e::host::{BinaryHost, PluginProcess, expect_killed, stop};
use drust_e2e::kubelet::{Kubelet, v1_claim};
use drust_e2e::manifests::{apply_file, repo_path};
use drust_e2e::plugin::{NodePlugin, read_checkpoint};
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use gpu_inventory::backend::RawMigDevice;
use gpu_inventory::fake::mig::{MigState, capability_minor};
use gpu_inventory::{MigStrategy, Topology};
use gpu_kubelet_plugin::claims::device_env;
use gpu_kubelet_plugin::failpoint;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;

const DRIVER: &str = "gpu.drust.dev";
const TIMEOUT: Duration = Duration::from_secs(60);
/// GPU 3 of the fake DGX A100: MIG enabled, no MIG devices in the topology.
const GPU3_MINOR: u32 = 3;

fn topology() -> PathBuf {
    repo_path("examples/topologies/dgx-a100-mig.yaml")
}

fn gpu3_uuid() -> anyhow::Result<String> {
    let t = Topology::from_file(topology())?;
    let g = t
        .gpus
        .iter()
        .find(|g| g.minor == GPU3_MINOR)
        .context("GPU 3")?;
    Ok(g.uuid.clone())
}

/// The MIG devices of GPU 3 in the fake's state dir (the topology lists none).
fn mig_on_gpu3(state_dir: &Path) -> anyhow::Result<Vec<RawMigDevice>> {
    let state = MigState::load(&state_dir.join("mig.json"))?;
    Ok(state.gpus.get(&gpu3_uuid()?).cloned().unwrap_or_default())
}

fn read_json(path: &Path) -> anyhow::Result<serde_json::Value> {
    Ok(serde_json::from_slice(
        &std::fs::read(path).with_context(|| path.display().to_string())?,
    )?)
}

fn claim_and_pod(name: &str) -> String {
    format!(
        r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {{name: {name}, namespace: default}}
spec:
  devices:
    requests:
      - name: mig
        exactly:
          deviceClassName: mig.drust.dev
          selectors:
            - cel:
                expression: >-
                  device.attributes["gpu.drust.dev"].profile == "1g.10gb" &&
                  device.attributes["gpu.drust.dev"].parentMinor == {GPU3_MINOR}
---
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: default}}
spec:
  restartPolicy: Never
  containers:
    - {{name: cuda, image: busybox, resources: {{claims: [{{name: mig}}]}}}}
  resourceClaims:
    - {{name: mig, resourceClaimName: {name}}}
"#
    )
}

/// Applies a claim + pod for a `1g.10gb` on GPU 3 and returns the claim once the scheduler
/// allocated it.
async fn scheduled_claim(
    client: &kube::Client,
    dir: &Path,
    name: &str,
) -> anyhow::Result<ResourceClaim> {
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, claim_and_pod(name))?;
    apply_file(client, &path).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let (_, claim) = drust_e2e::pods::bound_with_claim(&pods, &claims, name, TIMEOUT).await?;
    Ok(claim)
}

fn allocated_device(claim: &ResourceClaim) -> anyhow::Result<String> {
    allocation_results(claim)
        .and_then(|r| r.first())
        .map(|r| r.device.clone())
        .context("claim not allocated")
}

#[tokio::test]
async fn a_scheduled_1g_claim_creates_its_mig_device_at_prepare_and_destroys_it_at_unprepare()
-> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let client = cp.client().await?;
    let node = "node-dgx-a100-dynamic";
    cp.register_node(node, &[]).await?;
    let mut plugin = NodePlugin::start_with(&cp, DRIVER, node, &topology(), |c| {
        c.mig_strategy = MigStrategy::Partitionable;
    })?;
    plugin.wait_ready(&client, TIMEOUT).await?;
    let state = plugin.fake_state_dir()?;
    let cdi_root = plugin.config().cdi_root.clone();
    let scratch = tempfile::tempdir()?;
    apply_file(&client, &repo_path("deploy/deviceclasses/mig.yaml")).await?;

    // The scheduler allocates a 1g.10gb placement on GPU 3.
    let claim = scheduled_claim(&client, scratch.path(), "dyn-1g").await?;
    let uid = claim.metadata.uid.clone().context("uid")?;
    let device = allocated_device(&claim)?;
    let start: u32 = device
        .rsplit('-')
        .next()
        .and_then(|s| s.parse().ok())
        .context("placement start in the device name")?;
    ensure!(
        device.starts_with("gpu-0000-4e-00-0-mig-1g-10gb-"),
        "allocated {device}"
    );
    ensure!(
        mig_on_gpu3(&state)?.is_empty(),
        "no MIG device before prepare"
    );

    let (kubelet, _) = Kubelet::register(&plugin.registration_socket()).await?;
    let started = Instant::now();
    let answer = kubelet.prepare_v1(&[&claim]).await?;
    let took = started.elapsed();
    let a = &answer.claims[&uid];
    ensure!(a.error.is_empty(), "prepare: {}", a.error);
    eprintln!("dynamic MIG prepare through the kubelet API (1g.10gb, fake backend): {took:?}");

    let mig = mig_on_gpu3(&state)?;
    ensure!(mig.len() == 1, "MIG devices on GPU 3: {mig:?}");
    let m = &mig[0];
    ensure!(
        m.profile_id == 19 && m.placement.start == start && m.placement.size == 1,
        "created {m:?} for {device}"
    );
    let spec = read_json(&cdi_root.join(format!("{DRIVER}-claim_{uid}.json")))?;
    ensure!(
        spec["devices"][0]["containerEdits"]["env"][0] == device_env(&device, &m.uuid)
            && spec["containerEdits"]["env"][0] == "NVIDIA_VISIBLE_DEVICES=void",
        "{spec}"
    );
    let nodes: Vec<String> = spec["devices"][0]["containerEdits"]["deviceNodes"]
        .as_array()
        .context("device nodes")?
        .iter()
        .filter_map(|n| n["path"].as_str().map(String::from))
        .collect();
    let want = vec![
        format!("/dev/nvidia{GPU3_MINOR}"),
        format!(
            "/dev/nvidia-caps/nvidia-cap{}",
            capability_minor(GPU3_MINOR, m.gpu_instance_id, None)
        ),
        format!(
            "/dev/nvidia-caps/nvidia-cap{}",
            capability_minor(GPU3_MINOR, m.gpu_instance_id, Some(m.compute_instance_id))
        ),
    ];
    ensure!(nodes == want, "CDI device nodes {nodes:?}, want {want:?}");

    let r = kubelet.unprepare_v1(vec![v1_claim(&claim)]).await?;
    ensure!(r.claims[&uid].error.is_empty(), "{}", r.claims[&uid].error);
    ensure!(
        mig_on_gpu3(&state)?.is_empty(),
        "MIG device left after unprepare"
    );

    // An injected creation failure: a clear per-claim error, nothing left behind.
    let failing = scheduled_claim(&client, scratch.path(), "dyn-1g-fail").await?;
    let failing_uid = failing.metadata.uid.clone().context("uid")?;
    let failing_device = allocated_device(&failing)?;
    std::fs::write(state.join("fail-mig-create"), b"")?;
    let r = kubelet.prepare_v1(&[&failing]).await?;
    std::fs::remove_file(state.join("fail-mig-create"))?;
    let err = &r.claims[&failing_uid].error;
    for needle in [
        "default/dyn-1g-fail",
        failing_device.as_str(),
        "1g.10gb",
        "memory slices",
        "injected",
    ] {
        ensure!(err.contains(needle), "error lacks {needle:?}: {err}");
    }
    eprintln!("failed MIG creation, as the kubelet sees it: {err}");
    ensure!(
        mig_on_gpu3(&state)?.is_empty(),
        "MIG device left after a failed creation"
    );
    ensure!(
        !cdi_root
            .join(format!("{DRIVER}-claim_{failing_uid}.json"))
            .exists(),
        "CDI spec left after a failed creation"
    );
    let checkpoint =
        read_checkpoint(&plugin.config().checkpoint_path).map_err(anyhow::Error::msg)?;
    ensure!(
        checkpoint["claims"]
            .as_object()
            .is_none_or(|c| c.is_empty()),
        "checkpoint keeps {checkpoint}"
    );
    // Retried without the fault, it prepares.
    let r = kubelet.prepare_v1(&[&failing]).await?;
    ensure!(
        r.claims[&failing_uid].error.is_empty(),
        "{}",
        r.claims[&failing_uid].error
    );
    ensure!(mig_on_gpu3(&state)?.len() == 1);
    let r = kubelet.unprepare_v1(vec![v1_claim(&failing)]).await?;
    ensure!(
        r.claims[&failing_uid].error.is_empty(),
        "{}",
        r.claims[&failing_uid].error
    );

    drop(kubelet);
    plugin.stop().await?;
    cp.stop().await?;
    Ok(())
}

struct Host(BinaryHost);

impl std::ops::Deref for Host {
    type Target = BinaryHost;
    fn deref(&self) -> &BinaryHost {
        &self.0
    }
}

impl Host {
    fn state(&self) -> PathBuf {
        self.state_dir()
    }
    fn registration_socket(&self) -> PathBuf {
        self.registry().join(format!("{DRIVER}-reg.sock"))
    }
    fn log(&self) -> String {
        std::fs::read_to_string(self.root().join("plugin.log")).unwrap_or_default()
    }

    fn start(&self, failpoint: Option<&str>) -> anyhow::Result<PluginProcess> {
        let _ = std::fs::remove_file(self.registration_socket());
        let mut cmd = self.command(&self.root().join("plugin.log"), failpoint)?;
        cmd.args(["--mig-strategy", "partitionable"])
            .arg("--fake-state-dir")
            .arg(self.state());
        let start = Instant::now();
        let mut child = PluginProcess(cmd.spawn().context("spawning gpu-kubelet-plugin")?);
        while !self.registration_socket().exists() {
            if let Some(status) = child.0.try_wait()? {
                bail!("plugin exited at start: {status}; log: {}", self.log());
            }
            ensure!(
                start.elapsed() < TIMEOUT,
                "plugin not ready; log: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(child)
    }
}

#[tokio::test]
async fn a_plugin_killed_at_every_step_of_a_dynamic_mig_claim_leaves_one_device_or_none()
-> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let client = cp.client().await?;
    let host = Host(BinaryHost::new(
        "drust-dynmig-",
        cp.kubeconfig_path(),
        &topology(),
        DRIVER,
        "node-dgx-a100-crash",
    )?);
    cp.register_node(host.node(), &[]).await?;
    let device = "gpu-0000-4e-00-0-mig-1g-10gb-0".to_owned();
    let fps: Vec<&str> = failpoint::MIG
        .iter()
        .chain(failpoint::ALL.iter())
        .copied()
        .collect();
    let started = Instant::now();
    for (n, fp) in fps.iter().enumerate() {
        let claim = allocated_claim(
            &client,
            &format!("crash-{n}"),
            DRIVER,
            host.node(),
            std::slice::from_ref(&device),
        )
        .await?;
        let uid = claim.metadata.uid.clone().context("uid")?;
        if fp.starts_with("prepare/") {
            let child = host.start(Some(fp))?;
            let (k, _) = Kubelet::register(&host.registration_socket()).await?;
            let _ = k.prepare_v1(&[&claim]).await;
            expect_killed(child, fp, TIMEOUT).await?;
        } else {
            let child = host.start(None)?;
            let (k, _) = Kubelet::register(&host.registration_socket()).await?;
            let r = k.prepare_v1(&[&claim]).await?;
            ensure!(
                r.claims[&uid].error.is_empty(),
                "{fp}: {}",
                r.claims[&uid].error
            );
            drop(k);
            stop(child).await?;
            let child = host.start(Some(fp))?;
            let (k, _) = Kubelet::register(&host.registration_socket()).await?;
            let _ = k.unprepare_v1(vec![v1_claim(&claim)]).await;
            expect_killed(child, fp, TIMEOUT).await?;
        }
        let after_crash = mig_on_gpu3(&host.state())?;

        // Restart: recovery leaves at most the device of a completed prepare.
        let child = host.start(None)?;
        let recovered = mig_on_gpu3(&host.state())?;
        ensure!(recovered.len() <= 1, "{fp}: after restart {recovered:?}");
        let (k, _) = Kubelet::register(&host.registration_socket()).await?;
        if n % 2 == 0 {
            // The kubelet retries the prepare: exactly one MIG device, the one recorded.
            let r = k.prepare_v1(&[&claim]).await?;
            ensure!(
                r.claims[&uid].error.is_empty(),
                "{fp}: {}",
                r.claims[&uid].error
            );
            let mig = mig_on_gpu3(&host.state())?;
            ensure!(mig.len() == 1, "{fp}: after retry {mig:?}");
            let cp_json = read_checkpoint(&host.plugin_dir().join("checkpoint.json"))
                .map_err(anyhow::Error::msg)?;
            let recorded = &cp_json["claims"][&uid]["devices"][0]["mig"]["uuid"];
            ensure!(
                recorded == mig[0].uuid.as_str(),
                "{fp}: recorded {recorded}, have {mig:?}"
            );
            let spec = read_json(&host.cdi_root().join(format!("{DRIVER}-claim_{uid}.json")))?;
            ensure!(
                spec["devices"][0]["containerEdits"]["env"][0]
                    .as_str()
                    .is_some_and(|e| e.ends_with(&format!("={}", mig[0].uuid))),
                "{fp}: {spec}"
            );
        }
        let r = k.unprepare_v1(vec![v1_claim(&claim)]).await?;
        ensure!(
            r.claims[&uid].error.is_empty(),
            "{fp}: {}",
            r.claims[&uid].error
        );
        let left = mig_on_gpu3(&host.state())?;
        ensure!(left.is_empty(), "{fp}: MIG devices left {left:?}");
        let specs = std::fs::read_dir(host.cdi_root())?.count();
        ensure!(specs == 0, "{fp}: {specs} CDI specs left");
        if *fp == "prepare/after-mig-create" {
            ensure!(
                after_crash.len() == 1,
                "{fp}: the crash left {after_crash:?}"
            );
            let orphan = &after_crash[0].uuid;
            ensure!(
                host.log()
                    .lines()
                    .any(|l| l.contains("no prepared claim owns") && l.contains(orphan.as_str())),
                "{fp}: destroying orphan {orphan} was not logged"
            );
        }
        drop(k);
        stop(child).await?;
    }
    eprintln!(
        "dynamic MIG fault injection: {} failpoints in {:.1} s",
        fps.len(),
        started.elapsed().as_secs_f64()
    );
    cp.stop().await?;
    Ok(())
}
