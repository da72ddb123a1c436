//! Answers from PostgreSQL that never reached the server: the statement ran and committed,
//! the connection broke on the way back, and the server retried the step. A step that is not
//! idempotent must take what its retry finds for the outcome of its own first attempt. A
//! `FaultProxy` between the server and PostgreSQL loses the answer to one chosen statement
//! (`FaultProxy::lose_answer_to`).

use crate::support;

use std::time::Duration;

use serde_json::json;
use support::{NS, World, policy, token};
use ttlab_api::auth::Role;
use ttlab_model::{SessionId, SessionStatus};
use ttlab_store::testing::{ServerSocket, TestDb};
use ttlab_store::{Store, StoreOptions};
use ttlab_testkit::{FaultProxy, Upstream};

/// A proxy in front of the test database's server.
fn proxy_for(db: &TestDb) -> FaultProxy {
    let upstream = match db.server_socket() {
        ServerSocket::Unix(path) => Upstream::Unix(path),
        ServerSocket::Tcp(host, port) => {
            use std::net::ToSocketAddrs as _;
            Upstream::Tcp(
                (host.as_str(), port)
                    .to_socket_addrs()
                    .unwrap()
                    .next()
                    .unwrap(),
            )
        }
    };
    FaultProxy::start(upstream).unwrap()
}

/// The text of the statement that marks a session running (`Sessions::mark_running`,
/// crates/store/src/sessions/start.rs), and of no other.
const MARK_RUNNING: &str = "SET status = $2, ready_at = now()";

/// The soak's two ghosts: the provisioner's `mark_running` went through but its answer was
/// lost; the retry found the row running already (its `WHERE status = 'starting'` matched
/// nothing), took that for "someone else moved the session on", and deleted the running
/// lab's VM and Secret, leaving a running row with nothing behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_answer_to_mark_running_leaves_the_running_lab_alone() {
    let w = World::new().await;
    let proxy = proxy_for(&w.db);
    let store = Store::connect(&w.db.url_at(proxy.addr()), StoreOptions::default())
        .await
        .unwrap();
    let s = w
        .serve_on(w.config(policy(3600, 7200, 3), 8).await, store)
        .await;
    proxy.lose_answer_to(MARK_RUNNING);

    let alice = token("alice", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "quick"}))
        .await;
    assert_eq!(status, 202, "{v}");
    let sid = v["id"].as_str().unwrap().to_owned();
    let v = s
        .wait_session(&sid, &alice, |v| v["status"] != "starting")
        .await;
    assert_eq!(v["status"], "running", "{v}");

    // Provisioning is over once its lease is free: whatever it was going to delete, it has.
    let id: SessionId = sid.parse().unwrap();
    let direct = w.db.store().await.unwrap();
    let lease = direct
        .wait_provisioning_lock(id, Duration::from_secs(60))
        .await
        .unwrap()
        .expect("the provisioner let go of the session");
    lease.release().await.unwrap();
    assert_eq!(
        proxy.answers_lost(),
        1,
        "the answer to mark_running was not lost (a connection the proxy cannot follow, such \
         as TLS?): this test would prove nothing"
    );

    // The student's lab runs, and everything of it is still there.
    let (status, v) = s.get(&format!("/api/sessions/{sid}"), &alice).await;
    assert_eq!(
        (status, v["status"].as_str()),
        (200, Some("running")),
        "{v}"
    );
    let vm = v["nodes"][0]["vm"].as_str().unwrap();
    let node = v["nodes"][0]["node"].as_str().unwrap().parse().unwrap();
    let vm_object = w
        .sim
        .get("virtualmachines", NS, vm)
        .unwrap_or_else(|| panic!("the running lab's VM {vm} was deleted"));
    assert!(
        vm_object["metadata"]["deletionTimestamp"].is_null(),
        "the running lab's VM {vm} is being deleted: {}",
        vm_object["metadata"]
    );
    let secret = ttlab_vm_manifest::secret_name(id, &node);
    assert!(
        w.sim.get("secrets", NS, &secret).is_some(),
        "the running lab's cloud-init Secret {secret} was deleted"
    );
    let vmi = w.sim.get("virtualmachineinstances", NS, vm);
    assert_eq!(
        vmi.as_ref().and_then(|v| v["status"]["phase"].as_str()),
        Some("Running"),
        "{vmi:?}"
    );
    // Its agent answers with the session's token: the lab can be graded.
    let (status, g) = s
        .post(&format!("/api/sessions/{sid}/grade"), &alice, json!({}))
        .await;
    assert_eq!(status, 200, "{g}");
    assert_eq!(
        (g["passed"].as_u64(), g["total"].as_u64()),
        (Some(1), Some(2))
    );
    // And the row says so.
    let row = direct.sessions().get(id).await.unwrap().unwrap();
    assert_eq!(row.status, SessionStatus::Running);
    assert!(row.failure_reason.is_none(), "{:?}", row.failure_reason);
    s.stop().await;
}
