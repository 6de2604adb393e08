//! `dractl simulate --pending KIND/NAMESPACE/NAME` against the real API server (issue 42): what
//! a user submitted, read where it lives. kube-apiserver v1.36.3 with workload-aware scheduling
//! ([`ControlPlaneOptions::workload_aware`]), two paper DGX H100 nodes of 8 GPUs
//! ([`drust_e2e::paper`]), JobSet's own CRD (`sigs.k8s.io/jobset` v0.12.0 from the Go module
//! proxy, as a JobSet install applies it). dractl runs as the binary a user runs, with a
//! ServiceAccount holding only `deploy/rbac/dractl-explain.yaml`.
//!
//! - A PodGroup of `minCount` 4 whose four pending pods (each one claim of 4 GPUs) fits, two per
//!   node, the answer naming the pods as they are named; one of `minCount` 5 does not (exit 1).
//!   The pods name a scheduler that does not run, so they stay pending while dractl reads them.
//! - A Job suspended as Kueue holds it (4 pods of 4 GPUs, Indexed, completions = parallelism):
//!   fits, with the WorkloadWithJob flag; 5 pods do not.
//! - A JobSet (a driver of 1 GPU, 2 replicas x 2 workers of 3 GPUs, suspended): fits, each pod
//!   with its own role's claim.
//! - Bad input: a Job with a pod bound to a node is refused (exit 2), as is a PodGroup with no
//!   pending pod, naming the object and field.
//! - An API server that never answers: given up at the deadline (30 s), exit 2, the call named.

mod cli;

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, ensure};
use drust_e2e::kubernetes::KubernetesVersion;
use drust_e2e::manifests::{apply_file, apply_yaml, repo_path};
use drust_e2e::paper::{self, PaperNode};
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use serde_json::Value;

/// The JobSet release whose CRD is applied.
const JOBSET: &str = "sigs.k8s.io/jobset@v0.12.0";
/// A guard against a hung command, never a verdict.
const DEADLINE: Duration = Duration::from_secs(300);
/// Pods stay pending: no scheduler of this name runs.
const NO_SCHEDULER: &str = "not-scheduled";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulate_reads_pending_pod_groups_jobs_and_jobsets_from_the_cluster() -> anyhow::Result<()>
{
    let cp = ControlPlane::start(ControlPlaneOptions::workload_aware()).await?;
    let result = run(&cp).await;
    if result.is_err() {
        eprintln!("control plane logs in {}", cp.temp_dir().display());
    }
    cp.stop().await?;
    result
}

async fn run(cp: &ControlPlane) -> anyhow::Result<()> {
    let version = KubernetesVersion::from_env().unwrap_or_default();
    let client = cp.client().await?;
    apply_file(&client, &repo_path("deploy/deviceclasses/gpu.yaml")).await?;
    let crd = jobset_crd().await?;
    apply_file(&client, &crd).await?;
    paper::create(
        cp,
        &[
            PaperNode::new("gpu-a", "dgx-h100"),
            PaperNode::new("gpu-b", "dgx-h100"),
        ],
        2,
    )
    .await?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    drust_e2e::rbac::dractl_explain_kubeconfig(cp, &client, "simulator", &kubeconfig).await?;
    let templates = "
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: four-gpus, namespace: default}
spec:
  spec:
    devices:
      requests: [{name: gpus, exactly: {deviceClassName: gpu.drust.dev, count: 4}}]
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: three-gpus, namespace: default}
spec:
  spec:
    devices:
      requests: [{name: gpus, exactly: {deviceClassName: gpu.drust.dev, count: 3}}]
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: one-gpu, namespace: default}
spec:
  spec:
    devices:
      requests: [{name: gpu, exactly: {deviceClassName: gpu.drust.dev}}]
";
    apply_yaml(&client, templates, Path::new("templates")).await?;

    // PodGroups: the group first (the claim controller makes a pod's claims once it exists).
    for (group, min_count, pods) in [("fits", 4, 4), ("too-big", 5, 5)] {
        apply_yaml(
            &client,
            &drust_e2e::workloads::gang(version, group, min_count, ""),
            Path::new(group),
        )
        .await?;
        for i in 0..pods {
            apply_yaml(&client, &pod(group, i, "four-gpus"), Path::new(group)).await?;
        }
    }
    let out = dractl(
        &kubeconfig,
        &["--pending", "podgroup/default/fits", "-o", "json"],
    )
    .await?;
    ensure!(out.0 == Some(0), "exit {:?}: {}", out.0, out.2);
    let answer: Value = serde_json::from_str(&out.1)?;
    let fits = placed(&answer);
    ensure!(
        fits == [
            ("fits-0", "gpu-a", 4),
            ("fits-1", "gpu-a", 4),
            ("fits-2", "gpu-b", 4),
            ("fits-3", "gpu-b", 4)
        ],
        "{answer}"
    );
    ensure!(
        answer["gang"] == true && answer["podGroup"] == "default/fits",
        "{answer}"
    );
    let out = dractl(&kubeconfig, &["--pending", "podgroup/default/too-big"]).await?;
    ensure!(out.0 == Some(1), "exit {:?}: {}\n{}", out.0, out.1, out.2);
    ensure!(
        out.1.starts_with(
            "PodGroup default/too-big: a gang of 5 pods (minCount 5): does not fit; nothing is placed."
        ),
        "{}",
        out.1
    );
    let out = dractl(&kubeconfig, &["--pending", "podgroup/default/nobody"]).await?;
    ensure!(out.0 == Some(2), "exit {:?}: {}", out.0, out.2);
    ensure!(
        out.2
            .contains("(PodGroup default/nobody): pods: no pending pod"),
        "{}",
        out.2
    );

    // Jobs as Kueue holds them: suspended, no pod yet.
    for (name, parallelism) in [("train", 4), ("train-big", 5)] {
        apply_yaml(&client, &job(name, parallelism), Path::new(name)).await?;
    }
    let out = dractl(
        &kubeconfig,
        &["--pending", "job/default/train", "-o", "json"],
    )
    .await?;
    ensure!(out.0 == Some(0), "exit {:?}: {}", out.0, out.2);
    let answer: Value = serde_json::from_str(&out.1)?;
    ensure!(placed(&answer).len() == 4, "{answer}");
    ensure!(
        answer["flags"].to_string().contains("workloadWithJob"),
        "{answer}"
    );
    let out = dractl(
        &kubeconfig,
        &["--pending", "job/default/train-big", "--gang"],
    )
    .await?;
    ensure!(out.0 == Some(1), "exit {:?}: {}\n{}", out.0, out.1, out.2);

    // A JobSet, suspended.
    apply_yaml(&client, JOBSET_MANIFEST, Path::new("jobset")).await?;
    let out = dractl(
        &kubeconfig,
        &["--pending", "jobset/default/llm", "-o", "json"],
    )
    .await?;
    ensure!(out.0 == Some(0), "exit {:?}: {}", out.0, out.2);
    let answer: Value = serde_json::from_str(&out.1)?;
    let per_pod: Vec<(String, usize)> = placed(&answer)
        .into_iter()
        .map(|(p, _, d)| (p.to_owned(), d))
        .collect();
    ensure!(
        per_pod
            == [
                ("llm-driver-1".to_owned(), 1),
                ("llm-workers-1".to_owned(), 3),
                ("llm-workers-2".to_owned(), 3),
                ("llm-workers-3".to_owned(), 3),
                ("llm-workers-4".to_owned(), 3)
            ],
        "{answer}"
    );

    // A Job with a pod bound to a node: refused, not counted twice.
    apply_yaml(&client, &job("running", 1), Path::new("running")).await?;
    let jobs: kube::Api<k8s_openapi::api::batch::v1::Job> =
        kube::Api::namespaced(client.clone(), "default");
    let uid = jobs.get("running").await?.metadata.uid.context("job uid")?;
    apply_yaml(
        &client,
        &format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: running-0\n  namespace: default\n  \
             labels: {{batch.kubernetes.io/controller-uid: {uid}}}\nspec:\n  nodeName: gpu-a\n  \
             containers: [{{name: c, image: busybox}}]\n"
        ),
        Path::new("running pod"),
    )
    .await?;
    let out = dractl(&kubeconfig, &["--pending", "job/default/running"]).await?;
    ensure!(out.0 == Some(2), "exit {:?}: {}", out.0, out.2);
    ensure!(
        out.2.contains(
            "(Job default/running): status: 1 of its pods are already bound to nodes (running-0)"
        ),
        "{}",
        out.2
    );
    Ok(())
}

/// Pod `i` of the group: one claim from `template`, pending (no scheduler picks it up).
fn pod(group: &str, i: usize, template: &str) -> String {
    format!(
        "apiVersion: v1
kind: Pod
metadata: {{name: {group}-{i}, namespace: default}}
spec:
  schedulerName: {NO_SCHEDULER}
  schedulingGroup: {{podGroupName: {group}}}
  containers: [{{name: c, image: busybox, resources: {{claims: [{{name: gpus}}]}}}}]
  resourceClaims: [{{name: gpus, resourceClaimTemplateName: {template}}}]
"
    )
}

/// An Indexed Job of `parallelism` pods of 4 GPUs, suspended as Kueue holds it.
fn job(name: &str, parallelism: usize) -> String {
    format!(
        "apiVersion: batch/v1
kind: Job
metadata: {{name: {name}, namespace: default}}
spec:
  suspend: true
  parallelism: {parallelism}
  completions: {parallelism}
  completionMode: Indexed
  template:
    spec:
      restartPolicy: Never
      containers: [{{name: c, image: busybox, resources: {{claims: [{{name: gpus}}]}}}}]
      resourceClaims: [{{name: gpus, resourceClaimTemplateName: four-gpus}}]
"
    )
}

const JOBSET_MANIFEST: &str = "
apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata: {name: llm, namespace: default}
spec:
  suspend: true
  replicatedJobs:
    - name: driver
      template:
        spec:
          template:
            spec:
              restartPolicy: Never
              containers: [{name: d, image: busybox, resources: {claims: [{name: gpu}]}}]
              resourceClaims: [{name: gpu, resourceClaimTemplateName: one-gpu}]
    - name: workers
      replicas: 2
      template:
        spec:
          parallelism: 2
          completions: 2
          completionMode: Indexed
          template:
            spec:
              restartPolicy: Never
              containers: [{name: w, image: busybox, resources: {claims: [{name: gpus}]}}]
              resourceClaims: [{name: gpus, resourceClaimTemplateName: three-gpus}]
";

/// `(pod, node, devices)` of every placed pod.
fn placed(answer: &Value) -> Vec<(&str, &str, usize)> {
    answer["placed"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            (
                p["name"].as_str().unwrap_or(""),
                p["node"].as_str().unwrap_or(""),
                p["devices"].as_array().map_or(0, Vec::len),
            )
        })
        .collect()
}

/// `dractl simulate ARGS --kubeconfig KUBECONFIG`: exit status, stdout, stderr.
async fn dractl(kubeconfig: &Path, args: &[&str]) -> anyhow::Result<(Option<i32>, String, String)> {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_dractl"));
    command
        .arg("simulate")
        .args(args)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .kill_on_drop(true);
    let out = tokio::time::timeout(DEADLINE, command.output())
        .await
        .context("dractl simulate did not finish")??;
    Ok((
        out.status.code(),
        cli::text(&out.stdout),
        cli::text(&out.stderr),
    ))
}

/// JobSet's CRD from its Go module, downloaded through the module proxy.
async fn jobset_crd() -> anyhow::Result<std::path::PathBuf> {
    let mut command = tokio::process::Command::new("go");
    command
        .args(["mod", "download", "-json", JOBSET])
        .current_dir(std::env::temp_dir())
        .kill_on_drop(true);
    let out = tokio::time::timeout(DEADLINE, command.output())
        .await
        .context("go mod download did not finish")??;
    ensure!(
        out.status.success(),
        "go mod download {JOBSET}: {}",
        cli::text(&out.stderr)
    );
    let info: Value = serde_json::from_slice(&out.stdout)?;
    let dir = info["Dir"].as_str().context("go mod download: no Dir")?;
    Ok(Path::new(dir).join("config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml"))
}

/// An API server that accepts the connection and never answers: `--pending` gives up at its
/// deadline (`dractl::live::CALL_TIMEOUT`, 30 s) with exit status 2 and the call it was making,
/// instead of hanging.
#[tokio::test]
async fn a_silent_api_server_is_given_up_at_the_deadline_naming_the_call() -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    // Accept and hold every connection, reading nothing, answering nothing.
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            open.push(socket);
        }
    });
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: silent\n  cluster:\n    \
             server: https://127.0.0.1:{port}\n    insecure-skip-tls-verify: true\n\
             users:\n- name: u\n  user: {{token: t}}\ncontexts:\n- name: c\n  context: \
             {{cluster: silent, user: u}}\ncurrent-context: c\n"
        ),
    )?;
    let (code, _, stderr) = dractl(&kubeconfig, &["--pending", "job/team-a/train"]).await?;
    held.abort();
    ensure!(code == Some(2), "exit {code:?}: {stderr}");
    ensure!(
        stderr.starts_with("dractl simulate: list pods in team-a: "),
        "the call named: {stderr}"
    );
    Ok(())
}
