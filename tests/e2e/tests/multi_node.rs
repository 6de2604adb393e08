//! Several nodes in one control plane: two real nodes (kubelet, containerd and the plugin each,
//! fake DGX H100s with mknod'ed device nodes) and sixteen paper nodes (Node objects whose pools
//! the plugin binary publishes, eight DGX H100s and eight 4 x L40S, no kubelet), all in one test
//! on this machine ([`drust_e2e::cluster`]).
//!
//! What the API server stores is the verdict throughout:
//! - every node's pool is published by its own plugin, with the topology's GPUs;
//! - four pods of four GPUs each fill the two real nodes: two land on each (nothing else fits),
//!   their claims are allocated from their node's pool, and each container sees exactly its
//!   four GPUs (device nodes from the CDI spec, in the log the API server relays from that
//!   node's kubelet); a fifth waits as unschedulable until a pod on one node is deleted, then
//!   runs there;
//! - a pod on one real node reaches a pod on the other by its pod IP (each node has its own
//!   bridge and pod subnet; this host forwards between them);
//! - eight pods of eight GPUs each spread over the eight paper DGX nodes (one fits per node),
//!   bound by the scheduler with allocations naming that node's pool, and never run; a ninth is
//!   unschedulable; pods pinned to one paper L40S node take its four GPUs, the fifth is
//!   unschedulable;
//! - a seventeenth paper node is deleted while its slices exist: they go (the Node owns them;
//!   the garbage collector deletes them), and its plugin, trying to publish again, finds no Node
//!   and writes nothing; registered again (a new UID), the node gets its pool back, owned by the
//!   new Node.
//!
//! At the end the test prints each node's resident memory and CPU time (BENCHMARKS.md quotes
//! such a run; nothing here asserts them).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use drust_e2e::cluster::{Cluster, ClusterOptions, DRIVER, NodeGroup};
use drust_e2e::images::WORKLOAD_IMAGE;
use drust_e2e::manifests::{apply_yaml, repo_path};
use drust_e2e::node_pods::{SCRIPT, seen};
use drust_e2e::plugin::fake_gpus;
use gpu_kubelet_plugin::claims::device_env;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{DeleteParams, ListParams, LogParams, PostParams};

const DGX_H100: &str = "examples/topologies/dgx-h100.yaml";
const L40S: &str = "examples/topologies/pcie-l40s.yaml";
/// The paper node deleted (and registered again) at the end.
const LEAVING: &str = "paper-leaving-";
/// The node label this test gives each kind of node.
const KIND: &str = "e2e.drust.dev/kind";
/// Generous: a loaded 2-core machine runs two kubelets, two containerds and 18 plugins here.
const TIMEOUT: Duration = Duration::from_secs(240);

/// ResourceClaimTemplates: four and eight H100s, one L40S.
const TEMPLATES: &str = r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: four-h100, namespace: default}
spec:
  spec:
    devices:
      requests:
        - name: gpus
          exactly:
            deviceClassName: gpu.drust.dev
            allocationMode: ExactCount
            count: 4
            selectors:
              - cel:
                  expression: device.attributes["gpu.drust.dev"].productName == "NVIDIA H100 80GB HBM3"
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: eight-h100, namespace: default}
spec:
  spec:
    devices:
      requests:
        - name: gpus
          exactly:
            deviceClassName: gpu.drust.dev
            allocationMode: ExactCount
            count: 8
            selectors:
              - cel:
                  expression: device.attributes["gpu.drust.dev"].productName == "NVIDIA H100 80GB HBM3"
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: one-l40s, namespace: default}
spec:
  spec:
    devices:
      requests:
        - name: gpus
          exactly:
            deviceClassName: gpu.drust.dev
            selectors:
              - cel:
                  expression: device.attributes["gpu.drust.dev"].productName == "NVIDIA L40S"
"#;

/// A pod in `default` holding a claim from `template`, placed by `selector`: it prints its
/// device nodes and variables ([`SCRIPT`]) and sleeps until deleted.
fn gpu_pod(name: &str, template: &str, selector: (&str, &str)) -> anyhow::Result<Pod> {
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "nodeSelector": {selector.0: selector.1},
            "containers": [{
                "name": "main",
                "image": WORKLOAD_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c",
                    format!("{SCRIPT}; trap 'exit 0' TERM; sleep 3600 & wait")],
                "resources": {"claims": [{"name": "gpu"}]},
            }],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
        },
    }))?)
}

/// A pod in `default` on node `node` without devices, running `script`.
fn plain_pod(name: &str, node: &str, script: &str) -> anyhow::Result<Pod> {
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "nodeSelector": {"kubernetes.io/hostname": node},
            "containers": [{
                "name": "main",
                "image": WORKLOAD_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", script],
            }],
        },
    }))?)
}

/// Polls `probe` until it returns `Some`, for at most [`TIMEOUT`]; `what` and the last
/// observation (and `context`) go into the error.
async fn wait_for<T, F, Fut>(
    what: &str,
    context: impl Fn() -> String,
    mut probe: F,
) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Result<T, String>>>,
{
    let start = Instant::now();
    loop {
        let last = match probe().await? {
            Ok(v) => return Ok(v),
            Err(last) => last,
        };
        if start.elapsed() > TIMEOUT {
            bail!(
                "{what}: not after {TIMEOUT:?}; last seen: {last}\n{}",
                context()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("")
}

fn node_of(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref().and_then(|s| s.node_name.as_deref())
}

/// The scheduler's `PodScheduled=False` condition of `pod`: `(reason, message)`.
fn unschedulable(pod: &Pod) -> Option<(String, String)> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")
        .map(|c| {
            (
                c.reason.clone().unwrap_or_default(),
                c.message.clone().unwrap_or_default(),
            )
        })
}

/// Waits for pod `name` to be Running (fails at once if it ended).
async fn wait_running(pods: &Api<Pod>, name: &str, cluster: &Cluster) -> anyhow::Result<Pod> {
    wait_for(
        &format!("pod {name} Running"),
        || cluster.log_tail(),
        || async {
            let pod = pods.get(name).await?;
            match phase(&pod) {
                "Running" => Ok(Ok(pod)),
                "Succeeded" | "Failed" => bail!("pod {name} ended: {:?}", pod.status),
                _ => Ok(Err(format!("{:?}", pod.status))),
            }
        },
    )
    .await
}

/// Waits for pod `name` to be bound to a node by the scheduler.
async fn wait_bound(pods: &Api<Pod>, name: &str) -> anyhow::Result<Pod> {
    wait_for(&format!("pod {name} bound"), String::new, || async {
        let pod = pods.get(name).await?;
        Ok(if node_of(&pod).is_some() {
            Ok(pod)
        } else {
            Err(format!("{:?}", pod.status))
        })
    })
    .await
}

/// Waits for the scheduler to call pod `name` unschedulable, having considered all `nodes`
/// nodes; returns its message.
async fn wait_unschedulable(pods: &Api<Pod>, name: &str, nodes: usize) -> anyhow::Result<String> {
    let message = wait_for(
        &format!("pod {name} unschedulable"),
        String::new,
        || async {
            let pod = pods.get(name).await?;
            if let Some(node) = node_of(&pod) {
                bail!("pod {name} was bound to {node}; it should not fit");
            }
            Ok(match unschedulable(&pod) {
                Some((reason, message)) if reason == "Unschedulable" => Ok(message),
                _ => Err(format!("{:?}", pod.status)),
            })
        },
    )
    .await?;
    ensure!(
        message.starts_with(&format!("0/{nodes} nodes are available")),
        "pod {name}: the scheduler's verdict is not over all {nodes} nodes: {message}"
    );
    Ok(message)
}

/// The allocated claim of `pod` (its one claim), checked against what the API server must
/// hold for a pod bound to its node: every device from the node's own pool, the allocation's
/// node selector naming the node, the claim reserved for the pod. Returns the claim and its
/// device names.
async fn allocated_claim(
    claims: &Api<ResourceClaim>,
    pod: &Pod,
    want: usize,
) -> anyhow::Result<(ResourceClaim, Vec<String>)> {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let node = node_of(pod).with_context(|| format!("pod {name} is not bound"))?;
    let claim_name = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.resource_claim_name.clone())
        .with_context(|| format!("pod {name}'s claim"))?;
    let claim = claims.get(&claim_name).await?;
    let status = claim.status.as_ref().context("claim status")?;
    let allocation = status
        .allocation
        .as_ref()
        .with_context(|| format!("claim {claim_name} of pod {name} is not allocated"))?;
    let results = allocation
        .devices
        .as_ref()
        .and_then(|d| d.results.as_ref())
        .cloned()
        .unwrap_or_default();
    ensure!(
        results.len() == want,
        "claim {claim_name}: {} devices, want {want}: {results:?}",
        results.len()
    );
    for r in &results {
        ensure!(
            r.driver == DRIVER && r.pool == node,
            "claim {claim_name} of pod {name} on {node} has device {}/{}/{}, not from {node}'s pool",
            r.driver,
            r.pool,
            r.device
        );
    }
    let selected: Vec<String> = allocation
        .node_selector
        .as_ref()
        .map(|s| {
            s.node_selector_terms
                .iter()
                .flat_map(|t| t.match_fields.iter().flatten())
                .filter(|f| f.key == "metadata.name" && f.operator == "In")
                .flat_map(|f| f.values.iter().flatten().cloned())
                .collect()
        })
        .unwrap_or_default();
    ensure!(
        selected == [node],
        "claim {claim_name}: allocation node selector {:?}, want {node}",
        allocation.node_selector
    );
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    ensure!(
        status
            .reserved_for
            .iter()
            .flatten()
            .any(|r| r.resource == "pods" && r.uid == uid),
        "claim {claim_name} is not reserved for pod {name}: {:?}",
        status.reserved_for
    );
    let devices = results.iter().map(|r| r.device.clone()).collect();
    Ok((claim, devices))
}

#[tokio::test]
async fn two_real_and_sixteen_paper_nodes_get_pods_placed_run_and_denied_by_the_real_scheduler()
-> anyhow::Result<()> {
    let started = Instant::now();
    let cluster = Cluster::start(
        ClusterOptions::default()
            .real(NodeGroup::new("real-", 2, DGX_H100).label(KIND, "real"))
            .paper(NodeGroup::new("paper-h100-", 8, DGX_H100).label(KIND, "paper"))
            .paper(NodeGroup::new("paper-l40s-", 8, L40S).label(KIND, "paper"))
            // Deleted at the end; its plugin rediscovers every second, so that it tries to
            // publish again soon after.
            .paper(
                NodeGroup::new(LEAVING, 1, L40S)
                    .label(KIND, "leaving")
                    .plugin_args(&["--rediscovery-interval-seconds", "1"]),
            ),
    )
    .await?;
    let startup = started.elapsed();
    let client = cluster.client().clone();
    let all_nodes = 19;

    // Every node is there, Ready, with its labels, and holds its topology's GPUs in a pool its
    // own plugin published.
    let nodes: Api<Node> = Api::all(client.clone());
    let listed = nodes.list(&ListParams::default()).await?.items;
    ensure!(listed.len() == all_nodes, "{} nodes", listed.len());
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let h100s = fake_gpus(&repo_path(DGX_H100)).map_err(anyhow::Error::msg)?;
    let l40s = fake_gpus(&repo_path(L40S)).map_err(anyhow::Error::msg)?;
    for node in &listed {
        let name = node.metadata.name.clone().unwrap_or_default();
        let labels = node.metadata.labels.clone().unwrap_or_default();
        let kind = if name.starts_with("real-") {
            "real"
        } else if name.starts_with(LEAVING) {
            "leaving"
        } else {
            "paper"
        };
        ensure!(
            labels.get(KIND).map(String::as_str) == Some(kind),
            "{name}'s labels: {labels:?}"
        );
        let ready = node
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        ensure!(ready, "{name} is not Ready");
        let want: BTreeSet<&str> =
            if name.starts_with("paper-l40s-") || name.starts_with(LEAVING) {
                &l40s
            } else {
                &h100s
            }
            .iter()
            .map(|g| g.name.as_str())
            .collect();
        let published: BTreeSet<String> = slices
            .list(&ListParams::default().fields(&format!("spec.nodeName={name}")))
            .await?
            .items
            .iter()
            .filter(|s| s.spec.driver == DRIVER && s.spec.pool.name == name)
            .flat_map(|s| s.spec.devices.iter().flatten().map(|d| d.name.clone()))
            .collect();
        ensure!(
            published
                .iter()
                .map(String::as_str)
                .collect::<BTreeSet<_>>()
                == want,
            "{name} publishes {published:?}, want {want:?}"
        );
    }

    apply_yaml(
        &client,
        TEMPLATES,
        &repo_path("tests/e2e/tests/multi_node.rs"),
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let create = |pod: Pod| {
        let pods = pods.clone();
        async move { pods.create(&PostParams::default(), &pod).await }
    };

    // Real nodes: four pods of four H100s fill both nodes, two on each.
    let real_pods: Vec<String> = (0..4).map(|i| format!("real-gpu-{i}")).collect();
    for name in &real_pods {
        create(gpu_pod(name, "four-h100", (KIND, "real"))?).await?;
    }
    let mut on_node: BTreeMap<String, Vec<(String, Vec<String>)>> = BTreeMap::new();
    for name in &real_pods {
        let pod = wait_running(&pods, name, &cluster).await?;
        let node = node_of(&pod).context("node")?.to_owned();
        let (claim, devices) = allocated_claim(&claims, &pod, 4).await?;
        let real = cluster
            .real(&node)
            .with_context(|| format!("{name} runs on {node}, not a real node"))?;
        let uid = claim.metadata.uid.clone().unwrap_or_default();
        let spec = real
            .host()
            .cdi_root()
            .join(format!("{DRIVER}-claim_{uid}.json"));
        ensure!(
            spec.exists(),
            "{name}'s CDI spec on {node}: {}",
            spec.display()
        );

        // What the container saw, relayed by the API server from its node's kubelet.
        let log = wait_for(
            &format!("{name}'s report"),
            || cluster.log_tail(),
            || async {
                let log = pods
                    .logs(name, &LogParams::default())
                    .await
                    .map_err(|e| e.to_string());
                Ok(match log {
                    Ok(l) if l.lines().any(|l| l == "done") => Ok(l),
                    Ok(l) => Err(l),
                    Err(e) => Err(e),
                })
            },
        )
        .await?;
        let (seen_nodes, seen_env) = seen(&log);
        let mut want_nodes = vec![
            "/dev/nvidia-uvm ec:0".to_owned(),
            "/dev/nvidia-uvm-tools ec:1".to_owned(),
            "/dev/nvidiactl c3:ff".to_owned(),
        ];
        for device in &devices {
            let gpu = h100s
                .iter()
                .find(|g| g.name == *device)
                .with_context(|| format!("allocated {device}"))?;
            want_nodes.push(format!(
                "/dev/nvidia{} c3:{:x}",
                gpu.raw.minor, gpu.raw.minor
            ));
            let env = device_env(device, &gpu.raw.uuid);
            ensure!(
                seen_env.contains(&env),
                "{name} on {node} lacks {env}: {seen_env:?}"
            );
        }
        want_nodes.sort();
        ensure!(
            seen_nodes == want_nodes,
            "{name} on {node} sees {seen_nodes:?}, want {want_nodes:?}"
        );
        on_node
            .entry(node)
            .or_default()
            .push((name.clone(), devices));
    }
    ensure!(
        on_node.len() == 2 && on_node.values().all(|p| p.len() == 2),
        "four pods of four GPUs on two 8-GPU nodes: two on each, got {on_node:?}"
    );
    for (node, held) in &on_node {
        let devices: BTreeSet<&String> = held.iter().flat_map(|(_, d)| d).collect();
        ensure!(devices.len() == 8, "{node}'s pods share a device: {held:?}");
    }

    // A fifth does not fit anywhere until one of the pods goes.
    create(gpu_pod("real-gpu-waiting", "four-h100", (KIND, "real"))?).await?;
    let denied = wait_unschedulable(&pods, "real-gpu-waiting", all_nodes).await?;
    eprintln!("real-gpu-waiting: {denied}");
    let (freed_node, freed) = on_node
        .iter()
        .next_back()
        .map(|(n, p)| (n.clone(), p[0].0.clone()))
        .context("a pod to delete")?;
    let freed_pod = pods.get(&freed).await?;
    let freed_uid = allocated_claim(&claims, &freed_pod, 4)
        .await?
        .0
        .metadata
        .uid
        .unwrap_or_default();
    pods.delete(&freed, &DeleteParams::default()).await?;
    let freed_spec = cluster
        .real(&freed_node)
        .context("freed node")?
        .host()
        .cdi_root()
        .join(format!("{DRIVER}-claim_{freed_uid}.json"));
    wait_for(
        "the deleted pod's claim unprepared",
        || cluster.log_tail(),
        || async {
            Ok(if freed_spec.exists() {
                Err(format!("{} still there", freed_spec.display()))
            } else {
                Ok(())
            })
        },
    )
    .await?;
    let waiting = wait_running(&pods, "real-gpu-waiting", &cluster).await?;
    ensure!(
        node_of(&waiting) == Some(freed_node.as_str()),
        "the waiting pod went to {:?}, where GPUs were freed is {freed_node}",
        node_of(&waiting)
    );
    allocated_claim(&claims, &waiting, 4).await?;

    // Pod to pod across the real nodes: each node's own subnet, routed by this host.
    let [first, second] = [&cluster.real_nodes()[0], &cluster.real_nodes()[1]];
    let (server_node, client_node) = (first.name().to_owned(), second.name().to_owned());
    create(plain_pod(
        "net-server",
        &server_node,
        &format!(
            "mkdir -p /www && echo hello-from-{server_node} > /www/index.html && \
             exec httpd -f -p 8080 -h /www"
        ),
    )?)
    .await?;
    let server = wait_running(&pods, "net-server", &cluster).await?;
    let server_ip = server
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .context("the server's pod IP")?;
    ensure!(
        server_ip.starts_with(&subnet_prefix(&first.node().options().pod_subnet)),
        "net-server's IP {server_ip} is outside {server_node}'s {}",
        first.node().options().pod_subnet
    );
    create(plain_pod(
        "net-client",
        &client_node,
        &format!(
            "for i in $(seq 120); do wget -q -O /dev/termination-log http://{server_ip}:8080/ \
             && exit 0; sleep 1; done; exit 1"
        ),
    )?)
    .await?;
    let done = wait_for(
        "net-client done",
        || cluster.log_tail(),
        || async {
            let pod = pods.get("net-client").await?;
            Ok(match phase(&pod) {
                "Succeeded" | "Failed" => Ok(pod),
                _ => Err(format!("{:?}", pod.status)),
            })
        },
    )
    .await?;
    let client_ip = done
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .unwrap_or_default();
    let got = done
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.state.as_ref()?.terminated.as_ref()?.message.clone())
        .unwrap_or_default();
    ensure!(
        phase(&done) == "Succeeded" && got.trim() == format!("hello-from-{server_node}"),
        "net-client on {client_node} ({client_ip}) fetching from {server_ip} on {server_node}: \
         {:?}, got {got:?}",
        done.status
    );
    ensure!(
        client_ip.starts_with(&subnet_prefix(&second.node().options().pod_subnet)),
        "net-client's IP {client_ip} is outside {client_node}'s {}",
        second.node().options().pod_subnet
    );

    // Paper nodes: eight pods of eight H100s, one per paper DGX (none fits twice, and the
    // real nodes are not selected), bound and never run.
    let paper_pods: Vec<String> = (0..8).map(|i| format!("paper-gpu-{i}")).collect();
    for name in &paper_pods {
        create(gpu_pod(name, "eight-h100", (KIND, "paper"))?).await?;
    }
    let mut bound = BTreeSet::new();
    for name in &paper_pods {
        let pod = wait_bound(&pods, name).await?;
        let node = node_of(&pod).context("node")?.to_owned();
        ensure!(
            node.starts_with("paper-h100-") && cluster.paper(&node).is_some(),
            "{name} bound to {node}"
        );
        allocated_claim(&claims, &pod, 8).await?;
        ensure!(bound.insert(node.clone()), "two pods bound to {node}");
    }
    create(gpu_pod("paper-gpu-waiting", "eight-h100", (KIND, "paper"))?).await?;
    let denied = wait_unschedulable(&pods, "paper-gpu-waiting", all_nodes).await?;
    eprintln!("paper-gpu-waiting: {denied}");

    // Pinned to one paper L40S node: its four GPUs go to four pods, the fifth is denied.
    let pinned_node = "paper-l40s-3";
    let mut pinned_devices = BTreeSet::new();
    for i in 0..4 {
        let name = format!("pinned-{i}");
        create(gpu_pod(
            &name,
            "one-l40s",
            ("kubernetes.io/hostname", pinned_node),
        )?)
        .await?;
        let pod = wait_bound(&pods, &name).await?;
        ensure!(
            node_of(&pod) == Some(pinned_node),
            "{name}: {:?}",
            node_of(&pod)
        );
        let (_, devices) = allocated_claim(&claims, &pod, 1).await?;
        pinned_devices.extend(devices);
    }
    ensure!(pinned_devices.len() == 4, "{pinned_devices:?}");
    create(gpu_pod(
        "pinned-waiting",
        "one-l40s",
        ("kubernetes.io/hostname", pinned_node),
    )?)
    .await?;
    let denied = wait_unschedulable(&pods, "pinned-waiting", all_nodes).await?;
    eprintln!("pinned-waiting: {denied}");

    // Nothing bound to a paper node ever ran (no kubelet there to run it).
    for pod in pods.list(&ListParams::default()).await?.items {
        if node_of(&pod).is_some_and(|n| n.starts_with("paper-")) {
            ensure!(
                phase(&pod) == "Pending"
                    && pod
                        .status
                        .as_ref()
                        .and_then(|s| s.container_statuses.as_ref())
                        .is_none_or(Vec::is_empty),
                "{:?} on a paper node: {:?}",
                pod.metadata.name,
                pod.status
            );
        }
    }

    eprintln!(
        "two real and sixteen paper nodes: started in {:.1} s, test body {:.1} s",
        startup.as_secs_f64(),
        (started.elapsed() - startup).as_secs_f64()
    );
    eprintln!("node                 kind   part        RSS MiB   CPU s (since start)");
    for usage in cluster.usage() {
        let kind = if usage.paper { "paper" } else { "real" };
        for (part, u) in &usage.parts {
            eprintln!(
                "{:<20} {kind:<6} {part:<10} {:>8.1} {:>9.2}",
                usage.node,
                u.rss_mib(),
                u.cpu.as_secs_f64()
            );
        }
    }

    // A paper node deleted while its slices exist: the garbage collector deletes them (the Node
    // owns them), and its plugin, trying again, finds no Node and writes nothing. The Node
    // registered again (a new UID): the plugin publishes its pool again, owned by that Node.
    let leaving = format!("{LEAVING}0");
    let node_slices = || {
        let slices = slices.clone();
        let leaving = leaving.clone();
        async move {
            slices
                .list(&ListParams::default().fields(&format!("spec.nodeName={leaving}")))
                .await
                .map(|l| l.items)
        }
    };
    let before = node_slices().await?;
    ensure!(!before.is_empty(), "{leaving} has slices before it goes");
    nodes.delete(&leaving, &DeleteParams::default()).await?;
    let gone_at = Instant::now();
    wait_for(
        &format!("{leaving}'s slices gone"),
        || cluster.log_tail(),
        || async {
            let left = node_slices().await?;
            Ok(if left.is_empty() {
                Ok(())
            } else {
                Err(format!("{} slices left", left.len()))
            })
        },
    )
    .await?;
    eprintln!(
        "{leaving} deleted: its {} slices gone in {:.1} s",
        before.len(),
        gone_at.elapsed().as_secs_f64()
    );
    let plugin_log = cluster
        .paper(&leaving)
        .context("the leaving paper node")?
        .plugin_log();
    let refused = format!("reading Node {leaving}");
    wait_for(
        &format!("{leaving}'s plugin finding its Node gone"),
        || cluster.log_tail(),
        || async {
            let log = std::fs::read_to_string(&plugin_log)?;
            Ok(match log.lines().find(|l| l.contains(&refused)) {
                Some(line) => Ok(line.to_owned()),
                None => Err(format!("no {refused:?} in {}", plugin_log.display())),
            })
        },
    )
    .await
    .map(|line| eprintln!("{leaving}'s plugin: {line}"))?;
    // A write racing the delete (a create with the old owner UID) is collected too.
    wait_for(
        &format!("{leaving}'s slices gone after its plugin tried again"),
        || cluster.log_tail(),
        || async {
            let left = node_slices().await?;
            Ok(if left.is_empty() {
                Ok(())
            } else {
                Err(format!("{} slices left", left.len()))
            })
        },
    )
    .await?;
    let back = cluster
        .cp()
        .register_node(&leaving, &[(KIND, "leaving")])
        .await?;
    let uid = back.metadata.uid.clone().context("the new Node's UID")?;
    let republished = wait_for(
        &format!("{leaving}'s pool published again, owned by the new Node"),
        || cluster.log_tail(),
        || async {
            let now = node_slices().await?;
            let owned = now.iter().all(|s| {
                s.metadata
                    .owner_references
                    .as_ref()
                    .is_some_and(|o| o.iter().any(|o| o.uid == uid && o.kind == "Node"))
            });
            let devices = now
                .iter()
                .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
                .sum::<usize>();
            Ok(if owned && devices == l40s.len() {
                Ok(devices)
            } else {
                Err(format!(
                    "{} slices, {devices} devices, owned: {owned}",
                    now.len()
                ))
            })
        },
    )
    .await?;
    eprintln!("{leaving} registered again: {republished} devices published, owned by {uid}");
    cluster.stop().await?;
    Ok(())
}

/// `a.b.c.` of subnet `a.b.c.0/24`.
fn subnet_prefix(subnet: &str) -> String {
    subnet
        .split('/')
        .next()
        .and_then(|ip| ip.rsplit_once('.'))
        .map(|(prefix, _)| format!("{prefix}."))
        .unwrap_or_default()
}
