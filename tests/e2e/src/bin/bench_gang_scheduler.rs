//! `bench_gang_scheduler`: how long the real kube-scheduler (v1.36.3, workload-aware
//! scheduling on: [`ControlPlaneOptions::workload_aware`]) takes to place a gang of `PODS` pods
//! of `PER_POD` GPUs each over `NODES` paper nodes of 8 GPUs (the plugin's fake DGX H100
//! slices, created directly: [`drust_e2e::paper`]), in racks of 16 nodes; the gang `dractl
//! simulate` answers for in BENCHMARKS.md (`dra-allocator`'s `bench_gang` example).
//!
//! Each run submits a Workload, its PodGroup (`gang.minCount` = `PODS`, with `--by-rack` a
//! topology constraint on the rack label) and the pods, as a user does, and measures from the
//! first create: until every pod's claim exists (the controller manager makes them from the
//! template), until the PodGroup's `PodGroupScheduled` condition is first set (an attempt
//! made before every claim existed is retried), and until every pod is bound (or, for a gang
//! that does not fit, until every pod is refused with its claim seen). Then
//! the gang is deleted and its claims awaited gone before the next run.
//!
//! The controller manager and scheduler run with client rate limits of 1,000 requests a
//! second (burst 2,000), as upstream's `scheduler_perf` raises them: at the default 20 (50
//! for the scheduler) the claim controller's and binder's requests, not the scheduling,
//! would be timed. Everything runs on this machine, the control plane included.
//!
//! `cargo run --release -p drust-e2e --bin bench_gang_scheduler -- [NODES] [PODS] [PER_POD]
//! [--by-rack] [--runs N]` (defaults 1000 128 1, 3 runs); `BENCH_DEBUG=1` also prints the
//! pods' `PodScheduled=False` messages at each poll once the PodGroup has an answer.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use drust_e2e::manifests::{apply_file, apply_yaml, repo_path};
use drust_e2e::paper::{self, PaperNode};
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use k8s_openapi::api::scheduling::v1alpha2::{PodGroup, Workload};
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use serde_json::json;

const NS: &str = "default";
const RACK: &str = "bench.drust.dev/rack";
const GANG: &str = "bench.drust.dev/gang";
const TIMEOUT: Duration = Duration::from_secs(600);
const POLL: Duration = Duration::from_millis(50);

/// Messages of attempts that waited for an object the scheduler had not seen yet (a pod's
/// claim, its pod group, an allocation in flight): retried on that object's event, so not the
/// answer (`dynamicresources.go` PreFilter, `gangscheduling.go` PreEnqueue).
const NOT_SEEN_YET: [&str; 4] = [
    "not created yet",
    "not found",
    "in the process of being allocated",
    "to appear in scheduling queue",
];

struct Args {
    nodes: usize,
    pods: usize,
    per_pod: usize,
    by_rack: bool,
    runs: usize,
}

fn args() -> anyhow::Result<Args> {
    let mut numbers = Vec::new();
    let mut by_rack = false;
    let mut runs = 3;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--by-rack" => by_rack = true,
            "--runs" => runs = it.next().context("--runs N")?.parse()?,
            n => numbers.push(
                n.parse::<usize>()
                    .with_context(|| format!("argument {n}"))?,
            ),
        }
    }
    Ok(Args {
        nodes: numbers.first().copied().unwrap_or(1000),
        pods: numbers.get(1).copied().unwrap_or(128),
        per_pod: numbers.get(2).copied().unwrap_or(1),
        by_rack,
        runs,
    })
}

/// What one run saw, from the first create.
struct Run {
    /// Every pod's claim exists.
    claims_made: Duration,
    /// The PodGroup's first `PodGroupScheduled` condition (an attempt that found a pod's claim
    /// missing counts: it is retried).
    answered: Duration,
    /// That condition's status, and (for `False`) how many pods then said the scheduler had
    /// not seen an object yet, with one such message.
    first: String,
    first_waits: (usize, String),
    fits: bool,
    /// Every pod bound, or the gang refused with every claim seen.
    bound: Duration,
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> anyhow::Result<()> {
    let args = args()?;
    let mut options = ControlPlaneOptions::workload_aware();
    let fast = [
        "--kube-api-qps=1000".to_owned(),
        "--kube-api-burst=2000".to_owned(),
    ];
    options.controller_manager_args.extend(fast.clone());
    options.scheduler_args.extend(fast);
    let cp = ControlPlane::start(options).await?;
    let result = bench(&cp, &args).await;
    cp.stop().await?;
    result
}

async fn bench(cp: &ControlPlane, args: &Args) -> anyhow::Result<()> {
    let client = cp.client().await?;
    apply_file(&client, &repo_path("deploy/deviceclasses/gpu.yaml")).await?;
    let template = format!(
        "apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: gpus, namespace: {NS}}}
spec:
  spec:
    devices:
      requests:
        - {{name: gpus, exactly: {{deviceClassName: gpu.drust.dev, allocationMode: ExactCount, count: {}}}}}
",
        args.per_pod
    );
    apply_yaml(&client, &template, std::path::Path::new("gpus")).await?;

    let start = Instant::now();
    let nodes: Vec<PaperNode> = (0..args.nodes)
        .map(|i| {
            PaperNode::new(&format!("node-{i:04}"), "dgx-h100")
                .label(RACK, &format!("rack-{:02}", i / 16))
        })
        .collect();
    paper::create(cp, &nodes, 32).await?;
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let published = slices.list(&ListParams::default()).await?.items.len();
    if published != args.nodes {
        bail!("{published} slices for {} nodes", args.nodes);
    }
    eprintln!(
        "{} paper nodes (8 GPUs each) created in {:.1} s",
        args.nodes,
        start.elapsed().as_secs_f64()
    );
    // Let the scheduler's informers take in the nodes and slices before the first run.
    tokio::time::sleep(Duration::from_secs(5)).await;

    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NS);
    let groups: Api<PodGroup> = Api::namespaced(client.clone(), NS);
    let workloads: Api<Workload> = Api::namespaced(client.clone(), NS);
    let mut runs = Vec::new();
    for run in 0..args.runs {
        let name = format!("gang-{run}");
        let r = one_run(args, &name, &pods, &claims, &groups, &workloads).await?;
        println!(
            "run {run}: {} pods x {} GPUs over {} nodes{}: claims made {:.2} s, first answer ({}) {:.2} s, {} {:.2} s",
            args.pods,
            args.per_pod,
            args.nodes,
            if args.by_rack { " by rack" } else { "" },
            r.claims_made.as_secs_f64(),
            r.first,
            r.answered.as_secs_f64(),
            if r.fits { "all bound" } else { "refused" },
            r.bound.as_secs_f64()
        );
        if r.first_waits.0 > 0 {
            println!(
                "  at the first answer, {} pods waited for an object, e.g. {:?}",
                r.first_waits.0, r.first_waits.1
            );
        }
        runs.push(r);
        let now = DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        };
        let mine = ListParams::default().labels(&format!("{GANG}={name}"));
        pods.delete_collection(&now, &mine).await?;
        groups.delete_collection(&now, &mine).await?;
        workloads.delete_collection(&now, &mine).await?;
        let gone = Instant::now();
        while !claims.list(&ListParams::default()).await?.items.is_empty()
            || !pods.list(&ListParams::default()).await?.items.is_empty()
        {
            if gone.elapsed() > TIMEOUT {
                bail!("gang {name}'s pods and claims not gone after {TIMEOUT:?}");
            }
            tokio::time::sleep(POLL).await;
        }
    }
    Ok(())
}

async fn one_run(
    args: &Args,
    name: &str,
    pods: &Api<Pod>,
    claims: &Api<ResourceClaim>,
    groups: &Api<PodGroup>,
    workloads: &Api<Workload>,
) -> anyhow::Result<Run> {
    let labels = json!({ GANG: name });
    let workload: Workload = serde_json::from_value(json!({
        "apiVersion": "scheduling.k8s.io/v1alpha2", "kind": "Workload",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {"podGroupTemplates": [{"name": "workers",
            "schedulingPolicy": {"gang": {"minCount": args.pods}}}]},
    }))?;
    let mut group = json!({
        "apiVersion": "scheduling.k8s.io/v1alpha2", "kind": "PodGroup",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {
            "podGroupTemplateRef": {"workload": {"workloadName": name, "podGroupTemplateName": "workers"}},
            "schedulingPolicy": {"gang": {"minCount": args.pods}},
        },
    });
    if args.by_rack {
        group["spec"]["schedulingConstraints"] = json!({"topology": [{"key": RACK}]});
    }
    let group: PodGroup = serde_json::from_value(group)?;
    let start = Instant::now();
    workloads.create(&PostParams::default(), &workload).await?;
    groups.create(&PostParams::default(), &group).await?;
    for i in 0..args.pods {
        let pod: Pod = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("{name}-{i}"), "namespace": NS, "labels": labels},
            "spec": {
                "schedulingGroup": {"podGroupName": name},
                "terminationGracePeriodSeconds": 0,
                "containers": [{"name": "worker", "image": "registry.k8s.io/pause:3.10",
                    "resources": {"claims": [{"name": "gpus"}]}}],
                "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "gpus"}],
            },
        }))?;
        pods.create(&PostParams::default(), &pod).await?;
    }
    let mine = ListParams::default().labels(&format!("{GANG}={name}"));
    let (mut claims_made, mut answered) = (None, None);
    let mut first_waits = None;
    loop {
        if start.elapsed() > TIMEOUT {
            bail!("gang {name}: no answer after {TIMEOUT:?}");
        }
        if claims_made.is_none()
            && claims.list(&ListParams::default()).await?.items.len() == args.pods
        {
            claims_made = Some(start.elapsed());
        }
        let g = groups.get(name).await?;
        let condition = g
            .status
            .and_then(|s| s.conditions)
            .and_then(|cs| cs.into_iter().find(|c| c.type_ == "PodGroupScheduled"));
        if let Some(c) = &condition {
            answered.get_or_insert_with(|| (start.elapsed(), c.status.clone()));
        }
        let list = pods.list(&mine).await?.items;
        let bound = list
            .iter()
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some())
            .count();
        let messages: Vec<String> = list
            .iter()
            .filter_map(|p| {
                p.status
                    .as_ref()?
                    .conditions
                    .as_ref()?
                    .iter()
                    .find(|c| c.type_ == "PodScheduled" && c.status == "False")
                    .map(|c| c.message.clone().unwrap_or_default())
            })
            .collect();
        let waits = messages
            .iter()
            .any(|m| NOT_SEEN_YET.iter().any(|w| m.contains(w)));
        if std::env::var_os("BENCH_DEBUG").is_some() && answered.is_some() {
            let mut distinct: std::collections::BTreeMap<String, usize> = Default::default();
            for m in &messages {
                *distinct.entry(m.chars().take(160).collect()).or_default() += 1;
            }
            eprintln!(
                "{:.2} s bound {bound}: {distinct:?}",
                start.elapsed().as_secs_f64()
            );
        }
        if answered.as_ref().is_some_and(|a| a.1 == "False") && first_waits.is_none() {
            let waiting: Vec<&String> = messages
                .iter()
                .filter(|m| NOT_SEEN_YET.iter().any(|w| m.contains(w)))
                .collect();
            first_waits = Some((
                waiting.len(),
                waiting.first().map(|m| (*m).clone()).unwrap_or_default(),
            ));
        }
        let refused = condition
            .as_ref()
            .is_some_and(|c| c.status == "False" && c.reason == "Unschedulable")
            && bound == 0
            && messages.len() == args.pods
            && !waits;
        if bound == args.pods || refused {
            let now = start.elapsed();
            return Ok(Run {
                claims_made: claims_made.unwrap_or(now),
                answered: answered.as_ref().map_or(now, |a| a.0),
                first: answered.map(|a| a.1).unwrap_or_default(),
                first_waits: first_waits.unwrap_or_default(),
                fits: !refused,
                bound: now,
            });
        }
        tokio::time::sleep(POLL).await;
    }
}
