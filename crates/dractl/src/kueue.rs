//! What Kueue does not check for a queued job's DRA claims, as `dractl lint` warns of it.
//!
//! Kueue (v0.19, `KueueDRAIntegration`) admits a Workload by its pods' ResourceClaimTemplates
//! (`pkg/controller/core/workload_controller.go` `handleDRA`, `pkg/dra/claims.go`): a claim
//! named directly in a pod, `firstAvailable`, `allocationMode: All`, a DeviceClass missing
//! from its Configuration's `resources.deviceClassMappings` and one whose selectors test
//! `allowMultipleAllocations` (Kueue's devices lack it: no device matches) make the Workload
//! inadmissible (the Job stays suspended); device `constraints` are ignored, and only selectors are checked, cluster
//! wide. So a job whose claim no node can satisfy (an NVLink `matchAttribute`, more GPUs than a
//! node has) is admitted and charged, and its pods stay Pending holding the quota. README
//! "Queued jobs with Kueue" has the messages; `tests/e2e/tests/kueue.rs` backs each case.
//!
//! Queued: a Job, JobSet, Pod or other object with a pod template whose
//! `metadata.labels["kueue.x-k8s.io/queue-name"]` is set.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceClaimTemplate};
use serde_json::Value;

use crate::objects::{InputError, Location};

/// The label that queues a workload in a LocalQueue.
pub const QUEUE_LABEL: &str = "kueue.x-k8s.io/queue-name";

/// What Kueue's Configuration maps: the DeviceClasses of every `deviceClassMappings` entry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Mappings {
    /// Where it was read, for messages.
    pub file: String,
    /// Mapped DeviceClass names.
    pub classes: BTreeSet<String>,
}

/// Reads Kueue's Configuration (`config.kueue.x-k8s.io/v1beta2` or `v1beta1`) from `path`:
/// the document itself, or a ConfigMap (the chart's `kueue-manager-config`) holding it in a
/// data key.
///
/// # Errors
/// An unreadable file, or one that holds no Configuration.
pub fn read_config(path: &str) -> Result<Mappings, InputError> {
    let text = crate::objects::read_input(path)?;
    for (location, value) in crate::objects::documents(path, &text)? {
        if let Some(m) = mappings(&location, &value)? {
            return Ok(Mappings {
                file: path.to_owned(),
                classes: m,
            });
        }
        if value["kind"] == "ConfigMap" {
            for data in value["data"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(_, v)| v)
            {
                let Some(inner) = data.as_str() else { continue };
                for (_, doc) in crate::objects::documents(path, inner).unwrap_or_default() {
                    if let Some(m) = mappings(&location, &doc)? {
                        return Ok(Mappings {
                            file: path.to_owned(),
                            classes: m,
                        });
                    }
                }
            }
        }
    }
    Err(InputError::general(format!(
        "--kueue-config {path}: no Kueue Configuration (config.kueue.x-k8s.io/v1beta2 \
         Configuration, or a ConfigMap holding one)"
    )))
}

fn mappings(location: &Location, value: &Value) -> Result<Option<BTreeSet<String>>, InputError> {
    let api = value["apiVersion"].as_str().unwrap_or("");
    if value["kind"] != "Configuration" || !api.starts_with("config.kueue.x-k8s.io/") {
        return Ok(None);
    }
    let mut classes = BTreeSet::new();
    let list = &value["resources"]["deviceClassMappings"];
    if !list.is_null() && !list.is_array() {
        return Err(InputError {
            location: Some(location.clone()),
            object: Some("Configuration".into()),
            message: "resources.deviceClassMappings: must be a list".into(),
        });
    }
    for (i, m) in list.as_array().into_iter().flatten().enumerate() {
        for (j, c) in m["deviceClassNames"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            let Some(c) = c.as_str() else {
                return Err(InputError {
                    location: Some(location.clone()),
                    object: Some("Configuration".into()),
                    message: format!(
                        "resources.deviceClassMappings[{i}].deviceClassNames[{j}]: must be a string"
                    ),
                });
            };
            classes.insert(c.to_owned());
        }
    }
    Ok(Some(classes))
}

/// A queued workload's pod specs: `(field path, pod spec)`.
pub fn pod_specs(value: &Value) -> Vec<(String, &Value)> {
    let mut out = Vec::new();
    match value["kind"].as_str().unwrap_or("") {
        "Pod" => out.push(("spec".to_owned(), &value["spec"])),
        "JobSet" => {
            for (i, r) in value["spec"]["replicatedJobs"]
                .as_array()
                .into_iter()
                .flatten()
                .enumerate()
            {
                out.push((
                    format!("spec.replicatedJobs[{i}].template.spec.template.spec"),
                    &r["template"]["spec"]["template"]["spec"],
                ));
            }
        }
        "LeaderWorkerSet" => {
            let t = &value["spec"]["leaderWorkerTemplate"];
            for which in ["leaderTemplate", "workerTemplate"] {
                if t[which].is_object() {
                    out.push((
                        format!("spec.leaderWorkerTemplate.{which}.spec"),
                        &t[which]["spec"],
                    ));
                }
            }
        }
        _ => {
            if value["spec"]["template"]["spec"].is_object() {
                out.push((
                    "spec.template.spec".to_owned(),
                    &value["spec"]["template"]["spec"],
                ));
            }
        }
    }
    out
}

/// Whether `value` is queued by Kueue: its queue name, from the label (or the older
/// annotation).
pub fn queue_name(value: &Value) -> Option<&str> {
    let meta = &value["metadata"];
    meta["labels"][QUEUE_LABEL]
        .as_str()
        .or_else(|| meta["annotations"][QUEUE_LABEL].as_str())
        .filter(|q| !q.is_empty())
}

/// One warning: the field and the message.
pub type Warning = (String, String);

/// The cluster a queued job's claims are checked against (`--slices`).
#[derive(Debug, Clone, Default)]
pub struct Cluster {
    /// Its nodes (given, or one per slice's node name).
    pub nodes: Vec<Node>,
    /// DeviceClasses from the `--slices` files.
    pub classes: Vec<DeviceClass>,
    /// The published ResourceSlices.
    pub slices: Vec<k8s_openapi::api::resource::v1::ResourceSlice>,
}

impl Cluster {
    /// Reads `--slices` files: ResourceSlices, and the Nodes and DeviceClasses beside them
    /// (ResourceClaims are left out: the question is what the slices offer, not what is free).
    /// A slice's node missing from the files is taken as a Node without labels.
    ///
    /// # Errors
    /// As `dractl allocate` reads its files.
    pub fn read(paths: &[String]) -> Result<Cluster, InputError> {
        let inputs = crate::objects::load_files(paths)?;
        let mut nodes = inputs.nodes;
        for s in &inputs.slices {
            if let Some(n) = s.spec.node_name.as_deref().filter(|n| !n.is_empty())
                && !nodes.iter().any(|x| x.metadata.name.as_deref() == Some(n))
            {
                nodes.push(Node {
                    metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                        name: Some(n.to_owned()),
                        ..Default::default()
                    },
                    ..Default::default()
                });
            }
        }
        Ok(Cluster {
            nodes,
            classes: inputs.classes,
            slices: inputs.slices,
        })
    }

    /// Whether `claim` fits on some node with nothing in use; else the closest reason.
    fn fits(&self, claim: &ResourceClaim, classes: &[DeviceClass]) -> Result<(), String> {
        let mut objects = dra_allocator::Objects {
            nodes: self.nodes.clone(),
            classes: classes.to_vec(),
            slices: self.slices.clone(),
            claims: vec![claim.clone()],
        };
        dra_allocator::apply_defaults(&mut objects);
        let (report, _) =
            crate::explain::explain_objects(&objects, &dra_allocator::Options::default());
        if report.nodes.iter().any(|n| n.fits) {
            return Ok(());
        }
        Err(report
            .nodes
            .iter()
            .find_map(|n| {
                n.reason
                    .as_deref()
                    .or(n.error.as_deref())
                    .map(|r| format!("{}: {r}", n.name))
            })
            .unwrap_or_else(|| "the slices offer no node".to_owned()))
    }
}

/// What Kueue refuses or ignores in one template that a queued workload uses: the fields of
/// the template (`spec.spec...`) and what to do instead.
pub fn template_warnings(
    template: &ResourceClaimTemplate,
    mappings: Option<&Mappings>,
    cluster: Option<&Cluster>,
    classes: &[DeviceClass],
) -> Vec<Warning> {
    let mut out = Vec::new();
    let name = template.metadata.name.as_deref().unwrap_or("");
    let Some(devices) = &template.spec.spec.devices else {
        return out;
    };
    for (i, r) in devices.requests.iter().flatten().enumerate() {
        let field = format!("spec.spec.devices.requests[{i}]");
        if r.first_available.as_ref().is_some_and(|f| !f.is_empty()) {
            out.push((
                format!("{field}.firstAvailable"),
                format!(
                    "Kueue refuses firstAvailable (\"ResourceClaimTemplate {name}: \
                     FirstAvailable device selection is not supported\"): the job stays \
                     suspended; use one exactly request whose selector admits every \
                     alternative (without the order of preference)"
                ),
            ));
        }
        if let Some(e) = &r.exactly {
            if e.allocation_mode.as_deref() == Some("All") {
                out.push((
                    format!("{field}.exactly.allocationMode"),
                    format!(
                        "Kueue refuses allocationMode: All (\"ResourceClaimTemplate {name}: \
                         AllocationMode 'All' is not supported\"): the job stays suspended; \
                         ask for `count:` the node's GPU count instead"
                    ),
                ));
            }
            let class = classes
                .iter()
                .find(|c| c.metadata.name.as_deref() == Some(e.device_class_name.as_str()));
            let tests_sharing = class.is_some_and(|c| {
                c.spec.selectors.iter().flatten().any(|s| {
                    s.cel
                        .as_ref()
                        .is_some_and(|cel| cel.expression.contains("allowMultipleAllocations"))
                })
            });
            if tests_sharing {
                out.push((
                    format!("{field}.exactly.deviceClassName"),
                    format!(
                        "DeviceClass {} selects devices by allowMultipleAllocations, which \
                         Kueue's copies of the devices lack (v0.19 pkg/dra/claims.go): it finds \
                         no device (\"insufficient matching devices for CEL selector in \
                         DeviceClass {}\") and the job stays suspended; use a class without that \
                         test, gpu-share-kueue.drust.dev (examples/kueue/shares.yaml)",
                        e.device_class_name, e.device_class_name
                    ),
                ));
            }
            if let Some(m) = mappings
                && !m.classes.contains(&e.device_class_name)
            {
                out.push((
                    format!("{field}.exactly.deviceClassName"),
                    format!(
                        "DeviceClass {} is in no deviceClassMappings of {}: Kueue refuses the \
                         job (\"DeviceClass {} is not mapped in DRA configuration for podset \
                         ...\") and it stays suspended; add the class to a mapping (a whole-GPU \
                         class to drust.dev/gpu, examples/kueue/kueue-config.yaml)",
                        e.device_class_name, m.file, e.device_class_name
                    ),
                ));
            }
        }
    }
    // Kueue refuses the template already: whether a node could hold it comes after that.
    let Some(cluster) = cluster.filter(|_| out.is_empty()) else {
        return out;
    };
    let claim = ResourceClaim {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: template.metadata.name.clone(),
            namespace: Some(
                template
                    .metadata
                    .namespace
                    .clone()
                    .unwrap_or_else(|| "default".into()),
            ),
            ..Default::default()
        },
        spec: template.spec.spec.clone(),
        status: None,
    };
    // A request that needs an unknown class or firstAvailable/All: Kueue refuses it already.
    let known: BTreeSet<&str> = classes
        .iter()
        .filter_map(|c| c.metadata.name.as_deref())
        .collect();
    let usable = devices.requests.iter().flatten().all(|r| {
        r.exactly
            .as_ref()
            .is_some_and(|e| known.contains(e.device_class_name.as_str()))
    });
    if !usable {
        return out;
    }
    let Err(reason) = cluster.fits(&claim, classes) else {
        return out;
    };
    let constraints = devices.constraints.clone().unwrap_or_default();
    // The claim without constraint `skip`; without any for `None`.
    let without = |skip: Option<usize>| {
        let mut c = claim.clone();
        if let Some(d) = c.spec.devices.as_mut() {
            d.constraints = Some(
                constraints
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| skip.is_some_and(|s| s != *i))
                    .map(|(_, c)| c.clone())
                    .collect(),
            );
        }
        c
    };
    let blocking: Vec<usize> =
        if constraints.is_empty() || cluster.fits(&without(None), classes).is_err() {
            Vec::new()
        } else {
            let single: Vec<usize> = (0..constraints.len())
                .filter(|&i| cluster.fits(&without(Some(i)), classes).is_ok())
                .collect();
            if single.is_empty() {
                (0..constraints.len()).collect()
            } else {
                single
            }
        };
    let nodes = cluster.nodes.len();
    if blocking.is_empty() {
        out.push((
            "spec.spec.devices".to_owned(),
            format!(
                "no node of the given slices ({nodes}) can satisfy this claim ({reason}); Kueue \
                 only checks that enough devices match its selectors across the cluster, so it \
                 admits the job and charges its quota, and the pods stay Pending holding it; \
                 ask for what one node has, and set Kueue's waitForPodsReady so that a job \
                 that cannot start gives its quota back"
            ),
        ));
    }
    for i in blocking {
        let c = &constraints[i];
        let what = c
            .match_attribute
            .as_deref()
            .map(|a| format!("matchAttribute {a}"))
            .or_else(|| {
                c.distinct_attribute
                    .as_deref()
                    .map(|a| format!("distinctAttribute {a}"))
            })
            .unwrap_or_else(|| "this constraint".into());
        out.push((
            format!("spec.spec.devices.constraints[{i}]"),
            format!(
                "no node of the given slices ({nodes}) can satisfy {what} for these requests \
                 ({reason}), and without it the claim would fit; Kueue ignores constraints, so \
                 it admits the job and charges its quota, and the pods stay Pending holding it; \
                 ask for at most what one value of {} has on a node (or drop the constraint), \
                 and set Kueue's waitForPodsReady so that a job that cannot start gives its \
                 quota back",
                c.match_attribute
                    .as_deref()
                    .or(c.distinct_attribute.as_deref())
                    .unwrap_or("the attribute")
            ),
        ));
    }
    out
}

/// A warning for each claim named directly in a queued pod spec (`resourceClaimName`).
pub fn direct_claims(prefix: &str, spec: &Value) -> Vec<Warning> {
    spec["resourceClaims"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
        .filter(|(_, c)| c["resourceClaimName"].is_string())
        .map(|(i, c)| {
            (
                format!("{prefix}.resourceClaims[{i}].resourceClaimName"),
                format!(
                    "Kueue refuses a claim named in the pod ({}: \"KueueDRAIntegration feature \
                     does not support use of resource claims\"): the job stays suspended; use a \
                     ResourceClaimTemplate (one claim per pod), or to share a GPU between pods, \
                     shares of gpu-share-kueue.drust.dev (examples/kueue/shares.yaml)",
                    c["resourceClaimName"].as_str().unwrap_or("")
                ),
            )
        })
        .collect()
}

/// The templates a queued pod spec names: `(field, template name)`.
pub fn template_refs(prefix: &str, spec: &Value) -> Vec<(String, String)> {
    spec["resourceClaims"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
        .filter_map(|(i, c)| {
            Some((
                format!("{prefix}.resourceClaims[{i}].resourceClaimTemplateName"),
                c["resourceClaimTemplateName"].as_str()?.to_owned(),
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn the_mappings_are_read_from_the_configuration_or_the_charts_config_map() {
        let dir = tempfile::tempdir().unwrap();
        let config = "apiVersion: config.kueue.x-k8s.io/v1beta2\nkind: Configuration\n\
                      resources:\n  deviceClassMappings:\n    - name: drust.dev/gpu\n      \
                      deviceClassNames: [gpu.drust.dev, gpu-extended.drust.dev]\n";
        let direct = dir.path().join("config.yaml");
        std::fs::write(&direct, config).unwrap();
        let map = dir.path().join("configmap.yaml");
        std::fs::write(
            &map,
            serde_yaml_ng::to_string(&json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "kueue-manager-config", "namespace": "kueue-system"},
                "data": {"controller_manager_config.yaml": config}}))
            .unwrap(),
        )
        .unwrap();
        for path in [direct, map] {
            let m = read_config(path.to_str().unwrap()).unwrap();
            assert_eq!(
                m.classes.iter().map(String::as_str).collect::<Vec<_>>(),
                ["gpu-extended.drust.dev", "gpu.drust.dev"]
            );
        }
    }

    #[test]
    fn a_claim_for_more_devices_than_any_node_has_is_named_as_a_whole() {
        let cluster = Cluster {
            nodes: vec![serde_json::from_value(json!({"metadata": {"name": "n"}})).unwrap()],
            classes: Vec::new(),
            slices: vec![
                serde_json::from_value(json!({"metadata": {"name": "s"}, "spec": {
                "driver": "gpu.drust.dev", "nodeName": "n",
                "pool": {"name": "n", "generation": 1, "resourceSliceCount": 1},
                "devices": [{"name": "gpu-0"}, {"name": "gpu-1"}]}}))
                .unwrap(),
            ],
        };
        let class: DeviceClass = serde_json::from_value(json!({"metadata": {"name": "gpu"},
            "spec": {"selectors": [{"cel": {"expression": "device.driver == \"gpu.drust.dev\""}}]}}))
        .unwrap();
        let template = |count: i64| -> ResourceClaimTemplate {
            serde_json::from_value(json!({"metadata": {"name": "t", "namespace": "default"},
                "spec": {"spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
                    "deviceClassName": "gpu", "allocationMode": "ExactCount", "count": count}}]}}}}))
            .unwrap()
        };
        let warnings = template_warnings(
            &template(3),
            None,
            Some(&cluster),
            std::slice::from_ref(&class),
        );
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert_eq!(warnings[0].0, "spec.spec.devices");
        assert!(
            warnings[0]
                .1
                .contains("no node of the given slices (1) can satisfy this claim"),
            "{}",
            warnings[0].1
        );
        assert!(template_warnings(&template(2), None, Some(&cluster), &[class]).is_empty());
    }
}
