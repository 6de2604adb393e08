//! `GPUIdle` on idle claims, written through the claim: a condition on each of the claim's
//! entries in its `status.devices` (KEP-4817), which `kubectl describe resourceclaim` shows and
//! the explain controller relays to the claim's pods as a Warning event (`kubectl describe
//! pod`). Which device, for how long, and what it holds: a share's own figures, never its GPU's
//! (those would tell a tenant what its co-tenants use).
//!
//! Why through the claim and not as an event about the pod: the API server lets a plugin's
//! token write a claim's device status only for claims allocated on the token's node
//! (`DRAResourceClaimGranularStatusAuthorization`, beta and on in 1.36: `associated-node:patch`
//! on `resourceclaims/driver`, `pkg/registry/resource/utils.go`), while nothing can tie an
//! event about a Pod to the Pod's node: a ValidatingAdmissionPolicy cannot read the Pod, so a
//! token allowed to write such events could write them about any pod in any namespace.
//!
//! Deduplicated and rate-limited: a claim is marked when it becomes idle and again every
//! [`IdleMarks::repeat`] while it stays idle (its idle time brought up to date, the condition's
//! `lastTransitionTime` kept); a claim that is busy again is unmarked (its entries removed) and
//! its next idle spell is marked anew; at most [`IdleMarks::per_round`] writes go out per
//! sample, the rest the next. A busy claim is never marked.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::AllocatedDeviceStatus;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use super::report::{ClaimReport, Report};
use crate::checkpoint::ClaimRecord;

/// The condition's type, and the reason of the event the explain controller relays.
pub const REASON: &str = "GPUIdle";
/// The condition's reason.
pub const CONDITION_REASON: &str = "NoActivity";

/// One write of a claim's device status: its entries, or none to remove them.
#[derive(Debug, Clone, PartialEq)]
pub struct StatusWrite {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub name: String,
    /// The claim's UID.
    pub uid: String,
    /// This driver's entries: one per device, each with the `GPUIdle` condition; empty to
    /// remove them.
    pub devices: Vec<AllocatedDeviceStatus>,
}

/// Which claims are marked, since when and when last written.
#[derive(Debug)]
pub struct IdleMarks {
    /// The driver whose entries these are.
    pub driver: String,
    /// Mark a claim still idle again after this long.
    pub repeat: Duration,
    /// At most this many writes per sample.
    pub per_round: usize,
    /// By claim UID: when it was last written, its idle spell's start (the condition's
    /// `lastTransitionTime`), its namespace and name.
    marked: BTreeMap<String, Mark>,
}

#[derive(Debug, Clone)]
struct Mark {
    written: Instant,
    since: Time,
    namespace: String,
    name: String,
}

impl IdleMarks {
    /// `driver`'s marks, written again after `repeat`, at most `per_round` writes per sample.
    pub fn new(driver: &str, repeat: Duration, per_round: usize) -> Self {
        Self {
            driver: driver.to_owned(),
            repeat,
            per_round,
            marked: BTreeMap::new(),
        }
    }

    /// The writes `report` calls for at `now` (`wall`: the same moment on the wall clock, for
    /// conditions), the devices of each claim read from its `records`; marks them written.
    /// Unprepared claims are forgotten (their allocation, and entries, go with them).
    pub fn due(
        &mut self,
        report: &Report,
        records: &[(String, ClaimRecord)],
        now: Instant,
        wall: Time,
    ) -> Vec<StatusWrite> {
        let prepared: BTreeMap<&str, &ClaimReport> =
            report.claims.iter().map(|c| (c.uid.as_str(), c)).collect();
        self.marked
            .retain(|uid, _| prepared.contains_key(uid.as_str()));
        let mut due = Vec::new();
        // Busy again: unmarked, so that its next idle spell is marked anew.
        let busy_again: Vec<String> = self
            .marked
            .keys()
            .filter(|uid| prepared.get(uid.as_str()).is_some_and(|c| !c.idle))
            .cloned()
            .collect();
        for uid in busy_again {
            if due.len() >= self.per_round {
                return due;
            }
            if let Some(m) = self.marked.remove(&uid) {
                due.push(StatusWrite {
                    namespace: m.namespace,
                    name: m.name,
                    uid,
                    devices: Vec::new(),
                });
            }
        }
        for c in report.claims.iter().filter(|c| c.idle) {
            if due.len() >= self.per_round {
                return due;
            }
            let since = match self.marked.get(&c.uid) {
                Some(m) if now.saturating_duration_since(m.written) < self.repeat => continue,
                Some(m) => m.since.clone(),
                None => wall.clone(),
            };
            let Some((_, record)) = records.iter().find(|(uid, _)| *uid == c.uid) else {
                continue;
            };
            let condition = Condition {
                type_: REASON.to_owned(),
                status: "True".to_owned(),
                reason: CONDITION_REASON.to_owned(),
                message: note(c, report),
                last_transition_time: since.clone(),
                observed_generation: None,
            };
            let devices = record
                .devices
                .iter()
                .filter(|d| !d.admin_access)
                .map(|d| AllocatedDeviceStatus {
                    driver: self.driver.clone(),
                    pool: d.pool_name.clone(),
                    device: d.device_name.clone(),
                    share_id: d.share.as_ref().map(|s| s.id.clone()),
                    conditions: Some(vec![condition.clone()]),
                    ..AllocatedDeviceStatus::default()
                })
                .collect();
            self.marked.insert(
                c.uid.clone(),
                Mark {
                    written: now,
                    since,
                    namespace: c.namespace.clone(),
                    name: c.name.clone(),
                },
            );
            due.push(StatusWrite {
                namespace: c.namespace.clone(),
                name: c.name.clone(),
                uid: c.uid.clone(),
                devices,
            });
        }
        due
    }

    /// A write that failed: its claim is written again at the next sample.
    pub fn failed(&mut self, uid: &str) {
        self.marked.remove(uid);
    }
}

/// A duration for people: `3h 5m`, `12m`, `40s` (`seconds` rounded down to what it shows).
pub fn span(seconds: u64) -> String {
    let (h, m, s) = (seconds / 3600, seconds % 3600 / 60, seconds % 60);
    match (h, m) {
        (0, 0) => format!("{s}s"),
        (0, _) => format!("{m}m"),
        _ => format!("{h}h {m}m"),
    }
}

/// What the condition says about idle claim `c`: its devices, and what they hold. A whole
/// device's own figures; for a share only the share's (its allocation, what its processes use,
/// their SM utilization where known), never its GPU's, which its co-tenants make.
fn note(c: &ClaimReport, report: &Report) -> String {
    let devices: Vec<String> = c
        .devices
        .iter()
        .filter_map(|name| report.devices.iter().find(|d| &d.device == name))
        .map(|d| {
            let what = d.mig_profile.as_ref().map_or_else(
                || d.model.clone(),
                |profile| format!("{} MIG {profile}", d.model),
            );
            let figures = match c.share_memory_bytes {
                Some(share) => {
                    let sm = c
                        .sm_percent
                        .map_or_else(String::new, |p| format!(", {p}% SM"));
                    format!(
                        "its share of {} MiB, {} MiB in use by its processes{sm}",
                        share >> 20,
                        c.memory_used_bytes >> 20
                    )
                }
                None => {
                    let used = d.memory_used_bytes >> 20;
                    let memory = match d.memory_total_bytes {
                        Some(total) => format!("{used} MiB of {} MiB in use", total >> 20),
                        None => format!("{used} MiB in use"),
                    };
                    let sm = d
                        .sm_percent
                        .map_or_else(String::new, |p| format!(", {p}% SM"));
                    format!("{memory}{sm}")
                }
            };
            format!("{} ({what}, {figures})", d.device)
        })
        .collect();
    let mut note = format!(
        "GPU idle for {} (no sample at or above {}% SM or {}% memory activity): ResourceClaim \
         {}/{} holds {}. Delete the pod or its claim to give the GPU back.",
        span(c.idle_seconds),
        report.idle_sm_percent,
        report.idle_memory_percent,
        c.namespace,
        c.name,
        devices.join(", "),
    );
    if note.len() > 1024 {
        let cut = (0..=1021)
            .rev()
            .find(|i| note.is_char_boundary(*i))
            .unwrap_or(0);
        note.truncate(cut);
        note.push_str("...");
    }
    note
}

#[cfg(test)]
mod tests {
    use super::super::report::{DeviceReport, PodRef as Pod};
    use super::*;

    fn report(idle: bool, pods: &[&str]) -> Report {
        Report {
            idle_sm_percent: 5,
            idle_memory_percent: 5,
            devices: vec![DeviceReport {
                device: "gpu-0000-2a-00-0".into(),
                model: "NVIDIA H100 80GB HBM3".into(),
                sm_percent: Some(0),
                memory_used_bytes: 20 << 30,
                memory_total_bytes: Some(80 << 30),
                ..DeviceReport::default()
            }],
            claims: vec![ClaimReport {
                namespace: "team".into(),
                name: "notebook".into(),
                uid: "c-1".into(),
                devices: vec!["gpu-0000-2a-00-0".into()],
                pods: pods
                    .iter()
                    .map(|p| Pod {
                        name: (*p).into(),
                        uid: format!("uid-{p}"),
                    })
                    .collect(),
                idle_seconds: 1900,
                idle,
                busy: !idle,
                ..ClaimReport::default()
            }],
            ..Report::default()
        }
    }

    fn records(share: Option<u64>) -> Vec<(String, ClaimRecord)> {
        vec![(
            "c-1".to_owned(),
            ClaimRecord {
                namespace: "team".into(),
                name: "notebook".into(),
                state: crate::checkpoint::ClaimState::PrepareCompleted,
                devices: vec![crate::checkpoint::RecordedDevice {
                    request_names: vec!["gpu".into()],
                    pool_name: "node-a".into(),
                    device_name: "gpu-0000-2a-00-0".into(),
                    cdi_device_ids: Vec::new(),
                    uuid: "GPU-1".into(),
                    admin_access: false,
                    sharing: None,
                    mig: None,
                    share: share.map(|b| crate::checkpoint::RecordedShare {
                        id: "s-1".into(),
                        memory_bytes: b,
                        compute_percent: 0,
                        whole: false,
                    }),
                    imex_channel: None,
                }],
                cdi_spec_path: Default::default(),
                cdi_spec: Default::default(),
            },
        )]
    }

    fn wall(seconds: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(seconds).unwrap())
    }

    #[test]
    fn marked_once_per_idle_spell_again_after_the_repeat_and_unmarked_when_busy() {
        let mut marks = IdleMarks::new("gpu.drust.dev", Duration::from_secs(1800), 10);
        let t0 = Instant::now();
        let records = records(None);
        let first = marks.due(&report(true, &["jupyter-0"]), &records, t0, wall(1000));
        assert_eq!(first.len(), 1);
        let w = &first[0];
        assert_eq!(
            (w.namespace.as_str(), w.name.as_str()),
            ("team", "notebook")
        );
        assert_eq!(w.devices.len(), 1);
        let d = &w.devices[0];
        assert_eq!(
            (d.driver.as_str(), d.pool.as_str(), d.device.as_str()),
            ("gpu.drust.dev", "node-a", "gpu-0000-2a-00-0")
        );
        let c = &d.conditions.as_ref().unwrap()[0];
        assert_eq!((c.type_.as_str(), c.status.as_str()), ("GPUIdle", "True"));
        assert_eq!(
            c.message,
            "GPU idle for 31m (no sample at or above 5% SM or 5% memory activity): ResourceClaim \
             team/notebook holds gpu-0000-2a-00-0 (NVIDIA H100 80GB HBM3, 20480 MiB of 81920 MiB \
             in use, 0% SM). Delete the pod or its claim to give the GPU back."
        );
        // Deduplicated within the repeat.
        let later = t0 + Duration::from_secs(60);
        assert!(
            marks
                .due(&report(true, &[]), &records, later, wall(1060))
                .is_empty()
        );
        // Written again once the repeat passed, its spell's start kept.
        let much_later = t0 + Duration::from_secs(1801);
        let again = marks.due(&report(true, &[]), &records, much_later, wall(2801));
        assert_eq!(
            again[0].devices[0].conditions.as_ref().unwrap()[0].last_transition_time,
            wall(1000)
        );
        // Busy: its entries removed, and its next idle spell marked anew.
        let cleared = marks.due(&report(false, &[]), &records, much_later, wall(2801));
        assert_eq!(cleared.len(), 1);
        assert!(cleared[0].devices.is_empty());
        assert!(
            marks
                .due(&report(false, &[]), &records, much_later, wall(2801))
                .is_empty()
        );
        let anew = marks.due(&report(true, &[]), &records, much_later, wall(2900));
        assert_eq!(
            anew[0].devices[0].conditions.as_ref().unwrap()[0].last_transition_time,
            wall(2900)
        );
    }

    /// Issue 41, defect 8: a share's condition shows the share's own figures, never its GPU's
    /// (20 GiB used and 0% SM by the co-tenants here), and names its share.
    #[test]
    fn a_shares_mark_shows_its_own_figures() {
        let mut r = report(true, &["jupyter-0"]);
        r.claims[0].share_memory_bytes = Some(10 << 30);
        r.claims[0].memory_used_bytes = 512 << 20;
        r.claims[0].sm_percent = Some(0);
        let mut marks = IdleMarks::new("gpu.drust.dev", Duration::from_secs(1800), 10);
        let due = marks.due(&r, &records(Some(10 << 30)), Instant::now(), wall(1));
        let d = &due[0].devices[0];
        assert_eq!(d.share_id.as_deref(), Some("s-1"));
        let message = &d.conditions.as_ref().unwrap()[0].message;
        assert!(
            message.contains(
                "(NVIDIA H100 80GB HBM3, its share of 10240 MiB, 512 MiB in use by its \
                 processes, 0% SM)"
            ) && !message.contains("20480"),
            "{message}"
        );
    }

    #[test]
    fn a_busy_claim_is_never_marked_and_rounds_are_capped() {
        let mut marks = IdleMarks::new("gpu.drust.dev", Duration::from_secs(1800), 1);
        let t0 = Instant::now();
        let records = records(None);
        assert!(
            marks
                .due(&report(false, &["a"]), &records, t0, wall(1))
                .is_empty()
        );
        let mut two = report(true, &["a"]);
        let mut other = two.claims[0].clone();
        other.uid = "c-2".into();
        two.claims.push(other);
        let mut both = records.clone();
        both.push(("c-2".to_owned(), records[0].1.clone()));
        assert_eq!(
            marks.due(&two, &both, t0, wall(1)).len(),
            1,
            "capped per round"
        );
        let rest = marks.due(&two, &both, t0, wall(1));
        assert_eq!(rest.len(), 1);
        assert_eq!(rest[0].uid, "c-2");
        assert!(marks.due(&two, &both, t0, wall(1)).is_empty());
    }

    #[test]
    fn spans_read_as_people_write_them() {
        assert_eq!(span(40), "40s");
        assert_eq!(span(1900), "31m");
        assert_eq!(span(3 * 3600 + 300), "3h 5m");
    }
}
