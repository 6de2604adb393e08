//! Membership: which nodes a domain's channel claims were allocated on, and each member's
//! stable index in its clique.
//!
//! The index is the node's line in its clique's IMEX nodes file, which is the daemon's IMEX
//! node ID: it must never change while the node is a member, or peers import memory from the
//! wrong node (NVIDIA #1417/#1418: `invalid resource handle`; #1440: a status prune swapping two
//! indices). So it is read back from the domain's own status, kept for every node that stays,
//! and a new member gets the lowest index its clique does not hold. The status is the only
//! record: it survives daemon and controller restarts.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};

use crate::crd::{ComputeDomainNode, NOT_READY};

/// The driver whose channel devices the domains' claims get.
pub const DRIVER: &str = "gpu.drust.dev";
/// Channel device names start with this (`imex-channel-<N>`).
pub const CHANNEL_PREFIX: &str = "imex-channel-";
/// The channel device attribute holding the node's clique.
pub const CLIQUE_ATTRIBUTE: &str = "nvlinkClique";

/// One allocated channel device of a claim (the key of its `status.devices[]` entry).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Channel {
    /// The node the claim was allocated on.
    pub node: String,
    /// `driver` of the allocation result.
    pub driver: String,
    /// `pool`.
    pub pool: String,
    /// `device`.
    pub device: String,
    /// `shareID`, set when the device allows multiple allocations (KEP-5075); part of the
    /// status entry's key.
    pub share_id: Option<String>,
}

/// The channel devices of an allocated claim, each with its node: the allocation's node
/// selector (`metadata.name` field) or else the result's pool (drust's pools are named after
/// their node). Empty when the claim is not allocated or holds no channel.
pub fn channels(claim: &ResourceClaim) -> Vec<Channel> {
    let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
        return Vec::new();
    };
    let selected = allocation
        .node_selector
        .as_ref()
        .into_iter()
        .flat_map(|s| &s.node_selector_terms)
        .flat_map(|t| t.match_fields.iter().flatten())
        .find(|f| f.key == "metadata.name" && f.operator == "In")
        .and_then(|f| f.values.as_ref()?.first().cloned());
    allocation
        .devices
        .as_ref()
        .into_iter()
        .flat_map(|d| &d.results)
        .flatten()
        .filter(|r| r.driver == DRIVER && r.device.starts_with(CHANNEL_PREFIX))
        .map(|r| Channel {
            node: selected.clone().unwrap_or_else(|| r.pool.clone()),
            driver: r.driver.clone(),
            pool: r.pool.clone(),
            device: r.device.clone(),
            share_id: r.share_id.clone(),
        })
        .collect()
}

/// The clique of channel device `device` in pool `pool` of [`DRIVER`] (its
/// [`CLIQUE_ATTRIBUTE`], qualified or not); empty when the device has none or is not in a
/// slice.
pub fn clique<'a>(
    slices: impl IntoIterator<Item = &'a ResourceSlice>,
    pool: &str,
    device: &str,
) -> String {
    let qualified = format!("{DRIVER}/{CLIQUE_ATTRIBUTE}");
    slices
        .into_iter()
        .filter(|s| s.spec.driver == DRIVER && s.spec.pool.name == pool)
        .flat_map(|s| s.spec.devices.iter().flatten())
        .find(|d| d.name == device)
        .and_then(|d| {
            let attributes = d.attributes.as_ref()?;
            attributes
                .get(CLIQUE_ATTRIBUTE)
                .or_else(|| attributes.get(&qualified))?
                .string
                .clone()
        })
        .unwrap_or_default()
}

/// The new `status.nodes`: every node of `members` (node name → clique) with the index it
/// had in `previous` if it is still in the same clique, else the lowest index its clique does
/// not hold; IP address and status carried over (the caller refreshes them). Sorted by clique,
/// then index.
pub fn assign(
    previous: &[ComputeDomainNode],
    members: &BTreeMap<String, String>,
) -> Vec<ComputeDomainNode> {
    let mut kept: Vec<ComputeDomainNode> = previous
        .iter()
        .filter(|n| members.get(&n.name) == Some(&n.clique_id))
        .cloned()
        .collect();
    // A corrupted status (two members on one index) keeps the first and renumbers the other.
    let mut held: BTreeMap<&str, BTreeSet<i64>> = BTreeMap::new();
    let mut duplicates = Vec::new();
    for (i, n) in kept.iter().enumerate() {
        if !held.entry(&n.clique_id).or_default().insert(n.index) || n.index < 0 {
            duplicates.push(i);
        }
    }
    let mut held: BTreeMap<String, BTreeSet<i64>> =
        held.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
    let mut fresh: Vec<(String, String)> = duplicates
        .iter()
        .rev()
        .map(|&i| {
            let n = kept.remove(i);
            (n.name, n.clique_id)
        })
        .collect();
    fresh.extend(
        members
            .iter()
            .filter(|(name, _)| !kept.iter().any(|n| &n.name == *name))
            .filter(|(name, _)| !fresh.iter().any(|(f, _)| f == *name))
            .map(|(name, clique)| (name.clone(), clique.clone()))
            .collect::<Vec<_>>(),
    );
    fresh.sort();
    for (name, clique) in fresh {
        let taken = held.entry(clique.clone()).or_default();
        let index = (0..).find(|i| !taken.contains(i)).unwrap_or_default();
        taken.insert(index);
        kept.push(ComputeDomainNode {
            name,
            ip_address: String::new(),
            clique_id: clique,
            index,
            status: NOT_READY.to_owned(),
        });
    }
    kept.sort_by(|a, b| (&a.clique_id, a.index).cmp(&(&b.clique_id, b.index)));
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, clique: &str, index: i64) -> ComputeDomainNode {
        ComputeDomainNode {
            name: name.into(),
            ip_address: "10.0.0.1".into(),
            clique_id: clique.into(),
            index,
            status: "Ready".into(),
        }
    }

    fn members(list: &[(&str, &str)]) -> BTreeMap<String, String> {
        list.iter()
            .map(|(n, c)| ((*n).to_owned(), (*c).to_owned()))
            .collect()
    }

    #[test]
    fn a_staying_node_keeps_its_index_and_a_new_one_takes_the_lowest_free() {
        let previous = [node("a", "c", 0), node("b", "c", 1), node("c", "c", 2)];
        // b leaves, d joins: d gets 1, a and c keep theirs.
        let next = assign(&previous, &members(&[("a", "c"), ("c", "c"), ("d", "c")]));
        let got: Vec<(&str, i64)> = next.iter().map(|n| (n.name.as_str(), n.index)).collect();
        assert_eq!(got, [("a", 0), ("d", 1), ("c", 2)]);
        assert_eq!(next[0].ip_address, "10.0.0.1");
        assert_eq!(next[1].status, NOT_READY);
    }

    #[test]
    fn indices_are_per_clique() {
        let next = assign(&[], &members(&[("a", "x"), ("b", "y"), ("c", "x")]));
        let got: Vec<(&str, &str, i64)> = next
            .iter()
            .map(|n| (n.name.as_str(), n.clique_id.as_str(), n.index))
            .collect();
        assert_eq!(got, [("a", "x", 0), ("c", "x", 1), ("b", "y", 0)]);
    }

    #[test]
    fn a_node_that_changed_clique_is_renumbered_in_the_new_one() {
        let next = assign(&[node("a", "x", 5)], &members(&[("a", "y")]));
        assert_eq!((next[0].clique_id.as_str(), next[0].index), ("y", 0));
    }

    #[test]
    fn a_duplicate_index_in_the_status_is_repaired() {
        let previous = [node("a", "c", 0), node("b", "c", 0)];
        let next = assign(&previous, &members(&[("a", "c"), ("b", "c")]));
        let got: Vec<(&str, i64)> = next.iter().map(|n| (n.name.as_str(), n.index)).collect();
        assert_eq!(got, [("a", 0), ("b", 1)]);
    }

    #[test]
    fn sixty_four_joins_get_distinct_indices() {
        let list: Vec<(String, String)> =
            (0..64).map(|i| (format!("n{i}"), "c".to_owned())).collect();
        let m: BTreeMap<String, String> = list.into_iter().collect();
        let next = assign(&[], &m);
        let indices: BTreeSet<i64> = next.iter().map(|n| n.index).collect();
        assert_eq!(indices, (0..64).collect());
    }
}
