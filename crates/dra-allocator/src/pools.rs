//! Resource pools as one node sees them: which slices count, which generation wins, whether a
//! pool is complete, obsolete or invalid, and the order the search visits pools and slices in.
//!
//! upstream: `structured/internal/incubating/pools_incubating.go` (`GatherPools`, `addSlice`,
//! `buildPool`, `checkSlicesInPool`, `validateDeviceNames`, `validateDeviceCounterConsumption`);
//! KEP-4815 (partitionable devices), KEP-5007 (binding conditions: such pools go last).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use foldhash::{HashMap, HashSet, HashSetExt};

use k8s_openapi::api::core::v1::Node;

use crate::Features;
use crate::model::{Counters, SliceData};
use crate::node_selector::node_matches;

/// One pool for one node.
#[derive(Debug, Default)]
pub(crate) struct Pool<'a> {
    pub driver: &'a str,
    pub pool: &'a str,
    /// Not all slices of the newest generation are there.
    pub incomplete: bool,
    /// Duplicate device names or bad counters.
    pub invalid: bool,
    /// Why it is invalid (upstream only logs this).
    #[allow(dead_code)]
    pub invalid_reason: String,
    /// Slices with devices that the node can use, sorted by name (indices into the allocator's
    /// slices).
    pub slices: Vec<usize>,
    /// Slices of the pool that the node cannot use; only known (and only needed for counters)
    /// when the node's slices alone looked incomplete.
    pub not_targeting: Vec<usize>,
    /// Counter sets by name.
    pub counter_sets: BTreeMap<String, Counters>,
}

impl Pool<'_> {
    /// `PoolID.String()`: `driver/pool`.
    pub fn id(&self) -> String {
        format!("{}/{}", self.driver, self.pool)
    }
}

/// `GatherPools` for the slices of one node (its own slices, then the shared ones).
///
/// # Errors
/// A node selector that does not parse.
pub(crate) fn gather_pools<'a>(
    all: &[SliceData<'a>],
    by_pool: &HashMap<(&'a str, &'a str), Vec<usize>>,
    slices_for_node: impl IntoIterator<Item = usize>,
    node: &Node,
    features: Features,
    cache: &PoolCache<'a>,
) -> Result<Vec<Arc<Pool<'a>>>, String> {
    // (driver, pool) and the slices of the newest generation seen, in input order; looked up
    // through `index_of` once there are more than a few pools (a node usually sees one or two).
    let mut pools: Vec<((&'a str, &'a str), Vec<usize>)> = Vec::new();
    let mut index_of: Option<HashMap<(&'a str, &'a str), usize>> = None;
    const LINEAR: usize = 8;
    for index in slices_for_node {
        let Some(slice) = all.get(index) else {
            continue;
        };
        if !features.partitionable_devices
            && (slice.per_device_node_selection_set || slice.has_shared_counters())
        {
            continue;
        }
        let relevant = if slice.has_shared_counters() {
            true
        } else if slice.node_name.is_some_and(|n| !n.is_empty())
            || slice.all_nodes
            || slice.node_selector.is_some()
        {
            node_matches(
                node,
                slice.node_name.unwrap_or(""),
                slice.all_nodes,
                slice.node_selector,
            )
            .map_err(|e| {
                format!(
                    "failed to perform node selection for slice {}: {e}",
                    slice.name
                )
            })?
        } else if slice.per_device_node_selection {
            let mut any = false;
            for d in &slice.devices {
                let m = node_matches(
                    node,
                    d.obj.node_name.as_deref().unwrap_or(""),
                    d.obj.all_nodes.unwrap_or(false),
                    d.obj.node_selector.as_ref(),
                )
                .map_err(|e| {
                    format!(
                        "failed to perform node selection for device {} in slice {}: {e}",
                        d.name, slice.name
                    )
                })?;
                if m {
                    any = true;
                    break;
                }
            }
            any
        } else {
            // Some future way of node selection: skip, other pools may still do.
            continue;
        };
        if !relevant {
            continue;
        }
        // addSlice
        let key = (slice.driver, slice.pool);
        let at = if pools.len() <= LINEAR {
            pools.iter().position(|(k, _)| *k == key)
        } else {
            index_of
                .get_or_insert_with(|| {
                    pools
                        .iter()
                        .enumerate()
                        .map(|(i, (k, _))| (*k, i))
                        .collect()
                })
                .get(&key)
                .copied()
        };
        match at.and_then(|i| pools.get_mut(i)).map(|(_, list)| list) {
            None => {
                if let Some(index_of) = &mut index_of {
                    index_of.insert(key, pools.len());
                }
                pools.push((key, vec![index]));
            }
            Some(list) => {
                let current = list
                    .first()
                    .and_then(|&i| all.get(i))
                    .map_or(i64::MIN, |s| s.generation);
                if slice.generation < current {
                    continue;
                }
                if slice.generation > current {
                    list.clear();
                }
                list.push(index);
            }
        }
    }

    let mut result: Vec<Arc<Pool<'a>>> = Vec::new();
    let mut with_binding: Vec<Arc<Pool<'a>>> = Vec::new();
    for (key, slices) in pools {
        // A pool of slices that every node may see (no node name, or counter sets) comes out
        // the same for every node that sees the same slices: built once per allocator.
        let shared = slices.iter().all(|&i| {
            all.get(i)
                .is_some_and(|s| s.node_name.is_none_or(str::is_empty) || s.has_shared_counters())
        });
        let pool = if shared {
            let cache_key = (key, slices);
            let cached = cache
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(&cache_key)
                .cloned();
            match cached {
                Some(pool) => pool,
                None => {
                    let (key, mut slices) = cache_key.clone();
                    let pool = one_pool(all, by_pool, key, &mut slices, features).map(Arc::new);
                    cache
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .insert(cache_key, pool.clone());
                    pool
                }
            }
        } else {
            let mut slices = slices;
            one_pool(all, by_pool, key, &mut slices, features).map(Arc::new)
        };
        let Some(pool) = pool else {
            continue;
        };
        let binding = pool
            .slices
            .iter()
            .any(|&i| all.get(i).is_some_and(|s| s.has_binding_conditions));
        if binding {
            with_binding.push(pool);
        } else {
            result.push(pool);
        }
    }
    let by_id = |a: &Arc<Pool<'_>>, b: &Arc<Pool<'_>>| {
        a.driver.cmp(b.driver).then_with(|| a.pool.cmp(b.pool))
    };
    result.sort_by(by_id);
    with_binding.sort_by(by_id);
    result.append(&mut with_binding);
    Ok(result)
}

/// Pools built for earlier nodes, by (driver, pool) and the slices the node saw; `None` for
/// an obsolete pool (skipped).
pub(crate) type PoolCache<'a> = Mutex<HashMap<PoolKey<'a>, Option<Arc<Pool<'a>>>>>;

/// (driver, pool) and the slices a node sees of it.
pub(crate) type PoolKey<'a> = ((&'a str, &'a str), Vec<usize>);

/// One pool as a node sees it (`slices`, of its newest generation): incomplete, invalid, or
/// built; `None` when a newer generation exists elsewhere (obsolete, skipped).
fn one_pool<'a>(
    all: &[SliceData<'a>],
    by_pool: &HashMap<(&'a str, &'a str), Vec<usize>>,
    key: (&'a str, &'a str),
    slices: &mut [usize],
    features: Features,
) -> Option<Pool<'a>> {
    let first = slices.first().and_then(|&i| all.get(i))?;
    let (generation, count) = (first.generation, first.slice_count);
    Some(if slices.len() as i64 == count {
        build_pool(all, key, slices, None, features)
    } else {
        // checkSlicesInPool: look at every slice of the pool, for any node.
        let mut all_for_pool = Vec::new();
        let mut obsolete = false;
        for &i in by_pool.get(&key).into_iter().flatten() {
            let Some(s) = all.get(i) else {
                continue;
            };
            if s.generation == generation {
                all_for_pool.push(i);
            } else if s.generation > generation {
                obsolete = true;
                break;
            }
        }
        if obsolete {
            return None;
        }
        if all_for_pool.len() as i64 != count {
            return Some(Pool {
                driver: key.0,
                pool: key.1,
                incomplete: true,
                ..Pool::default()
            });
        }
        build_pool(all, key, slices, Some(&all_for_pool), features)
    })
}

/// `buildPool`.
fn build_pool<'a>(
    all: &[SliceData<'a>],
    key: (&'a str, &'a str),
    slices: &mut [usize],
    all_for_pool: Option<&[usize]>,
    features: Features,
) -> Pool<'a> {
    let name = |i: &usize| all.get(*i).map_or("", |s| s.name);
    slices.sort_by(|a, b| name(a).cmp(name(b)));
    let invalid = |reason: String| Pool {
        driver: key.0,
        pool: key.1,
        invalid: true,
        invalid_reason: reason,
        ..Pool::default()
    };
    // The common pool, one slice of plain devices that the node sees whole: its checks were
    // made when the slice was read. Same outcome as the general path below.
    if let [only] = *slices
        && let Some(s) = all.get(only)
        && all_for_pool.is_none_or(|a| a.len() == 1)
        && !(features.partitionable_devices && (s.has_shared_counters() || s.consumes_counters))
    {
        if let Some(d) = s.duplicate_device {
            return invalid(format!("duplicate device name {d}"));
        }
        return Pool {
            driver: key.0,
            pool: key.1,
            slices: vec![only],
            ..Pool::default()
        };
    }
    let (counter_slices, device_slices): (Vec<usize>, Vec<usize>) =
        if features.partitionable_devices {
            slices
                .iter()
                .partition(|&&i| all.get(i).is_some_and(SliceData::has_shared_counters))
        } else {
            (Vec::new(), slices.to_vec())
        };

    let mut names = HashSet::new();
    for d in device_slices
        .iter()
        .filter_map(|&i| all.get(i))
        .flat_map(|s| &s.devices)
    {
        if !names.insert(d.name) {
            return invalid(format!("duplicate device name {}", d.name));
        }
    }
    if !features.partitionable_devices {
        return Pool {
            driver: key.0,
            pool: key.1,
            slices: device_slices,
            ..Pool::default()
        };
    }
    let mut counter_sets: BTreeMap<String, Counters> = BTreeMap::new();
    for s in counter_slices.iter().filter_map(|&i| all.get(i)) {
        for (set, counters) in &s.shared_counters {
            if counter_sets.contains_key(set) {
                return invalid(format!("duplicate counter set name {set}"));
            }
            counter_sets.insert(set.clone(), counters.clone());
        }
    }
    if let Err(reason) = validate_consumption(&counter_sets, all, slices) {
        return invalid(reason);
    }
    let mut pool = Pool {
        driver: key.0,
        pool: key.1,
        slices: device_slices,
        counter_sets,
        ..Pool::default()
    };
    let Some(all_for_pool) = all_for_pool else {
        return pool;
    };
    if all_for_pool.len() == slices.len() {
        return pool;
    }
    let seen: HashSet<&str> = slices.iter().map(name).collect();
    let not_targeting: Vec<usize> = all_for_pool
        .iter()
        .copied()
        .filter(|i| !seen.contains(name(i)))
        .collect();
    if let Err(reason) = validate_consumption(&pool.counter_sets, all, &not_targeting) {
        return invalid(reason);
    }
    pool.not_targeting = not_targeting;
    pool
}

/// `validateDeviceCounterConsumption`: every consumed counter exists.
fn validate_consumption(
    sets: &BTreeMap<String, Counters>,
    all: &[SliceData<'_>],
    slices: &[usize],
) -> Result<(), String> {
    for d in slices
        .iter()
        .filter_map(|&i| all.get(i))
        .flat_map(|s| &s.devices)
    {
        for (set_name, counters) in &d.consumes_counters {
            let Some(set) = sets.get(set_name) else {
                return Err(format!("counter set {set_name} not found"));
            };
            for counter in counters.keys() {
                if !set.contains_key(counter) {
                    return Err(format!(
                        "counter {counter} not found in counter set {set_name}"
                    ));
                }
            }
        }
    }
    Ok(())
}
