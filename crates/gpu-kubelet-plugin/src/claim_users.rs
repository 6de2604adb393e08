//! Which pods use a claim that is reserved for no pod: a PodGroup's claim (KEP-5729,
//! `PodGroup.spec.resourceClaims`) has the PodGroup in `status.reservedFor`, so neither the API
//! server nor the kubelet's PodResources API (names, no UIDs) tells which pod a GPU process,
//! known by its cgroup's pod UID, belongs to. The container runtime does: a CDI `createRuntime`
//! hook in such a claim's spec ([`ClaimUsers::hook`], `drust-cdi-hook claim-user`) reads the
//! container's OCI state on stdin and records its pod before the container starts.
//!
//! The state's annotations are containerd's CRI ones
//! (`internal/cri/annotations/annotations.go` of containerd v2: `io.kubernetes.cri.sandbox-uid`,
//! `-name`, `-namespace` and `io.kubernetes.cri.container-name`). A runtime that sets none
//! leaves no record: the usage report then falls back to the PodResources names (the `usage`
//! module's report).
//!
//! Records: `<plugin dir>/claim-users/<claim uid>/<container id>.json`,
//! `{"namespace": .., "pod": .., "podUid": .., "container": ..}`, written atomically. The hook
//! never fails the container: what it cannot record is only missing from the usage report (it
//! prints why on stderr and exits 0). Unprepare removes the claim's records
//! ([`ClaimUsers::clear`]); start-up removes those of claims it does not keep.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::cdi::Hook;
use crate::memory_limits::{HOOK_POINT, HOOK_TIMEOUT_SECONDS};

/// The hook's subcommand that records a claim's container.
pub const CLAIM_USER_COMMAND: &str = "claim-user";

/// The record directory under the plugin directory.
pub const RECORDS_DIR: &str = "claim-users";

/// The largest OCI state the hook reads from stdin.
const MAX_STATE_BYTES: u64 = 1 << 20;

/// containerd's CRI annotations on a container's OCI spec (module docs).
const SANDBOX_UID: &str = "io.kubernetes.cri.sandbox-uid";
const SANDBOX_NAME: &str = "io.kubernetes.cri.sandbox-name";
const SANDBOX_NAMESPACE: &str = "io.kubernetes.cri.sandbox-namespace";
const CONTAINER_NAME: &str = "io.kubernetes.cri.container-name";

/// One container the runtime started with a claim's devices.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimUser {
    /// Its pod's namespace.
    pub namespace: String,
    /// Its pod's name.
    pub pod: String,
    /// Its pod's `metadata.uid`.
    pub pod_uid: String,
    /// Its name in the pod spec.
    pub container: String,
}

/// Where this node's claim-user hook is and where its records go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimUsers {
    /// The installed hook, a host path ([`crate::memory_limits::installed_hook_name`]).
    hook: PathBuf,
    /// The record directory.
    records: PathBuf,
}

impl ClaimUsers {
    /// The hook installed at `hook` (a host path), recording under `plugin_dir`/[`RECORDS_DIR`].
    pub fn new(hook: PathBuf, plugin_dir: &Path) -> Self {
        Self {
            hook,
            records: plugin_dir.join(RECORDS_DIR),
        }
    }

    /// The installed hook the specs run.
    pub fn hook_path(&self) -> &Path {
        &self.hook
    }

    /// The `createRuntime` hook that records each container of claim `claim_uid`.
    pub fn hook(&self, claim_uid: &str) -> Hook {
        Hook {
            hook_name: HOOK_POINT.to_owned(),
            path: self.hook.display().to_string(),
            args: vec![
                crate::memory_limits::HOOK_BINARY.to_owned(),
                CLAIM_USER_COMMAND.to_owned(),
                "--claim".to_owned(),
                claim_uid.to_owned(),
                "--records".to_owned(),
                self.records.display().to_string(),
            ],
            env: Vec::new(),
            timeout: Some(HOOK_TIMEOUT_SECONDS),
        }
    }

    /// The containers recorded for each of `claims` (UIDs) that has any. Unreadable records are
    /// skipped. Blocking (reads files).
    pub fn users(&self, claims: &BTreeSet<String>) -> BTreeMap<String, Vec<ClaimUser>> {
        claims
            .iter()
            .filter(|uid| safe_name(uid))
            .filter_map(|uid| {
                let mut users: Vec<ClaimUser> = std::fs::read_dir(self.records.join(uid))
                    .ok()?
                    .flatten()
                    .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
                    .filter_map(|e| std::fs::read(e.path()).ok())
                    .filter_map(|b| serde_json::from_slice(&b).ok())
                    .collect();
                users.sort();
                users.dedup();
                (!users.is_empty()).then(|| (uid.clone(), users))
            })
            .collect()
    }

    /// Removes the records of claim `claim_uid`. Blocking.
    ///
    /// # Errors
    /// The directory cannot be removed (it stays, for a retry).
    pub fn clear(&self, claim_uid: &str) -> std::io::Result<()> {
        if !safe_name(claim_uid) {
            return Ok(());
        }
        match std::fs::remove_dir_all(self.records.join(claim_uid)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// The claims (by UID) that have records, for start-up to clear those it does not keep.
    pub fn recorded_claims(&self) -> BTreeSet<String> {
        std::fs::read_dir(&self.records)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|e| e.file_name().into_string().ok())
            .collect()
    }
}

/// The part of the OCI state (runtime-spec `state`) the hook reads.
#[derive(Debug, Deserialize)]
struct OciState {
    id: String,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
}

/// Runs `drust-cdi-hook claim-user --claim UID --records DIR` (`args` after the program name)
/// on the OCI state in `stdin`: writes the container's record and returns where.
///
/// # Errors
/// Why nothing was recorded (bad arguments or state, no CRI annotations, an unwritable record);
/// the binary prints it and still exits 0, so the container starts.
pub fn run_hook(args: &[String], stdin: impl Read) -> Result<PathBuf, String> {
    let (claim, records) = parse_args(args)?;
    let mut text = String::new();
    stdin
        .take(MAX_STATE_BYTES)
        .read_to_string(&mut text)
        .map_err(|e| format!("reading the container state on stdin: {e}"))?;
    let state: OciState =
        serde_json::from_str(&text).map_err(|e| format!("the container state on stdin: {e}"))?;
    if !safe_name(&state.id) {
        return Err(format!("container id {:?} is not a plain name", state.id));
    }
    let get = |key: &str| {
        state
            .annotations
            .get(key)
            .filter(|v| !v.is_empty())
            .cloned()
            .ok_or_else(|| format!("container {}: no {key} annotation", state.id))
    };
    let user = ClaimUser {
        namespace: get(SANDBOX_NAMESPACE)?,
        pod: get(SANDBOX_NAME)?,
        pod_uid: get(SANDBOX_UID)?,
        container: get(CONTAINER_NAME)?,
    };
    let dir = records.join(&claim);
    let path = dir.join(format!("{}.json", state.id));
    let tmp = dir.join(format!(".{}.tmp", state.id));
    let bytes = serde_json::to_vec(&user).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(&tmp, bytes))
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|e| format!("writing {}: {e}", path.display()))?;
    Ok(path)
}

fn parse_args(args: &[String]) -> Result<(String, PathBuf), String> {
    let usage = |m: &str| {
        format!(
            "usage: {} {CLAIM_USER_COMMAND} --claim UID --records DIR (OCI state on stdin): {m}",
            crate::memory_limits::HOOK_BINARY
        )
    };
    match args {
        [command, rest @ ..] if command == CLAIM_USER_COMMAND => {
            let (mut claim, mut records) = (None, None);
            let mut it = rest.iter();
            while let Some(flag) = it.next() {
                let value = it
                    .next()
                    .ok_or_else(|| usage(&format!("{flag} needs a value")))?;
                match flag.as_str() {
                    "--claim" => claim = Some(value.clone()),
                    "--records" => records = Some(PathBuf::from(value)),
                    other => return Err(usage(&format!("unknown flag {other:?}"))),
                }
            }
            match (claim, records) {
                (Some(c), Some(r)) if safe_name(&c) && r.is_absolute() => Ok((c, r)),
                _ => Err(usage(
                    "--claim (a plain name) and --records (absolute) are required",
                )),
            }
        }
        _ => Err(usage("not the claim-user subcommand")),
    }
}

/// One path component of letters, digits, `-`, `_` and `.` (not `.` or `..`).
fn safe_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(records: &Path, claim: &str) -> Vec<String> {
        vec![
            CLAIM_USER_COMMAND.into(),
            "--claim".into(),
            claim.into(),
            "--records".into(),
            records.display().to_string(),
        ]
    }

    fn state(id: &str, annotations: &[(&str, &str)]) -> String {
        serde_json::json!({
            "ociVersion": "1.2.0",
            "id": id,
            "status": "created",
            "pid": 4242,
            "bundle": "/run/containerd/bundle",
            "annotations": annotations.iter().copied().collect::<BTreeMap<_, _>>(),
        })
        .to_string()
    }

    const CRI: [(&str, &str); 5] = [
        (SANDBOX_NAMESPACE, "team"),
        (SANDBOX_NAME, "worker-0"),
        (SANDBOX_UID, "0f0e0d0c-0000-4000-8000-000000000001"),
        (CONTAINER_NAME, "main"),
        ("io.kubernetes.cri.container-type", "container"),
    ];

    #[test]
    fn the_hook_records_the_pod_from_containerds_annotations_and_users_reads_it_back() {
        let dir = tempfile::tempdir().unwrap();
        let users = ClaimUsers::new(PathBuf::from("/hook"), dir.path());
        let hook = users.hook("claim-1");
        assert_eq!(hook.hook_name, "createRuntime");
        let path = run_hook(&hook.args[1..], state("abc123", &CRI).as_bytes()).unwrap();
        assert_eq!(path, dir.path().join("claim-users/claim-1/abc123.json"));
        let second = [
            (SANDBOX_NAMESPACE, "team"),
            (SANDBOX_NAME, "worker-1"),
            (SANDBOX_UID, "0f0e0d0c-0000-4000-8000-000000000002"),
            (CONTAINER_NAME, "main"),
        ];
        run_hook(&hook.args[1..], state("def456", &second).as_bytes()).unwrap();
        let read = users.users(&BTreeSet::from(["claim-1".to_owned(), "other".to_owned()]));
        let pods: Vec<&str> = read["claim-1"].iter().map(|u| u.pod.as_str()).collect();
        assert_eq!(pods, ["worker-0", "worker-1"]);
        assert_eq!(read.len(), 1, "no records, no entry");
        assert_eq!(
            users.recorded_claims(),
            BTreeSet::from(["claim-1".to_owned()])
        );
        users.clear("claim-1").unwrap();
        users.clear("claim-1").unwrap();
        assert!(users.recorded_claims().is_empty());
    }

    #[test]
    fn what_cannot_be_recorded_is_an_error_naming_it_and_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let a = args(&dir.path().join("claim-users"), "claim-1");
        let no_cri = run_hook(&a, state("abc", &[]).as_bytes()).unwrap_err();
        assert!(no_cri.contains(SANDBOX_NAMESPACE), "{no_cri}");
        let climbing = run_hook(&a, state("../x", &CRI).as_bytes()).unwrap_err();
        assert!(climbing.contains("plain name"), "{climbing}");
        assert!(run_hook(&a, "not json".as_bytes()).is_err());
        let bad_claim = run_hook(&args(dir.path(), "../c"), state("a", &CRI).as_bytes());
        assert!(bad_claim.unwrap_err().contains("usage"));
        let relative = run_hook(&args(Path::new("rel"), "c"), state("a", &CRI).as_bytes());
        assert!(relative.unwrap_err().contains("absolute"));
        assert!(!dir.path().join("claim-users").exists());
    }
}
