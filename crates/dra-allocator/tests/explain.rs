//! `dra_allocator::explain` names the stage that left too few devices, with counts, the
//! selector that removed them and the attribute values of a constraint; where every request
//! fits alone, the requests that compete.

use dra_allocator::explain::{ExplainReport, Stage};
use dra_allocator::{Objects, Options, apply_defaults, explain};
use serde_json::{Value, json};

const DRIVER: &str = "gpu.example.com";

/// Node `node-a` with four GPUs (numa 0, 0, 1, 1; gpu-3 an A100, the rest H100s), `extra`
/// claims (in use or the pod's), and device fields merged in per device.
fn objects(claims: Vec<Value>, device_extra: &[(usize, Value)]) -> Objects {
    let devices: Vec<Value> = (0..4)
        .map(|d| {
            let mut device = json!({"name": format!("gpu-{d}"), "attributes": {
                "model": {"string": if d == 3 { "A100" } else { "H100" }},
                "numa": {"int": d / 2}}});
            for (i, extra) in device_extra {
                if *i == d
                    && let (Some(o), Some(e)) = (device.as_object_mut(), extra.as_object())
                {
                    o.extend(e.clone());
                }
            }
            device
        })
        .collect();
    let mut objects = Objects {
        nodes: vec![serde_json::from_value(json!({"metadata": {"name": "node-a"}})).unwrap()],
        classes: vec![
            serde_json::from_value(json!({"metadata": {"name": "gpu"}, "spec": {"selectors": [
                {"cel": {"expression": format!("device.driver == \"{DRIVER}\"")}}]}}))
            .unwrap(),
        ],
        slices: vec![
            serde_json::from_value(json!({"metadata": {"name": "node-a"}, "spec": {
                "driver": DRIVER, "nodeName": "node-a",
                "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
                "devices": devices}}))
            .unwrap(),
        ],
        claims: claims
            .into_iter()
            .map(|c| serde_json::from_value(c).unwrap())
            .collect(),
    };
    apply_defaults(&mut objects);
    objects
}

fn claim(name: &str, devices: Value) -> Value {
    json!({"metadata": {"name": name, "namespace": "default"}, "spec": {"devices": devices}})
}

fn in_use(device: &str) -> Value {
    json!({"metadata": {"name": format!("holds-{device}"), "namespace": "other"},
        "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": "gpu"}}]}},
        "status": {"allocation": {"devices": {"results": [
            {"request": "r", "driver": DRIVER, "pool": "node-a", "device": device}]}}}})
}

fn only_node(report: &ExplainReport) -> &dra_allocator::explain::Explanation {
    let node = &report.nodes[0];
    assert!(!node.fits, "{report:?}");
    node.explanation.as_ref().expect("an explanation")
}

fn left(e: &dra_allocator::explain::Explanation, request: usize) -> Vec<(Stage, usize)> {
    e.requests[request]
        .stages
        .iter()
        .map(|s| (s.stage, s.left))
        .collect()
}

#[test]
fn a_request_selector_that_matches_nothing_is_named_with_its_count() {
    let objects = objects(
        vec![claim(
            "c",
            json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu",
            "selectors": [{"cel": {"expression": "device.attributes[\"gpu.example.com\"].model == \"H200\""}}]}}]}),
        )],
        &[],
    );
    let report = explain(&objects, &Options::default());
    let e = only_node(&report);
    let f = &e.requests[0];
    assert_eq!(f.blocked_at, Some(Stage::RequestSelectors));
    assert_eq!(
        left(e, 0)[..3],
        [
            (Stage::Offered, 4),
            (Stage::ClassSelectors, 4),
            (Stage::RequestSelectors, 0)
        ]
    );
    let stage = f.stage(Stage::RequestSelectors).unwrap();
    assert_eq!(stage.selectors.len(), 1);
    assert_eq!(stage.selectors[0].removed, 4);
    assert!(stage.selectors[0].expression.contains("H200"));
    assert_eq!(
        stage.examples,
        ["node-a/gpu-0", "node-a/gpu-1", "node-a/gpu-2"]
    );
    assert!(
        e.reason.starts_with(
            "claim default/c, request gpu: 0 of 4 devices match the request's selectors"
        ),
        "{}",
        e.reason
    );
    assert_eq!(report.groups().len(), 1);
}

#[test]
fn devices_in_use_and_tainted_are_told_apart() {
    let mut claims: Vec<Value> = ["gpu-0", "gpu-1"].iter().map(|d| in_use(d)).collect();
    claims.push(claim(
        "c",
        json!({"requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu", "count": 2}}]}),
    ));
    let taint = json!({"taints": [{"key": "health", "value": "xid-79", "effect": "NoSchedule"}]});
    let objects = objects(claims, &[(2, taint)]);
    let e = only_node(&explain(&objects, &Options::default())).clone();
    let f = &e.requests[0];
    assert_eq!(f.blocked_at, Some(Stage::TaintsTolerated));
    assert_eq!(f.stage(Stage::NotInUse).unwrap().left, 2);
    assert_eq!(
        f.stage(Stage::NotInUse).unwrap().examples,
        ["node-a/gpu-0", "node-a/gpu-1"]
    );
    let taints = f.stage(Stage::TaintsTolerated).unwrap();
    assert_eq!(taints.left, 1);
    assert_eq!(taints.examples, ["node-a/gpu-2 (health=xid-79:NoSchedule)"]);
}

#[test]
fn a_match_attribute_shortage_lists_each_value_with_its_devices() {
    let objects = objects(
        vec![
            in_use("gpu-0"),
            claim(
                "pair",
                json!({"requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu", "count": 2}}],
                "constraints": [{"matchAttribute": "gpu.example.com/numa"}]}),
            ),
        ],
        &[(3, json!({"taints": [{"key": "k", "effect": "NoSchedule"}]}))],
    );
    let e = only_node(&explain(&objects, &Options::default())).clone();
    let f = &e.requests[0];
    assert_eq!(f.blocked_at, Some(Stage::Constraint));
    let values: Vec<(String, usize)> = f.constraints[0]
        .values
        .iter()
        .map(|v| (v.value.clone(), v.devices))
        .collect();
    assert_eq!(values, [("0".to_owned(), 1), ("1".to_owned(), 1)]);
    assert!(
        e.reason.contains("matchAttribute gpu.example.com/numa: 0 has 1, 1 has 1; the request needs 2 in one value"),
        "{}",
        e.reason
    );
}

#[test]
fn requests_that_fit_alone_but_not_together_are_named_as_competing() {
    let objects = objects(
        vec![
            claim(
                "a",
                json!({"requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu", "count": 2}}]}),
            ),
            claim(
                "b",
                json!({"requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu", "count": 3}}]}),
            ),
        ],
        &[],
    );
    let e = only_node(&explain(&objects, &Options::default())).clone();
    assert!(e.requests.iter().all(|f| f.blocked_at.is_none()));
    assert_eq!(e.competition.len(), 1);
    assert_eq!(
        (e.competition[0].needed, e.competition[0].available),
        (5, 4)
    );
    assert_eq!(
        e.reason,
        "every request fits alone, but not together: claim default/a, request gpus and claim default/b, request gpus need 5 devices and can use only 4"
    );
}

#[test]
fn a_node_where_the_claims_fit_has_no_explanation_and_the_same_allocation() {
    let objects = objects(
        vec![claim(
            "c",
            json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}),
        )],
        &[],
    );
    let report = explain(&objects, &Options::default());
    assert!(report.nodes[0].fits);
    assert!(report.nodes[0].explanation.is_none());
    let allocated =
        serde_json::to_value(dra_allocator::allocate(&objects, &Options::default())).unwrap();
    assert_eq!(
        serde_json::to_value(&report.nodes[0].claims).unwrap(),
        allocated["nodes"][0]["claims"]
    );
}
