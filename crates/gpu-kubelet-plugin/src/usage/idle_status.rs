//! `GPUIdle` Warning events on the pods of idle claims: which device, for how long, and what
//! it holds, so `kubectl describe pod` tells the user.
//!
//! Deduplicated and rate-limited as the explain controller's events are: a pod is told once
//! when its claim becomes idle and again every [`IdleEvents::repeat`] while it stays idle; a
//! claim that is busy again is forgotten, so its next idle spell is told anew; at most
//! [`IdleEvents::per_round`] events go out per sample, the rest the next. A busy claim's pods
//! never get one.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use super::report::{ClaimReport, Report};
use crate::claims::PodRef;

/// The event's reason.
pub const REASON: &str = "GPUIdle";
/// The event's action.
pub const ACTION: &str = "SampleUsage";

/// One event to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodEvent {
    /// The pod it is about.
    pub pod: PodRef,
    /// Its note (at most 1 KiB).
    pub note: String,
}

/// Which pods were told, and when.
#[derive(Debug)]
pub struct IdleEvents {
    /// Tell a pod of a claim still idle again after this long.
    pub repeat: Duration,
    /// At most this many events per sample.
    pub per_round: usize,
    /// When each (claim UID, pod UID) was last told.
    told: BTreeMap<(String, String), Instant>,
}

impl IdleEvents {
    /// Telling again after `repeat`, at most `per_round` events per sample.
    pub fn new(repeat: Duration, per_round: usize) -> Self {
        Self {
            repeat,
            per_round,
            told: BTreeMap::new(),
        }
    }

    /// The events `report` calls for at `now`, marking them told.
    pub fn due(&mut self, report: &Report, now: Instant) -> Vec<PodEvent> {
        let idle: BTreeSet<&str> = report
            .claims
            .iter()
            .filter(|c| c.idle)
            .map(|c| c.uid.as_str())
            .collect();
        // Busy again (or unprepared): its next idle spell is told anew.
        self.told
            .retain(|(claim, _), _| idle.contains(claim.as_str()));
        let mut due = Vec::new();
        for c in report.claims.iter().filter(|c| c.idle) {
            for p in &c.pods {
                if due.len() >= self.per_round {
                    return due;
                }
                let key = (c.uid.clone(), p.uid.clone());
                if self
                    .told
                    .get(&key)
                    .is_some_and(|at| now.saturating_duration_since(*at) < self.repeat)
                {
                    continue;
                }
                self.told.insert(key, now);
                due.push(PodEvent {
                    pod: PodRef {
                        namespace: c.namespace.clone(),
                        name: p.name.clone(),
                        uid: p.uid.clone(),
                    },
                    note: note(c, report),
                });
            }
        }
        due
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

/// What the event says about idle claim `c`.
fn note(c: &ClaimReport, report: &Report) -> String {
    let devices: Vec<String> = c
        .devices
        .iter()
        .filter_map(|name| report.devices.iter().find(|d| &d.device == name))
        .map(|d| {
            let used = d.memory_used_bytes >> 20;
            let memory = match d.memory_total_bytes {
                Some(total) => format!("{used} MiB of {} MiB in use", total >> 20),
                None => format!("{used} MiB in use"),
            };
            let sm = d
                .sm_percent
                .map_or_else(String::new, |p| format!(", {p}% SM"));
            let what = d.mig_profile.as_ref().map_or_else(
                || d.model.clone(),
                |profile| format!("{} MIG {profile}", d.model),
            );
            format!("{} ({what}, {memory}{sm})", d.device)
        })
        .collect();
    let share = c
        .share_memory_bytes
        .map_or_else(String::new, |b| format!("; its share: {} MiB", b >> 20));
    let mut note = format!(
        "GPU idle for {} (no sample at or above {}% SM or {}% memory activity): ResourceClaim \
         {}/{} holds {}{share}. Delete the pod or its claim to give the GPU back.",
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

    #[test]
    fn told_once_per_idle_spell_and_again_after_the_repeat() {
        let mut events = IdleEvents::new(Duration::from_secs(1800), 10);
        let t0 = Instant::now();
        let first = events.due(&report(true, &["jupyter-0"]), t0);
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].pod.name, "jupyter-0");
        assert_eq!(first[0].pod.namespace, "team");
        assert_eq!(
            first[0].note,
            "GPU idle for 31m (no sample at or above 5% SM or 5% memory activity): ResourceClaim \
             team/notebook holds gpu-0000-2a-00-0 (NVIDIA H100 80GB HBM3, 20480 MiB of 81920 MiB \
             in use, 0% SM). Delete the pod or its claim to give the GPU back."
        );
        // Deduplicated within the repeat.
        let later = t0 + Duration::from_secs(60);
        assert!(events.due(&report(true, &["jupyter-0"]), later).is_empty());
        // Told again once the repeat passed.
        let much_later = t0 + Duration::from_secs(1801);
        assert_eq!(
            events.due(&report(true, &["jupyter-0"]), much_later).len(),
            1
        );
        // Busy: nothing, and forgotten, so the next idle spell is told at once.
        assert!(
            events
                .due(&report(false, &["jupyter-0"]), much_later)
                .is_empty()
        );
        assert_eq!(
            events.due(&report(true, &["jupyter-0"]), much_later).len(),
            1
        );
    }

    #[test]
    fn a_busy_claim_s_pods_are_never_told_and_rounds_are_capped() {
        let mut events = IdleEvents::new(Duration::from_secs(1800), 2);
        let t0 = Instant::now();
        assert!(events.due(&report(false, &["a", "b", "c"]), t0).is_empty());
        let r = report(true, &["a", "b", "c"]);
        assert_eq!(events.due(&r, t0).len(), 2, "capped per round");
        let rest = events.due(&r, t0);
        assert_eq!(rest.len(), 1);
        assert_eq!(rest[0].pod.name, "c");
        assert!(events.due(&r, t0).is_empty());
    }

    #[test]
    fn spans_read_as_people_write_them() {
        assert_eq!(span(40), "40s");
        assert_eq!(span(1900), "31m");
        assert_eq!(span(3 * 3600 + 300), "3h 5m");
    }
}
