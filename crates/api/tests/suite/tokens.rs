//! Guest agent tokens: a fresh random token per VM, carried by the VM's cloud-init Secret and
//! stored in the database, so another replica can grade; never shown by the API; forgotten
//! once the session is final.

use crate::support;

use base64::Engine as _;
use serde_json::{Value, json};
use support::{NS, World, policy, token};
use ttlab_api::auth::Role;
use ttlab_model::{NodeName, SessionId};

/// The agent token written by the cloud-init Secret of `node` in `session`.
fn token_in_secret(w: &World, session: SessionId, node: &NodeName) -> String {
    let name = ttlab_vm_manifest::secret_name(session, node);
    let secret = w.sim.get("secrets", NS, &name).expect("the Secret exists");
    let b64 = base64::engine::general_purpose::STANDARD;
    let raw = secret["data"]["userdata"]
        .as_str()
        .map(|d| b64.decode(d).unwrap())
        .or_else(|| {
            secret["stringData"]["userdata"]
                .as_str()
                .map(|s| s.as_bytes().to_vec())
        })
        .expect("userdata");
    let text = String::from_utf8(raw).unwrap();
    let body = text.strip_prefix("#cloud-config").expect("cloud-config");
    let config: Value = serde_json::from_str(body.trim()).expect("JSON body");
    let file = config["write_files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["path"] == ttlab_agent::protocol::TOKEN_PATH)
        .expect("the token file");
    let content = file["content"].as_str().unwrap();
    let bytes = match file["encoding"].as_str() {
        Some("b64" | "base64") => b64.decode(content).unwrap(),
        _ => content.as_bytes().to_vec(),
    };
    String::from_utf8(bytes).unwrap().trim().to_owned()
}

#[tokio::test]
async fn every_vm_gets_a_fresh_stored_token_that_another_replica_can_use() {
    let w = World::new().await;
    let a = w.server(policy(3600, 7200, 3), 8).await;
    let alice = token("alice", Role::Student);
    let (status, v) = a
        .post("/api/sessions", &alice, json!({"lesson": "duo"}))
        .await;
    assert_eq!(status, 202, "{v}");
    let sid = v["id"].as_str().unwrap().to_owned();
    let v = a
        .wait_session(&sid, &alice, |v| v["status"] != "starting")
        .await;
    assert_eq!(v["status"], "running", "{v}");
    let session: SessionId = sid.parse().unwrap();

    let store = w.db.store().await.unwrap();
    let mut seen = Vec::new();
    for node in ["one", "two"] {
        let node: NodeName = node.parse().unwrap();
        let in_secret = token_in_secret(&w, session, &node);
        assert!(
            ttlab_agent::protocol::AgentToken::parse(&in_secret).is_some(),
            "64 hex digits (256 random bits)"
        );
        let stored = store.agent_tokens().get(session, &node).await.unwrap();
        assert_eq!(stored.as_deref(), Some(in_secret.as_str()));
        seen.push(in_secret);
    }
    assert_ne!(seen[0], seen[1], "each VM has its own token");

    // Another student's VM gets another token.
    let bob = token("bob", Role::Student);
    let (_, b) = a
        .post("/api/sessions", &bob, json!({"lesson": "quick"}))
        .await;
    let bid = b["id"].as_str().unwrap().to_owned();
    a.wait_session(&bid, &bob, |v| v["status"] == "running")
        .await;
    let bob_token = token_in_secret(&w, bid.parse().unwrap(), &"vm".parse().unwrap());
    assert!(!seen.contains(&bob_token));

    // No view shows a token.
    let admin = token("root", Role::Admin);
    for (path, who) in [
        (format!("/api/sessions/{sid}"), &alice),
        ("/api/sessions/current".to_owned(), &alice),
        ("/api/admin/sessions".to_owned(), &admin),
        ("/api/admin/sessions?scope=recent".to_owned(), &admin),
    ] {
        let (status, body) = a.get(&path, who).await;
        assert_eq!(status, 200, "{path}: {body}");
        let text = body.to_string();
        for t in seen.iter().chain([&bob_token]) {
            assert!(!text.contains(t.as_str()), "{path} shows a token");
        }
    }

    // A second replica (its own pool, nothing in memory) grades through the stored tokens.
    let b_replica = w.server(policy(3600, 7200, 3), 8).await;
    let (status, g) = b_replica
        .post(&format!("/api/sessions/{bid}/grade"), &bob, json!({}))
        .await;
    assert_eq!(status, 200, "{g}");
    assert_eq!(
        (g["passed"].as_u64(), g["total"].as_u64()),
        (Some(1), Some(2)),
        "{g}"
    );

    // Finished: the tokens are forgotten.
    let (status, f) = b_replica
        .delete(&format!("/api/sessions/{sid}"), &alice)
        .await;
    assert_eq!(
        (status, f["status"].as_str()),
        (200, Some("finished")),
        "{f}"
    );
    assert_eq!(store.agent_tokens().count(session).await.unwrap(), 0);
    assert_eq!(
        store
            .agent_tokens()
            .count(bid.parse().unwrap())
            .await
            .unwrap(),
        1
    );
    a.stop().await;
    b_replica.stop().await;
}
