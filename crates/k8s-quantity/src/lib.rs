//! Kubernetes resource quantities (`k8s.io/apimachinery/pkg/api/resource`, v0.36): the one
//! quantity type of the workspace. The CEL library (`dra-cel`, as `dra_cel::libs::quantity`,
//! mirroring `k8s.io/apiserver/pkg/cel/library/quantity.go`), the allocator (capacities,
//! counters, request policies and the consumed capacity it writes) and the node side's
//! capacities (`gpu-inventory`) all use it.
//!
//! Upstream keeps a quantity in one of two forms, and several CEL functions answer from the
//! form rather than the value, so we keep the same two:
//! - `int64Amount` (`amount.go`): `value * 10^scale` with an `int64` value and an `int32` scale;
//! - `inf.Dec` (`gopkg.in/inf.v0`): `unscaled * 10^-scale` with a `big.Int` unscaled value.
//!
//! Which form a quantity has follows from how it was parsed ([`Quantity::parse`]) and computed
//! ([`Quantity::add`]). `isInteger()`/`asInteger()` are false/an error for every `inf.Dec`
//! (`quantity('1.5Gi')`, `quantity('1Pi')`) and for every `int64Amount` with a negative scale
//! (`quantity('1000m')`, `quantity('1.0')`); `asApproximateFloat()` rounds through the form's
//! own mantissa and exponent.
//!
//! Besides the amount, a [`Quantity`] keeps the rest of upstream's struct: its [`Format`] and
//! the text `ParseQuantity` caches (only canonical input). Both change what upstream writes
//! ([`Quantity::canonical_string`], `CanonicalizeBytes`) and what Go's `==` on two structs
//! answers ([`Quantity::go_struct_eq`]), which the allocator's consumed capacity depends on.
//!
//! A CEL value is upstream's `*resource.Quantity`, and upstream mutates what it points to:
//! `Cmp` turns its receiver into the `inf.Dec` form when either side is one, and `add`/`sub`
//! copy the struct but not the `inf.Dec` it points to, so adding to an `inf.Dec` quantity
//! changes that quantity too. `QuantityValue` mirrors that sharing within one evaluation.

mod canonical;
mod decimal;

use std::cmp::Ordering;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use self::decimal::{MAX_DIGITS, Magnitude};

/// Why a string is not a quantity, or why quantity arithmetic failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    /// The text does not have the quantity shape (`ErrFormatWrong`).
    #[error(
        "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
    )]
    Format,
    /// The suffix is unknown (`ErrSuffix`).
    #[error("unable to parse quantity's suffix")]
    Suffix,
    /// The number has no digits where upstream needs some (`ErrNumeric`).
    #[error("unable to parse numeric part of quantity")]
    Numeric,
    /// An exact sum would need more digits than we spell out (upstream has no limit).
    #[error("quantity {operation}: the exact result needs more than {limit} digits")]
    TooManyDigits {
        /// `add`, `sub` or `parse`.
        operation: &'static str,
        /// The limit: 10,000 digits.
        limit: u64,
    },
    /// Two scales are more than 2^31 - 1 apart where upstream subtracts them as `int32`: the
    /// difference wraps and the Go code panics (cel-go turns the panic into an internal error
    /// that ends the evaluation).
    #[error(
        "quantity {operation}: scales 10^{a} and 10^{b} are too far apart (upstream's int32 scale arithmetic wraps and panics)"
    )]
    ScalesTooFarApart {
        /// What was attempted (`comparison`, `parse`).
        operation: &'static str,
        /// One decimal exponent.
        a: i64,
        /// The other decimal exponent.
        b: i64,
    },
}

impl QuantityError {
    /// Whether upstream panics here rather than returning an error: cel-go recovers the panic
    /// as an internal error that no `&&`/`||` absorbs.
    pub fn is_upstream_panic(&self) -> bool {
        matches!(self, QuantityError::ScalesTooFarApart { .. })
    }
}

/// Nanos: the finest scale an `int64Amount` is parsed into, and what an `inf.Dec` is rounded to.
const NANO: i32 = -9;

/// `amount.go` `int64Amount`: `value * 10^scale`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Int64Amount {
    value: i64,
    scale: i32,
}

/// `math.go` `positiveScaleInt64`: `base * 10^scale`, `None` on overflow. A negative scale (only
/// reached through a wrapped `int32` difference) leaves `base` as it is, like upstream's loop
/// that does not run.
fn positive_scale_i64(base: i64, scale: i32) -> Option<i64> {
    if scale <= 0 || base == 0 {
        return Some(base);
    }
    base.checked_mul(10i64.checked_pow(scale.unsigned_abs())?)
}

/// `math.go` `negativeScaleInt64`: `base / 10^scale`, a fraction rounded away from zero.
fn negative_scale_i64(base: i64, scale: u32) -> i64 {
    let mut value = base;
    let mut fraction = false;
    for _ in 0..scale {
        fraction |= value % 10 != 0;
        value /= 10;
        if value == 0 {
            return match (fraction, base > 0) {
                (false, _) => 0,
                (true, true) => 1,
                (true, false) => -1,
            };
        }
    }
    match (fraction, base > 0) {
        (false, _) => value,
        (true, true) => value + 1,
        (true, false) => value - 1,
    }
}

impl Int64Amount {
    /// `int64Amount.AsInt64`: the scale must be zero or positive, and the result fit.
    fn as_int64(self) -> Option<i64> {
        match self.scale.cmp(&0) {
            Ordering::Equal => Some(self.value),
            Ordering::Less => None,
            Ordering::Greater => positive_scale_i64(self.value, self.scale),
        }
    }

    /// `int64Amount.Add`: `None` where upstream falls back to `inf.Dec` (an `int64` overflow).
    /// The scale difference is an `int32` subtraction that wraps like upstream's.
    fn add(self, b: Int64Amount) -> Option<Int64Amount> {
        if b.value == 0 {
            return Some(self);
        }
        if self.value == 0 {
            return Some(b);
        }
        match self.scale.cmp(&b.scale) {
            Ordering::Equal => Some(Int64Amount {
                value: self.value.checked_add(b.value)?,
                scale: self.scale,
            }),
            Ordering::Greater => {
                let c = positive_scale_i64(self.value, self.scale.wrapping_sub(b.scale))?;
                Some(Int64Amount {
                    value: c.checked_add(b.value)?,
                    scale: b.scale,
                })
            }
            Ordering::Less => {
                let c = positive_scale_i64(b.value, b.scale.wrapping_sub(self.scale))?;
                Some(Int64Amount {
                    value: self.value.checked_add(c)?,
                    scale: self.scale,
                })
            }
        }
    }

    /// `int64Amount.Sub`: `Add` of the negated value, negated as an `int64` (so the most
    /// negative value stays itself, as upstream's does).
    fn sub(self, b: Int64Amount) -> Option<Int64Amount> {
        self.add(Int64Amount {
            value: b.value.wrapping_neg(),
            scale: b.scale,
        })
    }

    /// `int64Amount.Cmp`: exact, except that scales more than 2^31 - 1 apart make upstream's
    /// `divideByScaleInt64` divide by zero (its `int32` difference wraps negative).
    fn cmp(self, b: Int64Amount) -> Result<Ordering, QuantityError> {
        let (hi, lo) = (self.scale.max(b.scale), self.scale.min(b.scale));
        if hi.wrapping_sub(lo) < 0 {
            return Err(QuantityError::ScalesTooFarApart {
                operation: "comparison",
                a: i64::from(self.scale),
                b: i64::from(b.scale),
            });
        }
        let diff = hi.abs_diff(lo);
        if diff <= 18 {
            // Both sides fit an i128 once lined up on the smaller scale.
            let up = |a: Int64Amount| i128::from(a.value) * 10i128.pow(a.scale.abs_diff(lo));
            return Ok(up(self).cmp(&up(b)));
        }
        Ok(cmp_exact(&Amount::Int(self), &Amount::Int(b)))
    }
}

/// `inf.Dec`: `±unscaled * 10^-scale`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Dec {
    negative: bool,
    unscaled: Magnitude,
    scale: i32,
}

impl Dec {
    /// `int64Amount.AsDec`: the same value and (negated) scale.
    fn from_int(a: Int64Amount) -> Dec {
        Dec {
            negative: a.value < 0,
            unscaled: Magnitude::from_u64(a.value.unsigned_abs()),
            scale: a.scale.wrapping_neg(),
        }
    }

    fn is_zero(&self) -> bool {
        self.unscaled.is_zero()
    }

    /// `inf.Dec.Add`/`Sub` (`dec.go`): both operands rescaled to the larger scale, then added.
    /// Upstream's `rescale` subtracts scales as `int32`; where that wraps (scales more than
    /// 2^31 - 1 apart) it computes 10^(over two billion), which we refuse as too many digits.
    fn add(&self, y: &Dec, negate_y: bool, operation: &'static str) -> Result<Dec, QuantityError> {
        let too_many = || QuantityError::TooManyDigits {
            operation,
            limit: MAX_DIGITS,
        };
        let scale = self.scale.max(y.scale);
        let rescaled = |d: &Dec| -> Result<Magnitude, QuantityError> {
            let shift = scale.wrapping_sub(d.scale);
            if shift < 0 {
                return Err(too_many());
            }
            let mut m = d.unscaled.clone();
            m.mul_pow10(u64::from(shift.unsigned_abs()));
            Ok(m)
        };
        let (a, b) = (rescaled(self)?, rescaled(y)?);
        let (a_neg, b_neg) = (self.negative, y.negative != negate_y);
        let (negative, unscaled) = if a_neg == b_neg {
            (a_neg, a.add(&b).map_err(|_| too_many())?)
        } else {
            match a.cmp_scaled(0, &b, 0) {
                Ordering::Less => (b_neg, b.sub(&a).map_err(|_| too_many())?),
                _ => (a_neg, a.sub(&b).map_err(|_| too_many())?),
            }
        };
        Ok(Dec {
            negative: negative && !unscaled.is_zero(),
            unscaled,
            scale,
        })
    }

    /// `inf.Dec.Round(x, 9, inf.RoundUp)` as `ParseQuantity` calls it on the magnitude:
    /// `QuoRound` by one with `shift = 9 - scale` as `int32`; a remainder rounds away from zero.
    fn round_up_to_nanos(&mut self) -> Result<(), QuantityError> {
        let too_many = || QuantityError::TooManyDigits {
            operation: "parse",
            limit: MAX_DIGITS,
        };
        let shift = (-NANO).wrapping_sub(self.scale);
        match shift.cmp(&0) {
            Ordering::Greater => self.unscaled.mul_pow10(u64::from(shift.unsigned_abs())),
            Ordering::Less => {
                // `exp10(-shift)` indexes a table with a negative number when -shift wraps.
                if shift == i32::MIN {
                    return Err(QuantityError::ScalesTooFarApart {
                        operation: "parse",
                        a: -i64::from(self.scale),
                        b: i64::from(NANO),
                    });
                }
                let (q, cut) = self.unscaled.div_pow10(u64::from(shift.unsigned_abs()));
                self.unscaled = if cut {
                    q.add(&Magnitude::from_u64(1)).map_err(|_| too_many())?
                } else {
                    q
                };
            }
            Ordering::Equal => {}
        }
        self.scale = -NANO;
        Ok(())
    }
}

/// The two forms of `resource.Quantity` (its `i` and `d` fields).
#[derive(Clone, Debug)]
enum Amount {
    Int(Int64Amount),
    Dec(Dec),
}

/// Exact numeric comparison, whatever the forms.
fn cmp_exact(x: &Amount, y: &Amount) -> Ordering {
    let parts = |a: &Amount| -> (i64, Magnitude, i64) {
        match a {
            Amount::Int(i) => (
                i.value.signum(),
                Magnitude::from_u64(i.value.unsigned_abs()),
                i64::from(i.scale),
            ),
            Amount::Dec(d) => (
                if d.is_zero() {
                    0
                } else if d.negative {
                    -1
                } else {
                    1
                },
                d.unscaled.clone(),
                -i64::from(d.scale),
            ),
        }
    };
    let (sx, mx, ex) = parts(x);
    let (sy, my, ey) = parts(y);
    if sx != sy || sx == 0 {
        return sx.cmp(&sy);
    }
    let by_magnitude = mx.cmp_scaled(ex, &my, ey);
    if sx < 0 {
        by_magnitude.reverse()
    } else {
        by_magnitude
    }
}

/// `Quantity.Cmp` on two values: `int64Amount.Cmp` when both are `int64Amount`, else `inf.Dec`
/// comparison (exact; upstream's `rescale` would take forever on scales that wrap, we answer).
fn cmp_upstream(x: &Amount, y: &Amount) -> Result<Ordering, QuantityError> {
    match (x, y) {
        (Amount::Int(a), Amount::Int(b)) => a.cmp(*b),
        _ => Ok(cmp_exact(x, y)),
    }
}

/// `Quantity.Add`/`Sub` on values: `int64Amount` arithmetic when both are `int64Amount` and it
/// does not overflow, else `inf.Dec` arithmetic (both operands converted with `AsDec`).
fn add_upstream(x: &Amount, y: &Amount, negate_y: bool) -> Result<Amount, QuantityError> {
    if let (Amount::Int(a), Amount::Int(b)) = (x, y) {
        let r = if negate_y { a.sub(*b) } else { a.add(*b) };
        if let Some(r) = r {
            return Ok(Amount::Int(r));
        }
    }
    let as_dec = |a: &Amount| match a {
        Amount::Int(i) => Dec::from_int(*i),
        Amount::Dec(d) => d.clone(),
    };
    let operation = if negate_y { "sub" } else { "add" };
    as_dec(x)
        .add(&as_dec(y), negate_y, operation)
        .map(Amount::Dec)
}

/// Go's `math.Pow10`: the same products and quotients of exact table entries, so the result
/// matches upstream bit for bit.
fn go_pow10(n: i64) -> f64 {
    const TAB: [f64; 32] = [
        1e00, 1e01, 1e02, 1e03, 1e04, 1e05, 1e06, 1e07, 1e08, 1e09, 1e10, 1e11, 1e12, 1e13, 1e14,
        1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22, 1e23, 1e24, 1e25, 1e26, 1e27, 1e28, 1e29,
        1e30, 1e31,
    ];
    const POS32: [f64; 10] = [
        1e00, 1e32, 1e64, 1e96, 1e128, 1e160, 1e192, 1e224, 1e256, 1e288,
    ];
    const NEG32: [f64; 11] = [
        1e-00, 1e-32, 1e-64, 1e-96, 1e-128, 1e-160, 1e-192, 1e-224, 1e-256, 1e-288, 1e-320,
    ];
    if (0..=308).contains(&n) {
        let n = n as usize;
        return POS32[n / 32] * TAB[n % 32];
    }
    if (-323..=0).contains(&n) {
        let n = (-n) as usize;
        return NEG32[n / 32] / TAB[n % 32];
    }
    if n > 0 { f64::INFINITY } else { 0.0 }
}

impl Amount {
    fn sign(&self) -> i64 {
        match self {
            Amount::Int(i) => i.value.signum(),
            Amount::Dec(d) if d.is_zero() => 0,
            Amount::Dec(d) => {
                if d.negative {
                    -1
                } else {
                    1
                }
            }
        }
    }

    /// `Quantity.AsInt64`: `false` for every `inf.Dec`.
    fn as_int64(&self) -> Option<i64> {
        match self {
            Amount::Int(i) => i.as_int64(),
            Amount::Dec(_) => None,
        }
    }

    /// `Quantity.AsApproximateFloat64`: the form's mantissa as a double times Go's
    /// `math.Pow10` of its decimal exponent (for `inf.Dec`, `-scale` computed as an `int32`).
    fn approximate_float(&self) -> f64 {
        let (base, exponent) = match self {
            Amount::Int(i) => (i.value as f64, i64::from(i.scale)),
            Amount::Dec(d) => {
                let m = d.unscaled.to_f64();
                (
                    if d.negative { -m } else { m },
                    i64::from(d.scale.wrapping_neg()),
                )
            }
        };
        if exponent == 0 {
            return base;
        }
        base * go_pow10(exponent)
    }
}

/// A quantity as upstream's `resource.Quantity` struct holds it (`quantity.go`): the amount in
/// its form (see the module docs), its [`Format`], and the text it was parsed from.
///
/// Of the text, upstream keeps only canonical input as its cached string `s` (what
/// [`Quantity::canonical_string`] returns and [`Quantity::go_struct_eq`] compares); `Display`
/// writes the text as given, whether upstream keeps it or not.
#[derive(Clone, Debug)]
pub struct Quantity {
    amount: Amount,
    format: Format,
    /// The text it was parsed from, when parsed; shared by clones.
    text: Option<Arc<str>>,
    /// Whether `text` is upstream's cached string `s`.
    cached: bool,
}

/// Numeric equality (`Quantity.Equal`): `1Gi == 1024Mi`, whatever the forms.
impl PartialEq for Quantity {
    fn eq(&self, other: &Self) -> bool {
        self.compare(other) == Ordering::Equal
    }
}

/// How a quantity is written (`resource.Format`), from its suffix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `e3`-style exponents (`DecimalExponent`).
    DecimalExponent,
    /// `Ki`, `Mi`, ... (`BinarySI`).
    BinarySi,
    /// `k`, `M`, ... and no suffix (`DecimalSI`).
    DecimalSi,
}

/// `parseQuantityString`'s pieces of a quantity's text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Parts<'a> {
    /// No leading `-`.
    pub positive: bool,
    /// The number with its sign, as `inf.Dec.SetString` reads it.
    pub value: &'a str,
    /// Digits before the point, leading zeros gone (`"0"` for none).
    pub num: &'a str,
    /// Digits after the point.
    pub denom: &'a str,
    /// The suffix, as written ([`interpret`] reads it).
    pub suffix: &'a str,
}

/// Splits a quantity's text into its [`Parts`] (`quantity.go` `parseQuantityString`).
///
/// # Errors
/// [`QuantityError::Format`] when the text does not have a quantity's shape.
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
            value: "0",
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
        value: &s[..suffix_start],
        num,
        denom,
        suffix: &s[suffix_start..],
    })
}

/// A suffix's base (2 or 10), exponent and format (`suffix.go` `interpret`); `None` for an
/// unknown suffix. An `e` exponent is truncated to `int32` as upstream does.
fn interpret(s: &str) -> Option<(u32, i32, Format)> {
    let decimal = match s {
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
    if let Some(e) = decimal {
        return Some((10, e, Format::DecimalSi));
    }
    let binary = match s {
        "Ki" => Some(10),
        "Mi" => Some(20),
        "Gi" => Some(30),
        "Ti" => Some(40),
        "Pi" => Some(50),
        "Ei" => Some(60),
        _ => None,
    };
    if let Some(e) = binary {
        return Some((2, e, Format::BinarySi));
    }
    if s.len() > 1 && (s.starts_with('e') || s.starts_with('E')) {
        let e: i64 = s[1..].parse().ok()?;
        // Upstream truncates the parsed int64 exponent to int32.
        return Some((10, e as i32, Format::DecimalExponent));
    }
    None
}

impl Quantity {
    /// Parses a quantity like `ParseQuantity` (`quantity.go`), into the same form:
    /// - `"0"` and every number that takes the fast path is an `int64Amount`: a decimal (or
    ///   `e` exponent) suffix with at most 18 digits and a scale of nanos or coarser after the
    ///   fraction (`1.5` is 15 * 10^-1, `1000m` 1000 * 10^-3, `1e3` 1 * 10^3), or a binary
    ///   suffix without a fraction, few enough digits for the suffix (`15 - digits -
    ///   exponent*3/10 - 1 >= 0`: up to `1Ti`, not `1Pi`) and no `int64` overflow;
    /// - everything else is an `inf.Dec` rounded away from zero to nanos (`1.5Gi`, `1Pi`,
    ///   `1e-10`, 19 or more digits), binary values capped at the largest `int64`.
    ///
    /// Scale arithmetic is `int32` and wraps like upstream's (`1.5e-2147483648` is
    /// 15 * 10^2147483647).
    ///
    /// The [`Format`] is the suffix's, except that a binary `inf.Dec` between zero and one is
    /// `DecimalSI` (`0.5Mi`). The text is upstream's cached string `s` only for `"0"` and an
    /// `int64Amount` already in canonical form: a binary suffix on a number that is not a
    /// multiple of 8 (`1Gi`, not `1024Mi` or `8Ki`); else a scale that is a multiple of three
    /// and digits that neither start with `0` nor end in `000` (`1500m`, `1k`; not `1000`,
    /// `1.5` or `0.5`). Text with spaces around it is not a quantity: JSON and YAML readers
    /// trim it first, as upstream's `UnmarshalJSON` does.
    ///
    /// # Errors
    /// [`QuantityError::Format`], [`QuantityError::Suffix`] or [`QuantityError::Numeric`] as
    /// upstream; [`QuantityError::ScalesTooFarApart`] where upstream's rounding panics;
    /// [`QuantityError::TooManyDigits`] for a number of more than 10,000 digits that needs
    /// rounding.
    pub fn parse(s: &str) -> Result<Quantity, QuantityError> {
        let Parsed {
            amount,
            format,
            cached,
        } = parse_amount(s)?;
        Ok(Quantity {
            amount,
            format,
            text: Some(s.into()),
            cached,
        })
    }

    /// `resource.NewQuantity(value, format)` (`quantity.go`): `value` as an `int64Amount` of
    /// scale 0, with no cached string.
    pub fn new(value: i64, format: Format) -> Quantity {
        Quantity {
            amount: Amount::Int(Int64Amount { value, scale: 0 }),
            format,
            text: None,
            cached: false,
        }
    }

    /// A quantity from an integer: [`Quantity::new`] in `DecimalSI`.
    pub fn from_int(v: i64) -> Quantity {
        Quantity::new(v, Format::DecimalSi)
    }

    /// How upstream writes this quantity (its `Format` field).
    pub fn format(&self) -> Format {
        self.format
    }

    /// Upstream's cached string `s`, where [`Quantity::parse`] keeps one.
    fn cached_string(&self) -> Option<&str> {
        self.text.as_deref().filter(|_| self.cached)
    }

    /// Go's `==` on two `resource.Quantity` structs (`quantity.go`): true only for two
    /// `int64Amount` forms with the same value and scale, the same [`Format`] and the same
    /// cached string (both none, or equal). Two `inf.Dec` forms point to different `inf.Dec`s
    /// and are never equal, so `1.5Gi` is not `==` to `1.5Gi`, nor `1Gi` to `1024Mi`.
    ///
    /// The allocator needs this where upstream compares structs rather than values:
    /// `violatesPolicy` (`k8s.io/dynamic-resource-allocation`,
    /// `structured/internal/incubating/consumable_capacity.go`) against a request policy's
    /// default.
    pub fn go_struct_eq(&self, other: &Quantity) -> bool {
        match (&self.amount, &other.amount) {
            (Amount::Int(a), Amount::Int(b)) => {
                a == b
                    && self.format == other.format
                    && self.cached_string() == other.cached_string()
            }
            _ => false,
        }
    }

    /// `Quantity.Value()` (`quantity.go`): the value as an `int64`, a fraction rounded up.
    ///
    /// - `int64Amount` (`AsScaledInt64(0)`, `amount.go`): a positive scale multiplies, and
    ///   an `int64` overflow gives 0; a negative scale divides and rounds away from zero
    ///   (`1500m` is 2, `-1500m` is -2).
    /// - `inf.Dec`: the integer part, plus one for a cut-off fraction (`1.5Gi` is 1610612736,
    ///   `1e-10` is 1, `-1.5` would be 0 as upstream's truncating `int64` division gives).
    ///   A magnitude beyond a `u64` gives 0 and one beyond an `int64` wraps: upstream's
    ///   `big.Int` to `int64` conversion there is not mirrored.
    pub fn value(&self) -> i64 {
        match &self.amount {
            Amount::Int(i) if i.scale >= 0 => positive_scale_i64(i.value, i.scale).unwrap_or(0),
            Amount::Int(i) => negative_scale_i64(i.value, i.scale.unsigned_abs()),
            Amount::Dec(d) => {
                let (whole, fraction) = if d.scale >= 0 {
                    d.unscaled.div_pow10(u64::from(d.scale.unsigned_abs()))
                } else {
                    let mut m = d.unscaled.clone();
                    m.mul_pow10(u64::from(d.scale.unsigned_abs()));
                    (m, false)
                };
                let magnitude = whole.to_u64().map_or(0, i128::from);
                let signed = if d.negative { -magnitude } else { magnitude };
                // Truncation to 64 bits is the documented wrap.
                (signed + i128::from(fraction)) as i64
            }
        }
    }

    /// -1, 0 or 1 (`Quantity.Sign`).
    pub fn sign(&self) -> i64 {
        self.amount.sign()
    }

    /// The value as an int64 when it is a whole number that fits, whatever the form: `1.5Gi`
    /// and `1000m` give `Some`. Upstream's CEL `asInteger()` is stricter, see
    /// [`Quantity::as_int64`].
    pub fn as_i64(&self) -> Option<i64> {
        let (negative, magnitude) = match &self.amount {
            Amount::Int(i) => {
                if i.scale >= 0 {
                    return positive_scale_i64(i.value, i.scale);
                }
                let div = 10i64.checked_pow(i.scale.unsigned_abs());
                return match div {
                    Some(d) if i.value % d == 0 => Some(i.value / d),
                    None if i.value == 0 => Some(0),
                    _ => None,
                };
            }
            Amount::Dec(d) => {
                let m = if d.scale >= 0 {
                    let (q, cut) = d.unscaled.div_pow10(u64::from(d.scale.unsigned_abs()));
                    if cut {
                        return None;
                    }
                    q
                } else {
                    let mut m = d.unscaled.clone();
                    m.mul_pow10(u64::from(d.scale.unsigned_abs()));
                    m
                };
                (d.negative, m.to_u64()?)
            }
        };
        if negative {
            0i64.checked_sub_unsigned(magnitude)
        } else {
            i64::try_from(magnitude).ok()
        }
    }

    /// `Quantity.AsInt64`, what CEL's `isInteger()` and `asInteger()` use: `None` for every
    /// `inf.Dec` and for an `int64Amount` with a negative scale, even when the value is whole.
    pub fn as_int64(&self) -> Option<i64> {
        self.amount.as_int64()
    }

    /// Whether upstream holds this quantity as an `inf.Dec` (else an `int64Amount`).
    pub fn is_inf_dec(&self) -> bool {
        matches!(self.amount, Amount::Dec(_))
    }

    /// The value as a double, computed like `Quantity.AsApproximateFloat64` from the form.
    pub fn as_f64(&self) -> f64 {
        self.amount.approximate_float()
    }

    /// `self + other` with `Quantity.Add`'s forms: `int64Amount` while both are and the sum
    /// fits an `int64` (at the smaller scale), `inf.Dec` otherwise.
    ///
    /// # Errors
    /// [`QuantityError::TooManyDigits`] when the exact sum is beyond 10,000 digits.
    ///
    /// The sum keeps `self`'s [`Format`], or takes `other`'s when `self` is zero, and has no
    /// cached string (`Quantity.Add`, `quantity.go`).
    pub fn add(&self, other: &Quantity) -> Result<Quantity, QuantityError> {
        Ok(Quantity {
            amount: add_upstream(&self.amount, &other.amount, false)?,
            format: self.format_with(other),
            text: None,
            cached: false,
        })
    }

    /// `self - other` with `Quantity.Sub`'s forms (see [`Quantity::add`]).
    ///
    /// # Errors
    /// As [`Quantity::add`].
    pub fn sub(&self, other: &Quantity) -> Result<Quantity, QuantityError> {
        Ok(Quantity {
            amount: add_upstream(&self.amount, &other.amount, true)?,
            format: self.format_with(other),
            text: None,
            cached: false,
        })
    }

    /// The format of `self + other` and `self - other`.
    fn format_with(&self, other: &Quantity) -> Format {
        if self.sign() == 0 {
            other.format
        } else {
            self.format
        }
    }

    /// `self + other` for a running total that must not under-count: what a shared device's
    /// consumed capacity or a counter set's use adds up to in the allocator. Where the exact
    /// sum is beyond the arithmetic ([`QuantityError::TooManyDigits`]: `1e20000` + `1`, which
    /// a request may carry) the total is 9 * 10^2147483647, the largest exponent an `e`
    /// suffix reaches and above any real capacity, so nothing more fits; never `self`.
    pub fn saturating_add(&self, other: &Quantity) -> Quantity {
        self.add(other).unwrap_or(Quantity {
            amount: Amount::Int(Int64Amount {
                value: 9,
                scale: i32::MAX,
            }),
            format: Format::DecimalExponent,
            text: None,
            cached: false,
        })
    }

    /// `self - other` for what is left of `self` (a counter's or capacity's availability):
    /// where the arithmetic cannot hold the difference, nothing is left (zero), never `self`.
    pub fn sub_or_zero(&self, other: &Quantity) -> Quantity {
        self.sub(other).unwrap_or_else(|_| Quantity::from_int(0))
    }

    /// `self - other` for what stays consumed after releasing `other` from `self`: where the
    /// arithmetic cannot hold the difference, `self` stays consumed (over-counted, never
    /// under).
    pub fn sub_or_self(&self, other: &Quantity) -> Quantity {
        self.sub(other).unwrap_or_else(|_| self.clone())
    }

    /// Exact numeric comparison (what `Quantity.Cmp` computes where it does not panic).
    pub fn compare(&self, other: &Quantity) -> Ordering {
        cmp_exact(&self.amount, &other.amount)
    }
}

/// What `ParseQuantity` builds: the amount, the format, and whether the text is kept as the
/// cached string `s`.
struct Parsed {
    amount: Amount,
    format: Format,
    cached: bool,
}

/// `ParseQuantity`, line by line.
fn parse_amount(s: &str) -> Result<Parsed, QuantityError> {
    if s.is_empty() {
        return Err(QuantityError::Format);
    }
    if s == "0" {
        return Ok(Parsed {
            amount: Amount::Int(Int64Amount { value: 0, scale: 0 }),
            format: Format::DecimalSi,
            cached: true,
        });
    }
    let p = split(s)?;
    let (base, exponent, mut format) = interpret(p.suffix).ok_or(QuantityError::Suffix)?;
    let binary = base == 2;
    let digits = p.num.len() as i64 + p.denom.len() as i64;
    let denom_len = p.denom.len() as i32;

    // The int64 fast path.
    let (precision, mut scale, mantissa) = if !binary {
        (18 - digits, exponent, 1i64)
    } else if p.denom.is_empty() {
        // `float32(exponent)*3/10` is exact for the binary exponents 10..60.
        let precision = 15 - p.num.len() as i64 - i64::from(exponent * 3 / 10) - 1;
        (precision, 0, 1i64 << exponent)
    } else {
        (-1, 0, 1)
    };
    if precision >= 0 {
        scale = scale.wrapping_sub(denom_len);
        if scale >= NANO {
            // `strconv.ParseInt(num + denom)`: at most 18 digits here, so it cannot overflow.
            let shifted = || p.num.bytes().chain(p.denom.bytes());
            let value = shifted()
                .try_fold(0i64, |v, d| {
                    v.checked_mul(10)?.checked_add(i64::from(d - b'0'))
                })
                .ok_or(QuantityError::Numeric)?;
            if let Some(result) = value.checked_mul(mantissa) {
                // Upstream keeps the text only when it is already what it would write.
                let cached = if binary {
                    exponent % 10 == 0 && value & 0x07 != 0
                } else {
                    scale % 3 == 0
                        && !(digits >= 3 && shifted().rev().take(3).all(|d| d == b'0'))
                        && shifted().next() != Some(b'0')
                };
                let value = if p.positive { result } else { -result };
                return Ok(Parsed {
                    amount: Amount::Int(Int64Amount { value, scale }),
                    format,
                    cached,
                });
            }
        }
    }

    // The inf.Dec path: `SetString(value)` needs at least one digit.
    if !p.value.bytes().any(|c| c.is_ascii_digit()) {
        return Err(QuantityError::Numeric);
    }
    let mut amount = Dec {
        negative: false,
        unscaled: Magnitude::from_digits(&format!("{}{}", p.num, p.denom)),
        scale: denom_len,
    };
    if binary {
        amount.unscaled.mul_pow2(exponent.unsigned_abs());
    } else {
        // `SetScale(Scale() + Scale(exponent).infScale())`, all int32.
        amount.scale = amount.scale.wrapping_add(exponent.wrapping_neg());
    }
    if !amount.is_zero() {
        amount.round_up_to_nanos()?;
    }
    let max = Dec::from_int(Int64Amount {
        value: i64::MAX,
        scale: 0,
    });
    if binary
        && cmp_exact(&Amount::Dec(amount.clone()), &Amount::Dec(max.clone())) == Ordering::Greater
    {
        amount = max;
    }
    // A binary value between zero and one is written in DecimalSI.
    if binary
        && !amount.is_zero()
        && amount
            .unscaled
            .cmp_scaled(-i64::from(amount.scale), &Magnitude::from_u64(1), 0)
            == Ordering::Less
    {
        format = Format::DecimalSi;
    }
    amount.negative = !p.positive && !amount.is_zero();
    Ok(Parsed {
        amount: Amount::Dec(amount),
        format,
        cached: false,
    })
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(t) = &self.text {
            return f.write_str(t);
        }
        match &self.amount {
            Amount::Int(i) if i.scale == 0 => write!(f, "{}", i.value),
            Amount::Int(i) => write!(f, "{}e{}", i.value, i.scale),
            Amount::Dec(d) => {
                let sign = if d.negative { "-" } else { "" };
                let (m, e) = (&d.unscaled, -i64::from(d.scale));
                if d.is_zero() || e == 0 {
                    write!(f, "{sign}{m}")
                } else if m.zeros() == 0 {
                    write!(f, "{sign}{m}e{e}")
                } else {
                    // `m` already ends in its own exponent: fold the scale into it.
                    let mut text = m.to_string();
                    let cut = text.rfind('e').unwrap_or(text.len());
                    text.truncate(cut);
                    write!(f, "{sign}{text}e{}", i128::from(m.zeros()) + i128::from(e))
                }
            }
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The fields of a `resource.Quantity` that hold its value: `i`, or `d`, a pointer to an
/// `inf.Dec` that copies of the struct share.
#[derive(Clone, Debug)]
enum Form {
    Int(Int64Amount),
    Dec(Arc<Mutex<Dec>>),
}

/// A CEL quantity value: upstream's `*resource.Quantity`, shared by every copy of the value
/// within one evaluation (a `cel.bind` variable, a list element, a device capacity read twice).
///
/// Two upstream mutations are visible through the sharing:
/// - `isGreaterThan`/`isLessThan`/`compareTo` call `(*Quantity).Cmp`, which converts its
///   receiver to `inf.Dec` (`AsDec`) when either side is one: `x.isLessThan(quantity('1.5Gi'))`
///   makes a later `x.isInteger()` false;
/// - `add`/`sub` (`quantityAdd` and friends in `library/quantity.go`) copy the struct and call
///   `Add`/`Sub` on the copy, which for an `inf.Dec` receiver writes the result into the
///   `inf.Dec` that the original points to: after `x.add(1)`, `x` is one more too.
#[derive(Clone, Debug)]
pub struct QuantityValue {
    target: Arc<Mutex<Form>>,
    /// Result of `add`/`sub`: upstream returns a pointer there, which `==` on the left-hand
    /// side of a plain quantity does not accept (a "no such overload" error).
    pub boxed: bool,
}

/// The right-hand side of `add`/`sub`.
pub enum Operand<'q> {
    /// `quantity_add`/`quantity_sub`.
    Quantity(&'q QuantityValue),
    /// `quantity_add_int`/`quantity_sub_int`: `resource.NewQuantity(i, DecimalExponent)`.
    Int(i64),
}

impl QuantityValue {
    /// A fresh value of `q` (each evaluation's device capacities).
    pub fn new(q: &Quantity) -> QuantityValue {
        QuantityValue::of(q.amount.clone())
    }

    /// `quantity()`: a fresh value parsed like [`Quantity::parse`].
    ///
    /// # Errors
    /// As [`Quantity::parse`].
    pub fn parse(s: &str) -> Result<QuantityValue, QuantityError> {
        parse_amount(s).map(|p| QuantityValue::of(p.amount))
    }

    fn of(amount: Amount) -> QuantityValue {
        let form = match amount {
            Amount::Int(i) => Form::Int(i),
            Amount::Dec(d) => Form::Dec(Arc::new(Mutex::new(d))),
        };
        QuantityValue {
            target: Arc::new(Mutex::new(form)),
            boxed: false,
        }
    }

    fn form(&self) -> Form {
        lock(&self.target).clone()
    }

    fn amount(&self) -> Amount {
        match self.form() {
            Form::Int(i) => Amount::Int(i),
            Form::Dec(d) => Amount::Dec(lock(&d).clone()),
        }
    }

    /// `sign()`: `Quantity.Sign`.
    pub fn sign(&self) -> i64 {
        self.amount().sign()
    }

    /// `isInteger()`/`asInteger()`: `Quantity.AsInt64` of the current form.
    pub fn as_int64(&self) -> Option<i64> {
        self.amount().as_int64()
    }

    /// `asApproximateFloat()`: `Quantity.AsApproximateFloat64` of the current form.
    pub fn approximate_float(&self) -> f64 {
        self.amount().approximate_float()
    }

    /// `isGreaterThan`/`isLessThan`/`compareTo`: `(*Quantity).Cmp`, which leaves the receiver
    /// in the `inf.Dec` form when either side is one.
    ///
    /// # Errors
    /// [`QuantityError::ScalesTooFarApart`] where upstream panics.
    pub fn compare(&self, other: &QuantityValue) -> Result<Ordering, QuantityError> {
        let (x, y) = (self.amount(), other.amount());
        let r = cmp_upstream(&x, &y)?;
        if let (Amount::Int(i), Amount::Dec(_)) = (&x, &y) {
            *lock(&self.target) = Form::Dec(Arc::new(Mutex::new(Dec::from_int(*i))));
        }
        Ok(r)
    }

    /// `==`: `Quantity.Equal`, which compares copies and converts nothing.
    ///
    /// # Errors
    /// As [`QuantityValue::compare`].
    pub fn equals(&self, other: &QuantityValue) -> Result<bool, QuantityError> {
        Ok(cmp_upstream(&self.amount(), &other.amount())? == Ordering::Equal)
    }

    /// `add`: a copy of the receiver plus the operand (`Quantity.Add`); an `inf.Dec` receiver
    /// receives the sum too.
    ///
    /// # Errors
    /// [`QuantityError::TooManyDigits`] when the exact sum is too long.
    pub fn add(&self, other: Operand<'_>) -> Result<QuantityValue, QuantityError> {
        self.add_or_sub(other, false)
    }

    /// `sub`: as [`QuantityValue::add`] with `Quantity.Sub`.
    ///
    /// # Errors
    /// As [`QuantityValue::add`].
    pub fn sub(&self, other: Operand<'_>) -> Result<QuantityValue, QuantityError> {
        self.add_or_sub(other, true)
    }

    fn add_or_sub(&self, other: Operand<'_>, negate: bool) -> Result<QuantityValue, QuantityError> {
        let copy = self.form();
        let x = match &copy {
            Form::Int(i) => Amount::Int(*i),
            Form::Dec(d) => Amount::Dec(lock(d).clone()),
        };
        let y = match other {
            Operand::Quantity(q) => q.amount(),
            Operand::Int(v) => Amount::Int(Int64Amount { value: v, scale: 0 }),
        };
        let form = match (add_upstream(&x, &y, negate)?, copy) {
            (Amount::Int(i), _) => Form::Int(i),
            // The copy's `inf.Dec` is the receiver's: write the result through it.
            (Amount::Dec(d), Form::Dec(shared)) => {
                *lock(&shared) = d;
                Form::Dec(shared)
            }
            (Amount::Dec(d), Form::Int(_)) => Form::Dec(Arc::new(Mutex::new(d))),
        };
        Ok(QuantityValue {
            target: Arc::new(Mutex::new(form)),
            boxed: true,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(s: &str) -> Quantity {
        Quantity::parse(s).unwrap()
    }

    #[test]
    fn binary_and_decimal_suffixes_compare_numerically() {
        assert_eq!(q("1Gi").compare(&q("1G")), Ordering::Greater);
        assert_eq!(q("1000m").compare(&q("1")), Ordering::Equal);
        assert_eq!(q("1.5Gi").compare(&q("1536Mi")), Ordering::Equal);
        assert_eq!(q("-1.5Gi").compare(&q("-1Gi")), Ordering::Less);
        assert_eq!(q("1k").as_int64(), Some(1000));
    }

    #[test]
    fn malformed_text_and_unknown_suffixes_are_errors() {
        assert_eq!(Quantity::parse("10Mo").unwrap_err(), QuantityError::Format);
        assert_eq!(Quantity::parse("10Q").unwrap_err(), QuantityError::Format);
        assert_eq!(Quantity::parse("10ki").unwrap_err(), QuantityError::Suffix);
        assert_eq!(Quantity::parse("").unwrap_err(), QuantityError::Format);
        assert_eq!(Quantity::parse("1e").unwrap_err(), QuantityError::Suffix);
        assert_eq!(
            Quantity::parse("1e9223372036854775808").unwrap_err(),
            QuantityError::Suffix
        );
        // No digit for inf.Dec's SetString; the fast path takes "." as zero.
        assert_eq!(
            Quantity::parse(".e-10").unwrap_err(),
            QuantityError::Numeric
        );
        assert_eq!(q(".").sign(), 0);
        assert_eq!(q("-").sign(), 0);
        for s in ["x", "1x", "1.2.3", " 1", "1 "] {
            assert_eq!(
                Quantity::parse(s).unwrap_err(),
                QuantityError::Format,
                "{s:?}"
            );
        }
        assert_eq!(Quantity::parse("--1").unwrap_err(), QuantityError::Suffix);
        // Upstream reads a missing number as zero (`parseQuantityString`).
        assert_eq!(q("Gi").canonical_string(), "0");
    }

    #[test]
    fn sub_nano_values_round_away_from_zero() {
        assert_eq!(q("0.1n").compare(&q("1n")), Ordering::Equal);
        assert_eq!(q("-1e-20").compare(&q("-1n")), Ordering::Equal);
        assert!(q("1e-20").is_inf_dec());
    }

    #[test]
    fn parsing_picks_upstreams_form() {
        // (text, inf.Dec form, AsInt64)
        let cases: &[(&str, bool, Option<i64>)] = &[
            ("0", false, Some(0)),
            ("0.0", false, None),
            ("1.0", false, None),
            ("1000m", false, None),
            ("1k", false, Some(1000)),
            ("1e3", false, Some(1000)),
            ("1E-3", false, None),
            ("100Mi", false, Some(100 << 20)),
            ("1Ti", false, Some(1 << 40)),
            ("1Pi", true, None),
            ("1Ei", true, None),
            ("1.5Gi", true, None),
            ("999999999999999999", false, Some(999_999_999_999_999_999)),
            ("9223372036854775807", true, None),
            ("1e-10", true, None),
            ("0.0000000000", true, None),
            ("1e4294967296", false, Some(1)),
            ("1e19", false, None),
        ];
        for (text, dec, int) in cases {
            let x = q(text);
            assert_eq!(x.is_inf_dec(), *dec, "{text}");
            assert_eq!(x.as_int64(), *int, "{text}");
        }
        // Binary values are capped at the largest int64.
        assert_eq!(q("10Ei").as_i64(), Some(i64::MAX));
        assert_eq!(q("1.5Gi").as_i64(), Some(1_610_612_736));
        assert_eq!(q("1000m").as_i64(), Some(1));
        assert_eq!(q("1.5").as_i64(), None);
        assert_eq!(q("-9223372036854775808").as_i64(), Some(i64::MIN));
    }

    #[test]
    fn parsing_keeps_the_format_and_caches_only_canonical_text() {
        // (text, format, cached string)
        let cases: &[(&str, Format, Option<&str>)] = &[
            ("0", Format::DecimalSi, Some("0")),
            ("00", Format::DecimalSi, None),
            ("1Gi", Format::BinarySi, Some("1Gi")),
            ("1024Mi", Format::BinarySi, None),
            ("8Ki", Format::BinarySi, None),
            ("1.5Gi", Format::BinarySi, None),
            ("0.5Ki", Format::BinarySi, None),
            ("0.5n", Format::DecimalSi, None),
            ("1e-10", Format::DecimalExponent, None),
            ("1500m", Format::DecimalSi, Some("1500m")),
            ("1.5", Format::DecimalSi, None),
            ("1000", Format::DecimalSi, None),
            ("0.5", Format::DecimalSi, None),
            ("1e3", Format::DecimalExponent, Some("1e3")),
            ("12e1", Format::DecimalExponent, None),
        ];
        for (text, format, cached) in cases {
            let x = q(text);
            assert_eq!(x.format(), *format, "{text}");
            assert_eq!(x.cached_string(), *cached, "{text}");
            assert_eq!(x.to_string(), *text, "Display writes the text as given");
        }
        // A binary inf.Dec between zero and one is written in DecimalSI.
        assert_eq!(q("0.0000001Ki").format(), Format::DecimalSi);
    }

    #[test]
    fn struct_equality_follows_the_go_form() {
        assert!(q("1Gi").go_struct_eq(&q("1Gi")));
        assert!(
            !q("1Gi").go_struct_eq(&q("1024Mi")),
            "different cached strings"
        );
        assert!(
            !q("1.5Gi").go_struct_eq(&q("1.5Gi")),
            "two inf.Dec pointers"
        );
        assert!(!Quantity::new(1024, Format::BinarySi).go_struct_eq(&q("8Ki")));
        assert!(Quantity::new(8192, Format::BinarySi).go_struct_eq(&q("8Ki")));
        assert!(!Quantity::new(8192, Format::DecimalSi).go_struct_eq(&q("8Ki")));
        assert!(
            !q("1k").go_struct_eq(&q("1e3")),
            "same value and scale, other format"
        );
    }

    #[test]
    fn value_rounds_a_fraction_up() {
        let cases: &[(&str, i64)] = &[
            ("1500m", 2),
            ("-1500m", -2),
            ("1000m", 1),
            ("1.5Gi", 1_610_612_736),
            ("1e-10", 1),
            ("-1.5Gi", -1_610_612_736),
            ("10Gi", 10 << 30),
            ("1k", 1000),
            ("1e19", 0),
            ("0", 0),
            ("1Pi", 1 << 50),
        ];
        for (text, want) in cases {
            assert_eq!(q(text).value(), *want, "{text}");
        }
        assert_eq!(Quantity::new(-7, Format::BinarySi).value(), -7);
    }

    /// Issue 41, defect 12: a sum the arithmetic cannot hold used to be the first operand,
    /// under-counting what is consumed; it is now above any real capacity.
    #[test]
    fn sums_beyond_the_arithmetic_never_under_count() {
        let big = q("1e20000");
        let one = Quantity::from_int(1);
        assert!(big.add(&one).is_err(), "the case under test");
        let capacity = q("80Gi");
        let used = q("1Gi").saturating_add(&one);
        assert_eq!(used.compare(&capacity), Ordering::Less, "an ordinary sum");
        assert_eq!(big.saturating_add(&one).compare(&big), Ordering::Greater);
        assert_eq!(
            one.saturating_add(&big).compare(&capacity),
            Ordering::Greater
        );
        assert_eq!(big.sub_or_zero(&one).sign(), 0, "nothing left");
        assert_eq!(big.sub_or_self(&one).compare(&big), Ordering::Equal);
        assert_eq!(
            q("3Gi").sub_or_zero(&q("1Gi")).compare(&q("2Gi")),
            Ordering::Equal
        );
        assert_eq!(
            q("3Gi").sub_or_self(&q("1Gi")).compare(&q("2Gi")),
            Ordering::Equal
        );
    }

    #[test]
    fn approximate_floats_follow_the_form() {
        assert_eq!(q("100m").as_f64(), 0.1);
        assert_eq!(q("1.5Gi").as_f64(), 1_610_612_736.0);
        assert_eq!(q("1e-20").as_f64(), 1e-9);
        assert!(q("0e400").as_f64().is_nan());
        assert_eq!(q("1e400").as_f64(), f64::INFINITY);
    }

    #[test]
    fn int64_sums_switch_to_inf_dec_on_overflow_and_keep_the_smaller_scale() {
        let s = q("1k").add(&q("1m")).unwrap();
        assert!(!s.is_inf_dec());
        assert_eq!(s.as_int64(), None);
        // 18 digits parse as int64Amount; ten of them still fit an int64, eleven do not.
        let big = q("900000000000000000");
        let mut sum = big.clone();
        for _ in 1..10 {
            sum = sum.add(&big).unwrap();
        }
        assert!(!sum.is_inf_dec());
        let over = sum.add(&big).unwrap();
        assert!(over.is_inf_dec());
        assert_eq!(over.compare(&q("9900000000000000000")), Ordering::Equal);
        // Upstream negates the most negative int64 into itself.
        let wrapped = q("1").sub(&Quantity::from_int(i64::MIN)).unwrap();
        assert_eq!(wrapped.sign(), -1);
    }

    #[test]
    fn comparing_a_value_converts_the_receiver_and_adding_writes_through_inf_dec() {
        let one = QuantityValue::new(&q("1"));
        assert_eq!(one.as_int64(), Some(1));
        let dec = QuantityValue::new(&q("1.5Gi"));
        assert_eq!(one.compare(&dec), Ok(Ordering::Less));
        assert_eq!(one.as_int64(), None);

        let sum = dec.add(Operand::Int(1)).unwrap();
        assert_eq!(sum.compare(&dec), Ok(Ordering::Equal));
        assert!(dec.equals(&QuantityValue::new(&q("1610612737"))).unwrap());

        let int = QuantityValue::new(&q("2"));
        let _ = int.add(Operand::Int(1)).unwrap();
        assert_eq!(int.as_int64(), Some(2));
    }

    #[test]
    fn arbitrary_text_and_arithmetic_never_panic() {
        // Digits, signs, points and suffix letters, plus exponents near the int32 edges.
        const PIECES: &[&str] = &[
            "0",
            "1",
            "5",
            "9",
            "00",
            ".",
            "+",
            "-",
            "e",
            "E",
            "i",
            "n",
            "u",
            "m",
            "k",
            "K",
            "M",
            "G",
            "T",
            "P",
            "Ki",
            "Gi",
            "Ei",
            "e-10",
            "e2147483647",
            "e-2147483648",
            "e4294967295",
            "123456789012345678",
            "9223372036854775808",
            "e400",
            "e-400",
            "e9000",
        ];
        let mut state: u64 = 0x5eed_0a11;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut parsed = Vec::new();
        for _ in 0..5_000 {
            let n = 1 + next() % 5;
            let text: String = (0..n)
                .map(|_| PIECES[(next() % PIECES.len() as u64) as usize])
                .collect();
            if let Ok(x) = Quantity::parse(&text) {
                let _ = (
                    x.as_f64(),
                    x.as_i64(),
                    x.as_int64(),
                    x.sign(),
                    x.to_string(),
                    x.canonical_string(),
                    x.value(),
                    x.go_struct_eq(&x),
                );
                parsed.push(QuantityValue::new(&x));
            }
        }
        assert!(parsed.len() > 1_000, "only {} parsed", parsed.len());
        for w in parsed.windows(2) {
            let (a, b) = (&w[0], &w[1]);
            let _ = (a.compare(b), a.equals(b), b.compare(a));
            for r in [
                a.add(Operand::Quantity(b)),
                a.sub(Operand::Quantity(b)),
                a.add(Operand::Int(i64::MIN)),
                a.sub(Operand::Int(i64::MIN)),
            ]
            .into_iter()
            .flatten()
            {
                let _ = (r.approximate_float(), r.as_int64(), r.sign(), r.compare(a));
            }
        }
    }

    #[test]
    fn scales_that_wrap_as_int32_fail_where_upstream_panics() {
        let far = QuantityValue::new(&q("1e2147483647"));
        let near = QuantityValue::new(&q("1n"));
        let e = far.compare(&near).unwrap_err();
        assert!(e.is_upstream_panic(), "{e}");
        // Upstream's Add ignores a wrapped scale difference: 1e2147483647 + 1n is 2n.
        let sum = far.add(Operand::Quantity(&near)).unwrap();
        assert!(sum.equals(&QuantityValue::new(&q("2n"))).unwrap());
    }
}
