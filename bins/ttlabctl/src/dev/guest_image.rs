//! `ttlabctl guest-image`: the Debian 12 guest image that real qemu guests boot (kube-sim's
//! qemu backend, `ttlabctl demo --guest qemu`, the real-guest tests), built from Debian's
//! packages or taken from a cloud image the user names, and cached.
//!
//! The build runs [`BUILD_SCRIPT`] (shipped in the binary) as root: `debootstrap` of bookworm
//! from the apt mirror this machine already uses, with systemd, cloud-init (NoCloud only), the
//! cloud kernel and a serial getty, into an ext4 filesystem that is the whole disk, converted
//! to qcow2; the kernel and initrd sit beside it and are booted directly. It reaches nothing
//! but the mirror. The result goes under `$XDG_CACHE_HOME/ttlab/images/` (else
//! `~/.cache/ttlab/images/`) in a directory named by the recipe's digest, with a
//! `manifest.json` recording the package versions; it is rebuilt only when absent or when the
//! recipe changes. The image directory is printed on stdout, everything else on stderr.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use sha2::Digest as _;
use ttlab_qemu_guest::{GuestImage, ImageManifest};

/// The build recipe, run with `sh -s -- WORKDIR MIRROR SUITE SIZE`.
pub const BUILD_SCRIPT: &str = include_str!("guest_image/build.sh");

/// The Debian release the image is made of.
const SUITE: &str = "bookworm";
/// The disk's size (the filesystem fills it; cloud-init grows nothing).
const DISK_SIZE: &str = "3G";
/// The kernel command line (the console is added by the guest runner).
const CMDLINE: &str = "root=LABEL=ttlab-root rw ds=nocloud quiet";

/// Arguments of `ttlabctl guest-image`.
#[derive(Debug, Args)]
pub struct GuestImageArgs {
    /// The cache directory [default: `$XDG_CACHE_HOME/ttlab/images`, else
    /// `~/.cache/ttlab/images`].
    #[arg(long, env = "TTLAB_IMAGE_CACHE")]
    pub cache_dir: Option<PathBuf>,
    /// The Debian mirror [default: the first Debian URI in /etc/apt/sources.list*].
    #[arg(long, env = "TTLAB_DEBIAN_MIRROR")]
    pub mirror: Option<String>,
    /// Take this cloud image (qcow2 or raw, with its own boot loader and cloud-init: Debian
    /// or Ubuntu genericcloud) instead of building one.
    #[arg(long)]
    pub from: Option<PathBuf>,
    /// Build again even when a cached image of the same recipe exists.
    #[arg(long)]
    pub rebuild: bool,
}

/// Runs `ttlabctl guest-image`.
pub async fn run(args: GuestImageArgs) -> Result<()> {
    let cache = match &args.cache_dir {
        Some(d) => d.clone(),
        None => default_cache_dir()?,
    };
    std::fs::create_dir_all(&cache)
        .with_context(|| format!("cannot create the image cache {}", cache.display()))?;
    let dir = match &args.from {
        Some(from) => import(&cache, from, args.rebuild).await?,
        None => {
            let mirror = match &args.mirror {
                Some(m) => m.trim_end_matches('/').to_owned(),
                None => apt_mirror(Path::new("/etc/apt"))
                    .unwrap_or_else(|| "http://deb.debian.org/debian".to_owned()),
            };
            build(&cache, &mirror, args.rebuild).await?
        }
    };
    println!("{}", dir.display());
    Ok(())
}

/// `$XDG_CACHE_HOME/ttlab/images`, else `$HOME/.cache/ttlab/images`.
pub fn default_cache_dir() -> Result<PathBuf> {
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|x| !x.is_empty()) {
        return Ok(PathBuf::from(x).join("ttlab/images"));
    }
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .context("neither XDG_CACHE_HOME nor HOME is set: pass --cache-dir")?;
    Ok(PathBuf::from(home).join(".cache/ttlab/images"))
}

/// The digest of everything the build depends on.
pub fn recipe_digest(mirror: &str) -> String {
    let mut h = sha2::Sha256::new();
    for part in [BUILD_SCRIPT, SUITE, DISK_SIZE, CMDLINE, mirror] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    hex(&h.finalize()[..8])
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The cached image of the current recipe, if it is there and whole.
pub fn cached(cache: &Path, mirror: &str) -> Option<GuestImage> {
    let recipe = recipe_digest(mirror);
    GuestImage::open(&cache.join(format!("debian-12-{recipe}")))
        .ok()
        .filter(|i| i.manifest.recipe == recipe)
}

/// The first `http(s)` Debian URI of the apt sources under `etc_apt` (one-line `deb` lines
/// or deb822 `URIs:` fields), without its trailing slash.
pub fn apt_mirror(etc_apt: &Path) -> Option<String> {
    let mut files = vec![etc_apt.join("sources.list")];
    if let Ok(rd) = std::fs::read_dir(etc_apt.join("sources.list.d")) {
        let mut more: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
        more.sort();
        files.extend(more);
    }
    for f in files {
        let Ok(text) = std::fs::read_to_string(&f) else {
            continue;
        };
        for line in text.lines().map(str::trim) {
            let uris: Vec<&str> = if let Some(rest) = line.strip_prefix("URIs:") {
                rest.split_whitespace().collect()
            } else if let Some(rest) = line.strip_prefix("deb ") {
                rest.split_whitespace()
                    .filter(|w| !w.starts_with('['))
                    .take(1)
                    .collect()
            } else {
                continue;
            };
            if let Some(u) = uris.into_iter().find(|u| {
                (u.starts_with("http://") || u.starts_with("https://"))
                    && u.trim_end_matches('/').ends_with("/debian")
            }) {
                return Some(u.trim_end_matches('/').to_owned());
            }
        }
    }
    None
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}

async fn build(cache: &Path, mirror: &str, rebuild: bool) -> Result<PathBuf> {
    let recipe = recipe_digest(mirror);
    let dir = cache.join(format!("debian-12-{recipe}"));
    if !rebuild && let Some(image) = cached(cache, mirror) {
        eprintln!(
            "ttlabctl guest-image: cached: {} (built {} in {} s; {})",
            dir.display(),
            image.manifest.built_at,
            image.manifest.build_seconds,
            versions_line(&image.manifest.versions)
        );
        return Ok(dir);
    }
    eprintln!(
        "ttlabctl guest-image: building a Debian 12 guest image (recipe {recipe}) from {mirror}.\n\
         It needs: root (debootstrap, chroot and mounts), debootstrap, e2fsprogs (mkfs.ext4 -d) \
         and qemu-img, and the mirror reachable; it downloads about 150 MB of packages and \
         takes about 3 minutes on two cores (less with the package cache of an earlier build)."
    );
    let mut missing = Vec::new();
    if !rustix::process::geteuid().is_root() {
        missing.push("root (run it with sudo, or as root)".to_owned());
    }
    for (tool, package) in [
        ("debootstrap", "debootstrap"),
        ("mkfs.ext4", "e2fsprogs"),
        ("qemu-img", "qemu-utils"),
        ("chroot", "coreutils"),
    ] {
        if !on_path(tool) && !Path::new("/usr/sbin").join(tool).is_file() {
            missing.push(format!("{tool} (Debian: apt-get install {package})"));
        }
    }
    if !missing.is_empty() {
        bail!(
            "cannot build the guest image; missing: {}",
            missing.join(", ")
        );
    }
    let work = cache.join(format!(".build-debian-12-{recipe}"));
    std::fs::create_dir_all(&work).with_context(|| format!("cannot create {}", work.display()))?;
    let started = Instant::now();
    let mut child = tokio::process::Command::new("sh")
        .args(["-s", "--"])
        .arg(&work)
        .args([mirror, SUITE, DISK_SIZE])
        .env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("cannot run sh")?;
    {
        use tokio::io::AsyncWriteExt as _;
        let mut stdin = child.stdin.take().context("no stdin")?;
        stdin.write_all(BUILD_SCRIPT.as_bytes()).await?;
    }
    let status = child.wait().await?;
    if !status.success() {
        bail!(
            "the image build failed ({status}); its log: {}",
            work.join("debootstrap.log").display()
        );
    }
    let versions = std::fs::read_to_string(work.join("versions"))
        .context("the build wrote no versions")?
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(a, b)| (a.to_owned(), b.to_owned()))
        .collect::<BTreeMap<_, _>>();
    let manifest = ImageManifest {
        name: "debian-12".into(),
        disk: "disk.qcow2".into(),
        disk_format: "qcow2".into(),
        kernel: Some("vmlinuz".into()),
        initrd: Some("initrd.img".into()),
        cmdline: Some(CMDLINE.into()),
        recipe: recipe.clone(),
        versions,
        source: format!("debootstrap {SUITE} from {mirror}"),
        built_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        build_seconds: started.elapsed().as_secs(),
    };
    let out = cache.join(format!(".new-debian-12-{recipe}"));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out)?;
    for f in ["disk.qcow2", "vmlinuz", "initrd.img"] {
        std::fs::rename(work.join(f), out.join(f))
            .with_context(|| format!("moving {f} into {}", out.display()))?;
    }
    GuestImage::write_manifest(&out, &manifest)?;
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&out, &dir)?;
    eprintln!(
        "ttlabctl guest-image: built {} in {} s ({})",
        dir.display(),
        manifest.build_seconds,
        versions_line(&manifest.versions)
    );
    Ok(dir)
}

fn versions_line(v: &BTreeMap<String, String>) -> String {
    v.iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Converts a cloud image into the cache (qcow2, booted by its own boot loader).
async fn import(cache: &Path, from: &Path, rebuild: bool) -> Result<PathBuf> {
    let meta = std::fs::metadata(from)
        .with_context(|| format!("cannot read the cloud image {}", from.display()))?;
    if !meta.is_file() {
        bail!("{} is not a file", from.display());
    }
    let canonical = std::fs::canonicalize(from)?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|m| m.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut h = sha2::Sha256::new();
    h.update(canonical.to_string_lossy().as_bytes());
    h.update(meta.len().to_le_bytes());
    h.update(mtime.to_le_bytes());
    let recipe = hex(&h.finalize()[..8]);
    let name = from
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "cloud-image".into());
    let dir = cache.join(format!("from-{recipe}"));
    if !rebuild
        && let Ok(image) = GuestImage::open(&dir)
        && image.manifest.recipe == recipe
    {
        eprintln!(
            "ttlabctl guest-image: cached: {} (from {})",
            dir.display(),
            from.display()
        );
        return Ok(dir);
    }
    eprintln!(
        "ttlabctl guest-image: converting {} to qcow2 (needs qemu-img; seconds to a minute)",
        from.display()
    );
    let started = Instant::now();
    let info = tokio::process::Command::new("qemu-img")
        .args(["info", "--output=json"])
        .arg(from)
        .output()
        .await
        .context("cannot run qemu-img (Debian: apt-get install qemu-utils)")?;
    if !info.status.success() {
        bail!(
            "{} is not a disk image qemu-img reads: {}",
            from.display(),
            String::from_utf8_lossy(&info.stderr).trim()
        );
    }
    let info: serde_json::Value = serde_json::from_slice(&info.stdout)?;
    let format = info["format"].as_str().unwrap_or("raw").to_owned();
    if !matches!(format.as_str(), "qcow2" | "raw") {
        bail!(
            "{} is a {format} image; give a qcow2 or raw cloud image",
            from.display()
        );
    }
    let out = cache.join(format!(".new-from-{recipe}"));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out)?;
    let status = tokio::process::Command::new("qemu-img")
        .args(["convert", "-q", "-f", &format, "-O", "qcow2"])
        .arg(from)
        .arg(out.join("disk.qcow2"))
        .status()
        .await?;
    if !status.success() {
        bail!("qemu-img convert failed ({status})");
    }
    let manifest = ImageManifest {
        name,
        disk: "disk.qcow2".into(),
        disk_format: "qcow2".into(),
        kernel: None,
        initrd: None,
        cmdline: None,
        recipe,
        versions: BTreeMap::new(),
        source: canonical.display().to_string(),
        built_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        build_seconds: started.elapsed().as_secs(),
    };
    GuestImage::write_manifest(&out, &manifest)?;
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&out, &dir)?;
    eprintln!("ttlabctl guest-image: ready: {}", dir.display());
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mirror_is_read_from_one_line_and_deb822_sources() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sources.list.d")).unwrap();
        assert_eq!(apt_mirror(dir.path()), None);
        std::fs::write(
            dir.path().join("sources.list.d/debian.sources"),
            "Types: deb\n# a comment\nURIs: http://mirror.example/debian/\nSuites: bookworm\n",
        )
        .unwrap();
        assert_eq!(
            apt_mirror(dir.path()).as_deref(),
            Some("http://mirror.example/debian")
        );
        std::fs::write(
            dir.path().join("sources.list"),
            "deb [arch=amd64] https://deb.example.org/debian bookworm main\n",
        )
        .unwrap();
        assert_eq!(
            apt_mirror(dir.path()).as_deref(),
            Some("https://deb.example.org/debian")
        );
    }

    #[test]
    fn the_recipe_digest_follows_the_mirror() {
        assert_eq!(
            recipe_digest("http://a/debian"),
            recipe_digest("http://a/debian")
        );
        assert_ne!(
            recipe_digest("http://a/debian"),
            recipe_digest("http://b/debian")
        );
        assert_eq!(recipe_digest("http://a/debian").len(), 16);
    }
}
