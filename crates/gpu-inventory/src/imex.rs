//! IMEX channels: the device type a multi-node NVLink job's containers import fabric memory
//! through, published beside the GPUs of the node's pool.
//!
//! A channel is the character device `/dev/nvidia-caps-imex-channels/channel<N>`, major the
//! number on the `<major> nvidia-caps-imex-channels` line of the "Character devices" section of
//! `/proc/devices`, minor `N` (NVIDIA's `internal/common/nvcaps.go` reads the major the same
//! way; the kernel module creates the node only for `NVreg_CreateImexChannel0=1`, so the
//! container runtime makes it from the CDI spec). A node without that line has no IMEX and
//! publishes no channel (non-fatal, as NVIDIA's driver since its PR #1013).
//!
//! Each channel is published as `imex-channel-<N>` with `type = "imex-channel"`, `channel = N`,
//! and `nvlinkClique` when every GPU of the node is in one completed clique. Every claim of a
//! ComputeDomain on a node gets the same channel (IMEX memory is imported across nodes under
//! the same channel number, and a node serves one domain at a time), so the device allows
//! multiple allocations (KEP-5075). Its binding conditions (KEP-5007) hold a pod in the
//! scheduler's PreBind until the ComputeDomain controller reports the node's IMEX daemon ready
//! ([`BINDING_CONDITION`]) or failed ([`BINDING_FAILURE_CONDITION`]) in the claim's
//! `status.devices`; the node plugin never writes them.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::Device;

use crate::model::{Inventory, int, string};

/// The name of the channels' line in `/proc/devices`.
pub const PROC_DEVICES_NAME: &str = "nvidia-caps-imex-channels";
/// The directory of the channel device nodes.
pub const CHANNEL_DIR: &str = "/dev/nvidia-caps-imex-channels";
/// Prefix of a channel's device name: `imex-channel-<N>`.
pub const DEVICE_PREFIX: &str = "imex-channel-";
/// The `type` attribute of a channel.
pub const DEVICE_TYPE: &str = "imex-channel";
/// The condition the ComputeDomain controller sets `True` on the claim's `status.devices`
/// entry once the node's IMEX daemon answers READY; the scheduler binds the pod only then.
pub const BINDING_CONDITION: &str = "IMEXDaemonReady";
/// The condition the ComputeDomain controller sets `True` when the node's IMEX daemon cannot
/// start: the scheduler deallocates the claim and schedules the pod again.
pub const BINDING_FAILURE_CONDITION: &str = "IMEXDaemonFailed";

/// The channels a node publishes: `count` channels numbered from 0, of character major
/// `major`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImexChannels {
    /// The major of `nvidia-caps-imex-channels` in `/proc/devices`.
    pub major: u32,
    /// How many channels, `0..count`.
    pub count: u32,
}

impl ImexChannels {
    /// Whether channel `n` is one of these.
    pub fn has(&self, n: u32) -> bool {
        n < self.count
    }

    /// The published devices, channel by channel; `clique` is the node's NVLink clique
    /// ([`node_clique`]).
    pub fn devices(&self, clique: Option<&str>) -> Vec<Device> {
        (0..self.count)
            .map(|n| Device {
                name: device_name(n),
                attributes: Some(attributes(n, clique)),
                allow_multiple_allocations: Some(true),
                binding_conditions: Some(vec![BINDING_CONDITION.to_owned()]),
                binding_failure_conditions: Some(vec![BINDING_FAILURE_CONDITION.to_owned()]),
                ..Default::default()
            })
            .collect()
    }
}

/// The attributes of channel `n` (bare names: the driver's domain).
pub fn attributes(
    n: u32,
    clique: Option<&str>,
) -> BTreeMap<String, k8s_openapi::api::resource::v1::DeviceAttribute> {
    let mut attributes = BTreeMap::from([
        ("type".to_owned(), string(DEVICE_TYPE)),
        ("channel".to_owned(), int(n)),
    ]);
    if let Some(clique) = clique {
        attributes.insert("nvlinkClique".to_owned(), string(clique));
    }
    attributes
}

/// `imex-channel-<n>`.
pub fn device_name(n: u32) -> String {
    format!("{DEVICE_PREFIX}{n}")
}

/// The channel a device name names (`imex-channel-<n>`, `n` in canonical decimal), if any.
pub fn channel_of(device: &str) -> Option<u32> {
    let digits = device.strip_prefix(DEVICE_PREFIX)?;
    let n: u32 = digits.parse().ok()?;
    (n.to_string() == digits).then_some(n)
}

/// `/dev/nvidia-caps-imex-channels/channel<n>`, in the container as on the host.
pub fn device_path(n: u32) -> String {
    format!("{CHANNEL_DIR}/channel{n}")
}

/// The major number of `nvidia-caps-imex-channels` in the text of `/proc/devices`: the first
/// line `<major> nvidia-caps-imex-channels` of its "Character devices:" section (a block
/// device of that name would not do). `None` when there is none.
pub fn channel_major(proc_devices: &str) -> Option<u32> {
    let mut character = false;
    for line in proc_devices.lines() {
        let line = line.trim();
        if line.ends_with(':') {
            character = line == "Character devices:";
            continue;
        }
        if !character {
            continue;
        }
        let mut fields = line.split_whitespace();
        if let (Some(major), Some(name), None) = (fields.next(), fields.next(), fields.next())
            && name == PROC_DEVICES_NAME
            && let Ok(major) = major.parse()
        {
            return Some(major);
        }
    }
    None
}

/// The node's NVLink clique: the one `nvlinkClique` all of its GPUs share; `None` without GPUs,
/// when one GPU has none (not in a completed clique), or when they differ.
pub fn node_clique(inventory: &Inventory) -> Option<String> {
    let mut cliques = inventory.gpus.iter().map(|g| g.nvlink_clique.as_deref());
    let first = cliques.next()??;
    cliques.all(|c| c == Some(first)).then(|| first.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROC_DEVICES: &str = "Character devices:\n  1 mem\n195 nvidia-frontend\n\
        235 nvidia-caps-imex-channels\n509 nvidia-caps\n\nBlock devices:\n  8 sd\n";

    #[test]
    fn the_major_is_read_from_the_character_devices_section() {
        assert_eq!(channel_major(PROC_DEVICES), Some(235));
    }

    #[test]
    fn a_missing_line_or_a_block_device_of_that_name_gives_no_major() {
        let cases = [
            "Character devices:\n  1 mem\n\nBlock devices:\n  8 sd\n",
            "Character devices:\n  1 mem\n\nBlock devices:\n235 nvidia-caps-imex-channels\n",
            "Character devices:\nabc nvidia-caps-imex-channels\n",
            "Character devices:\n235 nvidia-caps-imex-channels-x\n",
            "",
        ];
        for text in cases {
            assert_eq!(channel_major(text), None, "{text:?}");
        }
    }

    #[test]
    fn channel_names_round_trip_and_reject_other_names() {
        assert_eq!(device_name(7), "imex-channel-7");
        assert_eq!(channel_of("imex-channel-7"), Some(7));
        for name in [
            "imex-channel-",
            "imex-channel-07",
            "imex-channel-x",
            "gpu-0",
            "imex-channel--1",
        ] {
            assert_eq!(channel_of(name), None, "{name}");
        }
        assert_eq!(device_path(0), "/dev/nvidia-caps-imex-channels/channel0");
    }

    #[test]
    fn channel_devices_carry_the_binding_conditions_and_allow_multiple_allocations() {
        let devices = ImexChannels {
            major: 235,
            count: 2,
        }
        .devices(Some("uuid.1"));
        assert_eq!(devices.len(), 2);
        let d = &devices[1];
        assert_eq!(d.name, "imex-channel-1");
        assert_eq!(d.allow_multiple_allocations, Some(true));
        assert_eq!(
            d.binding_conditions.as_deref(),
            Some(&["IMEXDaemonReady".to_owned()][..])
        );
        assert_eq!(
            d.binding_failure_conditions.as_deref(),
            Some(&["IMEXDaemonFailed".to_owned()][..])
        );
        let a = d.attributes.as_ref().expect("attributes");
        assert_eq!(a["type"].string.as_deref(), Some("imex-channel"));
        assert_eq!(a["channel"].int, Some(1));
        assert_eq!(a["nvlinkClique"].string.as_deref(), Some("uuid.1"));
        let none = ImexChannels {
            major: 235,
            count: 1,
        }
        .devices(None);
        assert!(
            !none[0]
                .attributes
                .as_ref()
                .expect("attributes")
                .contains_key("nvlinkClique")
        );
    }

    fn inventory(topology: &str) -> Inventory {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../examples/topologies")
            .join(topology);
        let topology = crate::Topology::from_file(path).expect("topology");
        crate::discover(&crate::FakeBackend::new(topology)).expect("inventory")
    }

    #[test]
    fn the_node_clique_is_the_one_all_gpus_share() {
        let tray = inventory("gb200-nvl-tray.yaml");
        let clique = node_clique(&tray).expect("the GB200 tray's GPUs share a clique");
        assert_eq!(Some(clique.as_str()), tray.gpus[0].nvlink_clique.as_deref());
        assert_eq!(node_clique(&inventory("dgx-h100.yaml")), None);
        let mut split = tray.clone();
        split.gpus[0].nvlink_clique = Some("other.1".into());
        assert_eq!(node_clique(&split), None, "GPUs in two cliques");
        split.gpus[0].nvlink_clique = None;
        assert_eq!(node_clique(&split), None, "one GPU in none");
        split.gpus.clear();
        assert_eq!(node_clique(&split), None, "no GPU");
    }
}
