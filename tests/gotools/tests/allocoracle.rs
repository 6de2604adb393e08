//! The structured-allocator oracle (`cmd/allocoracle`, upstream's allocator as kube-scheduler
//! v1.36 runs it) builds and answers as the scheduler would on its own test inputs, so the
//! differential tests of issue 14's Rust allocator start from a working reference. Its Go unit
//! tests (`go test ./cmd/allocoracle/`) cover more cases; this checks the built binary end to end.

use std::path::PathBuf;
use std::process::Command;

use drust_gotools::{go_tool, gotools_dir};

fn testdata(name: &str) -> PathBuf {
    gotools_dir().join("cmd/allocoracle/testdata").join(name)
}

fn run(files: &[&str]) -> (i32, String, String) {
    let bin = go_tool("allocoracle").expect("allocoracle builds");
    let mut cmd = Command::new(bin);
    for f in files {
        cmd.arg("-f").arg(testdata(f));
    }
    let out = cmd.output().expect("allocoracle runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_allocator_oracle_allocates_like_the_scheduler_and_refuses_invalid_input() {
    let (code, stdout, stderr) = run(&["gpus.yaml", "claim-h100.yaml"]);
    assert_eq!(code, 0, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("one JSON object");
    let nodes = v["nodes"].as_array().expect("nodes");
    assert_eq!(nodes.len(), 2, "{stdout}");
    assert_eq!(nodes[0]["name"], "node-1");
    assert_eq!(nodes[0]["allocated"], true);
    assert_eq!(
        nodes[0]["claims"][0]["allocation"]["devices"]["results"][0]["device"], "gpu-1",
        "the selector picks the H100"
    );
    assert_eq!(nodes[1]["name"], "node-2");
    assert_eq!(nodes[1]["allocated"], false, "{stdout}");

    // An invalid ResourceSlice is refused as the API server would, naming file and document.
    let (code, _, stderr) = run(&["invalid-slice.yaml"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("invalid-slice.yaml") && stderr.contains("document 0"),
        "{stderr}"
    );
}
