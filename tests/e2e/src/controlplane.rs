//! Start, probe and tear down one loopback control plane in a temporary directory.
//!
//! Layout of the temporary directory:
//!
//! ```text
//! ca.crt                    CA that signed serving.crt; trusted by every kubeconfig
//! serving.crt, serving.key  serving certificate for 127.0.0.1 / localhost (apiserver, scheduler)
//! sa.key, sa.pub            service-account signing key (ECDSA P-256, PKCS#8) and its public half
//! tokens.csv                --token-auth-file: admin, controller-manager and scheduler tokens
//! admin.kubeconfig, controller-manager.kubeconfig, scheduler.kubeconfig
//! etcd/                     etcd data
//! apiserver-certs/          --cert-dir (unused while tls files are given; keeps /var/run clean)
//! <component>.log           stdout and stderr of each component
//! ```

mod credentials;
mod process;

pub use credentials::CERTIFICATE_USER;
pub use process::die_with_parent;

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Node, ServiceAccount};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::kubernetes::KubernetesVersion;
use credentials::{Credentials, write_kubeconfig};
use process::{PROBE_TIMEOUT, Processes, log_path};

/// Environment variable that, set to `1`, keeps the temporary directory after the control plane
/// stops (see [`ControlPlaneOptions::keep_temp_dir`]).
pub const KEEP_ENV: &str = "DRUST_KEEP_CONTROLPLANE";

/// Path of the build script, from this crate's manifest directory (`tests/e2e`).
const BUILD_SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/scripts/build-controlplane.sh"
);

/// The kubernetes Service gets the first address of `--service-cluster-ip-range`.
const SERVICE_CLUSTER_IP_RANGE: &str = "10.0.0.0/24";
const KUBERNETES_SERVICE_IP: &str = "10.0.0.1";
const SERVICE_ACCOUNT_ISSUER: &str = "https://kubernetes.default.svc.cluster.local";

/// One process of the control plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Component {
    /// etcd, the store behind the apiserver.
    Etcd,
    /// kube-apiserver.
    KubeApiserver,
    /// kube-controller-manager, with every controller but `node-lifecycle-controller`.
    KubeControllerManager,
    /// kube-scheduler, the real scheduler (including its DRA plugin).
    KubeScheduler,
}

impl Component {
    /// The binary's file name, which also names its log file (`<name>.log`).
    pub fn binary_name(self) -> &'static str {
        match self {
            Component::Etcd => "etcd",
            Component::KubeApiserver => "kube-apiserver",
            Component::KubeControllerManager => "kube-controller-manager",
            Component::KubeScheduler => "kube-scheduler",
        }
    }
}

impl fmt::Display for Component {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.binary_name())
    }
}

/// Errors of starting, using and stopping a control plane. Start errors quote the tail of the
/// failed component's log.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `DRUST_K8S` names no version the harness can build.
    #[error(transparent)]
    KubernetesVersion(#[from] crate::kubernetes::UnknownVersion),
    /// The build script could not run or failed.
    #[error(transparent)]
    BuildScript(#[from] crate::scripts::ScriptError),
    /// The build script succeeded but its last stdout line is not a directory with the binaries.
    #[error("{script} printed {printed:?}, which is not a directory holding {missing}")]
    BinariesMissing {
        /// The script.
        script: PathBuf,
        /// Its last stdout line.
        printed: String,
        /// The first binary not found there.
        missing: &'static str,
    },
    /// The temporary directory could not be created.
    #[error("creating the control plane's temporary directory")]
    CreateTempDir {
        /// Why.
        source: io::Error,
    },
    /// Random bytes for the tokens could not be read.
    #[error("reading random bytes for the bearer tokens")]
    GenerateToken {
        /// Why.
        source: io::Error,
    },
    /// rcgen failed to make a key or certificate.
    #[error("generating {what}")]
    GenerateCertificate {
        /// Which key or certificate.
        what: &'static str,
        /// Why.
        source: rcgen::Error,
    },
    /// A kubeconfig could not be rendered.
    #[error("rendering the kubeconfig for {path}")]
    RenderKubeconfig {
        /// Where it was to be written.
        path: PathBuf,
        /// Why.
        source: serde_yaml_ng::Error,
    },
    /// A file could not be written.
    #[error("writing {path}")]
    WriteFile {
        /// The file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// No free loopback port could be found.
    #[error("picking a free loopback port")]
    PickPort {
        /// Why.
        source: io::Error,
    },
    /// A component's binary could not be started.
    #[error("starting {component} ({binary})")]
    SpawnComponent {
        /// The component.
        component: Component,
        /// Its binary.
        binary: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// A component exited while the harness waited for it to become ready.
    #[error("{component} exited before it was ready ({status}); last lines of {log}:\n{log_tail}")]
    ComponentExited {
        /// The component.
        component: Component,
        /// How it exited.
        status: ExitStatus,
        /// Its log file.
        log: PathBuf,
        /// The last lines of its log.
        log_tail: String,
    },
    /// A component did not become ready in time.
    #[error(
        "{component} not ready after {waited:?} (last probe: {last_probe}); last lines of {log}:\n{log_tail}"
    )]
    ComponentNotReady {
        /// The component.
        component: Component,
        /// How long the harness waited, from spawning it.
        waited: Duration,
        /// What the last readiness probe saw.
        last_probe: String,
        /// Its log file.
        log: PathBuf,
        /// The last lines of its log.
        log_tail: String,
    },
    /// The state of a child process could not be read, or a signal could not be sent to it.
    #[error("checking on {component} (pid {pid})")]
    WatchComponent {
        /// The component.
        component: Component,
        /// Its process id.
        pid: u32,
        /// Why.
        source: io::Error,
    },
    /// A kubeconfig could not be loaded into a `kube::Config`.
    #[error("loading kubeconfig {path}")]
    LoadKubeconfig {
        /// The kubeconfig.
        path: PathBuf,
        /// Why.
        source: kube::config::KubeconfigError,
    },
    /// A URL the harness made up did not parse.
    #[error("parsing URL {url}")]
    ParseUrl {
        /// The URL.
        url: String,
        /// Why.
        source: http::uri::InvalidUri,
    },
    /// A `kube::Client` could not be built.
    #[error("building a client for {server}")]
    BuildClient {
        /// The server URL.
        server: String,
        /// Why.
        source: kube::Error,
    },
    /// Creating or patching a Node failed.
    #[error("registering node {node}: {step}")]
    RegisterNode {
        /// The Node name.
        node: String,
        /// Which request failed.
        step: &'static str,
        /// Why.
        source: kube::Error,
    },
    /// A ServiceAccount token could not be issued.
    #[error("requesting a token for ServiceAccount {namespace}/{name}")]
    RequestToken {
        /// The ServiceAccount's namespace.
        namespace: String,
        /// The ServiceAccount's name.
        name: String,
        /// Why.
        source: kube::Error,
    },
    /// The TokenRequest came back without a token.
    #[error("the TokenRequest for ServiceAccount {namespace}/{name} returned no token")]
    TokenMissing {
        /// The ServiceAccount's namespace.
        namespace: String,
        /// The ServiceAccount's name.
        name: String,
    },
}

/// How to start a [`ControlPlane`]. `Default` is a stock control plane of the version
/// `DRUST_K8S` selects, v1.36 or v1.37 ([`KubernetesVersion`]; DRA's `resource.k8s.io/v1` is GA
/// and on in both), keeping the temporary directory when [`KEEP_ENV`] is `1`.
#[derive(Debug, Clone)]
pub struct ControlPlaneOptions {
    /// `--feature-gates` for kube-apiserver, kube-controller-manager and kube-scheduler alike,
    /// gate name to value (for example `DRADeviceTaints` → `true`).
    pub feature_gates: BTreeMap<String, bool>,
    /// `--runtime-config` entries for kube-apiserver (for example
    /// `resource.k8s.io/v1beta2=true`).
    pub runtime_config: Vec<String>,
    /// Extra kube-apiserver flags, after the harness's own (so they win).
    pub apiserver_args: Vec<String>,
    /// Extra kube-controller-manager flags, after the harness's own.
    pub controller_manager_args: Vec<String>,
    /// Extra kube-scheduler flags, after the harness's own.
    pub scheduler_args: Vec<String>,
    /// Keep the temporary directory after stop or drop, and print where it is.
    pub keep_temp_dir: bool,
    /// How long each component may take to become ready, from its spawn.
    pub ready_timeout: Duration,
    /// Serve pods too: kube-apiserver listens on every address instead of 127.0.0.1 only, with
    /// this (non-loopback) address of the machine in its serving certificate, so a container in
    /// the node's pod network reaches it at `https://<address>:<port>`
    /// ([`ControlPlane::pod_endpoint`]). The test node runs no kube-proxy, so the `kubernetes`
    /// Service's ClusterIP does not route; pods are pointed here by `KUBERNETES_SERVICE_HOST`
    /// and `KUBERNETES_SERVICE_PORT`.
    pub pod_address: Option<std::net::IpAddr>,
}

impl ControlPlaneOptions {
    /// The defaults with workload-aware scheduling on for the version `DRUST_K8S` selects
    /// ([`KubernetesVersion::from_env`]; an unknown value gets 1.36's here, and
    /// [`ControlPlane::start`] refuses it). 1.36, as its blog post "Getting started" turns it on
    /// (kubernetes/website `content/en/blog/_posts/2026/workload-aware-scheduling-1-36.md`):
    /// the alpha gates `GenericWorkload`, `GangScheduling`, `TopologyAwareWorkloadScheduling`,
    /// `DRAWorkloadResourceClaims` and `WorkloadWithJob` on every component (the blog and the
    /// issue say `EnableWorkloadWithJob`; v1.36.3's `pkg/features/kube_features.go` names it
    /// `WorkloadWithJob`, and the apiserver refuses the other name), and
    /// `scheduling.k8s.io/v1alpha2` (Workload, PodGroup) served. 1.37: the same without
    /// `GangScheduling` (v1.37.2 has no such gate), and `scheduling.k8s.io/v1beta1` served, a
    /// beta API off by default (`pkg/controlplane/instance.go`). The gates are
    /// [`KubernetesVersion::workload_aware_gates`]. A real node's kubelet needs
    /// `DRAWorkloadResourceClaims` too before it runs a pod with a PodGroup's claim.
    pub fn workload_aware() -> Self {
        let version = KubernetesVersion::from_env().unwrap_or_default();
        let mut options = Self::default();
        for gate in version.workload_aware_gates() {
            options.feature_gates.insert((*gate).to_owned(), true);
        }
        options
            .runtime_config
            .push(format!("{}=true", version.scheduling_api_version()));
        options
    }
}

impl Default for ControlPlaneOptions {
    fn default() -> Self {
        Self {
            feature_gates: BTreeMap::new(),
            runtime_config: Vec::new(),
            apiserver_args: Vec::new(),
            controller_manager_args: Vec::new(),
            scheduler_args: Vec::new(),
            keep_temp_dir: std::env::var(KEEP_ENV).is_ok_and(|v| v == "1"),
            // Generous: a 2-core machine that is also compiling starts the apiserver in ~10 s.
            ready_timeout: Duration::from_secs(120),
            pod_address: None,
        }
    }
}

/// How long [`ControlPlane::start`] took, step by step. Component times run from that
/// component's spawn to the first successful readiness probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartTimings {
    /// Running the build script (a cache check when the binaries are already built).
    pub binaries: Duration,
    /// Keys, certificates, tokens and kubeconfigs.
    pub credentials: Duration,
    /// etcd: until `/health` reports healthy.
    pub etcd: Duration,
    /// kube-apiserver: until `/readyz` answers `ok`.
    pub kube_apiserver: Duration,
    /// kube-controller-manager: until the `default` ServiceAccount exists in `default`.
    pub kube_controller_manager: Duration,
    /// kube-scheduler: until its own `/readyz` answers `ok`.
    pub kube_scheduler: Duration,
    /// Everything after the binaries step: what a warm start costs.
    pub startup: Duration,
}

impl fmt::Display for StartTimings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "binaries {} ms, startup {} ms (credentials {} ms, etcd {} ms, kube-apiserver {} ms, \
             kube-controller-manager {} ms, kube-scheduler {} ms)",
            self.binaries.as_millis(),
            self.startup.as_millis(),
            self.credentials.as_millis(),
            self.etcd.as_millis(),
            self.kube_apiserver.as_millis(),
            self.kube_controller_manager.as_millis(),
            self.kube_scheduler.as_millis(),
        )
    }
}

/// A running loopback control plane: etcd, kube-apiserver, kube-controller-manager (all
/// controllers but `node-lifecycle-controller`, so Nodes without a kubelet stay schedulable) and
/// kube-scheduler, all in one temporary directory.
///
/// # Teardown
///
/// [`ControlPlane::stop`] terminates the components gracefully. Dropping a `ControlPlane`
/// (including during a panic) SIGKILLs and reaps every component. Every component also gets
/// `PR_SET_PDEATHSIG=SIGKILL`, so it dies if the test process is killed outright. Linux sends
/// that signal when the *thread* that spawned the child exits, so call [`ControlPlane::start`]
/// from the thread that owns the control plane for its whole life: the test function's own
/// thread (`#[tokio::test]`'s default current-thread runtime), never a `spawn_blocking` or a
/// short-lived thread. One control plane per test function.
pub struct ControlPlane {
    // Field order matters: the processes die before the directory holding etcd's data goes.
    processes: Processes,
    dir: tempfile::TempDir,
    keep_temp_dir: bool,
    server_url: String,
    ca_pem: String,
    admin_kubeconfig: PathBuf,
    certificate_user_kubeconfig: PathBuf,
    timings: StartTimings,
    pod_endpoint: Option<(std::net::IpAddr, u16)>,
}

impl fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ControlPlane")
            .field("server_url", &self.server_url)
            .field("dir", &self.dir.path())
            .field("pids", &self.pids())
            .finish_non_exhaustive()
    }
}

impl ControlPlane {
    /// Builds (or finds cached) binaries, then starts etcd, kube-apiserver,
    /// kube-controller-manager and kube-scheduler in that order, each after the previous is ready.
    ///
    /// The build script's progress is streamed to stderr. Timings are printed to stderr and kept
    /// in [`ControlPlane::timings`].
    ///
    /// # Errors
    ///
    /// Fails when the binaries cannot be built, credentials or files cannot be written, or a
    /// component fails to spawn, exits, or is not ready within
    /// [`ControlPlaneOptions::ready_timeout`]; the last two quote the tail of its log. Anything
    /// started before the failure is killed before this returns.
    pub async fn start(options: ControlPlaneOptions) -> Result<ControlPlane, Error> {
        let began = Instant::now();
        let bin_dir = build_binaries().await?;
        let binaries = began.elapsed();

        let startup_began = Instant::now();
        let mut builder = tempfile::Builder::new();
        builder.prefix("drust-controlplane-");
        builder.disable_cleanup(options.keep_temp_dir);
        let dir = builder
            .tempdir()
            .map_err(|source| Error::CreateTempDir { source })?;
        if options.keep_temp_dir {
            eprintln!(
                "control plane: keeping {} ({KEEP_ENV}=1)",
                dir.path().display()
            );
        }
        let root = dir.path();

        let apiserver_port = free_port()?;
        let server_url = format!("https://127.0.0.1:{apiserver_port}");
        let credentials = Credentials::generate(options.pod_address)?;
        let files = credentials.write(root, &server_url)?;
        let credentials_time = startup_began.elapsed();

        let mut processes = Processes::default();
        let feature_gates = feature_gates_flag(&options.feature_gates);

        // etcd
        let client_port = free_port()?;
        let peer_port = free_port()?;
        let etcd_client_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let etcd = processes.spawn(
            Component::Etcd,
            &bin_dir,
            root,
            [
                "--name=default".to_owned(),
                flag("data-dir", root.join("etcd")),
                format!("--listen-client-urls={etcd_client_url}"),
                format!("--advertise-client-urls={etcd_client_url}"),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--initial-cluster=default={peer_url}"),
                // Throwaway data: fsync only slows every test down.
                "--unsafe-no-fsync=true".to_owned(),
            ],
        )?;
        let etcd_time = processes
            .wait_ready(etcd, options.ready_timeout, || {
                etcd_healthy(SocketAddr::from((Ipv4Addr::LOCALHOST, client_port)))
            })
            .await?;

        // kube-apiserver
        let mut args = vec![
            format!("--etcd-servers={etcd_client_url}"),
            format!("--secure-port={apiserver_port}"),
            format!(
                "--bind-address={}",
                if options.pod_address.is_some() {
                    "0.0.0.0"
                } else {
                    "127.0.0.1"
                }
            ),
            "--advertise-address=127.0.0.1".to_owned(),
            // The endpoints of Service `kubernetes` would be 127.0.0.1, which Endpoints
            // validation rejects (loopback), so the reconciler would log an error every few
            // seconds. Nothing runs in a Pod here to use that Service.
            "--endpoint-reconciler-type=none".to_owned(),
            flag("cert-dir", root.join("apiserver-certs")),
            flag("tls-cert-file", &files.serving_cert),
            flag("tls-private-key-file", &files.serving_key),
            flag("client-ca-file", &files.ca_cert),
            flag("token-auth-file", &files.tokens),
            "--authorization-mode=Node,RBAC".to_owned(),
            format!("--service-account-issuer={SERVICE_ACCOUNT_ISSUER}"),
            flag("service-account-key-file", &files.sa_public_key),
            flag("service-account-signing-key-file", &files.sa_private_key),
            format!("--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}"),
            "--allow-privileged=true".to_owned(),
        ];
        if !options.runtime_config.is_empty() {
            args.push(format!(
                "--runtime-config={}",
                options.runtime_config.join(",")
            ));
        }
        args.extend(feature_gates.clone());
        args.extend(options.apiserver_args.iter().cloned());
        let apiserver = processes.spawn(Component::KubeApiserver, &bin_dir, root, args)?;
        let admin_config = load_config(&files.admin_kubeconfig).await?;
        let admin = client_for(admin_config.clone())?;
        let apiserver_time = processes
            .wait_ready(apiserver, options.ready_timeout, || readyz(admin.clone()))
            .await?;

        // kube-controller-manager and kube-scheduler start together; both only need the
        // apiserver.
        let mut args = vec![
            flag("kubeconfig", &files.controller_manager_kubeconfig),
            "--leader-elect=false".to_owned(),
            // A Node without a kubelet never renews its lease; the node lifecycle controller
            // would mark it NotReady and taint it. The name is from
            // cmd/kube-controller-manager/names/controller_names.go.
            "--controllers=*,-node-lifecycle-controller".to_owned(),
            flag("service-account-private-key-file", &files.sa_private_key),
            flag("root-ca-file", &files.ca_cert),
            "--secure-port=0".to_owned(),
        ];
        args.extend(feature_gates.clone());
        args.extend(options.controller_manager_args.iter().cloned());
        let controller_manager =
            processes.spawn(Component::KubeControllerManager, &bin_dir, root, args)?;

        let scheduler_port = free_port()?;
        let mut args = vec![
            flag("kubeconfig", &files.scheduler_kubeconfig),
            "--leader-elect=false".to_owned(),
            // The secure port serves the scheduler's /readyz, the readiness signal.
            "--bind-address=127.0.0.1".to_owned(),
            format!("--secure-port={scheduler_port}"),
            flag("tls-cert-file", &files.serving_cert),
            flag("tls-private-key-file", &files.serving_key),
        ];
        args.extend(feature_gates);
        args.extend(options.scheduler_args.iter().cloned());
        let scheduler = processes.spawn(Component::KubeScheduler, &bin_dir, root, args)?;

        // The ServiceAccount controller creates `default` in every namespace; the
        // ServiceAccount admission plugin rejects Pods in `default` until it exists.
        let service_accounts: Api<ServiceAccount> = Api::namespaced(admin.clone(), "default");
        let controller_manager_time = processes
            .wait_ready(controller_manager, options.ready_timeout, || {
                default_service_account_exists(service_accounts.clone())
            })
            .await?;

        // The scheduler's /readyz includes `sched-handler-sync`, which passes once its informers
        // have synced and their handlers saw the initial lists; scheduling starts right after
        // (cmd/kube-scheduler/app/server.go). /readyz is always allowed for anonymous users.
        let mut anonymous = admin_config;
        anonymous.cluster_url = uri(&format!("https://127.0.0.1:{scheduler_port}"))?;
        anonymous.auth_info = kube::config::AuthInfo::default();
        let scheduler_client = client_for(anonymous)?;
        let scheduler_time = processes
            .wait_ready(scheduler, options.ready_timeout, || {
                readyz(scheduler_client.clone())
            })
            .await?;

        let timings = StartTimings {
            binaries,
            credentials: credentials_time,
            etcd: etcd_time,
            kube_apiserver: apiserver_time,
            kube_controller_manager: controller_manager_time,
            kube_scheduler: scheduler_time,
            startup: startup_began.elapsed(),
        };
        tracing::info!(%timings, server = %server_url, "control plane ready");
        eprintln!("control plane ready at {server_url}: {timings}");

        Ok(ControlPlane {
            processes,
            dir,
            keep_temp_dir: options.keep_temp_dir,
            server_url,
            ca_pem: credentials.ca_pem,
            admin_kubeconfig: files.admin_kubeconfig,
            certificate_user_kubeconfig: files.certificate_user_kubeconfig,
            timings,
            pod_endpoint: options.pod_address.map(|a| (a, apiserver_port)),
        })
    }

    /// Stops the components in reverse start order: SIGTERM to kube-scheduler,
    /// kube-controller-manager and kube-apiserver, then etcd once they are gone; each gets 10 s
    /// before SIGKILL. Every process is reaped before this returns.
    ///
    /// # Errors
    ///
    /// [`Error::WatchComponent`] when a process cannot be signalled or waited for; the remaining
    /// processes are still killed (by drop).
    pub async fn stop(mut self) -> Result<(), Error> {
        self.processes.stop(Duration::from_secs(10)).await?;
        if self.keep_temp_dir {
            eprintln!("control plane stopped; kept {}", self.dir.path().display());
        }
        Ok(())
    }

    /// The kube-apiserver URL, `https://127.0.0.1:<port>`.
    pub fn server_url(&self) -> &str {
        &self.server_url
    }

    /// Where pods reach kube-apiserver (address, port), when started with
    /// [`ControlPlaneOptions::pod_address`].
    pub fn pod_endpoint(&self) -> Option<(std::net::IpAddr, u16)> {
        self.pod_endpoint
    }

    /// The PEM of the CA that signed the apiserver's serving certificate.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The admin kubeconfig (user `admin`, group `system:masters`, bearer token, CA data).
    pub fn kubeconfig_path(&self) -> &Path {
        &self.admin_kubeconfig
    }

    /// A kubeconfig of user [`CERTIFICATE_USER`], who authenticates with a client certificate
    /// signed by the cluster's CA and holds no bearer token; no role is bound to it.
    pub fn certificate_user_kubeconfig_path(&self) -> &Path {
        &self.certificate_user_kubeconfig
    }

    /// The temporary directory holding certificates, kubeconfigs, etcd data and logs.
    pub fn temp_dir(&self) -> &Path {
        self.dir.path()
    }

    /// Where `component` writes its stdout and stderr.
    pub fn log_path(&self, component: Component) -> PathBuf {
        log_path(self.dir.path(), component)
    }

    /// Process ids of the components, in start order.
    pub fn pids(&self) -> Vec<(Component, u32)> {
        self.processes
            .0
            .iter()
            .map(|p| (p.component, p.child.id()))
            .collect()
    }

    /// How long [`ControlPlane::start`] took.
    pub fn timings(&self) -> StartTimings {
        self.timings
    }

    /// A client acting as the admin (group `system:masters`), loaded from
    /// [`ControlPlane::kubeconfig_path`].
    ///
    /// # Errors
    ///
    /// [`Error::LoadKubeconfig`] or [`Error::BuildClient`].
    pub async fn client(&self) -> Result<kube::Client, Error> {
        client_for(load_config(&self.admin_kubeconfig).await?)
    }

    /// Writes a kubeconfig for this control plane that authenticates with `token` (for example
    /// one from [`ControlPlane::service_account_token`]) and trusts the CA by embedded data.
    ///
    /// # Errors
    ///
    /// [`Error::RenderKubeconfig`] or [`Error::WriteFile`].
    pub fn write_kubeconfig(&self, path: &Path, token: &str) -> Result<(), Error> {
        write_kubeconfig(path, &self.server_url, &self.ca_pem, "user", token)
    }

    /// Issues a token for ServiceAccount `namespace/name` through the TokenRequest API (default
    /// audience, one hour). The ServiceAccount must exist.
    ///
    /// # Errors
    ///
    /// [`Error::LoadKubeconfig`], [`Error::BuildClient`], [`Error::RequestToken`] or
    /// [`Error::TokenMissing`].
    pub async fn service_account_token(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<String, Error> {
        self.request_token(namespace, name, None).await
    }

    /// Issues a token for ServiceAccount `namespace/name` bound to the Pod `pod_name` (uid
    /// `pod_uid`) in the same namespace, as the kubelet's projected token of that Pod is. When
    /// the Pod is on a node, the API server adds the node's name and UID to the token
    /// (ServiceAccountTokenPodNodeInfo, GA) and the authenticated user's extra then carries
    /// `authentication.kubernetes.io/node-name`. The token is valid while the Pod exists.
    ///
    /// # Errors
    ///
    /// As [`ControlPlane::service_account_token`]; the API server refuses a Pod that does not
    /// exist, has another UID or runs as another ServiceAccount.
    pub async fn pod_bound_service_account_token(
        &self,
        namespace: &str,
        name: &str,
        pod_name: &str,
        pod_uid: &str,
    ) -> Result<String, Error> {
        self.request_token(namespace, name, Some((pod_name, pod_uid)))
            .await
    }

    async fn request_token(
        &self,
        namespace: &str,
        name: &str,
        pod: Option<(&str, &str)>,
    ) -> Result<String, Error> {
        let api: Api<ServiceAccount> = Api::namespaced(self.client().await?, namespace);
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                expiration_seconds: Some(3600),
                bound_object_ref: pod.map(|(pod_name, pod_uid)| BoundObjectReference {
                    api_version: Some("v1".to_owned()),
                    kind: Some("Pod".to_owned()),
                    name: Some(pod_name.to_owned()),
                    uid: Some(pod_uid.to_owned()),
                }),
                ..TokenRequestSpec::default()
            }),
            ..TokenRequest::default()
        };
        let response = api
            .create_token_request(name, &PostParams::default(), &request)
            .await
            .map_err(|source| Error::RequestToken {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                source,
            })?;
        response
            .status
            .and_then(|s| s.token)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| Error::TokenMissing {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
            })
    }

    /// Registers a Node that no kubelet backs, and makes it schedulable for the real scheduler.
    ///
    /// Creates the Node with `labels` (plus `kubernetes.io/hostname` and `kubernetes.io/os`,
    /// which `labels` may override), removes the `node.kubernetes.io/not-ready` taint that the
    /// `TaintNodesByCondition` admission plugin adds on create, and sets its status: condition
    /// `Ready=True`, capacity and allocatable of 16 cpu, 64Gi memory and 110 pods. With the node
    /// lifecycle controller off, nothing marks it NotReady later.
    ///
    /// # Errors
    ///
    /// [`Error::RegisterNode`] naming the failed request, or a client error.
    pub async fn register_node(&self, name: &str, labels: &[(&str, &str)]) -> Result<Node, Error> {
        let nodes: Api<Node> = Api::all(self.client().await?);
        let mut all_labels = BTreeMap::from([
            ("kubernetes.io/hostname".to_owned(), name.to_owned()),
            ("kubernetes.io/os".to_owned(), "linux".to_owned()),
        ]);
        all_labels.extend(
            labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
        );
        let node = Node {
            metadata: kube::api::ObjectMeta {
                name: Some(name.to_owned()),
                labels: Some(all_labels),
                ..Default::default()
            },
            ..Node::default()
        };
        let step_error = |step: &'static str| {
            move |source| Error::RegisterNode {
                node: name.to_owned(),
                step,
                source,
            }
        };
        nodes
            .create(&PostParams::default(), &node)
            .await
            .map_err(step_error("create"))?;
        // A JSON merge patch replaces the whole list; null removes it.
        nodes
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({ "spec": { "taints": null } })),
            )
            .await
            .map_err(step_error("remove the not-ready taint"))?;
        let resources = serde_json::json!({ "cpu": "16", "memory": "64Gi", "pods": "110" });
        let status = serde_json::json!({
            "status": {
                "capacity": resources,
                "allocatable": resources,
                "conditions": [{
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "registered by the drust e2e harness; no kubelet runs",
                }],
                "addresses": [
                    { "type": "InternalIP", "address": "127.0.0.1" },
                    { "type": "Hostname", "address": name },
                ],
            }
        });
        nodes
            .patch_status(name, &PatchParams::default(), &Patch::Merge(status))
            .await
            .map_err(step_error("set status"))
    }
}

/// Runs the build script, streaming its progress (stderr) through, and returns the directory
/// named on the last line of its stdout.
/// Runs [`BUILD_SCRIPT`], which builds the version `DRUST_K8S` selects (refused here first
/// when unknown).
async fn build_binaries() -> Result<PathBuf, Error> {
    KubernetesVersion::from_env()?;
    let script = PathBuf::from(BUILD_SCRIPT);
    let printed = crate::scripts::last_line(&script, &[]).await?;
    let dir = PathBuf::from(&printed);
    for component in [
        Component::Etcd,
        Component::KubeApiserver,
        Component::KubeControllerManager,
        Component::KubeScheduler,
    ] {
        if !dir.join(component.binary_name()).is_file() {
            return Err(Error::BinariesMissing {
                script,
                printed,
                missing: component.binary_name(),
            });
        }
    }
    Ok(dir)
}

fn flag(name: &str, path: impl AsRef<Path>) -> String {
    format!("--{name}={}", path.as_ref().display())
}

fn feature_gates_flag(gates: &BTreeMap<String, bool>) -> Option<String> {
    if gates.is_empty() {
        return None;
    }
    let list: Vec<String> = gates.iter().map(|(k, v)| format!("{k}={v}")).collect();
    Some(format!("--feature-gates={}", list.join(",")))
}

/// This machine's first IPv4 address outside loopback on an interface that is up (what a pod
/// on the node's bridge network can reach the host at), for [`ControlPlaneOptions::pod_address`].
pub fn host_address() -> Option<std::net::IpAddr> {
    nix::ifaddrs::getifaddrs()
        .ok()?
        .filter(|i| {
            i.flags.contains(nix::net::if_::InterfaceFlags::IFF_UP)
                && !i
                    .flags
                    .contains(nix::net::if_::InterfaceFlags::IFF_LOOPBACK)
        })
        .find_map(|i| {
            let a = i.address?.as_sockaddr_in()?.ip();
            (!a.is_loopback() && !a.is_link_local()).then_some(std::net::IpAddr::V4(a))
        })
}

/// A port for a component; see [`crate::ports`] for why it is not the kernel's pick.
fn free_port() -> Result<u16, Error> {
    crate::ports::free_port().map_err(|source| Error::PickPort { source })
}

async fn load_config(path: &Path) -> Result<kube::Config, Error> {
    let load_err = |source| Error::LoadKubeconfig {
        path: path.to_owned(),
        source,
    };
    let kubeconfig = Kubeconfig::read_from(path).map_err(load_err)?;
    kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(load_err)
}

fn client_for(mut config: kube::Config) -> Result<kube::Client, Error> {
    // Probes must fail fast rather than hang on a component that is still starting.
    config.connect_timeout = Some(PROBE_TIMEOUT);
    let server = config.cluster_url.to_string();
    kube::Client::try_from(config).map_err(|source| Error::BuildClient { server, source })
}

fn uri(url: &str) -> Result<http::Uri, Error> {
    url.parse().map_err(|source| Error::ParseUrl {
        url: url.to_owned(),
        source,
    })
}

/// etcd's `/health` over plain HTTP/1.0, which needs no client library.
async fn etcd_healthy(addr: SocketAddr) -> Result<(), String> {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect {addr}: {e}"))?;
    stream
        .write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .map_err(|e| format!("send to {addr}: {e}"))?;
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .await
        .map_err(|e| format!("read from {addr}: {e}"))?;
    let response = String::from_utf8_lossy(&response);
    if response.contains(r#""health":"true""#) {
        Ok(())
    } else {
        Err(response.lines().last().unwrap_or("").to_owned())
    }
}

async fn readyz(client: kube::Client) -> Result<(), String> {
    let request = http::Request::get("/readyz")
        .body(Vec::new())
        .map_err(|e| e.to_string())?;
    match client.request_text(request).await {
        Ok(body) if body.trim() == "ok" => Ok(()),
        Ok(body) => Err(body),
        Err(e) => Err(e.to_string()),
    }
}

async fn default_service_account_exists(api: Api<ServiceAccount>) -> Result<(), String> {
    match api.get_opt("default").await {
        Ok(Some(_)) => Ok(()),
        Ok(None) => Err("ServiceAccount default/default not created yet".to_owned()),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn feature_gates_are_one_flag_sorted_by_name() {
        let gates = BTreeMap::from([
            ("DRADeviceTaints".to_owned(), true),
            ("DRAConsumableCapacity".to_owned(), false),
        ]);
        assert_eq!(
            feature_gates_flag(&gates).as_deref(),
            Some("--feature-gates=DRAConsumableCapacity=false,DRADeviceTaints=true")
        );
        assert_eq!(feature_gates_flag(&BTreeMap::new()), None);
    }
}
