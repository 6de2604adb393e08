//! Unsigned decimal integers of any size, for the `inf.Dec` form of a quantity (`gopkg.in/inf.v0`
//! over `math/big`).
//!
//! A [`Magnitude`] is a coefficient times a power of ten. Upstream keeps every digit in a
//! `big.Int`; keeping the trailing zeros as a count instead makes the large exponents that
//! `ParseQuantity` accepts (`1234567890123456789e4000`) as cheap as small ones. Only addition
//! and subtraction of numbers whose zeros do not line up spell digits out, and those stop at
//! [`MAX_DIGITS`].

use std::cmp::Ordering;
use std::fmt::Write as _;

/// The most decimal digits an addition or subtraction spells out. Upstream has no limit; a sum
/// this long needs an operand with an exponent in the thousands, far beyond any resource.
pub(crate) const MAX_DIGITS: u64 = 10_000;

/// One limb holds nine decimal digits.
const LIMB: u64 = 1_000_000_000;
const LIMB_DIGITS: u64 = 9;

/// An addition or subtraction needs more than [`MAX_DIGITS`] digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TooManyDigits;

/// `coefficient * 10^zeros`, zero or positive.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Magnitude {
    /// The coefficient in base 10^9, least significant limb first, with no high zero limbs and
    /// no trailing decimal zero (those are counted in `zeros`); empty for zero.
    limbs: Vec<u32>,
    /// Decimal zeros after the coefficient; 0 for zero.
    zeros: u64,
}

fn pow10_u32(n: u64) -> u32 {
    // Callers pass n < 9.
    10u32.pow(u32::try_from(n).unwrap_or(0))
}

impl Magnitude {
    /// `v`.
    pub(crate) fn from_u64(mut v: u64) -> Magnitude {
        let mut limbs = Vec::new();
        while v > 0 {
            limbs.push((v % LIMB) as u32);
            v /= LIMB;
        }
        Magnitude { limbs, zeros: 0 }.normalized()
    }

    /// The number written by `digits` (ASCII digits only; leading zeros allowed; empty is zero).
    pub(crate) fn from_digits(digits: &str) -> Magnitude {
        let digits = digits.trim_start_matches('0');
        let significant = digits.trim_end_matches('0');
        let zeros = (digits.len() - significant.len()) as u64;
        let bytes = significant.as_bytes();
        let mut limbs = Vec::with_capacity(bytes.len().div_ceil(9));
        let mut end = bytes.len();
        while end > 0 {
            let start = end.saturating_sub(9);
            let limb = bytes[start..end].iter().fold(0u32, |acc, b| {
                acc * 10 + u32::from(b.wrapping_sub(b'0') % 10)
            });
            limbs.push(limb);
            end = start;
        }
        Magnitude { limbs, zeros }.normalized()
    }

    /// Whether this is zero.
    pub(crate) fn is_zero(&self) -> bool {
        self.limbs.is_empty()
    }

    /// Moves trailing zero digits of the coefficient into `zeros` and drops high zero limbs.
    fn normalized(mut self) -> Magnitude {
        while self.limbs.last() == Some(&0) {
            self.limbs.pop();
        }
        if self.limbs.is_empty() {
            self.zeros = 0;
            return self;
        }
        let whole = self.limbs.iter().take_while(|l| **l == 0).count();
        if whole > 0 {
            self.limbs.drain(..whole);
            self.zeros = self.zeros.saturating_add(whole as u64 * LIMB_DIGITS);
        }
        let mut low = self.limbs[0];
        let mut tz = 0;
        while low.is_multiple_of(10) {
            low /= 10;
            tz += 1;
        }
        if tz > 0 {
            self.div_small(pow10_u32(tz));
            self.zeros = self.zeros.saturating_add(tz);
        }
        self
    }

    /// Multiplies the coefficient by `m` (at most 2^31).
    fn mul_small(&mut self, m: u32) {
        let mut carry = 0u64;
        for limb in &mut self.limbs {
            let v = u64::from(*limb) * u64::from(m) + carry;
            *limb = (v % LIMB) as u32;
            carry = v / LIMB;
        }
        while carry > 0 {
            self.limbs.push((carry % LIMB) as u32);
            carry /= LIMB;
        }
    }

    /// Divides the coefficient by `d` (not zero), returning the remainder.
    fn div_small(&mut self, d: u32) -> u32 {
        let mut rem = 0u64;
        for limb in self.limbs.iter_mut().rev() {
            let v = rem * LIMB + u64::from(*limb);
            *limb = (v / u64::from(d)) as u32;
            rem = v % u64::from(d);
        }
        while self.limbs.last() == Some(&0) {
            self.limbs.pop();
        }
        rem as u32
    }

    /// Multiplies by 10^k.
    pub(crate) fn mul_pow10(&mut self, k: u64) {
        if !self.is_zero() {
            self.zeros = self.zeros.saturating_add(k);
        }
    }

    /// Multiplies by 2^k.
    pub(crate) fn mul_pow2(&mut self, mut k: u32) {
        if self.is_zero() {
            return;
        }
        // Spell the zeros out: doubling a power of ten is not a power of ten.
        let zeros = std::mem::take(&mut self.zeros);
        self.shift_in_zeros(zeros);
        while k > 0 {
            let step = k.min(30);
            self.mul_small(1 << step);
            k -= step;
        }
        *self = std::mem::take(self).normalized();
    }

    /// Multiplies the coefficient by 10^n in place (dense).
    fn shift_in_zeros(&mut self, n: u64) {
        let whole = usize::try_from(n / LIMB_DIGITS).unwrap_or(usize::MAX);
        if whole > 0 {
            self.limbs.splice(0..0, std::iter::repeat_n(0, whole));
        }
        let rest = n % LIMB_DIGITS;
        if rest > 0 {
            self.mul_small(pow10_u32(rest));
        }
    }

    /// Divides by 10^k, truncating: the quotient, and whether anything was cut off.
    pub(crate) fn div_pow10(&self, k: u64) -> (Magnitude, bool) {
        if self.is_zero() {
            return (Magnitude::default(), false);
        }
        if k <= self.zeros {
            let mut q = self.clone();
            q.zeros -= k;
            return (q, false);
        }
        // The coefficient ends in a non-zero digit, so cutting any of it leaves a remainder.
        let cut = k - self.zeros;
        if cut >= self.coefficient_digits() {
            return (Magnitude::default(), true);
        }
        let whole = usize::try_from(cut / LIMB_DIGITS).unwrap_or(usize::MAX);
        let mut q = Magnitude {
            limbs: self.limbs[whole.min(self.limbs.len())..].to_vec(),
            zeros: 0,
        };
        let rest = cut % LIMB_DIGITS;
        if rest > 0 {
            q.div_small(pow10_u32(rest));
        }
        (q.normalized(), true)
    }

    /// Digits of the coefficient (0 for zero).
    fn coefficient_digits(&self) -> u64 {
        match self.limbs.last() {
            None => 0,
            Some(top) => (self.limbs.len() as u64 - 1) * LIMB_DIGITS + u64::from(top.ilog10()) + 1,
        }
    }

    /// The coefficient's decimal digits: the value without its trailing zeros ("" for zero).
    pub(crate) fn coefficient_string(&self) -> String {
        let mut s = String::with_capacity(self.limbs.len() * 9);
        let mut limbs = self.limbs.iter().rev();
        if let Some(top) = limbs.next() {
            let _ = write!(s, "{top}");
        }
        for limb in limbs {
            let _ = write!(s, "{limb:09}");
        }
        s
    }

    /// The coefficient spelled out with zeros down to 10^`to` (`to` at most `zeros`).
    fn dense(&self, to: u64) -> Result<Magnitude, TooManyDigits> {
        let extra = self.zeros - to;
        if self.coefficient_digits().saturating_add(extra) > MAX_DIGITS {
            return Err(TooManyDigits);
        }
        let mut d = Magnitude {
            limbs: self.limbs.clone(),
            zeros: 0,
        };
        d.shift_in_zeros(extra);
        Ok(d)
    }

    /// Lines up two non-zero magnitudes on their common power of ten.
    fn aligned(&self, other: &Magnitude) -> Result<(Magnitude, Magnitude, u64), TooManyDigits> {
        let to = self.zeros.min(other.zeros);
        Ok((self.dense(to)?, other.dense(to)?, to))
    }

    /// `self + other`.
    ///
    /// # Errors
    /// [`TooManyDigits`] when the sum would be spelled out beyond [`MAX_DIGITS`].
    pub(crate) fn add(&self, other: &Magnitude) -> Result<Magnitude, TooManyDigits> {
        if self.is_zero() {
            return Ok(other.clone());
        }
        if other.is_zero() {
            return Ok(self.clone());
        }
        let (mut a, b, zeros) = self.aligned(other)?;
        if a.limbs.len() < b.limbs.len() {
            a.limbs.resize(b.limbs.len(), 0);
        }
        let mut carry = 0u64;
        for (i, limb) in a.limbs.iter_mut().enumerate() {
            let v = u64::from(*limb) + u64::from(b.limbs.get(i).copied().unwrap_or(0)) + carry;
            *limb = (v % LIMB) as u32;
            carry = v / LIMB;
        }
        if carry > 0 {
            a.limbs.push(carry as u32);
        }
        a.zeros = zeros;
        Ok(a.normalized())
    }

    /// `self - other`, for `self >= other`.
    ///
    /// # Errors
    /// [`TooManyDigits`] when the operands would be spelled out beyond [`MAX_DIGITS`].
    pub(crate) fn sub(&self, other: &Magnitude) -> Result<Magnitude, TooManyDigits> {
        if other.is_zero() {
            return Ok(self.clone());
        }
        if self.is_zero() {
            return Ok(Magnitude::default());
        }
        let (mut a, b, zeros) = self.aligned(other)?;
        let mut borrow = 0i64;
        for (i, limb) in a.limbs.iter_mut().enumerate() {
            let mut v = i64::from(*limb) - i64::from(b.limbs.get(i).copied().unwrap_or(0)) - borrow;
            borrow = 0;
            if v < 0 {
                v += LIMB as i64;
                borrow = 1;
            }
            *limb = v as u32;
        }
        a.zeros = zeros;
        Ok(a.normalized())
    }

    /// Compares `self * 10^self_exp` with `other * 10^other_exp` exactly, without spelling out
    /// either.
    pub(crate) fn cmp_scaled(&self, self_exp: i64, other: &Magnitude, other_exp: i64) -> Ordering {
        match (self.is_zero(), other.is_zero()) {
            (true, true) => return Ordering::Equal,
            (true, false) => return Ordering::Less,
            (false, true) => return Ordering::Greater,
            (false, false) => {}
        }
        // Position of the leading digit, then the digits themselves.
        let lead = |m: &Magnitude, e: i64| {
            i128::from(m.coefficient_digits()) + i128::from(m.zeros) + i128::from(e)
        };
        lead(self, self_exp)
            .cmp(&lead(other, other_exp))
            .then_with(|| {
                let (a, b) = (self.coefficient_string(), other.coefficient_string());
                let n = a.len().max(b.len());
                format!("{a:0<n$}").cmp(&format!("{b:0<n$}"))
            })
    }

    /// Divides by `factor` (2 or more) as often as it divides evenly: the quotient's decimal
    /// digits and how many times (what `removeInt64Factors` and `removeBigIntFactors` compute
    /// in upstream's `amount.go`).
    ///
    /// # Errors
    /// [`TooManyDigits`] when the value spelled out is beyond [`MAX_DIGITS`].
    pub(crate) fn remove_factors(&self, factor: u32) -> Result<(String, u32), TooManyDigits> {
        // Spelled out, trailing zeros included: the quotient's digits are its limbs.
        let mut quotient = self.dense(0)?;
        let mut times = 0;
        if quotient.is_zero() {
            return Ok(("0".to_owned(), times));
        }
        if factor >= 2 {
            loop {
                let mut next = quotient.clone();
                if next.div_small(factor) != 0 {
                    break;
                }
                quotient = next;
                times += 1;
            }
        }
        Ok((quotient.coefficient_string(), times))
    }

    /// The value as a u64 when it fits.
    pub(crate) fn to_u64(&self) -> Option<u64> {
        if self.coefficient_digits().saturating_add(self.zeros) > 20 {
            return None;
        }
        let mut v: u64 = 0;
        for limb in self.limbs.iter().rev() {
            v = v.checked_mul(LIMB)?.checked_add(u64::from(*limb))?;
        }
        for _ in 0..self.zeros {
            v = v.checked_mul(10)?;
        }
        Some(v)
    }

    /// Decimal exponent of the last significant digit: the value is the coefficient times
    /// 10^this.
    pub(crate) fn zeros(&self) -> u64 {
        self.zeros
    }

    /// The nearest double, ties to even (what `big.Float.SetInt(x).Float64()` gives for an
    /// integer), or +Inf beyond the largest double.
    pub(crate) fn to_f64(&self) -> f64 {
        if self.is_zero() {
            return 0.0;
        }
        // Rust's float parsing rounds correctly for any length of input.
        format!("{}e{}", self.coefficient_string(), self.zeros)
            .parse()
            .unwrap_or(f64::INFINITY)
    }
}

impl std::fmt::Display for Magnitude {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_zero() {
            return f.write_str("0");
        }
        f.write_str(&self.coefficient_string())?;
        if self.zeros > 0 {
            write!(f, "e{}", self.zeros)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(s: &str) -> Magnitude {
        Magnitude::from_digits(s)
    }

    #[test]
    fn digits_keep_trailing_zeros_as_a_count() {
        let x = m("00012300000000000000000");
        assert_eq!(x.to_string(), "123e17");
        assert_eq!(x.zeros(), 17);
        assert_eq!(m("").to_string(), "0");
        assert_eq!(m("000").to_string(), "0");
        assert_eq!(Magnitude::from_u64(u64::MAX).to_u64(), Some(u64::MAX));
        assert_eq!(m("18446744073709551616").to_u64(), None);
    }

    #[test]
    fn sums_and_differences_carry_and_borrow_across_limbs() {
        let a = m("999999999999999999");
        let b = m("1");
        assert_eq!(a.add(&b).unwrap().to_string(), "1e18");
        assert_eq!(m("1").add(&m("1000")).unwrap().to_u64(), Some(1001));
        assert_eq!(m("1000000000000000000").sub(&b).unwrap(), a);
        assert_eq!(m("5").sub(&m("5")).unwrap(), Magnitude::default());
        let mut big = m("1");
        big.mul_pow10(MAX_DIGITS + 1);
        assert_eq!(big.add(&b), Err(TooManyDigits));
    }

    #[test]
    fn division_by_powers_of_ten_reports_what_it_cut_off() {
        assert_eq!(m("123000").div_pow10(3), (m("123"), false));
        assert_eq!(m("123456").div_pow10(3), (m("123"), true));
        assert_eq!(m("123456").div_pow10(6), (Magnitude::default(), true));
        assert_eq!(
            m("1234567890123456789").div_pow10(10),
            (m("123456789"), true)
        );
        assert_eq!(m("0").div_pow10(10), (Magnitude::default(), false));
    }

    #[test]
    fn removing_factors_keeps_the_quotients_trailing_zeros() {
        let mut x = m("80");
        x.mul_pow2(30);
        assert_eq!(x.remove_factors(1024), Ok(("80".to_owned(), 3)));
        assert_eq!(m("1000").remove_factors(10), Ok(("1".to_owned(), 3)));
        assert_eq!(m("1536").remove_factors(1024), Ok(("1536".to_owned(), 0)));
        assert_eq!(m("0").remove_factors(1024), Ok(("0".to_owned(), 0)));
        let mut huge = m("1");
        huge.mul_pow10(MAX_DIGITS + 1);
        assert_eq!(huge.remove_factors(1024), Err(TooManyDigits));
    }

    #[test]
    fn doubling_spells_out_zeros_and_comparison_needs_no_spelling() {
        let mut x = m("15");
        x.mul_pow10(1);
        x.mul_pow2(30);
        assert_eq!(x.to_u64(), Some(150 * (1 << 30)));
        let mut huge = m("1");
        huge.mul_pow10(1_000_000);
        assert_eq!(huge.cmp_scaled(0, &m("2"), 999_999), Ordering::Greater);
        assert_eq!(huge.cmp_scaled(-1, &m("10"), 999_998), Ordering::Equal);
        assert_eq!(m("19").cmp_scaled(0, &m("2"), 1), Ordering::Less);
        assert_eq!(huge.to_f64(), f64::INFINITY);
        assert_eq!(m("9007199254740993").to_f64(), 9007199254740992.0);
    }
}
