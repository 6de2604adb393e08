//! Who holds which node and clique: one domain per node and per clique (NVIDIA #892), rebuilt
//! from the domains' statuses at start and kept in memory by the one controller.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, PoisonError};

use kube::ResourceExt;

use crate::crd::Domain;
use crate::*;

/// Which domain holds a node or a clique.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Holder {
    pub(crate) uid: String,
    /// `namespace/name`, for messages.
    pub(crate) domain: String,
}

impl<D: Domain> Context<D> {
    /// Rebuilds who holds which node and clique from the domains' statuses.
    pub(crate) fn seed(&self, domains: &[D]) {
        let mut holdings = self.holdings.lock().unwrap_or_else(PoisonError::into_inner);
        for d in domains {
            let Some(uid) = d.meta().uid.clone() else {
                continue;
            };
            let holder = Holder {
                uid,
                domain: format!("{}/{}", d.namespace().unwrap_or_default(), d.name_any()),
            };
            for n in d
                .domain_status()
                .map(|s| s.nodes.as_slice())
                .unwrap_or_default()
            {
                for k in hold_keys(&n.name, &n.clique_id) {
                    holdings.entry(k).or_insert_with(|| holder.clone());
                }
            }
        }
    }

    /// Takes every node of `wanted` (node → clique) whose node and clique no other domain
    /// holds, releases what the domain no longer wants, and returns the nodes refused with
    /// their holder.
    pub(crate) fn hold(
        &self,
        uid: &str,
        domain: &str,
        wanted: &BTreeMap<String, String>,
    ) -> BTreeMap<String, Holder> {
        hold_in(&self.holdings, uid, domain, wanted)
    }

    /// Releases everything domain `uid` holds.
    pub(crate) fn release(&self, uid: &str) {
        self.holdings
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|_, h| h.uid != uid);
    }
}

/// The keys a member holds: its node, and its clique if it has one.
pub(crate) fn hold_keys(node: &str, clique: &str) -> Vec<String> {
    let mut keys = vec![format!("node:{node}")];
    if !clique.is_empty() {
        keys.push(format!("clique:{clique}"));
    }
    keys
}

/// [`Context::hold`]'s logic over a bare map (unit-tested without a client).
pub(crate) fn hold_in(
    holdings: &Mutex<BTreeMap<String, Holder>>,
    uid: &str,
    domain: &str,
    wanted: &BTreeMap<String, String>,
) -> BTreeMap<String, Holder> {
    let mut holdings = holdings.lock().unwrap_or_else(PoisonError::into_inner);
    let me = Holder {
        uid: uid.to_owned(),
        domain: domain.to_owned(),
    };
    let mut refused = BTreeMap::new();
    let mut mine = BTreeSet::new();
    for (node, clique) in wanted {
        let keys = hold_keys(node, clique);
        if let Some(other) = keys
            .iter()
            .filter_map(|k| holdings.get(k))
            .find(|h| h.uid != uid)
        {
            refused.insert(node.clone(), other.clone());
            continue;
        }
        for k in keys {
            holdings.insert(k.clone(), me.clone());
            mine.insert(k);
        }
    }
    holdings.retain(|k, h| h.uid != uid || mine.contains(k));
    refused
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(crate) fn hold_refuses_a_clique_another_domain_holds_and_releases_what_is_left() {
        let ctx_holdings: Mutex<BTreeMap<String, Holder>> = Mutex::new(BTreeMap::new());
        // Exercise the logic through a minimal stand-in: the same code path as Context::hold.
        let hold = |uid: &str, wanted: &[(&str, &str)]| {
            let wanted: BTreeMap<String, String> = wanted
                .iter()
                .map(|(n, c)| ((*n).to_owned(), (*c).to_owned()))
                .collect();
            hold_in(&ctx_holdings, uid, uid, &wanted)
        };
        assert!(hold("a", &[("n1", "c1")]).is_empty());
        // Another node of clique c1: refused for b.
        assert_eq!(hold("b", &[("n2", "c1"), ("n3", "c2")]).len(), 1);
        // The same node with no clique: refused too.
        assert!(hold("b", &[("n1", "")]).contains_key("n1"));
        // a leaves c1: b may take it.
        assert!(hold("a", &[]).is_empty());
        assert!(hold("b", &[("n2", "c1")]).is_empty());
    }
}
