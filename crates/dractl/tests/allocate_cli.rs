//! `dractl allocate` from the outside: the README's example through the binary in every output
//! format, bad input files refused with exit code 2 naming file, document and field, and random
//! damage to valid input never panicking nor running unbounded.

use std::path::PathBuf;
use std::process::Output;
use std::time::Duration;

use serde_json::Value;

mod cli;
use cli::text;

/// The README's example inputs.
fn example_files() -> Vec<PathBuf> {
    cli::allocate_example()
}

fn dractl(files: &[PathBuf], extra: &[&str]) -> Output {
    cli::dractl("allocate", files, extra)
}

#[test]
fn the_readme_example_allocates_a_linked_pair_and_a_sidecar_around_the_gpu_in_use() {
    let out = dractl(&example_files(), &["-o", "json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).expect("exactly one JSON object");
    let nodes = report["nodes"].as_array().expect("nodes");
    assert_eq!(nodes.len(), 1, "{report}");
    assert_eq!(nodes[0]["name"], "gpu-node-0");
    assert_eq!(nodes[0]["allocated"], true, "{report}");
    let devices: Vec<(String, String)> = nodes[0]["claims"]
        .as_array()
        .expect("claims")
        .iter()
        .flat_map(|c| {
            let claim = c["name"].as_str().unwrap_or_default().to_owned();
            c["allocation"]["devices"]["results"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .map(move |r| {
                    (
                        claim.clone(),
                        r["device"].as_str().unwrap_or_default().to_owned(),
                    )
                })
        })
        .collect();
    // The first GPU is held by team-a's claim: the search starts after it, in slice order.
    assert_eq!(
        devices,
        [
            ("nccl-pair".to_owned(), "gpu-0000-2a-00-0".to_owned()),
            ("nccl-pair".to_owned(), "gpu-0000-3a-00-0".to_owned()),
            ("sidecar-gpu".to_owned(), "gpu-0000-5d-00-0".to_owned()),
        ]
    );

    let table = dractl(&example_files(), &["-o", "table"]);
    assert!(table.status.success(), "{}", text(&table.stderr));
    let table = text(&table.stdout);
    assert!(table.contains("gpu-node-0  allocated"), "{table}");
    assert!(
        table.contains("default/nccl-pair  gpus -> gpu.drust.dev/gpu-node-0/gpu-0000-2a-00-0"),
        "{table}"
    );

    let yaml = dractl(&example_files(), &["-o", "yaml"]);
    assert!(yaml.status.success(), "{}", text(&yaml.stderr));
    let from_yaml: Value = serde_yaml_ng::from_slice(&yaml.stdout).expect("YAML");
    assert_eq!(from_yaml, report, "YAML and JSON say the same");
}

#[test]
fn bad_input_files_exit_2_naming_file_document_and_field() {
    let dir = tempfile::tempdir().expect("temp dir");
    let write = |name: &str, body: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, body).expect("write");
        p
    };
    let mut files = example_files();
    let bad_yaml = write("bad.yaml", "apiVersion: v1\nkind: Node\nmetadata: [\n");
    files.push(bad_yaml);
    let out = dractl(&files, &[]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stdout));
    let err = text(&out.stderr);
    assert!(err.contains("bad.yaml"), "{err}");
    assert!(out.stdout.is_empty(), "no report on bad input");

    let mut files = example_files();
    files.push(write(
        "slice.yaml",
        "---\napiVersion: v1\nkind: Node\nmetadata: {name: node-b}\n---\n\
         apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {name: s}\n\
         spec: {driver: gpu.drust.dev, nodeName: node-b,\n\
         pool: {name: node-b, generation: 1, resourceSliceCount: 1},\n\
         devices: [{name: GPU_0}]}\n",
    ));
    let out = dractl(&files, &[]);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    for part in ["slice.yaml", "document 1", "spec.devices[0].name", "GPU_0"] {
        assert!(err.contains(part), "{part:?} missing: {err}");
    }

    let out = dractl(&example_files(), &["--node", "no-such-node"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("no-such-node"));
}

/// A tiny deterministic generator (SplitMix64): no dependency for a few hundred draws.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Replaces one randomly chosen value anywhere in `v` by a random one.
fn damage(v: &mut Value, rng: &mut Rng) {
    let replacement = || -> [Value; 10] {
        [
            Value::Null,
            Value::from(-1),
            Value::from(0),
            Value::from(1_000_000_000_000i64),
            Value::from(""),
            Value::from("x"),
            Value::from("1.5Gi"),
            Value::from("device.attributes[\"gpu.drust.dev\"].index / 0 == 1"),
            Value::Array(vec![]),
            serde_json::json!({}),
        ]
    };
    let descend = rng.below(4) != 0;
    match v {
        Value::Object(m) if descend && !m.is_empty() => {
            let k = m
                .keys()
                .nth(rng.below(m.len()))
                .cloned()
                .unwrap_or_default();
            if let Some(inner) = m.get_mut(&k) {
                return damage(inner, rng);
            }
        }
        Value::Array(a) if descend && !a.is_empty() => {
            let i = rng.below(a.len());
            if let Some(inner) = a.get_mut(i) {
                return damage(inner, rng);
            }
        }
        _ => {}
    }
    let choices = replacement();
    *v = choices[rng.below(choices.len())].clone();
}

/// The documents that still deserialize as their kind, unvalidated and undefaulted.
fn raw_objects(docs: &[Value]) -> dra_allocator::Objects {
    let mut objects = dra_allocator::Objects::default();
    for d in docs {
        let v = d.clone();
        match d["kind"].as_str() {
            Some("Node") => objects.nodes.extend(serde_json::from_value(v).ok()),
            Some("DeviceClass") => objects.classes.extend(serde_json::from_value(v).ok()),
            Some("ResourceSlice") => objects.slices.extend(serde_json::from_value(v).ok()),
            Some("ResourceClaim") => objects.claims.extend(serde_json::from_value(v).ok()),
            _ => {}
        }
    }
    objects
}

#[test]
fn random_damage_to_valid_input_never_panics_and_stays_bounded() {
    let documents: Vec<Value> = cli::yaml_documents(&example_files());
    let mut rng = Rng(0x5eed);
    let mut outcomes = [0usize; 2];
    // Bounded by the allocator's deadline: a damaged input that set off a long search ends
    // there with a timed-out node, an answer like any other here.
    let options = dractl::allocate::Options {
        timeout: Duration::from_secs(1),
        ..Default::default()
    };
    for case in 0..1000 {
        let mut docs = documents.clone();
        for _ in 0..1 + rng.below(3) {
            let i = rng.below(docs.len());
            if let Some(d) = docs.get_mut(i) {
                damage(d, &mut rng);
            }
        }
        // The allocator itself on the damaged objects without validation: no panic either.
        let raw = raw_objects(&docs);
        let raw_report = dra_allocator::allocate(&raw, &options);
        serde_json::to_string(&raw_report).expect("serializes");
        let mut reader = dractl::objects::Reader::new();
        let read = docs.into_iter().enumerate().try_for_each(|(i, d)| {
            let location = dractl::objects::Location {
                file: format!("case-{case}"),
                document: i,
                item: None,
            };
            reader.read_value(location, d)
        });
        match read.and_then(|()| dractl::allocate::allocate(reader.finish(), &options)) {
            Ok(report) => {
                outcomes[0] += 1;
                serde_json::to_string(&report).expect("serializes");
            }
            Err(e) => {
                outcomes[1] += 1;
                assert!(
                    e.to_string().contains(&format!("case-{case}"))
                        || e.to_string().contains("node"),
                    "{e}"
                );
            }
        }
    }
    eprintln!(
        "1000 damaged inputs: {} answered, {} refused",
        outcomes[0], outcomes[1]
    );
    assert!(outcomes[0] > 0 && outcomes[1] > 0, "{outcomes:?}");
}
