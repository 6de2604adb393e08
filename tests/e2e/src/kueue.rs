//! Kueue, installed on a [`ControlPlane`] as `helm install` of its own chart installs it, with
//! its manager running on this machine instead of in a pod.
//!
//! The release is the one pinned in `tests/gotools/kueue/go.mod`; `tests/scripts/build-kueue.sh`
//! builds its manager (`sigs.k8s.io/kueue/cmd/kueue`) from the Go module and copies the module's
//! Helm chart (`charts/kueue`) beside it, once, into `~/.cache/drust/kueue`.
//!
//! [`Kueue::start`] renders that chart (`helm template --include-crds`, with the user's
//! Configuration as `managerConfig.controllerManagerConfigYaml`) and applies every object but the
//! manager's Deployment and the visibility APIServices: the CRDs with their conversion webhooks,
//! the Mutating and ValidatingWebhookConfigurations, the webhook Service, the ServiceAccount and
//! its RBAC, the empty certificate Secret. Then it starts the manager as that ServiceAccount
//! (a token from the TokenRequest API: exactly the rights the chart grants) and does what the
//! kubelet would do for its pod:
//! - the webhook Service gets an EndpointSlice with this machine's address and the manager's
//!   webhook port, and the API server reaches it through the Service as in a cluster. That needs
//!   `--enable-aggregator-routing` ([`apiserver_args`]): the test cluster runs no kube-proxy, so
//!   the Service's ClusterIP routes nowhere, and an endpoint may not be a loopback address
//!   (EndpointSlice validation), so the manager serves on the machine's address;
//! - the certificate Secret is "mounted": Kueue's internal certificate management (the chart's
//!   default, no cert-manager) generates the CA and the serving certificate for
//!   `kueue-webhook-service.kueue-system.svc`, stores them in the Secret and injects the CA into
//!   the webhook configurations and CRDs; the harness copies `tls.crt` and `tls.key` from the
//!   Secret into the manager's `webhook.certDir`, as the Secret volume would.
//!
//! Why not certificates of the harness's own making, with the webhooks pointed at a loopback
//! `url` as Kueue's integration tests (envtest) do: those run the manager in-process. The
//! released binary with `internalCertManagement.enable: false` reads its metrics certificate
//! from the fixed path `/etc/kueue/metrics/certs` (`cmd/kueue/main.go`) and exits without it,
//! which a test cannot provide without writing to the host's `/etc`; and with internal
//! certificate management on, the certificate it serves names only the Service.
//!
//! Out of cluster, the Configuration gets these fields set by the harness: the health probe,
//! metrics and visibility servers on free loopback ports, the webhook server on this machine's
//! address and a free port, `webhook.certDir` in the temporary directory, `namespace` and
//! `leaderElection.resourceNamespace` `kueue-system` (a pod knows it from its ServiceAccount).
//! Everything else is the user's file.
//!
//! For the tests' Jobs under Kueue: [`held_job`] turns an example's Job into one that runs on the
//! local workload image until the test releases it (or an eviction's SIGTERM ends it), and
//! [`wait_workload`], [`job_pods`] and [`wait_job_pod_running`] follow it through Kueue and the
//! Job controller.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use serde::Deserialize as _;

use crate::ControlPlane;
use crate::manifests::{ManifestError, apply_yaml};
use crate::scripts::{ScriptError, last_line, script_path};

/// The namespace Kueue runs in (its default, `apis/config/v1beta2/defaults.go`).
pub const NAMESPACE: &str = "kueue-system";
/// The Helm release name; the chart prefixes its objects with it (`kueue-webhook-service`, ...).
pub const RELEASE: &str = "kueue";
/// The chart's ServiceAccount for the manager, whose rights the manager runs with.
pub const SERVICE_ACCOUNT: &str = "kueue-controller-manager";
/// The label that puts a Job in a LocalQueue.
pub const QUEUE_LABEL: &str = "kueue.x-k8s.io/queue-name";
const WEBHOOK_SERVICE: &str = "kueue-webhook-service";
const CERT_SECRET: &str = "kueue-webhook-server-cert";
/// From the manager's spawn to its webhooks answering through the API server. Generous: the
/// internal certificate bootstrap alone waits up to 1 + 2 + 4 + 8 s for the mounted files.
const START_TIMEOUT: Duration = Duration::from_secs(180);
/// How long a CRD may take to be Established.
const CRD_TIMEOUT: Duration = Duration::from_secs(60);
/// Lines of the manager's log quoted in an error.
const LOG_TAIL_LINES: usize = 40;

/// The kube-apiserver flags Kueue's webhooks need on the test control plane: Service endpoints
/// instead of ClusterIPs (see the module docs). Add them to
/// [`crate::ControlPlaneOptions::apiserver_args`].
pub fn apiserver_args() -> Vec<String> {
    vec!["--enable-aggregator-routing=true".to_owned()]
}

/// Installing or running Kueue failed.
#[derive(Debug, thiserror::Error)]
pub enum KueueError {
    /// `build-kueue.sh` could not run or failed.
    #[error(transparent)]
    Build(#[from] ScriptError),
    /// The build script's directory lacks the binary or the chart.
    #[error("{dir} holds no {missing} (tests/scripts/build-kueue.sh)")]
    BuildOutputMissing {
        /// The directory the script printed.
        dir: PathBuf,
        /// What is missing.
        missing: &'static str,
    },
    /// `helm template` of Kueue's chart failed.
    #[error("rendering Kueue's chart: {0}")]
    Render(#[from] crate::helm::HelmError),
    /// This machine has no address outside loopback for the webhook endpoint.
    #[error(
        "no IPv4 address outside loopback on an interface that is up, for Kueue's webhook endpoint"
    )]
    NoHostAddress,
    /// The user's Configuration is not usable.
    #[error("Kueue configuration {path}: {problem}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// A rendered or generated manifest could not be applied.
    #[error(transparent)]
    Apply(#[from] ManifestError),
    /// An API request failed.
    #[error("{action}: {source}")]
    Api {
        /// What the harness was doing.
        action: String,
        /// Why.
        source: kube::Error,
    },
    /// The manager's ServiceAccount token or its kubeconfig could not be had.
    #[error("the manager's credentials: {0}")]
    Credentials(#[from] crate::Error),
    /// A local file or process operation failed.
    #[error("{action}: {source}")]
    Io {
        /// What the harness was doing.
        action: String,
        /// Why.
        source: std::io::Error,
    },
    /// A CRD was not Established in time.
    #[error("CRD {name} not Established after {CRD_TIMEOUT:?}")]
    CrdNotEstablished {
        /// The CRD.
        name: String,
    },
    /// The manager exited.
    #[error("Kueue's manager exited ({status}); last lines of {log}:\n{log_tail}")]
    Exited {
        /// How it exited.
        status: std::process::ExitStatus,
        /// Its log file.
        log: PathBuf,
        /// The last lines of its log.
        log_tail: String,
    },
    /// The manager was not ready in time.
    #[error(
        "Kueue not ready after {START_TIMEOUT:?} (last probe: {last_probe}); last lines of {log}:\n{log_tail}"
    )]
    NotReady {
        /// What the last readiness probe saw.
        last_probe: String,
        /// Its log file.
        log: PathBuf,
        /// The last lines of its log.
        log_tail: String,
    },
}

fn io_err(action: impl Into<String>) -> impl FnOnce(std::io::Error) -> KueueError {
    let action = action.into();
    move |source| KueueError::Io { action, source }
}

fn api_err(action: impl Into<String>) -> impl FnOnce(kube::Error) -> KueueError {
    let action = action.into();
    move |source| KueueError::Api { action, source }
}

/// Kueue's manager, running against a [`ControlPlane`] (SIGKILLed on drop, and when the thread
/// that started it exits).
pub struct Kueue {
    child: tokio::process::Child,
    dir: tempfile::TempDir,
    log: PathBuf,
    version: String,
    startup: Duration,
    /// How the manager is run: kept so that [`Kueue::restart`] runs it again the same way.
    binary: PathBuf,
    manager_config: PathBuf,
    kubeconfig: PathBuf,
    listeners: Listeners,
    cert_dir: PathBuf,
}

impl std::fmt::Debug for Kueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kueue")
            .field("version", &self.version)
            .field("pid", &self.child.id())
            .field("dir", &self.dir.path())
            .finish_non_exhaustive()
    }
}

/// The ports the manager's servers take, and the address its webhook server listens on.
struct Listeners {
    host: IpAddr,
    health: u16,
    metrics: u16,
    webhook: u16,
    visibility: u16,
}

impl Kueue {
    /// Builds Kueue when not cached, installs its chart on `cp` with `config` (a
    /// `config.kueue.x-k8s.io/v1beta2` Configuration, e.g. `examples/kueue/kueue-config.yaml`)
    /// and starts its manager; returns once the manager's `/readyz` passes and a dry-run
    /// ResourceFlavor passes its webhooks through the API server.
    ///
    /// `cp` must run with [`apiserver_args`]. Call this from the thread that owns the test (see
    /// [`crate::die_with_parent`]).
    ///
    /// # Errors
    /// [`KueueError`] naming the step that failed; a manager that exits or is not ready in time
    /// is reported with the tail of its log.
    pub async fn start(cp: &ControlPlane, config: &Path) -> Result<Self, KueueError> {
        let began = Instant::now();
        let built = PathBuf::from(last_line(&script_path("build-kueue.sh"), &[]).await?);
        let binary = built.join("kueue");
        let chart = built.join("chart");
        for (path, missing) in [(&binary, "kueue binary"), (&chart, "chart/")] {
            if !path.exists() {
                return Err(KueueError::BuildOutputMissing {
                    dir: built.clone(),
                    missing,
                });
            }
        }
        let version = built
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.split('-').next())
            .unwrap_or("unknown")
            .to_owned();

        let dir = tempfile::Builder::new()
            .prefix("drust-kueue-")
            .tempdir()
            .map_err(io_err("creating Kueue's temporary directory"))?;
        let listeners = Listeners {
            host: crate::host_address().ok_or(KueueError::NoHostAddress)?,
            health: free_port()?,
            metrics: free_port()?,
            webhook: free_port()?,
            visibility: free_port()?,
        };
        let cert_dir = dir.path().join("certs");
        std::fs::create_dir(&cert_dir).map_err(io_err("creating the certificate directory"))?;
        let user_config = std::fs::read_to_string(config).map_err(io_err(format!(
            "reading Kueue's configuration {}",
            config.display()
        )))?;
        let manager_config = dir.path().join("controller_manager_config.yaml");
        std::fs::write(
            &manager_config,
            out_of_cluster_config(&user_config, &listeners, &cert_dir).map_err(|problem| {
                KueueError::Config {
                    path: config.to_owned(),
                    problem,
                }
            })?,
        )
        .map_err(io_err("writing the manager's configuration"))?;

        let client = cp.client().await?;
        install(&client, dir.path(), &chart, config).await?;
        publish_webhook_endpoint(&client, &listeners).await?;

        let kubeconfig = dir.path().join("kueue.kubeconfig");
        let token = cp.service_account_token(NAMESPACE, SERVICE_ACCOUNT).await?;
        cp.write_kubeconfig(&kubeconfig, &token)?;

        let log = dir.path().join("kueue.log");
        let child = spawn_manager(&binary, &manager_config, &kubeconfig, &log, dir.path())?;
        let mut kueue = Self {
            child,
            dir,
            log,
            version,
            startup: Duration::ZERO,
            binary,
            manager_config,
            kubeconfig,
            listeners,
            cert_dir,
        };
        kueue.wait_ready(&client).await?;
        kueue.startup = began.elapsed();
        eprintln!(
            "kueue {} ready in {} ms (build check, chart, certificates, webhooks)",
            kueue.version,
            kueue.startup.as_millis()
        );
        Ok(kueue)
    }

    /// The release running, e.g. `v0.19.2`.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// From [`Kueue::start`]'s call to ready.
    pub fn startup(&self) -> Duration {
        self.startup
    }

    /// The manager's stdout and stderr.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The last lines of the manager's log, for failure messages.
    pub fn log_tail(&self) -> String {
        log_tail(&self.log)
    }

    /// SIGTERMs the manager and waits up to 10 s for it to exit, then SIGKILLs it.
    ///
    /// # Errors
    /// [`KueueError::Io`] when it cannot be signalled or waited for.
    pub async fn stop(mut self) -> Result<(), KueueError> {
        self.stop_manager().await
    }

    /// Stops the manager as [`Kueue::stop`] does, leaving everything installed (CRDs, webhook
    /// configurations, Workloads): Kueue is down, as when its pod is gone. Then its webhooks
    /// refuse every object they are registered for ("failed calling webhook"), and nothing
    /// is admitted, until [`Kueue::restart`].
    ///
    /// # Errors
    /// As [`Kueue::stop`].
    pub async fn stop_manager(&mut self) -> Result<(), KueueError> {
        if let Some(pid) = self.child.id() {
            // Linux pids fit in i32.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        match tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await {
            Ok(status) => status
                .map(drop)
                .map_err(io_err("waiting for Kueue to exit")),
            Err(_) => self
                .child
                .kill()
                .await
                .map_err(io_err("killing Kueue after SIGTERM")),
        }
    }

    /// Starts the manager again, as [`Kueue::start`] ran it (same configuration, ports and
    /// ServiceAccount token; its log appended to), after [`Kueue::stop_manager`]; returns once it
    /// is ready as [`Kueue::start`] defines it.
    ///
    /// # Errors
    /// [`KueueError`] as from [`Kueue::start`]'s spawn and readiness wait.
    pub async fn restart(&mut self, cp: &ControlPlane) -> Result<(), KueueError> {
        self.child = spawn_manager(
            &self.binary,
            &self.manager_config,
            &self.kubeconfig,
            &self.log,
            self.dir.path(),
        )?;
        let client = cp.client().await?;
        self.wait_ready(&client).await
    }

    /// Polls until the manager's `/readyz` passes (certificates in place, webhook server
    /// started) and its webhooks answer through the API server, copying the certificate Secret
    /// into `cert_dir` once Kueue has filled it.
    async fn wait_ready(&mut self, client: &kube::Client) -> Result<(), KueueError> {
        let secrets: Api<Secret> = Api::namespaced(client.clone(), NAMESPACE);
        let flavors = resource_flavors(client);
        let probe_flavor: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ResourceFlavor",
            "metadata": {"name": "drust-e2e-readiness-probe"},
        }))
        .map_err(|e| KueueError::Config {
            path: PathBuf::from("(readiness probe)"),
            problem: e.to_string(),
        })?;
        let dry_run = PostParams {
            dry_run: true,
            ..PostParams::default()
        };
        let started = Instant::now();
        let mut mounted = false;
        loop {
            if let Some(status) = self
                .child
                .try_wait()
                .map_err(io_err("checking on Kueue's manager"))?
            {
                return Err(KueueError::Exited {
                    status,
                    log: self.log.clone(),
                    log_tail: self.log_tail(),
                });
            }
            let last_probe = if !mounted {
                match secrets.get_opt(CERT_SECRET).await {
                    Ok(secret) => match mount_certificates(secret.as_ref(), &self.cert_dir)? {
                        true => {
                            mounted = true;
                            "certificates copied from the Secret".to_owned()
                        }
                        false => format!("Secret {NAMESPACE}/{CERT_SECRET} not filled yet"),
                    },
                    Err(e) => format!("reading Secret {NAMESPACE}/{CERT_SECRET}: {e}"),
                }
            } else {
                match crate::http::get(self.listeners.health, "/readyz").await {
                    Ok((200, _)) => match flavors.create(&dry_run, &probe_flavor).await {
                        Ok(_) => return Ok(()),
                        Err(e) => format!("a dry-run ResourceFlavor: {e}"),
                    },
                    Ok((status, body)) => format!("/readyz: {status} {body}"),
                    Err(e) => format!("/readyz: {e}"),
                }
            };
            if started.elapsed() >= START_TIMEOUT {
                return Err(KueueError::NotReady {
                    last_probe,
                    log: self.log.clone(),
                    log_tail: self.log_tail(),
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Runs Kueue's manager `binary` with `config` as `kubeconfig`'s user, in `dir`, its output
/// appended to `log`; killed with the test (see [`crate::die_with_parent`]).
fn spawn_manager(
    binary: &Path,
    config: &Path,
    kubeconfig: &Path,
    log: &Path,
    dir: &Path,
) -> Result<tokio::process::Child, KueueError> {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(io_err("opening kueue.log"))?;
    let err = out.try_clone().map_err(io_err("opening kueue.log"))?;
    let mut command = tokio::process::Command::new(binary);
    command
        .arg(format!("--config={}", config.display()))
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        // The chart's default log level (controllerManager.manager.logLevel).
        .arg("--zap-log-level=2")
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .kill_on_drop(true);
    crate::die_with_parent(command.as_std_mut());
    command
        .spawn()
        .map_err(io_err(format!("starting {}", binary.display())))
}

/// A port for one of the manager's servers ([`crate::ports`]).
fn free_port() -> Result<u16, KueueError> {
    crate::ports::free_port().map_err(io_err("picking a free port for Kueue"))
}

/// `user` (a Configuration) with the fields a manager outside its pod needs (see the module
/// docs).
fn out_of_cluster_config(
    user: &str,
    listeners: &Listeners,
    cert_dir: &Path,
) -> Result<String, String> {
    let mut config: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(user).map_err(|e| format!("not YAML: {e}"))?;
    let kind = (config["apiVersion"].as_str(), config["kind"].as_str());
    if kind != (Some("config.kueue.x-k8s.io/v1beta2"), Some("Configuration")) {
        return Err(format!(
            "apiVersion/kind is {kind:?}, want config.kueue.x-k8s.io/v1beta2 Configuration"
        ));
    }
    if config["internalCertManagement"]["enable"].as_bool() == Some(false) {
        return Err(
            "internalCertManagement.enable is false; the harness needs Kueue's own certificates \
             (see tests/e2e/src/kueue.rs)"
                .to_owned(),
        );
    }
    if let Some(namespace) = config["namespace"].as_str().filter(|n| *n != NAMESPACE) {
        return Err(format!(
            "namespace is {namespace}; the harness installs Kueue in {NAMESPACE}"
        ));
    }
    let set = |config: &mut serde_yaml_ng::Value, path: &[&str], value: serde_yaml_ng::Value| {
        let mut at = config;
        for key in &path[..path.len() - 1] {
            if !at[*key].is_mapping() {
                at[*key] = serde_yaml_ng::Value::Mapping(Default::default());
            }
            at = &mut at[*key];
        }
        at[path[path.len() - 1]] = value;
    };
    let loopback = |port: u16| format!("127.0.0.1:{port}").into();
    set(&mut config, &["namespace"], NAMESPACE.into());
    // In a pod, controller-runtime reads it from the ServiceAccount's namespace file.
    set(
        &mut config,
        &["leaderElection", "resourceNamespace"],
        NAMESPACE.into(),
    );
    set(
        &mut config,
        &["health", "healthProbeBindAddress"],
        loopback(listeners.health),
    );
    set(
        &mut config,
        &["metrics", "bindAddress"],
        loopback(listeners.metrics),
    );
    set(
        &mut config,
        &["webhook", "host"],
        listeners.host.to_string().into(),
    );
    set(&mut config, &["webhook", "port"], listeners.webhook.into());
    set(
        &mut config,
        &["webhook", "certDir"],
        cert_dir.display().to_string().into(),
    );
    set(
        &mut config,
        &["visibilityServer", "bindAddress"],
        "127.0.0.1".into(),
    );
    set(
        &mut config,
        &["visibilityServer", "bindPort"],
        listeners.visibility.into(),
    );
    serde_yaml_ng::to_string(&config).map_err(|e| e.to_string())
}

/// Renders Kueue's chart with `config` as the manager's configuration and applies it: the
/// namespace, the CRDs (waiting until they are Established), then everything but the
/// manager's Deployment and the visibility APIServices (served by the manager in a pod, through
/// the API server's front proxy, which the test control plane does not set up).
async fn install(
    client: &kube::Client,
    dir: &Path,
    chart: &Path,
    config: &Path,
) -> Result<(), KueueError> {
    let rendered = crate::helm::helm_in(
        Some(&dir.join("helm")),
        &[
            "template",
            RELEASE,
            &chart.display().to_string(),
            "--namespace",
            NAMESPACE,
            "--include-crds",
            "--set-file",
            &format!(
                "managerConfig.controllerManagerConfigYaml={}",
                config.display()
            ),
        ],
    )
    .await?;
    let origin = chart.join("(helm template)");
    let (crds, rest) = split_rendered(&rendered).map_err(|problem| ManifestError {
        path: origin.clone(),
        document: 0,
        problem,
    })?;
    apply_yaml(
        client,
        &format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: {NAMESPACE}}}\n"),
        Path::new("Kueue's namespace"),
    )
    .await?;
    let applied = apply_yaml(client, &crds, &origin).await?;
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in applied {
        let name = crd.metadata.name.unwrap_or_default();
        let deadline = Instant::now() + CRD_TIMEOUT;
        loop {
            let established = api
                .get(&name)
                .await
                .map_err(api_err(format!("reading CRD {name}")))?
                .status
                .and_then(|s| s.conditions)
                .is_some_and(|c| {
                    c.iter()
                        .any(|c| c.type_ == "Established" && c.status == "True")
                });
            if established {
                break;
            }
            if Instant::now() >= deadline {
                return Err(KueueError::CrdNotEstablished { name });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    apply_yaml(client, &rest, &origin).await?;
    Ok(())
}

/// The CRDs of `rendered` (a `helm template` stream), and the objects to apply after them,
/// without the kinds that run or serve inside the manager's pod.
fn split_rendered(rendered: &str) -> Result<(String, String), String> {
    const LEFT_OUT: [&str; 2] = ["Deployment", "APIService"];
    let mut crds = Vec::new();
    let mut rest = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(rendered) {
        let value = serde_yaml_ng::Value::deserialize(doc).map_err(|e| e.to_string())?;
        if value.is_null() {
            continue;
        }
        let kind = value["kind"].as_str().unwrap_or_default();
        if LEFT_OUT.contains(&kind) {
            continue;
        }
        let text = serde_yaml_ng::to_string(&value).map_err(|e| e.to_string())?;
        if kind == "CustomResourceDefinition" {
            crds.push(text);
        } else {
            rest.push(text);
        }
    }
    Ok((crds.join("---\n"), rest.join("---\n")))
}

/// The EndpointSlice the EndpointSlice controller would write for the manager's pod: the
/// webhook Service's (unnamed) port at this machine's address and the manager's webhook port.
async fn publish_webhook_endpoint(
    client: &kube::Client,
    listeners: &Listeners,
) -> Result<(), KueueError> {
    let slice = serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": format!("{WEBHOOK_SERVICE}-drust-e2e"),
            "namespace": NAMESPACE,
            "labels": {
                "kubernetes.io/service-name": WEBHOOK_SERVICE,
                "endpointslice.kubernetes.io/managed-by": "drust-e2e",
            },
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [listeners.host.to_string()], "conditions": {"ready": true}}],
        "ports": [{"name": "", "port": listeners.webhook, "protocol": "TCP"}],
    });
    let text = serde_json::to_string(&slice).map_err(|e| KueueError::Config {
        path: PathBuf::from("(webhook EndpointSlice)"),
        problem: e.to_string(),
    })?;
    apply_yaml(client, &text, Path::new("Kueue's webhook EndpointSlice")).await?;
    Ok(())
}

/// Writes the Secret's `tls.crt` and `tls.key` into `dir` when Kueue has filled them in;
/// returns whether it did.
fn mount_certificates(secret: Option<&Secret>, dir: &Path) -> Result<bool, KueueError> {
    let Some(data) = secret.and_then(|s| s.data.as_ref()) else {
        return Ok(false);
    };
    let (Some(cert), Some(key)) = (data.get("tls.crt"), data.get("tls.key")) else {
        return Ok(false);
    };
    // The key first: the manager's certificate watcher starts on tls.crt.
    write_private(&dir.join("tls.key"), &key.0)?;
    write_private(&dir.join("tls.crt"), &cert.0)?;
    Ok(true)
}

fn write_private(path: &Path, bytes: &[u8]) -> Result<(), KueueError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(bytes))
        .map_err(io_err(format!("writing {}", path.display())))
}

fn log_tail(path: &Path) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
        }
        Err(e) => format!("(log unreadable: {e})"),
    }
}

/// The API of a Kueue kind (`kueue.x-k8s.io/v1beta2`), e.g. `("Workload", "workloads")`.
pub fn kueue_resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", kind),
        plural,
    )
}

fn resource_flavors(client: &kube::Client) -> Api<DynamicObject> {
    Api::all_with(
        client.clone(),
        &kueue_resource("ResourceFlavor", "resourceflavors"),
    )
}

/// A condition of a Kueue object (`status.conditions`): status, reason and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Condition {
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// The reason, CamelCase.
    pub reason: String,
    /// The human-readable message.
    pub message: String,
}

/// Condition `type_` of `object` (a Workload, ClusterQueue, ...), if it has one.
pub fn condition(object: &DynamicObject, type_: &str) -> Option<Condition> {
    let conditions = object.data["status"]["conditions"].as_array()?;
    let c = conditions.iter().find(|c| c["type"] == type_)?;
    let text = |k: &str| c[k].as_str().unwrap_or_default().to_owned();
    Some(Condition {
        status: text("status"),
        reason: text("reason"),
        message: text("message"),
    })
}

/// The Workload Kueue made for the object with UID `owner_uid` (a Job's, say) in `namespace`:
/// the one whose owner references name it.
///
/// # Errors
/// The API error when the Workloads cannot be listed.
pub async fn workload_of(
    client: &kube::Client,
    namespace: &str,
    owner_uid: &str,
) -> Result<Option<DynamicObject>, kube::Error> {
    let api: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        namespace,
        &kueue_resource("Workload", "workloads"),
    );
    Ok(api
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .find(|w| {
            w.metadata
                .owner_references
                .iter()
                .flatten()
                .any(|o| o.uid == owner_uid)
        }))
}

/// What Kueue's admission charged a Workload, per pod set and resource
/// (`status.admission.podSetAssignments[].resourceUsage`), as quantities' strings.
pub fn resource_usage(workload: &DynamicObject) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for a in workload.data["status"]["admission"]["podSetAssignments"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let usage = a["resourceUsage"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
            .collect();
        out.insert(a["name"].as_str().unwrap_or_default().to_owned(), usage);
    }
    out
}

/// Where the containers of a [`held_job`] find the file that ends them.
pub const RELEASE_MOUNT: &str = "/release";

/// The Job of `example` (an example file's text) named `job`, renamed `name`, with every
/// container in the local workload image ([`crate::images::WORKLOAD_IMAGE`]) running
/// [`crate::node_pods::SCRIPT`] and then waiting until `<release>/<name>` exists (`release`: a
/// directory of the node's host, mounted at [`RELEASE_MOUNT`]), so that the test says when the
/// Job finishes. SIGTERM (an eviction) ends a container at once, with status 143.
///
/// # Errors
/// When `example` holds no such Job or its documents are not YAML.
pub fn held_job(example: &str, job: &str, name: &str, release: &Path) -> anyhow::Result<Job> {
    let text = crate::manifests::documents_where(example, |d| {
        d["kind"] == "Job" && d["metadata"]["name"] == job
    })?;
    let mut value: serde_json::Value = serde_yaml_ng::from_str(&text)?;
    anyhow::ensure!(value.is_object(), "no Job {job} in the example");
    value["metadata"]["name"] = name.into();
    let spec = &mut value["spec"]["template"]["spec"];
    let script = format!(
        "trap 'exit 143' TERM; {}; until [ -e {RELEASE_MOUNT}/{name} ]; do sleep 0.2; done",
        crate::node_pods::SCRIPT
    );
    for container in spec["containers"].as_array_mut().into_iter().flatten() {
        container["image"] = crate::images::WORKLOAD_IMAGE.into();
        container["imagePullPolicy"] = "Never".into();
        container["command"] = serde_json::json!(["/bin/sh", "-c", script]);
        container["volumeMounts"] =
            serde_json::json!([{"name": "release", "mountPath": RELEASE_MOUNT}]);
    }
    spec["volumes"] = serde_json::json!([{
        "name": "release",
        "hostPath": {"path": release.display().to_string(), "type": "Directory"},
    }]);
    Ok(serde_json::from_value(value)?)
}

/// Waits up to `timeout` until the Workload of `job` has condition `type_` matching `ok`;
/// returns the Workload and the condition.
///
/// # Errors
/// When `job` has no UID, or the wait runs out, with the last condition seen.
pub async fn wait_workload(
    client: &kube::Client,
    job: &Job,
    type_: &str,
    timeout: Duration,
    ok: impl Fn(&Condition) -> bool,
) -> anyhow::Result<(DynamicObject, Condition)> {
    let uid = job.metadata.uid.clone().context("the Job's UID")?;
    let name = job.metadata.name.clone().unwrap_or_default();
    let namespace = job.metadata.namespace.clone().unwrap_or_default();
    Ok(crate::wait::until(
        &format!("the Workload of Job {name} with a matching {type_} condition"),
        timeout,
        || async {
            let workload = workload_of(client, &namespace, &uid)
                .await
                .map_err(|e| e.to_string())?
                .ok_or_else(|| "no Workload yet".to_owned())?;
            match condition(&workload, type_) {
                Some(c) if ok(&c) => Ok(Some((workload, c))),
                other => Err(format!("{type_}: {other:?}")),
            }
        },
    )
    .await?)
}

/// The pods of Job `name` (by the Job controller's `batch.kubernetes.io/job-name` label).
///
/// # Errors
/// The API error.
pub async fn job_pods(pods: &Api<Pod>, name: &str) -> Result<Vec<Pod>, kube::Error> {
    Ok(pods
        .list(
            &kube::api::ListParams::default()
                .labels(&format!("batch.kubernetes.io/job-name={name}")),
        )
        .await?
        .items)
}

/// Waits up to `timeout` for a pod of Job `name` to exist, then for it to run on `node`.
///
/// # Errors
/// When no pod appears in time, or it does not run ([`crate::node_pods::wait_running`]).
pub async fn wait_job_pod_running(
    pods: &Api<Pod>,
    name: &str,
    node: &crate::node::Node,
    timeout: Duration,
) -> anyhow::Result<Pod> {
    let pod = crate::wait::until(&format!("a pod of Job {name}"), timeout, || async {
        let found = job_pods(pods, name).await.map_err(|e| e.to_string())?;
        Ok(found.into_iter().next())
    })
    .await?;
    let pod_name = pod.metadata.name.clone().unwrap_or_default();
    crate::node_pods::wait_running(pods, &pod_name, node).await
}

/// Waits until ClusterQueue `name` is `Active` (its flavors and quotas accepted by Kueue),
/// within `timeout`.
///
/// # Errors
/// Not Active within `timeout`; the last condition seen is in the error.
pub async fn wait_cluster_queue_active(
    client: &kube::Client,
    name: &str,
    timeout: std::time::Duration,
) -> anyhow::Result<()> {
    let queues: kube::Api<DynamicObject> = kube::Api::all_with(
        client.clone(),
        &kueue_resource("ClusterQueue", "clusterqueues"),
    );
    crate::wait::until(&format!("ClusterQueue {name} Active"), timeout, || async {
        let cq = queues.get(name).await.map_err(|e| e.to_string())?;
        match condition(&cq, "Active") {
            Some(c) if c.status == "True" => Ok(Some(())),
            other => Err(format!("{other:?}")),
        }
    })
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listeners() -> Listeners {
        Listeners {
            host: "10.1.2.3".parse().unwrap(),
            health: 20001,
            metrics: 20002,
            webhook: 20003,
            visibility: 20004,
        }
    }

    #[test]
    fn the_example_configuration_gets_only_the_out_of_cluster_fields() {
        let example = std::fs::read_to_string(crate::manifests::repo_path(
            "examples/kueue/kueue-config.yaml",
        ))
        .unwrap();
        let text = out_of_cluster_config(&example, &listeners(), Path::new("/tmp/c")).unwrap();
        let mut got: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).unwrap();
        assert_eq!(got["webhook"]["host"], "10.1.2.3");
        assert_eq!(got["webhook"]["port"], 20003);
        assert_eq!(got["webhook"]["certDir"], "/tmp/c");
        assert_eq!(got["health"]["healthProbeBindAddress"], "127.0.0.1:20001");
        assert_eq!(got["metrics"]["bindAddress"], "127.0.0.1:20002");
        assert_eq!(got["visibilityServer"]["bindPort"], 20004);
        assert_eq!(got["namespace"], NAMESPACE);
        assert_eq!(got["leaderElection"]["resourceNamespace"], NAMESPACE);
        // Everything else is the user's, untouched.
        let mapping = got.as_mapping_mut().unwrap();
        for key in [
            "webhook",
            "health",
            "metrics",
            "visibilityServer",
            "namespace",
            "leaderElection",
        ] {
            mapping.remove(key);
        }
        let want: serde_yaml_ng::Value = serde_yaml_ng::from_str(&example).unwrap();
        assert_eq!(got, want);
    }

    #[test]
    fn configurations_the_harness_cannot_run_are_refused_with_the_field() {
        let cases = [
            ("apiVersion: v1\nkind: ConfigMap\n", "apiVersion/kind"),
            (
                "apiVersion: config.kueue.x-k8s.io/v1beta2\nkind: Configuration\n\
                 internalCertManagement: {enable: false}\n",
                "internalCertManagement.enable",
            ),
            (
                "apiVersion: config.kueue.x-k8s.io/v1beta2\nkind: Configuration\nnamespace: x\n",
                "namespace is x",
            ),
        ];
        for (config, want) in cases {
            let err = out_of_cluster_config(config, &listeners(), Path::new("/c")).unwrap_err();
            assert!(err.contains(want), "{config}: {err}");
        }
    }

    #[test]
    fn a_held_job_runs_every_container_of_the_example_job_until_its_release_file() {
        let example = std::fs::read_to_string(crate::manifests::repo_path(
            "examples/kueue/preemption.yaml",
        ))
        .unwrap();
        let job = held_job(&example, "sweep", "sweep-1", Path::new("/node/release")).unwrap();
        assert_eq!(job.metadata.name.as_deref(), Some("sweep-1"));
        let labels = job.metadata.labels.unwrap_or_default();
        assert_eq!(labels[QUEUE_LABEL], "dgx");
        assert_eq!(labels["kueue.x-k8s.io/priority-class"], "low");
        let pod = job.spec.unwrap().template.spec.unwrap();
        assert_eq!(pod.containers.len(), 2);
        for c in &pod.containers {
            assert_eq!(c.image.as_deref(), Some(crate::images::WORKLOAD_IMAGE));
            let script = &c.command.as_ref().unwrap()[2];
            assert!(
                script.starts_with("trap 'exit 143' TERM;")
                    && script.ends_with("until [ -e /release/sweep-1 ]; do sleep 0.2; done"),
                "{script}"
            );
            assert_eq!(
                c.volume_mounts.as_ref().unwrap()[0].mount_path,
                RELEASE_MOUNT
            );
        }
        // The example's claims are kept.
        assert_eq!(pod.resource_claims.unwrap().len(), 2);
        let volume = &pod.volumes.unwrap()[0];
        assert_eq!(
            volume.host_path.as_ref().map(|h| h.path.as_str()),
            Some("/node/release")
        );
        let err = held_job(&example, "no-such-job", "x", Path::new("/r")).unwrap_err();
        assert!(err.to_string().contains("no Job no-such-job"), "{err}");
    }

    #[test]
    fn the_chart_is_applied_without_the_deployment_and_the_api_services() {
        let rendered = "kind: CustomResourceDefinition\nmetadata: {name: a}\n---\n\
                        kind: Deployment\nmetadata: {name: b}\n---\n\
                        kind: APIService\nmetadata: {name: c}\n---\n\
                        kind: Service\nmetadata: {name: d}\n---\n";
        let (crds, rest) = split_rendered(rendered).unwrap();
        assert!(
            crds.contains("name: a") && !crds.contains("name: d"),
            "{crds}"
        );
        assert!(rest.contains("name: d"), "{rest}");
        assert!(
            !rest.contains("name: b") && !rest.contains("name: c"),
            "{rest}"
        );
    }
}
