//! The node plugin, run in-process against a control plane with every host path in a temp dir.

use std::path::{Path, PathBuf};
use std::time::Duration;

use dra_kubelet::PluginSockets;
use gpu_kubelet_plugin::{Backend, Config};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, ListParams};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::controlplane::ControlPlane;

/// The in-process node plugin failed.
#[derive(Debug, thiserror::Error)]
#[error("node plugin: {problem}")]
pub struct PluginError {
    /// What happened.
    pub problem: String,
}

/// A running node plugin.
pub struct NodePlugin {
    config: Config,
    _dir: tempfile::TempDir,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), gpu_kubelet_plugin::Error>>>,
}

impl NodePlugin {
    /// Starts the plugin for `node` with the fake `topology`, driver `driver_name`, talking to
    /// `cp` with the admin kubeconfig. Plugin dir, registrar dir, CDI root and checkpoint live
    /// in a fresh temp dir.
    ///
    /// # Errors
    /// [`PluginError`] when the temp dir cannot be created.
    pub fn start(
        cp: &ControlPlane,
        driver_name: &str,
        node: &str,
        topology: &Path,
    ) -> Result<Self, PluginError> {
        Self::start_with(cp, driver_name, node, topology, |_| {})
    }

    /// [`NodePlugin::start`], letting `configure` adjust the configuration (MIG strategy,
    /// re-discovery interval, ...) before the plugin runs.
    ///
    /// # Errors
    /// [`PluginError`] when the temp dir cannot be created.
    pub fn start_with(
        cp: &ControlPlane,
        driver_name: &str,
        node: &str,
        topology: &Path,
        configure: impl FnOnce(&mut Config),
    ) -> Result<Self, PluginError> {
        let dir = tempfile::Builder::new()
            .prefix("drust-plugin-")
            .tempdir()
            .map_err(|e| PluginError {
                problem: format!("creating its temp dir: {e}"),
            })?;
        let mut config = Config::new(
            driver_name,
            node,
            Backend::Fake {
                topology: topology.to_owned(),
                state_dir: Some(dir.path().join("fake-gpu-state")),
            },
        );
        config.kubeconfig = Some(cp.kubeconfig_path().to_owned());
        config.sockets = PluginSockets {
            plugin_dir: dir.path().join("plugins").join(driver_name),
            registrar_dir: dir.path().join("plugins_registry"),
            instance_id: None,
        };
        config.checkpoint_path = config.sockets.plugin_dir.join("checkpoint.json");
        config.cdi_root = dir.path().join("cdi");
        config.mps_root = dir.path().join("mps");
        config.mps_control_binary = drust_fakes::mps_control().to_owned();
        config.dev_root = dir.path().to_owned();
        config.proc_root = dir.path().to_owned();
        config.boot_id_path = dir.path().join("boot_id");
        let problem = |e: String| PluginError { problem: e };
        fake_host(dir.path(), topology).map_err(problem)?;
        configure(&mut config);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(gpu_kubelet_plugin::run(config.clone(), async {
            let _ = stopped.await;
        }));
        Ok(Self {
            config,
            _dir: dir,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// The plugin's configuration (socket paths, CDI root, checkpoint).
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The fake backend's state dir (its usage files, MIG devices, health events), which
    /// every plugin this harness starts has.
    ///
    /// # Errors
    /// The plugin runs another backend, or the fake one without a state dir.
    pub fn fake_state_dir(&self) -> anyhow::Result<PathBuf> {
        match &self.config.backend {
            Backend::Fake {
                state_dir: Some(state),
                ..
            } => Ok(state.clone()),
            other => anyhow::bail!(
                "the e2e plugin runs the fake backend with a state dir, not {other:?}"
            ),
        }
    }

    /// Drops a health event for the fake backend into `<state_dir>/events/<seq>.json` (written
    /// under a temporary name and renamed, so the plugin never reads half a file). Events are
    /// consumed in `seq` order.
    ///
    /// # Errors
    /// [`PluginError`] when the plugin has no fake state dir or the file cannot be written.
    pub fn inject_health_event(
        &self,
        seq: u32,
        event: &gpu_inventory::HealthEvent,
    ) -> Result<(), PluginError> {
        let problem = |e: String| PluginError { problem: e };
        let Backend::Fake {
            state_dir: Some(state_dir),
            ..
        } = &self.config.backend
        else {
            return Err(problem("no fake state dir to inject events into".into()));
        };
        write_health_event(state_dir, seq, event).map_err(|e| problem(e.to_string()))
    }

    /// The DRA socket.
    pub fn dra_socket(&self) -> PathBuf {
        self.config.sockets.dra_socket()
    }

    /// The registration socket.
    pub fn registration_socket(&self) -> PathBuf {
        self.config
            .sockets
            .registration_socket(&self.config.driver_name)
    }

    /// Waits until the plugin serves its sockets and its pool is complete in the API server
    /// (every slice of its newest generation); returns the slices.
    ///
    /// # Errors
    /// [`PluginError`] when the plugin exits or does not get there within `timeout`.
    pub async fn wait_ready(
        &mut self,
        client: &kube::Client,
        timeout: Duration,
    ) -> Result<Vec<ResourceSlice>, PluginError> {
        let api: Api<ResourceSlice> = Api::all(client.clone());
        let params = ListParams::default().fields(&format!(
            "spec.nodeName={},spec.driver={}",
            self.config.node_name, self.config.driver_name
        ));
        let start = std::time::Instant::now();
        loop {
            if self.task.as_ref().is_some_and(JoinHandle::is_finished) {
                let outcome = match self.task.take() {
                    Some(task) => match task.await {
                        Ok(Ok(())) => "exited".to_owned(),
                        Ok(Err(e)) => format!("failed: {}", error_chain(&e)),
                        Err(e) => format!("panicked: {e}"),
                    },
                    None => "exited".to_owned(),
                };
                return Err(PluginError { problem: outcome });
            }
            if self.registration_socket().exists() {
                let slices = api.list(&params).await.map_err(|e| PluginError {
                    problem: format!("listing ResourceSlices: {e}"),
                })?;
                // Complete: every slice of the newest generation is there. A pool published in
                // several slices (a counter set beside its devices) is created one slice at a
                // time; a pod scheduled in between finds the pool incomplete.
                let newest = slices.items.iter().map(|s| s.spec.pool.generation).max();
                let current: Vec<_> = slices
                    .items
                    .iter()
                    .filter(|s| Some(s.spec.pool.generation) == newest)
                    .collect();
                let complete = current.first().is_some_and(|s| {
                    usize::try_from(s.spec.pool.resource_slice_count).ok() == Some(current.len())
                });
                if complete {
                    return Ok(slices.items);
                }
            }
            if start.elapsed() > timeout {
                return Err(PluginError {
                    problem: format!("not ready after {timeout:?}"),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops the plugin and waits for it.
    ///
    /// # Errors
    /// [`PluginError`] when it had failed.
    pub async fn stop(mut self) -> Result<(), PluginError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.task.take() {
            Some(task) => match task.await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(PluginError {
                    problem: error_chain(&e),
                }),
                Err(e) => Err(PluginError {
                    problem: e.to_string(),
                }),
            },
            None => Ok(()),
        }
    }
}

/// Usage sampling for a test: every second, busy from 5 % SM or memory activity, idle after
/// `window`, processes' cgroups under `proc_root`, `GPUIdle` events when `idle_events`, no
/// kubelet asked for container names.
pub fn fast_usage(
    proc_root: &Path,
    window: Duration,
    idle_events: bool,
) -> gpu_kubelet_plugin::usage::UsageConfig {
    gpu_kubelet_plugin::usage::UsageConfig {
        interval: Duration::from_secs(1),
        idle: gpu_kubelet_plugin::usage::IdleThresholds {
            sm_percent: 5,
            memory_percent: 5,
            window,
        },
        proc_root: proc_root.to_owned(),
        idle_events,
        pod_resources_socket: None,
    }
}

/// The GPUs the fake backend discovers from the topology file `topology`, as the plugin publishes
/// them (names, indices, minors, UUIDs).
///
/// # Errors
/// When the file cannot be read or discovery fails.
pub fn fake_gpus(topology: &Path) -> Result<Vec<gpu_inventory::Gpu>, String> {
    let topology = gpu_inventory::Topology::from_file(topology).map_err(|e| e.to_string())?;
    Ok(
        gpu_inventory::discover(&gpu_inventory::FakeBackend::new(topology))
            .map_err(|e| e.to_string())?
            .gpus,
    )
}

/// The device names of [`fake_gpus`].
///
/// # Errors
/// As [`fake_gpus`].
pub fn fake_gpu_names(topology: &Path) -> Result<Vec<String>, String> {
    Ok(fake_gpus(topology)?.into_iter().map(|g| g.name).collect())
}

/// Creates what a GPU node has and the fake topology implies: `dev/nvidiactl`,
/// `dev/nvidia-uvm`, `dev/nvidia-uvm-tools`, `dev/nvidia<minor>` per GPU, the driver's full MIG
/// capability table `driver/nvidia-caps/mig-minors` (every `gpu<minor>/gi<0..=14>/access` and
/// `.../ci<0..=7>/access` of every GPU minor, numbered as the driver does:
/// [`gpu_inventory::fake::mig::capability_table`]) with a `dev/nvidia-caps/nvidia-cap<m>` node for
/// each, and a `boot_id` file. Use `root` as both the device root and the proc root.
///
/// # Errors
/// A description of the file that could not be written or the topology that could not be read.
pub fn fake_host(root: &Path, topology: &Path) -> Result<(), String> {
    use gpu_inventory::fake::mig::{capability_minor, capability_table};
    let topology = gpu_inventory::Topology::from_file(topology).map_err(|e| e.to_string())?;
    let dev = root.join("dev");
    let mut nodes: Vec<String> = ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]
        .map(String::from)
        .to_vec();
    nodes.extend(topology.gpus.iter().map(|g| format!("nvidia{}", g.minor)));
    let gpus = topology.gpus.iter().map(|g| g.minor + 1).max().unwrap_or(0);
    if gpus > 0 {
        let last = capability_minor(gpus - 1, 14, Some(7));
        nodes.extend((3..=last).map(|m| format!("nvidia-caps/nvidia-cap{m}")));
    }
    let caps = root.join("driver/nvidia-caps");
    std::fs::create_dir_all(&caps).map_err(|e| format!("{}: {e}", caps.display()))?;
    std::fs::write(caps.join("mig-minors"), capability_table(gpus))
        .map_err(|e| format!("mig-minors: {e}"))?;
    std::fs::create_dir_all(dev.join("nvidia-caps"))
        .map_err(|e| format!("{}: {e}", dev.display()))?;
    for n in nodes {
        std::fs::write(dev.join(&n), b"").map_err(|e| format!("{n}: {e}"))?;
    }
    let boot = root.join("boot_id");
    if !boot.exists() {
        std::fs::write(&boot, b"e2e-boot-1\n").map_err(|e| format!("{}: {e}", boot.display()))?;
    }
    Ok(())
}

impl Drop for NodePlugin {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// The plugin's checkpoint at `path` as JSON (`{"bootId": ..., "claims": {UID: record}}`), read
/// as the plugin reads it: the newest valid generation of its two slots; `{}`-like empty
/// content when there is none.
pub fn read_checkpoint(path: &Path) -> Result<serde_json::Value, String> {
    let file = gpu_kubelet_plugin::checkpoint::CheckpointFile::new(
        std::sync::Arc::new(gpu_kubelet_plugin::storage::RealFs),
        path,
    );
    let checkpoint = file.load().map_err(|e| e.to_string())?.unwrap_or_default();
    serde_json::to_value(checkpoint).map_err(|e| e.to_string())
}

/// `error: cause: cause` for an error and its sources.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Drops a health event for a fake backend with state directory `state_dir` into
/// `<state_dir>/events/<seq>.json`, written under a temporary name and renamed: the backend polls
/// the directory and would read a file written in place before its content is there (and set
/// it aside as invalid). Events are consumed in `seq` order.
///
/// # Errors
/// The directory or file cannot be written.
pub fn write_health_event(
    state_dir: &std::path::Path,
    seq: u32,
    event: &gpu_inventory::HealthEvent,
) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let dir = gpu_inventory::health::events_dir(state_dir);
    std::fs::create_dir_all(&dir).with_context(|| dir.display().to_string())?;
    let tmp = dir.join(format!("{seq:06}.json.tmp"));
    std::fs::write(&tmp, serde_json::to_vec(event)?).with_context(|| tmp.display().to_string())?;
    let path = dir.join(format!("{seq:06}.json"));
    std::fs::rename(&tmp, &path).with_context(|| path.display().to_string())
}
