//! A fake NVIDIA driver root: the files a CUDA container needs, laid out as a driver installation
//! puts them, with marker contents instead of code, and a recording stand-in for
//! `nvidia-cdi-hook`.
//!
//! What is in it (for driver version `V`):
//! - `usr/lib/x86_64-linux-gnu/`: [`LIBRARIES`]`.so.V` (regular files holding
//!   `fake <name> V`), the installer's symlinks `libcuda.so.1` and `libcuda.so`, and a stale
//!   `libcuda.so.535.54.03` of an older driver, which must not reach containers;
//! - `usr/bin/`: `nvidia-smi` (a shell script printing `fake nvidia-smi V`), the MPS tools and
//!   `nvidia-debugdump`, `nvidia-persistenced`, and the IMEX stand-ins `nvidia-imex` and
//!   `nvidia-imex-ctl` (static programs from `drust-fakes`, which say where they differ from
//!   NVIDIA's);
//! - `lib/firmware/nvidia/V/gsp_ga10x.bin` and `gsp_tu10x.bin`;
//! - `run/nvidia-persistenced/socket`: a Unix socket;
//! - `usr/bin/nvidia-cdi-hook`: [`HOOK_SCRIPT`], which appends each call's arguments to
//!   `<root>/hook.log` and does in the container's root what the real hook's subcommand
//!   would make visible: `create-symlinks --link T::L` creates the symlink `L -> T`,
//!   `update-ldcache --folder D...` writes the folders to `/etc/drust-fake-ldcache` (the real
//!   one runs `ldconfig` there).

use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};

/// Library names (without `.so.<version>`) the fake driver installs.
pub const LIBRARIES: [&str; 6] = [
    "libcuda",
    "libnvidia-ml",
    "libnvidia-ptxjitcompiler",
    "libnvidia-nvvm",
    "libcudadebugger",
    "libnvidia-gpucomp",
];

/// Binaries the fake driver installs in `usr/bin`.
pub const BINARIES: [&str; 5] = [
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
];

/// The library directory of the fake driver.
pub const LIB_DIR: &str = "usr/lib/x86_64-linux-gnu";

/// The stand-in for `nvidia-cdi-hook`. The runtime runs it with the container's state (JSON,
/// one line, with `"bundle":"<dir>"`) on stdin; containerd's bundles keep the root at
/// `<bundle>/rootfs`.
pub const HOOK_SCRIPT: &str = r#"#!/bin/sh
log="$(dirname "$0")/../../hook.log"
echo "$*" >> "$log"
bundle=$(sed -n 's/.*"bundle":"\([^"]*\)".*/\1/p')
rootfs="$bundle/rootfs"
[ -d "$rootfs" ] || { echo "no rootfs at $rootfs" >> "$log"; exit 1; }
case "$1" in
create-symlinks)
  shift
  while [ $# -gt 0 ]; do
    if [ "$1" = --link ]; then
      target="${2%%::*}"; link="${2#*::}"
      mkdir -p "$rootfs$(dirname "$link")" && ln -sfn "$target" "$rootfs$link" || exit 1
      shift
    fi
    shift
  done ;;
update-ldcache)
  shift
  mkdir -p "$rootfs/etc"
  : > "$rootfs/etc/drust-fake-ldcache"
  while [ $# -gt 0 ]; do
    [ "$1" = --folder ] && { echo "$2" >> "$rootfs/etc/drust-fake-ldcache"; shift; }
    shift
  done ;;
esac
"#;

/// A fake driver root on disk.
#[derive(Debug, Clone)]
pub struct FakeDriverRoot {
    /// The root (`--driver-root`).
    pub root: PathBuf,
    /// The driver version its files carry.
    pub version: String,
}

impl FakeDriverRoot {
    /// Lays out the fake driver of `version` under `root` (created).
    ///
    /// # Errors
    /// An I/O error naming nothing more: the caller names the root.
    pub fn create(root: &Path, version: &str) -> std::io::Result<Self> {
        let lib = root.join(LIB_DIR);
        std::fs::create_dir_all(&lib)?;
        for name in LIBRARIES {
            std::fs::write(
                lib.join(format!("{name}.so.{version}")),
                format!("fake {name} {version}\n"),
            )?;
        }
        std::fs::write(
            lib.join("libcuda.so.535.54.03"),
            "stale libcuda 535.54.03\n",
        )?;
        symlink(format!("libcuda.so.{version}"), lib.join("libcuda.so.1"))?;
        symlink("libcuda.so.1", lib.join("libcuda.so"))?;
        let bin = root.join("usr/bin");
        std::fs::create_dir_all(&bin)?;
        for name in BINARIES {
            executable(
                &bin.join(name),
                &format!("#!/bin/sh\necho \"fake {name} {version}\"\n"),
            )?;
        }
        executable(&bin.join("nvidia-cdi-hook"), HOOK_SCRIPT)?;
        for (name, stand_in) in [
            ("nvidia-imex", drust_fakes::imex()),
            ("nvidia-imex-ctl", drust_fakes::imex_ctl()),
        ] {
            std::fs::copy(stand_in, bin.join(name))?;
            std::fs::set_permissions(bin.join(name), std::fs::Permissions::from_mode(0o755))?;
        }
        let firmware = root.join("lib/firmware/nvidia").join(version);
        std::fs::create_dir_all(&firmware)?;
        for name in ["gsp_ga10x.bin", "gsp_tu10x.bin"] {
            std::fs::write(firmware.join(name), format!("fake firmware {name}\n"))?;
        }
        let run = root.join("run/nvidia-persistenced");
        std::fs::create_dir_all(&run)?;
        // The socket file stays after the listener is dropped: a bind mount needs only it.
        drop(std::os::unix::net::UnixListener::bind(run.join("socket"))?);
        Ok(Self {
            root: root.to_owned(),
            version: version.to_owned(),
        })
    }

    /// The hook stand-in's record: one line of arguments per call.
    pub fn hook_log(&self) -> PathBuf {
        self.root.join("hook.log")
    }
}

fn executable(path: &Path, text: &str) -> std::io::Result<()> {
    std::fs::write(path, text)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
}
