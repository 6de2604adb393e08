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
//! **MPS v3** (NVIDIA's MPS guide, "MPS v3 Interface" and "MPS v3 Namespaces"; driver r615+):
//! `-d`/`-f` with `-p 3` (or `CUDA_MPS_PROTOCOL_VERSION=3`) start a v3 daemon, `-m` is
//! accepted (multiuser) and logged. A v3 daemon takes `module verb` commands as arguments
//! (`nvidia-cuda-mps-control server create drust --uid=0`), answers a failed one with a message
//! on stderr and exit status 1, and refuses the legacy commands on stdin (and a legacy daemon
//! refuses v3 commands): a caller that mixes them up fails. Modules: `server create|list`,
//! `namespace create|set|list|delete` with the documented `--key=value` options and
//! `--format=csv,noheader` columns. Each namespace listens on
//! `$CUDA_MPS_PIPE_DIRECTORY/<server>/<namespace>/control`, its directory created when missing
//! and kept as it is (as the daemon's own directories are); a `fake_client_attach` there is held
//! to the namespace's limits, which override the client's thread percentage and bound its
//! memory (the guide's environment-variable notes for v3), logged as `client attached
//! namespace=<name> pinned=... threads=... ceiling pinned=<limit or -> threads=<N>`.
//! `-q` quits a daemon of either protocol.
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
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    let result = match words[..] {
        [] => client(None),
        ["-q"] | ["--quit"] => client(Some("quit".to_owned())),
        [first, ..] if first == "-d" || first == "-f" => daemon_options(&words[1..])
            .and_then(|options| {
                if first == "-d" {
                    background(&options)
                } else {
                    foreground(&options)
                }
            }),
        [module, ..] if !module.starts_with('-') => client(Some(format!("v3 {}", words.join(" ")))),
        _ => Err("usage: nvidia-cuda-mps-control [-d | -f] [-p 2|3] [-m] | -q | <module> <verb> ...".to_owned()),
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

/// The daemon's options after `-d` or `-f`: `-p 2|3` (or `CUDA_MPS_PROTOCOL_VERSION`, which
/// wins when both are set, as the guide says) and `-m`. The protocol and multiuser mode.
#[derive(Debug, Clone, Copy)]
struct Options {
    protocol: u8,
    multiuser: bool,
}

fn daemon_options(words: &[&str]) -> Result<Options, String> {
    let mut options = Options {
        protocol: 2,
        multiuser: false,
    };
    let mut rest = words.iter();
    while let Some(word) = rest.next() {
        match *word {
            "-m" | "--multiuser" => options.multiuser = true,
            "-p" | "--protocol" => {
                options.protocol = match rest.next().copied() {
                    Some("2") => 2,
                    Some("3") => 3,
                    other => return Err(format!("invalid protocol: {other:?}")),
                }
            }
            other => return Err(format!("unknown option: {other}")),
        }
    }
    match std::env::var("CUDA_MPS_PROTOCOL_VERSION").as_deref() {
        Ok("3") => options.protocol = 3,
        Ok("2") => options.protocol = 2,
        _ => {}
    }
    Ok(options)
}

/// `-d`: the daemon in its own process group, detached from our stdio, so whoever ran `-d`
/// sees it return (and its pipes close) while the daemon lives on.
fn background(options: &Options) -> Result<(), String> {
    may_start()?;
    let me = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
    let mut args = vec!["-f".to_owned(), "-p".to_owned(), options.protocol.to_string()];
    if options.multiuser {
        args.push("-m".to_owned());
    }
    Command::new(me)
        .args(args)
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
    /// 2 (legacy) or 3.
    protocol: u8,
    /// v3: named servers and their namespaces.
    servers: Mutex<BTreeMap<String, V3Server>>,
}

/// A v3 server: its owner, devices and namespaces (by name).
struct V3Server {
    uid: String,
    allowed_devices: String,
    namespaces: BTreeMap<String, Namespace>,
}

/// A v3 namespace's limits as set (`None`: not set).
#[derive(Clone, Default)]
struct Namespace {
    pinned: Option<String>,
    threads: Option<String>,
}

impl Daemon {
    fn log(&self, line: &str) {
        let mut log = self.log.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let _ = writeln!(log, "{line}");
    }
}

/// `-f`: serves until `quit`.
fn foreground(options: &Options) -> Result<(), String> {
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
        protocol: options.protocol,
        servers: Mutex::new(BTreeMap::new()),
    });
    daemon.log(&format!(
        "start CUDA_VISIBLE_DEVICES={} pid={}",
        std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default(),
        std::process::id(),
    ));
    daemon.log(&format!(
        "options protocol={} multiuser={}",
        options.protocol, options.multiuser
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

fn serve(daemon: &Arc<Daemon>, mut conn: UnixStream) {
    let mut request = String::new();
    if conn.read_to_string(&mut request).is_err() {
        return;
    }
    let v3 = request.starts_with("v3 ");
    if request.trim() != "quit" && v3 != (daemon.protocol == 3) {
        daemon.log(&format!("refused {}", request.trim()));
        let _ = conn.write_all(
            format!(
                "error: this daemon speaks MPS protocol {}: {}\n",
                daemon.protocol,
                request.trim()
            )
            .as_bytes(),
        );
        return;
    }
    if let Some(command) = request.strip_prefix("v3 ") {
        daemon.log(&format!("cmd {}", command.trim()));
        let answer = match v3_command(daemon, command.trim()) {
            Ok(out) => out,
            Err(e) => format!("error: {e}"),
        };
        let _ = conn.write_all(format!("{answer}\n").as_bytes());
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
fn attached(daemon: &Daemon, conn: UnixStream, limits: &str) {
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
    stream_attached(daemon, conn);
}

/// An attached client's connection: a line every 200 ms until it goes away.
fn stream_attached(daemon: &Daemon, mut conn: UnixStream) {
    for n in 0u64.. {
        let line = format!("attached {} {n}\n", std::process::id());
        if conn.write_all(line.as_bytes()).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    daemon.log("client detached");
}

/// A client: sends `command` (else the commands on stdin) to the daemon of
/// `CUDA_MPS_PIPE_DIRECTORY` and prints its answers; an answer starting `error: ` goes to
/// stderr and fails.
fn client(command: Option<String>) -> Result<(), String> {
    let control = control_socket()?;
    let mut conn = UnixStream::connect(&control)
        .map_err(|_| "Cannot find MPS control daemon process".to_owned())?;
    let mut commands = String::new();
    match command {
        Some(c) => commands = c,
        None => {
            std::io::stdin()
                .read_to_string(&mut commands)
                .map_err(|e| format!("stdin: {e}"))?;
        }
    }
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
    let mut first = true;
    loop {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => return Ok(()),
            Ok(n) => {
                if first && buf[..n].starts_with(b"error: ") {
                    let mut rest = String::from_utf8_lossy(&buf[7..n]).into_owned();
                    let _ = conn.read_to_string(&mut rest);
                    return Err(rest.trim().to_owned());
                }
                first = false;
                let _ = stdout.write_all(&buf[..n]);
                let _ = stdout.flush();
            }
        }
    }
}

/// The v3 name rule: lowercase letters, digits and underscores, up to 64 characters.
fn valid_name(name: &str) -> Result<(), String> {
    if name.is_empty()
        || name.len() > 64
        || !name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        return Err(format!("invalid name: {name:?}"));
    }
    Ok(())
}

/// One v3 command (`module verb args`): its output, or the error to report.
fn v3_command(daemon: &Arc<Daemon>, command: &str) -> Result<String, String> {
    let words: Vec<&str> = command.split_whitespace().collect();
    let mut positional = Vec::new();
    let mut options = BTreeMap::new();
    for w in words.iter().skip(2) {
        match w.strip_prefix("--") {
            Some(o) => match o.split_once('=') {
                Some((k, v)) => options.insert(k, v),
                None => options.insert(o, ""),
            },
            None => {
                positional.push(*w);
                None
            }
        };
    }
    let pipe = daemon.control.parent().map(PathBuf::from).unwrap_or_default();
    let csv = options.get("format").is_some_and(|f| f.starts_with("csv"));
    let mut servers = daemon.servers.lock().unwrap();
    let server_of = |options: &BTreeMap<&str, &str>| -> Result<String, String> {
        options
            .get("server")
            .map(|s| (*s).to_owned())
            .ok_or_else(|| "--server=<s> is required".to_owned())
    };
    match (words.first().copied(), words.get(1).copied(), &positional[..]) {
        (Some("server"), Some("create"), [name]) => {
            valid_name(name)?;
            if servers.contains_key(*name) {
                return Err(format!("server {name} already exists"));
            }
            std::fs::create_dir_all(pipe.join(name)).map_err(|e| e.to_string())?;
            servers.insert(
                (*name).to_owned(),
                V3Server {
                    uid: options.get("uid").copied().unwrap_or("0").to_owned(),
                    allowed_devices: options.get("allowed-devices").copied().unwrap_or("all").to_owned(),
                    namespaces: BTreeMap::new(),
                },
            );
            Ok(String::new())
        }
        (Some("server"), Some("list"), names) => {
            if let [name] = names
                && !servers.contains_key(*name)
            {
                return Err(format!("no server {name}"));
            }
            let rows: Vec<String> = servers
                .iter()
                .filter(|(n, _)| names.is_empty() || names.contains(&n.as_str()))
                .map(|(n, s)| {
                    format!(
                        "{n},{},{},Ready,{},{},-",
                        s.uid,
                        std::process::id(),
                        pipe.join(n).display(),
                        s.allowed_devices
                    )
                })
                .collect();
            Ok(table(csv, "NAME,UID,PID,STATUS,PIPE-DIRECTORY,ALLOWED-DEVICES,CONTEXT-IDS", rows))
        }
        (Some("namespace"), Some("create"), [name]) => {
            valid_name(name)?;
            let server = server_of(&options)?;
            let s = servers.get_mut(&server).ok_or_else(|| format!("no server {server}"))?;
            if s.namespaces.contains_key(*name) {
                return Err(format!("namespace {name} already exists on server {server}"));
            }
            let dir = pipe.join(&server).join(name);
            std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
            let socket = dir.join("control");
            let _ = std::fs::remove_file(&socket);
            let listener = UnixListener::bind(&socket).map_err(|e| format!("{}: {e}", socket.display()))?;
            s.namespaces.insert((*name).to_owned(), Namespace::default());
            let (daemon, server, name) = (Arc::clone(daemon), server.clone(), (*name).to_owned());
            std::thread::spawn(move || {
                for conn in listener.incoming().flatten() {
                    let daemon = Arc::clone(&daemon);
                    let (server, name) = (server.clone(), name.clone());
                    std::thread::spawn(move || namespace_client(&daemon, conn, &server, &name));
                }
            });
            Ok(String::new())
        }
        (Some("namespace"), Some("set"), [name]) => {
            let server = server_of(&options)?;
            let ns = servers
                .get_mut(&server)
                .and_then(|s| s.namespaces.get_mut(*name))
                .ok_or_else(|| format!("no namespace {name} on server {server}"))?;
            let pinned = options.get("pinned-memory-limit");
            let threads = options.get("active-thread-percentage");
            if pinned.is_none() && threads.is_none() {
                return Err("namespace set needs at least one option".into());
            }
            if let Some(t) = threads {
                match t.parse::<u32>() {
                    Ok(1..=100) => {}
                    _ => return Err(format!("invalid active thread percentage: {t}")),
                }
            }
            if let Some(p) = pinned {
                ns.pinned = Some((*p).to_owned());
            }
            if let Some(t) = threads {
                ns.threads = Some((*t).to_owned());
            }
            Ok(String::new())
        }
        (Some("namespace"), Some("list"), names) => {
            let wanted_server = options.get("server").copied();
            let mut rows = Vec::new();
            for (sname, s) in servers.iter().filter(|(n, _)| wanted_server.is_none_or(|w| w == n.as_str())) {
                for (n, ns) in &s.namespaces {
                    if names.is_empty() || names.contains(&n.as_str()) {
                        rows.push(format!(
                            "{n},{sname},Ready,{},{},0,{}",
                            ns.pinned.as_deref().unwrap_or("-"),
                            ns.threads.as_deref().unwrap_or("-"),
                            pipe.join(sname).join(n).display()
                        ));
                    }
                }
            }
            if let [name] = names
                && rows.is_empty()
            {
                return Err(format!("no namespace {name}"));
            }
            Ok(table(
                csv,
                "NAME,SERVER,SERVER-STATUS,PINNED-MEMORY-LIMIT,ACTIVE-THREAD-PERCENTAGE,CLIENT-PRIORITY,PIPE-DIRECTORY",
                rows,
            ))
        }
        (Some("namespace"), Some("delete"), [name]) => {
            let server = server_of(&options)?;
            let s = servers.get_mut(&server).ok_or_else(|| format!("no server {server}"))?;
            s.namespaces
                .remove(*name)
                .ok_or_else(|| format!("no namespace {name} on server {server}"))?;
            let _ = std::fs::remove_dir_all(pipe.join(&server).join(name));
            Ok(String::new())
        }
        _ => Err(format!("unknown command: {command}")),
    }
}

/// Rows as `--format=csv,noheader` prints them, else under a header.
fn table(csv: bool, header: &str, rows: Vec<String>) -> String {
    if csv {
        rows.join("\n")
    } else {
        std::iter::once(header.replace(',', " "))
            .chain(rows.iter().map(|r| r.replace(',', " ")))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// A client on a namespace's socket: only `fake_client_attach`, held to the namespace's limits.
fn namespace_client(daemon: &Arc<Daemon>, mut conn: UnixStream, server: &str, name: &str) {
    let mut request = String::new();
    if conn.read_to_string(&mut request).is_err() {
        return;
    }
    let Some(limits) = request.trim().strip_prefix("fake_client_attach") else {
        let _ = conn.write_all(b"error: a namespace socket takes clients only\n");
        return;
    };
    let ns = daemon
        .servers
        .lock()
        .unwrap()
        .get(server)
        .and_then(|s| s.namespaces.get(name).cloned());
    let Some(ns) = ns else {
        // Deleted meanwhile: nobody serves this socket any more.
        return;
    };
    let ceiling = format!(
        "ceiling pinned={} threads={}",
        ns.pinned.as_deref().unwrap_or("-"),
        ns.threads.as_deref().unwrap_or("100")
    );
    daemon.log(&format!("client attached namespace={name}{limits} {ceiling}"));
    stream_attached(daemon, conn);
}
