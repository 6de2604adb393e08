//! CDI spec files: one per prepared claim, under the CDI root the container runtime watches.
//!
//! Format: the Container Device Interface spec (github.com/cncf-tags/container-device-interface,
//! SPEC.md), version [`CDI_VERSION`]. Kind `<vendor>/claim` where the vendor is the driver name;
//! device names `<claim-uid>-<device>`; so the fully qualified ID the kubelet hands to the runtime
//! is `<driver>/claim=<claim-uid>-<device>`, unique per claim and never reused for other content.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use dra_kubelet::ClaimRef;
use serde::{Deserialize, Serialize};

use crate::storage::{Fs, remove_file, replace};

/// The CDI spec version we write: the oldest that has every field we use.
pub const CDI_VERSION: &str = "0.6.0";

/// A CDI spec (the subset we write).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    /// CDI spec version.
    pub cdi_version: String,
    /// `vendor/class`.
    pub kind: String,
    /// Spec annotations; ours name the claim ([`CdiWriter::claim_annotations`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Devices of this spec.
    pub devices: Vec<CdiDevice>,
    /// Edits applied when any device of this spec is injected.
    #[serde(default, skip_serializing_if = "ContainerEdits::is_empty")]
    pub container_edits: ContainerEdits,
}

impl Spec {
    /// Every set of container edits the spec holds: its own, then each device's.
    pub fn all_edits(&self) -> impl Iterator<Item = &ContainerEdits> {
        std::iter::once(&self.container_edits)
            .chain(self.devices.iter().map(|d| &d.container_edits))
    }
}

/// One CDI device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CdiDevice {
    /// Name within the kind.
    pub name: String,
    /// Edits applied when this device is injected.
    pub container_edits: ContainerEdits,
}

/// Container edits (the subset we write).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    /// `NAME=value` environment variables.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Device nodes to create in the container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    /// Host paths to mount into the container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
    /// OCI hooks the runtime runs for the container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<Hook>,
}

impl ContainerEdits {
    fn is_empty(&self) -> bool {
        self.env.is_empty()
            && self.device_nodes.is_empty()
            && self.mounts.is_empty()
            && self.hooks.is_empty()
    }
}

/// An OCI hook (CDI `hooks` entry): the runtime runs `path` with `args` (whose first element
/// is the program name, as in `execve`) at `hook_name`, on the host, with the container's state
/// on stdin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hook {
    /// The OCI hook point, e.g. `createContainer`.
    pub hook_name: String,
    /// The program, a path on the host.
    pub path: String,
    /// `argv`, program name first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// `NAME=value` environment of the hook.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Seconds the runtime lets the hook run before failing the container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<u32>,
}

/// A bind mount (CDI `mounts` entry).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    /// Path on the host.
    pub host_path: String,
    /// Path in the container.
    pub container_path: String,
    /// Mount options, e.g. `rbind`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

/// A device node, by its path on the host (and in the container), or by its numbers for a
/// node the host does not have (the runtime then makes it in the container).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    /// In the container, e.g. `/dev/accel0`.
    pub path: String,
    /// On the host, when not `path` (CDI 0.5.0+): the runtime reads the node's type, major and
    /// minor numbers there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    /// `c` (character) or `b` (block); with `major` and `minor` the runtime needs no node on
    /// the host.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// The major number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub major: Option<i64>,
    /// The minor number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<i64>,
    /// The cgroup device permissions, e.g. `rw` (default `rwm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permissions: Option<String>,
}

/// Writing or removing a spec failed.
#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    /// The spec file could not be written.
    #[error("writing CDI spec {path}: {source}")]
    Write {
        /// The spec file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// The spec file could not be read.
    #[error("reading CDI spec {path}: {source}")]
    Read {
        /// The spec file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// The spec file could not be removed.
    #[error("removing CDI spec {path}: {source}")]
    Remove {
        /// The spec file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
}

/// Writes claim specs for one driver under one CDI root.
#[derive(Debug, Clone)]
pub struct CdiWriter {
    fs: Arc<dyn Fs>,
    root: PathBuf,
    vendor: String,
    /// Keys an earlier version of the driver named the claim with, still read.
    legacy: Option<[String; 3]>,
}

impl CdiWriter {
    /// Specs of `driver_name` under `root` (the runtime's CDI dir, default `/var/run/cdi`).
    pub fn new(fs: Arc<dyn Fs>, root: impl Into<PathBuf>, driver_name: &str) -> Self {
        Self {
            fs,
            root: root.into(),
            vendor: driver_name.to_owned(),
            legacy: None,
        }
    }

    /// Also reads the claim from `[namespace, name, uid]` annotation keys, where a spec lacks
    /// this driver's own ([`Self::claim_annotations`]): the keys an earlier version of the
    /// driver wrote, so that its specs on disk still identify their claims after an upgrade.
    #[must_use]
    pub fn with_legacy_claim_annotations(mut self, keys: [&str; 3]) -> Self {
        self.legacy = Some(keys.map(str::to_owned));
        self
    }

    /// The annotation keys naming a claim's namespace, name and UID in this driver's specs:
    /// `<driver>/claim-namespace`, `<driver>/claim-name`, `<driver>/claim-uid`.
    pub fn claim_annotations(&self) -> [String; 3] {
        ["namespace", "name", "uid"].map(|k| format!("{}/claim-{k}", self.vendor))
    }

    /// Writes `claim`'s annotations ([`Self::claim_annotations`]) into `spec`.
    pub fn stamp(&self, spec: &mut Spec, claim: &ClaimRef) {
        let [namespace, name, uid] = self.claim_annotations();
        spec.annotations.insert(namespace, claim.namespace.clone());
        spec.annotations.insert(name, claim.name.clone());
        spec.annotations.insert(uid, claim.uid.clone());
    }

    /// The claim `spec` names: by this driver's keys ([`Self::claim_annotations`]), else by
    /// the earlier ones it was given ([`Self::with_legacy_claim_annotations`]); `None` when it
    /// names none (no UID, or no name).
    pub fn claim_of(&self, spec: &Spec) -> Option<ClaimRef> {
        let get = |k: &str| spec.annotations.get(k).cloned();
        let named_by = |[namespace, name, uid]: &[String; 3]| {
            Some(ClaimRef {
                namespace: get(namespace).unwrap_or_default(),
                name: get(name).unwrap_or_default(),
                uid: get(uid)?,
            })
        };
        let claim = named_by(&self.claim_annotations())
            .or_else(|| self.legacy.as_ref().and_then(named_by))?;
        (!claim.uid.is_empty() && !claim.name.is_empty()).then_some(claim)
    }

    /// `<vendor>/claim`.
    pub fn kind(&self) -> String {
        format!("{}/claim", self.vendor)
    }

    /// The CDI device name of `device` in claim `claim_uid`.
    pub fn device_name(claim_uid: &str, device: &str) -> String {
        format!("{claim_uid}-{device}")
    }

    /// The fully qualified CDI device ID, `<vendor>/claim=<claim-uid>-<device>`.
    pub fn device_id(&self, claim_uid: &str, device: &str) -> String {
        format!("{}={}", self.kind(), Self::device_name(claim_uid, device))
    }

    /// `<root>/<vendor>-claim_<claim-uid>.json`.
    pub fn spec_path(&self, claim_uid: &str) -> PathBuf {
        self.root
            .join(format!("{}-claim_{claim_uid}.json", self.vendor))
    }

    /// Writes `spec` for the claim atomically (a runtime never reads half a file) and returns
    /// its path. Not synced: a spec is only used once its claim's `PrepareCompleted` record is
    /// durable in the checkpoint, which holds the spec too, and start-up rewrites every
    /// completed claim's spec that is missing or differs (`recovery::ensure_spec`); a spec
    /// without a record is an orphan and removed. Syncing it would only add two fsyncs to
    /// every prepare.
    ///
    /// # Errors
    /// [`CdiError::Write`].
    pub fn write(&self, claim_uid: &str, spec: &Spec) -> Result<PathBuf, CdiError> {
        let path = self.spec_path(claim_uid);
        let write_err = |source| CdiError::Write {
            path: path.clone(),
            source,
        };
        let mut bytes = serde_json::to_vec_pretty(spec).map_err(|e| write_err(e.into()))?;
        bytes.push(b'\n');
        self.fs.create_dir_all(&self.root).map_err(write_err)?;
        replace(self.fs.as_ref(), &path, &bytes).map_err(write_err)?;
        Ok(path)
    }

    /// Reads the claim's spec; `Ok(None)` when absent or not parseable as a spec (a torn or
    /// foreign file is treated as absent and will be rewritten or removed).
    ///
    /// # Errors
    /// [`CdiError::Read`] for I/O errors other than absence.
    pub fn read(&self, claim_uid: &str) -> Result<Option<Spec>, CdiError> {
        let path = self.spec_path(claim_uid);
        match self.fs.read(&path) {
            Ok(bytes) => Ok(serde_json::from_slice(&bytes).ok()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(CdiError::Read { path, source }),
        }
    }

    /// Removes the claim's spec; a missing file is success. Not synced: a spec that a crash
    /// brings back is reconciled at start (its claim's record, if any, is finishing an
    /// unprepare and removes it again; without a record it is an orphan and removed), so the
    /// directory fsync would buy nothing.
    ///
    /// # Errors
    /// [`CdiError::Remove`].
    pub fn remove(&self, claim_uid: &str) -> Result<(), CdiError> {
        let path = self.spec_path(claim_uid);
        remove_file(self.fs.as_ref(), &path).map_err(|source| CdiError::Remove { path, source })
    }

    /// The claim UIDs of every claim spec of this vendor under the root, and any temp files a
    /// crash left behind (`(None, path)`).
    ///
    /// # Errors
    /// [`CdiError::Read`] when the root cannot be listed.
    pub fn list(&self) -> Result<Vec<(Option<String>, PathBuf)>, CdiError> {
        let prefix = format!("{}-claim_", self.vendor);
        let temp_prefix = format!(".{prefix}");
        let files = self.fs.list(&self.root).map_err(|source| CdiError::Read {
            path: self.root.clone(),
            source,
        })?;
        Ok(files
            .into_iter()
            .filter_map(|path| {
                let name = path.file_name()?.to_string_lossy().into_owned();
                if name.starts_with(&temp_prefix) && crate::storage::is_temp_file(&path) {
                    return Some((None, path));
                }
                let uid = name
                    .strip_prefix(&prefix)?
                    .strip_suffix(".json")?
                    .to_owned();
                Some((Some(uid), path))
            })
            .collect())
    }

    /// Removes a file found by [`CdiWriter::list`].
    ///
    /// # Errors
    /// [`CdiError::Remove`].
    pub fn remove_path(&self, path: &Path) -> Result<(), CdiError> {
        remove_file(self.fs.as_ref(), path).map_err(|source| CdiError::Remove {
            path: path.to_owned(),
            source,
        })
    }

    /// The CDI root.
    pub fn root(&self) -> &Path {
        &self.root
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::RealFs;

    /// Issue 41, defect 14: the claim's annotations are the driver's own, written by the
    /// lifecycle; specs of the driver's earlier versions (the keys it names) are still read,
    /// and no others.
    #[test]
    fn claim_annotations_are_the_drivers_and_legacy_ones_are_read() {
        let old = [
            "old.example.com/ns",
            "old.example.com/name",
            "old.example.com/uid",
        ];
        let plain = CdiWriter::new(Arc::new(RealFs), "/var/run/cdi", "dev.example.com");
        let w = plain.clone().with_legacy_claim_annotations(old);
        let claim = ClaimRef {
            namespace: "ns".into(),
            name: "a".into(),
            uid: "u-1".into(),
        };
        let mut spec = Spec::default();
        w.stamp(&mut spec, &claim);
        assert_eq!(
            spec.annotations.keys().collect::<Vec<_>>(),
            [
                "dev.example.com/claim-name",
                "dev.example.com/claim-namespace",
                "dev.example.com/claim-uid"
            ]
        );
        assert_eq!(w.claim_of(&spec), Some(claim.clone()));
        let mut legacy = Spec::default();
        for (k, v) in old.into_iter().zip(["ns", "a", "u-1"]) {
            legacy.annotations.insert(k.into(), v.into());
        }
        assert_eq!(w.claim_of(&legacy), Some(claim));
        assert_eq!(plain.claim_of(&legacy), None, "no legacy keys given");
        assert_eq!(w.claim_of(&Spec::default()), None, "names no claim");
    }

    #[test]
    fn ids_paths_and_kind_follow_the_driver_name() {
        let w = CdiWriter::new(Arc::new(RealFs), "/var/run/cdi", "dev.example.com");
        assert_eq!(w.kind(), "dev.example.com/claim");
        assert_eq!(
            w.device_id("u-1", "dev-0"),
            "dev.example.com/claim=u-1-dev-0"
        );
        assert_eq!(
            w.spec_path("u-1"),
            PathBuf::from("/var/run/cdi/dev.example.com-claim_u-1.json")
        );
    }

    #[test]
    fn write_then_remove_leaves_nothing_and_removing_twice_is_fine() {
        let dir = tempfile::tempdir().expect("tempdir");
        let w = CdiWriter::new(Arc::new(RealFs), dir.path().join("cdi"), "d.example");
        let spec = Spec {
            cdi_version: CDI_VERSION.into(),
            kind: w.kind(),
            ..Default::default()
        };
        let path = w.write("u", &spec).expect("write");
        let back: Spec =
            serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("parse");
        assert_eq!(back, spec);
        assert_eq!(
            w.list().expect("list"),
            [(Some("u".to_owned()), path.clone())]
        );
        assert_eq!(w.read("u").expect("read"), Some(spec));
        w.remove("u").expect("remove");
        w.remove("u").expect("remove again");
        assert_eq!(w.read("u").expect("read"), None);
        assert_eq!(
            std::fs::read_dir(dir.path().join("cdi"))
                .expect("dir")
                .count(),
            0
        );
    }
}
