//! IP addresses and prefixes with the parsing and formatting rules of Go's `net/netip`, as the
//! Kubernetes IP and CIDR libraries use them (`k8s.io/apiserver/pkg/cel/library/ip.go`,
//! `cidr.go`, v0.36.3): `ParseAddr`/`ParsePrefix`, then zones and IPv4-mapped IPv6 addresses
//! are rejected.
//!
//! IPv4 fields must be decimal without leading zeros (`010.0.0.1` is rejected); IPv6 follows
//! RFC 4291 text forms including a trailing embedded IPv4 address; formatting is RFC 5952
//! (lower-case hex, the first longest run of two or more zero groups compressed).

use std::fmt;

/// An IPv4 or IPv6 address (Go `netip.Addr` without a zone).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Addr {
    /// IPv4, big-endian in the low 32 bits.
    V4(u32),
    /// IPv6, big-endian.
    V6(u128),
}

/// An address and a prefix length in bits (Go `netip.Prefix`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Prefix {
    /// The address as written (not masked).
    pub addr: Addr,
    /// Prefix length: 0..=32 for IPv4, 0..=128 for IPv6.
    pub bits: u8,
}

/// Why a string is not an acceptable IP address or CIDR.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IpError {
    /// `netip.ParseAddr` rejected the text.
    #[error("IP Address {input:?} parse error during conversion from string: {reason}")]
    Addr {
        /// The input.
        input: String,
        /// What was wrong.
        reason: &'static str,
    },
    /// The address has an IPv6 zone (`fe80::1%eth0`).
    #[error("IP address {0:?} with zone value is not allowed")]
    Zone(String),
    /// An IPv4-mapped IPv6 address (`::ffff:1.2.3.4`).
    #[error("IPv4-mapped IPv6 address {0:?} is not allowed")]
    Mapped(String),
    /// `netip.ParsePrefix` rejected the text.
    #[error("network address parse error during conversion from string: {input:?}: {reason}")]
    Prefix {
        /// The input.
        input: String,
        /// What was wrong.
        reason: &'static str,
    },
}

fn addr_err(input: &str, reason: &'static str) -> IpError {
    IpError::Addr {
        input: input.to_string(),
        reason,
    }
}

/// Go's `parseIPv4Fields`: four decimal fields 0-255 without leading zeros.
fn parse_v4(s: &str, input: &str) -> Result<u32, IpError> {
    let mut fields = [0u32; 4];
    let mut pos = 0usize;
    let mut val = 0u32;
    let mut digits = 0usize;
    let b = s.as_bytes();
    for (i, &c) in b.iter().enumerate() {
        match c {
            b'0'..=b'9' => {
                if digits == 1 && val == 0 {
                    return Err(addr_err(input, "IPv4 field has octet with leading zero"));
                }
                val = val * 10 + u32::from(c - b'0');
                digits += 1;
                if val > 255 {
                    return Err(addr_err(input, "IPv4 field has value >255"));
                }
            }
            b'.' => {
                if i == 0 || i == b.len() - 1 || b[i - 1] == b'.' {
                    return Err(addr_err(input, "IPv4 field must have at least one digit"));
                }
                if pos == 3 {
                    return Err(addr_err(input, "IPv4 address too long"));
                }
                fields[pos] = val;
                pos += 1;
                val = 0;
                digits = 0;
            }
            _ => return Err(addr_err(input, "unexpected character")),
        }
    }
    if pos < 3 {
        return Err(addr_err(input, "IPv4 address too short"));
    }
    fields[3] = val;
    Ok(fields.iter().fold(0u32, |acc, f| (acc << 8) | f))
}

/// Go's `parseIPv6`; returns the address and whether a zone was present.
fn parse_v6(input: &str) -> Result<(u128, bool), IpError> {
    let (mut s, zoned) = match input.split_once('%') {
        Some((_, "")) => return Err(addr_err(input, "zone must be a non-empty string")),
        Some((a, _)) => (a, true),
        None => (input, false),
    };
    let mut ip = [0u8; 16];
    let mut ellipsis: Option<usize> = None;
    if let Some(rest) = s.strip_prefix("::") {
        ellipsis = Some(0);
        s = rest;
        if s.is_empty() {
            return Ok((0, zoned));
        }
    }
    let mut i = 0usize;
    while i < 16 {
        let b = s.as_bytes();
        let mut off = 0usize;
        let mut acc = 0u32;
        while off < b.len() {
            let d = match b[off] {
                c @ b'0'..=b'9' => c - b'0',
                c @ b'a'..=b'f' => c - b'a' + 10,
                c @ b'A'..=b'F' => c - b'A' + 10,
                _ => break,
            };
            acc = (acc << 4) + u32::from(d);
            if off > 3 {
                return Err(addr_err(input, "each group must have 4 or less digits"));
            }
            if acc > 0xffff {
                return Err(addr_err(input, "IPv6 field has value >=2^16"));
            }
            off += 1;
        }
        if off == 0 {
            return Err(addr_err(
                input,
                "each colon-separated field must have at least one digit",
            ));
        }
        if off < b.len() && b[off] == b'.' {
            if ellipsis.is_none() && i != 12 {
                return Err(addr_err(
                    input,
                    "embedded IPv4 address must replace the final 2 fields of the address",
                ));
            }
            if i + 4 > 16 {
                return Err(addr_err(
                    input,
                    "too many hex fields to fit an embedded IPv4 at the end of the address",
                ));
            }
            let v4 = parse_v4(s, input)?;
            ip[i..i + 4].copy_from_slice(&v4.to_be_bytes());
            s = "";
            i += 4;
            break;
        }
        ip[i] = (acc >> 8) as u8;
        ip[i + 1] = acc as u8;
        i += 2;
        s = &s[off..];
        if s.is_empty() {
            break;
        }
        if !s.starts_with(':') {
            return Err(addr_err(input, "unexpected character, want colon"));
        }
        if s.len() == 1 {
            return Err(addr_err(input, "colon must be followed by more characters"));
        }
        s = &s[1..];
        if let Some(rest) = s.strip_prefix(':') {
            if ellipsis.is_some() {
                return Err(addr_err(input, "multiple :: in address"));
            }
            ellipsis = Some(i);
            s = rest;
            if s.is_empty() {
                break;
            }
        }
    }
    if !s.is_empty() {
        return Err(addr_err(input, "trailing garbage after address"));
    }
    if i < 16 {
        let Some(e) = ellipsis else {
            return Err(addr_err(input, "address string too short"));
        };
        let n = 16 - i;
        ip.copy_within(e..i, e + n);
        ip[e..e + n].fill(0);
    } else if ellipsis.is_some() {
        return Err(addr_err(
            input,
            "the :: must expand to at least one field of zeros",
        ));
    }
    Ok((u128::from_be_bytes(ip), zoned))
}

/// Go's `netip.ParseAddr`; returns the address and whether it had a zone.
fn parse_go_addr(s: &str) -> Result<(Addr, bool), IpError> {
    for c in s.bytes() {
        match c {
            b'.' => return parse_v4(s, s).map(|a| (Addr::V4(a), false)),
            b':' => return parse_v6(s).map(|(a, z)| (Addr::V6(a), z)),
            b'%' => return Err(addr_err(s, "missing IPv6 address")),
            _ => {}
        }
    }
    Err(addr_err(s, "unable to parse IP"))
}

/// Whether `net/url` accepts `s` as the inside of a bracketed host: `netip.ParseAddr`
/// succeeds (zones allowed) and the address is not IPv4.
pub(crate) fn is_go_ipv6_literal(s: &str) -> Option<bool> {
    parse_go_addr(s).ok().map(|(a, _)| matches!(a, Addr::V6(_)))
}

impl Addr {
    /// Parses an address as the Kubernetes `ip()` function does (`parseIPAddr`).
    ///
    /// # Errors
    /// [`IpError::Addr`] for text `netip.ParseAddr` rejects, [`IpError::Zone`] for a zone,
    /// [`IpError::Mapped`] for an IPv4-mapped IPv6 address.
    pub fn parse(s: &str) -> Result<Addr, IpError> {
        let (a, zoned) = parse_go_addr(s)?;
        if zoned {
            return Err(IpError::Zone(s.to_string()));
        }
        if a.is_4in6() {
            return Err(IpError::Mapped(s.to_string()));
        }
        Ok(a)
    }

    fn is_4in6(self) -> bool {
        matches!(self, Addr::V6(v) if v >> 32 == 0xffff)
    }

    /// 4 or 6.
    pub fn family(self) -> i64 {
        match self {
            Addr::V4(_) => 4,
            Addr::V6(_) => 6,
        }
    }

    /// `0.0.0.0` or `::`.
    pub fn is_unspecified(self) -> bool {
        matches!(self, Addr::V4(0) | Addr::V6(0))
    }

    /// `127.0.0.0/8` or `::1`.
    pub fn is_loopback(self) -> bool {
        match self {
            Addr::V4(v) => v >> 24 == 127,
            Addr::V6(v) => v == 1,
        }
    }

    fn is_multicast(self) -> bool {
        match self {
            Addr::V4(v) => v >> 28 == 0xe,
            Addr::V6(v) => v >> 120 == 0xff,
        }
    }

    /// `224.0.0.0/24` or `ff02::/16`.
    pub fn is_link_local_multicast(self) -> bool {
        match self {
            Addr::V4(v) => v >> 8 == 0xe0_00_00,
            Addr::V6(v) => v >> 112 == 0xff02,
        }
    }

    /// `169.254.0.0/16` or `fe80::/10`.
    pub fn is_link_local_unicast(self) -> bool {
        match self {
            Addr::V4(v) => v >> 16 == 0xa9fe,
            Addr::V6(v) => v >> 118 == 0xfe80 >> 6,
        }
    }

    /// Go's `IsGlobalUnicast`: not unspecified, broadcast, loopback, multicast or link-local
    /// unicast (private and ULA addresses count as global).
    pub fn is_global_unicast(self) -> bool {
        if self == Addr::V4(u32::MAX) {
            return false;
        }
        !self.is_unspecified()
            && !self.is_loopback()
            && !self.is_multicast()
            && !self.is_link_local_unicast()
    }

    fn bit_len(self) -> u8 {
        match self {
            Addr::V4(_) => 32,
            Addr::V6(_) => 128,
        }
    }

    /// The address with all but the first `bits` bits cleared.
    fn masked(self, bits: u8) -> Addr {
        match self {
            Addr::V4(v) => Addr::V4(v & u32::MAX.checked_shl(32 - u32::from(bits)).unwrap_or(0)),
            Addr::V6(v) => Addr::V6(v & u128::MAX.checked_shl(128 - u32::from(bits)).unwrap_or(0)),
        }
    }
}

impl fmt::Display for Addr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Addr::V4(v) => {
                let b = v.to_be_bytes();
                write!(f, "{}.{}.{}.{}", b[0], b[1], b[2], b[3])
            }
            Addr::V6(v) if v >> 32 == 0xffff => {
                write!(f, "::ffff:{}", Addr::V4(v as u32))
            }
            Addr::V6(v) => {
                let groups: Vec<u16> = (0..8).map(|i| (v >> (112 - 16 * i)) as u16).collect();
                // The first longest run of at least two zero groups.
                let (mut best, mut best_len) = (8usize, 0usize);
                let mut i = 0;
                while i < 8 {
                    let start = i;
                    while i < 8 && groups[i] == 0 {
                        i += 1;
                    }
                    if i - start > best_len && i - start >= 2 {
                        best = start;
                        best_len = i - start;
                    }
                    i += 1;
                }
                let mut i = 0;
                while i < 8 {
                    if i == best {
                        f.write_str("::")?;
                        i += best_len;
                        continue;
                    }
                    if i > 0 && i != best + best_len {
                        f.write_str(":")?;
                    }
                    write!(f, "{:x}", groups[i])?;
                    i += 1;
                }
                Ok(())
            }
        }
    }
}

fn prefix_err(input: &str, reason: &'static str) -> IpError {
    IpError::Prefix {
        input: input.to_string(),
        reason,
    }
}

impl Prefix {
    /// Parses a CIDR as the Kubernetes `cidr()` function does (`parseCIDR` over
    /// `netip.ParsePrefix`): the prefix length is decimal without sign or leading zeros.
    ///
    /// # Errors
    /// [`IpError::Prefix`] for text `netip.ParsePrefix` rejects (including zones),
    /// [`IpError::Mapped`] for an IPv4-mapped IPv6 address.
    pub fn parse(s: &str) -> Result<Prefix, IpError> {
        let Some((a, bits)) = s.rsplit_once('/') else {
            return Err(prefix_err(s, "no '/'"));
        };
        let (addr, zoned) = parse_go_addr(a).map_err(|e| match e {
            IpError::Addr { reason, .. } => prefix_err(s, reason),
            other => other,
        })?;
        if zoned {
            return Err(prefix_err(s, "IPv6 zones cannot be present in a prefix"));
        }
        let b = bits.as_bytes();
        if b.len() > 1 && !(b'1'..=b'9').contains(&b[0]) {
            return Err(prefix_err(s, "bad bits after slash"));
        }
        if b.is_empty() || !b.iter().all(u8::is_ascii_digit) {
            return Err(prefix_err(s, "bad bits after slash"));
        }
        let bits = match bits.parse::<u32>() {
            Ok(n) if n <= u32::from(addr.bit_len()) => n as u8,
            _ => return Err(prefix_err(s, "prefix length out of range")),
        };
        if addr.is_4in6() {
            return Err(IpError::Mapped(s.to_string()));
        }
        Ok(Prefix { addr, bits })
    }

    /// The prefix with host bits cleared (Go `Prefix.Masked`).
    pub fn masked(self) -> Prefix {
        Prefix {
            addr: self.addr.masked(self.bits),
            bits: self.bits,
        }
    }

    /// Whether `ip` is inside the prefix; false across families (Go `Prefix.Contains`).
    pub fn contains(self, ip: Addr) -> bool {
        ip.bit_len() == self.addr.bit_len() && ip.masked(self.bits) == self.addr.masked(self.bits)
    }

    /// Whether `other` lies entirely within this prefix: the libraries' `Overlaps` and
    /// `bits <= other.bits`.
    pub fn contains_prefix(self, other: Prefix) -> bool {
        other.addr.bit_len() == self.addr.bit_len()
            && self.bits <= other.bits
            && other.addr.masked(self.bits) == self.addr.masked(self.bits)
    }
}

impl fmt::Display for Prefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.bits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip_in_canonical_form() {
        for (input, want) in [
            ("127.0.0.1", "127.0.0.1"),
            ("2001:DB8::1", "2001:db8::1"),
            ("2001:db8:0:0:1:0:0:1", "2001:db8::1:0:0:1"),
            ("::", "::"),
            ("::1.2.3.4", "::102:304"),
            ("1:0:0:2:0:0:0:3", "1:0:0:2::3"),
            ("1:2:3:4:5:6:7:0", "1:2:3:4:5:6:7:0"),
        ] {
            assert_eq!(Addr::parse(input).unwrap().to_string(), want, "{input}");
        }
    }

    #[test]
    fn leading_zeros_zones_and_mapped_addresses_are_rejected() {
        for bad in [
            "010.0.0.1",
            "fe80::1%eth0",
            "::ffff:1.2.3.4",
            "1.2.3",
            "1::2::3",
            "",
            "1:2:3:4:5:6:7:8:9",
            "::1:2:3:4:5:6:7:8",
        ] {
            assert!(Addr::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn prefixes_parse_mask_and_contain() {
        let p = Prefix::parse("10.1.2.3/8").unwrap();
        assert_eq!(p.masked().to_string(), "10.0.0.0/8");
        assert!(p.contains(Addr::parse("10.200.0.1").unwrap()));
        assert!(!p.contains(Addr::parse("::a01:203").unwrap()));
        assert!(p.contains_prefix(Prefix::parse("10.2.0.0/16").unwrap()));
        assert!(!p.contains_prefix(Prefix::parse("10.0.0.0/7").unwrap()));
        for bad in [
            "10.0.0.0/08",
            "10.0.0.0/33",
            "10.0.0.0/+8",
            "10.0.0.0",
            "::/129",
        ] {
            assert!(Prefix::parse(bad).is_err(), "{bad}");
        }
    }
}
