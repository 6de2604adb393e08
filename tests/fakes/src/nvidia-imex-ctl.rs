//! A stand-in for NVIDIA's `nvidia-imex-ctl`, the IMEX daemon's query tool, talking to the
//! stand-in daemon (`nvidia-imex.rs`, which says where both differ from the real tools).
//! Std only, statically linked (`build.rs`).
//!
//! - `nvidia-imex-ctl -c <imexd.cfg> -q`: prints `READY` and exits 0 when the daemon that
//!   config names answers on its command service (`IMEX_CMD_UNIX_DOMAIN_PATH` when set, else
//!   `IMEX_CMD_BIND_INTERFACE_IP` (127.0.0.1 when empty) and `IMEX_CMD_PORT`, default 50005);
//!   otherwise prints `NOT_READY` and exits 1. `--u=<socket>` (as NVIDIA's driver passes for a
//!   host daemon) names the Unix socket instead of the config's, and needs no `-c`.
//! - `-N`: prints the nodes the daemon read last, one per line, then `reads <n>` (the real
//!   tool prints a connection table instead).
//! - A config that cannot be read or parsed: the error on stderr, exit status 2.
//!   Each try to reach the daemon has a 2 s deadline.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::process::ExitCode;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(2);

fn read_config(path: &str) -> Result<BTreeMap<String, String>, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("reading config {path}: {e}"))?;
    let mut values = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (k, v) = line
            .split_once('=')
            .ok_or_else(|| format!("config {path} line {}: {line:?} is not KEY=VALUE", i + 1))?;
        values.insert(k.trim().to_owned(), v.trim().to_owned());
    }
    Ok(values)
}

fn ask(stream: &mut dyn ReadWrite, command: &str) -> std::io::Result<String> {
    stream.write_all(format!("{command}\n").as_bytes())?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    Ok(answer)
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

fn connect(
    config: &BTreeMap<String, String>,
    socket: Option<&str>,
) -> Result<Box<dyn ReadWrite>, String> {
    let get = |k: &str| config.get(k).map(String::as_str).filter(|v| !v.is_empty());
    if let Some(path) = socket.or_else(|| get("IMEX_CMD_UNIX_DOMAIN_PATH")) {
        let s = UnixStream::connect(path).map_err(|e| format!("connecting to {path}: {e}"))?;
        s.set_read_timeout(Some(DEADLINE)).map_err(|e| e.to_string())?;
        s.set_write_timeout(Some(DEADLINE)).map_err(|e| e.to_string())?;
        return Ok(Box::new(s));
    }
    let ip = get("IMEX_CMD_BIND_INTERFACE_IP").unwrap_or("127.0.0.1");
    let port: u16 = match get("IMEX_CMD_PORT") {
        None => 50005,
        Some(p) => p
            .parse()
            .map_err(|_| format!("config IMEX_CMD_PORT={p:?}: not a port"))?,
    };
    let addr = (ip, port)
        .to_socket_addrs()
        .map_err(|e| format!("{ip}:{port}: {e}"))?
        .next()
        .ok_or_else(|| format!("{ip}:{port}: no address"))?;
    let s = TcpStream::connect_timeout(&addr, DEADLINE)
        .map_err(|e| format!("connecting to {addr}: {e}"))?;
    s.set_read_timeout(Some(DEADLINE)).map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(DEADLINE)).map_err(|e| e.to_string())?;
    Ok(Box::new(s))
}

fn main() -> ExitCode {
    let mut config_path = None;
    let (mut query, mut nodes, mut socket) = (false, false, None);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "-c" => match args.next() {
                Some(p) => config_path = Some(p),
                None => {
                    eprintln!("nvidia-imex-ctl (stand-in): -c needs a file");
                    return ExitCode::from(2);
                }
            },
            "-q" => query = true,
            "-N" => nodes = true,
            other if other.starts_with("--u=") => socket = Some(other[4..].to_owned()),
            other => {
                eprintln!("nvidia-imex-ctl (stand-in): unknown argument {other:?}");
                return ExitCode::from(2);
            }
        }
    }
    // `--u=<socket>` alone needs no config (how NVIDIA's driver asks a host daemon).
    let config = match (&config_path, &socket) {
        (None, Some(_)) => Ok(BTreeMap::new()),
        (path, _) => read_config(path.as_deref().unwrap_or("/etc/nvidia-imex/config.cfg")),
    };
    let config = match config {
        Ok(c) => c,
        Err(e) => {
            eprintln!("nvidia-imex-ctl (stand-in): {e}");
            return ExitCode::from(2);
        }
    };
    let command = match (query, nodes) {
        (true, false) => "query",
        (false, true) => "nodes",
        _ => {
            eprintln!("nvidia-imex-ctl (stand-in): give one of -q, -N");
            return ExitCode::from(2);
        }
    };
    let answer = connect(&config, socket.as_deref())
        .and_then(|mut s| ask(s.as_mut(), command).map_err(|e| e.to_string()));
    match answer {
        Ok(text) if command == "nodes" || text == "READY\n" => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Ok(text) => {
            println!("NOT_READY");
            eprintln!("nvidia-imex-ctl (stand-in): the daemon answered {text:?}");
            ExitCode::FAILURE
        }
        Err(e) => {
            println!("NOT_READY");
            eprintln!("nvidia-imex-ctl (stand-in): {e}");
            ExitCode::FAILURE
        }
    }
}
