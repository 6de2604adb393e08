//! The IMEX stand-ins from the outside: `nvidia-imex -c <cfg>` with a nodes file,
//! `nvidia-imex-ctl -c <cfg> -q` answering `READY` while it runs and not after it is killed,
//! SIGUSR1 re-reading the nodes file, and bad configs failing with the error on stderr.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

/// Generous: nothing here waits on anything slower than a process start.
const DEADLINE: Duration = Duration::from_secs(30);

struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("drust-imex-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        Self(dir)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

fn ctl(cfg: &Path, flag: &str) -> Output {
    Command::new(drust_fakes::imex_ctl())
        .args(["-c".as_ref(), cfg.as_os_str(), flag.as_ref()])
        .output()
        .expect("nvidia-imex-ctl runs")
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn config(dir: &Path, unix: bool) -> PathBuf {
    let nodes = dir.join("nodes.cfg");
    std::fs::write(
        &nodes,
        "10.0.0.1\n# a comment\n\ncompute-domain-daemon-0001\n",
    )
    .expect("nodes");
    let cmd = if unix {
        format!(
            "IMEX_CMD_UNIX_DOMAIN_PATH={}\n",
            dir.join("imex.sock").display()
        )
    } else {
        format!(
            "IMEX_CMD_BIND_INTERFACE_IP=127.0.0.1\nIMEX_CMD_PORT={}\n",
            free_port()
        )
    };
    let cfg = dir.join("imexd.cfg");
    std::fs::write(
        &cfg,
        format!(
            "# rendered by a test\nDAEMONIZE=0\nLOG_FILE_NAME={}\nBIND_INTERFACE_IP=127.0.0.1\n\
             SERVER_PORT={}\nIMEX_NODE_CONFIG_FILE={}\nIMEX_CMD_ENABLED=1\n{cmd}\
             IMEX_WAIT_FOR_QUORUM=RECOVERY\n",
            dir.join("imex.log").display(),
            free_port(),
            nodes.display()
        ),
    )
    .expect("cfg");
    cfg
}

fn start(cfg: &Path) -> Daemon {
    Daemon(
        Command::new(drust_fakes::imex())
            .arg("-c")
            .arg(cfg)
            .spawn()
            .expect("nvidia-imex starts"),
    )
}

#[test]
fn the_daemon_answers_ready_rereads_its_nodes_on_sigusr1_and_is_not_ready_once_killed() {
    for unix in [false, true] {
        let dir = Dir::new(if unix { "unix" } else { "tcp" });
        let cfg = config(&dir.0, unix);
        let before = ctl(&cfg, "-q");
        assert!(!before.status.success(), "no daemon yet: {before:?}");
        assert_ne!(before.stdout, b"READY\n");

        let mut daemon = start(&cfg);
        wait_for("READY", || ctl(&cfg, "-q").stdout == b"READY\n");
        let nodes = ctl(&cfg, "-N");
        assert_eq!(
            String::from_utf8_lossy(&nodes.stdout),
            "10.0.0.1\ncompute-domain-daemon-0001\nreads 1\n"
        );

        std::fs::write(dir.0.join("nodes.cfg"), "10.0.0.1\n10.0.0.2\n10.0.0.3\n").expect("nodes");
        let status = Command::new("kill")
            .args(["-USR1", &daemon.0.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success());
        wait_for("the nodes re-read", || {
            ctl(&cfg, "-N").stdout == b"10.0.0.1\n10.0.0.2\n10.0.0.3\nreads 2\n"
        });
        assert!(
            daemon.0.try_wait().expect("try_wait").is_none(),
            "SIGUSR1 ends nothing"
        );

        // A bad nodes file at SIGUSR1 keeps the previous list.
        std::fs::write(dir.0.join("nodes.cfg"), "10.0.0.1 oops\n").expect("nodes");
        Command::new("kill")
            .args(["-USR1", &daemon.0.id().to_string()])
            .status()
            .expect("kill runs");
        let log = dir.0.join("imex.log");
        wait_for("the bad read logged", || {
            std::fs::read_to_string(&log).is_ok_and(|l| l.contains("keeping the previous nodes"))
        });
        assert_eq!(
            ctl(&cfg, "-N").stdout,
            b"10.0.0.1\n10.0.0.2\n10.0.0.3\nreads 2\n"
        );

        if unix {
            // NVIDIA's host-daemon probe: the socket alone, no config.
            let sock = dir.0.join("imex.sock");
            let out = Command::new(drust_fakes::imex_ctl())
                .arg("-q")
                .arg(format!("--u={}", sock.display()))
                .output()
                .expect("nvidia-imex-ctl runs");
            assert_eq!(out.stdout, b"READY\n", "{out:?}");
        }
        daemon.0.kill().expect("kill");
        daemon.0.wait().expect("wait");
        let after = ctl(&cfg, "-q");
        assert!(!after.status.success(), "killed: {after:?}");
        assert_eq!(String::from_utf8_lossy(&after.stdout), "NOT_READY\n");
    }
}

#[test]
fn bad_configs_fail_with_the_error_on_stderr() {
    let dir = Dir::new("bad");
    let missing = dir.0.join("missing.cfg");
    let out = ctl(&missing, "-q");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("missing.cfg"),
        "{out:?}"
    );

    let cases = [
        (
            "no-equals.cfg",
            "DAEMONIZE=0\nSERVER_PORT\n",
            "is not KEY=VALUE",
        ),
        ("daemonize.cfg", "SERVER_PORT=1\n", "DAEMONIZE=1"),
        ("port.cfg", "DAEMONIZE=0\nSERVER_PORT=70000\n", "not a port"),
        (
            "nodes.cfg",
            "DAEMONIZE=0\nIMEX_NODE_CONFIG_FILE=/nonexistent/nodes.cfg\n",
            "/nonexistent/nodes.cfg",
        ),
    ];
    for (name, text, want) in cases {
        let cfg = dir.0.join(name);
        std::fs::write(&cfg, text).expect("cfg");
        let out = Command::new(drust_fakes::imex())
            .arg("-c")
            .arg(&cfg)
            .output()
            .expect("nvidia-imex runs");
        assert!(!out.status.success(), "{name}: {out:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(want),
            "{name}: {out:?}"
        );
    }
    let out = Command::new(drust_fakes::imex())
        .args(["-c", "/nonexistent/imexd.cfg"])
        .output()
        .expect("nvidia-imex runs");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/imexd.cfg"));
}
