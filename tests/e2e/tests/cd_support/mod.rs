//! What the ComputeDomain tests share: a control plane with the CRDs of `deploy/crds/`, the
//! channel DeviceClass, paper nodes that publish one IMEX channel device each (the GPU
//! plugin's side of the contract, created directly), the controller binary as a process
//! (killable), and a paper kubelet that marks daemon Pods Ready with an IP.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context as _;
use drust_e2e::manifests::repo_path;
use drust_e2e::wait::until;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Event, Namespace, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

/// Generous: a 2-core machine shared with builds.
pub const TIMEOUT: Duration = Duration::from_secs(180);
/// The controller's namespace.
pub const SYSTEM: &str = "drust-system";
/// The workload namespace.
pub const WORK: &str = "work";
/// The domain label on claims (contract).
pub const DOMAIN_UID_LABEL: &str = "compute.drust.dev/domain-uid";
/// The driver.
pub const DRIVER: &str = "gpu.drust.dev";
/// The channel device every paper node publishes.
pub const CHANNEL: &str = "imex-channel-0";
/// The clique of the tests' rack.
pub const CLIQUE_A: &str = "5b1f2c8e-4d3a-4f7e-9a61-0c2d8e7f3b94.1";
/// Another clique.
pub const CLIQUE_B: &str = "5b1f2c8e-4d3a-4f7e-9a61-0c2d8e7f3b94.2";

/// drust's ComputeDomain API.
pub fn domain_api(client: &Client, ns: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("compute.drust.dev", "v1alpha1", "ComputeDomain");
    Api::namespaced_with(client.clone(), ns, &ApiResource::from_gvk(&gvk))
}

/// NVIDIA's ComputeDomain API (compatibility mode).
pub fn nvidia_domain_api(client: &Client, ns: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("resource.nvidia.com", "v1beta1", "ComputeDomain");
    Api::namespaced_with(client.clone(), ns, &ApiResource::from_gvk(&gvk))
}

/// A control plane with the CRDs, the DeviceClass and the two namespaces.
pub async fn start(options: ControlPlaneOptions) -> anyhow::Result<(ControlPlane, Client)> {
    let cp = ControlPlane::start(options).await?;
    let client = cp.client().await?;
    prepare(&client, true).await?;
    Ok((cp, client))
}

/// The workload namespace and the DeviceClass; with `everything`, also the CRDs of
/// `deploy/crds/` and [`SYSTEM`] (what the chart installs otherwise).
pub async fn prepare(client: &Client, everything: bool) -> anyhow::Result<()> {
    if everything {
        let crds: Api<DynamicObject> = Api::all_with(
            client.clone(),
            &ApiResource::from_gvk(&GroupVersionKind::gvk(
                "apiextensions.k8s.io",
                "v1",
                "CustomResourceDefinition",
            )),
        );
        for file in [
            "deploy/crds/compute.drust.dev_computedomains.yaml",
            "deploy/crds/resource.nvidia.com_computedomains.yaml",
        ] {
            let text = std::fs::read_to_string(repo_path(file)).context(file)?;
            let crd: DynamicObject = serde_yaml_ng::from_str(&text).context(file)?;
            crds.create(&PostParams::default(), &crd)
                .await
                .context(file)?;
        }
    }
    let namespaces: &[&str] = if everything { &[SYSTEM, WORK] } else { &[WORK] };
    for ns in namespaces {
        let namespace: Namespace = serde_json::from_value(json!({"metadata": {"name": ns}}))?;
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &namespace)
            .await?;
    }
    // The channels' DeviceClass as shipped (server-side apply: the chart may have made it).
    drust_e2e::manifests::apply_file(client, &repo_path("deploy/deviceclasses/imex-channel.yaml"))
        .await?;
    // The CRD is served once established.
    let domains = domain_api(client, WORK);
    until("the ComputeDomain CRD served", TIMEOUT, || async {
        match domains.list(&ListParams::default()).await {
            Ok(_) => Ok(Some(())),
            Err(e) => Err(e.to_string()),
        }
    })
    .await?;
    Ok(())
}

/// Registers paper nodes `names`, each with one slice holding [`CHANNEL`] as the contract
/// says, in clique `clique(i)` (none when `None`), `concurrency` at a time.
pub async fn paper_nodes(
    cp: &ControlPlane,
    client: &Client,
    names: &[String],
    clique: impl Fn(usize) -> Option<&'static str>,
) -> anyhow::Result<()> {
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let jobs = names.iter().enumerate().map(|(i, name)| {
        let slices = slices.clone();
        let clique = clique(i);
        async move {
            cp.register_node(name, &[]).await?;
            let mut attributes = json!({
                "type": {"string": "imex-channel"},
                "channel": {"int": 0},
            });
            if let Some(c) = clique {
                attributes["nvlinkClique"] = json!({"string": c});
            }
            let slice: ResourceSlice = serde_json::from_value(json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                "metadata": {"name": format!("{name}-imex")},
                "spec": {
                    "driver": DRIVER, "nodeName": name,
                    "pool": {"name": name, "generation": 1, "resourceSliceCount": 1},
                    "devices": [{
                        "name": CHANNEL,
                        "allowMultipleAllocations": true,
                        "attributes": attributes,
                        "bindingConditions": ["IMEXDaemonReady"],
                        "bindingFailureConditions": ["IMEXDaemonFailed"],
                    }],
                },
            }))?;
            slices.create(&PostParams::default(), &slice).await?;
            anyhow::Ok(())
        }
    });
    let results: Vec<anyhow::Result<()>> = futures::stream::iter(jobs)
        .buffer_unordered(16)
        .collect()
        .await;
    results.into_iter().collect::<anyhow::Result<Vec<()>>>()?;
    Ok(())
}

/// The controller binary as a process; SIGKILLed on drop.
pub struct Controller {
    child: Child,
    pub log: PathBuf,
}

impl Controller {
    /// Starts `drust-compute-domain-controller --api <api>` against `cp`, its log in `dir`.
    pub fn start(cp: &ControlPlane, api: &str, dir: &std::path::Path) -> anyhow::Result<Self> {
        let args = ["--api", api, "--namespace", SYSTEM, "--image", "drust:test"];
        Self::start_with(cp.kubeconfig_path(), &args, dir)
    }

    /// Starts it with `args` and `kubeconfig`.
    pub fn start_with(
        kubeconfig: &std::path::Path,
        args: &[&str],
        dir: &std::path::Path,
    ) -> anyhow::Result<Self> {
        static RUN: AtomicU32 = AtomicU32::new(0);
        let binary = drust_e2e::binary::compute_domain_controller_binary()
            .map_err(|e| anyhow::anyhow!(e))?;
        let log = dir.join(format!(
            "controller-{}.log",
            RUN.fetch_add(1, Ordering::Relaxed)
        ));
        let file = std::fs::File::create(&log)?;
        let child = Command::new(binary)
            .args(args)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .env("RUST_LOG", "info,compute_domain=debug")
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()?;
        Ok(Controller { child, log })
    }

    /// SIGKILL, and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The log so far (for failure messages).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        self.kill();
    }
}

/// How the paper kubelet treats daemon Pods, per node.
#[derive(Default)]
pub struct KubeletRules {
    /// Nodes whose daemon Pods stay unready.
    pub hold: BTreeSet<String>,
    /// Nodes whose daemon container crash-loops.
    pub crash: BTreeSet<String>,
}

/// Plays the kubelet for the daemon Pods in [`SYSTEM`] on paper nodes: a Pod it has not seen
/// gets phase Running, a fresh IP and `Ready=True` (or a CrashLoopBackOff container, or
/// nothing, as `rules` say). Stops when dropped.
pub struct PaperKubelet {
    pub rules: Arc<Mutex<KubeletRules>>,
    stop: Arc<AtomicBool>,
}

impl PaperKubelet {
    /// Starts it.
    pub fn start(client: &Client) -> Self {
        let rules = Arc::new(Mutex::new(KubeletRules::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let pods: Api<Pod> = Api::namespaced(client.clone(), SYSTEM);
        let (r, s) = (Arc::clone(&rules), Arc::clone(&stop));
        tokio::spawn(async move {
            let mut next_ip: u32 = 1;
            // Pod UID → what was written.
            let mut done: BTreeMap<String, &'static str> = BTreeMap::new();
            while !s.load(Ordering::Relaxed) {
                if let Ok(list) = pods.list(&ListParams::default()).await {
                    for pod in list.items {
                        let uid = pod.uid().unwrap_or_default();
                        let node = pod
                            .spec
                            .as_ref()
                            .and_then(|s| s.node_name.clone())
                            .unwrap_or_default();
                        let want = {
                            let rules = r.lock().unwrap_or_else(PoisonError::into_inner);
                            if rules.crash.contains(&node) {
                                "crash"
                            } else if rules.hold.contains(&node) {
                                "hold"
                            } else {
                                "ready"
                            }
                        };
                        if done.get(&uid) == Some(&want) || want == "hold" {
                            continue;
                        }
                        let ip = format!(
                            "10.{}.{}.{}",
                            next_ip >> 16,
                            (next_ip >> 8) & 255,
                            next_ip & 255
                        );
                        next_ip += 1;
                        let status = if want == "ready" {
                            json!({"status": {"phase": "Running", "podIP": ip,
                                "podIPs": [{"ip": ip}],
                                "conditions": [{"type": "Ready", "status": "True"},
                                               {"type": "PodScheduled", "status": "True"}]}})
                        } else {
                            json!({"status": {"phase": "Running", "podIP": ip,
                                "podIPs": [{"ip": ip}],
                                "conditions": [{"type": "Ready", "status": "False"},
                                               {"type": "PodScheduled", "status": "True"}],
                                "containerStatuses": [{"name": "imex", "image": "drust:test",
                                    "imageID": "", "ready": false, "restartCount": 5,
                                    "state": {"waiting": {"reason": "CrashLoopBackOff",
                                        "message": "back-off 40s restarting failed container imex: nvidia-imex exited 1: NV_ERR_IN_USE"}}}]}})
                        };
                        if pods
                            .patch_status(
                                &pod.name_any(),
                                &PatchParams::default(),
                                &Patch::Merge(&status),
                            )
                            .await
                            .is_ok()
                        {
                            done.insert(uid, want);
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        PaperKubelet { rules, stop }
    }
}

impl Drop for PaperKubelet {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A drust ComputeDomain `name` in [`WORK`] with template `template`.
pub async fn create_domain(
    client: &Client,
    name: &str,
    template: &str,
    num_nodes: i64,
) -> anyhow::Result<DynamicObject> {
    let mut spec = json!({"channel": {"resourceClaimTemplate": {"name": template}}});
    if num_nodes > 0 {
        spec["numNodes"] = json!(num_nodes);
    }
    let cd: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "compute.drust.dev/v1alpha1", "kind": "ComputeDomain",
        "metadata": {"name": name, "namespace": WORK},
        "spec": spec,
    }))?;
    Ok(domain_api(client, WORK)
        .create(&PostParams::default(), &cd)
        .await?)
}

/// The domain's `status` (null when none).
pub async fn domain_status(client: &Client, name: &str) -> Result<Value, String> {
    let cd = domain_api(client, WORK)
        .get(name)
        .await
        .map_err(|e| e.to_string())?;
    Ok(cd.data.get("status").cloned().unwrap_or(Value::Null))
}

/// `status.nodes` as name → (index, clique, ip, status).
pub fn members(status: &Value) -> BTreeMap<String, (i64, String, String, String)> {
    status["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|n| {
            (
                n["name"].as_str().unwrap_or_default().to_owned(),
                (
                    n["index"].as_i64().unwrap_or(-1),
                    n["cliqueID"].as_str().unwrap_or_default().to_owned(),
                    n["ipAddress"].as_str().unwrap_or_default().to_owned(),
                    n["status"].as_str().unwrap_or_default().to_owned(),
                ),
            )
        })
        .collect()
}

/// A pod in [`WORK`] with one claim from template `template`, pinned to `node` by a node
/// selector (the scheduler still places it and allocates its claim).
pub async fn create_pod(
    client: &Client,
    name: &str,
    template: &str,
    node: Option<&str>,
) -> anyhow::Result<()> {
    let mut pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": WORK},
        "spec": {
            "containers": [{"name": "c", "image": "registry.invalid/none",
                            "resources": {"claims": [{"name": "imex"}]}}],
            "resourceClaims": [{"name": "imex", "resourceClaimTemplateName": template}],
        },
    });
    if let Some(n) = node {
        pod["spec"]["nodeSelector"] = json!({"kubernetes.io/hostname": n});
    }
    let pod: Pod = serde_json::from_value(pod)?;
    Api::<Pod>::namespaced(client.clone(), WORK)
        .create(&PostParams::default(), &pod)
        .await?;
    Ok(())
}

/// A claim of the domain `uid` on `node`'s channel, made and allocated by the test itself
/// (playing the resourceclaim controller and the scheduler: no pod, no retry, so a failure
/// condition stays to be read).
pub async fn allocated_claim(
    client: &Client,
    name: &str,
    uid: &str,
    node: &str,
) -> anyhow::Result<()> {
    allocated_claim_in(client, WORK, name, uid, node).await
}

/// [`allocated_claim`] in namespace `ns`.
pub async fn allocated_claim_in(
    client: &Client,
    ns: &str,
    name: &str,
    uid: &str,
    node: &str,
) -> anyhow::Result<()> {
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), ns);
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": ns, "labels": {DOMAIN_UID_LABEL: uid}},
        "spec": {"devices": {"requests": [{"name": "channel", "exactly": {
            "deviceClassName": "imex-channel.drust.dev", "allocationMode": "ExactCount",
            "count": 1}}]}},
    }))?;
    claims.create(&PostParams::default(), &claim).await?;
    let status = json!({"status": {"allocation": {
        "devices": {"results": [{"request": "channel", "driver": DRIVER, "pool": node,
            "device": CHANNEL, "bindingConditions": ["IMEXDaemonReady"],
            "bindingFailureConditions": ["IMEXDaemonFailed"]}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
    }}});
    claims
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await?;
    Ok(())
}

/// The `type` condition (status, reason, message) of the claim's channel entry.
pub fn channel_condition(claim: &ResourceClaim, type_: &str) -> Option<(String, String, String)> {
    claim
        .status
        .as_ref()?
        .devices
        .as_ref()?
        .iter()
        .find(|d| d.driver == DRIVER && d.device == CHANNEL)?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// Warning events on the ComputeDomain `name` with `reason` (events.k8s.io, read through
/// core/v1).
pub async fn warnings(client: &Client, name: &str, reason: &str) -> Result<Vec<String>, String> {
    let events: Api<Event> = Api::namespaced(client.clone(), WORK);
    let list = events
        .list(&ListParams::default())
        .await
        .map_err(|e| e.to_string())?;
    Ok(list
        .items
        .into_iter()
        .filter(|e| {
            e.involved_object.kind.as_deref() == Some("ComputeDomain")
                && e.involved_object.name.as_deref() == Some(name)
                && e.reason.as_deref() == Some(reason)
                && e.type_.as_deref() == Some("Warning")
        })
        .map(|e| e.message.unwrap_or_default())
        .collect())
}

/// Waits for the domain's status to satisfy `check`, returning it.
pub async fn wait_status(
    client: &Client,
    name: &str,
    what: &str,
    check: impl Fn(&Value) -> bool,
) -> anyhow::Result<Value> {
    Ok(until(what, TIMEOUT, || async {
        let s = domain_status(client, name).await?;
        if check(&s) {
            Ok(Some(s))
        } else {
            Err(s.to_string())
        }
    })
    .await?)
}
