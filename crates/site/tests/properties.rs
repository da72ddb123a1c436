//! Invariants of placement over arbitrary sites and starts.

use std::collections::BTreeSet;

use proptest::prelude::*;
use proptest::sample::subsequence;
use ttlab_site::{Placement, Reachability, SiteLabel, SiteName, SiteState, Wanted, place};

const NAMES: [&str; 6] = ["campus-a", "campus-b", "campus-c", "eu-1", "eu-2", "home"];
const LABELS: [&str; 3] = ["eu", "gpu", "kvm-large"];

fn labels() -> impl Strategy<Value = BTreeSet<SiteLabel>> {
    subsequence(LABELS.to_vec(), 0..=LABELS.len())
        .prop_map(|l| l.into_iter().map(|s| s.parse().unwrap()).collect())
}

fn wanted() -> impl Strategy<Value = Wanted> {
    (
        subsequence(LABELS.to_vec(), 0..=1).prop_map(|l| {
            l.into_iter()
                .map(|s| s.parse().unwrap())
                .collect::<BTreeSet<_>>()
        }),
        any::<bool>(),
    )
        .prop_map(|(labels, golden_disk)| Wanted {
            labels,
            golden_disk,
        })
}

fn state(name: &'static str) -> impl Strategy<Value = SiteState> {
    (
        labels(),
        0..=4u32,
        prop_oneof![
            3 => Just(Reachability::Reachable),
            1 => Just(Reachability::Unreachable("timed out".into())),
        ],
        1..=8u32,
        0..=10u32,
        0..=3u32,
        any::<bool>(),
    )
        .prop_map(
            move |(labels, weight, reachable, vm_limit, in_use, vms_needed, golden_ready)| {
                SiteState {
                    name: name.parse().unwrap(),
                    labels,
                    weight,
                    reachable,
                    vm_limit,
                    in_use,
                    vms_needed,
                    golden_ready,
                }
            },
        )
}

/// Up to six sites with distinct names, in any order.
fn sites() -> impl Strategy<Value = Vec<SiteState>> {
    subsequence(NAMES.to_vec(), 0..=NAMES.len())
        .prop_flat_map(|names| names.into_iter().map(state).collect::<Vec<_>>())
        .prop_shuffle()
}

/// Eligibility, written out again from the rules rather than asked of the crate.
fn eligible(wanted: &Wanted, s: &SiteState) -> bool {
    wanted.labels.is_subset(&s.labels)
        && s.reachable == Reachability::Reachable
        && s.vm_limit.saturating_sub(s.in_use) >= s.vms_needed
}

fn by_name<'a>(sites: &'a [SiteState], name: &SiteName) -> &'a SiteState {
    sites.iter().find(|s| &s.name == name).unwrap()
}

proptest! {
    #[test]
    fn never_picks_an_ineligible_site(wanted in wanted(), sites in sites()) {
        if let Some(name) = place(&wanted, &sites).site() {
            let chosen = by_name(&sites, name);
            prop_assert!(eligible(&wanted, chosen), "{chosen:?}");
        }
    }

    #[test]
    fn picks_a_site_whenever_one_is_eligible(wanted in wanted(), sites in sites()) {
        let any_eligible = sites.iter().any(|s| eligible(&wanted, s));
        match place(&wanted, &sites) {
            Placement::Chosen { .. } => prop_assert!(any_eligible),
            Placement::NoSite { passed_over } => {
                prop_assert!(!any_eligible);
                // Every site is accounted for, once.
                let told: BTreeSet<&SiteName> = passed_over.iter().map(|p| &p.site).collect();
                let all: BTreeSet<&SiteName> = sites.iter().map(|s| &s.name).collect();
                prop_assert_eq!(told.len(), passed_over.len());
                prop_assert_eq!(told, all);
            }
        }
    }

    #[test]
    fn no_eligible_site_is_better_than_the_one_picked(wanted in wanted(), sites in sites()) {
        let Some(name) = place(&wanted, &sites).site().cloned() else {
            return Ok(());
        };
        let key = |s: &SiteState| {
            let golden = wanted.golden_disk && s.golden_ready;
            let score = u64::from(s.vm_limit.saturating_sub(s.in_use)) * u64::from(s.weight);
            (golden, score)
        };
        let chosen = by_name(&sites, &name);
        for other in sites.iter().filter(|s| eligible(&wanted, s) && s.name != name) {
            prop_assert!(
                key(other) < key(chosen) || (key(other) == key(chosen) && name < other.name),
                "{other:?} beats {chosen:?}"
            );
        }
    }

    #[test]
    fn the_order_of_the_sites_does_not_matter(
        wanted in wanted(),
        (sites, shuffled) in sites().prop_flat_map(|s| (Just(s.clone()), Just(s).prop_shuffle())),
    ) {
        prop_assert_eq!(place(&wanted, &sites), place(&wanted, &shuffled));
    }
}
