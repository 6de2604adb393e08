//! Regular expressions with RE2 syntax, as Go's `regexp` package accepts them.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

/// Why a pattern does not compile.
#[derive(Debug, Clone, thiserror::Error)]
#[error("error parsing regexp: {0}")]
pub struct RegexError(pub String);

static CACHE: LazyLock<Mutex<HashMap<String, Arc<regex::Regex>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// Compiles a pattern (cached process-wide: selectors repeat the same few patterns).
///
/// Go's RE2 rejects some syntax the `regex` crate accepts (e.g. `\Z`, Unicode class names it
/// does not know); those differences are not mirrored.
///
/// # Errors
/// [`RegexError`] when the pattern is invalid.
pub fn compile(pattern: &str) -> Result<Arc<regex::Regex>, RegexError> {
    if let Ok(cache) = CACHE.lock()
        && let Some(r) = cache.get(pattern)
    {
        return Ok(Arc::clone(r));
    }
    let r = regex::RegexBuilder::new(pattern)
        .size_limit(1 << 20)
        .build()
        .map_err(|e| RegexError(e.to_string()))?;
    let r = Arc::new(r);
    if let Ok(mut cache) = CACHE.lock() {
        if cache.len() > 4096 {
            cache.clear();
        }
        cache.insert(pattern.to_string(), Arc::clone(&r));
    }
    Ok(r)
}
