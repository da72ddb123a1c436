//! The schema's CHECK constraints accept exactly the spellings of the Rust enums, so a value
//! the model can produce is always storable and the database never holds one it cannot read.

use std::collections::BTreeSet;

use ttlab_model::{FinalStatus, Runtime, SessionStatus};
use ttlab_store::testing::TestDb;
use ttlab_store::{CycleTrigger, DiskKind};

/// The quoted literals in the definition of the CHECK constraint on `table.column`.
async fn allowed_values(
    client: &tokio_postgres::Client,
    table: &str,
    column: &str,
) -> BTreeSet<String> {
    let rows = client
        .query(
            "SELECT pg_get_constraintdef(c.oid) FROM pg_constraint c \
             JOIN pg_class t ON t.oid = c.conrelid \
             JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = ANY(c.conkey) \
             WHERE c.contype = 'c' AND t.relname = $1 AND a.attname = $2 \
             AND cardinality(c.conkey) = 1",
            &[&table, &column],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 1, "one CHECK on {table}.{column}");
    let def: String = rows[0].get(0);
    def.split('\'')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

fn names<T>(all: impl IntoIterator<Item = T>, f: impl Fn(T) -> &'static str) -> BTreeSet<String> {
    all.into_iter().map(|v| f(v).to_owned()).collect()
}

#[tokio::test]
async fn check_constraints_match_the_enums() {
    let db = TestDb::new().await.unwrap();
    let (client, conn) = tokio_postgres::connect(db.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    assert_eq!(
        allowed_values(&client, "sessions", "status").await,
        names(SessionStatus::ALL, SessionStatus::as_str)
    );
    assert_eq!(
        allowed_values(&client, "sessions", "finishing_to").await,
        names(FinalStatus::ALL, FinalStatus::as_str)
    );
    assert_eq!(
        allowed_values(&client, "sessions", "runtime").await,
        names(Runtime::ALL, Runtime::as_str)
    );
    assert_eq!(
        allowed_values(&client, "sessions", "disk_kind").await,
        names(DiskKind::ALL, DiskKind::as_str)
    );
    assert_eq!(
        allowed_values(&client, "reaper_cycles", "trigger").await,
        names(CycleTrigger::ALL, CycleTrigger::as_str)
    );
    // The one-live-session index covers exactly the live statuses.
    let row = client
        .query_one(
            "SELECT pg_get_expr(i.indpred, i.indrelid) FROM pg_index i \
             JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = 'sessions_one_live_per_user'",
            &[],
        )
        .await
        .unwrap();
    let predicate: String = row.get(0);
    let live: BTreeSet<String> = predicate
        .split('\'')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect();
    assert_eq!(live, names(SessionStatus::LIVE, SessionStatus::as_str));
}
