//! Runs `dra_allocator::allocate` on YAML/JSON files and prints the report as JSON, for
//! comparing with `tests/gotools/cmd/allocoracle`:
//!
//! `cargo run -p dra-allocator --example allocate -- FILE... [--node NAME] [--timeout SECS]`
//!
//! No validation: that is `dractl allocate`'s job.

use std::time::Duration;

use anyhow::{Context, bail};
use dra_allocator::{Objects, Options, allocate, apply_defaults};
use serde::Deserialize;

fn add(objects: &mut Objects, doc: serde_json::Value) -> anyhow::Result<()> {
    let kind = doc
        .get("kind")
        .and_then(|k| k.as_str())
        .unwrap_or("")
        .to_string();
    match kind.as_str() {
        "List" => {
            for item in doc
                .get("items")
                .and_then(|i| i.as_array())
                .cloned()
                .unwrap_or_default()
            {
                add(objects, item)?;
            }
        }
        "Node" => objects.nodes.push(serde_json::from_value(doc)?),
        "DeviceClass" => objects.classes.push(serde_json::from_value(doc)?),
        "ResourceSlice" => objects.slices.push(serde_json::from_value(doc)?),
        "ResourceClaim" => objects.claims.push(serde_json::from_value(doc)?),
        "" => {}
        other => bail!("unsupported kind {other}"),
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let mut objects = Objects::default();
    let mut options = Options::default();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--node" => options.node = args.next(),
            "--timeout" => {
                let secs: f64 = args.next().context("--timeout SECS")?.parse()?;
                options.timeout = Duration::from_secs_f64(secs);
            }
            path => {
                let text = std::fs::read_to_string(path).with_context(|| path.to_string())?;
                for doc in serde_yaml_ng::Deserializer::from_str(&text) {
                    let value = serde_json::Value::deserialize(doc)?;
                    if value.is_null() {
                        continue;
                    }
                    add(&mut objects, value).with_context(|| path.to_string())?;
                }
            }
        }
    }
    apply_defaults(&mut objects);
    let report = allocate(&objects, &options);
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}
