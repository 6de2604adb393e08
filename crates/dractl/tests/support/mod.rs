//! Test support for `dractl allocate`: the scenario generator, the upstream oracle in batch
//! mode, and the comparison and property checks.
#![allow(dead_code)]

pub mod check;
pub mod explained;
pub mod scenarios;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

/// The oracle binary (`tests/gotools/cmd/allocoracle`), built once per source hash.
pub fn oracle() -> PathBuf {
    drust_gotools::go_tool("allocoracle")
        .unwrap_or_else(|e| panic!("building the allocation oracle (Go is required): {e}"))
}

/// Where tests write their files: `<target dir>/dractl-allocate/`.
pub fn out_dir() -> PathBuf {
    // The test binary is <target>/<profile>/deps/<name>.
    let exe = std::env::current_exe().unwrap_or_default();
    let target = exe
        .ancestors()
        .nth(3)
        .map(Path::to_path_buf)
        .unwrap_or_else(std::env::temp_dir);
    let dir = target.join("dractl-allocate");
    std::fs::create_dir_all(&dir).expect("create the output directory");
    dir
}

/// One oracle answer: the report, or the reason the input was refused.
pub enum Answer {
    Report(Value),
    Invalid(String),
}

/// The scheduler's filter timeout (`DynamicResourcesArgs.filterTimeout`, 10 s by default).
pub const FILTER_TIMEOUT: Duration = Duration::from_secs(10);

/// Our allocator's options for comparisons: no deadline, so that no answer depends on how fast
/// this machine is at the moment (the deadline's own behaviour has its tests in
/// `dra-allocator/tests/interrupt.rs`).
pub fn untimed() -> dractl::allocate::Options {
    dractl::allocate::Options {
        timeout: Duration::ZERO,
        ..Default::default()
    }
}

/// Whether the oracle's report has a node that ran out of time (`timed out trying to allocate
/// devices`): no answer for that node, only a sign of how busy the machine was.
pub fn timed_out(report: &Value) -> bool {
    report["nodes"].as_array().into_iter().flatten().any(|n| {
        n["error"]
            .as_str()
            .is_some_and(|e| e.ends_with("timed out trying to allocate devices"))
    })
}

/// Runs the oracle on scenarios (id, objects) in one batch process, each node with `timeout`
/// (zero: none); answers in order.
pub fn oracle_batch(
    scenarios: &[(String, Vec<Value>)],
    jobs: usize,
    timeout: Duration,
) -> Vec<Answer> {
    let path = out_dir().join(format!("oracle-input-{}.jsonl", std::process::id()));
    let timeout = format!("{}ms", timeout.as_millis());
    {
        let mut f =
            std::io::BufWriter::new(std::fs::File::create(&path).expect("create batch file"));
        for (id, objects) in scenarios {
            let line = json!({"id": id, "objects": objects, "timeout": timeout});
            writeln!(f, "{line}").expect("write batch file");
        }
    }
    let out = Command::new(oracle())
        .arg("--batch")
        .arg(&path)
        .arg("--jobs")
        .arg(jobs.to_string())
        .stdin(Stdio::null())
        .output()
        .expect("run the oracle");
    let _ = std::fs::remove_file(&path);
    assert!(
        out.status.success(),
        "oracle failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let answers: Vec<Answer> = text
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).expect("oracle answers JSON");
            match v.get("output") {
                Some(o) => Answer::Report(o.clone()),
                None => Answer::Invalid(v["invalid"].as_str().unwrap_or("").to_owned()),
            }
        })
        .collect();
    assert_eq!(answers.len(), scenarios.len(), "one answer per scenario");
    answers
}

/// Our side: the objects read as `dractl allocate` reads them, then allocated ([`untimed`]).
pub fn ours(id: &str, objects: &[Value]) -> Result<Value, String> {
    ours_with(id, objects, &untimed())
}

/// [`ours`] with other options.
pub fn ours_with(
    id: &str,
    objects: &[Value],
    options: &dractl::allocate::Options,
) -> Result<Value, String> {
    let report =
        dractl::allocate::allocate(read(id, objects)?, options).map_err(|e| e.to_string())?;
    serde_json::to_value(&report).map_err(|e| e.to_string())
}

/// A scenario's objects read and validated as `dractl allocate` reads files.
pub fn read(id: &str, objects: &[Value]) -> Result<dractl::objects::Inputs, String> {
    let mut reader = dractl::objects::Reader::new();
    for (i, o) in objects.iter().enumerate() {
        let location = dractl::objects::Location {
            file: id.to_owned(),
            document: i,
            item: None,
        };
        reader
            .read_value(location, o.clone())
            .map_err(|e| e.to_string())?;
    }
    Ok(reader.finish())
}
