//! `POST /v1/token` on the real `ttlab-agent` binary over raw TCP on 127.0.0.1: after a
//! rotation only the new token opens any endpoint, also after a restart; the token file is
//! replaced whole with mode 0600; malformed bodies and a file that cannot be written change
//! nothing; concurrent rotations have exactly one winner.

mod support;

use std::io::Write as _;
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use support::{PATIENCE, RunningAgent, read_answer};
use ttlab_agent::protocol::{self, AgentToken, ErrorResponse, ExecResponse, TokenRotated};

fn error(body: &str) -> ErrorResponse {
    serde_json::from_str(body).unwrap_or_else(|_| panic!("not an error body: {body}"))
}

fn rotate(agent: &RunningAgent, with: &AgentToken, to: &AgentToken) -> (u16, String) {
    let json = format!(r#"{{"token":"{}"}}"#, to.reveal());
    agent.post_with(with, "/v1/token", &json)
}

/// `POST path` to the agent at `addr` (from threads: a `RunningAgent` stays on its own).
fn post_at(addr: SocketAddr, token: &AgentToken, path: &str, json: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(PATIENCE)).expect("timeout");
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer {}\r\nContent-Length: {}\r\n\r\n{json}",
        token.reveal(),
        json.len()
    );
    stream.write_all(request.as_bytes()).expect("send");
    read_answer(&mut stream)
}

fn rotated(body: &str) -> TokenRotated {
    serde_json::from_str(body).unwrap_or_else(|_| panic!("not a rotation answer: {body}"))
}

/// One request to each endpoint, valid apart from the token: (what, raw request).
fn every_endpoint(token: &AgentToken) -> Vec<(&'static str, Vec<u8>)> {
    let post = |path: &str, json: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer {}\r\nContent-Length: {}\r\n\r\n{json}",
            token.reveal(),
            json.len()
        )
        .into_bytes()
    };
    let get = |path: &str| {
        format!(
            "GET {path} HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer {}\r\n\r\n",
            token.reveal()
        )
        .into_bytes()
    };
    let same_token = format!(r#"{{"token":"{}"}}"#, token.reveal());
    vec![
        ("ready", get("/v1/ready")),
        (
            "exec",
            post("/v1/exec", r#"{"command":"echo ran","timeout_ms":10000}"#),
        ),
        (
            "console-size",
            post("/v1/console-size", r#"{"rows":40,"cols":120}"#),
        ),
        ("token", post("/v1/token", &same_token)),
        (
            "deadline",
            post("/v1/deadline", r#"{"power_off_at":1767225600}"#),
        ),
        ("unknown path", get("/nowhere")),
    ]
}

fn token_file(agent: &RunningAgent) -> String {
    std::fs::read_to_string(agent.path(protocol::TOKEN_PATH)).expect("token file")
}

/// Everything in the token's directory (no temporary file may be left behind).
fn token_dir(agent: &RunningAgent) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(agent.path("/etc/ttlab"))
        .expect("token dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// All log lines so far.
fn drain_log(agent: &RunningAgent) -> Vec<String> {
    let mut lines = Vec::new();
    while let Ok(line) = agent.log.recv_timeout(Duration::from_millis(200)) {
        lines.push(line);
    }
    lines
}

#[test]
fn after_a_rotation_only_the_new_token_opens_every_endpoint_also_after_a_restart() {
    let mut agent = RunningAgent::start();
    let old = agent.token.clone();
    let new = AgentToken::from_random_bytes([0x3c; 32]);

    let (status, body) = rotate(&agent, &old, &new);
    assert_eq!(status, 200, "{body}");
    assert_eq!(rotated(&body), TokenRotated { changed: true });
    assert!(!body.contains(new.reveal()) && !body.contains(old.reveal()));

    // The file holds the new token, written whole with mode 0600, and nothing else is left.
    assert_eq!(token_file(&agent), format!("{}\n", new.reveal()));
    let mode = std::fs::metadata(agent.path(protocol::TOKEN_PATH))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o7777, 0o600, "mode {mode:o}");
    assert_eq!(token_dir(&agent), ["agent.token"]);

    let check = |agent: &RunningAgent| {
        for (what, request) in every_endpoint(&old) {
            let (status, body) = agent.raw(&request);
            assert_eq!(status, 401, "old token on {what}: {body}");
            assert_eq!(error(&body).error, protocol::error_code::UNAUTHORIZED);
        }
        for (what, request) in every_endpoint(&new) {
            let (status, body) = agent.raw(&request);
            let expected = if what == "unknown path" { 404 } else { 200 };
            assert_eq!(status, expected, "new token on {what}: {body}");
            if what == "exec" {
                let r: ExecResponse = serde_json::from_str(&body).unwrap();
                assert_eq!(r.stdout, "ran\n");
            }
            if what == "token" {
                assert_eq!(rotated(&body), TokenRotated { changed: false });
            }
        }
    };
    check(&agent);
    // Rotating to the token in use rewrote nothing.
    assert_eq!(token_file(&agent), format!("{}\n", new.reveal()));

    let log = drain_log(&agent);
    assert!(
        log.iter().any(|l| l.contains("POST /v1/token -> 200")),
        "{log:?}"
    );
    for line in &log {
        assert!(
            !line.contains(old.reveal()) && !line.contains(new.reveal()),
            "a token in the log: {line}"
        );
    }

    agent.restart();
    check(&agent);
}

#[test]
fn a_request_authenticated_with_the_old_token_completes_after_the_rotation() {
    let agent = RunningAgent::start();
    let old = agent.token.clone();
    let new = AgentToken::from_random_bytes([0x4d; 32]);
    let started = agent.root.path().join("started");
    let running = std::thread::spawn({
        let (addr, old) = (agent.addr, old.clone());
        let started = started.display().to_string();
        move || {
            let json = format!(
                r#"{{"command":"touch {started}; sleep 1; echo finished","timeout_ms":30000}}"#
            );
            post_at(addr, &old, "/v1/exec", &json)
        }
    });
    let waited = std::time::Instant::now();
    while !started.exists() {
        assert!(waited.elapsed() < PATIENCE, "the command never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    let (status, body) = rotate(&agent, &old, &new);
    assert_eq!(status, 200, "{body}");
    let (status, body) = running.join().unwrap();
    assert_eq!(status, 200, "{body}");
    let r: ExecResponse = serde_json::from_str(&body).unwrap();
    assert_eq!(r.stdout, "finished\n");
    let (status, _) = agent.exec_json(r#"{"command":"true","timeout_ms":1000}"#);
    assert_eq!(status, 401, "the old token after the rotation");
}

#[test]
fn malformed_rotations_get_400_never_repeat_the_body_and_leave_the_file_untouched() {
    let agent = RunningAgent::start();
    let path = agent.path(protocol::TOKEN_PATH);
    let before = std::fs::read(&path).unwrap();
    let inode = std::fs::metadata(&path).unwrap().ino();
    // A would-be token that must never come back in an answer.
    let secret = "0123456789abcdef".repeat(4);
    let upper = secret.to_uppercase();
    let bodies = [
        String::new(),
        "{}".to_owned(),
        "[".to_owned(),
        r#"{"token":""}"#.to_owned(),
        r#"{"token":5}"#.to_owned(),
        r#"{"token":null}"#.to_owned(),
        format!(r#"{{"token":"{upper}"}}"#),
        format!(r#"{{"token":"{}"}}"#, &secret[..63]),
        format!(r#"{{"token":"{secret}0"}}"#),
        format!(r#"{{"token":"{}g"}}"#, &secret[..63]),
        format!(r#"{{"token":"{secret}","also":1}}"#),
        format!(r#"{{"token":"{secret}""#),
        format!(r#""{secret}""#),
        format!(r#"["{secret}"]"#),
        format!(r#"{{"token":["{secret}"]}}"#),
        format!(r#"{{"tokens":"{secret}"}}"#),
    ];
    for json in &bodies {
        let (status, body) = agent.post_with(&agent.token, "/v1/token", json);
        assert_eq!(status, 400, "{json}: {body}");
        let e = error(&body);
        assert_eq!(e.error, protocol::error_code::BAD_REQUEST, "{json}");
        assert!(e.message.contains("token"), "{json}: {}", e.message);
        for leaked in [&secret[..], &upper[..], &secret[..63]] {
            assert!(
                !body.contains(leaked),
                "{json}: the answer repeats it: {body}"
            );
        }
    }
    assert_eq!(std::fs::read(&path).unwrap(), before);
    assert_eq!(
        std::fs::metadata(&path).unwrap().ino(),
        inode,
        "never rewritten"
    );
    assert_eq!(token_dir(&agent), ["agent.token"]);
    for line in drain_log(&agent) {
        assert!(!line.contains(&secret[..63]), "{line}");
    }
    // Only POST: GET is refused without touching anything either.
    let (status, _) =
        agent.raw(format!("GET /v1/token HTTP/1.1\r\nHost: a\r\n{}\r\n", agent.auth()).as_bytes());
    assert_eq!(status, 405);
    let (status, body) =
        agent.raw(format!("GET /v1/ready HTTP/1.1\r\nHost: a\r\n{}\r\n", agent.auth()).as_bytes());
    assert_eq!(status, 200, "the old token still works: {body}");
}

#[test]
fn a_rotation_that_cannot_be_stored_is_a_500_and_the_old_token_stays_valid() {
    let agent = RunningAgent::start();
    let old = agent.token.clone();
    let new = AgentToken::from_random_bytes([0x5e; 32]);
    let path = agent.path(protocol::TOKEN_PATH);
    let before = std::fs::read(&path).unwrap();
    // A directory where the agent writes its temporary file: neither removable nor creatable,
    // whoever the agent runs as.
    let blocker = agent.path("/etc/ttlab/.agent.token.new");
    std::fs::create_dir_all(blocker.join("in-the-way")).unwrap();

    let (status, body) = rotate(&agent, &old, &new);
    assert_eq!(status, 500, "{body}");
    let e = error(&body);
    assert_eq!(e.error, protocol::error_code::INTERNAL);
    assert!(e.message.contains("stays valid"), "{}", e.message);
    assert!(!body.contains(new.reveal()));
    assert_eq!(
        std::fs::read(&path).unwrap(),
        before,
        "the token file is untouched"
    );
    let (status, _) = agent.raw(
        format!(
            "GET /v1/ready HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer {}\r\n\r\n",
            new.reveal()
        )
        .as_bytes(),
    );
    assert_eq!(status, 401, "the new token was not installed");
    let (status, _) =
        agent.raw(format!("GET /v1/ready HTTP/1.1\r\n{}\r\n", agent.auth()).as_bytes());
    assert_eq!(status, 200, "the old token still works");

    // Once the obstacle is gone the same rotation succeeds.
    std::fs::remove_dir_all(&blocker).unwrap();
    let (status, body) = rotate(&agent, &old, &new);
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        format!("{}\n", new.reveal())
    );
}

#[test]
fn concurrent_rotations_have_exactly_one_winner() {
    let agent = RunningAgent::start();
    let old = agent.token.clone();
    // At most MAX_CONCURRENT_REQUESTS at once, so none is refused as busy.
    let n = protocol::MAX_CONCURRENT_REQUESTS;
    let mut losers = std::collections::BTreeMap::<u16, usize>::new();
    for round in 0..5u8 {
        let current = if round == 0 {
            old.clone()
        } else {
            let text = std::fs::read_to_string(agent.path(protocol::TOKEN_PATH)).unwrap();
            AgentToken::parse(&text).unwrap()
        };
        let barrier = Arc::new(Barrier::new(n));
        let contenders: Vec<AgentToken> = (0..n)
            .map(|i| AgentToken::from_random_bytes([round * 16 + i as u8 + 1; 32]))
            .collect();
        let handles: Vec<_> = contenders
            .iter()
            .cloned()
            .map(|to| {
                let addr = agent.addr;
                let barrier = Arc::clone(&barrier);
                let current = current.clone();
                std::thread::spawn(move || {
                    barrier.wait();
                    let json = format!(r#"{{"token":"{}"}}"#, to.reveal());
                    post_at(addr, &current, "/v1/token", &json)
                })
            })
            .collect();
        let answers: Vec<(u16, String)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let winners: Vec<usize> = answers
            .iter()
            .enumerate()
            .filter(|(_, (status, _))| *status == 200)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(winners.len(), 1, "round {round}: {answers:?}");
        assert_eq!(
            rotated(&answers[winners[0]].1),
            TokenRotated { changed: true }
        );
        for (status, body) in &answers {
            assert!(
                matches!(*status, 200 | 401 | 409),
                "round {round}: a loser gets 401 or 409, got {status}: {body}"
            );
            if *status != 200 {
                *losers.entry(*status).or_default() += 1;
            }
        }
        assert_eq!(
            std::fs::read_to_string(agent.path(protocol::TOKEN_PATH)).unwrap(),
            format!("{}\n", contenders[winners[0]].reveal()),
            "round {round}: the file holds the winner's token, whole"
        );
        assert_eq!(token_dir(&agent), ["agent.token"]);
    }
    // 409: authenticated before the winner's rename, refused under the lock; 401: after it.
    println!("5 rounds of {n} concurrent rotations: losers by status {losers:?}");
}
