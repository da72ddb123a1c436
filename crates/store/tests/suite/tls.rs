//! TLS to PostgreSQL from `sslmode` in the URL, against a throwaway server that requires TLS
//! (its certificate signed by a CA made at test time with `openssl`).

use ttlab_store::testing::TlsServer;
use ttlab_store::{SslMode, Store, StoreError, StoreOptions};

/// The TLS server, or `None` (after `skip_or_fail`) when `openssl` is missing.
fn server() -> Option<TlsServer> {
    if ttlab_testkit::which("openssl").is_none() {
        ttlab_testkit::skip_or_fail("openssl is not on PATH (needed to make test certificates)");
        return None;
    }
    Some(TlsServer::start().expect("TLS-enabled throwaway PostgreSQL"))
}

fn params(mode: &str, ca: &std::path::Path) -> String {
    format!("sslmode={mode}&sslrootcert={}", ca.display())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_connects_and_a_wrong_ca_or_host_fails_clearly() {
    let Some(pg) = server() else { return };
    pg.create_database("ttlab", true).await.unwrap();

    // The right CA and name: the store works (the server refuses TCP without TLS, so it runs
    // encrypted), leases included.
    let url = pg.url("localhost", "ttlab", &params("verify-full", &pg.ca()));
    let store = Store::connect(&url, StoreOptions::default()).await.unwrap();
    assert_eq!(store.url().ssl_mode(), SslMode::VerifyFull);
    store.db_now().await.unwrap();
    let env = "dev".parse().unwrap();
    let lock = store.try_leader_lock(&env).await.unwrap().expect("free");
    lock.release().await.unwrap();
    assert!(store.migrate().await.unwrap().applied.is_empty());

    // A CA that did not sign the certificate: a one-line reason, no password, no panic.
    let wrong = pg.url("localhost", "ttlab", &params("verify-full", &pg.wrong_ca()));
    let err = Store::connect(&wrong, StoreOptions::default())
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, StoreError::Connect { .. }), "{err:?}");
    // A refusal, not an outage: a process gives up on it instead of waiting.
    assert!(err.is_rejection(), "{err:?}");
    assert!(text.contains("localhost"), "{text}");
    assert!(text.contains("certificate"), "{text}");
    assert!(text.contains("UnknownIssuer"), "{text}");
    assert!(!text.contains('\n'), "{text}");

    // The right CA, but the certificate does not name the host connected to.
    let by_ip = pg.url("127.0.0.1", "ttlab", &params("verify-full", &pg.ca()));
    let err = Store::connect(&by_ip, StoreOptions::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("certificate"), "{err}");
    assert!(err.contains("not valid for name \"127.0.0.1\""), "{err}");
    // verify-ca checks the authority only: that connects.
    let ca_only = pg.url("127.0.0.1", "ttlab", &params("verify-ca", &pg.ca()));
    Store::connect(&ca_only, StoreOptions::default())
        .await
        .unwrap()
        .db_now()
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_encrypts_without_checking_and_disable_is_refused_by_this_server() {
    let Some(pg) = server() else { return };
    pg.create_database("ttlab", true).await.unwrap();

    for mode in ["require", "prefer"] {
        let url = pg.url("127.0.0.1", "ttlab", &format!("sslmode={mode}"));
        Store::connect(&url, StoreOptions::default())
            .await
            .unwrap_or_else(|e| panic!("sslmode={mode}: {e}"))
            .db_now()
            .await
            .unwrap();
    }
    // `require` with a CA verifies it, as libpq does.
    let url = pg.url("127.0.0.1", "ttlab", &params("require", &pg.wrong_ca()));
    let err = Store::connect(&url, StoreOptions::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("UnknownIssuer"), "{err}");

    let plain = pg.url("127.0.0.1", "ttlab", "sslmode=disable");
    let err = Store::connect(&plain, StoreOptions::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no encryption") || err.contains("pg_hba"),
        "{err}"
    );
}

#[test]
fn bad_tls_settings_in_the_url_are_refused_before_connecting() {
    for (url, why) in [
        (
            "postgres://u:hunter2@db/x?sslmode=verify-full",
            "sslmode=verify-full needs sslrootcert",
        ),
        (
            "postgres://u:hunter2@db/x?sslmode=always",
            "sslmode must be disable, prefer, require, verify-ca or verify-full",
        ),
        (
            "postgres://u:hunter2@db/x?sslmode=verify-ca&sslrootcert=/no/such/ca.pem",
            "sslrootcert /no/such/ca.pem",
        ),
        (
            "host=db user=u password=hunter2 sslmode=verify-full",
            "needs sslrootcert",
        ),
    ] {
        let err = ttlab_store::DbUrl::parse(url).unwrap_err().to_string();
        assert!(err.starts_with("invalid database URL"), "{err}");
        assert!(err.contains(why), "{url}: {err}");
        assert!(!err.contains("hunter2"), "{err}");
    }
    // The other parameters still reach the driver; libpq's default is `prefer`.
    let u =
        ttlab_store::DbUrl::parse("postgres://u@db/x?application_name=t&sslmode=require").unwrap();
    assert_eq!(u.ssl_mode(), SslMode::Require);
    assert_eq!(u.config().get_application_name(), Some("t"));
    let u = ttlab_store::DbUrl::parse("postgres://u@db/x").unwrap();
    assert_eq!(u.ssl_mode(), SslMode::Prefer);
}
