//! Named string formats of the Kubernetes format library (`format.named(name)`,
//! `format.<name>()`, `<format>.validate(string)`), as `k8s.io/apiserver/pkg/cel/library/format.go`
//! (v0.36.3) declares them, with the validators it calls:
//!
//! - the DNS names through `k8s.io/apimachinery/pkg/api/validation/generic.go` (`NameIsDNSLabel`
//!   and friends, whose prefix form masks one trailing dash) and
//!   `k8s.io/apimachinery/pkg/util/validation/validation.go`, whose length errors count
//!   "characters";
//! - qualified names and label values through `k8s.io/apimachinery/pkg/api/validate/content`
//!   (`kube.go`, `dns.go`), whose length errors count "bytes";
//! - `uri` through Go's `url.ParseRequestURI`, reporting the `url.Error` text;
//! - `uuid`, `byte`, `date` and `datetime` through kube-openapi's `pkg/validation/strfmt`
//!   (`default.go`, `date.go`, `time.go`) with fixed messages.
//!
//! Lengths are in bytes, as Go's `len` counts them.

use crate::libs::url::Url;

/// A named format (upstream `cel.Format`, CEL type `kubernetes.NamedFormat`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    /// `dns1123Label`: a lowercase RFC 1123 label.
    Dns1123Label,
    /// `dns1123Subdomain`: a lowercase RFC 1123 subdomain.
    Dns1123Subdomain,
    /// `dns1035Label`: a DNS-1035 label.
    Dns1035Label,
    /// `qualifiedName`: a label key with an optional DNS subdomain prefix.
    QualifiedName,
    /// `dns1123LabelPrefix`: a label that may end in `-` (a `generateName` prefix).
    Dns1123LabelPrefix,
    /// `dns1123SubdomainPrefix`: a subdomain that may end in `-`.
    Dns1123SubdomainPrefix,
    /// `dns1035LabelPrefix`: a DNS-1035 label that may end in `-`.
    Dns1035LabelPrefix,
    /// `labelValue`: a label value (possibly empty).
    LabelValue,
    /// `uri`: what `url.ParseRequestURI` accepts.
    Uri,
    /// `uuid`: 32 hex digits with optional dashes at the usual places.
    Uuid,
    /// `byte`: padded standard base64.
    Byte,
    /// `date`: an RFC 3339 full date.
    Date,
    /// `datetime`: an RFC 3339 date-time.
    Datetime,
}

const DNS1123_LABEL_FMT: &str = "[a-z0-9]([-a-z0-9]*[a-z0-9])?";
const DNS1123_LABEL_MSG: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character";
const DNS1123_SUBDOMAIN_FMT: &str =
    "[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*";
const DNS1123_SUBDOMAIN_MSG: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character";
const DNS1035_LABEL_FMT: &str = "[a-z]([-a-z0-9]*[a-z0-9])?";
const DNS1035_LABEL_MSG: &str = "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic character, and end with an alphanumeric character";
const LABEL_KEY_FMT: &str = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]";
const LABEL_KEY_MSG: &str = "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character";
const LABEL_VALUE_FMT: &str = "(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?";
const LABEL_VALUE_MSG: &str = "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character";

impl Format {
    /// Every format, in upstream's documentation order.
    pub const ALL: [Format; 13] = [
        Format::Dns1123Label,
        Format::Dns1123Subdomain,
        Format::Dns1035Label,
        Format::QualifiedName,
        Format::Dns1123LabelPrefix,
        Format::Dns1123SubdomainPrefix,
        Format::Dns1035LabelPrefix,
        Format::LabelValue,
        Format::Uri,
        Format::Uuid,
        Format::Byte,
        Format::Date,
        Format::Datetime,
    ];

    /// The key `format.named` takes and the `format.<key>()` function names.
    pub fn key(self) -> &'static str {
        match self {
            Format::Dns1123Label => "dns1123Label",
            Format::Dns1123Subdomain => "dns1123Subdomain",
            Format::Dns1035Label => "dns1035Label",
            Format::QualifiedName => "qualifiedName",
            Format::Dns1123LabelPrefix => "dns1123LabelPrefix",
            Format::Dns1123SubdomainPrefix => "dns1123SubdomainPrefix",
            Format::Dns1035LabelPrefix => "dns1035LabelPrefix",
            Format::LabelValue => "labelValue",
            Format::Uri => "uri",
            Format::Uuid => "uuid",
            Format::Byte => "byte",
            Format::Date => "date",
            Format::Datetime => "datetime",
        }
    }

    /// The format with the given key (`format.named`), exact and case-sensitive.
    pub fn named(key: &str) -> Option<Format> {
        Format::ALL.into_iter().find(|f| f.key() == key)
    }

    /// Upstream's `MaxRegexSize`: the length of the (estimated) regular expression behind the
    /// validator, which scales the runtime cost of `validate` (`library/cost.go`).
    pub fn max_regex_size(self) -> u64 {
        match self {
            Format::Dns1123Label
            | Format::Dns1035Label
            | Format::Dns1123LabelPrefix
            | Format::Dns1035LabelPrefix => 30,
            Format::Dns1123Subdomain | Format::QualifiedName | Format::Dns1123SubdomainPrefix => 60,
            Format::LabelValue => 40,
            // govalidator's URL pattern, as upstream estimates ParseRequestURI.
            Format::Uri => 1103,
            // strfmt.UUIDPattern.
            Format::Uuid => 70,
            // govalidator's base64 pattern.
            Format::Byte => 84,
            // strfmt.DateTimePattern, for both.
            Format::Date | Format::Datetime => 71,
        }
    }

    /// The validation errors for `s`, empty when it is valid (`validate` then returns
    /// `optional.none()`).
    pub fn validate(self, s: &str) -> Vec<String> {
        let b = s.as_bytes();
        match self {
            Format::Dns1123Label => dns1123_label(b),
            Format::Dns1123Subdomain => dns1123_subdomain(b, "characters"),
            Format::Dns1035Label => dns1035_label(b),
            Format::QualifiedName => qualified_name(b),
            Format::Dns1123LabelPrefix => dns1123_label(&mask_trailing_dash(b)),
            Format::Dns1123SubdomainPrefix => {
                dns1123_subdomain(&mask_trailing_dash(b), "characters")
            }
            Format::Dns1035LabelPrefix => dns1035_label(&mask_trailing_dash(b)),
            Format::LabelValue => label_value(b),
            Format::Uri => Url::request_uri_error(s).into_iter().collect(),
            Format::Uuid => fixed(is_uuid(b), "does not match the UUID format"),
            Format::Byte => fixed(is_base64(b), "invalid base64"),
            Format::Date => fixed(is_date(b), "invalid date"),
            Format::Datetime => fixed(is_datetime(s), "invalid datetime"),
        }
    }
}

fn fixed(ok: bool, msg: &str) -> Vec<String> {
    if ok {
        Vec::new()
    } else {
        vec![msg.to_string()]
    }
}

/// `maskTrailingDash` (generic.go): a name of two or more bytes ending in `-` loses its last
/// two bytes and gains an `a` (upstream drops the byte before the dash too).
fn mask_trailing_dash(b: &[u8]) -> Vec<u8> {
    if b.len() > 1 && b.ends_with(b"-") {
        let mut v = b[..b.len() - 2].to_vec();
        v.push(b'a');
        v
    } else {
        b.to_vec()
    }
}

fn max_len_error(n: usize, unit: &str) -> String {
    format!("must be no more than {n} {unit}")
}

/// `RegexError` (both packages word it alike).
fn regex_error(msg: &str, fmt: &str, examples: &[&str]) -> String {
    let mut out = msg.to_string();
    out.push_str(" (e.g. ");
    for (i, e) in examples.iter().enumerate() {
        if i > 0 {
            out.push_str(" or ");
        }
        out.push('\'');
        out.push_str(e);
        out.push_str("', ");
    }
    out.push_str("regex used for validation is '");
    out.push_str(fmt);
    out.push_str("')");
    out
}

fn is_lower_alnum(c: u8) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit()
}

/// `^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`
fn matches_dns1123_label(b: &[u8]) -> bool {
    match (b.first(), b.last()) {
        (Some(&f), Some(&l)) => {
            is_lower_alnum(f)
                && is_lower_alnum(l)
                && b.iter().all(|&c| is_lower_alnum(c) || c == b'-')
        }
        _ => false,
    }
}

/// Labels of the lowercase RFC 1123 form joined by single dots.
fn matches_dns1123_subdomain(b: &[u8]) -> bool {
    b.split(|&c| c == b'.').all(matches_dns1123_label)
}

/// `^[a-z]([-a-z0-9]*[a-z0-9])?$`
fn matches_dns1035_label(b: &[u8]) -> bool {
    match (b.first(), b.last()) {
        (Some(&f), Some(&l)) => {
            f.is_ascii_lowercase()
                && is_lower_alnum(l)
                && b.iter().all(|&c| is_lower_alnum(c) || c == b'-')
        }
        _ => false,
    }
}

/// `^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$`
fn matches_label_key(b: &[u8]) -> bool {
    match (b.first(), b.last()) {
        (Some(&f), Some(&l)) => {
            f.is_ascii_alphanumeric()
                && l.is_ascii_alphanumeric()
                && b.iter()
                    .all(|&c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        }
        _ => false,
    }
}

/// `IsDNS1123Label` (util/validation).
fn dns1123_label(b: &[u8]) -> Vec<String> {
    let mut errs = Vec::new();
    if b.len() > 63 {
        errs.push(max_len_error(63, "characters"));
    }
    if !matches_dns1123_label(b) {
        if matches_dns1123_subdomain(b) {
            errs.push("must not contain dots".to_string());
        } else {
            errs.push(regex_error(
                DNS1123_LABEL_MSG,
                DNS1123_LABEL_FMT,
                &["my-name", "123-abc"],
            ));
        }
    }
    errs
}

/// `IsDNS1123Subdomain`; util/validation counts "characters", content counts "bytes".
fn dns1123_subdomain(b: &[u8], unit: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if b.len() > 253 {
        errs.push(max_len_error(253, unit));
    }
    if !matches_dns1123_subdomain(b) {
        errs.push(regex_error(
            DNS1123_SUBDOMAIN_MSG,
            DNS1123_SUBDOMAIN_FMT,
            &["example.com"],
        ));
    }
    errs
}

/// `IsDNS1035Label` (util/validation).
fn dns1035_label(b: &[u8]) -> Vec<String> {
    let mut errs = Vec::new();
    if b.len() > 63 {
        errs.push(max_len_error(63, "characters"));
    }
    if !matches_dns1035_label(b) {
        errs.push(regex_error(
            DNS1035_LABEL_MSG,
            DNS1035_LABEL_FMT,
            &["my-name", "abc-123"],
        ));
    }
    errs
}

/// `content.IsLabelKey` (what `IsQualifiedName` is).
fn qualified_name(b: &[u8]) -> Vec<String> {
    let examples = ["MyName", "my.name", "123-abc"];
    let parts: Vec<&[u8]> = b.split(|&c| c == b'/').collect();
    let mut errs = Vec::new();
    let name = match parts.as_slice() {
        [name] => *name,
        [prefix, name] => {
            if prefix.is_empty() {
                errs.push("prefix part must be non-empty".to_string());
            } else {
                errs.extend(
                    dns1123_subdomain(prefix, "bytes")
                        .into_iter()
                        .map(|m| format!("prefix part {m}")),
                );
            }
            *name
        }
        _ => {
            return vec![format!(
                "a valid label key {} with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')",
                regex_error(LABEL_KEY_MSG, LABEL_KEY_FMT, &examples)
            )];
        }
    };
    if name.is_empty() {
        errs.push("name part must be non-empty".to_string());
    } else if name.len() > 63 {
        errs.push(format!("name part {}", max_len_error(63, "bytes")));
    }
    if !matches_label_key(name) {
        errs.push(format!(
            "name part {}",
            regex_error(LABEL_KEY_MSG, LABEL_KEY_FMT, &examples)
        ));
    }
    errs
}

/// `content.IsLabelValue`.
fn label_value(b: &[u8]) -> Vec<String> {
    let mut errs = Vec::new();
    if b.len() > 63 {
        errs.push(max_len_error(63, "bytes"));
    }
    if !(b.is_empty() || matches_label_key(b)) {
        errs.push(regex_error(
            LABEL_VALUE_MSG,
            LABEL_VALUE_FMT,
            &["MyValue", "my_value", "12345"],
        ));
    }
    errs
}

/// strfmt's UUID pattern: groups of 8, 4, 4, 4 and 12 hex digits (either case), each dash
/// between them optional.
fn is_uuid(b: &[u8]) -> bool {
    let mut i = 0;
    for (n, len) in [8usize, 4, 4, 4, 12].into_iter().enumerate() {
        if n > 0 && b.get(i) == Some(&b'-') {
            i += 1;
        }
        let Some(group) = b.get(i..i + len) else {
            return false;
        };
        if !group.iter().all(u8::is_ascii_hexdigit) {
            return false;
        }
        i += len;
    }
    i == b.len()
}

/// govalidator's base64 pattern: whole groups of four from the standard alphabet, the last
/// one possibly padded with one or two `=`; the empty string does not match.
fn is_base64(b: &[u8]) -> bool {
    let alpha = |c: &u8| c.is_ascii_alphanumeric() || *c == b'+' || *c == b'/';
    if b.is_empty() || !b.len().is_multiple_of(4) {
        return false;
    }
    let (body, last) = b.split_at(b.len() - 4);
    if !body.iter().all(alpha) {
        return false;
    }
    match last {
        [a, b, b'=', b'='] => alpha(a) && alpha(b),
        [a, b, c, b'='] => alpha(a) && alpha(b) && alpha(c),
        _ => last.iter().all(alpha),
    }
}

fn digits(b: &[u8]) -> Option<u32> {
    if b.is_empty() || !b.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(b.iter().fold(0, |n, &c| n * 10 + u32::from(c - b'0')))
}

/// `time.Parse("2006-01-02", s)` succeeds: four-digit year, two-digit month and day, the day
/// within the month (leap years as Go's calendar has them), nothing after.
fn is_date(b: &[u8]) -> bool {
    if b.len() != 10 || b[4] != b'-' || b[7] != b'-' {
        return false;
    }
    let (Some(year), Some(month), Some(day)) = (digits(&b[..4]), digits(&b[5..7]), digits(&b[8..]))
    else {
        return false;
    };
    let leap = year.is_multiple_of(4) && (!year.is_multiple_of(100) || year.is_multiple_of(400));
    let days = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if leap => 29,
        2 => 28,
        _ => return false,
    };
    (1..=days).contains(&day)
}

/// strfmt's `IsDateTime`: at least four bytes; split at every `t` (case-insensitively); the
/// first piece a date and the second (later pieces are ignored) matching
/// `^([0-9]{2}):([0-9]{2}):([0-9]{2})(.[0-9]+)?(z|([+-][0-9]{2}:[0-9]{2}))$` with hours at
/// most 23 and minutes and seconds at most 59.
fn is_datetime(s: &str) -> bool {
    if s.len() < 4 {
        return false;
    }
    let mut pieces = s.split(['t', 'T']);
    let (Some(date), Some(time)) = (pieces.next(), pieces.next()) else {
        return false;
    };
    if !is_date(date.as_bytes()) {
        return false;
    }
    let b = time.as_bytes();
    if b.len() < 8 || b[2] != b':' || b[5] != b':' {
        return false;
    }
    let (Some(h), Some(m), Some(sec)) = (digits(&b[..2]), digits(&b[3..5]), digits(&b[6..8]))
    else {
        return false;
    };
    // The first eight bytes are ASCII, so this is a character boundary.
    let rest = &time[8..];
    let zone = |t: &str| {
        let t = t.as_bytes();
        matches!(t, [b'z' | b'Z'])
            || (t.len() == 6
                && matches!(t[0], b'+' | b'-')
                && t[1].is_ascii_digit()
                && t[2].is_ascii_digit()
                && t[3] == b':'
                && t[4].is_ascii_digit()
                && t[5].is_ascii_digit())
    };
    let fraction = || {
        // `.` is any character but a newline; the digit run stops at the zone, which starts
        // with no digit.
        let mut chars = rest.chars();
        match chars.next() {
            Some(c) if c != '\n' => {
                let after = chars.as_str();
                let n = after.bytes().take_while(u8::is_ascii_digit).count();
                n > 0 && zone(&after[n..])
            }
            _ => false,
        }
    };
    (zone(rest) || fraction()) && h <= 23 && m <= 59 && sec <= 59
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_format_is_found_by_its_key_and_nothing_else() {
        for f in Format::ALL {
            assert_eq!(Format::named(f.key()), Some(f));
        }
        assert_eq!(Format::named("DNS1123Label"), None);
        assert_eq!(Format::named(""), None);
    }

    #[test]
    fn prefix_forms_mask_the_byte_before_a_trailing_dash() {
        assert!(Format::Dns1123LabelPrefix.validate("my-prefix-").is_empty());
        assert!(Format::Dns1123LabelPrefix.validate("a--").is_empty());
        assert!(!Format::Dns1123Label.validate("my-prefix-").is_empty());
        assert_eq!(Format::Dns1035LabelPrefix.validate("-").len(), 1);
    }

    #[test]
    fn qualified_names_report_prefix_and_name_parts() {
        assert!(
            Format::QualifiedName
                .validate("example.com/MyName")
                .is_empty()
        );
        let errs = Format::QualifiedName.validate("/");
        assert_eq!(errs.len(), 3);
        assert_eq!(errs[0], "prefix part must be non-empty");
        assert_eq!(errs[1], "name part must be non-empty");
        assert_eq!(Format::QualifiedName.validate("a/b/c").len(), 1);
    }

    #[test]
    fn strfmt_formats_follow_their_patterns() {
        let cases = [
            (Format::Uuid, "123e4567-e89b-12d3-a456-426614174000", true),
            (Format::Uuid, "123E4567E89B12D3A456426614174000", true),
            (Format::Uuid, "123e4567-e89b-12d3-a456-42661417400", false),
            (Format::Byte, "aGVsbG8=", true),
            (Format::Byte, "aGVsbG8", false),
            (Format::Byte, "", false),
            (Format::Date, "2024-02-29", true),
            (Format::Date, "2023-02-29", false),
            (Format::Datetime, "2021-01-01T00:00:00Z", true),
            (Format::Datetime, "2021-01-01t23:59:59.5+01:00", true),
            (Format::Datetime, "2021-01-01T24:00:00Z", false),
        ];
        for (f, s, ok) in cases {
            assert_eq!(f.validate(s).is_empty(), ok, "{f:?} {s}");
        }
    }

    #[test]
    fn uri_errors_quote_the_input_like_go() {
        assert_eq!(
            Format::Uri.validate("example.com"),
            vec!["parse \"example.com\": invalid URI for request".to_string()]
        );
        assert!(Format::Uri.validate("https://example.com").is_empty());
    }
}
