//! The drust CLI library half: `dractl cel eval` evaluates DRA CEL selectors against devices in
//! the JSON Lines case format shared with the upstream oracle (`tests/gotools/cmd/celoracle`);
//! `dractl allocate` ([`allocate`], reading input with [`objects`]) computes the scheduler's
//! device allocations offline.

use std::io::{BufRead, Write};

pub mod allocate;
pub mod explain;
pub mod kueue;
pub mod lint;
pub mod live;
pub mod objects;
pub mod pending;
pub mod podgroup;
pub mod simulate;
pub mod top;
pub mod workload;

use dra_cel::{CompileError, Compiler, Device, Environment, EvalOptions, Features, MatchError};
use serde::{Deserialize, Serialize};

/// Feature switches of a case; unset fields take the Kubernetes v1.36 defaults.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CaseFeatures {
    /// DRAConsumableCapacity (default on).
    pub consumable_capacity: Option<bool>,
    /// DRAListTypeAttributes (default off).
    pub list_type_attributes: Option<bool>,
}

/// One case: an expression, a device, and optionally the environment and features.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Case {
    /// The selector expression.
    pub expression: String,
    /// The device, in ResourceSlice `resource.k8s.io/v1` form.
    pub device: Device,
    /// `"stored"` (default, the scheduler) or `"new"` (API validation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment: Option<String>,
    /// Feature switches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub features: Option<CaseFeatures>,
}

/// The error class of a failed case.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct ErrorOut {
    /// `compile`, `runtime`, `cost` or `input`.
    pub kind: String,
    /// Human-readable detail (not compared across implementations).
    pub message: String,
}

/// The outcome of one case: exactly one field is set.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Outcome {
    /// The selector's result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<bool>,
    /// The failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorOut>,
    /// The runtime cost of an evaluation that returned a result, in CEL cost units.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<u64>,
    /// The compile-time worst-case cost estimate (`new` environment only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimated_cost: Option<u64>,
}

impl Outcome {
    fn fail(kind: &str, message: impl ToString) -> Outcome {
        Outcome {
            result: None,
            error: Some(ErrorOut {
                kind: kind.into(),
                message: message.to_string(),
            }),
            cost: None,
            estimated_cost: None,
        }
    }

    /// `true`, `false`, or the error kind: what the conformance test compares.
    pub fn class(&self) -> String {
        match (&self.result, &self.error) {
            (Some(b), _) => b.to_string(),
            (None, Some(e)) => e.kind.clone(),
            (None, None) => "none".into(),
        }
    }
}

/// Errors of the `cel eval` command.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Reading the device or batch file failed.
    #[error("read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The device file is not a device.
    #[error("parse device {path}: {source}")]
    ParseDevice {
        /// The file.
        path: String,
        /// The cause.
        source: serde_json::Error,
    },
    /// Writing the output failed.
    #[error("write output: {0}")]
    Write(#[source] std::io::Error),
}

impl Case {
    fn compiler(&self) -> Result<Compiler, Outcome> {
        let defaults = Features::default();
        let f = self.features.unwrap_or_default();
        let features = Features {
            consumable_capacity: f
                .consumable_capacity
                .unwrap_or(defaults.consumable_capacity),
            list_type_attributes: f
                .list_type_attributes
                .unwrap_or(defaults.list_type_attributes),
        };
        let env = match self.environment.as_deref() {
            None | Some("") | Some("stored") => Environment::Stored,
            Some("new") => Environment::New,
            Some(other) => {
                return Err(Outcome::fail(
                    "input",
                    format!("unknown environment {other:?}"),
                ));
            }
        };
        Ok(Compiler::new(features, env))
    }
}

/// Evaluates one case, classifying failures like the upstream oracle.
pub fn evaluate(case: &Case) -> Outcome {
    let compiler = match case.compiler() {
        Ok(c) => c,
        Err(o) => return o,
    };
    let compiled = match compiler.compile(&case.expression) {
        Ok(c) => c,
        Err(e @ CompileError::Cost { estimated }) => {
            let mut o = Outcome::fail("cost", e);
            o.estimated_cost = Some(estimated);
            return o;
        }
        Err(
            e @ (CompileError::TooLong { .. }
            | CompileError::Parse(_)
            | CompileError::Check(_)
            | CompileError::ResultType(_)),
        ) => {
            return Outcome::fail("compile", e);
        }
    };
    let estimated_cost =
        (compiler.environment() == Environment::New).then(|| compiled.estimated_cost().max);
    let (result, cost) = compiled.matches_with_cost(&case.device, EvalOptions::default());
    let mut outcome = match result {
        Ok(b) => Outcome {
            result: Some(b),
            error: None,
            cost: Some(cost),
            estimated_cost: None,
        },
        Err(MatchError::Eval(e @ dra_cel::EvalError::CostLimit)) => Outcome::fail("cost", e),
        Err(e) => Outcome::fail("runtime", e),
    };
    outcome.estimated_cost = estimated_cost;
    outcome
}

/// Evaluates one JSON line (a decode failure is an `input` outcome).
pub fn evaluate_line(line: &str) -> Outcome {
    match serde_json::from_str::<Case>(line) {
        Ok(case) => evaluate(&case),
        Err(e) => Outcome::fail("input", e),
    }
}

/// `dractl cel eval --batch`: reads JSON Lines cases and writes one JSON outcome per case.
///
/// # Errors
/// [`CliError`] when reading or writing fails; bad cases are reported in the output.
pub fn eval_batch(input: impl BufRead, mut out: impl Write) -> Result<(), CliError> {
    for line in input.lines() {
        let line = line.map_err(|source| CliError::Read {
            path: "batch".into(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let outcome = evaluate_line(&line);
        let text = serde_json::to_string(&outcome).unwrap_or_else(|_| "{}".into());
        writeln!(out, "{text}").map_err(CliError::Write)?;
    }
    Ok(())
}

/// `dractl cel eval --expression --device`: one case.
///
/// # Errors
/// [`CliError`] when the device file cannot be read or parsed.
pub fn eval_one(
    expression: &str,
    device_path: &str,
    environment: Option<String>,
) -> Result<Outcome, CliError> {
    let text = std::fs::read_to_string(device_path).map_err(|source| CliError::Read {
        path: device_path.into(),
        source,
    })?;
    let device: Device = serde_json::from_str(&text).map_err(|source| CliError::ParseDevice {
        path: device_path.into(),
        source,
    })?;
    Ok(evaluate(&Case {
        expression: expression.into(),
        device,
        environment,
        features: None,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_line_yields_a_result_and_a_bad_line_an_input_error() {
        let input = "{\"expression\": \"device.driver == 'a'\", \"device\": {\"driver\": \"a\"}}\nnot json\n";
        let mut out = Vec::new();
        eval_batch(input.as_bytes(), &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("{\"result\":true,"), "{}", lines[0]);
        assert!(lines[1].contains("\"kind\":\"input\""));
    }
}

/// Timing of [`bench()`]: the same figures the oracle's `-bench` mode prints.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Timing {
    /// Which implementation.
    pub implementation: String,
    /// Cases read.
    pub cases: usize,
    /// Cases whose expression compiled (the evaluation set).
    pub eval_cases: usize,
    /// Iterations.
    pub iterations: usize,
    /// Mean compile time per expression, µs.
    pub compile_micros_per_expression: f64,
    /// Mean evaluation per (selector, device) including building the device view, ns.
    pub eval_nanos_per_selector_device: f64,
}

/// Times compilation and evaluation over JSON Lines cases, like the oracle's `-bench N`.
pub fn bench(lines: &[String], iterations: usize) -> Timing {
    let cases: Vec<Case> = lines
        .iter()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let compilers: Vec<Compiler> = cases.iter().filter_map(|c| c.compiler().ok()).collect();
    let start = std::time::Instant::now();
    let mut compiled = 0usize;
    for _ in 0..iterations {
        for (c, comp) in cases.iter().zip(&compilers) {
            let _ = std::hint::black_box(comp.compile(&c.expression));
            compiled += 1;
        }
    }
    let compile = start.elapsed();
    let programs: Vec<(dra_cel::CompiledExpression, &Device)> = cases
        .iter()
        .zip(&compilers)
        .filter_map(|(c, comp)| comp.compile(&c.expression).ok().map(|p| (p, &c.device)))
        .collect();
    let start = std::time::Instant::now();
    let mut evaluated = 0usize;
    for _ in 0..iterations * 10 {
        for (p, d) in &programs {
            let _ = std::hint::black_box(p.matches(d));
            evaluated += 1;
        }
    }
    let eval = start.elapsed();
    Timing {
        implementation: "drust dra-cel".into(),
        cases: cases.len(),
        eval_cases: programs.len(),
        iterations,
        compile_micros_per_expression: compile.as_secs_f64() * 1e6 / compiled.max(1) as f64,
        eval_nanos_per_selector_device: eval.as_secs_f64() * 1e9 / evaluated.max(1) as f64,
    }
}
