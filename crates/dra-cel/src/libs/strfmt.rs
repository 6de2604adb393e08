//! `<string>.format(<list>)` of the strings extension at version 2 (what the Kubernetes base
//! environment declares): clause parsing shared by the compile-time check of constant format
//! strings and by evaluation, and the per-clause formatting rules.
//!
//! Upstream is cel-go v0.26.0 `ext/formatting.go` (the version-1 formatter with the `en_US`
//! locale; `ext/strings.go` picks it below strings version 4). The `%f` and `%e` clauses go
//! through `golang.org/x/text/message`, which groups thousands with `,`, prints infinities as
//! `∞`, writes exponents as `×10` and superscript digits, and, because upstream builds
//! `%<precision>e`, reads the precision of `%e` as a field width.

use crate::value::{Value, map_entries};

/// One formatting clause after `%`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Clause {
    /// `%s`
    Str,
    /// `%d`
    Decimal,
    /// `%f`, with the precision if one was given.
    Fixed(Option<i64>),
    /// `%e`, with the precision if one was given.
    Scientific(Option<i64>),
    /// `%b`
    Binary,
    /// `%x` (false) or `%X` (true).
    Hex(bool),
    /// `%o`
    Octal,
}

/// Walks `format`, copying literal text into the result and calling `clause(index, clause)`
/// for the argument of each clause. `args` is the length of the argument list.
///
/// # Errors
/// The message of the first malformed clause, argument list too short, or failing `clause`.
pub(crate) fn walk(
    format: &str,
    args: usize,
    mut clause: impl FnMut(usize, Clause) -> Result<String, String>,
) -> Result<String, String> {
    let b = format.as_bytes();
    let mut out: Vec<u8> = Vec::with_capacity(b.len());
    let mut i = 0;
    let mut index = 0usize;
    while let Some(&c) = b.get(i) {
        if c != b'%' {
            out.push(c);
            i += 1;
            continue;
        }
        if b.get(i + 1) == Some(&b'%') {
            out.push(b'%');
            i += 2;
            continue;
        }
        if i + 1 >= b.len() {
            return Err("unexpected end of string".into());
        }
        if index >= args {
            return Err(format!("index {index} out of range"));
        }
        let (read, parsed) = parse_clause(&b[i + 1..])
            .map_err(|e| format!("could not parse formatting clause: {e}"))?;
        let text = clause(index, parsed).map_err(|e| format!("error during formatting: {e}"))?;
        out.extend_from_slice(text.as_bytes());
        i += 1 + read;
        index += 1;
    }
    // Only ASCII `%` sequences were replaced, and the inserted text is UTF-8.
    String::from_utf8(out).map_err(|_| "invalid UTF-8 in format result".to_string())
}

/// Parses `[.digits]verb`, returning the bytes read.
fn parse_clause(b: &[u8]) -> Result<(usize, Clause), String> {
    let mut i = 0;
    let mut precision = None;
    if b.first() == Some(&b'.') {
        i = 1;
        let start = i;
        loop {
            match b.get(i) {
                None => {
                    return Err(
                        "error while parsing precision: could not find end of precision \
                                specifier"
                            .into(),
                    );
                }
                Some(d) if d.is_ascii_digit() => i += 1,
                Some(_) => break,
            }
        }
        let digits = std::str::from_utf8(&b[start..i]).unwrap_or_default();
        let p: i64 = digits.parse().map_err(|_| {
            format!(
                "error while parsing precision: error while converting precision to integer: \
                 strconv.Atoi: parsing {digits:?}: invalid syntax"
            )
        })?;
        precision = Some(p);
    }
    let verb = b.get(i).copied().unwrap_or(0);
    let clause = match verb {
        b's' => Clause::Str,
        b'd' => Clause::Decimal,
        b'f' => Clause::Fixed(precision),
        b'e' => Clause::Scientific(precision),
        b'b' => Clause::Binary,
        b'x' => Clause::Hex(false),
        b'X' => Clause::Hex(true),
        b'o' => Clause::Octal,
        other => {
            return Err(format!(
                "unrecognized formatting clause \"{}\"",
                char::from(other)
            ));
        }
    };
    Ok((i + 1, clause))
}

/// Upstream's message for an argument of type `given` that `clause` does not accept.
pub(crate) fn type_error(clause: Clause, given: &str) -> String {
    let what = match clause {
        Clause::Str => {
            "string clause can only be used on strings, bools, bytes, ints, doubles, maps, \
             lists, types, durations, and timestamps"
        }
        Clause::Decimal => "decimal clause can only be used on integers",
        Clause::Fixed(_) => "fixed-point clause can only be used on doubles",
        Clause::Scientific(_) => "scientific clause can only be used on doubles",
        Clause::Binary => "only integers and bools can be formatted as binary",
        Clause::Hex(_) => "only integers, byte buffers, and strings can be formatted as hex",
        Clause::Octal => "octal clause can only be used on integers",
    };
    format!("{what}, was given {given}")
}

/// Formats one argument for `clause` at runtime.
///
/// # Errors
/// The clause does not accept the argument's type, or a nested value cannot be formatted.
pub(crate) fn format_arg(clause: Clause, v: &Value<'_>) -> Result<String, String> {
    let bad = || Err(type_error(clause, v.type_name()));
    match clause {
        Clause::Str => format_string(v),
        Clause::Decimal => match v {
            Value::Int(i) => Ok(i.to_string()),
            Value::Uint(u) => Ok(u.to_string()),
            _ => bad(),
        },
        Clause::Fixed(p) => match float_arg(v) {
            Some(d) => Ok(fixed(d, p.unwrap_or(6))),
            None => bad(),
        },
        Clause::Scientific(p) => match float_arg(v) {
            Some(d) => Ok(scientific(d, p.unwrap_or(6))),
            None => bad(),
        },
        Clause::Binary => match v {
            Value::Int(i) => Ok(signed_radix(*i, |u| format!("{u:b}"))),
            Value::Uint(u) => Ok(format!("{u:b}")),
            Value::Bool(b) => Ok(if *b { "1" } else { "0" }.into()),
            _ => bad(),
        },
        Clause::Hex(upper) => {
            let s = match v {
                Value::Int(i) => signed_radix(*i, |u| format!("{u:x}")),
                Value::Uint(u) => format!("{u:x}"),
                Value::String(s) => hex_bytes(s.as_str().as_bytes()),
                Value::Bytes(b) => hex_bytes(b),
                _ => {
                    return bad();
                }
            };
            Ok(if upper { s.to_ascii_uppercase() } else { s })
        }
        Clause::Octal => match v {
            Value::Int(i) => Ok(signed_radix(*i, |u| format!("{u:o}"))),
            Value::Uint(u) => Ok(format!("{u:o}")),
            _ => bad(),
        },
    }
}

/// Go's `%b`/`%o`/`%x` of an int64: a sign and the magnitude.
fn signed_radix(i: i64, f: impl Fn(u64) -> String) -> String {
    let m = f(i.unsigned_abs());
    if i < 0 { format!("-{m}") } else { m }
}

fn hex_bytes(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// `%f` and `%e` take doubles, and the strings that name the special doubles.
fn float_arg(v: &Value<'_>) -> Option<f64> {
    match v {
        Value::Double(d) => Some(*d),
        Value::String(s) => match s.as_str() {
            "NaN" => Some(f64::NAN),
            "Infinity" => Some(f64::INFINITY),
            "-Infinity" => Some(f64::NEG_INFINITY),
            _ => None,
        },
        _ => None,
    }
}

/// `x/text` number formatting of `%.<p>f` in `en_US`: at most `int16(p)` fraction digits
/// (unlimited when that is negative), trailing zeros kept down to `uint8(p)` digits, and
/// the integer part grouped by three.
fn fixed(d: f64, p: i64) -> String {
    if d.is_nan() {
        return "NaN".into();
    }
    if d.is_infinite() {
        return if d > 0.0 { "∞" } else { "-∞" }.into();
    }
    // Go's integer conversions truncate: these wrap exactly as upstream's do.
    let max_frac = p as i16;
    let min_frac = usize::from(p as u8);
    let digits = if max_frac < 0 {
        format!("{}", d.abs())
    } else {
        format!("{:.*}", usize::from(max_frac.unsigned_abs()), d.abs())
    };
    let (int_part, frac) = digits.split_once('.').unwrap_or((&digits, ""));
    let mut frac = frac.trim_end_matches('0').to_string();
    while frac.len() < min_frac {
        frac.push('0');
    }
    let mut out = String::with_capacity(digits.len() + digits.len() / 3 + 2);
    if d < 0.0 {
        out.push('-');
    }
    out.push_str(&group_thousands(int_part));
    if !frac.is_empty() {
        out.push('.');
        out.push_str(&frac);
    }
    out
}

fn group_thousands(int_part: &str) -> String {
    let n = int_part.len();
    let mut out = String::with_capacity(n + n / 3);
    for (i, c) in int_part.chars().enumerate() {
        if i > 0 && (n - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `x/text` formatting of `%<p>e` in `en_US`: six fraction digits, `×10` and an exponent of at
/// least two superscript digits, padded with spaces to a width of `uint16(p)` characters.
fn scientific(d: f64, p: i64) -> String {
    // The width parser gives up once the number passes 10^6 before its last digit, and
    // swallows the verb with the rest of the directive.
    if p / 10 > 1_000_000 {
        return "%!(NOVERB)".into();
    }
    let body = if d.is_nan() {
        "NaN".to_string()
    } else if d.is_infinite() {
        if d > 0.0 { "∞" } else { "-∞" }.to_string()
    } else {
        let e = format!("{:.6e}", d.abs());
        let (mantissa, exp) = e.split_once('e').unwrap_or((&e, "0"));
        let exp: i32 = exp.parse().unwrap_or(0);
        let mut s = String::new();
        if d < 0.0 {
            s.push('-');
        }
        s.push_str(mantissa);
        s.push_str("×10");
        if exp < 0 {
            s.push('⁻');
        }
        let digits = format!("{:02}", exp.unsigned_abs());
        s.extend(digits.chars().map(superscript));
        s
    };
    let width = usize::from(p as u16);
    let len = body.chars().count();
    if width > len {
        let mut s = " ".repeat(width - len);
        s.push_str(&body);
        s
    } else {
        body
    }
}

fn superscript(c: char) -> char {
    match c {
        '0' => '⁰',
        '1' => '¹',
        '2' => '²',
        '3' => '³',
        '4' => '⁴',
        '5' => '⁵',
        '6' => '⁶',
        '7' => '⁷',
        '8' => '⁸',
        _ => '⁹',
    }
}

/// `%s` (upstream `FormatString`).
fn format_string(v: &Value<'_>) -> Result<String, String> {
    match v {
        Value::List(l) => {
            let parts = l.iter().map(format_member).collect::<Result<Vec<_>, _>>()?;
            Ok(format!("[{}]", parts.join(", ")))
        }
        Value::Map(_)
        | Value::Attributes(_)
        | Value::AttributeDomain(..)
        | Value::Capacity(_)
        | Value::CapacityDomain(..) => format_map(v),
        Value::Int(i) => Ok(i.to_string()),
        Value::Uint(u) => Ok(u.to_string()),
        Value::Double(d) => Ok(crate::functions::format_double(*d)),
        Value::Bool(b) => Ok(b.to_string()),
        Value::String(s) => Ok(s.as_str().to_string()),
        Value::Bytes(b) => std::str::from_utf8(b)
            .map(str::to_string)
            .map_err(|_| "could not convert argument to string: invalid UTF-8 in bytes".into()),
        Value::Type(t) => Ok((*t).to_string()),
        Value::Null => Ok("null".into()),
        _ => Err(type_error(Clause::Str, v.type_name())),
    }
}

/// A list element or map value: formatted by its type and quoted as a CEL literal.
fn format_member(v: &Value<'_>) -> Result<String, String> {
    match v {
        Value::String(s) => Ok(go_quote(s.as_str())),
        Value::Bytes(_) => Ok(format!("b{}", go_quote(&format_string(v)?))),
        Value::Double(d) if d.is_nan() => Ok("\"NaN\"".into()),
        Value::Double(d) if d.is_infinite() => {
            Ok(if *d > 0.0 { "\"+Inf\"" } else { "\"-Inf\"" }.into())
        }
        Value::Double(d) => Ok(format!("{d:.6}")),
        Value::Int(_)
        | Value::Uint(_)
        | Value::Bool(_)
        | Value::Null
        | Value::Type(_)
        | Value::List(_)
        | Value::Map(_)
        | Value::Attributes(_)
        | Value::AttributeDomain(..)
        | Value::Capacity(_)
        | Value::CapacityDomain(..) => format_string(v),
        _ => Err(format!("no formatting function for {}", v.type_name())),
    }
}

fn format_map(v: &Value<'_>) -> Result<String, String> {
    let mut pairs = Vec::new();
    for (k, val) in map_entries(v) {
        let key = match &k {
            Value::String(s) => go_quote(s.as_str()),
            Value::Bool(b) => b.to_string(),
            Value::Int(i) => i.to_string(),
            Value::Uint(u) => u.to_string(),
            other => {
                return Err(format!(
                    "no formatting function for map key of type {}",
                    other.type_name()
                ));
            }
        };
        pairs.push((key, format_member(&val)?));
    }
    pairs.sort_by(|a, b| a.0.cmp(&b.0));
    let parts: Vec<String> = pairs.into_iter().map(|(k, v)| format!("{k}:{v}")).collect();
    Ok(format!("{{{}}}", parts.join(", ")))
}

/// Go's `strconv.Quote`: printable characters as they are, the usual backslash escapes, and
/// `\x`, `\u` or `\U` for the rest. Printability approximates Go's `unicode.IsPrint` without
/// the Unicode tables: control, format, private-use, surrogate and separator characters other
/// than the ASCII space are escaped.
pub(crate) fn go_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{7}' => out.push_str("\\a"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{b}' => out.push_str("\\v"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c if is_go_printable(c) => out.push(c),
            c if (c as u32) < 0x10000 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push_str(&format!("\\U{:08x}", c as u32)),
        }
    }
    out.push('"');
    out
}

fn is_go_printable(c: char) -> bool {
    let u = c as u32;
    if c == ' ' {
        return true;
    }
    if c.is_control() || c.is_whitespace() {
        return false;
    }
    !matches!(u,
        0xad | 0x600..=0x605 | 0x61c | 0x6dd | 0x70f | 0x890..=0x891 | 0x8e2 | 0x180e
        | 0x200b..=0x200f | 0x2028..=0x202e | 0x2060..=0x206f | 0xfeff | 0xfff9..=0xfffb
        | 0xe000..=0xf8ff | 0xfffe..=0xffff | 0x110bd | 0x110cd | 0x13430..=0x1343f
        | 0x1bca0..=0x1bca3 | 0x1d173..=0x1d17a | 0xe0001..=0xe007f | 0xf0000..)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(format: &str, args: &[Value<'static>]) -> Result<String, String> {
        walk(format, args.len(), |i, c| format_arg(c, &args[i]))
    }

    #[test]
    fn fixed_point_groups_thousands_and_rounds_the_exact_value() {
        assert_eq!(
            run("%.2f", &[Value::Double(1234567.891)]),
            Ok("1,234,567.89".into())
        );
        assert_eq!(run("%.2f", &[Value::Double(0.015)]), Ok("0.01".into()));
        assert_eq!(run("%f", &[Value::Double(-0.0)]), Ok("0.000000".into()));
        assert_eq!(run("%.0f", &[Value::Double(-0.4)]), Ok("-0".into()));
    }

    #[test]
    fn scientific_reads_the_precision_as_a_width() {
        assert_eq!(
            run("%.15e", &[Value::Double(1.5)]),
            Ok("  1.500000×10⁰⁰".into())
        );
        assert_eq!(
            run("%e", &[Value::Double(-1e-5)]),
            Ok("-1.000000×10⁻⁰⁵".into())
        );
        assert_eq!(run("%e", &[Value::Double(f64::NAN)]), Ok("   NaN".into()));
    }

    #[test]
    fn lists_and_maps_format_as_cel_literals_with_sorted_keys() {
        let l = Value::List(std::sync::Arc::new(vec![
            Value::string("a\"b"),
            Value::Double(2.5),
            Value::Bytes(std::sync::Arc::from(&b"x"[..])),
        ]));
        assert_eq!(run("%s", &[l]), Ok(r#"["a\"b", 2.500000, b"x"]"#.into()));
        let m = Value::Map(std::sync::Arc::new(vec![
            (Value::string("z"), Value::Int(1)),
            (Value::string("a"), Value::Int(2)),
        ]));
        assert_eq!(run("%s", &[m]), Ok(r#"{"a":2, "z":1}"#.into()));
    }

    #[test]
    fn malformed_clauses_and_short_argument_lists_are_errors() {
        assert!(run("%", &[Value::Int(1)]).is_err());
        assert!(run("%z", &[Value::Int(1)]).is_err());
        assert!(run("%.f", &[Value::Double(1.0)]).is_err());
        assert!(run("%d %d", &[Value::Int(1)]).is_err());
        assert!(run("%d", &[Value::Double(1.0)]).is_err());
        assert_eq!(run("100%%", &[]), Ok("100%".into()));
    }
}
