//! A device's attributes as the search reads them: one table per ResourceSlice, device after
//! device, with names and short string values matched without reading them (a device is
//! usually cold in memory when the search reaches it, and these tables sit side by side).
//!
//! Two lookups with upstream's two rules: [`lookup`] for constraints (`lookupAttribute` in
//! `structured/internal/incubating/allocator_incubating.go`: the qualified name first, then the
//! bare id in the driver's domain) and [`compare`] for selectors (the CEL environment's
//! attribute map, see `dra_cel::DeviceView`).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::DeviceAttribute;

/// A scalar attribute value, borrowed from the device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Value<'v> {
    String(&'v str),
    Int(i64),
    Bool(bool),
    Version(&'v str),
    /// None of the scalar fields set.
    Unknown,
}

impl std::fmt::Display for Value<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Value::String(s) => write!(f, "{s:?}"),
            Value::Int(i) => write!(f, "{i}"),
            Value::Bool(b) => write!(f, "{b}"),
            Value::Version(v) => write!(f, "version {v}"),
            Value::Unknown => f.write_str("(no value)"),
        }
    }
}

/// The value constraints compare (upstream's `lookupAttribute` takes the first of string,
/// int, bool, version).
fn value_of(a: &DeviceAttribute) -> Value<'_> {
    if let Some(s) = &a.string {
        Value::String(s)
    } else if let Some(i) = a.int {
        Value::Int(i)
    } else if let Some(b) = a.bool {
        Value::Bool(b)
    } else if let Some(v) = &a.version {
        Value::Version(v)
    } else {
        Value::Unknown
    }
}

/// Exactly one value field is set (what API validation requires): then every reader sees
/// the same value, whatever order it checks the fields in.
fn single(a: &DeviceAttribute) -> bool {
    let set = [
        a.string.is_some(),
        a.int.is_some(),
        a.bool.is_some(),
        a.version.is_some(),
    ];
    set.iter().filter(|s| **s).count() == 1
}

/// Where a name is matched: its first eight bytes and its length, so most names are told
/// apart, and names of up to eight bytes matched, without reading them.
#[derive(Debug, Clone, Copy)]
struct Key {
    head: u64,
    len: usize,
}

/// An attribute's value, with what comparisons need inline.
#[derive(Debug, Clone, Copy)]
struct Entry<'v> {
    value: Value<'v>,
    /// The first eight bytes of a string value.
    value_head: u64,
    single: bool,
}

/// The attributes of a slice's devices, device after device, in three parallel columns: keys
/// (16 bytes each, what a lookup scans), full names (read only for names over eight bytes) and
/// values (read only for the attribute found).
#[derive(Debug, Default)]
pub(crate) struct AttributeTable<'v> {
    keys: Vec<Key>,
    names: Vec<&'v str>,
    entries: Vec<Entry<'v>>,
}

/// One device's attributes in an [`AttributeTable`].
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Attributes<'t, 'v> {
    keys: &'t [Key],
    names: &'t [&'v str],
    entries: &'t [Entry<'v>],
}

/// The first eight bytes of a string, zero-padded.
fn head(name: &str) -> u64 {
    let mut bytes = [0u8; 8];
    for (b, n) in bytes.iter_mut().zip(name.bytes()) {
        *b = n;
    }
    u64::from_le_bytes(bytes)
}

/// Whether `s` (with its `s_head`) is `want` (with its `want_head`): strings of up to eight
/// bytes are compared without reading them.
fn same(s: &str, s_head: u64, want: &str, want_head: u64) -> bool {
    s_head == want_head && s.len() == want.len() && (want.len() <= 8 || s == want)
}

impl<'v> AttributeTable<'v> {
    /// Adds a device's attributes (in map order); returns where they are.
    pub fn push(
        &mut self,
        attributes: Option<&'v BTreeMap<String, DeviceAttribute>>,
    ) -> std::ops::Range<usize> {
        let start = self.keys.len();
        for (name, a) in attributes.into_iter().flatten() {
            let value = value_of(a);
            self.keys.push(Key {
                head: head(name),
                len: name.len(),
            });
            self.names.push(name);
            self.entries.push(Entry {
                value,
                value_head: match value {
                    Value::String(s) => head(s),
                    _ => 0,
                },
                single: single(a),
            });
        }
        start..self.keys.len()
    }

    /// The attributes of the device at `range` (empty if out of range).
    pub fn device(&self, range: std::ops::Range<usize>) -> Attributes<'_, 'v> {
        match (
            self.keys.get(range.clone()),
            self.names.get(range.clone()),
            self.entries.get(range),
        ) {
            (Some(keys), Some(names), Some(entries)) => Attributes {
                keys,
                names,
                entries,
            },
            _ => Attributes::default(),
        }
    }
}

impl<'v> Attributes<'_, 'v> {
    /// Starts loading the device's attribute keys and values into the cache without waiting
    /// for them: the search calls it as soon as a device passes the cheap checks, so that these
    /// two cold lines arrive while it works on the device's record, instead of one after the
    /// other when a constraint or selector first reads them. (A plain load the processor need
    /// not wait for: nothing consumes the value.)
    pub fn start_loading(&self) {
        std::hint::black_box(self.keys.first().map(|k| k.head));
        std::hint::black_box(self.entries.first().map(|e| e.value_head));
    }

    /// Whether attribute `i` is named `name` (whose first eight bytes are `name_head`).
    fn is(&self, i: usize, name: &str, name_head: u64) -> bool {
        self.keys.get(i).is_some_and(|k| {
            k.head == name_head
                && k.len == name.len()
                && (name.len() <= 8 || self.names.get(i).is_some_and(|n| *n == name))
        })
    }
}

/// `lookupAttribute`: the fully qualified name, or the bare ID when the domain is the driver's.
pub(crate) fn lookup<'v>(
    attributes: Attributes<'_, 'v>,
    driver: &str,
    name: &str,
) -> Option<Value<'v>> {
    let bare = match name.split_once('/') {
        Some((domain, id)) if domain == driver => Some((id, head(id))),
        _ => None,
    };
    let name_head = head(name);
    let mut by_id = None;
    for i in 0..attributes.keys.len() {
        if attributes.is(i, name, name_head) {
            return attributes.entries.get(i).map(|e| e.value);
        }
        if let Some((id, id_head)) = bare
            && attributes.is(i, id, id_head)
        {
            by_id = Some(i);
        }
    }
    attributes.entries.get(by_id?).map(|e| e.value)
}

/// A selector of the form `device.attributes["domain"].id == literal` answered from the
/// table: `None` where the CEL evaluator must decide (the attribute absent, not one scalar, a
/// version, or of another type than the literal; see [`dra_cel::AttributeComparison`]).
///
/// The attribute is the one `dra_cel::DeviceView` reads: keys split at their first '/', the
/// bare id in the driver's domain, the later key in map order when both spellings exist.
pub(crate) fn compare(
    attributes: Attributes<'_, '_>,
    driver: &str,
    c: &dra_cel::AttributeComparison<'_>,
) -> Option<bool> {
    if c.domain.contains('/') {
        // No key splits into such a domain: the evaluator reports the absent attribute.
        return None;
    }
    let qualified = (c.qualified, head(c.qualified));
    let bare = (c.domain == driver && !c.id.contains('/')).then(|| (c.id, head(c.id)));
    let mut found = None;
    for i in 0..attributes.keys.len() {
        if attributes.is(i, qualified.0, qualified.1)
            || bare.is_some_and(|(id, h)| attributes.is(i, id, h))
        {
            found = Some(i);
        }
    }
    let a = attributes.entries.get(found?)?;
    if !a.single {
        return None;
    }
    match (a.value, c.literal) {
        (Value::String(v), dra_cel::LiteralRef::String(l)) => {
            Some(same(v, a.value_head, l, head(l)))
        }
        (Value::Int(v), dra_cel::LiteralRef::Int(l)) => Some(v == l),
        (Value::Bool(v), dra_cel::LiteralRef::Bool(l)) => Some(v == l),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attribute(json: &str) -> DeviceAttribute {
        serde_json::from_str(json).expect("attribute")
    }

    /// Wherever the table answers a selector, the CEL evaluator gives the same answer.
    #[test]
    fn the_table_answers_selectors_as_cel_does() {
        let driver = "d.example.com";
        let devices: Vec<BTreeMap<String, DeviceAttribute>> = [
            vec![
                ("model", r#"{"string": "H100"}"#),
                ("n", r#"{"int": 3}"#),
                ("b", r#"{"bool": true}"#),
                ("v", r#"{"version": "1.2.3"}"#),
            ],
            vec![
                (
                    "d.example.com/model",
                    r#"{"string": "A100-SXM4-80GB-long-name"}"#,
                ),
                ("other.io/n", r#"{"int": 4}"#),
            ],
            vec![
                ("model", r#"{"string": "H100"}"#),
                ("d.example.com/model", r#"{"string": "B200"}"#),
            ],
            vec![
                ("model", r#"{"string": "H100", "int": 1}"#),
                ("a/b/c", r#"{"int": 5}"#),
            ],
            vec![("model", r#"{"int": 7}"#), ("n", r#"{"string": "3"}"#)],
        ]
        .iter()
        .map(|pairs| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), attribute(v)))
                .collect()
        })
        .collect();
        let expressions = [
            r#"device.attributes["d.example.com"].model == "H100""#,
            r#"device.attributes["d.example.com"].model == "B200""#,
            r#"device.attributes["d.example.com"]["model"] == "A100-SXM4-80GB-long-name""#,
            r#"device.attributes["d.example.com"].model == "A100-SXM4-80GB-long-nam""#,
            r#"device.attributes["d.example.com"].n == 3"#,
            r#"device.attributes["other.io"].n == 4"#,
            r#"device.attributes["d.example.com"].b == true"#,
            r#"device.attributes["d.example.com"].v == "1.2.3""#,
            r#"device.attributes["d.example.com"].model == 7"#,
            r#"device.attributes["a"]["b/c"] == 5"#,
            r#"device.attributes["a/b"].c == 5"#,
        ];
        let compiler =
            dra_cel::Compiler::new(dra_cel::Features::default(), dra_cel::Environment::Stored);
        let mut answered = 0;
        for e in expressions {
            let compiled = compiler.compile(e).expect(e);
            let c = compiled
                .attribute_comparison()
                .expect("an attribute comparison");
            for attrs in &devices {
                let mut table = AttributeTable::default();
                let range = table.push(Some(attrs));
                let Some(answer) = compare(table.device(range), driver, &c) else {
                    continue;
                };
                answered += 1;
                let device = dra_cel::Device {
                    driver: driver.into(),
                    attributes: attrs
                        .iter()
                        .map(|(k, a)| {
                            let cel = dra_cel::DeviceAttribute {
                                int: a.int,
                                bool: a.bool,
                                string: a.string.clone(),
                                version: a.version.clone(),
                                ..Default::default()
                            };
                            (k.clone(), cel)
                        })
                        .collect(),
                    ..Default::default()
                };
                assert_eq!(compiled.matches(&device), Ok(answer), "{e} on {attrs:?}");
            }
        }
        assert!(answered >= 12, "the table answered {answered} times");
    }
}
