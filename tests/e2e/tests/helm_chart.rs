//! The Helm chart `deploy/helm/drust`: `helm lint` and `helm template` (Helm built from its Go
//! module) for default and non-default values, bad values refused with the schema's message, the
//! rendered DaemonSet's flags accepted by the real binary; then the rendered chart on a real
//! control plane, where the node plugin runs with the chart's ServiceAccount token (real
//! authentication, RBAC and admission) and every privilege it must not have is denied.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use drust_e2e::helm::{helm, helm_in, template};
use drust_e2e::kubelet::Kubelet;
use drust_e2e::manifests::{apply_file, repo_path};
use drust_e2e::plugin::NodePlugin;
use drust_e2e::wait::until;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use gpu_kubelet_plugin::claims::{Cluster as _, KubeCluster};
use gpu_kubelet_plugin::mps::{DaemonPods, DaemonSetOwner, MpsControl, Protocol};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod, Secret};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde::Deserialize as _;
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(90);
const RELEASE: &str = "drust";
const NAMESPACE: &str = "drust-system";
const SERVICE_ACCOUNT: &str = "drust-kubelet-plugin";
const POLICY: &str = "drust-resourceslices-own-node";
const POD_POLICY: &str = "drust-mps-daemon-pods-own-node";
const IMAGE: &str = "registry.example.com/drust/gpu-kubelet-plugin:0.1.0";
const DRIVER: &str = "gpu.drust.dev";

/// The documents of a rendered chart, as JSON values.
fn documents(rendered: &str) -> anyhow::Result<Vec<Value>> {
    let mut docs = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(rendered) {
        let value = serde_yaml_ng::Value::deserialize(doc)?;
        if !value.is_null() {
            docs.push(serde_json::to_value(value)?);
        }
    }
    Ok(docs)
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> anyhow::Result<&'a Value> {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .with_context(|| format!("no {kind} {name} rendered"))
}

fn kinds(docs: &[Value]) -> BTreeMap<String, usize> {
    let mut kinds = BTreeMap::new();
    for d in docs {
        *kinds
            .entry(d["kind"].as_str().unwrap_or("?").to_owned())
            .or_default() += 1;
    }
    kinds
}

fn container(docs: &[Value]) -> anyhow::Result<&Value> {
    let ds = docs
        .iter()
        .find(|d| d["kind"] == "DaemonSet")
        .context("no DaemonSet rendered")?;
    Ok(&ds["spec"]["template"]["spec"]["containers"][0])
}

fn args(docs: &[Value]) -> anyhow::Result<Vec<String>> {
    Ok(container(docs)?["args"]
        .as_array()
        .context("container has no args")?
        .iter()
        .filter_map(|a| a.as_str().map(str::to_owned))
        .collect())
}

/// The message of a failed `helm template` with `set`.
async fn refused(set: &[&str]) -> anyhow::Result<String> {
    match template(RELEASE, NAMESPACE, set).await {
        Ok(_) => bail!("helm template accepted {set:?}"),
        Err(e) => Ok(e.to_string()),
    }
}

#[tokio::test]
async fn the_chart_lints_renders_its_values_and_refuses_bad_ones() -> anyhow::Result<()> {
    let began = Instant::now();
    let version = helm(&["version", "--short"]).await?;
    eprintln!(
        "helm {} ready in {} ms",
        version.trim(),
        began.elapsed().as_millis()
    );
    let chart = drust_e2e::helm::chart_path();
    let chart = chart.to_string_lossy();

    // Lint, default and non-default values.
    helm(&["lint", "--strict", &chart]).await?;
    helm(&[
        "lint",
        "--strict",
        &chart,
        "--set",
        "driverName=gpu.example.com,features.migStrategy=partitionable",
    ])
    .await?;

    // Default values: every object, the DeviceClasses exactly as in deploy/deviceclasses/.
    let docs = documents(&template(RELEASE, NAMESPACE, &[]).await?)?;
    let want: BTreeMap<String, usize> = [
        ("ClusterRole", 2),
        ("ClusterRoleBinding", 1),
        ("DaemonSet", 1),
        ("DeviceClass", 4),
        ("Role", 2),
        ("RoleBinding", 2),
        ("Service", 1),
        ("ServiceAccount", 1),
        ("ValidatingAdmissionPolicy", 4),
        ("ValidatingAdmissionPolicyBinding", 4),
    ]
    .into_iter()
    .map(|(k, n)| (k.to_owned(), n))
    .collect();
    ensure!(kinds(&docs) == want, "rendered {:?}", kinds(&docs));
    for (file, class) in [
        ("gpu.yaml", "gpu.drust.dev"),
        ("mig.yaml", "mig.drust.dev"),
        ("gpu-extended.yaml", "gpu-extended.drust.dev"),
        ("imex-channel.yaml", "imex-channel.drust.dev"),
    ] {
        let text = std::fs::read_to_string(repo_path(&format!("deploy/deviceclasses/{file}")))?;
        let plain = documents(&text)?;
        let rendered = find(&docs, "DeviceClass", class)?;
        ensure!(
            plain.len() == 1 && plain[0]["spec"] == rendered["spec"],
            "deploy/deviceclasses/{file} and the chart's {class} differ: {} vs {}",
            plain[0]["spec"],
            rendered["spec"]
        );
    }
    let a = args(&docs)?;
    for flag in [
        "--plugin-dir=/var/lib/kubelet/plugins/gpu.drust.dev",
        "--registrar-dir=/var/lib/kubelet/plugins_registry",
        "--mig-strategy=existing",
        "--sharing=true",
        "--health-monitoring=true",
        "--http-address=0.0.0.0:9477",
        "--http-auth=true",
        "--http-tls=true",
        "--mps-daemon-image=ghcr.io/drust/gpu-kubelet-plugin:0.1.0",
        "--mps-daemon-priority-class=system-node-critical",
        "--usage-interval-seconds=10",
        "--usage-proc-root=/host/proc",
        "--idle-window-seconds=1800",
        "--idle-events=true",
        "--pod-resources-socket=/var/lib/kubelet/pod-resources/kubelet.sock",
    ] {
        ensure!(a.iter().any(|x| x == flag), "{flag} not in {a:?}");
    }
    // IMEX channels: the plugin's own default (one where /proc/devices has the line).
    ensure!(!a.iter().any(|x| x.starts_with("--imex-channels")), "{a:?}");
    // Usage sampling reads the host's /proc and the kubelet's PodResources socket, read-only;
    // the GPUIdle marks need the claim status rules, and no events rule.
    for mount in [
        json!({"name": "host-proc", "mountPath": "/host/proc", "readOnly": true}),
        json!({"name": "pod-resources", "mountPath": "/var/lib/kubelet/pod-resources",
            "readOnly": true}),
    ] {
        ensure!(
            container(&docs)?["volumeMounts"]
                .as_array()
                .is_some_and(|m| m.contains(&mount)),
            "no read-only {mount}"
        );
    }
    let rules = |docs: &[Value]| -> anyhow::Result<Vec<Value>> {
        Ok(find(docs, "ClusterRole", "drust-kubelet-plugin")?["rules"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    };
    let mark_rule = json!({"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/driver"],
        "resourceNames": ["gpu.drust.dev"], "verbs": ["associated-node:patch"]});
    let on_rules = rules(&docs)?;
    ensure!(
        on_rules.contains(&mark_rule)
            && !on_rules
                .iter()
                .any(|r| r["apiGroups"] == json!(["events.k8s.io"])),
        "the idle marks' rules: {on_rules:?}"
    );
    let off = documents(&template(RELEASE, NAMESPACE, &["usage.intervalSeconds=0"]).await?)?;
    ensure!(
        !rules(&off)?.contains(&mark_rule)
            && args(&off)?.contains(&"--usage-interval-seconds=0".to_owned())
            && !serde_json::to_string(&off)?.contains("host-proc")
            && !serde_json::to_string(&off)?.contains("pod-resources"),
        "usage off still renders its flags, mount or status rules"
    );
    // /metrics and /usage behind the API server's reviews (issue 41, defect 9), on by default:
    // the plugin may create TokenReviews and SubjectAccessReviews, and nothing else is added;
    // Prometheus gets a role for /metrics alone. Off: neither.
    let reviews = [
        json!({"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
            "verbs": ["create"]}),
        json!({"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"],
            "verbs": ["create"]}),
    ];
    ensure!(
        reviews.iter().all(|r| on_rules.contains(r)),
        "the review rules: {on_rules:?}"
    );
    let reader = find(&docs, "ClusterRole", "drust-metrics-reader")?;
    ensure!(
        reader["rules"] == json!([{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]),
        "{reader}"
    );
    let open = documents(&template(RELEASE, NAMESPACE, &["http.auth=false"]).await?)?;
    let open_rules = rules(&open)?;
    ensure!(
        args(&open)?.contains(&"--http-auth=false".to_owned())
            && find(&open, "ClusterRole", "drust-metrics-reader").is_err()
            && !reviews.iter().any(|r| open_rules.contains(r))
            && on_rules
                .iter()
                .filter(|r| !reviews.contains(r))
                .eq(open_rules.iter()),
        "http.auth=false: {open_rules:?}"
    );
    let message = refused(&["http.auth=maybe"]).await?;
    ensure!(message.contains("/http/auth"), "{message}");

    // TLS on the HTTP port (issue 41): on by default with a self-signed certificate, the
    // probes over HTTPS; with a Secret, its files mounted read-only; off, plain HTTP probes.
    let probe_schemes = |docs: &[Value]| -> anyhow::Result<(Value, Value)> {
        let c = container(docs)?;
        Ok((
            c["livenessProbe"]["httpGet"]["scheme"].clone(),
            c["readinessProbe"]["httpGet"]["scheme"].clone(),
        ))
    };
    ensure!(
        args(&docs)?.contains(&"--http-tls=true".to_owned())
            && !args(&docs)?
                .iter()
                .any(|a| a.starts_with("--http-tls-cert-file"))
            && probe_schemes(&docs)? == (json!("HTTPS"), json!("HTTPS")),
        "http.tls by default: {:?} {:?}",
        args(&docs)?,
        probe_schemes(&docs)?
    );
    let with_secret =
        documents(&template(RELEASE, NAMESPACE, &["http.tls.secretName=drust-http-tls"]).await?)?;
    let a = args(&with_secret)?;
    let ds = find(&with_secret, "DaemonSet", "drust-kubelet-plugin")?;
    ensure!(
        a.contains(&"--http-tls-cert-file=/etc/drust/http-tls/tls.crt".to_owned())
            && a.contains(&"--http-tls-key-file=/etc/drust/http-tls/tls.key".to_owned())
            && ds["spec"]["template"]["spec"]["volumes"]
                .as_array()
                .is_some_and(|v| v.contains(&json!({"name": "http-tls",
                    "secret": {"secretName": "drust-http-tls", "defaultMode": 0o400}})))
            && container(&with_secret)?["volumeMounts"]
                .as_array()
                .is_some_and(|m| m.contains(&json!({"name": "http-tls",
                    "mountPath": "/etc/drust/http-tls", "readOnly": true}))),
        "http.tls.secretName: {a:?} {ds}"
    );
    let plain = documents(&template(RELEASE, NAMESPACE, &["http.tls.enabled=false"]).await?)?;
    ensure!(
        args(&plain)?.contains(&"--http-tls=false".to_owned())
            && probe_schemes(&plain)? == (json!("HTTP"), json!("HTTP")),
        "http.tls.enabled=false: {:?}",
        probe_schemes(&plain)?
    );
    let message = refused(&["http.tls.secretName=Not_A_Name"]).await?;
    ensure!(message.contains("/http/tls/secretName"), "{message}");

    // The optional NetworkPolicy (issue 41, defect 9): off by default; on, the plugins' HTTP
    // port answers only the peers given, and no other ingress reaches the plugin pods.
    ensure!(
        find(&docs, "NetworkPolicy", "drust-kubelet-plugin").is_err(),
        "a NetworkPolicy by default"
    );
    let fenced = documents(
        &template(
            RELEASE,
            NAMESPACE,
            &["http.networkPolicy.enabled=true,http.networkPolicy.from[0].namespaceSelector.matchLabels.team=monitoring"],
        )
        .await?,
    )?;
    let policy = find(&fenced, "NetworkPolicy", "drust-kubelet-plugin")?;
    ensure!(
        policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
            == "kubelet-plugin"
            && policy["spec"]["policyTypes"] == json!(["Ingress"])
            && policy["spec"]["ingress"]
                == json!([{"from": [{"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}],
                    "ports": [{"protocol": "TCP", "port": 9477}]}]),
        "{policy}"
    );
    // The dashboard and the alert, when asked for: every query and rule parses and validates as
    // Prometheus itself reads it, and selects only metrics the plugin serves.
    let on = documents(
        &template(
            RELEASE,
            NAMESPACE,
            &["metrics.grafanaDashboard.enabled=true,metrics.prometheusRule.enabled=true"],
        )
        .await?,
    )?;
    let rule = find(&on, "PrometheusRule", "drust-gpu-idle")?;
    let dashboard = find(&on, "ConfigMap", "drust-grafana-dashboard")?;
    ensure!(
        dashboard["metadata"]["labels"]["grafana_dashboard"] == "1",
        "{}",
        dashboard["metadata"]
    );
    let scratch = tempfile::tempdir()?;
    let (groups, dash) = (
        scratch.path().join("groups.yaml"),
        scratch.path().join("dashboard.json"),
    );
    std::fs::write(&groups, serde_json::to_string(&rule["spec"])?)?;
    std::fs::write(
        &dash,
        dashboard["data"]["drust-gpu-usage.json"]
            .as_str()
            .context("the dashboard's JSON")?,
    )?;
    let promcheck = drust_gotools::go_module_tool("promcheck").map_err(anyhow::Error::msg)?;
    let out = std::process::Command::new(promcheck)
        .arg("-rules")
        .arg(&groups)
        .arg("-dashboard")
        .arg(&dash)
        .output()?;
    ensure!(
        out.status.success(),
        "Prometheus's parsers refuse the chart's rule or dashboard: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let selected: Value = serde_json::from_slice(&out.stdout)?;
    let selected = selected["metrics"].as_array().context("metric names")?;
    ensure!(selected.len() >= 5, "{selected:?}");
    for m in selected {
        let m = m.as_str().unwrap_or_default();
        ensure!(
            gpu_kubelet_plugin::usage::collector::METRICS.contains(&m),
            "the chart queries {m}, which the plugin does not serve"
        );
    }
    let ds = find(&docs, "DaemonSet", "drust-kubelet-plugin")?;
    ensure!(
        ds["spec"]["updateStrategy"]
            == json!({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}),
        "{}",
        ds["spec"]["updateStrategy"]
    );
    let c = container(&docs)?;
    ensure!(c["securityContext"]["privileged"] == true, "{c}");
    ensure!(c["livenessProbe"]["httpGet"]["path"] == "/healthz", "{c}");
    ensure!(c["readinessProbe"]["httpGet"]["path"] == "/readyz", "{c}");
    let env = c["env"].as_array().context("env")?;
    for (name, field) in [
        ("NODE_NAME", "spec.nodeName"),
        ("POD_UID", "metadata.uid"),
        ("POD_NAMESPACE", "metadata.namespace"),
    ] {
        ensure!(
            env.iter()
                .any(|e| e["name"] == name && e["valueFrom"]["fieldRef"]["fieldPath"] == field),
            "{name} not from {field}: {env:?}"
        );
    }
    let service = find(&docs, "Service", "drust-metrics")?;
    ensure!(
        service["spec"]["selector"] == ds["spec"]["selector"]["matchLabels"],
        "the metrics Service does not select the plugin pods"
    );

    // Non-default values: another driver name flows into flags, class names and selectors;
    // partitionable MIG; sharing, health and the extended-resource class off.
    let docs = documents(
        &template(
            RELEASE,
            NAMESPACE,
            &[
                "driverName=gpu.example.com",
                "features.migStrategy=partitionable",
                "features.sharing=false",
                "features.healthMonitoring=false",
                "deviceClasses.extendedResource.enabled=false",
                "metrics.service.enabled=false",
            ],
        )
        .await?,
    )?;
    ensure!(kinds(&docs)["DeviceClass"] == 3, "{:?}", kinds(&docs));
    ensure!(!kinds(&docs).contains_key("Service"), "{:?}", kinds(&docs));
    // Without sharing, no MPS daemon Pods: no Role, no policy for Pods, no daemon flags.
    ensure!(
        kinds(&docs)["Role"] == 1 && kinds(&docs)["ValidatingAdmissionPolicy"] == 2,
        "{:?}",
        kinds(&docs)
    );
    ensure!(
        !args(&docs)?.iter().any(|a| a.starts_with("--mps-")),
        "{:?}",
        args(&docs)?
    );
    for class in [
        "gpu.example.com",
        "mig.example.com",
        "imex-channel.example.com",
    ] {
        let expression =
            find(&docs, "DeviceClass", class)?["spec"]["selectors"][0]["cel"]["expression"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
        ensure!(
            expression.contains(r#"device.driver == "gpu.example.com""#)
                && expression.contains(r#"device.attributes["gpu.example.com"]"#),
            "{class}: {expression}"
        );
    }
    let a = args(&docs)?;
    for flag in [
        "--plugin-dir=/var/lib/kubelet/plugins/gpu.example.com",
        "--mig-strategy=partitionable",
        "--sharing=false",
        "--health-monitoring=false",
    ] {
        ensure!(a.iter().any(|x| x == flag), "{flag} not in {a:?}");
    }
    ensure!(
        container(&docs)?["env"].as_array().is_some_and(|e| e
            .iter()
            .any(|e| e["name"] == "DRIVER_NAME" && e["value"] == "gpu.example.com")),
        "DRIVER_NAME"
    );

    // Unprivileged: the NVIDIA runtime injects the devices.
    let docs = documents(
        &template(
            RELEASE,
            NAMESPACE,
            &["security.deviceAccess=runtime", "features.sharing=false"],
        )
        .await?,
    )?;
    let c = container(&docs)?;
    ensure!(c["securityContext"]["privileged"] == false, "{c}");
    ensure!(
        c["securityContext"]["capabilities"]["drop"] == json!(["ALL"]),
        "{c}"
    );
    ensure!(
        find(&docs, "DaemonSet", "drust-kubelet-plugin")?["spec"]["template"]["spec"]["runtimeClassName"]
            == "nvidia",
        "runtimeClassName"
    );

    // Bad values fail with the schema's (or the chart's) message naming the value.
    let message = refused(&["features.migStrategy=dynamic"]).await?;
    eprintln!("bad migStrategy: {message}");
    ensure!(
        message.contains("values don't meet the specifications of the schema")
            && message.contains("/features/migStrategy")
            && message.contains("'existing', 'partitionable'"),
        "{message}"
    );
    let message = refused(&["driverName=GPU_Drust"]).await?;
    eprintln!("bad driverName: {message}");
    ensure!(
        message.contains("/driverName") && message.contains("does not match pattern"),
        "{message}"
    );
    let message = refused(&["http.port=0"]).await?;
    ensure!(message.contains("/http/port"), "{message}");
    // The ComputeDomain controller names drust's driver and channel class: a release that
    // publishes others (NVIDIA's names) cannot run it yet, and says so.
    let message = refused(&["computeDomains.enabled=true", "nvidiaCompatibility=true"]).await?;
    ensure!(
        message.contains("computeDomains.enabled")
            && message.contains("driver gpu.nvidia.com and DeviceClass imex-channel.nvidia.com"),
        "{message}"
    );
    let message = refused(&["features.imexChannels=many"]).await?;
    ensure!(message.contains("/features/imexChannels"), "{message}");
    let docs = documents(&template(RELEASE, NAMESPACE, &["features.imexChannels=2"]).await?)?;
    ensure!(
        args(&docs)?.iter().any(|x| x == "--imex-channels=2"),
        "{:?}",
        args(&docs)?
    );
    let message = refused(&["feature.sharing=false"]).await?;
    eprintln!("misspelt key: {message}");
    ensure!(
        message.contains("additional properties 'feature' not allowed"),
        "{message}"
    );
    let message = refused(&["security.deviceAccess=runtime"]).await?;
    eprintln!("runtime with sharing: {message}");
    ensure!(
        message.contains(
            "security.deviceAccess=runtime cannot be combined with features.sharing=true"
        ),
        "{message}"
    );

    // The rendered flags are the binary's: it parses them (plus a fake topology and the env the
    // pod gets) and publishes under the rendered driver name.
    let docs = documents(&template(RELEASE, NAMESPACE, &["driverName=gpu.example.com"]).await?)?;
    let a = args(&docs)?;
    let binary = tokio::task::spawn_blocking(drust_e2e::binary::plugin_binary)
        .await?
        .map_err(anyhow::Error::msg)?;
    let out = tokio::process::Command::new(binary)
        .args(&a)
        .args(["--dry-run", "--fake-topology"])
        .arg(repo_path("examples/topologies/dgx-h100.yaml"))
        .env("DRIVER_NAME", "gpu.example.com")
        .env("NODE_NAME", "node-a")
        // What the downward API gives the pod (the daemon Pods' namespace).
        .env("POD_NAMESPACE", NAMESPACE)
        .output()
        .await?;
    ensure!(
        out.status.success(),
        "gpu-kubelet-plugin {a:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8_lossy(&out.stdout);
    ensure!(printed.contains("driver: gpu.example.com"), "{printed}");
    Ok(())
}

/// A ResourceSlice of one device for driver gpu.drust.dev; `placement` is merged into its spec
/// (`nodeName`, `allNodes` or `nodeSelector`).
fn slice(name: &str, pool: &str, placement: Value) -> anyhow::Result<ResourceSlice> {
    slice_of(DRIVER, name, pool, placement)
}

/// As [`slice`], for `driver`.
fn slice_of(
    driver: &str,
    name: &str,
    pool: &str,
    placement: Value,
) -> anyhow::Result<ResourceSlice> {
    let mut spec = json!({
        "driver": driver,
        "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1},
        "devices": [{"name": "gpu-0"}],
    });
    if let (Some(spec), Some(placement)) = (spec.as_object_mut(), placement.as_object()) {
        spec.extend(placement.clone());
    }
    Ok(serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": spec,
    }))?)
}

/// Asserts `result` is the API server's 403 whose message contains every one of `needles`.
fn denied<T: std::fmt::Debug>(
    what: &str,
    result: Result<T, kube::Error>,
    needles: &[&str],
) -> anyhow::Result<()> {
    match result {
        Err(kube::Error::Api(e)) if e.code == 403 => {
            for n in needles {
                ensure!(
                    e.message.contains(n),
                    "{what}: denied, but the message lacks {n:?}: {}",
                    e.message
                );
            }
            eprintln!("denied as expected: {what}: {}", e.message);
            Ok(())
        }
        other => bail!("{what}: expected 403 Forbidden, got {other:?}"),
    }
}

async fn client_from(kubeconfig: &Path) -> anyhow::Result<kube::Client> {
    let config = kube::Config::from_custom_kubeconfig(
        Kubeconfig::read_from(kubeconfig)?,
        &KubeConfigOptions::default(),
    )
    .await?;
    Ok(kube::Client::try_from(config)?)
}

/// A ServiceAccount `name` in `drust-tenants` (created with `admin`) and a token of it.
async fn tenant_token(
    cp: &ControlPlane,
    admin: &kube::Client,
    name: &str,
) -> anyhow::Result<String> {
    drust_e2e::manifests::apply_yaml(
        admin,
        &format!(
            "apiVersion: v1\nkind: ServiceAccount\nmetadata: {{name: {name}, namespace: drust-tenants}}\n"
        ),
        Path::new("tenant ServiceAccount"),
    )
    .await?;
    Ok(cp.service_account_token("drust-tenants", name).await?)
}

/// The name the plugin's certificate holds for Prometheus's `tls_config.server_name`.
const METRICS_SERVICE_NAME: &str = "drust-metrics.drust-system.svc";

/// A CA and a serving certificate it signed for `localhost` and [`METRICS_SERVICE_NAME`], as
/// PEM files in a directory (what a `kubernetes.io/tls` Secret from cert-manager holds).
struct ServingPair {
    ca_pem: String,
    ca_file: std::path::PathBuf,
    cert: std::path::PathBuf,
    key: std::path::PathBuf,
}

impl ServingPair {
    fn generate(dir: &Path) -> anyhow::Result<Self> {
        use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;
        let key = KeyPair::generate()?;
        let cert = CertificateParams::new(vec![
            "localhost".to_owned(),
            METRICS_SERVICE_NAME.to_owned(),
        ])?
        .signed_by(&key, &ca)?;
        let pair = Self {
            ca_pem: ca.pem(),
            ca_file: dir.join("http-ca.crt"),
            cert: dir.join("http-tls.crt"),
            key: dir.join("http-tls.key"),
        };
        std::fs::write(&pair.ca_file, &pair.ca_pem)?;
        std::fs::write(&pair.cert, cert.pem())?;
        std::fs::write(&pair.key, key.serialize_pem())?;
        Ok(pair)
    }

    fn source(&self) -> gpu_kubelet_plugin::http::tls::TlsSource {
        gpu_kubelet_plugin::http::tls::TlsSource::Files {
            cert: self.cert.clone(),
            key: self.key.clone(),
        }
    }
}

/// The chart README's Prometheus scrape job (the first `scrape_configs` entry of its
/// "Scraping" example), with the Kubernetes service discovery left out: the test names the
/// target itself.
fn readme_scrape_job() -> anyhow::Result<Value> {
    let readme = std::fs::read_to_string(repo_path("deploy/helm/drust/README.md"))?;
    let block = readme
        .split("```yaml\n# prometheus.yml")
        .nth(1)
        .and_then(|rest| rest.split_once('\n'))
        .and_then(|(_comment, rest)| rest.split("\n---\n").next())
        .context("the chart README's prometheus.yml example")?;
    let jobs: Vec<Value> = serde_yaml_ng::from_str(block)?;
    let mut job = jobs.into_iter().next().context("a scrape job")?;
    let map = job.as_object_mut().context("a scrape job is a mapping")?;
    for discovery in ["kubernetes_sd_configs", "relabel_configs"] {
        ensure!(
            map.remove(discovery).is_some(),
            "the job has no {discovery}: {block}"
        );
    }
    Ok(job)
}

/// The answers of the plugin's HTTP endpoint on `port` (auth and TLS on, running as the
/// chart's ServiceAccount, serving `tls`) to callers with and without the roles, and to
/// Prometheus scraping as the chart's README says.
async fn http_endpoint_checks(
    cp: &ControlPlane,
    admin: &kube::Client,
    port: u16,
    tls: &ServingPair,
    scratch: &Path,
) -> anyhow::Result<()> {
    use drust_e2e::http::{Transport, get_via};
    let address = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let verified = Transport::TlsVerified {
        ca_pem: tls.ca_pem.clone(),
        server_name: "localhost".into(),
    };
    drust_e2e::manifests::apply_yaml(
        admin,
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: drust-tenants}\n---\n\
         apiVersion: v1\nkind: Namespace\nmetadata: {name: team-a}\n",
        Path::new("namespaces"),
    )
    .await?;
    // The chart's reader role bound to a Prometheus; a tenant may list claims in team-a (the
    // built-in `view` role there); another ServiceAccount holds no role at all.
    let (prometheus, tenant, nobody) = (
        tenant_token(cp, admin, "prometheus").await?,
        tenant_token(cp, admin, "tenant").await?,
        tenant_token(cp, admin, "nobody").await?,
    );
    drust_e2e::manifests::apply_yaml(
        admin,
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\n\
         metadata: {name: prometheus-drust-metrics}\n\
         roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: drust-metrics-reader}\n\
         subjects: [{kind: ServiceAccount, name: prometheus, namespace: drust-tenants}]\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\n\
         metadata: {name: tenant-view, namespace: team-a}\n\
         roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: view}\n\
         subjects: [{kind: ServiceAccount, name: tenant, namespace: drust-tenants}]\n",
        Path::new("bindings"),
    )
    .await?;

    for path in ["/healthz", "/readyz"] {
        let answer = get_via(address, path, None, verified.clone()).await?;
        ensure!(answer.status == 200, "{path} without a token: {answer:?}");
    }
    let answer = get_via(address, "/metrics", None, verified.clone()).await?;
    ensure!(
        answer.status == 401
            && answer.head.contains("www-authenticate: Bearer")
            && answer.body.contains("no bearer token"),
        "/metrics without a token: {answer:?}"
    );
    // A token the API server never issued, and one signed by another cluster's key.
    let forged = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW06YWRtaW4ifQ.c2lnbmF0dXJl";
    for token in ["not-a-token", forged] {
        let answer = get_via(address, "/metrics", Some(token), verified.clone()).await?;
        ensure!(
            answer.status == 401 && answer.body.contains("does not accept"),
            "/metrics with {token}: {answer:?}"
        );
    }
    let answer = get_via(address, "/metrics", Some(&nobody), verified.clone()).await?;
    ensure!(
        answer.status == 403
            && answer
                .body
                .contains("\"system:serviceaccount:drust-tenants:nobody\" may not get /metrics"),
        "/metrics for a ServiceAccount without the role: {answer:?}"
    );
    let answer = get_via(address, "/metrics", Some(&prometheus), verified.clone()).await?;
    ensure!(
        answer.status == 200
            && answer.body.contains("drust_")
            && answer.head.contains("openmetrics-text"),
        "/metrics for Prometheus: {} {}",
        answer.status,
        answer.body
    );
    // Again, from the cache, and the same answer.
    let again = get_via(address, "/metrics", Some(&prometheus), verified.clone()).await?;
    ensure!(again.status == 200, "{again:?}");

    // TLS: the token never crosses in the clear, since the port answers no plain HTTP; a
    // client that trusts another CA is refused; the kubelet's way (any certificate) works.
    let plain = drust_e2e::http::get_at(address, "/metrics", Some(&prometheus)).await;
    ensure!(
        plain.is_err(),
        "plain HTTP on the TLS port answered: {plain:?}"
    );
    let elsewhere = scratch.join("stranger");
    std::fs::create_dir_all(&elsewhere)?;
    let stranger = ServingPair::generate(&elsewhere)?;
    let refused = get_via(
        address,
        "/healthz",
        None,
        Transport::TlsVerified {
            ca_pem: stranger.ca_pem,
            server_name: "localhost".into(),
        },
    )
    .await;
    ensure!(
        refused
            .as_ref()
            .is_err_and(|e| format!("{e:?}").contains("InvalidCertificate")),
        "a client trusting another CA: {refused:?}"
    );
    let probe = get_via(address, "/healthz", None, Transport::TlsAnyCertificate).await?;
    ensure!(probe.status == 200, "{probe:?}");

    // Prometheus, configured exactly as the chart's README says (its scrape job, HTTPS,
    // insecure_skip_verify for self-signed certificates, the ServiceAccount token from a
    // file), with its own HTTP client and parser; then the README's CA variant (`ca_file`,
    // `server_name` naming the metrics Service).
    let token_file = scratch.join("prometheus-token");
    std::fs::write(&token_file, &prometheus)?;
    let mut job = readme_scrape_job()?;
    ensure!(
        job["scheme"] == "https"
            && job["tls_config"] == json!({"insecure_skip_verify": true})
            && job["authorization"]["credentials_file"]
                == "/var/run/secrets/kubernetes.io/serviceaccount/token",
        "the README's scrape job: {job}"
    );
    job["authorization"]["credentials_file"] = json!(token_file);
    for (variant, tls_config) in [
        ("as the README gives it", job["tls_config"].clone()),
        (
            "with the Secret's CA",
            json!({"ca_file": tls.ca_file, "server_name": METRICS_SERVICE_NAME}),
        ),
    ] {
        job["tls_config"] = tls_config;
        let scraped = drust_e2e::prometheus::scrape(&job, scratch, address)
            .await
            .map_err(|e| anyhow::anyhow!("Prometheus's scrape {variant}: {e}"))?;
        ensure!(
            scraped.status == 200
                && scraped
                    .content_type
                    .starts_with("application/openmetrics-text")
                && scraped.samples > 0
                && scraped.metrics.iter().any(|m| m.starts_with("drust_")),
            "Prometheus's scrape {variant}: {scraped:?}"
        );
        eprintln!(
            "Prometheus scraped {} samples over HTTPS {variant}",
            scraped.samples
        );
    }
    // Without the token the same client is refused.
    job.as_object_mut().map(|j| j.remove("authorization"));
    let anonymous = drust_e2e::prometheus::scrape(&job, scratch, address).await;
    ensure!(
        anonymous.as_ref().is_err_and(|e| e.contains("401")),
        "Prometheus without a token: {anonymous:?}"
    );

    // /usage: not Prometheus's role. The tenant: its own namespace, none other, not all; a
    // ServiceAccount without any role: nothing, not even with a namespace named.
    for (who, token, path, want) in [
        ("Prometheus", &prometheus, "/usage", 403),
        ("the tenant", &tenant, "/usage", 403),
        ("the tenant", &tenant, "/usage?namespace=team-a", 200),
        ("the tenant", &tenant, "/usage?namespace=default", 403),
        ("the tenant", &tenant, "/usage?namespace=Team%2Da", 400),
        ("a ServiceAccount without a role", &nobody, "/usage", 403),
        (
            "a ServiceAccount without a role",
            &nobody,
            "/usage?namespace=drust-tenants",
            403,
        ),
    ] {
        let answer = get_via(address, path, Some(token), verified.clone()).await?;
        ensure!(
            answer.status == want,
            "{path} for {who}: expected {want}, got {answer:?}"
        );
        if want == 200 {
            let report: Value = serde_json::from_str(&answer.body)?;
            ensure!(report["node"] == "gpu-node-a", "{report:#}");
        }
    }
    let answer = get_via(
        address,
        "/usage?namespace=default",
        Some(&tenant),
        verified.clone(),
    )
    .await?;
    ensure!(
        answer.body.contains(
            "may not get /usage or list resourceclaims.resource.k8s.io in namespace default"
        ),
        "{answer:?}"
    );

    // Nothing else came with the reviews: the plugin's ServiceAccount may not mint tokens,
    // impersonate, or read /metrics itself.
    let user = format!("system:serviceaccount:{NAMESPACE}:{SERVICE_ACCOUNT}");
    let reviews: Api<k8s_openapi::api::authorization::v1::SubjectAccessReview> =
        Api::all(admin.clone());
    for (what, attributes, want) in [
        (
            "create tokenreviews",
            json!({"resourceAttributes": {"group": "authentication.k8s.io",
                "resource": "tokenreviews", "verb": "create"}}),
            true,
        ),
        (
            "create subjectaccessreviews",
            json!({"resourceAttributes": {"group": "authorization.k8s.io",
                "resource": "subjectaccessreviews", "verb": "create"}}),
            true,
        ),
        (
            "create serviceaccounts/token",
            json!({"resourceAttributes": {"resource": "serviceaccounts",
                "subresource": "token", "verb": "create", "namespace": NAMESPACE}}),
            false,
        ),
        (
            "impersonate users",
            json!({"resourceAttributes": {"resource": "users", "verb": "impersonate"}}),
            false,
        ),
        (
            "get /metrics",
            json!({"nonResourceAttributes": {"path": "/metrics", "verb": "get"}}),
            false,
        ),
    ] {
        let mut spec = attributes;
        spec["user"] = json!(user);
        spec["groups"] = json!([
            "system:serviceaccounts",
            format!("system:serviceaccounts:{NAMESPACE}"),
            "system:authenticated"
        ]);
        let review = reviews
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"spec": spec}))?,
            )
            .await?;
        let allowed = review.status.is_some_and(|s| s.allowed);
        ensure!(
            allowed == want,
            "the plugin's ServiceAccount may {}{what}",
            if want { "" } else { "not " }
        );
    }
    Ok(())
}

#[tokio::test]
async fn the_plugin_runs_with_the_charts_least_privilege_on_a_real_control_plane()
-> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let admin = cp.client().await?;
    let scratch = tempfile::tempdir()?;
    cp.register_node(
        "gpu-node-a",
        &[("feature.node.kubernetes.io/pci-10de.present", "true")],
    )
    .await?;
    cp.register_node("gpu-node-b", &[("nvidia.com/gpu.present", "true")])
        .await?;
    cp.register_node("cpu-node", &[]).await?;

    // 1. The chart installed as the README says (plus this control plane's kubeconfig).
    let chart = drust_e2e::helm::chart_path();
    let kubeconfig_flag = format!("--kubeconfig={}", cp.kubeconfig_path().display());
    let installed = helm_in(
        Some(&scratch.path().join("helm-home")),
        &[
            "install",
            RELEASE,
            &chart.to_string_lossy(),
            "--namespace",
            NAMESPACE,
            "--create-namespace",
            "--set",
            "image.repository=registry.example.com/drust/gpu-kubelet-plugin",
            "--set",
            "image.tag=0.1.0",
            &kubeconfig_flag,
        ],
    )
    .await?;
    ensure!(installed.contains("STATUS: deployed"), "{installed}");

    // 2. The DaemonSet controller and the scheduler put one plugin pod on each GPU node and
    //    none on the CPU node (no kubelet runs them; they stay Pending, bound).
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NAMESPACE);
    let placed = until("a plugin pod bound on each GPU node", TIMEOUT, || async {
        let list = pods
            .list(&ListParams::default().labels("app.kubernetes.io/instance=drust"))
            .await
            .map_err(|e| e.to_string())?;
        let nodes: BTreeMap<String, Pod> = list
            .items
            .into_iter()
            .filter_map(|p| Some((p.spec.as_ref()?.node_name.clone()?, p)))
            .collect();
        Ok((nodes.len() >= 2).then_some(nodes))
    })
    .await?;
    ensure!(
        placed.keys().map(String::as_str).collect::<Vec<_>>() == ["gpu-node-a", "gpu-node-b"],
        "plugin pods on {:?}",
        placed.keys()
    );
    // The DaemonSet controller writes its status after it creates the pods: wait for it.
    let daemonsets = Api::<DaemonSet>::namespaced(admin.clone(), NAMESPACE);
    let ds = until("the DaemonSet's status: 2 nodes", TIMEOUT, || async {
        let ds = daemonsets
            .get("drust-kubelet-plugin")
            .await
            .map_err(|e| e.to_string())?;
        match ds.status.as_ref().map(|s| s.desired_number_scheduled) {
            Some(2) => Ok(Some(ds)),
            Some(n) if n > 2 => Err(format!("{n} nodes desired: {:?}", ds.status)),
            _ => Ok(None),
        }
    })
    .await?;

    // 3. The plugin's identity: a token of the chart's ServiceAccount bound to its pod on
    //    gpu-node-a, as the kubelet projects it.
    let kubeconfig = scratch.path().join("plugin.kubeconfig");
    let pod_a =
        drust_e2e::rbac::chart_plugin_kubeconfig(&cp, &admin, "gpu-node-a", &kubeconfig, TIMEOUT)
            .await?;
    let plugin_client = client_from(&kubeconfig).await?;
    let slices: Api<ResourceSlice> = Api::all(plugin_client.clone());

    // The policy is loaded by an informer: wait until a dry-run write for another node is
    // refused by it before trusting any outcome below.
    until("the slice policy enforced", TIMEOUT, || async {
        let probe = slice(
            "policy-probe",
            "gpu-node-b",
            json!({"nodeName": "gpu-node-b"}),
        )
        .map_err(|e| e.to_string())?;
        match slices
            .create(
                &PostParams {
                    dry_run: true,
                    ..Default::default()
                },
                &probe,
            )
            .await
        {
            Err(kube::Error::Api(e)) if e.message.contains(POLICY) => Ok(Some(())),
            other => Err(format!("{other:?}")),
        }
    })
    .await?;

    // 4. The plugin, as that identity, publishes its node's slices and prepares a claim.
    let http_port = drust_e2e::ports::free_port()?;
    // Its HTTPS certificate as a cert-manager Secret would hold it: signed by a CA, naming the
    // metrics Service, which Prometheus's `tls_config.server_name` checks.
    let http_tls = ServingPair::generate(scratch.path())?;
    let mut plugin = NodePlugin::start_with(
        &cp,
        DRIVER,
        "gpu-node-a",
        &repo_path("examples/topologies/dgx-h100.yaml"),
        |c| {
            c.kubeconfig = Some(kubeconfig.clone());
            // As the chart runs it: /metrics and /usage behind the API server's reviews.
            c.http_address = Some(([127, 0, 0, 1], http_port).into());
            c.http_auth = true;
            c.http_tls = Some(http_tls.source());
        },
    )?;
    let published = plugin.wait_ready(&admin, TIMEOUT).await?;
    ensure!(
        !published.is_empty()
            && published
                .iter()
                .all(|s| s.spec.node_name.as_deref() == Some("gpu-node-a")),
        "{published:?}"
    );
    eprintln!(
        "the plugin published {} slices with the chart's ServiceAccount",
        published.len()
    );
    apply_file(&admin, &repo_path("examples/single-gpu/single-gpu.yaml")).await?;
    let claim = {
        let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
        let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), "default");
        drust_e2e::pods::bound_with_claim(&pods, &claims, "cuda-one-gpu", TIMEOUT)
            .await?
            .1
    };
    let (kubelet, _) = Kubelet::register(&plugin.registration_socket()).await?;
    let uid = claim.metadata.uid.clone().unwrap_or_default();
    let prepared = kubelet.prepare_v1(&[&claim]).await?;
    ensure!(
        prepared.claims[&uid].error.is_empty(),
        "prepare with the chart's ServiceAccount: {}",
        prepared.claims[&uid].error
    );
    ensure!(
        !prepared.claims[&uid].devices.is_empty(),
        "no devices prepared"
    );

    // 4b. The plugin's /metrics and /usage (issue 41, defect 9), reviewed by the API server as
    //     the chart's ServiceAccount (its `create` on tokenreviews and subjectaccessreviews):
    //     401 without a token or with a forged one, 403 for a token whose user lacks the role,
    //     200 for Prometheus bound to the chart's metrics-reader role; /usage for a tenant only
    //     in its own namespace. The probes stay open.
    http_endpoint_checks(&cp, &admin, http_port, &http_tls, scratch.path()).await?;

    // 5. Denied, each by the policy: a slice for another node (create, update, delete of one
    //    that exists), a slice for all nodes, a slice with a node selector, another driver's
    //    slice, another node's pool.
    let other = "the kubelet plugin on node gpu-node-a may only write ResourceSlices with spec.nodeName gpu-node-a, not gpu-node-b";
    let policy = format!("ValidatingAdmissionPolicy '{POLICY}'");
    denied(
        "create a slice for gpu-node-b",
        slices
            .create(
                &PostParams::default(),
                &slice(
                    "b-by-plugin",
                    "gpu-node-b",
                    json!({"nodeName": "gpu-node-b"}),
                )?,
            )
            .await,
        &[&policy, other],
    )?;
    // The admin may: the policy is about the plugin's identity only.
    Api::<ResourceSlice>::all(admin.clone())
        .create(
            &PostParams::default(),
            &slice(
                "b-by-admin",
                "gpu-node-b",
                json!({"nodeName": "gpu-node-b"}),
            )?,
        )
        .await?;
    // An update as the plugin writes one: a replace of the stored object.
    let mut changed = Api::<ResourceSlice>::all(admin.clone())
        .get("b-by-admin")
        .await?;
    changed.spec.devices = Some(vec![serde_json::from_value(json!({"name": "gpu-1"}))?]);
    denied(
        "update gpu-node-b's slice",
        slices
            .replace("b-by-admin", &PostParams::default(), &changed)
            .await,
        &[&policy, other],
    )?;
    denied(
        "delete gpu-node-b's slice",
        slices.delete("b-by-admin", &DeleteParams::default()).await,
        &[&policy, other],
    )?;
    denied(
        "create a slice for all nodes",
        slices
            .create(
                &PostParams::default(),
                &slice("all-by-plugin", "everywhere", json!({"allNodes": true}))?,
            )
            .await,
        &[&policy, "for all nodes (spec.allNodes)"],
    )?;
    let selector = json!({"nodeSelector": {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "kubernetes.io/hostname", "operator": "In", "values": ["gpu-node-a"]}]}]}});
    denied(
        "create a slice with a node selector",
        slices
            .create(
                &PostParams::default(),
                &slice("selector-by-plugin", "selected", selector)?,
            )
            .await,
        &[&policy, "with a node selector (spec.nodeSelector)"],
    )?;

    // On its own node, still denied: another driver's slice, and a pool named after another
    // node (the scheduler would merge it into that node's pool of our driver).
    denied(
        "create another driver's slice on its own node",
        slices
            .create(
                &PostParams::default(),
                &slice_of(
                    "other.example.com",
                    "other-driver-by-plugin",
                    "gpu-node-a",
                    json!({"nodeName": "gpu-node-a"}),
                )?,
            )
            .await,
        &[
            &policy,
            "may only write ResourceSlices of driver gpu.drust.dev, not other.example.com",
        ],
    )?;
    denied(
        "create a slice of gpu-node-b's pool on its own node",
        slices
            .create(
                &PostParams::default(),
                &slice(
                    "b-pool-by-plugin",
                    "gpu-node-b",
                    json!({"nodeName": "gpu-node-a"}),
                )?,
            )
            .await,
        &[
            &policy,
            "on node gpu-node-a may only write ResourceSlices of pool gpu-node-a, not gpu-node-b",
        ],
    )?;

    // 6. Denied by RBAC: writing Nodes, writing Pods, reading Secrets, events elsewhere.
    let user = format!("system:serviceaccount:{NAMESPACE}:{SERVICE_ACCOUNT}");
    let nodes: Api<Node> = Api::all(plugin_client.clone());
    nodes
        .get("gpu-node-a")
        .await
        .context("the plugin may read its Node")?;
    denied(
        "label a Node",
        nodes
            .patch(
                "gpu-node-a",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"pwned": "true"}}})),
            )
            .await,
        &[&user, r#"cannot patch resource "nodes""#],
    )?;
    denied(
        "delete a Node",
        nodes.delete("gpu-node-b", &DeleteParams::default()).await,
        &[&user, r#"cannot delete resource "nodes""#],
    )?;
    denied(
        "create a Pod outside the release namespace",
        Api::<Pod>::namespaced(plugin_client.clone(), "default")
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": "escalate"},
                    "spec": {"nodeName": "gpu-node-a",
                             "containers": [{"name": "c", "image": IMAGE}]},
                }))?,
            )
            .await,
        &[&user, r#"cannot create resource "pods""#],
    )?;

    // 6b. MPS control daemon Pods: the plugin may create the Pod its code builds (dry run) from
    //     the rendered DaemonSet's own arguments, in its namespace, on its node, of its image,
    //     owned by the DaemonSet (whose UID the plugin reads as this identity); not on another
    //     node, not of another image, and not one that differs from it in any way that would
    //     give the token more than a daemon: each escalation below is denied by the exact-shape
    //     policy.
    let pod_policy = format!("ValidatingAdmissionPolicy '{POD_POLICY}'");
    let daemon_pods: Api<Pod> = Api::namespaced(plugin_client.clone(), NAMESPACE);
    let ds_args: Vec<String> = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|s| s.containers.first())
        .and_then(|c| c.args.clone())
        .unwrap_or_default();
    let arg = |name: &str| -> anyhow::Result<String> {
        ds_args
            .iter()
            .find_map(|a| a.strip_prefix(&format!("--{name}=")))
            .map(str::to_owned)
            .with_context(|| format!("--{name} in the DaemonSet's args {ds_args:?}"))
    };
    let daemon_binary = arg("mps-control-binary")?
        .strip_prefix("/driver-root/")
        .context("--mps-control-binary under the driver root")?
        .to_owned();
    let mps = |node: &str, image: &str| -> anyhow::Result<MpsControl> {
        Ok(MpsControl {
            binary: "nvidia-cuda-mps-control".into(),
            root: arg("mps-root")?.into(),
            start_timeout: TIMEOUT,
            pods: Some(DaemonPods {
                client: plugin_client.clone(),
                namespace: NAMESPACE.to_owned(),
                node_name: node.to_owned(),
                image: image.to_owned(),
                pull_policy: arg("mps-daemon-image-pull-policy")?,
                priority_class: arg("mps-daemon-priority-class").ok(),
                host_driver_root: arg("host-driver-root")?.into(),
                daemon_binary: daemon_binary.clone().into(),
                owner: Some(DaemonSetOwner::new(arg("mps-daemon-owner")?)),
            }),
        })
    };
    ensure!(
        arg("mps-daemon-image")? == IMAGE,
        "the chart's daemon image: {ds_args:?}"
    );
    let uid = "0b1c2d3e-4f50-4617-8293-a4b5c6d7e8f9";
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let own = mps("gpu-node-a", IMAGE)?
        .daemon_pod(uid, "GPU-0", Protocol::Legacy)
        .await?
        .context("a pod")?;
    ensure!(
        own.metadata
            .owner_references
            .as_ref()
            .and_then(|o| o.first())
            .map(|o| (o.kind.as_str(), o.uid.as_str()))
            == Some(("DaemonSet", ds.metadata.uid.as_deref().unwrap_or_default())),
        "the daemon Pod's owner: {:?}",
        own.metadata.owner_references
    );
    daemon_pods
        .create(&dry, &own)
        .await
        .context("the plugin may create its MPS daemon Pod on its own node")?;
    // The `kernel` level's share daemons run on MPS v3: the same Pod with `-p 3 -m`.
    let v3 = mps("gpu-node-a", IMAGE)?
        .daemon_pod(uid, "GPU-0", Protocol::V3)
        .await?
        .context("a pod")?;
    daemon_pods
        .create(&dry, &v3)
        .await
        .context("the plugin may create its MPS v3 daemon Pod on its own node")?;
    denied(
        "create an MPS daemon Pod on gpu-node-b",
        daemon_pods
            .create(
                &dry,
                &mps("gpu-node-b", IMAGE)?
                    .daemon_pod(uid, "GPU-0", Protocol::Legacy)
                    .await?
                    .context("a pod")?,
            )
            .await,
        &[
            &pod_policy,
            "on node gpu-node-a may only create or delete Pods with spec.nodeName gpu-node-a, not gpu-node-b",
        ],
    )?;
    denied(
        "create a Pod of another image on its own node",
        daemon_pods
            .create(
                &dry,
                &mps("gpu-node-a", "busybox")?
                    .daemon_pod(uid, "GPU-0", Protocol::Legacy)
                    .await?
                    .context("a pod")?,
            )
            .await,
        &[&pod_policy, "may only create Pods of its own image"],
    )?;
    // Each escalation the issue names, as a change to the plugin's own Pod.
    type Change = fn(&mut Value);
    let escalations: [(&str, Change, &str); 17] = [
        (
            "run the daemon with flags of its own choosing",
            |p| {
                if let Some(c) = p["spec"]["containers"][0]["command"].as_array_mut() {
                    c.push(json!("-S"));
                }
            },
            "runs exactly",
        ),
        (
            "run as the plugin's ServiceAccount",
            |p| p["spec"]["serviceAccountName"] = json!(SERVICE_ACCOUNT),
            "default ServiceAccount with no token",
        ),
        (
            "mount a ServiceAccount token",
            |p| p["spec"]["automountServiceAccountToken"] = json!(true),
            "default ServiceAccount with no token",
        ),
        (
            "mount a Secret",
            |p| {
                if let Some(v) = p["spec"]["volumes"].as_array_mut() {
                    v.push(json!({"name": "s", "secret": {"secretName": "anything"}}));
                }
            },
            "exactly three volumes",
        ),
        (
            "mount a projected token in place of its shared memory",
            |p| {
                p["spec"]["volumes"][2] = json!({"name": "shm", "projected": {"sources": [
                    {"serviceAccountToken": {"path": "token"}}]}});
            },
            "exactly three volumes",
        ),
        (
            "use the host's /run as its shared memory",
            |p| {
                p["spec"]["volumes"][2] =
                    json!({"name": "shm", "hostPath": {"path": "/run", "type": "Directory"}});
            },
            "exactly three volumes",
        ),
        (
            "an unbounded tmpfs as its shared memory",
            |p| p["spec"]["volumes"][2] = json!({"name": "shm", "emptyDir": {"medium": "Memory"}}),
            "exactly three volumes",
        ),
        (
            "mount the host's / writable",
            |p| p["spec"]["containers"][0]["volumeMounts"][0]["readOnly"] = json!(false),
            "driver root read-only",
        ),
        (
            "mount / as its claim directory",
            |p| p["spec"]["volumes"][1]["hostPath"]["path"] = json!("/"),
            "exactly three volumes",
        ),
        (
            "use the host's PID namespace",
            |p| p["spec"]["hostPID"] = json!(true),
            "host's network, PID or IPC namespace",
        ),
        (
            "use the host's network",
            |p| p["spec"]["hostNetwork"] = json!(true),
            "host's network, PID or IPC namespace",
        ),
        (
            "run its own command",
            |p| {
                p["spec"]["containers"][0]["command"] =
                    json!(["chroot", "/driver-root", "/bin/sh", "-c", "id"]);
            },
            "runs exactly `chroot /driver-root",
        ),
        (
            "add LD_PRELOAD",
            |p| {
                if let Some(e) = p["spec"]["containers"][0]["env"].as_array_mut() {
                    e.push(json!({"name": "LD_PRELOAD", "value": "/tmp/x.so"}));
                }
            },
            "runs exactly `chroot /driver-root",
        ),
        (
            "run a command at start (postStart hook)",
            |p| {
                p["spec"]["containers"][0]["lifecycle"] =
                    json!({"postStart": {"exec": {"command": ["/bin/sh", "-c", "id"]}}});
            },
            "no ports, lifecycle hooks, probes",
        ),
        (
            "add an init container",
            |p| {
                p["spec"]["initContainers"] =
                    json!([{"name": "i", "image": IMAGE, "command": ["id"]}]);
            },
            // Both policies refuse it, and either may answer first.
            "one container and nothing else|may only create Pods of its own image",
        ),
        (
            "drop its owner",
            |p| p["metadata"]["ownerReferences"] = json!(null),
            "must be owned (metadata.ownerReferences) by the DaemonSet",
        ),
        (
            "claim GPUs of its own (a resource claim)",
            |p| {
                p["spec"]["resourceClaims"] =
                    json!([{"name": "g", "resourceClaimName": "someone-elses"}]);
            },
            "one container and nothing else",
        ),
    ];
    let own_json = serde_json::to_value(&own)?;
    for (what, change, messages) in escalations {
        let mut pod = own_json.clone();
        change(&mut pod);
        let what = format!("create a daemon Pod that would {what}");
        let result = daemon_pods
            .create(&dry, &serde_json::from_value(pod)?)
            .await;
        // `a|b`: either message.
        let message = match &result {
            Err(kube::Error::Api(e)) => messages
                .split('|')
                .find(|m| e.message.contains(m))
                .unwrap_or(messages),
            _ => messages,
        };
        denied(
            &what,
            result,
            &["ValidatingAdmissionPolicy 'drust-mps-daemon-pods-", message],
        )?;
    }
    // The Role's one read of DaemonSets is its own (the daemon Pods' owner): no other, no list.
    let daemonsets: Api<DaemonSet> = Api::namespaced(plugin_client.clone(), NAMESPACE);
    denied(
        "read another DaemonSet",
        daemonsets.get("kube-proxy").await,
        &[&user, r#"cannot get resource "daemonsets""#],
    )?;
    denied(
        "list DaemonSets",
        daemonsets.list(&ListParams::default()).await,
        &[&user, r#"cannot list resource "daemonsets""#],
    )?;
    denied(
        "delete a Pod of its own node that is no MPS daemon",
        daemon_pods
            .delete(
                pod_a.metadata.name.as_deref().unwrap_or_default(),
                &DeleteParams {
                    dry_run: true,
                    ..Default::default()
                },
            )
            .await,
        &[&pod_policy, "may only delete MPS control daemon Pods"],
    )?;
    denied(
        "delete the plugin Pod of gpu-node-b",
        daemon_pods
            .delete(
                placed["gpu-node-b"]
                    .metadata
                    .name
                    .as_deref()
                    .unwrap_or_default(),
                &DeleteParams {
                    dry_run: true,
                    ..Default::default()
                },
            )
            .await,
        &[&pod_policy, "not gpu-node-b"],
    )?;
    for namespace in [NAMESPACE, "kube-system"] {
        let secrets: Api<Secret> = Api::namespaced(plugin_client.clone(), namespace);
        denied(
            &format!("list Secrets in {namespace}"),
            secrets.list(&ListParams::default()).await,
            &[&user, r#"cannot list resource "secrets""#],
        )?;
        denied(
            &format!("get a Secret in {namespace}"),
            secrets.get("anything").await,
            &[&user, r#"cannot get resource "secrets""#],
        )?;
    }
    // The plugin's own Warning event about its Node (what it reports after rebuilding a damaged
    // checkpoint), through its real code path (awaited here; the controller's warnings write it
    // in the background).
    KubeCluster::new(plugin_client.clone(), DRIVER, "gpu-node-a")
        .warning(
            "CheckpointRecovered",
            "Recover",
            "helm_chart e2e: RBAC allows this event",
        )
        .await;
    let events = Api::<Event>::namespaced(admin.clone(), "default")
        .list(&ListParams::default())
        .await?
        .items;
    ensure!(
        events
            .iter()
            .any(|e| e.reason.as_deref() == Some("CheckpointRecovered")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("gpu-node-a")),
        "the plugin's Warning event was not recorded: {events:?}"
    );
    let event = |namespace: &str| -> anyhow::Result<Event> {
        Ok(serde_json::from_value(json!({
            "metadata": {"generateName": "gpu-node-a-", "namespace": namespace},
            "eventTime": "2026-01-01T00:00:00.000000Z",
            "type": "Warning", "reason": "CheckpointRecovered", "action": "Recover",
            "reportingController": "gpu.drust.dev/kubelet-plugin",
            "reportingInstance": "gpu.drust.dev/kubelet-plugin-gpu-node-a",
            "regarding": {"apiVersion": "v1", "kind": "Node", "name": "gpu-node-a"},
        }))?)
    };
    // (An event about a Node outside default is invalid before admission: a cluster-scoped
    // object's events live in default.) Another node's Node:
    let mut other_node = event("default")?;
    other_node.regarding = Some(ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some("gpu-node-b".into()),
        ..Default::default()
    });
    denied(
        "create an Event about another Node",
        Api::<Event>::namespaced(plugin_client.clone(), "default")
            .create(&PostParams::default(), &other_node)
            .await,
        &["drust-events-own-node", "about its own Node"],
    )?;
    // Issue 41, defect 8: idle claims are marked through the claim, never with an event about a
    // pod. The plugin's real code path (the usage sampler's) marks the claim allocated on its
    // node; the API server refuses the same on a claim allocated on another node, and the
    // plugin may write no event about a pod at all.
    let idle = |message: &str| -> anyhow::Result<Vec<k8s_openapi::api::resource::v1::AllocatedDeviceStatus>> {
        let result = claim
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.as_ref())
            .and_then(|r| r.first())
            .context("the claim's allocation")?;
        Ok(vec![serde_json::from_value(json!({
            "driver": DRIVER, "pool": result.pool, "device": result.device,
            "conditions": [{"type": "GPUIdle", "status": "True", "reason": "NoActivity",
                "message": message, "lastTransitionTime": "2026-11-27T12:00:00Z"}],
        }))?])
    };
    let claim_name = claim.metadata.name.clone().unwrap_or_default();
    KubeCluster::new(plugin_client.clone(), DRIVER, "gpu-node-a")
        .set_device_status("default", &claim_name, idle("helm_chart e2e: GPU idle")?)
        .await
        .context("the plugin marks a claim allocated on its own node")?;
    let marked = Api::<ResourceClaim>::namespaced(admin.clone(), "default")
        .get(&claim_name)
        .await?;
    ensure!(
        serde_json::to_string(&marked.status)?.contains("helm_chart e2e: GPU idle"),
        "the mark was not stored: {:?}",
        marked.status
    );
    // The same claim, allocated elsewhere: the admin moves it to gpu-node-b (a test-only
    // allocation of the slice the admin wrote above).
    let elsewhere: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "on-node-b", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu",
            "exactly": {"deviceClassName": "gpu.drust.dev"}}]}},
    }))?;
    let admin_claims = Api::<ResourceClaim>::namespaced(admin.clone(), "default");
    admin_claims
        .create(&PostParams::default(), &elsewhere)
        .await?;
    admin_claims
        .patch_status(
            "on-node-b",
            &PatchParams::apply("helm-chart-e2e").force(),
            &Patch::Apply(json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": "on-node-b", "namespace": "default"},
                "status": {"allocation": {
                    "devices": {"results": [{"request": "gpu", "driver": DRIVER,
                        "pool": "gpu-node-b", "device": "gpu-1"}]},
                    "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{
                        "key": "metadata.name", "operator": "In",
                        "values": ["gpu-node-b"]}]}]}}},
            })),
        )
        .await?;
    let b_status: Vec<k8s_openapi::api::resource::v1::AllocatedDeviceStatus> =
        vec![serde_json::from_value(json!({
            "driver": DRIVER, "pool": "gpu-node-b", "device": "gpu-1",
            "conditions": [{"type": "GPUIdle", "status": "True", "reason": "NoActivity",
                "message": "forged", "lastTransitionTime": "2026-11-27T12:00:00Z"}],
        }))?];
    match KubeCluster::new(plugin_client.clone(), DRIVER, "gpu-node-a")
        .set_device_status("default", "on-node-b", b_status)
        .await
    {
        Err(kube::Error::Api(e)) if e.message.contains("resourceclaims/driver") => {
            eprintln!(
                "denied as expected: mark a claim allocated on gpu-node-b: {}",
                e.message
            );
        }
        other => bail!("marking a claim on another node was not refused: {other:?}"),
    }
    // Nor may the plugin change a claim's allocation or reservations through its status.
    let moved = json!({"status": {"reservedFor": []}});
    match Api::<ResourceClaim>::namespaced(plugin_client.clone(), "default")
        .patch_status(&claim_name, &PatchParams::default(), &Patch::Merge(&moved))
        .await
    {
        Err(kube::Error::Api(e))
            if e.code == 403 || e.message.contains("resourceclaims/binding") =>
        {
            eprintln!(
                "denied as expected: change a claim's reservations: {}",
                e.message
            );
        }
        other => bail!("changing a claim's reservations was not refused: {other:?}"),
    }
    let pod_event = json!({
        "metadata": {"generateName": "jupyter-0-", "namespace": NAMESPACE},
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "type": "Warning", "reason": "GPUIdle", "action": "SampleUsage",
        "reportingController": "gpu.drust.dev/kubelet-plugin",
        "reportingInstance": "gpu.drust.dev/kubelet-plugin-gpu-node-a",
        "regarding": {"apiVersion": "v1", "kind": "Pod", "name": "jupyter-0",
                      "namespace": NAMESPACE},
    });
    denied(
        "create a GPUIdle event about a pod in its namespace",
        Api::<Event>::namespaced(plugin_client.clone(), NAMESPACE)
            .create(
                &PostParams::default(),
                &serde_json::from_value(pod_event.clone())?,
            )
            .await,
        &[&user, r#"cannot create resource "events""#],
    )?;
    let mut in_default = pod_event;
    in_default["metadata"]["namespace"] = json!("default");
    in_default["regarding"]["namespace"] = json!("default");
    denied(
        "create a GPUIdle event about a pod in default",
        Api::<Event>::namespaced(plugin_client.clone(), "default")
            .create(&PostParams::default(), &serde_json::from_value(in_default)?)
            .await,
        &["drust-events-own-node", "about its own Node"],
    )?;

    // 7. A token of the same ServiceAccount that is bound to no pod (so to no node) may not
    //    write any slice, not even one for gpu-node-a.
    let unbound = scratch.path().join("unbound.kubeconfig");
    cp.write_kubeconfig(
        &unbound,
        &cp.service_account_token(NAMESPACE, SERVICE_ACCOUNT).await?,
    )?;
    denied(
        "create a slice with a token bound to no node",
        Api::<ResourceSlice>::all(client_from(&unbound).await?)
            .create(
                &PostParams::default(),
                &slice(
                    "a-unbound",
                    "gpu-node-a-2",
                    json!({"nodeName": "gpu-node-a"}),
                )?,
            )
            .await,
        &[&policy, "not bound to a Pod on a node"],
    )?;

    // The plugin's own slices are untouched by all this.
    let still = Api::<ResourceSlice>::all(admin.clone())
        .list(&ListParams::default().fields("spec.nodeName=gpu-node-a"))
        .await?
        .items;
    ensure!(still.len() == published.len(), "{still:?}");
    plugin.stop().await?;

    // 8. Uninstalling the chart deletes the MPS daemon Pods: one created for real by the
    //    plugin's identity, owned by the DaemonSet, is deleted by the garbage collector once
    //    `helm uninstall` deletes the DaemonSet (no kubelet runs here, so it is left
    //    terminating rather than gone).
    let name = daemon_pods
        .create(&PostParams::default(), &own)
        .await
        .context("the plugin creates its daemon Pod")?
        .metadata
        .name
        .unwrap_or_default();
    let uninstalled = helm_in(
        Some(&scratch.path().join("helm-home")),
        &[
            "uninstall",
            RELEASE,
            "--namespace",
            NAMESPACE,
            &kubeconfig_flag,
        ],
    )
    .await?;
    ensure!(uninstalled.contains("uninstalled"), "{uninstalled}");
    let admin_pods: Api<Pod> = Api::namespaced(admin.clone(), NAMESPACE);
    until(
        "the garbage collector deletes the daemon Pod",
        TIMEOUT,
        || async {
            match admin_pods.get_opt(&name).await {
                Ok(None) => Ok(Some(())),
                Ok(Some(p)) if p.metadata.deletion_timestamp.is_some() => Ok(Some(())),
                Ok(Some(_)) => Err("still there, not terminating".to_owned()),
                Err(e) => Err(e.to_string()),
            }
        },
    )
    .await?;

    cp.stop().await?;
    Ok(())
}
