//! Conversions between the generated v1/v1beta1 messages and the domain types, in one place.
//!
//! Claims the kubelet sends with a missing field are rejected here, per claim: the caller gets an
//! error entry keyed by whatever UID the request carried.

use crate::driver::{ClaimRef, PreparedDevice};
use crate::proto::{dra_v1, dra_v1beta1};

/// Why a claim from a request could not be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InvalidClaim {
    /// A required field of `Claim` was empty.
    #[error("claim {namespace}/{name} (uid {uid:?}): field `{field}` must not be empty")]
    EmptyField {
        /// The empty field's proto name.
        field: &'static str,
        /// The claim's namespace as sent.
        namespace: String,
        /// The claim's name as sent.
        name: String,
        /// The claim's UID as sent.
        uid: String,
    },
}

/// Validates one claim reference from a request.
pub(crate) fn claim_ref(namespace: &str, name: &str, uid: &str) -> Result<ClaimRef, InvalidClaim> {
    let field = [("uid", uid), ("namespace", namespace), ("name", name)]
        .into_iter()
        .find(|(_, v)| v.is_empty())
        .map(|(f, _)| f);
    match field {
        Some(field) => Err(InvalidClaim::EmptyField {
            field,
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            uid: uid.to_owned(),
        }),
        None => Ok(ClaimRef {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            uid: uid.to_owned(),
        }),
    }
}

impl TryFrom<&dra_v1::Claim> for ClaimRef {
    type Error = InvalidClaim;
    fn try_from(c: &dra_v1::Claim) -> Result<Self, Self::Error> {
        claim_ref(&c.namespace, &c.name, &c.uid)
    }
}

impl TryFrom<&dra_v1beta1::Claim> for ClaimRef {
    type Error = InvalidClaim;
    fn try_from(c: &dra_v1beta1::Claim) -> Result<Self, Self::Error> {
        claim_ref(&c.namespace, &c.name, &c.uid)
    }
}

impl From<PreparedDevice> for dra_v1::Device {
    fn from(d: PreparedDevice) -> Self {
        Self {
            request_names: d.request_names,
            pool_name: d.pool_name,
            device_name: d.device_name,
            cdi_device_ids: d.cdi_device_ids,
            share_id: d.share_id,
        }
    }
}

/// v1beta1 has no `share_id`; consumable-capacity shares need the v1 API.
impl From<PreparedDevice> for dra_v1beta1::Device {
    fn from(d: PreparedDevice) -> Self {
        Self {
            request_names: d.request_names,
            pool_name: d.pool_name,
            device_name: d.device_name,
            cdi_device_ids: d.cdi_device_ids,
        }
    }
}

impl From<dra_v1::Device> for PreparedDevice {
    fn from(d: dra_v1::Device) -> Self {
        Self {
            request_names: d.request_names,
            pool_name: d.pool_name,
            device_name: d.device_name,
            cdi_device_ids: d.cdi_device_ids,
            share_id: d.share_id,
        }
    }
}

impl From<dra_v1beta1::Device> for PreparedDevice {
    fn from(d: dra_v1beta1::Device) -> Self {
        Self {
            request_names: d.request_names,
            pool_name: d.pool_name,
            device_name: d.device_name,
            cdi_device_ids: d.cdi_device_ids,
            share_id: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_with_every_field_converts() {
        let c = dra_v1::Claim {
            namespace: "ns".into(),
            uid: "u".into(),
            name: "n".into(),
        };
        let r = ClaimRef::try_from(&c).expect("valid claim");
        assert_eq!(
            (r.namespace.as_str(), r.name.as_str(), r.uid.as_str()),
            ("ns", "n", "u")
        );
    }

    #[test]
    fn an_empty_field_is_named_in_the_error() {
        for (ns, name, uid, field) in [
            ("", "n", "u", "namespace"),
            ("ns", "", "u", "name"),
            ("ns", "n", "", "uid"),
        ] {
            let err = claim_ref(ns, name, uid).expect_err("must be rejected");
            assert!(err.to_string().contains(&format!("`{field}`")), "{err}");
        }
    }

    #[test]
    fn share_id_is_dropped_for_v1beta1_only() {
        let d = PreparedDevice {
            share_id: Some("s".into()),
            ..Default::default()
        };
        assert_eq!(
            dra_v1::Device::from(d.clone()).share_id.as_deref(),
            Some("s")
        );
        assert_eq!(
            PreparedDevice::from(dra_v1beta1::Device::from(d)).share_id,
            None
        );
    }
}
