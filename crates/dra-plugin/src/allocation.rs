//! A claim's allocation as one driver on one node reads it before prepare: the ResourceClaim
//! fetched from the API server within a deadline, checked against the kubelet's reference to
//! it, and its allocation results of this driver's pool grouped by device.
//!
//! Upstream's Go helper for kubelet plugins (`k8s.io/dynamic-resource-allocation/kubeletplugin`,
//! `draplugin.go`, `NodePrepareResources`) does the same before it hands claims to a driver:
//! reads each claim by name, refuses one that is not allocated or whose UID is not the one the
//! kubelet named (the claim was deleted and created again under that name).

use std::future::Future;
use std::time::Duration;

use dra_kubelet::ClaimRef;
use k8s_openapi::api::resource::v1::{
    DeviceAllocationConfiguration, DeviceRequestAllocationResult, ResourceClaim,
};

/// Where a driver reads ResourceClaims: the API server ([`kube::Client`]), or a test's.
pub trait ClaimSource: Send + Sync + 'static {
    /// The claim `namespace/name`, `None` when it does not exist; `Err` with the cause when
    /// the source could not answer.
    fn get(
        &self,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = Result<Option<ResourceClaim>, String>> + Send;
}

impl ClaimSource for kube::Client {
    async fn get(&self, namespace: &str, name: &str) -> Result<Option<ResourceClaim>, String> {
        kube::Api::<ResourceClaim>::namespaced(self.clone(), namespace)
            .get_opt(name)
            .await
            .map_err(|e| e.to_string())
    }
}

/// Why a claim's allocation cannot be prepared; each names the claim and, where one is at
/// fault, the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocationError {
    /// The source could not answer within the deadline, or failed.
    #[error("ResourceClaim {claim}: reading it from the API server: {message}")]
    Fetch {
        /// The claim.
        claim: ClaimRef,
        /// The cause (the deadline, or the source's error).
        message: String,
    },
    /// No claim of that name exists.
    #[error("ResourceClaim {claim}: not found")]
    NotFound {
        /// The claim.
        claim: ClaimRef,
    },
    /// A claim of that name exists with another `metadata.uid`: the kubelet's was deleted and
    /// another created under its name.
    #[error("ResourceClaim {claim}: metadata.uid is {found:?}, not the kubelet's (replaced)")]
    Replaced {
        /// The claim the kubelet named.
        claim: ClaimRef,
        /// The UID found.
        found: String,
    },
    /// `status.allocation.devices.results` is missing.
    #[error("ResourceClaim {claim}: status.allocation.devices.results is not set (not allocated)")]
    NotAllocated {
        /// The claim.
        claim: ClaimRef,
    },
    /// No allocation result is of this driver in this node's pool.
    #[error(
        "ResourceClaim {claim}: status.allocation.devices.results has no device of driver \
         {driver} in pool {pool}"
    )]
    NotOurs {
        /// The claim.
        claim: ClaimRef,
        /// This driver.
        driver: String,
        /// This node's pool.
        pool: String,
    },
}

/// Reads the claim the kubelet named from `source`, giving up after `timeout`.
///
/// # Errors
/// [`AllocationError::Fetch`] past the deadline or when the source fails,
/// [`AllocationError::NotFound`] when no such claim exists.
pub async fn fetch<S: ClaimSource>(
    source: &S,
    claim: &ClaimRef,
    timeout: Duration,
) -> Result<ResourceClaim, AllocationError> {
    let fetch = |message: String| AllocationError::Fetch {
        claim: claim.clone(),
        message,
    };
    tokio::time::timeout(timeout, source.get(&claim.namespace, &claim.name))
        .await
        .map_err(|_| fetch(format!("no answer within {} ms", timeout.as_millis())))?
        .map_err(fetch)?
        .ok_or_else(|| AllocationError::NotFound {
            claim: claim.clone(),
        })
}

/// One allocated device of this driver's pool, with every result that names it (one device
/// can satisfy several requests of a claim, e.g. subrequests).
#[derive(Debug, Clone, PartialEq)]
pub struct AllocatedDevice<'a> {
    /// `results[].pool`.
    pub pool: &'a str,
    /// `results[].device`.
    pub device: &'a str,
    /// Each result naming this device, with its index in `status.allocation.devices.results`
    /// (for errors naming the field), in the order of `results`. Never empty.
    pub results: Vec<(usize, &'a DeviceRequestAllocationResult)>,
}

impl AllocatedDevice<'_> {
    /// The requests (`results[].request`) this device satisfies, in order.
    pub fn request_names(&self) -> Vec<String> {
        self.results
            .iter()
            .map(|(_, r)| r.request.clone())
            .collect()
    }

    /// The index of its first result in `status.allocation.devices.results`.
    pub fn index(&self) -> usize {
        self.results.first().map_or(0, |(i, _)| *i)
    }
}

/// A claim's allocation on this node for one driver.
#[derive(Debug, Clone, PartialEq)]
pub struct Allocation<'a> {
    /// This driver's devices in this node's pool, in the order of their first result. Never
    /// empty.
    pub devices: Vec<AllocatedDevice<'a>>,
    /// `status.allocation.devices.config`: the opaque configurations, all drivers'.
    pub config: &'a [DeviceAllocationConfiguration],
}

/// Checks that `rc` is the claim the kubelet named and is allocated, and groups its results
/// of `driver` in `pool` by device.
///
/// # Errors
/// [`AllocationError::Replaced`], [`AllocationError::NotAllocated`] or
/// [`AllocationError::NotOurs`].
pub fn allocation<'a>(
    claim: &ClaimRef,
    rc: &'a ResourceClaim,
    driver: &str,
    pool: &str,
) -> Result<Allocation<'a>, AllocationError> {
    let uid = rc.metadata.uid.as_deref().unwrap_or_default();
    if uid != claim.uid {
        return Err(AllocationError::Replaced {
            claim: claim.clone(),
            found: uid.to_owned(),
        });
    }
    let allocated = rc
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref());
    let results = allocated
        .and_then(|d| d.results.as_deref())
        .ok_or_else(|| AllocationError::NotAllocated {
            claim: claim.clone(),
        })?;
    let mut devices: Vec<AllocatedDevice<'a>> = Vec::new();
    for (index, r) in results.iter().enumerate() {
        if r.driver != driver || r.pool != pool {
            continue;
        }
        match devices.iter_mut().find(|d| d.device == r.device) {
            Some(d) => d.results.push((index, r)),
            None => devices.push(AllocatedDevice {
                pool: &r.pool,
                device: &r.device,
                results: vec![(index, r)],
            }),
        }
    }
    if devices.is_empty() {
        return Err(AllocationError::NotOurs {
            claim: claim.clone(),
            driver: driver.to_owned(),
            pool: pool.to_owned(),
        });
    }
    Ok(Allocation {
        devices,
        config: allocated
            .and_then(|d| d.config.as_deref())
            .unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim() -> ClaimRef {
        ClaimRef {
            namespace: "ns".into(),
            name: "c".into(),
            uid: "u1".into(),
        }
    }

    fn rc(uid: &str, results: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "c", "namespace": "ns", "uid": uid},
            "spec": {},
            "status": {"allocation": {"devices": {"results": results}}},
        }))
        .unwrap()
    }

    fn result(request: &str, driver: &str, pool: &str, device: &str) -> serde_json::Value {
        serde_json::json!({"request": request, "driver": driver, "pool": pool, "device": device})
    }

    #[test]
    fn results_of_other_drivers_and_pools_are_skipped_and_one_device_lists_its_requests() {
        let rc = rc(
            "u1",
            serde_json::json!([
                result("a", "d.example", "node-1", "dev-0"),
                result("a", "other.example", "node-1", "dev-1"),
                result("b", "d.example", "node-2", "dev-1"),
                result("c", "d.example", "node-1", "dev-2"),
                result("d", "d.example", "node-1", "dev-0"),
            ]),
        );
        let a = allocation(&claim(), &rc, "d.example", "node-1").unwrap();
        let seen: Vec<(&str, Vec<String>, usize)> = a
            .devices
            .iter()
            .map(|d| (d.device, d.request_names(), d.index()))
            .collect();
        assert_eq!(
            seen,
            vec![
                ("dev-0", vec!["a".to_owned(), "d".to_owned()], 0),
                ("dev-2", vec!["c".to_owned()], 3),
            ]
        );
        assert_eq!(a.devices[0].results[1].0, 4);
    }

    #[test]
    fn a_replaced_unallocated_or_foreign_claim_is_refused_naming_it() {
        let replaced = rc("u2", serde_json::json!([]));
        let e = allocation(&claim(), &replaced, "d.example", "node-1").unwrap_err();
        assert!(matches!(e, AllocationError::Replaced { ref found, .. } if found == "u2"));
        assert!(e.to_string().contains("ns/c"), "{e}");

        let mut unallocated = rc("u1", serde_json::json!([]));
        unallocated.status = None;
        assert!(matches!(
            allocation(&claim(), &unallocated, "d.example", "node-1"),
            Err(AllocationError::NotAllocated { .. })
        ));

        let foreign = rc("u1", serde_json::json!([result("a", "x", "node-1", "d")]));
        let e = allocation(&claim(), &foreign, "d.example", "node-1").unwrap_err();
        assert!(
            e.to_string().contains("driver d.example in pool node-1"),
            "{e}"
        );
    }

    struct Hung;
    impl ClaimSource for Hung {
        async fn get(&self, _: &str, _: &str) -> Result<Option<ResourceClaim>, String> {
            std::future::pending().await
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_source_that_never_answers_is_given_up_at_the_deadline() {
        let e = fetch(&Hung, &claim(), Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(
            matches!(e, AllocationError::Fetch { ref message, .. } if message.contains("5000 ms")),
            "{e}"
        );
    }
}
