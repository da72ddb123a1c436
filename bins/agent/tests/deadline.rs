//! `POST /v1/deadline` on the real `ttlab-agent` binary over raw TCP on 127.0.0.1: a deadline
//! within bounds is stored whole in `/etc/ttlab/power-off-at` and answered back; anything
//! else is a 400 that leaves the file as it was; a file that cannot be written is a 500 that
//! keeps the previous deadline.

mod support;

use std::os::unix::fs::PermissionsExt as _;
use std::time::{SystemTime, UNIX_EPOCH};

use support::RunningAgent;
use ttlab_agent::protocol::{self, ErrorResponse, MAX_POWER_OFF_AHEAD_SECS, PowerOffAt};

fn now() -> i64 {
    i64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs(),
    )
    .unwrap()
}

fn set(agent: &RunningAgent, json: &str) -> (u16, String) {
    agent.post_with(&agent.token, "/v1/deadline", json)
}

fn stored(agent: &RunningAgent) -> Option<String> {
    std::fs::read_to_string(agent.path(protocol::POWER_OFF_AT_PATH)).ok()
}

#[test]
fn a_deadline_is_stored_whole_and_answered_back_later_or_earlier() {
    let agent = RunningAgent::start();
    for at in [now() + 3 * 3600, now() + 600, now() - 60] {
        let (status, body) = set(&agent, &format!(r#"{{"power_off_at":{at}}}"#));
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            serde_json::from_str::<PowerOffAt>(&body).unwrap(),
            PowerOffAt { power_off_at: at }
        );
        assert_eq!(stored(&agent), Some(format!("{at}\n")));
    }
    let mode = std::fs::metadata(agent.path(protocol::POWER_OFF_AT_PATH))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o7777, 0o644, "mode {mode:o}");
    let mut names: Vec<_> = std::fs::read_dir(agent.path("/etc/ttlab"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["agent.token", "power-off-at"],
        "no temporary file left"
    );
}

#[test]
fn deadlines_out_of_bounds_or_malformed_get_400_and_change_nothing() {
    let agent = RunningAgent::start();
    let kept = now() + 3600;
    let (status, body) = set(&agent, &format!(r#"{{"power_off_at":{kept}}}"#));
    assert_eq!(status, 200, "{body}");
    let too_late = now() + MAX_POWER_OFF_AHEAD_SECS + 86_400;
    for json in [
        r#"{"power_off_at":1577836799}"#.to_owned(),
        r#"{"power_off_at":0}"#.to_owned(),
        r#"{"power_off_at":-1}"#.to_owned(),
        format!(r#"{{"power_off_at":{too_late}}}"#),
        r#"{"power_off_at":99999999999999999999999}"#.to_owned(),
        r#"{"power_off_at":1767225600.5}"#.to_owned(),
        r#"{"power_off_at":"1767225600"}"#.to_owned(),
        r#"{"power_off_at":null}"#.to_owned(),
        r#"{"power_off_at":1767225600,"reason":"x"}"#.to_owned(),
        "{}".to_owned(),
        String::new(),
        "1767225600".to_owned(),
    ] {
        let (status, body) = set(&agent, &json);
        assert_eq!(status, 400, "{json}: {body}");
        let e: ErrorResponse = serde_json::from_str(&body).unwrap();
        assert_eq!(e.error, protocol::error_code::BAD_REQUEST, "{json}");
        assert_eq!(stored(&agent), Some(format!("{kept}\n")), "{json}");
    }
    let (_, body) = set(&agent, r#"{"power_off_at":1577836799}"#);
    assert!(body.contains("2020"), "the bound is named: {body}");
    let (_, body) = set(&agent, &format!(r#"{{"power_off_at":{too_late}}}"#));
    assert!(body.contains("400 days"), "the bound is named: {body}");
}

#[test]
fn a_deadline_that_cannot_be_stored_is_a_500_and_the_previous_one_stays() {
    let agent = RunningAgent::start();
    let kept = now() + 3600;
    let (status, _) = set(&agent, &format!(r#"{{"power_off_at":{kept}}}"#));
    assert_eq!(status, 200);
    let blocker = agent.path("/etc/ttlab/.power-off-at.new");
    std::fs::create_dir_all(blocker.join("in-the-way")).unwrap();
    let (status, body) = set(&agent, &format!(r#"{{"power_off_at":{}}}"#, kept + 60));
    assert_eq!(status, 500, "{body}");
    let e: ErrorResponse = serde_json::from_str(&body).unwrap();
    assert_eq!(e.error, protocol::error_code::INTERNAL);
    assert!(e.message.contains("previous deadline"), "{}", e.message);
    assert_eq!(stored(&agent), Some(format!("{kept}\n")));
}
