//! Runtime implementations of the declared functions, dispatched on the argument values, and
//! their runtime cost (cel-go `interpreter/runtimecost.go` `costCall` and the Kubernetes
//! `library.CostEstimator.CallCost`, `k8s.io/apiserver/pkg/cel/library/cost.go`).

use std::cmp::Ordering;
use std::sync::Arc;

use crate::eval::{EvalError, compare};
use crate::libs::format::Format;
use crate::libs::ip::{Addr, Prefix};
use crate::libs::quantity::{Operand, Quantity, QuantityError, QuantityValue};
use crate::libs::semver::Semver;
use crate::libs::url::Url;
use crate::value::{Eq, Str, Value, equals, is_map, map_entries, map_find};

type R<'a> = Result<Value<'a>, EvalError>;

fn rt<T>(msg: impl Into<String>) -> Result<T, EvalError> {
    Err(EvalError::Runtime(msg.into()))
}

fn no_overload<T>() -> Result<T, EvalError> {
    rt("no such overload")
}

fn s<'a>(v: String) -> Value<'a> {
    Value::String(Str::Shared(Arc::from(v)))
}

fn list<'a>(v: Vec<Value<'a>>) -> Value<'a> {
    Value::List(Arc::new(v))
}

/// Formats a double like Go's `strconv.FormatFloat(f, 'g', -1, 64)` (what cel-go's
/// `string(double)` does).
pub(crate) fn format_double(d: f64) -> String {
    if d.is_nan() {
        return "NaN".into();
    }
    if d.is_infinite() {
        return if d > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        };
    }
    if d == 0.0 {
        return if d.is_sign_negative() {
            "-0".into()
        } else {
            "0".into()
        };
    }
    let e = format!("{d:e}");
    let (mant, exp) = e.split_once('e').unwrap_or((&e, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if !(-4..6).contains(&exp) {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mant}e{sign}{:02}", exp.abs())
    } else {
        format!("{d}")
    }
}

fn to_int(v: &Value<'_>) -> Result<i64, EvalError> {
    match v {
        Value::Int(i) => Ok(*i),
        Value::Uint(u) => i64::try_from(*u).or_else(|_| rt("integer overflow")),
        Value::Double(d) => {
            if d.is_nan() || *d <= -9.223_372_036_854_776e18 || *d >= 9.223_372_036_854_776e18 {
                rt("integer overflow")
            } else {
                Ok(*d as i64)
            }
        }
        Value::String(s) => s
            .as_str()
            .parse::<i64>()
            .or_else(|e| rt(format!("cannot convert string to int: {e}"))),
        _ => no_overload(),
    }
}

fn str_arg<'v, 'a>(v: &'v Value<'a>) -> Result<&'v str, EvalError> {
    match v {
        Value::String(s) => Ok(s.as_str()),
        _ => no_overload(),
    }
}

fn int_arg(v: &Value<'_>) -> Result<i64, EvalError> {
    match v {
        Value::Int(i) => Ok(*i),
        _ => no_overload(),
    }
}

fn quantity_arg<'v>(v: &'v Value<'_>) -> Result<&'v QuantityValue, EvalError> {
    v.quantity().map_or_else(no_overload, Ok)
}

/// A quantity failure as cel-go reports it: an error value, or an internal error where the Go
/// code panics.
fn quantity_error(e: QuantityError) -> EvalError {
    if e.is_upstream_panic() {
        EvalError::Internal(e.to_string())
    } else {
        EvalError::Runtime(e.to_string())
    }
}

fn semver_arg<'v>(v: &'v Value<'_>) -> Result<&'v Semver, EvalError> {
    match v {
        Value::Semver(s) => Ok(s),
        _ => no_overload(),
    }
}

fn bool_of(e: Eq) -> R<'static> {
    match e {
        Eq::True => Ok(Value::Bool(true)),
        Eq::False => Ok(Value::Bool(false)),
        Eq::NoOverload => no_overload(),
        Eq::Panic(m) => Err(EvalError::Internal(m)),
    }
}

fn contains_value(l: &[Value<'_>], v: &Value<'_>) -> R<'static> {
    let mut err = false;
    for e in l {
        match equals(e, v) {
            Eq::True => return Ok(Value::Bool(true)),
            Eq::False => {}
            Eq::NoOverload => err = true,
            Eq::Panic(m) => return Err(EvalError::Internal(m)),
        }
    }
    if err {
        no_overload()
    } else {
        Ok(Value::Bool(false))
    }
}

/// Calls `name` with evaluated arguments (receiver first for member calls).
pub(crate) fn call<'a>(name: &str, overloads: &[&'static str], a: &[Value<'a>]) -> R<'a> {
    use Value as V;
    match (name, a) {
        ("_==_", [x, y]) => bool_of(equals(x, y)),
        // cel-go's `evalNe` negates `types.Equal(x, y) == types.True`, so an equality without
        // an overload (a URL against an int) is simply "not equal".
        ("_!=_", [x, y]) => match equals(x, y) {
            Eq::Panic(m) => Err(EvalError::Internal(m)),
            e => Ok(V::Bool(!matches!(e, Eq::True))),
        },
        ("_<_", [x, y]) => Ok(V::Bool(compare(x, y)? == Some(Ordering::Less))),
        ("_<=_", [x, y]) => Ok(V::Bool(matches!(
            compare(x, y)?,
            Some(Ordering::Less | Ordering::Equal)
        ))),
        ("_>_", [x, y]) => Ok(V::Bool(compare(x, y)? == Some(Ordering::Greater))),
        ("_>=_", [x, y]) => Ok(V::Bool(matches!(
            compare(x, y)?,
            Some(Ordering::Greater | Ordering::Equal)
        ))),
        ("!_", [V::Bool(b)]) => Ok(V::Bool(!b)),
        ("-_", [V::Int(i)]) => i
            .checked_neg()
            .map(V::Int)
            .map_or_else(|| rt("integer overflow"), Ok),
        ("-_", [V::Double(d)]) => Ok(V::Double(-d)),
        ("_+_", [V::Int(x), V::Int(y)]) => x
            .checked_add(*y)
            .map(V::Int)
            .map_or_else(|| rt("integer overflow"), Ok),
        ("_+_", [V::Uint(x), V::Uint(y)]) => x
            .checked_add(*y)
            .map(V::Uint)
            .map_or_else(|| rt("unsigned integer overflow"), Ok),
        ("_+_", [V::Double(x), V::Double(y)]) => Ok(V::Double(x + y)),
        ("_+_", [V::String(x), V::String(y)]) => Ok(s(format!("{}{}", x.as_str(), y.as_str()))),
        ("_+_", [V::Bytes(x), V::Bytes(y)]) => Ok(V::Bytes(Arc::from([&x[..], &y[..]].concat()))),
        ("_+_", [V::List(x), V::List(y)]) => {
            let mut v = Vec::with_capacity(x.len() + y.len());
            v.extend(x.iter().cloned());
            v.extend(y.iter().cloned());
            Ok(list(v))
        }
        ("_-_", [V::Int(x), V::Int(y)]) => x
            .checked_sub(*y)
            .map(V::Int)
            .map_or_else(|| rt("integer overflow"), Ok),
        ("_-_", [V::Uint(x), V::Uint(y)]) => x
            .checked_sub(*y)
            .map(V::Uint)
            .map_or_else(|| rt("unsigned integer overflow"), Ok),
        ("_-_", [V::Double(x), V::Double(y)]) => Ok(V::Double(x - y)),
        ("_*_", [V::Int(x), V::Int(y)]) => x
            .checked_mul(*y)
            .map(V::Int)
            .map_or_else(|| rt("integer overflow"), Ok),
        ("_*_", [V::Uint(x), V::Uint(y)]) => x
            .checked_mul(*y)
            .map(V::Uint)
            .map_or_else(|| rt("unsigned integer overflow"), Ok),
        ("_*_", [V::Double(x), V::Double(y)]) => Ok(V::Double(x * y)),
        ("_/_", [V::Int(_), V::Int(0)]) | ("_/_", [V::Uint(_), V::Uint(0)]) => {
            rt("division by zero")
        }
        ("_/_", [V::Int(x), V::Int(y)]) => x
            .checked_div(*y)
            .map(V::Int)
            .map_or_else(|| rt("integer overflow"), Ok),
        ("_/_", [V::Uint(x), V::Uint(y)]) => Ok(V::Uint(x / y)),
        ("_/_", [V::Double(x), V::Double(y)]) => Ok(V::Double(x / y)),
        ("_%_", [V::Int(_), V::Int(0)]) | ("_%_", [V::Uint(_), V::Uint(0)]) => {
            rt("modulus by zero")
        }
        ("_%_", [V::Int(x), V::Int(y)]) => x
            .checked_rem(*y)
            .map(V::Int)
            .map_or_else(|| rt("integer overflow"), Ok),
        ("_%_", [V::Uint(x), V::Uint(y)]) => Ok(V::Uint(x % y)),
        ("@in", [v, V::List(l)]) => contains_value(l, v),
        ("@in", [k, m]) if is_map(m) => {
            let entries = map_entries(m);
            Ok(V::Bool(map_find(&entries, k).is_some()))
        }
        ("size", [V::String(x)]) => Ok(V::Int(x.as_str().chars().count() as i64)),
        ("size", [V::Bytes(b)]) => Ok(V::Int(b.len() as i64)),
        ("size", [V::List(l)]) => Ok(V::Int(l.len() as i64)),
        ("size", [m]) if is_map(m) => Ok(V::Int(map_entries(m).len() as i64)),
        ("int", [V::Double(d)]) if d.is_finite() => to_int(&V::Double(d.trunc())).map(V::Int),
        ("int", [x]) => to_int(x).map(V::Int),
        ("uint", [V::Uint(u)]) => Ok(V::Uint(*u)),
        ("uint", [V::Int(i)]) => u64::try_from(*i)
            .map(V::Uint)
            .or_else(|_| rt("unsigned integer overflow")),
        ("uint", [V::Double(d)]) => {
            if d.is_nan() || *d < 0.0 || *d >= 1.844_674_407_370_955_2e19 {
                rt("unsigned integer overflow")
            } else {
                Ok(V::Uint(*d as u64))
            }
        }
        ("uint", [V::String(x)]) => x
            .as_str()
            .parse::<u64>()
            .map(V::Uint)
            .or_else(|e| rt(format!("cannot convert string to uint: {e}"))),
        ("double", [V::Double(d)]) => Ok(V::Double(*d)),
        ("double", [V::Int(i)]) => Ok(V::Double(*i as f64)),
        ("double", [V::Uint(u)]) => Ok(V::Double(*u as f64)),
        ("double", [V::String(x)]) => parse_go_float(x.as_str())
            .map(V::Double)
            .map_or_else(|| rt("cannot convert string to double"), Ok),
        ("string", [V::String(x)]) => Ok(V::String(x.clone())),
        ("string", [V::Int(i)]) => Ok(s(i.to_string())),
        ("string", [V::Uint(u)]) => Ok(s(u.to_string())),
        ("string", [V::Double(d)]) => Ok(s(format_double(*d))),
        ("string", [V::Bool(b)]) => Ok(s(b.to_string())),
        ("string", [V::Bytes(b)]) => match std::str::from_utf8(b) {
            Ok(t) => Ok(s(t.to_string())),
            Err(_) => rt("invalid UTF-8 in bytes, cannot convert to string"),
        },
        ("bytes", [V::Bytes(b)]) => Ok(V::Bytes(b.clone())),
        ("bytes", [V::String(x)]) => Ok(V::Bytes(Arc::from(x.as_str().as_bytes()))),
        ("bool", [V::Bool(b)]) => Ok(V::Bool(*b)),
        ("bool", [V::String(x)]) => match x.as_str() {
            "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(V::Bool(true)),
            "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(V::Bool(false)),
            other => rt(format!(
                "type conversion error from 'string' to 'bool' for '{other}'"
            )),
        },
        ("dyn", [x]) => Ok(x.clone()),
        ("type", [x]) => Ok(V::Type(x.type_name())),
        ("contains", [V::String(x), V::String(y)]) => Ok(V::Bool(x.as_str().contains(y.as_str()))),
        ("startsWith", [V::String(x), V::String(y)]) => {
            Ok(V::Bool(x.as_str().starts_with(y.as_str())))
        }
        ("endsWith", [V::String(x), V::String(y)]) => Ok(V::Bool(x.as_str().ends_with(y.as_str()))),
        ("matches", [V::String(x), V::String(re)]) => {
            let r = crate::libs::regex::compile(re.as_str())
                .map_err(|e| EvalError::Runtime(e.to_string()))?;
            Ok(V::Bool(r.is_match(x.as_str())))
        }
        ("find", [V::String(x), V::String(re)]) => {
            let r = crate::libs::regex::compile(re.as_str())
                .map_err(|e| EvalError::Runtime(e.to_string()))?;
            Ok(s(r
                .find(x.as_str())
                .map(|m| m.as_str().to_string())
                .unwrap_or_default()))
        }
        ("findAll", [V::String(x), V::String(re), rest @ ..]) => {
            let r = crate::libs::regex::compile(re.as_str())
                .map_err(|e| EvalError::Runtime(e.to_string()))?;
            let limit = match rest {
                [] => -1,
                [n] => int_arg(n)?,
                _ => return no_overload(),
            };
            if limit == 0 {
                return Ok(list(Vec::new()));
            }
            let all = r.find_iter(x.as_str()).map(|m| s(m.as_str().to_string()));
            Ok(list(if limit < 0 {
                all.collect()
            } else {
                all.take(usize::try_from(limit).unwrap_or(usize::MAX))
                    .collect()
            }))
        }
        ("charAt", [V::String(x), V::Int(i)]) => {
            let chars: Vec<char> = x.as_str().chars().collect();
            match usize::try_from(*i) {
                Ok(i) if i < chars.len() => Ok(s(chars[i].to_string())),
                Ok(i) if i == chars.len() => Ok(s(String::new())),
                _ => rt(format!("index out of range: {i}")),
            }
        }
        ("indexOf", [V::String(x), V::String(sub), rest @ ..]) => {
            let chars: Vec<char> = x.as_str().chars().collect();
            let subc: Vec<char> = sub.as_str().chars().collect();
            let start = match rest {
                [] => 0,
                [n] => int_arg(n)?,
                _ => return no_overload(),
            };
            if start < 0 {
                return rt(format!("index out of range: {start}"));
            }
            if start as usize > chars.len() {
                return Ok(V::Int(-1));
            }
            let start = start as usize;
            if subc.is_empty() {
                return Ok(V::Int(start as i64));
            }
            let pos = (start..=chars.len().saturating_sub(subc.len()))
                .find(|&i| i + subc.len() <= chars.len() && chars[i..i + subc.len()] == subc[..]);
            Ok(V::Int(pos.map_or(-1, |p| p as i64)))
        }
        ("lastIndexOf", [V::String(x), V::String(sub), rest @ ..]) => {
            let chars: Vec<char> = x.as_str().chars().collect();
            let subc: Vec<char> = sub.as_str().chars().collect();
            let end = match rest {
                [] => chars.len() as i64,
                [n] => int_arg(n)?,
                _ => return no_overload(),
            };
            if end < 0 || end as usize > chars.len() {
                return rt(format!("index out of range: {end}"));
            }
            if subc.is_empty() {
                return Ok(V::Int(end));
            }
            let end = end as usize;
            let last = end.min(chars.len().saturating_sub(subc.len()));
            if subc.len() > chars.len() {
                return Ok(V::Int(-1));
            }
            let pos = (0..=last)
                .rev()
                .find(|&i| chars[i..i + subc.len()] == subc[..]);
            Ok(V::Int(pos.map_or(-1, |p| p as i64)))
        }
        ("indexOf", [V::List(l), v]) => {
            for (i, e) in l.iter().enumerate() {
                if matches!(equals(e, v), Eq::True) {
                    return Ok(V::Int(i as i64));
                }
            }
            Ok(V::Int(-1))
        }
        ("lastIndexOf", [V::List(l), v]) => {
            for (i, e) in l.iter().enumerate().rev() {
                if matches!(equals(e, v), Eq::True) {
                    return Ok(V::Int(i as i64));
                }
            }
            Ok(V::Int(-1))
        }
        ("lowerAscii", [V::String(x)]) => Ok(s(x.as_str().to_ascii_lowercase())),
        ("upperAscii", [V::String(x)]) => Ok(s(x.as_str().to_ascii_uppercase())),
        ("replace", [V::String(x), V::String(from), V::String(to), rest @ ..]) => {
            let n = match rest {
                [] => -1,
                [n] => int_arg(n)?,
                _ => return no_overload(),
            };
            Ok(s(if n < 0 {
                x.as_str().replace(from.as_str(), to.as_str())
            } else {
                x.as_str()
                    .replacen(from.as_str(), to.as_str(), usize::try_from(n).unwrap_or(0))
            }))
        }
        ("split", [V::String(x), V::String(sep), rest @ ..]) => {
            let n = match rest {
                [] => -1,
                [n] => int_arg(n)?,
                _ => return no_overload(),
            };
            let (x, sep) = (x.as_str(), sep.as_str());
            if n == 0 {
                return Ok(list(Vec::new()));
            }
            let parts: Vec<String> = if sep.is_empty() {
                let chars: Vec<String> = x.chars().map(String::from).collect();
                if n > 0 && chars.len() > n as usize {
                    let k = n as usize - 1;
                    let mut v: Vec<String> = chars[..k].to_vec();
                    v.push(chars[k..].concat());
                    v
                } else {
                    chars
                }
            } else if n < 0 {
                x.split(sep).map(String::from).collect()
            } else {
                x.splitn(n as usize, sep).map(String::from).collect()
            };
            Ok(list(parts.into_iter().map(s).collect()))
        }
        ("substring", [V::String(x), V::Int(start), rest @ ..]) => {
            let chars: Vec<char> = x.as_str().chars().collect();
            let end = match rest {
                [] => chars.len() as i64,
                [n] => int_arg(n)?,
                _ => return no_overload(),
            };
            if *start < 0 || *start as usize > chars.len() {
                return rt(format!("index out of range: {start}"));
            }
            if end < 0 || end as usize > chars.len() {
                return rt(format!("index out of range: {end}"));
            }
            if *start > end {
                return rt(format!(
                    "invalid substring range. start: {start}, end: {end}"
                ));
            }
            Ok(s(chars[*start as usize..end as usize].iter().collect()))
        }
        ("trim", [V::String(x)]) => Ok(s(x.as_str().trim_matches(is_go_space).to_string())),
        ("join", [V::List(l), rest @ ..]) => {
            let sep = match rest {
                [] => "",
                [V::String(sp)] => sp.as_str(),
                _ => return no_overload(),
            };
            let mut parts = Vec::with_capacity(l.len());
            for e in l.iter() {
                parts.push(str_arg(e)?.to_string());
            }
            Ok(s(parts.join(sep)))
        }
        ("strings.quote", [V::String(x)]) => Ok(s(quote(x.as_str()))),
        ("format", [V::String(f), V::List(l)]) => {
            use crate::libs::strfmt;
            match strfmt::walk(f.as_str(), l.len(), |i, c| match l.get(i) {
                Some(v) => strfmt::format_arg(c, v),
                None => Err(format!("index {i} out of range")),
            }) {
                Ok(out) => Ok(s(out)),
                Err(e) => rt(e),
            }
        }
        ("slice", [V::List(l), V::Int(a), V::Int(b)]) => {
            if *a < 0 || *b < 0 {
                return rt(format!(
                    "cannot slice(start, end): negative indexes not supported ({a}, {b})"
                ));
            }
            if a > b {
                return rt(format!(
                    "cannot slice(start, end): start index must be less than or equal to end index ({a} > {b})"
                ));
            }
            if *b as usize > l.len() {
                return rt(format!(
                    "cannot slice(start, end): list is length {}",
                    l.len()
                ));
            }
            Ok(list(l[*a as usize..*b as usize].to_vec()))
        }
        ("flatten", [V::List(l), rest @ ..]) => {
            let depth = match rest {
                [] => 1,
                [n] => int_arg(n)?,
                _ => return no_overload(),
            };
            if depth < 0 {
                return rt("level must be non-negative");
            }
            Ok(list(flatten(l, depth)))
        }
        ("lists.range", [V::Int(n)]) => Ok(list((0..(*n).max(0)).map(V::Int).collect())),
        ("reverse", [V::List(l)]) => Ok(list(l.iter().rev().cloned().collect())),
        ("distinct", [V::List(l)]) => {
            let mut out: Vec<Value<'a>> = Vec::new();
            for e in l.iter() {
                if !out.iter().any(|o| matches!(equals(o, e), Eq::True)) {
                    out.push(e.clone());
                }
            }
            Ok(list(out))
        }
        ("sort", [V::List(l)]) => {
            let mut v = l.to_vec();
            let mut bad = false;
            v.sort_by(|x, y| match compare(x, y) {
                Ok(Some(o)) => o,
                _ => {
                    bad = true;
                    Ordering::Equal
                }
            });
            if bad { no_overload() } else { Ok(list(v)) }
        }
        // ext/lists.go `sortListByAssociatedKeys`: the keys must be comparable and of one type;
        // Go's sort.Slice compares every key at least once when there are two or more.
        ("@sortByAssociatedKeys", [V::List(l), V::List(keys)]) => {
            if l.len() != keys.len() {
                return rt(format!(
                    "@sortByAssociatedKeys() expected a list of the same size as the associated keys list, but got {} and {} elements respectively",
                    l.len(),
                    keys.len()
                ));
            }
            let Some(first) = keys.first() else {
                return Ok(V::List(l.clone()));
            };
            if !matches!(
                first,
                V::Int(_) | V::Uint(_) | V::Double(_) | V::Bool(_) | V::String(_) | V::Bytes(_)
            ) {
                return rt("list elements must be comparable");
            }
            let kind = std::mem::discriminant(first);
            if keys.len() > 1 && keys.iter().any(|k| std::mem::discriminant(k) != kind) {
                return rt("list elements must have the same type");
            }
            let mut order: Vec<usize> = (0..keys.len()).collect();
            order.sort_by(|&i, &j| match compare(&keys[i], &keys[j]) {
                Ok(Some(o)) => o,
                _ => Ordering::Equal,
            });
            Ok(list(order.into_iter().map(|i| l[i].clone()).collect()))
        }
        ("isSorted", [V::List(l)]) => {
            for w in l.windows(2) {
                if compare(&w[0], &w[1])? == Some(Ordering::Greater) {
                    return Ok(V::Bool(false));
                }
            }
            Ok(V::Bool(true))
        }
        ("sum", [V::List(l)]) => {
            let zero = if overloads.contains(&"list_sum_uint") {
                V::Uint(0)
            } else if overloads.contains(&"list_sum_double") {
                V::Double(0.0)
            } else {
                V::Int(0)
            };
            let mut acc = match l.first() {
                Some(_) => None,
                None => Some(zero),
            };
            for e in l.iter() {
                acc = Some(match acc {
                    None => e.clone(),
                    Some(a) => call("_+_", &[], &[a, e.clone()])?,
                });
            }
            Ok(acc.unwrap_or(V::Int(0)))
        }
        ("max" | "min", [V::List(l)]) => {
            let Some(first) = l.first() else {
                return rt(format!("{name}(list) argument must not be empty"));
            };
            let want = if name == "max" {
                Ordering::Greater
            } else {
                Ordering::Less
            };
            let mut best = first.clone();
            for e in l.iter().skip(1) {
                if compare(e, &best)? == Some(want) {
                    best = e.clone();
                }
            }
            Ok(best)
        }
        ("sets.contains", [V::List(x), V::List(y)]) => {
            for e in y.iter() {
                if !matches!(contains_value(x, e), Ok(V::Bool(true))) {
                    return Ok(V::Bool(false));
                }
            }
            Ok(V::Bool(true))
        }
        ("sets.equivalent", [V::List(x), V::List(y)]) => {
            let a = call(
                "sets.contains",
                &[],
                &[V::List(x.clone()), V::List(y.clone())],
            )?;
            let b = call(
                "sets.contains",
                &[],
                &[V::List(y.clone()), V::List(x.clone())],
            )?;
            Ok(V::Bool(matches!((a, b), (V::Bool(true), V::Bool(true)))))
        }
        ("sets.intersects", [V::List(x), V::List(y)]) => {
            for e in y.iter() {
                if matches!(contains_value(x, e), Ok(V::Bool(true))) {
                    return Ok(V::Bool(true));
                }
            }
            Ok(V::Bool(false))
        }
        // library/quantity.go: each function calls one resource.Quantity method on the value's
        // pointer (see QuantityValue for the forms and what the methods change).
        ("quantity", [V::String(x)]) => QuantityValue::parse(x.as_str())
            .map(V::Quantity)
            .map_err(quantity_error),
        ("isQuantity", [V::String(x)]) => match Quantity::parse(x.as_str()) {
            Ok(_) => Ok(V::Bool(true)),
            Err(QuantityError::Format | QuantityError::Suffix | QuantityError::Numeric) => {
                Ok(V::Bool(false))
            }
            // Not a verdict on the text: upstream panics, or we cannot spell the number out.
            Err(e) => Err(quantity_error(e)),
        },
        ("sign", [q]) => Ok(V::Int(quantity_arg(q)?.sign())),
        ("isGreaterThan", [V::Semver(x), y]) => Ok(V::Bool(x.as_ref() > semver_arg(y)?)),
        ("isLessThan", [V::Semver(x), y]) => Ok(V::Bool(x.as_ref() < semver_arg(y)?)),
        ("compareTo", [V::Semver(x), y]) => Ok(V::Int(ord_int(x.as_ref().cmp(semver_arg(y)?)))),
        ("isGreaterThan" | "isLessThan" | "compareTo", [x, y]) => {
            let ord = quantity_arg(x)?
                .compare(quantity_arg(y)?)
                .map_err(quantity_error)?;
            Ok(match name {
                "isGreaterThan" => V::Bool(ord == Ordering::Greater),
                "isLessThan" => V::Bool(ord == Ordering::Less),
                _ => V::Int(ord_int(ord)),
            })
        }
        ("asApproximateFloat", [q]) => Ok(V::Double(quantity_arg(q)?.approximate_float())),
        ("asInteger", [q]) => quantity_arg(q)?
            .as_int64()
            .map(V::Int)
            .map_or_else(|| rt("cannot convert value to integer"), Ok),
        ("isInteger", [q]) => Ok(V::Bool(quantity_arg(q)?.as_int64().is_some())),
        ("add" | "sub", [q, other]) => {
            let q = quantity_arg(q)?;
            let o = match other {
                V::Int(i) => Operand::Int(*i),
                o => Operand::Quantity(quantity_arg(o)?),
            };
            let r = if name == "add" { q.add(o) } else { q.sub(o) };
            r.map(V::Quantity).map_err(quantity_error)
        }
        ("semver", [V::String(x), rest @ ..]) => {
            let normalize = match rest {
                [] => false,
                [V::Bool(b)] => *b,
                _ => return no_overload(),
            };
            let r = if normalize {
                Semver::parse_normalized(x.as_str())
            } else {
                Semver::parse(x.as_str())
            };
            r.map(|v| V::Semver(Arc::new(v)))
                .map_err(|e| EvalError::Runtime(e.to_string()))
        }
        ("isSemver", [V::String(x), rest @ ..]) => {
            let normalize = match rest {
                [] => false,
                [V::Bool(b)] => *b,
                _ => return no_overload(),
            };
            let r = if normalize {
                Semver::parse_normalized(x.as_str())
            } else {
                Semver::parse(x.as_str())
            };
            Ok(V::Bool(r.is_ok()))
        }
        ("major", [v]) => Ok(V::Int(
            i64::try_from(semver_arg(v)?.major).unwrap_or(i64::MAX),
        )),
        ("minor", [v]) => Ok(V::Int(
            i64::try_from(semver_arg(v)?.minor).unwrap_or(i64::MAX),
        )),
        ("patch", [v]) => Ok(V::Int(
            i64::try_from(semver_arg(v)?.patch).unwrap_or(i64::MAX),
        )),
        ("url", [V::String(x)]) => Url::parse(x.as_str())
            .map(|u| V::Url(Arc::new(u)))
            .map_err(|e| EvalError::Runtime(e.to_string())),
        ("isURL", [V::String(x)]) => Ok(V::Bool(Url::is_request_uri(x.as_str()))),
        ("format.named", [V::String(x)]) => Ok(V::Optional(
            Format::named(x.as_str()).map(|f| Arc::new(V::Format(f))),
        )),
        ("validate", [V::Format(f), V::String(x)]) => {
            let errs = f.validate(x.as_str());
            Ok(V::Optional(if errs.is_empty() {
                None
            } else {
                Some(Arc::new(list(errs.into_iter().map(s).collect())))
            }))
        }
        (n, []) if n.starts_with("format.") => n
            .strip_prefix("format.")
            .and_then(Format::named)
            .map_or_else(no_overload, |f| Ok(V::Format(f))),
        ("getScheme", [V::Url(u)]) => Ok(s(u.scheme().to_string())),
        ("getHost", [V::Url(u)]) => Ok(s(u.host().to_string())),
        ("getHostname", [V::Url(u)]) => Ok(s(u.hostname().to_string())),
        ("getPort", [V::Url(u)]) => Ok(s(u.port().to_string())),
        ("getEscapedPath", [V::Url(u)]) => Ok(s(u.escaped_path())),
        ("getQuery", [V::Url(u)]) => Ok(V::Map(Arc::new(
            u.query()
                .into_iter()
                .map(|(k, vals)| (s(k), list(vals.into_iter().map(s).collect())))
                .collect(),
        ))),
        ("ip", [V::String(x)]) => Addr::parse(x.as_str())
            .map(V::Ip)
            .map_err(|e| EvalError::Runtime(e.to_string())),
        ("ip", [V::Cidr(p)]) => Ok(V::Ip(p.addr)),
        ("isIP", [V::String(x)]) => Ok(V::Bool(Addr::parse(x.as_str()).is_ok())),
        ("ip.isCanonical", [V::String(x)]) => Addr::parse(x.as_str())
            .map(|a| V::Bool(a.to_string() == x.as_str()))
            .map_err(|e| EvalError::Runtime(e.to_string())),
        ("family", [V::Ip(a)]) => Ok(V::Int(a.family())),
        ("isUnspecified", [V::Ip(a)]) => Ok(V::Bool(a.is_unspecified())),
        ("isLoopback", [V::Ip(a)]) => Ok(V::Bool(a.is_loopback())),
        ("isLinkLocalMulticast", [V::Ip(a)]) => Ok(V::Bool(a.is_link_local_multicast())),
        ("isLinkLocalUnicast", [V::Ip(a)]) => Ok(V::Bool(a.is_link_local_unicast())),
        ("isGlobalUnicast", [V::Ip(a)]) => Ok(V::Bool(a.is_global_unicast())),
        ("string", [V::Ip(a)]) => Ok(s(a.to_string())),
        ("string", [V::Cidr(p)]) => Ok(s(p.to_string())),
        ("cidr", [V::String(x)]) => Prefix::parse(x.as_str())
            .map(V::Cidr)
            .map_err(|e| EvalError::Runtime(e.to_string())),
        ("isCIDR", [V::String(x)]) => Ok(V::Bool(Prefix::parse(x.as_str()).is_ok())),
        ("containsIP", [V::Cidr(p), other]) => {
            let ip = match other {
                V::Ip(a) => *a,
                V::String(x) => {
                    Addr::parse(x.as_str()).map_err(|e| EvalError::Runtime(e.to_string()))?
                }
                _ => return no_overload(),
            };
            Ok(V::Bool(p.contains(ip)))
        }
        ("containsCIDR", [V::Cidr(p), other]) => {
            let o = match other {
                V::Cidr(o) => *o,
                V::String(x) => {
                    Prefix::parse(x.as_str()).map_err(|e| EvalError::Runtime(e.to_string()))?
                }
                _ => return no_overload(),
            };
            Ok(V::Bool(p.contains_prefix(o)))
        }
        ("prefixLength", [V::Cidr(p)]) => Ok(V::Int(i64::from(p.bits))),
        ("masked", [V::Cidr(p)]) => Ok(V::Cidr(p.masked())),
        ("optional.of", [x]) => Ok(V::Optional(Some(Arc::new(x.clone())))),
        ("optional.ofNonZeroValue", [x]) => Ok(V::Optional(if is_zero(x) {
            None
        } else {
            Some(Arc::new(x.clone()))
        })),
        ("optional.none", []) => Ok(V::Optional(None)),
        ("hasValue", [V::Optional(o)]) => Ok(V::Bool(o.is_some())),
        ("value", [V::Optional(o)]) => match o {
            Some(v) => Ok((**v).clone()),
            None => rt("optional.none() dereference"),
        },
        ("or", [V::Optional(o), other @ V::Optional(_)]) => Ok(if o.is_some() {
            V::Optional(o.clone())
        } else {
            other.clone()
        }),
        ("orValue", [V::Optional(o), other]) => Ok(match o {
            Some(v) => (**v).clone(),
            None => other.clone(),
        }),
        ("includes", [target, arg]) => match target {
            V::List(l) => {
                if l.len() > 48 {
                    // ResourceSliceMaxAttributeValuesPerDevice.
                    return rt(
                        "'includes' function cannot be applied to lists longer than 48 values",
                    );
                }
                Ok(V::Bool(
                    l.iter().any(|e| matches!(equals(e, arg), Eq::True)),
                ))
            }
            t => Ok(V::Bool(matches!(equals(t, arg), Eq::True))),
        },
        (_, args) if args.iter().any(|a| matches!(a, V::Error(_))) => {
            match args.iter().find_map(|a| match a {
                V::Error(e) => Some(e.clone()),
                _ => None,
            }) {
                Some(e) => rt(e.to_string()),
                None => no_overload(),
            }
        }
        _ => no_overload(),
    }
}

fn ord_int(o: Ordering) -> i64 {
    match o {
        Ordering::Less => -1,
        Ordering::Equal => 0,
        Ordering::Greater => 1,
    }
}

fn is_go_space(c: char) -> bool {
    c.is_whitespace() || c == '\u{85}' || c == '\u{a0}'
}

fn is_zero(v: &Value<'_>) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Int(i) => *i == 0,
        Value::Uint(u) => *u == 0,
        Value::Double(d) => *d == 0.0,
        Value::String(s) => s.as_str().is_empty(),
        Value::Bytes(b) => b.is_empty(),
        Value::List(l) => l.is_empty(),
        Value::Map(m) => m.is_empty(),
        _ => false,
    }
}

fn flatten<'a>(l: &[Value<'a>], depth: i64) -> Vec<Value<'a>> {
    let mut out = Vec::new();
    for e in l {
        match e {
            Value::List(inner) if depth > 0 => out.extend(flatten(inner, depth - 1)),
            other => out.push(other.clone()),
        }
    }
    out
}

fn quote(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '\u{7}' => out.push_str("\\a"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{b}' => out.push_str("\\v"),
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn parse_go_float(s: &str) -> Option<f64> {
    match s {
        "Inf" | "+Inf" | "inf" | "+inf" | "Infinity" | "+Infinity" | "infinity" => {
            Some(f64::INFINITY)
        }
        "-Inf" | "-inf" | "-Infinity" | "-infinity" => Some(f64::NEG_INFINITY),
        "NaN" | "nan" => Some(f64::NAN),
        _ if s
            .chars()
            .any(|c| c.is_ascii_alphabetic() && c != 'e' && c != 'E') =>
        {
            None
        }
        _ => s.parse().ok(),
    }
}

/// Runtime cost of one call, charged after it returns (cel-go `CostTracker.costCall`): the
/// overload trackers of `ext.Lists(3)`/`ext.Sets()` (by overload id, when the checker resolved
/// exactly one), then the Kubernetes `library.CostEstimator.CallCost` (by function name), then
/// cel-go's defaults (by overload id).
pub(crate) fn call_cost(
    name: &str,
    overloads: &[&'static str],
    a: &[Value<'_>],
    result: Option<&Value<'_>>,
) -> u64 {
    let id = match overloads {
        [only] => *only,
        _ => "",
    };
    if let Some(c) = extension_cost(id, a, result) {
        return c;
    }
    if let Some(c) = library_cost(name, id, a, result) {
        return c;
    }
    let size = |i: usize| a.get(i).map_or(1, Value::actual_size);
    let trav = |n: u64| crate::cost::by_factor(n, crate::cost::STRING_TRAVERSAL);
    match id {
        "starts_with_string" | "ends_with_string" | "string_to_bytes" | "bytes_to_string"
        | "strings_quote" | "string_format" => trav(size(0)),
        "in_list" => size(1),
        "equals" | "not_equals" => trav(size(0).min(size(1))),
        "add_string" | "add_bytes" => trav(size(0).saturating_add(size(1))),
        "matches_string" => {
            let s =
                crate::cost::by_factor(size(0).saturating_add(1), crate::cost::STRING_TRAVERSAL);
            let r = crate::cost::by_factor(size(1), crate::cost::REGEX_LENGTH);
            s.saturating_mul(r)
        }
        "contains_string" => trav(size(0)).saturating_mul(trav(size(1))),
        _ if is_sized_comparison(id) => trav(size(0).min(size(1))),
        _ => 1,
    }
}

fn is_sized_comparison(id: &str) -> bool {
    ["less_", "greater_", "less_equals_", "greater_equals_"]
        .iter()
        .any(|p| matches!(id.strip_prefix(p), Some("string" | "bytes")))
}

/// `trackAllocatingListCall`: `size * factor` (truncated) plus the call and the list.
fn allocating(factor: f64, size: u64) -> u64 {
    ((size as f64 * factor) as u64).saturating_add(1 + 10)
}

/// The overload trackers of `ext/lists.go` (v3) and `ext/sets.go`.
fn extension_cost(id: &str, a: &[Value<'_>], result: Option<&Value<'_>>) -> Option<u64> {
    let size = |i: usize| a.get(i).map_or(1, Value::actual_size);
    match id {
        "list_slice" | "lists_range" | "list_reverse" => {
            Some(allocating(1.0, result.map_or(1, Value::actual_size)))
        }
        "list_flatten" | "list_flatten_int" => {
            let depth = match a.get(1) {
                Some(Value::Int(d)) => *d as f64,
                _ => 1.0,
            };
            Some(allocating(depth, size(0)))
        }
        "list_distinct" => Some(self_compare(a.first())),
        _ if id.starts_with("list_") && id.ends_with("_sort") => Some(self_compare(a.first())),
        _ if id.starts_with("list_") && id.ends_with("_sortByAssociatedKeys") => {
            Some(self_compare(a.get(1)))
        }
        "list_sets_contains_list" | "list_sets_intersects_list" => {
            Some(1 + (size(0).saturating_mul(size(1)) as f64) as u64)
        }
        "list_sets_equivalent_list" => {
            Some(1 + (size(0).saturating_mul(size(1)) as f64 * 2.0) as u64)
        }
        _ => None,
    }
}

/// `trackListSelfCompare`: O(n^2) over the input list, more for strings and bytes.
fn self_compare(l: Option<&Value<'_>>) -> u64 {
    let Some(Value::List(l)) = l else {
        return allocating(2.0, 0);
    };
    let n = l.len() as u64;
    let factor = match l.first() {
        Some(Value::String(_) | Value::Bytes(_)) => 2.0 + crate::cost::STRING_TRAVERSAL,
        _ => 2.0,
    };
    allocating(factor, n.saturating_mul(n))
}

/// `traversalCost` of the Kubernetes library: strings and bytes by length (truncated), lists
/// and maps by their elements, anything else 1.
fn traversal_cost(v: &Value<'_>) -> u64 {
    let bytes = |n: usize| (n as f64 * crate::cost::STRING_TRAVERSAL) as u64;
    match v {
        Value::String(s) => bytes(s.as_str().len()),
        Value::Bytes(b) => bytes(b.len()),
        Value::List(l) => l
            .iter()
            .fold(0u64, |acc, e| acc.saturating_add(traversal_cost(e))),
        m if is_map(m) => map_entries(m).iter().fold(0u64, |acc, (k, v)| {
            acc.saturating_add(traversal_cost(k))
                .saturating_add(traversal_cost(v))
        }),
        _ => 1,
    }
}

/// `library.CostEstimator.CallCost`, keyed by function name.
fn library_cost(name: &str, id: &str, a: &[Value<'_>], result: Option<&Value<'_>>) -> Option<u64> {
    let size = |i: usize| a.get(i).map_or(1, Value::actual_size);
    let ceil = |n: u64, f: f64| (n as f64 * f).ceil() as u64;
    let t = crate::cost::STRING_TRAVERSAL;
    Some(match name {
        "isSorted" | "sum" | "max" | "min" | "indexOf" | "lastIndexOf" => {
            a.first().map_or(0, traversal_cost)
        }
        "url" | "lowerAscii" | "upperAscii" | "substring" | "trim" if !a.is_empty() => {
            ceil(size(0), t)
        }
        "replace" | "split" if !a.is_empty() => ceil(size(0), 2.0 * t),
        "join" if !a.is_empty() => ceil(result.map_or(1, Value::actual_size), 2.0 * t),
        "find" | "findAll" if a.len() >= 2 => {
            let s = ((1.0 + size(0) as f64) * t).ceil() as u64;
            let r = ceil(size(1), crate::cost::REGEX_LENGTH);
            s.saturating_mul(r)
        }
        "cidr" | "isIP" | "isCIDR" if !a.is_empty() => ceil(size(0), t),
        "ip" if id == "cidr_ip" => 1,
        "ip" if !a.is_empty() => ceil(size(0), t),
        "ip.isCanonical" if !a.is_empty() => ceil(size(0), 2.0 * t),
        "masked"
        | "prefixLength"
        | "family"
        | "isUnspecified"
        | "isLoopback"
        | "isLinkLocalMulticast"
        | "isLinkLocalUnicast"
        | "isGlobalUnicast" => 1,
        "containsIP" | "containsCIDR" if a.len() >= 2 => {
            let cidr = size(0);
            let mut c = ceil(cidr.saturating_add(cidr), t);
            if name == "containsCIDR" {
                c = c.saturating_add(ceil(cidr, t)).saturating_add(1);
            }
            if id == "cidr_contains_ip_string" || id == "cidr_contains_cidr_string" {
                c = c.saturating_add(ceil(size(1), t));
            }
            c
        }
        "quantity" | "isQuantity" | "semver" | "isSemver" if !a.is_empty() => ceil(size(0), t),
        "sign" | "asInteger" | "isInteger" | "asApproximateFloat" | "isGreaterThan"
        | "isLessThan" | "compareTo" | "add" | "sub" | "major" | "minor" | "patch" => 1,
        "getScheme" | "getHostname" | "getHost" | "getPort" | "getEscapedPath" | "getQuery" => 1,
        "validate" if a.len() >= 2 => match &a[0] {
            Value::Format(f) => {
                let s = ((1.0 + size(1) as f64) * t).ceil() as u64;
                s.saturating_mul(ceil(f.max_regex_size(), crate::cost::REGEX_LENGTH))
            }
            _ => return None,
        },
        "format.named" => 1,
        "_==_" if a.len() == 2 => match &a[0] {
            Value::Quantity(_)
            | Value::Semver(_)
            | Value::Ip(_)
            | Value::Cidr(_)
            | Value::Url(_)
            | Value::Format(_) => 1,
            _ => return None,
        },
        _ => return None,
    })
}
