//! Compiles each stand-in in `src/<tool>.rs` ([`TOOLS`]) as its own statically linked
//! program (std only), so it runs in the plugin's process tree, in a chroot into a fake driver
//! root, and in a busybox container alike. `rustc` is the compiler cargo runs this build with.

use std::path::PathBuf;
use std::process::Command;

const TOOLS: [&str; 3] = ["nvidia-cuda-mps-control", "nvidia-imex", "nvidia-imex-ctl"];

fn main() {
    for tool in TOOLS {
        build(tool);
    }
}

fn build(tool: &str) {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let source = format!("src/{tool}.rs");
    println!("cargo::rerun-if-changed={source}");
    let status = Command::new(&rustc)
        .args([
            "--edition",
            "2024",
            "-O",
            "-C",
            "target-feature=+crt-static",
            "-o",
        ])
        .arg(out.join(tool))
        .arg(&source)
        .status()
        .unwrap_or_else(|e| panic!("running rustc for {source}: {e}"));
    assert!(status.success(), "rustc {source}: {status}");
}
