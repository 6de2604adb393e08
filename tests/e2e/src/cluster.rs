//! One control plane with several nodes: real ones (kubelet, containerd and the GPU plugin
//! binary each, side by side on this machine) and paper ones (a Node object whose
//! ResourceSlices the plugin binary publishes from a fake topology, and no kubelet: the real
//! scheduler binds pods there and they never run, as in upstream's
//! `test/integration/scheduler_perf`).
//!
//! ```no_run
//! # async fn example() -> Result<(), drust_e2e::cluster::ClusterError> {
//! use drust_e2e::cluster::{Cluster, ClusterOptions, NodeGroup};
//!
//! let cluster = Cluster::start(
//!     ClusterOptions::default()
//!         .real(NodeGroup::new("gpu-", 2, "examples/topologies/dgx-h100.yaml")
//!             .label("nvlink-domain", "a"))
//!         .paper(NodeGroup::new("paper-", 16, "examples/topologies/pcie-l40s.yaml")),
//! )
//! .await?;
//! // gpu-0 and gpu-1 run pods; paper-0 .. paper-15 get them bound.
//! cluster.stop().await?;
//! # Ok(())
//! # }
//! ```
//!
//! Every node's plugin is the `gpu-kubelet-plugin` binary with the flags a real node's has
//! ([`BinaryHost::command`], `--fake-state-dir`) plus the group's own: a paper node's differs
//! only in having no kubelet to register with (its sockets live in its own temp dir, and no
//! PodResources socket). What the scheduler sees is drust's own publishing, never slices the
//! test wrote.
//!
//! Real nodes share one [`Machine`] (its lock: no other real node runs on this machine
//! meanwhile); the `i`-th real node gets [`NodeOptions::numbered`]`(i)`: bridge `drustbr<i>`,
//! pods in `10.88.<77 + i>.0/24`, cgroup root `/drust-node<i>`. The bridges are gateways on this
//! host, which forwards between them, so pods on different real nodes reach each other.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::Api;
use kube::api::ListParams;

use crate::host::{BinaryHost, HostError, PluginProcess};
use crate::manifests::{ManifestError, apply_file, repo_path};
use crate::node::{Machine, Node, NodeError, NodeOptions};
use crate::procstat::{ProcessUsage, pids_named};
use crate::{ControlPlane, ControlPlaneOptions};

/// The driver every node's plugin publishes as (the DeviceClasses' driver).
pub const DRIVER: &str = "gpu.drust.dev";

/// How long [`Cluster::start`] waits for every node's pool to be complete in the API server.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(300);

/// Starting, running or stopping a [`Cluster`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The control plane failed to start, or a client or call of it failed.
    #[error("control plane")]
    ControlPlane(#[from] crate::Error),
    /// The DeviceClasses of `deploy/deviceclasses` could not be applied.
    #[error("applying the DeviceClasses")]
    DeviceClasses(#[source] ManifestError),
    /// A real node failed to start or stop ([`NodeError::Unsupported`]: this machine cannot
    /// run one).
    #[error("real node {node}")]
    Node {
        /// The node.
        node: String,
        /// Why.
        source: NodeError,
    },
    /// The fake GPU host of a node's plugin could not be laid out.
    #[error("the plugin's host for node {node}")]
    Host {
        /// The node.
        node: String,
        /// Why.
        source: HostError,
    },
    /// A node's plugin could not be started.
    #[error("starting the plugin for node {node}")]
    SpawnPlugin {
        /// The node.
        node: String,
        /// Why.
        source: std::io::Error,
    },
    /// A node's plugin exited while the cluster started.
    #[error("the plugin for node {node} exited ({status}); last lines of {log}:\n{log_tail}")]
    PluginExited {
        /// The node.
        node: String,
        /// How it exited.
        status: std::process::ExitStatus,
        /// Its log file.
        log: PathBuf,
        /// The last lines of its log.
        log_tail: String,
    },
    /// Not every node's pool was complete in the API server in time.
    #[error("pools not published after {waited:?}: {missing:?}")]
    NotPublished {
        /// How long [`Cluster::start`] waited.
        waited: Duration,
        /// The nodes whose pool was missing or incomplete.
        missing: Vec<String>,
    },
    /// Listing ResourceSlices failed.
    #[error("listing ResourceSlices")]
    ListSlices(#[source] kube::Error),
}

/// `count` nodes alike: named `<prefix><i>` (`i` from 0), each on the fake GPU topology
/// `topology`, with node labels `labels`, their plugin given `plugin_args` besides the usual
/// flags.
#[derive(Debug, Clone)]
pub struct NodeGroup {
    /// Node names are this followed by the node's index in the group.
    pub prefix: String,
    /// How many nodes.
    pub count: usize,
    /// The fake topology file (see `examples/topologies/`): absolute, or relative to the
    /// repository root.
    pub topology: PathBuf,
    /// Node labels (a real node's kubelet sets them at registration).
    pub labels: BTreeMap<String, String>,
    /// Flags added to each node's plugin command (`--mig-strategy partitionable`, ...).
    pub plugin_args: Vec<String>,
    /// The kubelet's feature gates (real nodes only).
    pub kubelet_feature_gates: BTreeMap<String, bool>,
    /// Give each plugin a `/proc/devices` with the IMEX channels' line ([`FAKE_IMEX_MAJOR`]),
    /// so it publishes IMEX channel 0.
    pub imex_channels: bool,
}

/// The major of `nvidia-caps-imex-channels` in the `/proc/devices` of a group with
/// [`NodeGroup::imex_channels`] (NVIDIA's and its test infrastructure's choice; free on hosts
/// without the NVIDIA driver).
pub const FAKE_IMEX_MAJOR: u32 = 235;

impl NodeGroup {
    /// `count` nodes named `<prefix><i>` on `topology`, no labels, no extra flags.
    pub fn new(prefix: &str, count: usize, topology: impl AsRef<Path>) -> Self {
        Self {
            prefix: prefix.to_owned(),
            count,
            topology: repo_path("").join(topology),
            labels: BTreeMap::new(),
            plugin_args: Vec::new(),
            kubelet_feature_gates: BTreeMap::new(),
            imex_channels: false,
        }
    }

    /// With IMEX channels: each plugin reads a `/proc/devices` that is the host's plus
    /// `235 nvidia-caps-imex-channels` ([`FAKE_IMEX_MAJOR`]), and so publishes `imex-channel-0`.
    /// On a real node the runtime makes the channel's node in containers from the CDI spec
    /// (opening it fails with ENXIO: no driver backs the major).
    #[must_use]
    pub fn imex_channels(mut self) -> Self {
        self.imex_channels = true;
        self
    }

    /// With node label `key=value`.
    #[must_use]
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.to_owned(), value.to_owned());
        self
    }

    /// With `args` added to each plugin's command line.
    #[must_use]
    pub fn plugin_args(mut self, args: &[&str]) -> Self {
        self.plugin_args
            .extend(args.iter().map(|a| (*a).to_owned()));
        self
    }

    /// With the kubelet's feature gate `name` set to `on` (real nodes only).
    #[must_use]
    pub fn kubelet_feature_gate(mut self, name: &str, on: bool) -> Self {
        self.kubelet_feature_gates.insert(name.to_owned(), on);
        self
    }

    /// The group's node names, in index order.
    pub fn names(&self) -> Vec<String> {
        (0..self.count)
            .map(|i| format!("{}{i}", self.prefix))
            .collect()
    }
}

/// How to start a [`Cluster`].
#[derive(Debug, Clone, Default)]
pub struct ClusterOptions {
    /// The control plane's options.
    pub control_plane: ControlPlaneOptions,
    /// Real nodes, group by group.
    pub real: Vec<NodeGroup>,
    /// Paper nodes, group by group.
    pub paper: Vec<NodeGroup>,
    /// Leave out the DeviceClasses of `deploy/deviceclasses` (applied by default, as the chart
    /// installs them), for a test that installs the chart itself.
    pub without_device_classes: bool,
}

impl ClusterOptions {
    /// With the real nodes of `group` added.
    #[must_use]
    pub fn real(mut self, group: NodeGroup) -> Self {
        self.real.push(group);
        self
    }

    /// With the paper nodes of `group` added.
    #[must_use]
    pub fn paper(mut self, group: NodeGroup) -> Self {
        self.paper.push(group);
        self
    }
}

/// A real node of a [`Cluster`]: the kubelet and containerd ([`Node`]) and the plugin binary
/// serving that kubelet on its fake GPUs (mknod'ed device nodes, so containers get them).
pub struct RealNode {
    plugin: PluginProcess,
    host: BinaryHost,
    node: Node,
}

impl RealNode {
    /// The node's name.
    pub fn name(&self) -> &str {
        self.node.name()
    }

    /// The kubelet and containerd.
    pub fn node(&self) -> &Node {
        &self.node
    }

    /// The kubelet and containerd, to restart the kubelet.
    pub fn node_mut(&mut self) -> &mut Node {
        &mut self.node
    }

    /// The plugin's fake GPU host (CDI root, plugin dir with its checkpoint, state dir).
    pub fn host(&self) -> &BinaryHost {
        &self.host
    }

    /// The plugin's process ID.
    pub fn plugin_pid(&self) -> u32 {
        self.plugin.id()
    }

    /// The plugin's log file.
    pub fn plugin_log(&self) -> PathBuf {
        self.host.root().join("plugin.log")
    }

    /// What the node's processes hold and have spent: the kubelet, containerd, the plugin and
    /// containerd's shims (one per pod).
    pub fn usage(&self) -> NodeUsage {
        let shims = pids_named("containerd-shim", &self.node.root().to_string_lossy());
        NodeUsage {
            node: self.name().to_owned(),
            paper: false,
            parts: vec![
                ("kubelet", ProcessUsage::of_all(self.node.kubelet_pid())),
                (
                    "containerd",
                    ProcessUsage::of_all(self.node.containerd_pid()),
                ),
                ("plugin", ProcessUsage::of_all([self.plugin_pid()])),
                ("shims", ProcessUsage::of_all(shims)),
            ],
        }
    }
}

/// A paper node of a [`Cluster`]: its Node object (Ready, never heartbeating: the test control
/// plane runs no node-lifecycle controller) and the plugin binary publishing its pool.
pub struct PaperNode {
    name: String,
    plugin: PluginProcess,
    host: BinaryHost,
}

impl PaperNode {
    /// The node's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The plugin's fake GPU host.
    pub fn host(&self) -> &BinaryHost {
        &self.host
    }

    /// The plugin's process ID.
    pub fn plugin_pid(&self) -> u32 {
        self.plugin.id()
    }

    /// The plugin's log file.
    pub fn plugin_log(&self) -> PathBuf {
        self.host.root().join("plugin.log")
    }

    /// What the node costs: its plugin process.
    pub fn usage(&self) -> NodeUsage {
        NodeUsage {
            node: self.name.clone(),
            paper: true,
            parts: vec![("plugin", ProcessUsage::of_all([self.plugin_pid()]))],
        }
    }
}

/// One node's processes, each part by role.
#[derive(Debug, Clone)]
pub struct NodeUsage {
    /// The node.
    pub node: String,
    /// Whether it is a paper node.
    pub paper: bool,
    /// `("kubelet" | "containerd" | "plugin" | "shims", usage)`.
    pub parts: Vec<(&'static str, ProcessUsage)>,
}

impl NodeUsage {
    /// The sum of the parts.
    pub fn total(&self) -> ProcessUsage {
        self.parts
            .iter()
            .fold(ProcessUsage::default(), |a, (_, u)| a + *u)
    }

    /// The usage of part `role`, if the node has it.
    pub fn part(&self, role: &str) -> Option<ProcessUsage> {
        self.parts.iter().find(|(r, _)| *r == role).map(|(_, u)| *u)
    }
}

/// A control plane with real and paper nodes, every pool published.
pub struct Cluster {
    paper: Vec<PaperNode>,
    real: Vec<RealNode>,
    client: kube::Client,
    cp: ControlPlane,
}

impl Cluster {
    /// Starts the control plane, applies the DeviceClasses, registers the paper nodes and
    /// starts their plugins, starts the real nodes (side by side) and their plugins, and waits
    /// (up to 5 minutes) until every node's pool is complete in the API server.
    ///
    /// Real nodes take this machine's node lock first ([`Machine::acquire`], which also
    /// installs missing packages), before anything else starts.
    ///
    /// # Errors
    /// [`ClusterError`] naming the node or step that failed; a real node's
    /// [`NodeError::Unsupported`] when this machine cannot run one.
    pub async fn start(options: ClusterOptions) -> Result<Self, ClusterError> {
        let machine = if options.real.iter().any(|g| g.count > 0) {
            let first = options.real[0]
                .names()
                .into_iter()
                .next()
                .unwrap_or_default();
            Some(
                Machine::acquire()
                    .await
                    .map_err(|source| ClusterError::Node {
                        node: first,
                        source,
                    })?,
            )
        } else {
            None
        };
        let cp = ControlPlane::start(options.control_plane.clone()).await?;
        let client = cp.client().await?;
        if !options.without_device_classes {
            apply_device_classes(&client).await?;
        }

        let mut paper = Vec::new();
        for group in &options.paper {
            for name in group.names() {
                let labels: Vec<(&str, &str)> = group
                    .labels
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect();
                cp.register_node(&name, &labels).await?;
                let host = plugin_host(&cp, group, &name)?;
                let plugin = spawn_plugin(&host, group)?;
                paper.push(PaperNode { name, plugin, host });
            }
        }

        let mut real = Vec::new();
        if let Some(machine) = &machine {
            let mut starts = Vec::new();
            let mut index = 0u8;
            for group in &options.real {
                for name in group.names() {
                    let mut node_options = NodeOptions::numbered(index);
                    node_options.labels = group.labels.clone();
                    node_options.feature_gates = group.kubelet_feature_gates.clone();
                    index += 1;
                    let cp = &cp;
                    starts.push(async move {
                        Node::start_on(machine, cp, &name, node_options)
                            .await
                            .map(|node| (group, node))
                            .map_err(|source| ClusterError::Node { node: name, source })
                    });
                }
            }
            for (group, node) in futures::future::try_join_all(starts).await? {
                let name = node.name().to_owned();
                let host = plugin_host(&cp, group, &name)?.on_node(&node);
                host.make_device_nodes()
                    .map_err(|source| ClusterError::Host {
                        node: name.clone(),
                        source,
                    })?;
                let plugin = spawn_plugin(&host, group)?;
                real.push(RealNode { plugin, host, node });
            }
        }

        let mut cluster = Self {
            paper,
            real,
            client,
            cp,
        };
        cluster.wait_published(PUBLISH_TIMEOUT).await?;
        Ok(cluster)
    }

    /// The control plane.
    pub fn cp(&self) -> &ControlPlane {
        &self.cp
    }

    /// An admin client of the control plane.
    pub fn client(&self) -> &kube::Client {
        &self.client
    }

    /// The real nodes, in the order of their groups and indices.
    pub fn real_nodes(&self) -> &[RealNode] {
        &self.real
    }

    /// The real nodes, to restart a kubelet.
    pub fn real_nodes_mut(&mut self) -> &mut [RealNode] {
        &mut self.real
    }

    /// The paper nodes, in the order of their groups and indices.
    pub fn paper_nodes(&self) -> &[PaperNode] {
        &self.paper
    }

    /// Real node `name`.
    pub fn real(&self, name: &str) -> Option<&RealNode> {
        self.real.iter().find(|n| n.name() == name)
    }

    /// Paper node `name`.
    pub fn paper(&self, name: &str) -> Option<&PaperNode> {
        self.paper.iter().find(|n| n.name() == name)
    }

    /// Every node's processes now: real nodes first.
    pub fn usage(&self) -> Vec<NodeUsage> {
        self.real
            .iter()
            .map(RealNode::usage)
            .chain(self.paper.iter().map(PaperNode::usage))
            .collect()
    }

    /// A tail of every real node's kubelet and containerd logs, for failure messages.
    pub fn log_tail(&self) -> String {
        self.real
            .iter()
            .map(|n| format!("=== {}\n{}", n.name(), n.node.log_tail()))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Waits until every node's pool is complete in the API server: the slices of its newest
    /// generation all there. Fails at once when a plugin exited.
    async fn wait_published(&mut self, timeout: Duration) -> Result<(), ClusterError> {
        let api: Api<ResourceSlice> = Api::all(self.client.clone());
        let params = ListParams::default().fields(&format!("spec.driver={DRIVER}"));
        let start = Instant::now();
        loop {
            let plugins = self
                .real
                .iter_mut()
                .map(|n| (n.node.name().to_owned(), &mut n.plugin, &n.host))
                .chain(
                    self.paper
                        .iter_mut()
                        .map(|n| (n.name.clone(), &mut n.plugin, &n.host)),
                );
            for (node, plugin, host) in plugins {
                if let Ok(Some(status)) = plugin.try_wait() {
                    let log = host.root().join("plugin.log");
                    return Err(ClusterError::PluginExited {
                        node,
                        status,
                        log_tail: tail(&log, 30),
                        log,
                    });
                }
            }
            let slices = api
                .list(&params)
                .await
                .map_err(ClusterError::ListSlices)?
                .items;
            let missing: Vec<String> = self
                .real
                .iter()
                .map(RealNode::name)
                .chain(self.paper.iter().map(PaperNode::name))
                .filter(|node| !pool_complete(&slices, node))
                .map(str::to_owned)
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(ClusterError::NotPublished {
                    waited: start.elapsed(),
                    missing,
                });
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Stops the paper nodes' plugins, the real nodes' plugins, the real nodes and the control
    /// plane, in that order.
    ///
    /// # Errors
    /// The first failure; everything is still stopped (what is left goes on drop).
    pub async fn stop(self) -> Result<(), ClusterError> {
        let Self {
            paper,
            real,
            client,
            cp,
        } = self;
        drop(client);
        let stops = paper.into_iter().map(|n| async move {
            let PaperNode { name, plugin, host } = n;
            let stopped = crate::host::stop(plugin)
                .await
                .map_err(|source| ClusterError::Host { node: name, source });
            drop(host);
            stopped
        });
        let paper_result = futures::future::join_all(stops).await;
        let mut result: Result<(), ClusterError> = paper_result.into_iter().collect();
        for n in real {
            let RealNode { plugin, host, node } = n;
            let name = node.name().to_owned();
            let stopped = crate::host::stop(plugin)
                .await
                .map_err(|source| ClusterError::Host {
                    node: name.clone(),
                    source,
                });
            drop(host);
            let node_stopped = node
                .stop()
                .await
                .map_err(|source| ClusterError::Node { node: name, source });
            result = result.and(stopped).and(node_stopped);
        }
        let cp_stopped = cp.stop().await.map_err(ClusterError::from);
        result.and(cp_stopped)
    }
}

/// Applies every DeviceClass file of `deploy/deviceclasses`, in name order.
async fn apply_device_classes(client: &kube::Client) -> Result<(), ClusterError> {
    let dir = repo_path("deploy/deviceclasses");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| {
            ClusterError::DeviceClasses(ManifestError {
                path: dir.clone(),
                document: 0,
                problem: e.to_string(),
            })
        })?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    for file in files {
        apply_file(client, &file)
            .await
            .map_err(ClusterError::DeviceClasses)?;
    }
    Ok(())
}

/// A fresh fake GPU host for node `name` of `group`.
fn plugin_host(
    cp: &ControlPlane,
    group: &NodeGroup,
    name: &str,
) -> Result<BinaryHost, ClusterError> {
    BinaryHost::new(
        "drust-cluster-plugin-",
        cp.kubeconfig_path(),
        &group.topology,
        DRIVER,
        name,
    )
    .map_err(|source| ClusterError::Host {
        node: name.to_owned(),
        source,
    })
}

/// Starts the plugin on `host` with the group's flags, logging to `<host>/plugin.log`.
fn spawn_plugin(host: &BinaryHost, group: &NodeGroup) -> Result<PluginProcess, ClusterError> {
    let node = host.node().to_owned();
    let mut cmd = host
        .command(&host.root().join("plugin.log"), None)
        .map_err(|source| ClusterError::Host {
            node: node.clone(),
            source,
        })?;
    cmd.arg("--fake-state-dir")
        .arg(host.state_dir())
        .args(&group.plugin_args);
    if group.imex_channels {
        let path = host.root().join("proc-devices");
        fake_proc_devices(&path).map_err(|source| ClusterError::SpawnPlugin {
            node: node.clone(),
            source,
        })?;
        cmd.arg(format!("--proc-devices={}", path.display()));
    }
    cmd.spawn()
        .map(PluginProcess)
        .map_err(|source| ClusterError::SpawnPlugin { node, source })
}

/// Writes at `path` this host's `/proc/devices` with the IMEX channels' line first among its
/// character devices (a table of that line alone where the host's cannot be read).
fn fake_proc_devices(path: &Path) -> std::io::Result<()> {
    let line = format!("{FAKE_IMEX_MAJOR} nvidia-caps-imex-channels\n");
    let host = std::fs::read_to_string("/proc/devices").unwrap_or_default();
    let text = if host.contains("Character devices:\n") {
        host.replacen(
            "Character devices:\n",
            &format!("Character devices:\n{line}"),
            1,
        )
    } else {
        format!("Character devices:\n{line}")
    };
    std::fs::write(path, text)
}

/// Whether `node`'s pool is complete among `slices`: every slice of its newest generation is
/// there (a pool published in several slices is created one slice at a time).
fn pool_complete(slices: &[ResourceSlice], node: &str) -> bool {
    let pool: Vec<&ResourceSlice> = slices
        .iter()
        .filter(|s| s.spec.pool.name == node && s.spec.node_name.as_deref() == Some(node))
        .collect();
    let Some(newest) = pool.iter().map(|s| s.spec.pool.generation).max() else {
        return false;
    };
    let current: Vec<_> = pool
        .iter()
        .filter(|s| s.spec.pool.generation == newest)
        .collect();
    current.first().is_some_and(|s| {
        usize::try_from(s.spec.pool.resource_slice_count).ok() == Some(current.len())
    })
}

/// The last `lines` lines of the file at `path` (empty when it cannot be read).
fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
