//! Crash safety of prepare and unprepare: the real plugin binary is SIGKILLed at every step
//! (before and after each checkpoint write, CDI write and hardware action), restarted, and the
//! kubelet's call repeated, on a real control plane. Every run must end with the claim prepared
//! exactly once or cleanly unprepared, no device in two claims, and no stray files.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use drust_e2e::claims::allocated_claim;
use drust_e2e::host::{BinaryHost, PluginProcess, expect_killed, stop};
use drust_e2e::kubelet::{Kubelet, v1_claim};
use drust_e2e::manifests::repo_path;
use drust_e2e::plugin::read_checkpoint;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use gpu_kubelet_plugin::failpoint;
use k8s_openapi::api::resource::v1::ResourceClaim;

const DRIVER: &str = "gpu.drust.dev";
const NODE: &str = "gpu-node-0";
/// Runs per failpoint; half retry the prepare after the crash, half give up and unprepare.
const REPS: usize = 20;

/// The plugin's host, and the arguments every start of it adds.
struct Host(BinaryHost, Vec<std::ffi::OsString>);

impl std::ops::Deref for Host {
    type Target = BinaryHost;
    fn deref(&self) -> &BinaryHost {
        &self.0
    }
}

/// The fake DGX H100 both tests kill the plugin on.
const TOPOLOGY: &str = "examples/topologies/dgx-h100.yaml";

impl Host {
    /// A host of the fake DGX H100 for the node `NODE` of `cp`, whose plugin starts with `extra`.
    fn on(cp: &ControlPlane, prefix: &str, extra: Vec<std::ffi::OsString>) -> anyhow::Result<Host> {
        let host = BinaryHost::new(
            prefix,
            cp.kubeconfig_path(),
            &repo_path(TOPOLOGY),
            DRIVER,
            NODE,
        )?;
        Ok(Host(host, extra))
    }

    fn registration_socket(&self) -> PathBuf {
        self.registry().join(format!("{DRIVER}-reg.sock"))
    }

    /// Starts the plugin, armed with `failpoint` if given, and waits for its sockets.
    fn start(&self, failpoint: Option<&str>) -> anyhow::Result<PluginProcess> {
        let _ = std::fs::remove_file(self.registration_socket());
        let mut cmd = self.command(&self.root().join("plugin.log"), failpoint)?;
        cmd.args(&self.1);
        let start = Instant::now();
        let mut child = PluginProcess(cmd.spawn().context("spawning gpu-kubelet-plugin")?);
        while !self.registration_socket().exists() {
            if let Some(status) = child.0.try_wait()? {
                bail!("plugin exited at start: {status}; log: {}", self.log_tail());
            }
            ensure!(
                start.elapsed() < Duration::from_secs(30),
                "plugin not ready; log: {}",
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(child)
    }

    /// Arms `fp` and makes the kubelet's call it is on for `claim` (for `unprepare/...`, after a
    /// clean prepare): the plugin must die at the failpoint.
    async fn kill_at(&self, fp: &str, claim: &ResourceClaim) -> anyhow::Result<()> {
        let uid = claim.metadata.uid.clone().context("uid")?;
        if fp.starts_with("prepare/") {
            let child = self.start(Some(fp))?;
            let (k, _) = Kubelet::register(&self.registration_socket()).await?;
            let _ = k.prepare_v1(&[claim]).await; // the plugin dies mid-call
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

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.root().join("plugin.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Files that must not outlive a completed call: temp files anywhere in our dirs.
    fn stray_files(&self) -> Vec<PathBuf> {
        [self.cdi_root(), self.plugin_dir()]
            .iter()
            .flat_map(|d| std::fs::read_dir(d).into_iter().flatten().flatten())
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().ends_with(".tmp"))
            })
            .collect()
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

    /// Devices the checkpoint records for more than one claim (must be none: a device prepared
    /// for one claim is refused to another), with the claims holding each.
    fn devices_held_twice(&self) -> anyhow::Result<BTreeMap<String, Vec<String>>> {
        let mut holders: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (uid, claim) in self.checkpoint_claims()? {
            for device in claim["devices"].as_array().into_iter().flatten() {
                let name = device["deviceName"].as_str().unwrap_or_default().to_owned();
                holders.entry(name).or_default().push(uid.clone());
            }
        }
        holders.retain(|_, claims| claims.len() > 1);
        Ok(holders)
    }

    fn checkpoint_claims(&self) -> anyhow::Result<BTreeMap<String, serde_json::Value>> {
        let v = read_checkpoint(&self.plugin_dir().join("checkpoint.json"))
            .map_err(anyhow::Error::msg)?;
        Ok(serde_json::from_value(v["claims"].clone())?)
    }
}

#[tokio::test]
async fn the_plugin_killed_at_every_step_recovers_to_prepared_once_or_cleanly_unprepared()
-> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let client = cp.client().await?;
    cp.register_node(NODE, &[]).await?;
    let topology = repo_path(TOPOLOGY);
    let host = Host::on(&cp, "drust-fault-", Vec::new())?;
    let names: Vec<String> =
        drust_e2e::plugin::fake_gpu_names(&topology).map_err(anyhow::Error::msg)?;

    // A bystander claim stays prepared on the first GPU through every crash.
    let bystander =
        allocated_claim(&client, "bystander", DRIVER, NODE, &[names[0].clone()]).await?;
    let bystander_uid = bystander.metadata.uid.clone().context("uid")?;
    let child = host.start(None)?;
    let (kubelet, _) = Kubelet::register(&host.registration_socket()).await?;
    let answer = kubelet.prepare_v1(&[&bystander]).await?.claims[&bystander_uid].clone();
    ensure!(answer.error.is_empty(), "{}", answer.error);
    drop(kubelet);
    stop(child).await?;

    let started = Instant::now();
    let mut kills: BTreeMap<&str, usize> = BTreeMap::new();
    let mut n = 0;
    for fp in failpoint::ALL {
        for rep in 0..REPS {
            n += 1;
            let devices: Vec<String> = if rep % 2 == 0 {
                vec![names[1 + n % 7].clone()]
            } else {
                vec![names[1 + n % 7].clone(), names[1 + (n + 3) % 7].clone()]
            };
            let claim = allocated_claim(&client, &format!("c{n}"), DRIVER, NODE, &devices).await?;
            let uid = claim.metadata.uid.clone().context("uid")?;
            let ctx = || format!("{fp} run {rep} ({devices:?})");

            host.kill_at(fp, &claim).await.context(ctx())?;
            *kills.entry(fp).or_default() += 1;

            // Restart and repeat what the kubelet would do next.
            let child = host.start(None)?;
            let (k, _) = Kubelet::register(&host.registration_socket()).await?;
            let retry_prepare = rep % 2 == 0;
            if retry_prepare {
                let r = k.prepare_v1(&[&claim]).await?;
                let a = &r.claims[&uid];
                ensure!(a.error.is_empty(), "{}: {}", ctx(), a.error);
                let mut got: Vec<&str> = a.devices.iter().map(|d| d.device_name.as_str()).collect();
                got.sort_unstable();
                let mut want: Vec<&str> = devices.iter().map(String::as_str).collect();
                want.sort_unstable();
                want.dedup();
                ensure!(got == want, "{}: prepared {got:?}", ctx());
                let claims = host.checkpoint_claims()?;
                ensure!(
                    claims[&uid]["state"] == "PrepareCompleted",
                    "{}: {:?}",
                    ctx(),
                    claims[&uid]
                );
                let spec = host.cdi_root().join(format!("{DRIVER}-claim_{uid}.json"));
                ensure!(spec.exists(), "{}: CDI spec missing after prepare", ctx());
                let twice = host.devices_held_twice()?;
                ensure!(twice.is_empty(), "{}: devices held twice {twice:?}", ctx());
                // Prepared exactly once: a second prepare gives the same, and nothing else changed.
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

            // Clean: only the bystander is left, intact; no temp files; no device twice.
            let claims = host.checkpoint_claims()?;
            ensure!(
                claims.keys().collect::<Vec<_>>() == [&bystander_uid],
                "{}: checkpoint holds {:?}",
                ctx(),
                claims.keys()
            );
            ensure!(
                host.spec_files() == [format!("{DRIVER}-claim_{bystander_uid}.json")],
                "{}: CDI specs {:?}",
                ctx(),
                host.spec_files()
            );
            ensure!(
                host.stray_files().is_empty(),
                "{}: stray {:?}",
                ctx(),
                host.stray_files()
            );
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
        "fault injection: {total} SIGKILLs over {} failpoints in {:.1} s: {kills:?}",
        kills.len(),
        started.elapsed().as_secs_f64()
    );
    ensure!(kills.len() == failpoint::ALL.len() && kills.values().all(|&k| k == REPS));
    cp.stop().await?;
    Ok(())
}

/// Runs per failpoint for shares.
const SHARE_REPS: usize = 4;

/// A UUID for share `n` (the API server wants `shareID` to be one).
fn share_id(n: usize) -> String {
    format!("00000000-0000-4000-8000-{n:012}")
}

/// The pids of the MPS daemons the fake tool logged starting in `log` (`start ... pid=<pid>`).
fn daemon_starts(log: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("start "))
        .filter_map(|l| l.rsplit_once("pid=").map(|(_, pid)| pid.to_owned()))
        .collect()
}

/// Several shares of one GPU (fractional GPUs): two bystander shares stay prepared while a
/// third share's prepare or unprepare is SIGKILLed at every step and the kubelet's call repeated.
/// Every run must end with the bystanders' answers unchanged, their GPU's MPS daemon the very
/// process started for the first of them (never stopped or restarted under them), the third
/// share prepared once or cleanly gone, and no stray files. The last share's unprepare then stops
/// the daemon.
#[tokio::test]
async fn several_shares_of_one_gpu_survive_a_kill_at_every_step_of_another_share()
-> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let client = cp.client().await?;
    cp.register_node(NODE, &[]).await?;
    let topology = repo_path(TOPOLOGY);
    // Fractional GPUs, with the fake MPS tool.
    let host = Host::on(
        &cp,
        "drust-fault-shares-",
        vec![
            "--consumable-capacity".into(),
            "true".into(),
            "--mps-control-binary".into(),
            drust_fakes::mps_control().into(),
        ],
    )?;
    let gpu = drust_e2e::plugin::fake_gpus(&topology).map_err(anyhow::Error::msg)?[0].clone();
    let mps = host
        .root()
        .join("mps")
        .join(gpu.raw.uuid.to_ascii_lowercase());
    let log = mps.join("log/control.log");

    let mut bystanders = Vec::new();
    for (i, name) in ["bystander-a", "bystander-b"].iter().enumerate() {
        bystanders.push(
            drust_e2e::claims::allocated_share(
                &client,
                name,
                DRIVER,
                NODE,
                &gpu.name,
                &share_id(i),
                "20Gi",
            )
            .await?,
        );
    }
    let child = host.start(None)?;
    let (kubelet, _) = Kubelet::register(&host.registration_socket()).await?;
    let refs: Vec<&_> = bystanders.iter().collect();
    let answers = kubelet.prepare_v1(&refs).await?.claims;
    for (uid, a) in &answers {
        ensure!(a.error.is_empty(), "bystander {uid}: {}", a.error);
        ensure!(
            a.devices[0].share_id.is_some(),
            "bystander {uid}: no shareID"
        );
    }
    drop(kubelet);
    stop(child).await?;
    let daemon = daemon_starts(&log);
    ensure!(
        daemon.len() == 1,
        "one daemon started for two shares: {daemon:?}"
    );

    let started = Instant::now();
    let mut kills = 0;
    let mut n = 10;
    for fp in failpoint::ALL {
        for rep in 0..SHARE_REPS {
            n += 1;
            let claim = drust_e2e::claims::allocated_share(
                &client,
                &format!("s{n}"),
                DRIVER,
                NODE,
                &gpu.name,
                &share_id(n),
                "20Gi",
            )
            .await?;
            let uid = claim.metadata.uid.clone().context("uid")?;
            let ctx = || format!("share: {fp} run {rep}");
            host.kill_at(fp, &claim).await.context(ctx())?;
            kills += 1;

            let child = host.start(None)?;
            let (k, _) = Kubelet::register(&host.registration_socket()).await?;
            if rep % 2 == 0 {
                let r = k.prepare_v1(&[&claim]).await?;
                let a = &r.claims[&uid];
                ensure!(a.error.is_empty(), "{}: {}", ctx(), a.error);
                ensure!(
                    a.devices.len() == 1
                        && a.devices[0].share_id.as_deref() == Some(share_id(n).as_str()),
                    "{}: prepared {:?}",
                    ctx(),
                    a.devices
                );
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

            // The bystanders: recorded, answered as before, their daemon never disturbed.
            let mut claims: Vec<String> = host.checkpoint_claims()?.into_keys().collect();
            claims.sort();
            let mut want: Vec<String> = answers.keys().cloned().collect();
            want.sort();
            ensure!(claims == want, "{}: checkpoint holds {claims:?}", ctx());
            ensure!(
                host.stray_files().is_empty(),
                "{}: stray {:?}",
                ctx(),
                host.stray_files()
            );
            let b = k.prepare_v1(&refs).await?.claims;
            ensure!(b == answers, "{}: bystanders changed: {b:?}", ctx());
            ensure!(
                daemon_starts(&log) == daemon,
                "{}: the bystanders' daemon was restarted: {:?}",
                ctx(),
                daemon_starts(&log)
            );
            drop(k);
            stop(child).await?;
        }
    }
    eprintln!(
        "fault injection (shares): {kills} SIGKILLs over {} failpoints in {:.1} s, the \
         bystanders' MPS daemon (pid {daemon:?}) untouched",
        failpoint::ALL.len(),
        started.elapsed().as_secs_f64()
    );

    // The last share's unprepare stops the daemon.
    let child = host.start(None)?;
    let (k, _) = Kubelet::register(&host.registration_socket()).await?;
    let claims: Vec<_> = bystanders.iter().map(v1_claim).collect();
    let r = k.unprepare_v1(claims).await?;
    ensure!(r.claims.values().all(|a| a.error.is_empty()), "{r:?}");
    ensure!(
        !mps.exists(),
        "the daemon's directory outlived the last share"
    );
    drop(k);
    stop(child).await?;
    cp.stop().await?;
    Ok(())
}

/// Forwards every connection accepted on `listener` to `upstream` (a stand-in for a network
/// path to the API server that comes up late).
async fn forward(listener: tokio::net::TcpListener, upstream: std::net::SocketAddr) {
    while let Ok((mut inbound, _)) = listener.accept().await {
        tokio::spawn(async move {
            if let Ok(mut outbound) = tokio::net::TcpStream::connect(upstream).await {
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            }
        });
    }
}

/// A plugin whose API server cannot be reached at start (no route yet, the server restarting)
/// waits for it, however long, instead of exiting: it once gave up after five tries (about 15
/// s), so the DaemonSet pod crash-looped with a back-off that outlived the outage. This showed
/// on the real node, where the chart's pod had no route to the API server. A SIGTERM while it
/// waits stops it at once, and once the server is reachable its slices are published by the
/// same process.
#[tokio::test]
async fn a_plugin_started_while_the_api_server_is_unreachable_waits_for_it_instead_of_crash_looping()
-> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let client = cp.client().await?;
    cp.register_node(NODE, &[]).await?;
    let upstream: std::net::SocketAddr = cp
        .server_url()
        .trim_start_matches("https://")
        .parse()
        .context("the API server's address")?;

    // A kubeconfig naming a port where nothing listens yet (reserved, then released).
    let port = drust_e2e::ports::free_port()?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    let admin = std::fs::read_to_string(cp.kubeconfig_path())?;
    ensure!(
        admin.contains(cp.server_url()),
        "the admin kubeconfig names the server"
    );
    std::fs::write(
        &kubeconfig,
        admin.replace(cp.server_url(), &format!("https://127.0.0.1:{port}")),
    )?;
    let topology = repo_path("examples/topologies/dgx-h100.yaml");
    let host = BinaryHost::new("drust-unreachable-", &kubeconfig, &topology, DRIVER, NODE)?;
    let log = host.root().join("plugin.log");

    // Shut down while waiting: it exits promptly and cleanly.
    let mut child = PluginProcess(host.command(&log, None)?.spawn()?);
    tokio::time::sleep(Duration::from_secs(3)).await;
    ensure!(
        child.try_wait()?.is_none(),
        "the plugin exited:\n{}",
        tail(&log)
    );
    let stopping = Instant::now();
    stop(child).await?;
    ensure!(
        stopping.elapsed() < Duration::from_secs(5),
        "SIGTERM while waiting for the API server took {:?}",
        stopping.elapsed()
    );

    // Past the old give-up point (1 + 2 + 4 + 8 s) it still runs, then publishes once the
    // server is reachable.
    let mut child = PluginProcess(host.command(&log, None)?.spawn()?);
    tokio::time::sleep(Duration::from_secs(18)).await;
    ensure!(
        child.try_wait()?.is_none(),
        "the plugin gave up on the API server:\n{}",
        tail(&log)
    );
    ensure!(
        tail(&log).contains("publishing ResourceSlices failed; retrying"),
        "{}",
        tail(&log)
    );
    let proxy = tokio::spawn(forward(
        tokio::net::TcpListener::bind(("127.0.0.1", port)).await?,
        upstream,
    ));
    let slices: kube::Api<k8s_openapi::api::resource::v1::ResourceSlice> =
        kube::Api::all(client.clone());
    let reachable = Instant::now();
    loop {
        let published: usize = slices
            .list(&kube::api::ListParams::default().fields(&format!("spec.driver={DRIVER}")))
            .await?
            .items
            .iter()
            .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
            .sum();
        if published == 8 {
            break;
        }
        ensure!(
            reachable.elapsed() < Duration::from_secs(30),
            "no slices 30 s after the API server became reachable:\n{}",
            tail(&log)
        );
        ensure!(
            child.try_wait()?.is_none(),
            "the plugin exited:\n{}",
            tail(&log)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "API server reachable -> slices published: {} ms",
        reachable.elapsed().as_millis()
    );
    stop(child).await?;
    proxy.abort();
    cp.stop().await?;
    Ok(())
}

/// The last lines of a plugin log.
fn tail(log: &std::path::Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}
