//! Differential conformance: every corpus case must get the same result class (true, false,
//! compile, runtime, cost) from dra-cel as from upstream Kubernetes, evaluated by the Go oracle
//! `tests/gotools/cmd/celoracle` (built with `go build`, cached by a hash of its sources).

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The oracle, built once per source hash by the e2e crate's Go tool builder
/// (`~/.cache/drust/celoracle/<hash>/celoracle`).
fn oracle() -> PathBuf {
    drust_e2e::binary::go_tool("celoracle")
        .unwrap_or_else(|e| panic!("building the CEL oracle (Go is required): {e}"))
}

/// A small deterministic generator (fixed seed) of well- and ill-typed selectors.
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[(self.next() as usize) % xs.len()]
    }
    fn atom(&mut self) -> String {
        let dom = self.pick(&[
            "'dra.example.com'",
            "'gpu.nvidia.com'",
            "'other.io'",
            "'none.io'",
        ]);
        let attr = self.pick(&[
            "model", "count", "flag", "ver", "x", "uuid", "name", "missing",
        ]);
        let cap = self.pick(&["memory", "cores", "missing"]);
        let lit = self.pick(&[
            "'A100'", "3", "0", "-7", "true", "1.5", "'1.2.3'", "5u", "null",
        ]);
        let q = self.pick(&["'1Gi'", "'80Gi'", "'1500m'", "'0'", "'10Mo'", "'1e3'"]);
        match self.next() % 16 {
            0 => format!("device.attributes[{dom}].{attr} == {lit}"),
            1 => format!("has(device.attributes[{dom}].{attr})"),
            2 => format!("'{attr}' in device.attributes[{dom}]"),
            3 => format!("device.capacity[{dom}].{cap}.isGreaterThan(quantity({q}))"),
            4 => format!("device.attributes[{dom}].{attr} > {lit}"),
            5 => format!("device.attributes[{dom}].?{attr}.orValue({lit}) == {lit}"),
            6 => format!("device.attributes[{dom}].{attr}.startsWith('A')"),
            7 => format!("device.capacity[{dom}].{cap}.compareTo(quantity({q})) >= 0"),
            8 => format!(
                "device.attributes[{dom}].size() {} {}",
                self.pick(&["==", ">", "<"]),
                self.next() % 4
            ),
            9 => format!(
                "device.driver == {}",
                self.pick(&["'dra.example.com'", "'gpu.nvidia.com'", "1"])
            ),
            10 => format!(
                "device.attributes[{dom}].all(k, k.size() > {})",
                self.next() % 5
            ),
            11 => format!("{lit} == {lit}"),
            12 => format!("device.attributes[{dom}].{attr} + 1 == 4"),
            13 => format!("isQuantity({q})"),
            14 => format!("device.attributes[{dom}].{attr}"),
            _ => format!(
                "device.allowMultipleAllocations == {}",
                self.pick(&["true", "false", "0"])
            ),
        }
    }
    fn expr(&mut self, depth: u32) -> String {
        if depth == 0 || self.next().is_multiple_of(3) {
            return self.atom();
        }
        match self.next() % 4 {
            0 => format!("({} && {})", self.expr(depth - 1), self.expr(depth - 1)),
            1 => format!("({} || {})", self.expr(depth - 1), self.expr(depth - 1)),
            2 => format!("!({})", self.expr(depth - 1)),
            _ => format!(
                "({} ? {} : {})",
                self.expr(depth - 1),
                self.expr(depth - 1),
                self.expr(depth - 1)
            ),
        }
    }
}

/// The non-blank, non-comment lines of corpus file `tests/cel/<file>`. A missing, unreadable
/// or empty file fails the test: a corpus that silently shrinks proves nothing.
fn corpus_lines(file: &str) -> Vec<String> {
    corpus_lines_at(&repo_root().join("tests/cel").join(file))
}

/// The cases of a corpus file: its lines but blank ones and `#` comments; panics when the file
/// is missing or holds no case.
fn corpus_lines_at(path: &std::path::Path) -> Vec<String> {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("corpus file {}: {e}", path.display()));
    let lines: Vec<String> = text
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect();
    assert!(
        !lines.is_empty(),
        "corpus file {} has no cases",
        path.display()
    );
    lines
}

#[test]
#[should_panic(expected = "no-such-corpus.jsonl")]
fn a_missing_corpus_file_fails_the_conformance_test_instead_of_shrinking_it() {
    corpus_lines("no-such-corpus.jsonl");
}

#[test]
#[should_panic(expected = "has no cases")]
fn an_empty_corpus_file_fails_the_conformance_test_instead_of_shrinking_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("rules.jsonl");
    std::fs::write(&path, "# only a comment\n\n").expect("write");
    corpus_lines_at(&path);
}

/// The corpus, and how many of its first cases form the benchmark corpus.
fn corpus() -> (Vec<String>, usize) {
    let devices: Vec<serde_json::Value> = corpus_lines("devices.jsonl")
        .iter()
        .map(|l| serde_json::from_str(l).expect("device json"))
        .collect();
    assert!(
        devices.len() >= 2,
        "tests/cel/devices.jsonl needs two devices"
    );
    let expressions = corpus_lines("expressions.txt");
    let mut cases = Vec::new();
    let case = |e: &str, d: &serde_json::Value, env: Option<&str>, list_attrs: Option<bool>| {
        let mut c = serde_json::json!({"expression": e, "device": d});
        if let Some(env) = env {
            c["environment"] = env.into();
        }
        if let Some(l) = list_attrs {
            c["features"] = serde_json::json!({"listTypeAttributes": l});
        }
        c.to_string()
    };
    for e in &expressions {
        for d in &devices {
            cases.push(case(e, d, None, None));
        }
        cases.push(case(e, &devices[0], Some("new"), None));
        cases.push(case(e, &devices[1], None, Some(true)));
    }
    let mut g = Gen(0x005e_edd4_ac31);
    for i in 0..600 {
        let e = g.expr(3);
        cases.push(case(&e, &devices[i % devices.len()], None, None));
    }
    // The benchmark corpus stops here: the explicit cases include near-limit loops that take
    // upstream seconds each.
    let bench = cases.len();
    for file in ["cases.jsonl", "rules.jsonl"] {
        cases.extend(corpus_lines(file));
    }
    (cases, bench)
}

#[test]
fn dra_cel_agrees_with_upstream_on_every_corpus_case() {
    let (cases, bench) = corpus();
    assert!(cases.len() >= 1000, "corpus has only {} cases", cases.len());
    let dir = tempfile_dir();
    let input = dir.join("corpus.jsonl");
    std::fs::write(&input, cases.join("\n") + "\n").expect("write corpus");
    std::fs::write(dir.join("bench.jsonl"), cases[..bench].join("\n") + "\n")
        .expect("write benchmark corpus");
    let out = Command::new(oracle())
        .arg(&input)
        .output()
        .expect("run oracle");
    assert!(
        out.status.success(),
        "oracle failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let upstream: Vec<dractl::Outcome> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("oracle output"))
        .collect();
    assert_eq!(upstream.len(), cases.len());
    let mut disagreements = Vec::new();
    for (case, up) in cases.iter().zip(&upstream) {
        let ours = dractl::evaluate_line(case);
        if ours.class() != up.class() {
            disagreements.push(format!(
                "{case}\n  upstream: {}\n  dra-cel:  {}",
                serde_json::to_string(up).unwrap_or_default(),
                serde_json::to_string(&ours).unwrap_or_default()
            ));
        }
    }
    let agree = cases.len() - disagreements.len();
    println!("conformance: {agree}/{} cases agree", cases.len());
    let (mut est_n, mut est_bad, mut cost_n, mut cost_bad) = (0, Vec::new(), 0, Vec::new());
    for (case, up) in cases.iter().zip(&upstream) {
        let ours = dractl::evaluate_line(case);
        if let (Some(u), Some(o)) = (up.estimated_cost, ours.estimated_cost) {
            est_n += 1;
            if u != o {
                est_bad.push(format!("{case}\n  estimate upstream {u} dra-cel {o}"));
            }
        }
        // Upstream iterates Go maps in random order: the runtime cost of a comprehension over a
        // device map that stops early is not deterministic there.
        if let (Some(u), Some(o)) = (up.cost, ours.cost)
            && !iterates_a_device_map(case)
        {
            cost_n += 1;
            if u != o {
                cost_bad.push(format!("{case}\n  cost upstream {u} dra-cel {o}"));
            }
        }
    }
    println!(
        "estimated cost: {}/{est_n} equal; runtime cost: {}/{cost_n} equal",
        est_n - est_bad.len(),
        cost_n - cost_bad.len()
    );
    assert!(
        est_bad.is_empty() && cost_bad.is_empty(),
        "cost figures differ:\n{}",
        est_bad
            .iter()
            .chain(&cost_bad)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        disagreements.is_empty(),
        "{} of {} cases disagree:\n{}",
        disagreements.len(),
        cases.len(),
        disagreements.join("\n")
    );
}

fn iterates_a_device_map(case: &str) -> bool {
    (case.contains("device.attributes") || case.contains("device.capacity"))
        && [".all(", ".exists(", ".exists_one(", ".existsOne("]
            .iter()
            .any(|m| case.contains(m))
}

fn tempfile_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("dra-cel-conformance-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}
