//! Conversions between the generated v1/v1beta1 messages and the domain types, in one place.
//!
//! Claims the kubelet sends with a missing or malformed field are rejected here, per claim,
//! before any of their fields reaches a path, a CDI name or a log field: the caller gets an
//! error entry keyed by whatever UID the request carried, and the error shows the sent values
//! escaped.

use crate::driver::{ClaimRef, PreparedDevice};
use crate::proto::{dra_v1, dra_v1beta1};

/// Why a claim from a request could not be used. The values are printed quoted and escaped
/// (`{:?}`): they come from the request and may hold anything.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InvalidClaim {
    /// A required field of `Claim` was empty.
    #[error("claim {namespace:?}/{name:?} (uid {uid:?}): field `{field}` must not be empty")]
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
    /// A field does not have the form the API server gives it.
    #[error("claim {namespace:?}/{name:?} (uid {uid:?}): field `{field}` {problem}")]
    Malformed {
        /// The field's proto name.
        field: &'static str,
        /// What is wrong with it.
        problem: &'static str,
        /// The claim's namespace as sent.
        namespace: String,
        /// The claim's name as sent.
        name: String,
        /// The claim's UID as sent.
        uid: String,
    },
}

/// The RFC 4122 text form the API server gives `metadata.uid` (`k8s.io/apimachinery`'s
/// `util/uuid`, google/uuid's `String()`): 8-4-4-4-12 hexadecimal digits. UIDs end up in file
/// names, CDI device names and log fields, so nothing else gets through.
pub(crate) fn is_uid(uid: &str) -> bool {
    let groups: Vec<&str> = uid.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// A DNS-1123 label of at most `max` characters: lower-case alphanumerics and `-`, starting
/// and ending alphanumeric. With `dots`, a DNS-1123 subdomain: such labels joined by `.`.
/// Namespaces are labels (63), ResourceClaim names subdomains (253): apimachinery's
/// `IsDNS1123Label` / `IsDNS1123Subdomain`, applied by `ValidateResourceClaim`.
fn is_dns1123(value: &str, max: usize, dots: bool) -> bool {
    let label = |l: &str| {
        let b = l.as_bytes();
        !b.is_empty()
            && b.iter()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
            && b[0] != b'-'
            && b[b.len() - 1] != b'-'
    };
    value.len() <= max
        && if dots {
            value.split('.').all(label)
        } else {
            label(value)
        }
}

/// Validates one claim reference from a request: every field present, the UID in RFC 4122
/// form, the namespace a DNS-1123 label, the name a DNS-1123 subdomain.
pub(crate) fn claim_ref(namespace: &str, name: &str, uid: &str) -> Result<ClaimRef, InvalidClaim> {
    let empty = [("uid", uid), ("namespace", namespace), ("name", name)]
        .into_iter()
        .find(|(_, v)| v.is_empty())
        .map(|(f, _)| f);
    if let Some(field) = empty {
        return Err(InvalidClaim::EmptyField {
            field,
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            uid: uid.to_owned(),
        });
    }
    let malformed = if !is_uid(uid) {
        Some((
            "uid",
            "is not an RFC 4122 UUID (8-4-4-4-12 hexadecimal digits)",
        ))
    } else if !is_dns1123(namespace, 63, false) {
        Some((
            "namespace",
            "is not a DNS-1123 label (at most 63 of a-z, 0-9, '-')",
        ))
    } else if !is_dns1123(name, 253, true) {
        Some((
            "name",
            "is not a DNS-1123 subdomain (at most 253 of a-z, 0-9, '-', '.')",
        ))
    } else {
        None
    };
    match malformed {
        Some((field, problem)) => Err(InvalidClaim::Malformed {
            field,
            problem,
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
            uid: UID.into(),
            name: "n".into(),
        };
        let r = ClaimRef::try_from(&c).expect("valid claim");
        assert_eq!(
            (r.namespace.as_str(), r.name.as_str(), r.uid.as_str()),
            ("ns", "n", UID)
        );
    }

    #[test]
    fn an_empty_field_is_named_in_the_error() {
        for (ns, name, uid, field) in [
            ("", "n", UID, "namespace"),
            ("ns", "", UID, "name"),
            ("ns", "n", "", "uid"),
        ] {
            let err = claim_ref(ns, name, uid).expect_err("must be rejected");
            assert!(err.to_string().contains(&format!("`{field}`")), "{err}");
        }
    }

    const UID: &str = "9a1f0b6e-3c2d-4e5f-8a7b-0c1d2e3f4a5b";

    /// What reaches paths, CDI names and logs has the API server's form; anything else is an
    /// error naming the field, with the sent value escaped.
    #[test]
    fn a_malformed_uid_namespace_or_name_is_refused_naming_the_field() {
        let long_label = "a".repeat(64);
        let long_name = format!("{}.{}", "a".repeat(200), "b".repeat(53));
        for (ns, name, uid, field) in [
            ("ns", "n", "../../etc/passwd", "uid"),
            ("ns", "n", "9a1f0b6e3c2d4e5f8a7b0c1d2e3f4a5b", "uid"),
            ("ns", "n", "9a1f0b6e-3c2d-4e5f-8a7b-0c1d2e3f4a5g", "uid"),
            ("ns", "n", "9a1f0b6e-3c2d-4e5f-8a7b-0c1d2e3f4a5b\n", "uid"),
            ("Ns", "n", UID, "namespace"),
            ("ns/x", "n", UID, "namespace"),
            ("-ns", "n", UID, "namespace"),
            (long_label.as_str(), "n", UID, "namespace"),
            ("ns", "claim\nINFO forged", UID, "name"),
            ("ns", "a..b", UID, "name"),
            ("ns", "../x", UID, "name"),
            ("ns", long_name.as_str(), UID, "name"),
        ] {
            let err = claim_ref(ns, name, uid).expect_err(&format!("{ns:?} {name:?} {uid:?}"));
            let text = err.to_string();
            assert!(text.contains(&format!("`{field}`")), "{text}");
            assert!(
                !text.contains('\n'),
                "the message escapes what was sent: {text}"
            );
        }
        for (ns, name) in [
            ("a", "b"),
            ("kube-system", "pod-0-gpu-x7k2p"),
            (&*"n".repeat(63), "a.b-c.d"),
        ] {
            claim_ref(ns, name, UID).expect("valid");
        }
        claim_ref("ns", "n", &UID.to_uppercase()).expect("hex digits of either case");
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
