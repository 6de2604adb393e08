//! What [`dra_allocator::Allocation`] says about the devices it holds is what its API object
//! says: same devices in the same order, subrequests named `parent/sub`, the node selector of
//! a node-local slice.

use dra_allocator::{AllocatedState, Allocator, Features, Interrupt, Objects, apply_defaults};
use serde_json::json;

#[test]
fn an_allocations_devices_are_those_of_its_api_object() {
    let devices: Vec<_> = (0..4)
        .map(|d| json!({"name": format!("gpu-{d}"), "attributes": {"model": {"string": if d < 2 { "A100" } else { "H100" }}}}))
        .collect();
    let mut objects = Objects {
        nodes: vec![serde_json::from_value(json!({"metadata": {"name": "node-a"}})).unwrap()],
        classes: vec![
            serde_json::from_value(json!({"metadata": {"name": "gpu"}, "spec": {}})).unwrap(),
        ],
        slices: vec![
            serde_json::from_value(json!({"metadata": {"name": "node-a-gpus"}, "spec": {
                "driver": "gpu.example.com", "nodeName": "node-a",
                "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
                "devices": devices}}))
            .unwrap(),
        ],
        claims: vec![
            serde_json::from_value(json!({"metadata": {"name": "c", "namespace": "default"},
                "spec": {"devices": {"requests": [
                    {"name": "one", "exactly": {"deviceClassName": "gpu"}},
                    {"name": "pick", "firstAvailable": [
                        {"name": "b200", "deviceClassName": "gpu", "selectors": [{"cel": {"expression": "device.attributes[\"gpu.example.com\"].model == \"B200\""}}]},
                        {"name": "h100", "deviceClassName": "gpu", "count": 2, "selectors": [{"cel": {"expression": "device.attributes[\"gpu.example.com\"].model == \"H100\""}}]}]}]}}}))
            .unwrap(),
        ],
    };
    apply_defaults(&mut objects);
    let state = AllocatedState::from_claims(&objects.claims, true).unwrap();
    let allocator =
        Allocator::new(Features::V1_36, &state, &objects.classes, &objects.slices).unwrap();
    let claims: Vec<_> = objects.claims.iter().collect();
    let allocations = allocator
        .allocate(&objects.nodes[0], &claims, Interrupt::default())
        .unwrap()
        .expect("the claim fits");
    let [allocation] = allocations.as_slice() else {
        panic!("one allocation per claim: {allocations:?}");
    };
    assert_eq!(
        allocation.claim().and_then(|c| c.metadata.name.as_deref()),
        Some("c")
    );
    let devices: Vec<(String, String, String, String)> = allocation
        .devices()
        .map(|(r, d, p, n)| (r, d.to_owned(), p.to_owned(), n.to_owned()))
        .collect();
    let expected = |r: &str, n: &str| {
        (
            r.to_owned(),
            "gpu.example.com".to_owned(),
            "node-a".to_owned(),
            n.to_owned(),
        )
    };
    assert_eq!(
        devices,
        [
            expected("one", "gpu-0"),
            expected("pick/h100", "gpu-2"),
            expected("pick/h100", "gpu-3")
        ]
    );

    let api = allocation.to_api();
    let results = api
        .devices
        .as_ref()
        .and_then(|d| d.results.as_ref())
        .unwrap();
    let from_api: Vec<_> = results
        .iter()
        .map(|r| {
            (
                r.request.clone(),
                r.driver.clone(),
                r.pool.clone(),
                r.device.clone(),
            )
        })
        .collect();
    assert_eq!(from_api, devices);
    let selector = api.node_selector.expect("a node-local slice pins the node");
    let term = &selector.node_selector_terms[0];
    let field = &term.match_fields.as_ref().unwrap()[0];
    assert_eq!(
        (field.key.as_str(), field.operator.as_str()),
        ("metadata.name", "In")
    );
    assert_eq!(field.values.as_deref(), Some(&["node-a".to_owned()][..]));
}
