//! The drust node plugin: discovers this node's GPUs, publishes them as ResourceSlices, and
//! prepares claims for the kubelet over the DRA gRPC API.
//!
//! [`run`] wires it together: backend -> inventory -> [`publisher`] -> [`dra_kubelet`] server with
//! the [`claims`] controller behind it, until shutdown. The modules are layered, settings at the
//! bottom and the wiring on top; none names a module above its own (`tests/layers.rs` lists the
//! layers).

// Claim errors carry the claim and the cause (a kube::Error among them) so the kubelet gets a
// message naming both; they are per-claim and rare, so their size is not worth boxing.
#![allow(clippy::result_large_err)]

pub use dra_plugin::cdi;
pub mod checkpoint;
pub mod claim_config;
pub mod claim_users;
pub mod claims;
pub mod config;
pub mod device_metadata;
pub mod driver_files;
pub mod fabric;
pub mod failpoint;
pub mod hardware;
pub mod health;
pub mod health_record;
pub mod http;
pub mod imex;
pub mod instance;
pub mod memory_limits;
pub mod metrics;
pub mod mps;
pub mod node_label;
pub mod publisher;
pub mod usage;
pub use dra_plugin::storage;

// The start-up and the wiring, by job; their public items are re-exported below.
mod active;
mod client;
mod discovery;
mod dry_run;
mod enforcement;
mod error;
mod publishing;
mod state;
mod takeover;
mod wiring;

pub use client::kube_client;
pub use config::{Backend, Config, DEFAULT_DRIVER_NAME, OutputFormat};
pub use discovery::{discover, open_backend, rediscover};
pub use dry_run::write_dry_run;
pub use error::Error;
pub use publishing::Publishing;
pub use state::secure_state;
pub use wiring::run;
