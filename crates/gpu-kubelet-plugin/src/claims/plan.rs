//! From an allocated ResourceClaim to what prepare makes: the devices and the CDI spec.

use std::collections::BTreeMap;

use dra_kubelet::ClaimRef;
use k8s_openapi::api::resource::v1::ResourceClaim;

use super::error::ClaimError;
use crate::cdi::{
    ANNOTATION_NAME, ANNOTATION_NAMESPACE, ANNOTATION_UID, CDI_VERSION, CdiDevice, CdiWriter,
    ContainerEdits, DeviceNode, Spec,
};
use crate::checkpoint::RecordedDevice;
use crate::hardware::{CONTROL_DEVICE_NODES, CreatedMig, Hardware, NodeDevice};

/// The devices of one claim on this node, and the CDI spec that exposes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) devices: Vec<RecordedDevice>,
    /// The node devices behind `devices`, in the same order.
    pub(crate) used: Vec<NodeDevice>,
    /// The CDI spec; `None` when a device is a MIG placement whose device nodes and UUID are
    /// known only once prepare created it.
    pub(crate) spec: Option<Spec>,
}

/// Checks `rc` against the kubelet's `claim` and builds the plan for this driver's devices in
/// this node's pool.
pub(crate) fn plan(
    claim: &ClaimRef,
    rc: &ResourceClaim,
    driver: &str,
    pool: &str,
    catalogue: &BTreeMap<String, NodeDevice>,
    hardware: &dyn Hardware,
    cdi: &CdiWriter,
) -> Result<Plan, ClaimError> {
    let uid = rc.metadata.uid.clone().unwrap_or_default();
    if uid != claim.uid {
        return Err(ClaimError::UidMismatch {
            claim: claim.clone(),
            found: uid,
        });
    }
    let results = rc
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref())
        .ok_or_else(|| ClaimError::NotAllocated {
            claim: claim.clone(),
        })?;

    let mut devices: Vec<RecordedDevice> = Vec::new();
    let mut used: Vec<NodeDevice> = Vec::new();
    for (index, r) in results.iter().enumerate() {
        if r.driver != driver || r.pool != pool {
            continue;
        }
        let device = catalogue
            .get(&r.device)
            .ok_or_else(|| ClaimError::UnknownDevice {
                claim: claim.clone(),
                index,
                device: r.device.clone(),
            })?;
        // One device can satisfy several requests (e.g. subrequests); list it once.
        if let Some(d) = devices.iter_mut().find(|d| d.device_name == r.device) {
            d.request_names.push(r.request.clone());
            continue;
        }
        used.push(device.clone());
        devices.push(RecordedDevice {
            request_names: vec![r.request.clone()],
            pool_name: r.pool.clone(),
            device_name: r.device.clone(),
            cdi_device_ids: vec![cdi.device_id(&claim.uid, &r.device)],
            uuid: device.visible_id().to_owned(),
            admin_access: r.admin_access.unwrap_or(false),
            mig: None,
        });
    }
    if devices.is_empty() {
        return Err(ClaimError::NotOurs {
            claim: claim.clone(),
            driver: driver.to_owned(),
            pool: pool.to_owned(),
        });
    }
    let created_later = used
        .iter()
        .any(|d| matches!(d, NodeDevice::MigPlacement { .. }));
    let spec = if created_later {
        None
    } else {
        let used: Vec<&NodeDevice> = used.iter().collect();
        Some(spec(claim, &used, &BTreeMap::new(), hardware, cdi)?)
    };
    Ok(Plan {
        spec,
        used,
        devices,
    })
}

/// The claim's CDI spec: one CDI device per allocated device with its device nodes
/// (`/dev/nvidia<minor>`, plus the MIG capability nodes of a MIG device); the control nodes and
/// `NVIDIA_VISIBLE_DEVICES` (the claim's GPU or MIG UUIDs) at spec level, since one spec holds
/// exactly one claim's devices. Annotations name the claim for recovery from disk. `created`
/// holds the MIG devices prepare created, by device name.
pub(crate) fn spec(
    claim: &ClaimRef,
    used: &[&NodeDevice],
    created: &BTreeMap<String, CreatedMig>,
    hardware: &dyn Hardware,
    cdi: &CdiWriter,
) -> Result<Spec, ClaimError> {
    let uuids: Vec<&str> = used
        .iter()
        .map(|d| {
            created
                .get(d.name())
                .map_or_else(|| d.visible_id(), |c| c.uuid.as_str())
        })
        .collect();
    let mut cdi_devices = Vec::with_capacity(used.len());
    for d in used {
        let nodes = hardware
            .device_nodes(d, created.get(d.name()))
            .map_err(|source| ClaimError::Hardware {
                claim: claim.clone(),
                source,
            })?;
        cdi_devices.push(CdiDevice {
            name: CdiWriter::device_name(&claim.uid, d.name()),
            container_edits: ContainerEdits {
                env: Vec::new(),
                device_nodes: nodes.into_iter().map(|path| DeviceNode { path }).collect(),
            },
        });
    }
    Ok(Spec {
        cdi_version: CDI_VERSION.to_owned(),
        kind: cdi.kind(),
        annotations: BTreeMap::from([
            (ANNOTATION_NAMESPACE.to_owned(), claim.namespace.clone()),
            (ANNOTATION_NAME.to_owned(), claim.name.clone()),
            (ANNOTATION_UID.to_owned(), claim.uid.clone()),
        ]),
        devices: cdi_devices,
        container_edits: ContainerEdits {
            env: vec![format!("NVIDIA_VISIBLE_DEVICES={}", uuids.join(","))],
            device_nodes: CONTROL_DEVICE_NODES
                .iter()
                .map(|p| DeviceNode {
                    path: (*p).to_owned(),
                })
                .collect(),
        },
    })
}
