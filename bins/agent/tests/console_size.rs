//! `POST /v1/console-size` on the real `ttlab-agent` binary: only with the token, bad sizes and
//! bodies refused with 4xx, and a good one sets the window size of a real terminal (a pty
//! standing in for the serial console, so `stty size` on it prints the new size) or, under
//! `--root` without a device, the text a simulated console reads.

mod support;

use std::os::fd::AsFd as _;
use std::process::{Command, Stdio};

use support::RunningAgent;
use ttlab_agent::AgentClient;
use ttlab_agent::protocol::{self, ConsoleSize};

fn error_code(body: &str) -> String {
    serde_json::from_str::<protocol::ErrorResponse>(body)
        .unwrap_or_else(|_| panic!("not an error body: {body}"))
        .error
}

fn post(agent: &RunningAgent, auth: &str, body: &str) -> (u16, String) {
    agent.raw(
        format!(
            "POST /v1/console-size HTTP/1.1\r\nHost: a\r\n{auth}Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
}

#[test]
fn the_console_size_needs_the_token() {
    let agent = RunningAgent::start();
    let wrong = format!("Authorization: Bearer {}\r\n", "0".repeat(64));
    for auth in ["", wrong.as_str()] {
        let (status, body) = post(&agent, auth, r#"{"rows":40,"cols":120}"#);
        assert_eq!(status, 401, "{auth:?}: {body}");
        assert_eq!(error_code(&body), "unauthorized");
    }
    assert!(
        !agent.path(protocol::CONSOLE_TTY_PATH).exists(),
        "a refused request changed the console"
    );
}

#[test]
fn bad_sizes_and_bodies_are_refused_with_4xx_and_change_nothing() {
    let agent = RunningAgent::start();
    let auth = agent.auth();
    for (body, status, code) in [
        (r#"{"rows":0,"cols":120}"#, 400, "bad_request"),
        (r#"{"rows":40,"cols":0}"#, 400, "bad_request"),
        (r#"{"rows":40,"cols":1001}"#, 400, "bad_request"),
        (r#"{"rows":70000,"cols":80}"#, 400, "bad_request"),
        (r#"{"rows":-1,"cols":80}"#, 400, "bad_request"),
        (r#"{"rows":40}"#, 400, "bad_request"),
        (r#"{"rows":40,"cols":80,"x":1}"#, 400, "bad_request"),
        ("40x80", 400, "bad_request"),
        ("", 400, "bad_request"),
    ] {
        let (got, answer) = post(&agent, &auth, body);
        assert_eq!(got, status, "{body:?}: {answer}");
        assert_eq!(error_code(&answer), code, "{body:?}");
    }
    let (status, answer) =
        agent.raw(format!("GET /v1/console-size HTTP/1.1\r\nHost: a\r\n{auth}\r\n").as_bytes());
    assert_eq!(status, 405, "{answer}");
    let (status, answer) = agent.raw(
        format!(
            "POST /v1/console-size HTTP/1.1\r\nHost: a\r\n{auth}Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        )
        .as_bytes(),
    );
    assert_eq!(status, 411, "{answer}");
    assert!(
        !agent.path(protocol::CONSOLE_TTY_PATH).exists(),
        "a refused request changed the console"
    );
}

#[test]
fn without_a_device_the_size_is_written_where_a_simulated_console_reads_it() {
    let agent = RunningAgent::start();
    let (status, body) = post(&agent, &agent.auth(), r#"{"rows":40,"cols":132}"#);
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        serde_json::from_str::<ConsoleSize>(&body).unwrap(),
        ConsoleSize {
            rows: 40,
            cols: 132
        }
    );
    let written = std::fs::read_to_string(agent.path(protocol::CONSOLE_TTY_PATH)).unwrap();
    assert_eq!(written, "40 132\n");
}

/// The size of the terminal `tty` as `stty size` prints it ("ROWS COLS").
fn stty_size(tty: &std::path::Path) -> String {
    let input = std::fs::File::open(tty).expect("open the pty");
    let out = Command::new("stty")
        .arg("size")
        .stdin(Stdio::from(input))
        .output()
        .expect("stty runs");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[tokio::test]
async fn a_terminal_device_gets_the_size_and_stty_size_prints_it() {
    use rustix::pty::{OpenptFlags, grantpt, openpt, ptsname, unlockpt};
    let agent = RunningAgent::start();
    let master = openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY).expect("a pty");
    grantpt(master.as_fd()).unwrap();
    unlockpt(master.as_fd()).unwrap();
    let name = ptsname(master.as_fd(), Vec::new()).unwrap();
    let slave = std::path::PathBuf::from(name.to_string_lossy().into_owned());
    // The agent's console path (mapped under --root) is the pty.
    let console = agent.path(protocol::CONSOLE_TTY_PATH);
    std::fs::create_dir_all(console.parent().unwrap()).unwrap();
    std::os::unix::fs::symlink(&slave, &console).unwrap();
    assert_eq!(stty_size(&slave), "0 0", "a new pty has no size");

    let client = AgentClient::new(agent.addr, agent.token.clone());
    for (rows, cols) in [(37, 101), (24, 80)] {
        let set = client
            .set_console_size(ConsoleSize { rows, cols })
            .await
            .expect("size set");
        assert_eq!(set, ConsoleSize { rows, cols });
        assert_eq!(stty_size(&slave), format!("{rows} {cols}"));
    }
    // The symlink is still the device: nothing was written over it.
    assert!(
        std::fs::symlink_metadata(&console)
            .unwrap()
            .file_type()
            .is_symlink()
    );

    let refused = client
        .set_console_size(ConsoleSize { rows: 0, cols: 80 })
        .await
        .unwrap_err();
    assert!(
        matches!(refused, ttlab_agent::Error::InvalidRequest(_)),
        "{refused}"
    );
}
