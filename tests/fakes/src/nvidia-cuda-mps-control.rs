//! A stand-in for NVIDIA's `nvidia-cuda-mps-control`, for machines without a GPU.
//!
//! It is compiled on its own (std only, statically linked: `build.rs`), so the same file runs
//! in the plugin's process tree, in an MPS daemon pod chrooted into a fake driver root, and in a
//! busybox workload container that gets it through the claim's CDI spec.
//!
//! It behaves like the real tool where drust depends on it (NVIDIA's MPS guide, "Control
//! daemon" and "nvidia-cuda-mps-control"):
//! - `-d`: start the control daemon in the background and return at once; it listens on
//!   `$CUDA_MPS_PIPE_DIRECTORY/control` shortly after. Needs `CUDA_MPS_PIPE_DIRECTORY` and
//!   `CUDA_MPS_LOG_DIRECTORY`.
//! - `-f`: the same daemon in the foreground (how a daemon pod runs it).
//! - no arguments: client; sends the commands on stdin to the daemon of
//!   `CUDA_MPS_PIPE_DIRECTORY`, prints its answers; exits 1 when no daemon answers.
//!
//! Commands: `get_server_list`, `set_default_active_thread_percentage N`,
//! `get_default_active_thread_percentage`, `set_default_device_pinned_mem_limit DEV LIMIT`,
//! `get_default_device_pinned_mem_limit DEV`, `quit`. One command only the fake knows,
//! `fake_client_attach`, stands for a CUDA client connected to the daemon: the daemon keeps the
//! connection open and writes `attached <daemon pid> <n>` every 200 ms until the client goes;
//! the client prints those lines and returns when the daemon is gone. The client sends the
//! per-client limits of its environment with it, as a CUDA client brings them to its server
//! (`pinned=<CUDA_MPS_PINNED_DEVICE_MEM_LIMIT> threads=<CUDA_MPS_ACTIVE_THREAD_PERCENTAGE>`,
//! `-` when unset), and the daemon logs them: `client attached pinned=0=20480M threads=25`.
//!
//! Servers: `start_server -uid N`, or else the first attached client, starts the one MPS server (as root's, with the daemon's
//! pid) with the defaults of that moment; `get_server_list` lists it once it exists, and
//! `set_device_pinned_mem_limit PID DEV LIMIT` / `set_active_thread_percentage PID N` change its
//! limits for clients attaching later (an unknown PID answers `invalid server`). A client's
//! limits are ceilings it cannot raise (NVIDIA's MPS guide: a client's variables only lower the
//! server's), so the daemon also logs what holds for it: `... ceiling pinned=<DEV=LIMIT or ->
//! threads=<N>` from its server.
//!
//! The daemon records `CUDA_VISIBLE_DEVICES`, its pid and every command in
//! `$CUDA_MPS_LOG_DIRECTORY/control.log`. Test knobs: `FAKE_MPS_START_DELAY_SECONDS` delays
//! listening; `FAKE_MPS_FAIL_START=1` makes the daemon fail at start.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        [] => client(),
        ["-d"] => background(),
        ["-f"] => foreground(),
        _ => Err("usage: nvidia-cuda-mps-control [-d | -f]".to_owned()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

fn dir_from_env(name: &str) -> Result<PathBuf, String> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .ok_or_else(|| format!("{name} is not set"))
}

fn control_socket() -> Result<PathBuf, String> {
    Ok(dir_from_env("CUDA_MPS_PIPE_DIRECTORY")?.join("control"))
}

/// Checks shared by `-d` and `-f`: the directories are set, no daemon answers already.
fn may_start() -> Result<PathBuf, String> {
    let control = control_socket()?;
    dir_from_env("CUDA_MPS_LOG_DIRECTORY")?;
    if std::env::var("FAKE_MPS_FAIL_START").as_deref() == Ok("1") {
        return Err("An instance of this daemon is already running (injected failure)".into());
    }
    if UnixStream::connect(&control).is_ok() {
        return Err("An instance of this daemon is already running".into());
    }
    Ok(control)
}

/// `-d`: the daemon in its own process group, detached from our stdio, so whoever ran `-d`
/// sees it return (and its pipes close) while the daemon lives on.
fn background() -> Result<(), String> {
    may_start()?;
    let me = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
    Command::new(me)
        .arg("-f")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(|e| format!("starting the daemon: {e}"))?;
    Ok(())
}

struct Daemon {
    log: Mutex<std::fs::File>,
    percentage: Mutex<String>,
    limits: Mutex<BTreeMap<String, String>>,
    /// The server, once a client started it: its thread percentage and pinned limits by device.
    server: Mutex<Option<(String, BTreeMap<String, String>)>>,
    control: PathBuf,
}

impl Daemon {
    fn log(&self, line: &str) {
        let mut log = self.log.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let _ = writeln!(log, "{line}");
    }
}

/// `-f`: serves until `quit`.
fn foreground() -> Result<(), String> {
    let control = may_start()?;
    let log_dir = dir_from_env("CUDA_MPS_LOG_DIRECTORY")?;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_dir.join("control.log"))
        .map_err(|e| format!("{}: {e}", log_dir.display()))?;
    let daemon = Arc::new(Daemon {
        log: Mutex::new(log),
        percentage: Mutex::new("100.0".into()),
        limits: Mutex::new(BTreeMap::new()),
        server: Mutex::new(None),
        control: control.clone(),
    });
    daemon.log(&format!(
        "start CUDA_VISIBLE_DEVICES={} pid={}",
        std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default(),
        std::process::id()
    ));
    if let Some(delay) = std::env::var("FAKE_MPS_START_DELAY_SECONDS")
        .ok()
        .and_then(|d| d.parse::<f64>().ok())
    {
        std::thread::sleep(Duration::from_secs_f64(delay));
    }
    // A socket left by a daemon that died (nothing answered in `may_start`).
    let _ = std::fs::remove_file(&control);
    let staging = control.with_extension("tmp");
    let _ = std::fs::remove_file(&staging);
    let listener = UnixListener::bind(&staging)
        .and_then(|l| std::fs::rename(&staging, &control).map(|()| l))
        .map_err(|e| format!("{}: {e}", control.display()))?;
    for conn in listener.incoming().flatten() {
        let daemon = Arc::clone(&daemon);
        std::thread::spawn(move || serve(&daemon, conn));
    }
    Ok(())
}

fn serve(daemon: &Daemon, mut conn: UnixStream) {
    let mut request = String::new();
    if conn.read_to_string(&mut request).is_err() {
        return;
    }
    let mut out = Vec::new();
    let mut quit = false;
    for line in request.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let Some((&command, args)) = words.split_first() else {
            continue;
        };
        daemon.log(&format!("cmd {line}"));
        match (command, args) {
            ("start_server", ["-uid", _uid]) => {
                daemon.server.lock().unwrap().get_or_insert_with(|| {
                    (
                        daemon.percentage.lock().unwrap().clone(),
                        daemon.limits.lock().unwrap().clone(),
                    )
                });
            }
            ("get_server_list", []) => {
                if daemon.server.lock().unwrap().is_some() {
                    out.push(std::process::id().to_string());
                }
            }
            ("set_device_pinned_mem_limit", [pid, device, limit]) => {
                match daemon.server.lock().unwrap().as_mut() {
                    Some((_, limits)) if *pid == std::process::id().to_string() => {
                        limits.insert((*device).to_owned(), (*limit).to_owned());
                    }
                    _ => out.push(format!("invalid server: {pid}")),
                }
            }
            ("set_active_thread_percentage", [pid, pct]) => {
                match (daemon.server.lock().unwrap().as_mut(), pct.parse::<f64>()) {
                    (Some((threads, _)), Ok(p)) if *pid == std::process::id().to_string() => {
                        *threads = format!("{p:.1}");
                    }
                    _ => out.push(format!("invalid server or percentage: {pid} {pct}")),
                }
            }
            ("set_default_active_thread_percentage", [pct]) => match pct.parse::<f64>() {
                Ok(p) => *daemon.percentage.lock().unwrap() = format!("{p:.1}"),
                Err(_) => out.push(format!("invalid percentage: {pct}")),
            },
            ("get_default_active_thread_percentage", []) => {
                out.push(daemon.percentage.lock().unwrap().clone());
            }
            ("set_default_device_pinned_mem_limit", [device, limit]) => {
                daemon
                    .limits
                    .lock()
                    .unwrap()
                    .insert((*device).to_owned(), (*limit).to_owned());
            }
            ("get_default_device_pinned_mem_limit", [device]) => out.push(
                daemon
                    .limits
                    .lock()
                    .unwrap()
                    .get(*device)
                    .cloned()
                    .unwrap_or_else(|| "0".into()),
            ),
            ("fake_client_attach", limits) => return attached(daemon, conn, &limits.join(" ")),
            ("quit", []) => quit = true,
            _ => out.push(format!("unknown command: {line}")),
        }
    }
    let _ = conn.write_all(format!("{}\n", out.join("\n")).as_bytes());
    if quit {
        let _ = std::fs::remove_file(&daemon.control);
        daemon.log("quit");
        std::process::exit(0);
    }
}

/// A connected client: a line every 200 ms until it goes away.
fn attached(daemon: &Daemon, mut conn: UnixStream, limits: &str) {
    let ceiling = {
        let mut server = daemon.server.lock().unwrap();
        let (threads, pinned) = server.get_or_insert_with(|| {
            (
                daemon.percentage.lock().unwrap().clone(),
                daemon.limits.lock().unwrap().clone(),
            )
        });
        let pinned = pinned
            .iter()
            .map(|(d, l)| format!("{d}={l}"))
            .collect::<Vec<_>>()
            .join(",");
        format!(
            "ceiling pinned={} threads={threads}",
            if pinned.is_empty() { "-" } else { &pinned }
        )
    };
    daemon.log(&format!("client attached {limits} {ceiling}"));
    for n in 0u64.. {
        let line = format!("attached {} {n}\n", std::process::id());
        if conn.write_all(line.as_bytes()).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    daemon.log("client detached");
}

fn client() -> Result<(), String> {
    let control = control_socket()?;
    let mut conn = UnixStream::connect(&control)
        .map_err(|_| "Cannot find MPS control daemon process".to_owned())?;
    let mut commands = String::new();
    std::io::stdin()
        .read_to_string(&mut commands)
        .map_err(|e| format!("stdin: {e}"))?;
    if commands.trim() == "fake_client_attach" {
        let var = |name: &str| std::env::var(name).unwrap_or_else(|_| "-".into());
        commands = format!(
            "fake_client_attach pinned={} threads={}",
            var("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
            var("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
        );
    }
    conn.write_all(format!("{}\n", commands.trim()).as_bytes())
        .and_then(|()| conn.shutdown(std::net::Shutdown::Write))
        .map_err(|e| format!("{}: {e}", control.display()))?;
    // Answers as they come (an attached client streams until the daemon goes).
    let mut stdout = std::io::stdout();
    let mut buf = [0u8; 4096];
    loop {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => return Ok(()),
            Ok(n) => {
                let _ = stdout.write_all(&buf[..n]);
                let _ = stdout.flush();
            }
        }
    }
}
