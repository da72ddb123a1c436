//! KVM or software emulation (TCG). `/dev/kvm` can be present and still unusable: opening it
//! can hang, and a nested hypervisor can run a few instructions yet never boot a kernel. The
//! probe therefore boots the image's own kernel under KVM, with a timeout, and looks for the
//! kernel's first line on the serial port.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncReadExt as _;

use crate::{GuestImage, QEMU};

/// How qemu runs the guest's instructions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    /// Hardware virtualization through `/dev/kvm`: boots in seconds.
    Kvm,
    /// qemu's software emulation: a minute or more to boot, no special device needed.
    Tcg,
}

impl Accel {
    /// qemu's `-accel` value.
    pub fn qemu_arg(self) -> &'static str {
        match self {
            Self::Kvm => "kvm",
            Self::Tcg => "tcg,thread=multi",
        }
    }

    /// qemu's `-cpu` value.
    pub fn cpu(self) -> &'static str {
        match self {
            Self::Kvm => "host",
            Self::Tcg => "max",
        }
    }
}

impl std::fmt::Display for Accel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Kvm => "KVM",
            Self::Tcg => "TCG (software emulation)",
        })
    }
}

/// KVM if a kernel boots under it within `timeout`, else TCG. Without a kernel beside the
/// image (a cloud image with its own boot loader) the probe runs a few instructions of a tiny
/// firmware instead, which catches a hanging `/dev/kvm` but not every broken nesting.
pub async fn probe_accel(image: &GuestImage, timeout: Duration) -> Accel {
    if std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        tracing::info!("no usable /dev/kvm: guests run under TCG");
        return Accel::Tcg;
    }
    let dir = match tempfile_dir() {
        Some(d) => d,
        None => return Accel::Tcg,
    };
    let mut cmd = tokio::process::Command::new(QEMU);
    cmd.args([
        "-accel",
        "kvm",
        "-cpu",
        "host",
        "-m",
        "256",
        "-nodefaults",
        "-no-user-config",
    ])
    .args([
        "-display",
        "none",
        "-no-reboot",
        "-serial",
        "stdio",
        "-monitor",
        "none",
    ]);
    let expect: &[u8] = match (image.kernel(), image.initrd()) {
        (Some(kernel), _) => {
            cmd.arg("-kernel").arg(kernel).args([
                "-append",
                "console=ttyS0 panic=-1 rdinit=/ttlab-probe-no-init",
            ]);
            b"Linux version"
        }
        (None, _) => {
            let bios = dir.join("probe.bin");
            if std::fs::write(&bios, probe_firmware()).is_err() {
                return Accel::Tcg;
            }
            cmd.arg("-bios").arg(bios).args(["-machine", "pc"]);
            b"ttlab-kvm-ok"
        }
    };
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    let Ok(mut child) = cmd.spawn() else {
        return Accel::Tcg;
    };
    let mut out = child.stdout.take();
    let found = tokio::time::timeout(timeout, async {
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while let Some(o) = out.as_mut() {
            match o.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => {
                    seen.extend_from_slice(&buf[..n]);
                    if seen.windows(expect.len()).any(|w| w == expect) {
                        return true;
                    }
                }
            }
        }
        false
    })
    .await
    .unwrap_or(false);
    let _ = child.start_kill();
    let _ = child.wait().await;
    let _ = std::fs::remove_dir_all(&dir);
    if found {
        tracing::info!("KVM boots a kernel: guests run under KVM");
        Accel::Kvm
    } else {
        tracing::warn!(
            "/dev/kvm is present but qemu booted nothing under it (it failed, or printed \
             nothing within {timeout:?}): guests run under TCG"
        );
        Accel::Tcg
    }
}

fn tempfile_dir() -> Option<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("ttlab-kvm-probe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).ok()?;
    Some(dir)
}

/// 64 KiB of firmware whose reset vector prints `ttlab-kvm-ok` on COM1 and halts.
fn probe_firmware() -> Vec<u8> {
    let mut rom = vec![0xF4u8; 0x10000]; // hlt
    // At 0xF000:0x0000: mov dx,0x3f8; mov si,msg; (lodsb via cs) loop: mov al,[cs:si]; ...
    // Simpler: one `out` per byte.
    let mut code = vec![0xBA, 0xF8, 0x03]; // mov dx, 0x3f8
    for b in b"ttlab-kvm-ok\r\n" {
        code.extend_from_slice(&[0xB0, *b, 0xEE]); // mov al, b; out dx, al
    }
    code.extend_from_slice(&[0xF4, 0xEB, 0xFD]); // hlt; jmp $-1
    rom[..code.len()].copy_from_slice(&code);
    // The reset vector (0xFFFF0) jumps far to 0xF000:0x0000.
    rom[0xFFF0..0xFFF5].copy_from_slice(&[0xEA, 0x00, 0x00, 0x00, 0xF0]);
    rom
}
