use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use ttlab_model::labels::{COMPONENT, ObjectLabels};

use crate::{CloudInitError, UserData};

/// The `ttlab.io/component` value on cloud-init Secrets.
pub const COMPONENT_VALUE: &str = ttlab_model::labels::component::CLOUD_INIT;

/// The Secret that carries one VM's user-data (`cloudInitNoCloud.secretRef`). It is always
/// used, whatever the size: inline `userData` is never rendered. Its size is checked when it is
/// built, so an oversized lesson fails before any API call.
#[derive(Clone, PartialEq, Eq)]
pub struct UserDataSecret {
    name: String,
    labels: ObjectLabels,
    user_data: UserData,
}

impl UserDataSecret {
    /// The data key KubeVirt reads the user-data from.
    pub const KEY: &'static str = "userdata";
    /// The largest Secret the Kubernetes API server accepts: 1 MiB of keys plus values.
    pub const MAX_BYTES: usize = 1024 * 1024;

    /// Wraps rendered user-data as the Secret `name` (a DNS-1123 subdomain) with the
    /// session's labels (those of the VM's node). Fails if the Secret would exceed
    /// [`UserDataSecret::MAX_BYTES`].
    pub fn new(
        name: impl Into<String>,
        labels: ObjectLabels,
        user_data: UserData,
    ) -> Result<Self, CloudInitError> {
        let name = name.into();
        if !is_dns_subdomain(&name) {
            return Err(CloudInitError::InvalidSecretName(name));
        }
        let size = Self::KEY.len() + user_data.len();
        if size > Self::MAX_BYTES {
            return Err(CloudInitError::TooLarge {
                size,
                limit: Self::MAX_BYTES,
            });
        }
        Ok(Self {
            name,
            labels,
            user_data,
        })
    }

    /// The Secret's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The session's labels it carries.
    pub fn labels(&self) -> &ObjectLabels {
        &self.labels
    }

    /// The user-data it carries.
    pub fn user_data(&self) -> &UserData {
        &self.user_data
    }

    /// Its size as the API server counts it against the 1 MiB limit (key plus value bytes).
    pub fn size_bytes(&self) -> usize {
        Self::KEY.len() + self.user_data.len()
    }

    /// The Kubernetes labels: the session's, plus `ttlab.io/component: cloud-init`.
    pub fn label_map(&self) -> BTreeMap<String, String> {
        let mut labels = self.labels.to_map();
        labels.insert(COMPONENT.to_owned(), COMPONENT_VALUE.to_owned());
        labels
    }

    /// The Secret object (type `Opaque`, no namespace: the namespaced API sets it). `owner` is
    /// the VM, so deleting the VM deletes the Secret too.
    pub fn to_secret(&self, owner: Option<OwnerReference>) -> Secret {
        Secret {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                labels: Some(self.label_map()),
                owner_references: owner.map(|o| vec![o]),
                ..ObjectMeta::default()
            },
            type_: Some("Opaque".to_owned()),
            data: Some(BTreeMap::from([(
                Self::KEY.to_owned(),
                ByteString(self.user_data.as_str().as_bytes().to_vec()),
            )])),
            ..Secret::default()
        }
    }
}

impl fmt::Debug for UserDataSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UserDataSecret")
            .field("name", &self.name)
            .field("labels", &self.labels)
            .field("size_bytes", &self.size_bytes())
            .finish_non_exhaustive()
    }
}

fn is_dns_subdomain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}
