//! The real `gpu-kubelet-plugin` binary, for tests that must kill and restart the process.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, PoisonError};

use crate::manifests::repo_root;

/// Builds a Go test tool once per hash of its sources (the harness re-exports it).
pub use drust_gotools::go_tool;

/// Builds (if needed) and locates `gpu-kubelet-plugin` with the same cargo that runs the tests,
/// in the release profile when the caller is a release build (benchmarks), reading the
/// executable's path from cargo's JSON messages. Its CDI hook, `drust-cdi-hook`, is built beside
/// it, where the plugin looks for it by default.
///
/// # Errors
/// A description of the failed build.
pub fn plugin_binary() -> Result<PathBuf, String> {
    workspace_binary(
        "gpu-kubelet-plugin",
        &["gpu-kubelet-plugin", "drust-cdi-hook"],
        "gpu-kubelet-plugin",
    )
}

/// Builds (if needed) and locates the example driver on `dra-plugin`,
/// `examples/dra-example-driver`, as [`plugin_binary`] does the GPU plugin.
///
/// # Errors
/// A description of the failed build.
pub fn example_driver_binary() -> Result<PathBuf, String> {
    workspace_binary(
        "dra-example-driver",
        &["dra-example-driver"],
        "dra-example-driver",
    )
}

/// Builds (if needed) and locates `dractl`, as [`plugin_binary`] does the GPU plugin.
///
/// # Errors
/// A description of the failed build.
pub fn dractl_binary() -> Result<PathBuf, String> {
    workspace_binary("dractl", &["dractl"], "dractl")
}

/// Builds (if needed) and locates the ComputeDomain controller, `crates/compute-domain`, as
/// [`plugin_binary`] does the GPU plugin.
///
/// # Errors
/// A description of the failed build.
pub fn compute_domain_controller_binary() -> Result<PathBuf, String> {
    workspace_binary(
        "compute-domain",
        &["drust-compute-domain-controller"],
        "drust-compute-domain-controller",
    )
}

/// Builds `bins` of workspace package `package` with the cargo that runs the tests (release
/// when the caller is a release build) and returns the path of executable `want`: once per
/// process, since a test that starts many plugins (a cluster of paper nodes) would otherwise
/// run cargo, and wait for its build lock, once per plugin.
fn workspace_binary(package: &str, bins: &[&str], want: &str) -> Result<PathBuf, String> {
    static BUILT: Mutex<BTreeMap<String, PathBuf>> = Mutex::new(BTreeMap::new());
    // Held across the build: callers on other threads wait for it instead of starting their own.
    let mut built = BUILT.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(path) = built.get(want) {
        return Ok(path.clone());
    }
    let path = cargo_build(package, bins, want)?;
    built.insert(want.to_owned(), path.clone());
    Ok(path)
}

/// [`workspace_binary`]'s build.
fn cargo_build(package: &str, bins: &[&str], want: &str) -> Result<PathBuf, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "-p", package]);
    // What cargo set for the test binary running us (`CARGO_PKG_NAME=drust-e2e`, ...) must not
    // reach this cargo: build scripts that read such a variable (ring's reads CARGO_PKG_NAME and
    // CARGO_MANIFEST_DIR) are fingerprinted with cargo's own environment, so the dependency
    // chain up to the plugin was rebuilt here, and again by the next `cargo test`, every run.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name.starts_with("CARGO_PKG_")
            || [
                "CARGO_MANIFEST_DIR",
                "CARGO_MANIFEST_PATH",
                "CARGO_MANIFEST_LINKS",
                "CARGO_CRATE_NAME",
                "CARGO_BIN_NAME",
                "CARGO_PRIMARY_PACKAGE",
                "CARGO_TARGET_TMPDIR",
                "OUT_DIR",
            ]
            .contains(&name.as_ref())
        {
            cmd.env_remove(name.as_ref());
        }
    }
    for bin in bins {
        cmd.args(["--bin", bin]);
    }
    cmd.arg("--message-format=json-render-diagnostics");
    if !cfg!(debug_assertions) {
        cmd.arg("--release");
    }
    let out = cmd
        .current_dir(repo_root())
        .output()
        .map_err(|e| format!("running cargo build: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cargo build -p {package} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == want)
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .ok_or_else(|| format!("cargo reported no {want} executable"))
}
