use std::collections::BTreeSet;
use std::num::NonZeroU32;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use ttlab_model::SiteName;

use crate::{NamespaceName, SiteError, SiteLabel, SiteRef};

/// The name of the one site of a deployment without a sites file ([`SitesConfig::single`]).
pub const DEFAULT_SITE: &str = "default";

/// How the server reaches a site's Kubernetes API server.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Connection {
    /// With this kubeconfig file (`kubeconfig:` in the sites file).
    Kubeconfig(PathBuf),
    /// With the service account of the pod the server runs in: the server's own cluster
    /// (`in_cluster: true` in the sites file).
    InCluster,
    /// As the Kubernetes client infers it: the in-cluster service account in a pod,
    /// `~/.kube/config` elsewhere. Only the `default` site of [`SitesConfig::single`] without
    /// a kubeconfig has it; it is today's single-cluster behaviour.
    Inferred,
}

/// How the server reaches the guest agent of a VM on a site.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum AgentPath {
    /// Straight to the VM's pod IP: the server shares the site's pod network (`pod-ip`).
    #[serde(rename = "pod-ip")]
    PodIp,
    /// Through KubeVirt's VMI `portforward` subresource, via the site's API server
    /// (`portforward`).
    #[serde(rename = "portforward")]
    Portforward,
}

impl AgentPath {
    /// The value as written in the sites file (`pod-ip`, `portforward`).
    pub fn as_str(self) -> &'static str {
        match self {
            AgentPath::PodIp => "pod-ip",
            AgentPath::Portforward => "portforward",
        }
    }

    /// The path written `name` (`pod-ip`, `portforward`), as in the sites file and the
    /// server's `TTLAB_AGENT_PATH`; `None` for anything else.
    pub fn from_name(name: &str) -> Option<Self> {
        [AgentPath::PodIp, AgentPath::Portforward]
            .into_iter()
            .find(|p| p.as_str() == name)
    }

    /// The path a site gets when its entry names none: `pod-ip` in the server's own cluster
    /// ([`Connection::InCluster`], and [`Connection::Inferred`] as today), `portforward`
    /// through a kubeconfig (another cluster, whose pod network the server may not reach).
    pub fn default_for(connection: &Connection) -> Self {
        match connection {
            Connection::InCluster | Connection::Inferred => AgentPath::PodIp,
            Connection::Kubeconfig(_) => AgentPath::Portforward,
        }
    }
}

impl std::fmt::Display for AgentPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One validated site: a place lab VMs run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Site {
    /// Its name, unique in the configuration.
    pub name: SiteName,
    /// How to reach its API server.
    pub connection: Connection,
    /// The namespace its VMs live in.
    pub namespace: NamespaceName,
    /// The most VMs ttlab may run there at once.
    pub vm_limit: NonZeroU32,
    /// The capabilities it offers, which lessons may require.
    pub labels: BTreeSet<SiteLabel>,
    /// Its share in placement: free places count `weight` times (1 unless configured).
    pub weight: NonZeroU32,
    /// How the server reaches the agents of its VMs.
    pub agent_path: AgentPath,
}

/// Every site of a deployment, validated: at least one, names unique, in the file's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SitesConfig {
    sites: Vec<Site>,
}

impl SitesConfig {
    /// Parses and validates the text of a sites file (`TTLAB_SITES`). The first problem, in
    /// file order, is the error: it names the site and the field.
    pub fn parse(text: &str) -> Result<Self, SiteError> {
        let file: Option<RawFile> =
            serde_norway::from_str(text).map_err(|e| yaml_error(text, &e))?;
        let raw_sites = file.and_then(|f| f.sites).unwrap_or_default();
        if raw_sites.is_empty() {
            return Err(SiteError::NoSites);
        }
        let mut sites: Vec<Site> = Vec::with_capacity(raw_sites.len());
        for (index, raw) in raw_sites.into_iter().enumerate() {
            let position = index + 1;
            let name = SiteName::new(raw.name.as_str()).map_err(|e| SiteError::Invalid {
                site: SiteRef::Position(position),
                field: "name",
                message: e.to_string(),
            })?;
            if let Some(first) = sites.iter().position(|s| s.name == name) {
                return Err(SiteError::DuplicateName {
                    name,
                    first: first + 1,
                    second: position,
                });
            }
            sites.push(raw.validate(name)?);
        }
        Ok(Self { sites })
    }

    /// The configuration of a deployment without a sites file: one site named
    /// [`DEFAULT_SITE`], today's namespace, kubeconfig (or the inferred client when `None`) and
    /// VM limit, no labels, weight 1, and the agent reached by pod IP as today.
    pub fn single(
        namespace: &str,
        kubeconfig: Option<PathBuf>,
        vm_limit: u32,
    ) -> Result<Self, SiteError> {
        let name = default_site_name();
        let site = SiteRef::Named(name.clone());
        let namespace = NamespaceName::new(namespace).map_err(|e| SiteError::Invalid {
            site: site.clone(),
            field: "namespace",
            message: e.to_string(),
        })?;
        let vm_limit = NonZeroU32::new(vm_limit).ok_or_else(|| SiteError::Invalid {
            site: site.clone(),
            field: "vm_limit",
            message: "must be at least 1".to_owned(),
        })?;
        let connection = match kubeconfig {
            Some(path) if path.as_os_str().is_empty() => {
                return Err(SiteError::Invalid {
                    site,
                    field: "kubeconfig",
                    message: "the path is empty".to_owned(),
                });
            }
            Some(path) => Connection::Kubeconfig(path),
            None => Connection::Inferred,
        };
        Ok(Self {
            sites: vec![Site {
                name,
                connection,
                namespace,
                vm_limit,
                labels: BTreeSet::new(),
                weight: NonZeroU32::MIN,
                agent_path: AgentPath::PodIp,
            }],
        })
    }

    /// The sites, in the file's order (never empty).
    pub fn sites(&self) -> &[Site] {
        &self.sites
    }

    /// The site of this name, if there is one.
    pub fn get(&self, name: &SiteName) -> Option<&Site> {
        self.sites.iter().find(|s| &s.name == name)
    }
}

/// The name [`DEFAULT_SITE`] as a [`SiteName`].
pub fn default_site_name() -> SiteName {
    SiteName::new(DEFAULT_SITE).expect("`default` is a valid site name")
}

/// A sites file as written, before validation.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping with a `sites` list")]
struct RawFile {
    #[serde(default)]
    sites: Option<Vec<RawSite>>,
}

/// One entry of `sites` as written, before validation.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a site: a mapping of its fields")]
struct RawSite {
    name: String,
    #[serde(default)]
    kubeconfig: Option<PathBuf>,
    #[serde(default, alias = "in-cluster")]
    in_cluster: Option<bool>,
    namespace: String,
    vm_limit: u32,
    #[serde(default)]
    labels: Vec<String>,
    #[serde(default)]
    weight: Option<u32>,
    #[serde(default)]
    agent_path: Option<AgentPath>,
}

impl RawSite {
    /// Checks every field but the name (already checked) and builds the site.
    fn validate(self, name: SiteName) -> Result<Site, SiteError> {
        let site = SiteRef::Named(name.clone());
        let invalid = |field: &'static str, message: String| SiteError::Invalid {
            site: site.clone(),
            field,
            message,
        };
        let connection = match (self.kubeconfig, self.in_cluster.unwrap_or(false)) {
            (Some(_), true) => {
                return Err(invalid(
                    "kubeconfig",
                    "both `kubeconfig` and `in_cluster: true` are set: give exactly one".to_owned(),
                ));
            }
            (None, false) => {
                return Err(invalid(
                    "kubeconfig",
                    "neither `kubeconfig` nor `in_cluster: true` is set: give exactly one"
                        .to_owned(),
                ));
            }
            (Some(path), false) if path.as_os_str().is_empty() => {
                return Err(invalid("kubeconfig", "the path is empty".to_owned()));
            }
            (Some(path), false) => Connection::Kubeconfig(path),
            (None, true) => Connection::InCluster,
        };
        let namespace =
            NamespaceName::new(self.namespace).map_err(|e| invalid("namespace", e.to_string()))?;
        let vm_limit = NonZeroU32::new(self.vm_limit)
            .ok_or_else(|| invalid("vm_limit", "must be at least 1".to_owned()))?;
        let mut labels = BTreeSet::new();
        for text in self.labels {
            let label = SiteLabel::new(text).map_err(|e| invalid("labels", e.to_string()))?;
            if labels.contains(&label) {
                return Err(invalid("labels", format!("`{label}` is listed twice")));
            }
            labels.insert(label);
        }
        let weight = NonZeroU32::new(self.weight.unwrap_or(1))
            .ok_or_else(|| invalid("weight", "must be at least 1 (the default is 1)".to_owned()))?;
        let agent_path = self
            .agent_path
            .unwrap_or_else(|| AgentPath::default_for(&connection));
        Ok(Site {
            name,
            connection,
            namespace,
            vm_limit,
            labels,
            weight,
            agent_path,
        })
    }
}

/// Turns a YAML error into [`SiteError::Yaml`]: the location as fields, and serde_norway's
/// `sites[N].field: ` path turned into the site (by name where the text has a valid one) and
/// the field.
fn yaml_error(text: &str, e: &serde_norway::Error) -> SiteError {
    let mut message = e.to_string();
    let (line, column) = match e.location() {
        Some(loc) => {
            let suffix = format!(" at line {} column {}", loc.line(), loc.column());
            if let Some(pos) = message.rfind(&suffix) {
                message.replace_range(pos..pos + suffix.len(), "");
            }
            (Some(loc.line()), Some(loc.column()))
        }
        None => (None, None),
    };
    let (index, mut field, message) = match split_site_path(&message) {
        Some((index, field, rest)) => (Some(index), field.map(str::to_owned), rest.to_owned()),
        None => (None, None, message),
    };
    if field.is_none() {
        field = quoted_after(&message, "unknown field `")
            .or_else(|| quoted_after(&message, "missing field `"))
            .map(str::to_owned);
    }
    let site = index.map(|index| site_ref_at(text, index));
    SiteError::Yaml {
        line,
        column,
        site,
        field,
        message,
    }
}

/// Splits `sites[N]: rest` or `sites[N].field: rest` into the 0-based index, the field and
/// the rest.
fn split_site_path(message: &str) -> Option<(usize, Option<&str>, &str)> {
    let after = message.strip_prefix("sites[")?;
    let close = after.find(']')?;
    let index = after[..close].parse().ok()?;
    let after = &after[close + 1..];
    if let Some(rest) = after.strip_prefix(": ") {
        return Some((index, None, rest));
    }
    let after = after.strip_prefix('.')?;
    let colon = after.find(": ")?;
    Some((index, Some(&after[..colon]), &after[colon + 2..]))
}

/// The text between `opening` (which ends with a backtick) and the next backtick.
fn quoted_after<'a>(message: &'a str, opening: &str) -> Option<&'a str> {
    let start = message.find(opening)? + opening.len();
    let len = message[start..].find('`')?;
    Some(&message[start..start + len])
}

/// The site at 0-based `index` of the text's `sites`: by name when the text, read as plain
/// YAML, gives it a valid one, else by position.
fn site_ref_at(text: &str, index: usize) -> SiteRef {
    serde_norway::from_str::<serde_norway::Value>(text)
        .ok()
        .and_then(|v| {
            v.get("sites")?
                .get(index)?
                .get("name")?
                .as_str()
                .and_then(|n| SiteName::new(n).ok())
        })
        .map_or(SiteRef::Position(index + 1), SiteRef::Named)
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = "\
# Two sites: the server's own cluster, and a campus reached by kubeconfig.
sites:
  - name: campus-a
    kubeconfig: /etc/ttlab/sites/campus-a.kubeconfig
    namespace: ttlab-vms
    vm_limit: 8
    labels: [kvm-large, eu]
    weight: 2
    agent_path: pod-ip
  - name: home
    in_cluster: true
    namespace: labs
    vm_limit: 4
";

    fn site(text: &str) -> String {
        format!("sites:\n  - name: campus-a\n    namespace: ttlab-vms\n    vm_limit: 8\n{text}")
    }

    fn error(text: &str) -> (SiteError, String) {
        let err = SitesConfig::parse(text).unwrap_err();
        let message = err.to_string();
        (err, message)
    }

    /// The error names `site` and `field`, in the message and as values.
    fn assert_names(text: &str, site: &str, field: &str) -> String {
        let (err, message) = error(text);
        assert!(message.contains(site), "{message:?} should name {site}");
        assert!(
            message.contains(&format!("`{field}`")),
            "{message:?} should name field {field}"
        );
        assert_eq!(err.field(), Some(field), "{err:?}");
        message
    }

    #[test]
    fn parses_a_file_with_every_field_and_the_defaults() {
        let config = SitesConfig::parse(EXAMPLE).unwrap();
        let [a, home] = config.sites() else {
            panic!("{config:?}")
        };
        assert_eq!(a.name.as_str(), "campus-a");
        assert_eq!(
            a.connection,
            Connection::Kubeconfig("/etc/ttlab/sites/campus-a.kubeconfig".into())
        );
        assert_eq!(a.namespace.as_str(), "ttlab-vms");
        assert_eq!(a.vm_limit.get(), 8);
        let labels: Vec<&str> = a.labels.iter().map(SiteLabel::as_str).collect();
        assert_eq!(labels, ["eu", "kvm-large"]);
        assert_eq!(a.weight.get(), 2);
        assert_eq!(a.agent_path, AgentPath::PodIp);

        assert_eq!(home.connection, Connection::InCluster);
        assert!(home.labels.is_empty());
        assert_eq!(home.weight.get(), 1, "weight defaults to 1");
        assert_eq!(home.agent_path, AgentPath::PodIp, "in-cluster: pod IP");
        assert_eq!(config.get(&home.name), Some(home));
        assert_eq!(config.get(&"elsewhere".parse().unwrap()), None);
    }

    #[test]
    fn agent_path_defaults_to_portforward_through_a_kubeconfig() {
        let config = SitesConfig::parse(&site("    kubeconfig: /k\n")).unwrap();
        assert_eq!(config.sites()[0].agent_path, AgentPath::Portforward);
        let config =
            SitesConfig::parse(&site("    in_cluster: true\n    agent_path: portforward\n"))
                .unwrap();
        assert_eq!(config.sites()[0].agent_path, AgentPath::Portforward);
        assert_eq!(AgentPath::Portforward.as_str(), "portforward");
        assert_eq!(AgentPath::PodIp.as_str(), "pod-ip");
    }

    #[test]
    fn in_cluster_may_be_spelt_with_a_dash() {
        let config = SitesConfig::parse(&site("    in-cluster: true\n")).unwrap();
        assert_eq!(config.sites()[0].connection, Connection::InCluster);
    }

    #[test]
    fn an_empty_list_or_file_is_refused() {
        for text in ["", "# nothing yet\n", "sites: []\n", "sites:\n"] {
            let (err, message) = error(text);
            assert_eq!(err, SiteError::NoSites, "{text:?}");
            assert!(message.contains("`sites`"), "{message}");
        }
    }

    #[test]
    fn a_duplicate_name_names_the_site_and_both_positions() {
        let text = "sites:
  - {name: campus-a, in_cluster: true, namespace: a, vm_limit: 1}
  - {name: campus-b, in_cluster: true, namespace: b, vm_limit: 1}
  - {name: campus-a, in_cluster: true, namespace: c, vm_limit: 1}
";
        let message = assert_names(text, "site `campus-a`", "name");
        assert!(message.contains("#1 and #3"), "{message}");
    }

    #[test]
    fn a_bad_name_names_the_site_by_position() {
        let text = "sites:
  - {name: campus-a, in_cluster: true, namespace: a, vm_limit: 1}
  - {name: Campus_B, in_cluster: true, namespace: b, vm_limit: 1}
";
        let message = assert_names(text, "site #2", "name");
        assert!(message.contains("\"Campus_B\""), "{message}");
        let (err, _) = error(text);
        assert_eq!(err.site(), Some(SiteRef::Position(2)));
        let long = format!(
            "sites:\n  - {{name: {}, in_cluster: true, namespace: a, vm_limit: 1}}\n",
            "a".repeat(41)
        );
        let message = assert_names(&long, "site #1", "name");
        assert!(message.contains("40"), "{message}");
    }

    #[test]
    fn a_namespace_that_is_not_a_dns_label_is_refused() {
        let text =
            "sites:\n  - {name: campus-a, in_cluster: true, namespace: TTLab.VMs, vm_limit: 1}\n";
        let message = assert_names(text, "site `campus-a`", "namespace");
        assert!(message.contains("\"TTLab.VMs\""), "{message}");
    }

    #[test]
    fn a_vm_limit_of_zero_is_refused() {
        let text = "sites:\n  - {name: campus-a, in_cluster: true, namespace: a, vm_limit: 0}\n";
        let message = assert_names(text, "site `campus-a`", "vm_limit");
        assert!(message.contains("at least 1"), "{message}");
    }

    #[test]
    fn a_weight_of_zero_is_refused() {
        let message = assert_names(
            &site("    in_cluster: true\n    weight: 0\n"),
            "site `campus-a`",
            "weight",
        );
        assert!(message.contains("at least 1"), "{message}");
    }

    #[test]
    fn exactly_one_of_kubeconfig_and_in_cluster() {
        let both = site("    kubeconfig: /k\n    in_cluster: true\n");
        let message = assert_names(&both, "site `campus-a`", "kubeconfig");
        assert!(
            message.contains("both") && message.contains("in_cluster"),
            "{message}"
        );

        for neither in [site(""), site("    in_cluster: false\n")] {
            let message = assert_names(&neither, "site `campus-a`", "kubeconfig");
            assert!(message.contains("neither"), "{message}");
        }

        let empty = site("    kubeconfig: ''\n");
        let message = assert_names(&empty, "site `campus-a`", "kubeconfig");
        assert!(message.contains("empty"), "{message}");

        let config = SitesConfig::parse(&site("    kubeconfig: /k\n    in_cluster: false\n"));
        assert_eq!(
            config.unwrap().sites()[0].connection,
            Connection::Kubeconfig("/k".into())
        );
    }

    #[test]
    fn a_bad_or_repeated_label_is_refused() {
        let bad = site("    in_cluster: true\n    labels: [eu, KVM_Large]\n");
        let message = assert_names(&bad, "site `campus-a`", "labels");
        assert!(message.contains("\"KVM_Large\""), "{message}");

        let twice = site("    in_cluster: true\n    labels: [eu, eu]\n");
        let message = assert_names(&twice, "site `campus-a`", "labels");
        assert!(message.contains("`eu` is listed twice"), "{message}");
    }

    #[test]
    fn an_unknown_field_names_the_site_the_field_and_the_line() {
        let text = site("    in_cluster: true\n    wieght: 2\n");
        let message = assert_names(&text, "site `campus-a`", "wieght");
        assert!(message.contains("unknown field"), "{message}");
        let (err, _) = error(&text);
        let SiteError::Yaml { line, site, .. } = err else {
            panic!("{err:?}")
        };
        assert_eq!(line, Some(6), "{message}");
        assert_eq!(site, Some(SiteRef::Named("campus-a".parse().unwrap())));

        // Without a valid name, by position.
        let text =
            "sites:\n  - {name: A, in_cluster: true, namespace: a, vm_limit: 1, colour: red}\n";
        assert_names(text, "site #1", "colour");

        // Outside any site.
        let (err, message) = error("sites: []\nsite: []\n");
        assert!(message.contains("unknown field `site`"), "{message}");
        assert_eq!(err.site(), None);
        assert!(
            message.starts_with("sites file line 2 column 1: "),
            "{message}"
        );
    }

    #[test]
    fn a_missing_or_mistyped_field_names_the_site_and_the_field() {
        let text = "sites:\n  - name: campus-a\n    in_cluster: true\n    vm_limit: 1\n";
        let message = assert_names(text, "site `campus-a`", "namespace");
        assert!(message.contains("missing field"), "{message}");

        let text = site("    in_cluster: true\n    weight: heavy\n");
        let message = assert_names(&text, "site `campus-a`", "weight");
        assert!(message.contains("invalid type"), "{message}");

        let text = site("    in_cluster: true\n    agent_path: ssh\n");
        let message = assert_names(&text, "site `campus-a`", "agent_path");
        assert!(message.contains("pod-ip"), "{message}");
    }

    #[test]
    fn a_yaml_syntax_error_gives_its_line() {
        let text = "sites:\n  - name: campus-a\n\tnamespace: x\n";
        let (err, message) = error(text);
        let SiteError::Yaml { line, .. } = &err else {
            panic!("{err:?}")
        };
        assert_eq!(*line, Some(3), "{err:?}");
        assert!(
            message.starts_with("sites file line 3 column 1: "),
            "{message}"
        );
        assert!(message.contains("tab"), "{message}");

        let (_, message) = error("sites:\n  - name: campus-a\n    namespace: \"ttlab\n");
        assert!(message.contains("quoted scalar at line 3"), "{message}");
    }

    #[test]
    fn a_site_that_is_not_a_mapping_is_named_by_position() {
        let (err, message) = error("sites:\n  - campus-a\n");
        assert_eq!(err.site(), Some(SiteRef::Position(1)), "{message}");
        assert!(message.contains("site #1: invalid type"), "{message}");
        assert!(message.contains("expected a site"), "{message}");
    }

    #[test]
    fn single_is_todays_one_default_site() {
        let config = SitesConfig::single("ttlab-vms", None, 8).unwrap();
        let [site] = config.sites() else {
            panic!("{config:?}")
        };
        assert_eq!(site.name.as_str(), DEFAULT_SITE);
        assert_eq!(site.name, default_site_name());
        assert_eq!(site.connection, Connection::Inferred);
        assert_eq!(site.namespace.as_str(), "ttlab-vms");
        assert_eq!(site.vm_limit.get(), 8);
        assert!(site.labels.is_empty());
        assert_eq!(site.weight.get(), 1);
        assert_eq!(site.agent_path, AgentPath::PodIp);

        let config = SitesConfig::single("labs", Some("/home/me/.kube/config".into()), 2).unwrap();
        let site = &config.sites()[0];
        assert_eq!(
            site.connection,
            Connection::Kubeconfig("/home/me/.kube/config".into())
        );
        assert_eq!(site.agent_path, AgentPath::PodIp, "today's agent path");
    }

    #[test]
    fn single_refuses_what_a_file_would() {
        let message = SitesConfig::single("Labs", None, 8)
            .unwrap_err()
            .to_string();
        assert!(
            message.starts_with("site `default`, field `namespace`"),
            "{message}"
        );
        let message = SitesConfig::single("labs", None, 0)
            .unwrap_err()
            .to_string();
        assert!(
            message.starts_with("site `default`, field `vm_limit`"),
            "{message}"
        );
        let message = SitesConfig::single("labs", Some(PathBuf::new()), 1)
            .unwrap_err()
            .to_string();
        assert!(
            message.starts_with("site `default`, field `kubeconfig`"),
            "{message}"
        );
    }
}
