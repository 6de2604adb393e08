//! Compiles the kubelet protos in `proto/` with protox (pure Rust), so building needs no protoc.

use std::path::PathBuf;

const PROTOS: &[&str] = &[
    "k8s.io/kubelet/pkg/apis/dra/v1/api.proto",
    "k8s.io/kubelet/pkg/apis/dra/v1beta1/api.proto",
    "k8s.io/kubelet/pkg/apis/pluginregistration/v1/api.proto",
    "k8s.io/kubelet/pkg/apis/dra-health/v1alpha1/api.proto",
    "k8s.io/kubelet/pkg/apis/podresources/v1/api.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read at run time: a build script binary can be reused for another checkout of the crate.
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={}", root.join(proto).display());
    }
    let fds = protox::compile(PROTOS, [&root])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
