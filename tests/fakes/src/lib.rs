//! Stand-ins for NVIDIA's tools, for tests on machines without a GPU: statically linked
//! programs built by this crate's build script (`build.rs`), found through the paths below.

use std::path::Path;

/// The stand-in for `nvidia-cuda-mps-control` (`src/nvidia-cuda-mps-control.rs` says what it
/// does): a static executable, runnable in any container or chroot.
pub fn mps_control() -> &'static Path {
    Path::new(concat!(env!("OUT_DIR"), "/nvidia-cuda-mps-control"))
}
