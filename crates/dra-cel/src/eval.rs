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
    same_go_key,
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
    /// Upstream's Go code panics here and cel-go recovers the panic as an internal error that
    /// ends the evaluation: unlike a runtime error, no `&&`, `||` or comprehension absorbs it.
    #[error("internal error: {0}")]
    Internal(String),
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
    /// Bind initialisers not yet evaluated, by slot (cel-go initialises lazily).
    pub lazy: Vec<Option<&'a Node>>,
    /// The next attribute root is resolved without its own observation (a conditional branch
    /// or an index key that is an attribute: cel-go resolves those without the watch wrapper).
    pub skip_root: bool,
    /// Accumulator slots of the comprehensions being evaluated, innermost last.
    pub accumulators: Vec<usize>,
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

    /// Charges the observation of an attribute root unless it is resolved unobserved.
    fn charge_root(&mut self) -> Result<(), EvalError> {
        if std::mem::take(&mut self.skip_root) {
            Ok(())
        } else {
            self.charge(1)
        }
    }

    /// Evaluates `n`, resolving it without the root observation when it is an attribute.
    fn eval_unobserved(&mut self, n: &'a Node) -> R<'a> {
        self.skip_root = is_attribute(n);
        let r = self.eval(n);
        self.skip_root = false;
        r
    }

    pub(crate) fn eval(&mut self, n: &'a Node) -> R<'a> {
        match &n.kind {
            Kind::Const(v) => Ok(v.clone()),
            Kind::Var(slot) => {
                self.charge_root()?;
                if let Some(init) = self.lazy.get_mut(*slot).and_then(Option::take) {
                    let v = match self.eval(init) {
                        Ok(v) => v,
                        Err(EvalError::Runtime(e)) => Value::Error(Arc::from(e)),
                        Err(e) => return Err(e),
                    };
                    self.set_slot(*slot, v);
                }
                match self.slots.get(*slot) {
                    Some(Value::Error(e)) => rt(e.to_string()),
                    Some(v) => Ok(v.clone()),
                    None => Ok(Value::Null),
                }
            }
            Kind::Device => {
                self.charge_root()?;
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
                match base {
                    // An optional chain qualifies only what is present, observing only that.
                    Value::Optional(None) => Ok(Value::Optional(None)),
                    Value::Optional(Some(v)) => {
                        let r = self.opt_select((*v).clone(), field)?;
                        if matches!(r, Value::Optional(Some(_))) {
                            self.charge(1)?;
                        }
                        Ok(r)
                    }
                    base => {
                        self.charge(1)?;
                        self.select(base, field)
                    }
                }
            }
            Kind::OptSelect { operand, field } => {
                let base = self.attr_root(operand)?;
                let r = self.opt_select(base, field)?;
                if matches!(r, Value::Optional(Some(_))) {
                    self.charge(1)?;
                }
                Ok(r)
            }
            Kind::And(l, r) => {
                let lv = self.eval(l);
                if let Ok(Value::Bool(false)) = lv {
                    return Ok(Value::Bool(false));
                }
                // Only runtime errors are values that the other side can absorb; the cost
                // limit, the deadline and upstream panics stop evaluation.
                if let Err(
                    e @ (EvalError::CostLimit | EvalError::Interrupted | EvalError::Internal(_)),
                ) = lv
                {
                    return Err(e);
                }
                let rv = self.eval(r);
                if let Err(
                    e @ (EvalError::CostLimit | EvalError::Interrupted | EvalError::Internal(_)),
                ) = rv
                {
                    return Err(e);
                }
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
                // Only runtime errors are values that the other side can absorb; the cost
                // limit, the deadline and upstream panics stop evaluation.
                if let Err(
                    e @ (EvalError::CostLimit | EvalError::Interrupted | EvalError::Internal(_)),
                ) = lv
                {
                    return Err(e);
                }
                let rv = self.eval(r);
                if let Err(
                    e @ (EvalError::CostLimit | EvalError::Interrupted | EvalError::Internal(_)),
                ) = rv
                {
                    return Err(e);
                }
                match (lv, rv) {
                    (_, Ok(Value::Bool(true))) => Ok(Value::Bool(true)),
                    (Ok(Value::Bool(false)), Ok(Value::Bool(false))) => Ok(Value::Bool(false)),
                    (Err(EvalError::Runtime(e)), _) => rt(e),
                    (_, Err(e)) => Err(e),
                    (Err(e), _) => Err(e),
                    _ => no_overload(),
                }
            }
            // cel-go plans a conditional as an attribute whose branches are resolved, not
            // observed: an attribute branch does not pay for its root.
            Kind::Cond(c, t, f) => match self.eval(c)? {
                Value::Bool(true) => self.eval_unobserved(t),
                Value::Bool(false) => self.eval_unobserved(f),
                _ => no_overload(),
            },
            Kind::List { elems, optional } => {
                let mut out = Vec::with_capacity(elems.len());
                for (e, opt) in elems.iter().zip(optional) {
                    // The constructor is charged even when an element fails.
                    let v = match self.eval(e) {
                        Ok(v) => v,
                        Err(EvalError::Runtime(m)) => {
                            self.charge(10)?;
                            return rt(m);
                        }
                        Err(e) => return Err(e),
                    };
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
                self.charge(10)?;
                Ok(Value::List(Arc::new(out)))
            }
            Kind::Map { entries } => {
                let mut out: Vec<(Value<'a>, Value<'a>)> = Vec::with_capacity(entries.len());
                for (k, v, opt) in entries {
                    let kv = match self.eval(k) {
                        Ok(v) => v,
                        Err(EvalError::Runtime(m)) => {
                            self.charge(30)?;
                            return rt(m);
                        }
                        Err(e) => return Err(e),
                    };
                    let vv = match self.eval(v) {
                        Ok(v) => v,
                        Err(EvalError::Runtime(m)) => {
                            self.charge(30)?;
                            return rt(m);
                        }
                        Err(e) => return Err(e),
                    };
                    // cel-go's `evalMap` fills a Go map keyed by the key values: any key type is
                    // accepted, a repeated key keeps the last value, and an absent optional
                    // entry removes an earlier one with the same key.
                    if matches!(kv, Value::Bytes(_) | Value::Semver(_)) {
                        // Go cannot hash these key values; cel-go reports the recovered panic.
                        self.charge(30)?;
                        return rt(format!("hash of unhashable type {}", kv.type_name()));
                    }
                    let same = out.iter().position(|(k, _)| same_go_key(k, &kv));
                    let vv = if *opt {
                        match vv {
                            Value::Optional(Some(inner)) => (*inner).clone(),
                            Value::Optional(None) => {
                                if let Some(i) = same {
                                    out.remove(i);
                                }
                                continue;
                            }
                            _ => return no_overload(),
                        }
                    } else {
                        vv
                    };
                    match same {
                        Some(i) => out[i].1 = vv,
                        None => out.push((kv, vv)),
                    }
                }
                self.charge(30)?;
                Ok(Value::Map(Arc::new(out)))
            }
            Kind::Bind { slot, init, body } => {
                // The variable is initialised at its first reference, if any.
                if self.lazy.len() <= *slot {
                    self.lazy.resize(*slot + 1, None);
                }
                let outer = self.lazy[*slot].replace(init);
                let r = self.eval(body);
                self.lazy[*slot] = outer;
                r
            }
            Kind::Fold(f) => {
                let range = self.eval(&f.range)?;
                let items = iter_items(&range)?;
                let init = self.eval(&f.init)?;
                self.set_slot(f.accu, init);
                self.accumulators.push(f.accu);
                let r = self.fold_loop(f, &range, items);
                self.accumulators.pop();
                r
            }
            Kind::Call {
                name,
                overloads,
                args,
            } => self.call(name, overloads, args, n),
        }
    }

    fn fold_loop(
        &mut self,
        f: &'a crate::checker::Fold,
        range: &Value<'a>,
        items: Vec<(Value<'a>, Value<'a>)>,
    ) -> R<'a> {
        for (i, (k, v)) in items.into_iter().enumerate() {
            self.tick()?;
            match f.var2 {
                None => self.set_slot(f.var1, k),
                Some(s2) => {
                    if matches!(range, Value::List(_)) {
                        self.set_slot(f.var1, Value::Int(i64::try_from(i).unwrap_or(i64::MAX)));
                        self.set_slot(s2, k);
                    } else {
                        self.set_slot(f.var1, k);
                        self.set_slot(s2, v);
                    }
                }
            }
            let cond = self.eval(&f.cond);
            if !matches!(cond, Ok(Value::Bool(true))) {
                if let Err(
                    e @ (EvalError::CostLimit | EvalError::Interrupted | EvalError::Internal(_)),
                ) = cond
                {
                    return Err(e);
                }
                break;
            }
            let step = self.eval(&f.step);
            match step {
                Ok(v) => self.set_slot(f.accu, v),
                // An error accumulator keeps flowing through the loop like cel-go's
                // error values: a later `&&`/`||` step may still absorb it.
                Err(EvalError::Runtime(e)) => self.set_slot(f.accu, Value::Error(Arc::from(e))),
                Err(e) => return Err(e),
            }
        }
        self.eval(&f.result)
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
            | Kind::Select { test: false, .. }
            | Kind::OptSelect { .. } => self.eval(operand),
            // Optional qualifiers extend the attribute like plain ones (`planCallIndex`).
            Kind::Call {
                name: "_[_]" | "_[?_]",
                ..
            } => self.eval(operand),
            _ => {
                let skip = std::mem::take(&mut self.skip_root);
                let v = self.eval(operand)?;
                if !skip {
                    self.charge(1)?;
                }
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
        // Upstream's attribute and capacity maps find every domain (an unknown one is empty).
        let present = matches!(base, Value::Attributes(_) | Value::Capacity(_))
            || self.contains_key(&base, &key)?;
        if !present {
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
            (Value::Attributes(d), Value::String(s)) => d.attribute_domain(s.as_str()).is_some(),
            (Value::Capacity(d), Value::String(s)) => d.capacity_domain(s.as_str()).is_some(),
            (Value::AttributeDomain(d, dom), Value::String(s)) => {
                d.attribute(dom.as_str(), s.as_str()).is_some()
            }
            (Value::CapacityDomain(d, dom), Value::String(s)) => {
                d.has_capacity(dom.as_str(), s.as_str())
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
                    .attribute_domain(s.as_str())
                    .map(Str::Borrowed)
                    .unwrap_or_else(|| Str::Shared(Arc::from(s.as_str())));
                Ok(Value::AttributeDomain(d, dom))
            }
            (Value::Capacity(d), Value::String(s)) => {
                let dom = d
                    .capacity_domain(s.as_str())
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
                    Some(q) => Ok(Value::Quantity(q)),
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
            "_[_]" | "_[?_]" => {
                let base = self.attr_root(&args[0])?;
                // An attribute key qualifies without its own root observation.
                let key = self.eval_unobserved(&args[1])?;
                let (base, optional) = match base {
                    Value::Optional(None) => return Ok(Value::Optional(None)),
                    Value::Optional(Some(v)) => ((*v).clone(), true),
                    o => (o, name == "_[?_]"),
                };
                if !optional {
                    self.charge(1)?;
                    return self.index_value(base, &key, false);
                }
                return match self.index_value(base, &key, false) {
                    Ok(v) => {
                        self.charge(1)?;
                        Ok(Value::Optional(Some(Arc::new(v))))
                    }
                    Err(EvalError::Runtime(_)) => Ok(Value::Optional(None)),
                    Err(e) => Err(e),
                };
            }
            // cel-go short-circuits these (`decorateOptionalOr`) and they cost nothing.
            "or" | "orValue" if args.len() == 2 => {
                let lhs = self.eval(&args[0])?;
                return match lhs {
                    Value::Optional(Some(v)) if name == "orValue" => Ok((*v).clone()),
                    Value::Optional(Some(_)) => Ok(lhs),
                    Value::Optional(None) => self.eval(&args[1]),
                    _ => no_overload(),
                };
            }
            "@in" if overloads == ["in_list"] => {
                // cel-go turns `in` over a constant list of primitives into a set lookup that
                // costs nothing itself (`maybeOptimizeSetMembership`).
                if let Kind::Const(Value::List(elems)) = &args[1].kind
                    && elems.iter().all(|e| {
                        matches!(
                            e,
                            Value::Bool(_)
                                | Value::Int(_)
                                | Value::Uint(_)
                                | Value::Double(_)
                                | Value::String(_)
                        )
                    })
                {
                    if elems.is_empty() {
                        return Ok(Value::Bool(false));
                    }
                    let v = self.eval(&args[0])?;
                    if matches!(v, Value::Semver(_)) {
                        return rt(
                            "internal error: runtime error: hash of unhashable type cel.Semver",
                        );
                    }
                    let found = elems.iter().any(|c| set_member_eq(c, &v));
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
                // The macro expands to `t.hasValue() ? optional.of(<bind m = t.value()>) :
                // optional.none()` with a copy of the target `t` (cel-go `cel/library.go`,
                // `optMap`): hasValue() costs 1, and a present value pays for evaluating the
                // target a second time plus value() (1).
                self.charge(1)?;
                return match opt {
                    Value::Optional(None) => {
                        self.charge(1)?;
                        Ok(Value::Optional(None))
                    }
                    Value::Optional(Some(v)) => {
                        self.eval(&args[0])?;
                        self.charge(1)?;
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
            "@all2" | "@exists2" | "@existsOne2" | "@transformList" | "@transformMap"
            | "@transformMapEntry" => {
                return self.two_var(name, args);
            }
            _ => {}
        }
        // `@result + [x]` in a comprehension step: cel-go accumulates into a mutable list;
        // append in place so that building a list stays linear.
        if name == "_+_"
            && overloads == ["add_list"]
            && let Kind::Var(slot) = args[0].kind
            && self.accumulators.last() == Some(&slot)
            && matches!(self.slots.get(slot), Some(Value::List(_)))
        {
            self.charge_root()?;
            let rhs = self.eval(&args[1])?;
            let Value::List(tail) = rhs else {
                return no_overload();
            };
            let acc = std::mem::replace(&mut self.slots[slot], Value::Null);
            let Value::List(mut acc) = acc else {
                return no_overload();
            };
            Arc::make_mut(&mut acc).extend(tail.iter().cloned());
            self.charge(1)?;
            return Ok(Value::List(acc));
        }
        // cel-go evaluates both arguments of a unary or binary call before it returns the first
        // error, and its cost observer charges the call even then; calls of three or more
        // arguments stop at the first error and are not charged.
        // `lists.range(n)` would allocate n values before its cost is charged: charge first.
        if name == "lists.range"
            && let [arg] = args
        {
            let n = match self.eval(arg)? {
                Value::Int(n) => n,
                _ => return no_overload(),
            };
            let len = u64::try_from(n).unwrap_or(0);
            self.charge(len.saturating_add(1 + 10))?;
            return crate::functions::call(name, overloads, &[Value::Int(n)]);
        }
        let mut vals = Vec::with_capacity(args.len());
        let mut first_err: Option<String> = None;
        for a in args {
            match self.eval(a) {
                Ok(v) => vals.push(v),
                Err(EvalError::Runtime(e)) if args.len() <= 2 => {
                    vals.push(Value::Error(Arc::from(e.as_str())));
                    first_err.get_or_insert(e);
                }
                Err(e) => return Err(e),
            }
        }
        if let Some(e) = first_err {
            let cost = crate::functions::call_cost(name, overloads, &vals, None);
            self.charge(cost)?;
            return rt(e);
        }
        let result = crate::functions::call(name, overloads, &vals);
        let cost = crate::functions::call_cost(name, overloads, &vals, result.as_ref().ok());
        self.charge(cost)?;
        let _ = node;
        result
    }

    /// The two-variable comprehensions of `ext.TwoVarComprehensions`, charged as their
    /// expansions (`ext/comprehensions.go`): `all`/`exists` pay for the loop condition and the
    /// accumulator in the step, `existsOne` and filtered transforms nothing when the
    /// predicate is false (the accumulator branch of a conditional is resolved unobserved),
    /// and every macro pays 1 for reading the result.
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
            match name {
                // @not_strictly_false(@result)
                "@all2" => {
                    self.charge(2)?;
                    if !acc_bool && acc_err.is_none() {
                        break;
                    }
                }
                // @not_strictly_false(!@result)
                "@exists2" => {
                    self.charge(3)?;
                    if acc_bool {
                        break;
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
            if let Some(f) = filter {
                match self.eval(f)? {
                    Value::Bool(true) => {}
                    Value::Bool(false) => continue,
                    _ => return no_overload(),
                }
            }
            match name {
                "@all2" | "@exists2" => {
                    // @result && body / @result || body
                    self.charge(1)?;
                    let r = self.eval(body);
                    let decisive = name == "@exists2";
                    match r {
                        Ok(Value::Bool(b)) if b == decisive => {
                            acc_bool = decisive;
                            acc_err = None;
                        }
                        Ok(Value::Bool(_)) => {}
                        Ok(_) => {
                            acc_err =
                                acc_err.or(Some(EvalError::Runtime("no such overload".into())))
                        }
                        Err(EvalError::Runtime(e)) => {
                            acc_err = acc_err.or(Some(EvalError::Runtime(e)))
                        }
                        Err(e) => return Err(e),
                    }
                }
                // body ? @result + 1 : @result
                "@existsOne2" => match self.eval(body)? {
                    Value::Bool(true) => {
                        count += 1;
                        self.charge(2)?;
                    }
                    Value::Bool(false) => {}
                    _ => return no_overload(),
                },
                // @result + [body]
                "@transformList" => {
                    self.charge(1)?;
                    list_out.push(self.eval(body)?);
                    self.charge(10 + 1)?;
                }
                // cel.@mapInsert(@result, body): every entry of the body joins the result, and a
                // key already there (by CEL equality, so `1` and `1u` collide) is an error.
                "@transformMapEntry" => {
                    self.charge(1)?;
                    let update = self.eval(body);
                    self.charge(1)?;
                    let update = update?;
                    if !is_map(&update) {
                        return no_overload();
                    }
                    for (k, v) in map_entries(&update) {
                        if map_find(&map_out, &k).is_some() {
                            return rt(format!(
                                "insert failed: key {} already exists",
                                display_key(&k)
                            ));
                        }
                        map_out.push((k, v));
                    }
                }
                // cel.@mapInsert(@result, k, body)
                _ => {
                    self.charge(2)?;
                    // Keys are list indices or map keys: distinct by construction.
                    let key = self.slots.get(s1).cloned().unwrap_or(Value::Null);
                    let value = self.eval(body)?;
                    map_out.push((key, value));
                    self.charge(1)?;
                }
            }
        }
        match name {
            "@all2" | "@exists2" => {
                self.charge(1)?;
                match acc_err {
                    Some(e)
                        if (name == "@all2" && acc_bool) || (name == "@exists2" && !acc_bool) =>
                    {
                        Err(e)
                    }
                    _ => Ok(Value::Bool(acc_bool)),
                }
            }
            // @result == 1
            "@existsOne2" => {
                self.charge(2)?;
                Ok(Value::Bool(count == 1))
            }
            "@transformList" => {
                self.charge(1)?;
                Ok(Value::List(Arc::new(list_out)))
            }
            _ => {
                self.charge(1)?;
                Ok(Value::Map(Arc::new(map_out)))
            }
        }
    }
}

/// Whether cel-go plans the node as an attribute (identifier, selection or index chain).
fn is_attribute(n: &Node) -> bool {
    matches!(
        n.kind,
        Kind::Var(_)
            | Kind::Device
            | Kind::DeviceField(..)
            | Kind::Select { test: false, .. }
            | Kind::OptSelect { .. }
            | Kind::Call {
                name: "_[_]" | "_[?_]",
                ..
            }
    )
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
