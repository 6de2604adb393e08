//! The node's IMEX channels ([`gpu_inventory::imex`]): how many this node publishes, found
//! once at start from the kernel's device table, and the CDI device node a prepared channel
//! gets.
//!
//! The channel's node is made by the container runtime from the CDI spec's numbers
//! (`type: c`, the major from `/proc/devices`, minor = channel), as NVIDIA's driver injects it
//! (`internal/common/nvcaps.go`): hosts create at most channel 0 themselves, and only with
//! `NVreg_CreateImexChannel0=1`.

use std::path::Path;

use gpu_inventory::imex::{self, ImexChannels};
use tracing::{info, warn};

use crate::cdi::DeviceNode;

/// The channels to publish: `wanted` of them (`None`: one), where `proc_devices` names the
/// channels' major; none where it does not, or cannot be read (said in the log, never fatal:
/// a node without IMEX still serves its GPUs).
pub fn detect(proc_devices: &Path, wanted: Option<u32>) -> Option<ImexChannels> {
    if wanted == Some(0) {
        return None;
    }
    let text = match std::fs::read_to_string(proc_devices) {
        Ok(text) => text,
        Err(e) => {
            warn!(path = %proc_devices.display(), error = %e,
                "cannot read the kernel's device table: no IMEX channels are published");
            return None;
        }
    };
    let Some(major) = imex::channel_major(&text) else {
        let log = |m: &str| match wanted {
            Some(_) => warn!(path = %proc_devices.display(), "{m}"),
            None => info!(path = %proc_devices.display(), "{m}"),
        };
        log(&format!(
            "no {} line in the kernel's device table (no IMEX on this node): no IMEX channels \
             are published",
            imex::PROC_DEVICES_NAME
        ));
        return None;
    };
    let channels = ImexChannels {
        major,
        count: wanted.unwrap_or(1),
    };
    info!(major, count = channels.count, "IMEX channels published");
    Some(channels)
}

/// The CDI device node of channel `n`: the runtime makes
/// `/dev/nvidia-caps-imex-channels/channel<n>` in the container, character major
/// `major`, minor `n`, readable and writable.
pub fn device_node(major: u32, n: u32) -> DeviceNode {
    DeviceNode {
        path: imex::device_path(n),
        host_path: None,
        kind: Some("c".to_owned()),
        major: Some(i64::from(major)),
        minor: Some(i64::from(n)),
        permissions: Some("rw".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(text: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().expect("temp file");
        std::fs::write(f.path(), text).expect("write");
        f
    }

    #[test]
    fn one_channel_is_published_by_default_where_the_table_has_the_line() {
        let f = table("Character devices:\n195 nvidia\n235 nvidia-caps-imex-channels\n");
        assert_eq!(
            detect(f.path(), None),
            Some(ImexChannels {
                major: 235,
                count: 1
            })
        );
        assert_eq!(detect(f.path(), Some(4)).map(|c| c.count), Some(4));
        assert_eq!(detect(f.path(), Some(0)), None);
    }

    #[test]
    fn a_missing_line_or_table_publishes_no_channel_even_when_asked() {
        let f = table("Character devices:\n195 nvidia\n");
        assert_eq!(detect(f.path(), None), None);
        assert_eq!(detect(f.path(), Some(2)), None);
        assert_eq!(detect(Path::new("/nonexistent/devices"), Some(1)), None);
    }

    #[test]
    fn the_device_node_carries_type_major_minor_and_permissions() {
        let node = device_node(235, 3);
        let json = serde_json::to_value(&node).expect("json");
        assert_eq!(
            json,
            serde_json::json!({
                "path": "/dev/nvidia-caps-imex-channels/channel3",
                "type": "c", "major": 235, "minor": 3, "permissions": "rw"
            })
        );
    }
}
