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

pub use report::{ClaimReport, ContainerUse, DeviceReport, ProcessReport, Report};

pub use crate::config::{IdleThresholds, UsageConfig};
