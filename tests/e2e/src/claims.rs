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
                        count: Some(i64::try_from(devices.len()).unwrap_or(1)),
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
    let results: Vec<_> = devices
        .iter()
        .map(|d| serde_json::json!({"request": "gpu", "driver": driver, "pool": pool, "device": d}))
        .collect();
    let status = serde_json::json!({"status": {"allocation": {"devices": {"results": results}}}});
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
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
