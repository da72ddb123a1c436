//! Kubernetes resource quantities (`1Gi`, `512Mi`, `500m`, `2`, `1e3`) as exact milli-units,
//! for quota arithmetic.

/// A quantity in thousandths of the unit (bytes for memory, cores for CPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Milli(pub i128);

impl Milli {
    /// Parses a quantity string; `None` if it is not one.
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.trim();
        let split = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
            .unwrap_or(s.len());
        let (num, suffix) = s.split_at(split);
        if num.is_empty() {
            return None;
        }
        let (int_part, frac_part) = num.split_once('.').unwrap_or((num, ""));
        let neg = int_part.starts_with('-');
        let int_digits = int_part.trim_start_matches(['+', '-']);
        let int: i128 = if int_digits.is_empty() {
            0
        } else {
            int_digits.parse().ok()?
        };
        // Keep up to 9 fractional digits, scaled to nano.
        let mut frac_nano: i128 = 0;
        for (i, c) in frac_part.chars().take(9).enumerate() {
            let d = i128::from(c.to_digit(10)? as u8);
            frac_nano += d * 10i128.pow(8 - i as u32);
        }
        let nano = int * 1_000_000_000 + frac_nano;
        let (mul_num, mul_den): (i128, i128) = match suffix {
            "" => (1, 1),
            "m" => (1, 1000),
            "k" => (1000, 1),
            "M" => (1_000_000, 1),
            "G" => (1_000_000_000, 1),
            "T" => (1_000_000_000_000, 1),
            "Ki" => (1 << 10, 1),
            "Mi" => (1 << 20, 1),
            "Gi" => (1 << 30, 1),
            "Ti" => (1 << 40, 1),
            "Pi" => (1 << 50, 1),
            e if e.starts_with(['e', 'E']) => (10i128.checked_pow(e[1..].parse().ok()?)?, 1),
            _ => return None,
        };
        // nano * mul / den -> milli = / 1_000_000
        let milli = nano.checked_mul(mul_num)? / mul_den / 1_000_000;
        Some(Self(if neg { -milli } else { milli }))
    }

    /// Parses a JSON quantity (string or number).
    pub fn from_json(v: &serde_json::Value) -> Option<Self> {
        match v {
            serde_json::Value::String(s) => Self::parse(s),
            serde_json::Value::Number(n) => n
                .as_i64()
                .map(|i| Self(i128::from(i) * 1000))
                .or_else(|| n.as_f64().map(|f| Self((f * 1000.0) as i128))),
            _ => None,
        }
    }

    /// Renders like the API server's canonical form: `4Gi`, `512Mi`, `500m`, `3`.
    pub fn render(self) -> String {
        let v = self.0;
        if v % 1000 != 0 {
            return format!("{v}m");
        }
        let units = v / 1000;
        if units == 0 {
            return "0".into();
        }
        for (suffix, size) in [
            ("Ti", 1i128 << 40),
            ("Gi", 1 << 30),
            ("Mi", 1 << 20),
            ("Ki", 1 << 10),
        ] {
            if units % size == 0 {
                return format!("{}{suffix}", units / size);
            }
        }
        units.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_renders_common_quantities() {
        assert_eq!(Milli::parse("1Gi"), Some(Milli(1_073_741_824_000)));
        assert_eq!(Milli::parse("500m"), Some(Milli(500)));
        assert_eq!(
            Milli::parse("1.5Gi").map(Milli::render).as_deref(),
            Some("1536Mi")
        );
        assert_eq!(Milli::parse("2").map(Milli::render).as_deref(), Some("2"));
        assert_eq!(Milli::parse("1e3"), Some(Milli(1_000_000)));
        assert_eq!(Milli::parse("1k"), Some(Milli(1_000_000)));
        assert_eq!(Milli::parse("abc"), None);
        assert_eq!(Milli::parse("1Xi"), None);
        assert_eq!(Milli(48 * (1 << 30) * 1000).render(), "48Gi");
    }
}
