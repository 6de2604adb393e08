//! `dractl explain` from the outside: the README's pending example through the binary, as
//! text and JSON; a pod that fits says where; bad input exits 2.

use std::path::PathBuf;
use std::process::Output;

use serde_json::Value;

mod cli;
use cli::{cluster, repo, text};

fn dractl(files: &[PathBuf], extra: &[&str]) -> Output {
    cli::dractl("explain", files, extra)
}

#[test]
fn the_pending_example_names_the_claim_in_use_and_the_selector_that_removed_every_gpu() {
    let mut files = cluster();
    files.push(repo().join("examples/explain/pending-pod-claims.yaml"));

    let out = dractl(&files, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let human = text(&out.stdout);
    assert!(
        human.starts_with("Does not fit: the pod's claims fit on no node (1 node checked).\n"),
        "{human}"
    );
    assert!(
        human.contains("1 node (gpu-node-0), does not fit: claim default/full-nvlink-domain, request gpus: 7 of 8 devices are not allocated to other claims, the request needs 8"),
        "{human}"
    );
    assert!(
        human.contains("(removed: gpu-node-0/gpu-0000-18-00-0)  <- too few"),
        "{human}"
    );
    assert!(
        human.contains("removed 8; removed: gpu-node-0/gpu-0000-18-00-0"),
        "{human}"
    );

    let out = dractl(&files, &["-o", "json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let json: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let node = &json["nodes"][0];
    assert_eq!(node["name"], "gpu-node-0");
    assert_eq!(node["fits"], false);
    let requests = node["explanation"]["requests"].as_array().unwrap();
    let blocked: Vec<(&str, &str)> = requests
        .iter()
        .map(|r| {
            (
                r["request"].as_str().unwrap(),
                r["blockedAt"].as_str().unwrap_or("none"),
            )
        })
        .collect();
    assert_eq!(blocked, [("gpus", "notInUse"), ("gpu", "requestSelectors")]);
    assert_eq!(requests[1]["stages"][2]["selectors"][0]["removed"], 8);
}

#[test]
fn a_pod_that_fits_says_where_and_bad_input_exits_2() {
    let mut files = cluster();
    files.push(repo().join("examples/allocate/pod-claims.yaml"));
    let out = dractl(&files, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "Fits on 1 of 1 node: gpu-node-0.\n");

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "apiVersion: v1\nkind: Node\nmetadata: [\n").unwrap();
    let out = dractl(&[bad], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).starts_with("dractl explain: "),
        "{}",
        text(&out.stderr)
    );
}

fn simulate(files: &[PathBuf], extra: &[&str]) -> Output {
    cli::dractl("simulate", files, extra)
}

#[test]
fn simulate_packs_nvlink_pairs_until_one_is_short_and_says_why() {
    let template = repo().join("examples/simulate/nvlink-pair-template.yaml");
    let template = template.to_str().unwrap();
    let out = simulate(&cluster(), &["--claim-template", template]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    // Seven H100s free (one in use by team-a), all on one NVLink domain: three pairs.
    assert_eq!(
        text(&out.stdout),
        "3 more pods fit.\nPer node: gpu-node-0: 3.\n\nThe next pod does not fit:\n  1 node, does not fit: claim default/simulated-4-nvlink-pair, request gpus: 1 of 8 devices are not allocated to other claims, the request needs 2\n"
    );

    let out = simulate(
        &cluster(),
        &["--claim-template", template, "--count", "2", "-o", "json"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let json: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    // A job of two pods: it fits, each pod with its devices.
    assert_eq!(json["fits"], true);
    let devices: Vec<&str> = json["placed"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["devices"].as_array().unwrap())
        .map(|d| d.as_str().unwrap())
        .collect();
    assert_eq!(devices.len(), 4);
    let mut distinct = devices.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 4, "no device twice: {devices:?}");
    assert!(
        !devices.contains(&"gpu.drust.dev/gpu-node-0/gpu-0000-18-00-0"),
        "the GPU in use is not handed out: {devices:?}"
    );

    let out = simulate(&cluster(), &["--claim-template", "/nonexistent.yaml"]);
    assert_eq!(out.status.code(), Some(2));
}

/// A pod whose claim holds two shares smaller than a GPU: the scheduler would allocate it, and
/// the node plugin would refuse it at prepare forever. Explain says the node does not fit, and
/// why; the same pod with one share fits.
#[test]
fn two_shares_in_one_claim_fit_nowhere_and_explain_says_the_plugin_refuses_them() {
    let dir = tempfile::tempdir().unwrap();
    let device = |name: &str| {
        format!(
            "      - name: {name}
        allowMultipleAllocations: true
        attributes:
          type: {{string: gpu}}
        capacity:
          memory:
            value: 80Gi
            requestPolicy: {{default: 80Gi, validRange: {{min: 1Gi, step: 1Gi}}}}
          computePercent:
            value: \"100\"
            requestPolicy: {{default: \"0\", validRange: {{min: \"0\", step: \"1\"}}}}
"
        )
    };
    let cluster = format!(
        "apiVersion: v1
kind: Node
metadata: {{name: gpu-node-0}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata: {{name: gpu-node-0-gpu.drust.dev}}
spec:
  driver: gpu.drust.dev
  nodeName: gpu-node-0
  pool: {{name: gpu-node-0, generation: 1, resourceSliceCount: 1}}
  devices:
{}{}",
        device("gpu-0"),
        device("gpu-1")
    );
    // The pod's claims, as explain reads them.
    let pod = |count: u32| {
        format!(
            "apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {{name: shares, namespace: default}}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: gpu-share.drust.dev
          count: {count}
          capacity:
            requests: {{memory: 20Gi}}
"
        )
    };
    let files = |count: u32| {
        let c = dir.path().join("cluster.yaml");
        let p = dir.path().join(format!("pod-{count}.yaml"));
        std::fs::write(&c, &cluster).unwrap();
        std::fs::write(&p, pod(count)).unwrap();
        vec![c, repo().join("deploy/deviceclasses/gpu-share.yaml"), p]
    };
    let out = dractl(&files(2), &[]);
    let human = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        human.starts_with("Does not fit: the pod's claims fit on no node (1 node checked).\n")
            && human.contains("claim default/shares is allocated here, but 2 shares smaller than a GPU in one claim")
            && human.contains("prepares at most one per claim"),
        "{human}"
    );
    let out = dractl(&files(1), &[]);
    assert_eq!(
        text(&out.stdout),
        "Fits on 1 of 1 node: gpu-node-0.\n",
        "{}",
        text(&out.stderr)
    );
}
