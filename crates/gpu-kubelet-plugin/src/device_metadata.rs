//! Device metadata in containers (KEP-5304, "DRA: device metadata downward API", alpha in 1.36):
//! for each request of a prepared claim, a file describing its devices (driver, pool, name and
//! the attributes the ResourceSlice publishes: UUID, NVLink clique, PCI bus ID and root, NUMA
//! node, product, memory, ...), bind-mounted read-only into every container that holds the
//! request's devices, where a workload finds it without asking the API server.
//!
//! Laid out as upstream's kubelet plugin helper lays it out
//! (`k8s.io/dynamic-resource-allocation` v0.36 `kubeletplugin/metadata.go`, the paths of
//! `api/metadata/types.go` and `helpers.go`), so that upstream's reader
//! (`devicemetadata.ReadResourceClaimTemplateMetadata` and friends) finds it:
//! - on the host: `<plugin dir>/dra-device-metadata/<claim namespace>_<claim name>/<request>/metadata.json`;
//! - in the container: `/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/<pod claim name>/<request>/<driver>-metadata.json`
//!   for a claim made from a template (its `resource.kubernetes.io/pod-claim-name`
//!   annotation), `.../resourceclaims/<claim name>/<request>/<driver>-metadata.json` for a claim
//!   named directly. `<request>` is the base request (a subrequest's request), as upstream's
//!   `resourceclaim.BaseRequestRef`;
//! - the file: a JSON stream of the same `DeviceMetadata` in each API version this plugin writes,
//!   newest first (today `metadata.resource.k8s.io/v1alpha1` only), generation 1, its request
//!   named as the allocation names it (with a subrequest: `<request>/<subrequest>`).
//!
//! Upstream's helper writes a second CDI spec per request for the mount; drust puts the mount in
//! the claim's own spec, on the first device of each request (the kubelet hands a container every
//! CDI device of the requests it references, so each such container gets it once). The files
//! are written at prepare before the spec and removed at unprepare; start-up removes those of
//! claims it does not keep.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use k8s_openapi::api::resource::v1::{DeviceAttribute, ResourceClaim};
use serde::Serialize;

use crate::cdi::{Mount, Spec};

/// The host directory under the plugin directory (upstream's `metadataSubDir`).
pub const HOST_DIR: &str = "dra-device-metadata";
/// Where the files are in a container (upstream's `metadata.ContainerDir`).
pub const CONTAINER_DIR: &str = "/var/run/kubernetes.io/dra-device-attributes";
/// The API versions written, newest first.
pub const API_VERSIONS: [&str; 1] = ["metadata.resource.k8s.io/v1alpha1"];
/// The annotation naming a generated claim's entry in its pod (`resource.kubernetes.io/v1`
/// `PodResourceClaimAnnotation`).
pub const POD_CLAIM_ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";

/// One prepared device of a claim, as its metadata describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct MetadataDevice {
    /// The request (or `<request>/<subrequest>`) it was allocated for.
    pub request: String,
    /// Its pool.
    pub pool: String,
    /// Its name in the pool.
    pub name: String,
    /// Its attributes, as the ResourceSlice publishes them.
    pub attributes: BTreeMap<String, DeviceAttribute>,
}

/// One request's metadata file: its text and where it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadataFile {
    /// The base request.
    pub request: String,
    /// The first of its devices (by name): the CDI device that carries the mount.
    pub first_device: String,
    /// On the host.
    pub host_path: PathBuf,
    /// In the container.
    pub container_path: String,
    /// The JSON stream.
    pub content: Vec<u8>,
}

/// Writes and removes the metadata files of one driver's claims.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceMetadata {
    dir: PathBuf,
    driver: String,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Document<'a> {
    kind: &'static str,
    api_version: &'a str,
    metadata: ObjectMeta<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pod_claim_name: Option<&'a str>,
    requests: Vec<Request<'a>>,
}

#[derive(Serialize)]
struct ObjectMeta<'a> {
    name: &'a str,
    namespace: &'a str,
    uid: &'a str,
    generation: i64,
}

#[derive(Serialize)]
struct Request<'a> {
    name: &'a str,
    devices: Vec<Device<'a>>,
}

#[derive(Serialize)]
struct Device<'a> {
    driver: &'a str,
    pool: &'a str,
    name: &'a str,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    attributes: &'a BTreeMap<String, DeviceAttribute>,
}

impl DeviceMetadata {
    /// The files of `driver` under `plugin_dir`/[`HOST_DIR`].
    pub fn new(plugin_dir: &Path, driver: &str) -> Self {
        Self {
            dir: plugin_dir.join(HOST_DIR),
            driver: driver.to_owned(),
        }
    }

    /// The files of claim `rc` with `devices`, one per base request, in request order.
    ///
    /// # Errors
    /// The claim lacks a name, namespace or UID, or a name is not one plain path component.
    pub fn files(
        &self,
        rc: &ResourceClaim,
        devices: &[MetadataDevice],
    ) -> Result<Vec<MetadataFile>, String> {
        let meta = &rc.metadata;
        let (Some(name), Some(namespace), Some(uid)) = (
            meta.name.as_deref(),
            meta.namespace.as_deref(),
            meta.uid.as_deref(),
        ) else {
            return Err("the claim has no name, namespace or UID".to_owned());
        };
        let pod_claim = meta
            .annotations
            .as_ref()
            .and_then(|a| a.get(POD_CLAIM_ANNOTATION))
            .map(String::as_str)
            .filter(|n| !n.is_empty());
        for part in [name, namespace].into_iter().chain(pod_claim) {
            if !plain(part) {
                return Err(format!("{part:?} is not a plain path component"));
            }
        }
        let mut by_request: BTreeMap<&str, Vec<&MetadataDevice>> = BTreeMap::new();
        for d in devices {
            by_request
                .entry(base_request(&d.request))
                .or_default()
                .push(d);
        }
        let mut files = Vec::with_capacity(by_request.len());
        for (request, devices) in by_request {
            if !plain(request) {
                return Err(format!("request {request:?} is not a plain path component"));
            }
            // Upstream records one request per file, named as the allocation names it.
            let request_ref = devices.first().map_or(request, |d| d.request.as_str());
            let mut content = Vec::new();
            for api_version in API_VERSIONS {
                let document = Document {
                    kind: "DeviceMetadata",
                    api_version,
                    metadata: ObjectMeta {
                        name,
                        namespace,
                        uid,
                        generation: 1,
                    },
                    pod_claim_name: pod_claim,
                    requests: vec![Request {
                        name: request_ref,
                        devices: devices
                            .iter()
                            .map(|d| Device {
                                driver: &self.driver,
                                pool: &d.pool,
                                name: &d.name,
                                attributes: &d.attributes,
                            })
                            .collect(),
                    }],
                };
                serde_json::to_writer_pretty(&mut content, &document).map_err(|e| e.to_string())?;
                content.push(b'\n');
            }
            let file_name = format!("{}-metadata.json", self.driver);
            let container_path = match pod_claim {
                Some(pod_claim) => format!(
                    "{CONTAINER_DIR}/resourceclaimtemplates/{pod_claim}/{request}/{file_name}"
                ),
                None => format!("{CONTAINER_DIR}/resourceclaims/{name}/{request}/{file_name}"),
            };
            files.push(MetadataFile {
                request: request.to_owned(),
                first_device: devices
                    .iter()
                    .map(|d| d.name.as_str())
                    .min()
                    .unwrap_or_default()
                    .to_owned(),
                host_path: self
                    .claim_dir(namespace, name)
                    .join(request)
                    .join("metadata.json"),
                container_path,
                content,
            });
        }
        Ok(files)
    }

    /// Writes `files` (each atomically, mode 0644 as upstream's). Blocking.
    ///
    /// # Errors
    /// The file that could not be written, and why.
    pub fn write(files: &[MetadataFile]) -> Result<(), (PathBuf, std::io::Error)> {
        for f in files {
            let dir = f.host_path.parent().unwrap_or(Path::new("/"));
            let tmp = dir.join(".metadata.json.tmp");
            std::fs::create_dir_all(dir)
                .and_then(|()| std::fs::write(&tmp, &f.content))
                .and_then(|()| std::fs::rename(&tmp, &f.host_path))
                .map_err(|e| (f.host_path.clone(), e))?;
        }
        Ok(())
    }

    /// Removes the files of claim `namespace`/`name`. Blocking.
    ///
    /// # Errors
    /// The directory could not be removed (it stays, for a retry).
    pub fn clear(&self, namespace: &str, name: &str) -> std::io::Result<()> {
        if !plain(namespace) || !plain(name) {
            return Ok(());
        }
        match std::fs::remove_dir_all(self.claim_dir(namespace, name)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// The claims (`(namespace, name)`) that have files, for start-up to remove those it does
    /// not keep. Blocking.
    pub fn recorded_claims(&self) -> BTreeSet<(String, String)> {
        std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .filter_map(|n| {
                // Namespaces hold no `_` (DNS labels): the first one ends the namespace.
                let (ns, name) = n.split_once('_')?;
                Some((ns.to_owned(), name.to_owned()))
            })
            .collect()
    }

    fn claim_dir(&self, namespace: &str, name: &str) -> PathBuf {
        self.dir.join(format!("{namespace}_{name}"))
    }
}

/// Adds to `spec` (claim `claim_uid`'s) the read-only bind mount of each of `files`, on the CDI
/// device of its request's first device.
pub fn add_mounts(spec: &mut Spec, claim_uid: &str, files: &[MetadataFile]) {
    for f in files {
        let device = crate::cdi::CdiWriter::device_name(claim_uid, &f.first_device);
        if let Some(d) = spec.devices.iter_mut().find(|d| d.name == device) {
            d.container_edits.mounts.push(Mount {
                host_path: f.host_path.display().to_string(),
                container_path: f.container_path.clone(),
                options: vec!["ro".to_owned(), "bind".to_owned()],
            });
        }
    }
}

/// The attributes `device` is published with (as [`gpu_inventory::Inventory::pool`] makes
/// them, before the plugin adds sharing and fabric attributes), with `uuid` set to
/// `created_uuid` for a MIG device prepare created from a placement.
pub fn published_attributes(
    device: &crate::hardware::NodeDevice,
    created_uuid: Option<&str>,
) -> BTreeMap<String, DeviceAttribute> {
    use crate::hardware::NodeDevice;
    let published = match device {
        NodeDevice::Gpu(gpu) => Some(gpu.device()),
        NodeDevice::Mig { parent, mig } => Some(mig.device(parent)),
        NodeDevice::MigPlacement { parent, name, .. } => gpu_inventory::mig::partitionable(parent)
            .1
            .into_iter()
            .find(|d| &d.name == name),
    };
    let mut attributes = published.and_then(|d| d.attributes).unwrap_or_default();
    if let Some(uuid) = created_uuid {
        attributes.insert(
            "uuid".to_owned(),
            DeviceAttribute {
                string: Some(uuid.to_owned()),
                ..Default::default()
            },
        );
    }
    attributes
}

/// `<request>` of `<request>/<subrequest>` (upstream's `resourceclaim.BaseRequestRef`).
pub fn base_request(request: &str) -> &str {
    request.split_once('/').map_or(request, |(base, _)| base)
}

/// One path component of letters, digits, `-`, `_` and `.` (not `.` or `..`).
fn plain(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(pod_claim: Option<&str>) -> ResourceClaim {
        let mut rc = ResourceClaim::default();
        rc.metadata.name = Some("train-0-gpus-x7k2p".into());
        rc.metadata.namespace = Some("team".into());
        rc.metadata.uid = Some("0d4c1e2a-0000-4000-8000-00000000000a".into());
        if let Some(p) = pod_claim {
            rc.metadata.annotations =
                Some(BTreeMap::from([(POD_CLAIM_ANNOTATION.into(), p.into())]));
        }
        rc
    }

    fn device(request: &str, name: &str, uuid: &str) -> MetadataDevice {
        MetadataDevice {
            request: request.into(),
            pool: "node-a".into(),
            name: name.into(),
            attributes: BTreeMap::from([(
                "uuid".to_owned(),
                DeviceAttribute {
                    string: Some(uuid.into()),
                    ..Default::default()
                },
            )]),
        }
    }

    #[test]
    fn a_template_claims_files_go_where_upstreams_reader_looks_one_per_base_request() {
        let writer = DeviceMetadata::new(
            Path::new("/var/lib/kubelet/plugins/gpu.drust.dev"),
            "gpu.drust.dev",
        );
        let files = writer
            .files(
                &claim(Some("gpus")),
                &[
                    device("train/h100", "gpu-1", "GPU-b"),
                    device("train/h100", "gpu-0", "GPU-a"),
                    device("eval", "gpu-2", "GPU-c"),
                ],
            )
            .unwrap();
        let summary: Vec<(&str, &str, &str)> = files
            .iter()
            .map(|f| {
                (
                    f.request.as_str(),
                    f.first_device.as_str(),
                    f.container_path.as_str(),
                )
            })
            .collect();
        assert_eq!(
            summary,
            [
                (
                    "eval",
                    "gpu-2",
                    "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpus/eval/gpu.drust.dev-metadata.json"
                ),
                (
                    "train",
                    "gpu-0",
                    "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpus/train/gpu.drust.dev-metadata.json"
                ),
            ]
        );
        assert_eq!(
            files[1].host_path,
            Path::new(
                "/var/lib/kubelet/plugins/gpu.drust.dev/dra-device-metadata/team_train-0-gpus-x7k2p/train/metadata.json"
            )
        );
        let doc: serde_json::Value = serde_json::from_slice(&files[1].content).unwrap();
        assert_eq!(doc["apiVersion"], "metadata.resource.k8s.io/v1alpha1");
        assert_eq!(doc["kind"], "DeviceMetadata");
        assert_eq!(doc["podClaimName"], "gpus");
        assert_eq!(doc["metadata"]["generation"], 1);
        assert_eq!(doc["requests"][0]["name"], "train/h100");
        assert_eq!(
            doc["requests"][0]["devices"][1]["attributes"]["uuid"]["string"],
            "GPU-a"
        );
        assert_eq!(doc["requests"][0]["devices"][1]["driver"], "gpu.drust.dev");
    }

    #[test]
    fn a_claim_named_directly_goes_under_resourceclaims_and_bad_names_are_refused() {
        let writer = DeviceMetadata::new(Path::new("/p"), "gpu.drust.dev");
        let files = writer
            .files(&claim(None), &[device("gpu", "gpu-0", "GPU-a")])
            .unwrap();
        assert_eq!(
            files[0].container_path,
            "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/train-0-gpus-x7k2p/gpu/gpu.drust.dev-metadata.json"
        );
        let mut bad = claim(Some("../x"));
        assert!(writer.files(&bad, &[]).unwrap_err().contains("plain path"));
        bad.metadata.uid = None;
        assert!(writer.files(&bad, &[]).is_err());
    }

    #[test]
    fn files_are_written_found_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let writer = DeviceMetadata::new(dir.path(), "gpu.drust.dev");
        let files = writer
            .files(&claim(Some("gpus")), &[device("gpu", "gpu-0", "GPU-a")])
            .unwrap();
        DeviceMetadata::write(&files).unwrap();
        assert_eq!(
            std::fs::read(&files[0].host_path).unwrap(),
            files[0].content
        );
        assert_eq!(
            writer.recorded_claims(),
            BTreeSet::from([("team".to_owned(), "train-0-gpus-x7k2p".to_owned())])
        );
        writer.clear("team", "train-0-gpus-x7k2p").unwrap();
        writer.clear("team", "train-0-gpus-x7k2p").unwrap();
        assert!(writer.recorded_claims().is_empty());
    }
}
