//! A search that would run for a very long time ends at its deadline ("timed out", the
//! scheduler's filter timeout) or when cancelled, never with an answer it did not finish.
//!
//! The input defeats the bound on the search: two requests of 13 GPUs that must share a `group`
//! value, with two groups of 25. Each request alone has enough candidates, so every one of the
//! C(25, 13) = 5,200,300 choices for the first request is tried before the node is given up.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use dra_allocator::{
    AllocateError, AllocatedState, Allocator, Features, Interrupt, NodeReport, Objects, Options,
    allocate, apply_defaults,
};
use serde_json::json;

fn objects() -> Objects {
    let devices: Vec<_> = (0..50)
        .map(|d| json!({"name": format!("gpu-{d}"), "attributes": {"group": {"int": d / 25}}}))
        .collect();
    let mut objects = Objects {
        nodes: vec![serde_json::from_value(json!({"metadata": {"name": "node-a"}})).unwrap()],
        classes: vec![
            serde_json::from_value(json!({"metadata": {"name": "gpu"}, "spec": {}})).unwrap(),
        ],
        slices: vec![
            serde_json::from_value(json!({"metadata": {"name": "node-a"}, "spec": {
                "driver": "gpu.example.com", "nodeName": "node-a",
                "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
                "devices": devices}}))
            .unwrap(),
        ],
        claims: vec![
            serde_json::from_value(json!({"metadata": {"name": "c", "namespace": "default"},
                "spec": {"devices": {
                    "requests": [
                        {"name": "a", "exactly": {"deviceClassName": "gpu", "count": 13}},
                        {"name": "b", "exactly": {"deviceClassName": "gpu", "count": 13}}],
                    "constraints": [{"requests": ["a", "b"],
                        "matchAttribute": "gpu.example.com/group"}]}}}))
            .unwrap(),
        ],
    };
    apply_defaults(&mut objects);
    objects
}

#[test]
fn a_long_search_ends_at_its_deadline_as_timed_out() {
    let objects = objects();
    let started = Instant::now();
    let report = allocate(
        &objects,
        &Options {
            timeout: Duration::from_millis(200),
            ..Default::default()
        },
    );
    let elapsed = started.elapsed();
    match &report.nodes[..] {
        [NodeReport::Error { name, error }] => {
            assert_eq!(name, "node-a");
            assert_eq!(
                error, "node node-a: timed out trying to allocate devices",
                "upstream's message"
            );
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    // The deadline cannot end the search before it is due.
    assert!(elapsed >= Duration::from_millis(200), "{elapsed:?}");
}

#[test]
fn a_long_search_ends_when_cancelled() {
    let objects = objects();
    let state = AllocatedState::from_claims(&objects.claims, true).unwrap();
    let allocator =
        Allocator::new(Features::V1_36, &state, &objects.classes, &objects.slices).unwrap();
    let claims: Vec<_> = objects.claims.iter().collect();
    let cancel = AtomicBool::new(false);
    let started = Instant::now();
    let result = std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            cancel.store(true, Ordering::Relaxed);
        });
        allocator.allocate(
            &objects.nodes[0],
            &claims,
            Interrupt {
                deadline: None,
                cancel: Some(&cancel),
            },
        )
    });
    assert!(
        matches!(result, Err(AllocateError::Cancelled)),
        "{result:?}"
    );
    assert!(started.elapsed() >= Duration::from_millis(100));
}
