//! `bench_prepare`: prepare/unprepare latency over the real kubelet sockets, drust against the
//! upstream peer (`tests/gotools/cmd/peerplugin`: k8s.io/dynamic-resource-allocation's
//! kubeletplugin helper with the same durable file work), in one run on one control plane.
//!
//! Scenarios: a claim of 1 GPU, a claim of 8 GPUs, and 8 one-GPU claims prepared by 8 concurrent
//! calls (as for 8 pods starting at once). Each iteration prepares then unprepares; every call's
//! latency counts, including the API-server read of the claim and every fsync. The two plugins
//! take turns iteration by iteration (which goes first alternates).
//!
//! Fractional GPUs (drust only: the peer has no shares): drust runs with
//! `--consumable-capacity` and the fake MPS tool, and each round also prepares and unprepares a
//! share of one GPU alone (its prepare starts the GPU's MPS daemon, its unprepare stops it) and a
//! share beside another share of that GPU (the daemon already runs), printed next to the whole
//! GPU of the same round.
//!
//! With `--baseline <gpu-kubelet-plugin binary>` (an earlier build), that build runs as a third
//! plugin in the same rounds and a table compares this build with it.
//!
//! `cargo run --release -p drust-e2e --bin bench_prepare -- [--iterations N] [--baseline PATH]`

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use drust_e2e::binary::{go_tool, plugin_binary};
use drust_e2e::claims::allocated_claim;
use drust_e2e::kubelet::{Kubelet, v1_claim};
use drust_e2e::manifests::repo_path;
use drust_e2e::plugin::fake_host;
use drust_e2e::{ControlPlane, ControlPlaneOptions, die_with_parent};
use k8s_openapi::api::resource::v1::ResourceClaim;

const NODE: &str = "gpu-node-0";

struct Plugin {
    child: Child,
    registration: PathBuf,
    driver: String,
}

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
    }
}

fn spawn(
    mut cmd: Command,
    registration: PathBuf,
    driver: &str,
    log: &Path,
) -> anyhow::Result<Plugin> {
    let log = std::fs::File::create(log)?;
    die_with_parent(&mut cmd);
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()?;
    let start = Instant::now();
    while !registration.exists() {
        if let Some(s) = child.try_wait()? {
            bail!("{driver} plugin exited: {s}");
        }
        ensure!(
            start.elapsed() < Duration::from_secs(30),
            "{driver} plugin not ready"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(Plugin {
        child,
        registration,
        driver: driver.to_owned(),
    })
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)].as_secs_f64() * 1000.0
}

#[derive(Default)]
struct Samples {
    prepare: Vec<Duration>,
    unprepare: Vec<Duration>,
}

async fn call_prepare(k: &Kubelet, claims: &[&ResourceClaim]) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let r = k.prepare_v1(claims).await?;
    let took = t.elapsed();
    for (uid, a) in &r.claims {
        ensure!(a.error.is_empty(), "prepare {uid}: {}", a.error);
    }
    Ok(took)
}

async fn call_unprepare(k: &Kubelet, claims: &[&ResourceClaim]) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let r = k
        .unprepare_v1(claims.iter().map(|c| v1_claim(c)).collect())
        .await?;
    let took = t.elapsed();
    for (uid, a) in &r.claims {
        ensure!(a.error.is_empty(), "unprepare {uid}: {}", a.error);
    }
    Ok(took)
}

/// One plugin's claims for the three scenarios, the kubelet connection, and the samples.
struct Bench {
    one: ResourceClaim,
    eight: ResourceClaim,
    singles: Vec<ResourceClaim>,
    kubelet: Kubelet,
    samples: [Samples; 3],
}

impl Bench {
    /// Creates the claims (allocated to `devices` of the plugin's driver) and registers with
    /// the plugin as the kubelet does.
    async fn new(
        client: &kube::Client,
        plugin: &Plugin,
        devices: &[String],
    ) -> anyhow::Result<Self> {
        let d = &plugin.driver;
        let prefix = d.replace('.', "-");
        let one = allocated_claim(client, &format!("{prefix}-one"), d, NODE, &devices[..1]).await?;
        let eight =
            allocated_claim(client, &format!("{prefix}-eight"), d, NODE, &devices[..8]).await?;
        let mut singles = Vec::new();
        for (i, dev) in devices.iter().take(8).enumerate() {
            singles.push(
                allocated_claim(
                    client,
                    &format!("{prefix}-single-{i}"),
                    d,
                    NODE,
                    std::slice::from_ref(dev),
                )
                .await?,
            );
        }
        let (kubelet, _) = Kubelet::register(&plugin.registration).await?;
        Ok(Self {
            one,
            eight,
            singles,
            kubelet,
            samples: Default::default(),
        })
    }

    /// One round of the three scenarios; its latencies are kept when `keep`.
    async fn round(&mut self, keep: bool) -> anyhow::Result<()> {
        let k = &self.kubelet;
        let p = call_prepare(k, &[&self.one]).await?;
        let u = call_unprepare(k, &[&self.one]).await?;
        if keep {
            self.samples[0].prepare.push(p);
            self.samples[0].unprepare.push(u);
        }
        let p = call_prepare(k, &[&self.eight]).await?;
        let u = call_unprepare(k, &[&self.eight]).await?;
        if keep {
            self.samples[1].prepare.push(p);
            self.samples[1].unprepare.push(u);
        }
        // Eight pods' claims at once, as the kubelet sends them: concurrent calls on its one
        // connection to the plugin.
        let prepared = futures::future::try_join_all(
            self.singles
                .iter()
                .map(|c| async move { call_prepare(k, &[c]).await }),
        )
        .await?;
        let unprepared = futures::future::try_join_all(
            self.singles
                .iter()
                .map(|c| async move { call_unprepare(k, &[c]).await }),
        )
        .await?;
        if keep {
            self.samples[2].prepare.extend(prepared);
            self.samples[2].unprepare.extend(unprepared);
        }
        Ok(())
    }
}

/// Shares of one GPU on drust: a share alone, and one beside a second share.
struct Shares {
    alone: ResourceClaim,
    beside: ResourceClaim,
    other: ResourceClaim,
    kubelet: Kubelet,
    samples: [Samples; 2],
}

impl Shares {
    /// The share claims of `plugin` on `device`, named `<prefix>share-...`.
    async fn new(
        client: &kube::Client,
        plugin: &Plugin,
        device: &str,
        prefix: &str,
    ) -> anyhow::Result<Self> {
        let d = &plugin.driver;
        let mut claims = Vec::new();
        for (n, name) in ["share-alone", "share-beside", "share-other"]
            .iter()
            .enumerate()
        {
            let id = format!("00000000-0000-4000-8000-{n:012}");
            let name = format!("{prefix}{name}");
            claims.push(
                drust_e2e::claims::allocated_share(client, &name, d, NODE, device, &id, "20Gi")
                    .await?,
            );
        }
        let [alone, beside, other]: [ResourceClaim; 3] = claims
            .try_into()
            .map_err(|_| anyhow::anyhow!("three share claims"))?;
        Ok(Self {
            alone,
            beside,
            other,
            kubelet: Kubelet::register(&plugin.registration).await?.0,
            samples: Default::default(),
        })
    }

    async fn round(&mut self, keep: bool) -> anyhow::Result<()> {
        let k = &self.kubelet;
        let p = call_prepare(k, &[&self.alone]).await?;
        let u = call_unprepare(k, &[&self.alone]).await?;
        if keep {
            self.samples[0].prepare.push(p);
            self.samples[0].unprepare.push(u);
        }
        call_prepare(k, &[&self.other]).await?;
        let p = call_prepare(k, &[&self.beside]).await?;
        let u = call_unprepare(k, &[&self.beside]).await?;
        call_unprepare(k, &[&self.other]).await?;
        if keep {
            self.samples[1].prepare.push(p);
            self.samples[1].unprepare.push(u);
        }
        Ok(())
    }
}

/// Starts drust's plugin `bin` as driver `driver` on the fake DGX H100, its directories under
/// `<dir>/<name>`, with fractional GPUs and the fake MPS tool.
fn spawn_drust(
    bin: &Path,
    driver: &str,
    name: &str,
    cp: &ControlPlane,
    dir: &Path,
    topology: &Path,
) -> anyhow::Result<Plugin> {
    let mut cmd = Command::new(bin);
    cmd.args(["--driver-name", driver, "--node-name", NODE])
        .arg("--kubeconfig")
        .arg(cp.kubeconfig_path())
        .arg("--fake-topology")
        .arg(topology)
        .arg("--plugin-dir")
        .arg(dir.join(format!("{name}/plugin")))
        .arg("--registrar-dir")
        .arg(dir.join(format!("{name}/registry")))
        .arg("--cdi-root")
        .arg(dir.join(format!("{name}/cdi")))
        .arg("--proc-root")
        .arg(dir)
        .arg("--dev-root")
        .arg(dir)
        .arg("--boot-id-file")
        .arg(dir.join("boot_id"))
        .args(["--consumable-capacity", "true", "--mps-control-binary"])
        .arg(drust_fakes::mps_control())
        .arg("--mps-root")
        .arg(dir.join(format!("{name}/mps")))
        .env("RUST_LOG", "warn");
    spawn(
        cmd,
        dir.join(format!("{name}/registry/{driver}-reg.sock")),
        driver,
        &dir.join(format!("{name}.log")),
    )
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut iterations = 100;
    let mut baseline: Option<PathBuf> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--iterations" => iterations = args.next().context("--iterations N")?.parse()?,
            "--baseline" => baseline = Some(args.next().context("--baseline PATH")?.into()),
            other => bail!(
                "unknown argument {other:?} (usage: bench_prepare [--iterations N] [--baseline PATH])"
            ),
        }
    }
    let ours_bin = plugin_binary().map_err(anyhow::Error::msg)?;
    let peer_bin = go_tool("peerplugin").map_err(anyhow::Error::msg)?;
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let client = cp.client().await?;
    cp.register_node(NODE, &[]).await?;
    let dir = tempfile::Builder::new()
        .prefix("drust-bench-")
        .tempdir_in(repo_path("target"))?;
    let topology = repo_path("examples/topologies/dgx-h100.yaml");
    fake_host(dir.path(), &topology).map_err(anyhow::Error::msg)?;
    let names: Vec<String> =
        drust_e2e::plugin::fake_gpu_names(&topology).map_err(anyhow::Error::msg)?;

    let ours_driver = "gpu.drust.dev";
    let ours = spawn_drust(&ours_bin, ours_driver, "ours", &cp, dir.path(), &topology)?;
    let base_driver = "baseline.drust.dev";
    let base = match &baseline {
        Some(bin) => Some(spawn_drust(
            bin,
            base_driver,
            "base",
            &cp,
            dir.path(),
            &topology,
        )?),
        None => None,
    };

    let peer_driver = "peer.drust.dev";
    let mut cmd = Command::new(&peer_bin);
    cmd.arg("-kubeconfig")
        .arg(cp.kubeconfig_path())
        .args(["-node", NODE, "-driver", peer_driver])
        // Without client-go's default rate limit (5 QPS), so the comparison is of the plugins,
        // not of a client setting; drust's kube client has no such limit.
        .args(["-kube-api-qps", "1000", "-kube-api-burst", "1000"])
        .arg("-plugin-dir")
        .arg(dir.path().join("peer/plugin"))
        .arg("-registrar-dir")
        .arg(dir.path().join("peer/registry"))
        .arg("-cdi-root")
        .arg(dir.path().join("peer/cdi"));
    let peer = spawn(
        cmd,
        dir.path()
            .join(format!("peer/registry/{peer_driver}-reg.sock")),
        peer_driver,
        &dir.path().join("peer.log"),
    )?;

    eprintln!("benchmarking {iterations} iterations per scenario (plus one warm-up)...");
    // Interleaved round by round, which one goes first alternating, so both see the same
    // machine state (page cache, other load) over the run. Round 0 warms up and is not kept.
    let mut ours_bench = Bench::new(&client, &ours, &names).await?;
    let mut peer_bench = Bench::new(&client, &peer, &names).await?;
    let mut base_bench = match &base {
        Some(b) => Some(Bench::new(&client, b, &names).await?),
        None => None,
    };
    let mut shares = Shares::new(&client, &ours, &names[0], "").await?;
    // The baseline carries the same share workload, so both builds run alike.
    let mut base_shares = match &base {
        Some(b) => Some(Shares::new(&client, b, &names[0], "base-").await?),
        None => None,
    };
    for round in 0..=iterations {
        let keep = round > 0;
        // The shares first, the first plugin of the round's own last: each build goes first
        // every other round, right after its own share calls, so neither always meets the
        // other's leftovers (a daemon stopping, a process just woken).
        if round % 2 == 0 {
            if let Some(s) = base_shares.as_mut() {
                s.round(keep).await?;
            }
            shares.round(keep).await?;
        } else {
            shares.round(keep).await?;
            if let Some(s) = base_shares.as_mut() {
                s.round(keep).await?;
            }
        }
        if round % 2 == 0 {
            ours_bench.round(keep).await?;
            peer_bench.round(keep).await?;
            if let Some(b) = base_bench.as_mut() {
                b.round(keep).await?;
            }
        } else {
            if let Some(b) = base_bench.as_mut() {
                b.round(keep).await?;
            }
            peer_bench.round(keep).await?;
            ours_bench.round(keep).await?;
        }
    }
    let (ours_samples, peer_samples) = (ours_bench.samples, peer_bench.samples);

    let scenarios = ["1 GPU", "8 GPUs", "8 x 1-GPU claims at once"];
    println!(
        "| scenario | call | drust p50 ms | drust p99 ms | peer p50 ms | peer p99 ms | p99 ratio (peer/drust) |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (i, name) in scenarios.iter().enumerate() {
        for (call, ours_s, peer_s) in [
            (
                "prepare",
                &ours_samples[i].prepare,
                &peer_samples[i].prepare,
            ),
            (
                "unprepare",
                &ours_samples[i].unprepare,
                &peer_samples[i].unprepare,
            ),
        ] {
            let (mut o, mut p) = (ours_s.clone(), peer_s.clone());
            o.sort();
            p.sort();
            println!(
                "| {name} | {call} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2}x |",
                percentile(&o, 0.5),
                percentile(&o, 0.99),
                percentile(&p, 0.5),
                percentile(&p, 0.99),
                percentile(&p, 0.99) / percentile(&o, 0.99)
            );
        }
    }
    println!(
        "\n| drust, one GPU | prepare p50 ms | prepare p99 ms | unprepare p50 ms | unprepare p99 ms |"
    );
    println!("|---|---|---|---|---|");
    for (name, s) in [
        ("whole GPU", &ours_samples[0]),
        (
            "a share alone (starts, stops the daemon)",
            &shares.samples[0],
        ),
        (
            "a share beside another (daemon running)",
            &shares.samples[1],
        ),
    ] {
        let (mut p, mut u) = (s.prepare.clone(), s.unprepare.clone());
        p.sort();
        u.sort();
        println!(
            "| {name} | {:.2} | {:.2} | {:.2} | {:.2} |",
            percentile(&p, 0.5),
            percentile(&p, 0.99),
            percentile(&u, 0.5),
            percentile(&u, 0.99)
        );
    }
    if let Some(b) = &base_bench {
        println!(
            "\n| scenario | call | this build p50 ms | p99 ms | baseline p50 ms | p99 ms | p50 ratio (baseline/this) |"
        );
        println!("|---|---|---|---|---|---|---|");
        for (i, name) in scenarios.iter().enumerate() {
            for (call, this, then) in [
                ("prepare", &ours_samples[i].prepare, &b.samples[i].prepare),
                (
                    "unprepare",
                    &ours_samples[i].unprepare,
                    &b.samples[i].unprepare,
                ),
            ] {
                let (mut o, mut t) = (this.clone(), then.clone());
                o.sort();
                t.sort();
                println!(
                    "| {name} | {call} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2}x |",
                    percentile(&o, 0.5),
                    percentile(&o, 0.99),
                    percentile(&t, 0.5),
                    percentile(&t, 0.99),
                    percentile(&t, 0.5) / percentile(&o, 0.5)
                );
            }
        }
    }
    let mut eight = ours_samples[1].prepare.clone();
    eight.sort();
    println!("\nprepare p99 (8 GPUs): {:.1} ms", percentile(&eight, 0.99));
    drop(ours);
    drop(peer);
    drop(base);
    cp.stop().await?;
    Ok(())
}
