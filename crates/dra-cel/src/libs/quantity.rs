//! Kubernetes resource quantities (`k8s.io/apimachinery/pkg/api/resource`, `ParseQuantity`), as
//! the CEL quantity library (`k8s.io/apiserver/pkg/cel/library/quantity.go`) sees them.
//!
//! A quantity is `mantissa * 10^exponent`, rounded away from zero to nano units like upstream.
//! Values beyond an `i128` mantissa are rejected rather than kept as big decimals.

use std::cmp::Ordering;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A parsed quantity.
#[derive(Clone, Debug)]
pub struct Quantity {
    mantissa: i128,
    exponent: i32,
    /// The text it was parsed from, when parsed.
    text: Option<Box<str>>,
    /// Result of `add`/`sub`: upstream returns a pointer there, which `==` on the left-hand
    /// side of a plain quantity does not accept (a "no such overload" error).
    pub(crate) boxed: bool,
}

/// Why a string is not a quantity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    /// The text does not have the quantity shape.
    #[error(
        "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
    )]
    Format,
    /// The suffix is unknown.
    #[error("unable to parse quantity's suffix")]
    Suffix,
    /// The number does not fit what we represent.
    #[error("unable to parse quantity's numeric value")]
    Numeric,
    /// Arithmetic overflowed.
    #[error("quantity arithmetic overflow")]
    Overflow,
}

const NANO: i32 = -9;

fn pow10(n: u32) -> Option<i128> {
    10i128.checked_pow(n)
}

struct Parts<'a> {
    positive: bool,
    num: &'a str,
    denom: &'a str,
    suffix: &'a str,
}

fn split(s: &str) -> Result<Parts<'_>, QuantityError> {
    let b = s.as_bytes();
    let end = b.len();
    let mut pos = 0;
    let mut positive = true;
    if pos < end {
        match b[0] {
            b'-' => {
                positive = false;
                pos += 1;
            }
            b'+' => pos += 1,
            _ => {}
        }
    }
    while pos < end && b[pos] == b'0' {
        pos += 1;
    }
    if pos >= end {
        return Ok(Parts {
            positive,
            num: "0",
            denom: "",
            suffix: "",
        });
    }
    let num_start = pos;
    while pos < end && b[pos].is_ascii_digit() {
        pos += 1;
    }
    let mut num = &s[num_start..pos];
    if num.is_empty() {
        num = "0";
    }
    let mut denom = "";
    if pos < end && b[pos] == b'.' {
        pos += 1;
        let d = pos;
        while pos < end && b[pos].is_ascii_digit() {
            pos += 1;
        }
        denom = &s[d..pos];
    }
    let suffix_start = pos;
    while pos < end && b"eEinumkKMGTP".contains(&b[pos]) {
        pos += 1;
    }
    if pos < end && (b[pos] == b'-' || b[pos] == b'+') {
        pos += 1;
    }
    while pos < end && b[pos].is_ascii_digit() {
        pos += 1;
    }
    if pos < end {
        return Err(QuantityError::Format);
    }
    Ok(Parts {
        positive,
        num,
        denom,
        suffix: &s[suffix_start..],
    })
}

enum Base {
    Ten,
    Two,
}

fn suffix(s: &str) -> Option<(Base, i32)> {
    let dec = match s {
        "n" => Some(-9),
        "u" => Some(-6),
        "m" => Some(-3),
        "" => Some(0),
        "k" => Some(3),
        "M" => Some(6),
        "G" => Some(9),
        "T" => Some(12),
        "P" => Some(15),
        "E" => Some(18),
        _ => None,
    };
    if let Some(e) = dec {
        return Some((Base::Ten, e));
    }
    let bin = match s {
        "Ki" => Some(10),
        "Mi" => Some(20),
        "Gi" => Some(30),
        "Ti" => Some(40),
        "Pi" => Some(50),
        "Ei" => Some(60),
        _ => None,
    };
    if let Some(e) = bin {
        return Some((Base::Two, e));
    }
    if s.len() > 1 && (s.starts_with('e') || s.starts_with('E')) {
        let e: i64 = s[1..].parse().ok()?;
        // Upstream truncates the parsed int64 exponent to int32.
        return Some((Base::Ten, e as i32));
    }
    None
}

impl Quantity {
    /// Parses a quantity like `ParseQuantity`: `80Gi`, `1.5`, `100m`, `1e3`.
    ///
    /// # Errors
    /// [`QuantityError`] for malformed text, an unknown suffix, or a value we cannot represent.
    pub fn parse(s: &str) -> Result<Quantity, QuantityError> {
        if s.is_empty() {
            return Err(QuantityError::Format);
        }
        let p = split(s)?;
        let (base, exp) = suffix(p.suffix).ok_or(QuantityError::Suffix)?;
        let digits = format!("{}{}", p.num, p.denom);
        let mut m: i128 = digits.parse().map_err(|_| QuantityError::Numeric)?;
        let denom_len = i32::try_from(p.denom.len()).map_err(|_| QuantityError::Numeric)?;
        let mut e: i64 = -i64::from(denom_len);
        let binary = matches!(base, Base::Two);
        match base {
            Base::Ten => e += i64::from(exp),
            Base::Two => {
                m = m.checked_mul(1i128 << exp).ok_or(QuantityError::Numeric)?;
            }
        }
        // Round away from zero to nano units.
        if e < i64::from(NANO) {
            let shift = u32::try_from(i64::from(NANO) - e).unwrap_or(u32::MAX);
            match pow10(shift) {
                Some(div) => {
                    let q = m / div;
                    m = if m % div != 0 { q + 1 } else { q };
                }
                None => m = i128::from(m != 0),
            }
            e = i64::from(NANO);
        }
        if binary {
            // BinarySI is capped at the largest int64.
            let max = i128::from(i64::MAX);
            if e >= 0 {
                let scaled =
                    pow10(u32::try_from(e).unwrap_or(u32::MAX)).and_then(|f| m.checked_mul(f));
                if scaled.is_none_or(|v| v > max) {
                    m = max;
                    e = 0;
                }
            }
        }
        if !p.positive {
            m = -m;
        }
        let exponent = i32::try_from(e).map_err(|_| QuantityError::Numeric)?;
        Ok(Quantity {
            mantissa: m,
            exponent,
            text: Some(s.into()),
            boxed: false,
        })
    }

    /// A quantity from an integer (`resource.NewQuantity`).
    pub fn from_int(v: i64) -> Quantity {
        Quantity {
            mantissa: i128::from(v),
            exponent: 0,
            text: None,
            boxed: false,
        }
    }

    /// -1, 0 or 1.
    pub fn sign(&self) -> i64 {
        match self.mantissa.cmp(&0) {
            Ordering::Less => -1,
            Ordering::Equal => 0,
            Ordering::Greater => 1,
        }
    }

    fn normalized(&self) -> (i128, i64) {
        let (mut m, mut e) = (self.mantissa, i64::from(self.exponent));
        if m == 0 {
            return (0, 0);
        }
        while m % 10 == 0 {
            m /= 10;
            e += 1;
        }
        (m, e)
    }

    /// The value as an int64 when it is an integer that fits (`Quantity.AsInt64`).
    pub fn as_i64(&self) -> Option<i64> {
        let (m, e) = self.normalized();
        if e < 0 {
            return None;
        }
        let f = pow10(u32::try_from(e).ok()?)?;
        i64::try_from(m.checked_mul(f)?).ok()
    }

    /// The value as a double, computed like `Quantity.AsApproximateFloat64`.
    pub fn as_f64(&self) -> f64 {
        let base = self.mantissa as f64;
        let e = self.exponent;
        if e == 0 {
            return base;
        }
        base * 10f64.powi(e)
    }

    fn add_impl(&self, other: &Quantity, negate: bool) -> Result<Quantity, QuantityError> {
        let e = self.exponent.min(other.exponent);
        let scale = |q: &Quantity| -> Option<i128> {
            let shift = u32::try_from(q.exponent - e).ok()?;
            q.mantissa.checked_mul(pow10(shift)?)
        };
        let a = scale(self).ok_or(QuantityError::Overflow)?;
        let mut b = scale(other).ok_or(QuantityError::Overflow)?;
        if negate {
            b = b.checked_neg().ok_or(QuantityError::Overflow)?;
        }
        Ok(Quantity {
            mantissa: a.checked_add(b).ok_or(QuantityError::Overflow)?,
            exponent: e,
            text: None,
            boxed: true,
        })
    }

    /// `self + other`.
    ///
    /// # Errors
    /// [`QuantityError::Overflow`] beyond the representable range.
    pub fn add(&self, other: &Quantity) -> Result<Quantity, QuantityError> {
        self.add_impl(other, false)
    }

    /// `self - other`.
    ///
    /// # Errors
    /// [`QuantityError::Overflow`] beyond the representable range.
    pub fn sub(&self, other: &Quantity) -> Result<Quantity, QuantityError> {
        self.add_impl(other, true)
    }

    /// Numeric comparison (`Quantity.Cmp`).
    pub fn compare(&self, other: &Quantity) -> Ordering {
        let (s1, s2) = (self.sign(), other.sign());
        if s1 != s2 || s1 == 0 {
            return s1.cmp(&s2);
        }
        let (m1, e1) = self.normalized();
        let (m2, e2) = other.normalized();
        let d1 = m1.unsigned_abs().to_string();
        let d2 = m2.unsigned_abs().to_string();
        let p1 = d1.len() as i64 + e1;
        let p2 = d2.len() as i64 + e2;
        let mag = p1.cmp(&p2).then_with(|| {
            let n = d1.len().max(d2.len());
            format!("{d1:0<n$}").cmp(&format!("{d2:0<n$}"))
        });
        if s1 < 0 { mag.reverse() } else { mag }
    }
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.text {
            Some(t) => f.write_str(t),
            None => write!(f, "{}e{}", self.mantissa, self.exponent),
        }
    }
}

impl Serialize for Quantity {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Quantity {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Quantity::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_and_decimal_suffixes_compare_numerically() {
        let gi = Quantity::parse("1Gi").unwrap();
        let g = Quantity::parse("1G").unwrap();
        assert_eq!(gi.compare(&g), Ordering::Greater);
        assert_eq!(
            Quantity::parse("1000m")
                .unwrap()
                .compare(&Quantity::parse("1").unwrap()),
            Ordering::Equal
        );
        assert_eq!(Quantity::parse("1k").unwrap().as_i64(), Some(1000));
    }

    #[test]
    fn malformed_text_and_unknown_suffixes_are_errors() {
        assert_eq!(Quantity::parse("10Mo").unwrap_err(), QuantityError::Format);
        assert_eq!(Quantity::parse("10Q").unwrap_err(), QuantityError::Format);
        assert_eq!(Quantity::parse("10ki").unwrap_err(), QuantityError::Suffix);
        assert_eq!(Quantity::parse("").unwrap_err(), QuantityError::Format);
    }

    #[test]
    fn sub_nano_values_round_away_from_zero() {
        let q = Quantity::parse("0.1n").unwrap();
        assert_eq!(q.compare(&Quantity::parse("1n").unwrap()), Ordering::Equal);
    }
}
