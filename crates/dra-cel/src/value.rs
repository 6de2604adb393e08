//! Runtime values, borrowed from the device where possible.

use std::cmp::Ordering;
use std::sync::Arc;

use crate::device::DeviceView;
use crate::libs::format::Format;
use crate::libs::ip::{Addr, Prefix};
use crate::libs::quantity::QuantityValue;
use crate::libs::semver::Semver;
use crate::libs::url::Url;
use crate::types::Type;

/// A string value: borrowed from the device or the program, or shared.
#[derive(Clone, Debug)]
pub enum Str<'a> {
    /// Borrowed for the evaluation.
    Borrowed(&'a str),
    /// Owned and shared.
    Shared(Arc<str>),
}

impl Str<'_> {
    /// The text.
    pub fn as_str(&self) -> &str {
        match self {
            Str::Borrowed(s) => s,
            Str::Shared(s) => s,
        }
    }
}

/// A CEL value during evaluation.
#[derive(Clone, Debug)]
pub enum Value<'a> {
    /// `null`.
    Null,
    /// `bool`.
    Bool(bool),
    /// `int`.
    Int(i64),
    /// `uint`.
    Uint(u64),
    /// `double`.
    Double(f64),
    /// `string`.
    String(Str<'a>),
    /// `bytes`.
    Bytes(Arc<[u8]>),
    /// `list(T)`.
    List(Arc<Vec<Value<'a>>>),
    /// `map(K, V)`, in insertion order.
    Map(Arc<Vec<(Value<'a>, Value<'a>)>>),
    /// A type value (`type(x)`, `int`).
    Type(&'static str),
    /// `optional_type(T)`.
    Optional(Option<Arc<Value<'a>>>),
    /// `kubernetes.Quantity`: upstream's `*resource.Quantity`, shared by its copies.
    Quantity(QuantityValue),
    /// `kubernetes.Semver`.
    Semver(Arc<Semver>),
    /// `net.IP`.
    Ip(Addr),
    /// `net.CIDR`.
    Cidr(Prefix),
    /// `kubernetes.URL`.
    Url(Arc<Url>),
    /// `kubernetes.NamedFormat`.
    Format(Format),
    /// The `device` variable.
    Device(&'a DeviceView<'a>),
    /// `device.attributes`: domain -> map of attributes.
    Attributes(&'a DeviceView<'a>),
    /// `device.attributes[domain]`.
    AttributeDomain(&'a DeviceView<'a>, Str<'a>),
    /// `device.capacity`.
    Capacity(&'a DeviceView<'a>),
    /// `device.capacity[domain]`.
    CapacityDomain(&'a DeviceView<'a>, Str<'a>),
    /// An error held in a comprehension accumulator (cel-go keeps errors as values there).
    Error(Arc<str>),
}

impl<'a> Value<'a> {
    /// A shared string.
    pub fn string(s: &str) -> Value<'a> {
        Value::String(Str::Shared(Arc::from(s)))
    }

    /// The CEL type name of the value, as `type(x)` shows it.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::Null => "null_type",
            Value::Bool(_) => "bool",
            Value::Int(_) => "int",
            Value::Uint(_) => "uint",
            Value::Double(_) => "double",
            Value::String(_) => "string",
            Value::Bytes(_) => "bytes",
            Value::List(_) => "list",
            Value::Map(_)
            | Value::Attributes(_)
            | Value::AttributeDomain(..)
            | Value::Capacity(_)
            | Value::CapacityDomain(..) => "map",
            Value::Type(_) => "type",
            Value::Optional(_) => "optional_type",
            Value::Quantity(_) => "kubernetes.Quantity",
            Value::Semver(_) => "kubernetes.Semver",
            Value::Ip(_) => "net.IP",
            Value::Cidr(_) => "net.CIDR",
            Value::Url(_) => "kubernetes.URL",
            Value::Format(_) => "kubernetes.NamedFormat",
            Value::Device(_) => "kubernetes.DRADevice",
            Value::Error(_) => "*error*",
        }
    }

    pub(crate) fn quantity(&self) -> Option<&QuantityValue> {
        match self {
            Value::Quantity(q) => Some(q),
            _ => None,
        }
    }

    /// Size as cel-go's `traits.Sizer` reports it (strings in code points), for cost tracking.
    pub(crate) fn actual_size(&self) -> u64 {
        match self {
            Value::String(s) => s.as_str().chars().count() as u64,
            Value::Bytes(b) => b.len() as u64,
            Value::List(l) => l.len() as u64,
            Value::Map(m) => m.len() as u64,
            Value::Attributes(d) => d.attribute_domains().len() as u64,
            Value::Capacity(d) => d.capacity_domains().len() as u64,
            Value::AttributeDomain(d, dom) => d.attribute_names(dom.as_str()).count() as u64,
            Value::CapacityDomain(d, dom) => d.capacity_count(dom.as_str()) as u64,
            Value::Optional(Some(v)) => v.actual_size(),
            // The IP and CIDR types are sized in bytes: the address, the prefix rounded up.
            Value::Ip(a) => u64::from(a.family() == 6) * 12 + 4,
            Value::Cidr(p) => u64::from(p.bits).div_ceil(8),
            _ => 1,
        }
    }
}

/// The runtime type name for a checked type used as a value (`int`, `list`, ...).
pub(crate) fn type_name_of(t: &Type) -> &'static str {
    match t {
        Type::Bool => "bool",
        Type::Int => "int",
        Type::Uint => "uint",
        Type::Double => "double",
        Type::String => "string",
        Type::Bytes => "bytes",
        Type::Null => "null_type",
        Type::List(_) => "list",
        Type::Map(..) => "map",
        _ => "dyn",
    }
}

/// Outcome of an equality test: cel-go returns an error value for some custom types.
pub(crate) enum Eq {
    True,
    False,
    NoOverload,
    /// Upstream's `Equal` panics (a quantity comparison whose int32 scale difference wraps);
    /// cel-go ends the evaluation with an internal error.
    Panic(String),
}

impl Eq {
    fn from(b: bool) -> Eq {
        if b { Eq::True } else { Eq::False }
    }
}

fn num_eq(a: &Value<'_>, b: &Value<'_>) -> Option<bool> {
    Some(match (a, b) {
        (Value::Int(x), Value::Int(y)) => x == y,
        (Value::Uint(x), Value::Uint(y)) => x == y,
        (Value::Double(x), Value::Double(y)) => x == y,
        (Value::Int(x), Value::Uint(y)) | (Value::Uint(y), Value::Int(x)) => {
            u64::try_from(*x).is_ok_and(|x| x == *y)
        }
        (Value::Int(x), Value::Double(y)) | (Value::Double(y), Value::Int(x)) => {
            cmp_int_double(*x, *y) == Some(Ordering::Equal)
        }
        (Value::Uint(x), Value::Double(y)) | (Value::Double(y), Value::Uint(x)) => {
            cmp_uint_double(*x, *y) == Some(Ordering::Equal)
        }
        _ => return None,
    })
}

/// Compares an int with a double exactly (cel-go `compareIntDouble`).
pub(crate) fn cmp_int_double(i: i64, d: f64) -> Option<Ordering> {
    if d.is_nan() {
        return None;
    }
    if d < -9.223_372_036_854_776e18 {
        return Some(Ordering::Greater);
    }
    if d > 9.223_372_036_854_776e18 {
        return Some(Ordering::Less);
    }
    if d == 9.223_372_036_854_776e18 {
        // cel-go compares as doubles, where every int is at most 2^63: never greater.
        return Some(if (i as f64) < d {
            Ordering::Less
        } else {
            Ordering::Equal
        });
    }
    (i as f64).partial_cmp(&d).map(|o| {
        if o == Ordering::Equal {
            // Large magnitudes lose precision as doubles; compare as integers then.
            i.cmp(&(d as i64))
        } else {
            o
        }
    })
}

/// Compares a uint with a double exactly (cel-go `compareUintDouble`).
pub(crate) fn cmp_uint_double(u: u64, d: f64) -> Option<Ordering> {
    if d.is_nan() {
        return None;
    }
    if d < 0.0 {
        return Some(Ordering::Greater);
    }
    if d >= 1.844_674_407_370_955_2e19 {
        return Some(Ordering::Less);
    }
    (u as f64).partial_cmp(&d).map(|o| {
        if o == Ordering::Equal {
            u.cmp(&(d as u64))
        } else {
            o
        }
    })
}

/// Heterogeneous equality as cel-go's `types.Equal` (v0.26.0): different types are unequal,
/// numbers compare across int/uint/double, and the Kubernetes quantity and semver types return
/// "no such overload" when the other side is of another type.
pub(crate) fn equals(a: &Value<'_>, b: &Value<'_>) -> Eq {
    // `types.Equal`: a comparison with null is decided before the types' own equality.
    let (an, bn) = (matches!(a, Value::Null), matches!(b, Value::Null));
    if an || bn {
        return Eq::from(an && bn);
    }
    if let Some(r) = num_eq(a, b) {
        return Eq::from(r);
    }
    match (a, b) {
        (Value::Null, Value::Null) => Eq::True,
        (Value::Bool(x), Value::Bool(y)) => Eq::from(x == y),
        (Value::String(x), Value::String(y)) => Eq::from(x.as_str() == y.as_str()),
        (Value::Bytes(x), Value::Bytes(y)) => Eq::from(x == y),
        (Value::Type(x), Value::Type(y)) => Eq::from(x == y),
        (Value::Quantity(x), _) => match b.quantity() {
            // Upstream's add/sub return a pointer, which a plain quantity's Equal rejects.
            Some(y) if !y.boxed => match x.equals(y) {
                Ok(e) => Eq::from(e),
                Err(e) => Eq::Panic(e.to_string()),
            },
            _ => Eq::NoOverload,
        },
        (Value::Semver(x), Value::Semver(y)) => Eq::from(x.cmp(y) == Ordering::Equal),
        (Value::Semver(_), _) => Eq::NoOverload,
        // The IP, CIDR and URL types' `Equal` reject other types with "no such overload".
        (Value::Ip(x), Value::Ip(y)) => Eq::from(x == y),
        (Value::Cidr(x), Value::Cidr(y)) => Eq::from(x == y),
        (Value::Url(x), Value::Url(y)) => Eq::from(x.to_string() == y.to_string()),
        (Value::Ip(_) | Value::Cidr(_) | Value::Url(_), _) => Eq::NoOverload,
        // `cel.Format.Equal` compares names and rejects other types.
        (Value::Format(x), Value::Format(y)) => Eq::from(x == y),
        (Value::Format(_), _) => Eq::NoOverload,
        (Value::Optional(x), Value::Optional(y)) => match (x, y) {
            (None, None) => Eq::True,
            (Some(x), Some(y)) => equals(x, y),
            _ => Eq::False,
        },
        (Value::List(x), Value::List(y)) => {
            if x.len() != y.len() {
                return Eq::False;
            }
            // cel-go's list equality treats an element comparison error as no mismatch.
            for (p, q) in x.iter().zip(y.iter()) {
                match equals(p, q) {
                    e @ (Eq::False | Eq::Panic(_)) => return e,
                    Eq::True | Eq::NoOverload => {}
                }
            }
            Eq::True
        }
        (Value::Device(_), _) | (_, Value::Device(_)) => Eq::False,
        _ if is_map(a) && is_map(b) => {
            let (x, y) = (map_entries(a), map_entries(b));
            if x.len() != y.len() {
                return Eq::False;
            }
            for (k, v) in x.iter() {
                // As for lists, a value comparison error is no mismatch (cel-go `baseMap.Equal`).
                match map_find(&y, k) {
                    Some(w) if !matches!(equals(v, &w), Eq::False) => {}
                    _ => return Eq::False,
                }
            }
            Eq::True
        }
        _ => Eq::False,
    }
}

pub(crate) fn is_map(v: &Value<'_>) -> bool {
    matches!(
        v,
        Value::Map(_)
            | Value::Attributes(_)
            | Value::AttributeDomain(..)
            | Value::Capacity(_)
            | Value::CapacityDomain(..)
    )
}

/// Materialises any map value as entries.
pub(crate) fn map_entries<'a>(v: &Value<'a>) -> Vec<(Value<'a>, Value<'a>)> {
    match v {
        Value::Map(m) => m.as_ref().clone(),
        Value::Attributes(d) => d
            .attribute_domains()
            .into_iter()
            .map(|dom| {
                (
                    Value::String(Str::Borrowed(dom)),
                    Value::AttributeDomain(d, Str::Borrowed(dom)),
                )
            })
            .collect(),
        Value::Capacity(d) => d
            .capacity_domains()
            .into_iter()
            .map(|dom| {
                (
                    Value::String(Str::Borrowed(dom)),
                    Value::CapacityDomain(d, Str::Borrowed(dom)),
                )
            })
            .collect(),
        Value::AttributeDomain(d, dom) => d
            .attribute_names(dom.as_str())
            .filter_map(|(name, attr)| {
                Some((
                    Value::String(Str::Borrowed(name)),
                    d.attribute_value(attr).ok()?,
                ))
            })
            .collect(),
        Value::CapacityDomain(d, dom) => d
            .capacity_names(dom.as_str())
            .map(|(name, q)| (Value::String(Str::Borrowed(name)), Value::Quantity(q)))
            .collect(),
        _ => Vec::new(),
    }
}

/// Key lookup in a map with cel-go's key equality (numeric keys compare across types).
pub(crate) fn map_find<'a>(
    entries: &[(Value<'a>, Value<'a>)],
    key: &Value<'_>,
) -> Option<Value<'a>> {
    entries
        .iter()
        .find(|(k, _)| matches!(equals(k, key), Eq::True) && same_key_kind(k, key))
        .map(|(_, v)| v.clone())
}

fn same_key_kind(a: &Value<'_>, b: &Value<'_>) -> bool {
    let numeric = |v: &Value<'_>| matches!(v, Value::Int(_) | Value::Uint(_) | Value::Double(_));
    numeric(a) == numeric(b)
}

/// Whether two map-literal keys are the same Go map key in cel-go: scalars of the same CEL
/// type with equal values (so `1` and `1u` are distinct); containers never are.
pub(crate) fn same_go_key(a: &Value<'_>, b: &Value<'_>) -> bool {
    match (a, b) {
        (Value::Int(x), Value::Int(y)) => x == y,
        (Value::Uint(x), Value::Uint(y)) => x == y,
        (Value::Double(x), Value::Double(y)) => x == y,
        (Value::Bool(x), Value::Bool(y)) => x == y,
        (Value::String(x), Value::String(y)) => x.as_str() == y.as_str(),
        (Value::Null, Value::Null) => true,
        _ => false,
    }
}
