//! The Kubernetes CEL libraries the DRA environment includes.

pub mod format;
pub mod ip;
pub mod quantity;
pub mod regex;
pub mod semver;
pub(crate) mod strfmt;
pub mod url;
