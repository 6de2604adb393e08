//! Parsing with cel-go's input limits, safe against any input.
//!
//! cel-go v0.26.0 (`parser/parser.go`) rejects sources over 100,000 code points and parse trees
//! nested deeper than 250 (per grammar rule, and in its visitor). The `cel` crate parses and
//! visits recursively, so a deep enough input would overflow the stack; we bound the nesting
//! from the tokens first, parse a possibly deep input on a thread with a large stack, and
//! reject an AST deeper than upstream's limit before anything else recurses over it.

use cel::common::ast::{EntryExpr, Expr, IdedExpr};

/// `parser.expressionSizeCodePointLimit`.
pub(crate) const MAX_CODE_POINTS: usize = 100_000;
/// `parser.maxRecursionDepth`.
pub(crate) const MAX_DEPTH: usize = 250;
/// Above this token-level nesting bound the AST is certainly deeper than [`MAX_DEPTH`]
/// (the bound over-counts by at most the number of operator precedence levels).
const HOPELESS_BOUND: usize = 20 * MAX_DEPTH;

/// Why a source does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// More than [`MAX_CODE_POINTS`] code points.
    #[error("expression code point size exceeds limit: size: {0}, limit {MAX_CODE_POINTS}")]
    TooLarge(usize),
    /// Nested deeper than cel-go's recursion limit (250).
    #[error("max recursion depth exceeded")]
    TooDeep,
    /// A syntax error, as the `cel` parser reports it.
    #[error("{0}")]
    Syntax(String),
}

/// ASTs up to this depth are checked and evaluated on the caller's stack; deeper ones on a
/// thread with [`DEEP_STACK`] (debug builds need tens of KiB per level).
pub(crate) const SHALLOW_DEPTH: usize = 32;
/// Stack for work on deep trees, in bytes (reserved, committed only as used).
pub(crate) const DEEP_STACK: usize = 512 << 20;

/// Runs `f` on a thread with [`DEEP_STACK`] when `deep`, else on the caller's stack; `None`
/// when no thread could be started.
pub(crate) fn with_stack<T: Send>(deep: bool, f: impl FnOnce() -> T + Send) -> Option<T> {
    if !deep {
        return Some(f());
    }
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("dra-cel-deep".into())
            .stack_size(DEEP_STACK)
            .spawn_scoped(scope, f)
            .ok()?
            .join()
            .ok()
    })
}

/// Parses `source` with optional syntax enabled; returns the AST and its depth.
///
/// # Errors
/// [`ParseError`] for oversized, over-nested or malformed sources.
pub(crate) fn parse(source: &str) -> Result<(IdedExpr, usize), ParseError> {
    let points = source.chars().count();
    if points > MAX_CODE_POINTS {
        return Err(ParseError::TooLarge(points));
    }
    let bound = nesting_bound(source);
    if bound > HOPELESS_BOUND {
        return Err(ParseError::TooDeep);
    }
    // The generated parser descends about fifteen grammar rules per nesting level, with large
    // frames in debug builds: only shallow sources parse on the caller's stack.
    if bound <= SHALLOW_DEPTH {
        return parse_checked(source);
    }
    // No thread for the deep parse: refuse rather than risk the caller's stack.
    with_stack(true, || parse_checked(source)).unwrap_or(Err(ParseError::TooDeep))
}

fn parse_checked(source: &str) -> Result<(IdedExpr, usize), ParseError> {
    let parsed = cel::parser::Parser::new()
        .enable_optional_syntax(true)
        .max_recursion_depth(MAX_DEPTH as u16)
        .parse(source)
        .map_err(|e| ParseError::Syntax(e.to_string()))?;
    match depth(&parsed, MAX_DEPTH) {
        // Dropping a deep tree recurses as well; this runs on the deep-parse thread when the
        // tree can be deep.
        None => Err(ParseError::TooDeep),
        Some(d) => Ok((parsed, d)),
    }
}

/// An upper bound of the parse-tree nesting from the tokens: per bracket level, the number of
/// left-recursive operators (relations, arithmetic, member access, indexing) since the last
/// flat separator (`&&`, `||`, `?`, `:`, `,`), summed over the open brackets.
fn nesting_bound(source: &str) -> usize {
    let bytes = source.as_bytes();
    // chain[i]: operators chained at bracket level i.
    let mut chain: Vec<usize> = vec![1];
    let mut worst = 1usize;
    let mut i = 0;
    let mut quote: Option<u8> = None;
    // Whether the previous token ends an operand (so `-` is binary, not negation).
    let mut after_operand = false;
    let bump = |chain: &mut Vec<usize>| {
        if let Some(top) = chain.last_mut() {
            *top = top.saturating_add(1);
        }
    };
    while i < bytes.len() {
        let c = bytes[i];
        if let Some(q) = quote {
            if c == b'\\' {
                i += 2;
                continue;
            }
            if c == q {
                quote = None;
                after_operand = true;
            }
            i += 1;
            continue;
        }
        let next = bytes.get(i + 1).copied();
        let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
        match c {
            b'\'' | b'"' => quote = Some(c),
            b'(' | b'[' | b'{' => {
                bump(&mut chain);
                chain.push(1);
                after_operand = false;
            }
            b')' | b']' | b'}' => {
                if chain.len() > 1 {
                    chain.pop();
                }
                after_operand = true;
            }
            b'&' | b'|' | b',' | b'?' | b':' => {
                if let Some(top) = chain.last_mut() {
                    *top = 1;
                }
                after_operand = false;
            }
            // Unary `!` and `-` repeat flatly in the grammar; binary `-` chains.
            b'!' if next != Some(b'=') => after_operand = false,
            b'-' if !after_operand => {}
            b'+' | b'-' | b'*' | b'/' | b'%' | b'<' | b'>' | b'=' | b'!' | b'.' => {
                // Two-character operators count once, at their second character.
                if !(matches!(c, b'<' | b'>' | b'=' | b'!') && next == Some(b'=')) {
                    bump(&mut chain);
                }
                after_operand = false;
            }
            b'i' if next == Some(b'n')
                && (i == 0 || !word(bytes[i - 1]))
                && !bytes.get(i + 2).is_some_and(|b| word(*b)) =>
            {
                bump(&mut chain);
                after_operand = false;
                i += 1;
            }
            b if word(b) => after_operand = true,
            _ => {}
        }
        worst = worst.max(chain.iter().fold(0usize, |a, b| a.saturating_add(*b)));
        i += 1;
    }
    worst
}

/// The depth of the AST, `None` when deeper than `limit`; without recursion.
fn depth(root: &IdedExpr, limit: usize) -> Option<usize> {
    let mut stack: Vec<(&IdedExpr, usize)> = vec![(root, 1)];
    let mut max = 0;
    while let Some((e, d)) = stack.pop() {
        if d > limit {
            return None;
        }
        max = max.max(d);
        let d = d + 1;
        match &e.expr {
            Expr::Call(c) => {
                stack.extend(c.target.as_deref().map(|t| (t, d)));
                stack.extend(c.args.iter().map(|a| (a, d)));
            }
            Expr::Select(s) => stack.push((&s.operand, d)),
            Expr::List(l) => stack.extend(l.elements.iter().map(|a| (a, d))),
            Expr::Map(m) => {
                for entry in &m.entries {
                    if let EntryExpr::MapEntry(me) = &entry.expr {
                        stack.push((&me.key, d));
                        stack.push((&me.value, d));
                    }
                }
            }
            Expr::Struct(s) => {
                for entry in &s.entries {
                    if let EntryExpr::StructField(f) = &entry.expr {
                        stack.push((&f.value, d));
                    }
                }
            }
            Expr::Comprehension(c) => {
                for x in [
                    &c.iter_range,
                    &c.accu_init,
                    &c.loop_cond,
                    &c.loop_step,
                    &c.result,
                ] {
                    stack.push((x, d));
                }
            }
            Expr::Ident(_) | Expr::Literal(_) | Expr::Unspecified => {}
        }
    }
    Some(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_operator_chain_is_rejected_without_overflowing_the_stack() {
        let chain = vec!["1"; 20_000].join(" + ");
        assert_eq!(parse(&chain).unwrap_err(), ParseError::TooDeep);
        let chain = vec!["1"; 300].join(" + ");
        assert_eq!(parse(&chain).unwrap_err(), ParseError::TooDeep);
        let ok = parse(&vec!["1"; 200].join(" + "));
        assert!(ok.is_ok(), "{ok:?}");
    }

    #[test]
    fn repeated_unary_operators_are_flat() {
        assert!(parse(&format!("{}true", "!".repeat(10_000))).is_ok());
        assert!(parse(&format!("{}1 < 0", "-".repeat(10_000))).is_ok());
    }

    #[test]
    fn flat_conjunctions_do_not_count_as_nesting() {
        let flat = vec!["x == 1"; 1000].join(" && ");
        assert!(nesting_bound(&flat) <= 3, "{}", nesting_bound(&flat));
    }

    #[test]
    fn nesting_up_to_upstreams_limit_parses() {
        let lists = format!("{}1{}", "[".repeat(200), "]".repeat(200));
        assert!(parse(&lists).is_ok());
        let lists = format!("{}1{}", "[".repeat(300), "]".repeat(300));
        assert!(parse(&lists).is_err());
    }

    #[test]
    fn an_oversized_source_is_rejected_before_parsing() {
        let big = format!("'{}'", "a".repeat(MAX_CODE_POINTS));
        assert!(matches!(parse(&big), Err(ParseError::TooLarge(_))));
    }
}
