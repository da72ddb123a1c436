//! The production image carries only what production runs: the binaries it ships
//! (`ttlab-server`, `ttlab-reaper`, and `ttlabctl` built as the Dockerfile builds it, without
//! its default `dev-tools` feature) do not link kube-sim, the simulator that tests, the demo,
//! the benchmarks and the soak use.

use std::process::Command;

/// The workspace packages `package` links in a build with `args`, from `cargo tree`.
fn linked(package: &str, args: &[&str]) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "--locked",
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .args(["--format", "{p}", "-p", package])
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

#[test]
fn no_shipped_binary_links_the_simulator() {
    let shipped = [
        ("ttlab-server-bin", &[][..]),
        ("ttlab-reaper-bin", &[][..]),
        ("ttlab-ttlabctl-bin", &["--no-default-features"][..]),
    ];
    for (package, args) in shipped {
        let deps = linked(package, args);
        assert!(
            deps.iter().any(|d| d == "ttlab-store"),
            "{package}: the tree was read ({deps:?})"
        );
        assert!(
            !deps.iter().any(|d| d == "ttlab-kube-sim"),
            "{package} {args:?} links ttlab-kube-sim"
        );
    }
    // The developer build of ttlabctl (the default) has it: the check above can fail.
    assert!(
        linked("ttlab-ttlabctl-bin", &[])
            .iter()
            .any(|d| d == "ttlab-kube-sim")
    );
}

#[test]
fn the_dockerfile_builds_ttlabctl_without_its_dev_tools() {
    let dockerfile =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../Dockerfile"))
            .expect("the Dockerfile");
    let line = dockerfile
        .lines()
        .find(|l| l.contains("-p ttlab-ttlabctl-bin"))
        .expect("the Dockerfile builds ttlabctl");
    assert!(line.contains("--no-default-features"), "{line}");
}
