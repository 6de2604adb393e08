//! Type checking: turns the parsed AST into a typed program tree.
//!
//! Mirrors cel-go's `checker/checker.go` (v0.26.0): identifiers resolve to the `device` variable
//! or comprehension variables, field selection on `kubernetes.DRADevice` is checked against its
//! declared fields, calls resolve against the declared overloads with type-parameter
//! unification, list and map literals must be homogeneous
//! (`cel.HomogeneousAggregateLiterals` and `cel.ValidateHomogeneousAggregateLiterals`), and
//! constant regular expressions given to `matches` must compile (`cel.ValidateRegexLiterals`).
//! The macros the `cel` parser does not know (`cel.bind`, the two-variable comprehensions of
//! `ext.TwoVarComprehensions`, `optMap`/`optFlatMap`) are expanded here.

use std::sync::Arc;

use cel::common::ast::{
    CallExpr, ComprehensionExpr, EntryExpr, Expr as PExpr, IdedExpr, ListExpr, LiteralValue,
};

use crate::decls::{FUNCTIONS, Overload};
use crate::types::{
    CIDR, DEVICE, FRESH_BASE, IP, Mapping, QUANTITY, Type, instantiate, is_assignable,
    is_assignable_list, most_general, substitute,
};
use crate::value::Value;

/// Feature switches of the environment, as upstream's `cel.Features`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Features {
    /// DRAConsumableCapacity: declares `device.allowMultipleAllocations`.
    pub consumable_capacity: bool,
    /// DRAListTypeAttributes: attributes are `dyn` (maybe lists) and `includes` exists.
    pub list_type_attributes: bool,
}

impl Default for Features {
    /// The Kubernetes v1.36 defaults: consumable capacity on (beta), list-type attributes off.
    fn default() -> Self {
        Features {
            consumable_capacity: true,
            list_type_attributes: false,
        }
    }
}

/// A field of the `device` variable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DeviceField {
    Driver,
    Attributes,
    Capacity,
    AllowMultipleAllocations,
}

/// A checked, typed expression node.
#[derive(Debug)]
pub(crate) struct Node {
    pub ty: Type,
    pub kind: Kind,
}

/// What a node does at evaluation time.
#[derive(Debug)]
pub(crate) enum Kind {
    Const(Value<'static>),
    /// A comprehension or bind variable, by absolute slot.
    Var(usize),
    Device,
    DeviceField(Box<Node>, DeviceField),
    Select {
        operand: Box<Node>,
        field: Arc<str>,
        test: bool,
    },
    OptSelect {
        operand: Box<Node>,
        field: Arc<str>,
    },
    Call {
        name: &'static str,
        overloads: Vec<&'static str>,
        args: Vec<Node>,
    },
    And(Box<Node>, Box<Node>),
    Or(Box<Node>, Box<Node>),
    Cond(Box<Node>, Box<Node>, Box<Node>),
    List {
        elems: Vec<Node>,
        optional: Vec<bool>,
    },
    Map {
        entries: Vec<(Node, Node, bool)>,
    },
    Fold(Box<Fold>),
    Bind {
        slot: usize,
        init: Box<Node>,
        body: Box<Node>,
    },
}

/// A comprehension (the expansion of a macro).
#[derive(Debug)]
pub(crate) struct Fold {
    pub range: Node,
    pub var1: usize,
    pub var2: Option<usize>,
    pub accu: usize,
    pub init: Node,
    pub cond: Node,
    pub step: Node,
    pub result: Node,
}

/// The checked program: the root node and the number of variable slots it needs.
#[derive(Debug)]
pub(crate) struct Checked {
    pub root: Node,
    pub slots: usize,
}

/// A type-check failure, with cel-go's message wording where practical.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CheckError(pub String);

struct Scope {
    name: String,
    ty: Type,
    slot: usize,
}

/// The environment-dependent parts of checking.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CheckEnv {
    pub features: Features,
    /// `includes` is declared (list-type attributes, and an environment at v1.36 or later).
    pub includes: bool,
}

struct Checker {
    env: CheckEnv,
    mapping: Mapping,
    fresh: u32,
    scopes: Vec<Scope>,
    slots: usize,
    errors: Vec<String>,
}

/// Checks a parsed expression.
pub(crate) fn check(env: CheckEnv, expr: &IdedExpr) -> Result<Checked, CheckError> {
    let mut c = Checker {
        env,
        mapping: Mapping::default(),
        fresh: FRESH_BASE,
        scopes: Vec::new(),
        slots: 0,
        errors: Vec::new(),
    };
    let mut root = c.check(expr);
    if !c.errors.is_empty() {
        return Err(CheckError(c.errors.join("\n")));
    }
    c.finalize(&mut root);
    validate_homogeneous(&root, false, &mut c.errors);
    if !c.errors.is_empty() {
        return Err(CheckError(c.errors.join("\n")));
    }
    Ok(Checked {
        root,
        slots: c.slots,
    })
}

fn err_node() -> Node {
    Node {
        ty: Type::Error,
        kind: Kind::Const(Value::Null),
    }
}

fn device_type(features: Features) -> impl Fn(&str) -> Option<(Type, DeviceField)> {
    move |field| match field {
        "driver" => Some((Type::String, DeviceField::Driver)),
        "attributes" => {
            let attr = if features.list_type_attributes {
                Type::Dyn
            } else {
                Type::Any
            };
            Some((
                Type::map(Type::String, Type::map(Type::String, attr)),
                DeviceField::Attributes,
            ))
        }
        "capacity" => Some((
            Type::map(
                Type::String,
                Type::map(Type::String, Type::opaque(QUANTITY)),
            ),
            DeviceField::Capacity,
        )),
        "allowMultipleAllocations" if features.consumable_capacity => {
            Some((Type::Bool, DeviceField::AllowMultipleAllocations))
        }
        _ => None,
    }
}

fn literal(l: &LiteralValue) -> (Value<'static>, Type) {
    match l {
        LiteralValue::Boolean(b) => (Value::Bool(*b.inner()), Type::Bool),
        LiteralValue::Int(i) => (Value::Int(*i.inner()), Type::Int),
        LiteralValue::UInt(u) => (Value::Uint(*u.inner()), Type::Uint),
        LiteralValue::Double(d) => (Value::Double(*d.inner()), Type::Double),
        LiteralValue::String(s) => (Value::string(s.inner()), Type::String),
        LiteralValue::Bytes(b) => (Value::Bytes(std::sync::Arc::from(b.inner())), Type::Bytes),
        LiteralValue::Null => (Value::Null, Type::Null),
    }
}

fn simple_name(e: &IdedExpr) -> Option<&str> {
    match &e.expr {
        PExpr::Ident(n) => Some(n),
        _ => None,
    }
}

fn qualified_name(e: &IdedExpr) -> Option<String> {
    match &e.expr {
        PExpr::Ident(n) => Some(n.clone()),
        PExpr::Select(s) if !s.test => {
            qualified_name(&s.operand).map(|p| format!("{p}.{}", s.field))
        }
        _ => None,
    }
}

impl Checker {
    fn error(&mut self, msg: String) -> Node {
        self.errors.push(msg);
        err_node()
    }

    fn new_var(&mut self) -> Type {
        let t = Type::Param(self.fresh);
        self.fresh = self.fresh.saturating_add(1);
        t
    }

    fn lookup(&self, name: &str) -> Option<&Scope> {
        self.scopes.iter().rev().find(|s| s.name == name)
    }

    fn push_var(&mut self, name: &str, ty: Type) -> usize {
        let slot = self.scopes.len();
        self.scopes.push(Scope {
            name: name.to_string(),
            ty,
            slot,
        });
        self.slots = self.slots.max(self.scopes.len());
        slot
    }

    fn check(&mut self, e: &IdedExpr) -> Node {
        match &e.expr {
            PExpr::Literal(l) => {
                let (v, ty) = literal(l);
                Node {
                    ty,
                    kind: Kind::Const(v),
                }
            }
            PExpr::Ident(name) => self.check_ident(name),
            PExpr::Select(sel) => {
                if !sel.test
                    && let Some(q) = qualified_name(e)
                    && (self.lookup(&q).is_some() || q == IP || q == CIDR)
                {
                    return self.check_ident(&q);
                }
                let operand = self.check(&sel.operand);
                self.check_select(operand, &sel.field, sel.test, false)
            }
            PExpr::Call(call) => self.check_call(call),
            PExpr::List(list) => {
                let mut elem_ty: Option<Type> = None;
                let mut elems = Vec::with_capacity(list.elements.len());
                let mut optional = Vec::with_capacity(list.elements.len());
                for (i, el) in list.elements.iter().enumerate() {
                    let n = self.check(el);
                    let is_opt = list.optional_indices.contains(&i);
                    let mut t = substitute(&self.mapping, &n.ty, false);
                    if is_opt {
                        let (inner, was) = t.unwrap_optional();
                        if !was && !inner.is_dyn() {
                            self.errors.push(format!(
                                "expected type 'optional_type({inner})' but found '{inner}'"
                            ));
                        }
                        t = inner;
                    }
                    elem_ty = Some(self.join(elem_ty, t));
                    elems.push(n);
                    optional.push(is_opt);
                }
                let et = match elem_ty {
                    Some(t) => t,
                    None => self.new_var(),
                };
                Node {
                    ty: Type::list(et),
                    kind: Kind::List { elems, optional },
                }
            }
            PExpr::Map(map) => {
                let (mut kt, mut vt): (Option<Type>, Option<Type>) = (None, None);
                let mut entries = Vec::new();
                for entry in &map.entries {
                    let EntryExpr::MapEntry(me) = &entry.expr else {
                        return self.error("unsupported struct field in map literal".into());
                    };
                    let k = self.check(&me.key);
                    let ktt = substitute(&self.mapping, &k.ty, false);
                    kt = Some(self.join(kt, ktt));
                    let v = self.check(&me.value);
                    let mut vtt = substitute(&self.mapping, &v.ty, false);
                    if me.optional {
                        let (inner, was) = vtt.unwrap_optional();
                        if !was && !inner.is_dyn() {
                            self.errors.push(format!(
                                "expected type 'optional_type({inner})' but found '{inner}'"
                            ));
                        }
                        vtt = inner;
                    }
                    vt = Some(self.join(vt, vtt));
                    entries.push((k, v, me.optional));
                }
                let (k, v) = match (kt, vt) {
                    (Some(k), Some(v)) => (k, v),
                    _ => (self.new_var(), self.new_var()),
                };
                Node {
                    ty: Type::map(k, v),
                    kind: Kind::Map { entries },
                }
            }
            PExpr::Struct(s) => self.error(format!("undeclared reference to '{}'", s.type_name)),
            // cel-go's macro expander (parser/helper.go) rejects an iteration variable named
            // after either accumulator, the current `@result` or the legacy `__result__`.
            PExpr::Comprehension(comp)
                if [
                    comp.iter_var.as_str(),
                    comp.iter_var2.as_deref().unwrap_or(""),
                ]
                .iter()
                .any(|v| *v == "__result__" || *v == comp.accu_var) =>
            {
                self.error("iteration variable overwrites accumulator variable".into())
            }
            PExpr::Comprehension(comp) => self.check_fold(
                &comp.iter_range,
                &comp.iter_var,
                comp.iter_var2.as_deref(),
                &comp.accu_var,
                CompParts::Parsed {
                    init: &comp.accu_init,
                    cond: &comp.loop_cond,
                    step: &comp.loop_step,
                    result: &comp.result,
                },
            ),
            PExpr::Unspecified => self.error("unspecified expression".into()),
        }
    }

    fn join(&mut self, prev: Option<Type>, cur: Type) -> Type {
        match prev {
            None => cur,
            Some(p) => {
                // Without `cel.HomogeneousAggregateLiterals` a mixed literal is `dyn`; the
                // homogeneity validator rejects it later, except inside `format`.
                if is_assignable(&mut self.mapping, &p, &cur) {
                    most_general(&p, &cur)
                } else {
                    Type::Dyn
                }
            }
        }
    }

    fn check_ident(&mut self, name: &str) -> Node {
        if let Some(s) = self.lookup(name) {
            return Node {
                ty: s.ty.clone(),
                kind: Kind::Var(s.slot),
            };
        }
        if name == "device" {
            return Node {
                ty: Type::Struct(DEVICE),
                kind: Kind::Device,
            };
        }
        let type_value = match name {
            "bool" => Some(Type::Bool),
            "int" => Some(Type::Int),
            "uint" => Some(Type::Uint),
            "double" => Some(Type::Double),
            "string" => Some(Type::String),
            "bytes" => Some(Type::Bytes),
            "null_type" => Some(Type::Null),
            "list" => Some(Type::list(Type::Dyn)),
            "map" => Some(Type::map(Type::Dyn, Type::Dyn)),
            "type" => Some(Type::Type(Box::new(Type::Dyn))),
            "optional_type" => Some(Type::optional(Type::Dyn)),
            // Registered by the IP and CIDR libraries (`cel.Types`); the URL library does not.
            IP => Some(Type::opaque(IP)),
            CIDR => Some(Type::opaque(CIDR)),
            _ => None,
        };
        if let Some(t) = type_value {
            let v = Value::Type(match &t {
                Type::Type(_) => "type",
                Type::Opaque(n, _) => n,
                t => crate::value::type_name_of(t),
            });
            return Node {
                ty: Type::Type(Box::new(t)),
                kind: Kind::Const(v),
            };
        }
        self.error(format!(
            "undeclared reference to '{name}' (in container '')"
        ))
    }

    fn check_select(&mut self, operand: Node, field: &str, test: bool, optional: bool) -> Node {
        let operand_ty = substitute(&self.mapping, &operand.ty, false);
        let (target, is_opt) = operand_ty.unwrap_optional();
        let mut device_field = None;
        let result = match &target {
            Type::Map(_, v) => (**v).clone(),
            Type::Struct(_) => match device_type(self.env.features)(field) {
                Some((t, f)) => {
                    device_field = Some(f);
                    t
                }
                None => {
                    self.errors.push(format!("undefined field '{field}'"));
                    Type::Error
                }
            },
            Type::Param(_) => {
                is_assignable(&mut self.mapping, &Type::Dyn, &target);
                Type::Dyn
            }
            t => {
                if !t.is_dyn_or_error() {
                    self.errors
                        .push(format!("type '{t}' does not support field selection"));
                }
                Type::Dyn
            }
        };
        let mut ty = if is_opt || optional {
            Type::optional(result)
        } else {
            result
        };
        if test {
            ty = Type::Bool;
        }
        let field: Arc<str> = Arc::from(field);
        let kind = if optional {
            Kind::OptSelect {
                operand: Box::new(operand),
                field,
            }
        } else if let (Some(f), false, false) = (device_field, test, is_opt) {
            Kind::DeviceField(Box::new(operand), f)
        } else {
            Kind::Select {
                operand: Box::new(operand),
                field,
                test,
            }
        };
        Node {
            ty: substitute(&self.mapping, &ty, false),
            kind,
        }
    }

    fn check_call(&mut self, call: &CallExpr) -> Node {
        let name = call.func_name.as_str();
        if name == "_?._" {
            if call.args.len() != 2 || call.target.is_some() {
                return self.error("incorrect signature for optional field selection".into());
            }
            let field = match &call.args[1].expr {
                PExpr::Literal(LiteralValue::String(s)) => s.inner().to_string(),
                _ => return self.error("unsupported optional field selection".into()),
            };
            let operand = self.check(&call.args[0]);
            return self.check_select(operand, &field, false, true);
        }
        if let Some(expanded) = self.try_macro(call) {
            return expanded;
        }
        // A receiver that spells a qualified function name (`optional.of(x)`, `sets.contains`).
        let mut target = call.target.as_deref();
        let mut fname = name.to_string();
        if let Some(t) = target
            && let Some(q) = qualified_name(t)
        {
            let full = format!("{q}.{name}");
            if FUNCTIONS.contains_key(full.as_str()) && self.lookup(&q).is_none() {
                fname = full;
                target = None;
            }
        }
        let Some((fname, overloads)) = FUNCTIONS.get_key_value(fname.as_str()) else {
            for a in &call.args {
                self.check(a);
            }
            return self.error(format!(
                "undeclared reference to '{name}' (in container '')"
            ));
        };
        let mut args = Vec::with_capacity(call.args.len() + 1);
        if let Some(t) = target {
            args.push(self.check(t));
        }
        for a in &call.args {
            args.push(self.check(a));
        }
        if *fname == "_&&_" || *fname == "_||_" {
            let mut bad = false;
            for a in &args {
                if !is_assignable(&mut self.mapping, &a.ty, &Type::Bool) {
                    self.errors
                        .push(format!("expected type 'bool' but found '{}'", a.ty));
                    bad = true;
                }
            }
            if bad || args.len() != 2 {
                return err_node();
            }
            let mut it = args.into_iter();
            let (Some(l), Some(r)) = (it.next(), it.next()) else {
                return err_node();
            };
            let kind = if *fname == "_&&_" {
                Kind::And(Box::new(l), Box::new(r))
            } else {
                Kind::Or(Box::new(l), Box::new(r))
            };
            return Node {
                ty: Type::Bool,
                kind,
            };
        }
        self.resolve(fname, overloads, target.is_some(), args)
    }

    fn resolve(
        &mut self,
        fname: &'static str,
        overloads: &'static [Overload],
        member: bool,
        args: Vec<Node>,
    ) -> Node {
        let arg_types: Vec<Type> = args.iter().map(|a| a.ty.clone()).collect();
        let mut result: Option<Type> = None;
        let mut ids = Vec::new();
        for o in overloads {
            if o.member != member || o.args.len() != args.len() {
                continue;
            }
            if o.list_attributes_only && !self.env.includes {
                continue;
            }
            let base = self.fresh;
            self.fresh = self.fresh.saturating_add(4);
            let params: Vec<Type> = o.args.iter().map(|t| instantiate(t, base)).collect();
            let res = instantiate(&o.result, base);
            if is_assignable_list(&mut self.mapping, &arg_types, &params) {
                ids.push(o.id);
                let rt = substitute(&self.mapping, &res, false);
                result = Some(match result {
                    None => rt,
                    Some(prev) if !prev.is_dyn() && prev != rt => Type::Dyn,
                    Some(prev) => prev,
                });
            }
        }
        let Some(ty) = result else {
            let shown: Vec<String> = arg_types
                .iter()
                .map(|t| substitute(&self.mapping, t, true).to_string())
                .collect();
            if shown.iter().any(|s| s == "*error*") {
                return err_node();
            }
            let msg = if member {
                format!(
                    "found no matching overload for '{fname}' applied to '{}.({})'",
                    shown.first().map(String::as_str).unwrap_or(""),
                    shown.get(1..).unwrap_or(&[]).join(", ")
                )
            } else {
                format!(
                    "found no matching overload for '{fname}' applied to '({})'",
                    shown.join(", ")
                )
            };
            return self.error(msg);
        };
        if fname == "_?_:_" {
            let mut it = args.into_iter();
            if let (Some(c), Some(t), Some(f)) = (it.next(), it.next(), it.next()) {
                return Node {
                    ty,
                    kind: Kind::Cond(Box::new(c), Box::new(t), Box::new(f)),
                };
            }
            return err_node();
        }
        Node {
            ty,
            kind: Kind::Call {
                name: fname,
                overloads: ids,
                args,
            },
        }
    }

    /// Expands the macros the parser leaves as calls; `None` when `call` is no such macro.
    fn try_macro(&mut self, call: &CallExpr) -> Option<Node> {
        let name = call.func_name.as_str();
        let target = call.target.as_deref()?;
        let args = &call.args;
        if name == "bind" && simple_name(target) == Some("cel") && args.len() == 3 {
            let Some(var) = simple_name(&args[0]) else {
                return Some(
                    self.error("cel.bind() variable names must be simple identifiers".into()),
                );
            };
            let init = self.check(&args[1]);
            let ty = substitute(&self.mapping, &init.ty, false);
            let slot = self.push_var(var, ty);
            let body = self.check(&args[2]);
            self.scopes.pop();
            return Some(Node {
                ty: substitute(&self.mapping, &body.ty, false),
                kind: Kind::Bind {
                    slot,
                    init: Box::new(init),
                    body: Box::new(body),
                },
            });
        }
        let two_var = matches!(
            (name, args.len()),
            (
                "all"
                    | "exists"
                    | "existsOne"
                    | "exists_one"
                    | "transformList"
                    | "transformMap"
                    | "transformMapEntry",
                3
            ) | ("transformList" | "transformMap" | "transformMapEntry", 4)
        );
        if two_var {
            let (Some(v1), Some(v2)) = (simple_name(&args[0]), simple_name(&args[1])) else {
                return Some(self.error(format!(
                    "{name}() variable names must be simple identifiers"
                )));
            };
            if v1 == v2 {
                return Some(self.error(format!(
                    "{name}() second variable must be different from the first variable"
                )));
            }
            if [v1, v2]
                .iter()
                .any(|v| *v == "@result" || *v == "__result__")
            {
                return Some(
                    self.error("iteration variable overwrites accumulator variable".into()),
                );
            }
            let kind = match name {
                "all" => MacroKind::All,
                "exists" => MacroKind::Exists,
                "existsOne" | "exists_one" => MacroKind::ExistsOne,
                "transformList" => MacroKind::TransformList,
                "transformMap" => MacroKind::TransformMap,
                _ => MacroKind::TransformMapEntry,
            };
            let (filter, body) = if args.len() == 4 {
                (Some(&args[2]), &args[3])
            } else {
                (None, &args[2])
            };
            return Some(self.check_fold(
                target,
                v1,
                Some(v2),
                "@result",
                CompParts::Macro { kind, filter, body },
            ));
        }
        if name == "sortBy" && args.len() == 2 {
            return Some(self.check_sort_by(target, args));
        }
        if (name == "optMap" || name == "optFlatMap") && args.len() == 2 {
            let Some(var) = simple_name(&args[0]) else {
                return Some(self.error(format!(
                    "{name}() variable name must be a simple identifier"
                )));
            };
            let opt = self.check(target);
            let opt_ty = substitute(&self.mapping, &opt.ty, false);
            let inner = self.new_var();
            let want = Type::optional(inner.clone());
            if !is_assignable(&mut self.mapping, &want, &opt_ty) {
                return Some(self.error(format!(
                    "found no matching overload for 'hasValue' applied to '{opt_ty}.()'"
                )));
            }
            let elem = substitute(&self.mapping, &inner, false);
            let slot = self.push_var(var, elem);
            let body = self.check(&args[1]);
            self.scopes.pop();
            let body_ty = substitute(&self.mapping, &body.ty, false);
            let ty = if name == "optMap" {
                Type::optional(body_ty)
            } else {
                let v = self.new_var();
                if !is_assignable(&mut self.mapping, &Type::optional(v.clone()), &body_ty) {
                    return Some(self.error(format!(
                        "found no matching overload for '_?_:_' applied to '(bool, {body_ty}, optional_type)'"
                    )));
                }
                substitute(&self.mapping, &body_ty, false)
            };
            return Some(Node {
                ty,
                kind: Kind::Call {
                    name: if name == "optMap" {
                        "@optMap"
                    } else {
                        "@optFlatMap"
                    },
                    overloads: Vec::new(),
                    args: vec![
                        opt,
                        Node {
                            ty: Type::Int,
                            kind: Kind::Const(Value::Int(i64::try_from(slot).unwrap_or(0))),
                        },
                        body,
                    ],
                },
            });
        }
        None
    }

    /// `list.sortBy(e, key)` of `ext.Lists` version 2 and later (cel-go `ext/lists.go`,
    /// `sortByMacro`), expanded as upstream expands it:
    /// `cel.bind(@__sortBy_input__, list,
    /// @__sortBy_input__.@sortByAssociatedKeys(@__sortBy_input__.map(e, key)))`.
    fn check_sort_by(&mut self, target: &IdedExpr, args: &[IdedExpr]) -> Node {
        if !matches!(
            target.expr,
            PExpr::List(_)
                | PExpr::Select(_)
                | PExpr::Ident(_)
                | PExpr::Comprehension(_)
                | PExpr::Call(_)
        ) {
            return self.error(
                "sortBy can only be applied to a list, identifier, comprehension, call or select expression"
                    .into(),
            );
        }
        let Some(var) = simple_name(&args[0]) else {
            return self.error("argument is not an identifier".into());
        };
        const INPUT: &str = "@__sortBy_input__";
        const ACCU: &str = "@result";
        let expr = |expr: PExpr| IdedExpr { id: 0, expr };
        let ident = |name: &str| expr(PExpr::Ident(name.to_string()));
        let call = |func_name: &str, target: Option<IdedExpr>, args: Vec<IdedExpr>| {
            expr(PExpr::Call(CallExpr {
                func_name: func_name.to_string(),
                target: target.map(Box::new),
                args,
            }))
        };
        // The `map` macro as the parser expands it: `@result + [key]` from `[]`.
        let keys = expr(PExpr::Comprehension(Box::new(ComprehensionExpr {
            iter_range: ident(INPUT),
            iter_var: var.to_string(),
            iter_var2: None,
            accu_var: ACCU.to_string(),
            accu_init: expr(PExpr::List(ListExpr::new(Vec::new()))),
            loop_cond: expr(PExpr::Literal(LiteralValue::Boolean(true.into()))),
            loop_step: call(
                "_+_",
                None,
                vec![
                    ident(ACCU),
                    expr(PExpr::List(ListExpr::new(vec![args[1].clone()]))),
                ],
            ),
            result: ident(ACCU),
        })));
        let sorted = call("@sortByAssociatedKeys", Some(ident(INPUT)), vec![keys]);
        let bind = call(
            "bind",
            Some(ident("cel")),
            vec![ident(INPUT), target.clone(), sorted],
        );
        self.check(&bind)
    }

    fn check_fold(
        &mut self,
        range: &IdedExpr,
        var1: &str,
        var2: Option<&str>,
        accu_var: &str,
        parts: CompParts<'_>,
    ) -> Node {
        let range = self.check(range);
        let range_ty = substitute(&self.mapping, &range.ty, false);
        let (v1t, v2t) = match &range_ty {
            Type::List(e) => match var2 {
                Some(_) => (Type::Int, Some((**e).clone())),
                None => ((**e).clone(), None),
            },
            Type::Map(k, v) => ((**k).clone(), var2.map(|_| (**v).clone())),
            Type::Dyn | Type::Any | Type::Error | Type::Param(_) => {
                is_assignable(&mut self.mapping, &Type::Dyn, &range_ty);
                (Type::Dyn, var2.map(|_| Type::Dyn))
            }
            other => {
                self.errors.push(format!(
                    "expression of type '{other}' cannot be range of a comprehension (must be list, map, or dynamic)"
                ));
                (Type::Error, var2.map(|_| Type::Error))
            }
        };
        match parts {
            CompParts::Parsed {
                init,
                cond,
                step,
                result,
            } => {
                let init = self.check(init);
                let accu_ty = init.ty.clone();
                let accu = self.push_var(accu_var, accu_ty.clone());
                let var1_slot = self.push_var(var1, v1t);
                let var2_slot = var2.map(|v| self.push_var(v, v2t.clone().unwrap_or(Type::Dyn)));
                let cond = self.check(cond);
                self.assert_type(&cond.ty, &Type::Bool);
                let step = self.check(step);
                self.assert_type(&step.ty, &accu_ty);
                if var2_slot.is_some() {
                    self.scopes.pop();
                }
                self.scopes.pop();
                let result = self.check(result);
                self.scopes.pop();
                let ty = substitute(&self.mapping, &result.ty, false);
                Node {
                    ty,
                    kind: Kind::Fold(Box::new(Fold {
                        range,
                        var1: var1_slot,
                        var2: var2_slot,
                        accu,
                        init,
                        cond,
                        step,
                        result,
                    })),
                }
            }
            CompParts::Macro { kind, filter, body } => {
                let v2t = v2t.unwrap_or(Type::Dyn);
                // The accumulator type depends on the body; check the body first in a scope
                // that holds the accumulator at the same slot it will have at runtime.
                let accu_placeholder = self.new_var();
                let accu = self.push_var(accu_var, accu_placeholder.clone());
                let var1_slot = self.push_var(var1, v1t.clone());
                let var2_slot = self.push_var(var2.unwrap_or("#unused"), v2t);
                let filter = filter.map(|f| {
                    let n = self.check(f);
                    self.assert_type(&n.ty, &Type::Bool);
                    n
                });
                let body = self.check(body);
                let body_ty = substitute(&self.mapping, &body.ty, false);
                let accu_ty = match kind {
                    MacroKind::All | MacroKind::Exists => {
                        self.assert_type(&body_ty, &Type::Bool);
                        Type::Bool
                    }
                    MacroKind::ExistsOne => {
                        self.assert_type(&body_ty, &Type::Bool);
                        Type::Int
                    }
                    MacroKind::TransformList => Type::list(body_ty.clone()),
                    MacroKind::TransformMap => Type::map(v1t, body_ty.clone()),
                    // The step is `cel.@mapInsert(@result, body)`: the body must be a map
                    // whose entries join the accumulator.
                    MacroKind::TransformMapEntry => {
                        let want = Type::map(self.new_var(), self.new_var());
                        if !is_assignable(&mut self.mapping, &want, &body_ty) {
                            self.errors.push(format!(
                                "found no matching overload for 'cel.@mapInsert' applied to '(map, {body_ty})'"
                            ));
                        }
                        substitute(&self.mapping, &want, false)
                    }
                };
                is_assignable(&mut self.mapping, &accu_ty, &accu_placeholder);
                self.scopes.truncate(accu);
                let result_ty = match kind {
                    MacroKind::All | MacroKind::Exists | MacroKind::ExistsOne => Type::Bool,
                    _ => accu_ty.clone(),
                };
                Node {
                    ty: result_ty,
                    kind: Kind::Call {
                        name: match kind {
                            MacroKind::All => "@all2",
                            MacroKind::Exists => "@exists2",
                            MacroKind::ExistsOne => "@existsOne2",
                            MacroKind::TransformList => "@transformList",
                            MacroKind::TransformMap => "@transformMap",
                            MacroKind::TransformMapEntry => "@transformMapEntry",
                        },
                        overloads: Vec::new(),
                        args: {
                            let slot = |s: usize| Node {
                                ty: Type::Int,
                                kind: Kind::Const(Value::Int(i64::try_from(s).unwrap_or(0))),
                            };
                            let mut a = vec![range, slot(var1_slot), slot(var2_slot), body];
                            if let Some(f) = filter {
                                a.push(f);
                            }
                            a
                        },
                    },
                }
            }
        }
    }

    fn assert_type(&mut self, got: &Type, want: &Type) {
        if !is_assignable(&mut self.mapping, want, got) {
            self.errors
                .push(format!("expected type '{want}' but found '{got}'"));
        }
    }

    /// Applies the final substitutions (unbound parameters become `dyn`) to every node.
    fn finalize(&self, n: &mut Node) {
        n.ty = substitute(&self.mapping, &n.ty, true);
        match &mut n.kind {
            Kind::DeviceField(o, _)
            | Kind::Select { operand: o, .. }
            | Kind::OptSelect { operand: o, .. } => self.finalize(o),
            Kind::Call { args, .. } => args.iter_mut().for_each(|a| self.finalize(a)),
            Kind::And(a, b) | Kind::Or(a, b) => {
                self.finalize(a);
                self.finalize(b);
            }
            Kind::Cond(a, b, c) => {
                self.finalize(a);
                self.finalize(b);
                self.finalize(c);
            }
            Kind::List { elems, .. } => elems.iter_mut().for_each(|a| self.finalize(a)),
            Kind::Map { entries } => entries.iter_mut().for_each(|(k, v, _)| {
                self.finalize(k);
                self.finalize(v);
            }),
            Kind::Fold(f) => {
                for x in [
                    &mut f.range,
                    &mut f.init,
                    &mut f.cond,
                    &mut f.step,
                    &mut f.result,
                ] {
                    self.finalize(x);
                }
            }
            Kind::Bind { init, body, .. } => {
                self.finalize(init);
                self.finalize(body);
            }
            Kind::Const(_) | Kind::Var(_) | Kind::Device => {}
        }
    }
}

#[derive(Clone, Copy)]
enum MacroKind {
    All,
    Exists,
    ExistsOne,
    TransformList,
    TransformMap,
    TransformMapEntry,
}

enum CompParts<'a> {
    Parsed {
        init: &'a IdedExpr,
        cond: &'a IdedExpr,
        step: &'a IdedExpr,
        result: &'a IdedExpr,
    },
    Macro {
        kind: MacroKind,
        filter: Option<&'a IdedExpr>,
        body: &'a IdedExpr,
    },
}

/// The strings extension's compile-time check of `'<constant>'.format([<list literal>])`
/// (cel-go `ext/formatting.go`, `stringFormatValidator`): the format string must parse, each
/// clause must accept the checked type of its argument (`dyn` always does; only the kind is
/// compared, and `%s` also looks into nested list and map literals), and every argument must
/// be used.
fn format_check(args: &[Node], errors: &mut Vec<String>) {
    use crate::libs::strfmt::{Clause, walk};
    let [
        Node {
            kind: Kind::Const(Value::String(format)),
            ..
        },
        Node {
            kind: Kind::List { elems, .. },
            ..
        },
    ] = args
    else {
        return;
    };
    let mut used = 0usize;
    let result = walk(format.as_str(), elems.len(), |i, clause| {
        used += 1;
        let Some(arg) = elems.get(i) else {
            return Err(format!("index {i} out of range"));
        };
        let (ok, bad) = match clause {
            Clause::Str => match format_string_check(arg) {
                Ok(()) => (true, &arg.ty),
                Err(t) => (false, t),
            },
            Clause::Decimal | Clause::Octal => {
                (kind_in(&arg.ty, &[Type::Int, Type::Uint]), &arg.ty)
            }
            Clause::Fixed(_) | Clause::Scientific(_) => {
                (kind_in(&arg.ty, &[Type::Double, Type::String]), &arg.ty)
            }
            Clause::Binary => (
                kind_in(&arg.ty, &[Type::Int, Type::Uint, Type::Bool]),
                &arg.ty,
            ),
            Clause::Hex(_) => (
                kind_in(&arg.ty, &[Type::Int, Type::Uint, Type::String, Type::Bytes]),
                &arg.ty,
            ),
        };
        if ok {
            Ok(String::new())
        } else {
            Err(crate::libs::strfmt::type_error(clause, &bad.to_string()))
        }
    });
    match result {
        Err(e) => errors.push(e),
        Ok(_) if elems.len() > used => errors.push(format!(
            "too many arguments supplied to string.format (expected {used}, got {})",
            elems.len()
        )),
        Ok(_) => {}
    }
}

/// Whether `t` is `dyn` or has the kind of one of `kinds` (type parameters not compared).
fn kind_in(t: &Type, kinds: &[Type]) -> bool {
    matches!(t, Type::Dyn)
        || kinds
            .iter()
            .any(|k| std::mem::discriminant(k) == std::mem::discriminant(t))
}

/// `%s` accepts the scalar kinds, lists and maps, looking into list and map literals; the
/// error is the type of the first argument it does not accept.
fn format_string_check(n: &Node) -> Result<(), &Type> {
    let ok = kind_in(
        &n.ty,
        &[
            Type::list(Type::Dyn),
            Type::map(Type::Dyn, Type::Dyn),
            Type::Int,
            Type::Uint,
            Type::Double,
            Type::Bool,
            Type::String,
            Type::Bytes,
            Type::Type(Box::new(Type::Dyn)),
            Type::Null,
        ],
    );
    if !ok {
        return Err(&n.ty);
    }
    match &n.kind {
        Kind::List { elems, .. } => elems.iter().try_for_each(format_string_check),
        Kind::Map { entries } => entries.iter().try_for_each(|(k, v, _)| {
            format_string_check(k)?;
            format_string_check(v)
        }),
        _ => Ok(()),
    }
}

/// cel-go's `ValidateHomogeneousAggregateLiterals`: list elements, map keys and map values of a
/// literal must have equivalent checked types, except inside a `format` call (`exempt`: the
/// strings extension exempts it, `ext/formatting.go` `stringFormatValidator.Configure`). Also
/// runs the strings extension's check of constant format strings (`format_check`).
fn validate_homogeneous(n: &Node, exempt: bool, errors: &mut Vec<String>) {
    match &n.kind {
        Kind::List { elems, .. } if exempt => {
            elems
                .iter()
                .for_each(|e| validate_homogeneous(e, exempt, errors));
        }
        Kind::Map { entries } if exempt => {
            for (k, v, _) in entries {
                validate_homogeneous(k, exempt, errors);
                validate_homogeneous(v, exempt, errors);
            }
        }
        Kind::List { elems, optional } => {
            let mut first: Option<Type> = None;
            for (e, opt) in elems.iter().zip(optional) {
                let t = if *opt {
                    e.ty.unwrap_optional().0
                } else {
                    e.ty.clone()
                };
                match &first {
                    None => first = Some(t),
                    Some(f) if !f.is_equivalent(&t) => {
                        errors.push(format!("expected type '{f}' but found '{t}'"));
                        break;
                    }
                    _ => {}
                }
            }
            elems
                .iter()
                .for_each(|e| validate_homogeneous(e, exempt, errors));
        }
        Kind::Map { entries } => {
            let mut first: Option<(Type, Type)> = None;
            for (k, v, opt) in entries {
                let vt = if *opt {
                    v.ty.unwrap_optional().0
                } else {
                    v.ty.clone()
                };
                match &first {
                    None => first = Some((k.ty.clone(), vt)),
                    Some((fk, fv)) => {
                        if !fk.is_equivalent(&k.ty) {
                            errors.push(format!("expected type '{fk}' but found '{}'", k.ty));
                        }
                        if !fv.is_equivalent(&vt) {
                            errors.push(format!("expected type '{fv}' but found '{vt}'"));
                        }
                    }
                }
            }
            for (k, v, _) in entries {
                validate_homogeneous(k, exempt, errors);
                validate_homogeneous(v, exempt, errors);
            }
        }
        Kind::Call {
            name,
            args,
            overloads,
        } => {
            if *name == "matches" {
                // cel.ValidateRegexLiterals: the first call argument (the pattern of a member
                // call) must compile when it is a literal.
                let idx = if args.len() == 2 { 1 } else { usize::MAX };
                let idx = if overloads.contains(&"matches") {
                    0
                } else {
                    idx
                };
                if let Some(Node {
                    kind: Kind::Const(Value::String(s)),
                    ..
                }) = args.get(idx)
                    && crate::libs::regex::compile(s.as_str()).is_err()
                {
                    errors.push("invalid matches argument".into());
                }
            }
            if *name == "format" {
                format_check(args, errors);
            }
            let exempt = exempt || *name == "format";
            args.iter()
                .for_each(|a| validate_homogeneous(a, exempt, errors));
        }
        Kind::DeviceField(o, _)
        | Kind::Select { operand: o, .. }
        | Kind::OptSelect { operand: o, .. } => validate_homogeneous(o, exempt, errors),
        Kind::And(a, b) | Kind::Or(a, b) => {
            validate_homogeneous(a, exempt, errors);
            validate_homogeneous(b, exempt, errors);
        }
        Kind::Cond(a, b, c) => {
            validate_homogeneous(a, exempt, errors);
            validate_homogeneous(b, exempt, errors);
            validate_homogeneous(c, exempt, errors);
        }
        Kind::Fold(f) => {
            for x in [&f.range, &f.init, &f.cond, &f.step, &f.result] {
                validate_homogeneous(x, exempt, errors);
            }
        }
        Kind::Bind { init, body, .. } => {
            validate_homogeneous(init, exempt, errors);
            validate_homogeneous(body, exempt, errors);
        }
        Kind::Const(_) | Kind::Var(_) | Kind::Device => {}
    }
}
