//! The resource types kube-sim serves: their group, version, names and the rules that differ
//! between them (scope, status subresource, name format, schema).

/// How names of a resource are validated (as the real API server does per type).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameRule {
    /// RFC 1123 subdomain: lower-case alphanumerics, `-` and `.`, at most 253 characters.
    Subdomain,
    /// RFC 1123 label: lower-case alphanumerics and `-`, at most 63 characters.
    Label,
    /// RFC 1035 label: like [`NameRule::Label`] but starting with a letter.
    Dns1035,
}

/// How the body of a resource is checked for unknown fields and types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchemaSource {
    /// A built-in type: decoded through its `k8s-openapi` struct.
    Builtin,
    /// A custom resource: checked against the embedded structural schema with this key.
    Crd(&'static str),
}

/// One served resource type.
#[derive(Debug)]
pub struct ResourceType {
    /// API group (`""` for the core group).
    pub group: &'static str,
    /// API version.
    pub version: &'static str,
    /// Plural resource name (the URL segment).
    pub plural: &'static str,
    /// Singular resource name.
    pub singular: &'static str,
    /// Kind.
    pub kind: &'static str,
    /// Namespaced or cluster-scoped.
    pub namespaced: bool,
    /// kubectl short names.
    pub short_names: &'static [&'static str],
    /// Discovery categories (`all`).
    pub categories: &'static [&'static str],
    /// Has a `/status` subresource (the main endpoint then ignores status changes).
    pub status_subresource: bool,
    /// Name format.
    pub name_rule: NameRule,
    /// How bodies are validated.
    pub schema: SchemaSource,
}

impl ResourceType {
    /// `apiVersion` of objects of this type.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_owned()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// The resource as written in error messages and quota names: `pods`,
    /// `virtualmachines.kubevirt.io`.
    pub fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_owned()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    /// The kind as written in "is invalid" messages: `Pod`, `VirtualMachine.kubevirt.io`.
    pub fn qualified_kind(&self) -> String {
        if self.group.is_empty() {
            self.kind.to_owned()
        } else {
            format!("{}.{}", self.kind, self.group)
        }
    }

    /// The base path of this type's endpoints (`/api/v1`, `/apis/kubevirt.io/v1`).
    pub fn group_version_path(&self) -> String {
        if self.group.is_empty() {
            format!("/api/{}", self.version)
        } else {
            format!("/apis/{}/{}", self.group, self.version)
        }
    }
}

/// Index of a type in [`TYPES`].
pub type TypeId = usize;

const ALL: &[&str] = &["all"];
const VERBS: &[&str] = &[
    "create",
    "delete",
    "deletecollection",
    "get",
    "list",
    "patch",
    "update",
    "watch",
];

/// The verbs every served type supports.
pub fn verbs() -> &'static [&'static str] {
    VERBS
}

/// Every served type. Order is stable: [`TypeId`]s index into it.
pub static TYPES: &[ResourceType] = &[
    ResourceType {
        group: "",
        version: "v1",
        plural: "namespaces",
        singular: "namespace",
        kind: "Namespace",
        namespaced: false,
        short_names: &["ns"],
        categories: &[],
        status_subresource: true,
        name_rule: NameRule::Label,
        schema: SchemaSource::Builtin,
    },
    ResourceType {
        group: "",
        version: "v1",
        plural: "secrets",
        singular: "secret",
        kind: "Secret",
        namespaced: true,
        short_names: &[],
        categories: &[],
        status_subresource: false,
        name_rule: NameRule::Subdomain,
        schema: SchemaSource::Builtin,
    },
    ResourceType {
        group: "",
        version: "v1",
        plural: "pods",
        singular: "pod",
        kind: "Pod",
        namespaced: true,
        short_names: &["po"],
        categories: ALL,
        status_subresource: true,
        name_rule: NameRule::Subdomain,
        schema: SchemaSource::Builtin,
    },
    ResourceType {
        group: "",
        version: "v1",
        plural: "services",
        singular: "service",
        kind: "Service",
        namespaced: true,
        short_names: &["svc"],
        categories: ALL,
        status_subresource: true,
        name_rule: NameRule::Dns1035,
        schema: SchemaSource::Builtin,
    },
    ResourceType {
        group: "",
        version: "v1",
        plural: "persistentvolumeclaims",
        singular: "persistentvolumeclaim",
        kind: "PersistentVolumeClaim",
        namespaced: true,
        short_names: &["pvc"],
        categories: &[],
        status_subresource: true,
        name_rule: NameRule::Subdomain,
        schema: SchemaSource::Builtin,
    },
    ResourceType {
        group: "",
        version: "v1",
        plural: "resourcequotas",
        singular: "resourcequota",
        kind: "ResourceQuota",
        namespaced: true,
        short_names: &["quota"],
        categories: &[],
        status_subresource: true,
        name_rule: NameRule::Subdomain,
        schema: SchemaSource::Builtin,
    },
    ResourceType {
        group: "networking.k8s.io",
        version: "v1",
        plural: "networkpolicies",
        singular: "networkpolicy",
        kind: "NetworkPolicy",
        namespaced: true,
        short_names: &["netpol"],
        categories: &[],
        status_subresource: false,
        name_rule: NameRule::Subdomain,
        schema: SchemaSource::Builtin,
    },
    ResourceType {
        group: "kubevirt.io",
        version: "v1",
        plural: "virtualmachines",
        singular: "virtualmachine",
        kind: "VirtualMachine",
        namespaced: true,
        short_names: &["vm", "vms"],
        categories: ALL,
        status_subresource: true,
        name_rule: NameRule::Label,
        schema: SchemaSource::Crd("virtualmachine"),
    },
    ResourceType {
        group: "kubevirt.io",
        version: "v1",
        plural: "virtualmachineinstances",
        singular: "virtualmachineinstance",
        kind: "VirtualMachineInstance",
        namespaced: true,
        short_names: &["vmi", "vmis"],
        categories: ALL,
        status_subresource: false,
        name_rule: NameRule::Label,
        schema: SchemaSource::Crd("virtualmachineinstance"),
    },
    ResourceType {
        group: "cdi.kubevirt.io",
        version: "v1beta1",
        plural: "datavolumes",
        singular: "datavolume",
        kind: "DataVolume",
        namespaced: true,
        short_names: &["dv", "dvs"],
        categories: ALL,
        status_subresource: true,
        name_rule: NameRule::Subdomain,
        schema: SchemaSource::Crd("datavolume"),
    },
    ResourceType {
        group: "cdi.kubevirt.io",
        version: "v1beta1",
        plural: "datasources",
        singular: "datasource",
        kind: "DataSource",
        namespaced: true,
        short_names: &["das"],
        categories: ALL,
        status_subresource: true,
        name_rule: NameRule::Subdomain,
        schema: SchemaSource::Crd("datasource"),
    },
    ResourceType {
        group: "",
        version: "v1",
        plural: "configmaps",
        singular: "configmap",
        kind: "ConfigMap",
        namespaced: true,
        short_names: &["cm"],
        categories: &[],
        status_subresource: false,
        name_rule: NameRule::Subdomain,
        schema: SchemaSource::Builtin,
    },
    ResourceType {
        group: "",
        version: "v1",
        plural: "nodes",
        singular: "node",
        kind: "Node",
        namespaced: false,
        short_names: &["no"],
        categories: &[],
        status_subresource: true,
        name_rule: NameRule::Subdomain,
        schema: SchemaSource::Builtin,
    },
];

/// [`TypeId`] of namespaces.
pub const NAMESPACES: TypeId = 0;
/// [`TypeId`] of secrets.
pub const SECRETS: TypeId = 1;
/// [`TypeId`] of pods.
pub const PODS: TypeId = 2;
/// [`TypeId`] of services.
pub const SERVICES: TypeId = 3;
/// [`TypeId`] of persistent volume claims.
pub const PVCS: TypeId = 4;
/// [`TypeId`] of resource quotas.
pub const QUOTAS: TypeId = 5;
/// [`TypeId`] of network policies.
pub const NETWORK_POLICIES: TypeId = 6;
/// [`TypeId`] of virtual machines.
pub const VMS: TypeId = 7;
/// [`TypeId`] of virtual machine instances.
pub const VMIS: TypeId = 8;
/// [`TypeId`] of data volumes.
pub const DATA_VOLUMES: TypeId = 9;
/// [`TypeId`] of data sources.
pub const DATA_SOURCES: TypeId = 10;
/// [`TypeId`] of config maps.
pub const CONFIG_MAPS: TypeId = 11;
/// [`TypeId`] of nodes (registered by an external kubelet, [`crate::Controllers::External`]).
pub const NODES: TypeId = 12;

/// The served group versions, in discovery order: (group, version).
pub const GROUP_VERSIONS: &[(&str, &str)] = &[
    ("", "v1"),
    ("networking.k8s.io", "v1"),
    ("kubevirt.io", "v1"),
    ("cdi.kubevirt.io", "v1beta1"),
];

/// The group of the KubeVirt console subresource.
pub const SUBRESOURCES_GROUP: &str = "subresources.kubevirt.io";

/// Finds a type by group, version and plural.
pub fn find(group: &str, version: &str, plural: &str) -> Option<TypeId> {
    TYPES
        .iter()
        .position(|t| t.group == group && t.version == version && t.plural == plural)
}

/// Finds a type by plural name alone, optionally group-qualified (`virtualmachines` or
/// `virtualmachines.kubevirt.io`), as used by fault rules and quota names.
pub fn find_by_resource(resource: &str) -> Option<TypeId> {
    TYPES
        .iter()
        .position(|t| t.plural == resource || t.qualified() == resource)
}

/// Finds a type by `kind` (for owner references).
pub fn find_by_kind(api_version: &str, kind: &str) -> Option<TypeId> {
    TYPES
        .iter()
        .position(|t| t.kind == kind && t.api_version() == api_version)
        .or_else(|| TYPES.iter().position(|t| t.kind == kind))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_index_the_right_types() {
        for (id, plural) in [
            (NAMESPACES, "namespaces"),
            (SECRETS, "secrets"),
            (PODS, "pods"),
            (SERVICES, "services"),
            (PVCS, "persistentvolumeclaims"),
            (QUOTAS, "resourcequotas"),
            (NETWORK_POLICIES, "networkpolicies"),
            (VMS, "virtualmachines"),
            (VMIS, "virtualmachineinstances"),
            (DATA_VOLUMES, "datavolumes"),
            (DATA_SOURCES, "datasources"),
            (CONFIG_MAPS, "configmaps"),
            (NODES, "nodes"),
        ] {
            assert_eq!(TYPES[id].plural, plural);
        }
        assert_eq!(find_by_resource("virtualmachines.kubevirt.io"), Some(VMS));
        assert_eq!(find("", "v1", "pods"), Some(PODS));
        assert_eq!(find("kubevirt.io", "v1", "pods"), None);
    }
}
