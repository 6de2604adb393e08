//! Issue 14's benchmark: per-node allocation time, ours against upstream's allocator in the
//! same run, on identical inputs.
//!
//! `cargo run --release -p dractl --example bench_allocate [-- NAME...]`
//!
//! Each case is one input file (a `List` of Nodes, a DeviceClass, ResourceSlices and
//! ResourceClaims). Upstream: `tests/gotools/cmd/allocoracle -f FILE --timeout 0 --timings T`,
//! which times each node's `Allocate` call (the scheduler's Filter, after PreFilter built the
//! allocator). Ours: the same objects read and validated as `dractl allocate` reads them, the
//! allocator built once, the pod's claims validated once ([`dra_allocator::Allocator::pod`],
//! its time added to the first node's), and each node's
//! [`dra_allocator::Allocator::allocate_pod`] timed. Our call returns
//! [`dra_allocator::Allocation`]s that borrow names from the inputs, as upstream's results share
//! their strings with its inputs; building the API objects (`AllocationResult`, copies of every
//! string) is timed on top of it in the "with API objects" columns. The two sides take turns,
//! `rounds` rounds each; the per-node figures of all rounds make the median and p99. The answers
//! must be identical (share IDs by presence), or the case says which nodes differ.
//!
//! Prints a Markdown table for BENCHMARKS.md.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

const DRIVER: &str = "gpu.example.com";

fn class() -> Value {
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": {"name": "gpu"},
        "spec": {"selectors": [{"cel": {"expression": format!("device.driver == \"{DRIVER}\"")}}]}})
}

fn node(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
}

fn gpu(name: &str, model: &str, numa: i64, group: i64) -> Value {
    json!({"name": name,
        "attributes": {"model": {"string": model}, "numa": {"int": numa}, "group": {"int": group}},
        "capacity": {"memory": {"value": "80Gi"}}})
}

fn slice(name: &str, node: &str, pool: &str, count: i64, body: Value) -> Value {
    let mut spec = json!({"driver": DRIVER, "nodeName": node,
        "pool": {"name": pool, "generation": 1, "resourceSliceCount": count}});
    if let (Some(spec), Some(body)) = (spec.as_object_mut(), body.as_object()) {
        spec.extend(body.clone());
    }
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": name}, "spec": spec})
}

/// A claim already allocated to `devices` (pool, device) of DRIVER.
fn in_use(name: &str, devices: &[(String, String)]) -> Value {
    let requests: Vec<Value> = (0..devices.len())
        .map(|i| json!({"name": format!("r{i}"), "exactly": {"deviceClassName": "gpu"}}))
        .collect();
    let results: Vec<Value> = devices
        .iter()
        .enumerate()
        .map(|(i, (pool, device))| {
            json!({"request": format!("r{i}"), "driver": DRIVER, "pool": pool, "device": device})
        })
        .collect();
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "bench", "uid": format!("00000000-0000-4000-8000-{:012}", name.len() * 1000 + devices.len())},
        "spec": {"devices": {"requests": requests}},
        "status": {"allocation": {"devices": {"results": results}}}})
}

fn pod_claim(devices: Value) -> Value {
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "pod-claim", "namespace": "bench"}, "spec": {"devices": devices}})
}

/// `nodes` nodes of `per` GPUs (even ones H100, odd ones A100, five per NUMA node), with
/// `used` of all devices held by claims, spread evenly; then the pod's claim.
fn cluster(nodes: usize, per: usize, used: f64, claim: Value) -> Vec<Value> {
    let mut objects = vec![class()];
    let total_used = (used * (nodes * per) as f64).round() as usize;
    for n in 0..nodes {
        let name = format!("node-{n:03}");
        objects.push(node(&name));
        let devices: Vec<Value> = (0..per)
            .map(|d| {
                let model = if d % 2 == 0 { "H100" } else { "A100" };
                gpu(&format!("gpu-{d}"), model, (d / 5) as i64, 0)
            })
            .collect();
        objects.push(slice(&name, &name, &name, 1, json!({"devices": devices})));
        let here = total_used * (n + 1) / nodes - total_used * n / nodes;
        if here > 0 {
            let held: Vec<(String, String)> = (0..here.min(per))
                .map(|d| (name.clone(), format!("gpu-{d}")))
                .collect();
            objects.push(in_use(&format!("used-{n:03}"), &held));
        }
    }
    objects.push(pod_claim(claim));
    objects
}

fn model_is(model: &str) -> Value {
    json!([{"cel": {"expression": format!("device.attributes[\"{DRIVER}\"].model == \"{model}\"")}}])
}

/// 100 nodes, each a pool of 20 slices: one with the counter sets of 4 GPUs, one with the 4
/// whole GPUs, 18 with 4 partitions each (one per GPU); whole GPU 0 of every node is in use,
/// so its partitions fail on counters. The pod wants one partition.
fn partitionable() -> Vec<Value> {
    let mut objects = vec![class()];
    for n in 0..100 {
        let name = format!("node-{n:03}");
        objects.push(node(&name));
        let sets: Vec<Value> = (0..4)
            .map(|g| {
                json!({"name": format!("gpu-{g}-counters"),
                "counters": {"memory": {"value": "80Gi"}, "slices": {"value": "7"}}})
            })
            .collect();
        objects.push(slice(
            &format!("{name}-00"),
            &name,
            &name,
            20,
            json!({"sharedCounters": sets}),
        ));
        let whole: Vec<Value> = (0..4)
            .map(|g| {
                let mut d = gpu(&format!("gpu-{g}"), "H100", g / 2, 0);
                d["consumesCounters"] = json!([{"counterSet": format!("gpu-{g}-counters"),
                    "counters": {"memory": {"value": "80Gi"}, "slices": {"value": "7"}}}]);
                d
            })
            .collect();
        objects.push(slice(
            &format!("{name}-01"),
            &name,
            &name,
            20,
            json!({"devices": whole}),
        ));
        for s in 2..20 {
            let parts: Vec<Value> = (0..4)
                .map(|g| {
                    let mut d = gpu(&format!("gpu-{g}-part-{s}"), "H100-1g.10gb", g / 2, 0);
                    d["capacity"] = json!({"memory": {"value": "10Gi"}});
                    d["consumesCounters"] = json!([{"counterSet": format!("gpu-{g}-counters"),
                        "counters": {"memory": {"value": "10Gi"}, "slices": {"value": "1"}}}]);
                    d
                })
                .collect();
            objects.push(slice(
                &format!("{name}-{s:02}"),
                &name,
                &name,
                20,
                json!({"devices": parts}),
            ));
        }
        objects.push(in_use(
            &format!("used-{n:03}"),
            &[(name.clone(), "gpu-0".to_owned())],
        ));
    }
    objects.push(pod_claim(json!({"requests": [{"name": "part",
        "exactly": {"deviceClassName": "gpu", "selectors": model_is("H100-1g.10gb")}}]})));
    objects
}

/// One node, `free` free GPUs, a request for one more than that: upstream tries every subset.
fn one_more_than_free(free: usize) -> Vec<Value> {
    let devices: Vec<Value> = (0..free)
        .map(|d| gpu(&format!("gpu-{d}"), "H100", 0, 0))
        .collect();
    one_node(
        devices,
        json!({"requests": [{"name": "gpus",
            "exactly": {"deviceClassName": "gpu", "count": free + 1}}]}),
    )
}

/// The class, one node with `devices` in one slice, and the pod's claim asking `devices_spec`.
fn one_node(devices: Vec<Value>, devices_spec: Value) -> Vec<Value> {
    vec![
        class(),
        node("node-000"),
        slice(
            "node-000",
            "node-000",
            "node-000",
            1,
            json!({"devices": devices}),
        ),
        pod_claim(devices_spec),
    ]
}

/// One node, `groups` values of an attribute with `want - 1` GPUs each, a request for `want`
/// GPUs sharing the value: upstream tries every subset of every group.
fn one_short_per_value(groups: usize, want: usize) -> Vec<Value> {
    let devices: Vec<Value> = (0..groups * (want - 1))
        .map(|d| gpu(&format!("gpu-{d}"), "H100", 0, (d / (want - 1)) as i64))
        .collect();
    one_node(
        devices,
        json!({
            "requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu", "count": want}}],
            "constraints": [{"matchAttribute": format!("{DRIVER}/group")}]}),
    )
}

struct Case {
    name: &'static str,
    objects: Vec<Value>,
    rounds: usize,
}

fn cases() -> Vec<Case> {
    let one_h100 = || json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu", "selectors": model_is("H100")}}]});
    let prioritized = || {
        json!({"requests": [{"name": "gpu", "firstAvailable": [
        {"name": "h200", "deviceClassName": "gpu", "selectors": model_is("H200")},
        {"name": "two-h100", "deviceClassName": "gpu", "count": 2, "selectors": model_is("H100")},
        {"name": "any", "deviceClassName": "gpu"}]}]})
    };
    let numa_pair = || {
        json!({
        "requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu", "count": 2}}],
        "constraints": [{"matchAttribute": format!("{DRIVER}/numa")}]})
    };
    vec![
        Case {
            name: "500 nodes x 10 GPUs, 0% in use, 1 H100",
            objects: cluster(500, 10, 0.0, one_h100()),
            rounds: 5,
        },
        Case {
            name: "500 nodes x 10 GPUs, 50% in use, 1 H100",
            objects: cluster(500, 10, 0.5, one_h100()),
            rounds: 5,
        },
        Case {
            name: "500 nodes x 10 GPUs, 99% in use, 1 H100",
            objects: cluster(500, 10, 0.99, one_h100()),
            rounds: 5,
        },
        Case {
            name: "100 nodes, 2,000 partitionable slices, 1 partition",
            objects: partitionable(),
            rounds: 5,
        },
        Case {
            name: "500 nodes x 10 GPUs, 50% in use, prioritized list",
            objects: cluster(500, 10, 0.5, prioritized()),
            rounds: 5,
        },
        Case {
            name: "500 nodes x 10 GPUs, 50% in use, 2 GPUs matchAttribute numa",
            objects: cluster(500, 10, 0.5, numa_pair()),
            rounds: 5,
        },
        Case {
            name: "adversarial: 21 GPUs wanted, 20 free",
            objects: one_more_than_free(20),
            rounds: 3,
        },
        Case {
            name: "adversarial: matchAttribute, 4 values x 17 GPUs, 18 wanted",
            objects: one_short_per_value(4, 18),
            rounds: 3,
        },
    ]
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

fn ms(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1e3;
    if ms >= 100.0 {
        format!("{ms:.0}")
    } else if ms >= 1.0 {
        format!("{ms:.2}")
    } else {
        format!("{ms:.4}")
    }
}

/// Share IDs are random upstream: compared by presence.
fn normalize(v: &mut Value) {
    match v {
        Value::Object(m) => {
            for (k, x) in m.iter_mut() {
                if k == "shareID" {
                    *x = json!("<present>");
                } else {
                    normalize(x);
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(normalize),
        _ => {}
    }
}

/// Upstream: each node's Allocate time over `rounds` runs, and the last run's answer.
fn upstream(file: &Path, dir: &Path, rounds: usize) -> anyhow::Result<(Vec<Duration>, Value)> {
    let oracle = drust_gotools::go_tool("allocoracle").map_err(anyhow::Error::msg)?;
    let timings = dir.join("timings.json");
    let mut all = Vec::new();
    let mut answer = Value::Null;
    for _ in 0..rounds {
        let out = Command::new(&oracle)
            .arg("-f")
            .arg(file)
            .args(["--timeout", "0", "--timings"])
            .arg(&timings)
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "oracle: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        answer = serde_json::from_slice(&out.stdout)?;
        let t: Value = serde_json::from_slice(&std::fs::read(&timings)?)?;
        all.extend(
            t["allocateNanos"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_u64)
                .map(Duration::from_nanos),
        );
    }
    Ok((all, answer))
}

/// Our timings: per node, the search; and the search plus the API objects of its allocations.
struct Ours {
    search: Vec<Duration>,
    with_api: Vec<Duration>,
}

/// Ours: the objects as `dractl allocate` reads them; each node's allocate time over `rounds`
/// runs, and the answer `dractl allocate` prints.
fn ours(objects: &[Value], rounds: usize) -> anyhow::Result<(Ours, Value)> {
    let mut reader = dractl::objects::Reader::new();
    for (i, o) in objects.iter().enumerate() {
        let location = dractl::objects::Location {
            file: "bench".into(),
            document: 0,
            item: Some(i),
        };
        reader.read_value(location, o.clone())?;
    }
    let inputs = reader.finish();
    let mut objects = dra_allocator::Objects {
        nodes: inputs.nodes,
        classes: inputs.classes,
        slices: inputs.slices,
        claims: inputs.claims,
    };
    dra_allocator::apply_defaults(&mut objects);
    let options = dra_allocator::Options {
        timeout: Duration::ZERO,
        ..Default::default()
    };
    let answer = serde_json::to_value(dra_allocator::allocate(&objects, &options))?;
    let features = dra_allocator::Features::V1_36;
    let claims = objects.to_allocate();
    let mut all = Ours {
        search: Vec::new(),
        with_api: Vec::new(),
    };
    for _ in 0..rounds {
        // What PreFilter does once per pod, untimed as upstream's is.
        let state = dra_allocator::AllocatedState::from_claims(
            &objects.claims,
            features.consumable_capacity,
        )?;
        let allocator =
            dra_allocator::Allocator::new(features, &state, &objects.classes, &objects.slices)?;
        // The pod's claims are validated once for all nodes (upstream validates them in every
        // node's call): that time counts, added to the first node's.
        let started = Instant::now();
        let pod = allocator.pod(&claims);
        let mut validation = started.elapsed();
        for node in &objects.nodes {
            let started = Instant::now();
            let result = allocator.allocate_pod(node, &pod, dra_allocator::Interrupt::default());
            let search = started.elapsed() + std::mem::take(&mut validation);
            let started = Instant::now();
            if let Ok(Some(allocations)) = &result {
                let api: Vec<_> = allocations.iter().map(|a| a.to_api()).collect();
                std::hint::black_box(api);
            }
            all.with_api.push(search + started.elapsed());
            all.search.push(search);
            std::hint::black_box(result).ok();
        }
    }
    Ok((all, answer))
}

fn main() -> anyhow::Result<()> {
    let only: Vec<String> = std::env::args().skip(1).collect();
    let dir = tempfile::tempdir()?;
    println!(
        "| case | nodes | upstream median ms | upstream p99 ms | drust median ms | drust p99 ms | median ratio | p99 ratio | drust median ms with API objects | median ratio with API objects | answers |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for case in cases() {
        if !only.is_empty() && !only.iter().any(|o| case.name.contains(o.as_str())) {
            continue;
        }
        let file = dir.path().join("input.json");
        let list = json!({"apiVersion": "v1", "kind": "List", "items": case.objects});
        std::fs::write(&file, serde_json::to_vec(&list)?)?;
        // Rounds alternate between the two sides, so that both meet the machine in the same
        // moods (a shared VM's memory bandwidth moves medians by up to 2x over a minute).
        let (mut theirs, mut mine, mut mine_api) = (Vec::new(), Vec::new(), Vec::new());
        let (mut their_answer, mut my_answer) = (Value::Null, Value::Null);
        for _ in 0..case.rounds {
            let (t, answer) = upstream(&file, dir.path(), 1)?;
            theirs.extend(t);
            their_answer = answer;
            let (m, answer) = ours(&case.objects, 1)?;
            mine.extend(m.search);
            mine_api.extend(m.with_api);
            my_answer = answer;
        }
        normalize(&mut their_answer);
        normalize(&mut my_answer);
        let same = if their_answer == my_answer {
            let nodes = my_answer["nodes"].as_array().map_or(0, Vec::len);
            let fit = my_answer["nodes"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|n| n["allocated"] == json!(true))
                .count();
            format!("identical ({fit} of {nodes} nodes fit)")
        } else {
            "DIFFERENT".to_owned()
        };
        theirs.sort();
        mine.sort();
        mine_api.sort();
        let (tm, tp) = (percentile(&theirs, 0.5), percentile(&theirs, 0.99));
        let (om, op) = (percentile(&mine, 0.5), percentile(&mine, 0.99));
        let oa = percentile(&mine_api, 0.5);
        let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64().max(1e-9);
        println!(
            "| {} | {} | {} | {} | {} | {} | {:.1}x | {:.1}x | {} | {:.1}x | {} |",
            case.name,
            mine.len() / case.rounds.max(1),
            ms(tm),
            ms(tp),
            ms(om),
            ms(op),
            ratio(tm, om),
            ratio(tp, op),
            ms(oa),
            ratio(tm, oa),
            same
        );
    }
    Ok(())
}
