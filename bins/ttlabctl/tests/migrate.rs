//! `ttlabctl migrate` as a user runs it: against a throwaway PostgreSQL, twice, from several
//! processes at once, and with URLs that are malformed or point nowhere.

use std::process::{Command, Output};

use ttlab_store::SCHEMA_VERSION;
use ttlab_store::testing::TestDb;

fn ttlabctl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ttlabctl"))
        .args(args)
        .env_remove("DATABASE_URL")
        .output()
        .expect("ttlabctl runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The migrated schema is usable: every table answers through the store.
async fn assert_schema_usable(db: &TestDb) {
    let store = db.store().await.unwrap();
    let env: ttlab_model::EnvName = "dev".parse().unwrap();
    assert_eq!(store.sessions().count_live(&env).await.unwrap(), 0);
    assert!(
        store
            .reaper_cycles()
            .recent(Some(&env), 5)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        store
            .collect_requests()
            .pending(&env)
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn migrate_applies_the_schema_once_and_then_finds_it_up_to_date() {
    let db = TestDb::new_empty().await.unwrap();

    let first = ttlabctl(&["migrate", "--database-url", db.url()]);
    assert!(first.status.success(), "{}", text(&first.stderr));
    let out = text(&first.stdout);
    assert!(
        out.contains(&format!("applied {SCHEMA_VERSION} migration(s)")),
        "{out}"
    );
    assert!(out.contains("V1__initial_schema"), "{out}");

    // The URL may also come from DATABASE_URL.
    let second = Command::new(env!("CARGO_BIN_EXE_ttlabctl"))
        .arg("migrate")
        .env("DATABASE_URL", db.url())
        .output()
        .unwrap();
    assert!(second.status.success(), "{}", text(&second.stderr));
    assert!(text(&second.stdout).contains(&format!("up to date (version {SCHEMA_VERSION})")));

    assert_schema_usable(&db).await;
}

#[tokio::test]
async fn several_processes_migrating_at_once_apply_the_schema_exactly_once() {
    let db = TestDb::new_empty().await.unwrap();
    let children: Vec<_> = (0..4)
        .map(|_| {
            Command::new(env!("CARGO_BIN_EXE_ttlabctl"))
                .args(["migrate", "--database-url", db.url()])
                .env_remove("DATABASE_URL")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outputs: Vec<Output> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    for o in &outputs {
        assert!(o.status.success(), "{}", text(&o.stderr));
    }
    let applied = outputs
        .iter()
        .filter(|o| text(&o.stdout).contains(&format!("applied {SCHEMA_VERSION} migration(s)")))
        .count();
    assert_eq!(applied, 1);
}

fn assert_one_line_failure(out: &Output, expected: &str, password: &str) {
    assert_eq!(out.status.code(), Some(1), "exit status");
    let err = text(&out.stderr);
    assert_eq!(err.lines().count(), 1, "one line: {err:?}");
    assert!(err.contains(expected), "{err}");
    assert!(!err.contains(password), "password leaked: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(out.stdout.is_empty());
}

#[test]
fn a_malformed_url_is_one_clear_line_and_a_failure() {
    let out = ttlabctl(&[
        "migrate",
        "--database-url",
        "postgres://ttlab:hunter2@127.0.0.1:notaport/ttlab",
    ]);
    assert_one_line_failure(
        &out,
        "ttlabctl: error: invalid database URL postgres://ttlab:***@127.0.0.1:notaport/ttlab",
        "hunter2",
    );
    let out = ttlabctl(&["migrate", "--database-url", "localhost:5432/ttlab"]);
    assert_one_line_failure(&out, "expected postgres://", "\u{0}");
}

#[test]
fn an_unreachable_server_is_one_line_naming_host_and_database() {
    // Port 1 on loopback: nothing listens there, so the connection is refused at once.
    let out = ttlabctl(&[
        "migrate",
        "--database-url",
        "postgres://ttlab:hunter2@127.0.0.1:1/ttlab",
    ]);
    assert_one_line_failure(
        &out,
        "ttlabctl: error: cannot connect to PostgreSQL at 127.0.0.1:1/ttlab: connection refused",
        "hunter2",
    );
}

#[test]
fn a_missing_url_is_a_usage_error() {
    let out = ttlabctl(&["migrate"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("--database-url"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_wait_it_waits_for_a_database_that_is_down_and_migrates_once_it_answers() {
    let mut pg = tokio::task::spawn_blocking(ttlab_store::ephemeral::PgCluster::start)
        .await
        .unwrap()
        .expect("a throwaway PostgreSQL (initdb and postgres must be installed)");
    let url = pg.create_database("ttlab").await.unwrap();
    tokio::task::block_in_place(|| pg.pause()).unwrap();
    let waiting = tokio::process::Command::new(env!("CARGO_BIN_EXE_ttlabctl"))
        .args(["migrate", "--wait", "60s", "--database-url", &url])
        .env_remove("DATABASE_URL")
        .kill_on_drop(true)
        .output();
    let waiting = tokio::spawn(waiting);
    // Down for a while: it keeps trying instead of failing.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    assert!(
        !waiting.is_finished(),
        "it gave up while the database was down"
    );
    tokio::task::block_in_place(|| pg.resume()).unwrap();
    let out = tokio::time::timeout(std::time::Duration::from_secs(30), waiting)
        .await
        .expect("it migrates soon after the database returned")
        .unwrap()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("waiting for the database: cannot connect"),
        "{}",
        text(&out.stderr)
    );
    assert!(
        text(&out.stdout).contains(&format!("schema now at version {SCHEMA_VERSION}")),
        "{}",
        text(&out.stdout)
    );
    tokio::task::block_in_place(|| pg.stop()).unwrap();
}
