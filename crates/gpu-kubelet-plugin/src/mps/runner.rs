//! The process runner: `nvidia-cuda-mps-control` in client mode, one command per process
//! (legacy commands on stdin, v3 `module verb` commands as arguments), spawned off the async
//! workers, bounded by the start timeout, killed when dropped.

use std::path::Path;
use std::process::Stdio;

use tokio::io::AsyncWriteExt;
use tokio::process::Command;

use super::{MpsControl, MpsError, Protocol};

impl MpsControl {
    /// Sends one control command to the legacy daemon of `pipe`; its answer.
    pub(super) async fn command(&self, pipe: &Path, command: &str) -> Result<String, MpsError> {
        let mut client = Command::new(&self.binary);
        client.env("CUDA_MPS_PIPE_DIRECTORY", pipe);
        self.run(client, command, Some(command)).await
    }

    /// Runs one v3 command (`module verb ...` as the tool's arguments) against the daemon of
    /// `pipe`; its output.
    pub(super) async fn v3_command(&self, pipe: &Path, args: &[&str]) -> Result<String, MpsError> {
        let mut client = Command::new(&self.binary);
        client
            .args(args)
            .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
            .env("CUDA_MPS_PROTOCOL_VERSION", "3");
        self.run(client, &args.join(" "), None).await
    }

    /// Asks the daemon of `pipe` for its servers, in its protocol: whether it answers.
    pub(super) async fn probe(&self, pipe: &Path, protocol: Protocol) -> Result<String, MpsError> {
        match protocol {
            Protocol::Legacy => self.command(pipe, "get_server_list").await,
            Protocol::V3 => {
                self.v3_command(pipe, &["server", "list", "--format=csv,noheader"])
                    .await
            }
        }
    }

    pub(super) async fn run(
        &self,
        mut cmd: Command,
        args: &str,
        stdin: Option<&str>,
    ) -> Result<String, MpsError> {
        let spawn_err = |source| MpsError::Spawn {
            binary: self.binary.clone(),
            args: args.to_owned(),
            source,
        };
        cmd.stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
        // fork and exec block; keep them off the async workers.
        let mut child = tokio::task::spawn_blocking(move || cmd.spawn())
            .await
            .map_err(|e| spawn_err(std::io::Error::other(e)))?
            .map_err(spawn_err)?;
        if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
            match pipe.write_all(format!("{text}\n").as_bytes()).await {
                // The tool exited without reading (no daemon to send to): its exit status
                // says so.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
                other => other.map_err(spawn_err)?,
            }
        }
        let output = tokio::time::timeout(self.start_timeout, child.wait_with_output())
            .await
            .map_err(|_| MpsError::Timeout {
                pipe_dir: self.root.clone(),
                what: "finish a control command",
                timeout_ms: self.start_timeout.as_millis(),
            })?
            .map_err(spawn_err)?;
        if !output.status.success() {
            return Err(MpsError::Failed {
                binary: self.binary.clone(),
                args: args.to_owned(),
                status: output.status.to_string(),
                stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
            });
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }
}
