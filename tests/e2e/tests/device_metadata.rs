//! Device metadata in containers (KEP-5304), read inside a container on a real node by upstream's
//! own reader: the container runs `tests/gotools/cmd/devicemetadata`
//! (`k8s.io/dynamic-resource-allocation/devicemetadata` v0.36.3,
//! `ReadResourceClaimTemplateMetadataWithDriverName` and `ReadResourceClaimMetadataWithDriverName`,
//! which look only where upstream's kubelet plugin helper mounts the files), mounted from the
//! host read-only.
//!
//! A pod with a claim from a template (two H100s, request `gpus`) and a claim named directly
//! (one H100, request `gpu`): upstream's reader finds, under the pod's name for the first claim
//! and the claim's name for the second, the claim's name, namespace and UID as the API server
//! stores them, generation 1, the request, and each allocated device (driver, pool, name) with
//! the attributes a workload needs: its UUID (the fake GPU's), PCI bus ID and root, NUMA node.
//! The file is read-only in the container. Once the pod is deleted, the files are gone from the
//! node.
//!
//! A MIG device created at prepare (partitionable MIG, the fake PCIe A100 node): the reader finds
//! the allocated placement with the new MIG device's UUID, its profile and its parent's UUID. A
//! share's file names its GPU as a whole GPU's does (KEP-5304's `Device` has no share ID;
//! `gpu-kubelet-plugin`'s `claims` test checks two shares of one GPU).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, ensure};
use drust_e2e::cluster::{Cluster, ClusterOptions, DRIVER, NodeGroup};
use drust_e2e::images::WORKLOAD_IMAGE;
use drust_e2e::manifests::{apply_yaml, repo_path};
use drust_e2e::plugin::fake_gpus;
use drust_e2e::wait::until;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use kube::api::{DeleteParams, LogParams, PostParams};

const DGX_H100: &str = "examples/topologies/dgx-h100.yaml";
const A100_MIG: &str = "examples/topologies/pcie-a100-mig.yaml";
const TIMEOUT: Duration = Duration::from_secs(180);

const CLAIMS: &str = "apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: two-gpus, namespace: default}
spec:
  spec:
    devices:
      requests:
        - name: gpus
          exactly: {deviceClassName: gpu.drust.dev, count: 2}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: one-gpu, namespace: default}
spec:
  devices:
    requests:
      - name: gpu
        exactly: {deviceClassName: gpu.drust.dev, count: 1}
";

#[tokio::test]
async fn upstreams_reader_finds_each_claims_device_metadata_inside_the_container()
-> anyhow::Result<()> {
    let tool = drust_gotools::go_tool("devicemetadata").map_err(anyhow::Error::msg)?;
    let tool_dir = tool.parent().context("the tool's directory")?;
    let cluster =
        Cluster::start(ClusterOptions::default().real(NodeGroup::new("meta-", 1, DGX_H100)))
            .await?;
    let client = cluster.client().clone();
    let node = cluster.real_nodes()[0].name().to_owned();
    apply_yaml(&client, CLAIMS, Path::new("claims")).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let (done, logs) = run_reader(
        &pods,
        tool_dir,
        &[
            ("template", "-pod-claim gpus -request gpus", "gpus"),
            ("named", "-claim one-gpu -request gpu", "single"),
        ],
        serde_json::json!([
            {"name": "gpus", "resourceClaimTemplateName": "two-gpus"},
            {"name": "single", "resourceClaimName": "one-gpu"},
        ]),
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e}\n{}", cluster.log_tail()))?;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let gpus = fake_gpus(&repo_path(DGX_H100)).map_err(anyhow::Error::msg)?;
    let statuses = done
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.clone())
        .unwrap_or_default();
    let generated = statuses
        .iter()
        .find(|s| s.name == "gpus")
        .and_then(|s| s.resource_claim_name.clone())
        .context("the generated claim's name")?;
    for (container, claim_name, pod_claim, request, count) in [
        ("template", generated.as_str(), Some("gpus"), "gpus", 2),
        ("named", "one-gpu", None, "gpu", 1),
    ] {
        let read = answer(container, &logs[container])?;
        let claim = claims.get(claim_name).await?;
        ensure!(
            read["name"] == claim_name
                && read["namespace"] == "default"
                && read["uid"].as_str() == claim.metadata.uid.as_deref()
                && read["generation"] == 1
                && read["podClaimName"].as_str() == pod_claim,
            "{container}: the claim as the API server stores it: {read}"
        );
        let allocated: BTreeMap<String, String> = drust_e2e::claims::allocation_results(&claim)
            .context("allocated")?
            .iter()
            .map(|r| (r.device.clone(), r.pool.clone()))
            .collect();
        ensure!(
            read["requests"].as_array().map(Vec::len) == Some(1)
                && read["requests"][0]["name"] == request,
            "{container}: one request {request}: {read}"
        );
        let devices = read["requests"][0]["devices"]
            .as_array()
            .context("devices")?;
        ensure!(
            devices.len() == count,
            "{container}: {count} devices: {read}"
        );
        for d in devices {
            let name = d["name"].as_str().unwrap_or_default();
            let gpu = gpus
                .iter()
                .find(|g| g.name == name)
                .with_context(|| format!("{name} is a GPU of the node"))?;
            let attributes = &d["attributes"];
            ensure!(
                d["driver"] == DRIVER
                    && d["pool"] == node
                    && allocated.get(name) == Some(&node)
                    && attributes["uuid"]["string"] == gpu.raw.uuid.as_str()
                    && attributes["resource.kubernetes.io/pcieRoot"]["string"].is_string()
                    && attributes["resource.kubernetes.io/pciBusID"]["string"].is_string()
                    && attributes["resource.kubernetes.io/numaNode"]["int"].is_i64(),
                "{container}: device {name} as allocated, with its UUID, PCI and NUMA: {d}"
            );
        }
    }

    // The files go with the claims' preparation.
    let plugin_dir = cluster.real_nodes()[0].host().plugin_dir();
    let files = plugin_dir.join(gpu_kubelet_plugin::device_metadata::HOST_DIR);
    ensure!(
        std::fs::read_dir(&files)?.count() == 2,
        "one directory per claim under {}",
        files.display()
    );
    pods.delete("reader", &DeleteParams::default()).await?;
    until("the metadata files removed", TIMEOUT, || async {
        let left = std::fs::read_dir(&files).map(Iterator::count).unwrap_or(0);
        Ok((left == 0).then_some(()))
    })
    .await?;
    cluster.stop().await?;
    Ok(())
}

/// A MIG device made at prepare (partitionable MIG on the fake PCIe A100 node): upstream's
/// reader finds the allocated placement's device with the UUID the new MIG device got (the
/// fake backend's state, as NVML would answer), its profile and its parent GPU's UUID.
#[tokio::test]
async fn a_mig_device_created_at_prepare_has_its_new_uuid_in_the_containers_metadata()
-> anyhow::Result<()> {
    let tool = drust_gotools::go_tool("devicemetadata").map_err(anyhow::Error::msg)?;
    let tool_dir = tool.parent().context("the tool's directory")?;
    let cluster = Cluster::start(ClusterOptions::default().real(
        NodeGroup::new("meta-mig-", 1, A100_MIG).plugin_args(&["--mig-strategy", "partitionable"]),
    ))
    .await?;
    let client = cluster.client().clone();
    apply_yaml(
        &client,
        "apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: one-mig, namespace: default}
spec:
  devices:
    requests:
      - name: mig
        exactly:
          deviceClassName: mig.drust.dev
          selectors:
            - cel: {expression: 'device.attributes[\"gpu.drust.dev\"].profile == \"1g.10gb\"'}
",
        Path::new("mig claim"),
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let (_, logs) = run_reader(
        &pods,
        tool_dir,
        &[("mig", "-claim one-mig -request mig", "mig")],
        serde_json::json!([{"name": "mig", "resourceClaimName": "one-mig"}]),
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e}\n{}", cluster.log_tail()))?;
    let read = answer("mig", &logs["mig"])?;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let claim = claims.get("one-mig").await?;
    let result = drust_e2e::claims::allocation_results(&claim)
        .and_then(|r| r.first().cloned())
        .context("allocated")?;
    let state = gpu_inventory::fake::mig::MigState::load(
        &cluster.real_nodes()[0].host().state_dir().join("mig.json"),
    )?;
    let made: Vec<(String, String)> = state
        .gpus
        .iter()
        .flat_map(|(parent, migs)| migs.iter().map(move |m| (parent.clone(), m.uuid.clone())))
        .collect();
    ensure!(made.len() == 1, "one MIG device made at prepare: {made:?}");
    let (parent, uuid) = &made[0];
    let device = &read["requests"][0]["devices"][0];
    let attributes = &device["attributes"];
    ensure!(
        read["uid"].as_str() == claim.metadata.uid.as_deref()
            && read["requests"][0]["devices"].as_array().map(Vec::len) == Some(1)
            && device["driver"] == DRIVER
            && device["pool"] == result.pool.as_str()
            && device["name"] == result.device.as_str()
            && attributes["uuid"]["string"] == uuid.as_str()
            && attributes["profile"]["string"] == "1g.10gb"
            && attributes["parentUUID"]["string"] == parent.as_str(),
        "the placement {} with the new MIG device's UUID {uuid} (parent {parent}): {read}",
        result.device
    );
    pods.delete("reader", &DeleteParams::default()).await?;
    cluster.stop().await?;
    Ok(())
}

/// Runs pod `reader` with one container per `(name, reader arguments, pod claim)`, each running
/// upstream's reader (mounted from `tool_dir`) and then trying to write every metadata file it
/// can see, with the pod's `resource_claims`; returns the pod and each container's log once
/// every container has read (they stay, and so do the pod's claims).
async fn run_reader(
    pods: &Api<Pod>,
    tool_dir: &Path,
    containers: &[(&str, &str, &str)],
    resource_claims: serde_json::Value,
) -> anyhow::Result<(Pod, BTreeMap<String, String>)> {
    let containers: Vec<serde_json::Value> = containers
        .iter()
        .map(|(name, args, claim)| {
            let script = format!(
                "/tools/devicemetadata -driver {DRIVER} {args}; \
                 for f in $(find /var/run/kubernetes.io/dra-device-attributes -name '*.json'); do \
                 {{ echo test >> $f; }} 2>/dev/null && echo \"$f writable\"; done; \
                 echo done; trap 'exit 0' TERM; sleep 3600 & wait"
            );
            serde_json::json!({
                "name": name,
                "image": WORKLOAD_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", script],
                "resources": {"claims": [{"name": claim}]},
                "volumeMounts": [{"name": "tools", "mountPath": "/tools", "readOnly": true}],
            })
        })
        .collect();
    let names: Vec<String> = containers
        .iter()
        .filter_map(|c| c["name"].as_str().map(str::to_owned))
        .collect();
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "reader", "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "containers": containers,
            "volumes": [{"name": "tools", "hostPath": {"path": tool_dir.display().to_string(), "type": "Directory"}}],
            "resourceClaims": resource_claims,
        },
    }))?;
    pods.create(&PostParams::default(), &pod).await?;
    let read = until("every container's read", TIMEOUT, || async {
        let p = pods.get("reader").await.map_err(|e| e.to_string())?;
        if matches!(
            p.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Failed" | "Succeeded")
        ) {
            return Err(format!("the pod ended: {:?}", p.status));
        }
        let mut logs = BTreeMap::new();
        for container in &names {
            let log = pods
                .logs(
                    "reader",
                    &LogParams {
                        container: Some(container.clone()),
                        ..LogParams::default()
                    },
                )
                .await
                .map_err(|e| e.to_string())?;
            if !log.lines().any(|l| l == "done") {
                return Ok(None);
            }
            logs.insert(container.clone(), log);
        }
        Ok(Some((p, logs)))
    })
    .await?;
    Ok(read)
}

/// Upstream reader's answer in `container`'s log (its first line), with no metadata file
/// writable there.
fn answer(container: &str, log: &str) -> anyhow::Result<serde_json::Value> {
    eprintln!("{container}: {log}");
    let mut lines = log.lines();
    let read: serde_json::Value =
        serde_json::from_str(lines.next().context("the reader's answer")?)
            .with_context(|| format!("{container}: upstream's reader failed: {log}"))?;
    let rest: Vec<&str> = lines.filter(|l| *l != "done").collect();
    ensure!(
        rest.is_empty(),
        "{container}: the metadata is read-only: {rest:?}"
    );
    Ok(read)
}
