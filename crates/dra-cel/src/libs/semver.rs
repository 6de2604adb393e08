//! Semantic versions with the parsing rules of `github.com/blang/semver/v4` (what the
//! Kubernetes semver library, `k8s.io/apiserver/pkg/cel/library/semverlib.go`, uses).

use std::cmp::Ordering;

/// A pre-release identifier.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Pre {
    Num(u64),
    Alpha(String),
}

/// A parsed semantic version; build metadata is kept but ignored in comparisons.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Semver {
    /// Major version.
    pub major: u64,
    /// Minor version.
    pub minor: u64,
    /// Patch version.
    pub patch: u64,
    pre: Vec<Pre>,
}

/// Why a string is not a semantic version.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SemverError {
    /// The string is empty.
    #[error("Version string empty")]
    Empty,
    /// Fewer than three dot-separated parts.
    #[error("No Major.Minor.Patch elements found")]
    NotThreeParts,
    /// A numeric part is malformed.
    #[error("Invalid number {0:?}")]
    BadNumber(String),
    /// A pre-release identifier is malformed.
    #[error("Invalid prerelease {0:?}")]
    BadPrerelease(String),
    /// Build metadata is malformed.
    #[error("Invalid build meta data {0:?}")]
    BadBuild(String),
    /// A shortened version (normalize mode) carries pre-release or build data.
    #[error("short version cannot contain PreRelease/Build meta data")]
    ShortWithMeta,
}

fn is_alnum(s: &str) -> bool {
    s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

fn number(s: &str) -> Result<u64, SemverError> {
    if !s.bytes().all(|b| b.is_ascii_digit()) || (s.len() > 1 && s.starts_with('0')) {
        return Err(SemverError::BadNumber(s.to_string()));
    }
    s.parse::<u64>()
        .map_err(|_| SemverError::BadNumber(s.to_string()))
}

impl Semver {
    /// Parses strictly (`semver.Parse`): `MAJOR.MINOR.PATCH[-PRE][+BUILD]`, no leading zeroes.
    ///
    /// # Errors
    /// [`SemverError`] naming the malformed part.
    pub fn parse(s: &str) -> Result<Semver, SemverError> {
        if s.is_empty() {
            return Err(SemverError::Empty);
        }
        let mut parts = s.splitn(3, '.');
        let (Some(ma), Some(mi), Some(rest)) = (parts.next(), parts.next(), parts.next()) else {
            return Err(SemverError::NotThreeParts);
        };
        let major = number(ma)?;
        let minor = number(mi)?;
        let mut patch_str = rest;
        let mut build = None;
        if let Some(i) = patch_str.find('+') {
            build = Some(&patch_str[i + 1..]);
            patch_str = &patch_str[..i];
        }
        let mut pre_str = None;
        if let Some(i) = patch_str.find('-') {
            pre_str = Some(&patch_str[i + 1..]);
            patch_str = &patch_str[..i];
        }
        let patch = number(patch_str)?;
        let mut pre = Vec::new();
        if let Some(p) = pre_str {
            for id in p.split('.') {
                if id.is_empty() {
                    return Err(SemverError::BadPrerelease(id.to_string()));
                }
                if id.bytes().all(|b| b.is_ascii_digit()) {
                    if id.len() > 1 && id.starts_with('0') {
                        return Err(SemverError::BadPrerelease(id.to_string()));
                    }
                    pre.push(Pre::Num(
                        id.parse()
                            .map_err(|_| SemverError::BadPrerelease(id.to_string()))?,
                    ));
                } else if is_alnum(id) {
                    pre.push(Pre::Alpha(id.to_string()));
                } else {
                    return Err(SemverError::BadPrerelease(id.to_string()));
                }
            }
        }
        if let Some(b) = build {
            for id in b.split('.') {
                if id.is_empty() || !is_alnum(id) {
                    return Err(SemverError::BadBuild(id.to_string()));
                }
            }
        }
        Ok(Semver {
            major,
            minor,
            patch,
            pre,
        })
    }

    /// Parses leniently (`semver(s, true)`): drops a leading `v`, leading zeroes, and fills
    /// missing minor/patch with 0 (semverlib.go `normalizeAndParse`).
    ///
    /// # Errors
    /// [`SemverError`] when even the normalised form is not a version.
    pub fn parse_normalized(s: &str) -> Result<Semver, SemverError> {
        let s = s.strip_prefix('v').unwrap_or(s);
        let mut parts: Vec<String> = s
            .splitn(3, '.')
            .map(|p| {
                if p.len() > 1 {
                    let t = p.trim_start_matches('0');
                    if t.is_empty() || !t.as_bytes()[0].is_ascii_digit() {
                        format!("0{t}")
                    } else {
                        t.to_string()
                    }
                } else {
                    p.to_string()
                }
            })
            .collect();
        if parts.len() < 3 {
            if parts
                .last()
                .is_some_and(|p| p.contains('+') || p.contains('-'))
            {
                return Err(SemverError::ShortWithMeta);
            }
            while parts.len() < 3 {
                parts.push("0".into());
            }
        }
        Semver::parse(&parts.join("."))
    }
}

impl Ord for Semver {
    fn cmp(&self, o: &Self) -> Ordering {
        self.major
            .cmp(&o.major)
            .then(self.minor.cmp(&o.minor))
            .then(self.patch.cmp(&o.patch))
            .then_with(|| match (self.pre.is_empty(), o.pre.is_empty()) {
                (true, true) => Ordering::Equal,
                (true, false) => Ordering::Greater,
                (false, true) => Ordering::Less,
                (false, false) => {
                    for (a, b) in self.pre.iter().zip(&o.pre) {
                        let c = match (a, b) {
                            (Pre::Num(x), Pre::Num(y)) => x.cmp(y),
                            (Pre::Num(_), Pre::Alpha(_)) => Ordering::Less,
                            (Pre::Alpha(_), Pre::Num(_)) => Ordering::Greater,
                            (Pre::Alpha(x), Pre::Alpha(y)) => x.cmp(y),
                        };
                        if c != Ordering::Equal {
                            return c;
                        }
                    }
                    self.pre.len().cmp(&o.pre.len())
                }
            })
    }
}

impl PartialOrd for Semver {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_two_part_version_is_rejected_unless_normalized() {
        assert_eq!(Semver::parse("v1.0"), Err(SemverError::NotThreeParts));
        assert_eq!(Semver::parse_normalized("v1.0"), Semver::parse("1.0.0"));
    }

    #[test]
    fn a_prerelease_sorts_before_its_release() {
        let a = Semver::parse("1.0.0-alpha.1").unwrap();
        let b = Semver::parse("1.0.0").unwrap();
        assert!(a < b);
        assert!(Semver::parse("01.0.0").is_err());
    }
}
