//! Requests over the agent's limits, or without the right token, are refused before their
//! bodies are read: counted in bytes taken from the connection, not timed.

use ttlab_agent::AgentPaths;
use ttlab_agent::protocol::{
    AgentToken, MAX_REQUEST_BODY_BYTES, MAX_REQUEST_HEAD_BYTES, MAX_REQUEST_HEADERS,
};

struct Guest {
    _dir: tempfile::TempDir,
    paths: AgentPaths,
    token: AgentToken,
}

fn guest() -> Guest {
    let dir = tempfile::tempdir().unwrap();
    let paths = AgentPaths::under(Some(dir.path()));
    let token = AgentToken::from_random_bytes([0x5a; 32]);
    std::fs::create_dir_all(paths.token.parent().unwrap()).unwrap();
    std::fs::write(&paths.token, format!("{}\n", token.reveal())).unwrap();
    Guest {
        _dir: dir,
        paths,
        token,
    }
}

/// A request head followed by `body_len` bytes of body actually present on the connection.
fn request(head: &str, body_len: usize) -> Vec<u8> {
    let mut bytes = head.as_bytes().to_vec();
    bytes.resize(bytes.len() + body_len, b'x');
    bytes
}

#[test]
fn an_announced_body_over_the_limit_is_refused_after_the_head_alone() {
    let g = guest();
    let huge = 100 * 1024 * 1024;
    let input = request(
        &format!(
            "POST /v1/exec HTTP/1.1\r\nAuthorization: Bearer {}\r\nContent-Length: {huge}\r\n\r\n",
            g.token.reveal()
        ),
        4 * MAX_REQUEST_BODY_BYTES,
    );
    for read_size in [1, 7, 2048, 65536] {
        let a = ttlab_agent::answer_bytes(&input, read_size, &g.paths);
        assert_eq!(a.response.as_ref().map(|r| r.0), Some(413));
        assert!(!a.read_all);
        assert!(a.exec.is_none());
        assert!(
            a.consumed <= MAX_REQUEST_HEAD_BYTES,
            "read {} bytes of a refused request (reads of {read_size})",
            a.consumed
        );
    }
}

#[test]
fn a_wrong_or_missing_token_is_refused_before_the_body_is_read() {
    let g = guest();
    let mut wrong = g.token.reveal().to_owned().into_bytes();
    wrong[63] = if wrong[63] == b'0' { b'1' } else { b'0' };
    let wrong = String::from_utf8(wrong).unwrap();
    for auth in [
        format!("Authorization: Bearer {wrong}\r\n"),
        format!("Authorization: Bearer {}\r\n", &g.token.reveal()[..63]),
        format!("Authorization: Basic {}\r\n", g.token.reveal()),
        String::new(),
    ] {
        let body_len = MAX_REQUEST_BODY_BYTES;
        let input = request(
            &format!("POST /v1/exec HTTP/1.1\r\n{auth}Content-Length: {body_len}\r\n\r\n"),
            body_len,
        );
        let a = ttlab_agent::answer_bytes(&input, 1024, &g.paths);
        assert_eq!(a.response.as_ref().map(|r| r.0), Some(401), "{auth}");
        assert!(a.exec.is_none());
        assert!(
            a.consumed < input.len() - body_len / 2,
            "{auth}: read {} of {} bytes before refusing",
            a.consumed,
            input.len()
        );
    }
}

#[test]
fn an_oversized_head_is_refused_at_the_head_limit() {
    let g = guest();
    let mut input = b"GET /v1/ready HTTP/1.1\r\nX-Pad: ".to_vec();
    input.resize(input.len() + 10 * MAX_REQUEST_HEAD_BYTES, b'a');
    let a = ttlab_agent::answer_bytes(&input, 4096, &g.paths);
    assert_eq!(a.response.as_ref().map(|r| r.0), Some(431));
    assert!(a.consumed <= MAX_REQUEST_HEAD_BYTES, "{}", a.consumed);

    let mut many = String::from("GET /v1/ready HTTP/1.1\r\n");
    for i in 0..=MAX_REQUEST_HEADERS {
        many.push_str(&format!("X-{i}: 1\r\n"));
    }
    many.push_str("\r\n");
    let a = ttlab_agent::answer_bytes(many.as_bytes(), 4096, &g.paths);
    assert_eq!(a.response.as_ref().map(|r| r.0), Some(431));
}

#[test]
fn only_the_exact_token_reaches_the_command_runner() {
    let g = guest();
    let body = r#"{"command":"true","timeout_ms":1000}"#;
    let exec = |token: &str| {
        let input = format!(
            "POST /v1/exec HTTP/1.1\r\nAuthorization: Bearer {token}\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        ttlab_agent::answer_bytes(input.as_bytes(), 4096, &g.paths)
    };
    let ok = exec(g.token.reveal());
    assert_eq!(ok.response.as_ref().map(|r| r.0), Some(200));
    assert_eq!(ok.exec.as_ref().map(|e| e.command.as_str()), Some("true"));
    assert!(ok.read_all);
    let mut near = g.token.reveal().to_owned();
    near.push('0');
    for wrong in [near.as_str(), &g.token.reveal()[1..], "", "0"] {
        let a = exec(wrong);
        assert_eq!(a.response.as_ref().map(|r| r.0), Some(401), "{wrong:?}");
        assert!(a.exec.is_none());
    }
}
