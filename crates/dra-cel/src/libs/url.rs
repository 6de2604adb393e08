//! URLs with the parsing rules of Go's `net/url` (Go 1.26, default GODEBUG settings), as the
//! Kubernetes URL library uses them (`k8s.io/apiserver/pkg/cel/library/urls.go`, v0.36.3):
//! `url()` accepts a string only when `url.ParseRequestURI` does and then keeps the result of
//! `url.Parse`; `isURL()` asks `ParseRequestURI` alone.
//!
//! Only what the library exposes is kept: scheme, opaque part, user info, host, path (decoded
//! and raw), query and fragment, enough to reproduce `Hostname`, `Port`, `EscapedPath`, `Query`
//! and `String` (which URL equality compares).

use std::fmt;

use crate::libs::strfmt::go_quote;

/// A parsed URL (Go `url.URL`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Url {
    scheme: String,
    opaque: String,
    /// Escaped user info as written (`user:pass`), if an `@` was present.
    user: Option<(String, Option<String>)>,
    host: String,
    path: String,
    raw_path: String,
    omit_host: bool,
    force_query: bool,
    raw_query: String,
    fragment: String,
    raw_fragment: String,
}

/// Why a string is not a URL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    /// `net/url` rejected the text.
    #[error("URL parse error during conversion from string: parse {input:?}: {reason}")]
    Parse {
        /// The input.
        input: String,
        /// What was wrong.
        reason: String,
    },
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Path,
    Host,
    Zone,
    UserPassword,
    QueryComponent,
    Fragment,
}

/// Go's `shouldEscape` for one byte in one URL component.
fn should_escape(c: u8, mode: Mode) -> bool {
    if c.is_ascii_alphanumeric() {
        return false;
    }
    if matches!(mode, Mode::Host | Mode::Zone)
        && matches!(
            c,
            b'!' | b'$'
                | b'&'
                | b'\''
                | b'('
                | b')'
                | b'*'
                | b'+'
                | b','
                | b';'
                | b'='
                | b':'
                | b'['
                | b']'
                | b'<'
                | b'>'
                | b'"'
        )
    {
        return false;
    }
    match c {
        b'-' | b'_' | b'.' | b'~' => return false,
        b'$' | b'&' | b'+' | b',' | b'/' | b':' | b';' | b'=' | b'?' | b'@' => match mode {
            Mode::Path => return c == b'?',
            Mode::UserPassword => return matches!(c, b'@' | b'/' | b'?' | b':'),
            Mode::QueryComponent => return true,
            Mode::Fragment => return false,
            Mode::Host | Mode::Zone => {}
        },
        _ => {}
    }
    if mode == Mode::Fragment && matches!(c, b'!' | b'(' | b')' | b'*') {
        return false;
    }
    true
}

fn unhex(c: u8) -> u8 {
    match c {
        b'0'..=b'9' => c - b'0',
        b'a'..=b'f' => c - b'a' + 10,
        b'A'..=b'F' => c - b'A' + 10,
        _ => 0,
    }
}

/// Go's `EscapeError` text for the offending bytes (at most three, possibly cut inside a
/// character, which Go quotes as `\x` escapes).
fn escape_error(bytes: &[u8]) -> String {
    let mut quoted = String::from("\"");
    for chunk in bytes.utf8_chunks() {
        let valid = go_quote(chunk.valid());
        quoted.push_str(&valid[1..valid.len() - 1]);
        for x in chunk.invalid() {
            quoted.push_str(&format!("\\x{x:02x}"));
        }
    }
    quoted.push('"');
    format!("invalid URL escape {quoted}")
}

/// Go's `unescape`: decodes `%XX` (and `+` in query components), validating host and zone
/// characters.
fn unescape(s: &str, mode: Mode) -> Result<String, String> {
    let b = s.as_bytes();
    let mut i = 0;
    let mut n = 0;
    let mut has_plus = false;
    while i < b.len() {
        match b[i] {
            b'%' => {
                n += 1;
                if i + 2 >= b.len()
                    || !b[i + 1].is_ascii_hexdigit()
                    || !b[i + 2].is_ascii_hexdigit()
                {
                    return Err(escape_error(&b[i..b.len().min(i + 3)]));
                }
                let v = (unhex(b[i + 1]) << 4) | unhex(b[i + 2]);
                let pct25 = &b[i..i + 3] == b"%25";
                if mode == Mode::Host && unhex(b[i + 1]) < 8 && !pct25 {
                    return Err(escape_error(&b[i..i + 3]));
                }
                if mode == Mode::Zone && !pct25 && v != b' ' && should_escape(v, Mode::Host) {
                    return Err(escape_error(&b[i..i + 3]));
                }
                i += 3;
            }
            b'+' => {
                has_plus = mode == Mode::QueryComponent;
                i += 1;
            }
            c => {
                if matches!(mode, Mode::Host | Mode::Zone) && c < 0x80 && should_escape(c, mode) {
                    return Err(format!(
                        "invalid character {} in host name",
                        go_quote(&s[i..i + 1])
                    ));
                }
                i += 1;
            }
        }
    }
    if n == 0 && !has_plus {
        return Ok(s.to_string());
    }
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                out.push((unhex(b[i + 1]) << 4) | unhex(b[i + 2]));
                i += 3;
            }
            b'+' if mode == Mode::QueryComponent => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    // Go strings may hold any bytes; CEL strings must be UTF-8.
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// Go's `escape`.
fn escape(s: &str, mode: Mode) -> String {
    let mut out = String::with_capacity(s.len());
    for &c in s.as_bytes() {
        if c == b' ' && mode == Mode::QueryComponent {
            out.push('+');
        } else if should_escape(c, mode) {
            out.push('%');
            out.push(char::from(b"0123456789ABCDEF"[usize::from(c >> 4)]));
            out.push(char::from(b"0123456789ABCDEF"[usize::from(c & 15)]));
        } else {
            out.push(char::from(c));
        }
    }
    // Only bytes >= 0x80 are escaped among non-ASCII, so the result is ASCII-compatible.
    out
}

fn valid_encoded(s: &str, mode: Mode) -> bool {
    s.bytes().all(|c| {
        matches!(
            c,
            b'!' | b'$'
                | b'&'
                | b'\''
                | b'('
                | b')'
                | b'*'
                | b'+'
                | b','
                | b';'
                | b'='
                | b':'
                | b'@'
                | b'['
                | b']'
                | b'%'
        ) || !should_escape(c, mode)
    })
}

fn valid_optional_port(port: &str) -> bool {
    match port.strip_prefix(':') {
        None => port.is_empty(),
        Some(digits) => digits.bytes().all(|b| b.is_ascii_digit()),
    }
}

fn valid_userinfo(s: &str) -> bool {
    s.chars().all(|r| {
        r.is_ascii_alphanumeric()
            || matches!(
                r,
                '-' | '.'
                    | '_'
                    | ':'
                    | '~'
                    | '!'
                    | '$'
                    | '&'
                    | '\''
                    | '('
                    | ')'
                    | '*'
                    | '+'
                    | ','
                    | ';'
                    | '='
                    | '%'
                    | '@'
            )
    })
}

/// Go's `getScheme`: the scheme (as written) and the rest.
fn split_scheme(raw: &str) -> Result<(&str, &str), String> {
    for (i, c) in raw.bytes().enumerate() {
        match c {
            b'a'..=b'z' | b'A'..=b'Z' => {}
            b'0'..=b'9' | b'+' | b'-' | b'.' if i > 0 => {}
            b':' if i == 0 => return Err("missing protocol scheme".into()),
            b':' => return Ok((&raw[..i], &raw[i + 1..])),
            _ => return Ok(("", raw)),
        }
    }
    Ok(("", raw))
}

/// Go's `parseHost` with `urlstrictcolons=1` (the Go 1.26 default).
fn parse_host(scheme: &str, host: &str) -> Result<String, String> {
    match host.rfind('[') {
        Some(i) if i > 0 => return Err("invalid IP-literal".into()),
        Some(_) => {
            let Some(close) = host.rfind(']') else {
                return Err("missing ']' in host".into());
            };
            let colon_port = &host[close + 1..];
            if !valid_optional_port(colon_port) {
                return Err(format!("invalid port {} after host", go_quote(colon_port)));
            }
            let colon_port = unescape(colon_port, Mode::Host)?;
            let hostname = host.get(1..close).unwrap_or("");
            let unescaped = match hostname.find("%25") {
                Some(z) => {
                    unescape(&hostname[..z], Mode::Host)? + &unescape(&hostname[z..], Mode::Zone)?
                }
                None => unescape(hostname, Mode::Host)?,
            };
            if super::ip::is_go_ipv6_literal(&unescaped) != Some(true) {
                return Err("invalid IP-literal".into());
            }
            return Ok(format!("[{unescaped}]{colon_port}"));
        }
        None => {}
    }
    if let Some(first) = host.find(':') {
        let last = host.rfind(':').unwrap_or(first);
        // Strict colons: http(s) hosts keep the first colon, so `a:b:80` is an invalid port.
        let i = if scheme == "http" || scheme == "https" {
            first
        } else {
            last
        };
        let colon_port = &host[i..];
        if !valid_optional_port(colon_port) {
            return Err(format!("invalid port {} after host", go_quote(colon_port)));
        }
    }
    unescape(host, Mode::Host)
}

impl Url {
    /// Parses like the Kubernetes `url()` function: `ParseRequestURI` must accept the text,
    /// and the value is what `Parse` makes of it.
    ///
    /// # Errors
    /// [`UrlError::Parse`] when either parse fails.
    pub fn parse(raw: &str) -> Result<Url, UrlError> {
        Url::parse_go(raw, true)?;
        let (before, frag) = match raw.split_once('#') {
            Some((b, f)) => (b, Some(f)),
            None => (raw, None),
        };
        let mut u = Url::parse_go(before, false)?;
        if let Some(f) = frag.filter(|f| !f.is_empty()) {
            let fragment = unescape(f, Mode::Fragment).map_err(|reason| UrlError::Parse {
                input: raw.to_string(),
                reason,
            })?;
            u.raw_fragment = if escape(&fragment, Mode::Fragment) == f {
                String::new()
            } else {
                f.to_string()
            };
            u.fragment = fragment;
        }
        Ok(u)
    }

    /// Whether `url.ParseRequestURI` accepts the text (the `isURL()` function).
    pub fn is_request_uri(raw: &str) -> bool {
        Url::parse_go(raw, true).is_ok()
    }

    /// The text of the error `url.ParseRequestURI` returns for the input (Go's `url.Error`:
    /// `parse "<input>": <reason>`), or `None` when it accepts it. The `uri` format of the
    /// Kubernetes format library reports this text (`library/format.go`).
    pub fn request_uri_error(raw: &str) -> Option<String> {
        match Url::parse_go(raw, true) {
            Ok(_) => None,
            Err(UrlError::Parse { input, reason }) => {
                Some(format!("parse {}: {reason}", go_quote(&input)))
            }
        }
    }

    /// Go's unexported `parse(rawURL, viaRequest)`.
    fn parse_go(raw: &str, via_request: bool) -> Result<Url, UrlError> {
        let err = |reason: String| UrlError::Parse {
            input: raw.to_string(),
            reason,
        };
        if raw.bytes().any(|b| b < b' ' || b == 0x7f) {
            return Err(err("net/url: invalid control character in URL".into()));
        }
        if raw.is_empty() && via_request {
            return Err(err("empty url".into()));
        }
        let mut u = Url::default();
        if raw == "*" {
            u.path = "*".into();
            return Ok(u);
        }
        let (scheme, mut rest) = split_scheme(raw).map_err(err)?;
        u.scheme = scheme.to_ascii_lowercase();
        if rest.ends_with('?') && rest.matches('?').count() == 1 {
            u.force_query = true;
            rest = &rest[..rest.len() - 1];
        } else if let Some((r, q)) = rest.split_once('?') {
            rest = r;
            u.raw_query = q.to_string();
        }
        if !rest.starts_with('/') {
            if !u.scheme.is_empty() {
                u.opaque = rest.to_string();
                return Ok(u);
            }
            if via_request {
                return Err(err("invalid URI for request".into()));
            }
            let segment = rest.split('/').next().unwrap_or("");
            if segment.contains(':') {
                return Err(err("first path segment in URL cannot contain colon".into()));
            }
        }
        if (!u.scheme.is_empty() || !via_request && !rest.starts_with("///"))
            && rest.starts_with("//")
        {
            let mut authority = &rest[2..];
            rest = "";
            if let Some(i) = authority.find('/') {
                rest = &authority[i..];
                authority = &authority[..i];
            }
            let (userinfo, host) = match authority.rfind('@') {
                Some(i) => (Some(&authority[..i]), &authority[i + 1..]),
                None => (None, authority),
            };
            u.host = parse_host(&u.scheme, host).map_err(err)?;
            if let Some(ui) = userinfo {
                if !valid_userinfo(ui) {
                    return Err(err("net/url: invalid userinfo".into()));
                }
                u.user = Some(match ui.split_once(':') {
                    None => (unescape(ui, Mode::UserPassword).map_err(err)?, None),
                    Some((name, pass)) => (
                        unescape(name, Mode::UserPassword).map_err(err)?,
                        Some(unescape(pass, Mode::UserPassword).map_err(err)?),
                    ),
                });
            }
        } else if !u.scheme.is_empty() && rest.starts_with('/') {
            u.omit_host = true;
        }
        u.path = unescape(rest, Mode::Path).map_err(err)?;
        u.raw_path = if escape(&u.path, Mode::Path) == rest {
            String::new()
        } else {
            rest.to_string()
        };
        Ok(u)
    }

    /// The scheme, lower-cased (`getScheme()`).
    pub fn scheme(&self) -> &str {
        &self.scheme
    }

    /// Host and port as written, bracketed for IPv6 (`getHost()`).
    pub fn host(&self) -> &str {
        &self.host
    }

    fn split_host_port(&self) -> (&str, &str) {
        let mut host = self.host.as_str();
        let mut port = "";
        if let Some(c) = host.rfind(':')
            && valid_optional_port(&host[c..])
        {
            port = &host[c + 1..];
            host = &host[..c];
        }
        if host.len() >= 2 && host.starts_with('[') && host.ends_with(']') {
            host = &host[1..host.len() - 1];
        }
        (host, port)
    }

    /// The host without port or IPv6 brackets (`getHostname()`).
    pub fn hostname(&self) -> &str {
        self.split_host_port().0
    }

    /// The port digits, or empty (`getPort()`).
    pub fn port(&self) -> &str {
        self.split_host_port().1
    }

    /// The path as it should be written (Go `EscapedPath`, `getEscapedPath()`).
    pub fn escaped_path(&self) -> String {
        if !self.raw_path.is_empty()
            && valid_encoded(&self.raw_path, Mode::Path)
            && unescape(&self.raw_path, Mode::Path).is_ok_and(|p| p == self.path)
        {
            return self.raw_path.clone();
        }
        if self.path == "*" {
            return "*".into();
        }
        escape(&self.path, Mode::Path)
    }

    fn escaped_fragment(&self) -> String {
        if !self.raw_fragment.is_empty()
            && valid_encoded(&self.raw_fragment, Mode::Fragment)
            && unescape(&self.raw_fragment, Mode::Fragment).is_ok_and(|f| f == self.fragment)
        {
            return self.raw_fragment.clone();
        }
        escape(&self.fragment, Mode::Fragment)
    }

    /// The query parameters in order of first appearance, each with its values (Go `Query`,
    /// `getQuery()`): pairs with a `;` or a bad escape are skipped; more than 10,000 parameters
    /// give an empty result (`urlmaxqueryparams`).
    pub fn query(&self) -> Vec<(String, Vec<String>)> {
        let mut out: Vec<(String, Vec<String>)> = Vec::new();
        if self.raw_query.matches('&').count() + 1 > 10_000 {
            return out;
        }
        for pair in self.raw_query.split('&') {
            if pair.contains(';') || pair.is_empty() {
                continue;
            }
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let (Ok(k), Ok(v)) = (
                unescape(k, Mode::QueryComponent),
                unescape(v, Mode::QueryComponent),
            ) else {
                continue;
            };
            match out.iter_mut().find(|(key, _)| *key == k) {
                Some((_, vals)) => vals.push(v),
                None => out.push((k, vec![v])),
            }
        }
        out
    }
}

impl fmt::Display for Url {
    /// Go's `URL.String`, which URL equality compares.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut buf = String::new();
        if !self.scheme.is_empty() {
            buf.push_str(&self.scheme);
            buf.push(':');
        }
        if !self.opaque.is_empty() {
            buf.push_str(&self.opaque);
        } else {
            let no_authority = self.host.is_empty() && self.user.is_none();
            let writes_authority = !self.scheme.is_empty() || !no_authority;
            if writes_authority && !(self.omit_host && no_authority) {
                if !self.host.is_empty() || !self.path.is_empty() || self.user.is_some() {
                    buf.push_str("//");
                }
                if let Some((name, pass)) = &self.user {
                    buf.push_str(&escape(name, Mode::UserPassword));
                    if let Some(p) = pass {
                        buf.push(':');
                        buf.push_str(&escape(p, Mode::UserPassword));
                    }
                    buf.push('@');
                }
                buf.push_str(&escape(&self.host, Mode::Host));
            }
            let path = self.escaped_path();
            if !path.is_empty() && !path.starts_with('/') && !self.host.is_empty() {
                buf.push('/');
            }
            if buf.is_empty() && path.split('/').next().unwrap_or("").contains(':') {
                buf.push_str("./");
            }
            buf.push_str(&path);
        }
        if self.force_query || !self.raw_query.is_empty() {
            buf.push('?');
            buf.push_str(&self.raw_query);
        }
        if !self.fragment.is_empty() {
            buf.push('#');
            buf.push_str(&self.escaped_fragment());
        }
        f.write_str(&buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_of_an_http_url_are_split_like_go() {
        let u = Url::parse("https://user@Example.com:8443/a%20b/c?x=1&x=2&y#frag").unwrap();
        assert_eq!(u.scheme(), "https");
        assert_eq!(u.host(), "Example.com:8443");
        assert_eq!(u.hostname(), "Example.com");
        assert_eq!(u.port(), "8443");
        assert_eq!(u.escaped_path(), "/a%20b/c");
        assert_eq!(
            u.query(),
            vec![
                ("x".to_string(), vec!["1".to_string(), "2".to_string()]),
                ("y".to_string(), vec![String::new()])
            ]
        );
        assert_eq!(
            u.to_string(),
            "https://user@Example.com:8443/a%20b/c?x=1&x=2&y#frag"
        );
    }

    #[test]
    fn ipv6_hosts_keep_brackets_and_lose_them_in_the_hostname() {
        let u = Url::parse("http://[::1]:80/").unwrap();
        assert_eq!(u.host(), "[::1]:80");
        assert_eq!(u.hostname(), "::1");
    }

    #[test]
    fn request_uris_must_be_absolute_or_rooted() {
        assert!(Url::is_request_uri("/path"));
        assert!(Url::is_request_uri("mailto:someone"));
        assert!(!Url::is_request_uri("path"));
        assert!(!Url::is_request_uri(""));
        assert!(!Url::is_request_uri("http://a b.com/"));
        assert!(!Url::is_request_uri("http://[::1/"));
        assert!(!Url::is_request_uri("http://a:b:80/"));
        assert!(!Url::is_request_uri("/a%zz"));
    }
}
