//! What users submitted, read from a live cluster for `dractl simulate --pending
//! KIND/NAMESPACE/NAME`: a PodGroup with its pending pods, a Job, or a JobSet, with the
//! ResourceClaimTemplates and ResourceClaims their pods (and PodGroup) name, ready for
//! [`crate::simulate::simulate_job`] as if the same objects had been given with `--job` and
//! `--pod-group`.
//!
//! - `podgroup/NS/NAME`: the PodGroup (`scheduling.k8s.io` v1beta1, Kubernetes 1.37, else
//!   v1alpha2, 1.36) and its pending pods: the namespace's pods whose
//!   `spec.schedulingGroup.podGroupName` names it and that are bound to no node, in name order;
//!   pods with the same `spec.resourceClaims` form one role. At least one must exist (the
//!   scheduler, too, considers only pods it has).
//! - `job/NS/NAME`, `jobset/NS/NAME` (`jobset.x-k8s.io/v1alpha2`): the object read as
//!   [`crate::workload::parse`] reads a file, all its pods to place; meant for one that does not
//!   run yet (suspended by Kueue while it waits for quota, or just created). One with a pod
//!   already bound to a node is refused: its devices are already in the cluster's allocated
//!   claims, and simulating all of its pods again would count them twice. When its pod template
//!   names a PodGroup, that PodGroup is read too.
//!
//! Templates and unallocated ResourceClaims are read from the object's namespace; allocated
//! claims are the cluster's ([`crate::live::load_cluster`]). Read-only; RBAC (besides
//! [`crate::live::load_cluster`]'s): `list` on `pods`, `resourceclaimtemplates` and
//! `resourceclaims`, and `get` on the object's kind (`podgroups.scheduling.k8s.io`,
//! `jobs.batch`, `jobsets.jobset.x-k8s.io`): `deploy/rbac/dractl-explain.yaml`.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams};
use serde_json::Value;

use crate::live::{Connection, LiveError, call};
use crate::objects::{InputError, Location};
use crate::podgroup::{ClaimSource, GroupClaim};
use crate::simulate::PodGroupInput;
use crate::workload::{JobManifest, Role};

/// What `--pending` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `podgroup/NS/NAME`.
    PodGroup,
    /// `job/NS/NAME`.
    Job,
    /// `jobset/NS/NAME`.
    JobSet,
}

/// `--pending KIND/NAMESPACE/NAME`, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// The kind.
    pub kind: Kind,
    /// The namespace.
    pub namespace: String,
    /// The name.
    pub name: String,
}

impl std::str::FromStr for Target {
    type Err = String;

    /// `podgroup|job|jobset/NAMESPACE/NAME` (kinds in any case, `podgroups`, `jobs`, `jobsets`
    /// too, as kubectl takes them).
    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.splitn(3, '/');
        let (Some(kind), Some(namespace), Some(name)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(format!("{s:?}: expected KIND/NAMESPACE/NAME"));
        };
        let kind = match kind.to_ascii_lowercase().as_str() {
            "podgroup" | "podgroups" => Kind::PodGroup,
            "job" | "jobs" => Kind::Job,
            "jobset" | "jobsets" => Kind::JobSet,
            other => {
                return Err(format!(
                    "{s:?}: kind {other:?}: expected podgroup, job or jobset"
                ));
            }
        };
        if namespace.is_empty() || name.is_empty() || name.contains('/') {
            return Err(format!("{s:?}: expected KIND/NAMESPACE/NAME"));
        }
        Ok(Target {
            kind,
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        })
    }
}

/// What was read for the target.
#[derive(Debug, Clone)]
pub struct Pending {
    /// The Job, the JobSet, or the PodGroup's pending pods as one.
    pub manifest: JobManifest,
    /// The PodGroup, when the target is one or its pods name one.
    pub pod_group: Option<PodGroupInput>,
}

/// Why the target cannot be simulated.
#[derive(Debug, thiserror::Error)]
pub enum PendingError {
    /// The cluster could not be read.
    #[error(transparent)]
    Live(#[from] LiveError),
    /// An object read is not what dractl can simulate (bad input: exit status 2).
    #[error(transparent)]
    Input(#[from] InputError),
}

/// The location of an object read from the cluster, for messages.
fn location() -> Location {
    Location {
        file: "(cluster)".to_owned(),
        document: 0,
        item: None,
    }
}

/// Reads the target and what its pods name.
///
/// # Errors
/// [`PendingError::Live`] when an API call fails or times out (each within
/// [`crate::live::CALL_TIMEOUT`]), the object does not exist included;
/// [`PendingError::Input`] naming the object and field when it cannot be simulated (no pending
/// pod, a pod already bound, a malformed field).
pub async fn load(connection: &Connection, target: &Target) -> Result<Pending, PendingError> {
    let client = crate::live::client(connection).await?;
    let ns = target.namespace.as_str();
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let lp = ListParams::default();
    let all_pods = call(&format!("list pods in {ns}"), pods.list(&lp))
        .await?
        .items;
    let mut manifest = match target.kind {
        Kind::PodGroup => group_pods(target, &all_pods)?,
        Kind::Job | Kind::JobSet => {
            let (gvk, plural, label) = if target.kind == Kind::Job {
                (
                    GroupVersionKind::gvk("batch", "v1", "Job"),
                    "jobs",
                    "batch.kubernetes.io/controller-uid",
                )
            } else {
                (
                    GroupVersionKind::gvk("jobset.x-k8s.io", "v1alpha2", "JobSet"),
                    "jobsets",
                    "jobset.sigs.k8s.io/jobset-name",
                )
            };
            let resource = ApiResource::from_gvk_with_plural(&gvk, plural);
            let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &resource);
            let what = format!("get {} {ns}/{}", gvk.kind.to_ascii_lowercase(), target.name);
            let object = call(&what, api.get(&target.name)).await?;
            // A Job's pods carry its UID, a JobSet's its name.
            let owner = match target.kind {
                Kind::Job => object.metadata.uid.clone().unwrap_or_default(),
                _ => target.name.clone(),
            };
            let value = serde_json::to_value(&object).map_err(|e| LiveError::Api {
                what,
                error: e.to_string(),
            })?;
            let manifest = crate::workload::parse(location(), &value)?;
            refuse_bound(&manifest, &all_pods, label, &owner)?;
            manifest
        }
    };
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), ns);
    let templates = call(
        &format!("list resourceclaimtemplates in {ns}"),
        templates.list(&lp),
    )
    .await?
    .items;
    let template_docs = || {
        templates
            .iter()
            .filter_map(|t| serde_json::to_value(t).ok())
            .map(|mut v| {
                v["kind"] = Value::from("ResourceClaimTemplate");
                (location(), v)
            })
            .collect::<Vec<_>>()
    };
    manifest.templates = crate::simulate::read_claims(template_docs())?;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), ns);
    manifest.named = call(&format!("list resourceclaims in {ns}"), claims.list(&lp))
        .await?
        .items
        .into_iter()
        .filter(|c| !dra_allocator::is_allocated(c))
        .collect();
    let pod_group = match (target.kind, &manifest.pod_group) {
        (Kind::PodGroup, _) => Some(target.name.clone()),
        (_, group) => group.clone(),
    };
    let pod_group = match pod_group {
        None => None,
        Some(name) => {
            let value = get_pod_group(&client, ns, &name).await?;
            Some(PodGroupInput {
                pod_group: crate::podgroup::parse(location(), &value)?,
                templates: manifest.templates.clone(),
                claims: manifest.named.clone(),
            })
        }
    };
    Ok(Pending {
        manifest,
        pod_group,
    })
}

/// The PodGroup `ns/name` as JSON: `scheduling.k8s.io/v1beta1` where served, else `v1alpha2`.
async fn get_pod_group(client: &kube::Client, ns: &str, name: &str) -> Result<Value, LiveError> {
    let mut last = None;
    for version in ["v1beta1", "v1alpha2"] {
        let resource = ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("scheduling.k8s.io", version, "PodGroup"),
            "podgroups",
        );
        let groups: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &resource);
        let what = format!("get podgroup {ns}/{name} (scheduling.k8s.io/{version})");
        match tokio::time::timeout(crate::live::CALL_TIMEOUT, groups.get(name)).await {
            Ok(Ok(group)) => {
                return serde_json::to_value(&group).map_err(|e| LiveError::Api {
                    what,
                    error: e.to_string(),
                });
            }
            // Not served in this version, or no such object: try the other version.
            Ok(Err(kube::Error::Api(s))) if s.code == 404 => {
                last = Some(LiveError::Api {
                    what,
                    error: s.to_string(),
                });
            }
            Ok(Err(e)) => {
                return Err(LiveError::Api {
                    what,
                    error: e.to_string(),
                });
            }
            Err(_) => {
                return Err(LiveError::Api {
                    what,
                    error: format!("no answer within {:?}", crate::live::CALL_TIMEOUT),
                });
            }
        }
    }
    Err(last.unwrap_or_else(|| LiveError::Api {
        what: format!("get podgroup {ns}/{name}"),
        error: "not found".to_owned(),
    }))
}

/// A Job or JobSet with a pod bound to a node is running: refused (see the module docs).
fn refuse_bound(
    manifest: &JobManifest,
    pods: &[Pod],
    label: &str,
    value: &str,
) -> Result<(), InputError> {
    let bound: Vec<&str> = pods
        .iter()
        .filter(|p| {
            p.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(label))
                .is_some_and(|v| v == value)
                && p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some()
        })
        .filter_map(|p| p.metadata.name.as_deref())
        .collect();
    if bound.is_empty() {
        return Ok(());
    }
    Err(manifest.error(
        "status",
        format!(
            "{} of its pods are already bound to nodes ({}): dractl simulate --pending answers \
             for a {} none of whose pods is scheduled (suspended, queued, just created)",
            bound.len(),
            bound.join(", "),
            manifest.kind
        ),
    ))
}

/// A PodGroup's pending pods as one manifest: one role per distinct `spec.resourceClaims`.
fn group_pods(target: &Target, pods: &[Pod]) -> Result<JobManifest, InputError> {
    let mut manifest = JobManifest {
        location: location(),
        kind: "PodGroup",
        namespace: target.namespace.clone(),
        name: target.name.clone(),
        roles: Vec::new(),
        pod_group: Some(target.name.clone()),
        templates: Vec::new(),
        named: Vec::new(),
    };
    let mut pending: Vec<&Pod> = pods
        .iter()
        .filter(|p| {
            let spec = p.spec.as_ref();
            spec.and_then(|s| s.scheduling_group.as_ref())
                .and_then(|g| g.pod_group_name.as_deref())
                == Some(target.name.as_str())
                && spec.and_then(|s| s.node_name.as_ref()).is_none()
                && p.metadata.deletion_timestamp.is_none()
        })
        .collect();
    pending.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    if pending.is_empty() {
        return Err(manifest.error(
            "pods",
            format!(
                "no pending pod in namespace {} names it in spec.schedulingGroup.podGroupName",
                target.namespace
            ),
        ));
    }
    // Pods alike by their claims, in order of their first pod.
    let mut roles: BTreeMap<String, usize> = BTreeMap::new();
    for pod in pending {
        let pod_name = pod.metadata.name.clone().unwrap_or_default();
        let mut claims = Vec::new();
        for (i, c) in pod
            .spec
            .iter()
            .flat_map(|s| s.resource_claims.iter().flatten())
            .enumerate()
        {
            let field = format!("pod {pod_name}: spec.resourceClaims[{i}]");
            let source = match (&c.resource_claim_name, &c.resource_claim_template_name) {
                (Some(n), None) => ClaimSource::Claim(n.clone()),
                (None, Some(t)) => ClaimSource::Template(t.clone()),
                _ => {
                    return Err(manifest.error(
                        &field,
                        "exactly one of resourceClaimName and resourceClaimTemplateName must be set",
                    ));
                }
            };
            claims.push(GroupClaim {
                name: c.name.clone(),
                source,
                field,
            });
        }
        let key = format!(
            "{:?}",
            claims
                .iter()
                .map(|c| (&c.name, &c.source))
                .collect::<Vec<_>>()
        );
        match roles.get(&key) {
            Some(&i) => {
                let role = &mut manifest.roles[i];
                role.count += 1;
                role.pod_names.push(pod_name);
            }
            None => {
                roles.insert(key, manifest.roles.len());
                manifest.roles.push(Role {
                    name: pod_name.clone(),
                    count: 1,
                    gang_with_gate: false,
                    parallelism: 1,
                    claims,
                    pod_names: vec![pod_name],
                });
            }
        }
    }
    Ok(manifest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_kind_namespace_and_name_as_kubectl_spells_kinds() {
        let t: Target = "PodGroup/ml/train".parse().unwrap();
        assert_eq!(
            t,
            Target {
                kind: Kind::PodGroup,
                namespace: "ml".into(),
                name: "train".into()
            }
        );
        assert_eq!("jobs/a/b".parse::<Target>().unwrap().kind, Kind::Job);
        assert_eq!("jobset/a/b".parse::<Target>().unwrap().kind, Kind::JobSet);
        for bad in ["job/a", "job//b", "job/a/", "pod/a/b", "job/a/b/c"] {
            assert!(bad.parse::<Target>().is_err(), "{bad}");
        }
    }

    fn pod(name: &str, group: &str, template: &str, node: Option<&str>) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ml"},
            "spec": {
                "schedulingGroup": {"podGroupName": group},
                "nodeName": node,
                "containers": [{"name": "c", "image": "busybox"}],
                "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template}],
            },
        }))
        .unwrap()
    }

    #[test]
    fn a_pod_groups_pending_pods_form_roles_by_their_claims() {
        let target: Target = "podgroup/ml/train".parse().unwrap();
        let pods = [
            pod("w-2", "train", "four", None),
            pod("d-0", "train", "one", None),
            pod("w-1", "train", "four", None),
            pod("w-0", "train", "four", Some("node-a")),
            pod("x-0", "other", "four", None),
        ];
        let m = group_pods(&target, &pods).unwrap();
        let roles: Vec<_> = m
            .roles
            .iter()
            .map(|r| (r.count, r.pod_names.clone()))
            .collect();
        assert_eq!(
            roles,
            [
                (1, vec!["d-0".to_owned()]),
                (2, vec!["w-1".to_owned(), "w-2".to_owned()])
            ]
        );
        let e = group_pods(&"podgroup/ml/none".parse().unwrap(), &pods)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("(PodGroup ml/none): pods: no pending pod in namespace ml names it"),
            "{e}"
        );
    }
}
