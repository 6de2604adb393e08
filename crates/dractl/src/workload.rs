//! A Job manifest as `dractl simulate --job` reads it: how many pods run at once, the claims
//! of its pod template, and whether it is a gang.
//!
//! `batch/v1` Job: `spec.parallelism` pods (default 1) of `spec.template`, whose
//! `spec.resourceClaims` name ResourceClaimTemplates (one claim per pod) or ResourceClaims (one
//! claim all pods share), and whose `spec.schedulingGroup.podGroupName` may name a PodGroup
//! (then given with `--pod-group`). An Indexed Job with `completions` equal to `parallelism`
//! (more than 1) and no scheduling group is what Kubernetes 1.36's Job controller turns into a
//! gang of `minCount` = `parallelism` under the `WorkloadWithJob` gate (alpha, off; k8s.io/kubernetes
//! v1.36.3 `pkg/controller/job/job_scheduling_manager.go`, `shouldManageWorkloadForJob`;
//! KEP-5547): [`JobManifest::gang_with_gate`]. JobSets are not read.

use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::Value;

use crate::objects::{InputError, Location};
use crate::podgroup::{ClaimSource, GroupClaim};

/// The Job.
#[derive(Debug, Clone)]
pub struct JobManifest {
    /// Where it was read.
    pub location: Location,
    /// Its namespace (`default` when not given).
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Pods at once.
    pub parallelism: usize,
    /// Indexed, `completions` = `parallelism` > 1, no scheduling group: a gang of
    /// `parallelism` where the `WorkloadWithJob` gate is on.
    pub gang_with_gate: bool,
    /// `spec.template.spec.schedulingGroup.podGroupName`.
    pub pod_group: Option<String>,
    /// `spec.template.spec.resourceClaims`.
    pub claims: Vec<GroupClaim>,
    /// ResourceClaimTemplates in the files, as the claims they make.
    pub templates: Vec<ResourceClaim>,
    /// ResourceClaims in the files.
    pub named: Vec<ResourceClaim>,
}

impl JobManifest {
    /// An error about one field of this Job.
    pub fn error(&self, field: &str, message: impl std::fmt::Display) -> InputError {
        InputError {
            location: Some(self.location.clone()),
            object: Some(format!("Job {}/{}", self.namespace, self.name)),
            message: format!("{field}: {message}"),
        }
    }
}

/// Reads `--job` files: exactly one `batch/v1` Job, plus the ResourceClaimTemplates and
/// ResourceClaims its pods name.
///
/// # Errors
/// An [`InputError`] naming the file, document, object and field: no Job or several, a
/// `parallelism` or `completions` that is not a non-negative integer, `parallelism` 0, no pod
/// template, a claim entry without a name or naming neither or both sources.
pub fn read_job(files: &[String]) -> Result<JobManifest, InputError> {
    let mut jobs = Vec::new();
    let mut templates = Vec::new();
    let mut named = Vec::new();
    for file in files {
        let text = crate::objects::read_input(file)?;
        for (location, value) in crate::objects::documents(file, &text)? {
            match value.get("kind").and_then(Value::as_str) {
                Some("Job") => jobs.push((location, value)),
                Some("ResourceClaimTemplate") => templates.push((location, value)),
                Some("ResourceClaim") => named.push((location, value)),
                other => {
                    return Err(InputError::general(format!(
                        "{location}: kind {other:?}: expected a Job, or the \
                         ResourceClaimTemplates and ResourceClaims its pods name"
                    )));
                }
            }
        }
    }
    let (location, value) = match jobs.len() {
        1 => jobs.remove(0),
        0 => return Err(InputError::general("--job: no Job in the files")),
        n => {
            return Err(InputError::general(format!(
                "--job: {n} Jobs in the files: simulate one at a time"
            )));
        }
    };
    let mut job = parse(location, &value)?;
    job.templates = crate::simulate::read_claims(templates)?;
    job.named = crate::simulate::read_claims(named)?;
    Ok(job)
}

fn parse(location: Location, value: &Value) -> Result<JobManifest, InputError> {
    let mut job = JobManifest {
        location,
        namespace: value["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .to_owned(),
        name: value["metadata"]["name"].as_str().unwrap_or("").to_owned(),
        parallelism: 1,
        gang_with_gate: false,
        pod_group: None,
        claims: Vec::new(),
        templates: Vec::new(),
        named: Vec::new(),
    };
    if value["apiVersion"] != "batch/v1" {
        return Err(job.error(
            "apiVersion",
            format!("{}: dractl reads batch/v1 Jobs", value["apiVersion"]),
        ));
    }
    if job.name.is_empty() {
        return Err(job.error("metadata.name", "required"));
    }
    let spec = &value["spec"];
    let count = |field: &str| -> Result<Option<usize>, InputError> {
        let v = &spec[field];
        if v.is_null() {
            return Ok(None);
        }
        v.as_u64()
            .map(|n| Some(usize::try_from(n).unwrap_or(usize::MAX)))
            .ok_or_else(|| {
                job.error(
                    &format!("spec.{field}"),
                    format!("{v}: must be a non-negative integer"),
                )
            })
    };
    let parallelism = count("parallelism")?.unwrap_or(1);
    let completions = count("completions")?;
    if parallelism == 0 {
        return Err(job.error("spec.parallelism", "0: the Job runs no pod"));
    }
    job.parallelism = parallelism;
    let pod = &spec["template"]["spec"];
    if !pod.is_object() {
        return Err(job.error("spec.template.spec", "required"));
    }
    job.pod_group = pod["schedulingGroup"]["podGroupName"]
        .as_str()
        .map(str::to_owned);
    job.gang_with_gate = spec["completionMode"] == "Indexed"
        && parallelism > 1
        && completions == Some(parallelism)
        && job.pod_group.is_none();
    for (i, item) in pod["resourceClaims"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let field = format!("spec.template.spec.resourceClaims[{i}]");
        let name = item["name"].as_str().unwrap_or("");
        if name.is_empty() {
            return Err(job.error(&format!("{field}.name"), "required"));
        }
        let source = match (
            item["resourceClaimName"].as_str(),
            item["resourceClaimTemplateName"].as_str(),
        ) {
            (Some(c), None) if !c.is_empty() => ClaimSource::Claim(c.to_owned()),
            (None, Some(t)) if !t.is_empty() => ClaimSource::Template(t.to_owned()),
            _ => {
                return Err(job.error(
                    &field,
                    "exactly one of resourceClaimName and resourceClaimTemplateName must be set",
                ));
            }
        };
        job.claims.push(GroupClaim {
            name: name.to_owned(),
            source,
            field,
        });
    }
    Ok(job)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn location() -> Location {
        Location {
            file: "job.yaml".into(),
            document: 0,
            item: None,
        }
    }

    fn job(spec: Value) -> Value {
        json!({"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "train", "namespace": "ml"}, "spec": spec})
    }

    #[test]
    fn an_indexed_job_with_completions_equal_to_parallelism_is_a_gang_under_the_gate() {
        let template = json!({"spec": {"resourceClaims": [
            {"name": "gpus", "resourceClaimTemplateName": "four-h100"}]}});
        let indexed = parse(
            location(),
            &job(
                json!({"parallelism": 4, "completions": 4, "completionMode": "Indexed",
                "template": template}),
            ),
        )
        .unwrap();
        assert_eq!(indexed.parallelism, 4);
        assert!(indexed.gang_with_gate);
        assert_eq!(
            indexed.claims[0].source,
            ClaimSource::Template("four-h100".into())
        );
        let plain = parse(
            location(),
            &job(
                json!({"parallelism": 4, "completions": 8, "completionMode": "Indexed",
                "template": template}),
            ),
        )
        .unwrap();
        assert!(!plain.gang_with_gate);
    }

    #[test]
    fn each_malformed_field_is_named() {
        for (spec, want) in [
            (
                json!({"parallelism": -1, "template": {"spec": {}}}),
                "spec.parallelism: -1: must be a non-negative integer",
            ),
            (
                json!({"parallelism": 0, "template": {"spec": {}}}),
                "spec.parallelism: 0: the Job runs no pod",
            ),
            (json!({"parallelism": 2}), "spec.template.spec: required"),
            (
                json!({"template": {"spec": {"resourceClaims": [{"name": "x"}]}}}),
                "spec.template.spec.resourceClaims[0]: exactly one of resourceClaimName and resourceClaimTemplateName must be set",
            ),
        ] {
            let e = parse(location(), &job(spec)).unwrap_err().to_string();
            assert!(
                e.starts_with("job.yaml: document 0 (Job ml/train): ") && e.contains(want),
                "{e}\nwant: {want}"
            );
        }
    }
}
