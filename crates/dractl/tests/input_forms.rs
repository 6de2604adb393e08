//! `dractl allocate -f` reads every stream kubectl reads, proven against kubectl's own reader:
//! the upstream oracle (`tests/gotools/cmd/allocoracle`) reads its files with apimachinery's
//! `YAMLOrJSONDecoder`, as `kubectl apply -f` does. The README's example cluster is written in
//! each form kubectl accepts; for each, both read the one file and must allocate alike (and
//! like the example read from its own YAML files).

mod cli;
mod support;

use std::path::Path;

use serde_json::{Value, json};

/// The README's example objects (cluster, DeviceClass, slices, the pod's claims), in order. The
/// slices' `generateName` becomes their name (the oracle has no API server to generate one).
fn objects() -> Vec<Value> {
    cli::yaml_documents(&cli::allocate_example())
        .into_iter()
        .map(|mut v| {
            if let Some(prefix) = v["metadata"]
                .as_object_mut()
                .and_then(|m| m.remove("generateName"))
            {
                v["metadata"]["name"] = json!(format!("{}x", prefix.as_str().unwrap_or("")));
            }
            v
        })
        .collect()
}

fn yaml(v: &Value) -> String {
    serde_yaml_ng::to_string(v).expect("YAML")
}

fn pretty(v: &Value) -> String {
    serde_json::to_string_pretty(v).expect("JSON")
}

/// The forms: (name, file text).
fn forms(objects: &[Value]) -> Vec<(&'static str, String)> {
    let list = |items: &[Value]| json!({"apiVersion": "v1", "kind": "List", "items": items});
    let (first, rest) = objects.split_first().expect("objects");
    vec![
        (
            "YAML stream",
            objects.iter().map(yaml).collect::<Vec<_>>().join("---\n"),
        ),
        (
            "JSON stream, one object a line",
            objects
                .iter()
                .map(Value::to_string)
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        (
            "JSON stream of indented objects",
            objects.iter().map(pretty).collect::<Vec<_>>().join("\n"),
        ),
        (
            "YAML stream whose documents are JSON",
            objects
                .iter()
                .map(pretty)
                .collect::<Vec<_>>()
                .join("\n---\n"),
        ),
        (
            "YAML stream whose documents are one-line JSON, starting with ---",
            objects
                .iter()
                .map(|o| format!("---\n{o}\n"))
                .collect::<String>(),
        ),
        ("JSON List", pretty(&list(objects))),
        ("YAML List", yaml(&list(objects))),
        (
            "one JSON object, then YAML documents",
            format!(
                "{}\n---\n{}",
                first,
                rest.iter().map(yaml).collect::<Vec<_>>().join("---\n")
            ),
        ),
        (
            "JSON List, then a YAML document",
            format!(
                "{}\n---\n{}",
                list(&objects[..objects.len() - 1]),
                yaml(&objects[objects.len() - 1])
            ),
        ),
    ]
}

fn run_oracle(path: &Path) -> Value {
    let out = std::process::Command::new(support::oracle())
        .arg("-f")
        .arg(path)
        .output()
        .expect("run the oracle");
    assert!(
        out.status.success(),
        "the oracle (kubectl's reader) refuses {}: {}",
        path.display(),
        cli::text(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("oracle answers JSON")
}

fn run_dractl(path: &Path) -> Value {
    let out = cli::dractl("allocate", &[path.to_owned()], &["-o", "json"]);
    assert!(
        out.status.success(),
        "dractl refuses {}: {}",
        path.display(),
        cli::text(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("dractl answers JSON")
}

#[test]
fn every_stream_kubectl_reads_is_read_and_allocated_alike() {
    let objects = objects();
    let dir = tempfile::tempdir().expect("temp dir");
    let baseline = cli::dractl("allocate", &cli::allocate_example(), &["-o", "json"]);
    assert!(baseline.status.success(), "{}", cli::text(&baseline.stderr));
    let baseline: Value = serde_json::from_slice(&baseline.stdout).expect("JSON");
    assert_eq!(baseline["nodes"][0]["allocated"], true, "{baseline}");

    for (i, (form, text)) in forms(&objects).into_iter().enumerate() {
        let path = dir.path().join(format!("form-{i}"));
        std::fs::write(&path, &text).expect("write form");
        let upstream = run_oracle(&path);
        let ours = run_dractl(&path);
        let diffs = support::check::compare(&upstream, &ours);
        assert!(
            diffs.is_empty(),
            "{form}: dractl and kubectl's reader differ: {diffs:?}\n{text}"
        );
        let diffs = support::check::compare(&baseline, &ours);
        assert!(
            diffs.is_empty(),
            "{form}: not the example's allocation: {diffs:?}"
        );
    }
}

#[test]
fn a_stream_of_two_json_objects_stays_json_as_in_kubectl() {
    // After two JSON objects the stream is JSON (apimachinery's decoder no longer falls back to
    // YAML): a YAML document after them is an error for both readers.
    let objects = objects();
    let text = format!("{}\n{}\n---\n{}", objects[0], objects[1], yaml(&objects[2]));
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("two-json-then-yaml");
    std::fs::write(&path, &text).expect("write");
    let upstream = std::process::Command::new(support::oracle())
        .arg("-f")
        .arg(&path)
        .output()
        .expect("run the oracle");
    assert!(!upstream.status.success(), "kubectl's reader accepted it");
    let ours = cli::dractl("allocate", std::slice::from_ref(&path), &["-o", "json"]);
    assert_eq!(ours.status.code(), Some(2), "{}", cli::text(&ours.stdout));
    let e = cli::text(&ours.stderr);
    assert!(
        e.contains("document 2") && e.contains("parsing JSON"),
        "{e}"
    );
}

/// `dractl simulate --claim-template` reads its files the same way: each form gives the same
/// claims.
#[test]
fn claim_templates_for_simulate_are_read_in_every_form() {
    let template = |name: &str| {
        json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": "team-a"},
            "spec": {"spec": {"devices": {"requests": [
                {"name": "gpu", "exactly": {"deviceClassName": "gpu.drust.dev"}}
            ]}}},
        })
    };
    let templates = [template("one"), template("two")];
    let dir = tempfile::tempdir().expect("temp dir");
    let mut read = Vec::new();
    for (i, (form, text)) in forms(&templates).into_iter().enumerate() {
        let path = dir.path().join(format!("templates-{i}"));
        std::fs::write(&path, &text).expect("write form");
        let claims = dractl::simulate::templates(&[path.display().to_string()])
            .unwrap_or_else(|e| panic!("{form}: {e}\n{text}"));
        let names: Vec<_> = claims
            .iter()
            .map(|c| c.metadata.name.clone().unwrap_or_default())
            .collect();
        assert_eq!(names, ["one", "two"], "{form}");
        read.push(serde_json::to_value(&claims).expect("JSON"));
    }
    assert!(read.windows(2).all(|w| w[0] == w[1]), "the forms differ");
}
