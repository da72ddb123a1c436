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

#[tokio::test]
async fn rotate_token_installs_the_new_token_and_retrying_it_confirms() {
    let agent = RunningAgent::start();
    let old = client(&agent);
    let new_token = AgentToken::from_random_bytes([0x6b; 32]);
    let rotated = old.rotate_token(&new_token).await.expect("rotation");
    assert!(rotated.changed);
    assert!(matches!(old.ready().await, Err(Error::Unauthorized { .. })));
    // A retry with the old token is refused, and the same call with the new one confirms.
    assert!(matches!(
        old.rotate_token(&new_token).await,
        Err(Error::Unauthorized { .. })
    ));
    let new = old.clone().with_token(new_token.clone());
    assert!(
        !new.rotate_token(&new_token)
            .await
            .expect("same token")
            .changed
    );
    assert!(!new.ready().await.expect("ready with the new token").ready);
    assert_eq!(
        std::fs::read_to_string(agent.path(protocol::TOKEN_PATH)).unwrap(),
        format!("{}\n", new_token.reveal())
    );
}

#[tokio::test]
async fn a_rotation_the_agent_cannot_store_is_rejected_with_500() {
    let agent = RunningAgent::start();
    std::fs::create_dir_all(agent.path("/etc/ttlab/.agent.token.new/x")).unwrap();
    let err = client(&agent)
        .rotate_token(&AgentToken::from_random_bytes([0x7c; 32]))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Rejected { status: 500, code, .. } if code == protocol::error_code::INTERNAL),
        "{err}"
    );
    assert!(!err.is_retryable());
    client(&agent)
        .ready()
        .await
        .expect("the old token still works");
}

#[tokio::test]
async fn set_deadline_stores_whole_seconds_and_answers_them() {
    let agent = RunningAgent::start();
    let at = std::time::SystemTime::now() + Duration::from_millis(3 * 3600 * 1000 + 900);
    let stored = client(&agent).set_deadline(at).await.expect("deadline");
    let secs = at.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    assert_eq!(stored.power_off_at, i64::try_from(secs).unwrap());
    assert_eq!(
        std::fs::read_to_string(agent.path(protocol::POWER_OFF_AT_PATH)).unwrap(),
        format!("{secs}\n")
    );
}
