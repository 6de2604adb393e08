//! The Kubernetes CEL libraries the DRA environment includes.

pub mod format;
pub mod ip;
/// Quantities: the workspace's one type ([`k8s_quantity`]).
pub use k8s_quantity as quantity;
pub mod regex;
pub mod semver;
pub(crate) mod strfmt;
pub mod url;
