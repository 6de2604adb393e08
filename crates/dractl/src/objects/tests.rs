use super::*;

const GOOD: &str = r#"
apiVersion: v1
kind: Node
metadata:
  name: node-1
---
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata:
  name: gpu.example.com
spec:
  selectors:
  - cel:
      expression: device.driver == "gpu.example.com"
---
apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata:
  name: node-1-gpus
spec:
  driver: gpu.example.com
  nodeName: node-1
  pool: {name: node-1, generation: 1, resourceSliceCount: 1}
  devices:
  - name: gpu-0
    attributes:
      model: {string: A100}
      gpu.example.com/ver: {version: 1.2.3}
    capacity:
      memory: {value: 40Gi}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata:
  name: c1
spec:
  devices:
    requests:
    - name: gpu
      exactly:
        deviceClassName: gpu.example.com
"#;

fn read(text: &str) -> Result<Inputs, InputError> {
    let mut r = Reader::new();
    r.read_str("in.yaml", text)?;
    Ok(r.finish())
}

fn read_err(text: &str) -> String {
    match read(text) {
        Ok(_) => panic!("accepted:\n{text}"),
        Err(e) => e.to_string(),
    }
}

/// GOOD with one line replaced (the first occurrence of `from`).
fn good_with(from: &str, to: &str) -> String {
    assert!(GOOD.contains(from), "{from}");
    GOOD.replacen(from, to, 1)
}

#[test]
fn a_yaml_stream_of_all_kinds_is_read_in_order() {
    let inputs = read(GOOD).unwrap();
    assert_eq!(inputs.nodes.len(), 1);
    assert_eq!(inputs.classes.len(), 1);
    assert_eq!(inputs.slices.len(), 1);
    assert_eq!(inputs.claims.len(), 1);
    // A claim without a namespace lands in "default".
    assert_eq!(
        inputs.claims[0].metadata.namespace.as_deref(),
        Some("default")
    );
}

#[test]
fn json_streams_and_lists_are_read() {
    let json = r#"{"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "a"}},
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "b"}}]}
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "c"}}"#;
    let inputs = read(json).unwrap();
    let names: Vec<_> = inputs
        .nodes
        .iter()
        .map(|n| n.metadata.name.clone().unwrap())
        .collect();
    assert_eq!(names, ["a", "b", "c"]);

    let e = read_err(
        r#"{"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "a"}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "b"}}]}"#,
    );
    assert!(
        e.starts_with("in.yaml: document 0, item 1: unsupported kind Pod"),
        "{e}"
    );
}

#[test]
fn errors_name_file_document_object_and_field() {
    let e = read_err(&good_with("- name: gpu-0", "- name: GPU_0"));
    assert!(
        e.starts_with(
            "in.yaml: document 2 (ResourceSlice \"node-1-gpus\"): invalid: spec.devices[0].name: Invalid value: \"GPU_0\""
        ),
        "{e}"
    );
    let e = read_err(&good_with(
        "deviceClassName: gpu.example.com",
        "deviceClasName: x",
    ));
    assert!(
        e.contains("document 3 (ResourceClaim default/c1)") && e.contains("deviceClasName"),
        "{e}"
    );
}

#[test]
fn strict_decoding_refuses_unknown_and_duplicate_fields() {
    let e = read_err(&good_with(
        "model: {string: A100}",
        "model: {string: A100, sting: x}",
    ));
    assert!(
        e.contains(r#"unknown field "spec.devices[0].attributes.model.sting""#),
        "{e}"
    );
    let e = read_err(&good_with(
        "  nodeName: node-1",
        "  nodeName: node-1\n  nodeName: node-2",
    ));
    assert!(
        e.contains("document 2") && e.contains("duplicate field"),
        "{e}"
    );
    let e = read_err("apiVersion: v1\nkind: Node\nmetadata: {name: a}\nspec: {podCIDRz: x}\n");
    assert!(e.contains(r#"unknown field "spec.podCIDRz""#), "{e}");
}

#[test]
fn bad_yaml_unknown_kinds_versions_and_duplicates_are_refused() {
    let e = read_err("apiVersion: v1\nkind: Node\nmetadata: {name: [}\n");
    assert!(e.starts_with("in.yaml: document 0: parsing YAML"), "{e}");
    let e = read_err("apiVersion: v1\nkind: Pod\nmetadata: {name: a}\n");
    assert!(e.contains("unsupported kind Pod"), "{e}");
    let e =
        read_err("apiVersion: resource.k8s.io/v1beta1\nkind: DeviceClass\nmetadata: {name: a}\n");
    assert!(
        e.contains("unsupported version resource.k8s.io/v1beta1"),
        "{e}"
    );
    let e = read_err(&format!(
        "{GOOD}\n---\napiVersion: v1\nkind: Node\nmetadata:\n  name: node-1\n"
    ));
    assert!(
        e.contains("document 4 (Node \"node-1\"): duplicate object"),
        "{e}"
    );
    let e = read_err("kind: Node\nmetadata: {name: a}\n");
    assert!(e.contains("apiVersion"), "{e}");
}

#[test]
fn slice_rules() {
    for (from, to, want) in [
        (
            "  nodeName: node-1",
            "  allNodes: true\n  nodeName: node-1",
            "but multiple fields are set",
        ),
        (
            "  nodeName: node-1",
            "  nodeName: \"\"",
            "must be either unset or set to a non-empty string",
        ),
        (
            "resourceSliceCount: 1",
            "resourceSliceCount: 0",
            "spec.pool.resourceSliceCount",
        ),
        ("generation: 1", "generation: -1", "spec.pool.generation"),
        (
            "  driver: gpu.example.com",
            "  driver: Gpu_Example",
            "spec.driver",
        ),
        ("{version: 1.2.3}", "{version: v1.2.3}", "semver"),
        (
            "{string: A100}",
            "{string: A100, int: 3}",
            "exactly one value must be specified",
        ),
        (
            "{string: A100}",
            "{strings: [A100]}",
            "exactly one value must be specified",
        ),
        ("      model:", "      model-x:", "C identifier"),
        (
            "      gpu.example.com/ver:",
            "      /ver:",
            "the domain must not be empty",
        ),
        (
            "{value: 40Gi}",
            "{value: 40Gi, requestPolicy: {default: 1Gi}}",
            "allowMultipleAllocations must be true",
        ),
        ("{value: 40Gi}", "{value: 40Gx}", "quantities must match"),
        (
            "    capacity:",
            "    taints: [{key: k, effect: Sometimes}]\n    capacity:",
            "Unsupported value: \"Sometimes\"",
        ),
        (
            "    capacity:",
            "    bindingConditions: [ready]\n    capacity:",
            "bindingFailureConditions are required",
        ),
        (
            "    capacity:",
            "    nodeName: node-1\n    capacity:",
            "can only be set if `perDeviceNodeSelection`",
        ),
        (
            "    capacity:",
            "    consumesCounters: [{counterSet: a, counters: {}}]\n    capacity:",
            "consumesCounters[0].counters: Required value",
        ),
    ] {
        let e = read_err(&good_with(from, to));
        assert!(e.contains(want), "{from} -> {to}: {e}");
    }
}

fn slice_with_devices(n: usize, extra: &str) -> String {
    let mut s = String::from(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {name: s}\nspec:\n  driver: d.example.com\n  allNodes: true\n  pool: {name: p, generation: 0, resourceSliceCount: 1}\n  devices:\n",
    );
    for i in 0..n {
        s.push_str(&format!("  - name: d{i}\n{extra}"));
    }
    s
}

#[test]
fn slice_limits() {
    read(&slice_with_devices(128, "")).unwrap();
    let e = read_err(&slice_with_devices(129, ""));
    assert!(
        e.contains("spec.devices: Too many: 129: must have at most 128 items"),
        "{e}"
    );
    let taint = "    taints: [{key: k, effect: NoSchedule}]\n";
    read(&slice_with_devices(64, taint)).unwrap();
    let e = read_err(&slice_with_devices(65, taint));
    assert!(e.contains("must have at most 64 items"), "{e}");

    let mut attrs = String::from("    attributes:\n");
    for i in 0..33 {
        attrs.push_str(&format!("      a{i}: {{int: {i}}}\n"));
    }
    let e = read_err(&slice_with_devices(1, &attrs));
    assert!(
        e.contains("the total number of attributes and capacities must not exceed 32"),
        "{e}"
    );

    let e = read_err(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {name: s}\nspec:\n  driver: d.example.com\n  allNodes: true\n  pool: {name: p, generation: 0, resourceSliceCount: 1}\n  sharedCounters: [{name: c, counters: {mem: {value: 1Gi}}}]\n  devices: []\n",
    );
    assert!(
        e.contains("only one of `sharedCounters` or `devices`"),
        "{e}"
    );
}

#[test]
fn request_policy_rules() {
    let dev = |policy: &str| {
        slice_with_devices(
            1,
            &format!(
                "    allowMultipleAllocations: true\n    capacity:\n      mem: {{value: 10Gi, requestPolicy: {policy}}}\n"
            ),
        )
    };
    read(&dev(
        "{default: 1Gi, validRange: {min: 1Gi, step: 1Gi, max: 8Gi}}",
    ))
    .unwrap();
    read(&dev("{default: 2Gi, validValues: [1Gi, 2Gi, 4Gi]}")).unwrap();
    for (policy, want) in [
        (
            "{default: 3Gi, validValues: [1Gi, 2Gi]}",
            "default value is not valid",
        ),
        (
            "{default: 1Gi, validValues: [2Gi, 1Gi]}",
            "sorted in ascending order",
        ),
        (
            "{default: 1Gi, validValues: [1Gi, 20Gi]}",
            "option is larger than capacity value",
        ),
        (
            "{validValues: [1Gi]}",
            "required when validValues is defined",
        ),
        (
            "{default: 1Gi, validValues: [1Gi], validRange: {min: 1Gi}}",
            "exactly one policy",
        ),
        (
            "{default: 512Mi, validRange: {min: 1Gi}}",
            "default is less than min",
        ),
        (
            "{default: 1Gi, validRange: {min: 1Gi, max: 20Gi}}",
            "max is larger than capacity value",
        ),
        (
            "{default: 1536Mi, validRange: {min: 1Gi, step: 1Gi}}",
            "not a multiple of a given step",
        ),
    ] {
        let e = read_err(&dev(policy));
        assert!(e.contains(want), "{policy}: {e}");
    }
}

#[test]
fn class_and_claim_rules() {
    for (from, to, want) in [
        (
            "expression: device.driver == \"gpu.example.com\"",
            "expression: device.driver ==",
            "spec.selectors[0].cel.expression: Invalid value",
        ),
        (
            "expression: device.driver == \"gpu.example.com\"",
            "expression: device.nosuch",
            "compilation failed",
        ),
        (
            "  name: gpu.example.com\nspec:",
            "  name: Gpu\nspec:",
            "metadata.name",
        ),
        (
            "    - name: gpu\n",
            "    - name: Gpu\n",
            "spec.devices.requests[0].name",
        ),
        (
            "        deviceClassName: gpu.example.com\n",
            "        deviceClassName: gpu.example.com\n        allocationMode: All\n        count: 2\n",
            "must not be specified when allocationMode is 'All'",
        ),
        (
            "        deviceClassName: gpu.example.com\n",
            "        deviceClassName: gpu.example.com\n        allocationMode: Some\n",
            "Unsupported value: \"Some\"",
        ),
        (
            "        deviceClassName: gpu.example.com\n",
            "        deviceClassName: gpu.example.com\n        tolerations: [{operator: Exists, value: x}]\n",
            "must be empty for operator `Exists`",
        ),
        (
            "        deviceClassName: gpu.example.com\n",
            "        deviceClassName: gpu.example.com\n    constraints: [{requests: [nosuch], matchAttribute: example.com/x}]\n",
            "spec.devices.constraints[0].requests[0]: Invalid value: \"nosuch\"",
        ),
        (
            "        deviceClassName: gpu.example.com\n",
            "        deviceClassName: gpu.example.com\n    constraints: [{matchAttribute: model}]\n",
            "a fully qualified name must be a domain and a name",
        ),
        (
            "        deviceClassName: gpu.example.com\n",
            "        deviceClassName: gpu.example.com\n    constraints: [{}]\n",
            "exactly one of \"matchAttribute\" or \"distinctAttribute\"",
        ),
        (
            "      exactly:\n        deviceClassName: gpu.example.com\n",
            "      firstAvailable: [{name: a, deviceClassName: x}, {name: a, deviceClassName: x}]\n",
            "firstAvailable[1]: Duplicate value",
        ),
        (
            "      exactly:\n        deviceClassName: gpu.example.com\n",
            "      exactly: {deviceClassName: x}\n      firstAvailable: [{name: a, deviceClassName: x}]\n",
            "but multiple fields are set",
        ),
    ] {
        let e = read_err(&good_with(from, to));
        assert!(e.contains(want), "{to}: {e}");
    }
}

#[test]
fn claim_status_rules() {
    let claim = |status: &str| {
        format!(
            "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: c, namespace: ns}}\nspec:\n  devices:\n    requests: [{{name: gpu, exactly: {{deviceClassName: gpu.example.com}}}}]\nstatus:\n{status}"
        )
    };
    read(&claim("  allocation:\n    devices:\n      results: [{request: gpu, driver: d.example.com, pool: p, device: d0}]\n  reservedFor: [{resource: pods, name: p, uid: u1}]\n")).unwrap();
    for (status, want) in [
        (
            "  reservedFor: [{resource: pods, name: p, uid: u1}]\n",
            "may not be specified when `allocated` is not set",
        ),
        (
            "  allocation:\n    devices:\n      results: [{request: nosuch, driver: d.example.com, pool: p, device: d0}]\n",
            "results[0].request",
        ),
        (
            "  allocation:\n    devices:\n      results: [{request: gpu, driver: d.example.com, pool: p, device: d0, shareID: X}]\n",
            "RFC 4122",
        ),
    ] {
        let e = read_err(&claim(status));
        assert!(e.contains(want), "{status}: {e}");
    }
}
