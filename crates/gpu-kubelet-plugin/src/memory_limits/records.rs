//! The records of the limits the hook set: one file per container under
//! `<records>/<claim UID>/`, a lock that hooks and the plugin take in turn, and the pod-level sums
//! derived from them. Shared by the plugin's side ([`super::KernelMemory`]) and the hook's
//! runtime ([`super::hook`]).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// One container's limit, as the hook records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Record {
    pub(super) gpu: String,
    pub(super) cgroup: PathBuf,
    pub(super) bytes: u64,
}

/// Holds `<records>/.lock` (an exclusive `flock`), so that hooks and the plugin change records
/// and the pod-level limits derived from them one at a time. Released on drop.
pub(super) fn lock_records(
    records: &Path,
) -> Result<nix::fcntl::Flock<std::fs::File>, (PathBuf, std::io::Error)> {
    let path = records.join(".lock");
    let file = std::fs::create_dir_all(records)
        .and_then(|()| {
            std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
        })
        .map_err(|e| (path.clone(), e))?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, errno)| (path, std::io::Error::from(errno)))
}

/// The pod cgroup `container`'s cgroup is in, if its parent is named as the kubelet names pod
/// cgroups: `pod<uid>` (cgroupfs driver) or `kubepods[-<qos>]-pod<uid>.slice` (systemd driver,
/// `-` in the UID as `_`). Anything else (a runtime outside Kubernetes) gets no pod-level limit,
/// so that a shared parent such as `system.slice` is never limited.
pub(super) fn pod_cgroup(container: &Path) -> Option<&Path> {
    let parent = container.parent()?;
    let name = parent.file_name()?.to_str()?;
    let uid =
        |s: &str, sep: u8| !s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit() || b == sep);
    let cgroupfs = name.strip_prefix("pod").is_some_and(|u| uid(u, b'-'));
    let systemd = name
        .strip_prefix("kubepods-")
        .and_then(|n| n.strip_suffix(".slice"))
        .and_then(|n| n.rsplit_once("pod"))
        .is_some_and(|(qos, u)| matches!(qos, "" | "besteffort-" | "burstable-") && uid(u, b'_'));
    (cgroupfs || systemd).then_some(parent)
}

/// The sum, over the claims with a record of a container in `pod` on `gpu`, of each claim's
/// share: what the pod's cgroup may hold on the GPU together.
pub(super) fn pod_total(records: &Path, gpu: &str, pod: &Path) -> u64 {
    let mut total = 0u64;
    for claim in std::fs::read_dir(records).into_iter().flatten().flatten() {
        let share = std::fs::read_dir(claim.path())
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|f| std::fs::read(f.path()).ok())
            .filter_map(|b| serde_json::from_slice::<Record>(&b).ok())
            .filter(|r| r.gpu == gpu && r.cgroup.parent() == Some(pod))
            .map(|r| r.bytes)
            .max();
        total = total.saturating_add(share.unwrap_or(0));
    }
    total
}
