//! Kubernetes quantities as the allocator's Go code sees them (`k8s.io/apimachinery/pkg/api/resource`
//! v0.36): the exact value for arithmetic, plus the parts of the Go struct that change answers.
//!
//! Two of those parts matter to the allocator beyond the number itself:
//! - the text the consumed capacity of a result is written as: the string a quantity was parsed
//!   from when upstream caches it (`ParseQuantity` keeps it only for canonical input), otherwise
//!   `CanonicalizeBytes` of its value in its format;
//! - Go's `==` on two `resource.Quantity` structs, which `violatesPolicy`
//!   (`structured/internal/incubating/consumable_capacity.go`) uses to compare a consumed amount
//!   with the request policy's default: true only for two `int64Amount` forms with the same
//!   value, scale, format and cached string.
//!
//! Sums and comparisons use `dra_cel`'s quantity, which mirrors upstream's exact arithmetic.

use std::cmp::Ordering;
use std::fmt;
use std::sync::Arc;

pub(crate) use dra_cel::libs::quantity::Quantity as Exact;

pub(crate) use dra_cel::libs::quantity::Format;
use dra_cel::libs::quantity::{interpret, split};

/// Why a quantity string could not be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct QuantityError(String);

/// A quantity with its upstream form (see the module docs).
#[derive(Clone, Debug)]
pub struct Quantity {
    exact: Exact,
    /// `int64Amount{value, scale}` when upstream holds it that way, `None` for `inf.Dec`.
    int_form: Option<(i64, i32)>,
    format: Format,
    /// Upstream's cached string `s`.
    cached: Option<Arc<str>>,
    /// The value as sign, decimal digits (no leading zeros, "0" for zero) and a power of ten.
    negative: bool,
    digits: Arc<str>,
    exponent: i64,
}

/// Strips leading zeros; "0" for none left.
fn trim_digits(d: &str) -> &str {
    let t = d.trim_start_matches('0');
    if t.is_empty() { "0" } else { t }
}

/// Multiplies a decimal digit string by a small factor.
fn mul_small(digits: &str, factor: u64) -> String {
    let mut out: Vec<u8> = Vec::with_capacity(digits.len() + 20);
    let mut carry: u128 = 0;
    for c in digits.bytes().rev() {
        let v = u128::from(c.saturating_sub(b'0')) * u128::from(factor) + carry;
        out.push(b'0' + (v % 10) as u8);
        carry = v / 10;
    }
    while carry > 0 {
        out.push(b'0' + (carry % 10) as u8);
        carry /= 10;
    }
    out.reverse();
    let s = String::from_utf8(out).unwrap_or_default();
    trim_digits(&s).to_string()
}

/// Divides a decimal digit string by a small divisor: (quotient, remainder).
fn divmod_small(digits: &str, divisor: u64) -> (String, u64) {
    let mut out = String::with_capacity(digits.len());
    let mut rem: u128 = 0;
    let d = u128::from(divisor.max(1));
    for c in digits.bytes() {
        let v = rem * 10 + u128::from(c.saturating_sub(b'0'));
        out.push(char::from(b'0' + (v / d) as u8));
        rem = v % d;
    }
    (trim_digits(&out).to_string(), rem as u64)
}

/// Compares two digit strings without leading zeros.
fn cmp_digits(a: &str, b: &str) -> Ordering {
    a.len().cmp(&b.len()).then_with(|| a.cmp(b))
}

/// Adds one to a digit string.
fn plus_one(digits: &str) -> String {
    let mut out: Vec<u8> = digits.bytes().collect();
    let mut i = out.len();
    loop {
        if i == 0 {
            out.insert(0, b'1');
            break;
        }
        i -= 1;
        match out.get_mut(i) {
            Some(c) if *c == b'9' => *c = b'0',
            Some(c) => {
                *c += 1;
                break;
            }
            None => break,
        }
    }
    String::from_utf8(out).unwrap_or_default()
}

const MAX_INT64_DIGITS: &str = "9223372036854775807";

impl Quantity {
    /// Parses like `ParseQuantity` (leading and trailing spaces trimmed as `UnmarshalJSON` does).
    ///
    /// # Errors
    /// [`QuantityError`] with upstream's message for text that is not a quantity, or when the
    /// number is too large to handle.
    pub fn parse(text: &str) -> Result<Quantity, QuantityError> {
        let s = text.trim();
        let exact = Exact::parse(s).map_err(|e| QuantityError(e.to_string()))?;
        if s == "0" {
            return Ok(Quantity {
                exact,
                int_form: Some((0, 0)),
                format: Format::DecimalSi,
                cached: Some(Arc::from("0")),
                negative: false,
                digits: Arc::from("0"),
                exponent: 0,
            });
        }
        let p = split(s).map_err(|e| QuantityError(e.to_string()))?;
        let (base, exponent, mut format) = interpret(p.suffix)
            .ok_or_else(|| QuantityError("unable to parse quantity's suffix".into()))?;
        let num_len = p.num.len() as i64;
        let denom_len = p.denom.len() as i64;
        // The int64 fast path.
        let (precision, scale0, mantissa): (i64, i64, i64) = match format {
            Format::DecimalExponent | Format::DecimalSi => {
                (18 - (num_len + denom_len), i64::from(exponent), 1)
            }
            Format::BinarySi => {
                if exponent >= 0 && p.denom.is_empty() {
                    let prec = 15 - num_len - i64::from(exponent) * 3 / 10 - 1;
                    (prec, 0, 1i64.checked_shl(exponent as u32).unwrap_or(0))
                } else {
                    (-1, 0, 1)
                }
            }
        };
        if precision >= 0 {
            let scale = scale0 - denom_len;
            if scale >= -9 {
                let shifted = format!("{}{}", p.num, p.denom);
                let value: i64 = shifted.parse().map_err(|_| {
                    QuantityError("unable to parse numeric part of quantity".into())
                })?;
                if let Some(result) = value.checked_mul(mantissa) {
                    let result = if p.positive { result } else { -result };
                    let canonical = match format {
                        Format::BinarySi => exponent % 10 == 0 && (value & 0x07) != 0,
                        _ => {
                            scale % 3 == 0 && !shifted.ends_with("000") && !shifted.starts_with('0')
                        }
                    };
                    let scale = scale as i32;
                    return Ok(Quantity {
                        exact,
                        int_form: Some((result, scale)),
                        format,
                        cached: canonical.then(|| Arc::from(s)),
                        negative: result < 0,
                        digits: Arc::from(result.unsigned_abs().to_string()),
                        exponent: i64::from(scale),
                    });
                }
            }
        }
        // The inf.Dec path.
        let mut digits = trim_digits(&format!("{}{}", p.num, p.denom)).to_string();
        let mut exp = -denom_len;
        if base == 10 {
            exp += i64::from(exponent);
        } else {
            if digits.len() > 10_000 {
                return Err(QuantityError("quantity has too many digits".into()));
            }
            for _ in 0..exponent.max(0) {
                digits = mul_small(&digits, 2);
            }
        }
        if digits.len() > 10_000 {
            return Err(QuantityError("quantity has too many digits".into()));
        }
        let zero = digits == "0";
        if !zero && exp < -9 {
            // Round away from zero to nanos.
            let cut = usize::try_from(-9 - exp).unwrap_or(usize::MAX);
            if cut >= digits.len() {
                digits = "1".into();
            } else {
                let keep = digits.len() - cut;
                let (head, tail) = digits.split_at(keep);
                let nonzero = tail.bytes().any(|c| c != b'0');
                digits = if nonzero {
                    plus_one(head)
                } else {
                    head.to_string()
                };
            }
            exp = -9;
        }
        // Normalize trailing zeros into the exponent.
        let trimmed = digits.trim_end_matches('0');
        if !zero && trimmed.len() < digits.len() {
            exp += (digits.len() - trimmed.len()) as i64;
            digits = trimmed.to_string();
        }
        if format == Format::BinarySi {
            // Cap at the largest int64, and small values print as DecimalSI.
            let integer = integer_digits(&digits, exp);
            let above_max = match &integer {
                Some((whole, frac)) => {
                    cmp_digits(whole, MAX_INT64_DIGITS) == Ordering::Greater
                        || (cmp_digits(whole, MAX_INT64_DIGITS) == Ordering::Equal && *frac)
                }
                None => true,
            };
            if above_max {
                digits = MAX_INT64_DIGITS.into();
                exp = 0;
            } else if !zero && integer.is_some_and(|(whole, _)| whole == "0") {
                format = Format::DecimalSi;
            }
        }
        Ok(Quantity {
            exact,
            int_form: None,
            format,
            cached: None,
            negative: !p.positive && !zero,
            digits: Arc::from(digits),
            exponent: exp,
        })
    }

    /// `resource.NewQuantity(value, BinarySI)`.
    pub(crate) fn new_binary(value: i64) -> Quantity {
        Quantity {
            exact: Exact::from_int(value),
            int_form: Some((value, 0)),
            format: Format::BinarySi,
            cached: None,
            negative: value < 0,
            digits: Arc::from(value.unsigned_abs().to_string()),
            exponent: 0,
        }
    }

    /// The exact value for arithmetic.
    pub(crate) fn exact(&self) -> &Exact {
        &self.exact
    }

    /// Exact numeric comparison (`Quantity.Cmp`).
    pub fn cmp_value(&self, other: &Quantity) -> Ordering {
        self.exact.compare(&other.exact)
    }

    /// Go's `==` on the two structs (see the module docs).
    pub(crate) fn go_struct_eq(&self, other: &Quantity) -> bool {
        match (self.int_form, other.int_form) {
            (Some(a), Some(b)) => {
                a == b && self.format == other.format && self.cached == other.cached
            }
            _ => false,
        }
    }

    /// `Quantity.Value()`: the value rounded up to an integer, as upstream computes it for
    /// values that fit an int64 (0 where upstream's int64 scaling overflows).
    pub(crate) fn value_i64(&self) -> i64 {
        if let Some((value, scale)) = self.int_form {
            if scale >= 0 {
                let mut v = value;
                for _ in 0..scale {
                    match v.checked_mul(10) {
                        Some(n) => v = n,
                        None => return 0,
                    }
                }
                return v;
            }
            // negativeScaleInt64: rounds away from zero.
            let mut v = value;
            let mut fraction = false;
            for _ in 0..scale.unsigned_abs() {
                if !fraction && v % 10 != 0 {
                    fraction = true;
                }
                v /= 10;
                if v == 0 {
                    if fraction {
                        return if value > 0 { 1 } else { -1 };
                    }
                    return 0;
                }
            }
            if fraction {
                v = if value > 0 { v + 1 } else { v - 1 };
            }
            return v;
        }
        let Some((whole, frac)) = integer_digits(&self.digits, self.exponent) else {
            return 0;
        };
        let magnitude: i128 = whole.parse::<u64>().map_or(0, i128::from);
        let v = if self.negative {
            // Upstream truncates toward zero and then adds one.
            -magnitude + i128::from(frac)
        } else {
            magnitude + i128::from(frac)
        };
        v as i64
    }

    /// The string upstream writes for this quantity (`Quantity.String`, `MarshalJSON`).
    pub fn to_go_string(&self) -> String {
        if let Some(s) = &self.cached {
            return s.to_string();
        }
        if self.digits.as_ref() == "0" {
            return "0".into();
        }
        let sign = if self.negative { "-" } else { "" };
        let mut format = self.format;
        if format == Format::BinarySi {
            let small = self.cmp_value(&Quantity::new_binary(-1024)) == Ordering::Greater
                && self.cmp_value(&Quantity::new_binary(1024)) == Ordering::Less;
            if small {
                format = Format::DecimalSi;
            } else {
                match integer_digits(&self.digits, self.exponent) {
                    Some((whole, false)) => {
                        let mut amount = whole;
                        let mut times = 0i64;
                        loop {
                            let (q, r) = divmod_small(&amount, 1024);
                            if r != 0 || amount == "0" {
                                break;
                            }
                            amount = q;
                            times += 1;
                        }
                        let suffix = match times {
                            1 => "Ki",
                            2 => "Mi",
                            3 => "Gi",
                            4 => "Ti",
                            5 => "Pi",
                            6 => "Ei",
                            _ => "",
                        };
                        return format!("{sign}{amount}{suffix}");
                    }
                    _ => format = Format::DecimalSi,
                }
            }
        }
        // AsCanonicalBytes: factors of ten into the exponent, exponent a multiple of three.
        let trimmed = self.digits.trim_end_matches('0');
        let mut number = trimmed.to_string();
        let mut exponent = self.exponent + (self.digits.len() - trimmed.len()) as i64;
        while exponent % 3 != 0 {
            number.push('0');
            exponent -= 1;
        }
        let suffix = match format {
            Format::DecimalExponent => {
                if exponent == 0 {
                    String::new()
                } else {
                    format!("e{exponent}")
                }
            }
            _ => match exponent {
                -9 => "n".into(),
                -6 => "u".into(),
                -3 => "m".into(),
                3 => "k".into(),
                6 => "M".into(),
                9 => "G".into(),
                12 => "T".into(),
                15 => "P".into(),
                18 => "E".into(),
                _ => String::new(),
            },
        };
        format!("{sign}{number}{suffix}")
    }

    /// The quantity as k8s-openapi carries it.
    pub(crate) fn to_api(&self) -> k8s_openapi::apimachinery::pkg::api::resource::Quantity {
        k8s_openapi::apimachinery::pkg::api::resource::Quantity(self.to_go_string())
    }
}

/// The integer part of `digits × 10^exponent` and whether a fraction was cut off; `None` when
/// the integer would be unreasonably long.
fn integer_digits(digits: &str, exponent: i64) -> Option<(String, bool)> {
    if exponent >= 0 {
        let zeros = usize::try_from(exponent).ok()?;
        if zeros > 10_000 {
            return None;
        }
        let mut s = digits.to_string();
        if s != "0" {
            s.extend(std::iter::repeat_n('0', zeros));
        }
        return Some((s, false));
    }
    let cut = usize::try_from(-exponent).ok()?;
    if cut >= digits.len() {
        return Some(("0".into(), digits != "0"));
    }
    let (head, tail) = digits.split_at(digits.len() - cut);
    Some((
        trim_digits(head).to_string(),
        tail.bytes().any(|c| c != b'0'),
    ))
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_go_string())
    }
}

/// A quantity above any capacity or counter a slice can publish (9 * 10^2147483647, the largest
/// exponent a quantity has), for sums that exact arithmetic cannot hold.
fn saturated() -> Exact {
    Exact::parse("9e2147483647").unwrap_or_else(|_| Exact::from_int(i64::MAX))
}

/// Sums of quantities (`ConsumedCapacity`, counters): exact values only. Where the exact sum
/// is beyond what the arithmetic holds (more than 10,000 digits: `1e20000` + `1`, which a
/// tenant's request may carry), the sum is taken as larger than any capacity, so the device
/// does not fit: never the first operand, which would under-count what is consumed.
pub(crate) fn add(a: &Exact, b: &Exact) -> Exact {
    a.add(b).unwrap_or_else(|_| saturated())
}

/// `a - b` for what is left of `a` (a counter's or capacity's availability): where the
/// arithmetic cannot hold it, nothing is left (zero), never `a`.
pub(crate) fn sub_left(a: &Exact, b: &Exact) -> Exact {
    a.sub(b).unwrap_or_else(|_| zero())
}

/// `a - b` for what is still consumed after releasing `b` from `a`: where the arithmetic cannot
/// hold it, `a` stays consumed (over-counted, never under).
pub(crate) fn sub_released(a: &Exact, b: &Exact) -> Exact {
    a.sub(b).unwrap_or_else(|_| a.clone())
}

/// Zero.
pub(crate) fn zero() -> Exact {
    Exact::from_int(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(s: &str) -> String {
        Quantity::parse(s).unwrap().to_go_string()
    }

    #[test]
    fn canonical_strings_match_upstream() {
        for (input, want) in [
            ("0", "0"),
            ("00", "0"),
            ("1Gi", "1Gi"),
            ("1024Mi", "1Gi"),
            ("8Ki", "8Ki"),
            ("1.5Gi", "1536Mi"),
            ("1000m", "1"),
            ("1500m", "1500m"),
            ("1e3", "1e3"),
            ("1000", "1k"),
            ("100", "100"),
            ("20Gi", "20Gi"),
            ("512", "512"),
            ("1e-10", "1e-9"),
            ("+1Gi", "+1Gi"),
            ("0.5Ki", "512"),
            ("1.5", "1500m"),
            ("80Gi", "80Gi"),
            ("12e1", "120"),
            ("1200", "1200"),
        ] {
            assert_eq!(canon(input), want, "{input}");
        }
        assert_eq!(Quantity::new_binary(5 * (1 << 30)).to_go_string(), "5Gi");
        assert_eq!(Quantity::new_binary(1000).to_go_string(), "1k");
    }

    #[test]
    fn struct_equality_follows_the_go_form() {
        let a = Quantity::parse("1Gi").unwrap();
        let b = Quantity::parse("1Gi").unwrap();
        let c = Quantity::parse("1024Mi").unwrap();
        assert!(a.go_struct_eq(&b));
        assert!(!a.go_struct_eq(&c), "different cached strings");
        assert!(
            !Quantity::parse("1.5Gi")
                .unwrap()
                .go_struct_eq(&Quantity::parse("1.5Gi").unwrap())
        );
        assert!(!Quantity::new_binary(1024).go_struct_eq(&Quantity::parse("8Ki").unwrap()));
        assert!(Quantity::new_binary(8192).go_struct_eq(&Quantity::parse("8Ki").unwrap()));
    }

    #[test]
    fn value_rounds_up() {
        assert_eq!(Quantity::parse("1500m").unwrap().value_i64(), 2);
        assert_eq!(Quantity::parse("1.5Gi").unwrap().value_i64(), 1610612736);
        assert_eq!(Quantity::parse("1e-10").unwrap().value_i64(), 1);
        assert_eq!(Quantity::parse("10Gi").unwrap().value_i64(), 10 << 30);
    }

    /// Issue 41, defect 12: a sum the arithmetic cannot hold used to be the first operand,
    /// under-counting what is consumed; it is now above any capacity.
    #[test]
    fn sums_beyond_the_arithmetic_never_under_count() {
        let big = Exact::parse("1e20000").unwrap();
        let one = Exact::from_int(1);
        assert!(big.add(&one).is_err(), "the case under test");
        let capacity = Exact::parse("80Gi").unwrap();
        let used = add(&Exact::parse("1Gi").unwrap(), &one);
        assert_eq!(used.compare(&capacity), Ordering::Less, "an ordinary sum");
        assert_eq!(add(&big, &one).compare(&big), Ordering::Greater);
        assert_eq!(add(&one, &big).compare(&capacity), Ordering::Greater);
        assert_eq!(sub_left(&big, &one).sign(), 0, "nothing left");
        assert_eq!(sub_released(&big, &one).compare(&big), Ordering::Equal);
    }

    #[test]
    fn bad_quantities_are_errors_not_panics() {
        for s in ["", "x", "1x", "1.2.3", "--1", "1e"] {
            assert!(Quantity::parse(s).is_err(), "{s}");
        }
        // Upstream reads a missing number as zero (`parseQuantityString`).
        assert_eq!(Quantity::parse("Gi").unwrap().to_go_string(), "0");
    }
}
