//! Finding `ttlab-server`, `ttlab-reaper` and `ttlab-agent` for the demo and the benchmarks:
//! the binaries next to the running `ttlabctl`. When ttlabctl runs under `cargo run` (cargo
//! sets `CARGO` for the programs it runs, after releasing its build lock), they are built
//! first with the same cargo and profile (a no-op when they are up to date), so
//! `cargo run --bin ttlabctl -- demo` works on a fresh clone and never runs stale binaries.
//! A binary that answers `--help` with a failure is a placeholder of a component not built
//! yet, and counts as absent.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::Context as _;

/// The server binary's name.
pub(crate) const SERVER: &str = "ttlab-server";
/// The reaper binary's name.
pub(crate) const REAPER: &str = "ttlab-reaper";
/// The guest agent binary's name.
pub(crate) const AGENT: &str = "ttlab-agent";

/// What was found.
#[derive(Debug, Clone)]
pub(crate) struct Binaries {
    /// The directory searched (the one holding this ttlabctl).
    pub dir: PathBuf,
    /// `ttlab-server`, if usable.
    pub server: Option<PathBuf>,
    /// `ttlab-reaper`, if usable.
    pub reaper: Option<PathBuf>,
    /// `ttlab-agent`, if present.
    pub agent: Option<PathBuf>,
}

/// Finds the sibling binaries, building `wanted` ones that are missing when running under
/// cargo. Progress goes to stderr.
pub(crate) async fn locate(wanted: &[&str]) -> anyhow::Result<Binaries> {
    let exe = std::env::current_exe().context("finding the ttlabctl executable")?;
    let dir = exe
        .parent()
        .context("the ttlabctl executable has no parent directory")?
        .to_path_buf();
    let missing: Vec<&str> = wanted
        .iter()
        .copied()
        .filter(|name| !dir.join(name).is_file())
        .collect();
    match std::env::var_os("CARGO") {
        // Under cargo, build them every time: a no-op when they are up to date, and the demo
        // never runs a server older than the checkout.
        Some(cargo) => {
            if let Err(e) = build(Path::new(&cargo), &dir, wanted).await {
                if missing.is_empty() {
                    eprintln!("ttlabctl: {e:#}; running the binaries already built");
                } else {
                    return Err(e);
                }
            }
        }
        None if !missing.is_empty() => eprintln!(
            "ttlabctl: {} not found next to ttlabctl in {}; build them with \
             `cargo build --bin ttlab-server --bin ttlab-reaper --bin ttlab-agent` \
             (or run the demo with `cargo run --bin ttlabctl -- demo`, which does it)",
            missing.join(", "),
            dir.display()
        ),
        None => {}
    }
    Ok(Binaries {
        server: usable(&dir, SERVER).await,
        reaper: usable(&dir, REAPER).await,
        agent: Some(dir.join(AGENT)).filter(|p| p.is_file()),
        dir,
    })
}

/// The cargo profile whose output directory is `dir` (`target/debug` → dev).
fn profile_args(dir: &Path) -> Vec<String> {
    match dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => Vec::new(),
        Some("release") => vec!["--release".into()],
        Some(other) => vec!["--profile".into(), other.into()],
    }
}

async fn build(cargo: &Path, dir: &Path, names: &[&str]) -> anyhow::Result<()> {
    let mut args = vec!["build".to_owned()];
    // Package and binary: `-p` finds the package from any directory of the workspace.
    for n in names {
        args.push("-p".into());
        args.push(format!("{n}-bin"));
    }
    for n in names {
        args.push("--bin".into());
        args.push((*n).to_owned());
    }
    args.extend(profile_args(dir));
    eprintln!(
        "ttlabctl: building the binaries it runs: cargo {} (a few minutes on a fresh clone, \
         a moment when they are up to date)",
        args.join(" ")
    );
    let mut cmd = tokio::process::Command::new(cargo);
    cmd.args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit());
    // Build into the directory this ttlabctl came from (`<target>/<profile>`).
    if let Some(target) = dir.parent() {
        cmd.env("CARGO_TARGET_DIR", target);
    }
    if let Ok(manifest) = std::env::var("CARGO_MANIFEST_DIR") {
        cmd.current_dir(manifest);
    } else {
        cmd.current_dir(env!("CARGO_MANIFEST_DIR"));
    }
    let status = cmd
        .status()
        .await
        .with_context(|| format!("running {}", cargo.display()))?;
    if !status.success() {
        anyhow::bail!("cargo {} failed ({status})", args.join(" "));
    }
    Ok(())
}

/// `dir/name` if it exists and answers `--help` successfully (a placeholder of a component
/// not built yet exits with a failure).
async fn usable(dir: &Path, name: &str) -> Option<PathBuf> {
    let path = dir.join(name);
    if !path.is_file() {
        return None;
    }
    let out = tokio::process::Command::new(&path)
        .arg("--help")
        .stdin(Stdio::null())
        .output()
        .await
        .ok()?;
    if out.status.success() {
        Some(path)
    } else {
        let said = String::from_utf8_lossy(&out.stderr);
        eprintln!(
            "ttlabctl: {} is not usable: {}",
            path.display(),
            said.lines()
                .next()
                .unwrap_or("it exits with a failure")
                .trim()
        );
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_profile_follows_the_output_directory() {
        assert!(profile_args(Path::new("/w/target/debug")).is_empty());
        assert_eq!(
            profile_args(Path::new("/w/target/release")),
            vec!["--release"]
        );
        assert_eq!(
            profile_args(Path::new("/w/target/bench")),
            vec!["--profile", "bench"]
        );
    }
}
