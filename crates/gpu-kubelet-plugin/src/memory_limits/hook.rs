//! The hook's runtime: what `drust-cdi-hook memory-limit` does when the container runtime runs it
//! at `createRuntime` (the OCI state on stdin): find the container's cgroup, record the limit and
//! set it, with the pod-level sum, through NVML.

use std::io::Read;
use std::path::{Component, Path, PathBuf};

use gpu_inventory::{GpuBackend, MemoryLimits};
use serde::Deserialize;

use super::records::{Record, lock_records, pod_cgroup, pod_total};
use super::{HOOK_BINARY, MAX_STATE_BYTES, MEMORY_LIMIT_COMMAND};

/// The part of the OCI state (runtime-spec `state`) the hook reads.
#[derive(Debug, Deserialize)]
struct OciState {
    id: String,
    pid: Option<u32>,
}

/// The hook failed; the runtime then does not create the container.
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    /// The command line is not what the plugin writes.
    #[error(
        "usage: {HOOK_BINARY} {MEMORY_LIMIT_COMMAND} --gpu UUID --bytes N --claim UID --records DIR --cgroup-root DIR [--nvml-library PATH | --fake-topology FILE [--fake-state-dir DIR]] (OCI state on stdin): {0}"
    )]
    Usage(String),
    /// The OCI state on stdin is not usable.
    #[error("the container state on stdin: {0}")]
    State(String),
    /// The container's cgroup could not be found.
    #[error("container {container} (pid {pid}): {problem}")]
    Cgroup {
        /// The container ID.
        container: String,
        /// Its process.
        pid: u32,
        /// What is wrong.
        problem: String,
    },
    /// The record could not be written.
    #[error("writing the memory-limit record {path}: {source}")]
    Record {
        /// The record.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The GPU backend failed.
    #[error("setting the memory limit of container {container} on GPU {gpu}: {source}")]
    Backend {
        /// The container ID.
        container: String,
        /// The GPU UUID.
        gpu: String,
        /// The cause.
        source: gpu_inventory::BackendError,
    },
    /// The backend could not be opened.
    #[error("opening the GPU backend: {0}")]
    Open(String),
}

/// The hook's arguments after the subcommand.
#[derive(Debug, Default)]
struct HookArgs {
    gpu: String,
    bytes: u64,
    claim: String,
    records: PathBuf,
    cgroup_root: PathBuf,
    nvml_library: Option<PathBuf>,
    fake_topology: Option<PathBuf>,
    fake_state_dir: Option<PathBuf>,
}

fn parse_args(args: &[String]) -> Result<HookArgs, HookError> {
    let usage = |m: String| HookError::Usage(m);
    let (command, rest) = args
        .split_first()
        .ok_or_else(|| usage("no subcommand".into()))?;
    if command != MEMORY_LIMIT_COMMAND {
        return Err(usage(format!("unknown subcommand {command:?}")));
    }
    let mut parsed = HookArgs::default();
    let mut it = rest.iter();
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .ok_or_else(|| usage(format!("{flag} needs a value")))?;
        match flag.as_str() {
            "--gpu" => parsed.gpu.clone_from(value),
            "--bytes" => {
                parsed.bytes = value
                    .parse()
                    .map_err(|_| usage(format!("--bytes {value:?} is not a byte count")))?;
            }
            "--claim" => parsed.claim.clone_from(value),
            "--records" => parsed.records = value.into(),
            "--cgroup-root" => parsed.cgroup_root = value.into(),
            "--nvml-library" => parsed.nvml_library = Some(value.into()),
            "--fake-topology" => parsed.fake_topology = Some(value.into()),
            "--fake-state-dir" => parsed.fake_state_dir = Some(value.into()),
            other => return Err(usage(format!("unknown flag {other:?}"))),
        }
    }
    if parsed.gpu.is_empty() || parsed.bytes == 0 || !safe_name(&parsed.claim) {
        return Err(usage("--gpu, --bytes and --claim are required".into()));
    }
    if !parsed.records.is_absolute() || !parsed.cgroup_root.is_absolute() {
        return Err(usage("--records and --cgroup-root must be absolute".into()));
    }
    Ok(parsed)
}

/// A name that is one path component of letters, digits, `-`, `_` and `.` (not `.` or `..`).
fn safe_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// The cgroup v2 directory of process `pid` under `cgroup_root`, from `proc_cgroup` (the text of
/// `/proc/<pid>/cgroup`): its `0::<path>` line. A path that climbs (`..`) is refused.
fn cgroup_dir(proc_cgroup: &str, cgroup_root: &Path) -> Result<PathBuf, String> {
    let path = proc_cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .ok_or("no cgroup v2 entry (0::) in /proc/<pid>/cgroup")?;
    let relative = Path::new(path.trim());
    if relative
        .components()
        .any(|c| !matches!(c, Component::RootDir | Component::Normal(_)))
    {
        return Err(format!("cgroup path {path:?} is not a plain path"));
    }
    let dir = cgroup_root.join(relative.strip_prefix("/").unwrap_or(relative));
    if dir == cgroup_root {
        return Err("the process is in the root cgroup, not a container's".into());
    }
    Ok(dir)
}

/// Runs the hook: `args` after the program name, the OCI state on `stdin`, `/proc` at
/// `proc_root`, the backend opened by `open` from the parsed flags. Writes the record, then
/// sets the limit.
///
/// # Errors
/// [`HookError`]; the binary prints it and exits non-zero, so the runtime fails the container.
pub fn run_hook(
    args: &[String],
    stdin: impl Read,
    proc_root: &Path,
    open: impl FnOnce(
        Option<&Path>,
        Option<(&Path, Option<&Path>)>,
    ) -> Result<Box<dyn GpuBackend>, String>,
) -> Result<(), HookError> {
    let args = parse_args(args)?;
    let mut text = String::new();
    stdin
        .take(MAX_STATE_BYTES)
        .read_to_string(&mut text)
        .map_err(|e| HookError::State(e.to_string()))?;
    let state: OciState =
        serde_json::from_str(&text).map_err(|e| HookError::State(e.to_string()))?;
    if !safe_name(&state.id) {
        return Err(HookError::State(format!(
            "container id {:?} is not a plain name",
            state.id
        )));
    }
    let pid = state
        .pid
        .filter(|p| *p > 0)
        .ok_or_else(|| HookError::State("no pid: the hook must run at createRuntime".into()))?;
    let cgroup_err = |problem: String| HookError::Cgroup {
        container: state.id.clone(),
        pid,
        problem,
    };
    let proc_cgroup = std::fs::read_to_string(proc_root.join(pid.to_string()).join("cgroup"))
        .map_err(|e| cgroup_err(format!("reading /proc/{pid}/cgroup: {e}")))?;
    let cgroup = cgroup_dir(&proc_cgroup, &args.cgroup_root).map_err(cgroup_err)?;
    if !cgroup.is_dir() {
        return Err(cgroup_err(format!("{} does not exist", cgroup.display())));
    }
    let backend = open(
        args.nvml_library.as_deref(),
        args.fake_topology
            .as_deref()
            .map(|t| (t, args.fake_state_dir.as_deref())),
    )
    .map_err(HookError::Open)?;
    let failed = |source| HookError::Backend {
        container: state.id.clone(),
        gpu: args.gpu.clone(),
        source,
    };
    let index = backend.index_of(&args.gpu).map_err(failed)?;
    let _lock =
        lock_records(&args.records).map_err(|(path, source)| HookError::Record { path, source })?;
    // The record first: a crash after the limit is set still leaves it to clear.
    let dir = args.records.join(&args.claim);
    let path = dir.join(format!("{}.json", state.id));
    let record = Record {
        gpu: args.gpu.clone(),
        cgroup: cgroup.clone(),
        bytes: args.bytes,
    };
    let tmp = path.with_extension("tmp");
    std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(&tmp, serde_json::to_vec(&record).unwrap_or_default()))
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|source| HookError::Record {
            path: path.clone(),
            source,
        })?;
    backend
        .set_memory_limits(index, &cgroup, MemoryLimits::share(args.bytes))
        .map_err(failed)?;
    // The pod's cgroup holds the sum of its claims' shares on the GPU, so that several
    // containers of one claim in a pod share one limit.
    if let Some(pod) = pod_cgroup(&cgroup) {
        let total = pod_total(&args.records, &args.gpu, pod);
        backend
            .set_memory_limits(index, pod, MemoryLimits::share(total))
            .map_err(failed)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_container_cgroup_is_its_v2_entry_under_the_root() {
        let text = "4:memory:/kubepods/pod1/abc\n0::/kubepods/pod1/abc\n";
        assert_eq!(
            cgroup_dir(text, Path::new("/sys/fs/cgroup")).expect("found"),
            Path::new("/sys/fs/cgroup/kubepods/pod1/abc")
        );
        assert!(cgroup_dir("4:memory:/x\n", Path::new("/sys/fs/cgroup")).is_err());
        assert!(cgroup_dir("0::/\n", Path::new("/sys/fs/cgroup")).is_err());
        let climbing = cgroup_dir("0::/kubepods/../../etc\n", Path::new("/sys/fs/cgroup"));
        assert!(climbing.expect_err("refused").contains("plain path"));
    }
}
