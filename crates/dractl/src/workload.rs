//! A Job or JobSet as `dractl simulate --job` (or `--pending`) reads it: its pods, in roles of
//! pods alike (a Job's pods; each replicated job of a JobSet), the claims of each role's pod
//! template, and whether it is a gang.
//!
//! `batch/v1` Job: `spec.parallelism` pods (default 1) of `spec.template`, whose
//! `spec.resourceClaims` name ResourceClaimTemplates (one claim per pod) or ResourceClaims (one
//! claim all pods share), and whose `spec.schedulingGroup.podGroupName` may name a PodGroup
//! (then given with `--pod-group`). An Indexed Job with `completions` equal to `parallelism`
//! (more than 1) and no scheduling group is what Kubernetes 1.36's Job controller turns into a
//! gang of `minCount` = `parallelism` under the `WorkloadWithJob` gate (alpha, off; k8s.io/kubernetes
//! v1.36.3 `pkg/controller/job/job_scheduling_manager.go`, `shouldManageWorkloadForJob`;
//! KEP-5547): [`Role::gang_with_gate`].
//!
//! `jobset.x-k8s.io/v1alpha2` JobSet (sigs.k8s.io/jobset v0.12 `api/jobset/v1alpha2`):
//! `spec.replicatedJobs[]`, each `replicas` (default 1) Jobs of `template.spec`; a role per
//! replicated job of `replicas` x `parallelism` pods. JobSet v0.12 makes no Workload or PodGroup
//! of its own: a gang is a PodGroup the user made, named by the pod templates'
//! `schedulingGroup` (JobSet's "workload-aware scheduling with DRA" pattern); under the
//! `WorkloadWithJob` gate each child Job that is a gang candidate is a gang of its own, since
//! the Job controller does not look at the Job's owner.

use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::Value;

use crate::objects::{InputError, Location};
use crate::podgroup::{ClaimSource, GroupClaim};

/// `apiVersion` of the JobSets read.
pub const JOBSET_API_VERSION: &str = "jobset.x-k8s.io/v1alpha2";

/// Pods alike: a Job's, or one replicated job's of a JobSet.
#[derive(Debug, Clone)]
pub struct Role {
    /// The prefix of its pods' names: the Job's name, or `<jobset>-<replicated job>`.
    pub name: String,
    /// Pods at once: `parallelism`, times `replicas` in a JobSet.
    pub count: usize,
    /// Indexed, `completions` = `parallelism` > 1, no scheduling group: each of its Jobs is a
    /// gang of `parallelism` where the `WorkloadWithJob` gate is on.
    pub gang_with_gate: bool,
    /// Its Jobs' `parallelism` (the size of each such gang).
    pub parallelism: usize,
    /// The pod template's `spec.resourceClaims`.
    pub claims: Vec<GroupClaim>,
    /// The pods' names when they exist (pending pods read from the cluster); otherwise they
    /// are `<name>-<i>`.
    pub pod_names: Vec<String>,
}

/// The Job or JobSet.
#[derive(Debug, Clone)]
pub struct JobManifest {
    /// Where it was read.
    pub location: Location,
    /// `Job` or `JobSet` (or `PodGroup` for a PodGroup's pending pods read from the
    /// cluster).
    pub kind: &'static str,
    /// Its namespace (`default` when not given).
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its pods, by role (one for a Job).
    pub roles: Vec<Role>,
    /// `schedulingGroup.podGroupName` of the pod templates (the same in every role).
    pub pod_group: Option<String>,
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
            object: Some(self.object()),
            message: format!("{field}: {message}"),
        }
    }

    /// `Job namespace/name` (or `JobSet ...`).
    pub fn object(&self) -> String {
        format!("{} {}/{}", self.kind, self.namespace, self.name)
    }

    /// Pods at once, all roles together.
    pub fn pods(&self) -> usize {
        self.roles.iter().map(|r| r.count).sum()
    }
}

/// Reads `--job` files: exactly one `batch/v1` Job or `jobset.x-k8s.io/v1alpha2` JobSet, plus
/// the ResourceClaimTemplates and ResourceClaims its pods name.
///
/// # Errors
/// An [`InputError`] naming the file, document, object and field: no Job or several, a
/// `parallelism`, `completions` or `replicas` that is not a non-negative integer,
/// `parallelism` 0, no pod template, a claim entry without a name or naming neither or both
/// sources, replicated jobs naming different PodGroups.
pub fn read_job(files: &[String]) -> Result<JobManifest, InputError> {
    let mut jobs = Vec::new();
    let mut templates = Vec::new();
    let mut named = Vec::new();
    for file in files {
        let text = crate::objects::read_input(file)?;
        for (location, value) in crate::objects::documents(file, &text)? {
            match value.get("kind").and_then(Value::as_str) {
                Some("Job" | "JobSet") => jobs.push((location, value)),
                Some("ResourceClaimTemplate") => templates.push((location, value)),
                Some("ResourceClaim") => named.push((location, value)),
                other => {
                    return Err(InputError::general(format!(
                        "{location}: kind {other:?}: expected a Job or JobSet, or the \
                         ResourceClaimTemplates and ResourceClaims its pods name"
                    )));
                }
            }
        }
    }
    let (location, value) = match jobs.len() {
        1 => jobs.remove(0),
        0 => return Err(InputError::general("--job: no Job or JobSet in the files")),
        n => {
            return Err(InputError::general(format!(
                "--job: {n} Jobs and JobSets in the files: simulate one at a time"
            )));
        }
    };
    let mut job = parse(location, &value)?;
    job.templates = crate::simulate::read_claims(templates)?;
    job.named = crate::simulate::read_claims(named)?;
    Ok(job)
}

/// Reads one Job or JobSet document (`--job` files, or one read from the cluster).
///
/// # Errors
/// As [`read_job`].
pub fn parse(location: Location, value: &Value) -> Result<JobManifest, InputError> {
    let kind = match value["kind"].as_str() {
        Some("JobSet") => "JobSet",
        _ => "Job",
    };
    let mut job = JobManifest {
        location,
        kind,
        namespace: value["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .to_owned(),
        name: value["metadata"]["name"].as_str().unwrap_or("").to_owned(),
        roles: Vec::new(),
        pod_group: None,
        templates: Vec::new(),
        named: Vec::new(),
    };
    let want = if kind == "Job" {
        "batch/v1"
    } else {
        JOBSET_API_VERSION
    };
    if value["apiVersion"] != want {
        return Err(job.error(
            "apiVersion",
            format!("{}: dractl reads {want} {kind}s", value["apiVersion"]),
        ));
    }
    if job.name.is_empty() {
        return Err(job.error("metadata.name", "required"));
    }
    if kind == "Job" {
        let (role, group) = role(&job, job.name.clone(), 1, &value["spec"], "spec")?;
        job.pod_group = group;
        job.roles.push(role);
        return Ok(job);
    }
    let replicated = value["spec"]["replicatedJobs"]
        .as_array()
        .filter(|r| !r.is_empty())
        .ok_or_else(|| job.error("spec.replicatedJobs", "required: at least one"))?;
    let mut groups: Vec<(String, Option<String>)> = Vec::new();
    for (i, r) in replicated.iter().enumerate() {
        let field = format!("spec.replicatedJobs[{i}]");
        let name = r["name"]
            .as_str()
            .filter(|n| !n.is_empty())
            .ok_or_else(|| job.error(&format!("{field}.name"), "required"))?;
        let replicas = count(&job, &r["replicas"], &format!("{field}.replicas"))?.unwrap_or(1);
        let (role, group) = role(
            &job,
            format!("{}-{name}", job.name),
            replicas,
            &r["template"]["spec"],
            &format!("{field}.template.spec"),
        )?;
        if replicas > 0 {
            groups.push((field, group));
            job.roles.push(role);
        }
    }
    if let Some((field, group)) = groups.iter().find(|(_, g)| *g != groups[0].1) {
        return Err(job.error(
            &format!("{field}.template.spec.template.spec.schedulingGroup.podGroupName"),
            format!(
                "{group:?}, but {} names {:?}: dractl simulates one group at a time",
                groups[0].0, groups[0].1
            ),
        ));
    }
    job.pod_group = groups.into_iter().next().and_then(|(_, g)| g);
    if job.roles.is_empty() {
        return Err(job.error("spec.replicatedJobs", "every replicas is 0: no pod runs"));
    }
    Ok(job)
}

/// A non-negative integer field, or `None` when absent.
fn count(job: &JobManifest, v: &Value, field: &str) -> Result<Option<usize>, InputError> {
    if v.is_null() {
        return Ok(None);
    }
    v.as_u64()
        .map(|n| Some(usize::try_from(n).unwrap_or(usize::MAX)))
        .ok_or_else(|| job.error(field, format!("{v}: must be a non-negative integer")))
}

/// The role of a Job spec (`spec` of a Job, `template.spec` of a replicated job) run
/// `replicas` times, and its pods' PodGroup.
fn role(
    job: &JobManifest,
    name: String,
    replicas: usize,
    spec: &Value,
    at: &str,
) -> Result<(Role, Option<String>), InputError> {
    let parallelism = count(job, &spec["parallelism"], &format!("{at}.parallelism"))?.unwrap_or(1);
    let completions = count(job, &spec["completions"], &format!("{at}.completions"))?;
    if parallelism == 0 {
        return Err(job.error(&format!("{at}.parallelism"), "0: the Job runs no pod"));
    }
    let pod = &spec["template"]["spec"];
    if !pod.is_object() {
        return Err(job.error(&format!("{at}.template.spec"), "required"));
    }
    let group = pod["schedulingGroup"]["podGroupName"]
        .as_str()
        .map(str::to_owned);
    let mut role = Role {
        name,
        count: parallelism.saturating_mul(replicas),
        gang_with_gate: spec["completionMode"] == "Indexed"
            && parallelism > 1
            && completions == Some(parallelism)
            && group.is_none(),
        parallelism,
        claims: Vec::new(),
        pod_names: Vec::new(),
    };
    for (i, item) in pod["resourceClaims"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let field = format!("{at}.template.spec.resourceClaims[{i}]");
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
        role.claims.push(GroupClaim {
            name: name.to_owned(),
            source,
            field,
        });
    }
    Ok((role, group))
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
        assert_eq!(indexed.pods(), 4);
        assert!(indexed.roles[0].gang_with_gate);
        assert_eq!(
            indexed.roles[0].claims[0].source,
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
        assert!(!plain.roles[0].gang_with_gate);
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

    fn jobset(replicated: Value) -> Value {
        json!({"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": "llm", "namespace": "ml"},
            "spec": {"replicatedJobs": replicated}})
    }

    fn replicated(
        name: &str,
        replicas: u64,
        parallelism: u64,
        claims: Value,
        group: Value,
    ) -> Value {
        json!({"name": name, "replicas": replicas, "template": {"spec": {
            "parallelism": parallelism, "completions": parallelism, "completionMode": "Indexed",
            "template": {"spec": {"resourceClaims": claims, "schedulingGroup": group}}}}})
    }

    #[test]
    fn a_jobset_has_a_role_per_replicated_job_of_replicas_times_parallelism_pods() {
        let driver = replicated(
            "driver",
            1,
            1,
            json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]),
            Value::Null,
        );
        let workers = replicated(
            "workers",
            2,
            4,
            json!([{"name": "gpus", "resourceClaimTemplateName": "four-gpus"}]),
            Value::Null,
        );
        let idle = replicated("idle", 0, 3, json!([]), Value::Null);
        let set = parse(location(), &jobset(json!([driver, workers, idle]))).unwrap();
        assert_eq!(set.object(), "JobSet ml/llm");
        let roles: Vec<_> = set
            .roles
            .iter()
            .map(|r| (r.name.as_str(), r.count, r.gang_with_gate, r.parallelism))
            .collect();
        assert_eq!(
            roles,
            [("llm-driver", 1, false, 1), ("llm-workers", 8, true, 4)]
        );
        assert_eq!(set.pods(), 9);
        assert_eq!(
            set.roles[1].claims[0].field,
            "spec.replicatedJobs[1].template.spec.template.spec.resourceClaims[0]"
        );
        assert_eq!(set.pod_group, None);
    }

    #[test]
    fn a_jobset_whose_replicated_jobs_name_different_pod_groups_is_refused() {
        let a = replicated("a", 1, 2, json!([]), json!({"podGroupName": "g1"}));
        let b = replicated("b", 1, 2, json!([]), json!({"podGroupName": "g2"}));
        let same = parse(location(), &jobset(json!([a.clone(), a.clone()]))).unwrap();
        assert_eq!(same.pod_group.as_deref(), Some("g1"));
        assert!(!same.roles[0].gang_with_gate, "a pod group is named");
        let e = parse(location(), &jobset(json!([a, b])))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "(JobSet ml/llm): spec.replicatedJobs[1].template.spec.template.spec.\
                 schedulingGroup.podGroupName: Some(\"g2\"), but spec.replicatedJobs[0] names \
                 Some(\"g1\")"
            ),
            "{e}"
        );
        for (value, want) in [
            (
                jobset(json!([])),
                "spec.replicatedJobs: required: at least one",
            ),
            (
                jobset(json!([{"name": "x", "replicas": -2, "template": {}}])),
                "spec.replicatedJobs[0].replicas: -2: must be a non-negative integer",
            ),
            (
                jobset(json!([{"replicas": 1}])),
                "spec.replicatedJobs[0].name: required",
            ),
            (
                jobset(json!([{"name": "x", "template": {"spec": {}}}])),
                "spec.replicatedJobs[0].template.spec.template.spec: required",
            ),
        ] {
            let e = parse(location(), &value).unwrap_err().to_string();
            assert!(e.contains(want), "{e}\nwant: {want}");
        }
        let mut wrong = jobset(json!([]));
        wrong["apiVersion"] = json!("jobset.x-k8s.io/v1");
        let e = parse(location(), &wrong).unwrap_err().to_string();
        assert!(
            e.contains(
                "apiVersion: \"jobset.x-k8s.io/v1\": dractl reads jobset.x-k8s.io/v1alpha2 JobSets"
            ),
            "{e}"
        );
    }
}
