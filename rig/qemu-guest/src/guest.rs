//! One qemu process: root disk, seed, network, serial console, QMP, power-off and shutdown.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::UnixStream;
use tokio::sync::{broadcast, mpsc, watch};

use crate::{Accel, GuestImage, QEMU, QEMU_IMG, QemuError};

/// How the guest's root disk is made from the base image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RootDisk {
    /// A qcow2 overlay on the read-only base (`qemu-img create -b`): the golden-disk model, a
    /// thin writable layer per VM.
    Overlay,
    /// A full copy of the base (the container-disk fallback: nothing shared).
    Copy,
}

/// Everything one guest is started with.
#[derive(Debug, Clone)]
pub struct GuestSpec {
    /// The base image.
    pub image: GuestImage,
    /// How the root disk is made.
    pub root: RootDisk,
    /// A directory of this guest's own (disk, seed, sockets, log); created if missing.
    pub dir: PathBuf,
    /// cloud-init's instance id (a new one means a first boot).
    pub instance_id: String,
    /// The hostname in the seed's meta-data.
    pub hostname: String,
    /// Disks made from the VMI's `configMap` volumes, attached after the seed in this order
    /// (read-only virtio disks, each an ISO 9660 volume labelled as the volume says).
    pub config_disks: Vec<crate::ConfigDisk>,
    /// The user-data for cloud-init.
    pub user_data: Vec<u8>,
    /// Guest memory in MiB.
    pub memory_mib: u64,
    /// Virtual CPUs.
    pub cpus: u32,
    /// KVM or TCG.
    pub accel: Accel,
    /// Host side of the forwarded port: a loopback address of this guest's own.
    pub forward_from: SocketAddr,
    /// Guest side of the forwarded port (the agent's).
    pub forward_to: u16,
}

/// How the qemu process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exit {
    /// The guest powered itself off (or accepted the ACPI power button): qemu exited 0.
    PoweredOff,
    /// qemu exited otherwise, or was killed.
    Failed(String),
}

/// The serial console: what the guest prints, and a way to type.
#[derive(Debug, Clone)]
pub struct Console {
    output: broadcast::Sender<Bytes>,
    input: mpsc::Sender<Bytes>,
    history: Arc<Mutex<Vec<u8>>>,
}

/// How much of the serial output is kept for a client that connects late.
const HISTORY: usize = 64 * 1024;

impl Console {
    /// A receiver of everything printed from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<Bytes> {
        self.output.subscribe()
    }

    /// The last 64 KiB printed so far.
    pub fn history(&self) -> Vec<u8> {
        self.history
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Types bytes on the serial port.
    pub async fn send(&self, bytes: Bytes) -> Result<(), QemuError> {
        self.input.send(bytes).await.map_err(|_| QemuError::Ended)
    }
}

/// A running qemu guest. Dropping it kills the process.
pub struct Guest {
    pid: Option<u32>,
    dir: PathBuf,
    console: Console,
    exit: watch::Receiver<Option<Exit>>,
    kill: Option<tokio::sync::oneshot::Sender<()>>,
}

impl std::fmt::Debug for Guest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guest")
            .field("pid", &self.pid)
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl Guest {
    /// Makes the root disk and the seed, and starts qemu. Returns once the process runs and
    /// its serial console is connected.
    pub async fn start(spec: GuestSpec) -> Result<Self, QemuError> {
        let dir = spec.dir.clone();
        tokio::fs::create_dir_all(&dir)
            .await
            .map_err(QemuError::io(&dir))?;
        let root = make_root_disk(&spec.image, spec.root, &dir).await?;
        let seed =
            crate::write_seed(&dir, &spec.instance_id, &spec.hostname, &spec.user_data).await?;
        let mut config_isos = Vec::with_capacity(spec.config_disks.len());
        for disk in &spec.config_disks {
            config_isos.push(crate::write_config_disk(&dir, disk).await?);
        }
        let serial_sock = dir.join("serial.sock");
        let qmp_sock = dir.join("qmp.sock");
        for s in [&serial_sock, &qmp_sock] {
            let _ = std::fs::remove_file(s);
        }
        let log_path = dir.join("qemu.log");
        let log = std::fs::File::create(&log_path).map_err(QemuError::io(&log_path))?;
        let mut cmd = tokio::process::Command::new(QEMU);
        cmd.args(["-name", &spec.hostname, "-nodefaults", "-no-user-config"])
            .args(["-display", "none", "-monitor", "none"])
            .args(["-accel", spec.accel.qemu_arg(), "-cpu", spec.accel.cpu()])
            .args(["-m", &spec.memory_mib.to_string()])
            .args(["-smp", &spec.cpus.max(1).to_string()])
            .arg("-drive")
            .arg(format!(
                "file={},format=qcow2,if=virtio,cache=unsafe,discard=unmap",
                root.display()
            ))
            .arg("-drive")
            .arg(format!(
                "file={},format=raw,if=virtio,readonly=on",
                seed.display()
            ))
            .args(config_isos.iter().flat_map(|iso| {
                [
                    "-drive".to_owned(),
                    format!("file={},format=raw,if=virtio,readonly=on", iso.display()),
                ]
            }))
            .arg("-netdev")
            .arg(format!(
                "user,id=net0,restrict=on,hostfwd=tcp:{}:{}-:{}",
                spec.forward_from.ip(),
                spec.forward_from.port(),
                spec.forward_to
            ))
            .args(["-device", "virtio-net-pci,netdev=net0"])
            .args(["-device", "virtio-rng-pci"])
            .arg("-chardev")
            .arg(format!(
                "socket,id=serial0,path={},server=on,wait=off",
                serial_sock.display()
            ))
            .args(["-serial", "chardev:serial0"])
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", qmp_sock.display()));
        if let Some(kernel) = spec.image.kernel() {
            cmd.arg("-kernel").arg(kernel);
            if let Some(initrd) = spec.image.initrd() {
                cmd.arg("-initrd").arg(initrd);
            }
            let extra = spec.image.manifest.cmdline.clone().unwrap_or_default();
            cmd.arg("-append")
                .arg(format!("{extra} console=ttyS0,115200").trim());
        }
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone().map_err(QemuError::io(&log_path))?)
            .stderr(log)
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => QemuError::Missing {
                tool: QEMU,
                hint: "Debian: apt-get install qemu-system-x86",
            },
            _ => QemuError::Io {
                path: QEMU.into(),
                source: e,
            },
        })?;
        let pid = child.id();
        // The sockets appear once qemu has parsed its options.
        let serial = loop {
            match UnixStream::connect(&serial_sock).await {
                Ok(s) => break s,
                Err(_) => {
                    if let Ok(Some(status)) = child.try_wait() {
                        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                        return Err(QemuError::Tool {
                            tool: QEMU.to_owned(),
                            detail: format!("{status}: {}", log.trim()),
                        });
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        let (output, _) = broadcast::channel(256);
        let (input, input_rx) = mpsc::channel(64);
        let history = Arc::new(Mutex::new(Vec::new()));
        let console = Console {
            output: output.clone(),
            input,
            history: history.clone(),
        };
        tokio::spawn(pump_serial(serial, output, input_rx, history));
        let (exit_tx, exit) = watch::channel(None);
        let (kill, kill_rx) = tokio::sync::oneshot::channel::<()>();
        let log2 = log_path.clone();
        tokio::spawn(async move {
            let status = tokio::select! {
                s = child.wait() => s,
                _ = kill_rx => {
                    let _ = child.start_kill();
                    child.wait().await
                }
            };
            let how = match status {
                Ok(s) if s.success() => Exit::PoweredOff,
                Ok(s) => {
                    let log = std::fs::read_to_string(&log2).unwrap_or_default();
                    let tail: Vec<&str> = log.lines().rev().take(3).collect();
                    Exit::Failed(format!(
                        "qemu {s}: {}",
                        tail.into_iter().rev().collect::<Vec<_>>().join(" / ")
                    ))
                }
                Err(e) => Exit::Failed(format!("qemu: {e}")),
            };
            let _ = exit_tx.send(Some(how));
        });
        Ok(Self {
            pid,
            dir,
            console,
            exit,
            kill: Some(kill),
        })
    }

    /// The qemu process id.
    pub fn pid(&self) -> Option<u32> {
        self.pid
    }

    /// The guest's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The serial console.
    pub fn console(&self) -> Console {
        self.console.clone()
    }

    /// Resolves when qemu has ended, with how.
    pub async fn exited(&self) -> Exit {
        let mut rx = self.exit.clone();
        loop {
            if let Some(e) = rx.borrow_and_update().clone() {
                return e;
            }
            if rx.changed().await.is_err() {
                return Exit::Failed("qemu watcher ended".into());
            }
        }
    }

    /// Presses the ACPI power button, waits up to `grace` for the guest to power off, then
    /// kills qemu. Returns how it ended.
    pub async fn shutdown(&mut self, grace: Duration) -> Exit {
        if let Err(e) = self.powerdown().await {
            tracing::debug!(error = %e, "ACPI powerdown not delivered");
        }
        match tokio::time::timeout(grace, self.exited()).await {
            Ok(e) => e,
            Err(_) => {
                tracing::info!(dir = %self.dir.display(), "guest still running after {grace:?}: killed");
                self.kill_now();
                self.exited().await
            }
        }
    }

    /// Kills qemu at once.
    pub fn kill_now(&mut self) {
        if let Some(k) = self.kill.take() {
            let _ = k.send(());
        }
    }

    /// Sends `system_powerdown` over QMP.
    pub async fn powerdown(&self) -> Result<(), QemuError> {
        let path = self.dir.join("qmp.sock");
        let stream = UnixStream::connect(&path)
            .await
            .map_err(QemuError::io(&path))?;
        let (r, mut w) = stream.into_split();
        let mut lines = tokio::io::BufReader::new(r).lines();
        let io = QemuError::io(&path);
        let step = async {
            lines.next_line().await?; // greeting
            w.write_all(b"{\"execute\":\"qmp_capabilities\"}\n").await?;
            lines.next_line().await?;
            w.write_all(b"{\"execute\":\"system_powerdown\"}\n").await?;
            lines.next_line().await?;
            Ok::<(), std::io::Error>(())
        };
        tokio::time::timeout(Duration::from_secs(10), step)
            .await
            .map_err(|_| QemuError::Tool {
                tool: "qmp".into(),
                detail: "no answer within 10 s".into(),
            })?
            .map_err(io)
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        self.kill_now();
    }
}

async fn make_root_disk(
    image: &GuestImage,
    how: RootDisk,
    dir: &Path,
) -> Result<PathBuf, QemuError> {
    let root = dir.join("root.qcow2");
    let _ = tokio::fs::remove_file(&root).await;
    let base = image.disk();
    let base = base.to_str().ok_or(QemuError::Image {
        dir: image.dir.clone(),
        reason: "the disk path is not UTF-8".into(),
    })?;
    let mut cmd = tokio::process::Command::new(QEMU_IMG);
    match how {
        RootDisk::Overlay => cmd
            .args(["create", "-q", "-f", "qcow2", "-b", base, "-F"])
            .arg(&image.manifest.disk_format)
            .arg(&root),
        RootDisk::Copy => cmd
            .args(["convert", "-q", "-f"])
            .arg(&image.manifest.disk_format)
            .args(["-O", "qcow2", base])
            .arg(&root),
    };
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => QemuError::Missing {
                tool: QEMU_IMG,
                hint: "Debian: apt-get install qemu-utils",
            },
            _ => QemuError::Io {
                path: QEMU_IMG.into(),
                source: e,
            },
        })?;
    if !out.status.success() {
        return Err(QemuError::Tool {
            tool: QEMU_IMG.to_owned(),
            detail: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(root)
}

async fn pump_serial(
    serial: UnixStream,
    output: broadcast::Sender<Bytes>,
    mut input: mpsc::Receiver<Bytes>,
    history: Arc<Mutex<Vec<u8>>>,
) {
    let (mut r, mut w) = serial.into_split();
    let writer = tokio::spawn(async move {
        while let Some(b) = input.recv().await {
            if w.write_all(&b).await.is_err() {
                break;
            }
        }
    });
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let chunk = Bytes::copy_from_slice(&buf[..n]);
                {
                    let mut h = history
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    h.extend_from_slice(&chunk);
                    if h.len() > HISTORY {
                        let cut = h.len() - HISTORY;
                        h.drain(..cut);
                    }
                }
                let _ = output.send(chunk);
            }
        }
    }
    writer.abort();
}
