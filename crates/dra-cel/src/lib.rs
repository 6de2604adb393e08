//! The Kubernetes DRA CEL environment: compile and evaluate DeviceClass and ResourceClaim
//! device selectors exactly as kube-scheduler and API validation do.
//!
//! Upstream is `k8s.io/dynamic-resource-allocation/cel` v0.36.3 (`compile.go`) on cel-go
//! v0.26.0 with the Kubernetes base environment (`k8s.io/apiserver/pkg/cel/environment`).
//! We parse with the `cel` crate and type-check and evaluate our own checked tree.
//!
//! ```
//! use dra_cel::{Compiler, Device, Environment};
//! let device: Device = serde_json::from_str(
//!     r#"{"driver": "gpu.nvidia.com", "attributes": {"model": {"string": "A100"}},
//!         "capacity": {"memory": {"value": "80Gi"}}}"#).unwrap();
//! let compiled = Compiler::new(Default::default(), Environment::Stored)
//!     .compile("device.attributes['gpu.nvidia.com'].model == 'A100' && \
//!               device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity('40Gi'))")
//!     .unwrap();
//! assert!(compiled.matches(&device).unwrap());
//! ```

mod cache;
mod checker;
mod cost;
mod decls;
pub mod device;
mod eval;
mod fast;
mod functions;
pub mod libs;
mod parse;
mod types;
mod value;

use std::sync::Arc;
use std::time::Instant;

pub use cache::Cache;
pub use checker::{CheckError, Features};
pub use cost::CostEstimate;
pub use device::{Device, DeviceAttribute, DeviceCapacity, DeviceError, DeviceView};
pub use eval::EvalError;
pub use fast::{AttributeComparison, COST_BOUND as SHORTCUT_COST_BOUND, LiteralRef};
pub use types::Type;

/// Runtime cost limit per evaluation: `resource.k8s.io` `CELSelectorExpressionMaxCost`.
pub const MAX_COST: u64 = 1_000_000;

/// Maximum expression length in bytes: `CELSelectorExpressionMaxLength` (10 KiB), enforced
/// by API validation (the [`Environment::New`] environment).
pub const MAX_EXPRESSION_LENGTH: usize = 10 * 1024;

/// Which upstream environment to compile in (`environment.Type`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Environment {
    /// `StoredExpressions`: what the scheduler uses for stored selectors; everything declared.
    #[default]
    Stored,
    /// `NewExpressions`: what API validation uses for new selectors; declarations introduced
    /// after the compatibility version (v1.35 for a v1.36 control plane) are absent, and the
    /// expression length limit applies.
    New,
}

/// Why an expression does not compile.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompileError {
    /// Longer than [`MAX_EXPRESSION_LENGTH`] (New environment only).
    #[error("expression too long: {len} bytes, may not be more than {MAX_EXPRESSION_LENGTH}")]
    TooLong {
        /// Length in bytes.
        len: usize,
    },
    /// Syntax error.
    #[error("compilation failed: {0}")]
    Parse(String),
    /// Type-check error.
    #[error("compilation failed: {0}")]
    Check(#[from] CheckError),
    /// The result is not `bool` (or the unknown type).
    #[error("must evaluate to bool or the unknown type, not {0}")]
    ResultType(Type),
    /// The worst-case estimated cost is above [`MAX_COST`] (New environment only; API
    /// validation's `validateCELSelector`, `pkg/apis/resource/validation`).
    #[error("too complex, exceeds cost limit: estimated cost {estimated}")]
    Cost {
        /// The estimate's maximum, in CEL cost units.
        estimated: u64,
    },
}

/// Why a selector could not be evaluated against a device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MatchError {
    /// The device cannot be presented (invalid version attribute, unsupported value).
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// Evaluation failed at runtime, ran over its cost limit or past its deadline.
    #[error(transparent)]
    Eval(#[from] EvalError),
    /// The result was not a bool (a dynamic attribute of another type).
    #[error("CEL result of type {0} could not be converted to bool")]
    NotBool(&'static str),
}

/// Compiles selectors for one feature set and environment.
#[derive(Clone, Copy, Debug, Default)]
pub struct Compiler {
    features: Features,
    environment: Environment,
}

/// A compiled selector: compile once, evaluate against many devices; `Send + Sync`.
#[derive(Debug)]
pub struct CompiledExpression {
    checked: checker::Checked,
    estimate: CostEstimate,
    /// AST depth: deep programs are evaluated on a thread with a large stack.
    depth: usize,
    expression: String,
    features: Features,
    cost_limit: u64,
    /// The expression as one direct comparison, when it has such a shape.
    fast: Option<fast::Comparison>,
}

/// Per-evaluation options.
#[derive(Clone, Copy, Debug)]
pub struct EvalOptions {
    /// Runtime cost limit; [`MAX_COST`] by default.
    pub cost_limit: u64,
    /// Interrupt evaluation at this instant (checked every 100 comprehension iterations, like
    /// cel-go's interrupt check frequency).
    pub deadline: Option<Instant>,
}

impl Default for EvalOptions {
    fn default() -> Self {
        EvalOptions {
            cost_limit: MAX_COST,
            deadline: None,
        }
    }
}

impl Compiler {
    /// A compiler for the given features and environment.
    pub fn new(features: Features, environment: Environment) -> Compiler {
        Compiler {
            features,
            environment,
        }
    }

    /// Parses and type-checks `expression`; in the [`Environment::New`] environment also
    /// estimates its worst-case cost ([`CompiledExpression::estimated_cost`]).
    ///
    /// Sources are limited like cel-go's parser (100,000 code points, nesting 250); programs
    /// nested deeper than 32 levels are parsed, checked and later evaluated on a helper thread
    /// with a 512 MiB reserved stack, so no input can overflow the caller's stack.
    ///
    /// # Errors
    /// [`CompileError`] for syntax and type errors, a non-bool result, or (New environment) an
    /// expression longer than [`MAX_EXPRESSION_LENGTH`] or estimated above [`MAX_COST`].
    pub fn compile(&self, expression: &str) -> Result<CompiledExpression, CompileError> {
        if self.environment == Environment::New && expression.len() > MAX_EXPRESSION_LENGTH {
            return Err(CompileError::TooLong {
                len: expression.len(),
            });
        }
        let (parsed, depth) =
            parse::parse(expression).map_err(|e| CompileError::Parse(e.to_string()))?;
        let deep = depth > parse::SHALLOW_DEPTH;
        let (checked, estimate) = parse::with_stack(deep, move || self.check(&parsed))
            .unwrap_or_else(|| Err(CompileError::Parse("max recursion depth exceeded".into())))?;
        Ok(CompiledExpression {
            fast: fast::Comparison::recognize(&checked.root),
            estimate,
            depth,
            checked,
            expression: expression.to_string(),
            features: self.features,
            cost_limit: MAX_COST,
        })
    }
}

impl Compiler {
    /// Type-checks, estimates (rejecting over [`MAX_COST`] in the New environment) and folds.
    fn check(
        &self,
        parsed: &cel::common::ast::IdedExpr,
    ) -> Result<(checker::Checked, CostEstimate), CompileError> {
        let env = checker::CheckEnv {
            features: self.features,
            // The stored environment declares every versioned option, feature-gated or not;
            // NewExpressions declares `includes` whenever DRAListTypeAttributes is on.
            includes: self.environment == Environment::Stored || self.features.list_type_attributes,
        };
        let mut checked = checker::check(env, parsed)?;
        let ty = &checked.root.ty;
        let ok = matches!(ty, Type::Bool | Type::Any)
            || (self.features.list_type_attributes && *ty == Type::Dyn);
        if !ok {
            return Err(CompileError::ResultType(ty.clone()));
        }
        // The estimate is of the expression as written; folding happens at planning upstream.
        let estimate = cost::estimate(&checked.root);
        if self.environment == Environment::New && estimate.max > MAX_COST {
            return Err(CompileError::Cost {
                estimated: estimate.max,
            });
        }
        fold_constants(&mut checked.root)?;
        Ok((checked, estimate))
    }

    /// The environment this compiler compiles for.
    pub fn environment(&self) -> Environment {
        self.environment
    }
}

impl CompiledExpression {
    /// The source text.
    pub fn expression(&self) -> &str {
        &self.expression
    }

    /// The selector as one comparison of a device attribute with a literal, if it has that
    /// shape: for callers that index device attributes themselves (the allocator), see
    /// [`AttributeComparison`] for when its answer stands.
    pub fn attribute_comparison(&self) -> Option<AttributeComparison<'_>> {
        self.fast.as_ref()?.attribute()
    }

    /// The driver name, if the selector is `device.driver == "name"` (either side): its
    /// answer for any device is whether the device's driver is that name (at cost limits of at
    /// least [`SHORTCUT_COST_BOUND`], like [`CompiledExpression::attribute_comparison`]).
    pub fn driver_comparison(&self) -> Option<&str> {
        self.fast.as_ref()?.driver()
    }

    /// The checked result type (`bool`, or `any`/`dyn` for a bare attribute).
    pub fn output_type(&self) -> &Type {
        &self.checked.root.ty
    }

    /// The worst-case cost range over every device the API could store, in CEL cost units,
    /// with upstream's estimator (see the `cost` module; cel-go `checker/cost.go`, Kubernetes
    /// `library/cost.go` and the DRA size bounds of `dynamic-resource-allocation/cel`).
    pub fn estimated_cost(&self) -> CostEstimate {
        self.estimate
    }

    /// Evaluates against a ResourceSlice device with the default options.
    ///
    /// # Errors
    /// [`MatchError`] as [`CompiledExpression::matches_with`].
    pub fn matches(&self, device: &Device) -> Result<bool, MatchError> {
        self.matches_with(
            device,
            EvalOptions {
                cost_limit: self.cost_limit,
                deadline: None,
            },
        )
    }

    /// Evaluates against a ResourceSlice device (`CompilationResult.DeviceMatches`).
    ///
    /// # Errors
    /// [`MatchError::Device`] when an attribute cannot be converted, [`MatchError::Eval`] for
    /// runtime errors, the cost limit and the deadline, [`MatchError::NotBool`] for a non-bool
    /// result.
    pub fn matches_with(&self, device: &Device, options: EvalOptions) -> Result<bool, MatchError> {
        let view = DeviceView::new(device, self.features.list_type_attributes)?;
        self.matches_view(&view, options)
    }

    /// Evaluates against an already built device view.
    ///
    /// # Errors
    /// As [`CompiledExpression::matches_with`], without the device conversion errors.
    pub fn matches_view(
        &self,
        view: &DeviceView<'_>,
        options: EvalOptions,
    ) -> Result<bool, MatchError> {
        if let Some(fast) = &self.fast
            && options.cost_limit >= fast::COST_BOUND
            && let Some(matched) = fast.evaluate(view)
        {
            return Ok(matched);
        }
        self.evaluate_view(view, options).0
    }

    /// Evaluates against a ResourceSlice device and also returns the runtime cost charged, in
    /// CEL cost units (cel-go's `EvalDetails.ActualCost`; at most the limit plus the last
    /// step's cost when the limit stopped it).
    pub fn matches_with_cost(
        &self,
        device: &Device,
        options: EvalOptions,
    ) -> (Result<bool, MatchError>, u64) {
        match DeviceView::new(device, self.features.list_type_attributes) {
            Ok(view) => self.evaluate_view(&view, options),
            Err(e) => (Err(e.into()), 0),
        }
    }

    fn evaluate_view(
        &self,
        view: &DeviceView<'_>,
        options: EvalOptions,
    ) -> (Result<bool, MatchError>, u64) {
        parse::with_stack(self.depth > parse::SHALLOW_DEPTH, || {
            self.evaluate_here(view, options)
        })
        .unwrap_or((Err(MatchError::Eval(EvalError::Interrupted)), 0))
    }

    fn evaluate_here(
        &self,
        view: &DeviceView<'_>,
        options: EvalOptions,
    ) -> (Result<bool, MatchError>, u64) {
        // Capacities read during this evaluation share their state; the next one starts afresh.
        let capacity_values = device::CapacityValues::default();
        let view = view.with_capacity_values(&capacity_values);
        let mut ev = eval::Evaluator {
            device: &view,
            slots: Vec::with_capacity(self.checked.slots),
            cost: 0,
            limit: options.cost_limit,
            deadline: options.deadline,
            steps: 0,
            lazy: Vec::new(),
            skip_root: false,
            accumulators: Vec::new(),
        };
        let result = match ev.eval(&self.checked.root) {
            Ok(value::Value::Bool(b)) => Ok(b),
            Ok(other) => Err(MatchError::NotBool(other.type_name())),
            Err(e) => Err(e.into()),
        };
        (result, ev.cost)
    }
}

/// cel-go's planner (`OptOptimize`, `interpreter/decorators.go`) evaluates type conversions of
/// constants and builds list and map literals of constants when it plans the program: they
/// cost nothing at runtime, and a failing conversion (`int('x')`) is a compile error there.
fn fold_constants(n: &mut checker::Node) -> Result<(), CompileError> {
    use checker::Kind;
    let folded = match &mut n.kind {
        Kind::Call {
            name,
            overloads,
            args,
        } => {
            args.iter_mut().try_for_each(fold_constants)?;
            let conversion = matches!(
                *name,
                "int" | "uint" | "double" | "string" | "bytes" | "bool" | "dyn" | "type"
            );
            match args.as_slice() {
                [
                    checker::Node {
                        kind: Kind::Const(v),
                        ..
                    },
                ] if conversion => {
                    let v =
                        functions::call(name, overloads, std::slice::from_ref(v)).map_err(|e| {
                            CompileError::Parse(format!("program instantiation failed: {e}"))
                        })?;
                    Some(v)
                }
                _ => None,
            }
        }
        Kind::DeviceField(o, _)
        | Kind::Select { operand: o, .. }
        | Kind::OptSelect { operand: o, .. } => {
            fold_constants(o)?;
            None
        }
        Kind::And(a, b) | Kind::Or(a, b) => {
            fold_constants(a)?;
            fold_constants(b)?;
            None
        }
        Kind::Cond(a, b, c) => {
            fold_constants(a)?;
            fold_constants(b)?;
            fold_constants(c)?;
            None
        }
        Kind::List { elems, optional } => {
            elems.iter_mut().try_for_each(fold_constants)?;
            let all_const = elems.iter().all(|e| matches!(e.kind, Kind::Const(_)));
            if all_const && !optional.iter().any(|o| *o) {
                let values = elems
                    .iter()
                    .filter_map(|e| match &e.kind {
                        Kind::Const(v) => Some(v.clone()),
                        _ => None,
                    })
                    .collect();
                Some(value::Value::List(Arc::new(values)))
            } else {
                None
            }
        }
        Kind::Map { entries } => {
            for (k, v, _) in entries.iter_mut() {
                fold_constants(k)?;
                fold_constants(v)?;
            }
            // Keys as the evaluator takes them (`value::same_go_key`): a repeated key keeps the
            // last value; unhashable keys and optional entries are left to the evaluator.
            let mut out: Vec<(value::Value<'static>, value::Value<'static>)> = Vec::new();
            let mut foldable = true;
            for (k, v, o) in entries.iter() {
                match (&k.kind, &v.kind, o) {
                    (Kind::Const(k), Kind::Const(v), false)
                        if matches!(
                            k,
                            value::Value::String(_)
                                | value::Value::Int(_)
                                | value::Value::Uint(_)
                                | value::Value::Double(_)
                                | value::Value::Bool(_)
                                | value::Value::Null
                        ) =>
                    {
                        match out.iter().position(|(x, _)| value::same_go_key(x, k)) {
                            Some(i) => out[i].1 = v.clone(),
                            None => out.push((k.clone(), v.clone())),
                        }
                    }
                    _ => foldable = false,
                }
            }
            foldable.then(|| value::Value::Map(Arc::new(out)))
        }
        Kind::Fold(f) => {
            for x in [
                &mut f.range,
                &mut f.init,
                &mut f.cond,
                &mut f.step,
                &mut f.result,
            ] {
                fold_constants(x)?;
            }
            None
        }
        Kind::Bind { init, body, .. } => {
            fold_constants(init)?;
            fold_constants(body)?;
            None
        }
        Kind::Const(_) | Kind::Var(_) | Kind::Device => None,
    };
    if let Some(v) = folded {
        n.kind = Kind::Const(v);
    }
    Ok(())
}

/// Shared handle to a compiled expression, as the [`Cache`] hands it out.
pub type SharedExpression = Arc<CompiledExpression>;

#[cfg(test)]
mod tests {
    use super::*;

    fn device() -> Device {
        serde_json::from_str(
            r#"{"driver": "dra.example.com",
                "attributes": {"model": {"string": "A100"}, "count": {"int": 3},
                               "ver": {"version": "1.2.3"}, "other.io/x": {"bool": true}},
                "capacity": {"memory": {"value": "80Gi"}}}"#,
        )
        .unwrap()
    }

    fn run(expr: &str) -> Result<bool, String> {
        let c = Compiler::default()
            .compile(expr)
            .map_err(|e| format!("compile: {e}"))?;
        c.matches(&device()).map_err(|e| format!("runtime: {e}"))
    }

    #[test]
    fn a_missing_attribute_is_a_runtime_error_not_false() {
        assert_eq!(
            run("device.attributes['dra.example.com'].nope"),
            Err("runtime: no such key: nope".into())
        );
        assert_eq!(
            run("has(device.attributes['dra.example.com'].nope)"),
            Ok(false)
        );
        assert_eq!(
            run("device.attributes['dra.example.com'].?nope.orValue(false)"),
            Ok(false)
        );
    }

    #[test]
    fn and_absorbs_an_error_when_the_other_side_is_false() {
        assert_eq!(
            run("device.attributes['dra.example.com'].nope == 1 && false"),
            Ok(false)
        );
        assert_eq!(run("true || device.attributes['x'].nope"), Ok(true));
    }

    #[test]
    fn an_unknown_domain_is_an_empty_map() {
        assert_eq!(run("device.attributes['unknown.io'].size() == 0"), Ok(true));
        assert_eq!(run("device.attributes['other.io'].x"), Ok(true));
    }

    #[test]
    fn comparing_a_version_with_a_string_is_a_runtime_error() {
        assert!(run("device.attributes['dra.example.com'].ver == '1.2.3'").is_err());
        assert_eq!(
            run("device.attributes['dra.example.com'].count == '3'"),
            Ok(false)
        );
    }

    #[test]
    fn ordering_on_quantities_does_not_compile() {
        let e = run("device.capacity['dra.example.com'].memory < quantity('1Gi')").unwrap_err();
        assert!(e.starts_with("compile:"), "{e}");
    }

    #[test]
    fn a_non_bool_result_does_not_compile() {
        assert!(run("1").unwrap_err().starts_with("compile:"));
        assert!(run("dyn(true)").unwrap_err().starts_with("compile:"));
    }

    #[test]
    fn a_capacity_changed_by_one_evaluation_is_fresh_in_the_next() {
        // Cmp leaves the capacity in the inf.Dec form for the rest of the evaluation, and
        // adding to an inf.Dec capacity changes it; neither survives into the next evaluation.
        let mut d = device();
        d.capacity.insert(
            "frac".into(),
            DeviceCapacity {
                value: libs::quantity::Quantity::parse("1.5Gi").unwrap(),
            },
        );
        let program = Compiler::default()
            .compile(
                "device.capacity['dra.example.com'].memory.isInteger() \
                 && device.capacity['dra.example.com'].memory.isGreaterThan(quantity('1.5Gi')) \
                 && !device.capacity['dra.example.com'].memory.isInteger() \
                 && sign(device.capacity['dra.example.com'].frac.add(1)) == 1 \
                 && device.capacity['dra.example.com'].frac == quantity('1610612737')",
            )
            .unwrap();
        for _ in 0..3 {
            assert!(matches!(program.matches(&d), Ok(true)));
        }
    }

    #[test]
    fn an_upstream_panic_is_not_absorbed_by_or() {
        let e = run("quantity('1e2147483647').isGreaterThan(quantity('1n')) || true").unwrap_err();
        assert!(e.starts_with("runtime: internal error:"), "{e}");
        assert_eq!(
            run("quantity('1.5x').isInteger() || true"),
            Ok(true),
            "a parse error is an ordinary runtime error"
        );
    }

    #[test]
    fn an_expensive_comprehension_hits_the_cost_limit() {
        let e = run("lists.range(1000).all(x, lists.range(1000).all(y, x + y >= 0))").unwrap_err();
        assert!(e.contains("cost limit"), "{e}");
    }
}
