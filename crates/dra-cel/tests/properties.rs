//! Property tests on stable Rust (a seeded generator, no fuzzing engine): for arbitrary and
//! ill-formed input, compiling never panics; for every program that compiles, evaluation never
//! panics, never runs past its cost limit (the tracked cost stays within the limit unless
//! evaluation stopped with the cost error) and finishes within a bounded time.
//!
//! Each run is deterministic (fixed seeds) and takes a few seconds in a debug build.

use std::time::{Duration, Instant};

use dra_cel::{Compiler, Device, Environment, EvalError, EvalOptions, Features, MatchError};

/// xorshift64*: small, fast, reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[self.below(xs.len())]
    }
    fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }
}

fn devices() -> Vec<Device> {
    include_str!("../../../tests/cel/devices.jsonl")
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("fixture device"))
        .collect()
}

fn compilers() -> Vec<Compiler> {
    let mut out = Vec::new();
    for env in [Environment::Stored, Environment::New] {
        for list_type_attributes in [false, true] {
            out.push(Compiler::new(
                Features {
                    consumable_capacity: true,
                    list_type_attributes,
                },
                env,
            ));
        }
    }
    out
}

/// Upper bound for one evaluation with a 1 s deadline (generous: debug build, shared CPU).
const EVAL_BOUND: Duration = Duration::from_secs(10);

#[derive(Default)]
struct Stats {
    compiled: usize,
    evaluated: usize,
    cost_stopped: usize,
}

/// Compiles `expr` with every compiler and evaluates what compiles against every device,
/// checking the cost and time properties.
fn exercise(expr: &str, limit: u64, compilers: &[Compiler], devices: &[Device], stats: &mut Stats) {
    for compiler in compilers {
        let Ok(program) = compiler.compile(expr) else {
            continue;
        };
        stats.compiled += 1;
        let estimate = program.estimated_cost();
        assert!(estimate.min <= estimate.max, "{expr}: {estimate:?}");
        for device in devices {
            let start = Instant::now();
            let options = EvalOptions {
                cost_limit: limit,
                deadline: Some(start + Duration::from_secs(1)),
            };
            let (result, cost) = program.matches_with_cost(device, options);
            let elapsed = start.elapsed();
            stats.evaluated += 1;
            assert!(elapsed < EVAL_BOUND, "{expr}: took {elapsed:?}");
            match result {
                Err(MatchError::Eval(EvalError::CostLimit)) => {
                    stats.cost_stopped += 1;
                    assert!(
                        cost > limit,
                        "{expr}: stopped at {cost} within limit {limit}"
                    );
                }
                _ => assert!(cost <= limit, "{expr}: cost {cost} over limit {limit}"),
            }
        }
    }
}

const TOKENS: &[&str] = &[
    "device",
    ".",
    "attributes",
    "capacity",
    "driver",
    "allowMultipleAllocations",
    "[",
    "]",
    "(",
    ")",
    "{",
    "}",
    ",",
    ":",
    "?",
    ".?",
    "[?",
    "'dra.example.com'",
    "'gpu.nvidia.com'",
    "'model'",
    "model",
    "count",
    "ver",
    "memory",
    "&&",
    "||",
    "!",
    "-",
    "+",
    "*",
    "/",
    "%",
    "==",
    "!=",
    "<",
    "<=",
    ">",
    ">=",
    "in",
    "true",
    "false",
    "null",
    "0",
    "1",
    "-7",
    "3u",
    "1.5",
    "1e308",
    "9223372036854775807",
    "18446744073709551615u",
    "'x'",
    "b'\\xff'",
    "\"\\u00e9\"",
    "r'\\d'",
    "x",
    "y",
    "all",
    "exists",
    "exists_one",
    "map",
    "filter",
    "has",
    "size",
    "matches",
    "quantity",
    "semver",
    "isGreaterThan",
    "compareTo",
    "lists.range",
    "cel.bind",
    "optional.of",
    "orValue",
    "hasValue",
    "transformList",
    "sort",
    "join",
    "split",
    "format",
    "ip",
    "cidr",
    "url",
    "int",
    "string",
    "dyn",
    "type",
    "'%s'",
];

fn token_soup(rng: &mut Rng) -> String {
    let n = 1 + rng.below(24);
    (0..n)
        .map(|_| rng.pick(TOKENS))
        .collect::<Vec<_>>()
        .join(if rng.chance(2) { " " } else { "" })
}

/// A mostly well-typed selector grammar over the device, with comprehensions nested up to
/// `depth` and expensive building blocks.
fn selector(rng: &mut Rng, depth: usize) -> String {
    let dom = rng.pick(&[
        "'dra.example.com'",
        "'gpu.nvidia.com'",
        "'other.io'",
        "'none.io'",
    ]);
    let attr = rng.pick(&["model", "count", "flag", "ver", "x", "name", "missing"]);
    if depth == 0 || rng.chance(4) {
        return match rng.below(12) {
            0 => format!("device.attributes[{dom}].{attr} == 'A100'"),
            1 => format!("has(device.attributes[{dom}].{attr})"),
            2 => format!("device.attributes[{dom}].?{attr}.orValue(0) == 0"),
            3 => format!("device.capacity[{dom}].memory.isGreaterThan(quantity('1Gi'))"),
            4 => format!("'{attr}' in device.attributes[{dom}]"),
            5 => format!("device.attributes[{dom}].{attr}.matches('^[A-Z]+[0-9]*$')"),
            6 => "device.driver.startsWith('dra')".into(),
            7 => format!("string(device.attributes[{dom}].{attr}).size() > 2"),
            8 => "device.allowMultipleAllocations".into(),
            9 => format!("device.attributes[{dom}].{attr} > {}", rng.below(5)),
            10 => format!("'{}'.contains(device.driver)", "a".repeat(rng.below(1000))),
            _ => format!("device.attributes[{dom}].{attr}"),
        };
    }
    let n = 1 + rng.below(300);
    let inner = selector(rng, depth - 1);
    match rng.below(10) {
        0 => format!("({inner} && {})", selector(rng, depth - 1)),
        1 => format!("({inner} || {})", selector(rng, depth - 1)),
        2 => format!("!({inner})"),
        3 => format!("lists.range({n}).all(i{depth}, {inner})"),
        4 => format!("lists.range({n}).exists(i{depth}, i{depth} < 0 || {inner})"),
        5 => format!("device.attributes[{dom}].all(k{depth}, {inner})"),
        6 => format!("lists.range({n}).map(i{depth}, {inner}).size() >= 0"),
        7 => format!("lists.range({n}).transformList(i{depth}, v{depth}, {inner}).size() > 0"),
        8 => format!("cel.bind(b{depth}, device.attributes[{dom}], {inner})"),
        _ => format!(
            "({inner} ? {} : {})",
            selector(rng, depth - 1),
            selector(rng, depth - 1)
        ),
    }
}

#[test]
fn random_bytes_never_panic_the_compiler() {
    let compilers = compilers();
    let mut rng = Rng(0x5eed_0001);
    for _ in 0..1500 {
        let len = rng.below(64);
        let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        let text = String::from_utf8_lossy(&bytes);
        for c in &compilers {
            let _ = c.compile(&text);
        }
    }
}

#[test]
fn token_soup_compiles_or_fails_cleanly_and_evaluates_within_its_limit() {
    let (compilers, devices) = (compilers(), devices());
    let mut rng = Rng(0x5eed_0002);
    let mut stats = Stats::default();
    for _ in 0..3000 {
        let expr = token_soup(&mut rng);
        exercise(&expr, 1_000_000, &compilers[..2], &devices, &mut stats);
    }
    // The soup is mostly invalid; some of it must still reach evaluation.
    assert!(stats.evaluated > 0, "no token soup compiled");
}

#[test]
fn generated_selectors_never_run_past_their_cost_limit() {
    let (compilers, devices) = (compilers(), devices());
    let mut rng = Rng(0x5eed_0003);
    let mut stats = Stats::default();
    for i in 0..400 {
        let expr = selector(&mut rng, 1 + i % 3);
        // Small limits exercise the stop path, larger ones full evaluations.
        let limit = match i % 3 {
            0 => rng.below(200) as u64,
            1 => rng.below(20_000) as u64,
            _ => 200_000,
        };
        exercise(&expr, limit, &compilers[..1], &devices[..2], &mut stats);
    }
    assert!(
        stats.compiled > 200,
        "only {} selectors compiled",
        stats.compiled
    );
    assert!(
        stats.cost_stopped > 0,
        "no evaluation reached its cost limit"
    );
}

#[test]
fn deep_nesting_and_huge_literals_are_rejected_or_evaluated_without_overflow() {
    let (compilers, devices) = (compilers(), devices());
    let mut stats = Stats::default();
    let mut inputs = Vec::new();
    for n in [10, 100, 249, 251, 5_000] {
        inputs.push(format!("{}true{}", "(".repeat(n), ")".repeat(n)));
        inputs.push(format!("{}1{} == []", "[".repeat(n), "]".repeat(n)));
        inputs.push(format!("{} > 0", vec!["1"; n].join(" + ")));
        inputs.push(format!("{}true", "!".repeat(n)));
        inputs.push(format!("device{}", ".attributes".repeat(n)));
        inputs.push(format!("{}1{} == 1", "dyn(".repeat(n), ")".repeat(n)));
        let mut all = "true".to_string();
        for i in 0..n.min(300) {
            all = format!("[1].all(x{i}, {all})");
        }
        inputs.push(all);
        inputs.push(vec!["device.driver == 'x'"; n].join(" || "));
    }
    inputs.push(format!("'{}' != ''", "a".repeat(99_000)));
    inputs.push(format!("'{}' != ''", "a".repeat(100_001)));
    inputs.push(format!("b'{}'.size() > 0", "\\xff".repeat(20_000)));
    inputs.push("1e309 > 0.0".into());
    inputs.push("99999999999999999999 > 0".into());
    inputs.push("-9223372036854775808 < 0".into());
    inputs.push("18446744073709551616u > 0u".into());
    inputs.push(format!("{} > 0", "9".repeat(5000)));
    inputs.push("lists.range(9223372036854775807).size() > 0".into());
    inputs.push("'%s'.format([device.driver]) == ''".into());
    inputs.push(format!("{} > 0", vec!["1"; 20_000].join(" + ")));
    inputs.push("lists.range(1000000).map(x, x).size() > 0".into());
    for expr in &inputs {
        exercise(
            expr,
            dra_cel::MAX_COST,
            &compilers[..2],
            &devices[..1],
            &mut stats,
        );
    }
    assert!(stats.compiled > 0);
}
