//! The Kubernetes CEL libraries the DRA environment includes.

pub mod ip;
pub mod quantity;
pub mod regex;
pub mod semver;
pub mod url;
