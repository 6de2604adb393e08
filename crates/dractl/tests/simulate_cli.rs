//! `dractl simulate` for jobs and gangs, from the outside: the binary on two fake DGX H100
//! nodes (the plugin's own published slices, `crates/gpu-kubelet-plugin/tests/snapshots`) and on
//! the README's two GB200 NVL72 racks (`examples/simulate/`), in text and JSON, with the exit
//! status a script reads: 0 fits, 1 does not, 2 bad input.

use std::path::{Path, PathBuf};
use std::process::Output;

use serde_json::Value;

mod cli;
use cli::{repo, text};

/// Two DGX H100 nodes of 8 GPUs, all free: the plugin's slices for `gpu-node-0`, and the
/// same renamed for `gpu-node-1`; `in_use` GPUs of gpu-node-0 held by a claim.
fn two_dgx(dir: &Path, in_use: usize) -> Vec<PathBuf> {
    let snapshot = std::fs::read_to_string(
        repo().join("crates/gpu-kubelet-plugin/tests/snapshots/dgx-h100.yaml"),
    )
    .expect("snapshot");
    let devices: Vec<String> = snapshot
        .lines()
        .filter_map(|l| l.strip_prefix("    name: gpu-0000-"))
        .map(|d| format!("gpu-0000-{d}"))
        .collect();
    assert_eq!(devices.len(), 8, "a DGX H100 has 8 GPUs");
    let mut cluster = String::new();
    for node in ["gpu-node-0", "gpu-node-1"] {
        cluster.push_str(&format!(
            "---\napiVersion: v1\nkind: Node\nmetadata:\n  name: {node}\n"
        ));
        cluster.push_str(&snapshot.replace("gpu-node-0", node));
    }
    if in_use > 0 {
        let results: String = devices[..in_use]
            .iter()
            .map(|d| {
                format!(
                    "        - {{request: gpu, driver: gpu.drust.dev, pool: gpu-node-0, device: {d}}}\n"
                )
            })
            .collect();
        cluster.push_str(&format!(
            "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: in-use, namespace: team-a}}\n\
             spec:\n  devices:\n    requests:\n      - name: gpu\n        exactly: {{deviceClassName: gpu.drust.dev, count: {in_use}}}\n\
             status:\n  allocation:\n    devices:\n      results:\n{results}"
        ));
    }
    let path = dir.join("two-dgx.yaml");
    std::fs::write(&path, cluster).expect("write cluster");
    vec![path, repo().join("deploy/deviceclasses/gpu.yaml")]
}

/// A ResourceClaimTemplate of `count` H100s.
fn template(dir: &Path, name: &str, count: usize) -> String {
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(
        &path,
        format!(
            "apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\n\
             metadata: {{name: {name}, namespace: default}}\n\
             spec:\n  spec:\n    devices:\n      requests:\n        - name: gpus\n          exactly: {{deviceClassName: gpu.drust.dev, count: {count}}}\n"
        ),
    )
    .expect("write template");
    path.display().to_string()
}

fn simulate(files: &[PathBuf], extra: &[&str]) -> Output {
    cli::dractl("simulate", files, extra)
}

fn json(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

fn nodes(json: &Value) -> Vec<&str> {
    json["placed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["node"].as_str().unwrap())
        .collect()
}

#[test]
fn a_gang_of_four_pods_of_four_gpus_fits_two_per_node_on_two_eight_gpu_nodes() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = two_dgx(dir.path(), 0);
    let four = template(dir.path(), "four-h100", 4);
    let out = simulate(
        &cluster,
        &["--claim-template", &four, "--count", "4", "--gang"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let human = text(&out.stdout);
    assert!(
        human.starts_with("A gang of 4 pods (minCount 4): fits.\n  pod-1 on gpu-node-0: gpu-"),
        "{human}"
    );
    assert!(
        human.contains("Per node: gpu-node-0: 2, gpu-node-1: 2.\n"),
        "{human}"
    );

    let out = simulate(
        &cluster,
        &[
            "--claim-template",
            &four,
            "--count",
            "4",
            "--gang",
            "-o",
            "json",
        ],
    );
    assert_eq!(out.status.code(), Some(0));
    let json = json(&out);
    assert_eq!(
        nodes(&json),
        ["gpu-node-0", "gpu-node-0", "gpu-node-1", "gpu-node-1"]
    );
    let mut devices: Vec<&str> = json["placed"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["devices"].as_array().unwrap())
        .map(|d| d.as_str().unwrap())
        .collect();
    devices.sort();
    devices.dedup();
    assert_eq!(devices.len(), 16, "16 distinct GPUs");
    assert_eq!(json["placementExists"], true);
}

#[test]
fn with_min_count_five_nothing_is_placed_and_the_fifth_pod_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = two_dgx(dir.path(), 0);
    let four = template(dir.path(), "four-h100", 4);
    let out = simulate(
        &cluster,
        &[
            "--claim-template",
            &four,
            "--count",
            "5",
            "--min-count",
            "5",
        ],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "A gang of 5 pods (minCount 5): does not fit; nothing is placed.\n\
         \n\
         pod-5 fits on no node:\n  \
         2 nodes (gpu-node-0, gpu-node-1), does not fit: claim default/simulated-5-four-h100, request gpus: 0 of 8 devices are not allocated to other claims, the request needs 4\n\
         \n\
         No choice of devices does better: with devices chosen together, at most 4 fit.\n"
    );
    let out = simulate(
        &cluster,
        &[
            "--claim-template",
            &four,
            "--count",
            "5",
            "--min-count",
            "5",
            "-o",
            "json",
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    let json = json(&out);
    assert_eq!(json["placed"], serde_json::json!([]));
    assert_eq!(json["domains"][0]["placed"], 4);
    assert_eq!(json["domains"][0]["blocked"]["pod"], 5);

    // Four pods of a gang of minCount 5: the scheduler waits for the fifth and tries nothing.
    let out = simulate(
        &cluster,
        &[
            "--claim-template",
            &four,
            "--count",
            "4",
            "--min-count",
            "5",
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stdout),
        "A gang of 4 pods (minCount 5): does not fit: the scheduler waits for 5 pods to exist and tries nothing.\n"
    );
}

#[test]
fn a_sixteen_pod_job_says_which_pods_fit_where_and_what_stops_the_last() {
    let dir = tempfile::tempdir().unwrap();
    // One GPU of gpu-node-0 is in use: 15 free.
    let cluster = two_dgx(dir.path(), 1);
    let one = template(dir.path(), "one-h100", 1);
    let out = simulate(&cluster, &["--claim-template", &one, "--count", "16"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let human = text(&out.stdout);
    assert!(
        human.starts_with("A job of 16 pods: does not fit: 15 of 16 pods fit.\n"),
        "{human}"
    );
    assert!(
        human.contains("Per node: gpu-node-0: 7, gpu-node-1: 8.\n\npod-16 fits on no node:\n  2 nodes (gpu-node-0, gpu-node-1), does not fit: claim default/simulated-16-one-h100, request gpus: 0 of 8 devices are not allocated to other claims, the request needs 1\n"),
        "{human}"
    );

    // Fifteen fit, and as a gang of sixteen none is placed.
    let out = simulate(&cluster, &["--claim-template", &one, "--count", "15"]);
    assert_eq!(out.status.code(), Some(0));
    let out = simulate(
        &cluster,
        &[
            "--claim-template",
            &one,
            "--count",
            "16",
            "--gang",
            "-o",
            "json",
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    let json = json(&out);
    assert_eq!(
        (json["fits"].clone(), json["placed"].clone()),
        (false.into(), serde_json::json!([]))
    );
    assert_eq!(json["domains"][0]["capacity"]["pods"], 15);
}

#[test]
fn a_topology_key_keeps_the_gang_in_one_nvlink_clique_or_names_each_clique() {
    let r = repo();
    let cluster = vec![
        r.join("examples/simulate/nvl72-racks.yaml"),
        r.join("deploy/deviceclasses/gpu.yaml"),
    ];
    let tray = r.join("examples/simulate/tray-template.yaml");
    let podgroup = r.join("examples/simulate/podgroup.yaml");
    let (tray, podgroup) = (tray.to_str().unwrap(), podgroup.to_str().unwrap());
    let (a, b) = (
        "5b1f2c8e-4d3a-4f7e-9a61-0c2d8e7f3b94.32766",
        "9c4e7a21-6f0b-4c2d-8e15-3a7d5b9f0c62.32766",
    );

    // The README's PodGroup: three trays in one clique; rack A has one GPU in use.
    let out = simulate(
        &cluster,
        &[
            "--claim-template",
            tray,
            "--pod-group",
            podgroup,
            "--count",
            "3",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let human = text(&out.stdout);
    assert!(
        human.starts_with(&format!(
            "PodGroup default/train: a gang of 3 pods (minCount 3) in one domain of gpu.drust.dev/nvlink-clique: fits, in {b}.\n"
        )),
        "{human}"
    );
    assert!(
        human.contains("Per node: tray-b0: 1, tray-b1: 1, tray-b2: 1.\n"),
        "{human}"
    );

    // Four trays: no clique has them, each says how far it got and why.
    let out = simulate(
        &cluster,
        &[
            "--claim-template",
            tray,
            "--count",
            "4",
            "--gang",
            "--topology-key",
            "gpu.drust.dev/nvlink-clique",
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    let human = text(&out.stdout);
    for want in [
        format!("In {a} (3 nodes): 2 of 4 pods fit; pod-3 fits on no node:\n"),
        "1 node (tray-a2), does not fit: claim default/simulated-3-tray, request gpus: 3 of 4 devices are not allocated to other claims, the request needs 4\n".to_owned(),
        format!("In {b} (3 nodes): 3 of 4 pods fit; pod-4 fits on no node:\n"),
    ] {
        assert!(human.contains(&want), "{human}\nwant: {want}");
    }
    // Without the constraint the four trays are there, across the two cliques.
    let out = simulate(
        &cluster,
        &["--claim-template", tray, "--count", "4", "--gang"],
    );
    assert_eq!(out.status.code(), Some(0));
}

/// A PodGroup claim (one GPU for the whole group, KEP-5729) is allocated with the first pod; its
/// node selector then bounds every pod to that node.
#[test]
fn a_pod_group_claim_bounds_every_pod_to_its_node() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = two_dgx(dir.path(), 0);
    let two = template(dir.path(), "two-h100", 2);
    let podgroup = dir.path().join("podgroup.yaml");
    std::fs::write(
        &podgroup,
        "apiVersion: scheduling.k8s.io/v1beta1\nkind: PodGroup\nmetadata: {name: train, namespace: default}\n\
         spec:\n  schedulingPolicy: {gang: {minCount: 3}}\n  resourceClaims:\n    - {name: shared-gpu, resourceClaimTemplateName: shared-gpu}\n\
         ---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata: {name: shared-gpu, namespace: default}\n\
         spec:\n  spec:\n    devices:\n      requests:\n        - name: gpu\n          exactly: {deviceClassName: gpu.drust.dev}\n",
    )
    .unwrap();
    let pg = podgroup.to_str().unwrap();
    let out = simulate(
        &cluster,
        &[
            "--claim-template",
            &two,
            "--pod-group",
            pg,
            "--count",
            "3",
            "-o",
            "json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let json = json(&out);
    assert_eq!(nodes(&json), ["gpu-node-0", "gpu-node-0", "gpu-node-0"]);
    let shared = &json["sharedClaims"][0];
    assert_eq!(shared["name"], "train-shared-gpu-simulated");
    let selector = shared["allocation"]["nodeSelector"].to_string();
    assert!(selector.contains("gpu-node-0"), "{selector}");
    let flags: Vec<&str> = json["flags"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["code"].as_str().unwrap())
        .collect();
    assert!(flags.contains(&"sharedClaimNodeSelector"), "{flags:?}");

    // A fourth pod would need 9 GPUs on gpu-node-0, and gpu-node-1 is not the claim's node.
    let out = simulate(
        &cluster,
        &["--claim-template", &two, "--pod-group", pg, "--count", "4"],
    );
    assert_eq!(out.status.code(), Some(0), "minCount 3 is met");
    let human = text(&out.stdout);
    assert!(
        human.contains("1 node (gpu-node-1), does not fit: resourceclaim not available on the node: the group's claim default/train-shared-gpu-simulated is allocated on other nodes\n"),
        "{human}"
    );
}

#[test]
fn a_malformed_pod_group_is_named_with_its_field_and_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = two_dgx(dir.path(), 0);
    let two = template(dir.path(), "two-h100", 2);
    for (body, want) in [
        (
            "spec: {schedulingPolicy: {gang: {minCount: 0}}}",
            "(PodGroup default/train): spec.schedulingPolicy.gang.minCount: 0: must be a positive integer",
        ),
        (
            "spec: {schedulingPolicy: {basic: {}}, resourceClaims: [{name: x, resourceClaimTemplateName: nowhere}]}",
            "(PodGroup default/train): spec.resourceClaims[0].resourceClaimTemplateName: ResourceClaimTemplate default/nowhere is in neither",
        ),
    ] {
        let podgroup = dir.path().join("bad.yaml");
        std::fs::write(
            &podgroup,
            format!(
                "apiVersion: scheduling.k8s.io/v1alpha2\nkind: PodGroup\nmetadata: {{name: train}}\n{body}\n"
            ),
        )
        .unwrap();
        let out = simulate(
            &cluster,
            &[
                "--claim-template",
                &two,
                "--pod-group",
                podgroup.to_str().unwrap(),
                "--count",
                "2",
            ],
        );
        assert_eq!(out.status.code(), Some(2));
        let stderr = text(&out.stderr);
        assert!(
            stderr.starts_with("dractl simulate: ") && stderr.contains(want),
            "{stderr}\nwant: {want}"
        );
    }
}

/// A Job manifest: its parallelism and its pod template's claims; under 1.36's WorkloadWithJob
/// gate an Indexed Job with completions = parallelism is a gang, which `--gang` simulates.
#[test]
fn a_job_manifest_gives_the_pods_and_their_claims_and_a_pod_group_claim_is_the_groups() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = two_dgx(dir.path(), 0);
    let job = dir.path().join("job.yaml");
    std::fs::write(
        &job,
        "apiVersion: batch/v1\nkind: Job\nmetadata: {name: train, namespace: default}\n\
         spec:\n  parallelism: 4\n  completions: 4\n  completionMode: Indexed\n  template:\n    spec:\n      \
         restartPolicy: Never\n      containers: [{name: train, image: busybox}]\n      \
         resourceClaims:\n        - {name: gpus, resourceClaimTemplateName: four-h100}\n\
         ---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata: {name: four-h100, namespace: default}\n\
         spec:\n  spec:\n    devices:\n      requests:\n        - name: gpus\n          exactly: {deviceClassName: gpu.drust.dev, count: 4}\n",
    )
    .unwrap();
    let job = job.to_str().unwrap();
    let out = simulate(&cluster, &["--job", job, "-o", "json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let answer = json(&out);
    assert_eq!(
        (answer["pods"].clone(), answer["gang"].clone()),
        (4.into(), false.into())
    );
    assert_eq!(
        nodes(&answer),
        ["gpu-node-0", "gpu-node-0", "gpu-node-1", "gpu-node-1"]
    );
    assert!(
        answer["flags"].to_string().contains("workloadWithJob"),
        "{}",
        answer["flags"]
    );
    let out = simulate(&cluster, &["--job", job, "--gang", "--count", "5"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stdout)
            .starts_with("A gang of 5 pods (minCount 5): does not fit; nothing is placed.\n"),
        "{}",
        text(&out.stdout)
    );

    // The same Job in a PodGroup whose claim (one GPU) its pods also name: the group's claim.
    let grouped = dir.path().join("grouped.yaml");
    std::fs::write(
        &grouped,
        "apiVersion: batch/v1\nkind: Job\nmetadata: {name: train, namespace: default}\n\
         spec:\n  parallelism: 2\n  template:\n    spec:\n      schedulingGroup: {podGroupName: train}\n      \
         restartPolicy: Never\n      containers: [{name: train, image: busybox}]\n      \
         resourceClaims:\n        - {name: gpus, resourceClaimTemplateName: four-h100}\n        \
         - {name: shared, resourceClaimTemplateName: one-h100}\n\
         ---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata: {name: four-h100, namespace: default}\n\
         spec:\n  spec:\n    devices:\n      requests:\n        - name: gpus\n          exactly: {deviceClassName: gpu.drust.dev, count: 4}\n\
         ---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata: {name: one-h100, namespace: default}\n\
         spec:\n  spec:\n    devices:\n      requests:\n        - name: gpu\n          exactly: {deviceClassName: gpu.drust.dev}\n",
    )
    .unwrap();
    let podgroup = dir.path().join("podgroup.yaml");
    std::fs::write(
        &podgroup,
        "apiVersion: scheduling.k8s.io/v1alpha2\nkind: PodGroup\nmetadata: {name: train, namespace: default}\n\
         spec:\n  schedulingPolicy: {gang: {minCount: 2}}\n  resourceClaims:\n    - {name: shared, resourceClaimTemplateName: one-h100}\n",
    )
    .unwrap();
    let (grouped, podgroup) = (grouped.to_str().unwrap(), podgroup.to_str().unwrap());
    let out = simulate(
        &cluster,
        &["--job", grouped, "--pod-group", podgroup, "-o", "json"],
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "1 + 2 × 4 GPUs on one node: {}",
        text(&out.stderr)
    );
    let answer = json(&out);
    assert_eq!(answer["domains"][0]["placed"], 1);
    assert_eq!(
        answer["domains"][0]["sharedClaims"][0]["name"],
        "train-shared-simulated"
    );
    assert_eq!(answer["placementExists"], false);

    // Its pods name a PodGroup that is not given.
    let out = simulate(&cluster, &["--job", grouped]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("(Job default/train): spec.template.spec.schedulingGroup.podGroupName: \"train\": give PodGroup default/train with --pod-group"),
        "{stderr}"
    );
}

/// A JobSet: a role per replicated job (`replicas` x `parallelism` pods, each with its pod
/// template's claims); where its child Jobs are gang candidates under the WorkloadWithJob gate,
/// each is a gang of its own, and simulate says so.
#[test]
fn a_jobset_places_each_replicated_jobs_pods_with_their_own_claims() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = two_dgx(dir.path(), 0);
    let jobset = dir.path().join("jobset.yaml");
    let write = |workers: usize| {
        std::fs::write(
            &jobset,
            format!(
                "apiVersion: jobset.x-k8s.io/v1alpha2\nkind: JobSet\nmetadata: {{name: llm, namespace: default}}\n\
                 spec:\n  replicatedJobs:\n\
                 \x20   - name: driver\n      template:\n        spec:\n          template:\n            spec:\n\
                 \x20             containers: [{{name: d, image: busybox}}]\n\
                 \x20             resourceClaims: [{{name: gpu, resourceClaimTemplateName: one-h100}}]\n\
                 \x20   - name: workers\n      replicas: 2\n      template:\n        spec:\n\
                 \x20         parallelism: 2\n          completions: 2\n          completionMode: Indexed\n\
                 \x20         template:\n            spec:\n              containers: [{{name: w, image: busybox}}]\n\
                 \x20             resourceClaims: [{{name: gpus, resourceClaimTemplateName: workers}}]\n\
                 ---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata: {{name: one-h100, namespace: default}}\n\
                 spec:\n  spec:\n    devices:\n      requests:\n        - name: gpu\n          exactly: {{deviceClassName: gpu.drust.dev}}\n\
                 ---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata: {{name: workers, namespace: default}}\n\
                 spec:\n  spec:\n    devices:\n      requests:\n        - name: gpus\n          exactly: {{deviceClassName: gpu.drust.dev, count: {workers}}}\n"
            ),
        )
        .unwrap();
    };
    // 1 + 4 x 3 GPUs of 16.
    write(3);
    let file = jobset.to_str().unwrap();
    let out = simulate(&cluster, &["--job", file, "-o", "json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let answer = json(&out);
    let pods: Vec<(&str, usize)> = answer["placed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap(),
                p["devices"].as_array().unwrap().len(),
            )
        })
        .collect();
    assert_eq!(
        pods,
        [
            ("llm-driver-1", 1),
            ("llm-workers-1", 3),
            ("llm-workers-2", 3),
            ("llm-workers-3", 3),
            ("llm-workers-4", 3),
        ],
        "{answer}"
    );
    let flags = answer["flags"].to_string();
    assert!(
        flags.contains("replicated job \\\"llm-workers\\\"") && flags.contains("minCount 2"),
        "{flags}"
    );
    // 1 + 4 x 4 GPUs of 16: the last worker does not fit.
    write(4);
    let out = simulate(&cluster, &["--job", file]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).starts_with("A job of 5 pods: does not fit: 4 of 5 pods fit.\n"),
        "{}",
        text(&out.stdout)
    );
    // --count cannot size several roles.
    let out = simulate(&cluster, &["--job", file, "--count", "3"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("(JobSet default/llm): spec.replicatedJobs: --count"),
        "{}",
        text(&out.stderr)
    );
}
