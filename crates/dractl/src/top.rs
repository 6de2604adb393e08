//! `dractl top`: who holds GPUs and does not use them. One line per pod with its claims'
//! devices, utilization, memory used against its limit, how long it has been idle and what that
//! idle time cost; then the cluster's allocated and idle GPUs.
//!
//! It reads each node plugin's usage report (`/usage`, [`gpu_kubelet_plugin::usage::Report`])
//! through a port-forward to the plugin's pod opened by the API server (as `kubectl
//! port-forward`), so it needs no access to the nodes or the pod network, and a NetworkPolicy on
//! the plugins does not stand in its way. The plugin decides who may read what (`--http-auth`):
//! dractl shows it the user's own bearer token, which the plugin has the API server review. The
//! API server's pod proxy cannot carry it: the API server consumes the caller's `Authorization`
//! header and forwards no identity (k8s.io/apiserver `pkg/endpoints/filters/authentication.go`).
//!
//! The token is the kubeconfig user's (a token, a token file, an exec plugin such as `aws eks
//! get-token` or OIDC), or `--token-file`'s; a user who authenticates with a client certificate
//! has none to show, and is told so. Read-only; the RBAC it needs (`deploy/rbac/dractl-top.yaml`):
//! `list` on `pods` and `get`, `create` on `pods/portforward` in the plugins' namespace, and to
//! see every namespace `get` on the non-resource URL `/usage`; without the latter, `-n <ns>`
//! shows a namespace where the user may `list` ResourceClaims.
//!
//! GPUs are counted in whole-GPU equivalents: a whole GPU is 1, a MIG device its compute slices
//! out of 7 (`3g.40gb` is 3/7), a share its memory out of its device's.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::StreamExt;
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;

use gpu_kubelet_plugin::usage::idle_status::span;
use gpu_kubelet_plugin::usage::{ClaimReport, DeviceReport, Report};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use serde::Serialize;

use crate::live::{Connection, LiveError, call, client_for, config};

/// Time allowed for one plugin's report, the port-forward included.
pub const REPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// How many plugins are read at once.
pub const CONCURRENT_READS: usize = 8;
/// What a user without a bearer token is told.
const NO_TOKEN: &str = "the kubeconfig's user has no bearer token (it authenticates with a \
    client certificate, which the node plugins cannot verify): the plugins answer /usage only to \
    a bearer token the API server accepts. Pass --token-file with one, e.g. from `kubectl create \
    token <serviceaccount>` of a ServiceAccount bound to the dractl-top roles \
    (deploy/rbac/dractl-top.yaml)";

/// What to show.
#[derive(Clone, Debug)]
pub struct Options {
    /// Which namespaces' pods.
    pub scope: Scope,
    /// Only idle pods.
    pub idle_only: bool,
    /// Price of one GPU for one hour, for the cost of idle time.
    pub price_per_gpu_hour: Option<f64>,
    /// The namespace the node plugins run in.
    pub plugin_namespace: String,
    /// The label selector of the node plugins' pods.
    pub plugin_selector: String,
    /// A file holding the bearer token shown to the plugins (`--token-file`); `None`: the
    /// kubeconfig user's.
    pub token_file: Option<PathBuf>,
}

/// Which namespaces' pods are shown.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Every namespace (`-A`).
    All,
    /// One namespace (`-n`).
    Namespace(String),
    /// The kubeconfig context's namespace, as kubectl (`default` without one).
    Context,
}

/// One pod.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Row {
    /// Its namespace.
    pub namespace: String,
    /// Its name (empty when no claim names the pod).
    pub pod: String,
    /// The node it runs on.
    pub node: String,
    /// Its claims' names.
    pub claims: Vec<String>,
    /// Its claims' devices.
    pub devices: Vec<String>,
    /// Whole-GPU equivalents its claims hold.
    pub gpus: f64,
    /// The highest SM utilization of its devices, percent, where NVML has one.
    pub sm_percent: Option<u32>,
    /// Device memory its claims' processes use, bytes.
    pub memory_used_bytes: u64,
    /// The memory its claims hold (a share's allocation, else the devices' memory), bytes.
    pub memory_limit_bytes: u64,
    /// Every claim of the pod is idle.
    pub idle: bool,
    /// How long the pod's claims have been idle (the shortest), seconds.
    pub idle_seconds: u64,
    /// The cost of that idle time at `--price-per-gpu-hour`.
    pub idle_cost: Option<f64>,
}

/// The whole answer.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Top {
    /// One line per pod.
    pub rows: Vec<Row>,
    /// Whole-GPU equivalents held by prepared claims (of the namespaces shown).
    pub allocated_gpus: f64,
    /// Of those, held by idle claims.
    pub idle_gpus: f64,
    /// The cost of the idle time so far, where a price was given.
    pub idle_cost: Option<f64>,
    /// Plugins whose report could not be read, with why.
    pub unreachable: Vec<String>,
}

/// Reads every node plugin's report ([`read`]) and makes the table ([`top`]).
///
/// # Errors
/// [`LiveError`] when the kubeconfig is unusable, there is no bearer token, the plugins' pods
/// cannot be listed, or every plugin refused the caller.
pub async fn run(connection: &Connection, options: &Options) -> Result<Top, LiveError> {
    let config = config(connection).await?;
    let token = bearer_token(&config, options.token_file.as_deref()).await?;
    let client = client_for(config)?;
    let mut options = options.clone();
    if options.scope == Scope::Context {
        options.scope = Scope::Namespace(client.default_namespace().to_owned());
    }
    let (reports, unreachable) = read(&client, &token, &options).await?;
    Ok(top(&reports, unreachable, &options))
}

/// The bearer token shown to the node plugins: the first line of `token_file`, else the one the
/// kubeconfig's user authenticates to the API server with, as kube's client would send it (a
/// static token, a token file, an exec plugin, OIDC).
///
/// # Errors
/// [`LiveError::Token`] when the file cannot be read or is empty, or the user has no bearer
/// token (client certificates, basic authentication).
pub async fn bearer_token(
    config: &kube::Config,
    token_file: Option<&Path>,
) -> Result<String, LiveError> {
    use kube::client::ConfigExt;
    use tower::{Layer, ServiceExt};

    if let Some(path) = token_file {
        let text = std::fs::read_to_string(path)
            .map_err(|e| LiveError::Token(format!("--token-file {}: {e}", path.display())))?;
        return match text.trim() {
            "" => Err(LiveError::Token(format!(
                "--token-file {}: empty",
                path.display()
            ))),
            token => Ok(token.to_owned()),
        };
    }
    let layer = config
        .auth_layer()
        .map_err(|e| LiveError::Token(format!("the kubeconfig's credentials: {e}")))?
        .ok_or_else(|| LiveError::Token(NO_TOKEN.to_owned()))?;
    // The header kube's client would add to a request, taken from a request that goes nowhere.
    let capture = tower::service_fn(|request: http::Request<kube::client::Body>| async move {
        Ok::<_, tower::BoxError>(http::Response::new(
            request.headers().get(http::header::AUTHORIZATION).cloned(),
        ))
    });
    let header = layer
        .layer(capture)
        .oneshot(http::Request::new(kube::client::Body::empty()))
        .await
        .map_err(|e| LiveError::Token(format!("the kubeconfig's credentials: {e}")))?
        .into_body();
    header
        .as_ref()
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, token)| scheme.eq_ignore_ascii_case("bearer") && !token.is_empty())
        .map(|(_, token)| token.trim().to_owned())
        .ok_or_else(|| LiveError::Token(NO_TOKEN.to_owned()))
}

/// One plugin's answer to `GET /usage`.
enum Answer {
    /// Its report.
    Report(Box<Report>),
    /// It refused the token (401) or its user (403), with its message.
    Refused(String),
    /// It could not be read.
    Unreachable(String),
}

/// Reads every node plugin's report through a port-forward to its pod, showing it `token`: the
/// reports, and the plugins whose report could not be read, with why.
///
/// # Errors
/// [`LiveError`] when the plugins' pods cannot be listed, or every plugin refused `token`.
pub async fn read(
    client: &kube::Client,
    token: &str,
    options: &Options,
) -> Result<(Vec<Report>, Vec<String>), LiveError> {
    let ns = &options.plugin_namespace;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let list = call(
        &format!(
            "list the node plugins' pods in {ns} ({})",
            options.plugin_selector
        ),
        pods.list(&ListParams::default().labels(&options.plugin_selector)),
    )
    .await?;
    // One namespace: the plugin answers with that namespace's claims and processes alone, and
    // lets a user who may list its ResourceClaims read them.
    let path = match &options.scope {
        Scope::Namespace(only) => format!("/usage?namespace={only}"),
        Scope::All | Scope::Context => "/usage".to_owned(),
    };
    let answers: Vec<(String, Answer)> = futures::stream::iter(list.items)
        .map(|pod| {
            let (pods, path) = (&pods, &path);
            async move {
                let name = pod.metadata.name.clone().unwrap_or_default();
                let answer = answer_of(pods, &pod, path, token).await;
                (format!("{ns}/{name}"), answer)
            }
        })
        .buffer_unordered(CONCURRENT_READS)
        .collect()
        .await;
    let (mut reports, mut unreachable, mut refused) = (Vec::new(), Vec::new(), Vec::new());
    for (pod, answer) in answers {
        match answer {
            Answer::Report(report) => reports.push(*report),
            Answer::Refused(why) => refused.push(format!("{pod}: {why}")),
            Answer::Unreachable(why) => unreachable.push(format!("{pod}: {why}")),
        }
    }
    if reports.is_empty() && !refused.is_empty() {
        refused.sort();
        return Err(LiveError::Refused(format!(
            "the node plugins refused to show their usage: {}. Every namespace needs `get` on \
             the non-resource URL /usage; one namespace (-n) `list` on its resourceclaims \
             (deploy/rbac/dractl-top.yaml)",
            refused.join("; ")
        )));
    }
    unreachable.extend(refused);
    unreachable.sort();
    reports.sort_by(|a, b| a.node.cmp(&b.node));
    Ok((reports, unreachable))
}

/// `GET path` of `pod`'s port named `http`, through a port-forward, within [`REPORT_TIMEOUT`].
async fn answer_of(pods: &Api<Pod>, pod: &Pod, path: &str, token: &str) -> Answer {
    let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
    let (true, Some((port, scheme)), Some(name)) =
        (running, http_port(pod), pod.metadata.name.as_deref())
    else {
        return Answer::Unreachable("not running, or no port named http".into());
    };
    let answer = tokio::time::timeout(
        REPORT_TIMEOUT,
        get_forwarded(pods, name, port, scheme, path, token),
    )
    .await;
    match answer {
        Err(_) => Answer::Unreachable(format!("no answer within {REPORT_TIMEOUT:?}")),
        Ok(Err(e)) => Answer::Unreachable(e),
        Ok(Ok((status, body))) => match status {
            http::StatusCode::OK => match serde_json::from_str::<Report>(&body) {
                Ok(report) => Answer::Report(Box::new(report)),
                Err(e) => Answer::Unreachable(format!("its {path} is not a report: {e}")),
            },
            http::StatusCode::UNAUTHORIZED | http::StatusCode::FORBIDDEN => {
                Answer::Refused(format!("{status}: {}", body.trim()))
            }
            _ => Answer::Unreachable(format!("{path} answered {status}: {}", body.trim())),
        },
    }
}

/// How a plugin's HTTP endpoint is spoken to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    /// Plain HTTP.
    Http,
    /// HTTPS (the plugin's `--http-tls`, the chart's `http.tls.enabled`).
    Https,
}

/// The container port named `http` of `pod`, and its scheme: HTTPS where the kubelet probes
/// that port with `scheme: HTTPS` (the chart sets the probes' scheme from `http.tls.enabled`),
/// so dractl speaks to the endpoint exactly as the kubelet does.
pub fn http_port(pod: &Pod) -> Option<(u16, Scheme)> {
    let containers = pod.spec.iter().flat_map(|s| &s.containers);
    for c in containers {
        let Some(port) = c
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some("http"))
        else {
            continue;
        };
        let number = u16::try_from(port.container_port).ok()?;
        let https = [&c.readiness_probe, &c.liveness_probe, &c.startup_probe]
            .into_iter()
            .flatten()
            .filter_map(|p| p.http_get.as_ref())
            .filter(|g| match &g.port {
                k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(n) => n == "http",
                k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n) => {
                    *n == port.container_port
                }
            })
            .any(|g| g.scheme.as_deref() == Some("HTTPS"));
        return Some((number, if https { Scheme::Https } else { Scheme::Http }));
    }
    None
}

/// `GET path` on `port` of pod `name` through a port-forward (`create` on `pods/portforward`),
/// over TLS for [`Scheme::Https`], with `token` as its bearer token: the status and the body.
///
/// The certificate is not verified: the port-forward is carried into the pod's network
/// namespace over the API server's and the kubelet's own authenticated TLS, so nothing between
/// could present another one ([`gpu_kubelet_plugin::http::tls::unverified_client_config`]).
///
/// # Errors
/// Why the port-forward, the handshake or the request failed, as text.
pub async fn get_forwarded(
    pods: &Api<Pod>,
    name: &str,
    port: u16,
    scheme: Scheme,
    path: &str,
    token: &str,
) -> Result<(http::StatusCode, String), String> {
    let mut forwarder = pods
        .portforward(name, &[port])
        .await
        .map_err(|e| format!("port-forward to port {port}: {e}"))?;
    let stream = forwarder
        .take_stream(port)
        .ok_or_else(|| format!("port-forward to port {port}: no stream"))?;
    // Where the pod cannot be connected to, the kubelet says so on the port's error channel.
    let refused = forwarder.take_error(port);
    let exchange = async {
        match scheme {
            Scheme::Http => get(stream, path, token).await,
            Scheme::Https => {
                let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(
                    gpu_kubelet_plugin::http::tls::unverified_client_config(),
                ));
                let server = rustls::pki_types::ServerName::try_from("localhost")
                    .map_err(|e| e.to_string())?;
                let stream = connector
                    .connect(server, stream)
                    .await
                    .map_err(|e| format!("TLS handshake: {e}"))?;
                get(stream, path, token).await
            }
        }
    };
    let result = match refused {
        Some(refused) => {
            tokio::pin!(refused);
            tokio::pin!(exchange);
            tokio::select! {
                r = &mut exchange => r,
                Some(why) = &mut refused => Err(format!("port-forward to port {port}: {why}")),
            }
        }
        None => exchange.await,
    };
    forwarder.abort();
    result.map_err(|e| format!("GET {path} through a port-forward to port {port}: {e}"))
}

/// One HTTP/1.1 `GET path` on `stream` with `token`: the status and the body.
async fn get<S>(stream: S, path: &str, token: &str) -> Result<(http::StatusCode, String), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    let connection = tokio::spawn(connection);
    let request = http::Request::get(path)
        .header(http::header::HOST, "localhost")
        .header(http::header::AUTHORIZATION, format!("Bearer {token}"))
        .body(Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    connection.abort();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// The whole-GPU equivalent of `device` held by `claim`.
fn gpus(device: &DeviceReport, claim: &ClaimReport) -> f64 {
    if let (Some(share), Some(total)) = (claim.share_memory_bytes, device.memory_total_bytes)
        && total > 0
    {
        return (share as f64 / total as f64).min(1.0);
    }
    match device
        .mig_profile
        .as_deref()
        .and_then(|p| p.split_once('g'))
    {
        Some((slices, _)) => slices.parse::<f64>().map_or(1.0, |n| (n / 7.0).min(1.0)),
        None => 1.0,
    }
}

/// The table of `reports` as `options` asks.
pub fn top(reports: &[Report], unreachable: Vec<String>, options: &Options) -> Top {
    let mut out = Top {
        unreachable,
        ..Top::default()
    };
    let mut rows: BTreeMap<(String, String), Row> = BTreeMap::new();
    for report in reports {
        for claim in &report.claims {
            if matches!(&options.scope, Scope::Namespace(ns) if ns != &claim.namespace) {
                continue;
            }
            let devices: Vec<&DeviceReport> = claim
                .devices
                .iter()
                .filter_map(|n| report.devices.iter().find(|d| &d.device == n))
                .collect();
            let held: f64 = devices.iter().map(|d| gpus(d, claim)).sum();
            out.allocated_gpus += held;
            if claim.idle {
                out.idle_gpus += held;
            }
            let limit = claim
                .share_memory_bytes
                .unwrap_or_else(|| devices.iter().filter_map(|d| d.memory_total_bytes).sum());
            // A share's own figure where the plugin has one; else its devices' (a share's: its
            // whole GPU's).
            let sm = claim
                .sm_percent
                .or_else(|| devices.iter().filter_map(|d| d.sm_percent).max());
            let cost = options
                .price_per_gpu_hour
                .map(|price| claim.idle_seconds as f64 / 3600.0 * held * price);
            let pods: Vec<String> = if claim.pods.is_empty() {
                vec![String::new()]
            } else {
                claim.pods.iter().map(|p| p.name.clone()).collect()
            };
            for pod in pods {
                let row = rows
                    .entry((claim.namespace.clone(), pod.clone()))
                    .or_insert_with(|| Row {
                        namespace: claim.namespace.clone(),
                        pod,
                        node: report.node.clone(),
                        idle: true,
                        idle_seconds: u64::MAX,
                        ..Row::default()
                    });
                row.claims.push(claim.name.clone());
                row.devices.extend(devices.iter().map(|d| d.device.clone()));
                row.gpus += held;
                row.sm_percent = row.sm_percent.max(sm);
                row.memory_used_bytes += claim.memory_used_bytes;
                row.memory_limit_bytes += limit;
                row.idle &= claim.idle;
                row.idle_seconds = row.idle_seconds.min(claim.idle_seconds);
                if let Some(c) = cost {
                    *row.idle_cost.get_or_insert(0.0) += c;
                }
            }
            if let (true, Some(c)) = (claim.idle, cost) {
                *out.idle_cost.get_or_insert(0.0) += c;
            }
        }
    }
    out.rows = rows
        .into_values()
        .filter(|r| !options.idle_only || r.idle)
        .collect();
    // Idle first, longest first: the waste to act on.
    out.rows.sort_by(|a, b| {
        b.idle
            .cmp(&a.idle)
            .then(b.idle_seconds.cmp(&a.idle_seconds))
    });
    out
}

fn gib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / f64::from(1u32 << 30))
}

impl Top {
    /// The table for a terminal.
    pub fn text(&self, price: bool) -> String {
        let mut lines = vec![{
            let mut h = vec![
                "NAMESPACE",
                "POD",
                "NODE",
                "CLAIMS",
                "DEVICES",
                "GPUS",
                "SM%",
                "MEMORY GiB",
                "IDLE FOR",
            ];
            if price {
                h.push("IDLE COST");
            }
            h.into_iter().map(str::to_owned).collect::<Vec<_>>()
        }];
        for r in &self.rows {
            let mut l = vec![
                r.namespace.clone(),
                if r.pod.is_empty() {
                    "<no pod>".into()
                } else {
                    r.pod.clone()
                },
                r.node.clone(),
                r.claims.join(","),
                r.devices.join(","),
                format!("{:.2}", r.gpus),
                r.sm_percent.map_or_else(|| "-".into(), |p| p.to_string()),
                format!("{}/{}", gib(r.memory_used_bytes), gib(r.memory_limit_bytes)),
                if r.idle {
                    span(r.idle_seconds)
                } else {
                    "busy".into()
                },
            ];
            if price {
                l.push(
                    r.idle_cost
                        .map_or_else(|| "-".into(), |c| format!("{c:.2}")),
                );
            }
            lines.push(l);
        }
        let widths: Vec<usize> = (0..lines[0].len())
            .map(|i| lines.iter().map(|l| l[i].len()).max().unwrap_or(0))
            .collect();
        let mut out = String::new();
        for l in &lines {
            let cells: Vec<String> = l
                .iter()
                .zip(&widths)
                .map(|(c, w)| format!("{c:<w$}"))
                .collect();
            out.push_str(cells.join("  ").trim_end());
            out.push('\n');
        }
        let share = if self.allocated_gpus > 0.0 {
            self.idle_gpus / self.allocated_gpus * 100.0
        } else {
            0.0
        };
        out.push_str(&format!(
            "\nGPUs allocated: {:.2}; idle: {:.2} ({share:.0}%)",
            self.allocated_gpus, self.idle_gpus
        ));
        if let Some(c) = self.idle_cost {
            out.push_str(&format!("; idle time so far cost {c:.2}"));
        }
        out.push('\n');
        for u in &self.unreachable {
            out.push_str(&format!("unreachable plugin: {u}\n"));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_kubelet_plugin::usage::report::PodRef;

    fn plugin_pod(probe_port: serde_json::Value, scheme: Option<&str>) -> Pod {
        let mut get = serde_json::json!({"path": "/readyz", "port": probe_port});
        if let Some(scheme) = scheme {
            get["scheme"] = scheme.into();
        }
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "plugin",
                "ports": [{"name": "http", "containerPort": 9477}],
                "readinessProbe": {"httpGet": get}}]}
        }))
        .unwrap()
    }

    #[test]
    fn the_http_ports_scheme_is_the_one_its_probes_use() {
        use serde_json::json;
        for (port, scheme, want) in [
            (json!("http"), Some("HTTPS"), Scheme::Https),
            (json!(9477), Some("HTTPS"), Scheme::Https),
            (json!("http"), Some("HTTP"), Scheme::Http),
            (json!("http"), None, Scheme::Http),
            // A probe on another port says nothing about this one.
            (json!(9999), Some("HTTPS"), Scheme::Http),
        ] {
            assert_eq!(
                http_port(&plugin_pod(port.clone(), scheme)),
                Some((9477, want)),
                "{port} {scheme:?}"
            );
        }
        let bare: Pod = serde_json::from_value(json!({
            "spec": {"containers": [{"name": "plugin"}]}
        }))
        .unwrap();
        assert_eq!(http_port(&bare), None);
    }

    fn device(name: &str, sm: Option<u32>, profile: Option<&str>) -> DeviceReport {
        DeviceReport {
            device: name.into(),
            sm_percent: sm,
            mig_profile: profile.map(str::to_owned),
            memory_total_bytes: Some(80 << 30),
            ..DeviceReport::default()
        }
    }

    fn claim(ns: &str, name: &str, pods: &[&str], devices: &[&str], idle_s: u64) -> ClaimReport {
        ClaimReport {
            namespace: ns.into(),
            name: name.into(),
            uid: format!("uid-{name}"),
            devices: devices.iter().map(|d| (*d).to_owned()).collect(),
            pods: pods
                .iter()
                .map(|p| PodRef {
                    name: (*p).into(),
                    uid: format!("uid-{p}"),
                })
                .collect(),
            busy: idle_s == 0,
            idle: idle_s >= 1800,
            idle_seconds: idle_s,
            memory_used_bytes: 10 << 30,
            ..ClaimReport::default()
        }
    }

    fn report() -> Report {
        let mut share = claim("lab", "share", &["infer-0"], &["gpu-2"], 0);
        share.share_memory_bytes = Some(20 << 30);
        Report {
            node: "node-a".into(),
            devices: vec![
                device("gpu-0", Some(90), None),
                device("gpu-1", Some(0), None),
                device("gpu-2", Some(40), None),
                device("gpu-3-mig-3g.40gb-0", None, Some("3g.40gb")),
            ],
            claims: vec![
                claim("team", "train", &["trainer-0"], &["gpu-0"], 0),
                claim("team", "notebook", &["jupyter-0"], &["gpu-1"], 7200),
                share,
                claim("team", "mig", &["eval-0"], &["gpu-3-mig-3g.40gb-0"], 3600),
            ],
            ..Report::default()
        }
    }

    fn options(scope: Scope, idle_only: bool) -> Options {
        Options {
            scope,
            idle_only,
            price_per_gpu_hour: Some(2.0),
            plugin_namespace: "drust-system".into(),
            plugin_selector: "app.kubernetes.io/component=kubelet-plugin".into(),
            token_file: None,
        }
    }

    #[test]
    fn idle_pods_first_with_their_cost_and_the_cluster_totals() {
        let t = top(&[report()], Vec::new(), &options(Scope::All, false));
        let pods: Vec<&str> = t.rows.iter().map(|r| r.pod.as_str()).collect();
        assert_eq!(pods, ["jupyter-0", "eval-0", "infer-0", "trainer-0"]);
        let nb = &t.rows[0];
        assert!(nb.idle && nb.idle_seconds == 7200 && nb.gpus == 1.0);
        // Two hours of one GPU at 2.00 an hour.
        assert_eq!(nb.idle_cost, Some(4.0));
        let mig = &t.rows[1];
        assert!((mig.gpus - 3.0 / 7.0).abs() < 1e-9, "{}", mig.gpus);
        let share = &t.rows[2];
        assert_eq!((share.gpus, share.memory_limit_bytes), (0.25, 20 << 30));
        assert!(!t.rows[3].idle);
        assert!((t.allocated_gpus - (1.0 + 1.0 + 0.25 + 3.0 / 7.0)).abs() < 1e-9);
        assert!((t.idle_gpus - (1.0 + 3.0 / 7.0)).abs() < 1e-9);
        let text = t.text(true);
        assert!(text.starts_with("NAMESPACE"), "{text}");
        assert!(
            text.lines().any(|l| l.starts_with("team       jupyter-0")
                && l.contains("2h 0m")
                && l.ends_with("4.00")),
            "{text}"
        );
        assert!(
            text.contains("GPUs allocated: 2.68; idle: 1.43 (53%)"),
            "{text}"
        );
    }

    #[test]
    fn namespace_and_idle_filters() {
        let t = top(
            &[report()],
            Vec::new(),
            &options(Scope::Namespace("lab".into()), false),
        );
        assert_eq!(t.rows.len(), 1);
        assert_eq!(t.allocated_gpus, 0.25);
        let t = top(
            &[report()],
            vec!["x: down".into()],
            &options(Scope::All, true),
        );
        assert!(t.rows.iter().all(|r| r.idle));
        assert_eq!(t.rows.len(), 2);
        assert!(t.text(false).contains("unreachable plugin: x: down"));
    }

    async fn config_of(user: &str) -> kube::Config {
        let yaml = format!(
            "apiVersion: v1\nkind: Config\n\
             clusters: [{{name: c, cluster: {{server: 'https://127.0.0.1:6443'}}}}]\n\
             users: [{{name: u, user: {user}}}]\n\
             contexts: [{{name: x, context: {{cluster: c, user: u}}}}]\n\
             current-context: x\n"
        );
        let kubeconfig = kube::config::Kubeconfig::from_yaml(&yaml).expect("a kubeconfig");
        kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .expect("a config")
    }

    async fn token_of(user: &str, file: Option<&Path>) -> Result<String, String> {
        bearer_token(&config_of(user).await, file)
            .await
            .map_err(|e| e.to_string())
    }

    #[tokio::test]
    async fn the_bearer_token_is_the_kubeconfig_users_or_the_token_files() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = |name: &str| dir.path().join(name);
        std::fs::write(path("kube-token"), "from-file").expect("write");
        std::fs::write(path("given"), "  given-token\n").expect("write");
        std::fs::write(path("empty"), "\n").expect("write");
        assert_eq!(
            token_of("{token: static-token}", None).await,
            Ok("static-token".into())
        );
        let token_file = format!("{{tokenFile: {}}}", path("kube-token").display());
        assert_eq!(token_of(&token_file, None).await, Ok("from-file".into()));
        // --token-file wins over the kubeconfig's.
        assert_eq!(
            token_of("{token: static-token}", Some(&path("given"))).await,
            Ok("given-token".into())
        );
        // No bearer token: client certificates, basic authentication, nothing.
        for user in [
            "{client-certificate-data: Y2VydA==, client-key-data: a2V5}",
            "{username: u, password: p}",
            "{}",
        ] {
            let e = token_of(user, None).await.expect_err(user);
            assert!(
                e.contains("no bearer token") && e.contains("--token-file"),
                "{e}"
            );
        }
        let e = token_of("{}", Some(&path("empty")))
            .await
            .expect_err("empty");
        assert!(e.ends_with("empty"), "{e}");
    }
}
