//! Reading `dractl allocate`'s input: the objects a cluster would hold, as `kubectl get -o yaml`
//! or `-o json` prints them, checked the way the API server checks them on create.
//!
//! Each input is a stream of YAML documents, or of JSON values when it starts with `{` (as
//! apimachinery's `YAMLOrJSONDecoder` decides); each document is one object or a `List` of them.
//! Kinds: `v1` `Node`, and `resource.k8s.io/v1` `DeviceClass`, `ResourceSlice` and
//! `ResourceClaim`. Every object is decoded strictly (unknown and duplicate fields are errors,
//! like the API server's `fieldValidation=Strict`), then validated with the rules of upstream
//! `pkg/apis/resource/validation/validation.go` (k8s.io/kubernetes v1.36.3), see
//! [`validate`]. Any problem is an [`InputError`] naming the file, the document (and the `List`
//! item), the object and the field.
//!
//! The test oracle (`tests/gotools/cmd/allocoracle`) runs the API server's own code on the same
//! input; both must refuse the same objects.

pub(crate) mod names;
mod strict;
pub mod validate;

use std::collections::HashSet;
use std::fmt;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use serde::de::DeserializeOwned;
use serde_json::Value;

pub use validate::FieldError;

/// The objects read from all inputs, each list in input order.
#[derive(Clone, Debug, Default)]
pub struct Inputs {
    /// `v1` Nodes.
    pub nodes: Vec<Node>,
    /// DeviceClasses.
    pub classes: Vec<DeviceClass>,
    /// ResourceSlices.
    pub slices: Vec<ResourceSlice>,
    /// ResourceClaims; those with `status.allocation` are in use, the others are the pod's.
    pub claims: Vec<ResourceClaim>,
}

/// Where in the input something is: file, document, `List` item.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    /// The file as given (`-` for stdin).
    pub file: String,
    /// The document's index in the file's stream, from 0.
    pub document: usize,
    /// The item's index in a `List` document.
    pub item: Option<usize>,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: document {}", self.file, self.document)?;
        if let Some(i) = self.item {
            write!(f, ", item {i}")?;
        }
        Ok(())
    }
}

/// A fatal problem with the input. Displayed as
/// `FILE: document N[, item M] (Kind namespace/name): problem`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct InputError {
    /// Where; `None` for problems not tied to one document (a missing `--node`).
    pub location: Option<Location>,
    /// The object, `Kind namespace/name` or `Kind "name"`, when known.
    pub object: Option<String>,
    /// What is wrong (for validation errors: each field path and its problem).
    pub message: String,
}

impl fmt::Display for InputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(l) = &self.location {
            write!(f, "{l}")?;
            if let Some(o) = &self.object {
                write!(f, " ({o})")?;
            }
            write!(f, ": ")?;
        } else if let Some(o) = &self.object {
            write!(f, "{o}: ")?;
        }
        f.write_str(&self.message)
    }
}

impl InputError {
    /// An error about the input as a whole.
    pub fn general(message: impl Into<String>) -> InputError {
        InputError {
            location: None,
            object: None,
            message: message.into(),
        }
    }
}

/// The kinds `dractl allocate` reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Kind {
    Node,
    DeviceClass,
    ResourceSlice,
    ResourceClaim,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Node => "Node",
            Kind::DeviceClass => "DeviceClass",
            Kind::ResourceSlice => "ResourceSlice",
            Kind::ResourceClaim => "ResourceClaim",
        }
    }
}

/// Reads inputs one after another, remembering objects seen so that a duplicate is an error.
#[derive(Debug, Default)]
pub struct Reader {
    inputs: Inputs,
    seen: HashSet<(Kind, String, String)>,
    /// Names given so far to objects with only `generateName`.
    generated: usize,
}

impl Reader {
    /// An empty reader.
    pub fn new() -> Reader {
        Reader::default()
    }

    /// Reads one file's text (`file` names it in errors).
    ///
    /// # Errors
    /// The first problem found, as an [`InputError`]; objects before it stay read.
    pub fn read_str(&mut self, file: &str, text: &str) -> Result<(), InputError> {
        for (location, value) in split(file, text)? {
            self.read_value(location, value)?;
        }
        Ok(())
    }

    /// Reads one decoded document: an object, or a `List` of objects.
    ///
    /// # Errors
    /// The first problem found.
    pub fn read_value(&mut self, location: Location, value: Value) -> Result<(), InputError> {
        let api_version = value.get("apiVersion").and_then(Value::as_str);
        let kind = value.get("kind").and_then(Value::as_str);
        if api_version == Some("v1") && kind == Some("List") {
            let fail = |message: String| InputError {
                location: Some(location.clone()),
                object: Some("List".into()),
                message,
            };
            let Value::Object(mut map) = value else {
                return Err(fail("not an object".into()));
            };
            for key in map.keys() {
                if !matches!(key.as_str(), "apiVersion" | "kind" | "metadata" | "items") {
                    return Err(fail(format!(
                        "strict decoding error: unknown field {key:?}"
                    )));
                }
            }
            let items = match map.remove("items") {
                Some(Value::Array(items)) => items,
                None | Some(Value::Null) => Vec::new(),
                Some(_) => return Err(fail("items: must be a list".into())),
            };
            for (i, item) in items.into_iter().enumerate() {
                let mut l = location.clone();
                l.item = Some(i);
                self.read_object(l, item)?;
            }
            return Ok(());
        }
        self.read_object(location, value)
    }

    fn read_object(&mut self, location: Location, mut value: Value) -> Result<(), InputError> {
        let fail = |object: Option<String>, message: String| InputError {
            location: Some(location.clone()),
            object,
            message,
        };
        if !value.is_object() {
            return Err(fail(None, "not an object".into()));
        }
        let api_version = value
            .get("apiVersion")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        let kind_name = value
            .get("kind")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        if kind_name.is_empty() {
            return Err(fail(None, "Object 'Kind' is missing".into()));
        }
        if api_version.is_empty() {
            return Err(fail(None, "Object 'apiVersion' is missing".into()));
        }
        let kind = match (api_version.as_str(), kind_name.as_str()) {
            ("v1", "Node") => Kind::Node,
            ("resource.k8s.io/v1", "DeviceClass") => Kind::DeviceClass,
            ("resource.k8s.io/v1", "ResourceSlice") => Kind::ResourceSlice,
            ("resource.k8s.io/v1", "ResourceClaim") => Kind::ResourceClaim,
            (v, k @ ("DeviceClass" | "ResourceSlice" | "ResourceClaim"))
                if v.starts_with("resource.k8s.io/") =>
            {
                return Err(fail(
                    None,
                    format!(
                        "unsupported version {v} of {k}: only resource.k8s.io/v1 is read (kubectl get {}.v1.resource.k8s.io prints it)",
                        k.to_lowercase() + "s"
                    ),
                ));
            }
            (v, k) => {
                return Err(fail(
                    None,
                    format!(
                        "unsupported kind {k} ({v}): expected a v1 Node or a resource.k8s.io/v1 DeviceClass, ResourceSlice or ResourceClaim"
                    ),
                ));
            }
        };
        // A claim without a namespace goes to "default", as kubectl would send it.
        if kind == Kind::ResourceClaim
            && let Some(meta) = value.get_mut("metadata").and_then(Value::as_object_mut)
            && meta
                .get("namespace")
                .is_none_or(|ns| ns.is_null() || ns.as_str() == Some(""))
        {
            meta.insert("namespace".into(), Value::String("default".into()));
        }
        // Only `generateName` (as the plugin's `--dry-run` prints slices): named as the API
        // server would name it, with a 5-character suffix (ours counts up instead of random).
        if let Some(meta) = value.get_mut("metadata").and_then(Value::as_object_mut)
            && meta
                .get("name")
                .is_none_or(|n| n.is_null() || n.as_str() == Some(""))
            && let Some(prefix) = meta
                .get("generateName")
                .and_then(Value::as_str)
                .filter(|p| !p.is_empty())
        {
            let name = format!("{prefix}{}", generated_suffix(self.generated));
            self.generated += 1;
            meta.insert("name".into(), Value::String(name));
        }
        let namespace = value
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        let name = value
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        let object = if namespace.is_empty() {
            format!("{} {name:?}", kind.name())
        } else {
            format!("{} {namespace}/{name}", kind.name())
        };
        let fail_obj = |message: String| fail(Some(object.clone()), message);

        let errors = match kind {
            Kind::Node => {
                let node: Node = decode(&value).map_err(fail_obj)?;
                self.insert_seen(kind, &namespace, &name)
                    .map_err(fail_obj)?;
                self.inputs.nodes.push(node);
                return Ok(());
            }
            Kind::DeviceClass => {
                let class: DeviceClass = decode(&value).map_err(fail_obj)?;
                let errors = validate::device_class(&class);
                if errors.is_empty() {
                    self.insert_seen(kind, &namespace, &name)
                        .map_err(fail_obj)?;
                    self.inputs.classes.push(class);
                }
                errors
            }
            Kind::ResourceSlice => {
                let mut slice: ResourceSlice = decode(&value).map_err(fail_obj)?;
                validate::prepare_slice(&mut slice);
                let errors = validate::resource_slice(&slice);
                if errors.is_empty() {
                    self.insert_seen(kind, &namespace, &name)
                        .map_err(fail_obj)?;
                    self.inputs.slices.push(slice);
                }
                errors
            }
            Kind::ResourceClaim => {
                let claim: ResourceClaim = decode(&value).map_err(fail_obj)?;
                let errors = validate::resource_claim(&claim);
                if errors.is_empty() {
                    self.insert_seen(kind, &namespace, &name)
                        .map_err(fail_obj)?;
                    self.inputs.claims.push(claim);
                }
                errors
            }
        };
        if errors.is_empty() {
            return Ok(());
        }
        let list: Vec<String> = errors.iter().map(ToString::to_string).collect();
        Err(fail_obj(format!("invalid: {}", list.join("; "))))
    }

    fn insert_seen(&mut self, kind: Kind, namespace: &str, name: &str) -> Result<(), String> {
        if self
            .seen
            .insert((kind, namespace.to_owned(), name.to_owned()))
        {
            Ok(())
        } else {
            Err("duplicate object".into())
        }
    }

    /// The objects read so far.
    pub fn finish(self) -> Inputs {
        self.inputs
    }
}

/// Decodes an object strictly: type errors name the field, and a field that the type does not
/// have is an error (the API server's strict field validation).
fn decode<T: DeserializeOwned + serde::Serialize>(value: &Value) -> Result<T, String> {
    let typed: T = serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        if path == "." || path.is_empty() {
            format!("decoding: {}", e.inner())
        } else {
            format!("decoding: {path}: {}", e.inner())
        }
    })?;
    let round = serde_json::to_value(&typed).map_err(|e| format!("decoding: {e}"))?;
    let mut unknown = Vec::new();
    strict::unknown_fields(value, &round, "", &mut unknown);
    if let Some(first) = unknown.first() {
        return Err(format!(
            "strict decoding error: unknown field \"{}\"",
            first.trim_start_matches('.')
        ));
    }
    Ok(typed)
}

/// Splits a file into documents as kubectl reads a file (apimachinery's `YAMLOrJSONDecoder`,
/// `k8s.io/apimachinery/pkg/util/yaml/decoder.go`): a JSON stream when it starts with `{`, else
/// YAML documents (an empty document is `null`). A stream that starts as JSON but fails to
/// parse as JSON after at most one object (`{...}` then `---`, a YAML stream whose documents are
/// written as JSON) is read as YAML from where the JSON objects ended; after two JSON objects it
/// is a JSON stream and its error stands. Duplicate keys are refused. On failure: the index of
/// the failing document and the message.
fn split_documents(text: &str) -> Result<Vec<Value>, (usize, String)> {
    let trimmed = text.trim_start_matches(|c: char| c.is_whitespace() || c == '\u{feff}');
    let mut docs = Vec::new();
    let mut rest = text;
    if trimmed.starts_with('{') {
        let mut stream =
            serde_json::Deserializer::from_str(trimmed).into_iter::<strict::NoDupValue>();
        loop {
            let consumed = stream.byte_offset();
            match stream.next() {
                None => return Ok(docs),
                Some(Ok(v)) => docs.push(v.0),
                Some(Err(e)) if docs.len() > 1 => {
                    return Err((docs.len(), format!("parsing JSON: {e}")));
                }
                Some(Err(_)) => {
                    // As upstream: the blanks after the last object, through the first line
                    // break, are not YAML's to read.
                    let after = &trimmed[consumed..];
                    let blanks = after.len() - after.trim_start_matches([' ', '\t', '\r']).len();
                    rest = after[blanks..]
                        .strip_prefix('\n')
                        .unwrap_or(&after[blanks..]);
                    break;
                }
            }
        }
    }
    for doc in serde_yaml_ng::Deserializer::from_str(rest) {
        match <strict::NoDupValue as serde::Deserialize>::deserialize(doc) {
            Ok(v) => docs.push(v.0),
            Err(e) => return Err((docs.len(), format!("parsing YAML: {e}"))),
        }
    }
    Ok(docs)
}

/// The documents of one input, each with its location, `List` documents expanded into their
/// items; empty documents are left out. Not decoded or checked (for `dractl lint`, which reads
/// more kinds than [`Reader`]).
///
/// # Errors
/// A document that is not YAML or JSON.
pub fn documents(file: &str, text: &str) -> Result<Vec<(Location, Value)>, InputError> {
    let mut out = Vec::new();
    for (location, value) in split(file, text)? {
        match value {
            Value::Object(ref map)
                if map.get("kind").and_then(Value::as_str) == Some("List")
                    && map.get("apiVersion").and_then(Value::as_str) == Some("v1") =>
            {
                let items = map.get("items").and_then(Value::as_array).cloned();
                for (i, item) in items.into_iter().flatten().enumerate() {
                    let mut l = location.clone();
                    l.item = Some(i);
                    out.push((l, item));
                }
            }
            other => out.push((location, other)),
        }
    }
    Ok(out)
}

/// The non-empty documents of one input with their locations.
fn split(file: &str, text: &str) -> Result<Vec<(Location, Value)>, InputError> {
    let location = |document| Location {
        file: file.into(),
        document,
        item: None,
    };
    let docs = split_documents(text).map_err(|(document, message)| InputError {
        location: Some(location(document)),
        object: None,
        message,
    })?;
    Ok(docs
        .into_iter()
        .enumerate()
        .filter(|(_, v)| !v.is_null())
        .map(|(document, value)| (location(document), value))
        .collect())
}

/// The text of one input: a file, or stdin for `-`.
///
/// # Errors
/// An unreadable file, named.
pub fn read_input(path: &str) -> Result<String, InputError> {
    if path == "-" {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
            .map_err(|e| InputError::general(format!("-: reading stdin: {e}")))?;
        Ok(s)
    } else {
        std::fs::read_to_string(path).map_err(|e| InputError::general(format!("{path}: {e}")))
    }
}

/// Reads the named files in order (`-` is stdin), each at most once per name as given.
///
/// # Errors
/// The first problem found: an unreadable file, or an [`InputError`] for its content.
pub fn load_files(paths: &[String]) -> Result<Inputs, InputError> {
    let mut reader = Reader::new();
    for path in paths {
        reader.read_str(path, &read_input(path)?)?;
    }
    Ok(reader.finish())
}

#[cfg(test)]
mod tests;

/// The `n`th 5-character suffix for `generateName` (the API server's alphabet: no vowels, no
/// digits that read as letters).
fn generated_suffix(n: usize) -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut n = n;
    let mut out = [b'b'; 5];
    for c in out.iter_mut().rev() {
        *c = ALPHABET[n % ALPHABET.len()];
        n /= ALPHABET.len();
    }
    String::from_utf8_lossy(&out).into_owned()
}
