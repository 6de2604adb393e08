//! A compile cache keyed by expression text, shared across threads (upstream
//! `k8s.io/dynamic-resource-allocation/cel/cache.go` keeps an LRU of the same shape).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use crate::{CompileError, CompiledExpression, Compiler};

/// Thread-safe cache of compiled selectors. Failed compilations are not cached, like upstream.
#[derive(Debug)]
pub struct Cache {
    compiler: Compiler,
    capacity: usize,
    entries: RwLock<HashMap<String, Arc<CompiledExpression>>>,
}

impl Cache {
    /// A cache holding at most `capacity` expressions (cleared wholesale when full).
    pub fn new(compiler: Compiler, capacity: usize) -> Cache {
        Cache {
            compiler,
            capacity: capacity.max(1),
            entries: RwLock::new(HashMap::new()),
        }
    }

    /// The compiled expression, compiling it on a miss.
    ///
    /// # Errors
    /// [`CompileError`] from [`Compiler::compile`].
    pub fn get_or_compile(
        &self,
        expression: &str,
    ) -> Result<Arc<CompiledExpression>, CompileError> {
        if let Ok(entries) = self.entries.read()
            && let Some(c) = entries.get(expression)
        {
            return Ok(Arc::clone(c));
        }
        let compiled = Arc::new(self.compiler.compile(expression)?);
        if let Ok(mut entries) = self.entries.write() {
            if entries.len() >= self.capacity {
                entries.clear();
            }
            entries.insert(expression.to_string(), Arc::clone(&compiled));
        }
        Ok(compiled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_expression_is_compiled_once_and_shared_across_threads() {
        let cache = Arc::new(Cache::new(Compiler::default(), 10));
        let a = cache.get_or_compile("device.driver == 'x'").unwrap();
        let c2 = Arc::clone(&cache);
        let b = std::thread::spawn(move || c2.get_or_compile("device.driver == 'x'").unwrap())
            .join()
            .unwrap();
        assert!(Arc::ptr_eq(&a, &b));
    }
}
