//! The simulated guests: one per VirtualMachineInstance that reached `Scheduled`, keyed by the
//! VMI's uid. A guest boots (cloud-init applied into its directory), runs (its agent process
//! listening on the launcher pod's address), and ends by powering off, crashing, or being
//! shut down when its VMI or launcher pod is deleted. With [`crate::SimSettings::qemu`] a
//! guest is a real qemu process instead (`crate::qemu`): its serial port is the console, its
//! agent the one inside the guest, its power-off the process ending.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

/// How often a deleted qemu guest's shutdown is looked at (its task also wakes the
/// controllers when qemu exits).
const QEMU_SHUTDOWN_POLL: Duration = Duration::from_millis(500);

/// How a guest ends by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestEnd {
    /// The guest powered itself off: its VMI ends `Succeeded`.
    PowerOff,
    /// The guest crashed: its VMI ends `Failed`.
    Crash,
}

/// Where a guest is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestState {
    /// Booting: the VMI is `Scheduled`, the boot delay runs.
    Booting,
    /// Running: the VMI is `Running`; the agent starts (or has started).
    Running,
    /// Shutting down after its VMI or launcher pod was deleted.
    ShuttingDown,
    /// Off: powered off, crashed, or shut down. The agent is gone.
    Off(Option<GuestEnd>),
}

/// What tests can see of a guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestInfo {
    /// Namespace of the VMI.
    pub namespace: String,
    /// Name of the VMI (and of its VM).
    pub name: String,
    /// The VMI's uid.
    pub vmi_uid: String,
    /// The guest's root directory (cloud-init `write_files` land under it).
    pub dir: PathBuf,
    /// Its loopback address (the launcher pod's IP, reported in `status.interfaces`).
    pub ip: Ipv4Addr,
    /// Its hostname (from cloud-init's `hostname`, else the VMI's name).
    pub hostname: String,
    /// The agent process, while it runs.
    pub agent_pid: Option<u32>,
    /// Where the guest is in its life.
    pub state: GuestState,
}

#[derive(Debug)]
enum Phase {
    Booting {
        since: Instant,
        cloud_init_done: bool,
    },
    Running,
    ShuttingDown {
        since: Instant,
    },
    Off(Option<GuestEnd>),
}

struct Guest {
    ns: String,
    name: String,
    hostname: String,
    ip: Ipv4Addr,
    dir: PathBuf,
    phase: Phase,
    agent: Option<tokio::process::Child>,
    /// Cancels the guest's own tasks (agent start, setup marker).
    tasks: CancellationToken,
    tasks_started: bool,
    /// Its agent said it listens (KubeVirt learns the guest's OS from its guest agent then).
    agent_connected: bool,
    /// Whether a qemu process was asked for (once per guest).
    qemu_claimed: bool,
    /// The qemu process, once it runs.
    qemu: Option<QemuLink>,
}

/// What the guest table holds of a running qemu guest; the process itself belongs to its task
/// (`crate::qemu`).
pub(crate) struct QemuLink {
    /// The serial console.
    pub(crate) console: ttlab_qemu_guest::Console,
    /// The qemu process id.
    pub(crate) pid: Option<u32>,
    /// Cancelled to press the ACPI power button (the VMI or its pod was deleted).
    pub(crate) powerdown: CancellationToken,
    /// Cancelled to kill qemu at once.
    pub(crate) kill: CancellationToken,
    /// Turns true once qemu has exited.
    pub(crate) exited: tokio::sync::watch::Receiver<bool>,
}

impl Guest {
    fn state(&self) -> GuestState {
        match self.phase {
            Phase::Booting { .. } => GuestState::Booting,
            Phase::Running => GuestState::Running,
            Phase::ShuttingDown { .. } => GuestState::ShuttingDown,
            Phase::Off(e) => GuestState::Off(e),
        }
    }

    /// The guest is off: its tasks stop and its agent (or qemu) is killed (reaped in the
    /// background).
    fn power_down(&mut self, end: Option<GuestEnd>) {
        self.tasks.cancel();
        if let Some(q) = &self.qemu {
            q.kill.cancel();
        }
        if let Some(mut child) = self.agent.take() {
            let _ = child.start_kill();
            reap(child);
        }
        self.phase = Phase::Off(end);
    }
}

/// Waits for a killed child in the background when a runtime is there (dropping it otherwise
/// leaves it to tokio's orphan reaper).
fn reap(mut child: tokio::process::Child) {
    if let Ok(handle) = tokio::runtime::Handle::try_current() {
        handle.spawn(async move {
            let _ = child.wait().await;
        });
    } else {
        let _ = child.try_wait();
    }
}

/// Every guest of one simulator.
#[derive(Default)]
pub(crate) struct Guests {
    map: Mutex<HashMap<String, Guest>>,
}

/// What [`Guests::shutdown`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shutdown {
    /// Still shutting down for this long.
    Pending(Duration),
    /// Off (or never there).
    Done,
}

impl Guests {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Guest>> {
        self.map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The guest of VMI `uid` starts booting now unless it already exists; returns when its
    /// boot began, or `None` if the guest exists but is no longer booting.
    pub(crate) fn begin_boot(
        &self,
        uid: &str,
        ns: &str,
        name: &str,
        ip: Ipv4Addr,
        dir: PathBuf,
    ) -> Option<Instant> {
        let mut map = self.map();
        let g = map.entry(uid.to_owned()).or_insert_with(|| Guest {
            ns: ns.to_owned(),
            name: name.to_owned(),
            hostname: name.to_owned(),
            ip,
            dir,
            phase: Phase::Booting {
                since: Instant::now(),
                cloud_init_done: false,
            },
            agent: None,
            tasks: CancellationToken::new(),
            tasks_started: false,
            agent_connected: false,
            qemu_claimed: false,
            qemu: None,
        });
        match g.phase {
            Phase::Booting { since, .. } => Some(since),
            _ => None,
        }
    }

    /// Whether the guest's cloud-init already ran (a retried boot does not apply it twice).
    pub(crate) fn cloud_init_done(&self, uid: &str) -> bool {
        matches!(
            self.map().get(uid).map(|g| &g.phase),
            Some(Phase::Booting {
                cloud_init_done: true,
                ..
            })
        )
    }

    /// Cloud-init ran, naming the guest `hostname` if it said so.
    pub(crate) fn set_cloud_init_done(&self, uid: &str, hostname: Option<String>) {
        if let Some(g) = self.map().get_mut(uid)
            && let Phase::Booting {
                cloud_init_done, ..
            } = &mut g.phase
        {
            *cloud_init_done = true;
            if let Some(h) = hostname {
                g.hostname = h;
            }
        }
    }

    /// Booting → Running (before the VMI says so, so that a power-off right after the VMI's
    /// Running finds a running guest). False if the guest is neither booting nor running.
    pub(crate) fn mark_running(&self, uid: &str) -> bool {
        let mut map = self.map();
        let Some(g) = map.get_mut(uid) else {
            return false;
        };
        match g.phase {
            Phase::Booting { .. } => {
                g.phase = Phase::Running;
                true
            }
            Phase::Running => true,
            _ => false,
        }
    }

    /// The token of a running guest's own tasks (agent, setup), handed out once: whoever
    /// gets it starts them.
    pub(crate) fn take_tasks(&self, uid: &str) -> Option<CancellationToken> {
        let mut map = self.map();
        let g = map.get_mut(uid)?;
        if !matches!(g.phase, Phase::Running) || g.tasks_started {
            return None;
        }
        g.tasks_started = true;
        Some(g.tasks.clone())
    }

    /// Keeps the agent process of a running guest (a guest that is no longer running gets
    /// it killed at once).
    pub(crate) fn set_agent(&self, uid: &str, mut child: tokio::process::Child) {
        let mut map = self.map();
        match map.get_mut(uid) {
            Some(g) if matches!(g.phase, Phase::Running) => g.agent = Some(child),
            _ => {
                let _ = child.start_kill();
                reap(child);
            }
        }
    }

    /// The guest's agent listens (while the guest runs).
    pub(crate) fn set_agent_connected(&self, uid: &str) {
        if let Some(g) = self.map().get_mut(uid)
            && matches!(g.phase, Phase::Running)
        {
            g.agent_connected = true;
        }
    }

    /// Whether the running guest's agent listens.
    pub(crate) fn agent_connected(&self, uid: &str) -> bool {
        self.map()
            .get(uid)
            .is_some_and(|g| g.agent_connected && matches!(g.phase, Phase::Running))
    }

    pub(crate) fn state(&self, uid: &str) -> Option<GuestState> {
        self.map().get(uid).map(Guest::state)
    }

    /// The guest ends by itself (power-off or crash). Returns its VMI's uid.
    pub(crate) fn end(&self, ns: &str, name: &str, how: GuestEnd) -> Result<String, crate::Error> {
        let mut map = self.map();
        let mut found = false;
        for (uid, g) in map.iter_mut() {
            if g.ns != ns || g.name != name {
                continue;
            }
            found = true;
            if matches!(g.phase, Phase::Running) {
                g.power_down(Some(how));
                return Ok(uid.clone());
            }
        }
        Err(if found {
            crate::Error::NotRunning {
                namespace: ns.into(),
                name: name.into(),
            }
        } else {
            crate::Error::NoSuchGuest {
                namespace: ns.into(),
                name: name.into(),
            }
        })
    }

    /// Asks the guest of VMI `uid` to shut down (an ACPI shutdown that takes `grace`); the
    /// first call starts the clock. Idempotent: every caller sees the same deadline.
    pub(crate) fn shutdown(&self, uid: &str, grace: Duration) -> Shutdown {
        let mut map = self.map();
        let Some(g) = map.get_mut(uid) else {
            return Shutdown::Done;
        };
        if let Some(q) = &g.qemu {
            // A real guest: the ACPI power button, and the guest's own power-off (its task
            // kills qemu after the grace and reports the end here).
            return match g.phase {
                Phase::Off(_) => Shutdown::Done,
                Phase::ShuttingDown { .. } => Shutdown::Pending(QEMU_SHUTDOWN_POLL),
                Phase::Booting { .. } | Phase::Running => {
                    g.tasks.cancel();
                    if grace.is_zero() {
                        g.power_down(None);
                        return Shutdown::Done;
                    }
                    q.powerdown.cancel();
                    g.phase = Phase::ShuttingDown {
                        since: Instant::now(),
                    };
                    Shutdown::Pending(QEMU_SHUTDOWN_POLL)
                }
            };
        }
        match g.phase {
            Phase::Off(_) => Shutdown::Done,
            Phase::ShuttingDown { since } => {
                let elapsed = since.elapsed();
                if elapsed >= grace {
                    g.power_down(None);
                    Shutdown::Done
                } else {
                    Shutdown::Pending(grace - elapsed)
                }
            }
            Phase::Booting { .. } | Phase::Running => {
                if grace.is_zero() {
                    g.power_down(None);
                    return Shutdown::Done;
                }
                // Setup stops at once; the agent goes with the rest of the guest.
                g.tasks.cancel();
                g.phase = Phase::ShuttingDown {
                    since: Instant::now(),
                };
                Shutdown::Pending(grace)
            }
        }
    }

    /// The guest is off now (its VMI ended without a shutdown).
    pub(crate) fn power_down(&self, uid: &str, end: Option<GuestEnd>) {
        if let Some(g) = self.map().get_mut(uid)
            && !matches!(g.phase, Phase::Off(_))
        {
            g.power_down(end);
        }
    }

    /// Forgets the guest of VMI `uid` (its VMI is gone), killing what is left of it.
    pub(crate) fn remove(&self, uid: &str) {
        if let Some(mut g) = self.map().remove(uid) {
            g.power_down(None);
        }
    }

    /// Whether the booting guest of VMI `uid` should start its qemu process now: true once.
    pub(crate) fn claim_qemu(&self, uid: &str) -> bool {
        match self.map().get_mut(uid) {
            Some(g) if matches!(g.phase, Phase::Booting { .. }) && !g.qemu_claimed => {
                g.qemu_claimed = true;
                true
            }
            _ => false,
        }
    }

    /// Whether the qemu process of VMI `uid` was asked for already.
    pub(crate) fn qemu_claimed(&self, uid: &str) -> bool {
        self.map().get(uid).is_some_and(|g| g.qemu_claimed)
    }

    /// The qemu process of VMI `uid` runs. False (and the process is to be killed) if the
    /// guest stopped meanwhile.
    pub(crate) fn set_qemu(&self, uid: &str, link: QemuLink) -> bool {
        match self.map().get_mut(uid) {
            Some(g) if matches!(g.phase, Phase::Booting { .. }) => {
                g.qemu = Some(link);
                true
            }
            _ => false,
        }
    }

    /// Whether the qemu process of VMI `uid` runs (its VMI can turn Running).
    pub(crate) fn qemu_up(&self, uid: &str) -> bool {
        self.map().get(uid).is_some_and(|g| g.qemu.is_some())
    }

    /// The serial console of VMI `uid`'s qemu guest, while it runs.
    pub(crate) fn serial(&self, uid: &str) -> Option<ttlab_qemu_guest::Console> {
        self.map()
            .get(uid)
            .filter(|g| matches!(g.phase, Phase::Running))
            .and_then(|g| g.qemu.as_ref().map(|q| q.console.clone()))
    }

    /// qemu of VMI `uid` ended. A guest shutting down for its deletion is off; a running (or
    /// booting) one powered itself off (`end`) or crashed.
    pub(crate) fn qemu_exited(&self, uid: &str, end: GuestEnd) {
        if let Some(g) = self.map().get_mut(uid) {
            match g.phase {
                Phase::Off(_) => {}
                Phase::ShuttingDown { .. } => g.power_down(None),
                Phase::Booting { .. } | Phase::Running => g.power_down(Some(end)),
            }
        }
    }

    /// The guest of VMI `ns/name` (the newest if several incarnations are known).
    pub(crate) fn info(&self, ns: &str, name: &str) -> Option<GuestInfo> {
        let map = self.map();
        let mut found: Vec<GuestInfo> = map
            .iter()
            .filter(|(_, g)| g.ns == ns && g.name == name)
            .map(|(uid, g)| GuestInfo {
                namespace: g.ns.clone(),
                name: g.name.clone(),
                vmi_uid: uid.clone(),
                dir: g.dir.clone(),
                ip: g.ip,
                hostname: g.hostname.clone(),
                agent_pid: g
                    .agent
                    .as_ref()
                    .and_then(tokio::process::Child::id)
                    .or_else(|| g.qemu.as_ref().and_then(|q| q.pid)),
                state: g.state(),
            })
            .collect();
        // A live guest before one that is off.
        found.sort_by_key(|g| matches!(g.state, GuestState::Off(_)));
        found.into_iter().next()
    }

    /// Kills every agent and qemu process and waits for each to exit.
    pub(crate) async fn kill_all(&self) {
        let (children, qemus): (Vec<_>, Vec<_>) = {
            let mut map = self.map();
            map.values_mut()
                .map(|g| {
                    g.tasks.cancel();
                    let qemu = g.qemu.as_ref().map(|q| {
                        q.kill.cancel();
                        q.exited.clone()
                    });
                    (g.agent.take(), qemu)
                })
                .unzip()
        };
        for mut c in children.into_iter().flatten() {
            let _ = c.kill().await;
        }
        for mut exited in qemus.into_iter().flatten() {
            let _ =
                tokio::time::timeout(Duration::from_secs(10), exited.wait_for(|done| *done)).await;
        }
    }

    /// Sends every agent SIGKILL without waiting (for `Drop`).
    pub(crate) fn kill_all_now(&self) {
        for g in self.map().values_mut() {
            g.tasks.cancel();
            if let Some(q) = &g.qemu {
                q.kill.cancel();
            }
            if let Some(mut c) = g.agent.take() {
                let _ = c.start_kill();
                reap(c);
            }
        }
    }
}
