//! API validation of DeviceClasses, ResourceSlices and ResourceClaims on create: the rules of
//! upstream `pkg/apis/resource/validation/validation.go` (k8s.io/kubernetes v1.36.3, the
//! handwritten validation the API server runs), with the object-metadata and node-selector rules
//! of `pkg/apis/core/validation` that it calls, and the registry strategies' `PrepareForCreate`
//! field dropping for the feature gates that are off by default in v1.36
//! (`DRAListTypeAttributes`, `DRANodeAllocatableResources`).
//!
//! Validation sees objects before or after the API server's defaulting (`dra_allocator::apply_defaults`):
//! an unset `allocationMode` counts as `ExactCount`, a zero count with `ExactCount` as 1 and an
//! unset toleration operator as `Equal`, exactly as defaulting would set them.
//!
//! Not mirrored: `metadata` rules beyond names, namespaces, labels and annotations (owner
//! references, finalizers, managed fields), the admin-access namespace check (an admission
//! step, not validation) and status `devices[].conditions`/`networkData` details.

use std::collections::{BTreeMap, HashSet};
use std::fmt;

use dra_cel::libs::quantity::Quantity as Q;
use dra_cel::{CompileError, Compiler, Environment, Features};
use k8s_openapi::api::core::v1::NodeSelector;
use k8s_openapi::api::resource::v1 as r;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::names;

/// One validation problem: the field path and what is wrong with it, worded like apimachinery's
/// `field.Error` (`spec.devices[0].name: Invalid value: "GPU": ...`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// The field, e.g. `spec.devices[3].attributes[model]`.
    pub path: String,
    /// The problem, e.g. `Required value`.
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

type Errs = Vec<FieldError>;

fn err(path: &str, message: String) -> FieldError {
    FieldError {
        path: path.to_owned(),
        message,
    }
}
fn required(path: &str, detail: &str) -> FieldError {
    if detail.is_empty() {
        err(path, "Required value".into())
    } else {
        err(path, format!("Required value: {detail}"))
    }
}
fn invalid(path: &str, value: impl fmt::Debug, detail: &str) -> FieldError {
    err(path, format!("Invalid value: {value:?}: {detail}"))
}
fn too_many(path: &str, actual: usize, max: usize) -> FieldError {
    err(
        path,
        format!("Too many: {actual}: must have at most {max} items"),
    )
}
fn too_long(path: &str, max: usize) -> FieldError {
    err(path, format!("Too long: may not be more than {max} bytes"))
}
fn duplicate(path: &str, value: impl fmt::Debug) -> FieldError {
    err(path, format!("Duplicate value: {value:?}"))
}
fn forbidden(path: &str, detail: &str) -> FieldError {
    err(path, format!("Forbidden: {detail}"))
}
fn not_supported(path: &str, value: &str, supported: &[&str]) -> FieldError {
    let list: Vec<String> = supported.iter().map(|s| format!("{s:?}")).collect();
    err(
        path,
        format!(
            "Unsupported value: {value:?}: supported values: {}",
            list.join(", ")
        ),
    )
}

fn each_msg(path: &str, value: &str, msgs: Vec<String>, out: &mut Errs) {
    for m in msgs {
        out.push(invalid(path, value, &m));
    }
}

// Limits from pkg/apis/resource/types.go (v1.36.3).
const RESOURCE_SLICE_MAX_DEVICES: usize = 128;
const RESOURCE_SLICE_MAX_DEVICES_WITH_ADVANCED_FEATURES: usize = 64;
const RESOURCE_SLICE_MAX_COUNTER_SETS: usize = 8;
const MAX_COUNTERS_PER_COUNTER_SET: usize = 32;
const MAX_COUNTER_CONSUMPTIONS_PER_DEVICE: usize = 2;
const MAX_COUNTERS_PER_CONSUMPTION: usize = 32;
const MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE: usize = 32;
const MAX_ATTRIBUTE_VALUES_PER_DEVICE: usize = 48;
const DEVICE_MAX_DOMAIN_LENGTH: usize = 63;
const DEVICE_MAX_ID_LENGTH: usize = 32;
const DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH: usize = 64;
const DEVICE_TAINTS_MAX: usize = 16;
const BINDING_CONDITIONS_MAX: usize = 4;
const CAPACITY_VALID_VALUES_MAX: usize = 10;
const DEVICE_REQUESTS_MAX: usize = 32;
const DEVICE_CONSTRAINTS_MAX: usize = 32;
const DEVICE_CONFIG_MAX: usize = 32;
const DEVICE_SELECTORS_MAX: usize = 32;
const FIRST_AVAILABLE_MAX: usize = 8;
const CEL_EXPRESSION_MAX_LENGTH: usize = 10 * 1024;
const OPAQUE_PARAMETERS_MAX_LENGTH: usize = 10 * 1024;
const RESERVED_FOR_MAX: usize = 256;
const ALLOCATION_RESULTS_MAX: usize = 32;
const POOL_NAME_MAX_LENGTH: usize = 253;
const DRIVER_NAME_MAX_LENGTH: usize = 63;
const TOTAL_ANNOTATION_SIZE_LIMIT: usize = 256 * 1024;

const TAINT_EFFECTS: [&str; 3] = ["NoExecute", "NoSchedule", "None"];

// ---------------------------------------------------------------------------------------------
// Shared pieces.

/// `corevalidation.ValidateCSIDriverName`: what driver names (and attribute domains) must be.
fn driver_name(name: &str, path: &str, out: &mut Errs) {
    if name.is_empty() {
        out.push(required(path, ""));
        return;
    }
    if name.len() > DRIVER_NAME_MAX_LENGTH {
        out.push(too_long(path, DRIVER_NAME_MAX_LENGTH));
    }
    each_msg(
        path,
        name,
        names::dns1123_subdomain(&name.to_lowercase()),
        out,
    );
}

/// validation.go `validatePoolName`.
fn pool_name(name: &str, path: &str, out: &mut Errs) {
    if name.is_empty() {
        out.push(required(path, ""));
        return;
    }
    if name.len() > POOL_NAME_MAX_LENGTH {
        out.push(too_long(path, POOL_NAME_MAX_LENGTH));
    }
    for part in name.split('/') {
        each_msg(path, part, names::dns1123_subdomain(part), out);
    }
}

fn dns_label(name: &str, path: &str, out: &mut Errs) {
    each_msg(path, name, names::dns1123_label(name), out);
}

fn dns_subdomain(name: &str, path: &str, out: &mut Errs) {
    each_msg(path, name, names::dns1123_subdomain(name), out);
}

/// `metav1validation.ValidateLabelName`.
fn label_name(name: &str, path: &str, out: &mut Errs) {
    each_msg(path, name, names::qualified_name(name), out);
}

fn label_value(value: &str, path: &str, out: &mut Errs) {
    each_msg(path, value, names::label_value(value), out);
}

/// Parses a quantity as the API server's decoder does (an unparseable one fails decoding).
fn quantity(q: &Quantity, path: &str, out: &mut Errs) -> Option<Q> {
    match Q::parse(&q.0) {
        Ok(v) => Some(v),
        Err(e) => {
            out.push(invalid(path, &q.0, &e.to_string()));
            None
        }
    }
}

/// `Quantity.Value()`: the value rounded up to an integer (saturating).
fn quantity_value(q: &Q) -> i64 {
    if let Some(v) = q.as_i64() {
        return v;
    }
    let f = q.as_f64().ceil();
    if f >= i64::MAX as f64 {
        i64::MAX
    } else if f <= i64::MIN as f64 {
        i64::MIN
    } else {
        f as i64
    }
}

/// `corevalidation.ValidateObjectMeta` for what matters offline: the name (format per kind),
/// the namespace (required for namespaced kinds, forbidden otherwise), labels and annotations.
fn object_meta(
    meta: &ObjectMeta,
    namespaced: bool,
    name_rule: fn(&str) -> Vec<String>,
    out: &mut Errs,
) {
    let name = meta.name.as_deref().unwrap_or("");
    if name.is_empty() {
        if meta.generate_name.as_deref().unwrap_or("").is_empty() {
            out.push(required(
                "metadata.name",
                "name or generateName is required",
            ));
        } else {
            out.push(required(
                "metadata.name",
                "generateName is not supported offline: give the object a name",
            ));
        }
    } else {
        each_msg("metadata.name", name, name_rule(name), out);
    }
    let namespace = meta.namespace.as_deref().unwrap_or("");
    if namespaced {
        if namespace.is_empty() {
            out.push(required("metadata.namespace", ""));
        } else {
            dns_label(namespace, "metadata.namespace", out);
        }
    } else if !namespace.is_empty() {
        out.push(forbidden("metadata.namespace", "not allowed on this type"));
    }
    for (k, v) in meta.labels.iter().flatten() {
        label_name(k, "metadata.labels", out);
        label_value(v, &format!("metadata.labels[{k}]"), out);
    }
    let mut total = 0usize;
    for (k, v) in meta.annotations.iter().flatten() {
        each_msg(
            "metadata.annotations",
            k,
            names::qualified_name(&k.to_lowercase()),
            out,
        );
        total += k.len() + v.len();
    }
    if total > TOTAL_ANNOTATION_SIZE_LIMIT {
        out.push(too_long(
            "metadata.annotations",
            TOTAL_ANNOTATION_SIZE_LIMIT,
        ));
    }
}

/// `corevalidation.ValidateNodeSelector` (label values must be valid).
fn node_selector(sel: &NodeSelector, path: &str, out: &mut Errs) {
    let terms_path = format!("{path}.nodeSelectorTerms");
    if sel.node_selector_terms.is_empty() {
        out.push(required(
            &terms_path,
            "must have at least one node selector term",
        ));
        return;
    }
    for (i, term) in sel.node_selector_terms.iter().enumerate() {
        let tp = format!("{terms_path}[{i}]");
        for (j, req) in term.match_expressions.iter().flatten().enumerate() {
            let rp = format!("{tp}.matchExpressions[{j}]");
            let values = req.values.as_deref().unwrap_or(&[]);
            match req.operator.as_str() {
                "In" | "NotIn" if values.is_empty() => out.push(required(
                    &format!("{rp}.values"),
                    "must be specified when `operator` is 'In' or 'NotIn'",
                )),
                "Exists" | "DoesNotExist" if !values.is_empty() => out.push(forbidden(
                    &format!("{rp}.values"),
                    "may not be specified when `operator` is 'Exists' or 'DoesNotExist'",
                )),
                "Gt" | "Lt" if values.len() != 1 => out.push(required(
                    &format!("{rp}.values"),
                    "must be specified single value when `operator` is 'Lt' or 'Gt'",
                )),
                "In" | "NotIn" | "Exists" | "DoesNotExist" | "Gt" | "Lt" => {}
                other => out.push(invalid(
                    &format!("{rp}.operator"),
                    other,
                    "not a valid selector operator",
                )),
            }
            label_name(&req.key, &format!("{rp}.key"), out);
            for (k, v) in values.iter().enumerate() {
                label_value(v, &format!("{rp}.values[{k}]"), out);
            }
        }
        for (j, req) in term.match_fields.iter().flatten().enumerate() {
            let rp = format!("{tp}.matchFields[{j}]");
            let values = req.values.as_deref().unwrap_or(&[]);
            match req.operator.as_str() {
                "In" | "NotIn" => {
                    if values.len() != 1 {
                        out.push(required(
                            &format!("{rp}.values"),
                            "must be only one value when `operator` is 'In' or 'NotIn' for node field selector",
                        ));
                    }
                }
                other => out.push(invalid(
                    &format!("{rp}.operator"),
                    other,
                    "not a valid selector operator",
                )),
            }
            if req.key == "metadata.name" {
                for (k, v) in values.iter().enumerate() {
                    dns_subdomain(v, &format!("{rp}.values[{k}]"), out);
                }
            } else {
                out.push(invalid(
                    &format!("{rp}.key"),
                    &req.key,
                    "not a valid field selector key",
                ));
            }
        }
    }
}

/// validation.go `validateQualifiedName`: a C identifier, or `domain/ID`.
fn qualified_name(name: &str, path: &str, out: &mut Errs) {
    let parts: Vec<&str> = name.split('/').collect();
    match parts.as_slice() {
        [id] => c_identifier(id, path, out),
        [domain, id, ..] => {
            if domain.is_empty() {
                out.push(invalid(path, "", "the domain must not be empty"));
            } else {
                driver_name(domain, path, out);
            }
            if id.is_empty() {
                out.push(invalid(path, "", "the name must not be empty"));
            } else {
                c_identifier(id, path, out);
            }
            // Upstream ignores parts after a second '/' (a known gap); so do we.
        }
        [] => {}
    }
}

fn c_identifier(id: &str, path: &str, out: &mut Errs) {
    if id.len() > DEVICE_MAX_ID_LENGTH {
        out.push(too_long(path, DEVICE_MAX_ID_LENGTH));
    }
    each_msg(path, id, names::c_identifier(id), out);
}

/// validation.go `validateFullyQualifiedName`: a qualified name with a domain.
fn fully_qualified_name(name: &str, path: &str, out: &mut Errs) {
    qualified_name(name, path, out);
    if !name.contains('/') {
        out.push(invalid(
            path,
            name,
            "a fully qualified name must be a domain and a name separated by a slash",
        ));
    }
}

/// `validateSet`'s size check and duplicates: true when the size is within the limit (the caller
/// then validates the items; over the limit nothing else is checked, as upstream).
fn set_keys<'a>(
    keys: impl ExactSizeIterator<Item = &'a str>,
    max: Option<usize>,
    path: &str,
    out: &mut Errs,
) -> bool {
    let len = keys.len();
    if let Some(max) = max
        && len > max
    {
        out.push(too_many(path, len, max));
        return false;
    }
    let mut seen = HashSet::new();
    for (i, k) in keys.enumerate() {
        if !seen.insert(k) {
            out.push(duplicate(&format!("{path}[{i}]"), k));
        }
    }
    true
}

fn within(len: usize, max: usize, path: &str, out: &mut Errs) -> bool {
    if len > max {
        out.push(too_many(path, len, max));
        false
    } else {
        true
    }
}

fn selectors(list: Option<&Vec<r::DeviceSelector>>, path: &str, out: &mut Errs) {
    let list = list.map(Vec::as_slice).unwrap_or(&[]);
    if !within(list.len(), DEVICE_SELECTORS_MAX, path, out) {
        return;
    }
    for (i, s) in list.iter().enumerate() {
        let p = format!("{path}[{i}].cel");
        match &s.cel {
            None => out.push(required(&p, "")),
            Some(cel) => cel_selector(&cel.expression, &format!("{p}.expression"), out),
        }
    }
}

/// validation.go `validateCELSelector` for new expressions: length, compile errors, cost.
fn cel_selector(expression: &str, path: &str, out: &mut Errs) {
    if expression.len() > CEL_EXPRESSION_MAX_LENGTH {
        out.push(too_long(path, CEL_EXPRESSION_MAX_LENGTH));
        return;
    }
    let compiler = Compiler::new(Features::default(), Environment::New);
    match compiler.compile(expression) {
        Ok(_) => {}
        Err(CompileError::Cost { .. }) => {
            out.push(forbidden(path, "too complex, exceeds cost limit"));
        }
        Err(CompileError::TooLong { .. }) => out.push(too_long(path, CEL_EXPRESSION_MAX_LENGTH)),
        Err(e) => out.push(invalid(
            path,
            expression,
            &format!("compilation failed: {e}"),
        )),
    }
}

/// validation.go `validateOpaqueConfiguration` / `validateRawExtension` (new objects).
fn opaque(config: Option<&r::OpaqueDeviceConfiguration>, path: &str, out: &mut Errs) {
    let p = format!("{path}.opaque");
    let Some(config) = config else {
        out.push(required(&p, ""));
        return;
    };
    driver_name(&config.driver, &format!("{p}.driver"), out);
    let pp = format!("{p}.parameters");
    let raw = &config.parameters.0;
    if raw.is_null() {
        out.push(required(&pp, ""));
        return;
    }
    let len = serde_json::to_string(raw).map(|s| s.len()).unwrap_or(0);
    if len > OPAQUE_PARAMETERS_MAX_LENGTH {
        out.push(too_long(&pp, OPAQUE_PARAMETERS_MAX_LENGTH));
    } else if !raw.is_object() {
        out.push(invalid(
            &pp,
            "<value omitted>",
            "must be a valid JSON object",
        ));
    }
}

/// validation.go `validateDeviceToleration` (an unset operator is defaulted to `Equal`).
fn toleration(t: &r::DeviceToleration, path: &str, out: &mut Errs) {
    let key = t.key.as_deref().unwrap_or("");
    if !key.is_empty() {
        label_name(key, &format!("{path}.key"), out);
    }
    let value = t.value.as_deref().unwrap_or("");
    match t.operator.as_deref().unwrap_or("Equal") {
        "Exists" => {
            if !value.is_empty() {
                out.push(invalid(
                    &format!("{path}.value"),
                    value,
                    "must be empty for operator `Exists`",
                ));
            }
        }
        "" | "Equal" => label_value(value, &format!("{path}.value"), out),
        other => out.push(not_supported(
            &format!("{path}.operator"),
            other,
            &["Equal", "Exists"],
        )),
    }
    let effect = t.effect.as_deref().unwrap_or("");
    if !effect.is_empty() && !TAINT_EFFECTS.contains(&effect) {
        out.push(not_supported(
            &format!("{path}.effect"),
            effect,
            &TAINT_EFFECTS,
        ));
    }
}

/// validation.go `validateDeviceBindingParameters`.
fn binding_parameters(
    conditions: Option<&Vec<String>>,
    failure: Option<&Vec<String>>,
    path: &str,
    out: &mut Errs,
) {
    let conditions = conditions.map(Vec::as_slice).unwrap_or(&[]);
    let failure = failure.map(Vec::as_slice).unwrap_or(&[]);
    let cp = format!("{path}.bindingConditions");
    let fp = format!("{path}.bindingFailureConditions");
    if within(conditions.len(), BINDING_CONDITIONS_MAX, &cp, out) {
        for (i, c) in conditions.iter().enumerate() {
            label_name(c, &format!("{cp}[{i}]"), out);
        }
    }
    if within(failure.len(), BINDING_CONDITIONS_MAX, &fp, out) {
        for (i, c) in failure.iter().enumerate() {
            label_name(c, &format!("{fp}[{i}]"), out);
        }
    }
    let mut seen = HashSet::new();
    for (i, c) in conditions.iter().enumerate() {
        if !seen.insert(c) {
            out.push(duplicate(&format!("{cp}[{i}]"), c));
        }
    }
    let mut seen_failure = HashSet::new();
    for (i, c) in failure.iter().enumerate() {
        if !seen_failure.insert(c) {
            out.push(duplicate(&format!("{fp}[{i}]"), c));
        }
        if conditions.contains(c) {
            out.push(invalid(
                &format!("{fp}[{i}]"),
                c,
                "bindingFailureConditions must not overlap with bindingConditions",
            ));
        }
    }
    if conditions.is_empty() && !failure.is_empty() {
        out.push(invalid(
            &cp,
            conditions,
            "bindingConditions are required to use bindingFailureConditions",
        ));
    }
    if failure.is_empty() && !conditions.is_empty() {
        out.push(invalid(
            &fp,
            failure,
            "bindingFailureConditions are required to use bindingConditions",
        ));
    }
}

// ---------------------------------------------------------------------------------------------
// DeviceClass.

/// `ValidateDeviceClass` on create.
pub fn device_class(class: &r::DeviceClass) -> Vec<FieldError> {
    let mut out = Vec::new();
    object_meta(&class.metadata, false, names::dns1123_subdomain, &mut out);
    let spec = &class.spec;
    selectors(spec.selectors.as_ref(), "spec.selectors", &mut out);
    let config = spec.config.as_deref().unwrap_or(&[]);
    if within(config.len(), DEVICE_CONFIG_MAX, "spec.config", &mut out) {
        for (i, c) in config.iter().enumerate() {
            opaque(c.opaque.as_ref(), &format!("spec.config[{i}]"), &mut out);
        }
    }
    if let Some(name) = &spec.extended_resource_name
        && !is_extended_resource_name(name)
    {
        out.push(invalid(
            "spec.extendedResourceName",
            name,
            "must be a valid extended resource name",
        ));
    }
    out
}

/// `v1helper.IsExtendedResourceName`: a qualified name with a domain outside `kubernetes.io`,
/// not starting with `requests.`, whose `requests.`-prefixed form is a qualified name too.
fn is_extended_resource_name(name: &str) -> bool {
    let native = !name.contains('/') || name.contains("kubernetes.io/");
    if native || name.starts_with("requests.") {
        return false;
    }
    names::qualified_name(&format!("requests.{name}")).is_empty()
}

// ---------------------------------------------------------------------------------------------
// ResourceSlice.

/// The slice strategy's `PrepareForCreate` with v1.36's default gates: list-type attribute
/// values (`DRAListTypeAttributes`, off) and `nodeAllocatableResourceMappings`
/// (`DRANodeAllocatableResources`, off) are dropped, as the API server drops them.
pub fn prepare_slice(slice: &mut r::ResourceSlice) {
    for device in slice.spec.devices.iter_mut().flatten() {
        device.node_allocatable_resource_mappings = None;
        for attr in device.attributes.iter_mut().flat_map(BTreeMap::values_mut) {
            attr.bools = None;
            attr.ints = None;
            attr.strings = None;
            attr.versions = None;
        }
    }
}

/// `ValidateResourceSlice` on create (after [`prepare_slice`]).
pub fn resource_slice(slice: &r::ResourceSlice) -> Vec<FieldError> {
    let mut out = Vec::new();
    object_meta(&slice.metadata, false, names::dns1123_subdomain, &mut out);
    let spec = &slice.spec;
    driver_name(&spec.driver, "spec.driver", &mut out);
    pool_name(&spec.pool.name, "spec.pool.name", &mut out);
    if spec.pool.resource_slice_count <= 0 {
        out.push(invalid(
            "spec.pool.resourceSliceCount",
            spec.pool.resource_slice_count,
            "must be greater than zero",
        ));
    }
    if spec.pool.generation < 0 {
        out.push(invalid(
            "spec.pool.generation",
            spec.pool.generation,
            "must be greater than or equal to zero",
        ));
    }
    let mut set_fields = Vec::new();
    if let Some(node) = &spec.node_name {
        if node.is_empty() {
            out.push(invalid(
                "spec.nodeName",
                node,
                "must be either unset or set to a non-empty string",
            ));
        } else {
            set_fields.push("`nodeName`");
            dns_subdomain(node, "spec.nodeName", &mut out);
        }
    }
    if let Some(sel) = &spec.node_selector {
        set_fields.push("`nodeSelector`");
        node_selector(sel, "spec.nodeSelector", &mut out);
        if sel.node_selector_terms.len() != 1 {
            out.push(invalid(
                "spec.nodeSelector.nodeSelectorTerms",
                sel.node_selector_terms.len(),
                "must have exactly one node selector term",
            ));
        }
    }
    match spec.all_nodes {
        Some(true) => set_fields.push("`allNodes`"),
        Some(false) => out.push(invalid(
            "spec.allNodes",
            false,
            "must be either unset or set to true",
        )),
        None => {}
    }
    let per_device = spec.per_device_node_selection == Some(true);
    match spec.per_device_node_selection {
        Some(true) => set_fields.push("`perDeviceNodeSelection`"),
        Some(false) => out.push(invalid(
            "spec.perDeviceNodeSelection",
            false,
            "must be either unset or set to true",
        )),
        None => {}
    }
    match set_fields.len() {
        0 => out.push(required(
            "spec",
            "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required",
        )),
        1 => {}
        _ => out.push(invalid(
            "spec",
            format!("{{{}}}", set_fields.join(", ")),
            "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required, but multiple fields are set",
        )),
    }
    if spec.shared_counters.is_some() && spec.devices.is_some() {
        out.push(invalid(
            "spec",
            "",
            "only one of `sharedCounters` or `devices` is allowed",
        ));
    }

    let devices = spec.devices.as_deref().unwrap_or(&[]);
    let advanced = devices.iter().any(|d| {
        d.taints.as_ref().is_some_and(|t| !t.is_empty())
            || d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty())
    });
    let max_devices = if advanced {
        RESOURCE_SLICE_MAX_DEVICES_WITH_ADVANCED_FEATURES
    } else {
        RESOURCE_SLICE_MAX_DEVICES
    };
    if set_keys(
        devices.iter().map(|d| d.name.as_str()),
        Some(max_devices),
        "spec.devices",
        &mut out,
    ) {
        for (i, d) in devices.iter().enumerate() {
            device(d, &format!("spec.devices[{i}]"), per_device, &mut out);
        }
    }

    let sets = spec.shared_counters.as_deref().unwrap_or(&[]);
    if set_keys(
        sets.iter().map(|s| s.name.as_str()),
        Some(RESOURCE_SLICE_MAX_COUNTER_SETS),
        "spec.sharedCounters",
        &mut out,
    ) {
        for (i, set) in sets.iter().enumerate() {
            let p = format!("spec.sharedCounters[{i}]");
            if set.name.is_empty() {
                out.push(required(&format!("{p}.name"), ""));
            } else {
                dns_label(&set.name, &format!("{p}.name"), &mut out);
            }
            counters(
                &set.counters,
                MAX_COUNTERS_PER_COUNTER_SET,
                &format!("{p}.counters"),
                &mut out,
            );
        }
    }
    out
}

fn counters(map: &BTreeMap<String, r::Counter>, max: usize, path: &str, out: &mut Errs) {
    if map.is_empty() {
        out.push(required(path, ""));
        return;
    }
    if map.len() > max {
        out.push(too_many(path, map.len(), max));
        return;
    }
    for (name, counter) in map {
        dns_label(name, path, out);
        quantity(&counter.value, &format!("{path}[{name}].value"), out);
    }
}

/// validation.go `validateDevice`.
fn device(d: &r::Device, path: &str, per_device: bool, out: &mut Errs) {
    dns_label(&d.name, &format!("{path}.name"), out);
    let attributes = d.attributes.as_ref();
    let capacity = d.capacity.as_ref();
    let n = attributes.map_or(0, BTreeMap::len) + capacity.map_or(0, BTreeMap::len);
    if n > MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE {
        out.push(invalid(
            path,
            n,
            &format!(
                "the total number of attributes and capacities must not exceed {MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE}"
            ),
        ));
    }
    let values: usize = attributes.map_or(0, |a| {
        a.values()
            .map(|v| {
                let list = v.bools.as_ref().map_or(0, Vec::len)
                    + v.ints.as_ref().map_or(0, Vec::len)
                    + v.strings.as_ref().map_or(0, Vec::len)
                    + v.versions.as_ref().map_or(0, Vec::len);
                list.max(1)
            })
            .sum()
    });
    if values > MAX_ATTRIBUTE_VALUES_PER_DEVICE {
        out.push(invalid(
            path,
            values,
            &format!(
                "the total number of attribute values must not exceed {MAX_ATTRIBUTE_VALUES_PER_DEVICE}"
            ),
        ));
    }
    let key_max = DEVICE_MAX_DOMAIN_LENGTH + 1 + DEVICE_MAX_ID_LENGTH;
    for (name, attr) in attributes.into_iter().flatten() {
        qualified_name(name, &format!("{path}.attributes"), out);
        attribute(
            attr,
            &format!("{path}.attributes[{}]", truncate(name, key_max)),
            out,
        );
    }
    let multi = d.allow_multiple_allocations == Some(true);
    for (name, cap) in capacity.into_iter().flatten() {
        qualified_name(name, &format!("{path}.capacity"), out);
        let cp = format!("{path}.capacity[{}]", truncate(name, key_max));
        let max = quantity(&cap.value, &format!("{cp}.value"), out);
        if let Some(policy) = &cap.request_policy {
            let pp = format!("{cp}.requestPolicy");
            if multi {
                if let Some(max) = max {
                    request_policy(&max, policy, &pp, out);
                }
            } else {
                out.push(forbidden(&pp, "allowMultipleAllocations must be true"));
            }
        }
    }
    let taints = d.taints.as_deref().unwrap_or(&[]);
    if within(
        taints.len(),
        DEVICE_TAINTS_MAX,
        &format!("{path}.taints"),
        out,
    ) {
        for (i, t) in taints.iter().enumerate() {
            let tp = format!("{path}.taints[{i}]");
            label_name(&t.key, &format!("{tp}.key"), out);
            if let Some(v) = t.value.as_deref()
                && !v.is_empty()
            {
                label_value(v, &format!("{tp}.value"), out);
            }
            if t.effect.is_empty() {
                out.push(required(&format!("{tp}.effect"), ""));
            } else if !TAINT_EFFECTS.contains(&t.effect.as_str()) {
                out.push(not_supported(
                    &format!("{tp}.effect"),
                    &t.effect,
                    &TAINT_EFFECTS,
                ));
            }
        }
    }
    let consumes = d.consumes_counters.as_deref().unwrap_or(&[]);
    let cp = format!("{path}.consumesCounters");
    if set_keys(
        consumes.iter().map(|c| c.counter_set.as_str()),
        Some(MAX_COUNTER_CONSUMPTIONS_PER_DEVICE),
        &cp,
        out,
    ) {
        for (i, c) in consumes.iter().enumerate() {
            let p = format!("{cp}[{i}]");
            if c.counter_set.is_empty() {
                out.push(required(&format!("{p}.counterSet"), ""));
            } else {
                dns_label(&c.counter_set, &format!("{p}.counterSet"), out);
            }
            counters(
                &c.counters,
                MAX_COUNTERS_PER_CONSUMPTION,
                &format!("{p}.counters"),
                out,
            );
        }
    }
    let node_fields = d.node_name.is_some() || d.node_selector.is_some() || d.all_nodes.is_some();
    if per_device {
        let mut set = Vec::new();
        if let Some(node) = &d.node_name {
            if node.is_empty() {
                out.push(invalid(
                    &format!("{path}.nodeName"),
                    node,
                    "must not be empty",
                ));
            } else {
                set.push("`nodeName`");
                dns_subdomain(node, &format!("{path}.nodeName"), out);
            }
        }
        if let Some(sel) = &d.node_selector {
            set.push("`nodeSelector`");
            node_selector(sel, &format!("{path}.nodeSelector"), out);
        }
        match d.all_nodes {
            Some(true) => set.push("`allNodes`"),
            Some(false) => out.push(invalid(
                &format!("{path}.allNodes"),
                false,
                "must be either unset or set to true",
            )),
            None => {}
        }
        let detail = "exactly one of `nodeName`, `nodeSelector`, or `allNodes` is required when `perDeviceNodeSelection` is set to true in the ResourceSlice spec";
        match set.len() {
            0 => out.push(required(path, detail)),
            1 => {}
            _ => out.push(invalid(path, format!("{{{}}}", set.join(", ")), detail)),
        }
    } else if node_fields {
        out.push(invalid(
            path,
            "",
            "`nodeName`, `nodeSelector` and `allNodes` can only be set if `perDeviceNodeSelection` is set to true in the ResourceSlice spec",
        ));
    }
    binding_parameters(
        d.binding_conditions.as_ref(),
        d.binding_failure_conditions.as_ref(),
        path,
        out,
    );
}

fn truncate(s: &str, max: usize) -> String {
    let max = max.max(16);
    if s.len() <= max || !s.is_ascii() {
        return s.to_owned();
    }
    let remaining = max - 3;
    format!(
        "{}...{}",
        &s[..remaining.div_ceil(2)],
        &s[s.len() - remaining / 2..]
    )
}

/// validation.go `validateDeviceAttribute` (list values were dropped by [`prepare_slice`]).
fn attribute(a: &r::DeviceAttribute, path: &str, out: &mut Errs) {
    let mut n = 0;
    if a.bool.is_some() {
        n += 1;
    }
    if a.int.is_some() {
        n += 1;
    }
    if let Some(s) = &a.string {
        n += 1;
        if s.len() > DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH {
            out.push(too_long(
                &format!("{path}.string"),
                DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH,
            ));
        }
    }
    if let Some(v) = &a.version {
        n += 1;
        let vp = format!("{path}.version");
        if !names::is_semver(v) {
            out.push(invalid(
                &vp,
                v,
                "must be a string compatible with semver.org spec 2.0.0",
            ));
        }
        if v.len() > DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH {
            out.push(too_long(&vp, DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH));
        }
    }
    for (list, name) in [
        (a.bools.as_ref().map(Vec::len), "bools"),
        (a.ints.as_ref().map(Vec::len), "ints"),
        (a.strings.as_ref().map(Vec::len), "strings"),
        (a.versions.as_ref().map(Vec::len), "versions"),
    ] {
        if let Some(len) = list {
            n += 1;
            if len == 0 {
                out.push(invalid(
                    &format!("{path}.{name}"),
                    "[]",
                    "must not be empty if specified",
                ));
            }
        }
    }
    if n != 1 {
        out.push(invalid(path, "", "exactly one value must be specified"));
    }
}

/// validation.go `validateRequestPolicy` and what it calls.
fn request_policy(max: &Q, policy: &r::CapacityRequestPolicy, path: &str, out: &mut Errs) {
    let valid_values = policy.valid_values.as_deref().unwrap_or(&[]);
    if !valid_values.is_empty() && policy.valid_range.is_some() {
        out.push(forbidden(
            path,
            r#"exactly one policy can be specified, cannot specify "validValues" and "validRange" at the same time"#,
        ));
        return;
    }
    let default = policy
        .default
        .as_ref()
        .and_then(|d| quantity(d, &format!("{path}.default"), out));
    if !valid_values.is_empty() {
        let Some(default) = default else {
            if policy.default.is_none() {
                out.push(required(
                    &format!("{path}.default"),
                    "required when validValues is defined",
                ));
            }
            return;
        };
        let vp = format!("{path}.validValues");
        let parsed: Vec<Option<Q>> = valid_values
            .iter()
            .enumerate()
            .map(|(i, v)| quantity(v, &format!("{vp}[{i}]"), out))
            .collect();
        for i in 0..parsed.len().saturating_sub(1) {
            if let (Some(a), Some(b)) = (&parsed[i], &parsed[i + 1])
                && a.compare(b).is_gt()
            {
                out.push(invalid(
                    &format!("{vp}[{}]", i + 1),
                    b.to_string(),
                    "values must be sorted in ascending order",
                ));
            }
        }
        if parsed.len() > CAPACITY_VALID_VALUES_MAX {
            out.push(too_many(&vp, parsed.len(), CAPACITY_VALID_VALUES_MAX));
        } else {
            let mut found_default = false;
            let mut seen = HashSet::new();
            for (i, v) in parsed.iter().enumerate() {
                let Some(v) = v else { continue };
                if v.compare(max).is_gt() {
                    out.push(invalid(
                        &format!("{vp}[{i}]"),
                        v.to_string(),
                        &format!("option is larger than capacity value: {max}"),
                    ));
                }
                if v.compare(&default).is_eq() {
                    found_default = true;
                }
                // Upstream's set key is the value rounded up to an integer.
                if !seen.insert(quantity_value(v)) {
                    out.push(duplicate(&format!("{vp}[{i}]"), quantity_value(v)));
                }
            }
            if !found_default {
                out.push(invalid(
                    &vp,
                    default.to_string(),
                    "default value is not valid according to the requestPolicy",
                ));
            }
        }
    } else if let Some(range) = &policy.valid_range {
        let Some(default) = default else {
            if policy.default.is_none() {
                out.push(required(
                    &format!("{path}.default"),
                    "required when validRange is defined",
                ));
            }
            return;
        };
        let rp = format!("{path}.validRange");
        let Some(min) = quantity(&range.min, &format!("{rp}.min"), out) else {
            return;
        };
        if min.compare(max).is_gt() {
            out.push(invalid(
                &format!("{rp}.min"),
                min.to_string(),
                &format!("min is larger than capacity value: {max}"),
            ));
        }
        if default.compare(&min).is_lt() {
            out.push(invalid(
                &format!("{rp}.min"),
                default.to_string(),
                &format!("default is less than min: {min}"),
            ));
        }
        let range_max = range
            .max
            .as_ref()
            .and_then(|m| quantity(m, &format!("{rp}.max"), out));
        if let Some(rmax) = &range_max {
            if min.compare(rmax).is_gt() {
                out.push(invalid(
                    &format!("{rp}.max"),
                    min.to_string(),
                    &format!("min is larger than max: {rmax}"),
                ));
            }
            if rmax.compare(max).is_gt() {
                out.push(invalid(
                    &format!("{rp}.max"),
                    rmax.to_string(),
                    &format!("max is larger than capacity value: {max}"),
                ));
            }
            if default.compare(rmax).is_gt() {
                out.push(invalid(
                    &format!("{rp}.max"),
                    default.to_string(),
                    &format!("default is more than max: {rmax}"),
                ));
            }
        }
        if let Some(step) = range
            .step
            .as_ref()
            .and_then(|s| quantity(s, &format!("{rp}.step"), out))
        {
            let sp = format!("{rp}.step");
            if let Ok(one) = min.add(&step)
                && one.compare(max).is_gt()
            {
                out.push(invalid(
                    &sp,
                    step.to_string(),
                    &format!("one step {one} is larger than capacity value: {max}"),
                ));
            }
            let step_v = quantity_value(&step);
            let min_v = quantity_value(&min);
            let mut check = |v: &Q| {
                let diff = quantity_value(v).wrapping_sub(min_v);
                // Upstream divides by the step; a zero step would panic there. Report it.
                if step_v == 0 || diff.checked_rem(step_v).is_none_or(|r| r != 0) {
                    out.push(invalid(
                        &sp,
                        v.to_string(),
                        &format!("value is not a multiple of a given step ({step}) from ({min})"),
                    ));
                }
            };
            check(&default);
            if let Some(rmax) = &range_max {
                check(rmax);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// ResourceClaim.

/// Request names of a claim: each request with its subrequests (validation.go `requestNames`).
struct RequestNames(Vec<(String, Option<Vec<String>>)>);

impl RequestNames {
    fn of(claim: &r::ResourceClaim) -> RequestNames {
        RequestNames(
            claim
                .spec
                .devices
                .as_ref()
                .and_then(|d| d.requests.as_ref())
                .into_iter()
                .flatten()
                .map(|r| {
                    let subs = r
                        .first_available
                        .as_ref()
                        .filter(|f| !f.is_empty())
                        .map(|f| f.iter().map(|s| s.name.clone()).collect());
                    (r.name.clone(), subs)
                })
                .collect(),
        )
    }

    fn has(&self, name: &str) -> bool {
        let segments: Vec<&str> = name.split('/').collect();
        match segments.as_slice() {
            [request] => self.0.iter().any(|(n, _)| n == request),
            [request, sub] => self
                .0
                .iter()
                .filter(|(n, _)| n == request)
                .any(|(_, subs)| subs.as_ref().is_some_and(|s| s.iter().any(|x| x == sub))),
            _ => false,
        }
    }

    /// validation.go `validateRequestNameRef`.
    fn check_ref(&self, name: &str, path: &str, out: &mut Errs) {
        let detail = "must be the name of a request in the claim or the name of a request and a subrequest separated by '/'";
        let segments: Vec<&str> = name.split('/').collect();
        if segments.len() > 2 {
            out.push(invalid(path, name, detail));
            return;
        }
        for s in &segments {
            dns_label(s, path, out);
        }
        if !self.has(name) {
            out.push(invalid(path, name, detail));
        }
    }
}

/// `ValidateResourceClaim` on create, then the status (if any) as a status update of the
/// created claim (`ValidateResourceClaimStatusUpdate`).
pub fn resource_claim(claim: &r::ResourceClaim) -> Vec<FieldError> {
    let mut out = Vec::new();
    object_meta(&claim.metadata, true, names::dns1123_subdomain, &mut out);
    let names = RequestNames::of(claim);
    let empty = r::DeviceClaim::default();
    let devices = claim.spec.devices.as_ref().unwrap_or(&empty);
    let requests = devices.requests.as_deref().unwrap_or(&[]);
    if set_keys(
        requests.iter().map(|r| r.name.as_str()),
        Some(DEVICE_REQUESTS_MAX),
        "spec.devices.requests",
        &mut out,
    ) {
        for (i, req) in requests.iter().enumerate() {
            request(req, &format!("spec.devices.requests[{i}]"), &mut out);
        }
    }
    let constraints = devices.constraints.as_deref().unwrap_or(&[]);
    if within(
        constraints.len(),
        DEVICE_CONSTRAINTS_MAX,
        "spec.devices.constraints",
        &mut out,
    ) {
        for (i, c) in constraints.iter().enumerate() {
            let p = format!("spec.devices.constraints[{i}]");
            request_refs(
                c.requests.as_deref(),
                &names,
                &format!("{p}.requests"),
                &mut out,
            );
            if let Some(m) = &c.match_attribute {
                fully_qualified_name(m, &format!("{p}.matchAttribute"), &mut out);
            } else if let Some(d) = &c.distinct_attribute {
                fully_qualified_name(d, &format!("{p}.distinctAttribute"), &mut out);
            } else {
                out.push(required(
                    &p,
                    r#"exactly one of "matchAttribute" or "distinctAttribute" is required, but multiple fields are set"#,
                ));
            }
        }
    }
    let config = devices.config.as_deref().unwrap_or(&[]);
    if within(
        config.len(),
        DEVICE_CONFIG_MAX,
        "spec.devices.config",
        &mut out,
    ) {
        for (i, c) in config.iter().enumerate() {
            let p = format!("spec.devices.config[{i}]");
            request_refs(
                c.requests.as_deref(),
                &names,
                &format!("{p}.requests"),
                &mut out,
            );
            opaque(c.opaque.as_ref(), &p, &mut out);
        }
    }
    if out.is_empty()
        && let Some(status) = &claim.status
    {
        claim_status(status, &names, &mut out);
    }
    out
}

fn request_refs(list: Option<&[String]>, names: &RequestNames, path: &str, out: &mut Errs) {
    let list = list.unwrap_or(&[]);
    if set_keys(
        list.iter().map(String::as_str),
        Some(DEVICE_REQUESTS_MAX),
        path,
        out,
    ) {
        for (i, n) in list.iter().enumerate() {
            names.check_ref(n, &format!("{path}[{i}]"), out);
        }
    }
}

/// validation.go `validateDeviceRequest`.
fn request(req: &r::DeviceRequest, path: &str, out: &mut Errs) {
    dns_label(&req.name, &format!("{path}.name"), out);
    let first = req.first_available.as_deref().unwrap_or(&[]);
    match (req.exactly.as_ref(), first.is_empty()) {
        (None, true) => out.push(required(
            path,
            "exactly one of `exactly` or `firstAvailable` is required",
        )),
        (Some(_), false) => out.push(invalid(
            path,
            "null",
            "exactly one of `exactly` or `firstAvailable` is required, but multiple fields are set",
        )),
        (None, false) => {
            let fp = format!("{path}.firstAvailable");
            if set_keys(
                first.iter().map(|s| s.name.as_str()),
                Some(FIRST_AVAILABLE_MAX),
                &fp,
                out,
            ) {
                for (i, sub) in first.iter().enumerate() {
                    let sp = format!("{fp}[{i}]");
                    dns_label(&sub.name, &format!("{sp}.name"), out);
                    exact_like(
                        &sub.device_class_name,
                        sub.selectors.as_ref(),
                        sub.allocation_mode.as_deref(),
                        sub.count,
                        sub.tolerations.as_deref(),
                        sub.capacity.as_ref(),
                        &sp,
                        out,
                    );
                }
            }
        }
        (Some(e), true) => exact_like(
            &e.device_class_name,
            e.selectors.as_ref(),
            e.allocation_mode.as_deref(),
            e.count,
            e.tolerations.as_deref(),
            e.capacity.as_ref(),
            &format!("{path}.exactly"),
            out,
        ),
    }
}

/// What `validateExactDeviceRequest` and `validateDeviceSubRequest` share.
#[allow(clippy::too_many_arguments)]
fn exact_like(
    class: &str,
    sel: Option<&Vec<r::DeviceSelector>>,
    mode: Option<&str>,
    count: Option<i64>,
    tolerations: Option<&[r::DeviceToleration]>,
    capacity: Option<&r::CapacityRequirements>,
    path: &str,
    out: &mut Errs,
) {
    let cp = format!("{path}.deviceClassName");
    if class.is_empty() {
        out.push(required(&cp, ""));
    } else {
        dns_subdomain(class, &cp, out);
    }
    selectors(sel, &format!("{path}.selectors"), out);
    // Defaulting: an unset mode is ExactCount, and ExactCount with count 0 gets count 1.
    let count = count.unwrap_or(0);
    match mode.unwrap_or("") {
        "All" => {
            if count != 0 {
                out.push(invalid(
                    &format!("{path}.count"),
                    count,
                    "must not be specified when allocationMode is 'All'",
                ));
            }
        }
        "" | "ExactCount" => {
            if count < 0 {
                out.push(invalid(
                    &format!("{path}.count"),
                    count,
                    "must be greater than zero",
                ));
            }
        }
        other => out.push(not_supported(
            &format!("{path}.allocationMode"),
            other,
            &["All", "ExactCount"],
        )),
    }
    for (i, t) in tolerations.unwrap_or(&[]).iter().enumerate() {
        toleration(t, &format!("{path}.tolerations[{i}]"), out);
    }
    for (name, q) in capacity
        .and_then(|c| c.requests.as_ref())
        .into_iter()
        .flatten()
    {
        quantity(q, &format!("{path}.capacity.requests[{name}]"), out);
    }
}

/// validation.go `validateResourceClaimStatusUpdate` for a status written onto a new claim.
fn claim_status(status: &r::ResourceClaimStatus, names: &RequestNames, out: &mut Errs) {
    let reserved = status.reserved_for.as_deref().unwrap_or(&[]);
    if set_keys(
        reserved.iter().map(|c| c.uid.as_str()),
        Some(RESERVED_FOR_MAX),
        "status.reservedFor",
        out,
    ) {
        for (i, c) in reserved.iter().enumerate() {
            let p = format!("status.reservedFor[{i}]");
            if c.resource.is_empty() {
                out.push(required(&format!("{p}.resource"), ""));
            }
            if c.name.is_empty() {
                out.push(required(&format!("{p}.name"), ""));
            }
            if c.uid.is_empty() {
                out.push(required(&format!("{p}.uid"), ""));
            }
        }
    }
    let allocated: HashSet<(String, String, String, Option<String>)> = status
        .allocation
        .as_ref()
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref())
        .into_iter()
        .flatten()
        .map(|r| {
            (
                r.driver.clone(),
                r.pool.clone(),
                r.device.clone(),
                r.share_id.clone(),
            )
        })
        .collect();
    let devices = status.devices.as_deref().unwrap_or(&[]);
    let mut seen = HashSet::new();
    for (i, d) in devices.iter().enumerate() {
        let p = format!("status.devices[{i}]");
        driver_name(&d.driver, &format!("{p}.driver"), out);
        pool_name(&d.pool, &format!("{p}.pool"), out);
        dns_label(&d.device, &format!("{p}.device"), out);
        if let Some(id) = &d.share_id
            && !names::is_normalized_uuid(id)
        {
            out.push(invalid(&format!("{p}.shareID"), id, "uid must be in RFC 4122 normalized form, `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` with lowercase hexadecimal characters"));
        }
        let key = (
            d.driver.clone(),
            d.pool.clone(),
            d.device.clone(),
            d.share_id.clone(),
        );
        if !allocated.contains(&key) {
            out.push(invalid(
                &p,
                format!("{}/{}/{}", d.driver, d.pool, d.device),
                "must be an allocated device in the claim",
            ));
        }
        if !seen.insert(key) {
            out.push(duplicate(
                &p,
                format!("{}/{}/{}", d.driver, d.pool, d.device),
            ));
        }
    }
    let Some(allocation) = &status.allocation else {
        if !reserved.is_empty() {
            out.push(forbidden(
                "status.reservedFor",
                "may not be specified when `allocated` is not set",
            ));
        }
        return;
    };
    let ap = "status.allocation.devices";
    let results = allocation
        .devices
        .as_ref()
        .and_then(|d| d.results.as_deref())
        .unwrap_or(&[]);
    if within(
        results.len(),
        ALLOCATION_RESULTS_MAX,
        &format!("{ap}.results"),
        out,
    ) {
        for (i, res) in results.iter().enumerate() {
            let p = format!("{ap}.results[{i}]");
            names.check_ref(&res.request, &format!("{p}.request"), out);
            driver_name(&res.driver, &format!("{p}.driver"), out);
            pool_name(&res.pool, &format!("{p}.pool"), out);
            dns_label(&res.device, &format!("{p}.device"), out);
            binding_parameters(
                res.binding_conditions.as_ref(),
                res.binding_failure_conditions.as_ref(),
                &p,
                out,
            );
            if let Some(id) = &res.share_id
                && !names::is_normalized_uuid(id)
            {
                out.push(invalid(&format!("{p}.shareID"), id, "uid must be in RFC 4122 normalized form, `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` with lowercase hexadecimal characters"));
            }
            for (name, q) in res.consumed_capacity.iter().flatten() {
                quantity(q, &format!("{p}.consumedCapacity[{name}]"), out);
            }
        }
    }
    let config = allocation
        .devices
        .as_ref()
        .and_then(|d| d.config.as_deref())
        .unwrap_or(&[]);
    if within(
        config.len(),
        2 * DEVICE_CONFIG_MAX,
        &format!("{ap}.config"),
        out,
    ) {
        for (i, c) in config.iter().enumerate() {
            let p = format!("{ap}.config[{i}]");
            match c.source.as_str() {
                "" => out.push(required(&format!("{p}.source"), "")),
                "FromClaim" | "FromClass" => {}
                other => out.push(not_supported(
                    &format!("{p}.source"),
                    other,
                    &["FromClaim", "FromClass"],
                )),
            }
            request_refs(c.requests.as_deref(), names, &format!("{p}.requests"), out);
            opaque(c.opaque.as_ref(), &p, out);
        }
    }
    if let Some(sel) = &allocation.node_selector {
        node_selector(sel, "status.allocation.nodeSelector", out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extended_resource_names() {
        assert!(is_extended_resource_name("example.com/gpu"));
        assert!(!is_extended_resource_name("gpu"));
        assert!(!is_extended_resource_name("kubernetes.io/gpu"));
        assert!(!is_extended_resource_name("requests.example.com/gpu"));
    }

    #[test]
    fn truncation_keeps_both_ends() {
        assert_eq!(truncate("short", 96), "short");
        let long = "a".repeat(50) + &"b".repeat(50);
        let t = truncate(&long, 96);
        assert_eq!(t.len(), 96);
        assert!(t.starts_with('a') && t.ends_with('b') && t.contains("..."));
    }
}
