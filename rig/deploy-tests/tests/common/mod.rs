//! Rendering the overlays once per test binary; without kubectl a test reports it with
//! [`ttlab_testkit::skip_or_fail`] (a `SKIPPED:` line, or a failure under `CI=true`).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use ttlab_deploy_tests::{Rendered, deploy_dir, kubectl, kustomize};

/// The overlays under `deploy/overlays`.
pub const ENVIRONMENTS: [&str; 2] = ["dev", "prod"];

fn cache() -> &'static Mutex<BTreeMap<String, Rendered>> {
    static CACHE: OnceLock<Mutex<BTreeMap<String, Rendered>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(BTreeMap::new()))
}

/// `kubectl`, or `None` after [`ttlab_testkit::skip_or_fail`] said why (it panics under
/// `CI=true`).
pub fn kubectl_or_skip() -> Option<PathBuf> {
    let found = kubectl();
    if found.is_none() {
        ttlab_testkit::skip_or_fail(
            "kubectl is not on PATH, so the deploy/ manifests were not rendered \
             (install kubectl; .ci/run requires it)",
        );
    }
    found
}

/// `kubectl kustomize deploy/overlays/<env>`; `None` (test skipped) without kubectl.
pub fn render_overlay(env: &str) -> Option<Rendered> {
    render_cached(&format!("overlays/{env}"), || {
        let kubectl = kubectl_or_skip()?;
        Some(
            kustomize(&kubectl, &deploy_dir(&format!("overlays/{env}")))
                .unwrap_or_else(|e| panic!("{e}")),
        )
    })
}

/// The `env` overlay with `deploy/components/reaper-cronjob` enabled, as an operator would by
/// uncommenting its `components:` lines: a copy of the overlay in a temporary directory whose
/// paths point back into the repository.
pub fn render_with_cronjob(env: &str) -> Option<Rendered> {
    render_cached(&format!("overlays/{env}+cronjob"), || {
        let kubectl = kubectl_or_skip()?;
        let overlay = deploy_dir(&format!("overlays/{env}"));
        let dir = tempfile::tempdir().unwrap();
        let back = relative_to_root(dir.path());
        let repo_deploy = format!("{back}{}", deploy_dir("").display());
        let repo_deploy = repo_deploy.trim_end_matches('/');
        for entry in std::fs::read_dir(&overlay).unwrap() {
            let entry = entry.unwrap();
            let text = std::fs::read_to_string(entry.path()).unwrap();
            let text = if entry.file_name() == "kustomization.yaml" {
                let enabled = text
                    .replace("  - ../../base", &format!("  - {repo_deploy}/base"))
                    .replace("# components:", "components:")
                    .replace(
                        "#   - ../../components/reaper-cronjob",
                        &format!("  - {repo_deploy}/components/reaper-cronjob"),
                    );
                assert_ne!(
                    enabled, text,
                    "the overlay's commented components lines moved"
                );
                enabled
            } else {
                text
            };
            std::fs::write(dir.path().join(entry.file_name()), text).unwrap();
        }
        Some(kustomize(&kubectl, dir.path()).unwrap_or_else(|e| panic!("{e}")))
    })
}

/// `../..` from `dir` up to `/` (kustomize refuses absolute paths), so that appending an
/// absolute path without its leading `/` names it.
fn relative_to_root(dir: &Path) -> String {
    let depth = dir
        .canonicalize()
        .unwrap()
        .components()
        .filter(|c| matches!(c, Component::Normal(_)))
        .count();
    "../".repeat(depth).trim_end_matches('/').to_owned()
}

fn render_cached(
    key: &str,
    render: impl FnOnce() -> Option<Vec<serde_json::Value>>,
) -> Option<Rendered> {
    if let Some(hit) = cache().lock().unwrap().get(key) {
        return Some(hit.clone());
    }
    let rendered = Rendered::new(render()?);
    cache()
        .lock()
        .unwrap()
        .insert(key.to_owned(), rendered.clone());
    Some(rendered)
}

/// `target/<profile>/`, where cargo puts the workspace's binaries: a test runs from
/// `target/<profile>/deps/`.
pub fn binaries_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    exe.parent()
        .and_then(Path::parent)
        .expect("the test executable is in target/<profile>/deps/")
        .to_path_buf()
}

/// The built binary `name` in [`binaries_dir`], if it is there.
pub fn binary(name: &str) -> Option<PathBuf> {
    let path = binaries_dir().join(name);
    path.is_file().then_some(path)
}

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
