//! The `sessions` table against a real throwaway PostgreSQL: one live session per user,
//! conditional transitions, extensions, listings and notifications.

use std::collections::BTreeSet;

use chrono::{DateTime, Duration, Utc};
use ttlab_model::{EnvName, FinalStatus, Runtime, SessionId, SessionStatus, UserId};
use ttlab_store::testing::TestDb;
use ttlab_store::{
    Channel, DiskKind, NewSession, SessionTimes, SessionVm, Stage, Store, StoreError,
};

fn env(name: &str) -> EnvName {
    name.parse().unwrap()
}

fn new_session(user: &str, lesson: &str, env_name: &str, now: DateTime<Utc>) -> NewSession {
    NewSession {
        id: SessionId::new_random(),
        user: UserId::new(user).unwrap(),
        lesson: lesson.parse().unwrap(),
        runtime: Runtime::Vm,
        env: env(env_name),
        site: "default".parse().unwrap(),
        times: SessionTimes {
            started_at: now,
            expires_at: now + Duration::minutes(60),
            max_expires_at: now + Duration::minutes(180),
        },
        readiness_deadline: now + Duration::seconds(150),
    }
}

async fn setup() -> (TestDb, Store, DateTime<Utc>) {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let now = store.db_now().await.unwrap();
    (db, store, now)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_concurrent_starts_for_one_user_open_exactly_one_session() {
    let (_db, store, now) = setup().await;
    let tasks: Vec<_> = (0..50)
        .map(|i| {
            let store = store.clone();
            let lesson = format!("lesson-{i}");
            tokio::spawn(async move {
                let new = new_session("alice", &lesson, "dev", now);
                store.sessions().insert(&new).await
            })
        })
        .collect();
    let mut opened = Vec::new();
    let mut refused = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Ok(s) => opened.push(s),
            Err(e) => refused.push(e),
        }
    }
    assert_eq!(opened.len(), 1, "exactly one session opens");
    assert_eq!(refused.len(), 49);
    let winner = &opened[0];
    for e in &refused {
        match e {
            StoreError::SessionExists {
                user,
                lesson,
                session,
                status,
            } => {
                assert_eq!(user.as_str(), "alice");
                assert_eq!(
                    lesson, &winner.lesson,
                    "the error names the lesson already open"
                );
                assert_eq!(*session, winner.id);
                assert_eq!(*status, SessionStatus::Starting);
            }
            other => panic!("expected SessionExists, got {other}"),
        }
        let text = e.to_string();
        assert!(text.contains(winner.lesson.as_str()), "{text}");
        assert!(!text.contains('\n'));
    }
    let live = store
        .sessions()
        .list_live(&env("dev"), None, 100)
        .await
        .unwrap();
    assert_eq!(live.len(), 1);
    assert_eq!(live[0].id, winner.id);
}

#[tokio::test]
async fn a_user_may_start_again_once_the_previous_session_is_final() {
    let (_db, store, now) = setup().await;
    let s = store.sessions();
    let first = s
        .insert(&new_session("bob", "systemd", "dev", now))
        .await
        .unwrap();
    assert!(matches!(
        s.insert(&new_session("bob", "kubeadm", "dev", now)).await,
        Err(StoreError::SessionExists { .. })
    ));
    // Finishing still holds resources: still refused.
    s.begin_finishing(
        first.id,
        &[SessionStatus::Starting],
        FinalStatus::Failed,
        Some("boom"),
    )
    .await
    .unwrap()
    .unwrap();
    assert!(matches!(
        s.insert(&new_session("bob", "kubeadm", "dev", now)).await,
        Err(StoreError::SessionExists {
            status: SessionStatus::Finishing,
            ..
        })
    ));
    let done = s.complete_finishing(first.id).await.unwrap().unwrap();
    assert_eq!(done.status, SessionStatus::Failed);
    assert_eq!(done.finishing_to, None);
    assert!(done.reclaimed_at.is_some());
    assert_eq!(done.failure_reason.as_deref(), Some("boom"));
    let second = s
        .insert(&new_session("bob", "kubeadm", "dev", now))
        .await
        .unwrap();
    assert_eq!(
        s.live_for_user(second.user.as_ref().unwrap())
            .await
            .unwrap()
            .unwrap()
            .id,
        second.id
    );
}

#[tokio::test]
async fn transitions_report_whether_they_applied() {
    let (_db, store, now) = setup().await;
    let s = store.sessions();
    let row = s
        .insert(&new_session("carol", "systemd", "dev", now))
        .await
        .unwrap();
    assert_eq!(row.status, SessionStatus::Starting);

    // Not running yet: cannot become a ghost or expire.
    assert_eq!(s.mark_ghost(row.id).await.unwrap(), None);
    assert_eq!(
        s.begin_expiring(row.id, row.expires_at).await.unwrap(),
        None
    );
    // Not finishing: nothing to complete.
    assert_eq!(s.complete_finishing(row.id).await.unwrap(), None);

    let running = s.mark_running(row.id, None).await.unwrap().unwrap();
    assert_eq!(running.status, SessionStatus::Running);
    assert!(running.ready_at.is_some());
    // A second replica doing the same finds it already done.
    assert_eq!(s.mark_running(row.id, None).await.unwrap(), None);

    let finishing = s
        .begin_finishing(
            row.id,
            &[SessionStatus::Running],
            FinalStatus::Finished,
            None,
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(finishing.status, SessionStatus::Finishing);
    assert_eq!(finishing.finishing_to, Some(FinalStatus::Finished));
    assert!(finishing.finished_at.is_some());
    assert_eq!(
        s.begin_finishing(
            row.id,
            &[SessionStatus::Running],
            FinalStatus::Expired,
            None
        )
        .await
        .unwrap(),
        None
    );
    let finished = s.complete_finishing(row.id).await.unwrap().unwrap();
    assert_eq!(finished.status, SessionStatus::Finished);
    assert_eq!(s.complete_finishing(row.id).await.unwrap(), None);

    // Unknown ids apply nowhere.
    assert_eq!(
        s.mark_running(SessionId::new_random(), None).await.unwrap(),
        None
    );
}

#[tokio::test]
async fn forbidden_transitions_are_refused_without_touching_the_row() {
    let (_db, store, now) = setup().await;
    let s = store.sessions();
    let row = s
        .insert(&new_session("dan", "systemd", "dev", now))
        .await
        .unwrap();
    let err = s
        .begin_finishing(
            row.id,
            &[SessionStatus::Expired],
            FinalStatus::Finished,
            None,
        )
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::InvalidTransition {
                from: SessionStatus::Expired,
                to: SessionStatus::Finishing
            }
        ),
        "{err}"
    );
    assert_eq!(s.get(row.id).await.unwrap().unwrap(), row);
}

#[tokio::test]
async fn ghosts_are_only_running_sessions() {
    let (_db, store, now) = setup().await;
    let s = store.sessions();
    let row = s
        .insert(&new_session("erin", "systemd", "dev", now))
        .await
        .unwrap();
    s.mark_running(row.id, None).await.unwrap().unwrap();
    let ghost = s.mark_ghost(row.id).await.unwrap().unwrap();
    assert_eq!(ghost.status, SessionStatus::Ghost);
    assert!(ghost.finished_at.is_some());
    assert_eq!(ghost.reclaimed_at, None);
    assert_eq!(s.mark_ghost(row.id).await.unwrap(), None);
    assert_eq!(
        s.live_for_user(row.user.as_ref().unwrap()).await.unwrap(),
        None
    );
}

#[tokio::test]
async fn extension_is_conditional_on_what_the_caller_saw() {
    let (_db, store, now) = setup().await;
    let s = store.sessions();
    let row = s
        .insert(&new_session("fay", "systemd", "dev", now))
        .await
        .unwrap();
    let later = row.expires_at + Duration::minutes(30);
    // Only running sessions extend.
    assert_eq!(s.extend(row.id, 0, later).await.unwrap(), None);
    s.mark_running(row.id, None).await.unwrap().unwrap();

    let extended = s.extend(row.id, 0, later).await.unwrap().unwrap();
    assert_eq!(extended.expires_at, later);
    assert_eq!(extended.extensions_used, 1);
    // The lifespan the countdown, the extend button and the reaper judge is the row's.
    let lifespan = extended.lifespan();
    assert_eq!(
        (
            lifespan.started_at,
            lifespan.expires_at,
            lifespan.extensions_used
        ),
        (row.started_at, later, 1)
    );
    assert!(!lifespan.is_expired(later - Duration::seconds(1)));
    assert!(lifespan.is_expired(later));
    // A second click computed from the same old row does not use another extension.
    assert_eq!(s.extend(row.id, 0, later).await.unwrap(), None);
    // Past the hard cap, or backwards: refused.
    assert_eq!(
        s.extend(row.id, 1, row.max_expires_at + Duration::seconds(1))
            .await
            .unwrap(),
        None
    );
    assert_eq!(s.extend(row.id, 1, row.expires_at).await.unwrap(), None);
    let capped = s
        .extend(row.id, 1, row.max_expires_at)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(capped.extensions_used, 2);

    // The reaper judged the old expiry; the extension in between wins.
    assert_eq!(
        s.begin_expiring(row.id, row.expires_at).await.unwrap(),
        None
    );
    let expiring = s
        .begin_expiring(row.id, capped.expires_at)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(expiring.finishing_to, Some(FinalStatus::Expired));
    assert_eq!(
        s.complete_finishing(row.id).await.unwrap().unwrap().status,
        SessionStatus::Expired
    );
}

#[tokio::test]
async fn an_already_expired_session_cannot_be_extended() {
    let (_db, store, now) = setup().await;
    let s = store.sessions();
    let mut new = new_session("gil", "systemd", "dev", now - Duration::minutes(61));
    new.times.expires_at = now - Duration::minutes(1);
    let row = s.insert(&new).await.unwrap();
    s.mark_running(row.id, None).await.unwrap().unwrap();
    assert_eq!(
        s.extend(row.id, 0, now + Duration::minutes(30))
            .await
            .unwrap(),
        None
    );
}

#[tokio::test]
async fn reaper_listings_see_only_their_environment_and_what_is_due() {
    let (_db, store, now) = setup().await;
    let s = store.sessions();
    let mut due = new_session("u1", "systemd", "dev", now - Duration::minutes(90));
    due.times.expires_at = now - Duration::minutes(30);
    let due = s.insert(&due).await.unwrap();
    s.mark_running(due.id, None).await.unwrap().unwrap();
    let fresh = s
        .insert(&new_session("u2", "systemd", "dev", now))
        .await
        .unwrap();
    s.mark_running(fresh.id, None).await.unwrap().unwrap();
    let mut other_env = new_session("u3", "systemd", "prod", now - Duration::minutes(90));
    other_env.times.expires_at = now - Duration::minutes(30);
    let other_env = s.insert(&other_env).await.unwrap();
    s.mark_running(other_env.id, None).await.unwrap().unwrap();
    let mut stuck = new_session("u4", "systemd", "dev", now - Duration::minutes(10));
    stuck.readiness_deadline = now - Duration::minutes(5);
    let stuck = s.insert(&stuck).await.unwrap();

    let dev = env("dev");
    let expired = s.list_expired(&dev, now, 100).await.unwrap();
    assert_eq!(
        expired.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![due.id]
    );
    let stuck_rows = s.list_stuck_starting(&dev, now, 100).await.unwrap();
    assert_eq!(
        stuck_rows.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![stuck.id]
    );
    assert_eq!(s.next_deadline(&dev).await.unwrap(), Some(due.expires_at));
    assert_eq!(s.next_deadline(&env("staging")).await.unwrap(), None);
    assert_eq!(s.count_live(&dev).await.unwrap(), 3);

    // The stuck session can be failed only once its deadline has passed.
    assert_eq!(
        s.fail_stuck_starting(stuck.id, now - Duration::minutes(6))
            .await
            .unwrap(),
        None
    );
    let failing = s.fail_stuck_starting(stuck.id, now).await.unwrap().unwrap();
    assert_eq!(failing.finishing_to, Some(FinalStatus::Failed));
    assert!(
        failing
            .failure_reason
            .unwrap()
            .contains("readiness deadline")
    );

    // Paging through live rows by id visits each once.
    let mut seen = BTreeSet::new();
    let mut after = None;
    loop {
        let page = s.list_live(&dev, after, 1).await.unwrap();
        let Some(last) = page.last() else { break };
        after = Some(last.id);
        assert!(seen.insert(last.id));
    }
    assert_eq!(seen, BTreeSet::from([due.id, fresh.id, stuck.id]));
    let running = s
        .list_in_status(&dev, SessionStatus::Running, None, 10)
        .await
        .unwrap();
    assert_eq!(running.len(), 2);
    assert_eq!(
        s.list_recent(&env("prod"), 10).await.unwrap()[0].id,
        other_env.id
    );
}

#[tokio::test]
async fn provisioning_details_are_recorded_on_live_sessions() {
    let (_db, store, now) = setup().await;
    let s = store.sessions();
    let row = s
        .insert(&new_session("hal", "kubeadm", "dev", now))
        .await
        .unwrap();
    assert!(s.record_stage(row.id, Stage::VmCreated).await.unwrap());
    let first = s.get(row.id).await.unwrap().unwrap().vm_created_at.unwrap();
    assert!(s.record_stage(row.id, Stage::VmCreated).await.unwrap());
    assert_eq!(
        s.get(row.id).await.unwrap().unwrap().vm_created_at,
        Some(first),
        "the first instant is kept"
    );
    assert!(s.record_stage(row.id, Stage::VmiRunning).await.unwrap());
    assert!(s.record_stage(row.id, Stage::AgentUp).await.unwrap());
    assert!(
        s.record_disk(row.id, DiskKind::Container, "golden PVC is ReadWriteOnce")
            .await
            .unwrap()
    );
    let vms = vec![
        SessionVm {
            node: "control-plane".parse().unwrap(),
            name: format!("ttlab-{}-control-plane", row.id.simple()),
        },
        SessionVm {
            node: "worker-1".parse().unwrap(),
            name: format!("ttlab-{}-worker-1", row.id.simple()),
        },
    ];
    assert!(s.record_vms(row.id, &vms).await.unwrap());
    assert!(
        s.record_failure_reason(row.id, "setup script exited 1")
            .await
            .unwrap()
    );
    let got = s.get(row.id).await.unwrap().unwrap();
    assert!(got.vmi_running_at.is_some() && got.agent_up_at.is_some());
    assert_eq!(
        got.disk,
        Some((
            DiskKind::Container,
            "golden PVC is ReadWriteOnce".to_owned()
        ))
    );
    assert_eq!(got.vms, vms);
    assert_eq!(got.failure_reason.as_deref(), Some("setup script exited 1"));
    assert_eq!(got.runtime, Runtime::Vm);

    // Final rows are history: nothing more is recorded on them.
    s.begin_finishing(
        row.id,
        &[SessionStatus::Starting],
        FinalStatus::Failed,
        None,
    )
    .await
    .unwrap()
    .unwrap();
    s.complete_finishing(row.id).await.unwrap().unwrap();
    assert!(!s.record_stage(row.id, Stage::AgentUp).await.unwrap());
    assert!(!s.record_disk(row.id, DiskKind::Golden, "x").await.unwrap());
}

#[tokio::test]
async fn session_changes_notify_the_environment() {
    let (_db, store, now) = setup().await;
    let mut listener = store.listen(&[Channel::SessionsChanged]).await.unwrap();
    let row = store
        .sessions()
        .insert(&new_session("ivy", "systemd", "prod", now))
        .await
        .unwrap();
    let n = listener.recv().await.unwrap();
    assert_eq!(n.channel, Channel::SessionsChanged);
    assert_eq!(n.payload, "prod");
    store
        .sessions()
        .mark_running(row.id, None)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(listener.recv().await.unwrap().payload, "prod");
}

#[tokio::test]
async fn the_capacity_lock_serialises_and_releases_on_drop() {
    let (_db, store, now) = setup().await;
    let guard = store.lock_capacity().await.unwrap();
    // While held, a second taker waits.
    let blocked =
        tokio::time::timeout(std::time::Duration::from_millis(300), store.lock_capacity()).await;
    assert!(blocked.is_err(), "the capacity lock was taken twice");
    let waiting = tokio::spawn({
        let store = store.clone();
        async move {
            let g = store.lock_capacity().await.unwrap();
            g.rollback().await.unwrap();
        }
    });
    let opened = guard
        .insert_session(&new_session("jan", "systemd", "dev", now))
        .await
        .unwrap();
    waiting.await.unwrap();
    assert_eq!(
        store.sessions().get(opened.id).await.unwrap().unwrap().id,
        opened.id
    );

    // A guard dropped without a decision rolls back and frees the lock.
    let dropped = store.lock_capacity().await.unwrap();
    drop(dropped);
    let again = store.lock_capacity().await.unwrap();
    let err = again
        .insert_session(&new_session("jan", "kubeadm", "dev", now))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::SessionExists { .. }), "{err}");
    store
        .lock_capacity()
        .await
        .unwrap()
        .rollback()
        .await
        .unwrap();
}

#[tokio::test]
async fn one_reaper_leads_each_environment() {
    let (_db, store, _now) = setup().await;
    let dev = env("dev");
    let leader = store
        .try_leader_lock(&dev)
        .await
        .unwrap()
        .expect("free at first");
    leader.check().await.unwrap();
    assert!(store.try_leader_lock(&dev).await.unwrap().is_none());
    let prod = store.try_leader_lock(&env("prod")).await.unwrap();
    assert!(prod.is_some(), "environments lead independently");
    leader.release().await.unwrap();
    let next = store
        .try_leader_lock(&dev)
        .await
        .unwrap()
        .expect("released");
    drop(next);
}

#[tokio::test]
async fn ending_a_starting_session_waits_for_its_provisioner_to_let_go() {
    let (_db, store, _now) = setup().await;
    let id = SessionId::new_random();
    let other = SessionId::new_random();
    assert!(!store.provisioning_in_progress(id).await.unwrap());
    let provisioner = store
        .try_provisioning_lock(id)
        .await
        .unwrap()
        .expect("free at first");
    assert!(store.provisioning_in_progress(id).await.unwrap());
    assert!(!store.provisioning_in_progress(other).await.unwrap());

    // While the provisioner holds on, a waiter gives up after its time.
    let started = std::time::Instant::now();
    let waited = store
        .wait_provisioning_lock(id, std::time::Duration::from_millis(300))
        .await
        .unwrap();
    assert!(waited.is_none(), "the provisioner still holds it");
    assert!(started.elapsed() >= std::time::Duration::from_millis(300));

    // Once the provisioner lets go (here: dropping its lease releases it), the waiter gets it
    // at once.
    let waiter = {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .wait_provisioning_lock(id, std::time::Duration::from_secs(30))
                .await
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    drop(provisioner);
    let held = waiter
        .await
        .unwrap()
        .unwrap()
        .expect("granted once released");
    assert!(store.provisioning_in_progress(id).await.unwrap());
    assert!(store.try_provisioning_lock(id).await.unwrap().is_none());
    drop(held);
}

#[tokio::test]
async fn a_session_records_its_site_and_reads_it_back_everywhere() {
    let (_db, store, now) = setup().await;
    let opened = store
        .sessions()
        .insert(&new_session("alice", "systemd-basics", "dev", now))
        .await
        .unwrap();
    assert_eq!(opened.site.as_str(), "default");
    let sessions = store.sessions();
    assert_eq!(
        sessions.get(opened.id).await.unwrap().unwrap().site,
        opened.site
    );
    let (read, _) = sessions.get_with_now(opened.id).await.unwrap().unwrap();
    assert_eq!(read.site.as_str(), "default");
    let mine = sessions
        .live_for_user(&UserId::new("alice").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(mine.site.as_str(), "default");

    // Another site is stored as given, and every listing reads it.
    let elsewhere = NewSession {
        site: "campus-a".parse().unwrap(),
        ..new_session("bob", "systemd-basics", "dev", now)
    };
    let bob = sessions.insert(&elsewhere).await.unwrap();
    assert_eq!(bob.site.as_str(), "campus-a");
    let live = sessions.list_live(&env("dev"), None, 10).await.unwrap();
    let sites: BTreeSet<(SessionId, &str)> = live.iter().map(|s| (s.id, s.site.as_str())).collect();
    assert_eq!(
        sites,
        BTreeSet::from([(opened.id, "default"), (bob.id, "campus-a")])
    );
}

#[tokio::test]
async fn the_database_refuses_a_site_that_is_not_a_site_name() {
    let (db, store, now) = setup().await;
    let opened = store
        .sessions()
        .insert(&new_session("alice", "systemd-basics", "dev", now))
        .await
        .unwrap();
    let (client, conn) = tokio_postgres::connect(db.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let set_site = |site: String| {
        let client = &client;
        async move {
            client
                .execute(
                    "UPDATE sessions SET site = $2 WHERE id = $1",
                    &[&opened.id.as_uuid(), &site],
                )
                .await
        }
    };
    for bad in [
        String::new(),
        "Campus-A".to_owned(),
        "campus_a".to_owned(),
        "-a".to_owned(),
        "a-".to_owned(),
        "dév".to_owned(),
        "a".repeat(41),
    ] {
        let err = set_site(bad.clone()).await.unwrap_err();
        let db_err = err
            .as_db_error()
            .unwrap_or_else(|| panic!("{bad:?}: {err}"));
        assert_eq!(
            db_err.constraint(),
            Some("sessions_site_check"),
            "{bad:?}: {err}"
        );
    }
    let err = client
        .execute(
            "UPDATE sessions SET site = NULL WHERE id = $1",
            &[&opened.id.as_uuid()],
        )
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        Some(&tokio_postgres::error::SqlState::NOT_NULL_VIOLATION)
    );
    // The longest name the model accepts is stored, and read back.
    let longest = "a".repeat(40);
    assert_eq!(set_site(longest.clone()).await.unwrap(), 1);
    let read = store.sessions().get(opened.id).await.unwrap().unwrap();
    assert_eq!(read.site.as_str(), longest);
}

#[tokio::test]
async fn a_row_written_without_a_site_is_on_the_default_site() {
    let (db, store, now) = setup().await;
    let (client, conn) = tokio_postgres::connect(db.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    // As a backend of schema version 16 writes it.
    let id = SessionId::new_random();
    client
        .execute(
            "INSERT INTO sessions (id, user_id, lesson, runtime, env, status, started_at, \
             expires_at, max_expires_at, readiness_deadline) \
             VALUES ($1, 'carol', 'systemd-basics', 'vm', 'dev', 'starting', $2, $2, $2, $2)",
            &[&id.as_uuid(), &now],
        )
        .await
        .unwrap();
    let read = store.sessions().get(id).await.unwrap().unwrap();
    assert_eq!(read.site.as_str(), "default");
}

#[tokio::test]
async fn reaper_listings_of_a_site_see_only_that_sites_sessions() {
    let (_db, store, now) = setup().await;
    let s = store.sessions();
    let site = |n: &str| -> ttlab_model::SiteName { n.parse().unwrap() };
    let open = |user: &str, on: &str, expired: bool| {
        let mut new = new_session(user, "systemd", "dev", now - Duration::minutes(90));
        new.site = site(on);
        new.times.expires_at = if expired {
            now - Duration::minutes(30)
        } else {
            now + Duration::minutes(30)
        };
        new
    };
    let a_due = s.insert(&open("u1", "a", true)).await.unwrap();
    s.mark_running(a_due.id, None).await.unwrap().unwrap();
    let b_due = s.insert(&open("u2", "b", true)).await.unwrap();
    s.mark_running(b_due.id, None).await.unwrap().unwrap();
    let mut stuck = open("u3", "b", false);
    stuck.readiness_deadline = now - Duration::minutes(5);
    let b_stuck = s.insert(&stuck).await.unwrap();
    let gone = s.insert(&open("u4", "gone", false)).await.unwrap();
    s.mark_running(gone.id, None).await.unwrap().unwrap();

    let dev = env("dev");
    let ids = |rows: Vec<ttlab_store::Session>| rows.into_iter().map(|r| r.id).collect::<Vec<_>>();
    assert_eq!(
        ids(s.list_expired_on(&dev, &site("a"), now, 100).await.unwrap()),
        [a_due.id]
    );
    assert_eq!(
        ids(s.list_expired_on(&dev, &site("b"), now, 100).await.unwrap()),
        [b_due.id]
    );
    assert_eq!(ids(s.list_expired(&dev, now, 100).await.unwrap()).len(), 2);
    assert!(
        s.list_stuck_starting_on(&dev, &site("a"), now, 100)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        ids(s
            .list_stuck_starting_on(&dev, &site("b"), now, 100)
            .await
            .unwrap()),
        [b_stuck.id]
    );
    assert_eq!(
        s.next_deadline_on(&dev, &site("a")).await.unwrap(),
        Some(a_due.expires_at)
    );
    assert_eq!(s.next_deadline_on(&dev, &site("c")).await.unwrap(), None);
    assert_eq!(
        ids(s.list_live_on(&dev, &site("b"), None, 100).await.unwrap())
            .into_iter()
            .collect::<BTreeSet<_>>(),
        BTreeSet::from([b_due.id, b_stuck.id])
    );
    assert_eq!(
        ids(s
            .list_in_status_on(&dev, &site("a"), SessionStatus::Running, None, 100)
            .await
            .unwrap()),
        [a_due.id]
    );
    // The live sessions of sites not configured, counted by site.
    assert_eq!(
        s.live_on_other_sites(&dev, &[site("a"), site("b")])
            .await
            .unwrap(),
        [(site("gone"), 1)]
    );
    assert!(
        s.live_on_other_sites(&env("prod"), &[site("a")])
            .await
            .unwrap()
            .is_empty()
    );
    // The capacity check's view: one site's live VM sessions, or every site's in one
    // statement, grouped by site, the same sessions either way.
    let of = |rows: Vec<(SessionId, ttlab_model::LessonId, Vec<String>)>| {
        rows.into_iter().map(|r| r.0).collect::<BTreeSet<_>>()
    };
    let by_site = s.live_vm_sessions_by_site().await.unwrap();
    assert_eq!(
        by_site.keys().map(|k| k.as_str()).collect::<Vec<_>>(),
        ["a", "b", "gone"]
    );
    for name in ["a", "b", "gone"] {
        let one = of(s.live_vm_sessions_of_site(&site(name)).await.unwrap());
        assert_eq!(of(by_site[&site(name)].clone()), one, "{name}");
    }
    assert_eq!(
        of(by_site[&site("b")].clone()),
        BTreeSet::from([b_due.id, b_stuck.id])
    );
}
