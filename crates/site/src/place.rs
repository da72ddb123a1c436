use std::cmp::Ordering;
use std::collections::BTreeSet;
use std::fmt;

use ttlab_model::SiteName;

use crate::{Site, SiteLabel};

/// What a start asks of a site.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Wanted {
    /// The labels the lesson requires: a site must carry every one of them.
    pub labels: BTreeSet<SiteLabel>,
    /// Whether the lesson boots from a golden disk (then a site where it is ready is
    /// preferred).
    pub golden_disk: bool,
}

/// Whether a site's API server answered.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Reachability {
    /// It answered.
    Reachable,
    /// It did not; the reason is shown to operators (`timed out`, `401 Unauthorized`).
    Unreachable(String),
}

/// What placement knows of one site at the moment of a start. Names are expected to be
/// unique in one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SiteState {
    /// The site.
    pub name: SiteName,
    /// The labels it carries.
    pub labels: BTreeSet<SiteLabel>,
    /// Its share: free places count this many times (a weight of 0 makes its score 0).
    pub weight: u32,
    /// Whether its API server answered.
    pub reachable: Reachability,
    /// The most VMs ttlab may run there.
    pub vm_limit: u32,
    /// VM places taken there now.
    pub in_use: u32,
    /// The VMs this start would run there.
    pub vms_needed: u32,
    /// Whether the lesson's golden disk is ready there.
    pub golden_ready: bool,
}

impl SiteState {
    /// The state of a configured site: its name, labels, weight and limit from `site`, the
    /// rest observed.
    pub fn of(
        site: &Site,
        reachable: Reachability,
        in_use: u32,
        vms_needed: u32,
        golden_ready: bool,
    ) -> Self {
        Self {
            name: site.name.clone(),
            labels: site.labels.clone(),
            weight: site.weight.get(),
            reachable,
            vm_limit: site.vm_limit.get(),
            in_use,
            vms_needed,
            golden_ready,
        }
    }

    /// Places not taken: `vm_limit - in_use`, or 0 when over the limit.
    pub fn free(&self) -> u32 {
        self.vm_limit.saturating_sub(self.in_use)
    }

    /// Free places times weight: the larger, the more a site is preferred.
    pub fn score(&self) -> u64 {
        u64::from(self.free()) * u64::from(self.weight)
    }

    /// Why this site cannot take the start, or `None` if it can (it is eligible). Labels are
    /// checked first, then reachability, then headroom.
    pub fn pass_reason(&self, wanted: &Wanted) -> Option<PassReason> {
        let missing: Vec<SiteLabel> = wanted.labels.difference(&self.labels).cloned().collect();
        if !missing.is_empty() {
            return Some(PassReason::LacksLabels(missing));
        }
        if let Reachability::Unreachable(reason) = &self.reachable {
            return Some(PassReason::Unreachable(reason.clone()));
        }
        if self.free() < self.vms_needed {
            return Some(PassReason::Full {
                in_use: self.in_use,
                vm_limit: self.vm_limit,
                vms_needed: self.vms_needed,
            });
        }
        None
    }
}

/// Why a site was passed over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PassReason {
    /// It lacks these labels the lesson requires (sorted).
    LacksLabels(Vec<SiteLabel>),
    /// Its API server did not answer, for this reason.
    Unreachable(String),
    /// It has fewer free places than the start needs.
    Full {
        /// Places taken.
        in_use: u32,
        /// Its limit.
        vm_limit: u32,
        /// Places the start needs.
        vms_needed: u32,
    },
}

impl fmt::Display for PassReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PassReason::LacksLabels(labels) => {
                let s = if labels.len() == 1 { "" } else { "s" };
                write!(f, "lacks label{s} ")?;
                write_list(f, labels)
            }
            PassReason::Unreachable(reason) => write!(f, "unreachable ({reason})"),
            PassReason::Full {
                in_use, vm_limit, ..
            } if in_use >= vm_limit => write!(f, "full ({in_use} of {vm_limit})"),
            PassReason::Full {
                in_use,
                vm_limit,
                vms_needed,
            } => write!(f, "full ({in_use} of {vm_limit}, {vms_needed} needed)"),
        }
    }
}

/// A site passed over, and why: displays as `campus-b: full (8 of 8)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PassedOver {
    /// The site.
    pub site: SiteName,
    /// Why.
    pub reason: PassReason,
}

impl fmt::Display for PassedOver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.site, self.reason)
    }
}

/// Where a start goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// This site takes the whole session.
    Chosen {
        /// The site.
        site: SiteName,
        /// One line for operators: its free places, weight and score, its golden disk (when
        /// the lesson uses one), the other eligible sites it beat, the sites passed over.
        why: String,
    },
    /// No site can take the start.
    NoSite {
        /// Every site, in name order, with why it was passed over (empty when there was no
        /// site at all).
        passed_over: Vec<PassedOver>,
    },
}

impl Placement {
    /// The chosen site, if any.
    pub fn site(&self) -> Option<&SiteName> {
        match self {
            Placement::Chosen { site, .. } => Some(site),
            Placement::NoSite { .. } => None,
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Chosen { why, .. } => f.write_str(why),
            Placement::NoSite { passed_over } if passed_over.is_empty() => {
                f.write_str("no site: none is configured")
            }
            Placement::NoSite { passed_over } => {
                f.write_str("no site: ")?;
                for (i, p) in passed_over.iter().enumerate() {
                    if i > 0 {
                        f.write_str("; ")?;
                    }
                    write!(f, "{p}")?;
                }
                Ok(())
            }
        }
    }
}

/// Picks the site for a start. Eligible: carries every label `wanted` requires, reachable,
/// and free places (`vm_limit - in_use`) at least the VMs needed. Among the eligible: where
/// the golden disk is ready first (when the lesson uses one), then the largest free places ×
/// weight, then the first name. The answer does not depend on the order of `sites`.
pub fn place(wanted: &Wanted, sites: &[SiteState]) -> Placement {
    let mut eligible: Vec<&SiteState> = Vec::new();
    let mut passed_over: Vec<PassedOver> = Vec::new();
    for state in sites {
        match state.pass_reason(wanted) {
            None => eligible.push(state),
            Some(reason) => passed_over.push(PassedOver {
                site: state.name.clone(),
                reason,
            }),
        }
    }
    passed_over.sort_by(|a, b| a.site.cmp(&b.site));
    eligible.sort_by(|a, b| rank(wanted, a, b));
    let Some((best, others)) = eligible.split_first() else {
        return Placement::NoSite { passed_over };
    };
    let mut why = format!("{}: {}", best.name, describe(wanted, best));
    if !others.is_empty() {
        why.push_str("; ahead of ");
        for (i, other) in others.iter().enumerate() {
            if i > 0 {
                why.push_str(", ");
            }
            why.push_str(&format!("{} ({})", other.name, describe(wanted, other)));
        }
    }
    if !passed_over.is_empty() {
        why.push_str("; passed over ");
        for (i, p) in passed_over.iter().enumerate() {
            if i > 0 {
                why.push_str("; ");
            }
            why.push_str(&p.to_string());
        }
    }
    Placement::Chosen {
        site: best.name.clone(),
        why,
    }
}

/// The order of preference: `Less` means `a` is preferred.
fn rank(wanted: &Wanted, a: &SiteState, b: &SiteState) -> Ordering {
    let golden = |s: &SiteState| wanted.golden_disk && s.golden_ready;
    golden(b)
        .cmp(&golden(a))
        .then_with(|| b.score().cmp(&a.score()))
        .then_with(|| a.name.cmp(&b.name))
}

/// `5 of 8 free × weight 2 = 10, golden disk ready`.
fn describe(wanted: &Wanted, s: &SiteState) -> String {
    let mut out = format!(
        "{} of {} free × weight {} = {}",
        s.free(),
        s.vm_limit,
        s.weight,
        s.score()
    );
    if wanted.golden_disk {
        out.push_str(if s.golden_ready {
            ", golden disk ready"
        } else {
            ", golden disk not ready"
        });
    }
    out
}

/// Why no site of `sites` can ever run a lesson that requires `labels`, whatever their
/// state: the labels none of them offers, or, when each is offered somewhere but no one site
/// carries them all, what each site lacks. `None` when a site carries every one (with no
/// label required, any site).
pub fn labels_nowhere<'a>(
    labels: &BTreeSet<SiteLabel>,
    sites: impl IntoIterator<Item = &'a Site> + Clone,
) -> Option<String> {
    if sites
        .clone()
        .into_iter()
        .any(|s| labels.is_subset(&s.labels))
    {
        return None;
    }
    let offered: BTreeSet<&SiteLabel> = sites
        .clone()
        .into_iter()
        .flat_map(|s| s.labels.iter())
        .collect();
    let nowhere: Vec<&str> = labels
        .iter()
        .filter(|l| !offered.contains(l))
        .map(SiteLabel::as_str)
        .collect();
    if !nowhere.is_empty() {
        let s = if nowhere.len() == 1 { "" } else { "s" };
        return Some(format!(
            "no site offers the site label{s} {} this lesson requires",
            nowhere.join(", ")
        ));
    }
    let lacks: Vec<String> = sites
        .into_iter()
        .map(|s| {
            let missing: Vec<&str> = labels
                .difference(&s.labels)
                .map(SiteLabel::as_str)
                .collect();
            format!("{} lacks {}", s.name, missing.join(", "))
        })
        .collect();
    Some(format!(
        "no site carries every site label this lesson requires: {}",
        lacks.join("; ")
    ))
}

fn write_list(f: &mut fmt::Formatter<'_>, items: &[impl fmt::Display]) -> fmt::Result {
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            f.write_str(", ")?;
        }
        write!(f, "{item}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn label(s: &str) -> SiteLabel {
        s.parse().unwrap()
    }

    fn labels(list: &[&str]) -> BTreeSet<SiteLabel> {
        list.iter().map(|s| label(s)).collect()
    }

    /// A reachable site with 8 places, none taken, weight 1, no labels; the start needs 1 VM.
    fn state(name: &str) -> SiteState {
        SiteState {
            name: name.parse().unwrap(),
            labels: BTreeSet::new(),
            weight: 1,
            reachable: Reachability::Reachable,
            vm_limit: 8,
            in_use: 0,
            vms_needed: 1,
            golden_ready: false,
        }
    }

    fn chosen(placement: &Placement) -> &str {
        placement.site().map_or("<none>", SiteName::as_str)
    }

    fn no_site(placement: &Placement) -> Vec<String> {
        match placement {
            Placement::NoSite { passed_over } => {
                passed_over.iter().map(ToString::to_string).collect()
            }
            Placement::Chosen { why, .. } => panic!("chose: {why}"),
        }
    }

    #[test]
    fn a_site_lacking_a_required_label_is_passed_over() {
        let wanted = Wanted {
            labels: labels(&["kvm-large"]),
            golden_disk: false,
        };
        let c = state("campus-c");
        assert_eq!(
            no_site(&place(&wanted, std::slice::from_ref(&c))),
            ["campus-c: lacks label kvm-large"]
        );

        let both = Wanted {
            labels: labels(&["kvm-large", "eu"]),
            golden_disk: false,
        };
        assert_eq!(
            no_site(&place(&both, std::slice::from_ref(&c))),
            ["campus-c: lacks labels eu, kvm-large"]
        );

        let mut d = state("campus-d");
        d.labels = labels(&["eu", "kvm-large", "gpu"]);
        assert_eq!(chosen(&place(&both, &[c, d])), "campus-d");
    }

    #[test]
    fn an_unreachable_site_is_passed_over_with_its_reason() {
        let mut a = state("campus-a");
        a.reachable = Reachability::Unreachable("timed out".into());
        assert_eq!(
            no_site(&place(&Wanted::default(), &[a.clone()])),
            ["campus-a: unreachable (timed out)"]
        );
        assert_eq!(
            chosen(&place(&Wanted::default(), &[a, state("campus-b")])),
            "campus-b"
        );
    }

    #[test]
    fn a_site_without_room_for_every_vm_is_passed_over() {
        let mut full = state("campus-b");
        full.in_use = 8;
        assert_eq!(
            no_site(&place(&Wanted::default(), &[full.clone()])),
            ["campus-b: full (8 of 8)"]
        );

        // Seven taken: room for one VM, not for a two-VM lab.
        let mut seven = state("campus-b");
        seven.in_use = 7;
        assert_eq!(
            chosen(&place(&Wanted::default(), &[seven.clone()])),
            "campus-b"
        );
        seven.vms_needed = 2;
        assert_eq!(
            no_site(&place(&Wanted::default(), &[seven])),
            ["campus-b: full (7 of 8, 2 needed)"]
        );

        // Over the limit (the limit was lowered): no room, counted as full.
        full.in_use = 9;
        assert_eq!(full.free(), 0);
        assert_eq!(
            no_site(&place(&Wanted::default(), &[full.clone()])),
            ["campus-b: full (9 of 8)"]
        );

        // A start that needs no VM fits anywhere reachable.
        full.vms_needed = 0;
        assert_eq!(chosen(&place(&Wanted::default(), &[full])), "campus-b");
    }

    #[test]
    fn labels_are_told_before_reachability_and_reachability_before_room() {
        let wanted = Wanted {
            labels: labels(&["eu"]),
            golden_disk: false,
        };
        let mut s = state("campus-a");
        s.reachable = Reachability::Unreachable("connection refused".into());
        s.in_use = 8;
        assert!(matches!(
            s.pass_reason(&wanted),
            Some(PassReason::LacksLabels(_))
        ));
        assert!(matches!(
            s.pass_reason(&Wanted::default()),
            Some(PassReason::Unreachable(_))
        ));
        s.reachable = Reachability::Reachable;
        assert!(matches!(
            s.pass_reason(&Wanted::default()),
            Some(PassReason::Full { .. })
        ));
        s.in_use = 0;
        assert_eq!(s.pass_reason(&Wanted::default()), None);
    }

    #[test]
    fn a_ready_golden_disk_comes_first_when_the_lesson_uses_one() {
        let mut roomy = state("campus-a");
        roomy.weight = 4;
        let mut golden = state("campus-b");
        golden.in_use = 7;
        golden.golden_ready = true;
        let sites = [roomy, golden];

        let uses_golden = Wanted {
            labels: BTreeSet::new(),
            golden_disk: true,
        };
        let placement = place(&uses_golden, &sites);
        assert_eq!(chosen(&placement), "campus-b");
        assert_eq!(
            placement.to_string(),
            "campus-b: 1 of 8 free × weight 1 = 1, golden disk ready; ahead of campus-a \
             (8 of 8 free × weight 4 = 32, golden disk not ready)"
        );

        // A lesson on a container disk does not care where golden disks are ready.
        assert_eq!(chosen(&place(&Wanted::default(), &sites)), "campus-a");
    }

    #[test]
    fn the_most_free_places_times_weight_wins() {
        let mut a = state("campus-a");
        a.in_use = 2; // 6 × 1
        let mut b = state("campus-b");
        b.in_use = 5; // 3 × 3
        b.weight = 3;
        let mut c = state("campus-c");
        c.in_use = 1; // 7 × 1
        let placement = place(&Wanted::default(), &[a, b, c]);
        assert_eq!(chosen(&placement), "campus-b");
        assert_eq!(
            placement.to_string(),
            "campus-b: 3 of 8 free × weight 3 = 9; ahead of campus-c (7 of 8 free × weight 1 = 7), \
             campus-a (6 of 8 free × weight 1 = 6)"
        );
    }

    #[test]
    fn equal_sites_go_by_name() {
        let sites = [state("campus-c"), state("campus-a"), state("campus-b")];
        assert_eq!(chosen(&place(&Wanted::default(), &sites)), "campus-a");

        // Golden readiness and score tie too.
        let wanted = Wanted {
            labels: BTreeSet::new(),
            golden_disk: true,
        };
        let sites = sites.map(|mut s| {
            s.golden_ready = true;
            s
        });
        assert_eq!(chosen(&place(&wanted, &sites)), "campus-a");
    }

    #[test]
    fn the_reason_for_a_choice_names_the_sites_passed_over() {
        let mut down = state("campus-b");
        down.reachable = Reachability::Unreachable("timed out".into());
        let mut full = state("campus-c");
        full.in_use = 8;
        let placement = place(&Wanted::default(), &[full, down, state("campus-a")]);
        assert_eq!(
            placement,
            Placement::Chosen {
                site: "campus-a".parse().unwrap(),
                why: "campus-a: 8 of 8 free × weight 1 = 8; passed over campus-b: unreachable \
                      (timed out); campus-c: full (8 of 8)"
                    .into(),
            }
        );
    }

    #[test]
    fn no_site_lists_every_site_in_name_order() {
        let mut b = state("campus-b");
        b.in_use = 8;
        let mut a = state("campus-a");
        a.reachable = Reachability::Unreachable("timed out".into());
        let c = state("campus-c");
        let wanted = Wanted {
            labels: labels(&["kvm-large"]),
            golden_disk: true,
        };
        let mut c_large = c.clone();
        c_large.labels = labels(&["kvm-large"]);
        c_large.reachable = Reachability::Unreachable("401 Unauthorized".into());
        let placement = place(&wanted, &[c, b.clone(), a.clone()]);
        assert_eq!(
            placement.to_string(),
            "no site: campus-a: lacks label kvm-large; campus-b: lacks label kvm-large; \
             campus-c: lacks label kvm-large"
        );
        let placement = place(&Wanted::default(), &[c_large, b, a]);
        assert_eq!(
            no_site(&placement),
            [
                "campus-a: unreachable (timed out)",
                "campus-b: full (8 of 8)",
                "campus-c: unreachable (401 Unauthorized)",
            ]
        );
    }

    #[test]
    fn a_lesson_no_site_can_run_is_told_by_the_labels_missing() {
        let config = crate::SitesConfig::parse(
            "sites:\n  - {name: campus-a, in_cluster: true, namespace: a, vm_limit: 8, \
             labels: [eu]}\n  - {name: campus-b, kubeconfig: /b, namespace: b, vm_limit: 8, \
             labels: [kvm-large]}\n",
        )
        .unwrap();
        let sites = config.sites();
        assert_eq!(labels_nowhere(&BTreeSet::new(), sites), None);
        assert_eq!(labels_nowhere(&labels(&["kvm-large"]), sites), None);
        assert_eq!(
            labels_nowhere(&labels(&["gpu"]), sites).as_deref(),
            Some("no site offers the site label gpu this lesson requires")
        );
        assert_eq!(
            labels_nowhere(&labels(&["gpu", "eu", "arm"]), sites).as_deref(),
            Some("no site offers the site labels arm, gpu this lesson requires")
        );
        assert_eq!(
            labels_nowhere(&labels(&["eu", "kvm-large"]), sites).as_deref(),
            Some(
                "no site carries every site label this lesson requires: campus-a lacks \
                 kvm-large; campus-b lacks eu"
            )
        );
        assert_eq!(
            labels_nowhere(&labels(&["eu"]), &[]).as_deref(),
            Some("no site offers the site label eu this lesson requires")
        );
    }

    #[test]
    fn no_site_at_all_is_no_placement() {
        let placement = place(&Wanted::default(), &[]);
        assert_eq!(
            placement,
            Placement::NoSite {
                passed_over: Vec::new()
            }
        );
        assert_eq!(placement.to_string(), "no site: none is configured");
    }

    #[test]
    fn a_configured_site_gives_its_state() {
        let config = crate::SitesConfig::parse(
            "sites:\n  - {name: campus-a, in_cluster: true, namespace: a, vm_limit: 8, \
             labels: [eu], weight: 2}\n",
        )
        .unwrap();
        let s = SiteState::of(&config.sites()[0], Reachability::Reachable, 3, 2, true);
        assert_eq!(
            s,
            SiteState {
                name: "campus-a".parse().unwrap(),
                labels: labels(&["eu"]),
                weight: 2,
                reachable: Reachability::Reachable,
                vm_limit: 8,
                in_use: 3,
                vms_needed: 2,
                golden_ready: true,
            }
        );
        assert_eq!((s.free(), s.score()), (5, 10));
    }
}
