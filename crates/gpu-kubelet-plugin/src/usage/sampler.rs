//! The sampling loop: every interval, the GPUs' usage and their processes' cgroups on one
//! blocking thread (never under a GPU lock), the pods of the prepared claims from the API
//! server (`status.reservedFor`, cached) or, for a claim reserved for no pod (a PodGroup's),
//! from what the claim-user hook recorded ([`crate::claim_users`]), then a [`Report`] for
//! `/metrics` and `/usage`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use gpu_inventory::GpuBackend;
use tokio::sync::watch;
use tracing::{debug, info, warn};

use super::UsageConfig;
use super::cgroup::container_of_pid;
use super::idle_status::IdleMarks;
use super::report::{Containers, GpuSample, IdleTracker, Inputs, PodRef, Report, build};
use super::share_mounts::share_claims_of_pid;
use crate::claims::{ClaimController, Cluster};
use crate::hardware::Hardware;

/// How long one API read of a claim may take.
const CLAIM_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the kubelet's PodResources `List` may take, dial included.
const POD_RESOURCES_TIMEOUT: Duration = Duration::from_secs(5);

/// At most this many claim status writes (`GPUIdle` marks) per sample.
const EVENTS_PER_ROUND: usize = 10;

/// How long a claim's pods are trusted before they are read again, whatever the samples show.
const PODS_MAX_AGE: Duration = Duration::from_secs(600);

/// Samples `gpus` (NVML indexes) of `backend`, reading each process's cgroup under
/// `proc_root`. Blocking.
pub fn sample_gpus(
    backend: &dyn GpuBackend,
    gpus: &BTreeSet<u32>,
    proc_root: &Path,
) -> BTreeMap<u32, Result<GpuSample, String>> {
    gpus.iter()
        .map(|&index| {
            let sample = backend.usage(index).map(|usage| {
                let containers: BTreeMap<u32, _> = usage
                    .processes
                    .iter()
                    .filter_map(|p| Some((p.pid, container_of_pid(proc_root, p.pid)?)))
                    .collect();
                // Only processes in a pod can hold a share's mark.
                let share_claims = containers
                    .keys()
                    .map(|&pid| (pid, share_claims_of_pid(proc_root, pid)))
                    .filter(|(_, claims)| !claims.is_empty())
                    .collect();
                GpuSample {
                    usage,
                    containers,
                    share_claims,
                }
            });
            (index, sample.map_err(|e| e.to_string()))
        })
        .collect()
}

/// The pods of each prepared claim, read from the API server and kept until a sample shows a
/// pod the claim's entry does not list (at most once per interval) or [`PODS_MAX_AGE`].
#[derive(Default)]
struct PodCache {
    by_claim: BTreeMap<String, (Vec<PodRef>, Instant)>,
}

/// Which containers hold `driver`'s devices, from the kubelet at `socket`; the error as text.
async fn containers(socket: &Path, driver: &str) -> Result<Containers, String> {
    dra_kubelet::pod_resources::list(socket, POD_RESOURCES_TIMEOUT)
        .await
        .map(|pods| Containers::from_kubelet(&pods, driver))
        .map_err(|e| e.to_string())
}

/// Runs the sampler of `controller`'s devices (published by `driver` on `node`) until the task
/// is dropped, publishing each report on `reports`.
pub async fn run<C: Cluster, H: Hardware>(
    controller: ClaimController<C, H>,
    backend: Arc<dyn GpuBackend>,
    config: UsageConfig,
    driver: String,
    node: String,
    reports: watch::Sender<Arc<Report>>,
) {
    let mut tick = tokio::time::interval(config.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tracker = IdleTracker::default();
    let mut pods = PodCache::default();
    let mut idle_marks = IdleMarks::new(&driver, config.idle.window, EVENTS_PER_ROUND);
    let mut pod_resources_failed = false;
    loop {
        tick.tick().await;
        let (devices, claims) = controller.usage_view().await;
        let gpus: BTreeSet<u32> = devices.values().map(|d| d.gpu().raw.index).collect();
        let started = Instant::now();
        let sampled = {
            let backend = Arc::clone(&backend);
            let proc_root = config.proc_root.clone();
            tokio::task::spawn_blocking(move || sample_gpus(backend.as_ref(), &gpus, &proc_root))
        };
        // A hung NVML call keeps its thread; this loop waits for it rather than piling more up.
        let samples = match sampled.await {
            Ok(samples) => samples,
            Err(e) => {
                warn!(error = %e, "GPU usage sampling failed; retried at the next interval");
                continue;
            }
        };
        debug!(elapsed = ?started.elapsed(), gpus = samples.len(), "sampled GPU usage");
        let recorded = recorded_users(&controller, &claims).await;
        pods.refresh(
            &controller,
            &devices,
            &claims,
            &samples,
            config.interval,
            &recorded,
        )
        .await;
        let mut pod_map: BTreeMap<String, Vec<PodRef>> = pods
            .by_claim
            .iter()
            .map(|(uid, (p, _))| (uid.clone(), p.clone()))
            .collect();
        add_recorded_pods(&mut pod_map, &recorded);
        let named = match &config.pod_resources_socket {
            Some(socket) => Some(containers(socket, &driver).await),
            None => None,
        };
        match (&named, &pod_resources_failed) {
            (Some(Err(e)), false) => {
                warn!(error = %e, "container names are left out until the kubelet answers");
            }
            (Some(Ok(_)), true) => info!("the kubelet's PodResources API answers again"),
            _ => {}
        }
        pod_resources_failed = matches!(named, Some(Err(_)));
        let unix = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut report = build(
            &Inputs {
                node: &node,
                devices: &devices,
                claims: &claims,
                samples: &samples,
                pods: &pod_map,
                containers: match &named {
                    Some(Ok(c)) => c,
                    _ => Containers::none(),
                },
                thresholds: config.idle,
            },
            &mut tracker,
            Instant::now(),
            unix,
        );
        report.pod_resources_error = named.and_then(Result::err);
        for e in &report.errors {
            warn!(error = %e, "sampling a GPU's usage failed");
        }
        let report = Arc::new(report);
        reports.send_replace(Arc::clone(&report));
        if config.idle_events {
            let wall = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::now(),
            );
            for w in idle_marks.due(&report, &claims, Instant::now(), wall) {
                let written =
                    controller
                        .cluster()
                        .set_device_status(&w.namespace, &w.name, w.devices);
                let failure = match tokio::time::timeout(CLAIM_READ_TIMEOUT, written).await {
                    Ok(Ok(())) => continue,
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => "no answer in time".to_owned(),
                };
                warn!(claim = %format!("{}/{}", w.namespace, w.name), error = %failure,
                    "writing the claim's GPUIdle status failed; retried at the next sample");
                idle_marks.failed(&w.uid);
            }
        }
    }
}

/// Gives each claim that `pods` lists no pod for (reserved for no pod: a PodGroup's claim) the
/// pods its claim-user hook `recorded`, with their UIDs.
fn add_recorded_pods(
    pods: &mut BTreeMap<String, Vec<PodRef>>,
    recorded: &BTreeMap<String, Vec<crate::claim_users::ClaimUser>>,
) {
    for (uid, users) in recorded {
        let entry = pods.entry(uid.clone()).or_default();
        if entry.is_empty() {
            let mut refs: Vec<PodRef> = users
                .iter()
                .map(|u| PodRef {
                    name: u.pod.clone(),
                    uid: u.pod_uid.clone(),
                })
                .collect();
            refs.sort();
            refs.dedup();
            *entry = refs;
        }
    }
}

/// What the claim-user hook recorded for the prepared `claims` ([`crate::claim_users`]), read
/// on a blocking thread; empty when the hook is not installed.
async fn recorded_users<C: Cluster, H: Hardware>(
    controller: &ClaimController<C, H>,
    claims: &[(String, crate::checkpoint::ClaimRecord)],
) -> BTreeMap<String, Vec<crate::claim_users::ClaimUser>> {
    let Some(users) = controller.claim_users() else {
        return BTreeMap::new();
    };
    let uids: BTreeSet<String> = claims.iter().map(|(u, _)| u.clone()).collect();
    tokio::task::spawn_blocking(move || users.users(&uids))
        .await
        .unwrap_or_default()
}

impl PodCache {
    /// Reads the pods of the claims that have none cached, whose entry is older than
    /// [`PODS_MAX_AGE`], or (at most once per `interval`) on whose devices a pod runs that no
    /// cached claim lists. Drops unprepared claims. A failed read keeps the old entry.
    async fn refresh<C: Cluster, H: Hardware>(
        &mut self,
        controller: &ClaimController<C, H>,
        devices: &BTreeMap<String, crate::hardware::NodeDevice>,
        claims: &[(String, crate::checkpoint::ClaimRecord)],
        samples: &BTreeMap<u32, Result<GpuSample, String>>,
        interval: Duration,
        recorded: &BTreeMap<String, Vec<crate::claim_users::ClaimUser>>,
    ) {
        let prepared: BTreeSet<&str> = claims.iter().map(|(u, _)| u.as_str()).collect();
        self.by_claim
            .retain(|uid, _| prepared.contains(uid.as_str()));
        let known: BTreeSet<&str> = self
            .by_claim
            .values()
            .flat_map(|(p, _)| p.iter().map(|p| p.uid.as_str()))
            .chain(recorded.values().flatten().map(|u| u.pod_uid.as_str()))
            .collect();
        // GPUs running a pod no cached claim lists: their claims' pods may have changed.
        let unknown_on: BTreeSet<u32> = samples
            .iter()
            .filter_map(|(index, s)| Some((index, s.as_ref().ok()?)))
            .filter(|(_, s)| {
                s.containers
                    .values()
                    .any(|c| !known.contains(c.pod_uid.as_str()))
            })
            .map(|(index, _)| *index)
            .collect();
        let now = Instant::now();
        let stale: Vec<&(String, crate::checkpoint::ClaimRecord)> = claims
            .iter()
            .filter(|(uid, r)| match self.by_claim.get(uid) {
                None => true,
                Some((_, at)) => {
                    let age = now.saturating_duration_since(*at);
                    let suspect = r.devices.iter().any(|d| {
                        devices
                            .get(&d.device_name)
                            .is_some_and(|n| unknown_on.contains(&n.gpu().raw.index))
                    });
                    age >= PODS_MAX_AGE || (suspect && age >= interval)
                }
            })
            .collect();
        for (uid, r) in stale {
            let read = tokio::time::timeout(
                CLAIM_READ_TIMEOUT,
                controller.cluster().get_claim(&r.namespace, &r.name),
            )
            .await;
            let claim = match read {
                Ok(Ok(Some(c))) if c.metadata.uid.as_deref() == Some(uid.as_str()) => c,
                Ok(Ok(_)) => {
                    // Gone or re-created: the stale-claim check unprepares it.
                    self.by_claim.insert(uid.clone(), (Vec::new(), now));
                    continue;
                }
                Ok(Err(e)) => {
                    debug!(claim = %uid, error = %e, "reading the claim's pods failed");
                    continue;
                }
                Err(_) => {
                    debug!(claim = %uid, "reading the claim's pods timed out");
                    continue;
                }
            };
            let pods = claim
                .status
                .and_then(|s| s.reserved_for)
                .unwrap_or_default()
                .into_iter()
                .filter(|c| c.resource == "pods" && c.api_group.as_deref().unwrap_or("").is_empty())
                .map(|c| PodRef {
                    name: c.name,
                    uid: c.uid,
                })
                .collect();
            self.by_claim.insert(uid.clone(), (pods, now));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::claim_users::ClaimUser;

    #[test]
    fn a_claim_reserved_for_no_pod_gets_the_pods_its_hook_recorded_and_others_keep_theirs() {
        let user = |pod: &str, uid: &str, container: &str| ClaimUser {
            namespace: "team".into(),
            pod: pod.into(),
            pod_uid: uid.into(),
            container: container.into(),
        };
        let reserved = |name: &str, uid: &str| PodRef {
            name: name.into(),
            uid: uid.into(),
        };
        let mut pods = BTreeMap::from([
            ("group".to_owned(), Vec::new()),
            ("own".to_owned(), vec![reserved("solo", "u-solo")]),
        ]);
        let recorded = BTreeMap::from([
            (
                "group".to_owned(),
                vec![
                    user("w-1", "u-1", "main"),
                    user("w-0", "u-0", "main"),
                    user("w-0", "u-0", "sidecar"),
                ],
            ),
            ("own".to_owned(), vec![user("other", "u-x", "main")]),
            ("uncached".to_owned(), vec![user("w-2", "u-2", "main")]),
        ]);
        add_recorded_pods(&mut pods, &recorded);
        assert_eq!(
            pods["group"],
            [reserved("w-0", "u-0"), reserved("w-1", "u-1")]
        );
        assert_eq!(
            pods["own"],
            [reserved("solo", "u-solo")],
            "reservedFor wins"
        );
        assert_eq!(pods["uncached"], [reserved("w-2", "u-2")]);
    }
}
