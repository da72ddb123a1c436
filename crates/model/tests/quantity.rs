//! Properties of Kubernetes quantities: the display parses back, every written form has its
//! exact value, and quantities order as their values do, however they were written.

use std::cmp::Ordering;

use proptest::prelude::*;
use ttlab_model::{MAX_QUANTITY_UNITS, ModelError, Quantity, QuantityFault};

/// The suffixes with their value as a fraction (numerator, denominator).
const SUFFIXES: [(&str, u128, u128); 18] = [
    ("", 1, 1),
    ("m", 1, 1000),
    ("k", 1000, 1),
    ("M", 1_000_000, 1),
    ("G", 1_000_000_000, 1),
    ("T", 1_000_000_000_000, 1),
    ("P", 1_000_000_000_000_000, 1),
    ("E", 1_000_000_000_000_000_000, 1),
    ("Ki", 1 << 10, 1),
    ("Mi", 1 << 20, 1),
    ("Gi", 1 << 30, 1),
    ("Ti", 1 << 40, 1),
    ("Pi", 1 << 50, 1),
    ("Ei", 1 << 60, 1),
    ("e0", 1, 1),
    ("e3", 1000, 1),
    ("e-3", 1, 1000),
    ("E6", 1_000_000, 1),
];

const MAX_MILLI: i128 = MAX_QUANTITY_UNITS as i128 * 1000;

/// A quantity as text with its exact value as a fraction: `int.frac` (0–3 decimals) and a
/// suffix.
fn written() -> impl Strategy<Value = (String, u128, u128)> {
    (0..=999_999u128, 0..=3u32, 0..=999u128, 0..SUFFIXES.len()).prop_map(
        |(int, decimals, frac, s)| {
            let (suffix, num, den) = SUFFIXES[s];
            let scale = 10u128.pow(decimals);
            let frac = frac % scale;
            let text = if decimals == 0 {
                format!("{int}{suffix}")
            } else {
                format!("{int}.{frac:0width$}{suffix}", width = decimals as usize)
            };
            (text, (int * scale + frac) * num, scale * den)
        },
    )
}

/// Thousandths of the unit across the whole range a quantity can be written in.
fn milli() -> impl Strategy<Value = i128> {
    prop_oneof![
        -10_000i128..=10_000,
        -MAX_MILLI..=MAX_MILLI,
        (-(1i128 << 20)..=(1 << 20)).prop_map(|n| n * 1000 * 1024),
        (-7i128..=7).prop_map(|n| n * 1000 * (1 << 60)),
        Just(MAX_MILLI),
        Just(-MAX_MILLI),
    ]
}

proptest! {
    #[test]
    fn the_display_parses_back_to_the_same_quantity(milli in milli()) {
        let q = Quantity::from_milli(milli);
        let shown = q.to_string();
        prop_assert_eq!(shown.parse::<Quantity>(), Ok(q), "{}", shown);
    }

    #[test]
    fn every_written_form_has_its_exact_value((text, num, den) in written()) {
        let exact_milli = num * 1000;
        match text.parse::<Quantity>() {
            Ok(q) => {
                prop_assert_eq!(exact_milli % den, 0, "{} is finer than a thousandth", text);
                prop_assert_eq!(q.milli(), i128::try_from(exact_milli / den).unwrap(), "{}", text);
                let negative: Quantity = format!("-{text}").parse().unwrap();
                prop_assert_eq!(negative.milli(), -q.milli());
            }
            Err(ModelError::InvalidQuantity { fault: QuantityFault::TooFine, .. }) => {
                prop_assert_ne!(exact_milli % den, 0, "{} is a whole number of thousandths", text);
            }
            Err(ModelError::InvalidQuantity { fault: QuantityFault::TooLarge, .. }) => {
                prop_assert!(exact_milli / den > MAX_MILLI as u128, "{}", text);
            }
            Err(e) => prop_assert!(false, "{}: {}", text, e),
        }
    }

    #[test]
    fn quantities_order_as_their_values((a, an, ad) in written(), (b, bn, bd) in written()) {
        let (Ok(qa), Ok(qb)) = (a.parse::<Quantity>(), b.parse::<Quantity>()) else {
            return Ok(());
        };
        let want: Ordering = (an * bd).cmp(&(bn * ad));
        prop_assert_eq!(qa.cmp(&qb), want, "{} vs {}", a, b);
        prop_assert_eq!(qa == qb, want == Ordering::Equal);
    }

    #[test]
    fn sums_are_exact(values in proptest::collection::vec(milli(), 0..8)) {
        let values: Vec<i128> = values.into_iter().map(|m| m / 1024).collect();
        let sum: Quantity = values.iter().map(|&m| Quantity::from_milli(m)).sum();
        prop_assert_eq!(sum.milli(), values.iter().sum::<i128>());
    }

    #[test]
    fn any_text_is_a_quantity_or_a_reason(text in "\\PC{0,24}") {
        match text.parse::<Quantity>() {
            Ok(q) => prop_assert!(q.milli().abs() <= MAX_MILLI),
            Err(e) => {
                let is_quantity_error = matches!(e, ModelError::InvalidQuantity { .. });
                prop_assert!(is_quantity_error, "{}", e);
            }
        }
    }

    #[test]
    fn number_like_text_never_panics(text in "[-+]?[0-9.]{0,45}([kMGTPEm]|[KMGTPE]i|[eE]-?[0-9]{1,3})?") {
        let _ = text.parse::<Quantity>();
    }
}
