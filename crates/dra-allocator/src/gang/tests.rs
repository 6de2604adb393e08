use serde_json::{Value, json};

use super::*;
use crate::apply_defaults;

const DRIVER: &str = "gpu.example.com";

fn node(name: &str, labels: &[(&str, &str)]) -> Node {
    let labels: serde_json::Map<String, Value> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), json!(v)))
        .collect();
    serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap()
}

/// `n` GPUs on `node`, `big` the first `big` of them.
fn gpus(node: &str, n: usize, big: usize) -> ResourceSlice {
    let devices: Vec<Value> = (0..n)
        .map(|i| {
            json!({"name": format!("gpu-{i}"), "attributes": {
                "big": {"bool": i < big},
                "domain": {"int": i / 4},
            }})
        })
        .collect();
    serde_json::from_value(
        json!({"metadata": {"name": format!("{node}-gpus")}, "spec": {
        "driver": DRIVER, "nodeName": node,
        "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
        "devices": devices}}),
    )
    .unwrap()
}

fn class() -> k8s_openapi::api::resource::v1::DeviceClass {
    serde_json::from_value(json!({"metadata": {"name": "gpu"}, "spec": {"selectors": [
        {"cel": {"expression": format!("device.driver == \"{DRIVER}\"")}}]}}))
    .unwrap()
}

fn claim(name: &str, spec: Value) -> ResourceClaim {
    serde_json::from_value(json!({"metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": spec}}))
    .unwrap()
}

/// `count` GPUs, all on one NVLink domain when `same_domain`.
fn gpus_claim(name: &str, count: i64, same_domain: bool) -> ResourceClaim {
    let mut spec = json!({"requests": [{"name": "gpus", "exactly": {
        "deviceClassName": "gpu", "count": count}}]});
    if same_domain {
        spec["constraints"] =
            json!([{"requests": ["gpus"], "matchAttribute": format!("{DRIVER}/domain")}]);
    }
    claim(name, spec)
}

/// A claim already holding `devices` of `node`.
fn in_use(node: &str, devices: &[usize]) -> ResourceClaim {
    let requests: Vec<Value> = devices
        .iter()
        .map(|i| json!({"name": format!("r{i}"), "exactly": {"deviceClassName": "gpu"}}))
        .collect();
    let results: Vec<Value> = devices
        .iter()
        .map(|i| json!({"request": format!("r{i}"), "driver": DRIVER, "pool": node, "device": format!("gpu-{i}")}))
        .collect();
    serde_json::from_value(
        json!({"metadata": {"name": format!("in-use-{node}"), "namespace": "default"},
        "spec": {"devices": {"requests": requests}},
        "status": {"allocation": {"devices": {"results": results}}}}),
    )
    .unwrap()
}

fn defaulted(claims: Vec<ResourceClaim>) -> Vec<ResourceClaim> {
    let mut objects = Objects {
        claims,
        ..Objects::default()
    };
    apply_defaults(&mut objects);
    objects.claims
}

fn cluster(nodes: Vec<Node>, slices: Vec<ResourceSlice>, claims: Vec<ResourceClaim>) -> Objects {
    let mut objects = Objects {
        nodes,
        classes: vec![class()],
        slices,
        claims,
    };
    apply_defaults(&mut objects);
    objects
}

/// Two nodes of 8 GPUs each (two NVLink domains of 4 each).
fn two_nodes() -> Objects {
    cluster(
        vec![node("node-0", &[]), node("node-1", &[])],
        vec![gpus("node-0", 8, 0), gpus("node-1", 8, 0)],
        Vec::new(),
    )
}

/// `n` pods, each with one claim like `template`.
fn pods(n: usize, template: &ResourceClaim) -> Vec<GroupPod> {
    (1..=n)
        .map(|i| {
            let mut c = template.clone();
            c.metadata.name = Some(format!(
                "pod-{i}-{}",
                template.metadata.name.as_deref().unwrap()
            ));
            GroupPod {
                name: format!("pod-{i}"),
                claims: defaulted(vec![c]),
            }
        })
        .collect()
}

fn gang(pods: Vec<GroupPod>, min_count: usize) -> Group {
    Group {
        pods,
        shared: Vec::new(),
        min_count: Some(min_count),
        topology_key: None,
        pod_group: true,
    }
}

fn nodes_of(p: &GroupPlacement) -> Vec<&str> {
    p.placed.iter().map(|x| x.node.as_str()).collect()
}

fn codes(p: &GroupPlacement) -> Vec<&str> {
    p.flags.iter().map(|f| f.code).collect()
}

#[test]
fn a_gang_of_four_pods_of_four_gpus_fits_two_per_node_on_two_nodes_of_eight() {
    let group = gang(pods(4, &gpus_claim("four", 4, false)), 4);
    let p = place(&two_nodes(), &group, &Options::default()).unwrap();
    assert!(p.fits, "{p:#?}");
    assert_eq!(nodes_of(&p), ["node-0", "node-0", "node-1", "node-1"]);
    let mut all: Vec<&String> = p.placed.iter().flat_map(|x| &x.devices).collect();
    assert_eq!(all.len(), 16);
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 16, "no device twice");
    assert_eq!(p.placement_exists, Some(true));
    assert!(p.flags.is_empty(), "{:?}", p.flags);
}

#[test]
fn a_gang_short_of_min_count_places_nothing_and_says_which_pod_fits_nowhere() {
    let group = gang(pods(5, &gpus_claim("four", 4, false)), 5);
    let p = place(&two_nodes(), &group, &Options::default()).unwrap();
    assert!(!p.fits);
    assert!(p.placed.is_empty(), "all or nothing: {:?}", p.placed);
    let d = &p.domains[0];
    assert_eq!(
        d.placed, 4,
        "the scheduler's order got four before giving up"
    );
    let blocked = d.blocked.as_ref().expect("pod 5 is blocked");
    assert_eq!(blocked.pod, 5);
    for n in &blocked.report.nodes {
        assert!(!n.fits);
        let reason = n.reason.as_deref().unwrap();
        assert!(
            reason
                .contains("0 of 8 devices are not allocated to other claims, the request needs 4"),
            "{reason}"
        );
    }
    assert_eq!(p.placement_exists, Some(false));
    assert_eq!(d.capacity.as_ref().unwrap().pods, 4);
}

#[test]
fn fewer_pods_than_min_count_wait_for_the_rest_and_nothing_is_tried() {
    let group = gang(pods(4, &gpus_claim("four", 4, false)), 5);
    let p = place(&two_nodes(), &group, &Options::default()).unwrap();
    assert!(!p.fits && p.waiting_for_pods && p.domains.is_empty());
    assert_eq!(codes(&p), ["waitingForPods"]);
}

#[test]
fn a_gang_whose_min_count_is_met_places_the_pods_that_fit() {
    let group = gang(pods(5, &gpus_claim("four", 4, false)), 4);
    let p = place(&two_nodes(), &group, &Options::default()).unwrap();
    assert!(p.fits);
    assert_eq!(p.placed.len(), 4);
    assert_eq!(p.domains[0].blocked.as_ref().map(|b| b.pod), Some(5));
}

#[test]
fn a_job_without_gang_keeps_the_pods_that_fit() {
    let group = Group {
        pods: pods(17, &gpus_claim("one", 1, false)),
        ..Group::default()
    };
    let p = place(&two_nodes(), &group, &Options::default()).unwrap();
    assert!(!p.fits);
    assert_eq!(p.required, 17);
    assert_eq!(p.placed.len(), 16, "the first 16 stay placed");
    assert_eq!(p.domains[0].blocked.as_ref().map(|b| b.pod), Some(17));
}

/// rack-a: one node with 4 of 8 GPUs in use; rack-b: two free nodes; node-x: no label.
fn racks() -> Objects {
    cluster(
        vec![
            node("node-a0", &[("rack", "rack-a")]),
            node("node-b0", &[("rack", "rack-b")]),
            node("node-b1", &[("rack", "rack-b")]),
            node("node-x", &[]),
        ],
        vec![
            gpus("node-a0", 8, 0),
            gpus("node-b0", 8, 0),
            gpus("node-b1", 8, 0),
            gpus("node-x", 8, 0),
        ],
        vec![in_use("node-a0", &[0, 1, 2, 3])],
    )
}

#[test]
fn a_topology_key_keeps_the_gang_in_the_one_domain_with_room() {
    let mut group = gang(pods(4, &gpus_claim("four", 4, true)), 4);
    group.topology_key = Some("rack".into());
    let p = place(&racks(), &group, &Options::default()).unwrap();
    assert!(p.fits);
    assert_eq!(p.domain.as_deref(), Some("rack-b"));
    assert_eq!(nodes_of(&p), ["node-b0", "node-b0", "node-b1", "node-b1"]);
    assert_eq!(p.unlabeled_nodes, ["node-x"]);
    let a = &p.domains[0];
    assert_eq!(
        (a.name.as_deref(), a.placed, a.fits),
        (Some("rack-a"), 1, false)
    );
    assert_eq!(a.blocked.as_ref().map(|b| b.pod), Some(2));
}

#[test]
fn a_topology_key_with_no_domain_big_enough_says_why_for_each() {
    let mut group = gang(pods(5, &gpus_claim("four", 4, true)), 5);
    group.topology_key = Some("rack".into());
    let p = place(&racks(), &group, &Options::default()).unwrap();
    assert!(!p.fits && p.placed.is_empty() && p.domain.is_none());
    let summary: Vec<(Option<&str>, usize, Option<usize>)> = p
        .domains
        .iter()
        .map(|d| {
            (
                d.name.as_deref(),
                d.placed,
                d.blocked.as_ref().map(|b| b.pod),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [(Some("rack-a"), 1, Some(2)), (Some("rack-b"), 4, Some(5))]
    );
    // The unlabeled node would have held the fifth pod: it is in no domain.
    assert_eq!(p.placement_exists, Some(false));
}

/// The PodGroup's claim (one GPU) is allocated with the first pod; its node selector names
/// that node, so every pod goes there.
#[test]
fn a_pod_group_claim_bounds_every_pod_to_its_node() {
    let mut group = gang(pods(3, &gpus_claim("two", 2, false)), 3);
    group.shared = defaulted(vec![gpus_claim("group-gpu", 1, false)]);
    let p = place(&two_nodes(), &group, &Options::default()).unwrap();
    assert!(p.fits);
    assert_eq!(nodes_of(&p), ["node-0", "node-0", "node-0"]);
    assert_eq!(p.shared_claims.len(), 1);
    let selector = p.shared_claims[0]
        .allocation
        .node_selector
        .as_ref()
        .unwrap();
    assert!(serde_json::to_string(selector).unwrap().contains("node-0"));
    assert!(codes(&p).contains(&"sharedClaimNodeSelector"));

    // A fourth pod does not fit on node-0 (1 + 4 × 2 > 8) and may not go to node-1.
    let mut group = gang(pods(4, &gpus_claim("two", 2, false)), 4);
    group.shared = defaulted(vec![gpus_claim("group-gpu", 1, false)]);
    let p = place(&two_nodes(), &group, &Options::default()).unwrap();
    assert!(!p.fits);
    let blocked = p.domains[0].blocked.as_ref().unwrap();
    assert_eq!(blocked.pod, 4);
    let node1 = blocked
        .report
        .nodes
        .iter()
        .find(|n| n.name == "node-1")
        .unwrap();
    assert!(
        node1
            .reason
            .as_deref()
            .unwrap()
            .starts_with("resourceclaim not available on the node"),
        "{node1:?}"
    );
    assert_eq!(p.placement_exists, Some(false));
}

/// node-small (first in order) has 4 free GPUs, node-big 8: the group's claim goes with the
/// first pod, and where that pod lands decides.
#[test]
fn where_the_first_pod_lands_decides_for_a_group_claim_and_is_flagged() {
    let objects = cluster(
        vec![node("node-small", &[]), node("node-big", &[])],
        vec![gpus("node-small", 8, 0), gpus("node-big", 8, 0)],
        vec![in_use("node-small", &[0, 1, 2, 3])],
    );
    let mut group = gang(pods(3, &gpus_claim("two", 2, false)), 3);
    group.shared = defaulted(vec![gpus_claim("group-gpu", 1, false)]);
    let p = place(&objects, &group, &Options::default()).unwrap();
    assert!(!p.fits, "first fit takes node-small: {p:#?}");
    let first = p.domains[0].first_pod_nodes.as_ref().unwrap();
    assert_eq!(first.fits_from, ["node-big"]);
    assert_eq!(first.short_from.get("node-small"), Some(&1));
    assert_eq!(p.placement_exists, Some(true));
    let codes = codes(&p);
    assert!(codes.contains(&"dependsOnFirstNode"), "{codes:?}");
    assert!(codes.contains(&"greedyMissesPlacement"), "{codes:?}");
}

/// Each pod wants any GPU plus a big one; the first fit gives the first pod two big ones, and
/// the second finds none (kubernetes/kubernetes#138765). Chosen together, both fit.
#[test]
fn device_choices_made_pod_by_pod_can_miss_a_placement_that_exists() {
    let objects = cluster(
        vec![node("node-0", &[])],
        vec![gpus("node-0", 4, 2)],
        Vec::new(),
    );
    let template = claim(
        "any-and-big",
        json!({"requests": [
            {"name": "any", "exactly": {"deviceClassName": "gpu"}},
            {"name": "big", "exactly": {"deviceClassName": "gpu", "selectors": [
                {"cel": {"expression": format!("device.attributes[\"{DRIVER}\"].big")}}]}}]}),
    );
    let group = gang(pods(2, &template), 2);
    let p = place(&objects, &group, &Options::default()).unwrap();
    assert!(!p.fits);
    assert_eq!(p.domains[0].placed, 1);
    assert_eq!(p.placement_exists, Some(true));
    assert_eq!(
        p.domains[0].capacity.as_ref().unwrap().per_node,
        BTreeMap::from([("node-0".to_owned(), 2)])
    );
    assert!(codes(&p).contains(&"greedyMissesPlacement"));
}

#[test]
fn a_claim_already_allocated_for_the_group_bounds_the_pods_from_the_start() {
    let mut shared = gpus_claim("group-gpu", 1, false);
    shared.status = in_use("node-1", &[7]).status;
    let objects = two_nodes();
    let mut group = gang(pods(2, &gpus_claim("two", 2, false)), 2);
    group.shared = defaulted(vec![shared]);
    // The allocation has no node selector here (as written above): give it node-1's.
    let selector: k8s_openapi::api::core::v1::NodeSelector = serde_json::from_value(json!({
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-1"]}]}]
    }))
    .unwrap();
    group.shared[0]
        .status
        .as_mut()
        .and_then(|s| s.allocation.as_mut())
        .unwrap()
        .node_selector = Some(selector);
    let p = place(&objects, &group, &Options::default()).unwrap();
    assert!(p.fits);
    assert_eq!(nodes_of(&p), ["node-1", "node-1"]);
    let devices: Vec<&String> = p.placed.iter().flat_map(|x| &x.devices).collect();
    assert!(
        !devices.iter().any(|d| d.ends_with("node-1/gpu-7")),
        "the group's GPU is in use: {devices:?}"
    );
}
