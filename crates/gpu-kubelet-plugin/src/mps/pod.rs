//! The Pod a daemon runs in ([`DaemonPods`]): built, created through the API server, owned by
//! the plugin's DaemonSet, deleted once its daemon has quit. The chart's admission policy pins
//! the plugin's token to exactly this Pod (`deploy/helm/drust/templates/admission-policy.yaml`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::DeleteParams;

use super::{CLAIM_UID_LABEL, DAEMON_SHM_SIZE, MpsControl, MpsError, Protocol};

/// Where and how daemon Pods run.
#[derive(Clone)]
pub struct DaemonPods {
    /// The API server.
    pub client: kube::Client,
    /// Namespace of the daemon Pods (the plugin's own).
    pub namespace: String,
    /// This node: the Pods' `spec.nodeName`.
    pub node_name: String,
    /// Image with `chroot` (the plugin's own image).
    pub image: String,
    /// `imagePullPolicy` of that image.
    pub pull_policy: String,
    /// `priorityClassName` of the Pods, if any.
    pub priority_class: Option<String>,
    /// The driver root on the host (mounted at `/driver-root`, the daemon's root).
    pub host_driver_root: PathBuf,
    /// `nvidia-cuda-mps-control` inside the driver root.
    pub daemon_binary: PathBuf,
    /// The DaemonSet of the plugin (in `namespace`), named in each Pod's `ownerReferences` so
    /// that deleting it (`helm uninstall`) deletes the daemons too (garbage collection); `None`:
    /// no owner (plugins run outside the chart).
    pub owner: Option<DaemonSetOwner>,
}

/// The plugin's DaemonSet as the owner of daemon Pods: its name, and its UID once looked up
/// (`GET`, at the first daemon Pod; the chart's RBAC allows exactly that one object).
#[derive(Debug, Clone)]
pub struct DaemonSetOwner {
    name: String,
    uid: Arc<tokio::sync::OnceCell<String>>,
}

impl DaemonSetOwner {
    /// The DaemonSet `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            uid: Arc::default(),
        }
    }
}

impl std::fmt::Debug for DaemonPods {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DaemonPods")
            .field("namespace", &self.namespace)
            .field("node_name", &self.node_name)
            .field("image", &self.image)
            .field("host_driver_root", &self.host_driver_root)
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

impl MpsControl {
    /// The Pod that runs the daemon of claim `uid` for `visible_ids` (comma-separated GPU or
    /// MIG UUIDs) in `protocol`, as [`Self::start`] and [`Self::start_v3`] create it (see the
    /// module docs; its owner looked up as there); `None` without [`DaemonPods`].
    ///
    /// # Errors
    /// [`MpsError::Pod`] if the owner cannot be looked up or the Pod cannot be built (a bug).
    pub async fn daemon_pod(
        &self,
        uid: &str,
        visible_ids: &str,
        protocol: Protocol,
    ) -> Result<Option<Pod>, MpsError> {
        match &self.pods {
            Some(pods) => {
                let owner = self.owner_uid(pods, uid).await?;
                self.build_daemon_pod(pods, uid, visible_ids, owner, protocol)
                    .map(Some)
            }
            None => Ok(None),
        }
    }

    /// The UID of the owning DaemonSet ([`DaemonPods::owner`]), looked up once.
    pub(super) async fn owner_uid<'p>(
        &self,
        pods: &'p DaemonPods,
        uid: &str,
    ) -> Result<Option<(&'p str, &'p str)>, MpsError> {
        let Some(owner) = &pods.owner else {
            return Ok(None);
        };
        let found = owner
            .uid
            .get_or_try_init(|| async {
                let api = Api::<DaemonSet>::namespaced(pods.client.clone(), &pods.namespace);
                let problem =
                    match tokio::time::timeout(self.start_timeout, api.get(&owner.name)).await {
                        Ok(Ok(ds)) => match ds.metadata.uid {
                            Some(uid) => return Ok(uid),
                            None => "the DaemonSet has no UID".to_owned(),
                        },
                        Ok(Err(e)) => e.to_string(),
                        Err(_) => format!("no answer within {} ms", self.start_timeout.as_millis()),
                    };
                Err(MpsError::Pod {
                    namespace: pods.namespace.clone(),
                    name: Self::pod_name(uid),
                    what: "look up its owner, DaemonSet",
                    problem: format!("{}: {problem}", owner.name),
                })
            })
            .await?;
        Ok(Some((owner.name.as_str(), found.as_str())))
    }

    pub(super) fn build_daemon_pod(
        &self,
        pods: &DaemonPods,
        uid: &str,
        visible_ids: &str,
        owner: Option<(&str, &str)>,
        protocol: Protocol,
    ) -> Result<Pod, MpsError> {
        let binary = Path::new("/").join(&pods.daemon_binary);
        let mut command = vec![
            "chroot".to_owned(),
            "/driver-root".to_owned(),
            binary.display().to_string(),
            "-f".to_owned(),
        ];
        command.extend(protocol.daemon_args().iter().map(|a| (*a).to_owned()));
        // Not the controller: the DaemonSet controller would release (or count) a Pod it
        // controls that its selector does not match. An owner is enough for the collector.
        let owners = owner.map(|(name, owner_uid)| {
            [
                serde_json::json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
                                "name": name, "uid": owner_uid}),
            ]
        });
        let pod = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": Self::pod_name(uid),
                "namespace": pods.namespace,
                "labels": {
                    "app.kubernetes.io/name": "mps-control-daemon",
                    "app.kubernetes.io/managed-by": "gpu-kubelet-plugin",
                    CLAIM_UID_LABEL: uid,
                },
                "ownerReferences": owners,
            },
            "spec": {
                "nodeName": pods.node_name,
                // The plugin starts a lost daemon again, with the claim's limits.
                "restartPolicy": "Never",
                // The namespace's default account, with no token: the daemon calls no API.
                "serviceAccountName": "default",
                "automountServiceAccountToken": false,
                "enableServiceLinks": false,
                "terminationGracePeriodSeconds": 5,
                "priorityClassName": pods.priority_class,
                // It serves a claim already running here: no taint may keep it off the node.
                "tolerations": [{"operator": "Exists"}],
                "containers": [{
                    "name": "mps-control-daemon",
                    "image": pods.image,
                    "imagePullPolicy": pods.pull_policy,
                    "command": command,
                    "env": [
                        {"name": "CUDA_VISIBLE_DEVICES", "value": visible_ids},
                        {"name": "CUDA_MPS_PIPE_DIRECTORY", "value": "/tmp/pipe"},
                        {"name": "CUDA_MPS_LOG_DIRECTORY", "value": "/tmp/log"},
                    ],
                    // The daemon and its servers open the GPUs' device nodes.
                    "securityContext": {"privileged": true},
                    "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
                    "volumeMounts": [
                        // Read-only: the daemon writes only its pipes and log (and, in its
                        // own tmpfs, any shared memory).
                        {"name": "driver-root", "mountPath": "/driver-root", "readOnly": true,
                         "mountPropagation": "HostToContainer"},
                        {"name": "claim", "mountPath": "/driver-root/tmp"},
                        {"name": "shm", "mountPath": "/driver-root/dev/shm"},
                    ],
                }],
                "volumes": [
                    {"name": "driver-root",
                     "hostPath": {"path": pods.host_driver_root, "type": "Directory"}},
                    {"name": "claim",
                     "hostPath": {"path": self.claim_dir(uid), "type": "Directory"}},
                    // The daemon's /dev/shm: a tmpfs of its own, size-limited, shared with
                    // no client (Volta and later MPS needs none: `DAEMON_SHM_SIZE`).
                    {"name": "shm",
                     "emptyDir": {"medium": "Memory", "sizeLimit": DAEMON_SHM_SIZE}},
                ],
            },
        });
        serde_json::from_value(pod).map_err(|e| MpsError::Pod {
            namespace: pods.namespace.clone(),
            name: Self::pod_name(uid),
            what: "build",
            problem: e.to_string(),
        })
    }

    /// Deletes the daemon Pod of claim `uid` at once (its daemon has quit or is lost), if any.
    pub(super) async fn delete_pod(&self, uid: &str) -> Result<(), MpsError> {
        let Some(pods) = &self.pods else {
            return Ok(());
        };
        self.pod_call(pods, uid, "delete", async {
            match Api::<Pod>::namespaced(pods.client.clone(), &pods.namespace)
                .delete(
                    &Self::pod_name(uid),
                    &DeleteParams::default().grace_period(0),
                )
                .await
            {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
                Err(e) => Err(e),
            }
        })
        .await
    }

    /// One API call about the daemon Pod of `uid`, bounded by the start timeout.
    pub(super) async fn pod_call(
        &self,
        pods: &DaemonPods,
        uid: &str,
        what: &'static str,
        call: impl std::future::Future<Output = Result<(), kube::Error>>,
    ) -> Result<(), MpsError> {
        let problem = match tokio::time::timeout(self.start_timeout, call).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {} ms", self.start_timeout.as_millis()),
        };
        Err(MpsError::Pod {
            namespace: pods.namespace.clone(),
            name: Self::pod_name(uid),
            what,
            problem,
        })
    }

    /// The phase and container state of the daemon Pod of `uid`, for error messages.
    pub(super) async fn pod_state(&self, pods: &DaemonPods, uid: &str) -> String {
        let api = Api::<Pod>::namespaced(pods.client.clone(), &pods.namespace);
        match tokio::time::timeout(self.start_timeout, api.get_opt(&Self::pod_name(uid))).await {
            Ok(Ok(Some(pod))) => {
                let status = pod.status.unwrap_or_default();
                let containers = status
                    .container_statuses
                    .unwrap_or_default()
                    .into_iter()
                    .map(|c| format!("{:?}", c.state))
                    .collect::<Vec<_>>()
                    .join(", ");
                format!("phase {:?}, {containers}", status.phase)
            }
            Ok(Ok(None)) => "not found".to_owned(),
            Ok(Err(e)) => e.to_string(),
            Err(_) => "no answer".to_owned(),
        }
    }
}
