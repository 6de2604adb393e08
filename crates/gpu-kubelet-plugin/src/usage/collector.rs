//! The usage report on `/metrics`, read at each scrape from the latest [`Report`].
//!
//! Device metrics carry DCGM exporter's names, units and labels, so dashboards and alerts
//! written for it work unchanged (`gpu`, `UUID`, `pci_bus_id`, `device` as `nvidia<minor>`,
//! `modelName`, `GPU_I_PROFILE` and `GPU_I_ID` on MIG devices, `Hostname`, then `namespace`,
//! `pod`, `container`), plus `claim` and `dra_device` (the DRA device name). A device's pod
//! labels are set when one pod uses it (its processes run in one pod, or, with no process, its
//! one claim names one pod); otherwise they are empty and the per-container metric tells. The
//! `container` label is the container's name from the kubelet's PodResources API: the one
//! container of that pod holding the device (see [`super::report::Containers`]).
//!
//! | name | type | unit | labels | meaning |
//! |---|---|---|---|---|
//! | `DCGM_FI_DEV_GPU_UTIL` | gauge | % | device | SM utilization (whole GPUs) |
//! | `DCGM_FI_DEV_MEM_COPY_UTIL` | gauge | % | device | memory activity (whole GPUs) |
//! | `DCGM_FI_PROF_SM_ACTIVE` | gauge | ratio 0..1 | device | a MIG device's SM activity (GPM, Hopper and later) |
//! | `DCGM_FI_PROF_DRAM_ACTIVE` | gauge | ratio 0..1 | device | a MIG device's memory bandwidth use (GPM) |
//! | `DCGM_FI_DEV_FB_USED` | gauge | MiB | device | device memory used |
//! | `DCGM_FI_DEV_FB_FREE` | gauge | MiB | device | device memory free, where its size is known |
//! | `drust_container_gpu_memory_bytes` | gauge | bytes | device, `namespace`, `pod`, `container`, `pod_uid`, `container_id`, `claim` | memory of one container's processes on the device |
//! | `drust_claim_idle_seconds` | gauge | s | `namespace`, `claim`, `claim_uid` | time since the claim was last busy |
//! | `drust_claim_idle` | gauge | | as above | 1 once idle for the window |
//! | `drust_claim_sm_percent` | gauge | % | as above | its whole devices' SM utilization, or a share's processes' where NVML gives per-process figures that account for the GPU's work |
//! | `drust_claim_gpu_memory_used_bytes` | gauge | bytes | as above | memory its processes use |
//! | `drust_share_memory_limit_bytes` | gauge | bytes | as above | a share's allocated memory |
//! | `drust_usage_gpus_failing` | gauge | | | GPUs whose last sample failed |
//! | `drust_usage_pod_resources_failing` | gauge | | | 1 when the last PodResources `List` failed (container names left out) |

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeGaugeValue, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::gauge::ConstGauge;
use tokio::sync::watch;

use super::report::{DeviceReport, Report};

/// Every metric name this collector serves.
pub const METRICS: &[&str] = &[
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_MEM_COPY_UTIL",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_PROF_SM_ACTIVE",
    "DCGM_FI_PROF_DRAM_ACTIVE",
    "drust_container_gpu_memory_bytes",
    "drust_claim_idle_seconds",
    "drust_claim_idle",
    "drust_claim_sm_percent",
    "drust_claim_gpu_memory_used_bytes",
    "drust_share_memory_limit_bytes",
    "drust_usage_gpus_failing",
    "drust_usage_pod_resources_failing",
];

/// Serves the latest report ([`super::sampler::run`]).
#[derive(Debug)]
pub struct UsageCollector {
    reports: watch::Receiver<Arc<Report>>,
}

impl UsageCollector {
    /// A collector of the reports `reports` receives.
    pub fn new(reports: watch::Receiver<Arc<Report>>) -> Self {
        Self { reports }
    }
}

type Labels = Vec<(&'static str, String)>;

/// DCGM exporter's device labels for `d` on `node`, with its one pod's where it has one.
fn device_labels(d: &DeviceReport, report: &Report) -> Labels {
    let mut l: Labels = vec![
        ("gpu", d.gpu_index.to_string()),
        ("UUID", d.uuid.clone()),
        ("pci_bus_id", d.pci_bus_id.clone()),
        ("device", format!("nvidia{}", d.minor)),
        ("modelName", d.model.clone()),
    ];
    if let (Some(profile), Some(gi)) = (&d.mig_profile, d.gpu_instance_id) {
        l.push(("GPU_I_PROFILE", profile.clone()));
        l.push(("GPU_I_ID", gi.to_string()));
    }
    l.push(("Hostname", report.node.clone()));
    let claims: Vec<&super::ClaimReport> = report
        .claims
        .iter()
        .filter(|c| d.claims.contains(&c.uid))
        .collect();
    // The pods with a process on the device (a pod's containers count once).
    let mut pods: Vec<String> = d
        .processes
        .iter()
        .filter_map(|p| p.pod_uid.clone())
        .collect();
    pods.sort();
    pods.dedup();
    let (namespace, pod, claim) = match (claims.as_slice(), pods.as_slice()) {
        ([c], []) if c.pods.len() == 1 => {
            (c.namespace.clone(), c.pods[0].name.clone(), c.name.clone())
        }
        ([c], [uid]) => (
            c.namespace.clone(),
            c.pods
                .iter()
                .find(|p| &p.uid == uid)
                .map(|p| p.name.clone())
                .unwrap_or_default(),
            c.name.clone(),
        ),
        ([c], _) => (c.namespace.clone(), String::new(), c.name.clone()),
        _ => Default::default(),
    };
    let container = device_container(d, &namespace, &pod);
    l.push(("namespace", namespace));
    l.push(("pod", pod));
    l.push(("container", container));
    l.push(("claim", claim));
    l.push(("dra_device", d.device.clone()));
    l
}

/// The container of `pod` (in `namespace`) on `d`: the one its processes there run in, or with
/// no process on `d`, the one the kubelet says holds `d`; empty when that is not one container.
fn device_container(d: &DeviceReport, namespace: &str, pod: &str) -> String {
    if pod.is_empty() {
        return String::new();
    }
    let names: std::collections::BTreeSet<Option<&str>> = if d.processes.is_empty() {
        d.containers
            .iter()
            .filter(|c| c.pod == pod && c.namespace == namespace)
            .map(|c| Some(c.container.as_str()))
            .collect()
    } else {
        d.processes
            .iter()
            .filter(|p| p.pod.as_deref() == Some(pod))
            .map(|p| p.container.as_deref())
            .collect()
    };
    match names.into_iter().collect::<Vec<_>>().as_slice() {
        [Some(only)] => (*only).to_owned(),
        _ => String::new(),
    }
}

/// Encodes gauge `name` with one sample per series (whole or fractional values); nothing when
/// there is none.
fn gauge<N: EncodeGaugeValue + Copy>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: &[(Labels, N)],
) -> Result<(), std::fmt::Error> {
    if series.is_empty() {
        return Ok(());
    }
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    if let [(labels, value)] = series
        && labels.is_empty()
    {
        return ConstGauge::new(*value).encode(family);
    }
    for (labels, value) in series {
        ConstGauge::new(*value).encode(family.encode_family(labels)?)?;
    }
    Ok(())
}

/// Whole MiB, rounded down (DCGM's unit for framebuffer memory).
fn mib(bytes: u64) -> i64 {
    count(bytes >> 20)
}

/// `n` as a gauge value (saturating).
fn count(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Collector for UsageCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let report = Arc::clone(&self.reports.borrow());
        let devices: Vec<(Labels, &DeviceReport)> = report
            .devices
            .iter()
            .map(|d| (device_labels(d, &report), d))
            .collect();
        let per = |f: &dyn Fn(&DeviceReport) -> Option<i64>| -> Vec<(Labels, i64)> {
            devices
                .iter()
                .filter_map(|(l, d)| Some((l.clone(), f(d)?)))
                .collect()
        };
        let whole = |d: &DeviceReport| d.gpu_instance_id.is_none();
        gauge(
            &mut encoder,
            "DCGM_FI_DEV_GPU_UTIL",
            "GPU utilization (in %).",
            &per(&|d| d.sm_percent.filter(|_| whole(d)).map(i64::from)),
        )?;
        gauge(
            &mut encoder,
            "DCGM_FI_DEV_MEM_COPY_UTIL",
            "Memory utilization (in %).",
            &per(&|d| d.memory_percent.filter(|_| whole(d)).map(i64::from)),
        )?;
        // MIG devices: DCGM's profiling fields, ratios, as DCGM exporter serves per instance.
        let ratio = |percent: Option<u32>| percent.map(|p| f64::from(p) / 100.0);
        let per_mig = |f: &dyn Fn(&DeviceReport) -> Option<f64>| -> Vec<(Labels, f64)> {
            devices
                .iter()
                .filter(|(_, d)| !whole(d))
                .filter_map(|(l, d)| Some((l.clone(), f(d)?)))
                .collect()
        };
        gauge(
            &mut encoder,
            "DCGM_FI_PROF_SM_ACTIVE",
            "The ratio of cycles an SM has at least 1 warp assigned (in %).",
            &per_mig(&|d| ratio(d.sm_percent)),
        )?;
        gauge(
            &mut encoder,
            "DCGM_FI_PROF_DRAM_ACTIVE",
            "Ratio of cycles the device memory interface is active sending or receiving data (in %).",
            &per_mig(&|d| ratio(d.memory_percent)),
        )?;
        gauge(
            &mut encoder,
            "DCGM_FI_DEV_FB_USED",
            "Framebuffer memory used (in MiB).",
            &per(&|d| Some(mib(d.memory_used_bytes))),
        )?;
        gauge(
            &mut encoder,
            "DCGM_FI_DEV_FB_FREE",
            "Framebuffer memory free (in MiB).",
            &per(&|d| {
                let total = d.memory_total_bytes?;
                Some(mib(total.saturating_sub(d.memory_used_bytes)))
            }),
        )?;

        let mut containers: Vec<(Labels, i64)> = Vec::new();
        for (labels, d) in &devices {
            type Key = (String, String, String, String);
            let mut by_container: std::collections::BTreeMap<Key, u64> = Default::default();
            for p in &d.processes {
                let key = (
                    p.pod_uid.clone().unwrap_or_default(),
                    p.container_id.clone().unwrap_or_default(),
                    p.container.clone().unwrap_or_default(),
                    p.claim.clone().unwrap_or_default(),
                );
                *by_container.entry(key).or_default() += p.used_memory_bytes.unwrap_or(0);
            }
            for ((pod_uid, container_id, container, claim_uid), bytes) in by_container {
                let claim = report.claims.iter().find(|c| c.uid == claim_uid);
                let pod = claim
                    .and_then(|c| c.pods.iter().find(|p| p.uid == pod_uid))
                    .map(|p| p.name.clone())
                    .unwrap_or_default();
                let mut l: Labels = labels
                    .iter()
                    .filter(|(k, _)| !matches!(*k, "namespace" | "pod" | "container" | "claim"))
                    .cloned()
                    .collect();
                l.push((
                    "namespace",
                    claim.map(|c| c.namespace.clone()).unwrap_or_default(),
                ));
                l.push(("pod", pod));
                l.push(("container", container));
                l.push(("pod_uid", pod_uid));
                l.push(("container_id", container_id));
                l.push(("claim", claim.map(|c| c.name.clone()).unwrap_or_default()));
                containers.push((l, count(bytes)));
            }
        }
        gauge(
            &mut encoder,
            "drust_container_gpu_memory_bytes",
            "Device memory used by one container's processes on the device, bytes",
            &containers,
        )?;

        let claim_labels = |c: &super::ClaimReport| -> Labels {
            vec![
                ("namespace", c.namespace.clone()),
                ("claim", c.name.clone()),
                ("claim_uid", c.uid.clone()),
            ]
        };
        let claims = |f: &dyn Fn(&super::ClaimReport) -> Option<i64>| -> Vec<(Labels, i64)> {
            report
                .claims
                .iter()
                .filter_map(|c| Some((claim_labels(c), f(c)?)))
                .collect()
        };
        gauge(
            &mut encoder,
            "drust_claim_idle_seconds",
            "Seconds since the prepared claim's devices were last busy",
            &claims(&|c| Some(count(c.idle_seconds))),
        )?;
        gauge(
            &mut encoder,
            "drust_claim_idle",
            "1 when the claim has been idle for the idle window",
            &claims(&|c| Some(i64::from(c.idle))),
        )?;
        gauge(
            &mut encoder,
            "drust_claim_sm_percent",
            "SM utilization of the claim's devices, or of a share's processes, percent",
            &claims(&|c| c.sm_percent.map(i64::from)),
        )?;
        gauge(
            &mut encoder,
            "drust_claim_gpu_memory_used_bytes",
            "Device memory the claim's processes use, bytes",
            &claims(&|c| Some(count(c.memory_used_bytes))),
        )?;
        gauge(
            &mut encoder,
            "drust_share_memory_limit_bytes",
            "Memory allocated to the claim's share (consumedCapacity.memory), bytes",
            &claims(&|c| c.share_memory_bytes.map(count)),
        )?;
        gauge(
            &mut encoder,
            "drust_usage_gpus_failing",
            "GPUs whose last usage sample failed",
            &[(Vec::new(), count(report.errors.len() as u64))],
        )?;
        gauge(
            &mut encoder,
            "drust_usage_pod_resources_failing",
            "1 when the kubelet's PodResources API (container names) could not be read last time",
            &[(Vec::new(), i64::from(report.pod_resources_error.is_some()))],
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::report::{ClaimReport, ContainerUse, PodRef, ProcessReport};
    use super::*;
    use crate::metrics::Metrics;

    #[test]
    fn dcgm_names_and_labels_with_the_pod_claim_and_idle_state() {
        let metrics = Metrics::new();
        let pod = PodRef {
            name: "jupyter-0".into(),
            uid: "p-1".into(),
        };
        let report = Report {
            node: "node-a".into(),
            devices: vec![
                DeviceReport {
                    device: "gpu-0000-18-00-0".into(),
                    uuid: "GPU-1".into(),
                    gpu_index: 0,
                    minor: 0,
                    model: "NVIDIA H100 80GB HBM3".into(),
                    pci_bus_id: "0000:18:00.0".into(),
                    sm_percent: Some(3),
                    memory_percent: Some(0),
                    memory_used_bytes: 20 << 30,
                    memory_total_bytes: Some(80 << 30),
                    claims: vec!["c-1".into()],
                    processes: vec![ProcessReport {
                        pid: 7,
                        used_memory_bytes: Some(20 << 30),
                        pod_uid: Some("p-1".into()),
                        pod: Some("jupyter-0".into()),
                        namespace: Some("team".into()),
                        container_id: Some("abc".into()),
                        container: Some("lab".into()),
                        claim: Some("c-1".into()),
                        sm_percent: None,
                    }],
                    ..DeviceReport::default()
                },
                DeviceReport {
                    device: "gpu-0000-2a-00-0-mig-1g.10gb-0".into(),
                    uuid: "MIG-2".into(),
                    gpu_index: 1,
                    minor: 1,
                    model: "NVIDIA A100-SXM4-80GB".into(),
                    mig_profile: Some("1g.10gb".into()),
                    gpu_instance_id: Some(9),
                    sm_percent: Some(42),
                    memory_percent: Some(7),
                    ..DeviceReport::default()
                },
            ],
            claims: vec![ClaimReport {
                namespace: "team".into(),
                name: "notebook".into(),
                uid: "c-1".into(),
                pods: vec![pod],
                idle_seconds: 1900,
                idle: true,
                sm_percent: Some(3),
                memory_used_bytes: 20 << 30,
                share_memory_bytes: Some(40 << 30),
                ..ClaimReport::default()
            }],
            ..Report::default()
        };
        metrics.usage_reports().send_replace(Arc::new(report));
        let text = metrics.encode();
        let device0 = r#"gpu="0",UUID="GPU-1",pci_bus_id="0000:18:00.0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",namespace="team",pod="jupyter-0",container="lab",claim="notebook",dra_device="gpu-0000-18-00-0""#;
        for line in [
            format!("DCGM_FI_DEV_GPU_UTIL{{{device0}}} 3"),
            format!("DCGM_FI_DEV_FB_USED{{{device0}}} 20480"),
            format!("DCGM_FI_DEV_FB_FREE{{{device0}}} 61440"),
            r#"DCGM_FI_DEV_FB_USED{gpu="1",UUID="MIG-2",pci_bus_id="",device="nvidia1",modelName="NVIDIA A100-SXM4-80GB",GPU_I_PROFILE="1g.10gb",GPU_I_ID="9",Hostname="node-a",namespace="",pod="",container="",claim="",dra_device="gpu-0000-2a-00-0-mig-1g.10gb-0"} 0"#.into(),
            r#"DCGM_FI_PROF_SM_ACTIVE{gpu="1",UUID="MIG-2",pci_bus_id="",device="nvidia1",modelName="NVIDIA A100-SXM4-80GB",GPU_I_PROFILE="1g.10gb",GPU_I_ID="9",Hostname="node-a",namespace="",pod="",container="",claim="",dra_device="gpu-0000-2a-00-0-mig-1g.10gb-0"} 0.42"#.into(),
            r#"DCGM_FI_PROF_DRAM_ACTIVE{gpu="1",UUID="MIG-2",pci_bus_id="",device="nvidia1",modelName="NVIDIA A100-SXM4-80GB",GPU_I_PROFILE="1g.10gb",GPU_I_ID="9",Hostname="node-a",namespace="",pod="",container="",claim="",dra_device="gpu-0000-2a-00-0-mig-1g.10gb-0"} 0.07"#.into(),
            r#"drust_claim_idle_seconds{namespace="team",claim="notebook",claim_uid="c-1"} 1900"#.into(),
            r#"drust_claim_idle{namespace="team",claim="notebook",claim_uid="c-1"} 1"#.into(),
            r#"drust_claim_sm_percent{namespace="team",claim="notebook",claim_uid="c-1"} 3"#.into(),
            "drust_usage_gpus_failing 0".into(),
            "drust_usage_pod_resources_failing 0".into(),
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in:\n{text}");
        }
        let container = text
            .lines()
            .find(|l| l.starts_with("drust_container_gpu_memory_bytes{"))
            .unwrap();
        assert!(
            container
                .contains(r#"pod="jupyter-0",container="lab",pod_uid="p-1",container_id="abc",claim="notebook""#)
                && container.ends_with(&format!(" {}", 20u64 << 30)),
            "{container}"
        );
        for name in METRICS {
            assert!(
                text.lines().any(|l| l == format!("# TYPE {name} gauge")),
                "{name} not served:\n{text}"
            );
        }
        // A MIG device's figures are DCGM's profiling fields, never the whole-GPU ones; the old
        // drust_ metrics stay.
        assert!(!text.contains(r#"DCGM_FI_DEV_GPU_UTIL{gpu="1""#));
        assert!(!text.contains(r#"DCGM_FI_PROF_SM_ACTIVE{gpu="0""#));
        assert!(text.contains("drust_prepared_claims 0"));
    }

    /// Report with one device held by claim `c-1` of pod `jupyter-0`, with `processes` on it
    /// and `containers` holding it as the kubelet says.
    fn one_device(processes: Vec<ProcessReport>, containers: &[&str]) -> Report {
        Report {
            devices: vec![DeviceReport {
                device: "gpu-0".into(),
                claims: vec!["c-1".into()],
                containers: containers
                    .iter()
                    .map(|c| ContainerUse {
                        namespace: "team".into(),
                        pod: "jupyter-0".into(),
                        container: (*c).into(),
                    })
                    .collect(),
                processes,
                ..DeviceReport::default()
            }],
            claims: vec![ClaimReport {
                namespace: "team".into(),
                name: "notebook".into(),
                uid: "c-1".into(),
                pods: vec![PodRef {
                    name: "jupyter-0".into(),
                    uid: "p-1".into(),
                }],
                ..ClaimReport::default()
            }],
            ..Report::default()
        }
    }

    fn container_label(report: Report) -> String {
        let metrics = Metrics::new();
        metrics.usage_reports().send_replace(Arc::new(report));
        let text = metrics.encode();
        let line = text
            .lines()
            .find(|l| l.starts_with("DCGM_FI_DEV_FB_USED{"))
            .unwrap()
            .to_owned();
        let (_, rest) = line.split_once("container=\"").unwrap();
        rest.split_once('"').unwrap().0.to_owned()
    }

    #[test]
    fn the_container_label_names_one_container_or_none() {
        let process = |pid, container: Option<&str>| ProcessReport {
            pid,
            pod_uid: Some("p-1".into()),
            pod: Some("jupyter-0".into()),
            namespace: Some("team".into()),
            container: container.map(Into::into),
            claim: Some("c-1".into()),
            ..ProcessReport::default()
        };
        // No process: the one container the kubelet says holds the device.
        assert_eq!(container_label(one_device(Vec::new(), &["lab"])), "lab");
        // No process and two containers holding it: none.
        assert_eq!(
            container_label(one_device(Vec::new(), &["lab", "sidecar"])),
            ""
        );
        // Processes in one named container.
        let both = vec![process(1, Some("lab")), process(2, Some("lab"))];
        assert_eq!(container_label(one_device(both, &["lab"])), "lab");
        // A process whose container is not known beside a named one: none.
        let mixed = vec![process(1, Some("lab")), process(2, None)];
        assert_eq!(container_label(one_device(mixed, &["lab"])), "");
    }

    #[test]
    fn a_failing_pod_resources_api_is_a_metric() {
        let metrics = Metrics::new();
        let report = Report {
            pod_resources_error: Some("dialing the kubelet's PodResources socket".into()),
            ..Report::default()
        };
        metrics.usage_reports().send_replace(Arc::new(report));
        let text = metrics.encode();
        assert!(
            text.lines()
                .any(|l| l == "drust_usage_pod_resources_failing 1"),
            "{text}"
        );
    }
}
