//! Applying the repository's YAML manifests (`deploy/`, `examples/`) to a control plane, as
//! `kubectl apply --server-side` would.

use std::path::{Path, PathBuf};

use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kube::discovery::{Scope, pinned_kind};
use serde::Deserialize as _;

/// A manifest could not be applied.
#[derive(Debug, thiserror::Error)]
#[error("applying {path} (document {document}): {problem}")]
pub struct ManifestError {
    /// The file.
    pub path: PathBuf,
    /// Index of the YAML document in the file.
    pub document: usize,
    /// What went wrong, naming the object.
    pub problem: String,
}

/// The repository root (for `deploy/` and `examples/`).
pub fn repo_root() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    root.canonicalize().unwrap_or(root)
}

/// A path relative to the repository root.
pub fn repo_path(relative: &str) -> PathBuf {
    repo_root().join(relative)
}

/// Server-side applies every document of the multi-document YAML file `path` (field manager
/// `drust-e2e`), in order; returns the applied objects as the server stored them.
///
/// # Errors
/// [`ManifestError`] naming the file, document and object.
pub async fn apply_file(
    client: &kube::Client,
    path: &Path,
) -> Result<Vec<DynamicObject>, ManifestError> {
    let text = std::fs::read_to_string(path).map_err(|e| ManifestError {
        path: path.to_owned(),
        document: 0,
        problem: e.to_string(),
    })?;
    apply_yaml(client, &text, path).await
}

/// Server-side applies every document of the multi-document YAML `text` (for example the output
/// of `helm template`), as [`apply_file`] does; `origin` names it in errors. Objects without a
/// namespace go to `default` when namespaced.
///
/// # Errors
/// [`ManifestError`] naming `origin`, the document and the object.
pub async fn apply_yaml(
    client: &kube::Client,
    text: &str,
    origin: &Path,
) -> Result<Vec<DynamicObject>, ManifestError> {
    let path = origin;
    let err = |document: usize, problem: String| ManifestError {
        path: path.to_owned(),
        document,
        problem,
    };
    let mut applied = Vec::new();
    for (i, doc) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let value = serde_yaml_ng::Value::deserialize(doc).map_err(|e| err(i, e.to_string()))?;
        if value.is_null() {
            continue;
        }
        let obj: DynamicObject =
            serde_yaml_ng::from_value(value).map_err(|e| err(i, e.to_string()))?;
        let types = obj
            .types
            .clone()
            .ok_or_else(|| err(i, "apiVersion/kind missing".into()))?;
        let gvk = GroupVersionKind::try_from(&types).map_err(|e| err(i, e.to_string()))?;
        let name = obj
            .metadata
            .name
            .clone()
            .ok_or_else(|| err(i, "metadata.name missing".into()))?;
        let (resource, caps) = pinned_kind(client, &gvk)
            .await
            .map_err(|e| err(i, format!("{}: {e}", types.kind)))?;
        let api: Api<DynamicObject> = match caps.scope {
            Scope::Namespaced => Api::namespaced_with(
                client.clone(),
                obj.metadata.namespace.as_deref().unwrap_or("default"),
                &resource,
            ),
            Scope::Cluster => Api::all_with(client.clone(), &resource),
        };
        let stored = api
            .patch(
                &name,
                &PatchParams::apply("drust-e2e").force(),
                &Patch::Apply(&obj),
            )
            .await
            .map_err(|e| err(i, format!("{} {name}: {e}", types.kind)))?;
        applied.push(stored);
    }
    Ok(applied)
}

/// The documents of the YAML stream `text` that `keep` accepts, as a YAML stream: to apply an
/// example's objects in an order of the test's choosing.
///
/// # Errors
/// When `text` is not YAML.
pub fn documents_where(
    text: &str,
    keep: impl Fn(&serde_yaml_ng::Value) -> bool,
) -> anyhow::Result<String> {
    let mut out = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(text) {
        let v = <serde_yaml_ng::Value as serde::Deserialize>::deserialize(doc)?;
        if !v.is_null() && keep(&v) {
            out.push(serde_yaml_ng::to_string(&v)?);
        }
    }
    Ok(out.join("---\n"))
}

/// The YAML stream `text` (e.g. an example) with every Pod's containers running `script`
/// (`/bin/sh -c`) in the local workload image ([`crate::images::WORKLOAD_IMAGE`], never pulled)
/// instead of their own image, which this machine cannot pull.
///
/// # Errors
/// When `text` is not YAML or a Pod has no `spec.containers`.
pub fn on_workload_image(text: &str, script: &str) -> anyhow::Result<String> {
    use anyhow::Context;
    let mut out = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(text) {
        let mut v = <serde_yaml_ng::Value as serde::Deserialize>::deserialize(doc)?;
        if v["kind"] == "Pod" {
            let containers = v["spec"]["containers"]
                .as_sequence_mut()
                .context("a Pod without spec.containers")?;
            for c in containers {
                c["image"] = crate::images::WORKLOAD_IMAGE.into();
                c["imagePullPolicy"] = "Never".into();
                c["command"] = serde_yaml_ng::to_value(["/bin/sh", "-c", script])?;
            }
        }
        out.push(serde_yaml_ng::to_string(&v)?);
    }
    Ok(out.join("---\n"))
}
