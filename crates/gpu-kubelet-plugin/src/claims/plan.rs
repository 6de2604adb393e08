//! From an allocated ResourceClaim to what prepare makes: the devices and the CDI spec.

use std::collections::{BTreeMap, BTreeSet};

use dra_kubelet::ClaimRef;
use dra_plugin::allocation;
use k8s_openapi::api::resource::v1::ResourceClaim;

use super::error::ClaimError;
use crate::cdi::{CDI_VERSION, CdiDevice, CdiWriter, ContainerEdits, DeviceNode, Hook, Spec};
use crate::checkpoint::{RecordedDevice, RecordedShare};
use crate::claim_config::{self, ConfigTarget, DeviceKind, Sharing};
use crate::device_metadata::{DeviceMetadata, MetadataDevice, MetadataFile};
use crate::hardware::{CONTROL_DEVICE_NODES, CreatedMig, Hardware, NodeDevice};
use crate::mps::MpsControl;

/// The devices of one claim on this node, and the CDI spec that exposes them.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Plan {
    pub(crate) devices: Vec<RecordedDevice>,
    /// The node devices behind `devices`, in the same order.
    pub(crate) used: Vec<NodeDevice>,
    /// The CDI spec; `None` when a device is a MIG placement whose device nodes and UUID are
    /// known only once prepare created it.
    pub(crate) spec: Option<Spec>,
    /// Spec-level hooks of this claim alone: the claim-user hook of a claim reserved for no pod
    /// ([`crate::claim_users`]).
    pub(crate) claim_hooks: Vec<Hook>,
    /// The claim's device metadata (KEP-5304), where the plugin writes it; the spec already
    /// mounts its files, which prepare writes ([`crate::device_metadata`]).
    pub(crate) metadata: Option<MetadataPlan>,
    /// The claim's IMEX channels: recorded and in the spec, but not in `devices` (no GPU
    /// behind them, nothing for the hardware step).
    pub(crate) channels: Vec<RecordedDevice>,
}

impl Plan {
    /// Every device prepared for the claim: `devices`, then `channels`.
    pub(crate) fn all_devices(&self) -> Vec<RecordedDevice> {
        self.devices.iter().chain(&self.channels).cloned().collect()
    }
}

/// What a claim's device metadata files are made of.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct MetadataPlan {
    /// The claim's name, namespace, UID and annotations.
    pub(crate) claim: ResourceClaim,
    /// Its devices, each once per request it serves.
    pub(crate) devices: Vec<MetadataDevice>,
}

impl MetadataPlan {
    /// The files, with the UUIDs of the MIG devices prepare `created` (by device name).
    pub(crate) fn files(
        &self,
        writer: &DeviceMetadata,
        created: &BTreeMap<String, CreatedMig>,
    ) -> Result<Vec<MetadataFile>, String> {
        let mut devices = self.devices.clone();
        for d in &mut devices {
            if let Some(uuid) = created.get(&d.name).map(|m| m.uuid.clone()) {
                d.attributes.insert(
                    "uuid".to_owned(),
                    k8s_openapi::api::resource::v1::DeviceAttribute {
                        string: Some(uuid),
                        ..Default::default()
                    },
                );
            }
        }
        writer.files(&self.claim, &devices)
    }
}

/// What a plan is made against: this driver's pool, devices and settings.
pub(crate) struct PlanContext<'a> {
    pub(crate) driver: &'a str,
    pub(crate) pool: &'a str,
    pub(crate) catalogue: std::sync::Arc<super::Catalogue>,
    pub(crate) hardware: &'a dyn Hardware,
    pub(crate) cdi: &'a CdiWriter,
    /// Whether sharing configs are allowed (`--sharing`).
    pub(crate) sharing: bool,
    pub(crate) mps: &'a MpsControl,
    /// The `kernel` level's memory limits, if the node has them.
    pub(crate) kernel_memory: Option<&'a crate::memory_limits::KernelMemory>,
    /// The claim-user hook, where installed.
    pub(crate) claim_users: Option<&'a crate::claim_users::ClaimUsers>,
    /// The device metadata writer, where on.
    pub(crate) device_metadata: Option<&'a DeviceMetadata>,
    /// Spec-level edits of the driver's files ([`super::ControllerConfig::driver_edits`]).
    pub(crate) driver_edits: &'a ContainerEdits,
    /// The IMEX channels the node publishes.
    pub(crate) imex: Option<gpu_inventory::imex::ImexChannels>,
}

/// Checks `rc` against the kubelet's `claim` and builds the plan for this driver's devices in
/// this node's pool, with each device's sharing from the allocation's opaque configs.
pub(crate) fn plan(
    claim: &ClaimRef,
    rc: &ResourceClaim,
    cx: &PlanContext<'_>,
) -> Result<Plan, ClaimError> {
    let (driver, pool, catalogue) = (cx.driver, cx.pool, &cx.catalogue);
    // The claim is the kubelet's and allocated; its results of this pool, by device.
    let allocated = allocation::allocation(claim, rc, driver, pool)?;
    let configs = allocated.config;

    let mut devices: Vec<RecordedDevice> = Vec::new();
    let mut used: Vec<NodeDevice> = Vec::new();
    // Index in `results` of each of `devices`, for errors naming the result.
    let mut result_index: Vec<usize> = Vec::new();
    // The IMEX channels, apart: no GPU behind them, no hardware step.
    let mut channels: Vec<RecordedDevice> = Vec::new();
    for a in &allocated.devices {
        let (index, r) = a.results[0];
        if let Some(n) = gpu_inventory::imex::channel_of(a.device) {
            let imex = cx
                .imex
                .filter(|c| c.has(n))
                .ok_or_else(|| ClaimError::UnknownDevice {
                    claim: claim.clone(),
                    index,
                    device: r.device.clone(),
                })?;
            channels.push(RecordedDevice {
                request_names: a.request_names(),
                pool_name: a.pool.to_owned(),
                device_name: a.device.to_owned(),
                cdi_device_ids: vec![cx.cdi.device_id(&claim.uid, a.device)],
                uuid: String::new(),
                admin_access: r.admin_access.unwrap_or(false),
                sharing: None,
                mig: None,
                share: None,
                imex_channel: Some(crate::checkpoint::RecordedChannel {
                    channel: n,
                    major: imex.major,
                    domain_id: String::new(),
                    share_id: r.share_id.clone(),
                }),
            });
            continue;
        }
        let Some(device) = catalogue.devices.get(a.device) else {
            return Err(if catalogue.retired.contains_key(a.device) {
                ClaimError::DeviceGone {
                    claim: claim.clone(),
                    index,
                    device: r.device.clone(),
                }
            } else {
                ClaimError::UnknownDevice {
                    claim: claim.clone(),
                    index,
                    device: r.device.clone(),
                }
            });
        };
        // One device can satisfy several requests (e.g. subrequests), but one claim takes at
        // most one share of it.
        if let Some(&(second, _)) = a.results.get(1)
            && a.results.iter().any(|(_, r)| r.share_id.is_some())
        {
            return Err(ClaimError::Share {
                claim: claim.clone(),
                index: second,
                device: r.device.clone(),
                problem: "a second allocation of this device in the same claim: one claim \
                          takes at most one share of a device (ask for more capacity in one \
                          request instead)"
                    .into(),
            });
        }
        let share = match &r.share_id {
            None => None,
            Some(_) => Some(share(claim, index, r, device)?),
        };
        used.push(device.clone());
        result_index.push(index);
        devices.push(RecordedDevice {
            request_names: a.request_names(),
            pool_name: a.pool.to_owned(),
            device_name: a.device.to_owned(),
            cdi_device_ids: vec![cx.cdi.device_id(&claim.uid, a.device)],
            uuid: device.visible_id().to_owned(),
            admin_access: r.admin_access.unwrap_or(false),
            sharing: None,
            mig: None,
            share,
            imex_channel: None,
        });
    }
    let channel_targets: Vec<ConfigTarget<'_>> = channels
        .iter()
        .map(|d| ConfigTarget {
            request: d.request_names.first().map_or("", String::as_str),
            device: &d.device_name,
            kind: DeviceKind::ImexChannel,
            memory_bytes: 0,
            uuid: None,
        })
        .collect();
    let domains =
        claim_config::resolve_channels(configs, driver, &channel_targets).map_err(|source| {
            ClaimError::Config {
                claim: claim.clone(),
                source,
            }
        })?;
    for (d, domain) in channels.iter_mut().zip(domains) {
        if let Some(c) = &mut d.imex_channel {
            c.domain_id = domain;
        }
    }
    let targets: Vec<ConfigTarget<'_>> = devices
        .iter()
        .zip(&used)
        .map(|(d, n)| ConfigTarget {
            request: d.request_names.first().map_or("", String::as_str),
            device: &d.device_name,
            kind: if n.is_mig() {
                DeviceKind::Mig
            } else {
                DeviceKind::Gpu
            },
            memory_bytes: n.memory_bytes(),
            // A placement's MIG device gets its UUID only when prepare creates it.
            uuid: (!matches!(n, NodeDevice::MigPlacement { .. }))
                .then_some(d.uuid.as_str())
                .filter(|u| !u.is_empty()),
        })
        .collect();
    let sharing =
        claim_config::resolve(configs, driver, cx.sharing, &targets).map_err(|source| {
            ClaimError::Config {
                claim: claim.clone(),
                source,
            }
        })?;
    for (d, s) in devices.iter_mut().zip(sharing) {
        // Admin access (KEP-5018) reaches a device that other claims may be using: it never
        // changes the GPU's sharing (time slice, MPS), so neither does its unprepare. A class
        // or claim config asking for sharing is ignored for such a device, and said so.
        if d.admin_access && s.is_some() {
            tracing::info!(claim = %claim, device = %d.device_name,
                "admin access: the claim's sharing config is not applied to the device");
            continue;
        }
        d.sharing = s;
    }
    super::shares::check(claim, &devices, &result_index)?;
    for ((d, n), &index) in devices.iter().zip(&used).zip(&result_index) {
        let mps = matches!(d.sharing, Some(Sharing::Mps(_)))
            || d.share.as_ref().is_some_and(|s| s.uses_mps());
        let raw = &n.gpu().raw;
        if mps && raw.cuda_compute_capability_major < crate::mps::MIN_MPS_COMPUTE_CAPABILITY {
            return Err(ClaimError::MpsUnsupported {
                claim: claim.clone(),
                index,
                device: d.device_name.clone(),
                major: raw.cuda_compute_capability_major,
                minor: raw.cuda_compute_capability_minor,
            });
        }
    }
    let claim_hooks: Vec<Hook> = cx
        .claim_users
        .filter(|_| reserved_for_no_pod(rc))
        .map(|users| users.hook(&claim.uid))
        .into_iter()
        .collect();
    let clique = node_clique(&catalogue.devices);
    let metadata = cx.device_metadata.map(|_| MetadataPlan {
        claim: ResourceClaim {
            metadata: rc.metadata.clone(),
            ..Default::default()
        },
        devices: devices
            .iter()
            .zip(&used)
            .map(|(d, node)| (d, crate::device_metadata::published_attributes(node, None)))
            .chain(channels.iter().filter_map(|d| {
                let n = d.imex_channel.as_ref()?.channel;
                Some((d, gpu_inventory::imex::attributes(n, clique.as_deref())))
            }))
            .flat_map(|(d, attributes)| {
                d.request_names.iter().map(move |request| MetadataDevice {
                    request: request.clone(),
                    pool: d.pool_name.clone(),
                    name: d.device_name.clone(),
                    attributes: attributes.clone(),
                })
            })
            .collect(),
    });
    let created_later = used
        .iter()
        .any(|d| matches!(d, NodeDevice::MigPlacement { .. }));
    let spec = if created_later {
        None
    } else {
        let refs: Vec<&NodeDevice> = used.iter().collect();
        let mut spec = spec(
            claim,
            &refs,
            &BTreeMap::new(),
            &MpsEdits::of(cx.mps, cx.kernel_memory, &devices),
            &claim_edits(cx.driver_edits, &claim_hooks),
            cx.hardware,
            cx.cdi,
        )?;
        add_channels(&mut spec, claim, &channels);
        add_metadata_mounts(&mut spec, claim, cx.device_metadata, metadata.as_ref());
        Some(spec)
    };
    Ok(Plan {
        spec,
        used,
        devices,
        claim_hooks,
        metadata,
        channels,
    })
}

/// The NVLink clique all GPUs of `devices` share, as the channels publish it
/// ([`gpu_inventory::imex::node_clique`]).
fn node_clique(devices: &BTreeMap<String, NodeDevice>) -> Option<String> {
    let mut cliques = devices.values().map(|d| d.gpu().nvlink_clique.as_deref());
    let first = cliques.next()??;
    cliques.all(|c| c == Some(first)).then(|| first.to_owned())
}

/// Adds a CDI device for each IMEX channel among `devices` to `spec`: its device node, made by
/// the runtime from its numbers ([`crate::imex::device_node`]), and `DRUST_DEVICE_<NAME>=
/// channel<N>`. Nothing else: a channel needs no driver file beyond the GPUs'.
pub(crate) fn add_channels(spec: &mut Spec, claim: &ClaimRef, devices: &[RecordedDevice]) {
    for d in devices {
        let Some(c) = &d.imex_channel else {
            continue;
        };
        let mut edits = ContainerEdits::default();
        edits
            .env
            .push(device_env(&d.device_name, &format!("channel{}", c.channel)));
        edits
            .device_nodes
            .push(crate::imex::device_node(c.major, c.channel));
        spec.devices.push(CdiDevice {
            name: CdiWriter::device_name(&claim.uid, &d.device_name),
            container_edits: edits,
        });
    }
}

/// Mounts the metadata files of `metadata` into `spec` (their paths do not depend on what
/// prepare creates). A claim whose files cannot be named gets none, with a warning.
pub(crate) fn add_metadata_mounts(
    spec: &mut Spec,
    claim: &ClaimRef,
    writer: Option<&DeviceMetadata>,
    metadata: Option<&MetadataPlan>,
) {
    let (Some(writer), Some(metadata)) = (writer, metadata) else {
        return;
    };
    match metadata.files(writer, &BTreeMap::new()) {
        Ok(files) => crate::device_metadata::add_mounts(spec, &claim.uid, &files),
        Err(e) => tracing::warn!(claim = %claim, error = %e,
            "the claim's device metadata cannot be written; its containers get none"),
    }
}

/// The spec-level edits of one claim: the driver's (`driver`), then the claim's own hooks.
pub(crate) fn claim_edits<'e>(
    driver: &'e ContainerEdits,
    claim_hooks: &[Hook],
) -> std::borrow::Cow<'e, ContainerEdits> {
    if claim_hooks.is_empty() {
        return std::borrow::Cow::Borrowed(driver);
    }
    let mut edits = driver.clone();
    edits.hooks.extend(claim_hooks.iter().cloned());
    std::borrow::Cow::Owned(edits)
}

/// Whether `rc` is reserved for a consumer that is not a pod (a PodGroup, KEP-5729: its
/// `status.reservedFor` names the PodGroup, `scheduling.k8s.io` `podgroups`).
pub(crate) fn reserved_for_no_pod(rc: &ResourceClaim) -> bool {
    rc.status
        .as_ref()
        .and_then(|s| s.reserved_for.as_ref())
        .is_some_and(|r| {
            r.iter().any(|c| {
                c.resource != "pods" || c.api_group.as_deref().is_some_and(|g| !g.is_empty())
            })
        })
}

/// The MIG devices prepare created for `devices`, by device name.
pub(crate) fn created_migs(devices: &[RecordedDevice]) -> BTreeMap<String, CreatedMig> {
    devices
        .iter()
        .filter_map(|d| d.mig.clone().map(|m| (d.device_name.clone(), m)))
        .collect()
}

/// The share of `device` that allocation result `r` (at `index`) holds, from its `shareID` and
/// `consumedCapacity`.
fn share(
    claim: &ClaimRef,
    index: usize,
    r: &k8s_openapi::api::resource::v1::DeviceRequestAllocationResult,
    device: &NodeDevice,
) -> Result<RecordedShare, ClaimError> {
    let problem = |problem: String| ClaimError::Share {
        claim: claim.clone(),
        index,
        device: r.device.clone(),
        problem,
    };
    let consumed = r.consumed_capacity.clone().unwrap_or_default();
    let consumed =
        gpu_inventory::shares::consumed(&consumed).map_err(|e| problem(e.to_string()))?;
    let total = device.memory_bytes();
    if consumed.memory_bytes > total {
        return Err(problem(format!(
            "consumedCapacity memory is {} bytes, more than the device's {total}",
            consumed.memory_bytes
        )));
    }
    Ok(RecordedShare {
        id: r.share_id.clone().unwrap_or_default(),
        memory_bytes: consumed.memory_bytes,
        compute_percent: consumed.compute_percent,
        whole: gpu_inventory::shares::is_whole(consumed.memory_bytes, total),
    })
}

/// The MPS edits of a claim's CDI spec, all in the edits of the devices they serve (never at
/// spec level, which reaches every container of the claim): the claim's own daemon in the edits
/// of each device an MPS sharing config covers, and each share's daemon and limits in its
/// device's edits. A container of a request whose devices are not under MPS (a time-sliced or
/// exclusive request of the same claim) gets no pipe directory, no shared memory and no MPS
/// variable: NVIDIA's DRA driver, too, attaches a config's edits only to the devices it covers.
pub(crate) struct MpsEdits<'a> {
    control: &'a MpsControl,
    /// The `kernel` level: each share on a full GPU also gets the hook that sets its
    /// container's memory limit.
    kernel: Option<&'a crate::memory_limits::KernelMemory>,
    /// The devices under the claim's own daemon (an MPS sharing config), by name.
    claim_daemon: BTreeSet<String>,
    /// Daemon key, memory bytes and compute percentage of each share run under MPS, by device.
    shares: BTreeMap<String, (String, u64, u32)>,
}

impl<'a> MpsEdits<'a> {
    /// The edits `devices` need.
    pub(crate) fn of(
        control: &'a MpsControl,
        kernel: Option<&'a crate::memory_limits::KernelMemory>,
        devices: &[RecordedDevice],
    ) -> Self {
        Self {
            control,
            kernel,
            claim_daemon: super::sharing::claim_daemon::device_names(devices)
                .into_iter()
                .map(str::to_owned)
                .collect(),
            shares: super::shares::mps_shares(devices)
                .filter_map(|d| {
                    let s = d.share.as_ref()?;
                    Some((
                        d.device_name.clone(),
                        (
                            super::shares::daemon_key(&d.uuid),
                            s.memory_bytes,
                            s.compute_percent,
                        ),
                    ))
                })
                .collect(),
        }
    }
}

/// Whether any of `devices` is shared through MPS (the claim then has a daemon).
pub(crate) fn uses_mps(devices: &[RecordedDevice]) -> bool {
    devices
        .iter()
        .any(|d| matches!(d.sharing, Some(Sharing::Mps(_))))
}

/// The claim's CDI spec.
///
/// Everything that names a device is in that device's edits, because the kubelet hands each
/// container only the CDI devices of the requests it references (`resources.claims[].request`):
/// its device nodes (`/dev/nvidia<minor>`, plus the MIG capability nodes of a MIG device) and
/// `DRUST_DEVICE_<NAME>=<uuid>` ([`device_env`]), one variable per device so that a container
/// holding several devices sees all of them (CDI keeps only the last value of a repeated
/// variable, so one list variable cannot be per device), and its MPS edits ([`MpsEdits`]). The
/// spec-level edits are what every
/// container of the claim needs whatever its devices: the control nodes, the `driver` edits
/// (the driver's libraries, binaries, firmware, sockets and hooks: [`crate::driver_files`](mod@crate::driver_files)), and
/// `NVIDIA_VISIBLE_DEVICES=void` so that an
/// NVIDIA container runtime on the node injects nothing beyond what CDI did (as NVIDIA's own DRA
/// driver does). Annotations name the claim for recovery from disk. `created` holds the MIG
/// devices prepare created, by device name.
pub(crate) fn spec(
    claim: &ClaimRef,
    used: &[&NodeDevice],
    created: &BTreeMap<String, CreatedMig>,
    mps: &MpsEdits<'_>,
    driver: &ContainerEdits,
    hardware: &dyn Hardware,
    cdi: &CdiWriter,
) -> Result<Spec, ClaimError> {
    let mut cdi_devices = Vec::with_capacity(used.len());
    for d in used {
        let uuid = created
            .get(d.name())
            .map_or_else(|| d.visible_id(), |c| c.uuid.as_str());
        let nodes = hardware
            .device_nodes(d, created.get(d.name()))
            .map_err(|source| ClaimError::Hardware {
                claim: claim.clone(),
                source,
            })?;
        let mut edits = match mps.shares.get(d.name()) {
            Some((key, memory, compute)) => {
                // The `kernel` level runs the device's daemon on MPS v3: the share's own
                // namespace socket, nothing else of the daemon's.
                let mut edits = match mps.kernel {
                    Some(_) => mps
                        .control
                        .namespace_edits(key, &claim.uid, *memory, *compute),
                    None => mps.control.share_edits(key, &claim.uid, *memory, *compute),
                };
                // NVML refuses MIG handles; a MIG device's partition bounds its shares.
                if let Some(kernel) = mps.kernel.filter(|_| !d.is_mig()) {
                    edits.hooks.push(kernel.hook(&claim.uid, uuid, *memory));
                }
                edits
            }
            None if mps.claim_daemon.contains(d.name()) => mps.control.container_edits(&claim.uid),
            None => ContainerEdits::default(),
        };
        edits.env.insert(0, device_env(d.name(), uuid));
        edits.device_nodes = nodes
            .into_iter()
            .map(|path| DeviceNode {
                host_path: hardware.host_path(&path),
                path,
                ..Default::default()
            })
            .collect();
        cdi_devices.push(CdiDevice {
            name: CdiWriter::device_name(&claim.uid, d.name()),
            container_edits: edits,
        });
    }
    let mut spec = Spec {
        cdi_version: CDI_VERSION.to_owned(),
        kind: cdi.kind(),
        annotations: BTreeMap::new(),
        devices: cdi_devices,
        container_edits: {
            let mut edits = ContainerEdits::default();
            edits.env.push(NVIDIA_VISIBLE_DEVICES_VOID.to_owned());
            edits.env.extend(driver.env.iter().cloned());
            edits.mounts.extend(driver.mounts.iter().cloned());
            edits.hooks.extend(driver.hooks.iter().cloned());
            edits.device_nodes = CONTROL_DEVICE_NODES
                .iter()
                .map(|p| DeviceNode {
                    path: (*p).to_owned(),
                    host_path: hardware.host_path(p),
                    ..Default::default()
                })
                .collect();
            edits
        },
    };
    if used.is_empty() {
        // IMEX channels alone: no GPU, so none of the GPUs' nodes, files or hooks.
        spec.container_edits = ContainerEdits::default();
    }
    // The claim's names, as the lifecycle writes them: the record keeps the spec the file has.
    cdi.stamp(&mut spec, claim);
    Ok(spec)
}

/// The spec-level variable that keeps an NVIDIA container runtime (legacy mode) from injecting
/// GPUs of its own: `void` means "none" to it.
pub(crate) const NVIDIA_VISIBLE_DEVICES_VOID: &str = "NVIDIA_VISIBLE_DEVICES=void";

/// Prefix of the per-device variable [`device_env`] writes.
pub const DEVICE_ENV_PREFIX: &str = "DRUST_DEVICE_";

/// `DRUST_DEVICE_<NAME>=<uuid>`: the variable naming device `device` (a DNS label, e.g.
/// `gpu-3`, upper-cased with `-` as `_`) by its GPU or MIG UUID, what `nvidia-smi -L` shows.
/// Device names are unique in a pool and DNS labels have no `_`, so names never collide.
pub fn device_env(device: &str, uuid: &str) -> String {
    let name: String = device
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    format!("{DEVICE_ENV_PREFIX}{name}={uuid}")
}

/// Whether preparing `devices` (with their node devices `used`) changes the hardware: a MIG
/// placement is created, or a GPU's sharing (time slice, MPS) is set. Admin-access devices never
/// carry sharing ([`plan`]). Such claims keep the two-phase checkpoint records.
pub(crate) fn changes_hardware<'d>(
    devices: &[RecordedDevice],
    used: impl IntoIterator<Item = &'d NodeDevice>,
) -> bool {
    devices
        .iter()
        .any(|d| d.sharing.is_some() || d.mig.is_some())
        || super::shares::mps_shares(devices).next().is_some()
        || used
            .into_iter()
            .any(|d| matches!(d, NodeDevice::MigPlacement { .. }))
}
