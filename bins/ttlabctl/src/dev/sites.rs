//! The sites of the tools that run several kube-sim clusters (`demo --sites`, `soak --sites`):
//! their names and the sites file (`TTLAB_SITES`) the server and the reaper read.

use std::fmt::Write as _;
use std::path::Path;

/// The names of `n` sites: `default` alone, else `site-a`, `site-b`, ….
pub(crate) fn site_names(n: u8) -> Vec<String> {
    if n <= 1 {
        return vec!["default".to_owned()];
    }
    (0..n)
        .map(|i| format!("site-{}", char::from(b'a' + i)))
        .collect()
}

/// A sites file listing `sites` — each a name and the kubeconfig of its API server — all with
/// `namespace` and `vm_limit` places; the agent path is the default for a kubeconfig
/// (portforward, through the site's API server). `written_by` names the tool in a comment.
pub(crate) fn sites_yaml<P: AsRef<Path>>(
    written_by: &str,
    sites: &[(String, P)],
    namespace: &str,
    vm_limit: usize,
) -> String {
    let mut text = format!("# Written by {written_by}: one kube-sim per site.\nsites:\n");
    for (name, kubeconfig) in sites {
        // A JSON string is a YAML string: any path is quoted safely.
        let path = serde_json::Value::String(kubeconfig.as_ref().display().to_string());
        let _ = write!(
            text,
            "  - name: {name}\n    kubeconfig: {path}\n    namespace: {namespace}\n    vm_limit: {vm_limit}\n"
        );
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_site_is_the_default_and_more_are_lettered() {
        assert_eq!(site_names(1), ["default"]);
        assert_eq!(site_names(3), ["site-a", "site-b", "site-c"]);
    }

    #[test]
    fn the_sites_file_parses_back_with_every_site() {
        let text = sites_yaml(
            "a test",
            &[
                ("site-a".to_owned(), "/tmp/a b/kubeconfig"),
                ("site-b".to_owned(), "/tmp/\"b\"/kubeconfig"),
            ],
            "ttlab-vms",
            3,
        );
        let config = ttlab_site::SitesConfig::parse(&text).expect("a valid sites file");
        let names: Vec<String> = config.sites().iter().map(|s| s.name.to_string()).collect();
        assert_eq!(names, ["site-a", "site-b"]);
        assert!(config.sites().iter().all(|s| s.vm_limit.get() == 3));
    }
}
