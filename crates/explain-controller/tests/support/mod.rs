#![allow(dead_code)] // Each test binary uses part of it.

//! Shared by the controller's tests: the fake DGX H100's slices for any node, the chart's
//! objects for the controller, and the controller binary run with them.

use std::path::{Path, PathBuf};
use std::process::Child;

use anyhow::{Context, ensure};
use drust_e2e::ControlPlane;
use drust_e2e::manifests::{apply_yaml, repo_path};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, PostParams};
use serde::Deserialize as _;
use serde_json::Value;

pub const NAMESPACE: &str = "drust-system";
pub const SERVICE_ACCOUNT: &str = "drust-explain-controller";

/// Creates the fake DGX H100's ResourceSlices (the plugin's `--dry-run` snapshot) for `node`.
pub async fn create_slices(client: &kube::Client, node: &str) -> anyhow::Result<()> {
    create_slices_of(client, node, "dgx-h100.yaml").await
}

/// The plugin's dry-run snapshot `snapshot` (under crates/gpu-kubelet-plugin/tests/snapshots)
/// as `node`'s pool.
#[allow(dead_code)] // not every test binary uses it
pub async fn create_slices_of(
    client: &kube::Client,
    node: &str,
    snapshot: &str,
) -> anyhow::Result<()> {
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let snapshot = std::fs::read_to_string(repo_path(&format!(
        "crates/gpu-kubelet-plugin/tests/snapshots/{snapshot}"
    )))?;
    for doc in serde_yaml_ng::Deserializer::from_str(&snapshot) {
        let mut slice = ResourceSlice::deserialize(doc)?;
        slice.metadata.generate_name = Some(format!("{node}-gpus-"));
        slice.spec.node_name = Some(node.to_owned());
        slice.spec.pool.name = node.to_owned();
        slices.create(&PostParams::default(), &slice).await?;
    }
    Ok(())
}

/// The running controller; killed when dropped.
pub struct Controller {
    pub child: Child,
    /// Port of its /metrics, /healthz and /readyz.
    pub http: u16,
    /// The Deployment's memory limit in KiB (`resources.limits.memory`), if any.
    pub memory_limit_kib: Option<u64>,
    dir: tempfile::TempDir,
}

impl Controller {
    pub fn log(&self) -> PathBuf {
        self.dir.path().join("controller.log")
    }

    /// CPU seconds (user + system) and peak resident memory (KiB) so far.
    pub fn usage(&self) -> anyhow::Result<(f64, u64)> {
        let pid = self.child.id();
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.split_whitespace().collect())
            .unwrap_or_default();
        // Fields 14 and 15 of stat (utime, stime), counted from the state field (3).
        let ticks: u64 = fields.get(11).and_then(|v| v.parse().ok()).unwrap_or(0)
            + fields.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
        // /proc counts in USER_HZ, 100 per second in Linux's user-space ABI.
        let hz = 100.0;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let hwm = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        Ok((ticks as f64 / hz, hwm))
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Applies the chart's ServiceAccount, ClusterRole and binding for the controller
/// (`explainController.enabled=true` plus `set`) and starts the binary with the Deployment's
/// rendered arguments and the ServiceAccount's token.
pub async fn start(cp: &ControlPlane, set: &[&str]) -> anyhow::Result<Controller> {
    let client = cp.client().await?;
    let http = drust_e2e::ports::free_port()?;
    let port = format!("explainController.port={http}");
    let mut values = vec!["explainController.enabled=true", port.as_str()];
    values.extend(set);
    let rendered = drust_e2e::helm::template("drust", NAMESPACE, &values).await?;
    let mut rbac = String::new();
    let mut args: Vec<String> = Vec::new();
    let mut memory_limit_kib = None;
    for doc in serde_yaml_ng::Deserializer::from_str(&rendered) {
        let value: Value = serde_json::to_value(serde_yaml_ng::Value::deserialize(doc)?)?;
        if value["metadata"]["name"].as_str() != Some(SERVICE_ACCOUNT) {
            continue;
        }
        match value["kind"].as_str() {
            Some("ServiceAccount" | "ClusterRole" | "ClusterRoleBinding") => {
                rbac.push_str(&serde_yaml_ng::to_string(&value)?);
                rbac.push_str("---\n");
            }
            Some("Deployment") => {
                args = value["spec"]["template"]["spec"]["containers"][0]["args"]
                    .as_array()
                    .context("the Deployment's args")?
                    .iter()
                    .filter_map(|a| a.as_str().map(str::to_owned))
                    .collect();
                let limit = value["spec"]["template"]["spec"]["containers"][0]["resources"]
                    ["limits"]["memory"]
                    .as_str()
                    .unwrap_or_default();
                memory_limit_kib = k8s_quantity::Quantity::parse(limit)
                    .ok()
                    .and_then(|q| q.as_i64())
                    .and_then(|bytes| u64::try_from(bytes / 1024).ok());
            }
            _ => {}
        }
    }
    ensure!(
        !args.is_empty(),
        "the chart renders the controller's Deployment"
    );
    apply_yaml(
        &client,
        &format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: {NAMESPACE}}}\n"),
        Path::new("namespace"),
    )
    .await?;
    apply_yaml(&client, &rbac, Path::new("chart RBAC")).await?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    let token = cp.service_account_token(NAMESPACE, SERVICE_ACCOUNT).await?;
    cp.write_kubeconfig(&kubeconfig, &token)?;
    let log = std::fs::File::create(dir.path().join("controller.log"))?;
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_drust-explain-controller"));
    command
        .args(&args)
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .env("POD_NAME", "explain-controller-test")
        .stdout(log.try_clone()?)
        .stderr(log);
    drust_e2e::die_with_parent(&mut command);
    let child = command.spawn()?;
    Ok(Controller {
        child,
        http,
        memory_limit_kib,
        dir,
    })
}
