//! The CDI edits that connect containers to an MPS daemon: its socket directory (the pipe
//! directory, or a v3 namespace's) at [`CONTAINER_PIPE_DIR`], a share's limits in the client
//! environment, and a share's mark ([`SHARE_MARK_DIR`]). Each container keeps its own
//! `/dev/shm` (the module docs of [`super`]).

use std::path::Path;

use super::{CONTAINER_PIPE_DIR, MpsControl, SHARE_MARK_DIR};
use crate::cdi::{ContainerEdits, Mount};

impl MpsControl {
    /// The CDI edits that connect a container to the claim's daemon.
    pub fn container_edits(&self, uid: &str) -> ContainerEdits {
        Self::client_edits(&self.pipe_dir(uid))
    }

    /// The CDI edits that connect a container to a daemon through the socket directory `pipe`
    /// (its pipe directory, or one namespace's): that directory alone; the container keeps its
    /// own `/dev/shm` (module docs).
    fn client_edits(pipe: &Path) -> ContainerEdits {
        ContainerEdits {
            env: vec![format!("CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIR}")],
            mounts: vec![Mount {
                host_path: pipe.display().to_string(),
                container_path: CONTAINER_PIPE_DIR.to_owned(),
                options: vec!["rbind".into(), "rw".into()],
            }],
            ..ContainerEdits::default()
        }
    }

    /// The CDI edits of one share's containers (fractional GPUs, the claim controller's shares):
    /// connected to the daemon of `key` (its device's), with the share's own limits as the
    /// client environment MPS reads at a client's start (NVIDIA's MPS guide, "Environment
    /// variables"): `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<MiB>M` (the daemon serves one device,
    /// ordinal 0; rounded down to whole MiB so the share is never exceeded) and, when
    /// `compute_percent` is not 0, `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`.
    /// The share's mark ([`SHARE_MARK_DIR`]) names `claim_uid`.
    pub fn share_edits(
        &self,
        key: &str,
        claim_uid: &str,
        memory_bytes: u64,
        compute_percent: u32,
    ) -> ContainerEdits {
        Self::share_client_edits(
            &self.pipe_dir(key),
            claim_uid,
            memory_bytes,
            compute_percent,
        )
    }

    /// The CDI edits of claim `claim_uid`'s share, whose clients reach their daemon through
    /// `socket_dir` (the daemon's pipe directory, or the share's v3 namespace's): that
    /// directory, again read-only as the share's mark at `<SHARE_MARK_DIR>/<claim_uid>`, and the
    /// share's client limits in the environment ([`Self::share_edits`]).
    pub(super) fn share_client_edits(
        socket_dir: &Path,
        claim_uid: &str,
        memory_bytes: u64,
        compute_percent: u32,
    ) -> ContainerEdits {
        let mut edits = Self::client_edits(socket_dir);
        edits.mounts.push(Mount {
            host_path: socket_dir.display().to_string(),
            container_path: format!("{SHARE_MARK_DIR}/{claim_uid}"),
            options: ["bind", "ro", "nosuid", "nodev", "noexec"]
                .map(String::from)
                .to_vec(),
        });
        edits.env.push(format!(
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={}M",
            (memory_bytes >> 20).max(1)
        ));
        if compute_percent > 0 {
            edits.env.push(format!(
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={compute_percent}"
            ));
        }
        edits
    }
}
