//! What the example driver's tests share: ResourceClaims held in memory.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use dra_kubelet::ClaimRef;
use dra_plugin::allocation::ClaimSource;
use k8s_openapi::api::resource::v1::ResourceClaim;

/// ResourceClaims by `namespace/name`.
#[derive(Clone, Default)]
pub struct FakeClaims(pub Arc<Mutex<BTreeMap<String, ResourceClaim>>>);

impl FakeClaims {
    /// Adds `ns/name` with UID `uid`, allocated `devices` (`(driver, pool, device)`).
    pub fn add(&self, name: &str, uid: &str, devices: &[(&str, &str, &str)]) -> ClaimRef {
        let results: Vec<_> = devices
            .iter()
            .map(|(driver, pool, device)| {
                serde_json::json!({"request": "req", "driver": driver, "pool": pool, "device": device})
            })
            .collect();
        let rc: ResourceClaim = serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "ns", "name": name, "uid": uid},
            "spec": {},
            "status": {"allocation": {"devices": {"results": results}}},
        }))
        .expect("a ResourceClaim");
        self.0.lock().unwrap().insert(format!("ns/{name}"), rc);
        ClaimRef {
            namespace: "ns".into(),
            name: name.into(),
            uid: uid.into(),
        }
    }
}

impl ClaimSource for FakeClaims {
    async fn get(&self, namespace: &str, name: &str) -> Result<Option<ResourceClaim>, String> {
        Ok(self
            .0
            .lock()
            .unwrap()
            .get(&format!("{namespace}/{name}"))
            .cloned())
    }
}
