//! `ttlabctl bench pool`: "Start lab" → running with a warm pool, against the cold path in the
//! same run. The real `ttlab-server` (release build for figures worth reading), kube-sim with
//! realistic boot and setup delays, a throwaway PostgreSQL, all over loopback.
//!
//! Three scenarios (`--scenario`):
//! - `random` (the default): students arrive at random instants over the run (seeded) to a
//!   demand-driven pool (`demand: true`, starting at `--pool-size`, at most `--demand-max`):
//!   the pool's size follows the starts it sees. Target: a hit rate of at least 90 %.
//! - `fixed`: the same arrivals to a pool of a fixed `--pool-size`, for comparison.
//! - `class`: an operator schedules a class (`POST /api/admin/classes`) of `--seats` seats
//!   `--ahead` of its start, with a join code and no standing pool; its students click within
//!   `--click-window` of the start. A student refused for capacity joins the waitlist, waits
//!   for a place to be held for them and starts again. Targets: at least 95 % of the clicks
//!   served by the pool, click → running p50 ≤ 2 s and p99 ≤ 5 s over every click.
//!
//! Each student clicks "Start lab", polls the session until it is running, works for a while
//! and finishes. A click answered with a running session was served by the pool (a hit); any
//! other is a miss: one that claimed a member still being prepared (its row requested before
//! the click), or the cold path. Printed: click → running of the hits, of each kind of miss and
//! of all clicks, the hit rate, waitlist waits, and the pool's own counts.

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
/// Target share of clicks served by a demand-driven pool (`random`).
const RANDOM_HIT_RATE_TARGET: f64 = 0.90;
/// Target share of a class's clicks served by the members prepared for it (`class`).
const CLASS_HIT_RATE_TARGET: f64 = 0.95;
/// The join code the benchmark's class is scheduled with.
const CLASS_CODE: &str = "BENCH-CLASS";

/// What the students meet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// Random arrivals to a demand-driven pool.
    Random,
    /// Random arrivals to a pool of a fixed size.
    Fixed,
    /// A scheduled class whose students click within minutes of its start.
    Class,
}

/// Arguments of `ttlabctl bench pool`.
#[derive(Debug, Clone, Args)]
pub struct PoolBenchArgs {
    /// What the students meet: random arrivals to a demand-driven pool, the same to a fixed
    /// pool, or a scheduled class.
    #[arg(long, value_enum, default_value_t = Scenario::Random)]
    pub scenario: Scenario,
    /// Students arriving, each once (`random`, `fixed`).
    #[arg(long, default_value_t = 50)]
    pub students: u32,
    /// The span their arrivals are spread over, uniformly at random (`random`, `fixed`).
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    pub over: Duration,
    /// The pool's size: fixed (`fixed`), or where a demand-driven pool starts (`random`).
    #[arg(long, default_value_t = 4)]
    pub pool_size: u32,
    /// The most members a demand-driven pool grows to (`random`).
    #[arg(long, default_value_t = 16)]
    pub demand_max: u32,
    /// The class's seats, one student each (`class`).
    #[arg(long, default_value_t = 30)]
    pub seats: u32,
    /// How long before its start the class is scheduled (`class`).
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    pub ahead: Duration,
    /// The span after the class's start within which its students click, uniformly at random
    /// (`class`).
    #[arg(long, default_value = "2m", value_parser = parse_duration)]
    pub click_window: Duration,
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
    /// When they clicked, from the first instant a click could come (the run's or the class's
    /// start).
    at: Duration,
    /// Served running at once (by the pool).
    hit: bool,
    /// Not a hit, but served a member still being prepared (its VM already created when the
    /// start was answered): a miss that is not a cold start.
    preparing: bool,
    /// Click → the session seen running.
    to_running: Option<Duration>,
    /// Refused for capacity, they waited this long on the waitlist until a place was held for
    /// them.
    waited: Option<Duration>,
    /// What went wrong, if it never ran.
    error: Option<String>,
}

/// Runs the benchmark and prints its figures.
pub async fn run(args: PoolBenchArgs) -> anyhow::Result<()> {
    if args.students == 0 || args.pool_size == 0 || args.seats == 0 {
        anyhow::bail!("--students, --pool-size and --seats must be at least 1");
    }
    if args.scenario == Scenario::Random && args.demand_max < args.pool_size {
        anyhow::bail!(
            "--demand-max ({}) must be at least --pool-size ({})",
            args.demand_max,
            args.pool_size
        );
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
        print_header(&args, &lesson);
        let bench = Bench::new(&rig, &args, &lesson)?;
        match args.scenario {
            Scenario::Random | Scenario::Fixed => bench.arrivals().await,
            Scenario::Class => bench.class().await,
        }
    }
    .await;
    rig.stop().await;
    result
}

fn print_header(args: &PoolBenchArgs, lesson: &str) {
    let who = match args.scenario {
        Scenario::Random => format!(
            "random arrivals: {} students over {} s (seed {}), a demand-driven pool starting at \
             {} (at most {})",
            args.students,
            args.over.as_secs_f64(),
            args.seed,
            args.pool_size,
            args.demand_max
        ),
        Scenario::Fixed => format!(
            "random arrivals: {} students over {} s (seed {}), a pool of a fixed {}",
            args.students,
            args.over.as_secs_f64(),
            args.seed,
            args.pool_size
        ),
        Scenario::Class => format!(
            "a class of {} seats scheduled {} s ahead, its students clicking within {} s of its \
             start (seed {}), no standing pool",
            args.seats,
            args.ahead.as_secs_f64(),
            args.click_window.as_secs_f64(),
            args.seed
        ),
    };
    println!(
        "ttlab bench pool --scenario {}: {} build, {} CPUs, kube-sim guest boot {} s + setup {} s \
         ({}), lesson {lesson}, {who}, each working {} s, VM limit {}",
        match args.scenario {
            Scenario::Random => "random",
            Scenario::Fixed => "fixed",
            Scenario::Class => "class",
        },
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        std::thread::available_parallelism().map_or(0, usize::from),
        args.sim_boot.as_secs_f64(),
        args.sim_setup.as_secs_f64(),
        sim_priority(),
        args.work.as_secs_f64(),
        args.vm_limit,
    );
}

/// A run's server, operator and lesson.
struct Bench<'a> {
    rig: &'a Rig,
    args: &'a PoolBenchArgs,
    lesson: &'a str,
    http: client::HttpClient,
    admin: String,
    pool_url: String,
}

impl<'a> Bench<'a> {
    fn new(rig: &'a Rig, args: &'a PoolBenchArgs, lesson: &'a str) -> anyhow::Result<Self> {
        let admin = rig.token_as(
            &UserId::new("bench-operator").map_err(|e| anyhow::anyhow!("{e}"))?,
            Role::Admin,
        )?;
        Ok(Self {
            rig,
            args,
            lesson,
            http: client::client(64),
            admin,
            pool_url: format!("{}/api/admin/pools/{lesson}", rig.url),
        })
    }

    /// Sends an operator's request, and reads its JSON answer if it succeeded.
    async fn admin(
        &self,
        method: Method,
        url: &str,
        body: Option<&serde_json::Value>,
    ) -> anyhow::Result<serde_json::Value> {
        let (status, answer) =
            client::send(&self.http, method, url, Some(&self.admin), body).await?;
        anyhow::ensure!(
            status.is_success(),
            "{url}: {status} {}",
            String::from_utf8_lossy(&answer)
        );
        serde_json::from_slice(&answer).with_context(|| format!("{url}: the answer is not JSON"))
    }

    /// How long a student waits for running before the click counts as failed.
    fn running_deadline(&self) -> Duration {
        (self.args.sim_boot + self.args.sim_setup) * 4 + Duration::from_secs(60)
    }

    /// `random` and `fixed`: the pool is configured and fills, then students arrive at random.
    async fn arrivals(&self) -> anyhow::Result<()> {
        let args = self.args;
        let body = if args.scenario == Scenario::Random {
            serde_json::json!({
                "size": args.pool_size,
                "min": 1,
                "max": args.demand_max,
                "demand": true,
            })
        } else {
            serde_json::json!({ "size": args.pool_size, "demand": false })
        };
        self.admin(Method::PUT, &self.pool_url, Some(&body))
            .await
            .context("the pool could not be configured")?;
        // The pool fills first (boot + setup): the students come to a ready pool.
        let filling = Instant::now();
        let fill_deadline =
            filling + (args.sim_boot + args.sim_setup) * 3 + Duration::from_secs(60);
        loop {
            let v = self.admin(Method::GET, &self.pool_url, None).await?;
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
        let mut arrivals: Vec<Duration> =
            (0..args.students).map(|_| rng.millis(0, span_ms)).collect();
        arrivals.sort();
        // The pool's target as the server plans it, sampled while the students come.
        let sampling = self.sample_targets();
        let clicks = self.students(&arrivals, Instant::now(), None).await?;
        let targets = sampling.stop().await;
        let target = if args.scenario == Scenario::Random {
            RANDOM_HIT_RATE_TARGET
        } else {
            // Today's fixed pool has no target of its own: it is the comparison.
            0.0
        };
        report(&clicks, target);
        if let Some(first) = targets.first() {
            // Each change of the planned target, with when it happened.
            let mut changes = vec![format!("{first} at +0 s")];
            for (i, pair) in targets.windows(2).enumerate() {
                if pair[0] != pair[1] {
                    changes.push(format!("{} at +{} s", pair[1], (i + 1) * 5));
                }
            }
            println!(
                "the pool's target while students came (sampled every 5 s): {}",
                changes.join(", ")
            );
        }
        self.print_pool().await
    }

    /// Samples the pool's planned target every 5 s until stopped.
    fn sample_targets(&self) -> Sampler {
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let (http, url, admin) = (self.http.clone(), self.pool_url.clone(), self.admin.clone());
        let task = tokio::spawn(async move {
            let mut targets = Vec::new();
            loop {
                if let Ok((_, answer)) =
                    client::send(&http, Method::GET, &url, Some(&admin), None).await
                    && let Some(t) = serde_json::from_slice::<serde_json::Value>(&answer)
                        .ok()
                        .and_then(|v| v["target"].as_u64())
                {
                    targets.push(t);
                }
                tokio::select! {
                    _ = &mut stopped => break targets,
                    () = tokio::time::sleep(Duration::from_secs(5)) => {}
                }
            }
        });
        Sampler { stop, task }
    }

    /// `class`: a class is scheduled `--ahead` of its start with no standing pool; its
    /// members are prepared on the schedule; its students click within the window.
    async fn class(&self) -> anyhow::Result<()> {
        let args = self.args;
        // No standing pool: whatever is warm at the start was prepared for the class.
        self.admin(
            Method::PUT,
            &self.pool_url,
            Some(&serde_json::json!({ "size": 0, "min": 0, "demand": false })),
        )
        .await
        .context("the standing pool could not be set to 0")?;
        let ahead = chrono::Duration::from_std(args.ahead).context("--ahead is too long")?;
        let starts_at = chrono::Utc::now() + ahead;
        let start = Instant::now() + args.ahead;
        let body = serde_json::json!({
            "lesson": self.lesson,
            "title": "bench class",
            "seats": args.seats,
            "starts_at": starts_at,
            "ends_at": starts_at + chrono::Duration::hours(1),
            "join_code": CLASS_CODE,
        });
        let class = self
            .admin(
                Method::POST,
                &format!("{}/api/admin/classes", self.rig.url),
                Some(&body),
            )
            .await
            .context("the class could not be scheduled")?;
        let id = class["id"].clone();
        println!(
            "class scheduled to start in {} s: {} ({} s, {}), seats warm at its start {}{}",
            args.ahead.as_secs(),
            class["lead_time"]["describe"].as_str().unwrap_or("?"),
            class["lead_time"]["seconds"],
            class["lead_time"]["source"].as_str().unwrap_or("?"),
            class["seats_warm"],
            class["capacity_note"]
                .as_str()
                .map(|n| format!(" ({n})"))
                .unwrap_or_default()
        );

        // Until the start: when its first member appeared, when the members were all ready.
        let classes_url = format!("{}/api/admin/classes", self.rig.url);
        let mut first_preparing: Option<Instant> = None;
        let mut all_ready: Option<(Instant, u64)> = None;
        let mut last = serde_json::Value::Null;
        while Instant::now() < start {
            if let Ok(v) = self.admin(Method::GET, &classes_url, None).await
                && let Some(c) = v["classes"]
                    .as_array()
                    .and_then(|cs| cs.iter().find(|c| c["id"] == id))
            {
                let ready = c["warm"]["ready"].as_u64().unwrap_or(0);
                let preparing = c["warm"]["preparing"].as_u64().unwrap_or(0);
                if first_preparing.is_none() && ready + preparing > 0 {
                    first_preparing = Some(Instant::now());
                }
                let want = c["seats_warm"].as_u64().unwrap_or(u64::from(args.seats));
                if all_ready.is_none() && ready > 0 && ready >= want && preparing == 0 {
                    all_ready = Some((Instant::now(), ready));
                }
                last = c.clone();
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let before_start = |at: Instant| start.saturating_duration_since(at).as_secs_f64();
        match (first_preparing, all_ready) {
            (Some(first), Some((ready_at, n))) => println!(
                "members: the first was preparing {:.0} s before the start, all {n} ready {:.0} s \
                 before it: {:.0} s of preparation against a lead time of {} s",
                before_start(first),
                before_start(ready_at),
                ready_at.saturating_duration_since(first).as_secs_f64(),
                class["lead_time"]["seconds"]
            ),
            (Some(first), None) => println!(
                "members: the first was preparing {:.0} s before the start; at the start not all \
                 were ready: {}",
                before_start(first),
                last["warm"]
            ),
            (None, _) => println!("members: none was prepared before the start: {last}"),
        }

        let mut rng = Rng::new(args.seed);
        let window_ms = u64::try_from(args.click_window.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let mut arrivals: Vec<Duration> =
            (0..args.seats).map(|_| rng.millis(0, window_ms)).collect();
        arrivals.sort();
        let clicks = self.students(&arrivals, start, Some(CLASS_CODE)).await?;
        report(&clicks, CLASS_HIT_RATE_TARGET);
        let mut all: Vec<Duration> = clicks.iter().filter_map(|c| c.to_running).collect();
        let failed = clicks.iter().filter(|c| c.to_running.is_none()).count();
        let all = Dist::of(&mut all);
        println!("click → running, all {} clicks: {all}", clicks.len());
        println!("  {}", verdict("p50", all.p50, HIT_P50_TARGET, failed));
        println!("  {}", verdict("p99", all.p99, HIT_P99_TARGET, failed));
        let waited: Vec<&Click> = clicks.iter().filter(|c| c.waited.is_some()).collect();
        if !waited.is_empty() {
            println!(
                "waitlist: {} of {} students refused for capacity waited, in click order \
                 (clicked at → place held after → running after, from the click):",
                waited.len(),
                clicks.len()
            );
            for c in waited {
                println!(
                    "  clicked +{:.1} s → held after {:.1} s → {}",
                    c.at.as_secs_f64(),
                    c.waited.unwrap_or_default().as_secs_f64(),
                    c.to_running.map_or_else(
                        || format!("never running ({})", c.error.clone().unwrap_or_default()),
                        |d| format!("running after {:.1} s", d.as_secs_f64())
                    )
                );
            }
        }
        self.print_pool().await
    }

    /// Each student clicks at `start` + their instant, follows the session and finishes.
    async fn students(
        &self,
        arrivals: &[Duration],
        start: Instant,
        class_code: Option<&'static str>,
    ) -> anyhow::Result<Vec<Click>> {
        let mut tasks = Vec::new();
        for (i, at) in arrivals.iter().copied().enumerate() {
            let user =
                UserId::new(format!("bench-pool-{i:03}")).map_err(|e| anyhow::anyhow!("{e}"))?;
            let student = Student {
                http: self.http.clone(),
                url: self.rig.url.clone(),
                token: self.rig.token(&user)?,
                lesson: self.lesson.to_owned(),
                class_code,
                work: self.args.work,
                within: self.running_deadline(),
            };
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep_until((start + at).into()).await;
                let mut click = student.run().await;
                click.at = at;
                click
            }));
        }
        let mut clicks = Vec::new();
        for t in tasks {
            clicks.push(t.await.context("a student task failed")?);
        }
        Ok(clicks)
    }

    async fn print_pool(&self) -> anyhow::Result<()> {
        let v = self.admin(Method::GET, &self.pool_url, None).await?;
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
}

/// The pool's target, sampled in the background.
struct Sampler {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Vec<u64>>,
}

impl Sampler {
    async fn stop(self) -> Vec<u64> {
        let _ = self.stop.send(());
        self.task.await.unwrap_or_default()
    }
}

/// Prints the hits, the misses (those that claimed a member being prepared, and the cold
/// path) and the hit rate against `target` (none when 0).
fn report(clicks: &[Click], target: f64) {
    let (mut hits, mut preparing, mut cold, mut failed) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for c in clicks {
        match (c.to_running, c.hit, c.preparing) {
            (Some(d), true, _) => hits.push(d),
            (Some(d), false, true) => preparing.push(d),
            (Some(d), false, false) => cold.push(d),
            (None, _, _) => failed.push(c.error.clone().unwrap_or_default()),
        }
    }
    let hit_rate = hits.len() as f64 / clicks.len().max(1) as f64;
    println!(
        "clicks {}: hits {} ({:.1} %), misses {} ({} claimed a member being prepared, {} cold), never running {}",
        clicks.len(),
        hits.len(),
        hit_rate * 100.0,
        preparing.len() + cold.len(),
        preparing.len(),
        cold.len(),
        failed.len()
    );
    if target > 0.0 {
        println!(
            "  served by the pool {:.1} % vs target ≥ {:.0} %: {}",
            hit_rate * 100.0,
            target * 100.0,
            if hit_rate >= target { "met" } else { "MISSED" }
        );
    }
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
    let claimed = Dist::of(&mut preparing);
    println!("click → running, misses that claimed a member being prepared: {claimed}");
    let cold = Dist::of(&mut cold);
    println!("click → running, misses on the cold path (same run): {cold}");
    for (what, miss) in [("a preparing claim", &claimed), ("a cold miss", &cold)] {
        if miss.p50 > Duration::ZERO && hit.p50 > Duration::ZERO {
            println!(
                "  a hit's p50 is {:.0}× shorter than {what}'s ({} vs {})",
                miss.p50.as_secs_f64() / hit.p50.as_secs_f64(),
                ms(hit.p50),
                ms(miss.p50)
            );
        }
    }
}

/// One student and what they do.
struct Student {
    http: client::HttpClient,
    url: String,
    token: String,
    lesson: String,
    class_code: Option<&'static str>,
    work: Duration,
    within: Duration,
}

impl Student {
    /// Click, follow the session to running (through the waitlist if refused for capacity),
    /// work, finish (`DELETE`).
    async fn run(&self) -> Click {
        let clicked = Instant::now();
        let clicked_wall = chrono::Utc::now();
        let failed = |e: String, waited: Option<Duration>| Click {
            at: Duration::ZERO,
            hit: false,
            preparing: false,
            to_running: None,
            waited,
            error: Some(e),
        };
        let mut waited = None;
        let answer = loop {
            let (status, answer) = match self.start().await {
                Ok(a) => a,
                Err(e) => return failed(format!("{e:#}"), waited),
            };
            if status == http::StatusCode::ACCEPTED {
                break answer;
            }
            let capacity = status == http::StatusCode::SERVICE_UNAVAILABLE
                && serde_json::from_slice::<serde_json::Value>(&answer)
                    .is_ok_and(|v| v["error"] == "capacity");
            if !capacity || waited.is_some() {
                return failed(
                    format!("{status}: {}", String::from_utf8_lossy(&answer)),
                    waited,
                );
            }
            // Refused for capacity: the page joins the waitlist and starts again once a place
            // is held for this student.
            if let Err(e) = self.wait_for_a_place(clicked).await {
                return failed(format!("{e:#}"), waited);
            }
            waited = Some(clicked.elapsed());
        };
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&answer) else {
            return failed("the 202 answer is not JSON".into(), waited);
        };
        let Some(id) = v["id"].as_str().map(str::to_owned) else {
            return failed("the 202 answer has no session id".into(), waited);
        };
        let hit = v["status"] == "running";
        // A cold start's row is created by this click; a claimed member being prepared was
        // requested before it (and may have its VM already).
        let requested = v["stages"]["requested"]
            .as_str()
            .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok());
        let preparing = !hit
            && (!v["stages"]["vm_created"].is_null()
                || requested.is_some_and(|r| r < clicked_wall));
        // The start was accepted now (after any wait on the waitlist): it has `within` to run.
        let accepted = Instant::now();
        let to_running = if hit {
            Some(clicked.elapsed())
        } else {
            let session_url = format!("{}/api/sessions/{id}", self.url);
            loop {
                if accepted.elapsed() > self.within {
                    return failed(
                        format!("session {id} not running within {:?}", self.within),
                        waited,
                    );
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                let Ok((_, answer)) = client::send(
                    &self.http,
                    Method::GET,
                    &session_url,
                    Some(&self.token),
                    None,
                )
                .await
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
                        return failed(
                            format!(
                                "session {id} became {other}: {}",
                                v["failure_reason"].as_str().unwrap_or("")
                            ),
                            waited,
                        );
                    }
                }
            }
        };
        tokio::time::sleep(self.work).await;
        let _ = client::send(
            &self.http,
            Method::DELETE,
            &format!("{}/api/sessions/{id}", self.url),
            Some(&self.token),
            None,
        )
        .await;
        Click {
            at: Duration::ZERO,
            hit,
            preparing,
            to_running,
            waited,
            error: None,
        }
    }

    /// `POST /api/sessions`, with the class's join code if any.
    async fn start(&self) -> anyhow::Result<(http::StatusCode, Vec<u8>)> {
        let body = match self.class_code {
            Some(code) => serde_json::json!({ "lesson": self.lesson, "class_code": code }),
            None => serde_json::json!({ "lesson": self.lesson }),
        };
        let (status, answer) = client::send(
            &self.http,
            Method::POST,
            &format!("{}/api/sessions", self.url),
            Some(&self.token),
            Some(&body),
        )
        .await?;
        Ok((status, answer.to_vec()))
    }

    /// Joins the waitlist and polls it until a place is held for this student.
    async fn wait_for_a_place(&self, clicked: Instant) -> anyhow::Result<()> {
        let url = format!("{}/api/waitlist", self.url);
        let body = serde_json::json!({ "lesson": self.lesson });
        let (status, answer) = client::send(
            &self.http,
            Method::POST,
            &url,
            Some(&self.token),
            Some(&body),
        )
        .await?;
        anyhow::ensure!(
            status == http::StatusCode::CREATED,
            "joining the waitlist: {status} {}",
            String::from_utf8_lossy(&answer)
        );
        // A place frees when a student before them finishes: allow for everyone's work.
        let within = self.within + self.work * 8;
        loop {
            anyhow::ensure!(
                clicked.elapsed() < within,
                "no place held within {within:?} on the waitlist"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
            let Ok((_, answer)) =
                client::send(&self.http, Method::GET, &url, Some(&self.token), None).await
            else {
                continue;
            };
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(&answer) else {
                continue;
            };
            if v["waiting"] == false {
                anyhow::bail!("taken off the waitlist without a place: {v}");
            }
            if !v["held_until"].is_null() {
                return Ok(());
            }
        }
    }
}
