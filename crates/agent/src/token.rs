//! The bearer-token check: extracting the token from `Authorization` and comparing it with the
//! expected one in constant time.
//!
//! The comparison always walks every byte of the expected token (its length is public: 64 hex
//! digits) and folds the differences into one accumulator, so how long it takes does not
//! depend on where the first wrong byte is. The presented value is first copied into a buffer
//! of the expected length; a presented value of another length is wrong through a length bit
//! folded into the same accumulator, not through an early return.

use crate::protocol::AgentToken;

/// Length in bytes of a token's text form.
const TOKEN_LEN: usize = AgentToken::BYTES * 2;

/// The token in an `Authorization` header value (`Bearer <token>`, scheme case-insensitive,
/// surrounding spaces ignored). `None` for any other scheme or an empty token.
pub fn bearer(header_value: &[u8]) -> Option<&[u8]> {
    let value = header_value.trim_ascii();
    let (scheme, rest) = value.split_at_checked(6)?;
    if !scheme.eq_ignore_ascii_case(b"bearer") || rest.first() != Some(&b' ') {
        return None;
    }
    let token = rest.trim_ascii();
    (!token.is_empty()).then_some(token)
}

/// Whether `presented` is exactly `expected`, compared in constant time.
pub fn matches(expected: &AgentToken, presented: &[u8]) -> bool {
    compare(expected, presented, |_| {})
}

/// The comparison behind [`matches`]; `visit` is called with the index of every byte pair it
/// compares (always `0..64`, in order), so tests can check that no input ends it early.
fn compare(expected: &AgentToken, presented: &[u8], mut visit: impl FnMut(usize)) -> bool {
    let expected = expected.reveal().as_bytes();
    let mut padded = [0u8; TOKEN_LEN];
    for (dst, src) in padded.iter_mut().zip(presented) {
        *dst = *src;
    }
    // Any length other than 64 is a mismatch; folded in, not returned early.
    let mut diff = u8::from(presented.len() != TOKEN_LEN);
    for i in 0..TOKEN_LEN {
        visit(i);
        diff |= std::hint::black_box(expected[i] ^ padded[i]);
    }
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token() -> AgentToken {
        AgentToken::from_random_bytes(std::array::from_fn(|i| i as u8 * 7))
    }

    #[test]
    fn bearer_extracts_the_token_and_refuses_other_schemes() {
        assert_eq!(bearer(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer(b"  bearer   abc  "), Some(&b"abc"[..]));
        assert_eq!(bearer(b"BEARER abc"), Some(&b"abc"[..]));
        assert_eq!(bearer(b"Basic abc"), None);
        assert_eq!(bearer(b"Bearerabc"), None);
        assert_eq!(bearer(b"Bearer "), None);
        assert_eq!(bearer(b"Bearer"), None);
        assert_eq!(bearer(b""), None);
    }

    #[test]
    fn only_the_exact_token_matches() {
        let t = token();
        let good = t.reveal().as_bytes().to_vec();
        assert!(matches(&t, &good));

        let mut first = good.clone();
        first[0] ^= 1;
        let mut last = good.clone();
        last[63] ^= 1;
        let mut longer = good.clone();
        longer.push(b'0');
        for wrong in [
            &first[..],
            &last[..],
            &good[..63],
            &longer[..],
            b"",
            &[0u8; 64][..],
        ] {
            assert!(!matches(&t, wrong), "{wrong:?} must not match");
        }
    }

    #[test]
    fn every_comparison_visits_all_64_bytes_whatever_the_input() {
        let t = token();
        let good = t.reveal().as_bytes().to_vec();
        let mut first = good.clone();
        first[0] = b'z';
        let huge = vec![b'a'; 10_000];
        let inputs: [&[u8]; 6] = [&good, &first, b"", b"x", &good[..63], &huge];
        for input in inputs {
            let mut visited = Vec::new();
            compare(&t, input, |i| visited.push(i));
            assert_eq!(
                visited,
                (0..TOKEN_LEN).collect::<Vec<_>>(),
                "input of {} bytes",
                input.len()
            );
        }
    }
}
