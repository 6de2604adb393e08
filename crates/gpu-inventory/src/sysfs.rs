//! Values NVML does not give, read from sysfs under a configurable root (tests use a temp dir).

use std::path::{Component, Path, PathBuf};

/// A sysfs lookup failed.
#[derive(Debug, thiserror::Error)]
pub enum SysfsError {
    /// The PCI device link could not be read.
    #[error("reading the link {path}: {source}")]
    ReadLink {
        /// The link.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The link does not point where a PCI device link must.
    #[error("{path} points to {target}, not to devices/pci<domain>:<bus>/.../{bdf}")]
    UnexpectedTarget {
        /// The link.
        path: PathBuf,
        /// Where it points.
        target: PathBuf,
        /// The device's bus ID.
        bdf: String,
    },
}

/// The PCIe root complex of the PCI device `bdf` (`dddd:bb:dd.f`), e.g. `pci0000:17`: the first
/// path component under `devices/` of what `<sysfs_root>/bus/pci/devices/<bdf>` links to.
/// Mirrors upstream's `resolvePCIeRoot` (k8s.io/dynamic-resource-allocation/deviceattribute).
///
/// # Errors
/// [`SysfsError`] when the link is missing or points elsewhere.
pub fn pcie_root(sysfs_root: &Path, bdf: &str) -> Result<String, SysfsError> {
    let link = sysfs_root.join("bus/pci/devices").join(bdf);
    let target = std::fs::read_link(&link).map_err(|source| SysfsError::ReadLink {
        path: link.clone(),
        source,
    })?;
    // Resolve relative to the link's directory, lexically (sysfs links are relative).
    let absolute = if target.is_absolute() {
        target.clone()
    } else {
        let mut p = link.parent().map(Path::to_path_buf).unwrap_or_default();
        for c in target.components() {
            match c {
                Component::ParentDir => {
                    p.pop();
                }
                Component::CurDir => {}
                other => p.push(other),
            }
        }
        p
    };
    let unexpected = || SysfsError::UnexpectedTarget {
        path: link.clone(),
        target: target.clone(),
        bdf: bdf.to_owned(),
    };
    let under_devices = absolute
        .strip_prefix(sysfs_root.join("devices"))
        .map_err(|_| unexpected())?;
    if absolute.file_name().and_then(|n| n.to_str()) != Some(bdf) {
        return Err(unexpected());
    }
    match under_devices.components().next() {
        Some(Component::Normal(root)) => match root.to_str() {
            Some(r) if r.starts_with("pci") => Ok(r.to_owned()),
            _ => Err(unexpected()),
        },
        _ => Err(unexpected()),
    }
}

/// NUMA node of the PCI device `bdf` from `<sysfs_root>/bus/pci/devices/<bdf>/numa_node`;
/// `None` when unreadable or `-1` (no NUMA affinity).
pub fn numa_node(sysfs_root: &Path, bdf: &str) -> Option<u32> {
    let path = sysfs_root
        .join("bus/pci/devices")
        .join(bdf)
        .join("numa_node");
    std::fs::read_to_string(path)
        .ok()?
        .trim()
        .parse::<i64>()
        .ok()?
        .try_into()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pcie_root_is_the_first_component_of_the_resolved_device_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        let device = root.join("devices/pci0000:17/0000:17:01.0/0000:18:00.0");
        std::fs::create_dir_all(&device).expect("mkdir");
        std::fs::write(device.join("numa_node"), "1\n").expect("write");
        std::fs::create_dir_all(root.join("bus/pci/devices")).expect("mkdir");
        std::os::unix::fs::symlink(
            "../../../devices/pci0000:17/0000:17:01.0/0000:18:00.0",
            root.join("bus/pci/devices/0000:18:00.0"),
        )
        .expect("symlink");
        std::os::unix::fs::symlink(
            "../../../class/net/eth0",
            root.join("bus/pci/devices/0000:19:00.0"),
        )
        .expect("symlink");

        assert_eq!(
            pcie_root(root, "0000:18:00.0").expect("resolves"),
            "pci0000:17"
        );
        assert_eq!(numa_node(root, "0000:18:00.0"), Some(1));
        assert!(matches!(
            pcie_root(root, "0000:19:00.0"),
            Err(SysfsError::UnexpectedTarget { .. })
        ));
        assert!(matches!(
            pcie_root(root, "0000:20:00.0"),
            Err(SysfsError::ReadLink { .. })
        ));
        assert_eq!(numa_node(root, "0000:20:00.0"), None);
    }
}
