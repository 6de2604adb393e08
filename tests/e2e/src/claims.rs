//! ResourceClaims made allocated by hand (status written directly, as the scheduler would), for
//! tests and benchmarks that drive prepare without waiting for scheduling.

use k8s_openapi::api::resource::v1::{
    DeviceClaim, DeviceRequest, DeviceRequestAllocationResult, ExactDeviceRequest, ResourceClaim,
    ResourceClaimSpec,
};
use kube::Api;
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};

/// Creates `default/<name>` requesting `devices.len()` devices of DeviceClass `driver` in one
/// request named `gpu`, then writes its allocation: each of `devices` from `driver` in pool
/// `pool`.
///
/// # Errors
/// The API error, when the create or the status write is refused.
pub async fn allocated_claim(
    client: &kube::Client,
    name: &str,
    driver: &str,
    pool: &str,
    devices: &[String],
) -> Result<ResourceClaim, kube::Error> {
    let results: Vec<_> = devices
        .iter()
        .map(|d| serde_json::json!({"request": "gpu", "driver": driver, "pool": pool, "device": d}))
        .collect();
    create_allocated(client, name, driver, devices.len(), results).await
}

/// Creates `default/<name>` with one request `gpu` for `count` devices of DeviceClass `driver`
/// and writes `results` as its allocation.
async fn create_allocated(
    client: &kube::Client,
    name: &str,
    driver: &str,
    count: usize,
    results: Vec<serde_json::Value>,
) -> Result<ResourceClaim, kube::Error> {
    let api: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let claim = ResourceClaim {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: ResourceClaimSpec {
            devices: Some(DeviceClaim {
                requests: Some(vec![DeviceRequest {
                    name: "gpu".into(),
                    exactly: Some(ExactDeviceRequest {
                        device_class_name: driver.into(),
                        count: Some(i64::try_from(count).unwrap_or(1)),
                        allocation_mode: Some("ExactCount".into()),
                        ..Default::default()
                    }),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
        },
        ..Default::default()
    };
    api.create(&PostParams::default(), &claim).await?;
    let status = serde_json::json!({"status": {"allocation": {"devices": {"results": results}}}});
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
}

/// [`allocated_claim`] for one share of `device` (consumable capacity): its result carries
/// `share_id` (a UUID) and `consumedCapacity` `memory` (a quantity, e.g. `20Gi`), as the scheduler
/// writes them for a device with `allowMultipleAllocations`.
///
/// # Errors
/// The API error, when the create or the status write is refused.
pub async fn allocated_share(
    client: &kube::Client,
    name: &str,
    driver: &str,
    pool: &str,
    device: &str,
    share_id: &str,
    memory: &str,
) -> Result<ResourceClaim, kube::Error> {
    let result = serde_json::json!({"request": "gpu", "driver": driver, "pool": pool,
        "device": device, "shareID": share_id,
        "consumedCapacity": {"memory": memory, "computePercent": "0"}});
    create_allocated(client, name, driver, 1, vec![result]).await
}

/// The claim's allocation results (`status.allocation.devices.results`); `None` while it is not
/// allocated.
pub fn allocation_results(claim: &ResourceClaim) -> Option<&[DeviceRequestAllocationResult]> {
    claim
        .status
        .as_ref()?
        .allocation
        .as_ref()?
        .devices
        .as_ref()?
        .results
        .as_deref()
}

/// Creates pod `default/<name>` using claim `claim`, bound to `node` (`spec.nodeName`; no
/// kubelet needs to run it), and reserves the claim for it (`status.reservedFor`) as the
/// scheduler does. Returns the pod's UID.
///
/// # Errors
/// The API error, when the create or the status write is refused.
pub async fn pod_using(
    client: &kube::Client,
    name: &str,
    claim: &str,
    node: &str,
) -> Result<String, kube::Error> {
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), "default");
    let pod = k8s_openapi::api::core::v1::Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: Some(k8s_openapi::api::core::v1::PodSpec {
            node_name: Some(node.into()),
            containers: vec![k8s_openapi::api::core::v1::Container {
                name: "main".into(),
                image: Some("busybox".into()),
                resources: Some(k8s_openapi::api::core::v1::ResourceRequirements {
                    claims: Some(vec![k8s_openapi::api::core::v1::ResourceClaim {
                        name: "gpu".into(),
                        ..Default::default()
                    }]),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            resource_claims: Some(vec![k8s_openapi::api::core::v1::PodResourceClaim {
                name: "gpu".into(),
                resource_claim_name: Some(claim.into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    let uid = pods
        .create(&PostParams::default(), &pod)
        .await?
        .metadata
        .uid
        .unwrap_or_default();
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let status = serde_json::json!({"status": {"reservedFor": [
        {"resource": "pods", "name": name, "uid": uid}
    ]}});
    claims
        .patch_status(claim, &PatchParams::default(), &Patch::Merge(&status))
        .await?;
    Ok(uid)
}

/// The device of the first allocation result of claim `name` (read from the API server), as
/// the scheduler allocated it; `None` while it has none.
///
/// # Errors
/// The API error, when the claim cannot be read.
pub async fn allocated_device(
    claims: &Api<ResourceClaim>,
    name: &str,
) -> Result<Option<String>, kube::Error> {
    Ok(claims
        .get(name)
        .await?
        .status
        .and_then(|s| s.allocation)
        .and_then(|a| a.devices)
        .and_then(|d| d.results)
        .and_then(|r| r.first().map(|r| r.device.clone())))
}

/// The message of the `GPUIdle` condition (status `True`) on any of claim `namespace/name`'s
/// device-status entries of `driver` (the kubelet plugin's idle mark), if any.
///
/// # Errors
/// The API error, when the claim cannot be read.
pub async fn idle_mark(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    driver: &str,
) -> Result<Option<String>, kube::Error> {
    let claim = Api::<ResourceClaim>::namespaced(client.clone(), namespace)
        .get(name)
        .await?;
    Ok(idle_message(&claim, driver))
}

fn idle_message(claim: &ResourceClaim, driver: &str) -> Option<String> {
    claim
        .status
        .as_ref()?
        .devices
        .iter()
        .flatten()
        .filter(|d| d.driver == driver)
        .flat_map(|d| d.conditions.iter().flatten())
        .find(|c| c.type_ == "GPUIdle" && c.status == "True")
        .map(|c| c.message.clone())
}
