//! Which pod and container a process belongs to, from its cgroup (`/proc/<pid>/cgroup`).
//!
//! The kubelet places every container in a cgroup under its pod's, under `kubepods`
//! (kubelet's `pkg/kubelet/cm/cgroup_manager_linux.go` and `pod_container_manager_linux.go`
//! name them; the container runtime names the last segment):
//!
//! | cgroup driver | path |
//! |---|---|
//! | `cgroupfs` | `/kubepods[/burstable\|/besteffort]/pod<uid>/<container id>` |
//! | `systemd` | `/kubepods.slice[/kubepods-burstable.slice]/kubepods-burstable-pod<uid with _ for ->.slice/cri-containerd-<container id>.scope` |
//!
//! Guaranteed pods have no QoS level. The path may have a prefix (a node that itself runs in a
//! container or a nested cgroup). cgroup v2 lists one line, `0::<path>`; v1 lists one line per
//! hierarchy, all with the same pod and container. Container runtimes prefix the ID in systemd
//! scopes: `cri-containerd-`, `crio-`, `docker-`.

use std::path::Path;

/// A process's place in Kubernetes: its pod's UID and its container's runtime ID (64 hex
/// digits for containerd and CRI-O; the ID in `status.containerStatuses[].containerID` after
/// the `<runtime>://` prefix).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ContainerRef {
    /// The pod's `metadata.uid`, with dashes.
    pub pod_uid: String,
    /// The container's runtime ID; empty when the process sits in the pod's own cgroup.
    pub container_id: String,
}

/// The pod and container of the process whose `/proc/<pid>/cgroup` reads `text`; `None` for a
/// process outside any pod (a host process, the MPS server the plugin runs as a child).
pub fn container_of(text: &str) -> Option<ContainerRef> {
    text.lines().find_map(|line| {
        // `<id>:<controllers>:<path>`; the path may itself hold colons.
        let path = line.splitn(3, ':').nth(2)?;
        from_path(path)
    })
}

/// [`container_of`] for process `pid`, reading `<proc_root>/<pid>/cgroup`; `None` also when the
/// process is gone (it exited between NVML's list and this read).
pub fn container_of_pid(proc_root: &Path, pid: u32) -> Option<ContainerRef> {
    let text = std::fs::read_to_string(proc_root.join(pid.to_string()).join("cgroup")).ok()?;
    container_of(&text)
}

fn from_path(path: &str) -> Option<ContainerRef> {
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let root = segments
        .iter()
        .position(|s| *s == "kubepods" || *s == "kubepods.slice")?;
    let rest = &segments[root + 1..];
    let (pod_at, pod_uid) = rest
        .iter()
        .enumerate()
        .find_map(|(i, s)| pod_uid(s).map(|uid| (i, uid)))?;
    let container_id = rest
        .get(pod_at + 1)
        .map(|s| container_id(s))
        .unwrap_or_default();
    Some(ContainerRef {
        pod_uid,
        container_id,
    })
}

/// The pod UID in a pod's cgroup segment: `pod<uid>` (cgroupfs) or
/// `kubepods[-<qos>]-pod<uid with _>.slice` (systemd).
fn pod_uid(segment: &str) -> Option<String> {
    let raw = if let Some(slice) = segment.strip_suffix(".slice") {
        let at = slice.rfind("-pod")?;
        &slice[at + "-pod".len()..]
    } else {
        segment.strip_prefix("pod")?
    };
    let uid = raw.replace('_', "-");
    let valid = uid.len() == 36
        && uid.chars().enumerate().all(|(i, c)| {
            matches!(i, 8 | 13 | 18 | 23) == (c == '-') && (c == '-' || c.is_ascii_hexdigit())
        });
    valid.then_some(uid)
}

/// The container ID in a container's cgroup segment: as is (cgroupfs) or from a systemd scope,
/// `<runtime prefix>-<id>.scope`.
fn container_id(segment: &str) -> String {
    match segment.strip_suffix(".scope") {
        Some(scope) => scope
            .rsplit_once('-')
            .map_or(scope, |(_, id)| id)
            .to_owned(),
        None => segment.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0b3c2d1e-8f7a-4b6c-9d5e-1a2b3c4d5e6f";
    const ID: &str = "4f1c9a0e2b7d4c6a8e1f3b5d7c9e0a2b4d6f8a0c2e4b6d8f0a1c3e5b7d9f1a3c";

    fn expect(text: &str) {
        assert_eq!(
            container_of(text),
            Some(ContainerRef {
                pod_uid: UID.into(),
                container_id: ID.into(),
            }),
            "{text}"
        );
    }

    #[test]
    fn cgroupfs_driver_every_qos_class() {
        for qos in ["", "/burstable", "/besteffort"] {
            expect(&format!("0::/kubepods{qos}/pod{UID}/{ID}\n"));
        }
    }

    #[test]
    fn systemd_driver_every_qos_class_and_runtime() {
        let u = UID.replace('-', "_");
        for (slices, prefix) in [
            ("/kubepods.slice", "kubepods"),
            (
                "/kubepods.slice/kubepods-burstable.slice",
                "kubepods-burstable",
            ),
            (
                "/kubepods.slice/kubepods-besteffort.slice",
                "kubepods-besteffort",
            ),
        ] {
            for runtime in ["cri-containerd", "crio", "docker"] {
                expect(&format!(
                    "0::{slices}/{prefix}-pod{u}.slice/{runtime}-{ID}.scope\n"
                ));
            }
        }
    }

    #[test]
    fn a_prefix_before_kubepods_and_v1_hierarchies() {
        expect(&format!(
            "0::/system.slice/containerd.service/kubepods/burstable/pod{UID}/{ID}\n"
        ));
        expect(&format!(
            "12:pids:/kubepods/pod{UID}/{ID}\n11:cpu,cpuacct:/kubepods/pod{UID}/{ID}\n1:name=systemd:/kubepods/pod{UID}/{ID}\n"
        ));
    }

    #[test]
    fn outside_any_pod_or_malformed() {
        for text in [
            "0::/system.slice/gpu-kubelet-plugin.service\n",
            "0::/\n",
            "",
            "0::/kubepods/burstable\n",
            "0::/kubepods/burstable/podnot-a-uid/abc\n",
            "garbage without colons",
            "0::/kubepods/burstable/pod0b3c2d1e_8f7a_4b6c_9d5e_1a2b3c4d5e6fX/abc\n",
        ] {
            assert_eq!(container_of(text), None, "{text:?}");
        }
    }

    #[test]
    fn the_pod_cgroup_itself() {
        assert_eq!(
            container_of(&format!("0::/kubepods/besteffort/pod{UID}\n")),
            Some(ContainerRef {
                pod_uid: UID.into(),
                container_id: String::new(),
            })
        );
    }

    #[test]
    fn reads_proc() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("4242")).unwrap();
        std::fs::write(
            dir.path().join("4242/cgroup"),
            format!("0::/kubepods/pod{UID}/{ID}\n"),
        )
        .unwrap();
        assert_eq!(
            container_of_pid(dir.path(), 4242).map(|c| c.pod_uid),
            Some(UID.to_owned())
        );
        assert_eq!(container_of_pid(dir.path(), 1), None);
    }
}
