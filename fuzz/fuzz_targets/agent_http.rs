//! The agent's HTTP handling: any bytes on a connection (delivered in reads of any size) get a
//! JSON answer with a status the protocol knows, or a silent close; limits are enforced before
//! the bytes are read; only a request carrying the right token is ever accepted.
//!
//! The input's first byte picks the read size. Every `@TOKEN@` in the rest is replaced by the
//! agent's real token, so the fuzzer reaches the authorized paths (body reading, the exec
//! request's JSON); accepted exec requests are returned, never run.

#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use ttlab_agent::AgentPaths;
use ttlab_agent::protocol::{
    AgentToken, ErrorResponse, MAX_EXEC_TIMEOUT_MS, MAX_REQUEST_BODY_BYTES, MAX_REQUEST_HEAD_BYTES,
    ReadyResponse,
};

const PLACEHOLDER: &[u8] = b"@TOKEN@";

struct Guest {
    _dir: tempfile::TempDir,
    paths: AgentPaths,
    token: AgentToken,
}

fn guest() -> &'static Guest {
    static GUEST: OnceLock<Guest> = OnceLock::new();
    GUEST.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let paths = AgentPaths::under(Some(dir.path()));
        let token = AgentToken::from_random_bytes(*b"fuzzing-token-0123456789abcdefgh");
        std::fs::create_dir_all(paths.token.parent().unwrap()).unwrap();
        std::fs::write(&paths.token, format!("{}\n", token.reveal())).unwrap();
        Guest {
            _dir: dir,
            paths,
            token,
        }
    })
}

fn with_token(data: &[u8], token: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() + 64);
    let mut rest = data;
    while let Some(at) = rest
        .windows(PLACEHOLDER.len())
        .position(|w| w == PLACEHOLDER)
    {
        out.extend_from_slice(&rest[..at]);
        out.extend_from_slice(token);
        rest = &rest[at + PLACEHOLDER.len()..];
    }
    out.extend_from_slice(rest);
    out
}

fuzz_target!(|data: &[u8]| {
    let Some((&step, rest)) = data.split_first() else {
        return;
    };
    let guest = guest();
    let input = with_token(rest, guest.token.reveal().as_bytes());
    let answered = ttlab_agent::answer_bytes(&input, usize::from(step) + 1, &guest.paths);

    // Never more than one head and one body is read.
    assert!(answered.consumed <= input.len());
    assert!(answered.consumed <= MAX_REQUEST_HEAD_BYTES + MAX_REQUEST_BODY_BYTES);

    // libFuzzer's comparison tracing can learn the token from the compare itself and put it in
    // the input literally: what counts is whether the request carried it, however it got there.
    let carried_token = input
        .windows(64)
        .any(|w| w == guest.token.reveal().as_bytes());
    let Some((status, body)) = answered.response else {
        // Closed unanswered: only when the peer sent nothing at all.
        assert!(
            input.is_empty(),
            "a non-empty request was dropped unanswered"
        );
        return;
    };
    match status {
        200 => {
            if let Some(exec) = &answered.exec {
                assert!(exec.timeout_ms >= 1 && exec.timeout_ms <= MAX_EXEC_TIMEOUT_MS);
                assert!(answered.read_all);
            } else if answered.console_size.is_none()
                && !answered.token_rotation
                && answered.power_off_at.is_none()
            {
                // A change accepted is not carried out here and answers an empty body; any
                // other 200 is the readiness answer.
                serde_json::from_slice::<ReadyResponse>(&body).expect("a ready answer");
            }
            // Accepted only with the real token.
            assert!(carried_token);
        }
        400 | 401 | 404 | 405 | 408 | 411 | 413 | 431 | 503 => {
            assert!(answered.exec.is_none());
            let e: ErrorResponse = serde_json::from_slice(&body).expect("an error body");
            assert!(!e.error.is_empty() && !e.message.is_empty());
            // Refusals that come before the body never read past the head.
            if matches!(status, 401 | 411 | 413 | 431 | 503) {
                assert!(
                    answered.consumed <= MAX_REQUEST_HEAD_BYTES,
                    "{status} after reading {} bytes",
                    answered.consumed
                );
            }
            // The expected token never appears in an answer to a request that did not carry it.
            if !carried_token {
                assert!(
                    !body
                        .windows(64)
                        .any(|w| w == guest.token.reveal().as_bytes())
                );
            }
        }
        other => panic!("unexpected status {other}"),
    }
});
