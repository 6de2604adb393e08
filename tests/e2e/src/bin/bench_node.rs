//! `bench_node`: drust's plugin against the upstream peer on a real node (kubelet v1.36.3 and
//! containerd from [`drust_e2e::node`]), both serving the same kubelet in the same run.
//!
//! The peer is `tests/gotools/cmd/peerplugin`: upstream's kubeletplugin helper publishing eight
//! GPUs and writing one durable CDI spec and checkpoint per claim, as drust does; both plugins
//! name the same fake device nodes (mknod, under a temp dir) and both run as host processes.
//!
//! Figures:
//! - plugin start to its eight devices published in ResourceSlices (its old slices deleted
//!   first), over `--starts` starts each;
//! - pod creation to phase Running for a pod with one GPU (a ResourceClaimTemplate of the
//!   plugin's DeviceClass), over `--pods` pods per plugin, one pod at a time, drust and peer
//!   alternating (which one goes first alternates too), each pod deleted (and gone) before the
//!   next; the time runs from the create call to the watch event that shows phase Running;
//! - resident memory (VmRSS) of each plugin at idle after its start, and after all pods' claims
//!   (`--pods`, 100 by default) were prepared and unprepared, with the peak (VmHWM).
//!
//! `cargo run --release -p drust-e2e --bin bench_node -- [--pods N] [--starts N]` (root, as the
//! real node needs).

use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use drust_e2e::binary::go_tool;
use drust_e2e::host::{BinaryHost, PluginProcess, stop};
use drust_e2e::manifests::repo_path;
use drust_e2e::node::{Node, NodeOptions};
use drust_e2e::node_pods::sleeping_pod_with_claim;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams, WatchEvent, WatchParams};

const NODE: &str = "gpu-node-0";
const DRUST: &str = "gpu.drust.dev";
const PEER: &str = "peer.drust.dev";
const DEVICES: usize = 8;
const TIMEOUT: Duration = Duration::from_secs(120);

/// Which plugin a figure is for.
#[derive(Clone, Copy, PartialEq)]
enum Which {
    Drust,
    Peer,
}

impl Which {
    fn driver(self) -> &'static str {
        match self {
            Which::Drust => DRUST,
            Which::Peer => PEER,
        }
    }
}

/// Starts the plugin, for either kind.
struct Launcher {
    host: BinaryHost,
    peer_bin: std::path::PathBuf,
    kubeconfig: std::path::PathBuf,
    node: NodePaths,
}

struct NodePaths {
    peer_plugin_dir: std::path::PathBuf,
    registry: std::path::PathBuf,
    cdi_root: std::path::PathBuf,
}

impl Launcher {
    fn spawn(&self, which: Which) -> anyhow::Result<PluginProcess> {
        let log = self.host.root().join(format!("{}.log", which.driver()));
        let child = match which {
            Which::Drust => {
                let mut cmd = self.host.command(&log, None)?;
                cmd.env("RUST_LOG", "warn");
                cmd.spawn()?
            }
            Which::Peer => {
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log)?;
                let mut cmd = std::process::Command::new(&self.peer_bin);
                cmd.arg("-kubeconfig")
                    .arg(&self.kubeconfig)
                    .args(["-node", NODE, "-driver", PEER])
                    // Without client-go's default rate limit (5 QPS): drust's client has none.
                    .args(["-kube-api-qps", "1000", "-kube-api-burst", "1000"])
                    .args(["-devices", &DEVICES.to_string()])
                    .arg("-dev-root")
                    .arg(self.host.root())
                    .arg("-plugin-dir")
                    .arg(&self.node.peer_plugin_dir)
                    .arg("-registrar-dir")
                    .arg(&self.node.registry)
                    .arg("-cdi-root")
                    .arg(&self.node.cdi_root)
                    .stdin(std::process::Stdio::null())
                    .stdout(file.try_clone()?)
                    .stderr(file);
                drust_e2e::die_with_parent(&mut cmd);
                cmd.spawn()?
            }
        };
        Ok(PluginProcess(child))
    }
}

/// The devices `driver` has published for the node.
async fn published(slices: &Api<ResourceSlice>, driver: &str) -> anyhow::Result<usize> {
    Ok(slices
        .list(&ListParams::default().fields(&format!("spec.driver={driver}")))
        .await?
        .items
        .iter()
        .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
        .sum())
}

/// Starts `which` with none of its slices left and times until all its devices are published.
async fn start_to_slices(
    launcher: &Launcher,
    slices: &Api<ResourceSlice>,
    which: Which,
) -> anyhow::Result<(PluginProcess, Duration)> {
    slices
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().fields(&format!("spec.driver={}", which.driver())),
        )
        .await?;
    while published(slices, which.driver()).await? > 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let start = Instant::now();
    let mut plugin = launcher.spawn(which)?;
    while published(slices, which.driver()).await? < DEVICES {
        if let Some(status) = plugin.try_wait()? {
            bail!("{} exited: {status}", which.driver());
        }
        ensure!(
            start.elapsed() < TIMEOUT,
            "{} published nothing",
            which.driver()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok((plugin, start.elapsed()))
}

/// `VmRSS` and `VmHWM` of `pid`, in KiB.
fn memory(pid: u32) -> anyhow::Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> anyhow::Result<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .with_context(|| format!("{name} of {pid}"))
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// The DeviceClass `bench-<driver>` (every device of `driver`) and a ResourceClaimTemplate of the
/// same name asking for one of them.
async fn class_and_template(client: &kube::Client, driver: &str) -> anyhow::Result<()> {
    let name = format!("bench-{}", driver.replace('.', "-"));
    let class: DeviceClass = serde_json::from_value(serde_json::json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": format!("device.driver == \"{driver}\"")}}]},
    }))?;
    Api::<DeviceClass>::all(client.clone())
        .create(&PostParams::default(), &class)
        .await?;
    let template: ResourceClaimTemplate = serde_json::from_value(serde_json::json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": name}},
        ]}}},
    }))?;
    Api::<ResourceClaimTemplate>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &template)
        .await?;
    Ok(())
}

/// A pod holding one device of `driver` (its `bench-<driver>` template) until deleted.
fn pod(name: &str, driver: &str) -> anyhow::Result<Pod> {
    sleeping_pod_with_claim(name, &format!("bench-{}", driver.replace('.', "-")))
}

/// Creates `pod` and times until a watch event shows it Running; then deletes it and waits
/// until it is gone.
async fn pod_to_running(pods: &Api<Pod>, pod: &Pod, node: &Node) -> anyhow::Result<Duration> {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let version = pods
        .list_metadata(&ListParams::default().limit(1))
        .await?
        .metadata
        .resource_version
        .unwrap_or_default();
    let params = WatchParams::default()
        .fields(&format!("metadata.name={name}"))
        .timeout(TIMEOUT.as_secs() as u32);
    let mut events = pods.watch(&params, &version).await?.boxed();
    let start = Instant::now();
    pods.create(&PostParams::default(), pod).await?;
    let took = loop {
        match events.try_next().await? {
            Some(WatchEvent::Added(p) | WatchEvent::Modified(p)) => {
                match p.status.as_ref().and_then(|s| s.phase.as_deref()) {
                    Some("Running") => break start.elapsed(),
                    Some(phase @ ("Succeeded" | "Failed")) => {
                        bail!("pod {name} {phase}: {:?}", p.status)
                    }
                    _ => {}
                }
            }
            Some(WatchEvent::Error(e)) => bail!("watching pod {name}: {e:?}"),
            Some(_) => {}
            None => bail!(
                "pod {name} not Running after {TIMEOUT:?}\n{}",
                node.log_tail()
            ),
        }
    };
    pods.delete(&name, &DeleteParams::default()).await?;
    let start = Instant::now();
    while pods.get_opt(&name).await?.is_some() {
        ensure!(start.elapsed() < TIMEOUT, "pod {name} not deleted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(took)
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)].as_secs_f64() * 1000.0
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let (mut pods_each, mut starts) = (100usize, 5usize);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--pods" => pods_each = args.next().context("--pods N")?.parse()?,
            "--starts" => starts = args.next().context("--starts N")?.parse()?,
            other => {
                bail!("unknown argument {other:?} (usage: bench_node [--pods N] [--starts N])")
            }
        }
    }
    if let Some(why) = drust_e2e::node::unsupported() {
        bail!("this machine cannot run a node: {why}");
    }
    let peer_bin = go_tool("peerplugin").map_err(anyhow::Error::msg)?;
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let client = cp.client().await?;
    let node = Node::start(&cp, NODE, NodeOptions::default()).await?;
    let topology = repo_path("examples/topologies/dgx-h100.yaml");
    let host = BinaryHost::new(
        "drust-bench-node-",
        cp.kubeconfig_path(),
        &topology,
        DRUST,
        NODE,
    )?
    .on_node(&node);
    host.make_device_nodes()?;
    std::fs::create_dir_all(host.driver_root())?;
    let launcher = Launcher {
        peer_bin,
        kubeconfig: cp.kubeconfig_path().to_owned(),
        node: NodePaths {
            peer_plugin_dir: node.plugin_dir(PEER),
            registry: node.registry_dir(),
            cdi_root: node.cdi_root(),
        },
        host,
    };
    let slices: Api<ResourceSlice> = Api::all(client.clone());

    // Start to slices, `starts` times each (the last start stays up for the pods).
    let mut start_times = [Vec::new(), Vec::new()];
    let mut running: [Option<PluginProcess>; 2] = [None, None];
    for _ in 0..starts.max(1) {
        for (i, which) in [Which::Drust, Which::Peer].into_iter().enumerate() {
            if let Some(old) = running[i].take() {
                stop(old).await?;
            }
            let (plugin, took) = start_to_slices(&launcher, &slices, which).await?;
            start_times[i].push(took);
            running[i] = Some(plugin);
        }
    }
    // Registered with the kubelet: its registration socket is there.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let pid = |i: usize| running[i].as_ref().map_or(0, |p| p.id());
    let idle = [memory(pid(0))?, memory(pid(1))?];

    for driver in [DRUST, PEER] {
        class_and_template(&client, driver).await?;
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    // One warm-up pod each, not counted.
    for which in [Which::Drust, Which::Peer] {
        pod_to_running(
            &pods,
            &pod(
                &format!("warm-{}", which.driver().replace('.', "-")),
                which.driver(),
            )?,
            &node,
        )
        .await?;
    }
    let mut latencies = [Vec::new(), Vec::new()];
    eprintln!("{pods_each} pods per plugin, one at a time...");
    for n in 0..pods_each {
        let order = if n % 2 == 0 {
            [Which::Drust, Which::Peer]
        } else {
            [Which::Peer, Which::Drust]
        };
        for which in order {
            let name = format!("{}-{n}", which.driver().replace('.', "-"));
            let took = pod_to_running(&pods, &pod(&name, which.driver())?, &node).await?;
            latencies[usize::from(which == Which::Peer)].push(took);
        }
    }
    // Every claim deallocated and gone, so both plugins have unprepared them all.
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let start = Instant::now();
    while !claims.list(&ListParams::default()).await?.items.is_empty() {
        ensure!(start.elapsed() < TIMEOUT, "claims left after their pods");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = [memory(pid(0))?, memory(pid(1))?];

    for l in &mut latencies {
        l.sort();
    }
    for s in &mut start_times {
        s.sort();
    }
    println!("| what | drust | upstream peer | ratio (peer/drust) |");
    println!("|---|---|---|---|");
    let row = |what: String, d: f64, p: f64, unit: &str| {
        println!("| {what} | {d:.0} {unit} | {p:.0} {unit} | {:.2}x |", p / d);
    };
    for (label, q) in [("p50", 0.5), ("p99", 0.99)] {
        row(
            format!("pod create to Running, 1 GPU, {label} over {pods_each} pods"),
            percentile(&latencies[0], q),
            percentile(&latencies[1], q),
            "ms",
        );
    }
    for (label, q) in [("median", 0.5), ("max", 1.0)] {
        row(
            format!("plugin start to {DEVICES} devices in ResourceSlices, {label} of {starts}"),
            percentile(&start_times[0], q),
            percentile(&start_times[1], q),
            "ms",
        );
    }
    row(
        "VmRSS at idle".into(),
        idle[0].0 as f64,
        idle[1].0 as f64,
        "KiB",
    );
    row(
        format!("VmRSS after {pods_each} claims prepared and unprepared"),
        after[0].0 as f64,
        after[1].0 as f64,
        "KiB",
    );
    row(
        "VmHWM (peak RSS) after them".into(),
        after[0].1 as f64,
        after[1].1 as f64,
        "KiB",
    );

    for plugin in running.into_iter().flatten() {
        stop(plugin).await?;
    }
    node.stop().await?;
    cp.stop().await?;
    Ok(())
}
