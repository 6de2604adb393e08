//! The ComputeDomain controller with exactly the chart's least privilege: the chart installed
//! with `computeDomains.enabled` (its CRD, RBAC and admission policy), and the controller run
//! with the Deployment's own arguments as the chart's ServiceAccount. A pod is held in PreBind
//! until its (paper) IMEX daemon is Ready, then binds; deleting the domain removes its daemon;
//! the same token may not start any other Pod.

mod cd_support;

use anyhow::{bail, ensure};
use cd_support::*;
use drust_e2e::ControlPlane;
use drust_e2e::ControlPlaneOptions;
use drust_e2e::wait::until;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, ResourceExt};
use serde_json::json;

const RELEASE: &str = "drust";
const NAME: &str = "drust-compute-domain-controller";

async fn client_from(kubeconfig: &std::path::Path) -> anyhow::Result<Client> {
    let config = kube::Config::from_custom_kubeconfig(
        Kubeconfig::read_from(kubeconfig)?,
        &KubeConfigOptions::default(),
    )
    .await?;
    Ok(Client::try_from(config)?)
}

/// The chart's Deployment's container arguments.
async fn chart_args(client: &Client) -> anyhow::Result<Vec<String>> {
    let d = Api::<Deployment>::namespaced(client.clone(), SYSTEM)
        .get(NAME)
        .await?;
    let c = d
        .spec
        .and_then(|s| s.template.spec)
        .map(|s| s.containers)
        .unwrap_or_default();
    Ok(c.first().and_then(|c| c.args.clone()).unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_controller_works_with_the_charts_least_privilege() -> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let admin = cp.client().await?;
    let scratch = tempfile::tempdir()?;
    let installed = drust_e2e::helm::install_chart(
        &scratch.path().join("helm-home"),
        cp.kubeconfig_path(),
        RELEASE,
        SYSTEM,
        (std::net::Ipv4Addr::LOCALHOST.into(), 443),
        &["computeDomains.enabled=true".to_owned()],
    )
    .await?;
    ensure!(installed.contains("STATUS: deployed"), "{installed}");
    prepare(&admin, false).await?;
    let nodes: Vec<String> = (0..2).map(|i| format!("tray-{i}")).collect();
    paper_nodes(&cp, &admin, &nodes, |_| Some(CLIQUE_A)).await?;
    let kubelet = PaperKubelet::start(&admin);
    kubelet
        .rules
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .hold
        .insert("tray-1".into());

    // The controller as the chart runs it: its ServiceAccount, its arguments.
    let token = cp.service_account_token(SYSTEM, NAME).await?;
    let kubeconfig = scratch.path().join("controller.kubeconfig");
    cp.write_kubeconfig(&kubeconfig, &token)?;
    let mut args = chart_args(&admin).await?;
    args.extend(["--namespace".to_owned(), SYSTEM.to_owned()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let controller = Controller::start_with(&kubeconfig, &args, scratch.path())?;

    let cd = create_domain(&admin, "job", "job-channel", 0).await?;
    let uid = cd.uid().unwrap_or_default();
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(admin.clone(), WORK);
    until("template job-channel", TIMEOUT, || async {
        templates
            .get_opt("job-channel")
            .await
            .map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e}\ncontroller log:\n{}", controller.log_text()))?;
    create_pod(&admin, "worker", "job-channel", Some("tray-1")).await?;
    let daemons: Api<Pod> = Api::namespaced(admin.clone(), SYSTEM);
    let by_domain = ListParams::default().labels(&format!("{DOMAIN_UID_LABEL}={uid}"));
    until("a daemon Pod on tray-1", TIMEOUT, || async {
        let l = daemons.list(&by_domain).await.map_err(|e| e.to_string())?;
        Ok((!l.items.is_empty()).then_some(()))
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e}\ncontroller log:\n{}", controller.log_text()))?;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), WORK);
    let pod = pods.get("worker").await?;
    ensure!(
        pod.spec.and_then(|s| s.node_name).is_none(),
        "bound before the daemon was Ready"
    );
    kubelet
        .rules
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .hold
        .clear();
    let node = until("worker bound", TIMEOUT, || async {
        let p = pods.get("worker").await.map_err(|e| e.to_string())?;
        Ok(p.spec.and_then(|s| s.node_name))
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e}\ncontroller log:\n{}", controller.log_text()))?;
    ensure!(node == "tray-1", "{node}");
    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), WORK);
    let claim = claims
        .list(&by_domain)
        .await?
        .items
        .into_iter()
        .next()
        .ok_or_else(|| anyhow::anyhow!("no claim"))?;
    ensure!(
        channel_condition(&claim, "IMEXDaemonReady").is_some_and(|c| c.0 == "True"),
        "{claim:?}"
    );
    wait_status(&admin, "job", "job Ready", |s| s["status"] == "Ready").await?;

    // The same token may not start another kind of Pod there (the admission policy), nor
    // anything in another namespace (RBAC).
    let controller_client = client_from(&kubeconfig).await?;
    let rogue: Pod = serde_json::from_value(json!({
        "metadata": {"name": "rogue", "labels": {"app.kubernetes.io/name": "imex-daemon"}},
        "spec": {"nodeName": "tray-0", "automountServiceAccountToken": false,
                 "containers": [{"name": "c", "image": "docker.io/library/busybox",
                                 "command": ["sh"]}]},
    }))?;
    for ns in [SYSTEM, WORK] {
        match Api::<Pod>::namespaced(controller_client.clone(), ns)
            .create(&PostParams::default(), &rogue)
            .await
        {
            Err(kube::Error::Api(e)) if e.code == 403 || e.code == 422 => {}
            other => bail!("the controller's token created a rogue Pod in {ns}: {other:?}"),
        }
    }

    // Deleting the domain removes its daemon.
    domain_api(&admin, WORK)
        .delete("job", &DeleteParams::default())
        .await?;
    until("job and its daemon gone", TIMEOUT, || async {
        let cd = domain_api(&admin, WORK)
            .get_opt("job")
            .await
            .map_err(|e| e.to_string())?;
        let left = daemons
            .list(&by_domain)
            .await
            .map_err(|e| e.to_string())?
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .count();
        Ok((cd.is_none() && left == 0).then_some(()))
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e}\ncontroller log:\n{}", controller.log_text()))?;
    // Nothing it did was refused (events included, which do not fail a reconcile).
    let log = controller.log_text();
    ensure!(
        !log.contains("forbidden"),
        "the chart's RBAC refused a call:\n{log}"
    );
    Ok(())
}
