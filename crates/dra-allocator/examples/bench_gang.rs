//! The speed of [`dra_allocator::gang::place`]: a gang of `PODS` pods (default 128) of
//! `PER_POD` GPUs each (default 8) over `NODES` nodes (default 1,000) of 8 free GPUs each, in
//! racks of 16 nodes; once without and once with the rack as the topology key. Each figure is
//! the whole answer: the scheduler's order in every domain, the explanation of the first pod
//! that fits nowhere, and the check with devices chosen together.
//!
//! `cargo run --release -p dra-allocator --example bench_gang [-- NODES PODS PER_POD]`

use std::time::Instant;

use dra_allocator::gang::{Group, GroupPod, place};
use dra_allocator::{Objects, Options, apply_defaults};
use serde_json::{Value, json};

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("a number"))
        .collect();
    let nodes = args.first().copied().unwrap_or(1000);
    let pods = args.get(1).copied().unwrap_or(128);
    let per_pod = args.get(2).copied().unwrap_or(8);
    let driver = "gpu.example.com";
    let mut objects = Objects {
        nodes: (0..nodes)
            .map(|i| {
                serde_json::from_value(json!({"metadata": {"name": format!("node-{i:04}"),
                    "labels": {"rack": format!("rack-{}", i / 16)}}}))
                .unwrap()
            })
            .collect(),
        classes: vec![
            serde_json::from_value(json!({"metadata": {"name": "gpu"}, "spec": {"selectors": [
                {"cel": {"expression": format!("device.driver == \"{driver}\"")}}]}}))
            .unwrap(),
        ],
        slices: (0..nodes)
            .map(|i| {
                let devices: Vec<Value> = (0..8)
                    .map(|d| json!({"name": format!("gpu-{d}"), "attributes": {"domain": {"int": d / 4}}}))
                    .collect();
                serde_json::from_value(json!({"metadata": {"name": format!("node-{i:04}-gpus")},
                    "spec": {"driver": driver, "nodeName": format!("node-{i:04}"),
                        "pool": {"name": format!("node-{i:04}"), "generation": 1, "resourceSliceCount": 1},
                        "devices": devices}}))
                .unwrap()
            })
            .collect(),
        claims: (0..pods)
            .map(|i| {
                serde_json::from_value(json!({"metadata": {"name": format!("pod-{i}-gpus"), "namespace": "default"},
                    "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
                        "deviceClassName": "gpu", "count": per_pod}}]}}}))
                .unwrap()
            })
            .collect(),
    };
    apply_defaults(&mut objects);
    let claims = std::mem::take(&mut objects.claims);
    let group_pods: Vec<GroupPod> = claims
        .into_iter()
        .enumerate()
        .map(|(i, c)| GroupPod {
            name: format!("pod-{i}"),
            claims: vec![c],
        })
        .collect();
    for topology in [None, Some("rack".to_owned())] {
        let group = Group {
            pods: group_pods.clone(),
            shared: Vec::new(),
            min_count: Some(pods),
            topology_key: topology.clone(),
            pod_group: true,
        };
        let start = Instant::now();
        let p = place(&objects, &group, &Options::default()).expect("placed");
        println!(
            "{pods} pods x {per_pod} GPUs over {nodes} nodes of 8, topology {:?}: fits {}, {:.3} s",
            topology,
            p.fits,
            start.elapsed().as_secs_f64()
        );
    }
}
