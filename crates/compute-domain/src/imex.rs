//! The IMEX daemon of a domain on a member node: its `imexd.cfg`, its clique's nodes file (one
//! ConfigMap per domain), its Pod, and what the Pod's state says about the daemon.
//!
//! The Pod runs as drust's MPS daemons do (`gpu-kubelet-plugin/src/mps/pod.rs`): the daemon
//! chrooted into the driver root mounted read-only (by [`crate::supervisor`], which restarts it
//! when the nodes file changes), no service account token, pinned by `nodeName`, every
//! taint tolerated. It lives in the controller's namespace (an owner reference cannot cross
//! namespaces), so the domain's finalizer deletes it.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::crd::ComputeDomainNode;

/// Label on daemon Pods and ConfigMaps: the domain's UID (also on the claims, by contract).
pub const DOMAIN_UID_LABEL: &str = "compute.drust.dev/domain-uid";
/// `app.kubernetes.io/managed-by` of what the controller creates.
pub const MANAGED_BY: &str = "drust-compute-domain-controller";
/// Annotation on daemon Pods: `<namespace>/<name>` of the domain.
pub const DOMAIN_ANNOTATION: &str = "compute.drust.dev/domain";
/// Where the ConfigMap is mounted inside the driver root (the daemon runs chrooted there).
pub const CONFIG_DIR: &str = "/tmp/imex";
/// The daemon's config file, inside the chroot.
pub const CONFIG_FILE: &str = "/tmp/imex/imexd.cfg";
/// Its nodes file, inside the chroot.
pub const NODES_FILE: &str = "/tmp/imex/nodes.cfg";
/// A nodes-file line for an index with no daemon IP yet: keeps every later line in place
/// (the line number is the IMEX node ID).
pub const NO_ADDRESS: &str = "0.0.0.0";
/// The IMEX peer port (`SERVER_PORT`).
pub const SERVER_PORT: u16 = 50000;
/// The IMEX command port (`IMEX_CMD_PORT`).
pub const CMD_PORT: u16 = 50005;

/// How daemon Pods are made (the controller's flags).
#[derive(Debug, Clone)]
pub struct DaemonSettings {
    /// The controller's namespace: daemon Pods and ConfigMaps go there.
    pub namespace: String,
    /// The image with `chroot` (the plugin's image).
    pub image: String,
    /// Its pull policy.
    pub pull_policy: String,
    /// The driver root on the host (`/` or `/run/nvidia/driver`).
    pub host_driver_root: String,
    /// `nvidia-imex` inside the driver root.
    pub imex_binary: String,
    /// `nvidia-imex-ctl` inside the driver root.
    pub imex_ctl_binary: String,
    /// The daemon Pods' priority class; empty: none.
    pub priority_class: String,
    /// This binary inside the image: the Pod's process (`imex-daemon`, which runs and restarts
    /// `nvidia-imex`) and its readiness probe (`imex-ready`).
    pub self_binary: String,
}

/// The readiness check of a daemon: `chroot <driver_root> <ctl> -c <config> -q` answers
/// exactly `READY` (one trailing newline allowed), within `timeout`.
///
/// # Errors
/// What it answered instead, or why it did not run.
pub fn probe_ready(
    driver_root: &str,
    ctl: &str,
    config: &str,
    timeout: std::time::Duration,
) -> Result<(), String> {
    let mut child = std::process::Command::new("chroot")
        .args([driver_root, ctl, "-c", config, "-q"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("running chroot {driver_root} {ctl}: {e}"))?;
    let mut stdout = child.stdout.take();
    let reader = std::thread::spawn(move || {
        let mut out = String::new();
        if let Some(s) = stdout.as_mut() {
            let _ = std::io::Read::read_to_string(s, &mut out);
        }
        out
    });
    let deadline = std::time::Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "{ctl} -q gave no answer within {} ms",
                    timeout.as_millis()
                ));
            }
            Err(e) => return Err(format!("waiting for {ctl}: {e}")),
        }
    }
    let out = reader.join().unwrap_or_default();
    let answer = out.strip_suffix('\n').unwrap_or(&out);
    if answer == "READY" {
        Ok(())
    } else {
        Err(format!("{ctl} -q answered {answer:?}, not READY"))
    }
}

/// A short stable hash of `parts` (hex), for object names that must fit 63 characters.
pub fn short_hash(parts: &[&str]) -> String {
    let mut hasher = Sha256::new();
    for p in parts {
        hasher.update(p.as_bytes());
        hasher.update([0]);
    }
    hasher
        .finalize()
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The daemon Pod's name for domain `uid` on `node`.
pub fn pod_name(uid: &str, node: &str) -> String {
    format!("imex-{}", short_hash(&[uid, node]))
}

/// The domain's ConfigMap name.
pub fn config_map_name(uid: &str) -> String {
    format!("imex-{uid}")
}

/// The ConfigMap key of a clique's nodes file (`nodes.none.cfg` for nodes without a clique).
pub fn nodes_key(clique: &str) -> String {
    if clique.is_empty() {
        "nodes.none.cfg".to_owned()
    } else {
        format!("nodes.{clique}.cfg")
    }
}

/// `imexd.cfg` (KEY=VALUE lines, `nvidia-imex -c`): keys of NVIDIA's daemon config template
/// (multi-node.md §3.2), the nodes file beside it.
pub fn imexd_cfg() -> String {
    let lines = [
        "# Written by drust-compute-domain-controller.",
        "LOG_LEVEL=4",
        "LOG_FILE_NAME=",
        "LOG_APPEND_TO_LOG=0",
        "LOG_FILE_MAX_SIZE=1024",
        "LOG_MAX_ROTATE_COUNT=10",
        "LOG_USE_SYSLOG=0",
        "DAEMONIZE=0",
        "BIND_INTERFACE_IP=",
        &format!("SERVER_PORT={SERVER_PORT}"),
        &format!("IMEX_NODE_CONFIG_FILE={NODES_FILE}"),
        "NETWORK_INTERFACE=",
        "IMEX_WAIT_FOR_QUORUM=RECOVERY",
        "IMEX_ENABLE_AUTH_ENCRYPTION=0",
        "IMEX_CMD_ENABLED=1",
        "IMEX_CMD_BIND_INTERFACE_IP=127.0.0.1",
        &format!("IMEX_CMD_PORT={CMD_PORT}"),
        "IMEX_CMD_UNIX_DOMAIN_PATH=",
        "IMEX_NODE_DISCONNECTED_GRACE_TIME=-1",
    ];
    let mut out = lines.join("\n");
    out.push('\n');
    out
}

/// The nodes file of each clique: line `index` holds the daemon IP of the member with that
/// index ([`NO_ADDRESS`] where none has one yet), up to the highest index held.
pub fn nodes_files(nodes: &[ComputeDomainNode]) -> BTreeMap<String, String> {
    let mut by_clique: BTreeMap<&str, BTreeMap<i64, &str>> = BTreeMap::new();
    for n in nodes {
        by_clique
            .entry(&n.clique_id)
            .or_default()
            .insert(n.index, &n.ip_address);
    }
    by_clique
        .into_iter()
        .map(|(clique, lines)| {
            let last = lines.keys().next_back().copied().unwrap_or(-1);
            let text: String = (0..=last)
                .map(|i| {
                    let ip = lines.get(&i).copied().unwrap_or_default();
                    let ip = if ip.is_empty() { NO_ADDRESS } else { ip };
                    format!("{ip}\n")
                })
                .collect();
            (nodes_key(clique), text)
        })
        .collect()
}

/// The domain's ConfigMap: `imexd.cfg` and every clique's nodes file.
///
/// # Errors
/// Never for valid names; the message names the ConfigMap otherwise.
pub fn config_map(
    settings: &DaemonSettings,
    uid: &str,
    nodes: &[ComputeDomainNode],
) -> Result<ConfigMap, String> {
    let mut data = nodes_files(nodes);
    data.insert("imexd.cfg".to_owned(), imexd_cfg());
    let name = config_map_name(uid);
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": settings.namespace,
            "labels": {DOMAIN_UID_LABEL: uid, "app.kubernetes.io/managed-by": MANAGED_BY},
        },
        "data": data,
    }))
    .map_err(|e| format!("building ConfigMap {}/{name}: {e}", settings.namespace))
}

/// The daemon Pod of domain `domain` (`namespace/name`, UID `uid`) on `node`, in clique
/// `clique`.
///
/// # Errors
/// Never for valid names; the message names the Pod otherwise.
pub fn daemon_pod(
    settings: &DaemonSettings,
    domain: &str,
    uid: &str,
    node: &str,
    clique: &str,
) -> Result<Pod, String> {
    let name = pod_name(uid, node);
    let imex = format!("/{}", settings.imex_binary.trim_start_matches('/'));
    let ctl = format!("/{}", settings.imex_ctl_binary.trim_start_matches('/'));
    // The readiness probe: the daemon's own answer must be exactly READY. The image has no
    // shell; the controller binary compares it ([`probe_ready`]).
    let probe = [
        settings.self_binary.as_str(),
        "imex-ready",
        "--driver-root",
        "/driver-root",
        "--ctl",
        ctl.as_str(),
        "--config",
        CONFIG_FILE,
    ];
    let priority = (!settings.priority_class.is_empty()).then_some(&settings.priority_class);
    let pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": settings.namespace,
            "labels": {
                "app.kubernetes.io/name": "imex-daemon",
                "app.kubernetes.io/managed-by": MANAGED_BY,
                DOMAIN_UID_LABEL: uid,
            },
            "annotations": {DOMAIN_ANNOTATION: domain, "compute.drust.dev/node": node,
                            "compute.drust.dev/clique": clique},
        },
        "spec": {
            "nodeName": node,
            // A crashed daemon restarts in place, under the same name and index (#1417).
            "restartPolicy": "Always",
            "serviceAccountName": "default",
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "terminationGracePeriodSeconds": 5,
            "priorityClassName": priority,
            // It serves claims already placed here: no taint may keep it off the node.
            "tolerations": [{"operator": "Exists"}],
            "containers": [{
                "name": "imex",
                "image": settings.image,
                "imagePullPolicy": settings.pull_policy,
                "command": [settings.self_binary, "imex-daemon", "--driver-root",
                            "/driver-root", "--imex", imex, "--config", CONFIG_FILE,
                            "--nodes-file", NODES_FILE],
                // The daemon opens the GPUs' and the IMEX channels' device nodes.
                "securityContext": {"privileged": true},
                "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
                "readinessProbe": {
                    "exec": {"command": probe},
                    "periodSeconds": 2,
                    "timeoutSeconds": 5,
                },
                "ports": [{"name": "imex", "containerPort": SERVER_PORT}],
                "volumeMounts": [
                    {"name": "driver-root", "mountPath": "/driver-root", "readOnly": true,
                     "mountPropagation": "HostToContainer"},
                    {"name": "tmp", "mountPath": "/driver-root/tmp"},
                    {"name": "config", "mountPath": format!("/driver-root{CONFIG_DIR}"),
                     "readOnly": true},
                ],
            }],
            "volumes": [
                {"name": "driver-root",
                 "hostPath": {"path": settings.host_driver_root, "type": "Directory"}},
                {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
                {"name": "config", "configMap": {
                    "name": config_map_name(uid),
                    "items": [
                        {"key": "imexd.cfg", "path": "imexd.cfg"},
                        {"key": nodes_key(clique), "path": "nodes.cfg"},
                    ],
                }},
            ],
        },
    });
    serde_json::from_value(pod)
        .map_err(|e| format!("building Pod {}/{name}: {e}", settings.namespace))
}

/// What a daemon Pod says about its daemon.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DaemonState {
    /// No Pod yet, or starting.
    Starting,
    /// The Pod is Ready (the probe read `READY`), with its IP.
    Ready(String),
    /// The daemon cannot start: a CamelCase reason and a message.
    Failed(String, String),
}

/// Container waiting reasons that mean the daemon will not start without a change.
const FAILED_WAITING: &[&str] = &[
    "CrashLoopBackOff",
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
];

/// The daemon's state from its Pod.
pub fn daemon_state(pod: Option<&Pod>) -> DaemonState {
    let Some(pod) = pod else {
        return DaemonState::Starting;
    };
    // A Pod on its way out serves no new claim; its successor is made once it is gone.
    if pod.metadata.deletion_timestamp.is_some() {
        return DaemonState::Starting;
    }
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    let Some(status) = pod.status.as_ref() else {
        return DaemonState::Starting;
    };
    if status.phase.as_deref() == Some("Failed") {
        return DaemonState::Failed(
            "DaemonPodFailed".into(),
            format!(
                "IMEX daemon Pod {name} failed: {}",
                status.message.as_deref().unwrap_or("no message")
            ),
        );
    }
    for c in status.conditions.iter().flatten() {
        if c.type_ == "PodScheduled" && c.status == "False" {
            return DaemonState::Failed(
                "DaemonUnschedulable".into(),
                format!(
                    "IMEX daemon Pod {name} cannot run: {}",
                    c.message.as_deref().unwrap_or("unschedulable")
                ),
            );
        }
    }
    for c in status.container_statuses.iter().flatten() {
        if let Some(waiting) = c.state.as_ref().and_then(|s| s.waiting.as_ref())
            && let Some(reason) = waiting.reason.as_deref()
            && FAILED_WAITING.contains(&reason)
        {
            return DaemonState::Failed(
                "DaemonNotStarting".into(),
                format!(
                    "IMEX daemon Pod {name}: container {} is {reason}: {}",
                    c.name,
                    waiting.message.as_deref().unwrap_or("")
                ),
            );
        }
    }
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    match status.pod_ip.as_deref() {
        Some(ip) if ready && !ip.is_empty() => DaemonState::Ready(ip.to_owned()),
        _ => DaemonState::Starting,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> DaemonSettings {
        DaemonSettings {
            namespace: "drust".into(),
            image: "drust:dev".into(),
            pull_policy: "IfNotPresent".into(),
            host_driver_root: "/".into(),
            imex_binary: "usr/bin/nvidia-imex".into(),
            imex_ctl_binary: "usr/bin/nvidia-imex-ctl".into(),
            priority_class: String::new(),
            self_binary: "/usr/bin/drust-compute-domain-controller".into(),
        }
    }

    #[test]
    fn the_probe_accepts_exactly_ready() {
        let dir = tempfile::tempdir().unwrap();
        let script = |name: &str, body: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
            let mut perms = std::fs::metadata(&path).unwrap().permissions();
            std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
            std::fs::set_permissions(&path, perms).unwrap();
            path.display().to_string()
        };
        let t = std::time::Duration::from_secs(5);
        let ready = script("ready", "echo READY");
        // chroot into / (the test's root stands in for the driver root; needs CAP_SYS_CHROOT).
        if probe_ready("/", &ready, "/cfg", t).is_err() && !nix_root() {
            return;
        }
        assert_eq!(probe_ready("/", &ready, "/cfg", t), Ok(()));
        let starting = script("starting", "echo INITIALIZING");
        assert!(
            probe_ready("/", &starting, "/cfg", t)
                .unwrap_err()
                .contains("INITIALIZING")
        );
        let hung = script("hung", "sleep 30");
        let short = std::time::Duration::from_millis(300);
        assert!(
            probe_ready("/", &hung, "/cfg", short)
                .unwrap_err()
                .contains("no answer")
        );
    }

    fn nix_root() -> bool {
        std::fs::read_to_string("/proc/self/status")
            .unwrap_or_default()
            .lines()
            .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
    }

    #[test]
    fn nodes_files_hold_each_clique_in_index_order_with_gaps_kept() {
        let n = |name: &str, clique: &str, index, ip: &str| ComputeDomainNode {
            name: name.into(),
            ip_address: ip.into(),
            clique_id: clique.into(),
            index,
            status: String::new(),
        };
        let files = nodes_files(&[
            n("b", "u.1", 2, "10.0.0.2"),
            n("a", "u.1", 0, "10.0.0.1"),
            n("c", "u.2", 0, ""),
        ]);
        assert_eq!(files["nodes.u.1.cfg"], "10.0.0.1\n0.0.0.0\n10.0.0.2\n");
        assert_eq!(files["nodes.u.2.cfg"], "0.0.0.0\n");
    }

    #[test]
    fn the_daemon_pod_is_pinned_chrooted_read_only_and_tokenless() {
        let pod = daemon_pod(&settings(), "ns/cd", "uid-1", "node-a", "u.1").unwrap();
        let spec = pod.spec.unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("node-a"));
        assert_eq!(spec.automount_service_account_token, Some(false));
        let c = &spec.containers[0];
        assert_eq!(
            c.command.as_deref().unwrap(),
            [
                "/usr/bin/drust-compute-domain-controller",
                "imex-daemon",
                "--driver-root",
                "/driver-root",
                "--imex",
                "/usr/bin/nvidia-imex",
                "--config",
                CONFIG_FILE,
                "--nodes-file",
                NODES_FILE
            ]
        );
        let root = &c.volume_mounts.as_ref().unwrap()[0];
        assert_eq!(root.read_only, Some(true));
        let items = spec.volumes.unwrap()[2]
            .config_map
            .clone()
            .unwrap()
            .items
            .unwrap();
        assert_eq!(items[1].key, "nodes.u.1.cfg");
        assert_eq!(items[1].path, "nodes.cfg");
        assert!(pod.metadata.name.unwrap().len() <= 63);
    }

    #[test]
    fn imexd_cfg_is_key_value_lines_naming_the_nodes_file() {
        let cfg = imexd_cfg();
        assert!(cfg.contains("IMEX_NODE_CONFIG_FILE=/tmp/imex/nodes.cfg\n"));
        for line in cfg.lines().filter(|l| !l.starts_with('#')) {
            assert!(line.contains('='), "{line}");
        }
    }

    #[test]
    fn daemon_state_reads_ready_failed_and_starting() {
        let pod = |status: serde_json::Value| -> Pod {
            serde_json::from_value(json!({"metadata": {"name": "p"}, "status": status})).unwrap()
        };
        assert_eq!(daemon_state(None), DaemonState::Starting);
        assert_eq!(
            daemon_state(Some(&pod(json!({"podIP": "10.1.1.1",
                "conditions": [{"type": "Ready", "status": "True"}]})))),
            DaemonState::Ready("10.1.1.1".into())
        );
        assert_eq!(
            daemon_state(Some(&pod(json!({"podIP": "10.1.1.1",
                "conditions": [{"type": "Ready", "status": "False"}]})))),
            DaemonState::Starting
        );
        assert!(matches!(
            daemon_state(Some(&pod(json!({"containerStatuses": [{"name": "imex", "image": "i",
                "imageID": "", "ready": false, "restartCount": 3,
                "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]})))),
            DaemonState::Failed(r, _) if r == "DaemonNotStarting"
        ));
        let mut leaving = pod(json!({"podIP": "10.1.1.1",
            "conditions": [{"type": "Ready", "status": "True"}]}));
        leaving.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::now(),
            ));
        assert_eq!(daemon_state(Some(&leaving)), DaemonState::Starting);
        assert!(matches!(
            daemon_state(Some(&pod(json!({"phase": "Failed"})))),
            DaemonState::Failed(r, _) if r == "DaemonPodFailed"
        ));
    }
}
