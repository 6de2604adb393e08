//! The NVIDIA driver's user-space files a CUDA container needs, found under the driver root, and
//! the CDI edits that give them to every container of a claim.
//!
//! With CDI there is no NVIDIA container runtime in the path (our specs set
//! `NVIDIA_VISIBLE_DEVICES=void` so that one, if installed, injects nothing), so the claim's
//! spec must carry what NVIDIA's container toolkit would otherwise mount. We look for the same
//! set its CDI generator collects (`pkg/nvcdi/driver-nvml.go` and `internal/discover` in
//! NVIDIA/nvidia-container-toolkit), with our own lookup:
//! - **libraries**: every regular file named `*.so.<driver version>` in the library
//!   directories ([`LIBRARY_DIRS`], and their `vdpau/`), plus the legacy `libnvidia-nvvm70.so.*`;
//!   symlinks are left to the hooks (`ldconfig` recreates the soname links);
//! - **binaries** ([`BINARIES`]): `nvidia-smi` and the rest (not the MPS tools), in [`BINARY_DIRS`];
//! - **GSP firmware**: `lib/firmware/nvidia/<driver version>/gsp*.bin` (and `updates/`);
//! - **IPC sockets** ([`SOCKETS`], mounted writable): the persistence daemon's and the fabric
//!   manager's, where present. The MPS pipe directory is not among them: MPS daemons are per
//!   claim here ([`crate::mps`]);
//! - **hooks**, only when `nvidia-cdi-hook` exists: `create-symlinks` for `libcuda.so` (what
//!   build tools and some frameworks open), `update-ldcache` on the library directories (so the
//!   dynamic linker finds the driver in any image), as the toolkit's spec has them.
//!
//! Paths: the plugin reads the driver under `root` (in the chart, the host's driver root mounted
//! at `/driver-root`), the spec names the same files under `host_root` (the host path the
//! container runtime resolves), and the container sees each at its path relative to the root
//! (`/usr/lib/x86_64-linux-gnu/libcuda.so.570.124.06`), where a CUDA image expects it.

use std::collections::BTreeSet;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::cdi::{ContainerEdits, Hook, Mount};

/// Library directories searched under the driver root, in order (the first path of a file
/// wins when several name it, e.g. `/lib` linked to `/usr/lib`).
/// `nvidia/current` is where Debian's driver packages put them.
pub const LIBRARY_DIRS: [&str; 12] = [
    "usr/lib64",
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib/x86_64-linux-gnu/nvidia/current",
    "usr/lib/aarch64-linux-gnu/nvidia/current",
    "lib64",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "lib/x86_64-linux-gnu/nvidia/current",
    "lib/aarch64-linux-gnu/nvidia/current",
    "usr/lib",
    "lib",
];

/// Executable directories searched under the driver root, in order.
pub const BINARY_DIRS: [&str; 6] = [
    "usr/local/sbin",
    "usr/local/bin",
    "usr/sbin",
    "usr/bin",
    "sbin",
    "bin",
];

/// The driver's binaries a container gets, where present. Not the MPS tools
/// (`nvidia-cuda-mps-control`, `nvidia-cuda-mps-server`): an MPS client needs neither (the daemon
/// starts its servers), and the control tool is how a tenant would send `quit` or new limits to
/// a daemon that serves other claims too; the daemons run them from the driver root
/// ([`crate::mps`]).
pub const BINARIES: [&str; 5] = [
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-imex",
    "nvidia-imex-ctl",
];

/// IPC sockets a container gets, where present (first found of each group).
/// `/run` first, as the toolkit looks (`internal/discover/ipc.go`).
pub const SOCKETS: [[&str; 2]; 2] = [
    [
        "run/nvidia-persistenced/socket",
        "var/run/nvidia-persistenced/socket",
    ],
    [
        "run/nvidia-fabricmanager/socket",
        "var/run/nvidia-fabricmanager/socket",
    ],
];

/// Firmware directories searched for `nvidia/<version>/gsp*.bin`.
const FIRMWARE_DIRS: [&str; 2] = ["lib/firmware", "lib/firmware/updates"];

/// Where `nvidia-cdi-hook` is looked for under the driver root: the toolkit's package, then
/// the GPU Operator's toolkit directory.
pub const HOOK_PATHS: [&str; 2] = [
    "usr/bin/nvidia-cdi-hook",
    "usr/local/nvidia/toolkit/nvidia-cdi-hook",
];

/// Mount options of driver files: read-only, no set-uid, no devices; `rbind`/`rprivate` as the
/// toolkit's specs have them.
const FILE_OPTIONS: [&str; 5] = ["ro", "nosuid", "nodev", "rbind", "rprivate"];

/// Mount options of IPC sockets, as the toolkit's: not read-only, not executable.
const SOCKET_OPTIONS: [&str; 5] = ["nosuid", "nodev", "rbind", "rprivate", "noexec"];

pub use crate::config::DriverRoot;

/// The driver files found, as paths relative to the driver root (`usr/bin/nvidia-smi`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DriverFiles {
    /// The driver version the libraries were matched against (NVML's, e.g. `570.124.06`).
    pub version: String,
    /// `*.so.<version>` libraries and `libnvidia-nvvm70.so.*`.
    pub libraries: Vec<PathBuf>,
    /// [`BINARIES`] found.
    pub binaries: Vec<PathBuf>,
    /// GSP firmware files.
    pub firmware: Vec<PathBuf>,
    /// [`SOCKETS`] found.
    pub sockets: Vec<PathBuf>,
    /// `nvidia-cdi-hook` as a host path, if there is one.
    pub hook: Option<PathBuf>,
    /// The driver root on the host.
    pub host_root: PathBuf,
}

impl DriverRoot {
    /// Looks for the driver files of `version` under the root. Blocking (directory reads): call
    /// it off the async workers. Unreadable directories are skipped; finding nothing is not an
    /// error here (the caller says so, see [`DriverFiles::missing_libcuda`]).
    pub fn discover(&self, version: &str) -> DriverFiles {
        let mut seen = BTreeSet::new();
        let mut libraries = Vec::new();
        let suffix = format!(".so.{version}");
        for dir in LIBRARY_DIRS {
            for dir in [PathBuf::from(dir), Path::new(dir).join("vdpau")] {
                for (name, rel) in self.list(&dir) {
                    let wanted = (!version.is_empty() && name.ends_with(&suffix))
                        || name.starts_with("libnvidia-nvvm70.so.");
                    if wanted && self.is_new_regular_file(&rel, &mut seen) {
                        libraries.push(rel);
                    }
                }
            }
        }
        let mut binaries = Vec::new();
        for name in BINARIES {
            if let Some(rel) = BINARY_DIRS
                .iter()
                .map(|d| Path::new(d).join(name))
                .find(|rel| std::fs::metadata(self.root.join(rel)).is_ok_and(|m| m.is_file()))
            {
                binaries.push(rel);
            }
        }
        let mut firmware = Vec::new();
        if !version.is_empty() {
            for dir in FIRMWARE_DIRS {
                let dir = Path::new(dir).join("nvidia").join(version);
                for (name, rel) in self.list(&dir) {
                    if name.starts_with("gsp")
                        && name.ends_with(".bin")
                        && self.is_new_regular_file(&rel, &mut seen)
                    {
                        firmware.push(rel);
                    }
                }
            }
        }
        let sockets = SOCKETS
            .iter()
            .filter_map(|group| {
                group.iter().map(PathBuf::from).find(|rel| {
                    std::fs::metadata(self.root.join(rel)).is_ok_and(|m| m.file_type().is_socket())
                })
            })
            .collect();
        let hook = self.hook.clone().or_else(|| {
            HOOK_PATHS
                .iter()
                .find(|p| {
                    std::fs::metadata(self.root.join(p))
                        .is_ok_and(|m| m.is_file() && m.mode() & 0o111 != 0)
                })
                .map(|p| self.host_root.join(p))
        });
        DriverFiles {
            version: version.to_owned(),
            libraries,
            binaries,
            firmware,
            sockets,
            hook,
            host_root: self.host_root.clone(),
        }
    }

    /// `(file name, path relative to the root)` of the entries of `dir` (relative), sorted.
    fn list(&self, dir: &Path) -> Vec<(String, PathBuf)> {
        let Ok(entries) = std::fs::read_dir(self.root.join(dir)) else {
            return Vec::new();
        };
        let mut out: Vec<(String, PathBuf)> = entries
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_str()?.to_owned();
                let rel = dir.join(&name);
                Some((name, rel))
            })
            .collect();
        out.sort();
        out
    }

    /// Whether `rel` is a regular file itself (not a symlink) not seen before under another
    /// path (by device and inode), recording it.
    fn is_new_regular_file(&self, rel: &Path, seen: &mut BTreeSet<(u64, u64)>) -> bool {
        match std::fs::symlink_metadata(self.root.join(rel)) {
            Ok(m) if m.file_type().is_file() => seen.insert((m.dev(), m.ino())),
            _ => false,
        }
    }
}

impl DriverFiles {
    /// Whether `libcuda.so.<version>` is missing: CUDA containers of this node will fail to
    /// start their CUDA context, so the plugin warns at start.
    pub fn missing_libcuda(&self) -> bool {
        let want = format!("libcuda.so.{}", self.version);
        !self
            .libraries
            .iter()
            .any(|l| l.file_name().is_some_and(|n| n == want.as_str()))
    }

    /// The directories (container paths) holding the libraries, in first-seen order.
    pub fn library_dirs(&self) -> Vec<String> {
        let mut dirs: Vec<String> = Vec::new();
        for l in &self.libraries {
            let dir = container_path(l.parent().unwrap_or(Path::new("")));
            if !dirs.contains(&dir) {
                dirs.push(dir);
            }
        }
        dirs
    }

    /// The spec-level edits for every container of a claim: a read-only bind mount of each
    /// file at its path relative to the root, and with a hook binary, the `create-symlinks`
    /// and `update-ldcache` hooks at `createContainer`.
    pub fn container_edits(&self) -> ContainerEdits {
        let mounts = self
            .libraries
            .iter()
            .chain(&self.binaries)
            .chain(&self.firmware)
            .map(|rel| self.mount(rel, &FILE_OPTIONS))
            .chain(
                self.sockets
                    .iter()
                    .map(|rel| self.mount(rel, &SOCKET_OPTIONS)),
            )
            .collect();
        let mut hooks = Vec::new();
        if let Some(hook) = &self.hook {
            let path = hook.display().to_string();
            let hook = |args: Vec<String>| Hook {
                hook_name: "createContainer".into(),
                path: path.clone(),
                args: std::iter::once("nvidia-cdi-hook".to_owned())
                    .chain(args)
                    .collect(),
                env: Vec::new(),
                timeout: None,
            };
            if let Some(libcuda) = self.libraries.iter().find(|l| {
                l.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("libcuda.so."))
            }) {
                let link = container_path(&libcuda.with_file_name("libcuda.so"));
                hooks.push(hook(vec![
                    "create-symlinks".into(),
                    "--link".into(),
                    format!("libcuda.so.1::{link}"),
                ]));
            }
            let dirs = self.library_dirs();
            if !dirs.is_empty() {
                let mut args = vec!["update-ldcache".to_owned()];
                for d in dirs {
                    args.push("--folder".into());
                    args.push(d);
                }
                hooks.push(hook(args));
            }
        }
        ContainerEdits {
            mounts,
            hooks,
            ..ContainerEdits::default()
        }
    }

    fn mount(&self, rel: &Path, options: &[&str]) -> Mount {
        Mount {
            host_path: self.host_root.join(rel).display().to_string(),
            container_path: container_path(rel),
            options: options.iter().map(|o| (*o).to_owned()).collect(),
        }
    }
}

/// `/` + `rel`.
/// The first `name` (a file or a link to one) in [`LIBRARY_DIRS`] under `root`, as a full path.
///
/// The plugin loads NVML from this path when `--nvml-library` is not given, rather than putting
/// the driver root's library directories on `LD_LIBRARY_PATH`: those hold the host's own
/// `libc.so.6` too, which the dynamic loader would then prefer over the image's and mismatch
/// the image's `ld.so`.
pub fn find_library(root: &Path, name: &str) -> Option<PathBuf> {
    LIBRARY_DIRS
        .iter()
        .map(|dir| root.join(dir).join(name))
        .find(|p| p.is_file())
}

fn container_path(rel: &Path) -> String {
    Path::new("/").join(rel).display().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    const VERSION: &str = "570.124.06";

    fn root() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path();
        let lib = p.join("usr/lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&lib).unwrap();
        for name in [
            format!("libcuda.so.{VERSION}"),
            format!("libnvidia-ml.so.{VERSION}"),
            "libcuda.so.535.54.03".to_owned(),
            "libnvidia-nvvm70.so.4".to_owned(),
            "libc.so.6".to_owned(),
        ] {
            std::fs::write(lib.join(name), b"lib").unwrap();
        }
        std::os::unix::fs::symlink(format!("libcuda.so.{VERSION}"), lib.join("libcuda.so.1"))
            .unwrap();
        // `lib` is `usr/lib` on merged-/usr systems: the same files twice.
        std::os::unix::fs::symlink("usr/lib", p.join("lib")).unwrap();
        std::fs::create_dir_all(p.join("usr/bin")).unwrap();
        std::fs::write(p.join("usr/bin/nvidia-smi"), b"#!/bin/sh\n").unwrap();
        let fw = p.join("lib/firmware/nvidia").join(VERSION);
        std::fs::create_dir_all(&fw).unwrap();
        std::fs::write(fw.join("gsp_ga10x.bin"), b"fw").unwrap();
        std::fs::write(fw.join("README"), b"not firmware").unwrap();
        dir
    }

    #[test]
    fn finds_nvml_by_its_soname_in_the_library_dirs() {
        let dir = root();
        assert_eq!(
            find_library(dir.path(), "libcuda.so.1"),
            Some(dir.path().join("usr/lib/x86_64-linux-gnu/libcuda.so.1"))
        );
        assert_eq!(find_library(dir.path(), "libnvidia-ml.so.1"), None);
    }

    #[test]
    fn finds_the_versioned_libraries_binaries_and_firmware_once_each() {
        let dir = root();
        let files = DriverRoot {
            root: dir.path().to_owned(),
            host_root: "/run/nvidia/driver".into(),
            hook: None,
        }
        .discover(VERSION);
        let libs: Vec<String> = files
            .libraries
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        assert_eq!(
            libs,
            [
                format!("usr/lib/x86_64-linux-gnu/libcuda.so.{VERSION}"),
                format!("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.{VERSION}"),
                "usr/lib/x86_64-linux-gnu/libnvidia-nvvm70.so.4".to_owned(),
            ]
        );
        assert_eq!(files.binaries, [PathBuf::from("usr/bin/nvidia-smi")]);
        assert_eq!(
            files.firmware,
            [Path::new("lib/firmware/nvidia")
                .join(VERSION)
                .join("gsp_ga10x.bin")]
        );
        assert!(!files.missing_libcuda());
        assert!(files.hook.is_none());
        let edits = files.container_edits();
        assert!(edits.hooks.is_empty(), "no hook binary, no hooks");
        assert_eq!(
            edits.mounts[0],
            Mount {
                host_path: format!(
                    "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.{VERSION}"
                ),
                container_path: format!("/usr/lib/x86_64-linux-gnu/libcuda.so.{VERSION}"),
                options: FILE_OPTIONS.iter().map(|o| (*o).to_owned()).collect(),
            }
        );
    }

    #[test]
    fn with_a_hook_binary_the_spec_links_libcuda_and_updates_the_linker_cache() {
        let dir = root();
        std::fs::create_dir_all(dir.path().join("usr/bin")).unwrap();
        let hook = dir.path().join("usr/bin/nvidia-cdi-hook");
        std::fs::write(&hook, b"#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let files = DriverRoot {
            root: dir.path().to_owned(),
            host_root: "/".into(),
            hook: None,
        }
        .discover(VERSION);
        assert_eq!(files.hook, Some(PathBuf::from("/usr/bin/nvidia-cdi-hook")));
        let hooks = files.container_edits().hooks;
        let args: Vec<Vec<String>> = hooks.iter().map(|h| h.args.clone()).collect();
        assert_eq!(
            args,
            [
                vec![
                    "nvidia-cdi-hook",
                    "create-symlinks",
                    "--link",
                    "libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so"
                ],
                vec![
                    "nvidia-cdi-hook",
                    "update-ldcache",
                    "--folder",
                    "/usr/lib/x86_64-linux-gnu"
                ],
            ]
        );
        assert!(
            hooks
                .iter()
                .all(|h| h.hook_name == "createContainer" && h.path == "/usr/bin/nvidia-cdi-hook")
        );
    }

    #[test]
    fn an_empty_root_gives_no_edits_and_says_libcuda_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        let files = DriverRoot {
            root: dir.path().to_owned(),
            host_root: "/".into(),
            hook: None,
        }
        .discover(VERSION);
        assert!(files.missing_libcuda());
        assert_eq!(files.container_edits(), ContainerEdits::default());
    }
}
