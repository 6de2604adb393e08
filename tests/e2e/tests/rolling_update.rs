//! A rolling update of the node plugin without a failed call: two real plugin processes with
//! different instance IDs (pod UIDs) on one node, the test acting as the kubelet against their
//! real sockets and scraping their HTTP endpoints, on a real control plane.
//!
//! A prepares claims; B starts beside it (both registration sockets coexist) and, like the
//! kubelet would, gets the next calls, which wait until A, on SIGTERM, has finished its own
//! call in flight (paused by a failpoint) and handed over the active lock. Then C replaces B
//! the same way with nothing in flight, which measures the bare handover gap.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use dra_kubelet::proto::dra_v1;
use drust_e2e::claims::allocated_claim;
use drust_e2e::host::BinaryHost;
use drust_e2e::http::get;
use drust_e2e::kubelet::{Kubelet, v1_claim};
use drust_e2e::manifests::repo_path;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::resource::v1::ResourceClaim;

const DRIVER: &str = "gpu.drust.dev";
const NODE: &str = "gpu-node-0";
/// How long A's third prepare stalls after its PrepareStarted checkpoint write.
const PAUSE_MS: u64 = 3000;

/// A plugin process that is killed if the test fails while it runs.
struct PluginProcess {
    child: Child,
    id: &'static str,
    http: u16,
}

impl Drop for PluginProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

struct Host(BinaryHost);

impl std::ops::Deref for Host {
    type Target = BinaryHost;
    fn deref(&self) -> &BinaryHost {
        &self.0
    }
}

impl Host {
    fn registration_socket(&self, id: &str) -> PathBuf {
        self.registry().join(format!("{DRIVER}-{id}-reg.sock"))
    }
    fn log(&self, id: &str) -> PathBuf {
        self.root().join(format!("plugin-{id}.log"))
    }

    /// Starts instance `id`, armed with `failpoint` if given, and waits for its registration
    /// socket.
    fn start(&self, id: &'static str, failpoint: Option<&str>) -> anyhow::Result<PluginProcess> {
        let http = free_port()?;
        let _ = std::fs::remove_file(self.log(id));
        let mut cmd = self.command(&self.log(id), failpoint)?;
        cmd.args(["--instance-id", id])
            .arg("--http-address")
            .arg(format!("127.0.0.1:{http}"));
        let start = Instant::now();
        let mut p = PluginProcess {
            child: cmd.spawn().context("spawning gpu-kubelet-plugin")?,
            id,
            http,
        };
        while !self.registration_socket(id).exists() {
            if let Some(status) = p.child.try_wait()? {
                bail!("{id} exited at start: {status}; log: {}", self.log_tail(id));
            }
            ensure!(
                start.elapsed() < Duration::from_secs(60),
                "{id} not serving; log: {}",
                self.log_tail(id)
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(p)
    }

    fn log_tail(&self, id: &str) -> String {
        let log = std::fs::read_to_string(self.log(id)).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    fn checkpoint_claims(&self) -> anyhow::Result<BTreeMap<String, serde_json::Value>> {
        let v = drust_e2e::plugin::read_checkpoint(&self.plugin_dir().join("checkpoint.json"))
            .map_err(anyhow::Error::msg)?;
        Ok(serde_json::from_value(v["claims"].clone())?)
    }

    fn spec_files(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.cdi_root())
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(drust_e2e::ports::free_port()?)
}

/// The value of the sample `name` (with its labels, exactly as exposed) in `/metrics`.
async fn metric(p: &PluginProcess, sample: &str) -> anyhow::Result<f64> {
    let (status, body) = get(p.http, "/metrics").await?;
    ensure!(status == 200, "{}: /metrics answered {status}", p.id);
    drust_e2e::http::sample(&body, sample)
        .with_context(|| format!("{}: no sample {sample} in:\n{body}", p.id))
}

async fn wait_ready(p: &PluginProcess) -> anyhow::Result<()> {
    let port = p.http;
    drust_e2e::wait::until(
        &format!("{} ready", p.id),
        Duration::from_secs(60),
        || async move {
            match get(port, "/readyz").await {
                Ok((200, _)) => Ok(Some(())),
                Ok((code, body)) => Err(format!("{code} {body}")),
                Err(e) => Err(e.to_string()),
            }
        },
    )
    .await?;
    Ok(())
}

/// SIGTERM, as the kubelet does when the DaemonSet controller deletes the pod.
fn terminate(p: &PluginProcess) -> anyhow::Result<()> {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(p.child.id())?);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
    Ok(())
}

async fn wait_exit(mut p: PluginProcess, host: &Host) -> anyhow::Result<()> {
    let start = Instant::now();
    loop {
        if let Some(status) = p.child.try_wait()? {
            ensure!(
                status.success(),
                "{} exited with {status}; log: {}",
                p.id,
                host.log_tail(p.id)
            );
            return Ok(());
        }
        ensure!(
            start.elapsed() < Duration::from_secs(90),
            "{} did not exit",
            p.id
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn uid(c: &ResourceClaim) -> String {
    c.metadata.uid.clone().unwrap_or_default()
}

/// One v1 prepare of `claim` by `kubelet` (on its connection to its plugin), answered at the
/// returned instant.
fn prepare_v1(
    kubelet: &Kubelet,
    claim: &ResourceClaim,
) -> tokio::task::JoinHandle<anyhow::Result<(String, Instant)>> {
    let kubelet = kubelet.clone();
    let claim = claim.clone();
    tokio::spawn(async move {
        let r = kubelet.prepare_v1(&[&claim]).await?;
        Ok((r.claims[&uid(&claim)].error.clone(), Instant::now()))
    })
}

/// The same over `v1beta1.DRAPlugin`, as the kubelet calls a plugin offering only v1beta1.
fn prepare_v1beta1(
    kubelet: &Kubelet,
    claim: &ResourceClaim,
) -> tokio::task::JoinHandle<anyhow::Result<(String, Instant)>> {
    let kubelet = kubelet.clone();
    let claim = claim.clone();
    tokio::spawn(async move {
        let r = kubelet.prepare_v1beta1(&[&claim]).await?;
        Ok((r.claims[&uid(&claim)].error.clone(), Instant::now()))
    })
}

fn mode(path: &Path) -> anyhow::Result<u32> {
    Ok(std::fs::metadata(path)
        .with_context(|| path.display().to_string())?
        .permissions()
        .mode()
        & 0o777)
}

#[tokio::test]
async fn a_rolling_update_hands_over_between_two_plugin_processes_without_a_failed_call()
-> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let client = cp.client().await?;
    cp.register_node(NODE, &[]).await?;
    let topology = repo_path("examples/topologies/dgx-h100.yaml");
    let host = Host(BinaryHost::new(
        "drust-rolling-",
        cp.kubeconfig_path(),
        &topology,
        DRIVER,
        NODE,
    )?);
    let gpus: Vec<String> =
        drust_e2e::plugin::fake_gpu_names(&topology).map_err(anyhow::Error::msg)?;
    let mut claims = Vec::new();
    for (i, gpu) in gpus.iter().take(6).enumerate() {
        claims.push(
            allocated_claim(
                &client,
                &format!("c{}", i + 1),
                DRIVER,
                NODE,
                std::slice::from_ref(gpu),
            )
            .await?,
        );
    }
    let [c1, c2, c3, c4, c5, c6] = &claims[..] else {
        bail!("six claims")
    };

    // A: the running instance. Its third prepare stalls after PrepareStarted.
    let a = host.start(
        "instance-a",
        Some(&format!(
            "prepare/after-started-checkpoint@3:pause={PAUSE_MS}"
        )),
    )?;
    let (ka, _) = Kubelet::register(&host.registration_socket(a.id)).await?;
    wait_ready(&a).await?;
    ensure!(metric(&a, "drust_instance_active").await? == 1.0);
    let before = metric(&a, "drust_prepared_claims").await?;
    for c in [c1, c2] {
        let (error, _) = prepare_v1(&ka, c).await??;
        ensure!(error.is_empty(), "A prepare {}: {error}", uid(c));
    }
    ensure!(before == 0.0 && metric(&a, "drust_prepared_claims").await? == 2.0);
    ensure!(
        metric(
            &a,
            r#"drust_kubelet_requests_total{method="prepare",api_version="v1"}"#
        )
        .await?
            == 2.0
    );
    let (status, body) = get(a.http, "/healthz").await?;
    ensure!(status == 200, "A /healthz: {status} {body}");

    // Root-only state after a prepare.
    let spec = host
        .cdi_root()
        .join(format!("{DRIVER}-claim_{}.json", uid(c1)));
    for (path, want) in [
        (host.plugin_dir(), 0o700),
        (host.plugin_dir().join("checkpoint.json"), 0o600),
        (host.plugin_dir().join("active.lock"), 0o600),
        (host.plugin_dir().join("dra-instance-a.sock"), 0o600),
        (host.registration_socket(a.id), 0o600),
        (spec, 0o600),
    ] {
        ensure!(
            mode(&path)? == want,
            "{} has mode {:o}",
            path.display(),
            mode(&path)?
        );
    }

    // B: the new pod. Both registration sockets coexist; B is ready while A is active.
    let b = host.start("instance-b", None)?;
    ensure!(host.registration_socket(a.id).exists() && host.registration_socket(b.id).exists());
    let (kb, info) = Kubelet::register(&host.registration_socket(b.id)).await?;
    ensure!(info.endpoint.ends_with("dra-instance-b.sock"), "{info:?}");
    wait_ready(&b).await?;
    ensure!(metric(&b, "drust_instance_active").await? == 0.0);

    // A call in flight on A: it reaches the failpoint after reserving its devices and stalls
    // there (A's log says so; a whole-GPU claim's reservation is not written to disk by itself).
    let in_flight = prepare_v1(&ka, c3);
    drust_e2e::wait::until(
        "A's third prepare in flight",
        Duration::from_secs(30),
        || async {
            let log = std::fs::read_to_string(host.log(a.id)).map_err(|e| e.to_string())?;
            Ok(log.contains("failpoint armed: pausing").then_some(()))
        },
    )
    .await?;
    // The kubelet now calls B, the most recently registered instance.
    let waiting = [prepare_v1(&kb, c4), prepare_v1beta1(&kb, c5)];
    tokio::time::sleep(Duration::from_millis(500)).await;
    ensure!(
        waiting.iter().all(|t| !t.is_finished()),
        "B answered while A was still active"
    );
    ensure!(
        !in_flight.is_finished(),
        "A's paused prepare already answered"
    );

    let sigterm_a = Instant::now();
    terminate(&a)?;
    let (error, a_answered) = in_flight.await??;
    ensure!(error.is_empty(), "A's in-flight prepare: {error}");
    let mut b_answered = Vec::new();
    for t in waiting {
        let (error, at) = t.await??;
        ensure!(error.is_empty(), "B's prepare during the handover: {error}");
        b_answered.push(at);
    }
    wait_exit(a, &host).await?;
    let first_b = b_answered.iter().min().copied().context("answers")?;
    ensure!(
        a_answered <= first_b,
        "B served before A finished its call in flight"
    );
    ensure!(metric(&b, "drust_instance_active").await? == 1.0);

    // Every claim recorded once, completed, with one CDI spec each.
    let recorded = host.checkpoint_claims()?;
    let want: Vec<String> = [c1, c2, c3, c4, c5].iter().map(|c| uid(c)).collect();
    ensure!(
        recorded.keys().cloned().collect::<Vec<_>>() == {
            let mut w = want.clone();
            w.sort();
            w
        },
        "checkpoint holds {:?}",
        recorded.keys()
    );
    ensure!(
        recorded.values().all(|r| r["state"] == "PrepareCompleted"),
        "{recorded:?}"
    );
    let mut specs: Vec<String> = want
        .iter()
        .map(|u| format!("{DRIVER}-claim_{u}.json"))
        .collect();
    specs.sort();
    ensure!(
        host.spec_files() == specs,
        "CDI specs {:?}",
        host.spec_files()
    );
    ensure!(!host.registration_socket("instance-a").exists());
    ensure!(!host.plugin_dir().join("dra-instance-a.sock").exists());

    // B unprepares a claim A prepared.
    let r = kb.unprepare_v1(vec![v1_claim(c1)]).await?;
    ensure!(r.claims[&uid(c1)].error.is_empty(), "{r:?}");
    ensure!(!host.checkpoint_claims()?.contains_key(&uid(c1)));
    ensure!(metric(&b, "drust_prepared_claims").await? == 4.0);

    // C replaces B with nothing in flight: the bare handover gap.
    let c = host.start("instance-c", None)?;
    let (kc, _) = Kubelet::register(&host.registration_socket(c.id)).await?;
    wait_ready(&c).await?;
    let waiting = prepare_v1(&kc, c6);
    tokio::time::sleep(Duration::from_millis(500)).await;
    ensure!(
        !waiting.is_finished(),
        "C answered while B was still active"
    );
    let sigterm_b = Instant::now();
    terminate(&b)?;
    let (error, c_answered) = waiting.await??;
    ensure!(error.is_empty(), "C's prepare during the handover: {error}");
    wait_exit(b, &host).await?;

    // C unprepares everything, whoever prepared it.
    let rest: Vec<dra_v1::Claim> = [c2, c3, c4, c5, c6].iter().map(|c| v1_claim(c)).collect();
    let r = kc.unprepare_v1(rest).await?;
    ensure!(r.claims.values().all(|a| a.error.is_empty()), "{r:?}");
    ensure!(host.checkpoint_claims()?.is_empty());
    ensure!(host.spec_files().is_empty(), "{:?}", host.spec_files());
    ensure!(metric(&c, "drust_prepared_claims").await? == 0.0);
    for (sample, want) in [
        (
            r#"drust_kubelet_requests_total{method="prepare",api_version="v1"}"#,
            1.0,
        ),
        (
            r#"drust_kubelet_requests_total{method="unprepare",api_version="v1"}"#,
            1.0,
        ),
    ] {
        ensure!(metric(&c, sample).await? == want, "C {sample}");
    }
    drop(kc);
    terminate(&c)?;
    wait_exit(c, &host).await?;
    ensure!(
        std::fs::read_dir(host.registry())?.next().is_none(),
        "registration sockets left behind"
    );

    let gap_with_work = first_b.duration_since(sigterm_a);
    let a_finish = a_answered.duration_since(sigterm_a);
    let gap = c_answered.duration_since(sigterm_b);
    eprintln!(
        "rolling update: A's in-flight prepare answered {:.0} ms after SIGTERM (paused {PAUSE_MS} \
         ms in all); B's first waiting call answered {:.0} ms after A's SIGTERM; bare handover \
         B->C (SIGTERM to C's waiting prepare answered): {:.0} ms",
        a_finish.as_secs_f64() * 1e3,
        gap_with_work.as_secs_f64() * 1e3,
        gap.as_secs_f64() * 1e3,
    );
    cp.stop().await?;
    Ok(())
}
