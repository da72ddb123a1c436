//! Real qemu guests ([`crate::SimSettings::qemu`]): a VMI that reaches `Scheduled` boots the
//! guest image under qemu (`ttlab-qemu-guest`) instead of a simulated guest. The VMI turns
//! Running once qemu runs, as KubeVirt reports it once the domain starts, long before the
//! guest's agent answers; cloud-init inside the guest applies the user-data and installs the
//! agent from the agent disk. The agent port is forwarded from the launcher pod's loopback
//! address. qemu ending by itself is the guest powering off (exit 0: the VMI ends
//! `Succeeded`) or crashing (`Failed`); a deleted VMI presses the ACPI power button and waits
//! for the guest within its grace, as virt-launcher does, then kills it.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio_util::sync::CancellationToken;
use ttlab_model::Quantity;
use ttlab_qemu_guest::{Accel, Exit, Guest, GuestSpec, QemuSettings, RootDisk};

use crate::Triggers;
use crate::guests::{GuestEnd, Guests, QemuLink};

/// Memory a guest gets when its VMI asks for none (MiB).
const DEFAULT_MEMORY_MIB: u64 = 1024;
/// The least memory a guest boots with (MiB).
const MIN_MEMORY_MIB: u64 = 256;
/// How often a running guest's agent is asked whether it answers, until it does.
const AGENT_PROBE: Duration = Duration::from_secs(1);

/// What one guest boots with, read from its VMI and the objects it names.
pub(crate) struct Boot {
    pub(crate) uid: String,
    pub(crate) ns: String,
    pub(crate) name: String,
    /// The guest's own directory (disk, seed, sockets, log).
    pub(crate) dir: PathBuf,
    /// The launcher pod's address: the agent port is forwarded from it.
    pub(crate) ip: Ipv4Addr,
    pub(crate) agent_port: u16,
    pub(crate) config_disks: Vec<ttlab_qemu_guest::ConfigDisk>,
    pub(crate) user_data: Vec<u8>,
    /// How long a deleted guest gets to power off after the ACPI button.
    pub(crate) grace: Duration,
    /// From the VMI's domain.
    pub(crate) memory_mib: u64,
    pub(crate) cpus: u32,
    /// An `ephemeral` volume (the golden disk): a copy-on-write overlay of the base image;
    /// otherwise (the container disk) a full copy.
    pub(crate) golden: bool,
}

impl Boot {
    /// The domain's resources of `vmi`, as qemu gets them.
    pub(crate) fn resources(vmi: &Value) -> (u64, u32, bool) {
        let domain = &vmi["spec"]["domain"];
        let memory = domain["resources"]["requests"]["memory"]
            .as_str()
            .or_else(|| domain["memory"]["guest"].as_str())
            .and_then(mebibytes)
            .unwrap_or(DEFAULT_MEMORY_MIB);
        let cpus = domain["cpu"]["cores"]
            .as_u64()
            .and_then(|c| u32::try_from(c).ok())
            .unwrap_or(1);
        let golden = vmi["spec"]["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|v| v.get("ephemeral").is_some());
        (memory, cpus, golden)
    }
}

/// A Kubernetes memory quantity (`2Gi`, `512Mi`, `1G`, `1.5Gi`, bytes) in MiB, rounded down.
fn mebibytes(q: &str) -> Option<u64> {
    let q: Quantity = q.trim().parse().ok()?;
    let bytes = u64::try_from(q.milli().div_euclid(1000)).ok()?;
    Some(bytes >> 20)
}

/// What wakes a running guest's task.
enum Wake {
    Exited(Exit),
    Kill,
    Powerdown,
}

/// Starts the guest of `boot` in a task of its own, which owns the qemu process until it
/// ends, and reports to `guests` (then wakes the controllers) when it runs and when it ends.
pub(crate) fn spawn(
    settings: QemuSettings,
    accel: Arc<tokio::sync::OnceCell<Accel>>,
    guests: Arc<Guests>,
    triggers: Arc<Triggers>,
    boot: Boot,
) {
    tokio::spawn(async move {
        let accel = match settings.accel {
            Some(a) => a,
            None => {
                *accel
                    .get_or_init(|| {
                        ttlab_qemu_guest::probe_accel(&settings.image, settings.probe_timeout)
                    })
                    .await
            }
        };
        let memory_mib = boot
            .memory_mib
            .clamp(MIN_MEMORY_MIB, settings.max_memory_mib.max(MIN_MEMORY_MIB));
        let cpus = boot.cpus.clamp(1, settings.max_cpus.max(1));
        let spec = GuestSpec {
            image: settings.image.clone(),
            root: if boot.golden {
                RootDisk::Overlay
            } else {
                RootDisk::Copy
            },
            dir: boot.dir.clone(),
            instance_id: boot.uid.clone(),
            hostname: boot.name.clone(),
            config_disks: boot.config_disks,
            user_data: boot.user_data,
            memory_mib,
            cpus,
            accel,
            forward_from: SocketAddr::from((boot.ip, boot.agent_port)),
            forward_to: ttlab_agent::protocol::PORT,
        };
        let (ns, name, uid) = (boot.ns, boot.name, boot.uid);
        let started = Instant::now();
        let mut guest = match Guest::start(spec).await {
            Ok(g) => g,
            Err(e) => {
                tracing::warn!(ns, vmi = name, error = %e, "qemu guest did not start");
                guests.qemu_exited(&uid, GuestEnd::Crash);
                triggers.fire();
                return;
            }
        };
        let (exited_tx, exited_rx) = tokio::sync::watch::channel(false);
        let (powerdown, kill) = (CancellationToken::new(), CancellationToken::new());
        let link = QemuLink {
            console: guest.console(),
            pid: guest.pid(),
            powerdown: powerdown.clone(),
            kill: kill.clone(),
            exited: exited_rx,
        };
        if !guests.set_qemu(&uid, link) {
            tracing::info!(ns, vmi = name, "guest stopped while qemu started: killed");
            guest.kill_now();
            let _ = guest.exited().await;
            let _ = exited_tx.send(true);
            return;
        }
        tracing::info!(ns, vmi = name, %accel, memory_mib, cpus, golden = boot.golden, pid = ?guest.pid(), "qemu guest started");
        triggers.fire();
        let wake = tokio::select! {
            exit = guest.exited() => Wake::Exited(exit),
            () = kill.cancelled() => Wake::Kill,
            () = powerdown.cancelled() => Wake::Powerdown,
        };
        let exit = match wake {
            Wake::Exited(exit) => {
                tracing::info!(ns, vmi = name, ?exit, after = ?started.elapsed(), "qemu guest ended by itself");
                exit
            }
            Wake::Kill => {
                guest.kill_now();
                guest.exited().await
            }
            Wake::Powerdown => {
                let shut = tokio::select! {
                    exit = guest.shutdown(boot.grace) => Some(exit),
                    () = kill.cancelled() => None,
                };
                let exit = match shut {
                    Some(exit) => exit,
                    None => {
                        guest.kill_now();
                        guest.exited().await
                    }
                };
                tracing::info!(
                    ns,
                    vmi = name,
                    ?exit,
                    "qemu guest shut down for the deletion"
                );
                exit
            }
        };
        let _ = exited_tx.send(true);
        guests.qemu_exited(
            &uid,
            match exit {
                Exit::PoweredOff => GuestEnd::PowerOff,
                Exit::Failed(_) => GuestEnd::Crash,
            },
        );
        triggers.fire();
    });
}

/// Asks the running guest's agent, through the forwarded port, until it answers (any HTTP
/// reply: qemu accepts the connection before the guest does), then marks it connected.
pub(crate) fn probe_agent(
    guests: Arc<Guests>,
    triggers: Arc<Triggers>,
    uid: String,
    addr: SocketAddr,
    tasks: CancellationToken,
) {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = tasks.cancelled() => return,
                up = agent_answers(addr) => if up {
                    guests.set_agent_connected(&uid);
                    triggers.fire();
                    return;
                },
            }
            tokio::select! {
                () = tasks.cancelled() => return,
                () = tokio::time::sleep(AGENT_PROBE) => {}
            }
        }
    });
}

async fn agent_answers(addr: SocketAddr) -> bool {
    let wait = Duration::from_secs(2);
    let Ok(Ok(mut stream)) = tokio::time::timeout(wait, tokio::net::TcpStream::connect(addr)).await
    else {
        return false;
    };
    let ask = format!("GET /v1/health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if stream.write_all(ask.as_bytes()).await.is_err() {
        return false;
    }
    let mut head = [0u8; 5];
    matches!(
        tokio::time::timeout(wait, stream.read_exact(&mut head)).await,
        Ok(Ok(_))
    ) && &head == b"HTTP/"
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn memory_quantities_become_mebibytes() {
        assert_eq!(mebibytes("2Gi"), Some(2048));
        assert_eq!(mebibytes("256Mi"), Some(256));
        assert_eq!(mebibytes("1G"), Some(953));
        assert_eq!(mebibytes("1048576"), Some(1));
        assert_eq!(mebibytes("lots"), None);
        assert_eq!(mebibytes("2Zi"), None);
        assert_eq!(mebibytes("1.5Gi"), Some(1536));
        assert_eq!(mebibytes("-1Gi"), None);
    }

    #[test]
    fn a_vmi_domain_gives_memory_cpus_and_the_root_disk() {
        let vmi = json!({"spec": {
            "domain": {"resources": {"requests": {"memory": "2Gi"}}, "cpu": {"cores": 2}},
            "volumes": [{"name": "root", "ephemeral": {}}]
        }});
        assert_eq!(Boot::resources(&vmi), (2048, 2, true));
        let bare =
            json!({"spec": {"domain": {}, "volumes": [{"name": "root", "containerDisk": {}}]}});
        assert_eq!(Boot::resources(&bare), (DEFAULT_MEMORY_MIB, 1, false));
    }
}
