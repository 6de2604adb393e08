//! Compile-time cost estimation: the worst-case cost of a checked selector, as API validation
//! computes it before it accepts a new selector.
//!
//! Mirrors, over our checked tree, cel-go v0.26.0 `checker/cost.go` (the coster: identifiers and
//! selections cost 1, presence tests 0 in Kubernetes, list literals 10, map literals 30,
//! comprehensions `size(range) * (condition + step)`, `&&`/`||` as left-minimum/sum-maximum),
//! the per-overload estimators of `ext/lists.go` (v3) and `ext/sets.go`, the Kubernetes
//! `library.CostEstimator.EstimateCallCost` (`k8s.io/apiserver/pkg/cel/library/cost.go`
//! v0.36.3), and the DRA `draCostEstimator`/`sizeEstimator` with the declared maximum sizes of
//! the `device` variable (`k8s.io/dynamic-resource-allocation/cel/compile.go`).
//!
//! Sizes are what CEL's `size()` returns: code points of a string, bytes, list items, map
//! entries. Every figure saturates at `u64::MAX` like upstream's no-overflow arithmetic.

use std::collections::HashMap;
use std::sync::Arc;

use crate::checker::{DeviceField, Kind, Node};
use crate::types::{CIDR, FORMAT, IP, OPTIONAL, QUANTITY, SEMVER, Type, URL};
use crate::value::Value;

/// A cost range in CEL cost units (upstream `checker.CostEstimate`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CostEstimate {
    /// Least cost of any evaluation.
    pub min: u64,
    /// Greatest cost of any evaluation: what API validation compares with
    /// [`crate::MAX_COST`].
    pub max: u64,
}

/// A size range (upstream `checker.SizeEstimate`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Size {
    min: u64,
    max: u64,
}

const UNKNOWN: Size = Size {
    min: 0,
    max: u64::MAX,
};

/// Upstream `common.StringTraversalCostFactor`.
pub(crate) const STRING_TRAVERSAL: f64 = 0.1;
/// Upstream `common.RegexStringLengthCostFactor`.
pub(crate) const REGEX_LENGTH: f64 = 0.25;
/// Upstream `cel.MaxNameFormatRegexSize` (`k8s.io/apiserver/pkg/cel/limits.go`).
const MAX_NAME_FORMAT_REGEX_SIZE: f64 = 128.0;
/// Upstream `cel.MaxFormatSize`.
const MAX_FORMAT_SIZE: u64 = 64;
const LIST_CREATE: u64 = 10;
const MAP_CREATE: u64 = 30;

/// `resource.k8s.io/v1` limits that bound the device's maps and strings.
const DRIVER_NAME_MAX: u64 = 63;
const DOMAIN_MAX: u64 = 63;
const ID_MAX: u64 = 32;
const ATTRIBUTES_AND_CAPACITIES_MAX: u64 = 32;
const ATTRIBUTE_VALUE_MAX: u64 = 64;
/// `ResourceSliceMaxAttributeValuesPerDevice`: the bound of `includes`.
pub(crate) const ATTRIBUTE_VALUES_MAX: u64 = 48;

/// `multiplyByCostFactor`: `ceil(x * f)`, saturating.
pub(crate) fn by_factor(x: u64, f: f64) -> u64 {
    let xf = x as f64;
    if xf > 0.0 && f > 0.0 && xf > u64::MAX as f64 / f {
        return u64::MAX;
    }
    let c = (xf * f).ceil();
    if c >= 18_446_744_073_709_551_616.0 {
        u64::MAX
    } else {
        c as u64
    }
}

impl Size {
    fn fixed(n: u64) -> Size {
        Size { min: n, max: n }
    }
    fn add(self, o: Size) -> Size {
        Size {
            min: self.min.saturating_add(o.min),
            max: self.max.saturating_add(o.max),
        }
    }
    fn mul(self, o: Size) -> Size {
        Size {
            min: self.min.saturating_mul(o.min),
            max: self.max.saturating_mul(o.max),
        }
    }
    fn union(self, o: Size) -> Size {
        Size {
            min: self.min.min(o.min),
            max: self.max.max(o.max),
        }
    }
    fn factor(self, f: f64) -> CostEstimate {
        CostEstimate {
            min: by_factor(self.min, f),
            max: by_factor(self.max, f),
        }
    }
    fn times(self, c: CostEstimate) -> CostEstimate {
        CostEstimate {
            min: self.min.saturating_mul(c.min),
            max: self.max.saturating_mul(c.max),
        }
    }
    fn as_cost(self) -> CostEstimate {
        CostEstimate {
            min: self.min,
            max: self.max,
        }
    }
}

impl CostEstimate {
    fn fixed(n: u64) -> CostEstimate {
        CostEstimate { min: n, max: n }
    }
    fn add(self, o: CostEstimate) -> CostEstimate {
        CostEstimate {
            min: self.min.saturating_add(o.min),
            max: self.max.saturating_add(o.max),
        }
    }
    fn mul(self, o: CostEstimate) -> CostEstimate {
        CostEstimate {
            min: self.min.saturating_mul(o.min),
            max: self.max.saturating_mul(o.max),
        }
    }
    fn union(self, o: CostEstimate) -> CostEstimate {
        CostEstimate {
            min: self.min.min(o.min),
            max: self.max.max(o.max),
        }
    }
    fn factor(self, f: f64) -> CostEstimate {
        CostEstimate {
            min: by_factor(self.min, f),
            max: by_factor(self.max, f),
        }
    }
}

/// Element sizes of a list or map value (upstream `entrySizeEstimate`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    list: bool,
    key: Size,
    val: Size,
}

fn entry_union(a: Option<Entry>, b: Option<Entry>) -> Option<Entry> {
    let (a, b) = (a?, b?);
    Some(Entry {
        list: a.list,
        key: a.key.union(b.key),
        val: a.val.union(b.val),
    })
}

/// One step of a field path from the `device` variable.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Seg {
    Field(Arc<str>),
    Items,
    Keys,
    Values,
    Indices,
}

/// A path from the `device` variable; `None` for anything not reachable from it (upstream only
/// estimates sizes for paths rooted at `device`).
type Path = Option<Vec<Seg>>;

fn extend(p: &Path, s: Seg) -> Path {
    p.as_ref().map(|v| {
        let mut v = v.clone();
        v.push(s);
        v
    })
}

/// The declared types of the `device` variable, as far as the size estimator walks them.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Decl {
    Device,
    Driver,
    AllowMultiple,
    OuterAttributes,
    InnerAttributes,
    Attribute,
    OuterCapacity,
    InnerCapacity,
    Quantity,
    Domain,
    Id,
}

impl Decl {
    fn max_elements(self) -> u64 {
        match self {
            Decl::Device | Decl::Quantity => 0,
            Decl::Driver => DRIVER_NAME_MAX,
            Decl::AllowMultiple => 1,
            Decl::OuterAttributes
            | Decl::InnerAttributes
            | Decl::OuterCapacity
            | Decl::InnerCapacity => ATTRIBUTES_AND_CAPACITIES_MAX,
            // With list-type attributes the bound is max(64, 48): the same.
            Decl::Attribute => ATTRIBUTE_VALUE_MAX.max(ATTRIBUTE_VALUES_MAX),
            Decl::Domain => DOMAIN_MAX,
            Decl::Id => ID_MAX,
        }
    }
    fn elem(self) -> Option<Decl> {
        match self {
            Decl::OuterAttributes => Some(Decl::InnerAttributes),
            Decl::InnerAttributes => Some(Decl::Attribute),
            Decl::OuterCapacity => Some(Decl::InnerCapacity),
            Decl::InnerCapacity => Some(Decl::Quantity),
            _ => None,
        }
    }
    fn key(self) -> Option<Decl> {
        match self {
            Decl::OuterAttributes | Decl::OuterCapacity => Some(Decl::Domain),
            Decl::InnerAttributes | Decl::InnerCapacity => Some(Decl::Id),
            _ => None,
        }
    }
    fn field(self, name: &str) -> Option<Decl> {
        match (self, name) {
            (Decl::Device, "driver") => Some(Decl::Driver),
            (Decl::Device, "attributes") => Some(Decl::OuterAttributes),
            (Decl::Device, "capacity") => Some(Decl::OuterCapacity),
            (Decl::Device, "allowMultipleAllocations") => Some(Decl::AllowMultiple),
            // Any name in an attribute map has the attribute's bound.
            (Decl::InnerAttributes, _) => Some(Decl::Attribute),
            _ => None,
        }
    }
}

/// The DRA `sizeEstimator.EstimateSize`: the declared bound at the end of a device path.
fn device_size(path: &Path) -> Option<Size> {
    let path = path.as_ref()?;
    let mut node = Decl::Device;
    for seg in path {
        node = match seg {
            Seg::Items | Seg::Values => node.elem()?,
            Seg::Keys => node.key()?,
            Seg::Field(f) => node.field(f)?,
            Seg::Indices => node.field("@indices")?,
        };
    }
    Some(Size {
        min: 0,
        max: node.max_elements(),
    })
}

/// `isScalar`: types of constant size.
fn is_scalar(t: &Type) -> bool {
    match t {
        Type::Bool | Type::Int | Type::Uint | Type::Double => true,
        Type::Opaque(n, _)
            if *n == "google.protobuf.Timestamp" || *n == "google.protobuf.Duration" =>
        {
            true
        }
        Type::Opaque(n, p) if *n == OPTIONAL => p.first().is_some_and(is_scalar),
        _ => false,
    }
}

/// What the coster knows about one node after costing it.
struct Info {
    cost: CostEstimate,
    size: Option<Size>,
    path: Path,
    entry: Option<Entry>,
}

#[derive(Clone)]
struct Local {
    path: Path,
    size: Option<Size>,
    entry: Option<Entry>,
}

/// Estimates the cost of a checked program.
pub(crate) fn estimate(root: &Node) -> CostEstimate {
    Coster {
        locals: HashMap::new(),
    }
    .cost(root)
    .cost
}

struct Coster {
    locals: HashMap<usize, Vec<Local>>,
}

/// A call argument as the function estimators see it (upstream `checker.AstNode`).
struct Arg<'n> {
    node: &'n Node,
    size: Option<Size>,
    path: Path,
}

impl Arg<'_> {
    fn size_or_unknown(&self) -> Size {
        self.size.unwrap_or(UNKNOWN)
    }
    /// The library's `sizeEstimate`: computed size, else the size estimator, else unknown.
    fn estimate(&self) -> Size {
        self.size
            .or_else(|| device_size(&self.path))
            .unwrap_or(UNKNOWN)
    }
    /// The literal int argument (`nodeAsIntValue`), clamping negatives to 0.
    fn int_literal(&self, default: u64) -> u64 {
        match &self.node.kind {
            Kind::Const(Value::Int(i)) => u64::try_from(*i).unwrap_or(0),
            _ => default,
        }
    }
}

struct CallEstimate {
    cost: CostEstimate,
    result: Option<Size>,
}

fn plain(cost: CostEstimate) -> Option<CallEstimate> {
    Some(CallEstimate { cost, result: None })
}

impl Coster {
    fn push(&mut self, slot: usize, l: Local) {
        self.locals.entry(slot).or_default().push(l);
    }

    fn pop(&mut self, slot: usize) {
        if let Some(v) = self.locals.get_mut(&slot) {
            v.pop();
        }
    }

    fn local(&self, slot: usize) -> Option<&Local> {
        self.locals.get(&slot).and_then(|v| v.last())
    }

    /// `computeSize` for a node that has no size of its own: the size estimator on its path,
    /// then the size of its type.
    fn fallback_size(path: &Path, ty: &Type) -> Option<Size> {
        device_size(path).or_else(|| is_scalar(ty).then_some(Size::fixed(1)))
    }

    fn info(cost: CostEstimate, size: Option<Size>, path: Path, entry: Option<Entry>) -> Info {
        Info {
            cost,
            size,
            path,
            entry,
        }
    }

    fn cost(&mut self, n: &Node) -> Info {
        match &n.kind {
            Kind::Const(Value::Type(_)) => {
                // A type name is an identifier upstream.
                Self::info(
                    CostEstimate::fixed(1),
                    Self::fallback_size(&None, &n.ty),
                    None,
                    None,
                )
            }
            Kind::Const(v) => {
                let size = match v {
                    Value::String(s) => Some(Size::fixed(s.as_str().chars().count() as u64)),
                    Value::Bytes(b) => Some(Size::fixed(b.len() as u64)),
                    Value::List(l) => Some(Size::fixed(l.len() as u64)),
                    Value::Map(m) => Some(Size::fixed(m.len() as u64)),
                    _ => Some(Size::fixed(1)),
                };
                Self::info(CostEstimate::default(), size, None, None)
            }
            Kind::Var(slot) => {
                let local = self.local(*slot).cloned();
                let path = local.as_ref().and_then(|l| l.path.clone());
                let size = Self::fallback_size(&path, &n.ty)
                    .or_else(|| local.as_ref().and_then(|l| l.size));
                let entry = local.and_then(|l| l.entry);
                Self::info(CostEstimate::fixed(1), size, path, entry)
            }
            Kind::Device => {
                let path = Some(Vec::new());
                let size = Self::fallback_size(&path, &n.ty);
                Self::info(CostEstimate::fixed(1), size, path, None)
            }
            Kind::DeviceField(operand, f) => {
                let field = match f {
                    DeviceField::Driver => "driver",
                    DeviceField::Attributes => "attributes",
                    DeviceField::Capacity => "capacity",
                    DeviceField::AllowMultipleAllocations => "allowMultipleAllocations",
                };
                self.select(n, operand, field)
            }
            Kind::Select {
                operand,
                field,
                test,
            } => {
                if *test {
                    // Kubernetes sets PresenceTestHasCost(false).
                    let o = self.cost(operand);
                    return Self::info(o.cost, Some(Size::fixed(1)), None, None);
                }
                self.select(n, operand, field)
            }
            Kind::OptSelect { operand, .. } => {
                // `_?._(operand, 'field')`: a call of cost 1.
                let o = self.cost(operand);
                let cost = o.cost.add(CostEstimate::fixed(1));
                Self::info(cost, Self::fallback_size(&None, &n.ty), None, None)
            }
            Kind::And(l, r) | Kind::Or(l, r) => {
                let (l, r) = (self.cost(l), self.cost(r));
                let cost = CostEstimate {
                    min: l.cost.min,
                    max: l.cost.max.saturating_add(r.cost.max),
                };
                Self::info(cost, Some(Size::fixed(1)), None, None)
            }
            Kind::Cond(c, t, f) => {
                let (c, t, f) = (self.cost(c), self.cost(t), self.cost(f));
                let size = t.size.unwrap_or(UNKNOWN).union(f.size.unwrap_or(UNKNOWN));
                let entry = entry_union(t.entry, f.entry);
                let cost = c.cost.add(t.cost.union(f.cost));
                Self::info(cost, Some(size), None, entry)
            }
            Kind::List { elems, .. } => {
                let mut sum = CostEstimate::default();
                let mut item = Size {
                    min: if elems.is_empty() { 0 } else { u64::MAX },
                    max: 0,
                };
                for e in elems {
                    let i = self.cost(e);
                    sum = sum.add(i.cost);
                    item = item.union(i.size.unwrap_or(UNKNOWN));
                }
                let entry = Entry {
                    list: true,
                    key: Size::fixed(1),
                    val: item,
                };
                Self::info(
                    sum.add(CostEstimate::fixed(LIST_CREATE)),
                    Some(Size::fixed(elems.len() as u64)),
                    None,
                    Some(entry),
                )
            }
            Kind::Map { entries } => {
                let mut sum = CostEstimate::default();
                let empty = entries.is_empty();
                let start = Size {
                    min: if empty { 0 } else { u64::MAX },
                    max: 0,
                };
                let (mut ks, mut vs) = (start, start);
                for (k, v, _) in entries {
                    let ki = self.cost(k);
                    let vi = self.cost(v);
                    sum = sum.add(ki.cost).add(vi.cost);
                    ks = ks.union(ki.size.unwrap_or(UNKNOWN));
                    vs = vs.union(vi.size.unwrap_or(UNKNOWN));
                }
                let entry = Entry {
                    list: false,
                    key: ks,
                    val: vs,
                };
                Self::info(
                    sum.add(CostEstimate::fixed(MAP_CREATE)),
                    Some(Size::fixed(entries.len() as u64)),
                    None,
                    Some(entry),
                )
            }
            Kind::Bind { slot, init, body } => {
                // The iteration range is an empty list literal: 10, kept although binds are lazy.
                let i = self.cost(init);
                self.push(
                    *slot,
                    Local {
                        path: i.path.clone(),
                        size: i.size,
                        entry: i.entry,
                    },
                );
                let b = self.cost(body);
                self.pop(*slot);
                let cost = CostEstimate::fixed(LIST_CREATE).add(i.cost).add(b.cost);
                Self::info(cost, b.size, None, b.entry)
            }
            Kind::Fold(f) => {
                let range = self.cost(&f.range);
                let init = self.cost(&f.init);
                self.push(
                    f.accu,
                    Local {
                        path: init.path.clone(),
                        size: init.size,
                        entry: init.entry,
                    },
                );
                let range_list = is_list_range(&range, &f.range.ty);
                match f.var2 {
                    None => {
                        let (seg, size) = if range_list {
                            (Seg::Items, range.entry.map(|e| e.val))
                        } else {
                            (Seg::Keys, range.entry.map(|e| e.key))
                        };
                        self.push_iter(f.var1, &range, seg, size);
                    }
                    Some(v2) => {
                        let (k, v) = if range_list {
                            (Seg::Indices, Seg::Items)
                        } else {
                            (Seg::Keys, Seg::Values)
                        };
                        self.push_iter(f.var1, &range, k, range.entry.map(|e| e.key));
                        self.push_iter(v2, &range, v, range.entry.map(|e| e.val));
                    }
                }
                let cond = self.cost(&f.cond);
                let step = self.cost(&f.step);
                self.pop(f.var1);
                if let Some(v2) = f.var2 {
                    self.pop(v2);
                }
                let result = self.cost(&f.result);
                self.pop(f.accu);
                let count = range.size.unwrap_or(UNKNOWN);
                let cost = range
                    .cost
                    .add(init.cost)
                    .add(result.cost)
                    .add(count.times(step.cost.add(cond.cost)));
                let (size, entry) = match &f.init.kind {
                    Kind::Const(_) => (init.size, None),
                    Kind::List { .. } | Kind::Map { .. } => (Some(count), step.entry),
                    _ => (None, None),
                };
                let size = size.or_else(|| Self::fallback_size(&None, &n.ty));
                Self::info(cost, size, None, entry)
            }
            Kind::Call {
                name,
                overloads,
                args,
            } => self.call(n, name, overloads, args),
        }
    }

    fn push_iter(&mut self, slot: usize, range: &Info, seg: Seg, size: Option<Size>) {
        self.push(
            slot,
            Local {
                path: extend(&range.path, seg),
                size,
                entry: None,
            },
        );
    }

    fn select(&mut self, n: &Node, operand: &Node, field: &str) -> Info {
        let o = self.cost(operand);
        let mut cost = o.cost;
        if matches!(operand.ty, Type::Map(..) | Type::Struct(_) | Type::Param(_)) {
            cost = cost.add(CostEstimate::fixed(1));
        }
        let path = extend(&o.path, Seg::Field(Arc::from(field)));
        let size = Self::fallback_size(&path, &n.ty);
        Self::info(cost, size, path, None)
    }

    /// A macro of the two-variable comprehension library (or `optMap`) expanded as upstream
    /// expands it, costed like a comprehension.
    fn macro_call(&mut self, n: &Node, name: &str, args: &[Node]) -> Info {
        if name == "@optMap" || name == "@optFlatMap" {
            // target.hasValue() ? [optional.of](cel.bind(x, target.value(), body)) : optional.none()
            let target = self.cost(&args[0]);
            let slot = slot_of(&args[1]);
            let has_value = target.cost.add(CostEstimate::fixed(1));
            let value = target.cost.add(CostEstimate::fixed(1));
            self.push(
                slot,
                Local {
                    path: None,
                    size: value_size(&args[0].ty),
                    entry: None,
                },
            );
            let body = self.cost(&args[2]);
            self.pop(slot);
            let mut some = CostEstimate::fixed(LIST_CREATE).add(value).add(body.cost);
            if name == "@optMap" {
                some = some.add(CostEstimate::fixed(1));
            }
            let cost = has_value.add(some.union(CostEstimate::fixed(1)));
            return Self::info(cost, Self::fallback_size(&None, &n.ty), None, None);
        }
        let range = self.cost(&args[0]);
        let (s1, s2) = (slot_of(&args[1]), slot_of(&args[2]));
        let range_list = is_list_range(&range, &args[0].ty);
        let (init_size, init_entry) = match name {
            "@transformList" => (
                Size::fixed(0),
                Some(Entry {
                    list: true,
                    key: Size::fixed(1),
                    val: Size::fixed(0),
                }),
            ),
            "@transformMap" | "@transformMapEntry" => (
                Size::fixed(0),
                Some(Entry {
                    list: false,
                    key: Size::fixed(0),
                    val: Size::fixed(0),
                }),
            ),
            _ => (Size::fixed(1), None),
        };
        let init_cost = match name {
            "@transformList" => LIST_CREATE,
            "@transformMap" | "@transformMapEntry" => MAP_CREATE,
            _ => 0,
        };
        let (k, v) = if range_list {
            (Seg::Indices, Seg::Items)
        } else {
            (Seg::Keys, Seg::Values)
        };
        // The accumulator is not visible to the body; its slot is private to the macro.
        self.push_iter(s1, &range, k, range.entry.map(|e| e.key));
        self.push_iter(s2, &range, v, range.entry.map(|e| e.val));
        let body = self.cost(&args[3]);
        let filter = args.get(4).map(|f| self.cost(f));
        self.pop(s1);
        self.pop(s2);
        let accu = CostEstimate::fixed(1);
        let (cond, step, result, step_entry) = match name {
            // @not_strictly_false(@result); @result && body; @result
            "@all2" => (
                CostEstimate::fixed(2),
                CostEstimate {
                    min: 1,
                    max: 1u64.saturating_add(body.cost.max),
                },
                accu,
                None,
            ),
            // @not_strictly_false(!@result); @result || body; @result
            "@exists2" => (
                CostEstimate::fixed(3),
                CostEstimate {
                    min: 1,
                    max: 1u64.saturating_add(body.cost.max),
                },
                accu,
                None,
            ),
            // true; body ? @result + 1 : @result; @result == 1
            "@existsOne2" => (
                CostEstimate::default(),
                body.cost.add(CostEstimate::fixed(2).union(accu)),
                CostEstimate::fixed(2),
                None,
            ),
            // true; @result + [body]; @result
            "@transformList" => {
                let list_cost = body.cost.add(CostEstimate::fixed(LIST_CREATE));
                let add = accu.add(list_cost).add(CostEstimate::fixed(1));
                let elem = body.size.unwrap_or(UNKNOWN);
                let entry = Entry {
                    list: true,
                    key: Size::fixed(1),
                    val: Size::fixed(0).union(elem),
                };
                (CostEstimate::default(), add, accu, Some(entry))
            }
            // true; cel.@mapInsert(@result, body); @result
            "@transformMapEntry" => {
                let insert = accu.add(body.cost).add(CostEstimate::fixed(1));
                (CostEstimate::default(), insert, accu, None)
            }
            // true; cel.@mapInsert(@result, k, body); @result
            _ => {
                let insert = accu
                    .add(CostEstimate::fixed(1))
                    .add(body.cost)
                    .add(CostEstimate::fixed(1));
                (CostEstimate::default(), insert, accu, None)
            }
        };
        let (step, step_entry) = match &filter {
            Some(f) => (
                f.cost.add(step.union(accu)),
                entry_union(step_entry, init_entry),
            ),
            None => (step, step_entry),
        };
        let count = range.size.unwrap_or(UNKNOWN);
        let cost = range
            .cost
            .add(CostEstimate::fixed(init_cost))
            .add(result)
            .add(count.times(step.add(cond)));
        let (size, entry) = match name {
            "@transformList" | "@transformMap" | "@transformMapEntry" => (Some(count), step_entry),
            _ => (Some(init_size), None),
        };
        Self::info(cost, size, None, entry)
    }

    fn call(&mut self, n: &Node, name: &str, overloads: &[&'static str], args: &[Node]) -> Info {
        if name.starts_with('@')
            && !matches!(
                name,
                "@in" | "@not_strictly_false" | "@sortByAssociatedKeys"
            )
        {
            return self.macro_call(n, name, args);
        }
        // `dyn(x)` costs 1 plus its argument and keeps the argument's sizes.
        if name == "dyn" && args.len() == 1 {
            let a = self.cost(&args[0]);
            return Self::info(
                CostEstimate::fixed(1).add(a.cost),
                a.size.or_else(|| Self::fallback_size(&a.path, &args[0].ty)),
                None,
                a.entry,
            );
        }
        let member = overloads
            .first()
            .and_then(|id| crate::decls::is_member(name, id))
            .unwrap_or(false);
        let (target_node, arg_nodes) = if member && !args.is_empty() {
            (Some(&args[0]), &args[1..])
        } else {
            (None, args)
        };
        // Upstream costs the arguments before the target.
        let mut arg_infos = Vec::with_capacity(arg_nodes.len());
        for a in arg_nodes {
            arg_infos.push(self.cost(a));
        }
        let target_info = target_node.map(|t| self.cost(t));
        let mut sum = target_info
            .as_ref()
            .map_or_else(CostEstimate::default, |t| t.cost);
        let arg_cost = arg_infos
            .iter()
            .fold(CostEstimate::default(), |s, a| s.add(a.cost));
        let argv: Vec<Arg<'_>> = arg_nodes
            .iter()
            .zip(&arg_infos)
            .map(|(node, i)| Arg {
                node,
                size: i.size,
                path: i.path.clone(),
            })
            .collect();
        let target = target_node.zip(target_info.as_ref()).map(|(node, i)| Arg {
            node,
            size: i.size,
            path: i.path.clone(),
        });
        if overloads.is_empty() {
            return Self::info(CostEstimate::default(), None, None, None);
        }
        let mut fn_cost = CostEstimate {
            min: u64::MAX,
            max: 0,
        };
        let mut result: Option<Size> = None;
        let mut path: Path = None;
        let mut entry: Option<Entry> = None;
        for id in overloads {
            let est = function_cost(name, id, target.as_ref(), &argv, &arg_infos);
            fn_cost = fn_cost.union(est.cost.add(arg_cost));
            if let Some(r) = est.result {
                result = Some(match result {
                    None => r,
                    Some(p) => p.union(r),
                });
            }
            if matches!(*id, "add_string" | "add_bytes" | "add_list") && argv.len() == 2 {
                // The entry sizes of concatenated lists.
                if let Some(e) = entry_union(arg_infos[0].entry, arg_infos[1].entry) {
                    entry = Some(e);
                }
            }
            match *id {
                "index_list" | "index_map" if !argv.is_empty() => {
                    result = arg_infos[0].entry.map(|e| e.val);
                    let seg = if *id == "index_list" {
                        Seg::Items
                    } else {
                        Seg::Values
                    };
                    path = extend(&arg_infos[0].path, seg);
                }
                _ => {}
            }
            if result.is_none() {
                result = Self::fallback_size(&path, &n.ty);
            }
        }
        sum = sum.add(fn_cost);
        Info {
            cost: sum,
            size: result,
            path,
            entry,
        }
    }
}

/// Whether a comprehension range iterates as a list (its entry sizes say so, else its type).
fn is_list_range(range: &Info, ty: &Type) -> bool {
    match range.entry {
        Some(e) => e.list,
        None => matches!(ty, Type::List(_)),
    }
}

fn slot_of(n: &Node) -> usize {
    match n.kind {
        Kind::Const(Value::Int(s)) => usize::try_from(s).unwrap_or(0),
        _ => 0,
    }
}

/// The size of `opt.value()` when only the optional's type is known.
fn value_size(opt: &Type) -> Option<Size> {
    let (inner, _) = opt.unwrap_optional();
    is_scalar(&inner).then_some(Size::fixed(1))
}

fn list_elem(t: &Type) -> Option<&Type> {
    match t {
        Type::List(e) => Some(e),
        _ => None,
    }
}

/// Per-overload estimate (upstream `coster.functionCost` without the argument costs): the
/// overload estimators of the lists and sets extensions, then the Kubernetes library and DRA
/// estimators (by function name), then cel-go's defaults (by overload id).
fn function_cost(
    name: &str,
    id: &str,
    target: Option<&Arg<'_>>,
    args: &[Arg<'_>],
    infos: &[Info],
) -> CallEstimate {
    if let Some(e) = extension_estimate(id, target, args) {
        return e;
    }
    if let Some(e) = library_estimate(name, id, target, args) {
        return e;
    }
    let one = CostEstimate::fixed(1);
    let traversal = |s: Size| s.factor(STRING_TRAVERSAL);
    let est = match id {
        "string_format" => target.map(|t| CallEstimate {
            cost: traversal(t.size_or_unknown()),
            result: None,
        }),
        "string_to_bytes" if args.len() == 1 => {
            let sz = args[0].size_or_unknown();
            Some(CallEstimate {
                cost: traversal(sz),
                result: Some(Size {
                    min: sz.min,
                    max: sz.max.saturating_mul(4),
                }),
            })
        }
        "bytes_to_string" if args.len() == 1 => {
            let sz = args[0].size_or_unknown();
            Some(CallEstimate {
                cost: traversal(sz),
                result: Some(Size {
                    min: sz.min / 4,
                    max: sz.max,
                }),
            })
        }
        "strings_quote" if args.len() == 1 => {
            let sz = args[0].size_or_unknown();
            Some(CallEstimate {
                cost: traversal(sz),
                result: Some(Size {
                    min: sz.min.saturating_add(2),
                    max: sz.max.saturating_mul(2).saturating_add(2),
                }),
            })
        }
        "starts_with_string" | "ends_with_string" if args.len() == 1 => {
            plain(traversal(args[0].size_or_unknown()))
        }
        "in_list" if args.len() == 2 => plain(args[1].size_or_unknown().factor(1.0)),
        "matches_string" if args.len() == 1 => target.and_then(|t| {
            let s = t
                .size_or_unknown()
                .add(Size::fixed(1))
                .factor(STRING_TRAVERSAL);
            let r = args[0].size_or_unknown().factor(REGEX_LENGTH);
            plain(s.mul(r))
        }),
        "contains_string" if args.len() == 1 => target.and_then(|t| {
            let s = traversal(t.size_or_unknown());
            let sub = traversal(args[0].size_or_unknown());
            plain(s.mul(sub))
        }),
        "add_string" | "add_bytes" | "add_list" if args.len() == 2 => {
            let size = args[0].size_or_unknown().add(args[1].size_or_unknown());
            let cost = if id == "add_list" {
                one
            } else {
                traversal(size)
            };
            Some(CallEstimate {
                cost,
                result: Some(size),
            })
        }
        _ if args.len() == 2 && is_sized_comparison(id) => {
            let (l, r) = (args[0].size_or_unknown(), args[1].size_or_unknown());
            let smallest = l.max.min(r.max);
            let min = u64::from(smallest > 0);
            plain(CostEstimate { min, max: smallest }.factor(STRING_TRAVERSAL))
        }
        _ => None,
    };
    let _ = infos;
    est.unwrap_or(CallEstimate {
        cost: one,
        result: None,
    })
}

fn is_sized_comparison(id: &str) -> bool {
    matches!(id, "equals" | "not_equals")
        || ["less_", "greater_", "less_equals_", "greater_equals_"]
            .iter()
            .any(|p| matches!(id.strip_prefix(p), Some("string" | "bytes")))
}

/// The per-overload estimators registered by `ext.Lists(3)` and `ext.Sets()`.
fn extension_estimate(
    id: &str,
    target: Option<&Arg<'_>>,
    args: &[Arg<'_>],
) -> Option<CallEstimate> {
    let allocating = |factor: f64, size: Size| CallEstimate {
        cost: size
            .factor(factor)
            .add(CostEstimate::fixed(1))
            .add(CostEstimate::fixed(LIST_CREATE)),
        result: Some(size),
    };
    match id {
        "list_slice" => {
            let t = target?;
            if args.len() != 2 {
                return None;
            }
            let sz = t.estimate();
            let start = args[0].int_literal(0);
            let end = args[1].int_literal(sz.max);
            Some(allocating(1.0, Size::fixed(end.wrapping_sub(start))))
        }
        "lists_range" => {
            if target.is_some() || args.len() != 1 {
                return None;
            }
            Some(allocating(1.0, Size::fixed(args[0].int_literal(u64::MAX))))
        }
        "list_reverse" => Some(allocating(1.0, target?.estimate())),
        "list_flatten" | "list_flatten_int" => {
            let t = target?;
            if args.len() > 1 {
                return None;
            }
            let depth = args.first().map_or(1, |a| a.int_literal(u64::MAX));
            Some(allocating(depth as f64, t.estimate()))
        }
        "list_distinct" => {
            let sz = target?.estimate();
            Some(allocating(2.0, sz.mul(sz)))
        }
        // Sorted by the keys list (the argument), an O(n^2) estimate like `sort`.
        _ if id.starts_with("list_") && id.ends_with("_sortByAssociatedKeys") => {
            let sz = args.first()?.estimate();
            let factor = if id == "list_string_sortByAssociatedKeys"
                || id == "list_bytes_sortByAssociatedKeys"
            {
                2.0 + STRING_TRAVERSAL
            } else {
                2.0
            };
            Some(allocating(factor, sz.mul(sz)))
        }
        _ if id.starts_with("list_") && id.ends_with("_sort") => {
            let sz = target?.estimate();
            let factor = if id == "list_string_sort" || id == "list_bytes_sort" {
                2.0 + STRING_TRAVERSAL
            } else {
                2.0
            };
            Some(allocating(factor, sz.mul(sz)))
        }
        "list_sets_contains_list" | "list_sets_intersects_list" | "list_sets_equivalent_list" => {
            if args.len() != 2 {
                return None;
            }
            let factor = if id == "list_sets_equivalent_list" {
                2.0
            } else {
                1.0
            };
            let cost = args[0]
                .estimate()
                .mul(args[1].estimate())
                .factor(factor)
                .add(CostEstimate::fixed(1));
            plain(cost)
        }
        _ => None,
    }
}

/// `library.CostEstimator.EstimateCallCost` (keyed by function name) and the DRA `includes`.
fn library_estimate(
    name: &str,
    id: &str,
    target: Option<&Arg<'_>>,
    args: &[Arg<'_>],
) -> Option<CallEstimate> {
    let one = CostEstimate::fixed(1);
    let traversal = |s: Size| s.factor(STRING_TRAVERSAL);
    match name {
        "includes" if id == "dra_includes_dyn_dyn" => {
            target?;
            plain(
                Size {
                    min: 0,
                    max: ATTRIBUTE_VALUES_MAX,
                }
                .times(one),
            )
        }
        "isSorted" | "sum" | "max" | "min" | "indexOf" | "lastIndexOf" => {
            let t = target?;
            match list_elem(&t.node.ty) {
                Some(elem) => {
                    let mut el = one;
                    if matches!(elem, Type::String | Type::Bytes) {
                        let p = extend(&t.path, Seg::Items);
                        let sz = device_size(&p).unwrap_or(UNKNOWN);
                        el = el.add(traversal(sz));
                    }
                    plain(t.estimate().times(el))
                }
                None if matches!(t.node.ty, Type::Map(..) | Type::Opaque(_, _))
                    && has_params(&t.node.ty) =>
                {
                    plain(t.estimate().times(one))
                }
                None => plain(traversal(t.estimate())),
            }
        }
        "url" if args.len() == 1 => {
            let sz = args[0].estimate();
            Some(CallEstimate {
                cost: traversal(sz),
                result: Some(sz),
            })
        }
        "lowerAscii" | "upperAscii" | "substring" | "trim" => {
            let sz = target?.estimate();
            Some(CallEstimate {
                cost: traversal(sz),
                result: Some(sz),
            })
        }
        "replace" if args.len() >= 2 => {
            let sz = target?.estimate();
            let from = args[0].estimate();
            let with = args[1].estimate();
            let mut count = Size { min: 0, max: 0 };
            let mut retained = Size { min: 0, max: 0 };
            if from.min == 0 {
                count.max = sz.max.saturating_add(u64::from(sz.max < u64::MAX));
                retained.max = sz.max;
            } else if with.max <= from.min {
                count.max = 0;
                retained.max = sz.max;
            } else {
                count.max = go_f64_to_u64((sz.max as f64 / from.min as f64).ceil());
            }
            if from.max == 0 {
                count.min = sz.min.saturating_add(u64::from(sz.min < u64::MAX));
                retained.min = sz.min;
            } else if from.max <= with.min {
                count.min = 0;
                retained.min = sz.min;
            } else {
                count.min = go_f64_to_u64((sz.min as f64 / from.max as f64).ceil());
            }
            let size = count.mul(with).add(retained);
            Some(CallEstimate {
                cost: sz.factor(2.0 * STRING_TRAVERSAL),
                result: Some(size),
            })
        }
        "split" => {
            let sz = target?.estimate();
            let max = match args.get(1).map(|a| &a.node.kind) {
                Some(Kind::Const(Value::Int(i))) => *i as u64,
                _ => sz.max,
            };
            Some(CallEstimate {
                cost: sz.factor(2.0 * STRING_TRAVERSAL),
                result: Some(Size { min: 0, max }),
            })
        }
        "join" => {
            let t = target?;
            let list = t.estimate();
            let mut sz = Size { min: 0, max: 0 };
            if list_elem(&t.node.ty).is_some() {
                let p = extend(&t.path, Seg::Items);
                let elem = device_size(&p).unwrap_or(UNKNOWN);
                sz = list.mul(elem);
            }
            if let Some(sep) = args.first() {
                let seps = Size {
                    min: list.min.saturating_sub(1),
                    max: list.max.saturating_sub(1),
                };
                sz = sz.add(sep.estimate().mul(seps));
            }
            Some(CallEstimate {
                cost: traversal(sz),
                result: Some(sz),
            })
        }
        "find" | "findAll" if !args.is_empty() => {
            let sz = target?.estimate();
            let s = sz.add(Size::fixed(1)).factor(STRING_TRAVERSAL);
            let r = args[0].estimate().factor(REGEX_LENGTH);
            Some(CallEstimate {
                cost: s.mul(r),
                result: Some(Size {
                    min: 0,
                    max: sz.max,
                }),
            })
        }
        "cidr" | "isIP" | "isCIDR" if !args.is_empty() => plain(traversal(args[0].estimate())),
        "ip" if id == "cidr_ip" => plain(one),
        "ip" if !args.is_empty() => plain(traversal(args[0].estimate())),
        "ip.isCanonical" if !args.is_empty() => plain(args[0].estimate().factor(0.2)),
        "masked"
        | "prefixLength"
        | "family"
        | "isUnspecified"
        | "isLoopback"
        | "isLinkLocalMulticast"
        | "isLinkLocalUnicast"
        | "isGlobalUnicast" => plain(one),
        "containsIP" | "containsCIDR" if !args.is_empty() => {
            let sz = Size { min: 4, max: 16 };
            let mut c = sz.add(sz).factor(STRING_TRAVERSAL);
            if name == "containsCIDR" {
                c = c.add(sz.factor(STRING_TRAVERSAL)).add(one);
            }
            if id == "cidr_contains_ip_string" || id == "cidr_contains_cidr_string" {
                c = c.add(args[0].estimate().as_cost().factor(STRING_TRAVERSAL));
            }
            plain(c)
        }
        "quantity" | "isQuantity" | "semver" | "isSemver" if !args.is_empty() => {
            plain(traversal(args[0].estimate()))
        }
        "sign" | "asInteger" | "isInteger" | "asApproximateFloat" | "isGreaterThan"
        | "isLessThan" | "compareTo" | "add" | "sub" | "major" | "minor" | "patch" => plain(one),
        "getScheme" | "getHostname" | "getHost" | "getPort" | "getEscapedPath" | "getQuery" => {
            plain(one)
        }
        // The regular expression behind a format is unknown when checking: upstream assumes
        // `MaxNameFormatRegexSize` (128) for all.
        "validate" if !args.is_empty() => {
            plain(traversal(args[0].estimate()).factor(MAX_NAME_FORMAT_REGEX_SIZE * REGEX_LENGTH))
        }
        "format.named" => plain(one),
        "_==_" if args.len() == 2 => {
            let (l, r) = (&args[0], &args[1]);
            if !l.node.ty.is_equivalent(&r.node.ty) {
                return None;
            }
            match &l.node.ty {
                Type::Opaque(n, _) if [IP, CIDR, QUANTITY, SEMVER].contains(n) => plain(one),
                // Upstream bounds a format by `MaxFormatSize` (64).
                Type::Opaque(n, _) if *n == FORMAT => plain(
                    CostEstimate {
                        min: 1,
                        max: MAX_FORMAT_SIZE,
                    }
                    .factor(STRING_TRAVERSAL),
                ),
                Type::Opaque(n, _) if *n == URL => {
                    // Upstream reads the right-hand size twice.
                    let size = r.size.map_or(Size::fixed(1), |s| s.union(s));
                    plain(
                        CostEstimate {
                            min: 1,
                            max: size.max,
                        }
                        .factor(STRING_TRAVERSAL),
                    )
                }
                _ => None,
            }
        }
        _ => None,
    }
}

fn has_params(t: &Type) -> bool {
    match t {
        Type::Map(..) => true,
        Type::Opaque(_, p) => !p.is_empty(),
        _ => false,
    }
}

/// Go's `uint64(f)` for a non-negative float (saturating here; Go's result is undefined above
/// the range and never reached by sizes below 2^64).
fn go_f64_to_u64(f: f64) -> u64 {
    if f.is_nan() || f <= 0.0 {
        0
    } else if f >= 18_446_744_073_709_551_616.0 {
        u64::MAX
    } else {
        f as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Compiler, Environment};

    fn est(expr: &str) -> u64 {
        let c = Compiler::new(Default::default(), Environment::Stored)
            .compile(expr)
            .unwrap();
        estimate(&c.checked.root).max
    }

    #[test]
    fn an_attribute_comparison_costs_its_selection_chain_and_a_string_compare() {
        // device(1) + .attributes(1) + ['d'](1) + .model(1) + == (ceil(min(64, 4) * 0.1) = 1)
        assert_eq!(est("device.attributes['d'].model == 'A100'"), 5);
    }

    #[test]
    fn a_comprehension_over_an_attribute_map_is_bounded_by_the_declared_sizes() {
        // 3 to reach the map, 1 for the result, 32 entries * (cond 2 + step 1 + body 3).
        assert_eq!(
            est("device.attributes['d'].all(k, k.size() > 0)"),
            3 + 1 + 32 * 6
        );
    }

    #[test]
    fn factors_round_up_and_saturate() {
        assert_eq!(by_factor(4, STRING_TRAVERSAL), 1);
        assert_eq!(by_factor(0, STRING_TRAVERSAL), 0);
        assert_eq!(by_factor(u64::MAX, 2.0), u64::MAX);
    }
}
