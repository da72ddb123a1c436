//! The cluster group: the namespace, the kubeconfig and how many API calls may be in flight.

use std::path::PathBuf;

use ttlab_cluster::{ClusterError, ClusterSettings, KubeCluster};

/// Which cluster and namespace to work in, and how hard to press the API server.
#[derive(Debug, Clone, clap::Args)]
pub struct ClusterArgs {
    /// The namespace of the VMs.
    #[arg(long, env = "TTLAB_NAMESPACE", default_value = "ttlab-vms")]
    pub namespace: String,
    /// Kubeconfig file (in-cluster service account, or ~/.kube/config, when absent).
    #[arg(long, env = "KUBECONFIG", value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
    /// Most Kubernetes API calls in flight at once.
    #[arg(long, env = "TTLAB_KUBE_CONCURRENCY", default_value_t = 16)]
    pub kube_concurrency: usize,
}

impl ClusterArgs {
    /// The client settings: this namespace, this many calls in flight (at least one), and
    /// `user_agent` as the program's name (`ttlab-server/0.1.0`).
    pub fn settings(&self, user_agent: &str) -> ClusterSettings {
        ClusterSettings {
            max_in_flight: self.kube_concurrency.max(1),
            user_agent: user_agent.to_owned(),
            ..ClusterSettings::in_namespace(&self.namespace)
        }
    }

    /// Builds the Kubernetes client: from `--kubeconfig` when given, else as kube-rs infers
    /// it (the in-cluster service account in a pod, `~/.kube/config` elsewhere). Must run
    /// inside a Tokio runtime.
    pub async fn connect(&self, user_agent: &str) -> Result<KubeCluster, ClusterError> {
        client(self.kubeconfig.as_deref(), self.settings(user_agent)).await
    }
}

/// The client of `kubeconfig` when given, else as kube-rs infers it.
pub(crate) async fn client(
    kubeconfig: Option<&std::path::Path>,
    settings: ClusterSettings,
) -> Result<KubeCluster, ClusterError> {
    match kubeconfig {
        Some(path) => KubeCluster::from_kubeconfig(path, settings).await,
        None => KubeCluster::try_default(settings).await,
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
    }

    #[test]
    fn settings_name_the_namespace_the_program_and_at_least_one_call_in_flight() {
        let args =
            Args::try_parse_from(["x", "--namespace", "labs", "--kube-concurrency", "0"]).unwrap();
        let settings = args.cluster.settings("ttlab-test/1");
        assert_eq!(settings.namespace.as_deref(), Some("labs"));
        assert_eq!(settings.max_in_flight, 1);
        assert_eq!(settings.user_agent, "ttlab-test/1");
        let args = Args::try_parse_from(["x", "--kubeconfig", "/nonexistent/kubeconfig"]).unwrap();
        assert_eq!(args.cluster.namespace, "ttlab-vms");
        assert_eq!(args.cluster.settings("a/1").max_in_flight, 16);
    }

    #[tokio::test]
    async fn a_kubeconfig_that_cannot_be_read_is_an_error_naming_it() {
        let args = Args::try_parse_from(["x", "--kubeconfig", "/nonexistent/kubeconfig"]).unwrap();
        let err = args.cluster.connect("a/1").await.unwrap_err();
        assert!(
            matches!(&err, ClusterError::Config { message } if message.contains("/nonexistent/kubeconfig")),
            "{err}"
        );
    }
}
