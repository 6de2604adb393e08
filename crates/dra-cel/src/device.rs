//! The device a selector sees: the `resource.k8s.io/v1` Device fields of a ResourceSlice, and a
//! borrowed view of them that evaluation reads without copying attribute maps.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

use crate::libs::quantity::{Quantity, QuantityValue};
use crate::libs::semver::Semver;
use crate::value::{Str, Value};

/// A device attribute as in a ResourceSlice: exactly one field is set.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DeviceAttribute {
    /// `int`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub int: Option<i64>,
    /// `bool`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bool: Option<bool>,
    /// `string`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub string: Option<String>,
    /// `version`: a semantic version string.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// `ints` (DRAListTypeAttributes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ints: Option<Vec<i64>>,
    /// `bools` (DRAListTypeAttributes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bools: Option<Vec<bool>>,
    /// `strings` (DRAListTypeAttributes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strings: Option<Vec<String>>,
    /// `versions` (DRAListTypeAttributes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub versions: Option<Vec<String>>,
}

/// A device capacity: a quantity.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceCapacity {
    /// The capacity, e.g. `80Gi`.
    pub value: Quantity,
}

/// The parts of a ResourceSlice device a selector can read.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Device {
    /// The driver name; the domain of attributes and capacities without one.
    pub driver: String,
    /// Attributes by qualified name (`model`, `gpu.nvidia.com/model`).
    #[serde(default)]
    pub attributes: BTreeMap<String, DeviceAttribute>,
    /// Capacities by qualified name.
    #[serde(default)]
    pub capacity: BTreeMap<String, DeviceCapacity>,
    /// `allowMultipleAllocations`; false when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_multiple_allocations: Option<bool>,
}

/// Why a device cannot be presented to a selector (upstream `DeviceMatches` fails the same way
/// before evaluating: `k8s.io/dynamic-resource-allocation/cel/compile.go`, `getAttributeValue`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// A version attribute is not a semantic version.
    #[error("attribute {name}: parse semantic version: {source}")]
    Version {
        /// The attribute's qualified name.
        name: String,
        /// The parse failure.
        source: crate::libs::semver::SemverError,
    },
    /// An attribute has no value this environment supports.
    #[error("attribute {name}: unsupported attribute value")]
    Unsupported {
        /// The attribute's qualified name.
        name: String,
    },
}

/// A borrowed view of a device for evaluation.
#[derive(Clone, Copy, Debug)]
pub struct DeviceView<'a> {
    pub(crate) driver: &'a str,
    pub(crate) attributes: &'a BTreeMap<String, DeviceAttribute>,
    pub(crate) capacity: &'a BTreeMap<String, DeviceCapacity>,
    pub(crate) allow_multiple_allocations: bool,
    pub(crate) list_attributes: bool,
    /// The capacities' CEL values of the evaluation under way, if any.
    capacity_values: Option<&'a CapacityValues>,
}

/// The CEL values of a device's capacities during one evaluation, made on first read.
///
/// Upstream's `DeviceMatches` (`dynamic-resource-allocation/cel/compile.go`) hands CEL a pointer
/// to a copy of each capacity quantity, so every read of one capacity within an evaluation sees
/// the same quantity, including what `compareTo` and `add` did to it (see
/// [`QuantityValue`]); the next evaluation starts again from the device. (The copy still
/// shares an `inf.Dec` with the ResourceSlice upstream, so an `add` there also changes the
/// scheduler's cached device for later evaluations; we do not mirror that.)
#[derive(Debug, Default)]
pub(crate) struct CapacityValues {
    /// One slot per entry of `Device::capacity`, in its order.
    slots: OnceLock<Box<[OnceLock<QuantityValue>]>>,
}

/// Splits a qualified name into (domain, id), the driver being the default domain
/// (`parseQualifiedName` in compile.go).
pub(crate) fn split_name<'a>(name: &'a str, driver: &'a str) -> (&'a str, &'a str) {
    match name.split_once('/') {
        Some((d, n)) => (d, n),
        None => (driver, name),
    }
}

impl<'a> DeviceView<'a> {
    /// Builds the view, checking every attribute converts like upstream does before evaluation.
    ///
    /// # Errors
    /// [`DeviceError`] for an invalid version or a value the environment does not support.
    pub fn new(device: &'a Device, list_attributes: bool) -> Result<DeviceView<'a>, DeviceError> {
        for (name, a) in &device.attributes {
            let list_set = a.ints.is_some()
                || a.bools.is_some()
                || a.strings.is_some()
                || a.versions.is_some();
            if list_attributes && list_set {
                if a.ints.is_none() && a.bools.is_none() && a.strings.is_none() {
                    for v in a.versions.iter().flatten() {
                        Semver::parse(v).map_err(|source| DeviceError::Version {
                            name: name.clone(),
                            source,
                        })?;
                    }
                }
                continue;
            }
            if a.int.is_some() || a.bool.is_some() || a.string.is_some() {
                continue;
            }
            match &a.version {
                Some(v) => {
                    Semver::parse(v).map_err(|source| DeviceError::Version {
                        name: name.clone(),
                        source,
                    })?;
                }
                None => return Err(DeviceError::Unsupported { name: name.clone() }),
            }
        }
        Ok(DeviceView::checked(device, list_attributes))
    }

    /// The view of a device that [`DeviceView::new`] accepted before, with the same
    /// `list_attributes`, without checking its attributes again: for callers that evaluate one
    /// device many times (the allocator checks each device once when it reads its slice). A
    /// device `new` would refuse must not be given here.
    pub fn checked(device: &'a Device, list_attributes: bool) -> DeviceView<'a> {
        DeviceView::checked_with_driver(device, &device.driver, list_attributes)
    }

    /// [`DeviceView::checked`] reading the driver name from `driver`, which must equal
    /// `device.driver`: every device of a ResourceSlice has the slice's driver, so a caller
    /// evaluating many devices can hand in the one string they share instead of each device's
    /// copy (one memory read fewer per device).
    pub fn checked_with_driver(
        device: &'a Device,
        driver: &'a str,
        list_attributes: bool,
    ) -> DeviceView<'a> {
        debug_assert_eq!(driver, device.driver);
        DeviceView {
            driver,
            attributes: &device.attributes,
            capacity: &device.capacity,
            allow_multiple_allocations: device.allow_multiple_allocations.unwrap_or(false),
            list_attributes,
            capacity_values: None,
        }
    }

    /// The view for one evaluation, whose capacity values live in `values`.
    pub(crate) fn with_capacity_values<'b>(&self, values: &'b CapacityValues) -> DeviceView<'b>
    where
        'a: 'b,
    {
        DeviceView {
            capacity_values: Some(values),
            ..*self
        }
    }

    /// The CEL value of the capacity at `index` of `Device::capacity`.
    fn capacity_value(&self, index: usize, q: &Quantity) -> QuantityValue {
        let Some(values) = self.capacity_values else {
            return QuantityValue::new(q);
        };
        let slots = values
            .slots
            .get_or_init(|| (0..self.capacity.len()).map(|_| OnceLock::new()).collect());
        match slots.get(index) {
            Some(slot) => slot.get_or_init(|| QuantityValue::new(q)).clone(),
            None => QuantityValue::new(q),
        }
    }

    /// The distinct attribute domains.
    pub(crate) fn attribute_domains(&self) -> Vec<&'a str> {
        let mut v: Vec<&'a str> = self
            .attributes
            .keys()
            .map(|k| split_name(k, self.driver).0)
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// `domain` as one of the attribute domains (borrowed from the device), if it is one;
    /// what `attribute_domains().contains(..)` answers, without collecting them.
    pub(crate) fn attribute_domain(&self, domain: &str) -> Option<&'a str> {
        self.attributes
            .keys()
            .map(|k| split_name(k, self.driver).0)
            .find(|d| *d == domain)
    }

    /// `domain` as one of the capacity domains (borrowed from the device), if it is one.
    pub(crate) fn capacity_domain(&self, domain: &str) -> Option<&'a str> {
        self.capacity
            .keys()
            .map(|k| split_name(k, self.driver).0)
            .find(|d| *d == domain)
    }

    /// The distinct capacity domains.
    pub(crate) fn capacity_domains(&self) -> Vec<&'a str> {
        let mut v: Vec<&'a str> = self
            .capacity
            .keys()
            .map(|k| split_name(k, self.driver).0)
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Attributes of one domain, by id.
    pub(crate) fn attribute_names<'s>(
        &'s self,
        domain: &'s str,
    ) -> impl Iterator<Item = (&'a str, &'a DeviceAttribute)> + 's {
        let driver = self.driver;
        self.attributes.iter().filter_map(move |(k, a)| {
            let (d, n) = split_name(k, driver);
            (d == domain).then_some((n, a))
        })
    }

    /// Capacities of one domain, by id, as CEL values.
    pub(crate) fn capacity_names<'s>(
        &'s self,
        domain: &'s str,
    ) -> impl Iterator<Item = (&'a str, QuantityValue)> + 's {
        let driver = self.driver;
        self.capacity
            .iter()
            .enumerate()
            .filter_map(move |(i, (k, c))| {
                let (d, n) = split_name(k, driver);
                (d == domain).then(|| (n, self.capacity_value(i, &c.value)))
            })
    }

    /// How many capacities one domain has.
    pub(crate) fn capacity_count(&self, domain: &str) -> usize {
        self.capacity
            .keys()
            .filter(|k| split_name(k, self.driver).0 == domain)
            .count()
    }

    /// One attribute by domain and id.
    pub(crate) fn attribute(&self, domain: &str, id: &str) -> Option<&'a DeviceAttribute> {
        // The key is `domain/id`, or `id` alone in the driver's domain. Lengths are compared
        // before bytes, so keys of another length are never read. When both spellings are
        // present the later key in map order wins, as before.
        // A key splits at its first '/' (`split_name`): a domain with a '/' matches no key, and
        // a bare key never holds one.
        let bare = domain == self.driver && !id.contains('/');
        let qualified = if domain.contains('/') {
            usize::MAX
        } else {
            domain.len() + 1 + id.len()
        };
        let mut found = None;
        for (k, a) in self.attributes.iter() {
            let hit = if k.len() == qualified {
                k.as_bytes().get(domain.len()) == Some(&b'/')
                    && k.starts_with(domain)
                    && k.ends_with(id)
            } else {
                bare && k.len() == id.len() && k == id
            };
            if hit {
                found = Some(a);
            }
        }
        found
    }

    /// Whether a capacity exists.
    pub(crate) fn has_capacity(&self, domain: &str, id: &str) -> bool {
        self.capacity
            .keys()
            .any(|k| split_name(k, self.driver) == (domain, id))
    }

    /// One capacity by domain and id, as a CEL value.
    pub(crate) fn capacity(&self, domain: &str, id: &str) -> Option<QuantityValue> {
        let mut found = None;
        for (i, (k, c)) in self.capacity.iter().enumerate() {
            let (d, n) = split_name(k, self.driver);
            if d == domain && n == id {
                found = Some((i, &c.value));
            }
        }
        found.map(|(i, q)| self.capacity_value(i, q))
    }

    /// The CEL value of an attribute (versions become semver values).
    pub(crate) fn attribute_value(&self, a: &'a DeviceAttribute) -> Result<Value<'a>, DeviceError> {
        if self.list_attributes {
            if let Some(v) = &a.ints {
                return Ok(Value::List(std::sync::Arc::new(
                    v.iter().map(|i| Value::Int(*i)).collect(),
                )));
            }
            if let Some(v) = &a.bools {
                return Ok(Value::List(std::sync::Arc::new(
                    v.iter().map(|i| Value::Bool(*i)).collect(),
                )));
            }
            if let Some(v) = &a.strings {
                return Ok(Value::List(std::sync::Arc::new(
                    v.iter().map(|s| Value::String(Str::Borrowed(s))).collect(),
                )));
            }
            if let Some(v) = &a.versions {
                let mut out = Vec::with_capacity(v.len());
                for s in v {
                    let sv = Semver::parse(s).map_err(|source| DeviceError::Version {
                        name: s.clone(),
                        source,
                    })?;
                    out.push(Value::Semver(std::sync::Arc::new(sv)));
                }
                return Ok(Value::List(std::sync::Arc::new(out)));
            }
        }
        if let Some(i) = a.int {
            return Ok(Value::Int(i));
        }
        if let Some(b) = a.bool {
            return Ok(Value::Bool(b));
        }
        if let Some(s) = &a.string {
            return Ok(Value::String(Str::Borrowed(s)));
        }
        if let Some(v) = &a.version {
            let sv = Semver::parse(v).map_err(|source| DeviceError::Version {
                name: v.clone(),
                source,
            })?;
            return Ok(Value::Semver(std::sync::Arc::new(sv)));
        }
        Err(DeviceError::Unsupported {
            name: String::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `attribute` answers as splitting every key at its first '/' would, without reading keys
    /// of another length.
    #[test]
    fn attribute_lookup_agrees_with_splitting_every_key() {
        let keys = [
            "model",
            "d.example.com/model",
            "a/b/c",
            "a/b",
            "b/c",
            "other.io/model",
            "c",
            "d.example.com/x/y",
        ];
        let device = Device {
            driver: "d.example.com".into(),
            attributes: keys
                .iter()
                .enumerate()
                .map(|(i, k)| {
                    let a = DeviceAttribute {
                        int: Some(i as i64),
                        ..Default::default()
                    };
                    (k.to_string(), a)
                })
                .collect(),
            ..Default::default()
        };
        let view = DeviceView::checked(&device, false);
        let naive = |domain: &str, id: &str| {
            device
                .attributes
                .iter()
                .filter(|(k, _)| split_name(k, &device.driver) == (domain, id))
                .map(|(_, a)| a)
                .next_back()
        };
        let domains = ["d.example.com", "a", "a/b", "b", "other.io", "", "x"];
        let ids = ["model", "b/c", "b", "c", "x/y", "y", ""];
        for domain in domains {
            for id in ids {
                assert_eq!(
                    view.attribute(domain, id),
                    naive(domain, id),
                    "{domain} {id}"
                );
            }
        }
    }
}
