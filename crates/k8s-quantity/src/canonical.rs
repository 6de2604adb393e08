//! Writing a quantity as upstream does: `Quantity.String` and `CanonicalizeBytes`
//! (`quantity.go`), `AsCanonicalBytes` and `AsCanonicalBase1024Bytes` (`amount.go`), and the
//! suffixes of `suffix.go` (`k8s.io/apimachinery/pkg/api/resource`, v0.36).

use std::cmp::Ordering;

use crate::decimal::Magnitude;
use crate::{Amount, Format, Int64Amount, Quantity, cmp_exact};

impl Quantity {
    /// The text upstream writes for this quantity (`Quantity.String`, `MarshalJSON`): the
    /// cached string where [`Quantity::parse`] kept one, else `CanonicalizeBytes` of the value
    /// in its [`Format`]:
    /// - zero is `0`;
    /// - `BinarySI` for a whole number of magnitude 1024 or more: the number with the most
    ///   factors of 1024 taken out as `Ki` .. `Ei` (`1024Mi` is `1Gi`, `1.5Gi` is `1536Mi`);
    ///   other numbers are written as `DecimalSI` (`0.5Ki` is `512`);
    /// - `DecimalSI` and `DecimalExponent`: the digits without trailing zeros, padded until
    ///   the exponent is a multiple of three, then the exponent as `n` .. `E` (`1000` is `1k`,
    ///   `1.5` is `1500m`) or as `e3`.
    ///
    /// Like upstream, an exponent without a suffix (`DecimalSI` beyond `E` or below `n`,
    /// `BinarySI` beyond `Ei`) is dropped from the text. A `BinarySI` number beyond 10,000
    /// digits is written as `DecimalSI` (upstream has no limit).
    pub fn canonical_string(&self) -> String {
        match self.cached_string() {
            Some(s) => s.to_owned(),
            None => canonicalize(&self.amount, self.format),
        }
    }
}

/// `CanonicalizeBytes`, number and suffix in one string.
fn canonicalize(amount: &Amount, format: Format) -> String {
    let (negative, magnitude, exponent) = parts(amount);
    if magnitude.is_zero() {
        return "0".to_owned();
    }
    let sign = if negative { "-" } else { "" };
    if format == Format::BinarySi
        && !within_1024(amount)
        && let Some((number, times)) = base1024(&magnitude, exponent)
    {
        let suffix = match times {
            1 => "Ki",
            2 => "Mi",
            3 => "Gi",
            4 => "Ti",
            5 => "Pi",
            6 => "Ei",
            _ => "",
        };
        return format!("{sign}{number}{suffix}");
    }
    // `AsCanonicalBytes`: factors of ten into the exponent, then the exponent down to a
    // multiple of three.
    let mut number = magnitude.coefficient_string();
    let mut exponent = exponent + i128::from(magnitude.zeros());
    while exponent % 3 != 0 {
        number.push('0');
        exponent -= 1;
    }
    let suffix = match format {
        Format::DecimalExponent if exponent == 0 => String::new(),
        Format::DecimalExponent => format!("e{exponent}"),
        Format::DecimalSi | Format::BinarySi => match exponent {
            -9 => "n",
            -6 => "u",
            -3 => "m",
            3 => "k",
            6 => "M",
            9 => "G",
            12 => "T",
            15 => "P",
            18 => "E",
            _ => "",
        }
        .to_owned(),
    };
    format!("{sign}{number}{suffix}")
}

/// Sign, magnitude and decimal exponent of an amount: `±magnitude * 10^exponent`.
fn parts(amount: &Amount) -> (bool, Magnitude, i128) {
    match amount {
        Amount::Int(i) => (
            i.value < 0,
            Magnitude::from_u64(i.value.unsigned_abs()),
            i128::from(i.scale),
        ),
        Amount::Dec(d) => (d.negative, d.unscaled.clone(), -i128::from(d.scale)),
    }
}

/// `-1024 < amount < 1024` (`CmpInt64`), where `BinarySI` is written as `DecimalSI`.
fn within_1024(amount: &Amount) -> bool {
    let int = |value| Amount::Int(Int64Amount { value, scale: 0 });
    cmp_exact(amount, &int(-1024)) == Ordering::Greater
        && cmp_exact(amount, &int(1024)) == Ordering::Less
}

/// `AsScale(0)` then `AsCanonicalBase1024Bytes`: for a whole number, the digits of the
/// magnitude with the factors of 1024 removed and their count; `None` for a fraction (upstream writes it as
/// `DecimalSI`) or a number beyond 10,000 digits.
fn base1024(magnitude: &Magnitude, exponent: i128) -> Option<(String, u32)> {
    let to_units = exponent + i128::from(magnitude.zeros());
    if to_units < 0 {
        return None;
    }
    let mut whole = magnitude.clone();
    if exponent >= 0 {
        whole.mul_pow10(u64::try_from(exponent).ok()?);
    } else {
        // Only trailing zeros go: the number is whole.
        whole = magnitude.div_pow10(u64::try_from(-exponent).ok()?).0;
    }
    whole.remove_factors(1024).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(s: &str) -> String {
        Quantity::parse(s).unwrap().canonical_string()
    }

    #[test]
    fn canonical_strings_match_upstream() {
        for (input, want) in [
            ("0", "0"),
            ("00", "0"),
            ("-0", "0"),
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
            ("0.5Mi", "512Ki"),
            ("1.5", "1500m"),
            ("80Gi", "80Gi"),
            ("12e1", "120"),
            ("1200", "1200"),
            ("-2048Ki", "-2Mi"),
            ("-1.5Gi", "-1536Mi"),
            ("1Pi", "1Pi"),
            ("10Ei", "9223372036854775807"),
            ("1.0000000001Ki", "1024000000103n"),
            ("1e21", "1e21"),
            ("1000E", "1"),
            ("1E-12", "1e-9"),
        ] {
            assert_eq!(canon(input), want, "{input}");
        }
        assert_eq!(
            Quantity::new(5 * (1 << 30), Format::BinarySi).canonical_string(),
            "5Gi"
        );
        assert_eq!(
            Quantity::new(1000, Format::BinarySi).canonical_string(),
            "1k"
        );
        assert_eq!(
            Quantity::new(1536, Format::BinarySi).canonical_string(),
            "1536"
        );
        assert_eq!(
            Quantity::new(-1, Format::DecimalExponent).canonical_string(),
            "-1"
        );
    }

    #[test]
    fn sums_lose_the_cached_string_and_keep_the_format() {
        let sum = Quantity::parse("512Mi")
            .unwrap()
            .add(&Quantity::parse("512Mi").unwrap())
            .unwrap();
        assert_eq!(sum.canonical_string(), "1Gi");
        let from_zero = Quantity::from_int(0)
            .add(&Quantity::parse("2Ki").unwrap())
            .unwrap();
        assert_eq!(from_zero.format(), Format::BinarySi);
        assert_eq!(from_zero.canonical_string(), "2Ki");
    }
}
