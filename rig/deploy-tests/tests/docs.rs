//! The docs that restate the code are checked against it: the API reference is generated from
//! the server's OpenAPI document, and the configuration table lists exactly the settings the
//! binaries read (and the ConfigMap sets only settings something reads).
//!
//! `TTLAB_BLESS_DOCS=1 cargo test -p ttlab-deploy-tests --test docs` rewrites docs/api.md.

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use ttlab_deploy_tests::{openapi_markdown, repo_root};

use common::{ENVIRONMENTS, render_overlay};

#[test]
fn the_api_reference_is_generated_from_the_current_openapi_document() {
    let doc = ttlab_api::routes::openapi::document();
    let markdown = openapi_markdown(&doc);
    let path = repo_root().join("docs/api.md");
    if std::env::var_os("TTLAB_BLESS_DOCS").is_some_and(|v| v == "1") {
        std::fs::write(&path, &markdown).unwrap();
        return;
    }
    let current = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        current == markdown,
        "docs/api.md is stale: regenerate it with\n  TTLAB_BLESS_DOCS=1 cargo test -p ttlab-deploy-tests --test docs"
    );
    // Every path of the document has a section.
    for path in doc["paths"].as_object().unwrap().keys() {
        assert!(markdown.contains(&format!(" {path}`")), "{path}");
    }
}

/// The Rust sources under `dir`.
fn sources(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(std::fs::read_to_string(&path).unwrap());
            }
        }
    }
    out
}

/// Every `env = "NAME"` in `text`.
fn env_names(text: &str) -> impl Iterator<Item = String> + '_ {
    text.split("env = \"")
        .skip(1)
        .filter_map(|piece| piece.split('"').next())
        .map(str::to_owned)
}

/// The flag groups of `crates/cli` (`ttlab_cli::DatabaseArgs`, …) and the file declaring each.
const SHARED_GROUPS: [(&str, &str); 3] = [
    ("DatabaseArgs", "crates/cli/src/database.rs"),
    ("ClusterArgs", "crates/cli/src/cluster.rs"),
    ("SitesArgs", "crates/cli/src/sites.rs"),
];

/// Every `env = "NAME"` a binary reads: those in its own sources under `dir`, and those of
/// each shared flag group its sources name.
fn env_settings(dir: &Path) -> BTreeSet<String> {
    let texts = sources(dir);
    let mut out: BTreeSet<String> = texts.iter().flat_map(|t| env_names(t)).collect();
    for (group, file) in SHARED_GROUPS {
        if texts.iter().any(|t| t.contains(group)) {
            let text = std::fs::read_to_string(repo_root().join(file)).unwrap();
            out.extend(env_names(&text));
        }
    }
    out
}

/// The backquoted upper-case names in the first column of the doc's tables, per section
/// (`## Both binaries`, `## Server only …`, `## Reaper only …`).
fn documented(section_prefix: &str) -> BTreeSet<String> {
    let text = std::fs::read_to_string(repo_root().join("docs/configuration.md")).unwrap();
    let section = text
        .split("\n## ")
        .find(|s| s.starts_with(section_prefix))
        .unwrap_or_else(|| panic!("no section {section_prefix}"));
    section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .filter(|name| name.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_configuration_table_lists_exactly_what_the_binaries_read() {
    let root = repo_root();
    let server = env_settings(&root.join("bins/server/src"));
    let reaper = env_settings(&root.join("bins/reaper/src"));
    assert!(!server.is_empty() && !reaper.is_empty());
    let both = documented("Both binaries");
    let server_doc: BTreeSet<_> = both.union(&documented("Server only")).cloned().collect();
    let reaper_doc: BTreeSet<_> = both.union(&documented("Reaper only")).cloned().collect();
    // Read by the process without a flag (standard variables).
    let implicit = BTreeSet::from(["RUST_LOG".to_owned(), "KUBECONFIG".to_owned()]);

    for (binary, read, doc) in [
        ("ttlab-server", &server, &server_doc),
        ("ttlab-reaper", &reaper, &reaper_doc),
    ] {
        let undocumented: Vec<_> = read.difference(doc).collect();
        assert!(
            undocumented.is_empty(),
            "{binary} reads {undocumented:?}, missing from docs/configuration.md"
        );
        let unread: Vec<_> = doc
            .difference(read)
            .filter(|n| !implicit.contains(*n))
            .collect();
        assert!(
            unread.is_empty(),
            "docs/configuration.md lists {unread:?} for {binary}, which does not read them"
        );
    }

    // The ConfigMap sets nothing that nobody reads.
    for env in ENVIRONMENTS {
        let Some(rendered) = render_overlay(env) else {
            return;
        };
        let cm = rendered.generated_config_map("ttlab-config");
        for key in cm["data"].as_object().unwrap().keys() {
            assert!(
                server.contains(key) || reaper.contains(key) || implicit.contains(key),
                "{env}: the ConfigMap sets {key}, which neither binary reads"
            );
        }
    }
}
