//! What the controller makes and writes for a domain: its channel claim template, the daemons'
//! ConfigMap and Pods, the binding conditions on its channel claims, its Warning events, and
//! the clean-up its finalizer waits for.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, PoisonError};

use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use serde_json::json;

use crate::crd::{ComputeDomainNode, Condition, Domain};
use crate::imex::{self, DOMAIN_UID_LABEL};
use crate::membership::{self, Channel};
use crate::reconcile::{Binding, condition, now};
use crate::*;

impl<D: Domain> Context<D> {
    /// A Warning event on the domain, once per distinct (reason, note).
    pub(crate) async fn warn(&self, domain: &D, uid: &str, reason: &str, note: &str) {
        let key = (uid.to_owned(), reason.to_owned(), note.to_owned());
        if !self
            .published
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key)
        {
            return;
        }
        let mut note = note.to_owned();
        if note.len() > 1000 {
            let mut cut = 1000;
            while !note.is_char_boundary(cut) {
                cut -= 1;
            }
            note.truncate(cut);
        }
        let event = Event {
            type_: EventType::Warning,
            reason: reason.to_owned(),
            note: Some(note),
            action: "Reconcile".to_owned(),
            secondary: None,
        };
        let reference = domain.object_ref(&());
        let publish = self.recorder.publish(&event, &reference);
        match tokio::time::timeout(self.settings.api_timeout, publish).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, %reason, "publishing an event"),
            Err(_) => tracing::warn!(%reason, "publishing an event: no answer"),
        }
    }

    /// Creates the template if missing. A template of that name that is not this domain's is
    /// left alone: the condition to report (and a Warning event).
    pub(crate) async fn ensure_template(
        &self,
        domain: &D,
        uid: &str,
        key: &str,
    ) -> Result<Option<Condition>, Error> {
        let ns = domain.namespace().unwrap_or_default();
        let spec = domain.domain_spec();
        let tname = spec.channel.resource_claim_template.name.clone();
        if tname.is_empty() {
            // Bad input: said in the status and an event, not retried until the spec changes.
            let m =
                format!("ComputeDomain {key}: spec.channel.resourceClaimTemplate.name is empty");
            self.warn(domain, uid, "InvalidSpec", &m).await;
            return Ok(Some(condition("InvalidSpec", "EmptyTemplateName", &m)));
        }
        let api = Api::<ResourceClaimTemplate>::namespaced(self.client.clone(), &ns);
        let object = || format!("ResourceClaimTemplate {ns}/{tname}");
        let existing = call(
            self.settings.api_timeout,
            "get",
            object,
            api.get_opt(&tname),
        )
        .await?;
        let conflict = |t: &ResourceClaimTemplate| {
            let owned = t
                .owner_references()
                .iter()
                .any(|o| o.uid == uid && o.controller == Some(true));
            (!owned).then(|| {
                format!(
                    "ResourceClaimTemplate {ns}/{tname} (spec.channel.resourceClaimTemplate.name) \
                     exists and is not this ComputeDomain's; it is left as it is"
                )
            })
        };
        let message = match existing {
            Some(t) => conflict(&t),
            None => {
                let template =
                    build_template::<D>(domain, uid).map_err(|problem| Error::Build {
                        domain: key.to_owned(),
                        problem,
                    })?;
                match tokio::time::timeout(
                    self.settings.api_timeout,
                    api.create(&PostParams::default(), &template),
                )
                .await
                {
                    Ok(Ok(_)) => None,
                    // Created meanwhile by someone else: look again next time.
                    Ok(Err(e)) if is_status(&e, 409) => Some(format!(
                        "ResourceClaimTemplate {ns}/{tname} appeared meanwhile"
                    )),
                    Ok(Err(e)) => {
                        return Err(Error::Api {
                            action: "create",
                            object: object(),
                            problem: e.to_string(),
                        });
                    }
                    Err(_) => {
                        return Err(Error::Api {
                            action: "create",
                            object: object(),
                            problem: "no answer".to_owned(),
                        });
                    }
                }
            }
        };
        Ok(match message {
            Some(m) => {
                self.warn(domain, uid, TEMPLATE_CONFLICT, &m).await;
                Some(condition(TEMPLATE_CONFLICT, "TemplateNotOwned", &m))
            }
            None => None,
        })
    }

    /// The domain's ConfigMap, applied (a no-op write when unchanged).
    pub(crate) async fn apply_config_map(
        &self,
        uid: &str,
        domain: &str,
        nodes: &[ComputeDomainNode],
    ) -> Result<(), Error> {
        let s = &self.settings.daemon;
        let cm = imex::config_map(s, uid, nodes).map_err(|problem| Error::Build {
            domain: domain.to_owned(),
            problem,
        })?;
        let name = imex::config_map_name(uid);
        let api = Api::<ConfigMap>::namespaced(self.client.clone(), &s.namespace);
        call(
            self.settings.api_timeout,
            "apply",
            || format!("ConfigMap {}/{name}", s.namespace),
            api.patch(
                &name,
                &PatchParams::apply(&self.settings.field_manager).force(),
                &Patch::Apply(&cm),
            ),
        )
        .await
        .map(|_| ())
    }

    /// A daemon Pod on every member that has none; none on nodes that are not members.
    pub(crate) async fn sync_pods(
        &self,
        uid: &str,
        domain: &str,
        nodes: &[ComputeDomainNode],
        existing: &BTreeMap<String, Pod>,
    ) -> Result<(), Error> {
        let s = &self.settings.daemon;
        let api = Api::<Pod>::namespaced(self.client.clone(), &s.namespace);
        for node in nodes {
            let name = imex::pod_name(uid, &node.name);
            if existing.contains_key(&name) {
                continue;
            }
            let pod = imex::daemon_pod(s, domain, uid, &node.name, &node.clique_id).map_err(
                |problem| Error::Build {
                    domain: domain.to_owned(),
                    problem,
                },
            )?;
            match tokio::time::timeout(
                self.settings.api_timeout,
                api.create(&PostParams::default(), &pod),
            )
            .await
            {
                Ok(Ok(_)) => {}
                // The cache is behind: it exists.
                Ok(Err(e)) if is_status(&e, 409) => {}
                Ok(Err(e)) => {
                    return Err(Error::Api {
                        action: "create",
                        object: format!("Pod {}/{name}", s.namespace),
                        problem: e.to_string(),
                    });
                }
                Err(_) => {
                    return Err(Error::Api {
                        action: "create",
                        object: format!("Pod {}/{name}", s.namespace),
                        problem: "no answer".to_owned(),
                    });
                }
            }
        }
        let members: BTreeSet<String> =
            nodes.iter().map(|n| imex::pod_name(uid, &n.name)).collect();
        for name in existing.keys() {
            if !members.contains(name) {
                self.delete_pod(&api, name).await?;
            }
        }
        Ok(())
    }

    pub(crate) async fn delete_pod(&self, api: &Api<Pod>, name: &str) -> Result<(), Error> {
        let ns = &self.settings.daemon.namespace;
        match tokio::time::timeout(
            self.settings.api_timeout,
            api.delete(name, &DeleteParams::default()),
        )
        .await
        {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) if is_status(&e, 404) => Ok(()),
            Ok(Err(e)) => Err(Error::Api {
                action: "delete",
                object: format!("Pod {ns}/{name}"),
                problem: e.to_string(),
            }),
            Err(_) => Err(Error::Api {
                action: "delete",
                object: format!("Pod {ns}/{name}"),
                problem: "no answer".to_owned(),
            }),
        }
    }

    /// The binding conditions of `claim`'s channels, by server-side apply on its status (only
    /// the controller's own conditions: the scheduler's and the plugin's fields stay).
    pub(crate) async fn set_bindings(
        &self,
        claim: Arc<ResourceClaim>,
        desired: Vec<(Channel, Binding)>,
    ) -> Result<(), Error> {
        let ns = claim.namespace().unwrap_or_default();
        let name = claim.name_any();
        let time = now();
        let devices: Vec<serde_json::Value> = desired
            .iter()
            .map(|(ch, b)| {
                let (type_, reason, message) = match b {
                    Binding::Ready => (
                        READY_CONDITION,
                        "DaemonReady",
                        format!("the IMEX daemon on node {} is Ready", ch.node),
                    ),
                    Binding::Failed { reason, message } => {
                        (FAILED_CONDITION, reason.as_str(), message.clone())
                    }
                };
                let mut entry = json!({
                    "driver": ch.driver, "pool": ch.pool, "device": ch.device,
                    "conditions": [{"type": type_, "status": "True", "reason": reason,
                                    "message": message, "lastTransitionTime": time}],
                });
                if let Some(id) = &ch.share_id {
                    entry["shareID"] = json!(id);
                }
                entry
            })
            .collect();
        let patch = json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "status": {"devices": devices},
        });
        let api = Api::<ResourceClaim>::namespaced(self.client.clone(), &ns);
        let result = tokio::time::timeout(
            self.settings.api_timeout,
            api.patch_status(
                &name,
                &PatchParams::apply(&self.settings.field_manager).force(),
                &Patch::Apply(&patch),
            ),
        )
        .await;
        match result {
            Ok(Ok(_)) => Ok(()),
            // Deleted or deallocated meanwhile: nothing to mark.
            Ok(Err(e)) if is_status(&e, 404) => Ok(()),
            Ok(Err(e)) => Err(Error::Api {
                action: "apply the binding conditions of",
                object: format!("ResourceClaim {ns}/{name}"),
                problem: e.to_string(),
            }),
            Err(_) => Err(Error::Api {
                action: "apply the binding conditions of",
                object: format!("ResourceClaim {ns}/{name}"),
                problem: "no answer".to_owned(),
            }),
        }
    }

    /// A deleted domain: its daemon Pods and ConfigMap go, its holdings are released, then
    /// the finalizer.
    pub(crate) async fn finalize(
        &self,
        api: &Api<D>,
        domain: &D,
        uid: &str,
        key: &str,
    ) -> Result<Action, Error> {
        let s = &self.settings.daemon;
        let pods = Api::<Pod>::namespaced(self.client.clone(), &s.namespace);
        let by_domain = ListParams::default().labels(&format!("{DOMAIN_UID_LABEL}={uid}"));
        let listed = call(
            self.settings.api_timeout,
            "list the daemon Pods of",
            || format!("ComputeDomain {key}"),
            pods.list(&by_domain),
        )
        .await?;
        for pod in listed.items {
            self.delete_pod(&pods, &pod.name_any()).await?;
        }
        let cms = Api::<ConfigMap>::namespaced(self.client.clone(), &s.namespace);
        let cm = imex::config_map_name(uid);
        match tokio::time::timeout(
            self.settings.api_timeout,
            cms.delete(&cm, &DeleteParams::default()),
        )
        .await
        {
            Ok(Ok(_)) => {}
            Ok(Err(e)) if is_status(&e, 404) => {}
            Ok(Err(e)) => {
                return Err(Error::Api {
                    action: "delete",
                    object: format!("ConfigMap {}/{cm}", s.namespace),
                    problem: e.to_string(),
                });
            }
            Err(_) => {
                return Err(Error::Api {
                    action: "delete",
                    object: format!("ConfigMap {}/{cm}", s.namespace),
                    problem: "no answer".to_owned(),
                });
            }
        }
        self.release(uid);
        self.published
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|(u, _, _)| u != uid);
        if domain.finalizers().iter().any(|f| f == FINALIZER) {
            let finalizers: Vec<&String> = domain
                .finalizers()
                .iter()
                .filter(|f| *f != FINALIZER)
                .collect();
            let patch = json!({"metadata": {"finalizers": finalizers,
                               "resourceVersion": domain.resource_version()}});
            match tokio::time::timeout(
                self.settings.api_timeout,
                api.patch(
                    &domain.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                ),
            )
            .await
            {
                Ok(Ok(_)) => {}
                Ok(Err(e)) if is_status(&e, 404) => {}
                Ok(Err(e)) => {
                    return Err(Error::Api {
                        action: "remove the finalizer of",
                        object: format!("ComputeDomain {key}"),
                        problem: e.to_string(),
                    });
                }
                Err(_) => {
                    return Err(Error::Api {
                        action: "remove the finalizer of",
                        object: format!("ComputeDomain {key}"),
                        problem: "no answer".to_owned(),
                    });
                }
            }
        }
        Ok(Action::await_change())
    }
}

/// The workload's ResourceClaimTemplate: one request of [`CHANNEL_CLASS`] (one device, or all
/// of the node's with `allocationMode: All`), the opaque `ComputeDomainChannelConfig` naming
/// the domain, and the domain label on the claims made from it; owned by the domain.
///
/// # Errors
/// When the object does not build (a message naming the template).
pub fn build_template<D: Domain>(domain: &D, uid: &str) -> Result<ResourceClaimTemplate, String> {
    let spec = domain.domain_spec();
    let name = &spec.channel.resource_claim_template.name;
    let all = spec.channel.allocation_mode == Some(crd::AllocationMode::All);
    let exactly = if all {
        json!({"deviceClassName": CHANNEL_CLASS, "allocationMode": "All"})
    } else {
        json!({"deviceClassName": CHANNEL_CLASS, "allocationMode": "ExactCount", "count": 1})
    };
    let mut parameters = json!({
        "apiVersion": D::CONFIG_API_VERSION,
        "kind": "ComputeDomainChannelConfig",
        "domainID": uid,
    });
    if all {
        parameters["allocationMode"] = json!("All");
    }
    let template = json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": name,
            "namespace": domain.namespace(),
            "labels": {"app.kubernetes.io/managed-by": imex::MANAGED_BY},
            "ownerReferences": [{
                "apiVersion": D::api_version(&()), "kind": D::kind(&()),
                "name": domain.name_any(), "uid": uid,
                "controller": true, "blockOwnerDeletion": true,
            }],
        },
        "spec": {
            "metadata": {"labels": {DOMAIN_UID_LABEL: uid}},
            "spec": {"devices": {
                "requests": [{"name": CHANNEL_REQUEST, "exactly": exactly}],
                "config": [{"requests": [CHANNEL_REQUEST], "opaque": {
                    "driver": membership::DRIVER, "parameters": parameters}}],
            }},
        },
    });
    serde_json::from_value(template)
        .map_err(|e| format!("building ResourceClaimTemplate {name}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{DrustComputeDomain, NvidiaComputeDomain};

    pub(crate) fn domain<D: Domain>(api: &str, mode: Option<&str>) -> D {
        serde_json::from_value(json!({
            "apiVersion": api, "kind": "ComputeDomain",
            "metadata": {"name": "cd", "namespace": "ns", "uid": "u-1"},
            "spec": {"channel": {"resourceClaimTemplate": {"name": "cd-channel"},
                     "allocationMode": mode}}
        }))
        .unwrap()
    }

    #[test]
    pub(crate) fn the_template_requests_one_channel_with_the_domain_config_and_label() {
        let d: DrustComputeDomain = domain("compute.drust.dev/v1alpha1", None);
        let t = serde_json::to_value(build_template(&d, "u-1").unwrap()).unwrap();
        assert_eq!(t["spec"]["metadata"]["labels"][DOMAIN_UID_LABEL], "u-1");
        let devices = &t["spec"]["spec"]["devices"];
        assert_eq!(devices["requests"][0]["exactly"]["count"], 1);
        assert_eq!(
            devices["requests"][0]["exactly"]["deviceClassName"],
            CHANNEL_CLASS
        );
        let p = &devices["config"][0]["opaque"]["parameters"];
        assert_eq!(p["apiVersion"], "gpu.drust.dev/v1alpha1");
        assert_eq!(p["kind"], "ComputeDomainChannelConfig");
        assert_eq!(p["domainID"], "u-1");
        assert_eq!(t["metadata"]["ownerReferences"][0]["controller"], true);
    }

    #[test]
    pub(crate) fn nvidia_mode_uses_nvidia_config_api_and_all_mode() {
        let d: NvidiaComputeDomain = domain("resource.nvidia.com/v1beta1", Some("All"));
        let t = serde_json::to_value(build_template(&d, "u-1").unwrap()).unwrap();
        let devices = &t["spec"]["spec"]["devices"];
        assert_eq!(devices["requests"][0]["exactly"]["allocationMode"], "All");
        let p = &devices["config"][0]["opaque"]["parameters"];
        assert_eq!(p["apiVersion"], "resource.nvidia.com/v1beta1");
        assert_eq!(p["allocationMode"], "All");
        assert_eq!(
            t["metadata"]["ownerReferences"][0]["apiVersion"],
            "resource.nvidia.com/v1beta1"
        );
    }
}
