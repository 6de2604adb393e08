//! The ComputeDomain custom resources: NVIDIA's `resource.nvidia.com/v1beta1` (compatibility
//! mode) and drust's `compute.drust.dev/v1alpha1`, one spec and one status shape for both.
//!
//! Fields and JSON names mirror NVIDIA's `api/nvidia.com/resource/v1beta1/computedomain.go`
//! (kubernetes-sigs/dra-driver-nvidia-gpu): `spec.numNodes` (optional, deprecated),
//! `spec.channel.resourceClaimTemplate.name`, `spec.channel.allocationMode` (`Single` | `All`),
//! `status.status`, `status.nodes[]` (`name`, `ipAddress`, `cliqueID`, `index`, `status`).
//! drust adds `status.conditions` (why a domain is not Ready: a template conflict, a daemon
//! that cannot start, a clique held by another domain); NVIDIA's clients ignore it.

use kube::CustomResource;
use kube::core::NamespaceResourceScope;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `status.status` when every member's daemon is Ready (and `numNodes` is reached if set).
pub const READY: &str = "Ready";
/// `status.status` and a node's `status` otherwise.
pub const NOT_READY: &str = "NotReady";

/// The spec both APIs share. Immutable, as NVIDIA's: a renamed template would orphan the claims
/// made from the old one.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "self == oldSelf", "message": "spec is immutable: create another ComputeDomain instead"}
]))]
pub struct ComputeDomainSpec {
    /// Intended number of nodes (IMEX daemons) in the domain; 0 or absent: any. Used only
    /// for `status.status`. Deprecated by NVIDIA.
    #[serde(default, skip_serializing_if = "is_zero")]
    #[schemars(range(min = 0))]
    pub num_nodes: i64,
    /// The workload's channels.
    pub channel: ChannelSpec,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

/// `spec.channel`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ChannelSpec {
    /// The ResourceClaimTemplate the controller creates in the domain's namespace.
    pub resource_claim_template: ResourceClaimTemplateRef,
    /// `Single` (one channel, the default) or `All` (every channel of the node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocation_mode: Option<AllocationMode>,
}

/// `spec.channel.resourceClaimTemplate`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct ResourceClaimTemplateRef {
    /// Its name.
    #[schemars(length(min = 1))]
    pub name: String,
}

/// `spec.channel.allocationMode`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum AllocationMode {
    /// One channel.
    #[default]
    Single,
    /// Every channel the node publishes.
    All,
}

/// The status both APIs share. Written by the controller only (server-side apply, one field
/// manager).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct ComputeDomainStatus {
    /// `Ready` or `NotReady`.
    #[serde(default)]
    pub status: String,
    /// The member nodes, by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub nodes: Vec<ComputeDomainNode>,
    /// drust's addition: why the domain is not Ready, by type.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// One member node (`status.nodes[]`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ComputeDomainNode {
    /// The Node's name.
    pub name: String,
    /// The IP of the node's IMEX daemon Pod; empty until it has one.
    #[serde(default)]
    pub ip_address: String,
    /// `<clusterUuid>.<cliqueId>` of the node's channel device; empty: no clique.
    #[serde(default, rename = "cliqueID")]
    pub clique_id: String,
    /// The node's place in its clique's nodes file: assigned once, kept while the node is a
    /// member, never given to another member meanwhile. `(cliqueID, index)` is unique.
    #[serde(default)]
    pub index: i64,
    /// `Ready` when the node's daemon Pod is Ready, else `NotReady`.
    #[serde(default)]
    pub status: String,
}

/// A status condition (the shape of `metav1.Condition`, without `observedGeneration`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// Its type, such as `TemplateConflict`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// CamelCase reason.
    pub reason: String,
    /// For people.
    #[serde(default)]
    pub message: String,
    /// RFC 3339.
    #[serde(default)]
    pub last_transition_time: String,
}

/// NVIDIA's ComputeDomain (`resource.nvidia.com/v1beta1`), served in compatibility mode.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "resource.nvidia.com",
    version = "v1beta1",
    kind = "ComputeDomain",
    root = "NvidiaComputeDomain",
    namespaced,
    status = "ComputeDomainStatus",
    shortname = "cd"
)]
#[serde(transparent)]
pub struct NvidiaSpec(pub ComputeDomainSpec);

/// drust's ComputeDomain (`compute.drust.dev/v1alpha1`).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "compute.drust.dev",
    version = "v1alpha1",
    kind = "ComputeDomain",
    root = "DrustComputeDomain",
    namespaced,
    status = "ComputeDomainStatus",
    shortname = "cd"
)]
#[serde(transparent)]
pub struct DrustSpec(pub ComputeDomainSpec);

/// What the controller needs of either API's object.
pub trait Domain:
    kube::Resource<DynamicType = (), Scope = NamespaceResourceScope>
    + Clone
    + std::fmt::Debug
    + Serialize
    + serde::de::DeserializeOwned
    + Send
    + Sync
    + 'static
{
    /// The `apiVersion` of the opaque channel config in the template
    /// (`ComputeDomainChannelConfig`).
    const CONFIG_API_VERSION: &'static str;
    /// Its spec.
    fn domain_spec(&self) -> &ComputeDomainSpec;
    /// Its status, if any.
    fn domain_status(&self) -> Option<&ComputeDomainStatus>;
    /// The CRD.
    fn crd()
    -> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
}

impl Domain for NvidiaComputeDomain {
    const CONFIG_API_VERSION: &'static str = "resource.nvidia.com/v1beta1";
    fn domain_spec(&self) -> &ComputeDomainSpec {
        &self.spec.0
    }
    fn domain_status(&self) -> Option<&ComputeDomainStatus> {
        self.status.as_ref()
    }
    fn crd()
    -> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition
    {
        <Self as kube::CustomResourceExt>::crd()
    }
}

impl Domain for DrustComputeDomain {
    const CONFIG_API_VERSION: &'static str = "gpu.drust.dev/v1alpha1";
    fn domain_spec(&self) -> &ComputeDomainSpec {
        &self.spec.0
    }
    fn domain_status(&self) -> Option<&ComputeDomainStatus> {
        self.status.as_ref()
    }
    fn crd()
    -> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition
    {
        <Self as kube::CustomResourceExt>::crd()
    }
}

/// The CRD of `D` as the YAML in `deploy/crds/` holds it.
///
/// # Errors
/// When it does not serialize (never for these types).
pub fn crd_yaml<D: Domain>() -> Result<String, serde_yaml_ng::Error> {
    let body = serde_yaml_ng::to_string(&D::crd())?;
    Ok(format!(
        "# Generated from crates/compute-domain/src/crd.rs by\n\
         # `cargo run -p compute-domain --bin drust-compute-domain-controller -- crds <dir>`\n\
         # into deploy/crds and deploy/helm/drust/files/crds;\n\
         # the crate's test `crd_files_are_current` fails when this file is stale.\n{body}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvidia_json_names_round_trip() {
        let json = serde_json::json!({
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain",
            "metadata": {"name": "cd", "namespace": "default"},
            "spec": {"numNodes": 2, "channel": {"resourceClaimTemplate": {"name": "t"},
                     "allocationMode": "All"}},
            "status": {"status": "Ready", "nodes": [{"name": "n", "ipAddress": "10.0.0.1",
                       "cliqueID": "u.1", "index": 3, "status": "Ready"}]}
        });
        let cd: NvidiaComputeDomain = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(cd.spec.0.num_nodes, 2);
        assert_eq!(cd.spec.0.channel.allocation_mode, Some(AllocationMode::All));
        assert_eq!(cd.status.as_ref().unwrap().nodes[0].clique_id, "u.1");
        let back = serde_json::to_value(&cd).unwrap();
        assert_eq!(back["spec"], json["spec"]);
        assert_eq!(back["status"], json["status"]);
    }

    #[test]
    fn num_nodes_and_allocation_mode_are_optional() {
        let cd: DrustComputeDomain = serde_json::from_value(serde_json::json!({
            "apiVersion": "compute.drust.dev/v1alpha1", "kind": "ComputeDomain",
            "metadata": {"name": "cd"},
            "spec": {"channel": {"resourceClaimTemplate": {"name": "t"}}}
        }))
        .unwrap();
        assert_eq!(cd.spec.0.num_nodes, 0);
        assert_eq!(cd.spec.0.channel.allocation_mode, None);
    }

    #[test]
    fn crd_files_are_current() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/crds");
        for (file, yaml) in [
            (
                "resource.nvidia.com_computedomains.yaml",
                crd_yaml::<NvidiaComputeDomain>().unwrap(),
            ),
            (
                "compute.drust.dev_computedomains.yaml",
                crd_yaml::<DrustComputeDomain>().unwrap(),
            ),
        ] {
            for dir in [root.clone(), root.join("../helm/drust/files/crds")] {
                let on_disk = std::fs::read_to_string(dir.join(file)).unwrap_or_default();
                assert!(
                    on_disk == yaml,
                    "{}/{file} is stale: run `cargo run -p compute-domain --bin \
                     drust-compute-domain-controller -- crds deploy/crds` (and the same for \
                     deploy/helm/drust/files/crds)",
                    dir.display()
                );
            }
        }
    }
}
