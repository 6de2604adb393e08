//! PodGroup manifests as `dractl simulate` reads them: a gang's `minCount`, its topology key
//! and the claims of the whole group.
//!
//! Both shapes of the API are read, whose fields used here have the same names:
//! `scheduling.k8s.io/v1alpha2` (Kubernetes 1.36: `k8s.io/api` v0.36.3
//! `scheduling/v1alpha2/types.go`) and `scheduling.k8s.io/v1beta1` (1.37: v0.37.2
//! `scheduling/v1beta1/types.go`; `podGroupTemplateRef` became `workloadRef` and
//! `disruptionMode` a struct, neither of which is read; `tests/e2e/tests/gangs.rs` runs both on
//! the real API server). Read: `spec.schedulingPolicy` (exactly one of `basic` and `gang.minCount`, a positive
//! integer), `spec.schedulingConstraints.topology` (at most one `{key}`, a label key) and
//! `spec.resourceClaims` (at most 4, each a DNS label `name` and exactly one of
//! `resourceClaimName` and `resourceClaimTemplateName`, KEP-5729). Other fields (priority,
//! disruption mode, the template reference) do not change where pods fit and are left alone.

use serde_json::Value;

use crate::objects::{InputError, Location};

/// The API versions read.
pub const API_VERSIONS: [&str; 2] = ["scheduling.k8s.io/v1alpha2", "scheduling.k8s.io/v1beta1"];

/// `MaxPodGroupResourceClaims`.
pub const MAX_CLAIMS: usize = 4;

/// What a PodGroup claim names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimSource {
    /// `resourceClaimTemplateName`: a claim made from this template for the group.
    Template(String),
    /// `resourceClaimName`: this ResourceClaim, reserved for the group.
    Claim(String),
}

/// One entry of `spec.resourceClaims`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupClaim {
    /// Its name in the PodGroup.
    pub name: String,
    /// What it names.
    pub source: ClaimSource,
    /// Its field path, for messages.
    pub field: String,
}

/// A PodGroup, as far as placement goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodGroup {
    /// Where it was read.
    pub location: Location,
    /// `apiVersion`.
    pub api_version: String,
    /// Its namespace (`default` when not given).
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// `gang.minCount`; `None` for the `basic` policy.
    pub min_count: Option<usize>,
    /// `schedulingConstraints.topology[0].key`.
    pub topology_key: Option<String>,
    /// `resourceClaims`.
    pub claims: Vec<GroupClaim>,
}

impl PodGroup {
    /// `PodGroup namespace/name`.
    pub fn object(&self) -> String {
        format!("PodGroup {}/{}", self.namespace, self.name)
    }

    /// An error about one field of this PodGroup.
    pub fn error(&self, field: &str, message: impl std::fmt::Display) -> InputError {
        InputError {
            location: Some(self.location.clone()),
            object: Some(self.object()),
            message: format!("{field}: {message}"),
        }
    }
}

/// Reads one PodGroup document.
///
/// # Errors
/// An [`InputError`] naming the file, document, object and field: another API version, a
/// policy that is neither or both of `basic` and `gang`, a `minCount` that is not a positive
/// integer, more than one topology constraint or an empty key, more than [`MAX_CLAIMS`]
/// claims, a claim without a name, a duplicate name, or naming neither or both sources.
pub fn parse(location: Location, value: &Value) -> Result<PodGroup, InputError> {
    let api_version = value["apiVersion"].as_str().unwrap_or("").to_owned();
    let name = value["metadata"]["name"].as_str().unwrap_or("").to_owned();
    let mut group = PodGroup {
        location,
        api_version: api_version.clone(),
        namespace: value["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .to_owned(),
        name,
        min_count: None,
        topology_key: None,
        claims: Vec::new(),
    };
    if !API_VERSIONS.contains(&api_version.as_str()) {
        return Err(group.error(
            "apiVersion",
            format!(
                "{api_version:?}: dractl reads {} (Kubernetes 1.36) and {} (1.37)",
                API_VERSIONS[0], API_VERSIONS[1]
            ),
        ));
    }
    if group.name.is_empty() {
        return Err(group.error("metadata.name", "required"));
    }
    let spec = &value["spec"];
    if !spec.is_object() {
        return Err(group.error("spec", "required"));
    }
    let policy = &spec["schedulingPolicy"];
    let (basic, gang) = (&policy["basic"], &policy["gang"]);
    match (basic.is_null(), gang.is_null()) {
        (true, true) => {
            return Err(group.error(
                "spec.schedulingPolicy",
                "exactly one of basic and gang must be set",
            ));
        }
        (false, false) => {
            return Err(group.error(
                "spec.schedulingPolicy",
                "exactly one of basic and gang must be set, not both",
            ));
        }
        (false, true) => {}
        (true, false) => {
            let min = &gang["minCount"];
            match min.as_u64().filter(|&m| m >= 1) {
                Some(m) => group.min_count = Some(usize::try_from(m).unwrap_or(usize::MAX)),
                None => {
                    return Err(group.error(
                        "spec.schedulingPolicy.gang.minCount",
                        format!("{min}: must be a positive integer"),
                    ));
                }
            }
        }
    }
    let topology = &spec["schedulingConstraints"]["topology"];
    if !topology.is_null() {
        let Some(items) = topology.as_array() else {
            return Err(group.error("spec.schedulingConstraints.topology", "must be a list"));
        };
        if items.len() > 1 {
            return Err(group.error(
                "spec.schedulingConstraints.topology",
                format!(
                    "{} constraints: the API allows one (and the scheduler reads the first)",
                    items.len()
                ),
            ));
        }
        if let Some(item) = items.first() {
            let key = item["key"].as_str().unwrap_or("");
            let problems = crate::objects::names::qualified_name(key);
            if key.is_empty() || !problems.is_empty() {
                return Err(group.error(
                    "spec.schedulingConstraints.topology[0].key",
                    format!(
                        "{key:?}: must be a node label key{}",
                        problems
                            .first()
                            .map(|p| format!(" ({p})"))
                            .unwrap_or_default()
                    ),
                ));
            }
            group.topology_key = Some(key.to_owned());
        }
    }
    let claims = &spec["resourceClaims"];
    if !claims.is_null() {
        let Some(items) = claims.as_array() else {
            return Err(group.error("spec.resourceClaims", "must be a list"));
        };
        if items.len() > MAX_CLAIMS {
            return Err(group.error(
                "spec.resourceClaims",
                format!("{} claims: at most {MAX_CLAIMS}", items.len()),
            ));
        }
        for (i, item) in items.iter().enumerate() {
            let field = format!("spec.resourceClaims[{i}]");
            let name = item["name"].as_str().unwrap_or("");
            if name.is_empty() {
                return Err(group.error(&format!("{field}.name"), "required"));
            }
            if let Some(p) = crate::objects::names::dns1123_label(name).first() {
                return Err(group.error(&format!("{field}.name"), format!("{name:?}: {p}")));
            }
            if group.claims.iter().any(|c| c.name == name) {
                return Err(group.error(
                    &format!("{field}.name"),
                    format!("{name:?}: duplicate name"),
                ));
            }
            let claim = item["resourceClaimName"].as_str();
            let template = item["resourceClaimTemplateName"].as_str();
            let source = match (claim, template) {
                (Some(c), None) if !c.is_empty() => ClaimSource::Claim(c.to_owned()),
                (None, Some(t)) if !t.is_empty() => ClaimSource::Template(t.to_owned()),
                _ => {
                    return Err(group.error(
                        &field,
                        "exactly one of resourceClaimName and resourceClaimTemplateName must \
                         be set",
                    ));
                }
            };
            group.claims.push(GroupClaim {
                name: name.to_owned(),
                source,
                field,
            });
        }
    }
    Ok(group)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn location() -> Location {
        Location {
            file: "pg.yaml".into(),
            document: 0,
            item: None,
        }
    }

    fn pod_group(api_version: &str, spec: Value) -> Value {
        json!({"apiVersion": api_version, "kind": "PodGroup",
            "metadata": {"name": "train", "namespace": "ml"}, "spec": spec})
    }

    #[test]
    fn both_api_versions_give_the_same_gang_topology_and_claims() {
        let spec = json!({
            "schedulingPolicy": {"gang": {"minCount": 4}},
            "schedulingConstraints": {"topology": [{"key": "nvidia.com/gpu.clique"}]},
            "resourceClaims": [
                {"name": "domain", "resourceClaimTemplateName": "nvlink-domain"},
                {"name": "shared", "resourceClaimName": "dataset-cache"}]});
        let alpha = parse(location(), &pod_group(API_VERSIONS[0], spec.clone())).unwrap();
        let beta = parse(location(), &pod_group(API_VERSIONS[1], spec)).unwrap();
        assert_eq!(alpha.min_count, Some(4));
        assert_eq!(alpha.topology_key.as_deref(), Some("nvidia.com/gpu.clique"));
        assert_eq!(
            alpha.claims.iter().map(|c| &c.source).collect::<Vec<_>>(),
            [
                &ClaimSource::Template("nvlink-domain".into()),
                &ClaimSource::Claim("dataset-cache".into())
            ]
        );
        assert_eq!(
            (beta.min_count, beta.topology_key, beta.claims),
            (alpha.min_count, alpha.topology_key, alpha.claims)
        );
    }

    /// A PodGroup as the 1.37 API server returns it: the fields 1.37 added or reshaped
    /// (`workloadRef`, `disruptionMode: {all: {}}`, `preemptionPolicy`, `status`) are left
    /// alone.
    #[test]
    fn a_pod_group_as_1_37_stores_it_reads_the_same() {
        let stored = json!({"apiVersion": API_VERSIONS[1], "kind": "PodGroup",
            "metadata": {"name": "train", "namespace": "ml", "uid": "u-1",
                "ownerReferences": [{"apiVersion": API_VERSIONS[1], "kind": "Workload",
                    "name": "train", "uid": "u-0"}]},
            "spec": {
                "workloadRef": {"workloadName": "train", "templateName": "workers"},
                "schedulingPolicy": {"gang": {"minCount": 2}},
                "schedulingConstraints": {"topology": [{"key": "gpu.drust.dev/nvlink-clique"}]},
                "resourceClaims": [{"name": "fabric", "resourceClaimTemplateName": "one-gpu"}],
                "disruptionMode": {"all": {}},
                "preemptionPolicy": "PreemptLowerPriority",
                "priority": 0},
            "status": {"conditions": [{"type": "PodGroupScheduled", "status": "True"}],
                "resourceClaimStatuses": [{"name": "fabric",
                    "resourceClaimName": "train-fabric-x7k2p"}]}});
        let g = parse(location(), &stored).unwrap();
        assert_eq!(g.min_count, Some(2));
        assert_eq!(
            g.topology_key.as_deref(),
            Some("gpu.drust.dev/nvlink-clique")
        );
        assert_eq!(
            g.claims.iter().map(|c| &c.source).collect::<Vec<_>>(),
            [&ClaimSource::Template("one-gpu".into())]
        );
    }

    #[test]
    fn a_basic_policy_is_no_gang() {
        let g = parse(
            location(),
            &pod_group(API_VERSIONS[0], json!({"schedulingPolicy": {"basic": {}}})),
        )
        .unwrap();
        assert_eq!(g.min_count, None);
    }

    #[test]
    fn each_malformed_field_is_named() {
        let cases = [
            (
                pod_group("scheduling.k8s.io/v1alpha1", json!({})),
                "apiVersion: \"scheduling.k8s.io/v1alpha1\"",
            ),
            (
                pod_group(API_VERSIONS[0], json!({"schedulingPolicy": {}})),
                "spec.schedulingPolicy: exactly one of basic and gang must be set",
            ),
            (
                pod_group(
                    API_VERSIONS[0],
                    json!({"schedulingPolicy": {"gang": {"minCount": 0}}}),
                ),
                "spec.schedulingPolicy.gang.minCount: 0: must be a positive integer",
            ),
            (
                pod_group(
                    API_VERSIONS[1],
                    json!({"schedulingPolicy": {"gang": {"minCount": 2}},
                        "schedulingConstraints": {"topology": [{"key": "a"}, {"key": "b"}]}}),
                ),
                "spec.schedulingConstraints.topology: 2 constraints",
            ),
            (
                pod_group(
                    API_VERSIONS[1],
                    json!({"schedulingPolicy": {"basic": {}},
                        "schedulingConstraints": {"topology": [{"key": ""}]}}),
                ),
                "spec.schedulingConstraints.topology[0].key: \"\": must be a node label key",
            ),
            (
                pod_group(
                    API_VERSIONS[0],
                    json!({"schedulingPolicy": {"basic": {}},
                        "resourceClaims": [{"name": "a", "resourceClaimName": "x",
                            "resourceClaimTemplateName": "y"}]}),
                ),
                "spec.resourceClaims[0]: exactly one of resourceClaimName and \
                 resourceClaimTemplateName must be set",
            ),
            (
                pod_group(
                    API_VERSIONS[0],
                    json!({"schedulingPolicy": {"basic": {}},
                        "resourceClaims": [{"name": "a", "resourceClaimName": "x"},
                            {"name": "a", "resourceClaimName": "y"}]}),
                ),
                "spec.resourceClaims[1].name: \"a\": duplicate name",
            ),
        ];
        for (value, want) in cases {
            let e = parse(location(), &value).unwrap_err().to_string();
            assert!(
                e.starts_with("pg.yaml: document 0 (PodGroup ml/train): "),
                "{e}"
            );
            assert!(e.contains(want), "{e}\nwant: {want}");
        }
    }
}
