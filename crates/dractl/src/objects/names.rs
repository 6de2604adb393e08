//! Name formats of Kubernetes validation (apimachinery `pkg/util/validation`, v0.36.3): each
//! function returns the problems, empty when the value is valid.

/// `DNS1123LabelMaxLength`.
pub const DNS1123_LABEL_MAX: usize = 63;
/// `DNS1123SubdomainMaxLength`.
pub const DNS1123_SUBDOMAIN_MAX: usize = 253;
/// `LabelValueMaxLength` and the name part of a qualified name.
pub const QUALIFIED_NAME_MAX: usize = 63;

fn is_lower_alnum(c: u8) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit()
}

fn label_shape(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && is_lower_alnum(b[0])
        && is_lower_alnum(b[b.len() - 1])
        && b.iter().all(|&c| is_lower_alnum(c) || c == b'-')
}

/// `IsDNS1123Label`.
pub fn dns1123_label(s: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if s.len() > DNS1123_LABEL_MAX {
        errs.push(format!(
            "must be no more than {DNS1123_LABEL_MAX} characters"
        ));
    }
    if !label_shape(s) {
        errs.push("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character".into());
    }
    errs
}

/// `IsDNS1123Subdomain`.
pub fn dns1123_subdomain(s: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if s.len() > DNS1123_SUBDOMAIN_MAX {
        errs.push(format!(
            "must be no more than {DNS1123_SUBDOMAIN_MAX} characters"
        ));
    }
    if !s.split('.').all(label_shape) {
        errs.push("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character".into());
    }
    errs
}

fn qualified_name_part(s: &str) -> bool {
    let b = s.as_bytes();
    let alnum = |c: u8| c.is_ascii_alphanumeric();
    !b.is_empty()
        && alnum(b[0])
        && alnum(b[b.len() - 1])
        && b.iter()
            .all(|&c| alnum(c) || c == b'-' || c == b'_' || c == b'.')
}

/// `IsQualifiedName`: `[prefix/]name`, the prefix a DNS subdomain, the name at most 63
/// characters of alphanumerics, `-`, `_`, `.`, starting and ending alphanumeric.
pub fn qualified_name(s: &str) -> Vec<String> {
    let mut errs = Vec::new();
    let parts: Vec<&str> = s.split('/').collect();
    let name = match parts.as_slice() {
        [name] => *name,
        [prefix, name] => {
            if prefix.is_empty() {
                errs.push("prefix part must be non-empty".into());
            } else {
                errs.extend(
                    dns1123_subdomain(prefix)
                        .into_iter()
                        .map(|m| format!("prefix part {m}")),
                );
            }
            *name
        }
        _ => {
            errs.push("a qualified name must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character with an optional DNS subdomain prefix and '/'".into());
            return errs;
        }
    };
    if name.is_empty() {
        errs.push("name part must be non-empty".into());
    } else if name.len() > QUALIFIED_NAME_MAX {
        errs.push(format!(
            "name part must be no more than {QUALIFIED_NAME_MAX} characters"
        ));
    }
    if !name.is_empty() && !qualified_name_part(name) {
        errs.push("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character".into());
    }
    errs
}

/// `IsValidLabelValue`: empty, or at most 63 characters shaped like a qualified name's name.
pub fn label_value(s: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if s.len() > QUALIFIED_NAME_MAX {
        errs.push(format!(
            "must be no more than {QUALIFIED_NAME_MAX} characters"
        ));
    }
    if !s.is_empty() && !qualified_name_part(s) {
        errs.push("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character".into());
    }
    errs
}

/// `content.IsCIdentifier`: `[A-Za-z_][A-Za-z0-9_]*`.
pub fn c_identifier(s: &str) -> Vec<String> {
    let b = s.as_bytes();
    let ok = !b.is_empty()
        && (b[0].is_ascii_alphabetic() || b[0] == b'_')
        && b.iter().all(|&c| c.is_ascii_alphanumeric() || c == b'_');
    if ok {
        Vec::new()
    } else {
        vec!["a valid C identifier must start with alphabetic character or '_', followed by a string of alphanumeric characters or '_'".into()]
    }
}

/// The semantic version shape that validation.go's `semverRe` accepts (semver.org 2.0.0).
pub fn is_semver(s: &str) -> bool {
    let (rest, build) = match s.split_once('+') {
        Some((r, b)) => (r, Some(b)),
        None => (s, None),
    };
    if let Some(build) = build {
        let ok = build
            .split('.')
            .all(|id| !id.is_empty() && id.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-'));
        if !ok {
            return false;
        }
    }
    let (core, pre) = match rest.split_once('-') {
        Some((c, p)) => (c, Some(p)),
        None => (rest, None),
    };
    let numeric = |id: &str| {
        !id.is_empty()
            && id.bytes().all(|c| c.is_ascii_digit())
            && (id == "0" || !id.starts_with('0'))
    };
    let nums: Vec<&str> = core.split('.').collect();
    if nums.len() != 3 || !nums.iter().all(|n| numeric(n)) {
        return false;
    }
    if let Some(pre) = pre {
        let ok = pre.split('.').all(|id| {
            if id.is_empty() || !id.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-') {
                return false;
            }
            // Numeric identifiers must not have leading zeros; any with a letter or '-' is fine.
            id.bytes().any(|c| !c.is_ascii_digit()) || numeric(id)
        });
        if !ok {
            return false;
        }
    }
    true
}

/// A UUID in RFC 4122 normalized form, `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, lowercase hex
/// (validation.go `validateUID`).
pub fn is_normalized_uuid(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 36
        && b.iter().enumerate().all(|(i, &c)| match i {
            8 | 13 | 18 | 23 => c == b'-',
            _ => c.is_ascii_digit() || (b'a'..=b'f').contains(&c),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_apimachinery_formats() {
        assert!(dns1123_label("gpu-0").is_empty());
        assert!(!dns1123_label("Gpu").is_empty());
        assert!(!dns1123_label("-a").is_empty());
        assert!(!dns1123_label(&"a".repeat(64)).is_empty());
        assert!(dns1123_subdomain("gpu.example.com").is_empty());
        assert!(!dns1123_subdomain("gpu..example").is_empty());
        assert!(!dns1123_subdomain("").is_empty());
        assert!(qualified_name("example.com/Key_1").is_empty());
        assert!(qualified_name("key").is_empty());
        assert!(!qualified_name("/key").is_empty());
        assert!(!qualified_name("a/b/c").is_empty());
        assert!(!qualified_name("").is_empty());
        assert!(label_value("").is_empty());
        assert!(label_value("A.b-c_d").is_empty());
        assert!(!label_value("-x").is_empty());
        assert!(c_identifier("_model2").is_empty());
        assert!(!c_identifier("2model").is_empty());
        assert!(!c_identifier("a-b").is_empty());
    }

    #[test]
    fn semver_and_uuid_shapes() {
        for ok in [
            "1.2.3",
            "0.0.0",
            "1.2.3-alpha.1",
            "1.2.3-0a",
            "1.2.3+build.5",
            "10.20.30-rc.1+b",
        ] {
            assert!(is_semver(ok), "{ok}");
        }
        for bad in [
            "1.2",
            "01.2.3",
            "1.2.3-01",
            "1.2.3-",
            "1.2.3+",
            "v1.2.3",
            "1.2.3-a..b",
        ] {
            assert!(!is_semver(bad), "{bad}");
        }
        assert!(is_normalized_uuid("5b7a4c3e-1f2d-4e6a-9b8c-0d1e2f3a4b5c"));
        assert!(!is_normalized_uuid("5B7A4C3E-1F2D-4E6A-9B8C-0D1E2F3A4B5C"));
        assert!(!is_normalized_uuid("5b7a4c3e1f2d4e6a9b8c0d1e2f3a4b5c"));
    }
}
