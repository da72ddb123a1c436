//! The golden-disk decision table: what the cluster showed about a lesson's golden PVC, to
//! either the golden disk (with the resolved claim name) or the container disk, with a reason.
//!
//! The golden disk is an optimisation, never a prerequisite. Every state other than "ready" —
//! not requested, missing, forbidden, still importing, failed import, unbound, being deleted,
//! single-node access mode, a different image — falls back to the lesson's container disk
//! without an error, and the [`FallbackReason`] says why (for the session row and the metrics
//! label; its strings are stable).
//!
//! The crate owns two pure steps:
//! 1. [`observe`] (and [`resolve_data_source`] before it, when the lesson names a CDI
//!    DataSource): plain facts the cluster crate read (PVC phase, access modes, deletion,
//!    annotations, DataVolume phase) to one [`GoldenObservation`];
//! 2. [`decide`]: the table itself, observation to [`DiskDecision`].
//!
//! It refuses to own any I/O: reading the PVC, DataVolume and DataSource is the cluster
//! crate's job, rendering the volume is `ttlab-vm-manifest`'s.
//!
//! ```
//! use std::collections::BTreeMap;
//! use ttlab_disk_select::{decide, observe, DiskDecision, FallbackReason, Lookup, PvcFacts};
//!
//! let pvc = PvcFacts {
//!     name: "golden-ubuntu".into(),
//!     phase: Some("Bound".into()),
//!     access_modes: vec!["ReadOnlyMany".into()],
//!     being_deleted: false,
//!     annotations: BTreeMap::new(),
//! };
//! let seen = observe(&Lookup::Found(pvc.clone()), &Lookup::NotFound, None);
//! assert_eq!(decide(&seen), DiskDecision::Golden { claim: "golden-ubuntu".into() });
//!
//! let rwo = PvcFacts { access_modes: vec!["ReadWriteOnce".into()], ..pvc };
//! let seen = observe(&Lookup::Found(rwo), &Lookup::NotFound, None);
//! let decision = decide(&seen);
//! assert_eq!(decision.fallback_reason(), Some(FallbackReason::SingleNode));
//! assert_eq!(decision.reason_str(), "single_node");
//! ```

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// PVC annotation CDI keeps up to date with the phase of its importer pod
/// (`Pending`, `Running`, `Succeeded`, `Failed`).
pub const ANN_IMPORT_POD_PHASE: &str = "cdi.kubevirt.io/storage.pod.phase";
/// PVC annotation CDI sets to the import source URL (`docker://quay.io/...:tag` for a registry).
pub const ANN_IMPORT_ENDPOINT: &str = "cdi.kubevirt.io/storage.import.endpoint";
/// PVC annotation an operator may set to the container-disk image the golden PVC holds. It
/// takes precedence over [`ANN_IMPORT_ENDPOINT`] when both are present.
pub const ANN_GOLDEN_IMAGE: &str = "ttlab.io/image";

/// Errors of this crate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DiskSelectError {
    /// A stored reason string is not one this version knows.
    #[error("unknown disk fallback reason {0:?}")]
    UnknownReason(String),
}

/// The result of reading one object from the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup<T> {
    /// The object exists; these are its facts.
    Found(T),
    /// The API answered 404.
    NotFound,
    /// The API answered 403: the backend may not read it.
    Forbidden,
}

/// What the cluster crate read from the golden PersistentVolumeClaim.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PvcFacts {
    /// `metadata.name`.
    pub name: String,
    /// `status.phase` (`Pending`, `Bound`, `Lost`), if reported.
    pub phase: Option<String>,
    /// `status.accessModes` when bound, else `spec.accessModes`.
    pub access_modes: Vec<String>,
    /// `metadata.deletionTimestamp` is set (the pvc-protection finalizer holds it; it refuses
    /// new pods).
    pub being_deleted: bool,
    /// `metadata.annotations`.
    pub annotations: BTreeMap<String, String>,
}

/// What the cluster crate read from the CDI DataVolume of the same name as the PVC.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DataVolumeFacts {
    /// `status.phase` (`ImportScheduled`, `ImportInProgress`, `Succeeded`, `Failed`, …).
    pub phase: Option<String>,
    /// `status.progress` (`"45.30%"`), if reported.
    pub progress: Option<String>,
}

/// A namespaced reference to a PVC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PvcRef {
    /// Namespace of the claim.
    pub namespace: String,
    /// Name of the claim.
    pub name: String,
}

/// What the cluster crate read from a CDI DataSource.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DataSourceFacts {
    /// The PVC the DataSource currently points at: `status.source.pvc` if set (the resolved
    /// source), else `spec.source.pvc`. `None` for a snapshot source or an unresolved chain.
    pub pvc: Option<PvcRef>,
}

/// What the cluster showed about the golden disk, reduced to the cases the decision needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GoldenObservation {
    /// The lesson asks for a container disk.
    NotRequested,
    /// The PVC (or the DataSource naming it) does not exist.
    NotFound,
    /// The backend may not read the PVC (or DataSource).
    Forbidden,
    /// The DataSource points at no PVC in the VM's namespace (a snapshot source, another
    /// namespace, or not resolved yet).
    UnresolvedSource,
    /// CDI is still importing into the PVC.
    Importing {
        /// The DataVolume phase, or the importer pod phase annotation, if known.
        phase: Option<String>,
        /// The DataVolume progress (`"45.30%"`), if known.
        progress: Option<String>,
    },
    /// CDI reported the import failed.
    ImportFailed,
    /// The PVC is not bound (`Pending` or `Lost`).
    NotBound {
        /// The PVC phase, if any.
        phase: Option<String>,
    },
    /// The PVC has a deletionTimestamp.
    Deleting,
    /// The PVC cannot be attached on several nodes at once (no `ReadOnlyMany` or
    /// `ReadWriteMany`): VMs on other nodes would hang in attach.
    SingleNode,
    /// The PVC holds another image than the lesson's container disk.
    WrongImage {
        /// The lesson's image.
        expected: String,
        /// The image the PVC records.
        found: String,
    },
    /// Usable: the claim to mount read-only under a per-VM copy-on-write layer.
    Ready {
        /// The resolved PVC name.
        claim: String,
    },
}

/// Why the container disk was chosen. The strings ([`FallbackReason::as_str`], also the serde
/// form) are stable: the session row and the metrics labels store them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[derive(strum::Display, strum::EnumString, strum::IntoStaticStr, strum::EnumCount)]
#[strum(
    serialize_all = "snake_case",
    parse_err_ty = DiskSelectError,
    parse_err_fn = unknown_reason
)]
pub enum FallbackReason {
    /// The lesson asks for a container disk.
    NotRequested,
    /// The golden PVC or DataSource does not exist.
    NotFound,
    /// The backend may not read it.
    Forbidden,
    /// The DataSource points at no PVC in the namespace.
    UnresolvedSource,
    /// CDI is still importing.
    Importing,
    /// CDI's import failed.
    ImportFailed,
    /// The PVC is not bound.
    NotBound,
    /// The PVC is being deleted.
    Deleting,
    /// The PVC is single-node (ReadWriteOnce / ReadWriteOncePod).
    SingleNode,
    /// The PVC holds another image.
    WrongImage,
}

impl FallbackReason {
    /// Every reason, in declaration order (its length is the derived count of variants, so
    /// a new reason cannot be left out).
    pub const ALL: [FallbackReason; <FallbackReason as strum::EnumCount>::COUNT] = [
        Self::NotRequested,
        Self::NotFound,
        Self::Forbidden,
        Self::UnresolvedSource,
        Self::Importing,
        Self::ImportFailed,
        Self::NotBound,
        Self::Deleting,
        Self::SingleNode,
        Self::WrongImage,
    ];

    /// The stable snake_case string.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

fn unknown_reason(s: &str) -> DiskSelectError {
    DiskSelectError::UnknownReason(s.to_owned())
}

/// Which kind of root disk a VM gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[derive(strum::Display, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum DiskKind {
    /// The golden PVC under a per-VM copy-on-write layer.
    Golden,
    /// The lesson's container disk image.
    ContainerDisk,
}

impl DiskKind {
    /// The stable snake_case string (`golden`, `container_disk`).
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// The decision: which root disk, and why.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "disk", rename_all = "snake_case")]
pub enum DiskDecision {
    /// Mount this claim read-only as the base of an `ephemeral` volume.
    Golden {
        /// The PVC name (a DataSource already resolved to its current PVC).
        claim: String,
    },
    /// Boot the lesson's container disk.
    ContainerDisk {
        /// Why the golden disk was not used.
        reason: FallbackReason,
    },
}

impl DiskDecision {
    /// The kind of disk chosen.
    pub const fn kind(&self) -> DiskKind {
        match self {
            Self::Golden { .. } => DiskKind::Golden,
            Self::ContainerDisk { .. } => DiskKind::ContainerDisk,
        }
    }

    /// The fallback reason, `None` for the golden disk.
    pub const fn fallback_reason(&self) -> Option<FallbackReason> {
        match self {
            Self::Golden { .. } => None,
            Self::ContainerDisk { reason } => Some(*reason),
        }
    }

    /// The reason as a stable string for a metrics label: `ready` for the golden disk, else
    /// the [`FallbackReason`] string.
    pub fn reason_str(&self) -> &'static str {
        match self {
            Self::Golden { .. } => "ready",
            Self::ContainerDisk { reason } => reason.as_str(),
        }
    }
}

/// The decision table: golden only when the golden disk is ready, container disk otherwise.
pub fn decide(seen: &GoldenObservation) -> DiskDecision {
    use GoldenObservation as O;
    let reason = match seen {
        O::Ready { claim } => {
            return DiskDecision::Golden {
                claim: claim.clone(),
            };
        }
        O::NotRequested => FallbackReason::NotRequested,
        O::NotFound => FallbackReason::NotFound,
        O::Forbidden => FallbackReason::Forbidden,
        O::UnresolvedSource => FallbackReason::UnresolvedSource,
        O::Importing { .. } => FallbackReason::Importing,
        O::ImportFailed => FallbackReason::ImportFailed,
        O::NotBound { .. } => FallbackReason::NotBound,
        O::Deleting => FallbackReason::Deleting,
        O::SingleNode => FallbackReason::SingleNode,
        O::WrongImage { .. } => FallbackReason::WrongImage,
    };
    DiskDecision::ContainerDisk { reason }
}

/// Resolves a DataSource to the name of the PVC it currently points at (a DataImportCron
/// repoints it at each new import, so resolve at VM creation time). The claim must live in
/// `vm_namespace`: an `ephemeral` volume cannot mount a claim of another namespace.
///
/// On failure, returns the observation to feed to [`decide`] directly.
pub fn resolve_data_source(
    source: &Lookup<DataSourceFacts>,
    vm_namespace: &str,
) -> Result<String, GoldenObservation> {
    match source {
        Lookup::NotFound => Err(GoldenObservation::NotFound),
        Lookup::Forbidden => Err(GoldenObservation::Forbidden),
        Lookup::Found(DataSourceFacts { pvc: Some(pvc) })
            if pvc.namespace == vm_namespace && !pvc.name.is_empty() =>
        {
            Ok(pvc.name.clone())
        }
        Lookup::Found(_) => Err(GoldenObservation::UnresolvedSource),
    }
}

/// Reduces what the cluster showed about the golden PVC (and the DataVolume of the same name,
/// if any) to one observation. The checks, in order — the first that applies wins:
///
/// 1. PVC not found / forbidden → [`NotFound`](GoldenObservation::NotFound) /
///    [`Forbidden`](GoldenObservation::Forbidden).
/// 2. deletionTimestamp set → [`Deleting`](GoldenObservation::Deleting).
/// 3. DataVolume found with a phase other than `Succeeded` → `Failed` gives
///    [`ImportFailed`](GoldenObservation::ImportFailed), any other phase (or none yet)
///    [`Importing`](GoldenObservation::Importing) with phase and progress. A DataVolume that is
///    not found or not readable says nothing (the PVC may have been made without one, or CDI
///    garbage-collected it); the PVC annotation is then the only import evidence.
/// 4. annotation [`ANN_IMPORT_POD_PHASE`] present and not `Succeeded` → likewise.
/// 5. PVC phase other than `Bound` → [`NotBound`](GoldenObservation::NotBound).
/// 6. neither `ReadOnlyMany` nor `ReadWriteMany` among the access modes →
///    [`SingleNode`](GoldenObservation::SingleNode).
/// 7. `expected_image` given and the PVC records another image →
///    [`WrongImage`](GoldenObservation::WrongImage). The recorded image is [`ANN_GOLDEN_IMAGE`],
///    else [`ANN_IMPORT_ENDPOINT`] without its `docker://` scheme. A tag-less reference means
///    `:latest`. A digest-pinned reference (what a DataImportCron imports) matches any
///    reference to the same repository, since a digest cannot be compared with a tag offline:
///    set [`ANN_GOLDEN_IMAGE`] to be exact. A PVC that records no image is accepted (it is the
///    operator's claim, named by the lesson).
/// 8. otherwise → [`Ready`](GoldenObservation::Ready) with the PVC's name.
pub fn observe(
    pvc: &Lookup<PvcFacts>,
    data_volume: &Lookup<DataVolumeFacts>,
    expected_image: Option<&str>,
) -> GoldenObservation {
    let pvc = match pvc {
        Lookup::NotFound => return GoldenObservation::NotFound,
        Lookup::Forbidden => return GoldenObservation::Forbidden,
        Lookup::Found(pvc) => pvc,
    };
    if pvc.being_deleted {
        return GoldenObservation::Deleting;
    }
    if let Lookup::Found(dv) = data_volume
        && dv.phase.as_deref() != Some("Succeeded")
    {
        return import_state(dv.phase.clone(), dv.progress.clone());
    }
    if let Some(phase) = pvc.annotations.get(ANN_IMPORT_POD_PHASE)
        && phase != "Succeeded"
    {
        return import_state(Some(phase.clone()), None);
    }
    if pvc.phase.as_deref() != Some("Bound") {
        return GoldenObservation::NotBound {
            phase: pvc.phase.clone(),
        };
    }
    if !pvc
        .access_modes
        .iter()
        .any(|m| m == "ReadOnlyMany" || m == "ReadWriteMany")
    {
        return GoldenObservation::SingleNode;
    }
    if let (Some(expected), Some(found)) = (expected_image, recorded_image(pvc))
        && !same_image(expected, &found)
    {
        return GoldenObservation::WrongImage {
            expected: expected.to_owned(),
            found,
        };
    }
    GoldenObservation::Ready {
        claim: pvc.name.clone(),
    }
}

fn import_state(phase: Option<String>, progress: Option<String>) -> GoldenObservation {
    if phase.as_deref() == Some("Failed") {
        GoldenObservation::ImportFailed
    } else {
        GoldenObservation::Importing { phase, progress }
    }
}

fn recorded_image(pvc: &PvcFacts) -> Option<String> {
    if let Some(image) = pvc.annotations.get(ANN_GOLDEN_IMAGE) {
        return Some(image.clone());
    }
    let endpoint = pvc.annotations.get(ANN_IMPORT_ENDPOINT)?;
    Some(
        endpoint
            .strip_prefix("docker://")
            .unwrap_or(endpoint)
            .to_owned(),
    )
}

/// Splits an image reference into repository and reference (`:tag` or `@digest`).
fn split_image(image: &str) -> (&str, Reference<'_>) {
    let image = image.strip_prefix("docker://").unwrap_or(image);
    if let Some((repo, digest)) = image.split_once('@') {
        return (repo, Reference::Digest(digest));
    }
    // A ':' after the last '/' is a tag; one before it is a registry port.
    let last_slash = image.rfind('/').map_or(0, |i| i + 1);
    match image[last_slash..].rfind(':') {
        Some(i) => (
            &image[..last_slash + i],
            Reference::Tag(&image[last_slash + i + 1..]),
        ),
        None => (image, Reference::Tag("latest")),
    }
}

#[derive(PartialEq)]
enum Reference<'a> {
    Tag(&'a str),
    Digest(&'a str),
}

fn same_image(a: &str, b: &str) -> bool {
    let (repo_a, ref_a) = split_image(a);
    let (repo_b, ref_b) = split_image(b);
    if repo_a != repo_b {
        return false;
    }
    match (ref_a, ref_b) {
        (Reference::Tag(x), Reference::Tag(y)) => x == y,
        (Reference::Digest(x), Reference::Digest(y)) => x == y,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready_pvc() -> PvcFacts {
        PvcFacts {
            name: "golden-ubuntu".into(),
            phase: Some("Bound".into()),
            access_modes: vec!["ReadOnlyMany".into()],
            being_deleted: false,
            annotations: BTreeMap::new(),
        }
    }

    fn with_ann(mut pvc: PvcFacts, k: &str, v: &str) -> PvcFacts {
        pvc.annotations.insert(k.into(), v.into());
        pvc
    }

    fn dv(phase: &str) -> Lookup<DataVolumeFacts> {
        Lookup::Found(DataVolumeFacts {
            phase: Some(phase.into()),
            progress: Some("45.30%".into()),
        })
    }

    /// Every observation, with the decision the table must give. The `match` below makes
    /// adding an observation without a row a compile error.
    #[test]
    fn decision_table_row_by_row() {
        use GoldenObservation as O;
        let rows: Vec<(O, DiskDecision)> = vec![
            (
                O::Ready {
                    claim: "golden-x-abc".into(),
                },
                DiskDecision::Golden {
                    claim: "golden-x-abc".into(),
                },
            ),
            (O::NotRequested, fallback(FallbackReason::NotRequested)),
            (O::NotFound, fallback(FallbackReason::NotFound)),
            (O::Forbidden, fallback(FallbackReason::Forbidden)),
            (
                O::UnresolvedSource,
                fallback(FallbackReason::UnresolvedSource),
            ),
            (
                O::Importing {
                    phase: Some("ImportInProgress".into()),
                    progress: Some("12.00%".into()),
                },
                fallback(FallbackReason::Importing),
            ),
            (
                O::Importing {
                    phase: None,
                    progress: None,
                },
                fallback(FallbackReason::Importing),
            ),
            (O::ImportFailed, fallback(FallbackReason::ImportFailed)),
            (
                O::NotBound {
                    phase: Some("Pending".into()),
                },
                fallback(FallbackReason::NotBound),
            ),
            (O::Deleting, fallback(FallbackReason::Deleting)),
            (O::SingleNode, fallback(FallbackReason::SingleNode)),
            (
                O::WrongImage {
                    expected: "a:1".into(),
                    found: "b:1".into(),
                },
                fallback(FallbackReason::WrongImage),
            ),
        ];
        let mut reasons_seen = std::collections::BTreeSet::new();
        for (seen, want) in &rows {
            // Exhaustiveness guard: a new variant must get a row above.
            match seen {
                O::NotRequested
                | O::NotFound
                | O::Forbidden
                | O::UnresolvedSource
                | O::Importing { .. }
                | O::ImportFailed
                | O::NotBound { .. }
                | O::Deleting
                | O::SingleNode
                | O::WrongImage { .. }
                | O::Ready { .. } => {}
            }
            let got = decide(seen);
            assert_eq!(&got, want, "{seen:?}");
            if let Some(r) = got.fallback_reason() {
                reasons_seen.insert(r);
            }
        }
        assert_eq!(
            reasons_seen.into_iter().collect::<Vec<_>>(),
            FallbackReason::ALL.to_vec(),
            "every fallback reason is reachable"
        );
    }

    fn fallback(reason: FallbackReason) -> DiskDecision {
        DiskDecision::ContainerDisk { reason }
    }

    #[test]
    fn only_ready_gives_golden() {
        let golden = decide(&GoldenObservation::Ready { claim: "c".into() });
        assert_eq!(golden.kind(), DiskKind::Golden);
        assert_eq!(golden.reason_str(), "ready");
        assert_eq!(golden.fallback_reason(), None);
    }

    #[test]
    fn reason_strings_are_stable_and_round_trip() {
        let strings: Vec<&str> = FallbackReason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(
            strings,
            [
                "not_requested",
                "not_found",
                "forbidden",
                "unresolved_source",
                "importing",
                "import_failed",
                "not_bound",
                "deleting",
                "single_node",
                "wrong_image"
            ]
        );
        for r in FallbackReason::ALL {
            assert_eq!(r.as_str().parse::<FallbackReason>(), Ok(r));
            assert_eq!(
                serde_json::to_string(&r).unwrap(),
                format!("\"{}\"", r.as_str())
            );
        }
        assert_eq!(
            "golden".parse::<FallbackReason>(),
            Err(DiskSelectError::UnknownReason("golden".into()))
        );
        assert_eq!(DiskKind::ContainerDisk.as_str(), "container_disk");
        let json = serde_json::to_string(&fallback(FallbackReason::SingleNode)).unwrap();
        assert_eq!(json, r#"{"disk":"container_disk","reason":"single_node"}"#);
    }

    #[test]
    fn observe_maps_cluster_facts() {
        use GoldenObservation as O;
        let none = Lookup::<DataVolumeFacts>::NotFound;
        let found = |p: PvcFacts| Lookup::Found(p);
        let ready = O::Ready {
            claim: "golden-ubuntu".into(),
        };
        let rows: Vec<(&str, Lookup<PvcFacts>, Lookup<DataVolumeFacts>, O)> = vec![
            (
                "plain bound ROX",
                found(ready_pvc()),
                none.clone(),
                ready.clone(),
            ),
            (
                "RWX also serves many nodes",
                found(PvcFacts {
                    access_modes: vec!["ReadWriteMany".into()],
                    ..ready_pvc()
                }),
                none.clone(),
                ready.clone(),
            ),
            ("missing", Lookup::NotFound, none.clone(), O::NotFound),
            ("forbidden", Lookup::Forbidden, none.clone(), O::Forbidden),
            (
                "deleting wins over everything",
                found(PvcFacts {
                    being_deleted: true,
                    phase: Some("Pending".into()),
                    access_modes: vec![],
                    ..ready_pvc()
                }),
                dv("ImportInProgress"),
                O::Deleting,
            ),
            (
                "dv importing",
                found(ready_pvc()),
                dv("ImportInProgress"),
                O::Importing {
                    phase: Some("ImportInProgress".into()),
                    progress: Some("45.30%".into()),
                },
            ),
            (
                "dv without phase yet",
                found(ready_pvc()),
                Lookup::Found(DataVolumeFacts::default()),
                O::Importing {
                    phase: None,
                    progress: None,
                },
            ),
            (
                "dv failed",
                found(ready_pvc()),
                dv("Failed"),
                O::ImportFailed,
            ),
            (
                "dv succeeded",
                found(ready_pvc()),
                dv("Succeeded"),
                ready.clone(),
            ),
            (
                "dv forbidden says nothing",
                found(ready_pvc()),
                Lookup::Forbidden,
                ready.clone(),
            ),
            (
                "importer pod running",
                found(with_ann(ready_pvc(), ANN_IMPORT_POD_PHASE, "Running")),
                none.clone(),
                O::Importing {
                    phase: Some("Running".into()),
                    progress: None,
                },
            ),
            (
                "importer pod failed",
                found(with_ann(ready_pvc(), ANN_IMPORT_POD_PHASE, "Failed")),
                none.clone(),
                O::ImportFailed,
            ),
            (
                "importer pod succeeded",
                found(with_ann(ready_pvc(), ANN_IMPORT_POD_PHASE, "Succeeded")),
                none.clone(),
                ready.clone(),
            ),
            (
                "pending",
                found(PvcFacts {
                    phase: Some("Pending".into()),
                    ..ready_pvc()
                }),
                none.clone(),
                O::NotBound {
                    phase: Some("Pending".into()),
                },
            ),
            (
                "no phase",
                found(PvcFacts {
                    phase: None,
                    ..ready_pvc()
                }),
                none.clone(),
                O::NotBound { phase: None },
            ),
            (
                "rwo",
                found(PvcFacts {
                    access_modes: vec!["ReadWriteOnce".into()],
                    ..ready_pvc()
                }),
                none.clone(),
                O::SingleNode,
            ),
            (
                "rwop",
                found(PvcFacts {
                    access_modes: vec!["ReadWriteOncePod".into()],
                    ..ready_pvc()
                }),
                none.clone(),
                O::SingleNode,
            ),
            (
                "no access modes",
                found(PvcFacts {
                    access_modes: vec![],
                    ..ready_pvc()
                }),
                none.clone(),
                O::SingleNode,
            ),
        ];
        for (what, pvc, dv, want) in rows {
            assert_eq!(observe(&pvc, &dv, None), want, "{what}");
        }
    }

    #[test]
    fn image_check() {
        let expected = "quay.io/containerdisks/ubuntu:22.04";
        let check = |pvc: PvcFacts| observe(&Lookup::Found(pvc), &Lookup::NotFound, Some(expected));
        let ready = GoldenObservation::Ready {
            claim: "golden-ubuntu".into(),
        };
        let endpoint = |v: &str| with_ann(ready_pvc(), ANN_IMPORT_ENDPOINT, v);
        assert_eq!(check(ready_pvc()), ready, "no recorded image");
        assert_eq!(
            check(endpoint("docker://quay.io/containerdisks/ubuntu:22.04")),
            ready
        );
        assert_eq!(
            check(endpoint(
                "docker://quay.io/containerdisks/ubuntu@sha256:abc"
            )),
            ready,
            "digest-pinned import of the same repository"
        );
        assert_eq!(
            check(endpoint("docker://quay.io/containerdisks/ubuntu:24.04")),
            GoldenObservation::WrongImage {
                expected: expected.into(),
                found: "quay.io/containerdisks/ubuntu:24.04".into(),
            }
        );
        assert!(matches!(
            check(endpoint("docker://quay.io/containerdisks/fedora:22.04")),
            GoldenObservation::WrongImage { .. }
        ));
        assert!(
            matches!(
                check(endpoint("docker://quay.io/containerdisks/ubuntu")),
                GoldenObservation::WrongImage { .. }
            ),
            "no tag means latest"
        );
        // The explicit annotation wins over the import endpoint.
        let both = with_ann(
            endpoint("docker://quay.io/containerdisks/fedora:40"),
            ANN_GOLDEN_IMAGE,
            expected,
        );
        assert_eq!(check(both), ready);
        // A registry port is not a tag.
        assert!(same_image("reg:5000/os", "reg:5000/os:latest"));
        assert!(!same_image("reg:5000/os", "reg:5001/os"));
    }

    #[test]
    fn data_source_resolution() {
        let ds = |ns: &str, name: &str| {
            Lookup::Found(DataSourceFacts {
                pvc: Some(PvcRef {
                    namespace: ns.into(),
                    name: name.into(),
                }),
            })
        };
        assert_eq!(
            resolve_data_source(&ds("labs", "ubuntu-8f3a2c"), "labs"),
            Ok("ubuntu-8f3a2c".into())
        );
        assert_eq!(
            resolve_data_source(&ds("other", "ubuntu-8f3a2c"), "labs"),
            Err(GoldenObservation::UnresolvedSource)
        );
        assert_eq!(
            resolve_data_source(&ds("labs", ""), "labs"),
            Err(GoldenObservation::UnresolvedSource)
        );
        assert_eq!(
            resolve_data_source(&Lookup::Found(DataSourceFacts::default()), "labs"),
            Err(GoldenObservation::UnresolvedSource)
        );
        assert_eq!(
            resolve_data_source(&Lookup::NotFound, "labs"),
            Err(GoldenObservation::NotFound)
        );
        assert_eq!(
            resolve_data_source(&Lookup::Forbidden, "labs"),
            Err(GoldenObservation::Forbidden)
        );
    }
}
