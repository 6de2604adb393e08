//! Device names: stable, hardware-derived DNS labels.
//!
//! Scheme:
//! - A full GPU is `gpu-<domain>-<bus>-<device>-<function>` from its PCI bus ID, e.g.
//!   `gpu-0000-18-00-0` for `00000000:18:00.0`. The PCI address is fixed by the slot the GPU sits
//!   in, so the name survives reboots, driver reloads, NVML re-enumeration and the loss of any
//!   other GPU (NVML indices shift then; bus IDs do not). A GPU whose bus ID cannot be parsed is
//!   named from its UUID instead (`gpu-<uuid without the GPU- prefix>`, cut to 63 characters).
//! - A MIG device (existing or a possible placement) is
//!   `<parent>-mig-<profile>-<first memory slice>`, e.g. `gpu-0000-18-00-0-mig-1g-10gb-0`, with
//!   the profile's `.` and `+` spelled `-` (`1g.10gb+me` -> `1g-10gb-me`). The placement names
//!   the physical slices, so an existing MIG device and the partitionable placement it occupies
//!   share one name, whatever GPU instance id the driver handed out. A compute instance that
//!   covers only part of its GPU instance gets `-c<compute instance id>` appended.
//!
//! Every name is at most 63 characters of `[a-z0-9-]`, starting and ending alphanumeric (a DNS
//! label, as `Device.name` and `CounterSet.name` require).
//!
//! In NVIDIA compatibility mode ([`Naming::Nvidia`]) devices are named as NVIDIA's DRA driver
//! names them (`cmd/gpu-kubelet-plugin/deviceinfo.go` and `mig.go` of
//! github.com/NVIDIA/k8s-dra-driver-gpu): `gpu-<minor>`, and
//! `gpu-<parent minor>-mig-<profile>-<profile ID>-<first memory slice>` with the profile's dots
//! removed and other characters outside `[a-z0-9-]` spelled `-` (`1g.10gb+me` -> `1g10gb-me`),
//! so dashboards and tools keyed on NVIDIA's names (DCGM's `dra_device_name`) keep working.
//! Minor numbers are as stable as NVIDIA's names are, not as stable as PCI addresses.

use crate::backend::RawGpu;
use crate::model::standard_pci_bus_id;

/// Which scheme names devices (and spells the few values NVIDIA's driver spells differently).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Naming {
    /// drust's own: PCI-derived names (see the module docs).
    #[default]
    Drust,
    /// NVIDIA's DRA driver's, for drop-in compatibility.
    Nvidia,
}

/// A full GPU's name in NVIDIA's scheme: `gpu-<minor>`.
pub fn nvidia_gpu_device_name(gpu: &RawGpu) -> String {
    format!("gpu-{}", gpu.minor)
}

/// A MIG device's or placement's name in NVIDIA's scheme (see the module docs); a compute
/// instance smaller than its GPU instance gets `-c<id>` appended, as in drust's scheme (NVIDIA's
/// driver publishes no such devices).
pub fn nvidia_mig_device_name(
    parent_minor: u32,
    profile: &str,
    profile_id: u32,
    start: u32,
    compute_instance: Option<u32>,
) -> String {
    let mut name = format!(
        "gpu-{parent_minor}-mig-{}-{profile_id}-{start}",
        profile.replace('.', "")
    );
    if let Some(ci) = compute_instance {
        name.push_str(&format!("-c{ci}"));
    }
    label(&name)
}

/// Longest DNS label.
pub const MAX_NAME: usize = 63;

/// Lowercases, maps every other character to `-`, squeezes and trims dashes, cuts to 63.
fn label(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    for c in raw.chars() {
        let c = c.to_ascii_lowercase();
        if c.is_ascii_alphanumeric() {
            out.push(c);
        } else if !out.ends_with('-') {
            out.push('-');
        }
    }
    let mut out: String = out.trim_matches('-').chars().take(MAX_NAME).collect();
    while out.ends_with('-') {
        out.pop();
    }
    out
}

/// The device name of a full GPU (see the module docs).
pub fn gpu_device_name(gpu: &RawGpu) -> String {
    match standard_pci_bus_id(&gpu.pci_bus_id) {
        Some(bdf) => label(&format!("gpu-{bdf}")),
        None => {
            let uuid = gpu.uuid.trim();
            let uuid = uuid
                .strip_prefix("GPU-")
                .or_else(|| uuid.strip_prefix("gpu-"))
                .unwrap_or(uuid);
            label(&format!("gpu-{uuid}"))
        }
    }
}

/// The device name of a MIG device or placement of profile `profile` (e.g. `1g.10gb+me`)
/// starting at memory slice `start` on the GPU named `parent`; `compute_instance` is set for a
/// compute instance smaller than its GPU instance.
pub fn mig_device_name(
    parent: &str,
    profile: &str,
    start: u32,
    compute_instance: Option<u32>,
) -> String {
    // `-me` (no media extensions) and `+me` must not collide once `+` becomes `-`.
    let profile = profile.replace("-me", ".nome");
    let mut name = format!("{parent}-mig-{profile}-{start}");
    if let Some(ci) = compute_instance {
        name.push_str(&format!("-c{ci}"));
    }
    label(&name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_dns_label(s: &str) -> bool {
        !s.is_empty()
            && s.len() <= MAX_NAME
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !s.starts_with('-')
            && !s.ends_with('-')
    }

    #[test]
    fn mig_names_are_labels_and_distinct_per_profile_and_placement() {
        let parent = "gpu-0000-18-00-0";
        let cases = [
            ("1g.10gb", 0, None, "gpu-0000-18-00-0-mig-1g-10gb-0"),
            ("1g.10gb+me", 6, None, "gpu-0000-18-00-0-mig-1g-10gb-me-6"),
            ("1g.10gb-me", 6, None, "gpu-0000-18-00-0-mig-1g-10gb-nome-6"),
            ("7g.80gb", 0, Some(2), "gpu-0000-18-00-0-mig-7g-80gb-0-c2"),
        ];
        for (profile, start, ci, want) in cases {
            let name = mig_device_name(parent, profile, start, ci);
            assert_eq!(name, want);
            assert!(is_dns_label(&name), "{name}");
        }
    }

    #[test]
    fn labels_are_cut_and_trimmed_to_dns_labels() {
        for raw in ["gpu--A..b--", &"x".repeat(100), "gpu-GPU-ABC/def", "-a-"] {
            assert!(is_dns_label(&label(raw)), "{raw} -> {}", label(raw));
        }
    }
}
