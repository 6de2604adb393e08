//! `dractl lint` from the outside: every example in the repository lints clean for its driver
//! (the unsatisfiable one excepted, named as such), a file with one mistake of each kind gets
//! one finding per mistake naming the field, JSON for tools, exit codes 0 / 1 / 2.

use std::path::PathBuf;

use serde_json::Value;

mod cli;
use cli::{repo, text};

fn lint(files: &[PathBuf], extra: &[&str]) -> std::process::Output {
    cli::dractl("lint", files, extra)
}

#[test]
fn every_example_lints_clean_for_its_driver_but_the_unsatisfiable_one() {
    let mut checked = 0;
    for dir in std::fs::read_dir(repo().join("examples")).expect("examples") {
        let dir = dir.expect("entry").path();
        let name = dir
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("")
            .to_owned();
        // Cluster inputs for allocate/explain/simulate, and fake machines: not claims to lint;
        // the example driver on dra-plugin publishes no GPUs (its demo is its own driver's).
        if [
            "topologies",
            "allocate",
            "explain",
            "simulate",
            "dra-example-driver",
        ]
        .contains(&name.as_str())
            || !dir.is_dir()
        {
            continue;
        }
        let driver = if name == "nvidia-compat" {
            "gpu.nvidia.com"
        } else {
            "gpu.drust.dev"
        };
        for file in std::fs::read_dir(&dir).expect("example dir") {
            let file = file.expect("entry").path();
            if file.extension().and_then(|e| e.to_str()) != Some("yaml") {
                continue;
            }
            let out = lint(std::slice::from_ref(&file), &["--driver-name", driver]);
            let stdout = text(&out.stdout);
            if name == "unsatisfiable" {
                assert_eq!(out.status.code(), Some(1), "{}: {stdout}", file.display());
                assert!(
                    stdout.contains("[unsatisfiable] no known topology can satisfy this claim")
                        && stdout.contains("removed"),
                    "{stdout}"
                );
            } else {
                assert_eq!(
                    out.status.code(),
                    Some(0),
                    "{}: {stdout}{}",
                    file.display(),
                    text(&out.stderr)
                );
            }
            checked += 1;
        }
    }
    assert!(checked >= 15, "only {checked} example files linted");
}

const MISTAKES: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: team-a}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: typo, namespace: team-a}
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly:
            deviceClassName: gpu.drust.dev
            selectors:
              - cel: {expression: 'device.attributes["gpu.drust.dev"].prodctName == "NVIDIA H100 80GB HBM3"'}
              - cel: {expression: 'device.attributes["gpu.drust.dev"].productName =='}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: configs, namespace: team-a}
spec:
  devices:
    requests:
      - name: gpu
        exactly: {deviceClassName: gpu.drust.dev}
      - name: mig
        exactly: {deviceClassName: mig.drust.dev}
    config:
      - requests: [gpu]
        opaque:
          driver: gpu.drust.dev
          parameters:
            apiVersion: gpu.drust.dev/v1alpha1
            kind: GpuConfig
            sharing: {strategy: MPS, mps: {defaultActiveThreadPercentage: 150}}
      - requests: [mig]
        opaque:
          driver: gpu.drust.dev
          parameters:
            apiVersion: resource.nvidia.com/v1beta1
            kind: MigDeviceConfig
            sharing: {strategy: TimeSlicing, timeSlicingConfig: {interval: Long}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: sixteen, namespace: team-a}
spec:
  devices:
    requests:
      - name: gpus
        exactly: {deviceClassName: gpu.drust.dev, count: 16}
---
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: big-memory}
spec:
  selectors:
    - cel: {expression: 'device.capacity["gpu.drust.dev"].memry.compareTo(quantity("40Gi")) >= 0'}
"#;

#[test]
fn each_mistake_is_one_finding_naming_its_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("mistakes.yaml");
    std::fs::write(&file, MISTAKES).expect("write");
    let out = lint(std::slice::from_ref(&file), &["-o", "json"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    assert_eq!(report["checked"], 4);
    assert_eq!(report["skipped"], 1);
    let findings: Vec<(String, String, String, String)> = report["findings"]
        .as_array()
        .expect("findings")
        .iter()
        .map(|f| {
            let s = |k: &str| f[k].as_str().unwrap_or("").to_owned();
            (s("object"), s("field"), s("check"), s("message"))
        })
        .collect();
    let has = |object: &str, field: &str, check: &str, needle: &str| {
        assert!(
            findings
                .iter()
                .any(|(o, f, c, m)| o == object && f == field && c == check && m.contains(needle)),
            "no {check} finding on {object} {field} containing {needle:?} in {findings:#?}"
        );
    };
    let typo = "ResourceClaimTemplate team-a/typo";
    has(
        typo,
        "spec.spec.devices.requests[0].exactly.selectors[0].cel.expression",
        "attribute",
        r#"gpu.drust.dev publishes no attribute "prodctName"; did you mean "productName"?"#,
    );
    has(
        typo,
        "spec.spec.devices.requests[0].exactly.selectors[1].cel.expression",
        "cel",
        "Syntax error",
    );
    let configs = "ResourceClaim team-a/configs";
    has(
        configs,
        "spec.devices.config[0].opaque.parameters",
        "config",
        "sharing.mps.defaultActiveThreadPercentage is 150; it must be 1..=100",
    );
    has(
        configs,
        "spec.devices.config[1].opaque.parameters",
        "config",
        "sharing.timeSlicingConfig: unknown field `timeSlicingConfig`",
    );
    has(
        "ResourceClaim team-a/sixteen",
        "spec.devices",
        "unsatisfiable",
        "the request needs 16",
    );
    has(
        "DeviceClass big-memory",
        "spec.selectors[0].cel.expression",
        "attribute",
        r#"publishes no capacity "memry"; did you mean "memory"?"#,
    );
    assert_eq!(findings.len(), 6, "{findings:#?}");

    // The same as text, one line each.
    let out = lint(&[file], &[]);
    let human = text(&out.stdout);
    assert!(
        human.contains("mistakes.yaml: document 1 (ResourceClaimTemplate team-a/typo): spec.spec.devices.requests[0].exactly.selectors[0].cel.expression: [attribute]")
            && human.ends_with("4 objects checked for driver gpu.drust.dev (1 other document skipped): 6 findings\n"),
        "{human}"
    );
}

#[test]
fn nvidia_mode_knows_nvidias_names_and_unreadable_input_exits_2() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("nvidia.yaml");
    std::fs::write(
        &file,
        r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: mig, namespace: default}
spec:
  devices:
    requests:
      - name: mig
        exactly:
          deviceClassName: mig.nvidia.com
          selectors:
            - cel: {expression: "device.attributes['gpu.nvidia.com'].profile == '1g.10gb' && device.attributes['gpu.nvidia.com'].parentUUID != ''"}
"#,
    )
    .expect("write");
    let out = lint(
        std::slice::from_ref(&file),
        &["--driver-name", "gpu.nvidia.com"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
    // For our driver the same claim names a class and a domain it does not have: no
    // satisfiability verdict on an unknown class, and other drivers' attributes are theirs.
    let out = lint(&[file], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));

    let out = lint(&[dir.path().join("missing.yaml")], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("missing.yaml"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn selectors_the_api_server_would_refuse_for_length_or_cost_are_findings() {
    let dir = tempfile::tempdir().expect("tempdir");
    let long = vec!["device.driver == \"gpu.drust.dev\""; 400].join(" && ");
    assert!(long.len() > dra_cel::MAX_EXPRESSION_LENGTH);
    let costly = "device.attributes.all(d, device.attributes.all(e, device.capacity.all(f, \
                  device.attributes[d].all(g, true))))";
    for (expression, needle) in [
        (long.as_str(), "too long"),
        (costly, "too complex, exceeds cost limit"),
    ] {
        let file = dir.path().join("class.yaml");
        std::fs::write(
            &file,
            format!(
                "apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata: {{name: c}}\nspec:\n  selectors:\n    - cel: {{expression: {}}}\n",
                serde_json::to_string(expression).expect("quote")
            ),
        )
        .expect("write");
        let out = lint(&[file], &[]);
        assert_eq!(out.status.code(), Some(1));
        let stdout = text(&out.stdout);
        assert!(
            stdout.contains("spec.selectors[0].cel.expression: [cel]") && stdout.contains(needle),
            "{needle}: {stdout}"
        );
    }
}

/// A claim for MIG profiles of a model the driver knows (its built-in MIG tables) but no example
/// machine has: valid, so at most a warning (exit status 0), never "unsatisfiable". A profile
/// no model has stays an error.
#[test]
fn a_claim_for_a_known_model_no_example_machine_has_is_a_warning_not_an_error() {
    let claim = |profiles: &[&str]| {
        let requests: Vec<String> = profiles
            .iter()
            .enumerate()
            .map(|(i, p)| {
                format!(
                    "      - name: mig-{i}\n        exactly:\n          deviceClassName: mig.drust.dev\n          selectors:\n          - cel:\n              expression: device.attributes[\"gpu.drust.dev\"].profile == \"{p}\"\n"
                )
            })
            .collect();
        format!(
            "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: a100-40gb-mig\n  namespace: default\nspec:\n  devices:\n    requests:\n{}",
            requests.concat()
        )
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let known = dir.path().join("a100-40gb-mig.yaml");
    std::fs::write(&known, claim(&["1g.5gb", "2g.10gb", "3g.20gb"])).expect("write");
    let out = lint(std::slice::from_ref(&known), &[]);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", text(&out.stderr));
    assert!(
        stdout.contains("warning [examples] fits none of the 7 example machines")
            && stdout.contains("NVIDIA A100-")
            && stdout.contains("40GB, MIG on, a model the driver knows")
            && stdout.ends_with(
                "1 object checked for driver gpu.drust.dev (0 other documents skipped): 1 warning\n"
            ),
        "{stdout}"
    );
    let json = lint(std::slice::from_ref(&known), &["-o", "json"]);
    assert_eq!(json.status.code(), Some(0));
    let report: Value = serde_json::from_slice(&json.stdout).expect("JSON");
    assert_eq!(report["findings"][0]["severity"], "warning", "{report}");

    let unknown = dir.path().join("no-such-profile.yaml");
    std::fs::write(&unknown, claim(&["1g.5gb", "5g.50gb"])).expect("write");
    let out = lint(std::slice::from_ref(&unknown), &[]);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("[unsatisfiable] no known topology can satisfy this claim"),
        "{stdout}"
    );
}

/// A claim the scheduler allocates but the node plugin refuses at prepare: two shares smaller
/// than a GPU (a request with `count: 2`, or two share requests) would leave its pod waiting
/// forever. Lint names the refusal; one share, or two whole GPUs through the share class, are
/// clean.
#[test]
fn a_claim_of_two_shares_is_refused_by_name_before_a_pod_waits_for_it() {
    let claim = |requests: &str| {
        format!(
            "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: shares\n  namespace: default\nspec:\n  devices:\n    requests:\n{requests}"
        )
    };
    let request = |name: &str, count: u32, memory: Option<&str>| {
        let capacity = memory
            .map(|m| {
                format!("          capacity:\n            requests:\n              memory: {m}\n")
            })
            .unwrap_or_default();
        format!(
            "      - name: {name}\n        exactly:\n          deviceClassName: gpu-share.drust.dev\n          count: {count}\n{capacity}"
        )
    };
    let dir = tempfile::tempdir().expect("temp dir");
    for (file, requests, refused) in [
        ("count-2.yaml", request("gpu", 2, Some("20Gi")), true),
        (
            "two-requests.yaml",
            request("a", 1, Some("20Gi")) + &request("b", 1, Some("10Gi")),
            true,
        ),
        ("one-share.yaml", request("gpu", 1, Some("40Gi")), false),
        ("two-whole.yaml", request("gpu", 2, None), false),
    ] {
        let path = dir.path().join(file);
        std::fs::write(&path, claim(&requests)).expect("write");
        let out = lint(std::slice::from_ref(&path), &[]);
        let stdout = text(&out.stdout);
        if refused {
            assert_eq!(out.status.code(), Some(1), "{file}: {stdout}");
            assert!(
                stdout.contains("[prepare]")
                    && stdout.contains("2 shares smaller than a GPU in one claim")
                    && stdout.contains("prepares at most one per claim"),
                "{file}: {stdout}"
            );
        } else {
            assert_eq!(
                out.status.code(),
                Some(0),
                "{file}: {stdout}{}",
                text(&out.stderr)
            );
        }
    }
}

/// A Job queued by Kueue, with one claim of each kind Kueue refuses or does not check
/// (README "Queued jobs with Kueue"), and the same Job without the queue label.
const QUEUED: &str = r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: nvlink-four, namespace: default}
spec:
  spec:
    devices:
      requests:
        - name: gpus
          exactly: {deviceClassName: gpu.drust.dev, count: 4}
      constraints:
        - {requests: [gpus], matchAttribute: gpu.drust.dev/nvlinkDomain}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: h100-else-a100, namespace: default}
spec:
  spec:
    devices:
      requests:
        - name: gpu
          firstAvailable:
            - {name: h100, deviceClassName: gpu.drust.dev}
            - {name: a100, deviceClassName: gpu.drust.dev}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: whole-node, namespace: default}
spec:
  spec:
    devices:
      requests:
        - name: gpus
          exactly: {deviceClassName: gpu.drust.dev, allocationMode: All}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: hopper, namespace: default}
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly: {deviceClassName: hopper-or-newer.drust.dev}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: share, namespace: default}
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly:
            deviceClassName: gpu-share.drust.dev
            capacity: {requests: {memory: 20Gi}}
---
apiVersion: batch/v1
kind: Job
metadata:
  name: train
  namespace: default
  labels: {kueue.x-k8s.io/queue-name: training}
spec:
  template:
    spec:
      restartPolicy: Never
      containers: [{name: train, image: busybox}]
      resourceClaims:
        - {name: gpus, resourceClaimTemplateName: nvlink-four}
        - {name: fallback, resourceClaimTemplateName: h100-else-a100}
        - {name: all, resourceClaimTemplateName: whole-node}
        - {name: hopper, resourceClaimTemplateName: hopper}
        - {name: cache, resourceClaimName: team-cache}
        - {name: share, resourceClaimTemplateName: share}
---
apiVersion: batch/v1
kind: Job
metadata: {name: not-queued, namespace: default}
spec:
  template:
    spec:
      restartPolicy: Never
      containers: [{name: train, image: busybox}]
      resourceClaims:
        - {name: gpus, resourceClaimTemplateName: nvlink-four}
        - {name: cache, resourceClaimName: team-cache}
"#;

/// A node of four GPUs on two NVLink bridges (two per `nvlinkDomain`), as `--slices` input.
const BRIDGED_NODE: &str = r#"
apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata: {name: bridged-gpus}
spec:
  driver: gpu.drust.dev
  nodeName: bridged
  pool: {name: bridged, generation: 1, resourceSliceCount: 1}
  devices:
    - {name: gpu-0, attributes: {type: {string: gpu}, nvlinkDomain: {string: "0000:18:00.0"}}}
    - {name: gpu-1, attributes: {type: {string: gpu}, nvlinkDomain: {string: "0000:18:00.0"}}}
    - {name: gpu-2, attributes: {type: {string: gpu}, nvlinkDomain: {string: "0000:3a:00.0"}}}
    - {name: gpu-3, attributes: {type: {string: gpu}, nvlinkDomain: {string: "0000:3a:00.0"}}}
"#;

#[test]
fn a_queued_job_is_warned_of_each_claim_kueue_refuses_or_does_not_check() {
    let dir = tempfile::tempdir().unwrap();
    let jobs = dir.path().join("queued.yaml");
    std::fs::write(&jobs, QUEUED).unwrap();
    let slices = dir.path().join("slices.yaml");
    std::fs::write(&slices, BRIDGED_NODE).unwrap();
    let config = repo().join("examples/kueue/kueue-config.yaml");
    let out = lint(
        std::slice::from_ref(&jobs),
        &[
            "--slices",
            slices.to_str().unwrap(),
            "--kueue-config",
            config.to_str().unwrap(),
            "-o",
            "json",
        ],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "warnings only: {}",
        text(&out.stderr)
    );
    let json: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let kueue: Vec<(&str, &str, &str)> = json["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["check"] == "kueue")
        .map(|f| {
            assert_eq!(f["severity"], "warning");
            (
                f["object"].as_str().unwrap(),
                f["field"].as_str().unwrap(),
                f["message"].as_str().unwrap(),
            )
        })
        .collect();
    let p = "spec.template.spec.resourceClaims";
    let expected = [
        (
            format!("{p}[4].resourceClaimName"),
            "does not support use of resource claims",
        ),
        (
            format!(
                "{p}[0].resourceClaimTemplateName (ResourceClaimTemplate default/nvlink-four: spec.spec.devices.constraints[0])"
            ),
            "can satisfy matchAttribute gpu.drust.dev/nvlinkDomain for these requests",
        ),
        (
            format!(
                "{p}[1].resourceClaimTemplateName (ResourceClaimTemplate default/h100-else-a100: spec.spec.devices.requests[0].firstAvailable)"
            ),
            "FirstAvailable device selection is not supported",
        ),
        (
            format!(
                "{p}[2].resourceClaimTemplateName (ResourceClaimTemplate default/whole-node: spec.spec.devices.requests[0].exactly.allocationMode)"
            ),
            "AllocationMode 'All' is not supported",
        ),
        (
            format!(
                "{p}[3].resourceClaimTemplateName (ResourceClaimTemplate default/hopper: spec.spec.devices.requests[0].exactly.deviceClassName)"
            ),
            "DeviceClass hopper-or-newer.drust.dev is in no deviceClassMappings",
        ),
        (
            format!(
                "{p}[5].resourceClaimTemplateName (ResourceClaimTemplate default/share: spec.spec.devices.requests[0].exactly.deviceClassName)"
            ),
            "insufficient matching devices for CEL selector in DeviceClass gpu-share.drust.dev",
        ),
    ];
    assert_eq!(kueue.len(), expected.len(), "{kueue:#?}");
    for ((object, field, message), (want_field, want)) in kueue.iter().zip(&expected) {
        assert_eq!(*object, "Job default/train", "only the queued Job");
        assert_eq!(field, want_field);
        assert!(message.starts_with("queued in training: "), "{message}");
        assert!(message.contains(want), "{message}\nwant: {want}");
    }
    // The constraint's warning says what the node has and what to do.
    assert!(
        kueue[1].2.contains(r#""0000:18:00.0" has 2"#),
        "{}",
        kueue[1].2
    );
    assert!(kueue[1].2.contains("waitForPodsReady"), "{}", kueue[1].2);

    // Without --slices and --kueue-config, what Kueue refuses whatever the cluster.
    let out = lint(std::slice::from_ref(&jobs), &[]);
    assert_eq!(out.status.code(), Some(0));
    let human = text(&out.stdout);
    assert_eq!(human.matches("[kueue]").count(), 4, "{human}");
    assert!(
        human.ends_with("(1 other document skipped): 4 warnings\n"),
        "{human}"
    );

    // An unreadable Kueue configuration is bad input.
    let out = lint(
        std::slice::from_ref(&jobs),
        &["--kueue-config", slices.to_str().unwrap()],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("no Kueue Configuration"),
        "{}",
        text(&out.stderr)
    );
}
