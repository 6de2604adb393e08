//! `bench_cluster`: what a node of the multi-node harness costs ([`drust_e2e::cluster`]): a real
//! node (kubelet, containerd, its shims and the plugin) against a paper node (the plugin
//! publishing for a Node object that no kubelet backs), both on fake DGX H100s.
//!
//! Figures, per node, from `/proc` ([`drust_e2e::procstat`]):
//! - resident memory (VmRSS) of each process once every pool is published, and again with
//!   pods placed (two pods of four GPUs running on each real node, one pod of eight GPUs bound
//!   to each paper node);
//! - CPU time from the processes' start until every pool is published (start-up);
//! - CPU used over an idle window of `--window` seconds without pods, and another with the pods,
//!   as a percentage of one core.
//!
//! The control plane's processes are measured beside them, for scale.
//!
//! `cargo run --release -p drust-e2e --bin bench_cluster -- [--real N] [--paper N] [--window S]`
//! (root, as real nodes need; the release build runs the release plugin).

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use drust_e2e::cluster::{Cluster, ClusterOptions, NodeGroup, NodeUsage};
use drust_e2e::images::WORKLOAD_IMAGE;
use drust_e2e::manifests::{apply_yaml, repo_path};
use drust_e2e::procstat::ProcessUsage;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{ListParams, PostParams};

const DGX_H100: &str = "examples/topologies/dgx-h100.yaml";
const KIND: &str = "bench.drust.dev/kind";
const TIMEOUT: Duration = Duration::from_secs(300);

const TEMPLATES: &str = r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: four-h100, namespace: default}
spec:
  spec:
    devices:
      requests:
        - {name: gpus, exactly: {deviceClassName: gpu.drust.dev, allocationMode: ExactCount, count: 4}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: eight-h100, namespace: default}
spec:
  spec:
    devices:
      requests:
        - {name: gpus, exactly: {deviceClassName: gpu.drust.dev, allocationMode: ExactCount, count: 8}}
"#;

fn pod(name: &str, template: &str, kind: &str) -> anyhow::Result<Pod> {
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "nodeSelector": {KIND: kind},
            "containers": [{
                "name": "main",
                "image": WORKLOAD_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", "trap 'exit 0' TERM; sleep 3600 & wait"],
                "resources": {"claims": [{"name": "gpu"}]},
            }],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
        },
    }))?)
}

/// Percent of one core used between `before` and `after`, `window` apart.
fn percent(before: ProcessUsage, after: ProcessUsage, window: Duration) -> f64 {
    after.cpu.saturating_sub(before.cpu).as_secs_f64() * 100.0 / window.as_secs_f64()
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let v: Vec<f64> = values.collect();
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// One node's figures.
struct Row {
    node: String,
    paper: bool,
    part: &'static str,
    rss_idle: f64,
    rss_pods: f64,
    startup_cpu: f64,
    idle_percent: f64,
    pods_percent: f64,
}

fn rows(
    start: &[NodeUsage],
    idle: &[NodeUsage],
    pods: &[NodeUsage],
    after: &[NodeUsage],
    window: Duration,
) -> Vec<Row> {
    let mut out = Vec::new();
    for (((s, i), p), a) in start.iter().zip(idle).zip(pods).zip(after) {
        let mut parts: Vec<&'static str> = s.parts.iter().map(|(r, _)| *r).collect();
        parts.push("total");
        for part in parts {
            let get = |u: &NodeUsage| {
                if part == "total" {
                    u.total()
                } else {
                    u.part(part).unwrap_or_default()
                }
            };
            out.push(Row {
                node: s.node.clone(),
                paper: s.paper,
                part,
                rss_idle: get(i).rss_mib(),
                rss_pods: get(a).rss_mib(),
                startup_cpu: get(s).cpu.as_secs_f64(),
                idle_percent: percent(get(s), get(i), window),
                pods_percent: percent(get(p), get(a), window),
            });
        }
    }
    out
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let (mut real, mut paper, mut window) = (2usize, 16usize, 60u64);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--real" => real = args.next().context("--real N")?.parse()?,
            "--paper" => paper = args.next().context("--paper N")?.parse()?,
            "--window" => window = args.next().context("--window S")?.parse()?,
            other => bail!(
                "unknown argument {other:?} (usage: bench_cluster [--real N] [--paper N] \
                 [--window S])"
            ),
        }
    }
    let window = Duration::from_secs(window);
    let started = Instant::now();
    let cluster = Cluster::start(
        ClusterOptions::default()
            .real(NodeGroup::new("real-", real, DGX_H100).label(KIND, "real"))
            .paper(NodeGroup::new("paper-", paper, DGX_H100).label(KIND, "paper")),
    )
    .await?;
    let startup = started.elapsed();
    let cp_pids: Vec<(String, u32)> = cluster
        .cp()
        .pids()
        .into_iter()
        .map(|(c, p)| (c.to_string(), p))
        .collect();
    let cp_usage = || -> Vec<ProcessUsage> {
        cp_pids
            .iter()
            .map(|(_, p)| ProcessUsage::of(*p).unwrap_or_default())
            .collect()
    };
    let at_start = cluster.usage();
    let cp_start = cp_usage();
    eprintln!(
        "{real} real + {paper} paper nodes published in {:.1} s; idle window of {} s",
        startup.as_secs_f64(),
        window.as_secs()
    );
    tokio::time::sleep(window).await;
    let idle = cluster.usage();
    let cp_idle = cp_usage();

    let client = cluster.client().clone();
    apply_yaml(
        &client,
        TEMPLATES,
        &repo_path("tests/e2e/src/bin/bench_cluster.rs"),
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let placing = Instant::now();
    for i in 0..real * 2 {
        pods.create(
            &PostParams::default(),
            &pod(&format!("real-{i}"), "four-h100", "real")?,
        )
        .await?;
    }
    for i in 0..paper {
        pods.create(
            &PostParams::default(),
            &pod(&format!("paper-{i}"), "eight-h100", "paper")?,
        )
        .await?;
    }
    loop {
        let list = pods.list(&ListParams::default()).await?.items;
        let running = list
            .iter()
            .filter(|p| {
                p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                    && p.metadata
                        .name
                        .as_deref()
                        .is_some_and(|n| n.starts_with("real-"))
            })
            .count();
        let bound = list
            .iter()
            .filter(|p| {
                p.spec
                    .as_ref()
                    .and_then(|s| s.node_name.as_deref())
                    .is_some()
                    && p.metadata
                        .name
                        .as_deref()
                        .is_some_and(|n| n.starts_with("paper-"))
            })
            .count();
        if running == real * 2 && bound == paper {
            break;
        }
        if placing.elapsed() > TIMEOUT {
            bail!(
                "{running} real pods running, {bound} paper pods bound\n{}",
                cluster.log_tail()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let placed = placing.elapsed();
    let with_pods = cluster.usage();
    let cp_pods = cp_usage();
    eprintln!(
        "{} pods placed ({} running on real nodes) in {:.1} s; window of {} s with pods",
        real * 2 + paper,
        real * 2,
        placed.as_secs_f64(),
        window.as_secs()
    );
    tokio::time::sleep(window).await;
    let after = cluster.usage();
    let cp_after = cp_usage();

    println!(
        "node       kind   part        RSS MiB idle  RSS MiB pods  CPU s start  CPU % idle  CPU % pods"
    );
    let table = rows(&at_start, &idle, &with_pods, &after, window);
    for r in &table {
        println!(
            "{:<10} {:<6} {:<10} {:>13.1} {:>13.1} {:>12.2} {:>11.2} {:>11.2}",
            r.node,
            if r.paper { "paper" } else { "real" },
            r.part,
            r.rss_idle,
            r.rss_pods,
            r.startup_cpu,
            r.idle_percent,
            r.pods_percent
        );
    }
    println!("\nmean per node:");
    for (paper, part) in [
        (false, "kubelet"),
        (false, "containerd"),
        (false, "shims"),
        (false, "plugin"),
        (false, "total"),
        (true, "plugin"),
    ] {
        let of = || table.iter().filter(|r| r.paper == paper && r.part == part);
        println!(
            "{:<6} {:<10} {:>13.1} {:>13.1} {:>12.2} {:>11.2} {:>11.2}",
            if paper { "paper" } else { "real" },
            part,
            mean(of().map(|r| r.rss_idle)),
            mean(of().map(|r| r.rss_pods)),
            mean(of().map(|r| r.startup_cpu)),
            mean(of().map(|r| r.idle_percent)),
            mean(of().map(|r| r.pods_percent)),
        );
    }
    println!("\ncontrol plane:");
    for (i, (name, _)) in cp_pids.iter().enumerate() {
        println!(
            "{:<24} {:>13.1} {:>13.1} {:>12.2} {:>11.2} {:>11.2}",
            name,
            cp_idle[i].rss_mib(),
            cp_after[i].rss_mib(),
            cp_start[i].cpu.as_secs_f64(),
            percent(cp_start[i], cp_idle[i], window),
            percent(cp_pods[i], cp_after[i], window),
        );
    }
    cluster.stop().await?;
    Ok(())
}
