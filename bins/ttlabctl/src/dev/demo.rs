//! `ttlabctl demo`: the whole system on one machine, in one command.
//!
//! It starts a throwaway PostgreSQL (schema applied), kube-sim in-process (a simulated
//! Kubernetes + KubeVirt on loopback, with quick but realistic boot and setup times, the golden
//! PVC of one sample lesson present and the others absent), then `ttlab-server` and
//! `ttlab-reaper` as separate child processes that talk only through PostgreSQL. It waits for
//! the server's `/readyz`, prints the URL, ready-made student and admin login links and how to
//! watch the cluster with kubectl, and runs until Ctrl-C or SIGTERM, when it stops the
//! children (by pid), the simulation and PostgreSQL, and deletes every file it made. With
//! `--no-reaper` the reaper is not started, so a VM outlives its session's expiry until its
//! own hard deadline powers it off (to watch that deadline). With `--sites N` (N > 1) it runs
//! N kube-sim instances, one cluster per site (`site-a`, `site-b`, …, each with
//! `--site-vm-limit` places and its own kubeconfig), and gives both binaries a sites file
//! (`TTLAB_SITES`) naming them all; the agents are then reached through each site's API
//! server (KubeVirt's portforward), as for a cluster the server's pod network cannot reach.
//!
//! The children get `DATABASE_URL`, `KUBECONFIG`, `TTLAB_ENV`, `TTLAB_NAMESPACE`,
//! `TTLAB_LISTEN`, `TTLAB_LESSONS`, `TTLAB_AGENT_BINARY`, `TTLAB_WEB_DIR` and
//! `TTLAB_AUTH_SECRET` (and with several sites `TTLAB_SITES`) from the demo; every other setting (`TTLAB_SESSION_TTL=2m`,
//! `TTLAB_VM_LIMIT`, `TTLAB_REAP_INTERVAL`, `RUST_LOG`, …) passes through from the
//! environment.

mod binaries;
mod children;
pub(crate) mod client;
pub(crate) mod stack;

use std::ffi::OsString;
use std::io::IsTerminal as _;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use clap::Args;
use ttlab_api::auth::{AuthConfig, AuthSecret, Role};
use ttlab_kube_sim::{KubeSim, Timings};
use ttlab_lesson::LessonSet;

pub(crate) use binaries::{AGENT, REAPER, SERVER, locate as locate_binaries};
pub(crate) use children::ChildProcess;
use stack::{Database, GoldenSetup};

use crate::dev::sites::{site_names, sites_yaml};

/// The user of the printed student link.
const DEMO_STUDENT: &str = "demo-student";
/// The user of the printed admin link.
const DEMO_ADMIN: &str = "demo-admin";
/// How long the server may take to answer `/readyz` with 200.
const READY_TIMEOUT: Duration = Duration::from_secs(90);
/// How long a child may take to stop after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(15);

/// Arguments of `ttlabctl demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Port of the web pages and API on 127.0.0.1 (0 picks a free one).
    #[arg(long, env = "TTLAB_DEMO_PORT", default_value_t = 8080)]
    pub port: u16,
    /// Also write the simulated cluster's kubeconfig here, for kubectl (deleted on exit).
    #[arg(long, env = "TTLAB_DEMO_KUBECONFIG_OUT", value_name = "PATH")]
    pub kubeconfig_out: Option<PathBuf>,
    /// Token signing secret, at least 32 bytes (a random one when not given).
    #[arg(long, env = "TTLAB_AUTH_SECRET", hide_env_values = true)]
    pub auth_secret: Option<String>,
    /// Environment label of the demo's objects.
    #[arg(long, env = "TTLAB_ENV", default_value = "demo")]
    pub env: String,
    /// Namespace of the VMs in the simulated cluster.
    #[arg(long, env = "TTLAB_NAMESPACE", default_value = "ttlab-vms")]
    pub namespace: String,
    /// Lesson file or directory (default: the checkout's `lessons/`).
    #[arg(long, env = "TTLAB_LESSONS", value_name = "PATH")]
    pub lessons: Option<PathBuf>,
    /// Static web pages (default: the checkout's `web/`).
    #[arg(long, env = "TTLAB_WEB_DIR", value_name = "PATH")]
    pub web_dir: Option<PathBuf>,
    /// Simulated guest boot time (VMI Scheduled → its agent listening; the VMI reports Running
    /// halfway, as KubeVirt reports it while the guest still boots).
    #[arg(long, env = "TTLAB_SIM_BOOT", default_value = "3s", value_parser = parse_duration)]
    pub sim_boot: Duration,
    /// Simulated lab setup time inside the guest (Running → readiness marker).
    #[arg(long, env = "TTLAB_SIM_SETUP", default_value = "3s", value_parser = parse_duration)]
    pub sim_setup: Duration,
    /// What a VM is: `sim` (simulated, ready in seconds) or `qemu` (a real Debian 12 guest
    /// with systemd, booted by qemu: a minute or two under software emulation; needs
    /// qemu-system-x86, genisoimage and the image of `ttlabctl guest-image`).
    #[arg(long, env = "TTLAB_DEMO_GUEST", value_enum, default_value_t = GuestKind::Sim)]
    pub guest: GuestKind,
    /// The guest image directory for `--guest qemu` [default: the cached image of
    /// `ttlabctl guest-image`].
    #[arg(long, env = "TTLAB_GUEST_IMAGE", value_name = "DIR")]
    pub guest_image: Option<PathBuf>,
    /// Run without the reaper: expired sessions are not reclaimed, so a VM keeps running past
    /// its session's expiry until its own hard deadline (start + `TTLAB_SESSION_MAX` +
    /// `TTLAB_HARD_DEADLINE_GRACE`) powers it off. To watch the guest's own deadline.
    #[arg(long, env = "TTLAB_DEMO_NO_REAPER")]
    pub no_reaper: bool,
    /// How many sites (clusters) to run, each a kube-sim of its own (1 to 16). With more
    /// than one, the server and the reaper get a sites file naming them all.
    #[arg(long, env = "TTLAB_DEMO_SITES", default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=16))]
    pub sites: u8,
    /// Each site's VM limit when there are several sites (with one, `TTLAB_VM_LIMIT` holds).
    #[arg(long, env = "TTLAB_DEMO_SITE_VM_LIMIT", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    pub site_vm_limit: u32,
    /// Validity of the printed login tokens.
    #[arg(long, env = "TTLAB_DEMO_TOKEN_TTL", default_value = "12h", value_parser = parse_duration)]
    pub token_ttl: Duration,
}

/// What the demo's VMs are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GuestKind {
    /// kube-sim's simulated guest.
    Sim,
    /// Real qemu guests.
    Qemu,
}

/// The guest backend for `--guest`: for qemu, the image named or cached, or an error that
/// says how to build it.
fn guest_backend(args: &DemoArgs) -> anyhow::Result<ttlab_kube_sim::guest::GuestBackend> {
    use ttlab_kube_sim::guest::{GuestBackend, QemuSettings};
    if args.guest == GuestKind::Sim {
        return Ok(GuestBackend::Simulated);
    }
    let dir = match &args.guest_image {
        Some(d) => d.clone(),
        None => {
            let cache = crate::dev::guest_image::default_cache_dir()?;
            let mirror = crate::dev::guest_image::apt_mirror(Path::new("/etc/apt"))
                .unwrap_or_else(|| "http://deb.debian.org/debian".to_owned());
            match crate::dev::guest_image::cached(&cache, &mirror) {
                Some(i) => i.dir,
                None => anyhow::bail!(
                    "--guest qemu needs a guest image and none is cached in {}: build it with \
                     `sudo ttlabctl guest-image` (about 3 minutes), or pass --guest-image DIR",
                    cache.display()
                ),
            }
        }
    };
    let image = ttlab_qemu_guest::GuestImage::open(&dir)?;
    Ok(GuestBackend::Qemu(Box::new(QemuSettings::new(image))))
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e} (use e.g. 500ms, 3s, 2m)"))
}

/// The checkout this ttlabctl was built from (for `lessons/` and `web/`).
pub(crate) fn checkout_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs the demo until interrupted.
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let shutdown = Shutdown::listen()?;
    let mut demo = Demo::default();
    let started = tokio::select! {
        r = demo.start(&args) => r.map(Some),
        () = shutdown.wait() => Ok(None),
    };
    let result = match started {
        Ok(Some(banner)) => {
            println!("{banner}");
            demo.wait(&shutdown).await
        }
        Ok(None) => {
            eprintln!("ttlabctl: interrupted while starting");
            Ok(())
        }
        Err(e) => Err(e),
    };
    eprintln!("ttlabctl: stopping the demo");
    let stopped = demo.teardown().await;
    match (&result, &stopped) {
        (_, Ok(dir)) => eprintln!("ttlabctl: demo stopped; removed {dir}"),
        (_, Err(e)) => eprintln!("ttlabctl: error while stopping: {e:#}"),
    }
    result.and(stopped.map(|_| ()))
}

/// Everything the demo started, so that it can all be stopped, whatever step failed.
#[derive(Default)]
struct Demo {
    data: Option<tempfile::TempDir>,
    database: Option<Database>,
    sims: Vec<(String, KubeSim)>,
    server: Option<ChildProcess>,
    reaper: Option<ChildProcess>,
    kubeconfig_out: Option<PathBuf>,
}

impl Demo {
    /// Starts everything and returns the text to print.
    async fn start(&mut self, args: &DemoArgs) -> anyhow::Result<String> {
        let secret = match &args.auth_secret {
            Some(s) => s.clone(),
            None => random_secret()?,
        };
        // Checked before anything starts.
        let auth = AuthConfig::new(AuthSecret::new(secret.as_bytes())?);
        let env: ttlab_model::EnvName = args
            .env
            .parse()
            .map_err(|e| anyhow::anyhow!("TTLAB_ENV {:?}: {e}", args.env))?;
        let lessons_path = args
            .lessons
            .clone()
            .unwrap_or_else(|| checkout_dir().join("lessons"));
        let lessons = LessonSet::load(&lessons_path).with_context(|| {
            format!(
                "loading the lessons from {} (set --lessons or TTLAB_LESSONS)",
                lessons_path.display()
            )
        })?;
        let lessons_path = std::fs::canonicalize(&lessons_path).unwrap_or(lessons_path);
        let web_dir = prepare_web(args.web_dir.clone()).await;

        let bins = locate_binaries(&[SERVER, REAPER, AGENT]).await?;
        let server_bin = bins.server.clone().with_context(|| {
            format!(
                "ttlab-server is not available in {}: the demo needs at least the server",
                bins.dir.display()
            )
        })?;
        let agent_bin = match std::env::var_os("TTLAB_AGENT_BINARY") {
            Some(p) => PathBuf::from(p),
            None => bins.agent.clone().with_context(|| {
                format!(
                    "ttlab-agent is missing in {} (the server embeds it in every VM)",
                    bins.dir.display()
                )
            })?,
        };

        let data = tempfile::Builder::new()
            .prefix("ttlab-demo-")
            .tempdir()
            .context("creating the demo's data directory")?;
        let data_dir = data.path().to_path_buf();
        self.data = Some(data);

        let t0 = Instant::now();
        let database = Database::start().await?;
        let database_url = database.url().to_owned();
        let database_dir = database.dir().to_path_buf();
        self.database = Some(database);
        eprintln!(
            "ttlabctl: PostgreSQL ready in {} ms ({})",
            t0.elapsed().as_millis(),
            database_dir.display()
        );

        let mut timings = Timings::realistic();
        timings.scheduling = Duration::from_millis(500);
        timings.boot = args.sim_boot;
        timings.setup = args.sim_setup;
        timings.stop = Duration::from_secs(1);
        let guest_root = data_dir.join("guests");
        let backend = guest_backend(args)?;
        if let ttlab_kube_sim::guest::GuestBackend::Qemu(q) = &backend {
            eprintln!(
                "ttlabctl: VMs are real qemu guests of {} ({}); a VM takes one to five minutes to \
                 be ready under software emulation (more on a loaded machine), much less under KVM",
                q.image.dir.display(),
                q.image.manifest.name
            );
            // A real guest shuts down within its grace period, not at once.
            timings.stop = Duration::from_secs(30);
        }
        let site_names = site_names(args.sites);
        let mut sites_file = None;
        let mut kubeconfig = data_dir.join("kubeconfig");
        let mut golden = Default::default();
        for (i, name) in site_names.iter().enumerate() {
            let root = if site_names.len() == 1 {
                guest_root.clone()
            } else {
                guest_root.join(name)
            };
            let sim =
                stack::start_sim_with(&args.namespace, timings.clone(), &root, backend.clone())
                    .await
                    .with_context(|| format!("starting the kube-sim of site {name}"))?;
            let disks = stack::create_golden_disks(&sim, &args.namespace, &lessons)?;
            let path = if site_names.len() == 1 {
                data_dir.join("kubeconfig")
            } else {
                data_dir.join(format!("{name}.kubeconfig"))
            };
            sim.write_kubeconfig(&path, &args.namespace)?;
            if i == 0 {
                golden = disks;
                kubeconfig = path;
                if let Some(out) = &args.kubeconfig_out {
                    sim.write_kubeconfig(out, &args.namespace)
                        .with_context(|| format!("writing the kubeconfig to {}", out.display()))?;
                    self.kubeconfig_out = Some(out.clone());
                }
            }
            self.sims.push((name.clone(), sim));
        }
        if site_names.len() > 1 {
            let path = data_dir.join("sites.yaml");
            let sites: Vec<(String, PathBuf)> = self
                .sims
                .iter()
                .map(|(name, _)| (name.clone(), data_dir.join(format!("{name}.kubeconfig"))))
                .collect();
            let text = sites_yaml(
                "ttlabctl demo --sites",
                &sites,
                &args.namespace,
                args.site_vm_limit as usize,
            );
            std::fs::write(&path, text)
                .with_context(|| format!("writing the sites file {}", path.display()))?;
            sites_file = Some(path);
        }

        let port = if args.port == 0 {
            stack::free_loopback_port()?
        } else {
            args.port
        };
        let listen = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let url = format!("http://{listen}");
        let mut common: Vec<(&str, OsString)> = vec![
            ("DATABASE_URL", database_url.clone().into()),
            ("KUBECONFIG", kubeconfig.clone().into()),
            ("TTLAB_ENV", env.as_str().into()),
            ("TTLAB_NAMESPACE", args.namespace.clone().into()),
        ];
        if let Some(file) = &sites_file {
            common.push(("TTLAB_SITES", file.clone().into()));
        }
        if std::env::var_os("RUST_LOG").is_none() {
            common.push(("RUST_LOG", "info".into()));
        }
        // Their output reaches a terminal only through us: colours only if ours is one.
        if !std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none() {
            common.push(("NO_COLOR", "1".into()));
        }
        let mut server_env = common.clone();
        server_env.extend([
            ("TTLAB_LISTEN", listen.to_string().into()),
            ("TTLAB_AUTH_SECRET", secret.clone().into()),
            ("TTLAB_LESSONS", lessons_path.clone().into()),
            ("TTLAB_AGENT_BINARY", agent_bin.into()),
        ]);
        if let Some(w) = &web_dir {
            server_env.push(("TTLAB_WEB_DIR", w.clone().into()));
        }
        let server = ChildProcess::spawn("server", &server_bin, &[], &server_env)?;
        let server_pid = server.pid();
        self.server = Some(server);

        let mut reaper_line = String::new();
        if args.no_reaper {
            reaper_line = "  reaper:   NOT RUNNING (--no-reaper): expired sessions are not \
                           reclaimed; each VM powers itself off at its hard deadline\n"
                .to_owned();
        } else if let Some(reaper_bin) = &bins.reaper {
            let metrics = SocketAddr::from((Ipv4Addr::LOCALHOST, stack::free_loopback_port()?));
            let mut reaper_env = common.clone();
            reaper_env.push(("TTLAB_METRICS_LISTEN", metrics.to_string().into()));
            let reaper = ChildProcess::spawn("reaper", reaper_bin, &[], &reaper_env)?;
            reaper_line = format!(
                "  reaper:   pid {} (metrics http://{metrics}/metrics)\n",
                reaper.pid()
            );
            self.reaper = Some(reaper);
        }

        if let Some(server) = self.server.as_mut() {
            wait_ready(server, &url).await?;
        }

        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let mint = |user: &str, role| -> anyhow::Result<String> {
            // The same minting as `ttlabctl token`.
            Ok(auth.mint(&user.parse()?, role, now, args.token_ttl)?)
        };
        let student = mint(DEMO_STUDENT, Role::Student)?;
        let admin = mint(DEMO_ADMIN, Role::Admin)?;

        let mut banner = String::new();
        banner.push_str(&format!("ttlab demo ready: {url}/\n"));
        banner.push_str(&format!(
            "  student:  {} (user {DEMO_STUDENT})\n",
            login_link(&url, "/", &student)
        ));
        banner.push_str(&format!(
            "  admin:    {} (user {DEMO_ADMIN})\n",
            login_link(&url, "/admin", &admin)
        ));
        banner.push_str(&format!(
            "  API:      curl -H \"Authorization: Bearer {student}\" {url}/api/lessons\n"
        ));
        banner.push_str("  lessons:\n");
        for (id, g) in &golden {
            let disk = match g {
                GoldenSetup::Present { pvc } => {
                    format!("golden PVC {pvc} present: golden root disk")
                }
                GoldenSetup::Absent { source } => {
                    format!("golden {source} absent: container disk fallback")
                }
                GoldenSetup::NotUsed => "container disk".to_owned(),
            };
            banner.push_str(&format!("    {id}: {disk}\n"));
        }
        banner.push_str(&format!("  server:   pid {server_pid}\n"));
        if reaper_line.is_empty() {
            banner.push_str(
                "  reaper:   NOT RUNNING: ttlab-reaper is not available in this build, so \
                 expired sessions are not reclaimed\n",
            );
        } else {
            banner.push_str(&reaper_line);
        }
        if web_dir.is_none() {
            banner.push_str("  web:      NOT SERVED (see the message above); the API works\n");
        }
        if let Some(file) = &sites_file {
            banner.push_str(&format!("  sites:    {}\n", file.display()));
            for (name, sim) in &self.sims {
                banner.push_str(&format!(
                    "    {name}: kube-sim at {} (VM limit {}; kubectl: KUBECONFIG={} kubectl get vm,vmi -n {} -w)\n",
                    sim.url(),
                    args.site_vm_limit,
                    data_dir.join(format!("{name}.kubeconfig")).display(),
                    args.namespace
                ));
            }
        } else if let Some((_, sim)) = self.sims.first() {
            banner.push_str(&format!("  cluster:  kube-sim at {}\n", sim.url()));
            let watch_config = self.kubeconfig_out.as_deref().unwrap_or(&kubeconfig);
            banner.push_str(&format!(
                "  kubectl:  KUBECONFIG={} kubectl get vm,vmi,pods,secrets,pvc -n {} -w\n",
                watch_config.display(),
                args.namespace
            ));
        }
        banner.push_str(&format!("  postgres: {}\n", database_dir.display()));
        // Another server replica joins the demo with this (and the kubeconfig above).
        banner.push_str(&format!("  database: {database_url}\n"));
        banner.push_str(&format!(
            "  data:     {} (removed on exit)\n",
            data_dir.display()
        ));
        banner.push_str("Ctrl-C stops everything.");
        Ok(banner)
    }

    /// Runs until a signal, or until a child exits by itself (an error).
    async fn wait(&mut self, shutdown: &Shutdown) -> anyhow::Result<()> {
        let Self { server, reaper, .. } = self;
        tokio::select! {
            () = shutdown.wait() => Ok(()),
            (name, status, tail) = exited(server.as_mut()) => {
                anyhow::bail!("the {name} exited by itself ({}); its last lines:\n{tail}", show(status))
            }
            (name, status, tail) = exited(reaper.as_mut()) => {
                anyhow::bail!("the {name} exited by itself ({}); its last lines:\n{tail}", show(status))
            }
        }
    }

    /// Stops the reaper, the server, the simulation and PostgreSQL, and deletes the data.
    /// Returns the data directory's path.
    async fn teardown(&mut self) -> anyhow::Result<String> {
        let mut errors = Vec::new();
        for child in [self.reaper.as_mut(), self.server.as_mut()]
            .into_iter()
            .flatten()
        {
            match child.stop(STOP_GRACE).await {
                Ok(status) => eprintln!(
                    "ttlabctl: {} (pid {}) stopped ({status})",
                    child.name(),
                    child.pid()
                ),
                Err(e) => errors.push(format!("{e:#}")),
            }
        }
        for (_, sim) in self.sims.drain(..) {
            sim.shutdown().await;
        }
        if let Some(db) = self.database.take()
            && let Err(e) = db.stop().await
        {
            errors.push(format!("{e:#}"));
        }
        if let Some(out) = self.kubeconfig_out.take()
            && let Err(e) = std::fs::remove_file(&out)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            errors.push(format!("removing {}: {e}", out.display()));
        }
        let mut dir = String::new();
        if let Some(data) = self.data.take() {
            dir = data.path().display().to_string();
            if let Err(e) = data.close() {
                errors.push(format!("removing {dir}: {e}"));
            }
        }
        if errors.is_empty() {
            Ok(dir)
        } else {
            anyhow::bail!("{}", errors.join("; "))
        }
    }
}

/// Waits until the server's `/readyz` answers 200, failing early if it exits.
pub(crate) async fn wait_ready(server: &mut ChildProcess, url: &str) -> anyhow::Result<()> {
    let http = client::client(1);
    let readyz = format!("{url}/readyz");
    let started = Instant::now();
    loop {
        if let Some(status) = server.has_exited() {
            anyhow::bail!(
                "ttlab-server exited while starting ({status}); its last lines:\n{}",
                server.tail()
            );
        }
        let last = match client::send(&http, client::Method::GET, &readyz, None, None).await {
            Ok((s, _)) if s.is_success() => return Ok(()),
            Ok((s, body)) => format!("{s}: {}", String::from_utf8_lossy(&body)),
            Err(e) => format!("{e:#}"),
        };
        if started.elapsed() > READY_TIMEOUT {
            anyhow::bail!(
                "ttlab-server was not ready within {}s ({readyz}: {last})",
                READY_TIMEOUT.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until `c` (if any) exits by itself: its name, exit status and last lines.
async fn exited(
    c: Option<&mut ChildProcess>,
) -> (
    &'static str,
    std::io::Result<std::process::ExitStatus>,
    String,
) {
    match c {
        Some(c) => {
            let status = c.exited().await;
            (c.name(), status, c.tail())
        }
        None => std::future::pending().await,
    }
}

fn show(status: std::io::Result<std::process::ExitStatus>) -> String {
    match status {
        Ok(s) => s.to_string(),
        Err(e) => e.to_string(),
    }
}

/// A page of the web UI that signs in with `token`.
fn login_link(url: &str, page: &str, token: &str) -> String {
    format!("{url}{page}?token={token}")
}

/// 32 random bytes, hex-encoded (64 characters).
pub(crate) fn random_secret() -> anyhow::Result<String> {
    use std::io::Read as _;
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("reading /dev/urandom for a random secret")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The web pages to serve, installing their npm dependencies first if needed. `None` (with a
/// message saying why) when they cannot be served; the API works without them.
async fn prepare_web(given: Option<PathBuf>) -> Option<PathBuf> {
    let explicit = given.is_some();
    let dir = given.unwrap_or_else(|| checkout_dir().join("web"));
    if !dir.is_dir() {
        if explicit {
            eprintln!(
                "ttlabctl: web pages: {} is not a directory; serving the API only",
                dir.display()
            );
        } else {
            eprintln!(
                "ttlabctl: web pages: no web/ directory in this checkout; serving the API only"
            );
        }
        return None;
    }
    let dir = std::fs::canonicalize(&dir).unwrap_or(dir);
    if dir.join("package.json").is_file() && !dir.join("node_modules/@xterm/xterm").is_dir() {
        eprintln!(
            "ttlabctl: web pages: installing their npm dependencies once (npm ci in {})",
            dir.display()
        );
        let status = tokio::process::Command::new("npm")
            .arg("ci")
            .arg("--no-audit")
            .arg("--no-fund")
            .current_dir(&dir)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::inherit())
            .stderr(std::process::Stdio::inherit())
            .status()
            .await;
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => {
                eprintln!(
                    "ttlabctl: web pages: npm ci failed ({s}); serving the API only \
                     (run `npm ci` in {} and restart the demo)",
                    dir.display()
                );
                return None;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                eprintln!(
                    "ttlabctl: web pages: they need `npm ci` and npm is not installed; \
                     serving the API only (install Node.js and npm to get the pages)"
                );
                return None;
            }
            Err(e) => {
                eprintln!("ttlabctl: web pages: could not run npm ({e}); serving the API only");
                return None;
            }
        }
    }
    Some(dir)
}

/// Ctrl-C (SIGINT) or SIGTERM, caught from the start so that no signal kills ttlabctl before
/// it has stopped its children.
struct Shutdown {
    rx: tokio::sync::watch::Receiver<bool>,
}

impl Shutdown {
    fn listen() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        let mut int = signal(SignalKind::interrupt()).context("catching SIGINT")?;
        let mut term = signal(SignalKind::terminate()).context("catching SIGTERM")?;
        let (tx, rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
            tx.send_replace(true);
        });
        Ok(Self { rx })
    }

    async fn wait(&self) {
        let mut rx = self.rx.clone();
        let _ = rx.wait_for(|stop| *stop).await;
    }
}
