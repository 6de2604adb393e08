//! Consumable capacity: how much of a device capacity a request consumes, and whether that
//! still fits next to what is allocated and being allocated.
//!
//! upstream: `structured/internal/incubating/consumable_capacity.go` (`CmpRequestOverCapacity`,
//! `calculateConsumedCapacity`, `roundUpRange`, `roundUpValidValues`, `violatesPolicy`,
//! `GetConsumedCapacityFromRequest`); KEP-5075 (DRA consumable capacity).

use std::cmp::Ordering;
use std::collections::BTreeMap;

use k8s_quantity::{Format, Quantity};

use crate::model::{Capacity, ConsumedCapacity, Policy};

/// Requested capacity by name (`CapacityRequirements.requests`).
pub(crate) type Requests = BTreeMap<String, Quantity>;

/// `CmpRequestOverCapacity`: whether the request fits the device's capacities given what is
/// allocated (`current`) and being allocated (`allocating`).
///
/// # Errors
/// The request names a capacity the device does not have (upstream skips such devices).
pub(crate) fn fits(
    current: Option<&ConsumedCapacity>,
    requests: Option<&Requests>,
    capacity: &BTreeMap<String, Capacity>,
    allocating: Option<&ConsumedCapacity>,
) -> Result<bool, ()> {
    if let Some(requests) = requests
        && requests.keys().any(|name| !capacity.contains_key(name))
    {
        return Err(());
    }
    // Nothing requested, allocated or being allocated, and no policy: each capacity consumes
    // exactly itself, which fits. The common case, without a quantity copied.
    if requests.is_none_or(BTreeMap::is_empty)
        && current.is_none_or(BTreeMap::is_empty)
        && allocating.is_none_or(BTreeMap::is_empty)
        && capacity.values().all(|c| c.policy.is_none())
    {
        return Ok(true);
    }
    for (name, cap) in capacity {
        let consumed = consumed_for(requests.and_then(|r| r.get(name)), cap);
        if violates_policy(&consumed, cap.policy.as_ref()) {
            return Ok(false);
        }
        let mut total = match current.and_then(|c| c.get(name)) {
            Some(allocated) => allocated.saturating_add(&consumed),
            None => consumed,
        };
        if let Some(more) = allocating.and_then(|a| a.get(name)) {
            total = total.saturating_add(more);
        }
        if total.compare(&cap.value) == Ordering::Greater {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Why [`fits`] says no, in words naming the capacity: a request for a capacity the device
/// does not have, a request outside the capacity's request policy, or what is left of the
/// capacity against what the request would consume (`memory: 3Gi of 81559Mi left, the request
/// consumes 19Gi`). `None` when it fits.
pub(crate) fn shortfall(
    current: Option<&ConsumedCapacity>,
    requests: Option<&Requests>,
    capacity: &BTreeMap<String, Capacity>,
    allocating: Option<&ConsumedCapacity>,
) -> Option<String> {
    if let Some(name) = requests.and_then(|r| r.keys().find(|n| !capacity.contains_key(*n))) {
        return Some(format!("no capacity {name}"));
    }
    for (name, cap) in capacity {
        let requested = requests.and_then(|r| r.get(name));
        let consumed = consumed_for(requested, cap);
        if violates_policy(&consumed, cap.policy.as_ref()) {
            return Some(format!(
                "{name}: {} is outside the device's request policy",
                requested.map_or_else(|| consumed.canonical_string(), Quantity::canonical_string)
            ));
        }
        let mut used = current
            .and_then(|c| c.get(name))
            .cloned()
            .unwrap_or_else(|| Quantity::from_int(0));
        if let Some(more) = allocating.and_then(|a| a.get(name)) {
            used = used.saturating_add(more);
        }
        let total = used.saturating_add(&consumed);
        if total.compare(&cap.value) == Ordering::Greater {
            let left = cap.value.sub_or_zero(&used);
            return Some(format!(
                "{name}: {} of {} left, the request consumes {}",
                readable(&left),
                cap.value.canonical_string(),
                readable(&consumed)
            ));
        }
    }
    None
}

/// An amount for people: whole GiB or MiB when it is a multiple of one, else as is.
fn readable(q: &Quantity) -> String {
    match q.as_i64() {
        Some(v) if v != 0 && v % (1 << 30) == 0 => format!("{}Gi", v >> 30),
        Some(v) if v != 0 && v % (1 << 20) == 0 => format!("{}Mi", v >> 20),
        Some(v) => v.to_string(),
        None => q.to_string(),
    }
}

/// `GetConsumedCapacityFromRequest`: what one allocation consumes of every capacity.
pub(crate) fn consumed_from_request(
    requests: Option<&Requests>,
    capacity: &BTreeMap<String, Capacity>,
) -> BTreeMap<String, Quantity> {
    capacity
        .iter()
        .map(|(name, cap)| {
            (
                name.clone(),
                consumed_for(requests.and_then(|r| r.get(name)), cap),
            )
        })
        .collect()
}

/// `calculateConsumedCapacity`: the request rounded up by the policy; without a request the
/// policy default, else the whole capacity.
fn consumed_for(requested: Option<&Quantity>, cap: &Capacity) -> Quantity {
    let Some(requested) = requested else {
        return match cap.policy.as_ref().and_then(|p| p.default.as_ref()) {
            Some(default) => default.clone(),
            None => cap.value.clone(),
        };
    };
    let Some(policy) = &cap.policy else {
        return requested.clone();
    };
    if let Some((min, _, step)) = &policy.valid_range {
        return round_up_range(requested, min, step.as_ref());
    }
    if let Some(values) = &policy.valid_values {
        return values
            .iter()
            .find(|v| requested.compare(v) != Ordering::Greater)
            .unwrap_or(requested)
            .clone();
    }
    requested.clone()
}

/// `roundUpRange`: at least min, then up to the next step (in int64 arithmetic).
fn round_up_range(requested: &Quantity, min: &Quantity, step: Option<&Quantity>) -> Quantity {
    if requested.compare(min) == Ordering::Less {
        return min.clone();
    }
    let Some(step) = step else {
        return requested.clone();
    };
    let step = step.value();
    if step == 0 {
        // Upstream divides by zero here (API validation rejects such a step).
        return requested.clone();
    }
    let min = min.value();
    let added = requested.value().wrapping_sub(min);
    let mut n = added.wrapping_div(step);
    if added.wrapping_rem(step) != 0 {
        n = n.wrapping_add(1);
    }
    Quantity::new(min.wrapping_add(step.wrapping_mul(n)), Format::BinarySi)
}

/// `violatesPolicy`.
fn violates_policy(consumed: &Quantity, policy: Option<&Policy>) -> bool {
    let Some(policy) = policy else {
        return false;
    };
    if let Some(default) = &policy.default
        && consumed.go_struct_eq(default)
    {
        return false;
    }
    if let Some((min, max, step)) = &policy.valid_range {
        if let Some(max) = max
            && consumed.compare(max) == Ordering::Greater
        {
            return true;
        }
        if let Some(step) = step {
            let step = step.value();
            if step == 0 {
                // Upstream divides by zero here (API validation rejects such a step).
                return true;
            }
            let added = consumed.value().wrapping_sub(min.value());
            return added.wrapping_rem(step) != 0;
        }
        return false;
    }
    if let Some(values) = policy.valid_values.as_ref().filter(|v| !v.is_empty()) {
        return !values
            .iter()
            .any(|v| consumed.compare(v) == Ordering::Equal);
    }
    false
}

/// `ConsumedCapacityCollection.Insert` for one device's entry.
pub(crate) fn insert(entry: &mut ConsumedCapacity, consumed: &ConsumedCapacity) {
    for (name, q) in consumed {
        match entry.get_mut(name) {
            Some(existing) => *existing = existing.saturating_add(q),
            None => {
                entry.insert(name.clone(), q.clone());
            }
        }
    }
}

/// `ConsumedCapacity.Sub` for names present, and whether the entry is now all zero
/// (`Empty`, which makes `Remove` drop it).
pub(crate) fn remove(entry: &mut ConsumedCapacity, consumed: &ConsumedCapacity) -> bool {
    for (name, q) in consumed {
        if let Some(existing) = entry.get_mut(name) {
            *existing = existing.sub_or_self(q);
        }
    }
    entry.values().all(|q| q.sign() == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(s: &str) -> Quantity {
        Quantity::parse(s).unwrap()
    }

    fn cap(value: &str, policy: Option<Policy>) -> Capacity {
        Capacity {
            value: q(value),
            policy,
        }
    }

    fn range(default: &str, min: &str, max: Option<&str>, step: Option<&str>) -> Policy {
        Policy {
            default: Some(q(default)),
            valid_range: Some((q(min), max.map(q), step.map(q))),
            valid_values: None,
        }
    }

    #[test]
    fn without_a_request_the_default_or_the_whole_capacity_is_consumed() {
        let c = cap("40Gi", Some(range("1Gi", "1Gi", None, None)));
        assert_eq!(consumed_for(None, &c).canonical_string(), "1Gi");
        assert_eq!(
            consumed_for(None, &cap("40Gi", None)).canonical_string(),
            "40Gi"
        );
    }

    #[test]
    fn a_step_rounds_the_request_up_from_min() {
        let c = cap("40Gi", Some(range("1Gi", "1Gi", None, Some("2Gi"))));
        assert_eq!(consumed_for(Some(&q("2Gi")), &c).canonical_string(), "3Gi");
        assert_eq!(
            consumed_for(Some(&q("512Mi")), &c).canonical_string(),
            "1Gi"
        );
    }

    #[test]
    fn valid_values_round_up_to_the_next_value() {
        let c = cap(
            "40Gi",
            Some(Policy {
                default: Some(q("10Gi")),
                valid_range: None,
                valid_values: Some(vec![q("10Gi"), q("20Gi")]),
            }),
        );
        assert_eq!(
            consumed_for(Some(&q("15Gi")), &c).canonical_string(),
            "20Gi"
        );
        assert_eq!(
            consumed_for(Some(&q("30Gi")), &c).canonical_string(),
            "30Gi"
        );
        let mut caps = BTreeMap::new();
        caps.insert("memory".to_string(), c);
        let mut requests = Requests::new();
        requests.insert("memory".into(), q("30Gi"));
        assert_eq!(fits(None, Some(&requests), &caps, None), Ok(false));
    }

    #[test]
    fn a_shortfall_names_the_capacity_what_is_left_and_what_the_request_consumes() {
        let capacity = BTreeMap::from([(
            "memory".to_owned(),
            cap("81559Mi", Some(range("79Gi", "1Gi", None, Some("1Gi")))),
        )]);
        let used = BTreeMap::from([("memory".to_owned(), q("76Gi"))]);
        let wants = BTreeMap::from([("memory".to_owned(), q("20G"))]);
        assert_eq!(
            shortfall(Some(&used), Some(&wants), &capacity, None).as_deref(),
            Some("memory: 3735Mi of 81559Mi left, the request consumes 19Gi")
        );
        assert_eq!(shortfall(None, Some(&wants), &capacity, None), None);
        let unknown = BTreeMap::from([("cores".to_owned(), q("1"))]);
        assert_eq!(
            shortfall(None, Some(&unknown), &capacity, None).as_deref(),
            Some("no capacity cores")
        );
    }

    #[test]
    fn a_request_for_an_unknown_capacity_is_an_error() {
        let mut caps = BTreeMap::new();
        caps.insert("memory".to_string(), cap("40Gi", None));
        let mut requests = Requests::new();
        requests.insert("cores".into(), q("1"));
        assert_eq!(fits(None, Some(&requests), &caps, None), Err(()));
    }

    #[test]
    fn allocated_and_allocating_capacity_add_up() {
        let mut caps = BTreeMap::new();
        caps.insert("memory".to_string(), cap("40Gi", None));
        let mut requests = Requests::new();
        requests.insert("memory".into(), q("20Gi"));
        let mut used = ConsumedCapacity::new();
        used.insert("memory".into(), q("10Gi"));
        assert_eq!(
            fits(Some(&used), Some(&requests), &caps, Some(&used)),
            Ok(true)
        );
        used.insert("memory".into(), q("11Gi"));
        assert_eq!(
            fits(Some(&used), Some(&requests), &caps, Some(&used)),
            Ok(false)
        );
    }
}
