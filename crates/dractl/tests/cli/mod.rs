#![allow(dead_code)] // Each test binary uses part of it.

//! Running the `dractl` binary as a user does, for the CLI tests.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The README's cluster: a node and a claim in use, the DeviceClass, the fake DGX H100's slices.
pub fn cluster() -> Vec<PathBuf> {
    let r = repo();
    vec![
        r.join("examples/allocate/cluster.yaml"),
        r.join("deploy/deviceclasses/gpu.yaml"),
        r.join("crates/gpu-kubelet-plugin/tests/snapshots/dgx-h100.yaml"),
    ]
}

/// The README's `dractl allocate` example: [`cluster`] and the pod's claims.
pub fn allocate_example() -> Vec<PathBuf> {
    let mut files = cluster();
    files.push(repo().join("examples/allocate/pod-claims.yaml"));
    files
}

/// The YAML documents of `files`, in order, empty ones left out.
pub fn yaml_documents(files: &[PathBuf]) -> Vec<serde_json::Value> {
    files
        .iter()
        .flat_map(|f| {
            let text = std::fs::read_to_string(f).expect("read example");
            serde_yaml_ng::Deserializer::from_str(&text)
                .map(|d| <serde_json::Value as serde::Deserialize>::deserialize(d).expect("YAML"))
                .filter(|v| !v.is_null())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// `dractl <subcommand> -f FILE... <extra>`.
pub fn dractl(subcommand: &str, files: &[PathBuf], extra: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dractl"));
    cmd.arg(subcommand);
    for f in files {
        cmd.arg("-f").arg(f);
    }
    cmd.args(extra).output().expect("dractl runs")
}

/// Output bytes as text.
pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}
