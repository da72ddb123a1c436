//! Kubernetes resource quantities (`4Gi`, `512Mi`, `1.5G`, `500m`, `2`, `1e3`), exact.

use std::fmt;
use std::iter::Sum;
use std::ops::{Add, Sub};
use std::str::FromStr;

use crate::ModelError;

/// The largest magnitude a quantity may be written with, in units: 2⁶³−1, the largest the
/// Kubernetes API server keeps (it clamps larger values; they are refused here).
pub const MAX_QUANTITY_UNITS: i64 = i64::MAX;

/// The most significant digits a quantity's number may have (leading zeros of the number and
/// trailing zeros of its fraction do not count).
pub const MAX_QUANTITY_DIGITS: usize = 38;

/// The exponents a quantity may be written with (`1e3`, `5e-3`): the span of the decimal
/// suffixes, from `m` (10⁻³) to `E` (10¹⁸).
pub const QUANTITY_EXPONENTS: std::ops::RangeInclusive<i32> = -3..=18;

/// A Kubernetes resource quantity, held exactly in thousandths of its unit (bytes for memory,
/// cores for CPU), so that sums and comparisons (a quota's usage against its limit) are exact.
///
/// It parses the forms Kubernetes accepts: an optional sign, a decimal number (`4`, `1.5`,
/// `1.`, `.5`), and a binary suffix (`Ki`, `Mi`, `Gi`, `Ti`, `Pi`, `Ei`), a decimal suffix
/// (`m`, `k`, `M`, `G`, `T`, `P`, `E`), an exponent (`e3`, `E-3`, in [`QUANTITY_EXPONENTS`])
/// or none. A value finer than a thousandth (`0.5m`, `1.0001`) is refused rather than rounded
/// (the API server rounds it up to a nano-unit), and so is a magnitude above
/// [`MAX_QUANTITY_UNITS`]. How the quantity was written is not kept: `1.5Gi` and `1536Mi` are
/// equal (see [`QuantityParts`] for the written form).
///
/// It displays in one form: the largest binary suffix that divides it (`1536Mi`, `48Gi`),
/// else whole units (`3`, `1000`), else thousandths (`500m`); that text parses back to the
/// same quantity.
///
/// ```
/// use ttlab_model::Quantity;
///
/// let q: Quantity = "1.5Gi".parse().unwrap();
/// assert_eq!(q.whole_units(), Some(1_610_612_736));
/// assert_eq!(q.to_string(), "1536Mi");
/// assert_eq!("500m".parse::<Quantity>().unwrap().milli(), 500);
/// assert!("1e3".parse::<Quantity>().unwrap() > "999".parse().unwrap());
/// assert!("4GB".parse::<Quantity>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Quantity {
    milli: i128,
}

impl Quantity {
    /// Nothing: `0`.
    pub const ZERO: Quantity = Quantity { milli: 0 };

    /// The quantity of `milli` thousandths of the unit.
    pub const fn from_milli(milli: i128) -> Self {
        Self { milli }
    }

    /// The quantity of `units` whole units (bytes, cores, objects).
    pub const fn from_units(units: i64) -> Self {
        Self {
            milli: units as i128 * 1000,
        }
    }

    /// The value in thousandths of the unit.
    pub const fn milli(self) -> i128 {
        self.milli
    }

    /// The value in whole units, if it is a whole number of them (`1500m` is not).
    pub const fn whole_units(self) -> Option<i128> {
        if self.milli % 1000 == 0 {
            Some(self.milli / 1000)
        } else {
            None
        }
    }
}

impl Add for Quantity {
    type Output = Quantity;
    /// The sum (saturating at `i128`'s bounds, far beyond any quantity that parses).
    fn add(self, other: Quantity) -> Quantity {
        Quantity::from_milli(self.milli.saturating_add(other.milli))
    }
}

impl Sub for Quantity {
    type Output = Quantity;
    /// The difference (saturating at `i128`'s bounds, far beyond any quantity that parses).
    fn sub(self, other: Quantity) -> Quantity {
        Quantity::from_milli(self.milli.saturating_sub(other.milli))
    }
}

impl Sum for Quantity {
    fn sum<I: Iterator<Item = Quantity>>(iter: I) -> Quantity {
        iter.fold(Quantity::ZERO, Add::add)
    }
}

/// The binary suffixes, largest first, as powers of two.
const BINARY: [(&str, u32); 6] = [
    ("Ei", 60),
    ("Pi", 50),
    ("Ti", 40),
    ("Gi", 30),
    ("Mi", 20),
    ("Ki", 10),
];

/// The decimal suffixes, as powers of ten.
const DECIMAL: [(&str, i32); 7] = [
    ("m", -3),
    ("k", 3),
    ("M", 6),
    ("G", 9),
    ("T", 12),
    ("P", 15),
    ("E", 18),
];

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(units) = self.whole_units() else {
            return write!(f, "{}m", self.milli);
        };
        if units != 0 {
            for (suffix, power) in BINARY {
                let size = 1i128 << power;
                if units % size == 0 {
                    return write!(f, "{}{suffix}", units / size);
                }
            }
        }
        write!(f, "{units}")
    }
}

impl FromStr for Quantity {
    type Err = ModelError;
    fn from_str(text: &str) -> Result<Self, ModelError> {
        QuantityParts::lex(text)
            .and_then(QuantityParts::value)
            .map_err(|fault| ModelError::InvalidQuantity {
                value: text.to_owned(),
                fault,
            })
    }
}

/// What is wrong with a quantity's text (the reason inside [`ModelError::InvalidQuantity`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantityFault {
    /// The text is empty.
    Empty,
    /// No number before the suffix (`Gi`), or a number with two decimal points (`1.2.3`).
    NoNumber,
    /// The suffix is not a Kubernetes one (`GB`, `gi`, ` Gi`).
    UnknownSuffix,
    /// An exponent that is not an integer in [`QUANTITY_EXPONENTS`] (`1e40`, `1e`).
    Exponent,
    /// More than [`MAX_QUANTITY_DIGITS`] significant digits.
    TooLong,
    /// Finer than a thousandth of the unit (`0.5m`).
    TooFine,
    /// Larger in magnitude than [`MAX_QUANTITY_UNITS`].
    TooLarge,
}

impl fmt::Display for QuantityFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Empty => "it is empty",
            Self::NoNumber => "expected a number such as 4, 512 or 1.5 before the unit",
            Self::UnknownSuffix => {
                "unknown unit (use Ki, Mi, Gi, Ti, Pi, Ei, k, M, G, T, P or E; \
                 note that `GB` and `gi` are not Kubernetes units)"
            }
            Self::Exponent => "the exponent must be an integer from -3 to 18",
            Self::TooLong => "the number is too long",
            Self::TooFine => "it is finer than a thousandth of the unit",
            Self::TooLarge => "it is too large",
        })
    }
}

/// A quantity's suffix, as written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Suffix {
    /// A decimal suffix, as its power of ten: none (0), `m` (-3), `k` (3) … `E` (18).
    Decimal(i32),
    /// A binary suffix, as its power of two: `Ki` (10) … `Ei` (60).
    Binary(u32),
    /// An exponent: `e3`, `E-3`.
    Exponent(i32),
}

/// A quantity as written, before any arithmetic: for a caller whose rule is about the form
/// (no sign, no exponent) as well as the value.
///
/// ```
/// use ttlab_model::{QuantityParts, Suffix};
///
/// let parts = QuantityParts::lex("-1.5Gi").unwrap();
/// assert!(parts.negative && parts.signed);
/// assert_eq!((parts.integer, parts.fraction), ("1", Some("5")));
/// assert_eq!(parts.suffix, Suffix::Binary(30));
/// assert_eq!(parts.value().unwrap().whole_units(), Some(-1_610_612_736));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantityParts<'a> {
    /// A sign was written (`+` or `-`).
    pub signed: bool,
    /// The sign was `-`.
    pub negative: bool,
    /// The digits before the decimal point (empty in `.5`).
    pub integer: &'a str,
    /// The digits after the decimal point, if one was written (empty in `1.`).
    pub fraction: Option<&'a str>,
    /// The suffix.
    pub suffix: Suffix,
}

impl<'a> QuantityParts<'a> {
    /// Splits `text` into sign, number and suffix, as Kubernetes reads a quantity.
    pub fn lex(text: &'a str) -> Result<Self, QuantityFault> {
        if text.is_empty() {
            return Err(QuantityFault::Empty);
        }
        let (signed, negative, unsigned) = match text.as_bytes()[0] {
            b'-' => (true, true, &text[1..]),
            b'+' => (true, false, &text[1..]),
            _ => (false, false, text),
        };
        let number_end = unsigned
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(unsigned.len());
        let (number, suffix) = unsigned.split_at(number_end);
        let (integer, fraction) = match number.split_once('.') {
            Some((i, f)) => (i, Some(f)),
            None => (number, None),
        };
        if (integer.is_empty() && fraction.is_none_or(str::is_empty))
            || fraction.is_some_and(|f| f.contains('.'))
        {
            return Err(QuantityFault::NoNumber);
        }
        let suffix = if let Some(&(_, power)) = BINARY.iter().find(|(s, _)| *s == suffix) {
            Suffix::Binary(power)
        } else if let Some(&(_, power)) = DECIMAL.iter().find(|(s, _)| *s == suffix) {
            Suffix::Decimal(power)
        } else if suffix.is_empty() {
            Suffix::Decimal(0)
        } else if let Some(exponent) = suffix.strip_prefix(['e', 'E']) {
            match exponent.parse::<i32>() {
                Ok(e) if QUANTITY_EXPONENTS.contains(&e) => Suffix::Exponent(e),
                _ => return Err(QuantityFault::Exponent),
            }
        } else {
            return Err(QuantityFault::UnknownSuffix);
        };
        Ok(Self {
            signed,
            negative,
            integer,
            fraction,
            suffix,
        })
    }

    /// The exact value.
    pub fn value(self) -> Result<Quantity, QuantityFault> {
        let fraction = self.fraction.unwrap_or("").trim_end_matches('0');
        let digits = format!("{}{fraction}", self.integer);
        let significant = digits.trim_start_matches('0');
        if significant.len() > MAX_QUANTITY_DIGITS {
            return Err(QuantityFault::TooLong);
        }
        // value = mantissa / 10^f × suffix; in thousandths: mantissa × suffix × 10^(3 - f).
        let mantissa: i128 = if significant.is_empty() {
            0
        } else {
            significant.parse().map_err(|_| QuantityFault::TooLong)?
        };
        let f = i32::try_from(fraction.len()).map_err(|_| QuantityFault::TooLong)?;
        let milli = match self.suffix {
            Suffix::Decimal(e) | Suffix::Exponent(e) => scale10(mantissa, e + 3 - f)?,
            Suffix::Binary(k) => scale2(mantissa, k, f - 3)?,
        };
        if milli > i128::from(MAX_QUANTITY_UNITS) * 1000 {
            return Err(QuantityFault::TooLarge);
        }
        Ok(Quantity::from_milli(if self.negative {
            -milli
        } else {
            milli
        }))
    }
}

/// `mantissa × 10^e`, exactly.
fn scale10(mantissa: i128, e: i32) -> Result<i128, QuantityFault> {
    if mantissa == 0 {
        return Ok(0);
    }
    let power = |n: i32| 10i128.checked_pow(n.unsigned_abs());
    if e >= 0 {
        power(e)
            .and_then(|p| mantissa.checked_mul(p))
            .ok_or(QuantityFault::TooLarge)
    } else {
        match power(e) {
            Some(p) if mantissa % p == 0 => Ok(mantissa / p),
            _ => Err(QuantityFault::TooFine),
        }
    }
}

/// `mantissa × 2^k / 10^d`, exactly.
fn scale2(mantissa: i128, k: u32, d: i32) -> Result<i128, QuantityFault> {
    if mantissa == 0 {
        return Ok(0);
    }
    if d <= 0 {
        let shifted = 1i128
            .checked_shl(k)
            .and_then(|p| mantissa.checked_mul(p))
            .ok_or(QuantityFault::TooLarge)?;
        return scale10(shifted, -d);
    }
    // 10^d = 5^d × 2^d: the fives must divide the mantissa, the twos the mantissa × 2^k.
    let d = d.unsigned_abs();
    let fives = 5i128
        .checked_pow(d)
        .filter(|p| mantissa % p == 0)
        .ok_or(QuantityFault::TooFine)?;
    let rest = mantissa / fives;
    if rest.trailing_zeros() + k < d {
        return Err(QuantityFault::TooFine);
    }
    if k >= d {
        1i128
            .checked_shl(k - d)
            .and_then(|p| rest.checked_mul(p))
            .ok_or(QuantityFault::TooLarge)
    } else {
        Ok(rest >> (d - k))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(text: &str) -> Quantity {
        text.parse().unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    fn fault(text: &str) -> QuantityFault {
        match text.parse::<Quantity>() {
            Err(ModelError::InvalidQuantity { fault, .. }) => fault,
            other => panic!("{text:?}: {other:?}"),
        }
    }

    #[test]
    fn every_form_parses_to_its_exact_value() {
        for (text, milli) in [
            ("0", 0),
            ("4Gi", 4i128 << 30),
            ("512Mi", 512 << 20),
            ("1.5Gi", 3 << 29),
            ("2G", 2_000_000_000),
            ("1e9", 1_000_000_000),
            ("1E3", 1000),
            ("1Ki", 1024),
            ("1Pi", 1 << 50),
            ("1Ei", 1 << 60),
            ("1P", 1_000_000_000_000_000),
            ("1E", 1_000_000_000_000_000_000),
            (".5Gi", 1 << 29),
            ("1.Gi", 1 << 30),
            ("+2", 2),
            ("-2", -2),
            ("0.000Gi", 0),
            ("1.000000000000000000000000000000000000000000", 1),
        ] {
            assert_eq!(q(text).whole_units(), Some(milli), "{text}");
        }
        assert_eq!(q("5e-3").milli(), 5);
        assert_eq!(q("500m").milli(), 500);
        assert_eq!(q("1500m").milli(), 1500);
        assert_eq!(q("0.1").milli(), 100);
        assert_eq!(q("-0.5").milli(), -500);
        assert_eq!(q("1.5Ki").milli(), 1_536_000);
        // 2^-30 GiB is one byte: exact however many decimals it takes.
        assert_eq!(q("0.000000000931322574615478515625Gi").milli(), 1000);
        assert_eq!(q("0.0009765625Ki").milli(), 1000);
        assert_eq!(
            q("9223372036854775807").whole_units(),
            Some(i128::from(i64::MAX))
        );
    }

    #[test]
    fn bad_text_says_what_is_wrong() {
        for (text, want) in [
            ("", QuantityFault::Empty),
            ("Gi", QuantityFault::NoNumber),
            (".", QuantityFault::NoNumber),
            ("-", QuantityFault::NoNumber),
            ("1.2.3Gi", QuantityFault::NoNumber),
            ("4GB", QuantityFault::UnknownSuffix),
            ("4gi", QuantityFault::UnknownSuffix),
            ("4 Gi", QuantityFault::UnknownSuffix),
            (" 4Gi", QuantityFault::NoNumber),
            ("4Gi ", QuantityFault::UnknownSuffix),
            ("1K", QuantityFault::UnknownSuffix),
            ("2Zi", QuantityFault::UnknownSuffix),
            ("1e40", QuantityFault::Exponent),
            ("1e-4", QuantityFault::Exponent),
            ("1e", QuantityFault::Exponent),
            ("1e1.5", QuantityFault::Exponent),
            ("0.5m", QuantityFault::TooFine),
            ("1.0001", QuantityFault::TooFine),
            ("0.0001Ki", QuantityFault::TooFine),
            ("9223372036854775808", QuantityFault::TooLarge),
            ("8Ei", QuantityFault::TooLarge),
            ("10E", QuantityFault::TooLarge),
            (&"9".repeat(39), QuantityFault::TooLong),
        ] {
            assert_eq!(fault(text), want, "{text:?}");
        }
        let err = "4GB".parse::<Quantity>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid quantity \"4GB\": unknown unit (use Ki, Mi, Gi, Ti, Pi, Ei, k, M, G, T, P \
             or E; note that `GB` and `gi` are not Kubernetes units)"
        );
    }

    #[test]
    fn display_is_one_form_that_parses_back() {
        for (text, shown) in [
            ("1Gi", "1Gi"),
            ("1.5Gi", "1536Mi"),
            ("48Gi", "48Gi"),
            ("1024Ti", "1Pi"),
            ("2", "2"),
            ("1k", "1000"),
            ("500m", "500m"),
            ("0", "0"),
            ("0Gi", "0"),
            ("-1Ki", "-1Ki"),
            ("-1.5", "-1500m"),
        ] {
            assert_eq!(q(text).to_string(), shown, "{text}");
            assert_eq!(q(shown), q(text), "{shown}");
        }
    }

    #[test]
    fn sums_are_exact() {
        let total: Quantity = ["100m", "1.9", "0.5Ki"].into_iter().map(q).sum();
        assert_eq!(total.milli(), 100 + 1900 + 512_000);
        assert_eq!((q("1Gi") - q("512Mi")).to_string(), "512Mi");
        assert_eq!(
            Quantity::from_units(3) + Quantity::from_milli(500),
            q("3.5")
        );
    }
}
