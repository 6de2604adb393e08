//! Stand-ins for NVIDIA's tools, for tests on machines without a GPU: statically linked
//! programs built by this crate's build script (`build.rs`), found through the paths below.

use std::path::Path;

/// The stand-in for `nvidia-cuda-mps-control` (`src/nvidia-cuda-mps-control.rs` says what it
/// does): a static executable, runnable in any container or chroot.
pub fn mps_control() -> &'static Path {
    Path::new(concat!(env!("OUT_DIR"), "/nvidia-cuda-mps-control"))
}

/// The stand-in for the IMEX daemon `nvidia-imex` (`src/nvidia-imex.rs` says what it does and
/// where it differs from the real one): a static executable.
pub fn imex() -> &'static Path {
    Path::new(concat!(env!("OUT_DIR"), "/nvidia-imex"))
}

/// The stand-in for `nvidia-imex-ctl` (`src/nvidia-imex-ctl.rs`): `-c <cfg> -q` prints `READY`
/// when the stand-in daemon of that config answers.
pub fn imex_ctl() -> &'static Path {
    Path::new(concat!(env!("OUT_DIR"), "/nvidia-imex-ctl"))
}

/// Attaches one stand-in CUDA client to the MPS daemon (or v3 namespace) whose socket
/// directory is `pipe`, with `env` as its own variables (`CUDA_MPS_*` limits it brings), waits
/// for the daemon's first `attached ...` line, then ends the client. The line it got.
///
/// # Errors
/// The client could not run, or ended without attaching (its stderr names why).
pub fn attach_once(pipe: &Path, env: &[(&str, &str)]) -> std::io::Result<String> {
    use std::io::{BufRead, Write};
    use std::process::{Command, Stdio};
    let mut client = Command::new(mps_control())
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    let read = client
        .stdin
        .take()
        .ok_or_else(|| std::io::Error::other("no stdin"))
        .and_then(|mut stdin| stdin.write_all(b"fake_client_attach\n"))
        .and_then(|()| {
            let stdout = client
                .stdout
                .take()
                .ok_or_else(|| std::io::Error::other("no stdout"))?;
            std::io::BufReader::new(stdout).read_line(&mut line)
        });
    let _ = client.kill();
    let output = client.wait_with_output()?;
    read?;
    if line.starts_with("attached") {
        Ok(line.trim_end().to_owned())
    } else {
        Err(std::io::Error::other(format!(
            "the client did not attach: {:?} {}",
            line,
            String::from_utf8_lossy(&output.stderr).trim()
        )))
    }
}
