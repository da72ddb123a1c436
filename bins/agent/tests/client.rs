//! The typed client (`ttlab_agent::AgentClient`) against the real binary on 127.0.0.1.

mod support;

use std::time::Duration;

use support::{PATIENCE, RunningAgent, write_file};
use ttlab_agent::protocol::{self, AgentToken, ReadyResponse};
use ttlab_agent::{AgentClient, Error};

fn client(agent: &RunningAgent) -> AgentClient {
    AgentClient::new(agent.addr, agent.token.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_marker_appearing_while_the_client_polls_makes_it_ready() {
    let agent = RunningAgent::start();
    let polling = tokio::spawn({
        let client = client(&agent);
        async move { client.wait_ready(PATIENCE).await }
    });
    // Wait until the agent has answered at least one poll (not ready yet), then finish setup.
    let log = tokio::task::block_in_place(|| agent.wait_for_log("GET /v1/ready -> 200"));
    assert!(log.contains("127.0.0.1"), "{log}");
    write_file(&agent.path(protocol::READY_MARKER_PATH), "");
    let ready = polling.await.expect("poll task").expect("ready");
    assert_eq!(
        ready,
        ReadyResponse {
            ready: true,
            failed: None
        }
    );
}

#[tokio::test]
async fn a_setup_failure_ends_the_wait_with_its_reason() {
    let agent = RunningAgent::start();
    write_file(&agent.path(protocol::FAILED_MARKER_PATH), "apt-get failed");
    let r = client(&agent).wait_ready(PATIENCE).await.expect("answer");
    assert!(!r.ready);
    assert_eq!(r.failed.as_deref(), Some("apt-get failed"));
}

#[tokio::test]
async fn waiting_gives_up_with_not_ready_after_the_deadline() {
    let agent = RunningAgent::start();
    let err = client(&agent)
        .wait_ready(Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::NotReady { last, .. } if last == "not ready yet"),
        "{err}"
    );
}

#[tokio::test]
async fn exec_runs_commands_and_reports_timeouts() {
    let agent = RunningAgent::start();
    let c = client(&agent);
    let r = c
        .exec("echo graded; exit 3", Duration::from_secs(10))
        .await
        .expect("exec");
    assert_eq!(
        (r.exit_code, r.stdout.as_str(), r.timed_out),
        (Some(3), "graded\n", false)
    );

    let r = c
        .exec("sleep 60", Duration::from_millis(200))
        .await
        .expect("exec");
    assert!(r.timed_out);
    assert_eq!(r.exit_code, None);
}

#[tokio::test]
async fn a_wrong_token_is_unauthorized_and_not_retryable() {
    let agent = RunningAgent::start();
    let c = AgentClient::new(agent.addr, AgentToken::from_random_bytes([9; 32]));
    let err = c.ready().await.unwrap_err();
    assert!(matches!(err, Error::Unauthorized { .. }), "{err}");
    assert!(!err.is_retryable());
    // wait_ready stops at once on a non-retryable error.
    assert!(matches!(
        c.wait_ready(PATIENCE).await,
        Err(Error::Unauthorized { .. })
    ));
}

#[tokio::test]
async fn a_missing_token_file_is_unavailable_and_retryable() {
    let agent = RunningAgent::start_without_token();
    let err = client(&agent).ready().await.unwrap_err();
    assert!(
        matches!(&err, Error::Unavailable { code, .. } if code == protocol::error_code::TOKEN_UNAVAILABLE),
        "{err}"
    );
    assert!(err.is_retryable());
}

#[tokio::test]
async fn a_silent_peer_times_out() {
    // Accepts connections (the kernel completes the handshake) but never answers.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let c = AgentClient::new(addr, AgentToken::from_random_bytes([1; 32]))
        .with_timeouts(Duration::from_secs(5), Duration::from_millis(200));
    let err = c.ready().await.unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(err.is_retryable());
    drop(listener);
}
