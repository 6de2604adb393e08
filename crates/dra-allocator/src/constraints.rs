//! Claim constraints: `matchAttribute` (all devices share a value) and `distinctAttribute` (no
//! two devices share one), checked device by device as the search adds and removes them.
//!
//! upstream: `structured/internal/incubating/allocator_incubating.go`
//! (`matchAttributeConstraint`, `lookupAttribute`) and `constraint.go`
//! (`distinctAttributeConstraint`). The distinct constraint keeps one value per request, so a
//! request with several devices can repeat a value: kubernetes/kubernetes#140438, fixed after
//! v1.36.2 by #140600 but present in the v0.36.3 code we mirror.

use std::collections::BTreeMap;
use std::sync::Arc;

use foldhash::HashSet;

use crate::attributes::{Attributes, Value, lookup};

/// What a constraint is, shared by every copy of it (one per node searched).
#[derive(Debug)]
pub(crate) struct Spec {
    requests: HashSet<String>,
    attribute: String,
}

/// One constraint of a claim, with the state of the devices added so far.
#[derive(Debug, Clone)]
pub(crate) enum Constraint<'v> {
    /// `matchAttribute`.
    Match {
        spec: Arc<Spec>,
        value: Option<Value<'v>>,
        devices: usize,
    },
    /// `distinctAttribute`.
    Distinct {
        spec: Arc<Spec>,
        /// Upstream: the last value added per request.
        values: BTreeMap<&'v str, Value<'v>>,
        devices: usize,
        /// With the fix of #140438: every device's value, in the order added (the search
        /// removes in reverse order).
        per_device: Option<Vec<(&'v str, Value<'v>)>>,
    },
}

/// Whether a constraint limited to `requests` applies to a (sub)request.
fn applies(requests: &HashSet<String>, request: &str, sub: Option<&str>) -> bool {
    if requests.is_empty() {
        return true;
    }
    match sub {
        None => requests.contains(request),
        Some(sub) => requests.contains(request) || requests.contains(&format!("{request}/{sub}")),
    }
}

impl<'v> Constraint<'v> {
    /// A `matchAttribute` constraint.
    pub fn matching(attribute: &str, requests: &[String]) -> Constraint<'v> {
        Constraint::Match {
            spec: Arc::new(Spec {
                requests: requests.iter().cloned().collect(),
                attribute: attribute.to_string(),
            }),
            value: None,
            devices: 0,
        }
    }

    /// A `distinctAttribute` constraint; `per_device`: with the fix of #140438.
    pub fn distinct(attribute: &str, requests: &[String], per_device: bool) -> Constraint<'v> {
        Constraint::Distinct {
            spec: Arc::new(Spec {
                requests: requests.iter().cloned().collect(),
                attribute: attribute.to_string(),
            }),
            values: BTreeMap::new(),
            devices: 0,
            per_device: per_device.then(Vec::new),
        }
    }

    /// `matchAttribute` or `distinctAttribute`, and the attribute (for explanations).
    pub fn describe(&self) -> (&'static str, &str) {
        match self {
            Constraint::Match { spec, .. } => ("matchAttribute", &spec.attribute),
            Constraint::Distinct { spec, .. } => ("distinctAttribute", &spec.attribute),
        }
    }

    /// Whether the constraint covers a (sub)request.
    pub fn applies_to(&self, request: &str, sub: Option<&str>) -> bool {
        match self {
            Constraint::Match { spec, .. } | Constraint::Distinct { spec, .. } => {
                applies(&spec.requests, request, sub)
            }
        }
    }

    /// Whether removing a device can make this constraint accept more than before the device
    /// was added: upstream's `distinctAttribute`, whose removal forgets the request's value
    /// even while other devices of the request hold it (#140438).
    pub fn loosens_on_removal(&self) -> bool {
        matches!(
            self,
            Constraint::Distinct {
                per_device: None,
                ..
            }
        )
    }

    /// `add`: whether the device may join, recording it if so.
    pub fn add(
        &mut self,
        request: &'v str,
        sub: Option<&str>,
        attributes: Attributes<'_, 'v>,
        driver: &str,
    ) -> bool {
        match self {
            Constraint::Match {
                spec,
                value,
                devices,
            } => {
                if !applies(&spec.requests, request, sub) {
                    return true;
                }
                let Some(found) = lookup(attributes, driver, &spec.attribute) else {
                    return false;
                };
                if *devices == 0 {
                    *value = Some(found);
                    *devices = 1;
                    return true;
                }
                let same = match (&found, value.as_ref()) {
                    (Value::Unknown, _) => false,
                    (f, Some(v)) => f == v,
                    (_, None) => false,
                };
                if !same {
                    return false;
                }
                *devices += 1;
                true
            }
            Constraint::Distinct {
                spec,
                values,
                devices,
                per_device,
            } => {
                if !applies(&spec.requests, request, sub) {
                    return true;
                }
                let Some(found) = lookup(attributes, driver, &spec.attribute) else {
                    return false;
                };
                if let Some(seen) = per_device {
                    if found == Value::Unknown || seen.iter().any(|(_, v)| *v == found) {
                        return false;
                    }
                    seen.push((request, found));
                    return true;
                }
                if *devices == 0 {
                    values.insert(request, found);
                    *devices = 1;
                    return true;
                }
                if values
                    .values()
                    .any(|v| found == Value::Unknown || *v == found)
                {
                    return false;
                }
                values.insert(request, found);
                *devices += 1;
                true
            }
        }
    }

    /// `remove`: undoes one successful [`Constraint::add`] with the same arguments.
    pub fn remove(&mut self, request: &str, sub: Option<&str>) {
        match self {
            Constraint::Match { spec, devices, .. } => {
                if applies(&spec.requests, request, sub) {
                    *devices = devices.saturating_sub(1);
                }
            }
            Constraint::Distinct {
                spec,
                values,
                devices,
                per_device,
            } => {
                if !applies(&spec.requests, request, sub) {
                    return;
                }
                if let Some(seen) = per_device {
                    if let Some(i) = seen.iter().rposition(|(r, _)| *r == request) {
                        seen.remove(i);
                    }
                    return;
                }
                {
                    values.remove(request);
                    *devices = devices.saturating_sub(1);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::DeviceAttribute;

    fn attrs(pairs: &[(&str, DeviceAttribute)]) -> Attributes<'static, 'static> {
        let map: BTreeMap<String, DeviceAttribute> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        let table = Box::leak(Box::new(crate::attributes::AttributeTable::default()));
        let range = table.push(Some(Box::leak(Box::new(map))));
        table.device(range)
    }

    fn s(v: &str) -> DeviceAttribute {
        DeviceAttribute {
            string: Some(v.into()),
            ..Default::default()
        }
    }

    #[test]
    fn match_attribute_accepts_the_bare_id_in_the_driver_domain() {
        let mut c = Constraint::matching("drv.example.com/model", &[]);
        let a = attrs(&[("model", s("A100"))]);
        let b = attrs(&[("drv.example.com/model", s("A100"))]);
        let other = attrs(&[("model", s("H100"))]);
        assert!(c.add("r", None, a, "drv.example.com"));
        assert!(c.add("r", None, b, "drv.example.com"));
        assert!(!c.add("r", None, other, "drv.example.com"));
        assert!(!c.add("r", None, a, "other.example.com"), "foreign domain");
    }

    #[test]
    fn a_constraint_for_other_requests_lets_every_device_pass() {
        let mut c = Constraint::matching("x/y", &["a".into()]);
        assert!(c.add("b", None, Attributes::default(), "x"));
        assert!(!c.add("a", None, Attributes::default(), "x"));
        assert!(
            c.add("b", Some("s"), Attributes::default(), "x"),
            "b/s is not one of its requests"
        );
        let mut c = Constraint::matching("x/y", &["b/s".into()]);
        assert!(!c.add("b", Some("s"), Attributes::default(), "x"));
    }

    #[test]
    fn distinct_attribute_keeps_one_value_per_request_like_upstream() {
        // kubernetes/kubernetes#140438: the second device of request "r" overwrites the first
        // value, so a third device may repeat the first one.
        let mut c = Constraint::distinct("x/v", &[], false);
        let one = attrs(&[("v", s("1"))]);
        let two = attrs(&[("v", s("2"))]);
        assert!(c.add("r", None, one, "x"));
        assert!(!c.add("r", None, one, "x"));
        assert!(c.add("r", None, two, "x"));
        assert!(c.add("r", None, one, "x"));

        // With the fix every device's value counts, and removal takes back the last one added.
        let mut c = Constraint::distinct("x/v", &[], true);
        assert!(c.add("r", None, one, "x"));
        assert!(c.add("r", None, two, "x"));
        assert!(!c.add("r", None, one, "x"));
        c.remove("r", None);
        assert!(c.add("r", None, two, "x"), "2 was removed");
        assert!(!c.add("s", None, one, "x"));
    }
}
