//! The Kubernetes CEL libraries the DRA environment includes.

pub mod quantity;
pub mod regex;
pub mod semver;
