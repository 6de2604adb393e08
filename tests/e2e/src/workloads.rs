//! A gang's Workload and PodGroup manifests in the `scheduling.k8s.io` version the running
//! Kubernetes serves ([`KubernetesVersion::scheduling_api_version`]).
//!
//! The two versions differ here only in how a PodGroup names its Workload's template:
//! `v1alpha2` (k8s.io/api v0.36.3 `scheduling/v1alpha2/types.go`) has
//! `podGroupTemplateRef: {workload: {workloadName, podGroupTemplateName}}`, `v1beta1` (v0.37.2
//! `scheduling/v1beta1/types.go`) has `workloadRef: {workloadName, templateName}`. The
//! Workload's `podGroupTemplates[].schedulingPolicy.gang.minCount` and the PodGroup's
//! `schedulingPolicy`, `schedulingConstraints` and `resourceClaims` read the same in both.

use crate::kubernetes::KubernetesVersion;

/// The name of the Workload's one PodGroup template.
pub const TEMPLATE: &str = "workers";

/// A Workload `name` in namespace `default` with one gang template of `min_count`, and the
/// PodGroup `name` made from it, whose `spec` ends with `pod_group_spec` (YAML lines indented by
/// two spaces, each ending in a newline: constraints, claims; may be empty). Two documents,
/// separated by `---`, ending in a newline.
pub fn gang(
    version: KubernetesVersion,
    name: &str,
    min_count: u32,
    pod_group_spec: &str,
) -> String {
    let api = version.scheduling_api_version();
    let reference = match version {
        KubernetesVersion::V1_36 => format!(
            "podGroupTemplateRef: {{workload: {{workloadName: {name}, podGroupTemplateName: {TEMPLATE}}}}}"
        ),
        KubernetesVersion::V1_37 => {
            format!("workloadRef: {{workloadName: {name}, templateName: {TEMPLATE}}}")
        }
    };
    format!(
        "apiVersion: {api}
kind: Workload
metadata: {{name: {name}, namespace: default}}
spec:
  podGroupTemplates:
    - name: {TEMPLATE}
      schedulingPolicy: {{gang: {{minCount: {min_count}}}}}
---
apiVersion: {api}
kind: PodGroup
metadata: {{name: {name}, namespace: default}}
spec:
  {reference}
  schedulingPolicy: {{gang: {{minCount: {min_count}}}}}
{pod_group_spec}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn docs(text: &str) -> Vec<serde_json::Value> {
        text.split("\n---\n")
            .map(|d| serde_yaml_ng::from_str(d).unwrap())
            .collect()
    }

    #[test]
    fn each_version_names_the_template_its_own_way() {
        let extra = "  schedulingConstraints:\n    topology: [{key: clique}]\n";
        let old = docs(&gang(KubernetesVersion::V1_36, "train", 4, extra));
        assert_eq!(old[0]["apiVersion"], "scheduling.k8s.io/v1alpha2");
        assert_eq!(
            old[1]["spec"]["podGroupTemplateRef"]["workload"]["podGroupTemplateName"],
            TEMPLATE
        );
        assert_eq!(
            old[1]["spec"]["schedulingConstraints"]["topology"][0]["key"],
            "clique"
        );
        let new = docs(&gang(KubernetesVersion::V1_37, "train", 4, ""));
        assert_eq!(new[1]["apiVersion"], "scheduling.k8s.io/v1beta1");
        assert_eq!(new[1]["spec"]["workloadRef"]["workloadName"], "train");
        assert_eq!(new[1]["spec"]["workloadRef"]["templateName"], TEMPLATE);
        assert!(new[1]["spec"]["podGroupTemplateRef"].is_null());
        assert_eq!(
            new[0]["spec"]["podGroupTemplates"][0]["schedulingPolicy"]["gang"]["minCount"],
            4
        );
    }
}
