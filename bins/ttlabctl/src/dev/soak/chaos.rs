//! The chaos options: SIGKILL and restart a reaper or a server (alternating environments), stop
//! and start PostgreSQL, roll a server (a successor started and serving, then SIGTERM: the old
//! one hands its sessions in preparation over), and the dirty network faults — blackhole,
//! stall, lose replies — on one process's fault proxy at a time (to PostgreSQL or to the
//! Kubernetes API), the loops taking turns. Each disturbance is journaled with when it began
//! and ended, for the invariants that excuse what it caused (late reclamation, 503 during an
//! outage) and for those that must hold anyway (no session failed by a deploy).

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use tokio::sync::watch;
use ttlab_testkit::FaultMode;

use super::rig::{Disrupted, Disturbance, NetFault, Shared, Target, lock};
use crate::dev::demo::stack::free_loopback_port;
use crate::dev::demo::wait_ready;

/// How long a rolled server gets after SIGTERM: its hand-over (up to 10 s) and its open
/// requests, as a Deployment's termination grace would give.
const ROLL_GRACE: Duration = Duration::from_secs(25);

/// How many times a rolling restart starts its successor before it gives up (the old server
/// then keeps serving).
const ROLL_ATTEMPTS: u32 = 5;

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
        out.push(tokio::spawn(postgres_loop(
            shared.clone(),
            stop.clone(),
            every,
        )));
    }
    if let Some(every) = s.rolling_restart_every {
        out.push(tokio::spawn(rolling_loop(
            shared.clone(),
            stop.clone(),
            every,
        )));
    }
    // One network fault at a time: the loops take turns on this lock.
    let turn = Arc::new(tokio::sync::Mutex::new(()));
    for (i, (fault, setting)) in [
        (NetFault::Blackhole, s.blackhole),
        (NetFault::Stall, s.stall),
        (NetFault::LoseReplies, s.lose_replies),
    ]
    .into_iter()
    .enumerate()
    {
        if let Some((every, lasts)) = setting {
            out.push(tokio::spawn(net_loop(
                shared.clone(),
                stop.clone(),
                turn.clone(),
                fault,
                every,
                lasts,
                // Each loop starts at a different link, so the three cover them all sooner.
                i * 3,
            )));
        }
    }
    if let Some((every, lasts)) = s.lose_site {
        out.push(tokio::spawn(lose_site_loop(
            shared.clone(),
            stop.clone(),
            turn,
            every,
            lasts,
        )));
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
        wait_ready(child, &shared.url(env)).await?;
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

async fn rolling_loop(shared: Arc<Shared>, mut stop: watch::Receiver<bool>, every: Duration) {
    let mut env = 0;
    while wait(&mut stop, every).await {
        if let Err(e) = roll(&shared, env).await {
            eprintln!("ttlabctl: soak: chaos: rolling restart: {e:#}");
        }
        env = 1 - env;
    }
}

/// A rolling restart of environment `env`'s server, as a Deployment with maxSurge 1 does it:
/// the successor starts (on a port of its own) and is ready, students are sent to it, then the
/// old server gets SIGTERM and hands over the sessions it was preparing.
async fn roll(shared: &Shared, env: usize) -> anyhow::Result<()> {
    let listen = SocketAddr::from((Ipv4Addr::LOCALHOST, free_loopback_port()?));
    let url = format!("http://{listen}");
    let mut old = {
        let mut procs = shared.procs.lock().await;
        let Some(p) = procs.iter_mut().find(|p| p.env == env && !p.reaper) else {
            return Ok(());
        };
        let old = p.child.take();
        let before = p.var("TTLAB_LISTEN");
        p.set_var("TTLAB_LISTEN", listen.to_string().into());
        // A successor that cannot start (PostgreSQL down or its connection cut just then)
        // exits; it is started again, as a Deployment restarts a crashed pod.
        let mut started = Ok(());
        for attempt in 1..=ROLL_ATTEMPTS {
            started = match p.spawn() {
                Ok(()) => match p.child.as_mut() {
                    Some(child) => wait_ready(child, &url).await,
                    None => Ok(()),
                },
                Err(e) => Err(e),
            };
            if started.is_ok() || attempt == ROLL_ATTEMPTS {
                break;
            }
            shared.journal.count("rolling successors restarted");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        if let Err(e) = started {
            // The old server keeps serving.
            if let Some(mut new) = p.child.take() {
                let _ = new.stop(Duration::from_secs(5)).await;
            }
            p.child = old;
            if let Some(v) = before {
                p.set_var("TTLAB_LISTEN", v);
            }
            return Err(e);
        }
        old
    };
    shared.set_url(env, url);
    let start = Utc::now();
    if let Some(child) = old.as_mut() {
        let status = child.stop(ROLL_GRACE).await?;
        if !status.success() {
            eprintln!(
                "ttlabctl: soak: the rolled {} ended with {status}",
                child.name()
            );
            shared.journal.count("rolled servers not stopping cleanly");
        }
    }
    shared.journal.count("rolling restarts");
    lock(&shared.journal.disturbances).push(Disturbance {
        what: Disrupted::Rolling(env),
        start,
        end: Utc::now(),
    });
    Ok(())
}

async fn net_loop(
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
    turn: Arc<tokio::sync::Mutex<()>>,
    fault: NetFault,
    every: Duration,
    lasts: Duration,
    first: usize,
) {
    let mut next = first;
    while wait(&mut stop, every).await {
        if shared.links.is_empty() {
            return;
        }
        let link = &shared.links[next % shared.links.len()];
        next += 1;
        let _turn = turn.lock().await;
        // A site taken away stays away: its links are the site loss's until it returns.
        if link.id.target == Target::Kube && *lock(&shared.lost_site) == Some(link.id.site) {
            continue;
        }
        let start = Utc::now();
        link.proxy.set_mode(match fault {
            NetFault::Blackhole => FaultMode::Blackhole,
            NetFault::Stall => FaultMode::Stall,
            NetFault::LoseReplies => FaultMode::LoseReplies,
        });
        tokio::time::sleep(lasts).await;
        match fault {
            // A partition that healed: what was held is delivered.
            NetFault::Stall => link.proxy.set_mode(FaultMode::Pass),
            // The byte streams are broken: the connections end (as the peer's RST would end
            // them once the path is back), new ones pass.
            NetFault::Blackhole | NetFault::LoseReplies => {
                link.proxy.set_mode(FaultMode::Close);
                link.proxy.set_mode(FaultMode::Pass);
            }
        }
        shared.journal.count(match fault {
            NetFault::Blackhole => "connections blackholed",
            NetFault::Stall => "connections stalled",
            NetFault::LoseReplies => "replies lost",
        });
        lock(&shared.journal.disturbances).push(Disturbance {
            what: Disrupted::Link(link.id, fault),
            start,
            end: Utc::now(),
        });
    }
}

/// Takes the sites away in turn: every process's connections to the site's API server are
/// blackholed (the server and the reaper see a cluster that stopped answering, as a network
/// partition or a crashed control plane shows itself), for `lasts`; then those connections
/// are cut and new ones pass. Each loss waits for the turn of the network faults to begin, so
/// none of them is on the site's links just then, and they leave those links alone until the
/// site is back.
async fn lose_site_loop(
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
    turn: Arc<tokio::sync::Mutex<()>>,
    every: Duration,
    lasts: Duration,
) {
    let sites = shared.settings.sites.len();
    let mut site = 0;
    while wait(&mut stop, every).await {
        let links: Vec<_> = shared
            .links
            .iter()
            .filter(|l| l.id.target == Target::Kube && l.id.site == site)
            .collect();
        let start = {
            let _turn = turn.lock().await;
            *lock(&shared.lost_site) = Some(site);
            for l in &links {
                l.proxy.set_mode(FaultMode::Blackhole);
            }
            Utc::now()
        };
        eprintln!(
            "ttlabctl: soak: chaos: {} lost for {}",
            shared.settings.sites[site],
            humantime::format_duration(lasts)
        );
        tokio::time::sleep(lasts).await;
        for l in &links {
            l.proxy.set_mode(FaultMode::Close);
            l.proxy.set_mode(FaultMode::Pass);
        }
        *lock(&shared.lost_site) = None;
        shared.journal.count("sites lost");
        lock(&shared.journal.disturbances).push(Disturbance {
            what: Disrupted::Site(site),
            start,
            end: Utc::now(),
        });
        site = (site + 1) % sites;
    }
}
