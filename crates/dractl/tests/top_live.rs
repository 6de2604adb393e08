//! `dractl top` against the real control plane (v1.36.3), run as identities that hold only the
//! roles of `deploy/rbac/dractl-top.yaml`: it reads the node plugin's usage report through a
//! port-forward opened by the API server and a real kubelet, showing the plugin its bearer
//! token, and prints the idle pod first, with its device, memory, idle time and cost, and the
//! busy pod as busy. The plugin checks every reader itself (`--http-auth`): a tenant holding
//! the Role alone sees its own namespace and is refused every other; a user of a client
//! certificate is told to pass `--token-file`, and with one is served.
//!
//! The node plugin runs in-process on the fake DGX H100 (usage every second, a 2-second idle
//! window) and publishes for a node no kubelet backs; a real node (kubelet and containerd on
//! this machine) runs the plugin's stand-in Pod in `drust-system`, labelled as the chart labels
//! the plugin's pods, with the host's network, so that a port-forward into it reaches the
//! in-process plugin's port.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, ensure};
use drust_e2e::claims::{allocated_claim, pod_using};
use drust_e2e::http::{Transport, get, get_via};
use drust_e2e::kubelet::Kubelet;
use drust_e2e::manifests::{apply_yaml, repo_path};
use drust_e2e::node::{Node, NodeOptions};
use drust_e2e::plugin::NodePlugin;
use drust_e2e::rbac::bind_dractl_top;
use drust_e2e::wait::until;
use drust_e2e::{CERTIFICATE_USER, ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

const DRIVER: &str = "gpu.drust.dev";
/// The node the plugin publishes for (no kubelet: the test acts as the kubelet).
const NODE: &str = "node-top";
/// The real node that runs the plugin's stand-in Pod.
const REAL_NODE: &str = "node-top-real";
const PLUGIN_POD: &str = "drust-kubelet-plugin-x1";
const TIMEOUT: Duration = Duration::from_secs(60);

fn dractl(kubeconfig: &Path, args: &[&str]) -> anyhow::Result<std::process::Output> {
    Ok(std::process::Command::new(env!("CARGO_BIN_EXE_dractl"))
        .arg("top")
        .args(args)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .output()?)
}

/// dractl's stdout when it succeeded, else its output as the error.
fn succeeded(out: &std::process::Output) -> anyhow::Result<String> {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(
        out.status.success(),
        "dractl top failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(stdout)
}

/// dractl's stderr when it failed with exit code 2 (a live cluster error).
fn failed(out: &std::process::Output) -> anyhow::Result<String> {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    ensure!(
        out.status.code() == Some(2),
        "dractl top should have failed: {:?} {}{stderr}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(stderr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_shows_the_idle_pod_first_with_only_the_documented_rbac() -> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let node = Node::start(&cp, REAL_NODE, NodeOptions::default()).await;
    let result = match node {
        Ok(node) => {
            let result = run(&cp, &node).await;
            node.stop().await?;
            result
        }
        Err(e) => Err(e.into()),
    };
    cp.stop().await?;
    result
}

async fn run(cp: &ControlPlane, node: &Node) -> anyhow::Result<()> {
    let client = cp.client().await?;
    cp.register_node(NODE, &[]).await?;
    let port = drust_e2e::ports::free_port()?;
    let proc_dir = tempfile::tempdir()?;
    let topology = repo_path("examples/topologies/dgx-h100.yaml");
    let mut plugin = NodePlugin::start_with(cp, DRIVER, NODE, &topology, |c| {
        c.http_address = Some(([0, 0, 0, 0], port).into());
        c.http_auth = true;
        // As the chart runs it: HTTPS with a self-signed certificate.
        c.http_tls = Some(
            gpu_kubelet_plugin::http::tls::TlsSource::from_flags(None, None, NODE)
                .expect("self-signed"),
        );
        c.usage = Some(drust_e2e::plugin::fast_usage(
            proc_dir.path(),
            Duration::from_secs(2),
            false,
        ));
    })?;
    let slices = plugin.wait_ready(&client, TIMEOUT).await?;
    let state = plugin.fake_state_dir()?;
    let by_index = |index: i64| -> anyhow::Result<String> {
        slices
            .iter()
            .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
            .find(|d| {
                d.attributes
                    .as_ref()
                    .and_then(|a| a.get("index"))
                    .and_then(|a| a.int)
                    == Some(index)
            })
            .map(|d| d.name)
            .context("device by index")
    };
    let (gpu0, gpu1) = (by_index(0)?, by_index(1)?);

    // The plugin's pod, as the chart labels it, on the real node's network, where the
    // in-process plugin listens.
    apply_yaml(
        &client,
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: drust-system}\n",
        Path::new("namespace"),
    )
    .await?;
    let plugin_pods: Api<Pod> = Api::namespaced(client.clone(), "drust-system");
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": PLUGIN_POD, "labels": {
            "app.kubernetes.io/name": "drust", "app.kubernetes.io/component": "kubelet-plugin"}},
        "spec": {"nodeName": REAL_NODE, "hostNetwork": true,
                 "automountServiceAccountToken": false, "terminationGracePeriodSeconds": 1,
                 "containers": [{"name": "plugin", "image": drust_e2e::images::WORKLOAD_IMAGE,
                 "imagePullPolicy": "Never",
                 "command": ["/bin/sh", "-c", "trap 'exit 0' TERM; sleep 3600 & wait"],
                 "ports": [{"name": "http", "containerPort": port}],
                 // As the chart's probes: the kubelet checks the plugin over HTTPS (here
                 // /healthz, which needs no kubelet registration: the test registers the
                 // plugin itself, later), and dractl speaks HTTPS to the port because the
                 // probe does.
                 "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http",
                    "scheme": "HTTPS"}, "periodSeconds": 1}}]},
    }))?;
    plugin_pods.create(&PostParams::default(), &pod).await?;
    drust_e2e::node_pods::wait_running(&plugin_pods, PLUGIN_POD, node).await?;
    // The real kubelet's HTTPS probe reaches the plugin's self-signed endpoint.
    until(
        "the plugin pod Ready by its HTTPS probe",
        TIMEOUT,
        || async {
            let pod = plugin_pods
                .get(PLUGIN_POD)
                .await
                .map_err(|e| e.to_string())?;
            Ok(drust_e2e::node_pods::ready(&pod).then_some(()))
        },
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e}: {}", node.log_tail()))?;

    // A busy pod and an idle one.
    let train =
        allocated_claim(&client, "train", DRIVER, NODE, std::slice::from_ref(&gpu0)).await?;
    let notebook = allocated_claim(
        &client,
        "notebook",
        DRIVER,
        NODE,
        std::slice::from_ref(&gpu1),
    )
    .await?;
    let busy_pod = pod_using(&client, "trainer-0", "train", NODE).await?;
    let idle_pod = pod_using(&client, "jupyter-0", "notebook", NODE).await?;
    std::fs::create_dir_all(state.join("usage"))?;
    for (index, sm, pid, pod) in [(0, 90, 5001, &busy_pod), (1, 0, 5002, &idle_pod)] {
        let usage = json!({"smPercent": sm, "memoryPercent": 0, "memoryUsedBytes": 8u64 << 30,
                           "processes": [{"pid": pid, "usedMemoryBytes": 8u64 << 30}]});
        std::fs::write(state.join(format!("usage/{index}.json")), usage.to_string())?;
        let dir = proc_dir.path().join(pid.to_string());
        std::fs::create_dir_all(&dir)?;
        std::fs::write(
            dir.join("cgroup"),
            format!("0::/kubepods/burstable/pod{pod}/0123abcd\n"),
        )?;
    }
    let (kubelet, _) = Kubelet::register(&plugin.registration_socket()).await?;
    let answer = kubelet.prepare_v1(&[&train, &notebook]).await?;
    ensure!(
        answer.claims.values().all(|c| c.error.is_empty()),
        "{answer:?}"
    );
    // The probes stay open; the usage report does not; nothing is served in the clear.
    let https = |path: &'static str| {
        get_via(
            ([127, 0, 0, 1], port).into(),
            path,
            None,
            Transport::TlsAnyCertificate,
        )
    };
    let status = https("/healthz").await?.status;
    ensure!(status == 200, "the plugin's /healthz: {status}");
    let status = https("/usage").await?.status;
    ensure!(
        status == 401,
        "the plugin's /usage without a token: {status}"
    );
    let plain = get(port, "/healthz").await;
    ensure!(plain.is_err(), "plain HTTP on the TLS port: {plain:?}");

    // The documented role, and nothing else.
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    drust_e2e::rbac::dractl_top_kubeconfig(cp, &client, &kubeconfig).await?;

    let top: Value = until("dractl top showing the notebook idle", TIMEOUT, || async {
        let out = dractl(
            &kubeconfig,
            &["-A", "-o", "json", "--price-per-gpu-hour", "3"],
        )
        .map_err(|e| e.to_string())?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            return Err(format!("{stdout}{}", String::from_utf8_lossy(&out.stderr)));
        }
        let top: Value = serde_json::from_str(&stdout).map_err(|e| e.to_string())?;
        let idle = top["rows"][0]["pod"] == "jupyter-0" && top["rows"][0]["idle"] == true;
        if idle { Ok(Some(top)) } else { Err(stdout) }
    })
    .await?;
    let rows = top["rows"].as_array().context("rows")?;
    ensure!(rows.len() == 2, "{top:#}");
    let (nb, tr) = (&rows[0], &rows[1]);
    ensure!(
        nb["namespace"] == "default"
            && nb["node"] == NODE
            && nb["claims"] == json!(["notebook"])
            && nb["devices"] == json!([gpu1])
            && nb["gpus"] == 1.0
            && nb["smPercent"] == 0
            && nb["memoryUsedBytes"] == (8u64 << 30)
            && nb["idleSeconds"].as_u64() >= Some(2)
            && nb["idleCost"].as_f64().is_some_and(|c| c > 0.0),
        "{nb:#}"
    );
    ensure!(
        tr["pod"] == "trainer-0" && tr["idle"] == false && tr["smPercent"] == 90,
        "{tr:#}"
    );
    ensure!(
        top["allocatedGpus"] == 2.0 && top["idleGpus"] == 1.0,
        "{top:#}"
    );
    ensure!(top["unreachable"] == json!([]), "{top:#}");

    // The table a person reads, namespace-scoped as kubectl is.
    let out = dractl(&kubeconfig, &["-n", "default", "--idle"])?;
    let text = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("dractl top -n default --idle:\n{text}");
    let all = dractl(&kubeconfig, &["-A"])?;
    eprintln!("dractl top -A:\n{}", String::from_utf8_lossy(&all.stdout));
    ensure!(
        text.lines().any(|l| l.starts_with("default    jupyter-0"))
            && !text.contains("trainer-0")
            && text.contains("GPUs allocated: 2.00; idle: 1.00 (50%)"),
        "{text}"
    );

    // The roles reach no further: no proxy into the plugin's pod or another namespace's pods,
    // no port-forward into another namespace's pods.
    let topper = kube::Client::try_from(
        kube::Config::from_custom_kubeconfig(
            kube::config::Kubeconfig::read_from(&kubeconfig)?,
            &kube::config::KubeConfigOptions::default(),
        )
        .await?,
    )?;
    for (what, request) in [
        (
            "GET through the proxy of a pod in default",
            http::Request::get("/api/v1/namespaces/default/pods/jupyter-0:80/proxy/")
                .body(Vec::new())?,
        ),
        (
            "GET through the plugin pod's proxy",
            http::Request::get(format!(
                "/api/v1/namespaces/drust-system/pods/{PLUGIN_POD}:{port}/proxy/usage"
            ))
            .body(Vec::new())?,
        ),
    ] {
        match topper.request_text(request).await {
            Err(kube::Error::Api(e)) if e.code == 403 => {}
            other => anyhow::bail!("{what}: expected 403 Forbidden, got {other:?}"),
        }
    }
    match Api::<Pod>::namespaced(topper.clone(), "default")
        .portforward("jupyter-0", &[80])
        .await
    {
        Err(e) if e.to_string().contains("403") => {}
        Err(e) => anyhow::bail!("port-forward into default: expected 403 Forbidden, got {e}"),
        Ok(_) => anyhow::bail!("port-forward into default: expected 403 Forbidden, got through"),
    }

    // A tenant of `default` holding the Role alone (it reaches the plugins) and the built-in
    // `view` role in its namespace: its own namespace, and no other.
    apply_yaml(
        &client,
        "apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: tenant, namespace: default}\n\
         ---\napiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\n\
         metadata: {name: tenant-view, namespace: default}\n\
         roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: view}\n\
         subjects: [{kind: ServiceAccount, name: tenant, namespace: default}]\n",
        Path::new("tenant"),
    )
    .await?;
    bind_dractl_top(
        &client,
        "tenant",
        "{kind: ServiceAccount, name: tenant, namespace: default}",
        false,
    )
    .await?;
    let tenant = dir.path().join("tenant.kubeconfig");
    cp.write_kubeconfig(
        &tenant,
        &cp.service_account_token("default", "tenant").await?,
    )?;
    let own: Value = serde_json::from_str(&succeeded(&dractl(
        &tenant,
        &["-n", "default", "-o", "json"],
    )?)?)?;
    ensure!(
        own["rows"].as_array().map(Vec::len) == Some(2) && own["unreachable"] == json!([]),
        "the tenant's own namespace: {own:#}"
    );
    for args in [&["-A"][..], &["-n", "kube-system"][..]] {
        let stderr = failed(&dractl(&tenant, args)?)?;
        ensure!(
            stderr.contains("refused to show their usage")
                && stderr.contains("403 Forbidden")
                && stderr.contains("system:serviceaccount:default:tenant"),
            "the tenant with {args:?}: {stderr}"
        );
    }

    // A user of a client certificate has no token to show: told so, and served with one given.
    bind_dractl_top(
        &client,
        "cert-user",
        &format!("{{kind: User, name: {CERTIFICATE_USER}, apiGroup: rbac.authorization.k8s.io}}"),
        false,
    )
    .await?;
    let certificate = cp.certificate_user_kubeconfig_path();
    let stderr = failed(&dractl(certificate, &["-A"])?)?;
    ensure!(
        stderr.contains("no bearer token") && stderr.contains("--token-file"),
        "{stderr}"
    );
    let token_file = dir.path().join("topper.token");
    std::fs::write(
        &token_file,
        cp.service_account_token("default", "topper").await?,
    )?;
    let token_file = token_file.to_string_lossy().into_owned();
    let served: Value = serde_json::from_str(&succeeded(&dractl(
        certificate,
        &["-A", "-o", "json", "--token-file", &token_file],
    )?)?)?;
    ensure!(
        served["rows"].as_array().map(Vec::len) == Some(2),
        "with --token-file: {served:#}"
    );

    // Without the role: refused by the API server, and said so.
    let other = dir.path().join("other.kubeconfig");
    cp.write_kubeconfig(
        &other,
        &cp.service_account_token("default", "default").await?,
    )?;
    let stderr = failed(&dractl(&other, &["-A"])?)?;
    ensure!(stderr.contains("forbidden"), "{stderr}");
    Ok(())
}
