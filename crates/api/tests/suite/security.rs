//! The security pass over the API, on a real server, PostgreSQL and kube-sim: what another
//! student, a forged or stale token, and a student on admin routes can reach (nothing), and
//! that a console is only ever opened into one's own running, unexpired session.

use crate::support;

use serde_json::{Value, json};
use support::{Running, World, policy, start_running, token};
use ttlab_api::auth::Role;

async fn ticket(s: &Running, sid: &str, token: &str) -> (u16, Value) {
    s.post(
        &format!("/api/sessions/{sid}/console-ticket"),
        token,
        json!({}),
    )
    .await
}

fn ws_url(s: &Running, path: &str) -> String {
    format!("{}{path}", s.base.replacen("http://", "ws://", 1))
}

/// Opens a console WebSocket that must be refused before the upgrade: status and error body.
async fn refused(url: String) -> (u16, Value) {
    match tokio_tungstenite::connect_async(url).await {
        Ok(_) => panic!("the console opened"),
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            let status = response.status().as_u16();
            let body = response.into_body().unwrap_or_default();
            (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
        }
        Err(e) => panic!("unexpected error: {e}"),
    }
}

/// Every route that names a session: (method, path suffix after `/api/sessions/{id}`).
const SESSION_ROUTES: [(&str, &str); 6] = [
    ("GET", ""),
    ("DELETE", ""),
    ("POST", "/extend"),
    ("POST", "/grade"),
    ("GET", "/events"),
    ("POST", "/console-ticket"),
];

/// Every admin route.
const ADMIN_ROUTES: [(&str, &str); 5] = [
    ("GET", "/api/admin/sessions"),
    ("GET", "/api/admin/capacity"),
    ("GET", "/api/admin/reaper"),
    ("POST", "/api/admin/reaper/collect"),
    ("GET", "/api/admin/stats"),
];

async fn call(s: &Running, method: &str, path: &str, token: Option<&str>) -> (u16, Value) {
    let (ct, body) = match method {
        "POST" => (Some("application/json"), b"{}".to_vec()),
        _ => (None, Vec::new()),
    };
    s.raw(method, path, token, ct, body).await
}

#[tokio::test]
async fn another_students_session_is_404_on_every_route_and_its_console_403() {
    let w = World::new().await;
    let s = w.server(policy(3600, 4 * 3600, 3), 8).await;
    let (sid, alice) = start_running(&s, "alice", "quick").await;
    let bob = token("bob", Role::Student);

    for (method, suffix) in SESSION_ROUTES {
        let path = format!("/api/sessions/{sid}{suffix}");
        let (status, e) = call(&s, method, &path, Some(bob.as_str())).await;
        assert_eq!(
            (status, e["error"].as_str()),
            (404, Some("session_not_found")),
            "{method} {path} as another student: {e}"
        );
    }
    // Nothing bob tried had an effect: still running, not extended, alice's own.
    let (status, v) = s.get(&format!("/api/sessions/{sid}"), &alice).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["status"], "running", "{v}");
    assert_eq!(v["extensions_used"], 0, "{v}");
    // `current` is per caller: bob has none.
    let (status, v) = s.get("/api/sessions/current", &bob).await;
    assert_eq!(
        (status, v["error"].as_str()),
        (404, Some("session_not_found")),
        "{v}"
    );

    // Alice's own ticket used by anyone is still only for her session; bob's ticket for his
    // own session does not open hers; a ticket taken by the wrong session is spent.
    let (bob_sid, bob) = start_running(&s, "bob", "quick").await;
    let (status, t) = ticket(&s, &bob_sid, &bob).await;
    assert_eq!(status, 200, "{t}");
    let bobs = t["ticket"].as_str().unwrap();
    let (status, e) = refused(ws_url(
        &s,
        &format!("/api/sessions/{sid}/console?ticket={bobs}"),
    ))
    .await;
    assert_eq!(
        (status, e["error"].as_str()),
        (403, Some("invalid_ticket")),
        "{e}"
    );
    let (status, e) = refused(ws_url(&s, t["url"].as_str().unwrap())).await;
    assert_eq!(
        (status, e["error"].as_str()),
        (403, Some("invalid_ticket")),
        "a ticket tried on another session is spent: {e}"
    );
    // An admin may read the session, but acting on it stays the owner's.
    let admin = token("root", Role::Admin);
    let (status, _) = s.get(&format!("/api/sessions/{sid}"), &admin).await;
    assert_eq!(status, 200);
    for (method, suffix) in [
        ("DELETE", ""),
        ("POST", "/extend"),
        ("POST", "/console-ticket"),
    ] {
        let path = format!("/api/sessions/{sid}{suffix}");
        let (status, e) = call(&s, method, &path, Some(admin.as_str())).await;
        assert_eq!(status, 404, "{method} {path} as an admin: {e}");
    }
    s.stop().await;
}

/// Tokens that must never authenticate: (what, token).
fn bad_tokens() -> Vec<(&'static str, String)> {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let signed = |claims: Value| {
        let head = b64.encode(br#"{"alg":"HS256","typ":"JWT"}"#);
        let body = b64.encode(claims.to_string());
        let input = format!("{head}.{body}");
        // HMAC-SHA256 by hand: the test forges its tokens without the server's code.
        use hmac::Mac as _;
        let mut mac =
            <hmac::Hmac<sha2::Sha256> as hmac::KeyInit>::new_from_slice(support::SECRET).unwrap();
        mac.update(input.as_bytes());
        let sig = b64.encode(mac.finalize().into_bytes());
        format!("{input}.{sig}")
    };
    let admin_claims = json!({"sub": "root", "role": "admin", "exp": now + 3600});
    let wrong_key =
        ttlab_api::auth::AuthConfig::new(ttlab_api::auth::AuthSecret::new(vec![9u8; 32]).unwrap())
            .mint(
                &"root".parse().unwrap(),
                Role::Admin,
                now,
                std::time::Duration::from_secs(3600),
            )
            .unwrap();
    let expired = support::auth()
        .mint(
            &"root".parse().unwrap(),
            Role::Admin,
            now - 7200,
            std::time::Duration::from_secs(60),
        )
        .unwrap();
    let good = signed(admin_claims.clone());
    let mut tampered = good.clone();
    tampered.pop();
    tampered.push(if good.ends_with('A') { 'B' } else { 'A' });
    vec![
        (
            "alg none",
            format!(
                "{}.{}.",
                b64.encode(br#"{"alg":"none","typ":"JWT"}"#),
                b64.encode(admin_claims.to_string())
            ),
        ),
        (
            "alg none with the real signature",
            format!(
                "{}.{}.{}",
                b64.encode(br#"{"alg":"none","typ":"JWT"}"#),
                b64.encode(admin_claims.to_string()),
                good.rsplit('.').next().unwrap()
            ),
        ),
        ("HS512", {
            let head = b64.encode(br#"{"alg":"HS512","typ":"JWT"}"#);
            let body = b64.encode(admin_claims.to_string());
            let input = format!("{head}.{body}");
            // Signed with the right key, by HMAC-SHA512 directly (the server's provider
            // signs nothing but HS256).
            use hmac::Mac as _;
            let mut mac =
                <hmac::Hmac<sha2::Sha512> as hmac::KeyInit>::new_from_slice(support::SECRET)
                    .unwrap();
            mac.update(input.as_bytes());
            let sig = b64.encode(mac.finalize().into_bytes());
            format!("{input}.{sig}")
        }),
        ("wrong key", wrong_key),
        ("tampered signature", tampered),
        ("expired", expired),
        (
            "no sub",
            signed(json!({"role": "admin", "exp": now + 3600})),
        ),
        (
            "empty sub",
            signed(json!({"sub": "", "role": "admin", "exp": now + 3600})),
        ),
        ("no role", signed(json!({"sub": "root", "exp": now + 3600}))),
        (
            "unknown role",
            signed(json!({"sub": "root", "role": "root", "exp": now + 3600})),
        ),
        ("no exp", signed(json!({"sub": "root", "role": "admin"}))),
        ("garbage", "x.y.z".to_owned()),
        ("empty", String::new()),
    ]
}

#[tokio::test]
async fn forged_stale_or_incomplete_tokens_are_401_on_every_route() {
    let w = World::new().await;
    let s = w.server(policy(3600, 4 * 3600, 3), 8).await;
    let (sid, _alice) = start_running(&s, "alice", "quick").await;
    let mut routes: Vec<(&str, String)> = vec![
        ("GET", "/api/lessons".into()),
        ("POST", "/api/sessions".into()),
        ("GET", "/api/sessions/current".into()),
    ];
    routes.extend(
        SESSION_ROUTES
            .iter()
            .map(|(m, suffix)| (*m, format!("/api/sessions/{sid}{suffix}"))),
    );
    routes.extend(ADMIN_ROUTES.iter().map(|(m, p)| (*m, (*p).to_owned())));
    let tokens = bad_tokens();
    for (method, path) in &routes {
        for (what, t) in &tokens {
            let (status, e) = call(&s, method, path, Some(t.as_str())).await;
            assert_eq!(
                (status, e["error"].as_str()),
                (401, Some("unauthorized")),
                "{method} {path} with a token that is {what}: {e}"
            );
        }
        let (status, _) = call(&s, method, path, None).await;
        assert_eq!(status, 401, "{method} {path} without a token");
    }
    // The session was not touched by any of it.
    let (status, v) = s
        .get(
            &format!("/api/sessions/{sid}"),
            &token("alice", Role::Student),
        )
        .await;
    assert_eq!(
        (status, v["status"].as_str()),
        (200, Some("running")),
        "{v}"
    );
    s.stop().await;
}

#[tokio::test]
async fn a_student_gets_403_from_every_admin_route() {
    let w = World::new().await;
    let s = w.server(policy(3600, 4 * 3600, 3), 8).await;
    let alice = token("alice", Role::Student);
    let admin = token("root", Role::Admin);
    for (method, path) in ADMIN_ROUTES {
        let (status, e) = call(&s, method, path, Some(alice.as_str())).await;
        assert_eq!(
            (status, e["error"].as_str()),
            (403, Some("forbidden")),
            "{method} {path} as a student: {e}"
        );
        // The same route answers an admin (collect-now times out without a reaper: 504).
        let (status, e) = call(&s, method, path, Some(admin.as_str())).await;
        assert!(
            status == 200 || status == 504,
            "{method} {path} as an admin: {status} {e}"
        );
    }
    s.stop().await;
}

#[tokio::test]
async fn an_expired_or_finished_session_gets_no_console_even_with_a_ticket() {
    let w = World::new().await;
    let s = w.server(policy(3600, 4 * 3600, 3), 8).await;

    // Expired: the lifespan has passed but no reaper has reclaimed it yet (still `running`).
    let (sid, alice) = start_running(&s, "alice", "quick").await;
    let (status, t) = ticket(&s, &sid, &alice).await;
    assert_eq!(status, 200, "{t}");
    let (db, connection) = tokio_postgres::connect(w.db.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    let connection = tokio::spawn(connection);
    let moved = db
        .execute(
            "UPDATE sessions SET expires_at = started_at WHERE id = $1::text::uuid",
            &[&sid],
        )
        .await
        .unwrap();
    assert_eq!(moved, 1);
    let (status, e) = refused(ws_url(&s, t["url"].as_str().unwrap())).await;
    assert_eq!(
        (status, e["error"].as_str()),
        (409, Some("expired")),
        "a ticket issued before the expiry: {e}"
    );
    let (status, e) = ticket(&s, &sid, &alice).await;
    assert_eq!((status, e["error"].as_str()), (409, Some("expired")), "{e}");

    // Finished: a ticket taken before the finish does not open the console after it.
    let (sid, carol) = start_running(&s, "carol", "quick").await;
    let (status, t) = ticket(&s, &sid, &carol).await;
    assert_eq!(status, 200, "{t}");
    let (status, v) = s.delete(&format!("/api/sessions/{sid}"), &carol).await;
    assert!(status < 300, "{status} {v}");
    let (status, e) = refused(ws_url(&s, t["url"].as_str().unwrap())).await;
    assert_eq!(
        (status, e["error"].as_str()),
        (409, Some("not_running")),
        "a ticket issued before the finish: {e}"
    );
    let (status, e) = ticket(&s, &sid, &carol).await;
    assert_eq!(
        (status, e["error"].as_str()),
        (409, Some("not_running")),
        "{e}"
    );
    drop(db);
    let _ = connection.await;
    s.stop().await;
}

#[tokio::test]
async fn a_static_file_path_the_file_system_rejects_is_404_not_500() {
    let w = World::new().await;
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let long = "w".repeat(300);
    for path in [
        // A name longer than the file system allows (found by the api_request fuzz target).
        format!("/vendor/xterm/{long}"),
        format!("/vendor/addon-fit/{long}"),
        format!("/static/{long}"),
        // A path through a file.
        "/static/app.js/x".to_owned(),
        "/vendor/xterm/package.json/x".to_owned(),
    ] {
        let (status, _) = call(&s, "GET", &path, None).await;
        assert_eq!(status, 404, "GET {path}");
    }
    s.stop().await;
}

#[tokio::test]
async fn pages_static_files_and_api_answers_carry_the_security_headers() {
    let w = World::new().await;
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let alice = token("alice", Role::Student);
    for (path, token, status, content_type) in [
        ("/", None, 200, "text/html"),
        ("/admin", None, 200, "text/html"),
        ("/static/app.js", None, 200, "text/javascript"),
        ("/static/style.css", None, 200, "text/css"),
        (
            "/api/lessons",
            Some(alice.as_str()),
            200,
            "application/json",
        ),
        // Errors too: a refused token, an unknown path, and (no ops port here) the metrics.
        ("/api/lessons", Some("not.a.token"), 401, "application/json"),
        ("/api/nothing-here", None, 404, "application/json"),
        ("/metrics", None, 200, "application/openmetrics-text"),
    ] {
        let (got, headers, len) = s.head_of(path, token).await;
        assert_eq!(got, status, "GET {path}");
        assert!(len > 0, "GET {path}: an empty body");
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_else(|| panic!("GET {path}: no {name} in {headers:?}"))
                .to_owned()
        };
        assert!(
            header("content-type").starts_with(content_type),
            "GET {path}: {headers:?}"
        );
        let csp = header("content-security-policy");
        for directive in [
            "default-src 'self'",
            "script-src 'self';",
            "connect-src 'self'",
            "object-src 'none'",
            "base-uri 'none'",
            "form-action 'self'",
            "frame-ancestors 'none'",
        ] {
            assert!(
                csp.contains(directive),
                "GET {path}: {directive} not in {csp}"
            );
        }
        assert!(
            !csp.contains("unsafe-eval") && !csp.contains('*'),
            "GET {path}: {csp}"
        );
        assert_eq!(header("x-content-type-options"), "nosniff", "GET {path}");
        assert_eq!(header("referrer-policy"), "no-referrer", "GET {path}");
        assert_eq!(header("x-frame-options"), "DENY", "GET {path}");
    }
    s.stop().await;
}

#[tokio::test]
async fn a_lessons_instructions_reach_the_page_rendered_and_with_nothing_that_runs() {
    let w = World::new().await;
    let mut config = w.config(policy(3600, 7200, 3), 8).await;
    let showcase = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../web/tests/lessons");
    config.lessons = ttlab_lesson::LessonSet::load(&showcase).unwrap();
    let s = w.serve(config).await;
    let (status, lessons) = s.get("/api/lessons", &token("alice", Role::Student)).await;
    assert_eq!(status, 200, "{lessons}");
    let html = lessons[0]["instructions_html"].as_str().unwrap();
    for shown in [
        "<table><thead><tr><th>service</th>",
        "<ol>\n<li>\n<p>Prepare the machine:</p>\n<ul>\n<li>",
        "&lt;script&gt;window.__pwned",
        "<a href=\"https://nginx.org/en/docs/\" target=\"_blank\" rel=\"noopener noreferrer\">",
    ] {
        assert!(html.contains(shown), "{shown:?} is not in {html}");
    }
    for never in ["<script", "<iframe", "<svg", "<div", "<b ", "<!--"] {
        assert!(!html.contains(never), "{never:?} is in {html}");
    }
    // Every attribute is one of the links' or the image's, with a target they may have.
    let attributes: Vec<&str> = html
        .split('<')
        .skip(1)
        .filter_map(|tag| tag.split_once('>').map(|(inside, _)| inside))
        .filter_map(|inside| inside.split_once(' ').map(|(_, attributes)| attributes))
        .collect();
    assert_eq!(
        attributes,
        [
            "href=\"https://nginx.org/en/docs/\" target=\"_blank\" rel=\"noopener noreferrer\"",
            "href=\"mailto:teacher@ttlab.example\" target=\"_blank\" rel=\"noopener noreferrer\"",
            "src=\"https://ttlab.invalid/diagram.png\" alt=\"A diagram of the lab\"",
        ]
    );
    s.stop().await;
}
