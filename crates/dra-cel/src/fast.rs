//! The commonest selectors answered without the evaluator: `device.driver == "..."` and
//! `device.attributes["domain"].id == <string, int or bool literal>` (either side of `==`;
//! `["id"]` for `.id` too). DeviceClasses and claims are mostly written this way (NVIDIA's and
//! our DeviceClasses, `productName` and `model` selectors).
//!
//! Only the outcome that needs no error handling is taken here: the attribute is present and
//! holds the literal's type. Everything else (an absent domain or attribute, which is a
//! runtime error, another type, list-type attributes) returns `None`, and the caller evaluates
//! the full tree, so answers and errors are those of the evaluator by construction. The
//! runtime cost of these shapes is a small constant (the root, two qualifiers, the comparison),
//! so it can never reach a cost limit of [`COST_BOUND`] or more; callers with a lower limit
//! use the evaluator, which charges cost step by step.

use crate::checker::{DeviceField, Kind, Node};
use crate::device::DeviceView;
use crate::value::Value;

/// A cost limit at or above which the shapes recognised here cannot run out of budget (their
/// runtime cost is at most 5).
pub const COST_BOUND: u64 = 100;

/// A literal of a comparison.
#[derive(Debug, Clone, PartialEq)]
enum Literal {
    String(String),
    Int(i64),
    Bool(bool),
}

/// What a recognised expression compares.
#[derive(Debug, Clone, PartialEq)]
enum Subject {
    Driver,
    Attribute {
        domain: String,
        id: String,
        /// `domain/id`.
        qualified: String,
    },
}

/// A literal as [`AttributeComparison`] hands it out.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LiteralRef<'a> {
    /// A string literal.
    String(&'a str),
    /// An int literal.
    Int(i64),
    /// A bool literal.
    Bool(bool),
}

/// A selector `device.attributes["domain"].id == literal` (either side, `["id"]` too), for a
/// caller that keeps its own index of device attributes
/// ([`crate::CompiledExpression::attribute_comparison`]).
///
/// The answer is `attribute == literal` only where the attribute the selector reads (see
/// [`DeviceView`]: the key `domain/id`, or `id` alone when `domain` is the driver, the later
/// one in key order when both exist) is present, holds exactly one scalar value and that value
/// has the literal's type (a version never does); anywhere else the caller must evaluate the
/// expression, which also yields its errors. Valid for cost limits of at least [`COST_BOUND`]
/// and without list-type attributes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttributeComparison<'a> {
    /// The attribute's domain.
    pub domain: &'a str,
    /// The attribute's id within the domain.
    pub id: &'a str,
    /// `domain/id`.
    pub qualified: &'a str,
    /// The literal it is compared with.
    pub literal: LiteralRef<'a>,
}

/// A selector that is one comparison of a device field with a literal.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Comparison {
    subject: Subject,
    literal: Literal,
}

fn literal(n: &Node) -> Option<Literal> {
    match &n.kind {
        Kind::Const(Value::String(s)) => Some(Literal::String(s.as_str().to_string())),
        Kind::Const(Value::Int(i)) => Some(Literal::Int(*i)),
        Kind::Const(Value::Bool(b)) => Some(Literal::Bool(*b)),
        _ => None,
    }
}

fn string_const(n: &Node) -> Option<&str> {
    match &n.kind {
        Kind::Const(Value::String(s)) => Some(s.as_str()),
        _ => None,
    }
}

/// `device.<field>` on the `device` variable itself.
fn device_field(n: &Node, want: DeviceField) -> bool {
    matches!(&n.kind, Kind::DeviceField(operand, f)
        if *f == want && matches!(operand.kind, Kind::Device))
}

/// `device.attributes["domain"]`.
fn attribute_domain(n: &Node) -> Option<&str> {
    match &n.kind {
        Kind::Call {
            name: "_[_]", args, ..
        } => match args.as_slice() {
            [map, key] if device_field(map, DeviceField::Attributes) => string_const(key),
            _ => None,
        },
        _ => None,
    }
}

fn subject(n: &Node) -> Option<Subject> {
    if device_field(n, DeviceField::Driver) {
        return Some(Subject::Driver);
    }
    let (operand, id) = match &n.kind {
        Kind::Select {
            operand,
            field,
            test: false,
        } => (&**operand, &**field),
        Kind::Call {
            name: "_[_]", args, ..
        } => match args.as_slice() {
            [operand, key] => (operand, string_const(key)?),
            _ => return None,
        },
        _ => return None,
    };
    let domain = attribute_domain(operand)?;
    Some(Subject::Attribute {
        domain: domain.to_string(),
        id: id.to_string(),
        qualified: format!("{domain}/{id}"),
    })
}

impl Comparison {
    /// The comparison `root` is, if it has one of the recognised shapes.
    pub(crate) fn recognize(root: &Node) -> Option<Comparison> {
        let Kind::Call {
            name: "_==_", args, ..
        } = &root.kind
        else {
            return None;
        };
        let [a, b] = args.as_slice() else {
            return None;
        };
        let (subject, literal) = match (subject(a), literal(b)) {
            (Some(s), Some(l)) => (s, l),
            _ => (subject(b)?, literal(a)?),
        };
        // The driver is a string: comparing it with another type is the evaluator's business.
        if subject == Subject::Driver && !matches!(literal, Literal::String(_)) {
            return None;
        }
        Some(Comparison { subject, literal })
    }

    /// The comparison of an attribute, if this is one.
    pub(crate) fn attribute(&self) -> Option<AttributeComparison<'_>> {
        let Subject::Attribute {
            domain,
            id,
            qualified,
        } = &self.subject
        else {
            return None;
        };
        Some(AttributeComparison {
            domain,
            id,
            qualified,
            literal: match &self.literal {
                Literal::String(s) => LiteralRef::String(s),
                Literal::Int(i) => LiteralRef::Int(*i),
                Literal::Bool(b) => LiteralRef::Bool(*b),
            },
        })
    }

    /// The driver name compared with, if this is `device.driver == "..."`.
    pub(crate) fn driver(&self) -> Option<&str> {
        match (&self.subject, &self.literal) {
            (Subject::Driver, Literal::String(s)) => Some(s),
            _ => None,
        }
    }

    /// The answer, or `None` where the evaluator must decide.
    pub(crate) fn evaluate(&self, view: &DeviceView<'_>) -> Option<bool> {
        match &self.subject {
            Subject::Driver => match &self.literal {
                Literal::String(s) => Some(view.driver == s),
                _ => None,
            },
            Subject::Attribute { domain, id, .. } => {
                if view.list_attributes {
                    return None;
                }
                let a = view.attribute(domain, id)?;
                // The value the evaluator would see: the first set of int, bool, string
                // (`DeviceView::attribute_value`); a version is a semver, never equal here.
                match (&self.literal, a.int, a.bool, &a.string) {
                    (Literal::Int(l), Some(v), _, _) => Some(v == *l),
                    (Literal::Bool(l), None, Some(v), _) => Some(v == *l),
                    (Literal::String(l), None, None, Some(v)) => Some(v == l),
                    _ => None,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Compiler, Device, Environment, EvalOptions, Features};

    fn device(json: &str) -> Device {
        serde_json::from_str(json).expect("device")
    }

    /// Every expression answers the same with and without the shortcut, errors included.
    #[test]
    fn the_shortcut_answers_as_the_evaluator_does() {
        let compiler = Compiler::new(Features::default(), Environment::Stored);
        let devices = [
            device(
                r#"{"driver": "d.example.com", "attributes": {"model": {"string": "H100"}, "n": {"int": 3}, "b": {"bool": true}, "v": {"version": "1.2.3"}}}"#,
            ),
            device(
                r#"{"driver": "d.example.com", "attributes": {"d.example.com/model": {"string": "A100"}, "other.io/n": {"int": 4}}}"#,
            ),
            device(
                r#"{"driver": "other.io", "attributes": {"model": {"int": 7}, "n": {"string": "3"}}}"#,
            ),
            device(
                r#"{"driver": "d.example.com", "attributes": {"model": {"string": "H100"}, "d.example.com/model": {"string": "B200"}}}"#,
            ),
            device(r#"{"driver": "d.example.com"}"#),
        ];
        let expressions = [
            r#"device.driver == "d.example.com""#,
            r#""other.io" == device.driver"#,
            r#"device.attributes["d.example.com"].model == "H100""#,
            r#"device.attributes["d.example.com"]["model"] == "A100""#,
            r#""B200" == device.attributes["d.example.com"].model"#,
            r#"device.attributes["d.example.com"].n == 3"#,
            r#"device.attributes["other.io"].n == 4"#,
            r#"device.attributes["other.io"].model == 7"#,
            r#"device.attributes["d.example.com"].b == true"#,
            r#"device.attributes["d.example.com"].v == "1.2.3""#,
            r#"device.attributes["d.example.com"].n == "3""#,
            r#"device.attributes["d.example.com/x"].model == "H100""#,
        ];
        let mut shortcut_taken = 0;
        for e in expressions {
            let compiled = compiler.compile(e).expect(e);
            assert!(compiled.fast.is_some(), "{e} is a recognised shape");
            for d in &devices {
                let view = DeviceView::new(d, false).expect("view");
                let full = compiled.evaluate_view(&view, EvalOptions::default()).0;
                let fast = compiled.matches_view(&view, EvalOptions::default());
                assert_eq!(format!("{fast:?}"), format!("{full:?}"), "{e} on {d:?}");
                // What the allocator answers from the driver name alone.
                if let Some(name) = compiled.driver_comparison() {
                    let by_name: Result<bool, crate::MatchError> = Ok(d.driver == name);
                    assert_eq!(format!("{by_name:?}"), format!("{full:?}"), "{e} on {d:?}");
                }
                shortcut_taken += usize::from(
                    compiled
                        .fast
                        .as_ref()
                        .and_then(|f| f.evaluate(&view))
                        .is_some(),
                );
            }
        }
        assert!(
            shortcut_taken > 15,
            "the shortcut answered {shortcut_taken} times"
        );
    }

    #[test]
    fn other_shapes_keep_the_evaluator() {
        let compiler = Compiler::new(Features::default(), Environment::Stored);
        for e in [
            r#"device.attributes["d.example.com"].model != "H100""#,
            r#"device.attributes["d.example.com"].model == device.driver"#,
            r#"[device][0].driver == "x""#,
            r#"device.capacity["d.example.com"].memory == quantity("1Gi")"#,
        ] {
            let compiled = compiler.compile(e).expect(e);
            assert!(compiled.fast.is_none(), "{e}");
        }
    }
}
