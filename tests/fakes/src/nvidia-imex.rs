//! A stand-in for NVIDIA's IMEX daemon `nvidia-imex`, for machines without a multi-node NVLink
//! fabric. Compiled on its own (std only, statically linked: `build.rs`), so it runs in the
//! test's process tree and in a daemon pod chrooted into a fake driver root alike.
//!
//! Where drust depends on the real daemon (NVIDIA's IMEX guide, "IMEX Service Config Options";
//! NVIDIA's DRA driver, `cmd/compute-domain-daemon/`), it behaves the same:
//! - `nvidia-imex -c <imexd.cfg>`: the config file, `KEY=VALUE` lines, `#` comments and blank
//!   lines ignored. A file that cannot be read, a line without `=`, or a value that is not
//!   what its key takes is an error on stderr and exit status 1. Read:
//!   `IMEX_NODE_CONFIG_FILE` (default `/etc/nvidia-imex/nodes_config.cfg`), `SERVER_PORT`
//!   (default 50000), `BIND_INTERFACE_IP`, `IMEX_CMD_ENABLED` (default 1), `IMEX_CMD_PORT`
//!   (default 50005), `IMEX_CMD_BIND_INTERFACE_IP`, `IMEX_CMD_UNIX_DOMAIN_PATH`, `DAEMONIZE`,
//!   `LOG_FILE_NAME`; other keys are accepted and ignored.
//! - The nodes file: one IP address or host name per line (blank lines and `#` comments
//!   ignored); read at start (an unreadable or invalid one is fatal) and again on **SIGUSR1**
//!   (an unreadable or invalid one is logged and the previous list kept).
//! - It listens for peers on `BIND_INTERFACE_IP:SERVER_PORT` (all interfaces when empty) and
//!   for `nvidia-imex-ctl` on `IMEX_CMD_UNIX_DOMAIN_PATH` when set, else on
//!   `IMEX_CMD_BIND_INTERFACE_IP:IMEX_CMD_PORT` (127.0.0.1 when empty). Once both listen, it
//!   logs `IMEX daemon ready`. SIGTERM or SIGKILL end it like any process.
//!
//! Where it differs: no GPU, no fabric, no peer protocol (a peer connection is accepted and
//! closed; readiness never waits for a quorum), no authentication or TLS, `DAEMONIZE=1` is
//! refused (the stand-in runs in the foreground only; drust's daemon pods set 0), and the
//! command service speaks a one-line text protocol of its own: `query` answers `READY`,
//! `nodes` answers the nodes of the last good read, one per line, then `reads <n>` (how many
//! times the file was read). The daemon logs each line it acts on (to `LOG_FILE_NAME`, or
//! stderr when empty).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

static RELOAD: AtomicBool = AtomicBool::new(false);

const SIGUSR1: i32 = 10;

unsafe extern "C" {
    fn signal(signum: i32, handler: extern "C" fn(i32)) -> usize;
}

extern "C" fn on_sigusr1(_: i32) {
    // Async-signal-safe: one atomic store; the main loop does the work.
    RELOAD.store(true, Ordering::SeqCst);
}

/// The parsed `imexd.cfg`.
struct Config {
    values: BTreeMap<String, String>,
}

impl Config {
    fn read(path: &str) -> Result<Self, String> {
        let text =
            std::fs::read_to_string(path).map_err(|e| format!("reading config {path}: {e}"))?;
        let mut values = BTreeMap::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (key, value) = line.split_once('=').ok_or_else(|| {
                format!("config {path} line {}: {line:?} is not KEY=VALUE", i + 1)
            })?;
            values.insert(key.trim().to_owned(), value.trim().to_owned());
        }
        Ok(Self { values })
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.values
            .get(key)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    }

    fn port(&self, key: &str, default: u16) -> Result<u16, String> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .parse()
                .map_err(|_| format!("config {key}={v:?}: not a port (0 to 65535)")),
        }
    }

    fn flag(&self, key: &str, default: bool) -> Result<bool, String> {
        match self.get(key) {
            None => Ok(default),
            Some("0") => Ok(false),
            Some("1") => Ok(true),
            Some(v) => Err(format!("config {key}={v:?}: not 0 or 1")),
        }
    }
}

/// The nodes of a nodes file.
fn read_nodes(path: &str) -> Result<Vec<String>, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("reading nodes file {path}: {e}"))?;
    let mut nodes = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let ok = line
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '_'));
        if !ok {
            return Err(format!(
                "nodes file {path} line {}: {line:?} is not an IP address or host name",
                i + 1
            ));
        }
        nodes.push(line.to_owned());
    }
    Ok(nodes)
}

struct State {
    nodes: Vec<String>,
    reads: u64,
}

struct Log(Mutex<Box<dyn Write + Send>>);

impl Log {
    fn line(&self, text: &str) {
        let mut out = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let _ = writeln!(out, "nvidia-imex (stand-in) [{}]: {text}", std::process::id());
        let _ = out.flush();
    }
}

fn answer(line: &str, state: &Mutex<State>) -> String {
    match line.trim() {
        "query" => "READY\n".to_owned(),
        "nodes" => {
            let s = state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let mut out: String = s.nodes.iter().map(|n| format!("{n}\n")).collect();
            out.push_str(&format!("reads {}\n", s.reads));
            out
        }
        other => format!("ERROR unknown command {other:?}\n"),
    }
}

fn serve<S: std::io::Read + Write>(stream: S, state: &Mutex<State>, log: &Log) {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    if reader.read_line(&mut line).is_ok() {
        log.line(&format!("command {:?}", line.trim()));
        let _ = reader.get_mut().write_all(answer(&line, state).as_bytes());
    }
}

fn run(args: &[String]) -> Result<(), String> {
    // First: a SIGUSR1 from a caller that saw the daemon answer must never end it.
    // SAFETY: `on_sigusr1` is an `extern "C" fn(i32)` that only stores to an atomic, which is
    // async-signal-safe; `signal` is libc's, linked statically.
    unsafe {
        signal(SIGUSR1, on_sigusr1);
    }
    let mut config_path = "/etc/nvidia-imex/config.cfg".to_owned();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-c" | "--config" => {
                config_path = it.next().ok_or("-c needs a file")?.clone();
            }
            other => return Err(format!("unknown argument {other:?} (the stand-in takes -c)")),
        }
    }
    let config = Config::read(&config_path)?;
    if config.flag("DAEMONIZE", true)? {
        return Err(format!(
            "config {config_path}: DAEMONIZE=1 (the default) is not supported by the stand-in; \
             set DAEMONIZE=0"
        ));
    }
    // Every value checked before anything starts.
    config.port("SERVER_PORT", 50000)?;
    config.port("IMEX_CMD_PORT", 50005)?;
    config.flag("IMEX_CMD_ENABLED", true)?;
    let log: Arc<Log> = Arc::new(Log(Mutex::new(match config.get("LOG_FILE_NAME") {
        None => Box::new(std::io::stderr()),
        Some(path) => Box::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| format!("opening log file {path}: {e}"))?,
        ),
    })));
    let nodes_path = config
        .get("IMEX_NODE_CONFIG_FILE")
        .unwrap_or("/etc/nvidia-imex/nodes_config.cfg")
        .to_owned();
    let nodes = read_nodes(&nodes_path)?;
    log.line(&format!("read {} nodes from {nodes_path}: {nodes:?}", nodes.len()));
    let state = Arc::new(Mutex::new(State { nodes, reads: 1 }));

    let peer_ip = config.get("BIND_INTERFACE_IP").unwrap_or("0.0.0.0");
    let peer_port = config.port("SERVER_PORT", 50000)?;
    let peers = TcpListener::bind((peer_ip, peer_port))
        .map_err(|e| format!("listening for peers on {peer_ip}:{peer_port}: {e}"))?;
    std::thread::spawn(move || {
        // No peer protocol: a peer's connection is accepted and closed.
        for stream in peers.incoming() {
            drop(stream);
        }
    });

    if config.flag("IMEX_CMD_ENABLED", true)? {
        if let Some(path) = config.get("IMEX_CMD_UNIX_DOMAIN_PATH") {
            let _ = std::fs::remove_file(path);
            let listener = UnixListener::bind(path)
                .map_err(|e| format!("listening for commands on {path}: {e}"))?;
            let (state, log) = (Arc::clone(&state), Arc::clone(&log));
            std::thread::spawn(move || {
                for stream in listener.incoming().flatten() {
                    serve(stream, &state, &log);
                }
            });
        } else {
            let ip = config
                .get("IMEX_CMD_BIND_INTERFACE_IP")
                .unwrap_or("127.0.0.1");
            let port = config.port("IMEX_CMD_PORT", 50005)?;
            let listener = TcpListener::bind((ip, port))
                .map_err(|e| format!("listening for commands on {ip}:{port}: {e}"))?;
            let (state, log) = (Arc::clone(&state), Arc::clone(&log));
            std::thread::spawn(move || {
                for stream in listener.incoming().flatten() {
                    serve(stream, &state, &log);
                }
            });
        }
    }
    log.line("IMEX daemon ready");
    loop {
        std::thread::sleep(Duration::from_millis(50));
        if RELOAD.swap(false, Ordering::SeqCst) {
            match read_nodes(&nodes_path) {
                Ok(nodes) => {
                    log.line(&format!(
                        "SIGUSR1: read {} nodes from {nodes_path}: {nodes:?}",
                        nodes.len()
                    ));
                    let mut s = state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    s.nodes = nodes;
                    s.reads += 1;
                }
                Err(e) => log.line(&format!("SIGUSR1: {e}; keeping the previous nodes")),
            }
        }
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nvidia-imex (stand-in): {e}");
            ExitCode::FAILURE
        }
    }
}
