//! The production image carries only what production runs: the binaries it ships
//! (`ttlab-server`, `ttlab-reaper`, and `ttlabctl` built as the Dockerfile builds it, without
//! its default `dev-tools` feature) link no crate of the test rig (`rig/`: kube-sim, the
//! simulated KubeVirt, the guests, the control plane's harness, the test kit), not `tempfile`,
//! and not the store's test support (its `test-support` feature: a test database and throwaway
//! PostgreSQL clusters).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// The crates `package` links in a build with `args` (normal dependencies only, as `cargo
/// build` resolves them), each with the features it is built with, from `cargo tree`.
fn linked(package: &str, args: &[&str]) -> BTreeMap<String, Vec<String>> {
    let out = cargo()
        .args([
            "tree",
            "--offline",
            "--locked",
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .args(["--format", "{p}|{f}", "-p", package])
        .args(args)
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut crates = BTreeMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some((package, features)) = line.split_once('|') else {
            continue;
        };
        let Some(name) = package.split_whitespace().next() else {
            continue;
        };
        let features = features.trim_end_matches("(*)").trim();
        crates.insert(
            name.to_owned(),
            features
                .split(',')
                .filter(|f| !f.is_empty())
                .map(str::to_owned)
                .collect(),
        );
    }
    crates
}

/// The workspace's packages under `rig/`, from `cargo metadata`: a crate added to the rig is
/// covered without naming it here.
fn rig_crates() -> Vec<String> {
    let out = cargo()
        .args([
            "metadata",
            "--offline",
            "--locked",
            "--no-deps",
            "--format-version",
            "1",
        ])
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let rig = Path::new(metadata["workspace_root"].as_str().expect("a root")).join("rig");
    metadata["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .filter(|p| Path::new(p["manifest_path"].as_str().expect("a path")).starts_with(&rig))
        .map(|p| p["name"].as_str().expect("a name").to_owned())
        .collect()
}

fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(env!("CARGO_MANIFEST_DIR"));
    cmd
}

/// What a shipped build must not link besides the rig, with why.
const NEVER_SHIPPED: &[(&str, &str)] = &[(
    "tempfile",
    "temporary files and directories are for tests and the developer tools",
)];

/// A build that ships.
struct Shipped {
    /// The package.
    package: &'static str,
    /// How the image builds it.
    args: &'static [&'static str],
    /// What this build alone must not link besides [`NEVER_SHIPPED`], with why (the server,
    /// say, does serve HTTP; production ttlabctl need not).
    also_never: &'static [(&'static str, &'static str)],
}

/// The store's feature that compiles its test database and throwaway clusters.
const STORE_TEST_SUPPORT: &str = "test-support";

#[test]
fn no_shipped_binary_links_the_rig_or_test_support() {
    let rig = rig_crates();
    for expected in [
        "ttlab-kube-sim",
        "ttlab-kubevirt-sim",
        "ttlab-sim-guest",
        "ttlab-qemu-guest",
        "ttlab-envtest",
        "ttlab-testkit",
        "ttlab-deploy-tests",
    ] {
        assert!(
            rig.iter().any(|r| r == expected),
            "{expected} is a rig crate ({rig:?})"
        );
    }
    let shipped = [
        Shipped {
            package: "ttlab-server-bin",
            args: &[],
            also_never: &[],
        },
        Shipped {
            package: "ttlab-reaper-bin",
            args: &[],
            also_never: &[],
        },
        Shipped {
            package: "ttlab-ttlabctl-bin",
            args: &["--no-default-features"],
            also_never: &[],
        },
    ];
    for Shipped {
        package,
        args,
        also_never,
    } in shipped
    {
        let deps = linked(package, args);
        let store = deps
            .get("ttlab-store")
            .unwrap_or_else(|| panic!("{package}: the tree was read ({deps:?})"));
        assert!(
            !store.iter().any(|f| f == STORE_TEST_SUPPORT),
            "{package} {args:?} builds ttlab-store with its {STORE_TEST_SUPPORT} feature"
        );
        for r in &rig {
            assert!(
                !deps.contains_key(r),
                "{package} {args:?} links {r}, a crate of the test rig"
            );
        }
        for (name, why) in NEVER_SHIPPED.iter().chain(also_never) {
            assert!(
                !deps.contains_key(*name),
                "{package} {args:?} links {name}: {why}"
            );
        }
    }
    // The developer build of ttlabctl (the default) has them: the checks above can fail.
    let dev = linked("ttlab-ttlabctl-bin", &[]);
    assert!(dev.contains_key("ttlab-kube-sim"), "{dev:?}");
    assert!(dev.contains_key("ttlab-testkit"), "{dev:?}");
    assert!(dev.contains_key("tempfile"), "{dev:?}");
    assert!(
        dev["ttlab-store"].iter().any(|f| f == STORE_TEST_SUPPORT),
        "{:?}",
        dev["ttlab-store"]
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

#[test]
fn production_ttlabctl_links_no_http_server() {
    // `ttlabctl token` mints with ttlab-auth alone, and `ttlabctl class` is an HTTP client:
    // no server framework, not the server, not hyper's server half.
    let deps = linked("ttlab-ttlabctl-bin", &["--no-default-features"]);
    assert!(
        deps.contains_key("ttlab-auth"),
        "the tree was read ({deps:?})"
    );
    for server_part in ["axum", "ttlab-api"] {
        assert!(
            !deps.contains_key(server_part),
            "production ttlabctl links {server_part}"
        );
    }
    if let Some(hyper) = deps.get("hyper") {
        assert!(
            !hyper.iter().any(|f| f == "server"),
            "production ttlabctl builds hyper with its server feature ({hyper:?})"
        );
    }
    // The server does link them: the checks above can fail.
    let server = linked("ttlab-server-bin", &[]);
    for server_part in ["axum", "ttlab-api"] {
        assert!(
            server.contains_key(server_part),
            "ttlab-server should link {server_part}"
        );
    }
    assert!(
        server["hyper"].iter().any(|f| f == "server"),
        "{:?}",
        server["hyper"]
    );
}
