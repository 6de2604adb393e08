//! The example driver (`examples/dra-example-driver`, a second implementation of the
//! `dra-plugin` lifecycle) put through the GPU plugin's crash-safety suite: the real binary is
//! SIGKILLed at every lifecycle failpoint, restarted, and the kubelet's call repeated (by the
//! kubelet's own client code), on a real control plane. Every run must end with the claim
//! prepared exactly once (its CDI spec naming its device to the container, the device's owner
//! file naming the claim) or cleanly unprepared, a bystander claim untouched, no device in two
//! claims, and no stray files. Then the same binary serves a real kubelet (containerd, the
//! scheduler) for `examples/dra-example-driver/demo.yaml`'s pod.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use dra_example_driver::ExampleFormat;
use dra_plugin::checkpoint::SlotFile;
use dra_plugin::storage::RealFs;
use drust_e2e::claims::allocated_claim;
use drust_e2e::host::{PluginProcess, expect_killed, stop};
use drust_e2e::kubelet::{Kubelet, v1_claim};
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::resource::v1::ResourceClaim;

const DRIVER: &str = "example.drust.dev";
const NODE: &str = "example-node-0";
const DEVICES: usize = 4;
/// Runs per failpoint; half retry the prepare after the crash, half give up and unprepare.
const REPS: usize = 10;

/// The example driver's directories under one temporary root.
struct Host {
    root: tempfile::TempDir,
    binary: PathBuf,
    kubeconfig: PathBuf,
}

impl Host {
    fn plugin_dir(&self) -> PathBuf {
        self.root.path().join("plugin")
    }
    fn registry(&self) -> PathBuf {
        self.root.path().join("registry")
    }
    fn cdi_root(&self) -> PathBuf {
        self.root.path().join("cdi")
    }
    fn state_dir(&self) -> PathBuf {
        self.plugin_dir().join("devices")
    }
    fn registration_socket(&self) -> PathBuf {
        self.registry().join(format!("{DRIVER}-reg.sock"))
    }
    fn log(&self) -> PathBuf {
        self.root.path().join("driver.log")
    }

    /// Starts the driver, armed with `failpoint` if given, and waits for its sockets.
    fn start(&self, failpoint: Option<&str>) -> anyhow::Result<PluginProcess> {
        let _ = std::fs::remove_file(self.registration_socket());
        let log = || {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.log())
        };
        let mut cmd = Command::new(&self.binary);
        cmd.args(["--driver-name", DRIVER, "--node-name", NODE])
            .args(["--devices", &DEVICES.to_string()])
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--plugin-dir")
            .arg(self.plugin_dir())
            .arg("--registrar-dir")
            .arg(self.registry())
            .arg("--cdi-root")
            .arg(self.cdi_root())
            .arg("--boot-id-file")
            .arg(self.root.path().join("boot_id"))
            .env("RUST_LOG", "info")
            .env_remove(dra_plugin::failpoint::ENV)
            .stdin(Stdio::null())
            .stdout(log()?)
            .stderr(log()?);
        if let Some(fp) = failpoint {
            cmd.env(dra_plugin::failpoint::ENV, fp);
        }
        drust_e2e::die_with_parent(&mut cmd);
        let started = Instant::now();
        let mut child = PluginProcess(cmd.spawn().context("spawning dra-example-driver")?);
        while !self.registration_socket().exists() {
            if let Some(status) = child.0.try_wait()? {
                bail!("driver exited at start: {status}; log: {}", self.log_tail());
            }
            ensure!(
                started.elapsed() < Duration::from_secs(30),
                "driver not ready; log: {}",
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(child)
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.log()).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Arms `fp` and makes the kubelet's call it is on for `claim` (for `unprepare/...`, after
    /// a clean prepare): the driver must die at the failpoint.
    async fn kill_at(&self, fp: &str, claim: &ResourceClaim) -> anyhow::Result<()> {
        let uid = claim.metadata.uid.clone().context("uid")?;
        if fp.starts_with("prepare/") {
            let child = self.start(Some(fp))?;
            let (k, _) = Kubelet::register(&self.registration_socket()).await?;
            let _ = k.prepare_v1(&[claim]).await; // the driver dies mid-call
            return Ok(expect_killed(child, fp, Duration::from_secs(60)).await?);
        }
        let child = self.start(None)?;
        let (k, _) = Kubelet::register(&self.registration_socket()).await?;
        let r = k.prepare_v1(&[claim]).await?;
        ensure!(
            r.claims[&uid].error.is_empty(),
            "{fp}: {}",
            r.claims[&uid].error
        );
        drop(k);
        stop(child).await?;
        let child = self.start(Some(fp))?;
        let (k, _) = Kubelet::register(&self.registration_socket()).await?;
        let _ = k.unprepare_v1(vec![v1_claim(claim)]).await;
        Ok(expect_killed(child, fp, Duration::from_secs(60)).await?)
    }

    /// The driver's checkpoint as its own format reads it.
    fn checkpoint_claims(&self) -> anyhow::Result<BTreeMap<String, serde_json::Value>> {
        let file = SlotFile::<ExampleFormat>::new(
            std::sync::Arc::new(RealFs),
            self.plugin_dir().join("checkpoint.json"),
        );
        let records = file.load()?.unwrap_or_default();
        Ok(serde_json::from_value(
            serde_json::to_value(records)?["claims"].clone(),
        )?)
    }

    /// File names in `dir`, sorted.
    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// Each device's owner file: device name to the claim UID it names.
    fn owners(&self) -> BTreeMap<String, String> {
        Self::names(&self.state_dir())
            .into_iter()
            .map(|n| {
                let owner = std::fs::read_to_string(self.state_dir().join(&n)).unwrap_or_default();
                (n, owner)
            })
            .collect()
    }
}

#[tokio::test]
async fn the_example_driver_killed_at_every_step_recovers_to_prepared_once_or_cleanly_unprepared()
-> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let client = cp.client().await?;
    cp.register_node(NODE, &[]).await?;
    let host = Host {
        root: tempfile::Builder::new()
            .prefix("drust-example-")
            .tempdir()?,
        binary: drust_e2e::binary::example_driver_binary().map_err(anyhow::Error::msg)?,
        kubeconfig: cp.kubeconfig_path().to_owned(),
    };
    std::fs::write(host.root.path().join("boot_id"), "boot-1\n")?;

    // The driver publishes its devices.
    let child = host.start(None)?;
    let slices = kube::Api::<k8s_openapi::api::resource::v1::ResourceSlice>::all(client.clone())
        .list(&Default::default())
        .await?;
    let published: Vec<String> = slices
        .items
        .iter()
        .filter(|s| s.spec.driver == DRIVER)
        .flat_map(|s| s.spec.devices.iter().flatten().map(|d| d.name.clone()))
        .collect();
    ensure!(
        published == ["dev-0", "dev-1", "dev-2", "dev-3"],
        "published {published:?}"
    );

    // A bystander claim stays prepared on dev-0 through every crash.
    let bystander = allocated_claim(&client, "bystander", DRIVER, NODE, &["dev-0".into()]).await?;
    let bystander_uid = bystander.metadata.uid.clone().context("uid")?;
    let (kubelet, _) = Kubelet::register(&host.registration_socket()).await?;
    let answer = kubelet.prepare_v1(&[&bystander]).await?.claims[&bystander_uid].clone();
    ensure!(answer.error.is_empty(), "{}", answer.error);
    drop(kubelet);
    stop(child).await?;

    let started = Instant::now();
    let mut kills: BTreeMap<&str, usize> = BTreeMap::new();
    let mut n = 0;
    for fp in dra_plugin::failpoint::LIFECYCLE {
        for rep in 0..REPS {
            n += 1;
            let devices: Vec<String> = if rep % 2 == 0 {
                vec![format!("dev-{}", 1 + n % 3)]
            } else {
                vec![
                    format!("dev-{}", 1 + n % 3),
                    format!("dev-{}", 1 + (n + 1) % 3),
                ]
            };
            let claim = allocated_claim(&client, &format!("c{n}"), DRIVER, NODE, &devices).await?;
            let uid = claim.metadata.uid.clone().context("uid")?;
            let ctx = || format!("{fp} run {rep} ({devices:?})");

            host.kill_at(fp, &claim).await.context(ctx())?;
            *kills.entry(fp).or_default() += 1;

            // Restart and repeat what the kubelet would do next.
            let child = host.start(None)?;
            let (k, _) = Kubelet::register(&host.registration_socket()).await?;
            if rep % 2 == 0 {
                let r = k.prepare_v1(&[&claim]).await?;
                let a = &r.claims[&uid];
                ensure!(a.error.is_empty(), "{}: {}", ctx(), a.error);
                let got: Vec<&str> = a.devices.iter().map(|d| d.device_name.as_str()).collect();
                ensure!(got == devices, "{}: prepared {got:?}", ctx());
                let claims = host.checkpoint_claims()?;
                ensure!(
                    claims[&uid]["state"] == "PrepareCompleted",
                    "{}: {:?}",
                    ctx(),
                    claims[&uid]
                );
                // What the container gets: each device named in its environment.
                let spec: serde_json::Value = serde_json::from_slice(&std::fs::read(
                    host.cdi_root().join(format!("{DRIVER}-claim_{uid}.json")),
                )?)?;
                let env = spec["devices"][0]["containerEdits"]["env"][0].clone();
                ensure!(
                    env == format!("EXAMPLE_DEVICE_0={}", devices[0]).as_str(),
                    "{}: CDI spec {spec}",
                    ctx()
                );
                let owners = host.owners();
                for d in &devices {
                    ensure!(owners.get(d) == Some(&uid), "{}: owners {owners:?}", ctx());
                }
                let again = k.prepare_v1(&[&claim]).await?;
                ensure!(
                    again.claims[&uid].devices == a.devices,
                    "{}: answer changed",
                    ctx()
                );
            }
            let r = k.unprepare_v1(vec![v1_claim(&claim)]).await?;
            ensure!(
                r.claims[&uid].error.is_empty(),
                "{}: {}",
                ctx(),
                r.claims[&uid].error
            );

            // Clean: only the bystander is left, intact; no temp files anywhere.
            let claims = host.checkpoint_claims()?;
            ensure!(
                claims.keys().collect::<Vec<_>>() == [&bystander_uid],
                "{}: checkpoint holds {:?}",
                ctx(),
                claims.keys()
            );
            ensure!(
                Host::names(&host.cdi_root()) == [format!("{DRIVER}-claim_{bystander_uid}.json")],
                "{}: CDI specs {:?}",
                ctx(),
                Host::names(&host.cdi_root())
            );
            ensure!(
                host.owners() == BTreeMap::from([("dev-0".to_owned(), bystander_uid.clone())]),
                "{}: owner files {:?}",
                ctx(),
                host.owners()
            );
            let stray: Vec<String> = [host.cdi_root(), host.plugin_dir(), host.state_dir()]
                .iter()
                .flat_map(|d| Host::names(d))
                .filter(|n| n.ends_with(".tmp"))
                .collect();
            ensure!(stray.is_empty(), "{}: stray {stray:?}", ctx());
            let b = k.prepare_v1(&[&bystander]).await?;
            ensure!(
                b.claims[&bystander_uid].devices == answer.devices,
                "{}: bystander changed",
                ctx()
            );
            drop(k);
            stop(child).await?;
        }
    }
    let total: usize = kills.values().sum();
    eprintln!(
        "example driver: {total} SIGKILLs over {} failpoints in {:.1} s: {kills:?}",
        kills.len(),
        started.elapsed().as_secs_f64()
    );
    ensure!(
        kills.len() == dra_plugin::failpoint::LIFECYCLE.len() && kills.values().all(|&k| k == REPS)
    );
    cp.stop().await?;
    Ok(())
}

/// What the example pod's container prints into its termination message.
const PRINT_ENV: &str = "{ env | grep '^EXAMPLE_' | sort; echo done; } > /dev/termination-log; cat /dev/termination-log";

/// The example driver serving a real kubelet: the scheduler allocates one of its published
/// devices to `examples/dra-example-driver/demo.yaml`'s pod, the kubelet has the driver prepare
/// it, containerd injects its CDI spec, and the container sees the device named in its
/// environment; deleting the pod unprepares the claim (its spec and its device's owner file
/// gone).
#[tokio::test]
async fn the_example_driver_serves_a_real_kubelet_and_the_container_sees_its_device()
-> anyhow::Result<()> {
    use drust_e2e::node::{Node, NodeOptions};
    use drust_e2e::node_pods::{terminated_message, wait_pod_done};
    use k8s_openapi::api::core::v1::Pod;

    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let client = cp.client().await?;
    let node = Node::start(&cp, NODE, NodeOptions::default()).await?;
    let root = tempfile::Builder::new()
        .prefix("drust-example-node-")
        .tempdir()?;
    std::fs::write(root.path().join("boot_id"), "boot-1\n")?;
    let plugin_dir = node.plugin_dir(DRIVER);
    let log = root.path().join("driver.log");
    let mut cmd =
        Command::new(drust_e2e::binary::example_driver_binary().map_err(anyhow::Error::msg)?);
    cmd.args(["--driver-name", DRIVER, "--node-name", NODE])
        .args(["--devices", &DEVICES.to_string()])
        .arg("--kubeconfig")
        .arg(cp.kubeconfig_path())
        .arg("--plugin-dir")
        .arg(&plugin_dir)
        .arg("--registrar-dir")
        .arg(node.registry_dir())
        .arg("--cdi-root")
        .arg(node.cdi_root())
        .arg("--boot-id-file")
        .arg(root.path().join("boot_id"))
        .env("RUST_LOG", "info")
        .env_remove(dra_plugin::failpoint::ENV)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log)?)
        .stderr(std::fs::OpenOptions::new().append(true).open(&log)?);
    drust_e2e::die_with_parent(&mut cmd);
    let driver = PluginProcess(cmd.spawn().context("spawning dra-example-driver")?);

    let demo = drust_e2e::manifests::repo_path("examples/dra-example-driver/demo.yaml");
    let text =
        drust_e2e::manifests::on_workload_image(&std::fs::read_to_string(&demo)?, PRINT_ENV)?;
    drust_e2e::manifests::apply_yaml(&client, &text, &demo).await?;
    // The claim generated for the pod, once allocated (it goes when the pod completes).
    let claims: kube::Api<ResourceClaim> = kube::Api::namespaced(client.clone(), "default");
    let start = Instant::now();
    let claim = loop {
        let allocated = claims
            .list(&Default::default())
            .await?
            .items
            .into_iter()
            .find(|c| c.status.as_ref().is_some_and(|s| s.allocation.is_some()));
        if let Some(c) = allocated {
            break c;
        }
        ensure!(
            start.elapsed() < Duration::from_secs(120),
            "no claim allocated\n{}",
            node.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let uid = claim.metadata.uid.clone().context("uid")?;
    let device = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref()?.first())
        .map(|r| r.device.clone())
        .context("allocation")?;

    let pods: kube::Api<Pod> = kube::Api::namespaced(client.clone(), "default");
    let pod = wait_pod_done(&pods, "example", &node)
        .await
        .with_context(|| {
            format!(
                "driver log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            )
        })?;
    let seen = terminated_message(&pod, "main").unwrap_or_default();
    eprintln!("what the container saw:\n{seen}");
    ensure!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Succeeded"),
        "pod failed: {:?}",
        pod.status
    );
    let lines: Vec<&str> = seen.lines().collect();
    let want = [
        format!("EXAMPLE_CLAIM_UID={uid}"),
        format!("EXAMPLE_DEVICE_0={device}"),
        "done".to_owned(),
    ];
    ensure!(lines == want, "the container saw {lines:?}, want {want:?}");
    let log_text = std::fs::read_to_string(&log)?;
    ensure!(
        log_text.contains("prepared") && log_text.contains(&uid),
        "the driver logged no prepare of {uid}:\n{log_text}"
    );

    // Deleting the pod makes the kubelet unprepare: the spec and the owner file go.
    pods.delete("example", &Default::default()).await?;
    let spec = node.cdi_root().join(format!("{DRIVER}-claim_{uid}.json"));
    let start = Instant::now();
    while spec.exists() || plugin_dir.join("devices").join(&device).exists() {
        ensure!(
            start.elapsed() < Duration::from_secs(120),
            "not unprepared after the pod was deleted\n{}",
            node.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop(driver).await?;
    node.stop().await?;
    cp.stop().await?;
    Ok(())
}
