//! The chaos options: SIGKILL and restart a reaper or a server (alternating environments), stop
//! and start PostgreSQL. Each disturbance is journaled with when it began and ended, for the
//! invariants that excuse what it caused (late reclamation, 503 during an outage).

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use tokio::sync::watch;

use super::rig::{Disrupted, Disturbance, Shared, lock};
use crate::demo::wait_ready;

/// How long PostgreSQL stays down per restart.
const OUTAGE: Duration = Duration::from_secs(2);

/// Starts the chaos loops the settings ask for.
pub(crate) fn spawn_all(
    shared: &Arc<Shared>,
    stop: watch::Receiver<bool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut out = Vec::new();
    let s = &shared.settings;
    if let Some(every) = s.kill_reaper_every {
        out.push(tokio::spawn(kill_loop(
            shared.clone(),
            stop.clone(),
            every,
            true,
        )));
    }
    if let Some(every) = s.kill_server_every {
        out.push(tokio::spawn(kill_loop(
            shared.clone(),
            stop.clone(),
            every,
            false,
        )));
    }
    if let Some(every) = s.restart_postgres_every {
        out.push(tokio::spawn(postgres_loop(shared.clone(), stop, every)));
    }
    out
}

/// Waits `d`; false when the run stopped first.
async fn wait(stop: &mut watch::Receiver<bool>, d: Duration) -> bool {
    let stopped = tokio::select! {
        () = tokio::time::sleep(d) => false,
        _ = stop.wait_for(|s| *s) => true,
    };
    !stopped && !*stop.borrow()
}

async fn kill_loop(
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
    every: Duration,
    reaper: bool,
) {
    let mut env = 0;
    while wait(&mut stop, every).await {
        if let Err(e) = kill_and_restart(&shared, env, reaper).await {
            eprintln!("ttlabctl: soak: chaos: {e:#}");
        }
        env = 1 - env;
    }
}

async fn kill_and_restart(shared: &Shared, env: usize, reaper: bool) -> anyhow::Result<()> {
    let mut procs = shared.procs.lock().await;
    let Some(p) = procs
        .iter_mut()
        .find(|p| p.env == env && p.reaper == reaper)
    else {
        return Ok(());
    };
    let start = Utc::now();
    if let Some(child) = p.child.as_mut() {
        if let Some(pid) = i32::try_from(child.pid())
            .ok()
            .and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
        child.exited().await?;
    }
    shared.journal.count(if reaper {
        "reapers killed"
    } else {
        "servers killed"
    });
    p.spawn()?;
    if !reaper && let Some(child) = p.child.as_mut() {
        wait_ready(child, &shared.urls[env]).await?;
    }
    lock(&shared.journal.disturbances).push(Disturbance {
        what: if reaper {
            Disrupted::Reaper(env)
        } else {
            Disrupted::Server(env)
        },
        start,
        end: Utc::now(),
    });
    Ok(())
}

async fn postgres_loop(shared: Arc<Shared>, mut stop: watch::Receiver<bool>, every: Duration) {
    while wait(&mut stop, every).await {
        let mut db = shared.database.lock().await;
        let Some(db) = db.as_mut() else { return };
        let start = Utc::now();
        if let Err(e) = db.pause().await {
            eprintln!("ttlabctl: soak: chaos: {e:#}");
            continue;
        }
        tokio::time::sleep(OUTAGE).await;
        if let Err(e) = db.resume().await {
            eprintln!("ttlabctl: soak: chaos: {e:#}");
        }
        shared.journal.count("PostgreSQL restarts");
        lock(&shared.journal.disturbances).push(Disturbance {
            what: Disrupted::Postgres,
            start,
            end: Utc::now(),
        });
    }
}
