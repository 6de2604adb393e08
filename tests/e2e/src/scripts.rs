//! The build scripts under `tests/scripts` that put a tool into the cache (`build-*.sh`): each
//! streams its progress to stderr and names what it built on the last line of its stdout.

use std::path::{Path, PathBuf};
use std::process::Stdio;

/// A build script could not run or failed.
#[derive(Debug, thiserror::Error)]
pub enum ScriptError {
    /// `bash` could not be started, or its output read.
    #[error("running {}: {source}", script.display())]
    Spawn {
        /// The script.
        script: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The script exited non-zero; its progress went to stderr.
    #[error("{} failed ({status}); its output is above", script.display())]
    Failed {
        /// The script.
        script: PathBuf,
        /// How it exited.
        status: std::process::ExitStatus,
    },
}

/// The path of `tests/scripts/<name>` in this repository.
pub fn script_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/scripts")
        .join(name)
}

/// Runs `bash <script> <args>`, streaming its stderr through (a cold build's progress must
/// reach the terminal), and returns the last non-empty line of its stdout, trimmed.
///
/// # Errors
/// [`ScriptError`] when it cannot start or exits non-zero.
pub async fn last_line(script: &Path, args: &[&str]) -> Result<String, ScriptError> {
    let spawn = |source| ScriptError::Spawn {
        script: script.to_owned(),
        source,
    };
    // Not `output()`: tokio's `output()` pipes stderr as well.
    let child = tokio::process::Command::new("bash")
        .arg(script)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .map_err(spawn)?;
    let output = child.wait_with_output().await.map_err(spawn)?;
    if !output.status.success() {
        return Err(ScriptError::Failed {
            script: script.to_owned(),
            status: output.status,
        });
    }
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim()
        .to_owned())
}
