//! `ttlabctl bench pool`: "Start lab" → running with a warm pool, against the cold path in the
//! same run. The real `ttlab-server` (release build for figures worth reading), kube-sim with
//! realistic boot and setup delays, a throwaway PostgreSQL, all over loopback.
//!
//! An operator gives the lesson a pool (`PUT /api/admin/pools/{lesson}`, size 4 by default);
//! once it is ready, students arrive at random instants over the run (seeded), each clicks
//! "Start lab", polls the session until it is running, works for a while and finishes. A
//! click answered with a running session was served by the pool (a hit); any other went the
//! cold way (a miss). Printed: click → running p50 and p99 of the hits against their targets
//! (≤ 2 s, ≤ 5 s), the hit rate, the misses' figures beside them, and the pool's own counts.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use ttlab_api::auth::Role;
use ttlab_model::UserId;

use super::api::{Dist, Rig, RigSettings, ms, parse_duration, sim_priority, verdict};
use crate::dev::demo::client::{self, Method};
use crate::dev::soak::students::Rng;

/// Target of click → running p50 for a hit.
const HIT_P50_TARGET: Duration = Duration::from_secs(2);
/// Target of click → running p99 for a hit.
const HIT_P99_TARGET: Duration = Duration::from_secs(5);

/// Arguments of `ttlabctl bench pool`.
#[derive(Debug, Clone, Args)]
pub struct PoolBenchArgs {
    /// Students arriving, each once.
    #[arg(long, default_value_t = 50)]
    pub students: u32,
    /// The span their arrivals are spread over (uniformly at random).
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    pub over: Duration,
    /// The pool's size.
    #[arg(long, default_value_t = 4)]
    pub pool_size: u32,
    /// How long each student works before finishing the session.
    #[arg(long, default_value = "2m", value_parser = parse_duration)]
    pub work: Duration,
    /// Simulated guest boot time (VMI Scheduled → its agent listening, Running halfway; a VM
    /// powers on in about 20 s).
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    pub sim_boot: Duration,
    /// Simulated lab setup inside the guest (Running → readiness marker).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub sim_setup: Duration,
    /// The server's VM limit.
    #[arg(long, default_value_t = 40)]
    pub vm_limit: u64,
    /// Seed of the arrival instants.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Lesson to pool (default: the first single-node VM lesson).
    #[arg(long)]
    pub lesson: Option<String>,
    /// Lesson file or directory (default: the checkout's `lessons/`).
    #[arg(long, env = "TTLAB_LESSONS", value_name = "PATH")]
    pub lessons: Option<std::path::PathBuf>,
}

/// One student's click.
struct Click {
    /// Served running at once (by the pool).
    hit: bool,
    /// Click → the session seen running.
    to_running: Option<Duration>,
    /// What went wrong, if it never ran.
    error: Option<String>,
}

/// Runs the benchmark and prints its figures.
pub async fn run(args: PoolBenchArgs) -> anyhow::Result<()> {
    if args.students == 0 || args.pool_size == 0 {
        anyhow::bail!("--students and --pool-size must be at least 1");
    }
    let (lessons, lessons_path, lesson) =
        super::api::single_node_vm_lesson(args.lessons.as_deref(), args.lesson.as_deref())?;
    let (server_bin, agent_bin) = super::api::server_and_agent().await?;
    let mut rig = Rig::default();
    let result = async {
        let settings = RigSettings {
            boot: args.sim_boot,
            setup: args.sim_setup,
            vm_limit: args.vm_limit,
        };
        rig.start(&settings, &lessons, &lessons_path, &server_bin, &agent_bin)
            .await?;
        measure(&rig, &args, &lesson).await
    }
    .await;
    rig.stop().await;
    result
}

async fn measure(rig: &Rig, args: &PoolBenchArgs, lesson: &str) -> anyhow::Result<()> {
    let http = client::client(64);
    println!(
        "ttlab bench pool: {} build, {} CPUs, kube-sim guest boot {} s + setup {} s \
         ({}), lesson {lesson}, \
         pool size {}, {} students over {} s (seed {}), each working {} s, VM limit {}",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        std::thread::available_parallelism().map_or(0, usize::from),
        args.sim_boot.as_secs_f64(),
        args.sim_setup.as_secs_f64(),
        sim_priority(),
        args.pool_size,
        args.students,
        args.over.as_secs_f64(),
        args.seed,
        args.work.as_secs_f64(),
        args.vm_limit,
    );
    let admin = rig.token_as(
        &UserId::new("bench-operator").map_err(|e| anyhow::anyhow!("{e}"))?,
        Role::Admin,
    )?;
    let pool_url = format!("{}/api/admin/pools/{lesson}", rig.url);
    let body = serde_json::json!({ "size": args.pool_size });
    let (status, answer) =
        client::send(&http, Method::PUT, &pool_url, Some(&admin), Some(&body)).await?;
    anyhow::ensure!(
        status.is_success(),
        "the pool could not be configured: {status} {}",
        String::from_utf8_lossy(&answer)
    );
    // The pool fills first (boot + setup): the students come to a ready pool.
    let filling = Instant::now();
    let fill_deadline = filling + (args.sim_boot + args.sim_setup) * 3 + Duration::from_secs(60);
    loop {
        let (_, answer) = client::send(&http, Method::GET, &pool_url, Some(&admin), None).await?;
        let v: serde_json::Value =
            serde_json::from_slice(&answer).context("the pool's state is not JSON")?;
        if v["ready"].as_u64().unwrap_or(0) >= u64::from(args.pool_size) {
            break;
        }
        anyhow::ensure!(
            Instant::now() < fill_deadline,
            "the pool did not fill within {:?}: {v}",
            fill_deadline - filling
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!(
        "pool filled: {} members ready {:.1} s after it was configured",
        args.pool_size,
        filling.elapsed().as_secs_f64()
    );

    // Arrival instants, uniform over the span, sorted.
    let mut rng = Rng::new(args.seed);
    let span_ms = u64::try_from(args.over.as_millis())
        .unwrap_or(u64::MAX)
        .max(1);
    let mut arrivals: Vec<Duration> = (0..args.students).map(|_| rng.millis(0, span_ms)).collect();
    arrivals.sort();
    let start = Instant::now();
    let running_deadline = (args.sim_boot + args.sim_setup) * 4 + Duration::from_secs(60);
    let mut tasks = Vec::new();
    for (i, at) in arrivals.into_iter().enumerate() {
        let user = UserId::new(format!("bench-pool-{i:03}")).map_err(|e| anyhow::anyhow!("{e}"))?;
        let token = rig.token(&user)?;
        let (http, url, lesson, work) =
            (http.clone(), rig.url.clone(), lesson.to_owned(), args.work);
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until((start + at).into()).await;
            student(&http, &url, &token, &lesson, work, running_deadline).await
        }));
    }
    let mut clicks = Vec::new();
    for t in tasks {
        clicks.push(t.await.context("a student task failed")?);
    }

    let (mut hits, mut misses, mut failed) = (Vec::new(), Vec::new(), Vec::new());
    for c in &clicks {
        match (c.to_running, c.hit) {
            (Some(d), true) => hits.push(d),
            (Some(d), false) => misses.push(d),
            (None, _) => failed.push(c.error.clone().unwrap_or_default()),
        }
    }
    let hit_rate = hits.len() as f64 / clicks.len().max(1) as f64;
    println!(
        "clicks {}: hits {} ({:.1} %), misses {}, never running {}",
        clicks.len(),
        hits.len(),
        hit_rate * 100.0,
        misses.len(),
        failed.len()
    );
    for f in failed.iter().take(3) {
        println!("  never running: {f}");
    }
    let hit = Dist::of(&mut hits);
    println!("click → running, hits (served by the pool): {hit}");
    println!(
        "  {}",
        verdict("p50", hit.p50, HIT_P50_TARGET, failed.len())
    );
    println!(
        "  {}",
        verdict("p99", hit.p99, HIT_P99_TARGET, failed.len())
    );
    let cold = Dist::of(&mut misses);
    println!("click → running, misses (the cold path, same run): {cold}");
    if cold.p50 > Duration::ZERO && hit.p50 > Duration::ZERO {
        println!(
            "  a hit's p50 is {:.0}× shorter than a miss's ({} vs {})",
            cold.p50.as_secs_f64() / hit.p50.as_secs_f64(),
            ms(hit.p50),
            ms(cold.p50)
        );
    }
    let (_, answer) = client::send(&http, Method::GET, &pool_url, Some(&admin), None).await?;
    let v: serde_json::Value =
        serde_json::from_slice(&answer).context("the pool's state is not JSON")?;
    println!(
        "the pool as the server reports it: ready {}, preparing {}, claims (24 h) {}, misses (24 h) {}, hit rate {}, median refill {} s, target {}",
        v["ready"],
        v["preparing"],
        v["claims_24h"],
        v["misses_24h"],
        v["hit_rate"],
        v["median_refill_seconds"],
        v["target"]
    );
    Ok(())
}

/// One student: click, follow the session to running, work, finish (`DELETE`).
async fn student(
    http: &client::HttpClient,
    url: &str,
    token: &str,
    lesson: &str,
    work: Duration,
    within: Duration,
) -> Click {
    let clicked = Instant::now();
    let body = serde_json::json!({ "lesson": lesson });
    let failed = |e: String| Click {
        hit: false,
        to_running: None,
        error: Some(e),
    };
    let (status, answer) = match client::send(
        http,
        Method::POST,
        &format!("{url}/api/sessions"),
        Some(token),
        Some(&body),
    )
    .await
    {
        Ok(a) => a,
        Err(e) => return failed(format!("{e:#}")),
    };
    let answered = clicked.elapsed();
    if status != http::StatusCode::ACCEPTED {
        return failed(format!("{status}: {}", String::from_utf8_lossy(&answer)));
    }
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&answer) else {
        return failed("the 202 answer is not JSON".into());
    };
    let Some(id) = v["id"].as_str().map(str::to_owned) else {
        return failed("the 202 answer has no session id".into());
    };
    let hit = v["status"] == "running";
    let to_running = if hit {
        Some(answered)
    } else {
        let session_url = format!("{url}/api/sessions/{id}");
        loop {
            if clicked.elapsed() > within {
                return failed(format!("session {id} not running within {within:?}"));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            let Ok((_, answer)) =
                client::send(http, Method::GET, &session_url, Some(token), None).await
            else {
                continue;
            };
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(&answer) else {
                continue;
            };
            match v["status"].as_str() {
                Some("running") => break Some(clicked.elapsed()),
                Some("starting") | None => {}
                Some(other) => {
                    return failed(format!(
                        "session {id} became {other}: {}",
                        v["failure_reason"].as_str().unwrap_or("")
                    ));
                }
            }
        }
    };
    tokio::time::sleep(work).await;
    let _ = client::send(
        http,
        Method::DELETE,
        &format!("{url}/api/sessions/{id}"),
        Some(token),
        None,
    )
    .await;
    Click {
        hit,
        to_running,
        error: None,
    }
}
