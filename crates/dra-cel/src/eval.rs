//! Evaluation of a checked program against one device, with cel-go's runtime cost tracking.
//!
//! Error semantics follow cel-go v0.26.0 (`interpreter/interpretable.go`): `&&`/`||` absorb an
//! error when the other side decides the result, comprehensions run until their loop condition
//! is false, and a constant list on the right of `in` becomes a hash set. Cost follows
//! `interpreter/runtimecost.go`: 1 per identifier and per field/index qualifier, the call costs
//! of the standard and Kubernetes libraries, 10 per list and 30 per map literal that is not
//! constant; exceeding the limit interrupts evaluation.

use std::cmp::Ordering;
use std::sync::Arc;
use std::time::Instant;

use crate::checker::{DeviceField, Kind, Node};
use crate::device::DeviceView;
use crate::value::{
    Eq, Str, Value, cmp_int_double, cmp_uint_double, equals, is_map, map_entries, map_find,
};

/// How an evaluation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EvalError {
    /// A CEL runtime error (`no such key`, `no such overload`, division by zero, ...).
    #[error("{0}")]
    Runtime(String),
    /// The runtime cost limit was exceeded.
    #[error("operation cancelled: actual cost limit exceeded")]
    CostLimit,
    /// The deadline passed.
    #[error("operation interrupted")]
    Interrupted,
}

fn rt<T>(msg: impl Into<String>) -> Result<T, EvalError> {
    Err(EvalError::Runtime(msg.into()))
}

fn no_overload<T>() -> Result<T, EvalError> {
    rt("no such overload")
}

type R<'a> = Result<Value<'a>, EvalError>;

/// Evaluation state for one (program, device) pair.
pub(crate) struct Evaluator<'a> {
    pub device: &'a DeviceView<'a>,
    pub slots: Vec<Value<'a>>,
    pub cost: u64,
    pub limit: u64,
    pub deadline: Option<Instant>,
    pub steps: u32,
}

impl<'a> Evaluator<'a> {
    fn charge(&mut self, c: u64) -> Result<(), EvalError> {
        self.cost = self.cost.saturating_add(c);
        if self.cost > self.limit {
            return Err(EvalError::CostLimit);
        }
        Ok(())
    }

    fn tick(&mut self) -> Result<(), EvalError> {
        self.steps = self.steps.wrapping_add(1);
        if self.steps.is_multiple_of(100)
            && let Some(d) = self.deadline
            && Instant::now() >= d
        {
            return Err(EvalError::Interrupted);
        }
        Ok(())
    }

    pub(crate) fn eval(&mut self, n: &'a Node) -> R<'a> {
        match &n.kind {
            Kind::Const(v) => Ok(v.clone()),
            Kind::Var(slot) => {
                self.charge(1)?;
                match self.slots.get(*slot) {
                    Some(Value::Error(e)) => rt(e.to_string()),
                    Some(v) => Ok(v.clone()),
                    None => Ok(Value::Null),
                }
            }
            Kind::Device => {
                self.charge(1)?;
                Ok(Value::Device(self.device))
            }
            Kind::DeviceField(operand, f) => {
                let base = self.attr_root(operand)?;
                self.charge(1)?;
                match base {
                    Value::Device(d) => Ok(match f {
                        DeviceField::Driver => Value::String(Str::Borrowed(d.driver)),
                        DeviceField::Attributes => Value::Attributes(d),
                        DeviceField::Capacity => Value::Capacity(d),
                        DeviceField::AllowMultipleAllocations => {
                            Value::Bool(d.allow_multiple_allocations)
                        }
                    }),
                    other => self.select(other, field_name(*f)),
                }
            }
            Kind::Select {
                operand,
                field,
                test,
            } => {
                let base = self.attr_root(operand)?;
                if *test {
                    return self.has(base, field);
                }
                self.charge(1)?;
                self.select(base, field)
            }
            Kind::OptSelect { operand, field } => {
                let base = self.eval(operand)?;
                self.charge(1)?;
                self.opt_select(base, field)
            }
            Kind::And(l, r) => {
                let lv = self.eval(l);
                if let Ok(Value::Bool(false)) = lv {
                    return Ok(Value::Bool(false));
                }
                let rv = self.eval(r);
                match (lv, rv) {
                    (_, Ok(Value::Bool(false))) => Ok(Value::Bool(false)),
                    (Ok(Value::Bool(true)), Ok(Value::Bool(true))) => Ok(Value::Bool(true)),
                    (Err(EvalError::Runtime(e)), _) => rt(e),
                    (_, Err(e)) => Err(e),
                    (Err(e), _) => Err(e),
                    _ => no_overload(),
                }
            }
            Kind::Or(l, r) => {
                let lv = self.eval(l);
                if let Ok(Value::Bool(true)) = lv {
                    return Ok(Value::Bool(true));
                }
                let rv = self.eval(r);
                match (lv, rv) {
                    (_, Ok(Value::Bool(true))) => Ok(Value::Bool(true)),
                    (Ok(Value::Bool(false)), Ok(Value::Bool(false))) => Ok(Value::Bool(false)),
                    (Err(EvalError::Runtime(e)), _) => rt(e),
                    (_, Err(e)) => Err(e),
                    (Err(e), _) => Err(e),
                    _ => no_overload(),
                }
            }
            Kind::Cond(c, t, f) => match self.eval(c)? {
                Value::Bool(true) => self.eval(t),
                Value::Bool(false) => self.eval(f),
                _ => no_overload(),
            },
            Kind::List { elems, optional } => {
                let mut out = Vec::with_capacity(elems.len());
                for (e, opt) in elems.iter().zip(optional) {
                    let v = self.eval(e)?;
                    if *opt {
                        match v {
                            Value::Optional(Some(inner)) => out.push((*inner).clone()),
                            Value::Optional(None) => {}
                            _ => return no_overload(),
                        }
                    } else {
                        out.push(v);
                    }
                }
                if !is_const_node(n) {
                    self.charge(10)?;
                }
                Ok(Value::List(Arc::new(out)))
            }
            Kind::Map { entries } => {
                let mut out: Vec<(Value<'a>, Value<'a>)> = Vec::with_capacity(entries.len());
                for (k, v, opt) in entries {
                    let kv = self.eval(k)?;
                    if !matches!(
                        kv,
                        Value::String(_) | Value::Int(_) | Value::Uint(_) | Value::Bool(_)
                    ) {
                        return rt(format!("unsupported key type: {}", kv.type_name()));
                    }
                    let vv = self.eval(v)?;
                    let vv = if *opt {
                        match vv {
                            Value::Optional(Some(inner)) => (*inner).clone(),
                            Value::Optional(None) => continue,
                            _ => return no_overload(),
                        }
                    } else {
                        vv
                    };
                    if map_find(&out, &kv).is_some() {
                        return rt(format!("Failed with repeated key: {}", display_key(&kv)));
                    }
                    out.push((kv, vv));
                }
                if !is_const_node(n) {
                    self.charge(30)?;
                }
                Ok(Value::Map(Arc::new(out)))
            }
            Kind::Bind { slot, init, body } => {
                let v = self.eval(init)?;
                self.set_slot(*slot, v);
                self.eval(body)
            }
            Kind::Fold(f) => {
                let range = self.eval(&f.range)?;
                let items = iter_items(&range)?;
                let init = self.eval(&f.init)?;
                self.set_slot(f.accu, init);
                for (i, (k, v)) in items.into_iter().enumerate() {
                    self.tick()?;
                    match f.var2 {
                        None => self.set_slot(f.var1, k),
                        Some(s2) => {
                            if matches!(range, Value::List(_)) {
                                self.set_slot(
                                    f.var1,
                                    Value::Int(i64::try_from(i).unwrap_or(i64::MAX)),
                                );
                                self.set_slot(s2, k);
                            } else {
                                self.set_slot(f.var1, k);
                                self.set_slot(s2, v);
                            }
                        }
                    }
                    let cond = self.eval(&f.cond);
                    if !matches!(cond, Ok(Value::Bool(true))) {
                        if let Err(e @ (EvalError::CostLimit | EvalError::Interrupted)) = cond {
                            return Err(e);
                        }
                        break;
                    }
                    let step = self.eval(&f.step);
                    match step {
                        Ok(v) => self.set_slot(f.accu, v),
                        // An error accumulator keeps flowing through the loop like cel-go's
                        // error values: a later `&&`/`||` step may still absorb it.
                        Err(EvalError::Runtime(e)) => {
                            self.set_slot(f.accu, Value::Error(Arc::from(e)))
                        }
                        Err(e) => return Err(e),
                    }
                }
                self.eval(&f.result)
            }
            Kind::Call {
                name,
                overloads,
                args,
            } => self.call(name, overloads, args, n),
        }
    }

    fn set_slot(&mut self, slot: usize, v: Value<'a>) {
        if slot >= self.slots.len() {
            self.slots.resize(slot + 1, Value::Null);
        }
        self.slots[slot] = v;
    }

    /// Evaluates the operand of a qualifier. An attribute chain (identifier, field selections,
    /// constant indexes) costs 1 for its root plus 1 per qualifier; any other operand is a
    /// relative attribute whose root costs 1 on top of the operand.
    fn attr_root(&mut self, operand: &'a Node) -> R<'a> {
        match &operand.kind {
            Kind::Var(_)
            | Kind::Device
            | Kind::DeviceField(..)
            | Kind::Select { test: false, .. } => self.eval(operand),
            Kind::Call { name: "_[_]", .. } => self.eval(operand),
            _ => {
                let v = self.eval(operand)?;
                self.charge(1)?;
                Ok(v)
            }
        }
    }

    fn select(&mut self, base: Value<'a>, field: &str) -> R<'a> {
        match base {
            Value::Optional(None) => Ok(Value::Optional(None)),
            Value::Optional(Some(v)) => {
                let r = self.select((*v).clone(), field);
                match r {
                    Ok(v) => Ok(Value::Optional(Some(Arc::new(v)))),
                    Err(EvalError::Runtime(_)) => Ok(Value::Optional(None)),
                    Err(e) => Err(e),
                }
            }
            other => self.index_value(other, &Value::String(Str::Borrowed(leak_free(field))), true),
        }
    }

    fn opt_select(&mut self, base: Value<'a>, field: &str) -> R<'a> {
        let base = match base {
            Value::Optional(None) => return Ok(Value::Optional(None)),
            Value::Optional(Some(v)) => (*v).clone(),
            other => other,
        };
        if !is_map(&base) && !matches!(base, Value::Device(_)) {
            return no_overload();
        }
        let key = Value::string(field);
        if !self.contains_key(&base, &key)? {
            return Ok(Value::Optional(None));
        }
        let v = self.index_value(base, &key, true)?;
        Ok(Value::Optional(Some(Arc::new(v))))
    }

    fn has(&mut self, base: Value<'a>, field: &str) -> R<'a> {
        match base {
            Value::Device(_) => Ok(Value::Bool(matches!(
                field,
                "driver" | "attributes" | "capacity" | "allowMultipleAllocations"
            ))),
            // Upstream wraps these two maps so that any domain is present.
            Value::Attributes(_) | Value::Capacity(_) => Ok(Value::Bool(true)),
            ref m if is_map(m) => {
                let key = Value::string(field);
                Ok(Value::Bool(self.contains_key(&base, &key)?))
            }
            Value::Optional(_) => no_overload(),
            _ => no_overload(),
        }
    }

    fn contains_key(&mut self, m: &Value<'a>, key: &Value<'_>) -> Result<bool, EvalError> {
        Ok(match (m, key) {
            (Value::Attributes(d), Value::String(s)) => d.attribute_domains().contains(&s.as_str()),
            (Value::Capacity(d), Value::String(s)) => d.capacity_domains().contains(&s.as_str()),
            (Value::AttributeDomain(d, dom), Value::String(s)) => {
                d.attribute(dom.as_str(), s.as_str()).is_some()
            }
            (Value::CapacityDomain(d, dom), Value::String(s)) => {
                d.capacity(dom.as_str(), s.as_str()).is_some()
            }
            (Value::Device(_), Value::String(s)) => {
                matches!(
                    s.as_str(),
                    "driver" | "attributes" | "capacity" | "allowMultipleAllocations"
                )
            }
            (Value::Map(entries), k) => map_find(entries, k).is_some(),
            (m, _) if is_map(m) => false,
            _ => return no_overload().map(|_: Value<'_>| false),
        })
    }

    /// `base[key]` (also field selection with `select = true`).
    fn index_value(&mut self, base: Value<'a>, key: &Value<'_>, _select: bool) -> R<'a> {
        match (&base, key) {
            (Value::Attributes(d), Value::String(s)) => {
                let dom = d
                    .attribute_domains()
                    .into_iter()
                    .find(|x| *x == s.as_str())
                    .map(Str::Borrowed)
                    .unwrap_or_else(|| Str::Shared(Arc::from(s.as_str())));
                Ok(Value::AttributeDomain(d, dom))
            }
            (Value::Capacity(d), Value::String(s)) => {
                let dom = d
                    .capacity_domains()
                    .into_iter()
                    .find(|x| *x == s.as_str())
                    .map(Str::Borrowed)
                    .unwrap_or_else(|| Str::Shared(Arc::from(s.as_str())));
                Ok(Value::CapacityDomain(d, dom))
            }
            (Value::AttributeDomain(d, dom), Value::String(s)) => {
                match d.attribute(dom.as_str(), s.as_str()) {
                    Some(a) => d
                        .attribute_value(a)
                        .map_err(|e| EvalError::Runtime(e.to_string())),
                    None => rt(format!("no such key: {}", s.as_str())),
                }
            }
            (Value::CapacityDomain(d, dom), Value::String(s)) => {
                match d.capacity(dom.as_str(), s.as_str()) {
                    Some(q) => Ok(Value::QuantityRef(q)),
                    None => rt(format!("no such key: {}", s.as_str())),
                }
            }
            (Value::Device(d), Value::String(s)) => Ok(match s.as_str() {
                "driver" => Value::String(Str::Borrowed(d.driver)),
                "attributes" => Value::Attributes(d),
                "capacity" => Value::Capacity(d),
                "allowMultipleAllocations" => Value::Bool(d.allow_multiple_allocations),
                other => return rt(format!("no such key: {other}")),
            }),
            (Value::Map(entries), k) => match map_find(entries, k) {
                Some(v) => Ok(v),
                None => rt(format!("no such key: {}", display_key(k))),
            },
            (m, k) if is_map(m) => rt(format!("no such key: {}", display_key(k))),
            (Value::List(l), k) => {
                let i = match k {
                    Value::Int(i) => *i,
                    Value::Uint(u) => i64::try_from(*u).unwrap_or(i64::MAX),
                    Value::Double(d) if d.fract() == 0.0 && d.is_finite() => *d as i64,
                    Value::Double(_) => return rt("unsupported index value"),
                    _ => return rt("unsupported index type"),
                };
                match usize::try_from(i).ok().and_then(|i| l.get(i)) {
                    Some(v) => Ok(v.clone()),
                    None => rt(format!("index out of bounds: {i}")),
                }
            }
            _ => no_overload(),
        }
    }

    fn call(
        &mut self,
        name: &'static str,
        overloads: &[&'static str],
        args: &'a [Node],
        node: &'a Node,
    ) -> R<'a> {
        match name {
            "_[_]" => {
                let base = self.attr_root(&args[0])?;
                let key = self.eval(&args[1])?;
                self.charge(1)?;
                return match base {
                    Value::Optional(None) => Ok(Value::Optional(None)),
                    Value::Optional(Some(v)) => match self.index_value((*v).clone(), &key, false) {
                        Ok(v) => Ok(Value::Optional(Some(Arc::new(v)))),
                        Err(EvalError::Runtime(_)) => Ok(Value::Optional(None)),
                        Err(e) => Err(e),
                    },
                    other => self.index_value(other, &key, false),
                };
            }
            "_[?_]" => {
                let base = self.eval(&args[0])?;
                let key = self.eval(&args[1])?;
                self.charge(1)?;
                let base = match base {
                    Value::Optional(None) => return Ok(Value::Optional(None)),
                    Value::Optional(Some(v)) => (*v).clone(),
                    o => o,
                };
                return match self.index_value(base, &key, false) {
                    Ok(v) => Ok(Value::Optional(Some(Arc::new(v)))),
                    Err(EvalError::Runtime(_)) => Ok(Value::Optional(None)),
                    Err(e) => Err(e),
                };
            }
            "@in" if is_const_node(&args[1]) => {
                // cel-go folds a constant list of primitives into a hash set.
                if let Kind::List { elems, .. } = &args[1].kind
                    && elems.iter().all(|e| {
                        matches!(
                            e.kind,
                            Kind::Const(
                                Value::Bool(_)
                                    | Value::Int(_)
                                    | Value::Uint(_)
                                    | Value::Double(_)
                                    | Value::String(_)
                            )
                        )
                    })
                {
                    let v = self.eval(&args[0])?;
                    if elems.is_empty() {
                        return Ok(Value::Bool(false));
                    }
                    if matches!(v, Value::Semver(_)) {
                        return rt(
                            "internal error: runtime error: hash of unhashable type cel.Semver",
                        );
                    }
                    let found = elems.iter().any(|e| match &e.kind {
                        Kind::Const(c) => set_member_eq(c, &v),
                        _ => false,
                    });
                    return Ok(Value::Bool(found));
                }
            }
            "@not_strictly_false" => {
                let v = self.eval(&args[0]);
                self.charge(1)?;
                return match v {
                    Ok(Value::Bool(false)) => Ok(Value::Bool(false)),
                    Ok(_) | Err(EvalError::Runtime(_)) => Ok(Value::Bool(true)),
                    Err(e) => Err(e),
                };
            }
            "@optMap" | "@optFlatMap" => {
                let opt = self.eval(&args[0])?;
                let slot = match args[1].kind {
                    Kind::Const(Value::Int(s)) => usize::try_from(s).unwrap_or(0),
                    _ => 0,
                };
                // Expansion: hasValue() call (1), value() call (1), the bind, the ternary.
                self.charge(1)?;
                return match opt {
                    Value::Optional(None) => {
                        self.charge(1)?;
                        Ok(Value::Optional(None))
                    }
                    Value::Optional(Some(v)) => {
                        self.charge(1 + 1)?;
                        self.set_slot(slot, (*v).clone());
                        let r = self.eval(&args[2])?;
                        if name == "@optMap" {
                            self.charge(1)?;
                            Ok(Value::Optional(Some(Arc::new(r))))
                        } else {
                            Ok(r)
                        }
                    }
                    _ => no_overload(),
                };
            }
            "@all2" | "@exists2" | "@existsOne2" | "@transformList" | "@transformMap" => {
                return self.two_var(name, args);
            }
            _ => {}
        }
        let mut vals = Vec::with_capacity(args.len());
        for a in args {
            vals.push(self.eval(a)?);
        }
        let result = crate::functions::call(name, overloads, &vals);
        let cost = crate::functions::call_cost(name, overloads, &vals, result.as_ref().ok());
        self.charge(cost)?;
        let _ = node;
        result
    }

    fn two_var(&mut self, name: &str, args: &'a [Node]) -> R<'a> {
        let range = self.eval(&args[0])?;
        let s1 = slot_of(&args[1]);
        let s2 = slot_of(&args[2]);
        let body = &args[3];
        let filter = args.get(4);
        let items = iter_items(&range)?;
        let is_list = matches!(range, Value::List(_));
        let mut acc_bool = name == "@all2";
        let mut acc_err: Option<EvalError> = None;
        let mut count = 0i64;
        let mut list_out = Vec::new();
        let mut map_out: Vec<(Value<'a>, Value<'a>)> = Vec::new();
        for (i, (k, v)) in items.into_iter().enumerate() {
            self.tick()?;
            // Loop condition: @not_strictly_false(accu) costs accu ident + call.
            match name {
                "@all2" | "@exists2" => {
                    self.charge(2)?;
                    if name == "@all2" && !acc_bool && acc_err.is_none() {
                        break;
                    }
                    if name == "@exists2" && acc_bool {
                        break;
                    }
                    if name == "@exists2" {
                        self.charge(1)?;
                    }
                }
                _ => {}
            }
            if is_list {
                self.set_slot(s1, Value::Int(i64::try_from(i).unwrap_or(i64::MAX)));
                self.set_slot(s2, k);
            } else {
                self.set_slot(s1, k);
                self.set_slot(s2, v);
            }
            self.charge(1)?; // the accumulator read in the step
            if let Some(f) = filter {
                match self.eval(f)? {
                    Value::Bool(true) => {}
                    Value::Bool(false) => continue,
                    _ => return no_overload(),
                }
            }
            let r = self.eval(body);
            match name {
                "@all2" => match r {
                    Ok(Value::Bool(false)) => {
                        acc_bool = false;
                        acc_err = None;
                    }
                    Ok(Value::Bool(true)) => {}
                    Ok(_) => {
                        acc_err = acc_err.or(Some(EvalError::Runtime("no such overload".into())))
                    }
                    Err(EvalError::Runtime(e)) => acc_err = acc_err.or(Some(EvalError::Runtime(e))),
                    Err(e) => return Err(e),
                },
                "@exists2" => match r {
                    Ok(Value::Bool(true)) => {
                        acc_bool = true;
                        acc_err = None;
                    }
                    Ok(Value::Bool(false)) => {}
                    Ok(_) => {
                        acc_err = acc_err.or(Some(EvalError::Runtime("no such overload".into())))
                    }
                    Err(EvalError::Runtime(e)) => acc_err = acc_err.or(Some(EvalError::Runtime(e))),
                    Err(e) => return Err(e),
                },
                "@existsOne2" => match r? {
                    Value::Bool(true) => {
                        count += 1;
                        self.charge(1)?;
                    }
                    Value::Bool(false) => {}
                    _ => return no_overload(),
                },
                "@transformList" => {
                    list_out.push(r?);
                    self.charge(10 + 1)?;
                }
                _ => {
                    let key = self.slots.get(s1).cloned().unwrap_or(Value::Null);
                    map_out.push((key, r?));
                    self.charge(1)?;
                }
            }
        }
        match name {
            "@all2" | "@exists2" => match acc_err {
                Some(e) if (name == "@all2" && acc_bool) || (name == "@exists2" && !acc_bool) => {
                    Err(e)
                }
                _ => Ok(Value::Bool(acc_bool)),
            },
            "@existsOne2" => {
                self.charge(2)?;
                Ok(Value::Bool(count == 1))
            }
            "@transformList" => Ok(Value::List(Arc::new(list_out))),
            _ => Ok(Value::Map(Arc::new(map_out))),
        }
    }
}

fn slot_of(n: &Node) -> usize {
    match n.kind {
        Kind::Const(Value::Int(s)) => usize::try_from(s).unwrap_or(0),
        _ => 0,
    }
}

fn field_name(f: DeviceField) -> &'static str {
    match f {
        DeviceField::Driver => "driver",
        DeviceField::Attributes => "attributes",
        DeviceField::Capacity => "capacity",
        DeviceField::AllowMultipleAllocations => "allowMultipleAllocations",
    }
}

// Field names come from the program, which outlives the evaluation; we copy them into a shared
// string only when a lookup needs to keep them (unknown domains).
fn leak_free(s: &str) -> &str {
    s
}

fn display_key(k: &Value<'_>) -> String {
    match k {
        Value::String(s) => s.as_str().to_string(),
        Value::Int(i) => i.to_string(),
        Value::Uint(u) => u.to_string(),
        Value::Bool(b) => b.to_string(),
        Value::Double(d) => d.to_string(),
        other => other.type_name().to_string(),
    }
}

fn set_member_eq(c: &Value<'_>, v: &Value<'_>) -> bool {
    match (c, v) {
        (Value::Bool(a), Value::Bool(b)) => a == b,
        (Value::String(a), Value::String(b)) => a.as_str() == b.as_str(),
        (
            Value::Int(_) | Value::Uint(_) | Value::Double(_),
            Value::Int(_) | Value::Uint(_) | Value::Double(_),
        ) => {
            // Lossless conversions only, as the set holds converted keys.
            matches!(equals(c, v), Eq::True)
                && !matches!((c, v), (Value::Double(d), _) | (_, Value::Double(d)) if d.is_nan())
        }
        _ => false,
    }
}

/// Whether a node is a literal that cel-go's optimizer folds to a constant (no creation cost).
pub(crate) fn is_const_node(n: &Node) -> bool {
    match &n.kind {
        Kind::Const(_) => true,
        Kind::List { elems, optional } => {
            !optional.iter().any(|o| *o) && elems.iter().all(is_const_node)
        }
        Kind::Map { entries } => entries
            .iter()
            .all(|(k, v, o)| !o && is_const_node(k) && is_const_node(v)),
        _ => false,
    }
}

/// The iteration items of a comprehension range: (element or key, value).
fn iter_items<'a>(range: &Value<'a>) -> Result<Vec<(Value<'a>, Value<'a>)>, EvalError> {
    match range {
        Value::List(l) => Ok(l.iter().map(|v| (v.clone(), Value::Null)).collect()),
        m if is_map(m) => Ok(map_entries(m)),
        other => rt(format!(
            "got '{}', expected iterable type",
            other.type_name()
        )),
    }
}

/// Ordering for `<` and friends: `None` when the types have no ordering overload.
pub(crate) fn compare(a: &Value<'_>, b: &Value<'_>) -> Result<Option<Ordering>, EvalError> {
    Ok(match (a, b) {
        (Value::Bool(x), Value::Bool(y)) => Some(x.cmp(y)),
        (Value::Int(x), Value::Int(y)) => Some(x.cmp(y)),
        (Value::Uint(x), Value::Uint(y)) => Some(x.cmp(y)),
        (Value::Double(x), Value::Double(y)) => x.partial_cmp(y),
        (Value::String(x), Value::String(y)) => Some(x.as_str().cmp(y.as_str())),
        (Value::Bytes(x), Value::Bytes(y)) => Some(x.cmp(y)),
        (Value::Int(x), Value::Uint(y)) => Some(match u64::try_from(*x) {
            Ok(x) => x.cmp(y),
            Err(_) => Ordering::Less,
        }),
        (Value::Uint(x), Value::Int(y)) => Some(match u64::try_from(*y) {
            Ok(y) => x.cmp(&y),
            Err(_) => Ordering::Greater,
        }),
        (Value::Int(x), Value::Double(y)) => cmp_int_double(*x, *y),
        (Value::Double(x), Value::Int(y)) => cmp_int_double(*y, *x).map(Ordering::reverse),
        (Value::Uint(x), Value::Double(y)) => cmp_uint_double(*x, *y),
        (Value::Double(x), Value::Uint(y)) => cmp_uint_double(*y, *x).map(Ordering::reverse),
        _ => return no_overload(),
    })
}
