//! The API's request handling on the real router: any method, path, query, Authorization
//! header, content type and body. The database and the cluster are unreachable (closed
//! loopback ports), so a request that gets past validation ends in 503; everything before that
//! — auth, path and query extractors, JSON bodies — is the code under test.
//!
//! Oracles: never a panic, never a 500 (a client mistake is a 4xx, an unreachable database a
//! 503); error bodies are JSON `{"error", "message"}`; without a valid token no `/api/` route
//! (but the public OpenAPI document and the ticket-guarded console) answers anything but 4xx;
//! a student never gets a 2xx from an admin route; the signing secret never appears in an
//! answer.

#![no_main]

use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arbitrary::Arbitrary;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use base64::Engine as _;
use http_body_util::BodyExt as _;
use libfuzzer_sys::fuzz_target;
use tower::ServiceExt as _;
use ttlab_api::auth::{AuthConfig, AuthSecret, Role};
use ttlab_api::{ApiConfig, AppState};
use ttlab_cloudinit::AgentPayload;
use ttlab_cluster::{ClusterSettings, KubeCluster};
use ttlab_store::{DbUrl, Store, StoreOptions};

const SECRET: &[u8] = b"fuzz-secret-0123456789-abcdefghijklmnop";

#[derive(Debug, Arbitrary)]
enum Auth {
    None,
    Student,
    OtherStudent,
    Admin,
    AlgNone,
    WrongKey,
    Expired,
    NoSub,
    NoRole,
    BadRole,
    Raw(String),
    RawBearer(String),
}

impl Auth {
    fn valid_role(&self) -> Option<Role> {
        match self {
            Self::Student | Self::OtherStudent => Some(Role::Student),
            Self::Admin => Some(Role::Admin),
            _ => None,
        }
    }
}

#[derive(Debug, Arbitrary)]
enum Target {
    Lessons,
    Sessions,
    Current,
    Session,
    Extend,
    Grade,
    Events,
    Ticket,
    Console,
    AdminSessions,
    AdminCapacity,
    AdminReaper,
    AdminCollect,
    AdminStats,
    OpenApi,
    Health,
    Raw(String),
}

#[derive(Debug, Arbitrary)]
enum Id {
    Uuid(u128),
    Raw(String),
}

#[derive(Debug, Arbitrary)]
struct Input {
    method: u8,
    target: Target,
    id: Id,
    query: Option<String>,
    auth: Auth,
    content_type: Option<u8>,
    body: RequestBody,
}

#[derive(Debug, Arbitrary)]
enum RequestBody {
    Empty,
    Json(JsonBody),
    Raw(Vec<u8>),
}

#[derive(Debug, Arbitrary)]
enum JsonBody {
    Lesson(String),
    Value(u8, String),
}

struct World {
    runtime: tokio::runtime::Runtime,
    state: AppState,
    tokens: Tokens,
}

struct Tokens {
    student: String,
    other: String,
    admin: String,
    wrong_key: String,
    expired: String,
    no_sub: String,
    no_role: String,
    bad_role: String,
    alg_none: String,
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn sign(claims: serde_json::Value, key: &[u8]) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(key).unwrap(),
    )
    .unwrap()
}

fn world() -> &'static World {
    static WORLD: OnceLock<World> = OnceLock::new();
    WORLD.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let auth = AuthConfig::new(AuthSecret::new(SECRET.to_vec()).unwrap());
        let hour = Duration::from_secs(3600);
        let t = now();
        let b64 = |v: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v);
        let tokens = Tokens {
            student: auth
                .mint(&"alice".parse().unwrap(), Role::Student, t, hour)
                .unwrap(),
            other: auth
                .mint(&"bob".parse().unwrap(), Role::Student, t, hour)
                .unwrap(),
            admin: auth
                .mint(&"root".parse().unwrap(), Role::Admin, t, hour)
                .unwrap(),
            wrong_key: AuthConfig::new(AuthSecret::new(vec![9u8; 32]).unwrap())
                .mint(&"alice".parse().unwrap(), Role::Admin, t, hour)
                .unwrap(),
            expired: auth
                .mint(&"alice".parse().unwrap(), Role::Admin, t - 7200, hour)
                .unwrap(),
            no_sub: sign(
                serde_json::json!({"role": "admin", "exp": t + 3600}),
                SECRET,
            ),
            no_role: sign(serde_json::json!({"sub": "alice", "exp": t + 3600}), SECRET),
            bad_role: sign(
                serde_json::json!({"sub": "alice", "role": "root", "exp": t + 3600}),
                SECRET,
            ),
            alg_none: format!(
                "{}.{}.",
                b64(r#"{"alg":"none","typ":"JWT"}"#),
                b64(&format!(
                    r#"{{"sub":"alice","role":"admin","exp":{}}}"#,
                    t + 3600
                ))
            ),
        };
        let state = runtime.block_on(async {
            let store = Store::open(
                DbUrl::parse("postgres://fuzz@127.0.0.1:1/fuzz?connect_timeout=1").unwrap(),
                StoreOptions::default(),
            )
            .unwrap();
            let kube = kube::Config::new("http://127.0.0.1:1".parse().unwrap());
            let cluster = KubeCluster::from_config(kube, ClusterSettings::default()).unwrap();
            let config = ApiConfig::new(
                "dev".parse().unwrap(),
                auth,
                ttlab_lesson::samples::sample_set(),
                AgentPayload::new(b"\x7fELF stand-in").unwrap(),
            );
            AppState::new(config, store, std::sync::Arc::new(cluster))
        });
        World {
            runtime,
            state,
            tokens,
        }
    })
}

const METHODS: [&str; 6] = ["GET", "POST", "DELETE", "PUT", "PATCH", "HEAD"];

fuzz_target!(|input: Input| {
    let world = world();
    let id = match &input.id {
        Id::Uuid(n) => uuid_text(*n),
        Id::Raw(s) => s.clone(),
    };
    let path = match &input.target {
        Target::Lessons => "/api/lessons".to_owned(),
        Target::Sessions => "/api/sessions".to_owned(),
        Target::Current => "/api/sessions/current".to_owned(),
        Target::Session => format!("/api/sessions/{id}"),
        Target::Extend => format!("/api/sessions/{id}/extend"),
        Target::Grade => format!("/api/sessions/{id}/grade"),
        Target::Events => format!("/api/sessions/{id}/events"),
        Target::Ticket => format!("/api/sessions/{id}/console-ticket"),
        Target::Console => format!("/api/sessions/{id}/console"),
        Target::AdminSessions => "/api/admin/sessions".to_owned(),
        Target::AdminCapacity => "/api/admin/capacity".to_owned(),
        Target::AdminReaper => "/api/admin/reaper".to_owned(),
        Target::AdminCollect => "/api/admin/reaper/collect".to_owned(),
        Target::AdminStats => "/api/admin/stats".to_owned(),
        Target::OpenApi => "/api/openapi.json".to_owned(),
        Target::Health => "/healthz".to_owned(),
        Target::Raw(p) => p.clone(),
    };
    let uri = match &input.query {
        Some(q) => format!("{path}?{q}"),
        None => path,
    };
    let method = METHODS[usize::from(input.method) % METHODS.len()];
    let Ok(mut request) = Request::builder()
        .method(method)
        .uri(&uri)
        .body(Body::empty())
    else {
        return; // not a request a client could send
    };
    let t = &world.tokens;
    let authorization = match &input.auth {
        Auth::None => None,
        Auth::Student => Some(format!("Bearer {}", t.student)),
        Auth::OtherStudent => Some(format!("Bearer {}", t.other)),
        Auth::Admin => Some(format!("Bearer {}", t.admin)),
        Auth::AlgNone => Some(format!("Bearer {}", t.alg_none)),
        Auth::WrongKey => Some(format!("Bearer {}", t.wrong_key)),
        Auth::Expired => Some(format!("Bearer {}", t.expired)),
        Auth::NoSub => Some(format!("Bearer {}", t.no_sub)),
        Auth::NoRole => Some(format!("Bearer {}", t.no_role)),
        Auth::BadRole => Some(format!("Bearer {}", t.bad_role)),
        Auth::Raw(s) => Some(s.clone()),
        Auth::RawBearer(s) => Some(format!("Bearer {s}")),
    };
    if let Some(value) = authorization {
        let Ok(value) = value.parse() else { return };
        request.headers_mut().insert("authorization", value);
    }
    match input.content_type {
        None => {}
        Some(n) => {
            let ct = [
                "application/json",
                "text/plain",
                "application/json; charset=utf-8",
                "application/x-www-form-urlencoded",
            ][usize::from(n) % 4];
            request
                .headers_mut()
                .insert("content-type", ct.parse().unwrap());
        }
    }
    let body = match &input.body {
        RequestBody::Empty => Vec::new(),
        RequestBody::Json(JsonBody::Lesson(l)) => {
            serde_json::to_vec(&serde_json::json!({"lesson": l})).unwrap()
        }
        RequestBody::Json(JsonBody::Value(k, v)) => {
            let key = ["lesson", "id", "node", "scope", "limit", "ticket"][usize::from(*k) % 6];
            let mut map = serde_json::Map::new();
            map.insert(key.to_owned(), serde_json::Value::String(v.clone()));
            serde_json::to_vec(&map).unwrap()
        }
        RequestBody::Raw(b) => b.clone(),
    };
    // What the request itself carries (the fuzzer can learn the secret from this target's own
    // comparisons and send it; an answer quoting the request back is not a leak).
    let mut sent = uri.clone().into_bytes();
    if let Some(v) = request.headers().get("authorization") {
        sent.extend_from_slice(v.as_bytes());
    }
    sent.extend_from_slice(&body);
    let carried_secret = sent.windows(SECRET.len()).any(|w| w == SECRET);
    *request.body_mut() = Body::from(body);

    let router = ttlab_api::routes::router(world.state.clone());
    let (status, content_type, bytes) = world.runtime.block_on(async {
        let response = router.oneshot(request).await.unwrap();
        let status = response.status();
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        // Event streams never end by themselves: read what is there within a moment.
        let collected =
            tokio::time::timeout(Duration::from_secs(2), response.into_body().collect()).await;
        let bytes = match collected {
            Ok(Ok(c)) => c.to_bytes().to_vec(),
            Ok(Err(_)) | Err(_) => Vec::new(),
        };
        (status, content_type, bytes)
    });

    assert_ne!(
        status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{method} {uri}: {}",
        String::from_utf8_lossy(&bytes)
    );
    assert!(
        carried_secret || !bytes.windows(SECRET.len()).any(|w| w == SECRET),
        "the signing secret leaked"
    );
    // (A HEAD answer has the headers of the GET answer and no body.)
    if (status.is_client_error() || status.is_server_error())
        && content_type.starts_with("application/json")
        && method != "HEAD"
    {
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            panic!("{method} {uri} answered {status} with a body that is not JSON ({e}): {bytes:?}")
        });
        assert!(v["error"].is_string() && v["message"].is_string(), "{v}");
    }
    let uri_path = uri.split('?').next().unwrap_or("");
    let guarded = uri_path.starts_with("/api/")
        && uri_path != "/api/openapi.json"
        && !uri_path.ends_with("/console");
    if guarded && input.auth.valid_role().is_none() {
        assert!(
            status.is_client_error(),
            "{method} {uri} with {:?} answered {status}",
            input.auth
        );
    }
    if uri_path.starts_with("/api/admin") && input.auth.valid_role() == Some(Role::Student) {
        assert!(
            !status.is_success(),
            "a student got {status} from {method} {uri}"
        );
    }
});

fn uuid_text(n: u128) -> String {
    let h = format!("{n:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}
