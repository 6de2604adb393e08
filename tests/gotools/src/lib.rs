//! Rust handles on the Go test tooling beside this crate (`tests/gotools/cmd/*`): building a
//! tool once per hash of its sources, and [`KubeletPeer`], the kubelet's side of a DRA plugin's
//! sockets made of the kubelet's own code.
//!
//! The Go programs call upstream libraries (the kubelet, CEL, the DRA helpers) so tests can
//! compare against or talk to the real peer; nothing here ships.

mod kubelet_peer;

use std::path::{Path, PathBuf};
use std::process::Command;

pub use kubelet_peer::{
    DRA_V1, DRA_V1BETA1, KubeletPeer, PeerError, PeerEvent, Registration, Service,
};

/// This directory: the Go module `drust.dev/gotools`.
pub fn gotools_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_owned()
}

/// Where built tools are cached: `$DRUST_CACHE_DIR`, else `~/.cache/drust`.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("DRUST_CACHE_DIR").map_or_else(
        || {
            PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/tmp".into()))
                .join(".cache/drust")
        },
        PathBuf::from,
    )
}

/// Builds the Go tool `tests/gotools/cmd/<name>` once per hash of its sources (every file in
/// its directory) and the module's `go.mod`/`go.sum`, into [`cache_dir`]`/<name>/<hash>/<name>`.
/// A cold build of a tool that imports the kubelet takes about 3 minutes on 2 cores; the Go
/// build cache it shares with the control plane's build makes later ones quick.
///
/// # Errors
/// A description of the failed read or build.
pub fn go_tool(name: &str) -> Result<PathBuf, String> {
    let gotools = gotools_dir();
    let module = [gotools.join("go.mod"), gotools.join("go.sum")];
    build(
        &gotools,
        &format!("cmd/{name}"),
        &module,
        name,
        name,
        &[],
        false,
    )
}

/// Builds the Go module `tests/gotools/<name>` (a module of its own, so its dependencies do not
/// change the control plane's) as a C shared library (`-buildmode=c-shared`, cgo on) named
/// `file`, cached like [`go_tool`]: `tests/gotools/mocknvml` becomes a `libnvidia-ml.so.1`.
///
/// # Errors
/// A description of the failed read or build.
pub fn go_library(name: &str, file: &str) -> Result<PathBuf, String> {
    let dir = gotools_dir().join(name);
    build(&dir, ".", &[], name, file, &["-buildmode=c-shared"], true)
}

/// Builds the Go module `tests/gotools/<name>` (a module of its own, so its dependencies do not
/// change the control plane's) as an executable, cached like [`go_tool`]:
/// `tests/gotools/promcheck` (Prometheus's own rule and PromQL parsers).
///
/// # Errors
/// A description of the failed read or build.
pub fn go_module_tool(name: &str) -> Result<PathBuf, String> {
    let dir = gotools_dir().join(name);
    build(&dir, ".", &[], name, name, &[], false)
}

/// `go build` of package `package` (relative to `module`) into the cache, keyed by the hash of
/// the package's files and `extra` files.
fn build(
    module: &Path,
    package: &str,
    extra: &[PathBuf],
    name: &str,
    file: &str,
    flags: &[&str],
    cgo: bool,
) -> Result<PathBuf, String> {
    use sha2::{Digest, Sha256};
    let gotools = module;
    let cmd = module.join(package);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&cmd)
        .map_err(|e| format!("{}: {e}", cmd.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files.extend_from_slice(extra);
    let mut h = Sha256::new();
    for f in &files {
        h.update(
            f.strip_prefix(gotools)
                .unwrap_or(f)
                .to_string_lossy()
                .as_bytes(),
        );
        h.update(std::fs::read(f).map_err(|e| format!("reading {}: {e}", f.display()))?);
    }
    let hash: String = h.finalize()[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let bin = cache_dir().join(name).join(hash).join(file);
    // Tests of one binary run on threads: build once, the others wait and reuse it.
    static BUILDING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = BUILDING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if bin.exists() {
        return Ok(bin);
    }
    if let Some(dir) = bin.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let tmp = bin.with_extension(format!("tmp{}", std::process::id()));
    let status = Command::new("go")
        .args(["build", "-trimpath"])
        .args(flags)
        .arg("-o")
        .arg(&tmp)
        .arg(format!("./{package}"))
        .env("CGO_ENABLED", if cgo { "1" } else { "0" })
        .current_dir(gotools)
        .status()
        .map_err(|e| format!("running go build: {e}"))?;
    if !status.success() {
        return Err(format!(
            "go build ./{package} in {}: {status}",
            gotools.display()
        ));
    }
    std::fs::rename(&tmp, &bin).map_err(|e| format!("{}: {e}", bin.display()))?;
    Ok(bin)
}
