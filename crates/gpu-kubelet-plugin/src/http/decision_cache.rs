//! Recent access decisions of the HTTP endpoint, each kept for a short time, so that a scraper
//! asking every 15 s costs the API server a TokenReview and a SubjectAccessReview only once in
//! a while. The API server's delegated authentication and authorization cache the same way
//! (k8s.io/apiserver `pkg/authentication/token/cache`, `plugin/pkg/authorizer/webhook`):
//! positive and negative answers alike, never a failed review, keyed by a SHA-256 digest so no
//! token is kept, and bounded in size.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// The SHA-256 digest of what a decision was made for (a token, or a user and a request).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Key([u8; 32]);

impl Key {
    /// The digest of `parts`, each length-prefixed so that no two lists of parts collide by
    /// concatenation.
    pub fn of(parts: &[&[u8]]) -> Self {
        let mut hasher = Sha256::new();
        for part in parts {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part);
        }
        Self(hasher.finalize().into())
    }
}

/// Decisions by [`Key`], each until its time to live runs out; at most `capacity` of them.
#[derive(Debug)]
pub struct DecisionCache<V> {
    entries: Mutex<HashMap<Key, (V, Instant)>>,
    capacity: usize,
}

impl<V: Clone> DecisionCache<V> {
    /// An empty cache holding at most `capacity` decisions (at least one).
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
            capacity: capacity.max(1),
        }
    }

    /// The decision for `key`, unless there is none or it expired by `now`.
    pub fn get(&self, key: &Key, now: Instant) -> Option<V> {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries
            .get(key)
            .filter(|(_, expires)| now < *expires)
            .map(|(value, _)| value.clone())
    }

    /// Keeps `value` for `key` until `now + ttl`. When the cache is full, expired decisions go
    /// first, then the one closest to expiring: a burst of new tokens can only shorten how long
    /// older decisions are kept, never make the cache grow.
    pub fn insert(&self, key: Key, value: V, ttl: Duration, now: Instant) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if !entries.contains_key(&key) && entries.len() >= self.capacity {
            entries.retain(|_, (_, expires)| now < *expires);
            if entries.len() >= self.capacity
                && let Some(soonest) = entries
                    .iter()
                    .min_by_key(|(_, (_, expires))| *expires)
                    .map(|(k, _)| *k)
            {
                entries.remove(&soonest);
            }
        }
        entries.insert(key, (value, now + ttl));
    }

    /// How many decisions are held, expired ones included.
    pub fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether no decision is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(60);

    #[test]
    fn a_decision_is_kept_until_its_time_to_live_runs_out() {
        let cache = DecisionCache::new(4);
        let (key, t0) = (Key::of(&[b"token"]), Instant::now());
        cache.insert(key, true, TTL, t0);
        assert_eq!(cache.get(&key, t0), Some(true));
        assert_eq!(
            cache.get(&key, t0 + TTL - Duration::from_millis(1)),
            Some(true)
        );
        assert_eq!(cache.get(&key, t0 + TTL), None);
        assert_eq!(cache.get(&Key::of(&[b"other"]), t0), None);
    }

    #[test]
    fn a_new_decision_replaces_the_old_one_for_its_key() {
        let cache = DecisionCache::new(4);
        let (key, t0) = (Key::of(&[b"token"]), Instant::now());
        cache.insert(key, false, Duration::from_secs(30), t0);
        cache.insert(key, true, TTL, t0 + Duration::from_secs(29));
        assert_eq!(cache.get(&key, t0 + Duration::from_secs(40)), Some(true));
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn a_full_cache_drops_expired_decisions_then_the_closest_to_expiring() {
        let cache = DecisionCache::new(3);
        let t0 = Instant::now();
        let key = |n: u8| Key::of(&[&[n]]);
        cache.insert(key(1), 1, Duration::from_secs(10), t0);
        cache.insert(key(2), 2, Duration::from_secs(90), t0);
        cache.insert(key(3), 3, Duration::from_secs(60), t0);
        // Full, none expired: the one expiring first (1) goes.
        cache.insert(key(4), 4, TTL, t0);
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.get(&key(1), t0), None);
        assert_eq!(
            [2, 3, 4].map(|n| cache.get(&key(n), t0)),
            [Some(2), Some(3), Some(4)]
        );
        // Later, 3 and 4 have expired: both go, and nothing still valid is dropped.
        let later = t0 + Duration::from_secs(61);
        cache.insert(key(5), 5, TTL, later);
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.get(&key(2), later), Some(2));
        assert_eq!(cache.get(&key(5), later), Some(5));
    }

    #[test]
    fn keys_of_different_parts_differ_even_when_their_bytes_join_alike() {
        assert_ne!(Key::of(&[b"ab", b"c"]), Key::of(&[b"a", b"bc"]));
        assert_eq!(Key::of(&[b"ab", b"c"]), Key::of(&[b"ab", b"c"]));
    }
}
