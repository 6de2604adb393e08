//! Container images built locally, never pulled: OCI image archives (an `oci-layout`, an
//! `index.json` and blobs) with one uncompressed, deterministic layer, for `ctr images import`.
//!
//! The workload and sandbox images are Debian's static busybox (`busybox-static`,
//! `/bin/busybox`) with a few applet links; ../shared/docs/real-node.md has the facts that make
//! containerd accept such an archive (the `io.containerd.image.name` annotation with a fully
//! qualified name, the platform on the manifest descriptor, `rootfs.diff_ids` equal to the
//! uncompressed layer's digest).

use std::io;
use std::path::{Path, PathBuf};

use serde_json::json;
use sha2::{Digest, Sha256};

/// The workload image's name (import it, then use it with `imagePullPolicy: Never`).
pub const WORKLOAD_IMAGE: &str = "docker.io/library/drust-busybox:test";
/// The sandbox ("pause") image's name, pinned as containerd's sandbox image.
pub const SANDBOX_IMAGE: &str = "docker.io/library/drust-pause:test";
/// Debian's static busybox.
pub const BUSYBOX: &str = "/bin/busybox";

/// Applets linked in `/bin` of the busybox images.
const APPLETS: &[&str] = &[
    "sh", "ls", "cat", "echo", "env", "sleep", "test", "true", "false", "stat", "head", "grep",
    "dd", "wc", "sort", "mkdir", "printf", "readlink", "id", "uname", "sed", "tee",
];

/// One entry of a layer.
#[derive(Debug, Clone)]
pub enum Entry {
    /// A directory (mode 0755).
    Dir(String),
    /// A file with these bytes and mode.
    Bytes {
        /// Path in the image, without a leading `/`.
        path: String,
        /// Contents.
        data: Vec<u8>,
        /// Permission bits.
        mode: u32,
    },
    /// A file copied from the host.
    File {
        /// Path in the image, without a leading `/`.
        path: String,
        /// Path on the host.
        source: PathBuf,
        /// Permission bits.
        mode: u32,
    },
    /// A symbolic link.
    Symlink {
        /// Path in the image, without a leading `/`.
        path: String,
        /// Its target.
        target: String,
    },
}

/// What an image contains and runs.
#[derive(Debug, Clone)]
pub struct Image {
    /// Fully qualified name, e.g. `docker.io/library/x:tag`.
    pub name: String,
    /// `config.Entrypoint`.
    pub entrypoint: Vec<String>,
    /// `config.Cmd`.
    pub cmd: Vec<String>,
    /// `config.Env`.
    pub env: Vec<String>,
    /// The single layer's entries, in order (parents before children).
    pub entries: Vec<Entry>,
}

/// `Ok` when Debian's static busybox is installed.
fn need_busybox() -> io::Result<()> {
    if Path::new(BUSYBOX).exists() {
        return Ok(());
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!("{BUSYBOX} is missing: install Debian's busybox-static"),
    ))
}

/// The busybox root filesystem: `/bin/busybox`, its applet links, and the directories a
/// container runtime expects.
///
/// # Errors
/// When `/bin/busybox` is missing (install Debian's `busybox-static`).
pub fn busybox_rootfs() -> io::Result<Vec<Entry>> {
    need_busybox()?;
    let mut entries: Vec<Entry> = ["bin", "dev", "etc", "proc", "sys", "tmp", "var", "run"]
        .iter()
        .map(|d| Entry::Dir((*d).to_owned()))
        .collect();
    entries.push(Entry::File {
        path: "bin/busybox".into(),
        source: BUSYBOX.into(),
        mode: 0o755,
    });
    entries.extend(APPLETS.iter().map(|a| Entry::Symlink {
        path: format!("bin/{a}"),
        target: "busybox".into(),
    }));
    entries.push(Entry::Bytes {
        path: "etc/passwd".into(),
        data: b"root:x:0:0:root:/:/bin/sh\n".to_vec(),
        mode: 0o644,
    });
    Ok(entries)
}

/// The workload image: busybox (with `bash` as its `sh`) and a stand-in MPS client, running
/// `sh` unless the pod says
/// otherwise, with the `PATH`
/// of Debian-based images (CUDA's among them), so binaries CDI mounts in `/usr/bin` are found.
///
/// # Errors
/// As [`busybox_rootfs`].
pub fn workload() -> io::Result<Image> {
    let mut entries = busybox_rootfs()?;
    // A stand-in for a CUDA application's MPS client (libcuda connecting to the daemon of
    // `CUDA_MPS_PIPE_DIRECTORY`): the static fake control tool, whose `fake_client_attach`
    // stays connected as a client does. Part of the image, as the application is: the driver's
    // MPS tools are not mounted into containers.
    entries.extend(["usr", "usr/local", "usr/local/bin"].map(|d| Entry::Dir(d.to_owned())));
    entries.push(Entry::File {
        path: FAKE_CUDA_CLIENT.trim_start_matches('/').to_owned(),
        source: drust_fakes::mps_control().to_owned(),
        mode: 0o755,
    });
    // NVIDIA's examples run `bash -c`; busybox has no bash applet, so `bash` is its `sh`.
    entries.push(Entry::Bytes {
        path: "bin/bash".into(),
        data: b"#!/bin/sh\nexec /bin/sh \"$@\"\n".to_vec(),
        mode: 0o755,
    });
    Ok(Image {
        name: WORKLOAD_IMAGE.into(),
        entrypoint: vec![],
        cmd: vec!["/bin/sh".into()],
        env: vec!["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into()],
        entries,
    })
}

/// Where the workload image has its stand-in MPS client (see [`workload`]): `echo
/// fake_client_attach | /usr/local/bin/fake-cuda-client` attaches to the daemon.
pub const FAKE_CUDA_CLIENT: &str = "/usr/local/bin/fake-cuda-client";

/// The sandbox image: busybox sleeping until SIGTERM, as `pause` does.
///
/// # Errors
/// As [`busybox_rootfs`].
pub fn sandbox() -> io::Result<Image> {
    Ok(Image {
        name: SANDBOX_IMAGE.into(),
        entrypoint: vec![
            "/bin/sh".into(),
            "-c".into(),
            "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done".into(),
        ],
        cmd: vec![],
        env: vec!["PATH=/bin".into()],
        entries: busybox_rootfs()?,
    })
}

/// Where the plugin image keeps the fake topology it is given ([`plugin`]).
pub const PLUGIN_TOPOLOGY: &str = "/etc/drust/topology.yaml";

/// The node plugin's image as the chart runs it: `binary` at `/usr/bin/gpu-kubelet-plugin` (the
/// entrypoint, as in `deploy/Dockerfile`) and the `drust-cdi-hook` beside it, the shared libraries it links (from `ldd`, at the
/// same paths, with the dynamic loader), `chroot` (which MPS daemon Pods run) and `sh` from
/// busybox (the Dockerfile's Debian image has both), and `topology` at [`PLUGIN_TOPOLOGY`] for
/// `--fake-topology`. `name` is the fully qualified image name with its tag.
///
/// # Errors
/// When `ldd` fails or a file cannot be read.
pub fn plugin(name: &str, binary: &Path, topology: &Path) -> io::Result<Image> {
    let out = std::process::Command::new("ldd").arg(binary).output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "ldd {}: {}",
            binary.display(),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)` and
    // `/lib64/ld-linux-x86-64.so.2 (0x...)`; `linux-vdso.so.1 (0x...)` has no file.
    let libraries: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let path = l.split("=>").last()?.split_whitespace().next()?;
            path.starts_with('/').then(|| path.to_owned())
        })
        .collect();
    let mut dirs: Vec<String> = [
        "bin",
        "dev",
        "etc",
        "etc/drust",
        "proc",
        "sys",
        "tmp",
        "run",
    ]
    .iter()
    .map(|d| (*d).to_owned())
    .chain(
        ["usr", "usr/bin", "usr/sbin"]
            .iter()
            .map(|d| (*d).to_owned()),
    )
    .collect();
    for lib in &libraries {
        let mut parent = Path::new(lib.trim_start_matches('/')).parent();
        let mut chain = Vec::new();
        while let Some(p) = parent.filter(|p| !p.as_os_str().is_empty()) {
            chain.push(p.display().to_string());
            parent = p.parent();
        }
        for d in chain.into_iter().rev() {
            if !dirs.contains(&d) {
                dirs.push(d);
            }
        }
    }
    let mut entries: Vec<Entry> = dirs.into_iter().map(Entry::Dir).collect();
    entries.push(Entry::File {
        path: "usr/bin/gpu-kubelet-plugin".into(),
        source: binary.to_owned(),
        mode: 0o755,
    });
    // Its CDI hook beside it, as in the Dockerfile (built with it by `plugin_binary`).
    entries.push(Entry::File {
        path: "usr/bin/drust-cdi-hook".into(),
        source: binary.with_file_name("drust-cdi-hook"),
        mode: 0o755,
    });
    need_busybox()?;
    entries.push(Entry::File {
        path: "bin/busybox".into(),
        source: BUSYBOX.into(),
        mode: 0o755,
    });
    // `chroot` and `sh`, as the Dockerfile's Debian image has them.
    entries.push(Entry::Symlink {
        path: "usr/sbin/chroot".into(),
        target: "/bin/busybox".into(),
    });
    entries.push(Entry::Symlink {
        path: "bin/sh".into(),
        target: "busybox".into(),
    });
    entries.extend(libraries.iter().map(|lib| Entry::File {
        path: lib.trim_start_matches('/').to_owned(),
        source: lib.into(),
        mode: 0o755,
    }));
    entries.push(Entry::File {
        path: PLUGIN_TOPOLOGY.trim_start_matches('/').to_owned(),
        source: topology.to_owned(),
        mode: 0o644,
    });
    Ok(Image {
        name: name.to_owned(),
        entrypoint: vec!["/usr/bin/gpu-kubelet-plugin".into()],
        cmd: vec![],
        env: vec!["PATH=/usr/sbin:/usr/bin:/sbin:/bin".into()],
        entries,
    })
}

fn layer_tar(entries: &[Entry]) -> io::Result<Vec<u8>> {
    let mut tar = tar::Builder::new(Vec::new());
    tar.mode(tar::HeaderMode::Deterministic);
    for e in entries {
        let mut h = tar::Header::new_ustar();
        h.set_mtime(0);
        h.set_uid(0);
        h.set_gid(0);
        match e {
            Entry::Dir(path) => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(0o755);
                h.set_size(0);
                tar.append_data(&mut h, format!("{path}/"), io::empty())?;
            }
            Entry::Bytes { path, data, mode } => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(*mode);
                h.set_size(data.len() as u64);
                tar.append_data(&mut h, path, data.as_slice())?;
            }
            Entry::File { path, source, mode } => {
                let data = std::fs::read(source)?;
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(*mode);
                h.set_size(data.len() as u64);
                tar.append_data(&mut h, path, data.as_slice())?;
            }
            Entry::Symlink { path, target } => {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_mode(0o777);
                h.set_size(0);
                tar.append_link(&mut h, path, target)?;
            }
        }
    }
    tar.into_inner()
}

fn digest(data: &[u8]) -> String {
    let hex: String = Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("sha256:{hex}")
}

/// Writes `image` as an OCI image archive (a tar) at `out`.
///
/// # Errors
/// When a file cannot be read or the archive written.
pub fn write_archive(image: &Image, out: &Path) -> io::Result<()> {
    let layer = layer_tar(&image.entries)?;
    let layer_digest = digest(&layer);
    let config = serde_json::to_vec(&json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": image.entrypoint,
            "Cmd": image.cmd,
            "Env": image.env,
        },
        "rootfs": { "type": "layers", "diff_ids": [layer_digest] },
    }))?;
    let config_digest = digest(&config);
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": config.len(),
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": layer_digest,
            "size": layer.len(),
        }],
    }))?;
    let manifest_digest = digest(&manifest);
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_digest,
            "size": manifest.len(),
            "platform": { "architecture": "amd64", "os": "linux" },
            "annotations": { "io.containerd.image.name": image.name },
        }],
    }))?;
    let mut tar = tar::Builder::new(std::fs::File::create(out)?);
    tar.mode(tar::HeaderMode::Deterministic);
    let mut add = |path: &str, data: &[u8]| -> io::Result<()> {
        let mut h = tar::Header::new_ustar();
        h.set_mtime(0);
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        h.set_entry_type(tar::EntryType::Regular);
        tar.append_data(&mut h, path, data)
    };
    add("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    add("index.json", &index)?;
    for (d, data) in [
        (&layer_digest, &layer),
        (&config_digest, &config),
        (&manifest_digest, &manifest),
    ] {
        add(&format!("blobs/sha256/{}", &d["sha256:".len()..]), data)?;
    }
    tar.into_inner()?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_image_gives_the_same_archive() {
        let image = Image {
            name: "docker.io/library/t:1".into(),
            entrypoint: vec!["/bin/sh".into()],
            cmd: vec![],
            env: vec![],
            entries: vec![
                Entry::Dir("bin".into()),
                Entry::Bytes {
                    path: "bin/x".into(),
                    data: b"x".to_vec(),
                    mode: 0o755,
                },
                Entry::Symlink {
                    path: "bin/y".into(),
                    target: "x".into(),
                },
            ],
        };
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.tar"), dir.path().join("b.tar"));
        write_archive(&image, &a).unwrap();
        write_archive(&image, &b).unwrap();
        assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
        let mut names: Vec<String> = tar::Archive::new(std::fs::File::open(&a).unwrap())
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().display().to_string())
            .collect();
        names.sort();
        assert!(names.contains(&"index.json".to_owned()));
        assert!(names.contains(&"oci-layout".to_owned()));
        assert_eq!(names.iter().filter(|n| n.starts_with("blobs/")).count(), 3);
    }
}
