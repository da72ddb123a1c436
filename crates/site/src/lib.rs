//! Sites, the places lab VMs run, and the choice of one for a start. A site is one cluster's
//! API server (a kubeconfig, or the server's own cluster), a namespace in it, a VM limit,
//! labels lessons may require (`kvm-large`, `eu`), a weight, and the path to its VMs' agents
//! (pod IP, or KubeVirt's portforward through the API server).
//!
//! The crate owns, with no I/O and no clock, [`SitesConfig::parse`]: the text of the sites
//! file (`TTLAB_SITES`; the caller reads it) to validated [`Site`]s, or a [`SiteError`]
//! naming the site and the field. [`SitesConfig::single`] is the one `default` site of a
//! deployment without that file.
//!
//! Reading the file is the caller's job.
//!
//! ```
//! use ttlab_site::{AgentPath, SitesConfig};
//!
//! let config = SitesConfig::parse(
//!     "sites:
//!        - name: campus-b
//!          kubeconfig: /etc/ttlab/sites/campus-b.kubeconfig
//!          namespace: ttlab-vms
//!          vm_limit: 8
//!          labels: [kvm-large]
//!     ",
//! )
//! .unwrap();
//! assert_eq!(config.sites()[0].agent_path, AgentPath::Portforward);
//!
//! let err = SitesConfig::parse("sites:\n  - {name: a, in_cluster: true, namespace: a, vm_limit: 0}")
//!     .unwrap_err();
//! assert_eq!(err.to_string(), "site `a`, field `vm_limit`: must be at least 1");
//! ```

mod config;
mod error;
mod names;

pub use config::{AgentPath, Connection, DEFAULT_SITE, Site, SitesConfig, default_site_name};
pub use error::{SiteError, SiteRef};
pub use names::{InvalidLabel, Namespace, SiteLabel};
pub use ttlab_model::SiteName;
