//! Node selection: which ResourceSlices and devices a Node can use.
//!
//! upstream: `structured/internal/incubating/pools_incubating.go`, `NodeMatches`, over
//! `k8s.io/component-helpers/scheduling/corev1/nodeaffinity` (`NewNodeSelector`, `Match`) and
//! `k8s.io/apimachinery/pkg/labels` (`NewRequirement`, `Requirement.Matches`).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, NodeSelector, NodeSelectorRequirement};

/// `NodeMatches`: a node name wins, then `allNodes`, then the selector; nothing set matches
/// nothing.
///
/// # Errors
/// The node selector does not parse (`failed to parse node selector ...`).
pub(crate) fn node_matches(
    node: &Node,
    node_name: &str,
    all_nodes: bool,
    selector: Option<&NodeSelector>,
) -> Result<bool, String> {
    if !node_name.is_empty() {
        return Ok(node.metadata.name.as_deref().unwrap_or("") == node_name);
    }
    if all_nodes {
        return Ok(true);
    }
    match selector {
        Some(selector) => {
            let terms = parse(selector).map_err(|e| {
                format!("failed to parse node selector {}: {e}", go_string(selector))
            })?;
            Ok(matches(&terms, node))
        }
        None => Ok(false),
    }
}

/// One parsed requirement.
enum Requirement<'a> {
    In(&'a str, &'a [String]),
    NotIn(&'a str, &'a [String]),
    Exists(&'a str),
    DoesNotExist(&'a str),
    Gt(&'a str, i64),
    Lt(&'a str, i64),
}

/// A parsed `NodeSelectorTerm`: label requirements (ANDed) and field requirements.
struct Term<'a> {
    labels: Option<Vec<Requirement<'a>>>,
    /// `(key, value, equal)`.
    fields: Option<Vec<(&'a str, &'a str, bool)>>,
}

const EMPTY: &[String] = &[];

/// `NewNodeSelector`: empty terms are dropped, parse errors are collected.
fn parse(selector: &NodeSelector) -> Result<Vec<Term<'_>>, String> {
    let mut errors: Vec<String> = Vec::new();
    let mut terms = Vec::new();
    for (i, term) in selector.node_selector_terms.iter().enumerate() {
        let exprs = term.match_expressions.as_deref().unwrap_or_default();
        let fields = term.match_fields.as_deref().unwrap_or_default();
        if exprs.is_empty() && fields.is_empty() {
            continue;
        }
        let path = format!("nodeSelectorTerms[{i}]");
        let mut parsed = Term {
            labels: None,
            fields: None,
        };
        if !exprs.is_empty() {
            let mut reqs = Vec::new();
            for (j, r) in exprs.iter().enumerate() {
                match label_requirement(r, &format!("{path}.matchExpressions[{j}]")) {
                    Ok(req) => reqs.push(req),
                    Err(mut e) => errors.append(&mut e),
                }
            }
            parsed.labels = Some(reqs);
        }
        if !fields.is_empty() {
            let mut reqs = Vec::new();
            for (j, r) in fields.iter().enumerate() {
                let p = format!("{path}.matchFields[{j}]");
                let values = r.values.as_deref().unwrap_or(EMPTY);
                match (r.operator.as_str(), values) {
                    ("In", [v]) => reqs.push((r.key.as_str(), v.as_str(), true)),
                    ("NotIn", [v]) => reqs.push((r.key.as_str(), v.as_str(), false)),
                    ("In" | "NotIn", _) => errors.push(format!(
                        "{p}.values: Invalid value: {}: must have one element",
                        go_list(values)
                    )),
                    (op, _) => errors.push(format!(
                        "{p}.operator: Unsupported value: \"{op}\": supported values: \"In\", \"NotIn\""
                    )),
                }
            }
            parsed.fields = Some(reqs);
        }
        terms.push(parsed);
    }
    match errors.len() {
        0 => Ok(terms),
        1 => Err(errors.concat()),
        _ => Err(format!("[{}]", errors.join(", "))),
    }
}

fn go_list(values: &[String]) -> String {
    format!(
        "[]string{{{}}}",
        values
            .iter()
            .map(|v| format!("{v:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// `labels.NewRequirement` for one node selector requirement.
fn label_requirement<'a>(
    r: &'a NodeSelectorRequirement,
    path: &str,
) -> Result<Requirement<'a>, Vec<String>> {
    let values = r.values.as_deref().unwrap_or(EMPTY);
    let key = r.key.as_str();
    let mut errors = Vec::new();
    if let Err(e) = validate_label_key(key) {
        errors.push(format!("{path}.key: Invalid value: {key:?}: {e}"));
    }
    let req = match r.operator.as_str() {
        "In" | "NotIn" => {
            if values.is_empty() {
                errors.push(format!(
                    "{path}.values: Invalid value: []: for 'in', 'notin' operators, values set can't be empty"
                ));
            }
            if r.operator == "In" {
                Some(Requirement::In(key, values))
            } else {
                Some(Requirement::NotIn(key, values))
            }
        }
        "Exists" | "DoesNotExist" => {
            if !values.is_empty() {
                errors.push(format!(
                    "{path}.values: Invalid value: {}: values set must be empty for exists and does not exist",
                    go_list(values)
                ));
            }
            if r.operator == "Exists" {
                Some(Requirement::Exists(key))
            } else {
                Some(Requirement::DoesNotExist(key))
            }
        }
        "Gt" | "Lt" => {
            if values.len() != 1 {
                errors.push(format!(
                    "{path}.values: Invalid value: {}: for 'Gt', 'Lt' operators, exactly one value is required",
                    go_list(values)
                ));
            }
            let mut parsed = 0;
            for (i, v) in values.iter().enumerate() {
                match v.parse::<i64>() {
                    Ok(n) => parsed = n,
                    Err(_) => errors.push(format!(
                        "{path}.values[{i}]: Invalid value: {v:?}: for 'Gt', 'Lt' operators, the value must be an integer"
                    )),
                }
            }
            if r.operator == "Gt" {
                Some(Requirement::Gt(key, parsed))
            } else {
                Some(Requirement::Lt(key, parsed))
            }
        }
        op => {
            errors.push(format!(
                "{path}.operator: Unsupported value: \"{op}\": supported values: \"In\", \"NotIn\", \"Exists\", \"DoesNotExist\", \"Gt\", \"Lt\""
            ));
            None
        }
    };
    for (i, v) in values.iter().enumerate() {
        if let Err(e) = validate_label_value(v) {
            errors.push(format!("{path}.values[{i}]: Invalid value: {v:?}: {e}"));
        }
    }
    match req {
        Some(req) if errors.is_empty() => Ok(req),
        _ => Err(errors),
    }
}

/// `validation.IsQualifiedName`, simplified to its accept/reject decision.
fn validate_label_key(key: &str) -> Result<(), &'static str> {
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix {
        let dns_ok = !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && l.bytes()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
                    && !l.starts_with('-')
                    && !l.ends_with('-')
            });
        if !dns_ok {
            return Err("prefix part must be a lowercase RFC 1123 subdomain");
        }
    }
    if name.is_empty() || name.len() > 63 || !is_label_chars(name) {
        return Err(
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character",
        );
    }
    Ok(())
}

fn is_label_chars(s: &str) -> bool {
    let b = s.as_bytes();
    b.first().is_some_and(u8::is_ascii_alphanumeric)
        && b.last().is_some_and(u8::is_ascii_alphanumeric)
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// `validation.IsValidLabelValue`.
fn validate_label_value(v: &str) -> Result<(), &'static str> {
    if v.is_empty() {
        return Ok(());
    }
    if v.len() > 63 || !is_label_chars(v) {
        return Err(
            "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character",
        );
    }
    Ok(())
}

/// `NodeSelector.Match`: any term matches.
fn matches(terms: &[Term<'_>], node: &Node) -> bool {
    let empty = BTreeMap::new();
    let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
    let name = node.metadata.name.as_deref().unwrap_or("");
    terms.iter().any(|t| {
        if let Some(reqs) = &t.labels
            && !reqs.iter().all(|r| requirement_matches(r, labels))
        {
            return false;
        }
        if let Some(fields) = &t.fields
            && !name.is_empty()
        {
            let ok = fields.iter().all(|(key, value, equal)| {
                let actual = if *key == "metadata.name" { name } else { "" };
                (actual == *value) == *equal
            });
            if !ok {
                return false;
            }
        }
        true
    })
}

fn requirement_matches(r: &Requirement<'_>, labels: &BTreeMap<String, String>) -> bool {
    match r {
        Requirement::In(k, vs) => labels.get(*k).is_some_and(|v| vs.contains(v)),
        Requirement::NotIn(k, vs) => labels.get(*k).is_none_or(|v| !vs.contains(v)),
        Requirement::Exists(k) => labels.contains_key(*k),
        Requirement::DoesNotExist(k) => !labels.contains_key(*k),
        Requirement::Gt(k, n) => labels
            .get(*k)
            .and_then(|v| v.parse::<i64>().ok())
            .is_some_and(|v| v > *n),
        Requirement::Lt(k, n) => labels
            .get(*k)
            .and_then(|v| v.parse::<i64>().ok())
            .is_some_and(|v| v < *n),
    }
}

/// Go's generated `String()` of a `NodeSelector`, close enough to name it in a message.
fn go_string(selector: &NodeSelector) -> String {
    let req = |r: &NodeSelectorRequirement| {
        format!(
            "NodeSelectorRequirement{{Key:{},Operator:{},Values:[{}],}}",
            r.key,
            r.operator,
            r.values.as_deref().unwrap_or_default().join(" ")
        )
    };
    let terms: Vec<String> = selector
        .node_selector_terms
        .iter()
        .map(|t| {
            let e: Vec<String> = t.match_expressions.iter().flatten().map(req).collect();
            let f: Vec<String> = t.match_fields.iter().flatten().map(req).collect();
            format!(
                "NodeSelectorTerm{{MatchExpressions:[]NodeSelectorRequirement{{{}}},MatchFields:[]NodeSelectorRequirement{{{}}},}}",
                e.join(","),
                f.join(",")
            )
        })
        .collect();
    format!(
        "&NodeSelector{{NodeSelectorTerms:[]NodeSelectorTerm{{{}}},}}",
        terms.join(",")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(name: &str, labels: serde_json::Value) -> Node {
        serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap()
    }

    fn selector(v: serde_json::Value) -> NodeSelector {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_node_name_wins_over_everything_else() {
        let n = node("a", json!({}));
        assert_eq!(node_matches(&n, "a", false, None), Ok(true));
        assert_eq!(node_matches(&n, "b", true, None), Ok(false));
        assert_eq!(node_matches(&n, "", true, None), Ok(true));
        assert_eq!(node_matches(&n, "", false, None), Ok(false));
    }

    #[test]
    fn label_operators_match_like_kubernetes() {
        let n = node("a", json!({"zone": "z1", "gen": "5"}));
        let check = |expr: serde_json::Value| {
            let s = selector(json!({"nodeSelectorTerms": [{"matchExpressions": [expr]}]}));
            node_matches(&n, "", false, Some(&s)).unwrap()
        };
        assert!(check(
            json!({"key": "zone", "operator": "In", "values": ["z1", "z2"]})
        ));
        assert!(!check(
            json!({"key": "zone", "operator": "NotIn", "values": ["z1"]})
        ));
        assert!(check(
            json!({"key": "missing", "operator": "NotIn", "values": ["z1"]})
        ));
        assert!(check(json!({"key": "zone", "operator": "Exists"})));
        assert!(check(json!({"key": "missing", "operator": "DoesNotExist"})));
        assert!(check(
            json!({"key": "gen", "operator": "Gt", "values": ["4"]})
        ));
        assert!(!check(
            json!({"key": "gen", "operator": "Lt", "values": ["4"]})
        ));
    }

    #[test]
    fn terms_are_ored_and_empty_terms_match_nothing() {
        let n = node("a", json!({"zone": "z1"}));
        let s = selector(json!({"nodeSelectorTerms": [{}, {"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": ["a"]}]}]}));
        assert_eq!(node_matches(&n, "", false, Some(&s)), Ok(true));
        let s = selector(json!({"nodeSelectorTerms": [{}]}));
        assert_eq!(node_matches(&n, "", false, Some(&s)), Ok(false));
    }

    #[test]
    fn a_bad_selector_is_an_error() {
        let n = node("a", json!({}));
        let s = selector(json!({"nodeSelectorTerms": [{"matchExpressions": [
            {"key": "zone", "operator": "Bogus"}]}]}));
        let e = node_matches(&n, "", false, Some(&s)).unwrap_err();
        assert!(e.starts_with("failed to parse node selector"), "{e}");
    }
}
