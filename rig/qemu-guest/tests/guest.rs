//! The qemu guest runner against the real image: the accelerator probe answers within its
//! timeout, a guest boots cloud-init from its NoCloud seed and prints on its serial console,
//! the forwarded port is the only way in, and the ACPI power button powers it off (qemu exits
//! 0). Bad image directories fail with a clear error.
//!
//! Needs `qemu-system-x86_64`, `qemu-img`, an ISO writer and `TTLAB_GUEST_IMAGE` (the
//! directory `ttlabctl guest-image` prints); without them: `SKIPPED:`, or a failure under
//! `CI=true`.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use ttlab_qemu_guest::{
    Exit, Guest, GuestImage, GuestSpec, ImageManifest, QemuError, RootDisk, probe_accel,
};

fn image() -> Option<GuestImage> {
    for tool in ["qemu-system-x86_64", "qemu-img"] {
        if ttlab_testkit::which(tool).is_none() {
            ttlab_testkit::skip_or_fail(&format!("{tool} is not installed"));
            return None;
        }
    }
    if ["genisoimage", "mkisofs", "xorriso"]
        .iter()
        .all(|t| ttlab_testkit::which(t).is_none())
    {
        ttlab_testkit::skip_or_fail("no ISO writer (Debian: apt-get install genisoimage)");
        return None;
    }
    let Some(dir) = std::env::var_os("TTLAB_GUEST_IMAGE") else {
        ttlab_testkit::skip_or_fail(
            "TTLAB_GUEST_IMAGE is not set (the directory `ttlabctl guest-image` prints)",
        );
        return None;
    };
    Some(GuestImage::open(std::path::Path::new(&dir)).expect("TTLAB_GUEST_IMAGE is an image"))
}

#[test]
fn bad_image_directories_are_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let err = GuestImage::open(dir.path()).unwrap_err();
    assert!(matches!(err, QemuError::Io { .. }), "{err}");
    assert!(err.to_string().contains("manifest.json"), "{err}");

    std::fs::write(dir.path().join("manifest.json"), "{ not json").unwrap();
    let err = GuestImage::open(dir.path()).unwrap_err();
    assert!(err.to_string().contains("does not parse"), "{err}");

    let manifest = ImageManifest {
        name: "t".into(),
        disk: "disk.qcow2".into(),
        disk_format: "qcow2".into(),
        kernel: Some("vmlinuz".into()),
        initrd: None,
        cmdline: None,
        recipe: "r".into(),
        versions: Default::default(),
        source: "test".into(),
        built_at: "2026-01-01T00:00:00Z".into(),
        build_seconds: 0,
    };
    GuestImage::write_manifest(dir.path(), &manifest).unwrap();
    let err = GuestImage::open(dir.path()).unwrap_err();
    assert!(err.to_string().contains("disk.qcow2 is missing"), "{err}");
    std::fs::write(dir.path().join("disk.qcow2"), b"").unwrap();
    let err = GuestImage::open(dir.path()).unwrap_err();
    assert!(err.to_string().contains("vmlinuz is missing"), "{err}");
    std::fs::write(dir.path().join("vmlinuz"), b"").unwrap();
    assert_eq!(GuestImage::open(dir.path()).unwrap().manifest, manifest);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_boots_its_seed_prints_on_the_console_and_powers_off_by_acpi() {
    let Some(image) = image() else {
        return;
    };
    let probe_started = Instant::now();
    let accel = probe_accel(&image, Duration::from_secs(15)).await;
    let probe_took = probe_started.elapsed();
    println!(
        "accelerator: {accel} (probed in {:.1} s)",
        probe_took.as_secs_f64()
    );
    assert!(
        probe_took < Duration::from_secs(30),
        "the probe keeps to its timeout"
    );

    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind((Ipv4Addr::new(127, 0, 0, 1), 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    // The seed is applied, and the disk made from a ConfigMap is found by its label and holds
    // the ConfigMap's key as a file, as KubeVirt presents a configMap volume.
    let user_data = b"#cloud-config\n{\"runcmd\": [[\"sh\", \"-c\", \"mkdir -p /mnt/cfg && mount -o ro $(blkid -L cfg-test) /mnt/cfg; echo config-disk-says-$(cat /mnt/cfg/greeting) > /dev/ttyS0; echo seed-$((6*7))-applied > /dev/ttyS0\"]]}\n";
    let started = Instant::now();
    let mut guest = Guest::start(GuestSpec {
        image,
        root: RootDisk::Overlay,
        dir: dir.path().join("g"),
        instance_id: "iid-test-1".into(),
        hostname: "probe-vm".into(),
        config_disks: vec![ttlab_qemu_guest::ConfigDisk {
            name: "agent".into(),
            label: "cfg-test".into(),
            files: vec![("greeting".into(), b"hello".to_vec())],
        }],
        user_data: user_data.to_vec(),
        memory_mib: 512,
        cpus: 1,
        accel,
        forward_from: SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
        forward_to: 8899,
    })
    .await
    .expect("qemu starts");
    let console = guest.console();
    let mut out = console.subscribe();
    let mut seen = String::from_utf8_lossy(&console.history()).into_owned();
    let deadline = Instant::now() + Duration::from_secs(400);
    while !seen.contains("seed-42-applied") {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, out.recv()).await {
            Ok(Ok(b)) => seen.push_str(&String::from_utf8_lossy(&b)),
            Ok(Err(tokio::sync::broadcast::error::RecvError::Lagged(_))) => {}
            other => panic!("no cloud-init output ({other:?}):\n{seen}"),
        }
    }
    assert!(
        seen.contains("config-disk-says-hello"),
        "the ConfigMap's disk, found by its label: {seen}"
    );
    println!(
        "cloud-init ran the seed's runcmd {:.1} s after qemu start",
        started.elapsed().as_secs_f64()
    );
    // Typing reaches the guest: the login prompt answers Enter.
    console
        .send(bytes::Bytes::from_static(b"\r"))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !seen.contains("probe-vm login:") {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, out.recv()).await {
            Ok(Ok(b)) => seen.push_str(&String::from_utf8_lossy(&b)),
            Ok(Err(tokio::sync::broadcast::error::RecvError::Lagged(_))) => {}
            other => panic!("no login prompt ({other:?}):\n{seen}"),
        }
    }
    let stopping = Instant::now();
    let exit = guest.shutdown(Duration::from_secs(120)).await;
    assert_eq!(
        exit,
        Exit::PoweredOff,
        "the guest accepted the ACPI power button"
    );
    println!(
        "ACPI power-off took {:.1} s",
        stopping.elapsed().as_secs_f64()
    );
}
