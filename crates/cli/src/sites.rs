//! The sites group: `--sites` (`TTLAB_SITES`), the file naming every place lab VMs run, or
//! without it today's one cluster and namespace as the one site `default`; and the client of
//! one site.

use std::path::PathBuf;

use ttlab_cluster::{ClusterError, ClusterSettings, KubeCluster};
use ttlab_site::{Connection, Site, SitesConfig};

use crate::ClusterArgs;

/// Where the sites are described.
#[derive(Debug, Clone, clap::Args)]
pub struct SitesArgs {
    /// The sites file (YAML, see docs/operator-guide.md, "Sites"). Unset: one site named
    /// `default`, from --namespace, --kubeconfig and the VM limit.
    #[arg(long, env = "TTLAB_SITES", value_name = "PATH")]
    pub sites: Option<PathBuf>,
}

/// Why the sites could not be loaded: the file could not be read, or it (or, without it, the
/// single site's settings) is invalid. The message names the file, the site and the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadSitesError(pub String);

impl std::fmt::Display for LoadSitesError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LoadSitesError {}

impl SitesArgs {
    /// Reads and validates the sites file when one is named; else the one site `default`
    /// of `cluster`'s namespace and kubeconfig with `vm_limit` places.
    pub fn load(
        &self,
        cluster: &ClusterArgs,
        vm_limit: u32,
    ) -> Result<SitesConfig, LoadSitesError> {
        match &self.sites {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    LoadSitesError(format!("the sites file {}: {e}", path.display()))
                })?;
                SitesConfig::parse(&text)
                    .map_err(|e| LoadSitesError(format!("the sites file {}: {e}", path.display())))
            }
            None => SitesConfig::single(&cluster.namespace, cluster.kubeconfig.clone(), vm_limit)
                .map_err(|e| LoadSitesError(e.to_string())),
        }
    }
}

/// The client settings of one site: its namespace, `cluster`'s calls in flight (at least
/// one) and `user_agent`.
pub fn site_settings(site: &Site, cluster: &ClusterArgs, user_agent: &str) -> ClusterSettings {
    ClusterSettings {
        max_in_flight: cluster.kube_concurrency.max(1),
        user_agent: user_agent.to_owned(),
        ..ClusterSettings::in_namespace(site.namespace.as_str())
    }
}

/// Builds one site's Kubernetes client: from its kubeconfig, the pod's service account
/// (`in_cluster`), or as the client infers it (the `default` site without a kubeconfig).
/// An error is the site's alone: the caller reports it for that site and goes on with the
/// others. Must run inside a Tokio runtime.
pub async fn connect_site(
    site: &Site,
    cluster: &ClusterArgs,
    user_agent: &str,
) -> Result<KubeCluster, ClusterError> {
    let settings = site_settings(site, cluster, user_agent);
    match &site.connection {
        Connection::Kubeconfig(path) => crate::cluster::client(Some(path), settings).await,
        Connection::InCluster => KubeCluster::in_cluster(settings),
        Connection::Inferred => crate::cluster::client(None, settings).await,
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    #[derive(Debug, clap::Parser)]
    struct Args {
        #[command(flatten)]
        cluster: ClusterArgs,
        #[command(flatten)]
        sites: SitesArgs,
    }

    #[test]
    fn without_a_sites_file_the_one_cluster_is_the_site_default() {
        let args = Args::try_parse_from(["x", "--namespace", "labs"]).unwrap();
        let config = args.sites.load(&args.cluster, 8).unwrap();
        let [site] = config.sites() else {
            panic!("{config:?}")
        };
        assert_eq!(site.name.as_str(), "default");
        assert_eq!(site.namespace.as_str(), "labs");
        assert_eq!(site.vm_limit.get(), 8);
        assert_eq!(site.connection, Connection::Inferred);
    }

    #[test]
    fn a_sites_file_is_read_and_its_errors_name_the_file_the_site_and_the_field() {
        let dir = std::env::temp_dir().join(format!("ttlab-cli-sites-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.yaml");
        std::fs::write(
            &good,
            "sites:\n  - {name: a, in_cluster: true, namespace: labs-a, vm_limit: 4}\n  \
             - {name: b, kubeconfig: /etc/b.kubeconfig, namespace: labs-b, vm_limit: 2}\n",
        )
        .unwrap();
        let args = Args::try_parse_from(["x", "--sites", good.to_str().unwrap()]).unwrap();
        let config = args.sites.load(&args.cluster, 8).unwrap();
        let names: Vec<&str> = config.sites().iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);

        let bad = dir.join("bad.yaml");
        std::fs::write(
            &bad,
            "sites:\n  - {name: a, in_cluster: true, namespace: a, vm_limit: 0}\n",
        )
        .unwrap();
        let args = Args::try_parse_from(["x", "--sites", bad.to_str().unwrap()]).unwrap();
        let err = args.sites.load(&args.cluster, 8).unwrap_err().to_string();
        assert!(
            err.contains("bad.yaml") && err.contains("site `a`, field `vm_limit`"),
            "{err}"
        );

        let missing = dir.join("missing.yaml");
        let args = Args::try_parse_from(["x", "--sites", missing.to_str().unwrap()]).unwrap();
        let err = args.sites.load(&args.cluster, 8).unwrap_err().to_string();
        assert!(err.contains("missing.yaml"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_site_whose_kubeconfig_cannot_be_read_is_an_error_naming_it() {
        let dir = std::env::temp_dir().join(format!("ttlab-cli-sites-k-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("sites.yaml");
        std::fs::write(
            &file,
            "sites:\n  - {name: b, kubeconfig: /nonexistent/b.kubeconfig, namespace: labs, vm_limit: 2}\n",
        )
        .unwrap();
        let args = Args::try_parse_from(["x", "--sites", file.to_str().unwrap()]).unwrap();
        let config = args.sites.load(&args.cluster, 8).unwrap();
        let err = connect_site(&config.sites()[0], &args.cluster, "a/1")
            .await
            .unwrap_err();
        assert!(
            matches!(&err, ClusterError::Config { message } if message.contains("/nonexistent/b.kubeconfig")),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
