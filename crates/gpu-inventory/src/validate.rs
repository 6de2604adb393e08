//! The API server's ResourceSlice rules, checked before we publish, so a slice the server would
//! reject is never sent (and the tests prove every topology's layout stays within them).
//!
//! Mirrors k8s.io/kubernetes/pkg/apis/resource/validation/validation.go at v1.36
//! (`validateResourceSliceSpec`, `validateDevice`, `validateCounterSet`,
//! `validateDeviceCounterConsumption`, `validateDeviceAttribute`) and the pool-wide checks of
//! k8s.io/dynamic-resource-allocation/resourceslice (`validatePool`: unique device and counter
//! set names, every consumed counter exists). Limits are those of k8s.io/api/resource/v1.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{Device, DeviceAttribute, ResourceSlice};

use crate::slices::{
    MAX_COUNTER_SETS_PER_SLICE, MAX_DEVICES_PER_SLICE, MAX_DEVICES_PER_SLICE_ADVANCED,
    uses_advanced_features,
};

/// `ResourceSliceMaxAttributesAndCapacitiesPerDevice`.
pub const MAX_ATTRIBUTES_AND_CAPACITIES: usize = 32;
/// `ResourceSliceMaxAttributeValuesPerDevice`.
pub const MAX_ATTRIBUTE_VALUES: usize = 48;
/// `DeviceAttributeMaxValueLength`.
pub const MAX_ATTRIBUTE_VALUE_LENGTH: usize = 64;
/// `DeviceMaxIDLength`.
pub const MAX_ID_LENGTH: usize = 32;
/// `DeviceMaxDomainLength`.
pub const MAX_DOMAIN_LENGTH: usize = 63;
/// `ResourceSliceMaxCountersPerCounterSet`.
pub const MAX_COUNTERS_PER_SET: usize = 32;
/// `ResourceSliceMaxDeviceCounterConsumptionsPerDevice`.
pub const MAX_CONSUMPTIONS_PER_DEVICE: usize = 2;
/// `ResourceSliceMaxCountersPerDeviceCounterConsumption`.
pub const MAX_COUNTERS_PER_CONSUMPTION: usize = 32;

/// A slice (or the pool) breaks an API rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("ResourceSlice {slice}: {field}: {problem}")]
pub struct InvalidSlice {
    /// The slice name (or `pool` for pool-wide rules).
    pub slice: String,
    /// The offending field path, e.g. `spec.devices[3].attributes[uuid]`.
    pub field: String,
    /// What is wrong.
    pub problem: String,
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns_label)
}

fn is_c_identifier(s: &str) -> bool {
    let mut b = s.bytes();
    matches!(b.next(), Some(c) if c.is_ascii_alphabetic() || c == b'_')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_')
}

fn qualified_name_problem(name: &str) -> Option<String> {
    let (domain, id) = match name.split_once('/') {
        Some((d, i)) => (Some(d), i),
        None => (None, name),
    };
    if let Some(d) = domain
        && (d.len() > MAX_DOMAIN_LENGTH || !is_dns_subdomain(d))
    {
        return Some(format!(
            "domain {d:?} is not a DNS subdomain of at most 63 characters"
        ));
    }
    (id.len() > MAX_ID_LENGTH || !is_c_identifier(id))
        .then(|| format!("{id:?} is not a C identifier of at most 32 characters"))
}

fn is_semver(v: &str) -> bool {
    // Major.minor.patch without leading zeros, optional -prerelease and +build (semverRe).
    let core = v.split(['-', '+']).next().unwrap_or_default();
    let parts: Vec<&str> = core.split('.').collect();
    parts.len() == 3
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.bytes().all(|b| b.is_ascii_digit())
                && (p.len() == 1 || !p.starts_with('0'))
        })
}

fn attribute_problem(a: &DeviceAttribute) -> Option<String> {
    let set = [
        a.bool.is_some(),
        a.int.is_some(),
        a.string.is_some(),
        a.version.is_some(),
        a.bools.is_some(),
        a.ints.is_some(),
        a.strings.is_some(),
        a.versions.is_some(),
    ]
    .into_iter()
    .filter(|s| *s)
    .count();
    if set != 1 {
        return Some(format!("exactly one value must be set, found {set}"));
    }
    if let Some(s) = &a.string
        && s.len() > MAX_ATTRIBUTE_VALUE_LENGTH
    {
        return Some(format!(
            "string longer than {MAX_ATTRIBUTE_VALUE_LENGTH} characters"
        ));
    }
    if let Some(v) = &a.version
        && (v.len() > MAX_ATTRIBUTE_VALUE_LENGTH || !is_semver(v))
    {
        return Some(format!(
            "version {v:?} is not semver of at most 64 characters"
        ));
    }
    None
}

fn attribute_values(d: &Device) -> usize {
    d.attributes
        .iter()
        .flatten()
        .map(|(_, a)| {
            let lists = a.bools.as_ref().map_or(0, Vec::len)
                + a.ints.as_ref().map_or(0, Vec::len)
                + a.strings.as_ref().map_or(0, Vec::len)
                + a.versions.as_ref().map_or(0, Vec::len);
            lists.max(1)
        })
        .sum()
}

/// Checks every slice of one pool against the API server's rules and the pool-wide rules.
///
/// # Errors
/// The first [`InvalidSlice`] found, naming the slice and field.
pub fn validate_pool(slices: &[ResourceSlice]) -> Result<(), InvalidSlice> {
    let mut sets: BTreeMap<
        &str,
        BTreeMap<&str, &k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    > = BTreeMap::new();
    let mut names = BTreeSet::new();
    let count = i64::try_from(slices.len()).unwrap_or(i64::MAX);
    for s in slices {
        // A slice to be created has only its name prefix.
        let slice = s
            .metadata
            .name
            .clone()
            .or_else(|| s.metadata.generate_name.clone())
            .unwrap_or_default();
        let err = |field: String, problem: String| InvalidSlice {
            slice: slice.clone(),
            field,
            problem,
        };
        let spec = &s.spec;
        if spec.pool.resource_slice_count != count {
            return Err(err(
                "spec.pool.resourceSliceCount".into(),
                format!(
                    "is {}, the pool has {count} slices",
                    spec.pool.resource_slice_count
                ),
            ));
        }
        if spec.pool.generation != slices[0].spec.pool.generation || spec.pool.generation < 0 {
            return Err(err(
                "spec.pool.generation".into(),
                "differs within the pool".into(),
            ));
        }
        if spec.devices.is_some() && spec.shared_counters.is_some() {
            return Err(err(
                "spec".into(),
                "only one of `sharedCounters` or `devices` is allowed".into(),
            ));
        }
        let counter_sets = spec.shared_counters.as_deref().unwrap_or_default();
        if counter_sets.len() > MAX_COUNTER_SETS_PER_SLICE {
            return Err(err(
                "spec.sharedCounters".into(),
                format!(
                    "{} counter sets, at most {MAX_COUNTER_SETS_PER_SLICE}",
                    counter_sets.len()
                ),
            ));
        }
        for (i, set) in counter_sets.iter().enumerate() {
            let field = format!("spec.sharedCounters[{i}]");
            if !is_dns_label(&set.name) {
                return Err(err(
                    format!("{field}.name"),
                    format!("{:?} is not a DNS label", set.name),
                ));
            }
            if set.counters.is_empty() || set.counters.len() > MAX_COUNTERS_PER_SET {
                return Err(err(
                    format!("{field}.counters"),
                    format!(
                        "{} counters, must be 1 to {MAX_COUNTERS_PER_SET}",
                        set.counters.len()
                    ),
                ));
            }
            if let Some(bad) = set.counters.keys().find(|k| !is_dns_label(k)) {
                return Err(err(
                    format!("{field}.counters"),
                    format!("{bad:?} is not a DNS label"),
                ));
            }
            if sets
                .insert(
                    &set.name,
                    set.counters
                        .iter()
                        .map(|(k, v)| (k.as_str(), &v.value))
                        .collect(),
                )
                .is_some()
            {
                return Err(err(
                    format!("{field}.name"),
                    format!("counter set {} is not unique in the pool", set.name),
                ));
            }
        }
        let devices = spec.devices.as_deref().unwrap_or_default();
        let limit = if devices.iter().any(uses_advanced_features) {
            MAX_DEVICES_PER_SLICE_ADVANCED
        } else {
            MAX_DEVICES_PER_SLICE
        };
        if devices.len() > limit {
            return Err(err(
                "spec.devices".into(),
                format!("{} devices, at most {limit} here", devices.len()),
            ));
        }
        for (i, d) in devices.iter().enumerate() {
            let field = format!("spec.devices[{i}]");
            if !is_dns_label(&d.name) {
                return Err(err(
                    format!("{field}.name"),
                    format!("{:?} is not a DNS label", d.name),
                ));
            }
            if !names.insert(d.name.as_str()) {
                return Err(err(
                    format!("{field}.name"),
                    format!("device {} is not unique in the pool", d.name),
                ));
            }
            let attrs = d.attributes.as_ref().map_or(0, BTreeMap::len);
            let caps = d.capacity.as_ref().map_or(0, BTreeMap::len);
            if attrs + caps > MAX_ATTRIBUTES_AND_CAPACITIES {
                return Err(err(
                    field,
                    format!(
                        "{} attributes and capacities, at most {MAX_ATTRIBUTES_AND_CAPACITIES}",
                        attrs + caps
                    ),
                ));
            }
            if attribute_values(d) > MAX_ATTRIBUTE_VALUES {
                return Err(err(
                    field,
                    format!("more than {MAX_ATTRIBUTE_VALUES} attribute values"),
                ));
            }
            for (k, a) in d.attributes.iter().flatten() {
                if let Some(p) = qualified_name_problem(k).or_else(|| attribute_problem(a)) {
                    return Err(err(format!("{field}.attributes[{k}]"), p));
                }
            }
            for k in d.capacity.iter().flatten().map(|(k, _)| k) {
                if let Some(p) = qualified_name_problem(k) {
                    return Err(err(format!("{field}.capacity[{k}]"), p));
                }
            }
            let consumes = d.consumes_counters.as_deref().unwrap_or_default();
            if consumes.len() > MAX_CONSUMPTIONS_PER_DEVICE {
                return Err(err(
                    format!("{field}.consumesCounters"),
                    format!(
                        "{} entries, at most {MAX_CONSUMPTIONS_PER_DEVICE}",
                        consumes.len()
                    ),
                ));
            }
            let mut seen = BTreeSet::new();
            for (j, c) in consumes.iter().enumerate() {
                let cfield = format!("{field}.consumesCounters[{j}]");
                if !is_dns_label(&c.counter_set) || !seen.insert(&c.counter_set) {
                    return Err(err(
                        cfield,
                        format!("counter set {:?} invalid or repeated", c.counter_set),
                    ));
                }
                if c.counters.is_empty() || c.counters.len() > MAX_COUNTERS_PER_CONSUMPTION {
                    return Err(err(
                        format!("{cfield}.counters"),
                        format!(
                            "{} counters, must be 1 to {MAX_COUNTERS_PER_CONSUMPTION}",
                            c.counters.len()
                        ),
                    ));
                }
                if let Some(bad) = c.counters.keys().find(|k| !is_dns_label(k)) {
                    return Err(err(
                        format!("{cfield}.counters"),
                        format!("{bad:?} is not a DNS label"),
                    ));
                }
            }
            if let Some((sub, p)) = binding_problem(d) {
                return Err(err(format!("{field}.{sub}"), p));
            }
        }
    }
    // Pool-wide: every consumed counter exists in a counter set of the pool.
    for s in slices {
        for d in s.spec.devices.iter().flatten() {
            for c in d.consumes_counters.iter().flatten() {
                let Some(set) = sets.get(c.counter_set.as_str()) else {
                    return Err(InvalidSlice {
                        slice: "pool".into(),
                        field: format!("device {}", d.name),
                        problem: format!(
                            "consumes from counter set {} the pool does not define",
                            c.counter_set
                        ),
                    });
                };
                if let Some(missing) = c.counters.keys().find(|k| !set.contains_key(k.as_str())) {
                    return Err(InvalidSlice {
                        slice: "pool".into(),
                        field: format!("device {}", d.name),
                        problem: format!(
                            "counter {missing} is not in counter set {}",
                            c.counter_set
                        ),
                    });
                }
            }
        }
    }
    Ok(())
}

/// `BindingConditionsMaxSize` and `BindingFailureConditionsMaxSize`.
pub const MAX_BINDING_CONDITIONS: usize = 4;

/// `validateDeviceBindingParameters` (KEP-5007): at most [`MAX_BINDING_CONDITIONS`] of each,
/// each a label name (`ValidateLabelName`), no repeats, no overlap between the two lists, and
/// each list only with the other. The field and what is wrong.
fn binding_problem(d: &Device) -> Option<(&'static str, String)> {
    let ready = d.binding_conditions.as_deref().unwrap_or_default();
    let failure = d.binding_failure_conditions.as_deref().unwrap_or_default();
    for (field, list) in [
        ("bindingConditions", ready),
        ("bindingFailureConditions", failure),
    ] {
        if list.len() > MAX_BINDING_CONDITIONS {
            return Some((
                field,
                format!("{} entries, at most {MAX_BINDING_CONDITIONS}", list.len()),
            ));
        }
        let mut seen = BTreeSet::new();
        for c in list {
            if !label_name(c) {
                return Some((field, format!("{c:?} is not a valid condition type")));
            }
            if !seen.insert(c) {
                return Some((field, format!("{c:?} is repeated")));
            }
        }
    }
    if let Some(c) = failure.iter().find(|c| ready.contains(c)) {
        return Some((
            "bindingFailureConditions",
            format!("{c:?} must not also be a binding condition"),
        ));
    }
    match (ready.is_empty(), failure.is_empty()) {
        (true, false) => Some((
            "bindingConditions",
            "required to use bindingFailureConditions".into(),
        )),
        (false, true) => Some((
            "bindingFailureConditions",
            "required to use bindingConditions".into(),
        )),
        _ => None,
    }
}

/// A qualified name as `ValidateLabelName` takes it: an optional DNS subdomain prefix and `/`,
/// then 1 to 63 alphanumerics, `-`, `_`, `.`, beginning and ending with an alphanumeric.
fn label_name(s: &str) -> bool {
    let (prefix, name) = match s.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, s),
    };
    let prefix_ok =
        prefix.is_none_or(|p| !p.is_empty() && p.len() <= 253 && p.split('.').all(is_dns_label));
    prefix_ok
        && !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric())
        && name
            .bytes()
            .last()
            .is_some_and(|b| b.is_ascii_alphanumeric())
}

#[cfg(test)]
mod tests {
    #[test]
    fn binding_conditions_follow_the_api_servers_rules() {
        let device = |ready: &[&str], failure: &[&str]| Device {
            name: "imex-channel-0".into(),
            binding_conditions: (!ready.is_empty())
                .then(|| ready.iter().map(|c| (*c).to_owned()).collect()),
            binding_failure_conditions: (!failure.is_empty())
                .then(|| failure.iter().map(|c| (*c).to_owned()).collect()),
            ..Default::default()
        };
        assert_eq!(
            binding_problem(&device(&["IMEXDaemonReady"], &["IMEXDaemonFailed"])),
            None
        );
        assert_eq!(binding_problem(&device(&[], &[])), None);
        let bad = [
            device(&["IMEXDaemonReady"], &[]),
            device(&[], &["IMEXDaemonFailed"]),
            device(&["A", "A"], &["B"]),
            device(&["A"], &["A"]),
            device(&["not valid"], &["B"]),
            device(&["A", "B", "C", "D", "E"], &["F"]),
        ];
        for d in bad {
            assert!(binding_problem(&d).is_some(), "{d:?}");
        }
        // The channels as published pass the whole slice check.
        let pool: crate::slices::Pool = crate::imex::ImexChannels {
            major: 235,
            count: 2,
        }
        .devices(Some("u.1"))
        .into();
        validate_pool(&crate::slices::pool_slices("gpu.drust.dev", "n", 1, &pool))
            .expect("valid channels");
    }

    use super::*;
    use crate::slices::{Pool, pool_slices};
    use k8s_openapi::api::resource::v1::{Counter, CounterSet, DeviceCounterConsumption};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn device(name: &str) -> Device {
        Device {
            name: name.into(),
            ..Default::default()
        }
    }

    fn attr(s: &str) -> DeviceAttribute {
        DeviceAttribute {
            string: Some(s.into()),
            ..Default::default()
        }
    }

    #[test]
    fn each_api_rule_is_caught_with_its_field() {
        let q = || Counter {
            value: Quantity("1".into()),
        };
        let long = "x".repeat(65);
        let cases: Vec<(&str, Pool)> = vec![
            ("name", Pool::from(vec![device("GPU_0")])),
            ("not unique", Pool::from(vec![device("a"), device("a")])),
            (
                "attributes[nvlinkDomain]",
                Pool::from(vec![Device {
                    attributes: Some([("nvlinkDomain".to_owned(), attr(&long))].into()),
                    ..device("a")
                }]),
            ),
            (
                "attributes[bad-name]",
                Pool::from(vec![Device {
                    attributes: Some([("bad-name".to_owned(), attr("x"))].into()),
                    ..device("a")
                }]),
            ),
            (
                "attributes and capacities",
                Pool::from(vec![Device {
                    attributes: Some((0..33).map(|i| (format!("a{i}"), attr("x"))).collect()),
                    ..device("a")
                }]),
            ),
            (
                "does not define",
                Pool::from(vec![Device {
                    consumes_counters: Some(vec![DeviceCounterConsumption {
                        counter_set: "missing".into(),
                        counters: [("c".to_owned(), q())].into(),
                    }]),
                    ..device("a")
                }]),
            ),
            (
                "is not in counter set",
                Pool {
                    devices: vec![Device {
                        consumes_counters: Some(vec![DeviceCounterConsumption {
                            counter_set: "s".into(),
                            counters: [("other".to_owned(), q())].into(),
                        }]),
                        ..device("a")
                    }],
                    counter_sets: vec![CounterSet {
                        name: "s".into(),
                        counters: [("c".to_owned(), q())].into(),
                    }],
                },
            ),
        ];
        for (needle, pool) in cases {
            let err = validate_pool(&pool_slices("d", "n", 1, &pool))
                .expect_err(needle)
                .to_string();
            assert!(err.contains(needle), "{needle}: {err}");
        }
    }

    #[test]
    fn hand_made_slices_breaking_layout_rules_are_caught() {
        let mut slices = pool_slices("d", "n", 1, &Pool::from(vec![device("a")]));
        slices[0].spec.shared_counters = Some(vec![CounterSet {
            name: "s".into(),
            counters: [(
                "c".to_owned(),
                Counter {
                    value: Quantity("1".into()),
                },
            )]
            .into(),
        }]);
        let err = validate_pool(&slices).expect_err("both").to_string();
        assert!(err.contains("only one of"), "{err}");
        let mut slices = pool_slices(
            "d",
            "n",
            1,
            &Pool::from(
                (0..129)
                    .map(|i| device(&format!("d{i}")))
                    .collect::<Vec<_>>(),
            ),
        );
        slices[0]
            .spec
            .devices
            .as_mut()
            .expect("devices")
            .push(device("extra"));
        slices.truncate(1);
        slices[0].spec.pool.resource_slice_count = 1;
        let err = validate_pool(&slices).expect_err("too many").to_string();
        assert!(err.contains("at most 128"), "{err}");
    }
}
