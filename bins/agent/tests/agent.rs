//! The real `ttlab-agent` binary over raw TCP on 127.0.0.1: authentication, limits, malformed
//! input, and the command runner's timeout and output caps.

mod support;

use std::io::Write;
use std::net::TcpStream;
use std::process::Command;

use support::{PATIENCE, RunningAgent, exits, read_answer, status_kib, write_file};
use ttlab_agent::protocol::{
    self, ExecResponse, MAX_OUTPUT_BYTES, MAX_REQUEST_HEAD_BYTES, ReadyResponse,
};

fn error_code(body: &str) -> String {
    serde_json::from_str::<protocol::ErrorResponse>(body)
        .unwrap_or_else(|_| panic!("not an error body: {body}"))
        .error
}

fn exec(agent: &RunningAgent, command: &str, timeout_ms: u64) -> ExecResponse {
    let json = serde_json::json!({ "command": command, "timeout_ms": timeout_ms }).to_string();
    let (status, body) = agent.exec_json(&json);
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).expect("exec answer")
}

#[test]
fn requests_without_the_right_token_get_401() {
    let agent = RunningAgent::start();
    let wrong = "0".repeat(64);
    let mut almost = agent.token.reveal().to_owned();
    almost.replace_range(63.., if almost.ends_with('0') { "1" } else { "0" });
    for auth in [
        String::new(),
        format!("Authorization: Bearer {wrong}\r\n"),
        format!("Authorization: Bearer {almost}\r\n"),
        format!("Authorization: Bearer {}x\r\n", agent.token.reveal()),
        format!("Authorization: Basic {}\r\n", agent.token.reveal()),
    ] {
        for path in ["/v1/ready", "/nowhere"] {
            let (status, body) =
                agent.raw(format!("GET {path} HTTP/1.1\r\nHost: a\r\n{auth}\r\n").as_bytes());
            assert_eq!(status, 401, "{auth:?} {path}: {body}");
            assert_eq!(error_code(&body), "unauthorized");
        }
    }
    let (status, body) =
        agent.raw(format!("GET /v1/ready HTTP/1.1\r\nHost: a\r\n{}\r\n", agent.auth()).as_bytes());
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        serde_json::from_str::<ReadyResponse>(&body).unwrap(),
        ReadyResponse {
            ready: false,
            failed: None
        }
    );
}

#[test]
fn without_a_token_file_every_request_is_refused_as_unavailable() {
    let agent = RunningAgent::start_without_token();
    let auth = format!("Authorization: Bearer {}\r\n", agent.token.reveal());
    let (status, body) = agent.raw(format!("GET /v1/ready HTTP/1.1\r\n{auth}\r\n").as_bytes());
    assert_eq!(status, 503);
    assert_eq!(error_code(&body), "token_unavailable");

    // The token file is re-read per request: writing it makes the same request succeed.
    write_file(
        &agent.path(protocol::TOKEN_PATH),
        &format!("{}\n", agent.token.reveal()),
    );
    let (status, _) = agent.raw(format!("GET /v1/ready HTTP/1.1\r\n{auth}\r\n").as_bytes());
    assert_eq!(status, 200);
}

#[test]
fn ready_reports_the_markers() {
    let agent = RunningAgent::start();
    let get = format!("GET /v1/ready HTTP/1.1\r\n{}\r\n", agent.auth());
    write_file(
        &agent.path(protocol::FAILED_MARKER_PATH),
        "setup.sh exited with 4\n",
    );
    let (_, body) = agent.raw(get.as_bytes());
    let r: ReadyResponse = serde_json::from_str(&body).unwrap();
    assert_eq!(
        r,
        ReadyResponse {
            ready: false,
            failed: Some("setup.sh exited with 4".into())
        }
    );

    std::fs::remove_file(agent.path(protocol::FAILED_MARKER_PATH)).unwrap();
    write_file(&agent.path(protocol::READY_MARKER_PATH), "");
    let (_, body) = agent.raw(get.as_bytes());
    assert_eq!(
        serde_json::from_str::<ReadyResponse>(&body).unwrap(),
        ReadyResponse {
            ready: true,
            failed: None
        }
    );
}

#[test]
fn an_oversized_body_is_refused_without_being_sent() {
    let agent = RunningAgent::start();
    let mut stream = TcpStream::connect(agent.addr).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    // Announce 100 MB but send only the head: the answer must come without the body.
    let head = format!(
        "POST /v1/exec HTTP/1.1\r\n{}Content-Length: 100000000\r\n\r\n",
        agent.auth()
    );
    stream.write_all(head.as_bytes()).unwrap();
    let (status, body) = read_answer(&mut stream);
    assert_eq!(status, 413, "{body}");
    assert_eq!(error_code(&body), "too_large");
}

#[test]
fn oversized_heads_and_too_many_headers_get_431() {
    let agent = RunningAgent::start();
    let mut big = format!("GET /v1/ready HTTP/1.1\r\n{}X-Pad: ", agent.auth()).into_bytes();
    big.extend(std::iter::repeat_n(b'a', MAX_REQUEST_HEAD_BYTES));
    big.extend(b"\r\n\r\n");
    let (status, body) = agent.raw(&big);
    assert_eq!(status, 431, "{body}");

    let mut many = format!("GET /v1/ready HTTP/1.1\r\n{}", agent.auth());
    for i in 0..100 {
        many.push_str(&format!("X-{i}: 1\r\n"));
    }
    many.push_str("\r\n");
    let (status, _) = agent.raw(many.as_bytes());
    assert_eq!(status, 431);
}

#[test]
fn garbage_gets_400_and_the_agent_keeps_serving() {
    let agent = RunningAgent::start();
    let garbage: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    for raw in [
        &garbage[..],
        b"HELLO\r\n\r\n",
        b"GET /v1/ready HTTP/9.9\r\n\r\n",
        b"GET  HTTP/1.1\r\n\r\n",
    ] {
        let (status, body) = agent.raw(raw);
        assert_eq!(status, 400, "{body}");
        assert_eq!(error_code(&body), "bad_request");
    }
    // A connection closed without a byte is simply dropped.
    drop(TcpStream::connect(agent.addr).unwrap());

    let r = exec(&agent, "echo still here", 5_000);
    assert_eq!(r.stdout, "still here\n");
}

#[test]
fn wrong_methods_paths_and_bodies_get_clear_errors() {
    let agent = RunningAgent::start();
    let auth = agent.auth();
    let cases: Vec<(String, u16, &str)> = vec![
        (
            format!("GET /v2/other HTTP/1.1\r\n{auth}\r\n"),
            404,
            "not_found",
        ),
        (
            format!("DELETE /v1/ready HTTP/1.1\r\n{auth}\r\n"),
            405,
            "method_not_allowed",
        ),
        (
            format!("GET /v1/exec HTTP/1.1\r\n{auth}\r\n"),
            405,
            "method_not_allowed",
        ),
        (
            format!("POST /v1/exec HTTP/1.1\r\n{auth}Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
            411,
            "length_required",
        ),
        (
            format!("POST /v1/exec HTTP/1.1\r\n{auth}\r\n"),
            411,
            "length_required",
        ),
        (
            format!("POST /v1/exec HTTP/1.1\r\n{auth}Content-Length: 5\r\n\r\nnope!"),
            400,
            "bad_request",
        ),
    ];
    for (raw, want, code) in cases {
        let (status, body) = agent.raw(raw.as_bytes());
        assert_eq!(
            (status, error_code(&body).as_str()),
            (want, code),
            "{raw:?}: {body}"
        );
    }
    for json in [
        r#"{"command":1,"timeout_ms":5}"#,
        r#"{"command":"true"}"#,
        r#"{"command":"true","timeout_ms":5,"x":1}"#,
    ] {
        let (status, body) = agent.exec_json(json);
        assert_eq!(
            (status, error_code(&body).as_str()),
            (400, "bad_request"),
            "{json}: {body}"
        );
    }
    for timeout in [0, protocol::MAX_EXEC_TIMEOUT_MS + 1] {
        let (status, body) =
            agent.exec_json(&format!(r#"{{"command":"true","timeout_ms":{timeout}}}"#));
        assert_eq!(status, 400, "{body}");
        assert!(body.contains("timeout_ms"), "{body}");
    }
}

#[test]
fn exec_returns_exit_code_output_and_duration() {
    let agent = RunningAgent::start();
    let r = exec(&agent, "printf 'a\\nb'; echo oops >&2; exit 7", 10_000);
    assert_eq!(r.exit_code, Some(7));
    assert!(!r.timed_out);
    assert_eq!(r.stdout, "a\nb");
    assert_eq!(r.stderr, "oops\n");
    assert!(!r.stdout_truncated && !r.stderr_truncated);

    // Commands run in the root directory (DIR under --root).
    let r = exec(&agent, "pwd", 10_000);
    assert_eq!(r.stdout.trim(), agent.root.path().to_str().unwrap());
}

#[test]
fn a_command_past_its_timeout_is_killed_with_its_children() {
    let agent = RunningAgent::start();
    let pidfile = agent.root.path().join("child.pid");
    let command = format!("sleep 300 & echo $! > {}; sleep 300", pidfile.display());
    let r = exec(&agent, &command, 500);
    assert!(r.timed_out);
    assert_eq!(r.exit_code, None);
    assert!(
        (500..20_000).contains(&r.duration_ms),
        "took {} ms",
        r.duration_ms
    );
    let child: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        exits(child),
        "the background sleep {child} survived the timeout"
    );
}

#[test]
fn a_command_printing_100_mb_is_capped_and_memory_stays_bounded() {
    let agent = RunningAgent::start();
    let before = status_kib(agent.pid(), "VmHWM");
    let r = exec(
        &agent,
        "head -c 100000000 /dev/zero | tr '\\0' y; echo done >&2",
        60_000,
    );
    let peak = status_kib(agent.pid(), "VmHWM");
    eprintln!("agent peak RSS: {before} KiB before, {peak} KiB after printing 100 MB");
    assert_eq!(r.exit_code, Some(0));
    assert_eq!(r.stdout.len(), MAX_OUTPUT_BYTES);
    assert!(r.stdout.bytes().all(|b| b == b'y'));
    assert!(r.stdout_truncated);
    assert_eq!(r.stderr, "done\n");
    assert!(!r.stderr_truncated);
    assert!(peak < 32 * 1024, "agent peak RSS {peak} KiB");
}

#[test]
fn past_the_concurrency_limit_requests_get_503_busy() {
    let agent = RunningAgent::start();
    // Idle connections hold every slot (each until its request deadline).
    let idle: Vec<TcpStream> = (0..protocol::MAX_CONCURRENT_REQUESTS)
        .map(|_| TcpStream::connect(agent.addr).unwrap())
        .collect();
    let (status, body) =
        agent.raw(format!("GET /v1/ready HTTP/1.1\r\n{}\r\n", agent.auth()).as_bytes());
    assert_eq!(status, 503, "{body}");
    assert_eq!(error_code(&body), "busy");
    drop(idle);
}

#[test]
fn bad_command_lines_exit_2_with_the_usage() {
    let out = Command::new(env!("CARGO_BIN_EXE_ttlab-agent"))
        .args(["--listen", "nowhere"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("ADDR:PORT") && stderr.contains(protocol::CLI_USAGE),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
}

#[test]
fn an_address_in_use_exits_1() {
    let agent = RunningAgent::start();
    let out = Command::new(env!("CARGO_BIN_EXE_ttlab-agent"))
        .args(["--listen", &agent.addr.to_string()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot listen on"));
}

#[test]
fn locate_binary_finds_the_built_agent() {
    let found = ttlab_agent::locate_binary().expect("built agent");
    assert_eq!(
        found.canonicalize().unwrap(),
        std::path::Path::new(env!("CARGO_BIN_EXE_ttlab-agent"))
            .canonicalize()
            .unwrap()
    );
}

#[test]
fn deeply_nested_json_is_a_clean_400() {
    let agent = RunningAgent::start();
    for json in [
        format!(r#"{{"command":{}"#, "[".repeat(60_000)),
        format!(r#"{{"x":{}"#, "{\"a\":".repeat(10_000)),
    ] {
        let (status, body) = agent.exec_json(&json);
        assert_eq!(status, 400, "{body}");
    }
    assert_eq!(exec(&agent, "echo alive", 5_000).stdout, "alive\n");
}

#[test]
fn a_client_expecting_100_continue_gets_it_before_sending_the_body() {
    let agent = RunningAgent::start();
    let mut stream = TcpStream::connect(agent.addr).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let json = r#"{"command":"echo continued","timeout_ms":5000}"#;
    let head = format!(
        "POST /v1/exec HTTP/1.1\r\n{}Expect: 100-continue\r\nContent-Length: {}\r\n\r\n",
        agent.auth(),
        json.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    let mut interim = [0u8; 25];
    std::io::Read::read_exact(&mut stream, &mut interim).unwrap();
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
    stream.write_all(json.as_bytes()).unwrap();
    let (status, body) = read_answer(&mut stream);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("continued"), "{body}");
}

#[test]
fn this_build_of_the_agent_fits_a_cloud_init_secret() {
    use std::io::Write as _;
    let binary = std::fs::read(env!("CARGO_BIN_EXE_ttlab-agent")).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(&binary).unwrap();
    let gz = gz.finish().unwrap();
    let b64 = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, &gz);
    eprintln!(
        "ttlab-agent: {} bytes raw, {} gzipped, {} base64",
        binary.len(),
        gz.len(),
        b64.len()
    );
    // Leave at least a quarter of the 1 MiB Secret to the lab files and the rest of cloud-init.
    assert!(b64.len() < 768 * 1024, "{} bytes of base64", b64.len());
}
