//! Who holds GPUs and does not use them: per-device usage joined with the claims that hold the
//! devices and the pods whose processes run on them, and how long each claim has been idle.
//!
//! Every [`UsageConfig::interval`] the active instance samples each GPU it publishes
//! ([`gpu_inventory::GpuBackend::usage`]: utilization, memory used, processes) on a blocking
//! thread, without any GPU lock and apart from prepare and unprepare, reads each process's
//! cgroup to find its pod and container ([`cgroup`]), asks the kubelet which container of each
//! pod holds each device (its PodResources API, for container names), and builds a [`Report`] ([`report`])
//! that `/metrics` ([`collector`]) and `/usage` serve; idle claims get a `GPUIdle` condition on
//! their device status, which the explain controller relays to their pods ([`idle_status`]).
//!
//! **Busy and idle.** A device is busy in a sample when its SM utilization or its memory
//! activity reaches [`IdleThresholds`]; a MIG device by GPM's figures of its GPU instance
//! (SM utilization, memory bandwidth; Hopper and later), and where there are none (an A100, or
//! the instance's first sample) while a process runs on it. A share (consumable capacity) is busy when its own
//! processes' SM utilization reaches the threshold, where NVML gives per-process figures
//! (`nvmlDeviceGetProcessUtilization`) that account for all of the GPU's work; otherwise (no
//! per-process figures, or work NVML counts to a process outside any claim, as it may count
//! MPS clients' work to the server) when its GPU is busy and a process of the share's pods runs
//! on it, or, when the pods of the GPU's shares cannot be told apart, whenever its GPU is
//! busy: in doubt, busy. A claim is busy when one of its
//! devices is; it is idle once it has not been busy for [`IdleThresholds::window`] since it
//! was prepared (or since the plugin started, for a claim prepared before).

pub mod cgroup;
pub mod collector;
pub mod idle_status;
pub mod report;
pub mod sampler;
pub mod share_mounts;

use std::path::PathBuf;
use std::time::Duration;

pub use report::{ClaimReport, ContainerUse, DeviceReport, ProcessReport, Report};

/// When a claim counts as idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdleThresholds {
    /// A device whose SM utilization (percent, 0..=100) reaches this is busy.
    pub sm_percent: u32,
    /// A device whose memory activity (percent of time memory was read or written) reaches this
    /// is busy.
    pub memory_percent: u32,
    /// How long a claim must go without a busy sample to be idle.
    pub window: Duration,
}

impl Default for IdleThresholds {
    /// 5 % SM, 5 % memory activity, 30 minutes.
    fn default() -> Self {
        Self {
            sm_percent: 5,
            memory_percent: 5,
            window: Duration::from_secs(30 * 60),
        }
    }
}

/// How usage is sampled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageConfig {
    /// Time between two samples (default 10 s).
    pub interval: Duration,
    /// When a claim is idle.
    pub idle: IdleThresholds,
    /// The host's `/proc` as the plugin sees it (processes' cgroups).
    pub proc_root: PathBuf,
    /// Mark idle claims with a `GPUIdle` condition on their device status ([`idle_status`]).
    pub idle_events: bool,
    /// The kubelet's PodResources socket, asked at each sample which container holds each
    /// device (container names); `None`: not asked, names left out. The binary's default is
    /// [`dra_kubelet::pod_resources::DEFAULT_SOCKET`].
    pub pod_resources_socket: Option<PathBuf>,
}

impl Default for UsageConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(10),
            idle: IdleThresholds::default(),
            proc_root: PathBuf::from("/proc"),
            idle_events: true,
            pod_resources_socket: None,
        }
    }
}
