//! Sites, the places lab VMs run, and the choice of one for a start. A site is one cluster's
//! API server (a kubeconfig, or the server's own cluster), a namespace in it, a VM limit,
//! labels lessons may require (`kvm-large`, `eu`), a weight, and the path to its VMs' agents
//! (pod IP, or KubeVirt's portforward through the API server).
//!
//! The crate owns two pure steps, values in and values out, with no I/O and no clock:
//! 1. [`SitesConfig::parse`]: the text of the sites file (`TTLAB_SITES`; the caller reads
//!    it) to validated [`Site`]s, or a [`SiteError`] naming the site and the field;
//!    [`SitesConfig::single`] is the one `default` site of a deployment without that file;
//! 2. [`place`]: what a start wants ([`Wanted`]) and what is known of each site now
//!    ([`SiteState`]: reachable, VM places taken, golden disk ready) to one site for the whole
//!    session with a reason an operator can read, or to none with why each was passed over;
//!    [`labels_nowhere`] says why no configured site can ever run a lesson, by its labels.
//!
//! Reading the file, asking the clusters and counting VMs are the caller's job.
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
//!
//! ```
//! use ttlab_site::{Reachability, SiteState, SitesConfig, Wanted, place};
//!
//! let config = SitesConfig::parse(
//!     "sites:
//!        - name: campus-a
//!          in_cluster: true
//!          namespace: ttlab-vms
//!          vm_limit: 8
//!        - name: campus-b
//!          kubeconfig: /etc/ttlab/sites/campus-b.kubeconfig
//!          namespace: ttlab-vms
//!          vm_limit: 8
//!          labels: [kvm-large]
//!          weight: 2
//!     ",
//! )
//! .unwrap();
//! let [a, b] = config.sites() else { unreachable!() };
//! let mut states = vec![
//!     SiteState::of(a, Reachability::Reachable, 0, 1, false),
//!     SiteState::of(b, Reachability::Reachable, 5, 1, false),
//! ];
//!
//! // Any site will do: the most free places × weight wins (8 × 1 against 3 × 2).
//! let placement = place(&Wanted::default(), &states);
//! assert_eq!(placement.site().map(|s| s.as_str()), Some("campus-a"));
//! assert_eq!(
//!     placement.to_string(),
//!     "campus-a: 8 of 8 free × weight 1 = 8; ahead of campus-b (3 of 8 free × weight 2 = 6)"
//! );
//!
//! // The lesson needs `kvm-large`, and campus-b is full.
//! let wanted = Wanted { labels: ["kvm-large".parse().unwrap()].into(), golden_disk: false };
//! states[1].in_use = 8;
//! let placement = place(&wanted, &states);
//! assert_eq!(placement.site(), None);
//! assert_eq!(
//!     placement.to_string(),
//!     "no site: campus-a: lacks label kvm-large; campus-b: full (8 of 8)"
//! );
//! ```

mod config;
mod error;
mod place;

pub use config::{AgentPath, Connection, DEFAULT_SITE, Site, SitesConfig, default_site_name};
pub use error::{SiteError, SiteRef};
pub use place::{
    PassReason, PassedOver, Placement, Reachability, SiteState, Wanted, labels_nowhere, place,
};
pub use ttlab_model::{NamespaceName, SiteLabel, SiteName};
