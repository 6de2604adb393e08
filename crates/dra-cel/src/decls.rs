//! Function declarations of the DRA CEL environment: the CEL standard library plus the
//! libraries Kubernetes adds (`k8s.io/apiserver/pkg/cel/environment/base.go`, v0.36.3) and the
//! DRA `includes` function (`k8s.io/dynamic-resource-allocation/cel/compile.go`).
//!
//! Declarations are written in a small signature language, `id: [.]arg, arg -> result`, where a
//! leading `.` marks a member (receiver-style) overload and single capital letters are type
//! parameters.

use std::collections::HashMap;
use std::sync::LazyLock;

use crate::types::{CIDR, FORMAT, IP, QUANTITY, SEMVER, Type, URL};

/// One overload of a function.
#[derive(Debug)]
pub(crate) struct Overload {
    /// Upstream overload id (used by the cost model).
    pub id: &'static str,
    /// Receiver-style call (`x.f(y)`) rather than global (`f(x, y)`).
    pub member: bool,
    /// Argument types, the receiver first for member overloads.
    pub args: Vec<Type>,
    /// Result type.
    pub result: Type,
    /// Only in environments with list-type attributes (DRAListTypeAttributes).
    pub list_attributes_only: bool,
}

fn parse_type(s: &str) -> Type {
    let s = s.trim();
    if let Some(inner) = s.strip_prefix("list(").and_then(|r| r.strip_suffix(')')) {
        return Type::list(parse_type(inner));
    }
    if let Some(inner) = s.strip_prefix("map(").and_then(|r| r.strip_suffix(')')) {
        let (k, v) = split_top(inner);
        return Type::map(parse_type(k), parse_type(v));
    }
    if let Some(inner) = s
        .strip_prefix("optional(")
        .and_then(|r| r.strip_suffix(')'))
    {
        return Type::optional(parse_type(inner));
    }
    if let Some(inner) = s.strip_prefix("type(").and_then(|r| r.strip_suffix(')')) {
        return Type::Type(Box::new(parse_type(inner)));
    }
    match s {
        "int" => Type::Int,
        "uint" => Type::Uint,
        "double" => Type::Double,
        "bool" => Type::Bool,
        "string" => Type::String,
        "bytes" => Type::Bytes,
        "null" => Type::Null,
        "dyn" => Type::Dyn,
        "quantity" => Type::opaque(QUANTITY),
        "semver" => Type::opaque(SEMVER),
        "url" => Type::opaque(URL),
        "format" => Type::opaque(FORMAT),
        "ip" => Type::opaque(IP),
        "cidr" => Type::opaque(CIDR),
        "timestamp" => Type::opaque("google.protobuf.Timestamp"),
        "duration" => Type::opaque("google.protobuf.Duration"),
        "A" => Type::Param(0),
        "B" => Type::Param(1),
        "K" => Type::Param(2),
        "V" => Type::Param(3),
        other => unreachable_type(other),
    }
}

// A malformed declaration is a programming error caught by the unit test that builds the table.
fn unreachable_type(s: &str) -> Type {
    debug_assert!(false, "bad type in declaration: {s}");
    Type::Error
}

fn split_top(s: &str) -> (&str, &str) {
    let mut depth = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => return (&s[..i], &s[i + 1..]),
            _ => {}
        }
    }
    (s, "")
}

fn split_args(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        let (a, r) = split_top(rest);
        out.push(a.trim());
        rest = r.trim();
    }
    out
}

fn overload(sig: &'static str) -> Overload {
    let (id, rest) = sig.split_once(':').unwrap_or(("", sig));
    let (args, result) = rest.split_once("->").unwrap_or((rest, "dyn"));
    let args = args.trim();
    let (member, args) = match args.strip_prefix('.') {
        Some(a) => (true, a),
        None => (false, args),
    };
    Overload {
        id: id.trim(),
        member,
        args: split_args(args).into_iter().map(parse_type).collect(),
        result: parse_type(result),
        list_attributes_only: false,
    }
}

const NUMERIC_CMP: &[(&str, &str)] = &[
    ("bool", "bool"),
    ("int", "int"),
    ("uint", "uint"),
    ("double", "double"),
    ("string", "string"),
    ("bytes", "bytes"),
    ("int", "uint"),
    ("int", "double"),
    ("uint", "int"),
    ("uint", "double"),
    ("double", "int"),
    ("double", "uint"),
    // Declared so that checking matches upstream (`null` is assignable to both); no value of
    // these types can be built in this environment, so they never match at runtime.
    ("timestamp", "timestamp"),
    ("duration", "duration"),
];

/// Comparison overloads with cel-go's ids (`less_string`, `less_int64_double`, ...), which the
/// cost model keys on.
fn comparisons(name: &str) -> Vec<Overload> {
    let go = |t: &str| {
        match t {
            "int" => "int64",
            "uint" => "uint64",
            other => other,
        }
        .to_string()
    };
    NUMERIC_CMP
        .iter()
        .map(|(a, b)| {
            let id = if a == b {
                format!("{name}_{}", go(a))
            } else {
                format!("{name}_{}_{}", go(a), go(b))
            };
            let sig: &'static str = Box::leak(format!("{id}: {a}, {b} -> bool").into_boxed_str());
            overload(sig)
        })
        .collect()
}

/// Whether overload `id` of function `name` is a member (receiver-style) overload.
pub(crate) fn is_member(name: &str, id: &str) -> Option<bool> {
    FUNCTIONS
        .get(name)?
        .iter()
        .find(|o| o.id == id)
        .map(|o| o.member)
}

fn templated(prefix: &str, member: bool, types: &[&str], shape: &str) -> Vec<Overload> {
    types
        .iter()
        .map(|t| {
            let dot = if member { "." } else { "" };
            let body = shape.replace('T', t);
            let sig: &'static str =
                Box::leak(format!("{prefix}_{t}: {dot}{body}").into_boxed_str());
            overload(sig)
        })
        .collect()
}

/// All declared functions by name.
pub(crate) static FUNCTIONS: LazyLock<HashMap<&'static str, Vec<Overload>>> = LazyLock::new(|| {
    let mut m: HashMap<&'static str, Vec<Overload>> = HashMap::new();
    let mut add = |name: &'static str, sigs: &[&'static str]| {
        m.entry(name)
            .or_default()
            .extend(sigs.iter().map(|s| overload(s)));
    };
    add(
        "_+_",
        &[
            "add_int64: int, int -> int",
            "add_uint64: uint, uint -> uint",
            "add_double: double, double -> double",
            "add_string: string, string -> string",
            "add_bytes: bytes, bytes -> bytes",
            "add_list: list(A), list(A) -> list(A)",
        ],
    );
    add(
        "_-_",
        &[
            "subtract_int64: int, int -> int",
            "subtract_uint64: uint, uint -> uint",
            "subtract_double: double, double -> double",
        ],
    );
    add(
        "_*_",
        &[
            "multiply_int64: int, int -> int",
            "multiply_uint64: uint, uint -> uint",
            "multiply_double: double, double -> double",
        ],
    );
    add(
        "_/_",
        &[
            "divide_int64: int, int -> int",
            "divide_uint64: uint, uint -> uint",
            "divide_double: double, double -> double",
        ],
    );
    add(
        "_%_",
        &[
            "modulo_int64: int, int -> int",
            "modulo_uint64: uint, uint -> uint",
        ],
    );
    add(
        "-_",
        &[
            "negate_int64: int -> int",
            "negate_double: double -> double",
        ],
    );
    add("!_", &["logical_not: bool -> bool"]);
    add("@not_strictly_false", &["not_strictly_false: bool -> bool"]);
    add("_&&_", &["logical_and: bool, bool -> bool"]);
    add("_||_", &["logical_or: bool, bool -> bool"]);
    add("_?_:_", &["conditional: bool, A, A -> A"]);
    add("_==_", &["equals: A, A -> bool"]);
    add("_!=_", &["not_equals: A, A -> bool"]);
    add(
        "_[_]",
        &[
            "index_list: list(A), int -> A",
            "index_map: map(K,V), K -> V",
        ],
    );
    add(
        "@in",
        &["in_list: A, list(A) -> bool", "in_map: K, map(K,V) -> bool"],
    );
    add(
        "size",
        &[
            "size_string: string -> int",
            "size_bytes: bytes -> int",
            "size_list: list(A) -> int",
            "size_map: map(K,V) -> int",
            "string_size: .string -> int",
            "bytes_size: .bytes -> int",
            "list_size: .list(A) -> int",
            "map_size: .map(K,V) -> int",
        ],
    );
    for (op, name) in [
        ("_<_", "less"),
        ("_<=_", "less_equals"),
        ("_>_", "greater"),
        ("_>=_", "greater_equals"),
    ] {
        m.entry(op).or_default().extend(comparisons(name));
    }
    let mut add = |name: &'static str, sigs: &[&'static str]| {
        m.entry(name)
            .or_default()
            .extend(sigs.iter().map(|s| overload(s)));
    };
    add(
        "int",
        &[
            "int_to_int: int -> int",
            "uint_to_int: uint -> int",
            "double_to_int: double -> int",
            "string_to_int: string -> int",
        ],
    );
    add(
        "uint",
        &[
            "uint_to_uint: uint -> uint",
            "int_to_uint: int -> uint",
            "double_to_uint: double -> uint",
            "string_to_uint: string -> uint",
        ],
    );
    add(
        "double",
        &[
            "double_to_double: double -> double",
            "int_to_double: int -> double",
            "uint_to_double: uint -> double",
            "string_to_double: string -> double",
        ],
    );
    add(
        "string",
        &[
            "string_to_string: string -> string",
            "int_to_string: int -> string",
            "uint_to_string: uint -> string",
            "double_to_string: double -> string",
            "bool_to_string: bool -> string",
            "bytes_to_string: bytes -> string",
            "ip_to_string: ip -> string",
            "cidr_to_string: cidr -> string",
        ],
    );
    add(
        "bytes",
        &[
            "bytes_to_bytes: bytes -> bytes",
            "string_to_bytes: string -> bytes",
        ],
    );
    add(
        "bool",
        &[
            "bool_to_bool: bool -> bool",
            "string_to_bool: string -> bool",
        ],
    );
    add("dyn", &["to_dyn: A -> dyn"]);
    add("type", &["type: A -> type(A)"]);
    add("contains", &["contains_string: .string, string -> bool"]);
    add(
        "startsWith",
        &["starts_with_string: .string, string -> bool"],
    );
    add("endsWith", &["ends_with_string: .string, string -> bool"]);
    add(
        "matches",
        &[
            "matches: string, string -> bool",
            "matches_string: .string, string -> bool",
        ],
    );
    // Strings extension, version 2 (cel-go ext/strings.go).
    add("charAt", &["string_char_at_int: .string, int -> string"]);
    add(
        "indexOf",
        &[
            "string_index_of_string: .string, string -> int",
            "string_index_of_string_int: .string, string, int -> int",
            "list_a_index_of_int: .list(A), A -> int",
        ],
    );
    add(
        "lastIndexOf",
        &[
            "string_last_index_of_string: .string, string -> int",
            "string_last_index_of_string_int: .string, string, int -> int",
            "list_a_last_index_of_int: .list(A), A -> int",
        ],
    );
    add("lowerAscii", &["string_lower_ascii: .string -> string"]);
    add("upperAscii", &["string_upper_ascii: .string -> string"]);
    add(
        "replace",
        &[
            "string_replace_string_string: .string, string, string -> string",
            "string_replace_string_string_int: .string, string, string, int -> string",
        ],
    );
    add(
        "split",
        &[
            "string_split_string: .string, string -> list(string)",
            "string_split_string_int: .string, string, int -> list(string)",
        ],
    );
    add(
        "substring",
        &[
            "string_substring_int: .string, int -> string",
            "string_substring_int_int: .string, int, int -> string",
        ],
    );
    add("trim", &["string_trim: .string -> string"]);
    add(
        "join",
        &[
            "list_join: .list(string) -> string",
            "list_join_string: .list(string), string -> string",
        ],
    );
    add("strings.quote", &["strings_quote: string -> string"]);
    add("format", &["string_format: .string, list(dyn) -> string"]);
    // Lists extension, version 3 (cel-go ext/lists.go).
    add("slice", &["list_slice: .list(A), int, int -> list(A)"]);
    add(
        "flatten",
        &[
            "list_flatten: .list(list(A)) -> list(A)",
            "list_flatten_int: .list(dyn), int -> list(dyn)",
        ],
    );
    add("lists.range", &["lists_range: int -> list(int)"]);
    add("reverse", &["list_reverse: .list(A) -> list(A)"]);
    add("distinct", &["list_distinct: .list(A) -> list(A)"]);
    let sortable = ["int", "uint", "double", "bool", "string", "bytes"];
    m.entry("sort")
        .or_default()
        .extend(sortable.iter().map(|t| {
            let sig: &'static str =
                Box::leak(format!("list_{t}_sort: .list({t}) -> list({t})").into_boxed_str());
            overload(sig)
        }));
    // The hidden function behind the `sortBy` macro (ext/lists.go, `sortByMacro`).
    m.entry("@sortByAssociatedKeys")
        .or_default()
        .extend(sortable.iter().map(|t| {
            let sig: &'static str = Box::leak(
                format!("list_{t}_sortByAssociatedKeys: .list(A), list({t}) -> list(A)")
                    .into_boxed_str(),
            );
            overload(sig)
        }));
    // Kubernetes lists library (k8s.io/apiserver/pkg/cel/library/lists.go).
    m.entry("isSorted").or_default().extend(templated(
        "list_is_sorted",
        true,
        &sortable,
        "list(T) -> bool",
    ));
    m.entry("sum").or_default().extend(templated(
        "list_sum",
        true,
        &["int", "uint", "double"],
        "list(T) -> T",
    ));
    m.entry("max")
        .or_default()
        .extend(templated("list_max", true, &sortable, "list(T) -> T"));
    m.entry("min")
        .or_default()
        .extend(templated("list_min", true, &sortable, "list(T) -> T"));
    let mut add = |name: &'static str, sigs: &[&'static str]| {
        m.entry(name)
            .or_default()
            .extend(sigs.iter().map(|s| overload(s)));
    };
    // Sets extension (cel-go ext/sets.go).
    add(
        "sets.contains",
        &["list_sets_contains_list: list(A), list(A) -> bool"],
    );
    add(
        "sets.equivalent",
        &["list_sets_equivalent_list: list(A), list(A) -> bool"],
    );
    add(
        "sets.intersects",
        &["list_sets_intersects_list: list(A), list(A) -> bool"],
    );
    // Regex library (k8s.io/apiserver/pkg/cel/library/regex.go).
    add("find", &["string_find_string: .string, string -> string"]);
    add(
        "findAll",
        &[
            "string_find_all_string: .string, string -> list(string)",
            "string_find_all_string_int: .string, string, int -> list(string)",
        ],
    );
    // Quantity library (quantity.go).
    add("quantity", &["string_to_quantity: string -> quantity"]);
    add("isQuantity", &["is_quantity_string: string -> bool"]);
    add("sign", &["quantity_sign: quantity -> int"]);
    add(
        "isGreaterThan",
        &[
            "quantity_is_greater_than: .quantity, quantity -> bool",
            "semver_is_greater_than: .semver, semver -> bool",
        ],
    );
    add(
        "isLessThan",
        &[
            "quantity_is_less_than: .quantity, quantity -> bool",
            "semver_is_less_than: .semver, semver -> bool",
        ],
    );
    add(
        "compareTo",
        &[
            "quantity_compare_to: .quantity, quantity -> int",
            "semver_compare_to: .semver, semver -> int",
        ],
    );
    add(
        "asApproximateFloat",
        &["quantity_get_float: .quantity -> double"],
    );
    add("asInteger", &["quantity_get_int: .quantity -> int"]);
    add("isInteger", &["quantity_is_integer: .quantity -> bool"]);
    add(
        "add",
        &[
            "quantity_add: .quantity, quantity -> quantity",
            "quantity_add_int: .quantity, int -> quantity",
        ],
    );
    add(
        "sub",
        &[
            "quantity_sub: .quantity, quantity -> quantity",
            "quantity_sub_int: .quantity, int -> quantity",
        ],
    );
    // Semver library, version 1 (semverlib.go).
    add(
        "semver",
        &[
            "string_to_semver: string -> semver",
            "string_bool_to_semver: string, bool -> semver",
        ],
    );
    add(
        "isSemver",
        &[
            "is_semver_string: string -> bool",
            "is_semver_string_bool: string, bool -> bool",
        ],
    );
    add("major", &["semver_major: .semver -> int"]);
    add("minor", &["semver_minor: .semver -> int"]);
    add("patch", &["semver_patch: .semver -> int"]);
    // URL library (k8s.io/apiserver/pkg/cel/library/urls.go).
    add("url", &["string_to_url: string -> url"]);
    add("isURL", &["is_url_string: string -> bool"]);
    add("getScheme", &["url_get_scheme: .url -> string"]);
    add("getHost", &["url_get_host: .url -> string"]);
    add("getHostname", &["url_get_hostname: .url -> string"]);
    add("getPort", &["url_get_port: .url -> string"]);
    add("getEscapedPath", &["url_get_escaped_path: .url -> string"]);
    add(
        "getQuery",
        &["url_get_query: .url -> map(string, list(string))"],
    );
    // IP library (ip.go).
    add(
        "ip",
        &["string_to_ip: string -> ip", "cidr_ip: .cidr -> ip"],
    );
    add("isIP", &["is_ip: string -> bool"]);
    add("ip.isCanonical", &["ip_is_canonical: string -> bool"]);
    add("family", &["ip_family: .ip -> int"]);
    add("isUnspecified", &["ip_is_unspecified: .ip -> bool"]);
    add("isLoopback", &["ip_is_loopback: .ip -> bool"]);
    add(
        "isLinkLocalMulticast",
        &["ip_is_link_local_multicast: .ip -> bool"],
    );
    add(
        "isLinkLocalUnicast",
        &["ip_is_link_local_unicast: .ip -> bool"],
    );
    add("isGlobalUnicast", &["ip_is_global_unicast: .ip -> bool"]);
    // CIDR library (cidr.go).
    add("cidr", &["string_to_cidr: string -> cidr"]);
    add("isCIDR", &["is_cidr: string -> bool"]);
    add(
        "containsIP",
        &[
            "cidr_contains_ip_string: .cidr, string -> bool",
            "cidr_contains_ip_ip: .cidr, ip -> bool",
        ],
    );
    add(
        "containsCIDR",
        &[
            "cidr_contains_cidr_string: .cidr, string -> bool",
            "cidr_contains_cidr: .cidr, cidr -> bool",
        ],
    );
    add("prefixLength", &["cidr_prefix_length: .cidr -> int"]);
    add("masked", &["cidr_masked: .cidr -> cidr"]);
    // Format library (k8s.io/apiserver/pkg/cel/library/format.go).
    add(
        "format.named",
        &["format-named: string -> optional(format)"],
    );
    add(
        "validate",
        &["format-validate: .format, string -> optional(list(string))"],
    );
    add("format.dns1123Label", &["format.dns1123Label: -> format"]);
    add(
        "format.dns1123Subdomain",
        &["format.dns1123Subdomain: -> format"],
    );
    add("format.dns1035Label", &["format.dns1035Label: -> format"]);
    add("format.qualifiedName", &["format.qualifiedName: -> format"]);
    add(
        "format.dns1123LabelPrefix",
        &["format.dns1123LabelPrefix: -> format"],
    );
    add(
        "format.dns1123SubdomainPrefix",
        &["format.dns1123SubdomainPrefix: -> format"],
    );
    add(
        "format.dns1035LabelPrefix",
        &["format.dns1035LabelPrefix: -> format"],
    );
    add("format.labelValue", &["format.labelValue: -> format"]);
    add("format.uri", &["format.uri: -> format"]);
    add("format.uuid", &["format.uuid: -> format"]);
    add("format.byte", &["format.byte: -> format"]);
    add("format.date", &["format.date: -> format"]);
    add("format.datetime", &["format.datetime: -> format"]);
    // Optional types (cel-go cel/library.go, optional library).
    add("optional.of", &["optional_of: A -> optional(A)"]);
    add(
        "optional.ofNonZeroValue",
        &["optional_ofNonZeroValue: A -> optional(A)"],
    );
    add("optional.none", &["optional_none: -> optional(A)"]);
    add("hasValue", &["optional_hasValue: .optional(A) -> bool"]);
    add("value", &["optional_value: .optional(A) -> A"]);
    add(
        "or",
        &["optional_or_optional: .optional(A), optional(A) -> optional(A)"],
    );
    add("orValue", &["optional_orValue_value: .optional(A), A -> A"]);
    add(
        "_[?_]",
        &[
            "list_optindex_optional_int: list(A), int -> optional(A)",
            "optional_list_optindex_optional_int: optional(list(A)), int -> optional(A)",
            "map_optindex_optional_value: map(K,V), K -> optional(V)",
            "optional_map_optindex_optional_value: optional(map(K,V)), K -> optional(V)",
        ],
    );
    // cel-go adds optional overloads of indexing when optional types are enabled.
    add(
        "_[_]",
        &[
            "optional_list_index_int: optional(list(A)), int -> optional(A)",
            "optional_map_index_value: optional(map(K,V)), K -> optional(V)",
        ],
    );
    // DRA includes (k8s.io/dynamic-resource-allocation/cel/compile.go), list-type attributes only.
    let mut includes = overload("dra_includes_dyn_dyn: .dyn, dyn -> bool");
    includes.list_attributes_only = true;
    m.entry("includes").or_default().push(includes);
    m
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_declaration_parses_to_known_types() {
        for (name, overloads) in FUNCTIONS.iter() {
            for o in overloads {
                assert!(!o.id.is_empty(), "{name} has an overload without id");
                assert_ne!(o.result, Type::Error, "{}", o.id);
                assert!(o.args.iter().all(|a| *a != Type::Error), "{}", o.id);
            }
        }
    }
}
