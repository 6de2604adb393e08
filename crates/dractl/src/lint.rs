//! `dractl lint`: checks ResourceClaims, ResourceClaimTemplates and DeviceClasses before they
//! are applied, for one DRA driver (ours, `gpu.drust.dev`, or `gpu.nvidia.com` in NVIDIA
//! compatibility mode).
//!
//! Checks, each finding naming the file, document, object and field:
//! - `cel`: every selector compiles as the API server compiles new selectors (dra-cel's
//!   `NewExpressions` environment: syntax, types, a bool result, at most 10 KiB, an estimated
//!   cost within `CELSelectorExpressionMaxCost`; `pkg/apis/resource/validation`).
//! - `attribute`: every `device.attributes["<domain>"].<name>` and `device.capacity[...]` of this
//!   driver's domain (or `resource.kubernetes.io`) names something the driver publishes on some
//!   known topology, else the nearest published name is suggested.
//! - `config`: opaque parameters for this driver decode strictly, in our API or NVIDIA's
//!   (`gpu_kubelet_plugin::claim_config::check_parameters`).
//! - `unsatisfiable`: a claim (or a template's claim) that fits on no node of any known
//!   topology, with the allocator's reason for the closest one. Known topologies: the fake
//!   machines of `examples/topologies` (built into the binary), and a machine of 8 GPUs of each
//!   model the driver knows ([`MODELS`]: every product of its built-in MIG tables), MIG off and
//!   MIG on; each published as the plugin publishes it (existing MIG devices, partitionable
//!   placements, shares). Skipped where a request names a DeviceClass that is neither in the
//!   files nor one the chart installs for this driver, and for a claim with another finding (it
//!   fails for that first).
//! - `examples` (a warning, exit status 0): a claim that fits only a machine of a known model,
//!   none of the example machines: valid, but nothing in this repository shows it running.
//!
//! - `kueue` (warnings): for a workload queued by Kueue (a Job, JobSet, Pod, ... labelled
//!   `kueue.x-k8s.io/queue-name`), what Kueue refuses or does not check in the claims its pods
//!   use ([`crate::kueue`]): a claim named directly, `firstAvailable`, `allocationMode: All`, a
//!   DeviceClass that the Kueue Configuration given with `--kueue-config` does not map, and a
//!   claim (or its `matchAttribute` constraint) that no node of the slices given with
//!   `--slices` can satisfy. Each names the workload, the template and its field, and what to
//!   do instead.
//!
//! Other kinds in the files (Namespaces, workloads that are not queued, ...) are skipped and
//! counted.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{
    DeviceClaimConfiguration, DeviceClass, DeviceClassConfiguration, DeviceRequest, ResourceClaim,
    ResourceClaimSpec, ResourceClaimTemplate, ResourceSlice,
};
use serde::Serialize;
use serde_json::{Value, json};

use crate::objects::{InputError, Location};

/// NVIDIA's DRA driver name: compatibility mode (NVIDIA's device names and spellings).
pub const NVIDIA_DRIVER: &str = "gpu.nvidia.com";

/// The topologies every claim is checked against: the repository's fake machines.
const TOPOLOGIES: [(&str, &str); 7] = [
    (
        "dgx-a100-mig",
        include_str!("../../../examples/topologies/dgx-a100-mig.yaml"),
    ),
    (
        "dgx-h100",
        include_str!("../../../examples/topologies/dgx-h100.yaml"),
    ),
    (
        "gb200-nvl-tray",
        include_str!("../../../examples/topologies/gb200-nvl-tray.yaml"),
    ),
    (
        "mixed-a100-l4",
        include_str!("../../../examples/topologies/mixed-a100-l4.yaml"),
    ),
    (
        "paired-nvlink-bridges",
        include_str!("../../../examples/topologies/paired-nvlink-bridges.yaml"),
    ),
    (
        "pcie-a100-mig",
        include_str!("../../../examples/topologies/pcie-a100-mig.yaml"),
    ),
    (
        "pcie-l40s",
        include_str!("../../../examples/topologies/pcie-l40s.yaml"),
    ),
];

/// A GPU model as NVML reports it.
#[derive(Debug, Clone, Copy)]
pub struct Model {
    /// `nvmlDeviceGetName`.
    pub product: &'static str,
    /// `nvmlDeviceGetArchitecture`.
    pub architecture: &'static str,
    /// CUDA compute capability (major, minor).
    pub compute_capability: (u32, u32),
    /// Total memory, bytes.
    pub memory_bytes: u64,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
}

const fn model(
    product: &'static str,
    architecture: &'static str,
    compute_capability: (u32, u32),
    memory_bytes: u64,
    multiprocessors: u32,
) -> Model {
    Model {
        product,
        architecture,
        compute_capability,
        memory_bytes,
        multiprocessors,
    }
}

/// The GPU models the driver knows beyond the example machines: every product of its built-in
/// MIG tables (`gpu_inventory::mig_tables`).
pub const MODELS: [Model; 5] = [
    model(
        "NVIDIA A100-SXM4-40GB",
        "Ampere",
        (8, 0),
        42_949_672_960,
        108,
    ),
    model(
        "NVIDIA A100-PCIE-40GB",
        "Ampere",
        (8, 0),
        42_949_672_960,
        108,
    ),
    model(
        "NVIDIA A100-SXM4-80GB",
        "Ampere",
        (8, 0),
        85_899_345_920,
        108,
    ),
    model(
        "NVIDIA A100 80GB PCIe",
        "Ampere",
        (8, 0),
        85_899_345_920,
        108,
    ),
    model(
        "NVIDIA H100 80GB HBM3",
        "Hopper",
        (9, 0),
        85_520_809_984,
        132,
    ),
];

/// GPUs in each machine made of one of [`MODELS`].
const MODEL_MACHINE_GPUS: u32 = 8;

/// How much a finding matters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Severity {
    /// The object would fail or never run: exit status 1.
    Error,
    /// Worth knowing, not wrong: exit status 0.
    Warning,
}

/// One problem.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// Where: file, document (and `List` item).
    pub location: String,
    /// `Kind namespace/name`.
    pub object: String,
    /// The field path.
    pub field: String,
    /// `cel`, `attribute`, `config`, `unsatisfiable`, `decode` (errors), `examples` or
    /// `kueue` (warnings).
    pub check: &'static str,
    /// Error or warning.
    pub severity: Severity,
    /// What is wrong.
    pub message: String,
}

/// What a run found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// The driver checked for.
    pub driver: String,
    /// Objects checked.
    pub checked: usize,
    /// Documents of other kinds, skipped.
    pub skipped: usize,
    /// The problems, in input order.
    pub findings: Vec<Finding>,
}

impl Report {
    /// Whether a finding is an error (the exit status is then 1).
    pub fn failed(&self) -> bool {
        self.findings.iter().any(|f| f.severity == Severity::Error)
    }

    /// The human form: one line per finding, then a summary line.
    pub fn text(&self) -> String {
        let mut out = String::new();
        for f in &self.findings {
            let warning = if f.severity == Severity::Warning {
                "warning "
            } else {
                ""
            };
            out.push_str(&format!(
                "{} ({}): {}: {warning}[{}] {}\n",
                f.location, f.object, f.field, f.check, f.message
            ));
        }
        let warnings = self
            .findings
            .iter()
            .filter(|f| f.severity == Severity::Warning)
            .count();
        let count = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
        out.push_str(&format!(
            "{} checked for driver {} ({} skipped): {}\n",
            count(self.checked, "object"),
            self.driver,
            count(self.skipped, "other document"),
            match (self.findings.len() - warnings, warnings) {
                (0, 0) => "clean".to_owned(),
                (0, w) => count(w, "warning"),
                (e, 0) => count(e, "finding"),
                (e, w) => format!("{}, {}", count(e, "finding"), count(w, "warning")),
            }
        ));
        out
    }
}

/// What this driver publishes on the known topologies.
struct Known {
    driver: String,
    nodes: Vec<Node>,
    /// The nodes made of the example machines.
    examples: BTreeSet<String>,
    /// The nodes made of [`MODELS`], with what they are, for messages.
    models: BTreeMap<String, String>,
    slices: Vec<ResourceSlice>,
    /// (attributes or capacity, domain) -> names.
    names: BTreeMap<(&'static str, String), BTreeSet<String>>,
    /// The DeviceClasses the chart installs for this driver.
    classes: Vec<DeviceClass>,
}

impl Known {
    fn new(driver: &str) -> Result<Known, InputError> {
        let naming = if driver == NVIDIA_DRIVER {
            gpu_inventory::Naming::Nvidia
        } else {
            gpu_inventory::Naming::Drust
        };
        let mut known = Known {
            driver: driver.to_owned(),
            nodes: Vec::new(),
            examples: BTreeSet::new(),
            models: BTreeMap::new(),
            slices: Vec::new(),
            names: BTreeMap::new(),
            classes: Vec::new(),
        };
        for (name, yaml) in TOPOLOGIES {
            let topology = gpu_inventory::Topology::parse(yaml, name)
                .map_err(|e| InputError::general(format!("built-in topology {name}: {e}")))?;
            for node in known.publish(name, topology, naming)? {
                known.examples.insert(node);
            }
        }
        for (i, model) in MODELS.iter().enumerate() {
            for mig in [false, true] {
                let name = format!("model-{i}-mig-{}", if mig { "on" } else { "off" });
                let what = format!(
                    "{MODEL_MACHINE_GPUS} x {}, MIG {}",
                    model.product,
                    if mig { "on" } else { "off" }
                );
                for node in known.publish(&name, model_machine(model, mig, &name)?, naming)? {
                    known.models.insert(node, what.clone());
                }
            }
        }
        for slice in &known.slices {
            for d in slice.spec.devices.iter().flatten() {
                let mut add = |what: &'static str, key: &str| {
                    let (domain, name) = match key.rsplit_once('/') {
                        Some((domain, name)) => (domain.to_owned(), name.to_owned()),
                        None => (driver.to_owned(), key.to_owned()),
                    };
                    known.names.entry((what, domain)).or_default().insert(name);
                };
                for key in d.attributes.iter().flat_map(BTreeMap::keys) {
                    add("attributes", key);
                }
                for key in d.capacity.iter().flat_map(BTreeMap::keys) {
                    add("capacity", key);
                }
            }
        }
        let domain = driver.strip_prefix("gpu.").unwrap_or(driver);
        for (kind, class, extra) in [
            ("gpu", format!("gpu.{domain}"), ""),
            ("mig", format!("mig.{domain}"), ""),
            (
                "gpu",
                format!("gpu-share.{domain}"),
                " && device.allowMultipleAllocations",
            ),
        ] {
            let class: DeviceClass = serde_json::from_value(json!({
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceClass",
                "metadata": {"name": class},
                "spec": {"selectors": [{"cel": {"expression": format!(
                    "device.driver == \"{driver}\" && device.attributes[\"{driver}\"].type == \"{kind}\"{extra}"
                )}}]}
            }))
            .map_err(|e| InputError::general(format!("built-in DeviceClass: {e}")))?;
            known.classes.push(class);
        }
        Ok(known)
    }
}

impl Known {
    /// Publishes `topology` as the plugin would (existing MIG devices, partitionable
    /// placements, shares), one node each, named after `name`; returns the node names.
    fn publish(
        &mut self,
        name: &str,
        topology: gpu_inventory::Topology,
        naming: gpu_inventory::Naming,
    ) -> Result<Vec<String>, InputError> {
        let backend = gpu_inventory::FakeBackend::new(topology);
        let inventory = gpu_inventory::discover_with(&backend, naming)
            .map_err(|e| InputError::general(format!("built-in topology {name}: {e}")))?;
        let mut names = Vec::new();
        for (strategy, shares, node) in [
            (gpu_inventory::MigStrategy::Existing, false, name.to_owned()),
            (
                gpu_inventory::MigStrategy::Partitionable,
                false,
                format!("{name}-partitionable"),
            ),
            (
                gpu_inventory::MigStrategy::Existing,
                true,
                format!("{name}-shares"),
            ),
        ] {
            let mut pool = inventory.pool(strategy);
            if shares {
                gpu_inventory::shares::publish_shares(
                    &mut pool,
                    gpu_inventory::shares::ShareEnforcement::Mps,
                );
            }
            self.nodes.push(Node {
                metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                    name: Some(node.clone()),
                    ..Default::default()
                },
                ..Default::default()
            });
            for mut slice in gpu_inventory::slices::pool_slices(&self.driver, &node, 1, &pool) {
                slice.metadata.name = slice.metadata.generate_name.take();
                self.slices.push(slice);
            }
            names.push(node);
        }
        Ok(names)
    }
}

/// A machine of [`MODEL_MACHINE_GPUS`] GPUs of `model` ([`MODELS`]), MIG off or on (no MIG
/// device created: partitionable mode publishes every placement of the built-in table).
fn model_machine(
    model: &Model,
    mig: bool,
    name: &str,
) -> Result<gpu_inventory::Topology, InputError> {
    let (major, minor) = model.compute_capability;
    let gpus: Vec<Value> = (0..MODEL_MACHINE_GPUS)
        .map(|g| {
            json!({
                "index": g,
                "minor": g,
                "uuid": format!("GPU-00000000-0000-4000-8000-{:012x}", g),
                "name": model.product,
                "brand": "Nvidia",
                "architecture": model.architecture,
                "cudaComputeCapabilityMajor": major,
                "cudaComputeCapabilityMinor": minor,
                "memoryTotalBytes": model.memory_bytes,
                "multiprocessorCount": model.multiprocessors,
                "pciBusId": format!("00000000:{:02x}:00.0", 0x10 + g),
                "numaNode": g / 4,
                "migMode": if mig { "enabled" } else { "disabled" },
            })
        })
        .collect();
    let topology = json!({
        "system": {"driverVersion": "580.95.05", "cudaDriverVersion": 13000},
        "gpus": gpus,
    });
    gpu_inventory::Topology::parse(&topology.to_string(), name)
        .map_err(|e| InputError::general(format!("built-in model machine {name}: {e}")))
}

/// One object to check, decoded.
enum Object {
    Class(Box<DeviceClass>),
    Claim(Box<ResourceClaim>),
    Template(Box<ResourceClaimTemplate>),
}

/// What queued workloads are checked against, beyond the files themselves.
#[derive(Debug, Clone, Default)]
pub struct Context {
    /// The cluster's published slices (`--slices`): a queued job's claim that no node of them
    /// can satisfy gets a warning.
    pub cluster: Option<crate::kueue::Cluster>,
    /// Kueue's Configuration (`--kueue-config`): a queued job's DeviceClass it does not map
    /// gets a warning.
    pub kueue: Option<crate::kueue::Mappings>,
}

/// Lints `paths` (`-` for stdin) for `driver`.
///
/// # Errors
/// An unreadable file or a document that is not YAML or JSON ([`InputError`], exit status 2).
pub fn lint_files(paths: &[String], driver: &str) -> Result<Report, InputError> {
    lint_files_with(paths, driver, &Context::default())
}

/// [`lint_files`], with queued workloads checked against `context`.
///
/// # Errors
/// As [`lint_files`].
pub fn lint_files_with(
    paths: &[String],
    driver: &str,
    context: &Context,
) -> Result<Report, InputError> {
    let mut docs = Vec::new();
    for path in paths {
        docs.extend(crate::objects::documents(
            path,
            &crate::objects::read_input(path)?,
        )?);
    }
    lint_values_with(docs, driver, context)
}

/// [`lint_files`] on decoded documents.
///
/// # Errors
/// When the built-in topologies cannot be published (a defect of this build).
pub fn lint_values(docs: Vec<(Location, Value)>, driver: &str) -> Result<Report, InputError> {
    lint_values_with(docs, driver, &Context::default())
}

/// [`lint_files_with`] on decoded documents.
///
/// # Errors
/// As [`lint_values`].
pub fn lint_values_with(
    docs: Vec<(Location, Value)>,
    driver: &str,
    context: &Context,
) -> Result<Report, InputError> {
    let known = Known::new(driver)?;
    let mut queued: Vec<(Location, String, Value)> = Vec::new();
    let mut report = Report {
        driver: driver.to_owned(),
        ..Report::default()
    };
    let mut objects = Vec::new();
    for (location, value) in docs {
        let api_version = value
            .get("apiVersion")
            .and_then(Value::as_str)
            .unwrap_or("");
        let kind = value.get("kind").and_then(Value::as_str).unwrap_or("");
        let name = |v: &Value| {
            let meta = &v["metadata"];
            match meta["namespace"].as_str() {
                Some(ns) => format!("{kind} {ns}/{}", meta["name"].as_str().unwrap_or("")),
                None => format!("{kind} {}", meta["name"].as_str().unwrap_or("")),
            }
        };
        let object = name(&value);
        let decoded = match (api_version, kind) {
            ("resource.k8s.io/v1", "DeviceClass") => {
                serde_json::from_value(value).map(|c| Object::Class(Box::new(c)))
            }
            ("resource.k8s.io/v1", "ResourceClaim") => {
                serde_json::from_value(value).map(|c| Object::Claim(Box::new(c)))
            }
            ("resource.k8s.io/v1", "ResourceClaimTemplate") => {
                serde_json::from_value(value).map(|c| Object::Template(Box::new(c)))
            }
            _ => {
                if crate::kueue::queue_name(&value).is_some()
                    && !crate::kueue::pod_specs(&value).is_empty()
                {
                    report.checked += 1;
                    queued.push((location, object, value));
                } else {
                    report.skipped += 1;
                }
                continue;
            }
        };
        report.checked += 1;
        match decoded {
            Ok(o) => objects.push((location, object, o)),
            Err(e) => report.findings.push(Finding {
                location: location.to_string(),
                object,
                field: "(object)".into(),
                check: "decode",
                severity: Severity::Error,
                message: e.to_string(),
            }),
        }
    }
    let classes: Vec<DeviceClass> = objects
        .iter()
        .filter_map(|(_, _, o)| match o {
            Object::Class(c) => Some((**c).clone()),
            _ => None,
        })
        .collect();
    for (location, object, o) in &objects {
        let mut lint = Lint {
            known: &known,
            location: location.to_string(),
            object,
            findings: &mut report.findings,
        };
        match o {
            Object::Class(c) => {
                for (i, s) in c.spec.selectors.iter().flatten().enumerate() {
                    if let Some(cel) = &s.cel {
                        lint.selector(
                            &format!("spec.selectors[{i}].cel.expression"),
                            &cel.expression,
                        );
                    }
                }
                lint.class_configs(c.spec.config.as_deref().unwrap_or_default());
            }
            Object::Claim(c) => {
                let before = lint.findings.len();
                lint.claim_spec("spec", &c.spec);
                // A claim with a broken selector or config fails for that reason first.
                if lint.findings.len() == before {
                    lint.satisfiable("spec", c.as_ref().clone(), &classes);
                }
            }
            Object::Template(t) => {
                let before = lint.findings.len();
                lint.claim_spec("spec.spec", &t.spec.spec);
                if lint.findings.len() > before {
                    continue;
                }
                let claim = ResourceClaim {
                    metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                        name: t.metadata.name.clone(),
                        namespace: Some(
                            t.metadata
                                .namespace
                                .clone()
                                .unwrap_or_else(|| "default".into()),
                        ),
                        ..Default::default()
                    },
                    spec: t.spec.spec.clone(),
                    status: None,
                };
                lint.satisfiable("spec.spec", claim, &classes);
            }
        }
    }
    queued_warnings(&queued, &objects, &classes, &known, context, &mut report);
    Ok(report)
}

/// The `kueue` warnings of every queued workload, on the templates of the files that its pods
/// name.
fn queued_warnings(
    queued: &[(Location, String, Value)],
    objects: &[(Location, String, Object)],
    files: &[DeviceClass],
    known: &Known,
    context: &Context,
    report: &mut Report,
) {
    // The classes a claim may use: the files', the --slices files', the chart's.
    let mut classes: Vec<DeviceClass> = files.to_vec();
    let extra = context
        .cluster
        .iter()
        .flat_map(|c| &c.classes)
        .chain(&known.classes);
    for c in extra {
        if !classes.iter().any(|f| f.metadata.name == c.metadata.name) {
            classes.push(c.clone());
        }
    }
    for (location, object, value) in queued {
        let queue = crate::kueue::queue_name(value).unwrap_or("");
        let namespace = value["metadata"]["namespace"].as_str().unwrap_or("default");
        let mut warn = |field: String, message: String| {
            report.findings.push(Finding {
                location: location.to_string(),
                object: object.clone(),
                field,
                check: "kueue",
                severity: Severity::Warning,
                message: format!("queued in {queue}: {message}"),
            });
        };
        for (prefix, spec) in crate::kueue::pod_specs(value) {
            for (field, message) in crate::kueue::direct_claims(&prefix, spec) {
                warn(field, message);
            }
            for (field, name) in crate::kueue::template_refs(&prefix, spec) {
                let template = objects.iter().find_map(|(_, _, o)| match o {
                    Object::Template(t)
                        if t.metadata.name.as_deref() == Some(name.as_str())
                            && t.metadata.namespace.as_deref().unwrap_or("default")
                                == namespace =>
                    {
                        Some(t)
                    }
                    _ => None,
                });
                let Some(template) = template else { continue };
                for (inner, message) in crate::kueue::template_warnings(
                    template,
                    context.kueue.as_ref(),
                    context.cluster.as_ref(),
                    &classes,
                ) {
                    warn(
                        format!("{field} (ResourceClaimTemplate {namespace}/{name}: {inner})"),
                        message,
                    );
                }
            }
        }
    }
}

struct Lint<'a> {
    known: &'a Known,
    location: String,
    object: &'a str,
    findings: &'a mut Vec<Finding>,
}

impl Lint<'_> {
    fn find(&mut self, field: String, check: &'static str, message: String) {
        self.report(field, check, Severity::Error, message);
    }

    fn report(&mut self, field: String, check: &'static str, severity: Severity, message: String) {
        self.findings.push(Finding {
            location: self.location.clone(),
            object: self.object.to_owned(),
            field,
            check,
            severity,
            message,
        });
    }

    fn claim_spec(&mut self, prefix: &str, spec: &ResourceClaimSpec) {
        let Some(devices) = &spec.devices else { return };
        for (i, r) in devices.requests.iter().flatten().enumerate() {
            self.request(&format!("{prefix}.devices.requests[{i}]"), r);
        }
        for (i, c) in devices.config.iter().flatten().enumerate() {
            self.claim_config(&format!("{prefix}.devices.config[{i}]"), c);
        }
    }

    fn request(&mut self, field: &str, r: &DeviceRequest) {
        if let Some(e) = &r.exactly {
            for (j, s) in e.selectors.iter().flatten().enumerate() {
                if let Some(cel) = &s.cel {
                    self.selector(
                        &format!("{field}.exactly.selectors[{j}].cel.expression"),
                        &cel.expression,
                    );
                }
            }
        }
        for (k, sub) in r.first_available.iter().flatten().enumerate() {
            for (j, s) in sub.selectors.iter().flatten().enumerate() {
                if let Some(cel) = &s.cel {
                    self.selector(
                        &format!("{field}.firstAvailable[{k}].selectors[{j}].cel.expression"),
                        &cel.expression,
                    );
                }
            }
        }
    }

    fn claim_config(&mut self, field: &str, c: &DeviceClaimConfiguration) {
        if let Some(o) = c.opaque.as_ref().filter(|o| o.driver == self.known.driver) {
            self.parameters(&format!("{field}.opaque.parameters"), &o.parameters.0);
        }
    }

    fn class_configs(&mut self, configs: &[DeviceClassConfiguration]) {
        for (i, c) in configs.iter().enumerate() {
            if let Some(o) = c.opaque.as_ref().filter(|o| o.driver == self.known.driver) {
                self.parameters(
                    &format!("spec.config[{i}].opaque.parameters"),
                    &o.parameters.0,
                );
            }
        }
    }

    fn parameters(&mut self, field: &str, parameters: &Value) {
        if let Err(problem) = gpu_kubelet_plugin::claim_config::check_parameters(parameters) {
            let problem = problem
                .strip_prefix("opaque.parameters")
                .map_or(problem.clone(), |rest| {
                    rest.trim_start_matches(['.', ':', ' ']).to_owned()
                });
            self.find(field.to_owned(), "config", problem);
        }
    }

    fn selector(&mut self, field: &str, expression: &str) {
        let compiler =
            dra_cel::Compiler::new(dra_cel::Features::default(), dra_cel::Environment::New);
        if let Err(e) = compiler.compile(expression) {
            self.find(field.to_owned(), "cel", e.to_string());
        }
        for (what, domain, name) in referenced(expression) {
            let ours = domain == self.known.driver || domain == "resource.kubernetes.io";
            if !ours {
                continue;
            }
            let names = self.known.names.get(&(what, domain.clone()));
            if names.is_some_and(|n| n.contains(&name)) {
                continue;
            }
            let nearest = names.and_then(|n| {
                n.iter()
                    .map(|c| (strsim::levenshtein(c, &name), c))
                    .filter(|(d, _)| *d <= 3)
                    .min()
                    .map(|(_, c)| c.clone())
            });
            let what_name = if what == "attributes" {
                "attribute"
            } else {
                "capacity"
            };
            self.find(
                field.to_owned(),
                "attribute",
                match nearest {
                    Some(n) => {
                        format!("{domain} publishes no {what_name} {name:?}; did you mean {n:?}?")
                    }
                    None => format!("{domain} publishes no {what_name} {name:?}"),
                },
            );
        }
    }

    /// Whether `claim` fits on some node of the known topologies.
    fn satisfiable(&mut self, prefix: &str, mut claim: ResourceClaim, files: &[DeviceClass]) {
        let class_names: BTreeSet<String> = files
            .iter()
            .chain(&self.known.classes)
            .filter_map(|c| c.metadata.name.clone())
            .collect();
        let requests = claim
            .spec
            .devices
            .as_ref()
            .and_then(|d| d.requests.clone())
            .unwrap_or_default();
        let all_known = requests.iter().all(|r| {
            r.exactly
                .iter()
                .map(|e| &e.device_class_name)
                .chain(
                    r.first_available
                        .iter()
                        .flatten()
                        .map(|s| &s.device_class_name),
                )
                .all(|c| class_names.contains(c))
        });
        if requests.is_empty() || !all_known {
            return;
        }
        if claim.metadata.name.is_none() {
            claim.metadata.name = Some("claim".into());
        }
        let mut classes: Vec<DeviceClass> = files.to_vec();
        for c in &self.known.classes {
            if !files.iter().any(|f| f.metadata.name == c.metadata.name) {
                classes.push(c.clone());
            }
        }
        let mut objects = dra_allocator::Objects {
            nodes: self.known.nodes.clone(),
            classes,
            slices: self.known.slices.clone(),
            claims: vec![claim],
        };
        // As the API server stores them (allocationMode ExactCount, count 1, ...).
        dra_allocator::apply_defaults(&mut objects);
        let (report, refusals) =
            crate::explain::explain_objects(&objects, &dra_allocator::Options::default());
        if !report.nodes.iter().any(|n| n.fits)
            && let Some((node, reason)) = refusals.first()
        {
            self.find(
                format!("{prefix}.devices"),
                "prepare",
                format!("fits on {node} only as an allocation the driver refuses: {reason}"),
            );
            return;
        }
        let mut fits = report.nodes.iter().filter(|n| n.fits).map(|n| &n.name);
        let fits_a_model = match fits.clone().find(|n| self.known.examples.contains(*n)) {
            Some(_) => return,
            None => fits.find_map(|n| self.known.models.get(n)),
        };
        if let Some(model) = fits_a_model {
            self.report(
                format!("{prefix}.devices"),
                "examples",
                Severity::Warning,
                format!(
                    "fits none of the {} example machines of examples/topologies; it fits a \
                     machine of {model}, a model the driver knows",
                    TOPOLOGIES.len()
                ),
            );
            return;
        }
        // The closest node: the one whose requests kept the most devices where they stopped,
        // then got furthest down their funnels.
        let progress = |n: &dra_allocator::explain::NodeExplanation| {
            n.explanation.as_ref().map_or((0, 0), |e| {
                e.requests.iter().fold((0, 0), |(passed, left), r| {
                    let at = r
                        .stages
                        .iter()
                        .position(|s| Some(s.stage) == r.blocked_at)
                        .unwrap_or(r.stages.len());
                    let kept = r.stages.get(at).map_or(0, |s| s.left);
                    (left + kept, passed + at)
                })
            })
        };
        let reason = report
            .nodes
            .iter()
            .filter(|n| n.reason.is_some() || n.error.is_some())
            .max_by_key(|n| progress(n))
            .and_then(|n| {
                n.reason
                    .as_deref()
                    .or(n.error.as_deref())
                    .map(|r| format!(" (closest, {}: {r})", n.name))
            })
            .unwrap_or_default();
        self.find(
            format!("{prefix}.devices"),
            "unsatisfiable",
            format!(
                "no known topology can satisfy this claim: it fits on none of the {} fake \
                 machines of examples/topologies nor a machine of {MODEL_MACHINE_GPUS} GPUs of \
                 any of the {} models the driver knows, as the plugin publishes them (either MIG \
                 strategy, or shares){reason}",
                TOPOLOGIES.len(),
                MODELS.len()
            ),
        );
    }
}

/// The `(attributes|capacity, domain, name)` an expression reads by literal key:
/// `device.attributes["d"].name`, `device.attributes["d"]["name"]`, `device.capacity[...]`.
fn referenced(expression: &str) -> Vec<(&'static str, String, String)> {
    static PATTERN: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    let pattern = PATTERN.get_or_init(|| {
        regex::Regex::new(
            r#"device\s*\.\s*(attributes|capacity)\s*\[\s*(?:"([^"]*)"|'([^']*)')\s*\]\s*(?:\.\s*([A-Za-z_][A-Za-z0-9_]*)|\[\s*(?:"([^"]*)"|'([^']*)')\s*\])"#,
        )
        .expect("a valid pattern")
    });
    pattern
        .captures_iter(expression)
        .filter_map(|c| {
            let what = if &c[1] == "attributes" {
                "attributes"
            } else {
                "capacity"
            };
            let domain = c.get(2).or_else(|| c.get(3))?.as_str().to_owned();
            let name = c
                .get(4)
                .or_else(|| c.get(5))
                .or_else(|| c.get(6))?
                .as_str()
                .to_owned();
            Some((what, domain, name))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn referenced_names_are_read_in_both_spellings() {
        assert_eq!(
            referenced(
                r#"device.attributes["gpu.drust.dev"].prodctName == "x" && device.capacity['gpu.drust.dev']["memory"].compareTo(quantity("1Gi")) >= 0"#
            ),
            [
                (
                    "attributes",
                    "gpu.drust.dev".to_owned(),
                    "prodctName".to_owned()
                ),
                ("capacity", "gpu.drust.dev".to_owned(), "memory".to_owned()),
            ]
        );
    }

    #[test]
    fn the_known_models_are_the_mig_tables_products_and_agree_with_the_example_machines() {
        let models: BTreeSet<&str> = MODELS.iter().map(|m| m.product).collect();
        let products: BTreeSet<&str> = gpu_inventory::mig_tables::builtin_products().collect();
        assert_eq!(models, products, "a model per built-in MIG table");
        let mut compared = 0;
        for (name, yaml) in TOPOLOGIES {
            let topology = gpu_inventory::Topology::parse(yaml, name).unwrap();
            for gpu in &topology.gpus {
                let Some(m) = MODELS.iter().find(|m| m.product == gpu.name) else {
                    continue;
                };
                assert_eq!(
                    (
                        m.architecture,
                        m.compute_capability,
                        m.memory_bytes,
                        m.multiprocessors
                    ),
                    (
                        gpu.architecture.as_str(),
                        (
                            gpu.cuda_compute_capability_major,
                            gpu.cuda_compute_capability_minor
                        ),
                        gpu.memory_total_bytes,
                        gpu.multiprocessor_count
                    ),
                    "{name}: {}",
                    gpu.name
                );
                compared += 1;
            }
        }
        assert!(compared > 0);
    }
}
