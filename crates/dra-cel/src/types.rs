//! CEL types as the type checker sees them, and the assignability rules between them.
//!
//! Mirrors cel-go's `checker/types.go` (v0.26.0): `Dyn` and `Any` accept everything, type
//! parameters unify through a substitution mapping, and the most general of two types wins when
//! a literal's element types are joined.

use std::collections::HashMap;
use std::fmt;

/// A CEL type at check time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Type {
    /// `dyn`: any value, checked at runtime.
    Dyn,
    /// `google.protobuf.Any`: what upstream declares for scalar device attributes.
    Any,
    /// The type of an expression that failed to check.
    Error,
    /// `null_type`.
    Null,
    /// `bool`.
    Bool,
    /// `int` (64-bit signed).
    Int,
    /// `uint` (64-bit unsigned).
    Uint,
    /// `double` (IEEE 754 binary64).
    Double,
    /// `string` (Unicode code points).
    String,
    /// `bytes`.
    Bytes,
    /// `list(T)`.
    List(Box<Type>),
    /// `map(K, V)`.
    Map(Box<Type>, Box<Type>),
    /// `type(T)`: the type of a type value.
    Type(Box<Type>),
    /// An opaque type with parameters: `optional_type(T)`, `kubernetes.Quantity`, ...
    Opaque(&'static str, Vec<Type>),
    /// A message type with declared fields (only `kubernetes.DRADevice` here).
    Struct(&'static str),
    /// A type parameter (declaration parameter or checker type variable).
    Param(u32),
}

/// Opaque type name of optionals.
pub const OPTIONAL: &str = "optional_type";
/// Opaque type name of Kubernetes quantities.
pub const QUANTITY: &str = "kubernetes.Quantity";
/// Opaque type name of semantic versions.
pub const SEMVER: &str = "kubernetes.Semver";
/// Opaque type name of URLs.
pub const URL: &str = "kubernetes.URL";
/// Opaque type name of IP addresses.
pub const IP: &str = "net.IP";
/// Opaque type name of CIDRs.
pub const CIDR: &str = "net.CIDR";
/// Type name of the Kubernetes named formats (`library/format.go`; an object type upstream
/// with no fields, modelled as opaque here).
pub const FORMAT: &str = "kubernetes.NamedFormat";
/// Struct name of the `device` variable.
pub const DEVICE: &str = "kubernetes.DRADevice";

impl Type {
    /// `list(t)`.
    pub fn list(t: Type) -> Type {
        Type::List(Box::new(t))
    }
    /// `map(k, v)`.
    pub fn map(k: Type, v: Type) -> Type {
        Type::Map(Box::new(k), Box::new(v))
    }
    /// `optional_type(t)`.
    pub fn optional(t: Type) -> Type {
        Type::Opaque(OPTIONAL, vec![t])
    }
    /// A parameterless opaque type.
    pub fn opaque(name: &'static str) -> Type {
        Type::Opaque(name, Vec::new())
    }

    pub(crate) fn is_dyn(&self) -> bool {
        matches!(self, Type::Dyn | Type::Any)
    }

    pub(crate) fn is_dyn_or_error(&self) -> bool {
        matches!(self, Type::Dyn | Type::Any | Type::Error)
    }

    /// The wrapped type of an optional, or the type itself.
    pub(crate) fn unwrap_optional(&self) -> (Type, bool) {
        match self {
            Type::Opaque(OPTIONAL, p) if p.len() == 1 => (p[0].clone(), true),
            other => (other.clone(), false),
        }
    }

    fn kind(&self) -> u8 {
        match self {
            Type::Dyn => 0,
            Type::Any => 1,
            Type::Error => 2,
            Type::Null => 3,
            Type::Bool => 4,
            Type::Int => 5,
            Type::Uint => 6,
            Type::Double => 7,
            Type::String => 8,
            Type::Bytes => 9,
            Type::List(_) => 10,
            Type::Map(..) => 11,
            Type::Type(_) => 12,
            Type::Opaque(..) => 13,
            Type::Struct(_) => 14,
            Type::Param(_) => 15,
        }
    }

    fn params(&self) -> Vec<&Type> {
        match self {
            Type::List(e) => vec![e],
            Type::Map(k, v) => vec![k, v],
            Type::Type(t) => vec![t],
            Type::Opaque(_, p) => p.iter().collect(),
            _ => Vec::new(),
        }
    }

    /// Equivalence as cel-go's `Type.IsEquivalentType` (used by the homogeneous literal
    /// validator): same kind, name and equivalent parameters.
    pub(crate) fn is_equivalent(&self, other: &Type) -> bool {
        if self.kind() != other.kind() {
            return false;
        }
        match (self, other) {
            (Type::Opaque(a, _), Type::Opaque(b, _)) if a != b => false,
            (Type::Struct(a), Type::Struct(b)) => a == b,
            (Type::Param(a), Type::Param(b)) => a == b,
            _ => {
                let (pa, pb) = (self.params(), other.params());
                pa.len() == pb.len() && pa.iter().zip(pb).all(|(a, b)| a.is_equivalent(b))
            }
        }
    }
}

impl fmt::Display for Type {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Type::Dyn => f.write_str("dyn"),
            Type::Any => f.write_str("any"),
            Type::Error => f.write_str("*error*"),
            Type::Null => f.write_str("null_type"),
            Type::Bool => f.write_str("bool"),
            Type::Int => f.write_str("int"),
            Type::Uint => f.write_str("uint"),
            Type::Double => f.write_str("double"),
            Type::String => f.write_str("string"),
            Type::Bytes => f.write_str("bytes"),
            Type::List(e) => write!(f, "list({e})"),
            Type::Map(k, v) => write!(f, "map({k}, {v})"),
            Type::Type(t) => write!(f, "type({t})"),
            Type::Opaque(n, p) if p.is_empty() => f.write_str(n),
            Type::Opaque(n, p) => {
                write!(f, "{n}(")?;
                for (i, t) in p.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{t}")?;
                }
                f.write_str(")")
            }
            Type::Struct(n) => f.write_str(n),
            Type::Param(n) => write!(f, "_var{n}"),
        }
    }
}

/// Type parameter substitutions found while checking one expression.
#[derive(Clone, Debug, Default)]
pub(crate) struct Mapping {
    subs: HashMap<u32, Type>,
}

impl Mapping {
    fn find(&self, t: &Type) -> Option<&Type> {
        match t {
            Type::Param(p) => self.subs.get(p),
            _ => None,
        }
    }

    fn add(&mut self, param: &Type, t: Type) {
        if let Type::Param(p) = param {
            self.subs.insert(*p, t);
        }
    }
}

fn is_equal_or_less_specific(t1: &Type, t2: &Type) -> bool {
    if t1.is_dyn() || matches!(t1, Type::Param(_)) {
        return true;
    }
    if t2.is_dyn() || matches!(t2, Type::Param(_)) {
        return false;
    }
    if t1.kind() != t2.kind() {
        return false;
    }
    match (t1, t2) {
        (Type::Opaque(n1, p1), Type::Opaque(n2, p2)) => {
            n1 == n2
                && p1.len() == p2.len()
                && p1
                    .iter()
                    .zip(p2)
                    .all(|(a, b)| is_equal_or_less_specific(a, b))
        }
        (Type::List(a), Type::List(b)) => is_equal_or_less_specific(a, b),
        (Type::Map(k1, v1), Type::Map(k2, v2)) => {
            is_equal_or_less_specific(k1, k2) && is_equal_or_less_specific(v1, v2)
        }
        (Type::Type(_), Type::Type(_)) => true,
        _ => t1 == t2,
    }
}

pub(crate) fn most_general(t1: &Type, t2: &Type) -> Type {
    if is_equal_or_less_specific(t1, t2) {
        t1.clone()
    } else {
        t2.clone()
    }
}

fn not_referenced_in(m: &Mapping, t: &Type, within: &Type) -> bool {
    if t == within {
        return false;
    }
    match within {
        Type::Param(_) => match m.find(within) {
            None => true,
            Some(sub) => not_referenced_in(m, t, sub),
        },
        Type::Opaque(..) | Type::List(_) | Type::Map(..) | Type::Type(_) => {
            within.params().iter().all(|p| not_referenced_in(m, t, p))
        }
        _ => true,
    }
}

fn is_valid_substitution(m: &mut Mapping, t1: &Type, t2: &Type) -> (bool, bool) {
    if t1 == t2 {
        return (true, true);
    }
    if let Some(t2_sub) = m.find(t2).cloned() {
        if *t1 == t2_sub {
            return (true, true);
        }
        if internal_is_assignable(m, t1, &t2_sub) {
            let t2_new = most_general(t1, &t2_sub);
            if not_referenced_in(m, t2, &t2_new) {
                m.add(t2, t2_new);
            }
            return (true, true);
        }
        return (false, true);
    }
    if not_referenced_in(m, t2, t1) {
        m.add(t2, t1.clone());
        return (true, false);
    }
    (false, false)
}

fn is_legacy_nullable(t: &Type) -> bool {
    matches!(t, Type::Opaque(..) | Type::Struct(_) | Type::Any)
}

pub(crate) fn internal_is_assignable(m: &mut Mapping, t1: &Type, t2: &Type) -> bool {
    if matches!(t2, Type::Param(_)) {
        let (valid, has_sub) = is_valid_substitution(m, t1, t2);
        if valid {
            return true;
        }
        if has_sub {
            return false;
        }
    }
    if matches!(t1, Type::Param(_)) {
        return is_valid_substitution(m, t2, t1).0;
    }
    if t1.is_dyn_or_error() || t2.is_dyn_or_error() {
        return true;
    }
    if matches!(t1, Type::Null) {
        return is_legacy_nullable(t2) || matches!(t2, Type::Null);
    }
    if matches!(t2, Type::Null) {
        return is_legacy_nullable(t1);
    }
    match (t1, t2) {
        (Type::Type(_), _) => matches!(t2, Type::Type(_)),
        (Type::Opaque(n1, p1), Type::Opaque(n2, p2)) => {
            n1 == n2 && internal_is_assignable_list(m, p1, p2)
        }
        (Type::List(a), Type::List(b)) => internal_is_assignable(m, a, b),
        (Type::Map(k1, v1), Type::Map(k2, v2)) => {
            internal_is_assignable(m, k1, k2) && internal_is_assignable(m, v1, v2)
        }
        (Type::Opaque(..) | Type::List(_) | Type::Map(..), _) => false,
        _ => t1 == t2,
    }
}

fn internal_is_assignable_list(m: &mut Mapping, l1: &[Type], l2: &[Type]) -> bool {
    l1.len() == l2.len()
        && l1
            .iter()
            .zip(l2)
            .all(|(a, b)| internal_is_assignable(m, a, b))
}

/// Assignability that commits substitutions only on success.
pub(crate) fn is_assignable(m: &mut Mapping, t1: &Type, t2: &Type) -> bool {
    let mut copy = m.clone();
    if internal_is_assignable(&mut copy, t1, t2) {
        *m = copy;
        true
    } else {
        false
    }
}

/// List assignability that commits substitutions only on success.
pub(crate) fn is_assignable_list(m: &mut Mapping, l1: &[Type], l2: &[Type]) -> bool {
    let mut copy = m.clone();
    if internal_is_assignable_list(&mut copy, l1, l2) {
        *m = copy;
        true
    } else {
        false
    }
}

/// Applies the substitutions; unbound parameters become `dyn` when `param_to_dyn`.
pub(crate) fn substitute(m: &Mapping, t: &Type, param_to_dyn: bool) -> Type {
    if let Some(sub) = m.find(t) {
        return substitute(m, sub, param_to_dyn);
    }
    match t {
        Type::Param(_) if param_to_dyn => Type::Dyn,
        Type::Opaque(n, p) => Type::Opaque(
            n,
            p.iter().map(|x| substitute(m, x, param_to_dyn)).collect(),
        ),
        Type::List(e) => Type::list(substitute(m, e, param_to_dyn)),
        Type::Map(k, v) => Type::map(
            substitute(m, k, param_to_dyn),
            substitute(m, v, param_to_dyn),
        ),
        Type::Type(p) => Type::Type(Box::new(substitute(m, p, param_to_dyn))),
        other => other.clone(),
    }
}

/// Replaces declaration parameters (`Param(n)` with n below [`FRESH_BASE`]) with fresh ones.
pub(crate) fn instantiate(t: &Type, base: u32) -> Type {
    match t {
        Type::Param(n) if *n < FRESH_BASE => Type::Param(base + n),
        Type::Opaque(n, p) => Type::Opaque(n, p.iter().map(|x| instantiate(x, base)).collect()),
        Type::List(e) => Type::list(instantiate(e, base)),
        Type::Map(k, v) => Type::map(instantiate(k, base), instantiate(v, base)),
        Type::Type(p) => Type::Type(Box::new(instantiate(p, base))),
        other => other.clone(),
    }
}

/// Type variables made by the checker start here; lower numbers are declaration parameters.
pub(crate) const FRESH_BASE: u32 = 1000;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_type_parameter_binds_to_the_first_type_and_generalises_to_dyn() {
        let mut m = Mapping::default();
        let a = Type::Param(FRESH_BASE);
        assert!(is_assignable(&mut m, &Type::Int, &a));
        assert_eq!(substitute(&m, &a, false), Type::Int);
        assert!(!is_assignable(&mut m, &Type::String, &a));
        assert!(is_assignable(&mut m, &Type::Dyn, &a));
        assert_eq!(substitute(&m, &a, false), Type::Dyn);
    }

    #[test]
    fn lists_of_different_element_types_are_not_assignable() {
        let mut m = Mapping::default();
        assert!(!is_assignable(
            &mut m,
            &Type::list(Type::Int),
            &Type::list(Type::String)
        ));
        assert!(is_assignable(
            &mut m,
            &Type::list(Type::Int),
            &Type::list(Type::Dyn)
        ));
    }
}
