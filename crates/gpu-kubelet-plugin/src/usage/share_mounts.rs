//! Which shares a process's container holds, from its mount table (`/proc/<pid>/mountinfo`).
//!
//! A share's containers get a read-only mount at `<SHARE_MARK_DIR>/<claim UID>`
//! ([`crate::mps::SHARE_MARK_DIR`], [`crate::mps::MpsControl::share_edits`]). Two share claims
//! of one GPU used by one pod differ in nothing else a process shows from the outside (same
//! device, same pod, the same MPS pipe directory at the `mps` level), and a process's cgroup
//! names its container's runtime ID, not its name. The mount table is no secret (unlike a
//! process's environment): its fifth field is each mount point, relative to the process's root
//! (the kernel's `Documentation/filesystems/proc.rst`, "/proc/<pid>/mountinfo").

use std::path::Path;

use crate::mps::SHARE_MARK_DIR;

/// The claim UIDs whose share mark `text` (a `mountinfo`) shows, sorted, without repeats.
pub fn share_claims(text: &str) -> Vec<String> {
    let prefix = format!("{SHARE_MARK_DIR}/");
    let mut claims: Vec<String> = text
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .filter_map(|mount_point| mount_point.strip_prefix(&prefix))
        .filter(|uid| !uid.is_empty() && !uid.contains('/'))
        .map(str::to_owned)
        .collect();
    claims.sort();
    claims.dedup();
    claims
}

/// [`share_claims`] of process `pid`, reading `<proc_root>/<pid>/mountinfo`; empty when it
/// cannot be read (the process exited). Blocking.
pub fn share_claims_of_pid(proc_root: &Path, pid: u32) -> Vec<String> {
    std::fs::read_to_string(proc_root.join(pid.to_string()).join("mountinfo"))
        .map(|text| share_claims(&text))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_marks_among_a_containers_mounts() {
        let text = format!(
            "1520 1400 0:95 / / rw,relatime - overlay overlay rw\n\
             1530 1520 254:1 /run/drust/mps/gpu-a/pipe /run/nvidia-mps rw - ext4 /dev/vda rw\n\
             1531 1520 254:1 /run/drust/mps/gpu-a/pipe {SHARE_MARK_DIR}/0b-2 ro,nosuid - ext4 /dev/vda rw\n\
             1532 1520 254:1 /run/drust/mps/gpu-a/pipe {SHARE_MARK_DIR}/0a-1 ro,nosuid - ext4 /dev/vda rw\n\
             1533 1520 0:96 / /dev/shm rw - tmpfs shm rw\n"
        );
        assert_eq!(share_claims(&text), ["0a-1", "0b-2"]);
        assert!(share_claims("1 0 0:1 / / rw - ext4 /dev/vda rw\n").is_empty());
        assert!(share_claims("").is_empty());
        // A deeper path is no mark.
        assert!(
            share_claims(&format!("1 0 0:1 / {SHARE_MARK_DIR}/a/b ro - ext4 x ro\n")).is_empty()
        );
    }
}
