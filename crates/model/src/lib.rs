//! The vocabulary every ttlab crate shares, and nothing else: typed ids (a [`SessionId`] is
//! not a [`UserId`] nor a [`ClassId`]), the session [`SessionStatus`] machine with its allowed
//! transitions, the lab [`Runtime`], the deployment [`EnvName`], the [`SiteName`] of a place
//! VMs run with its [`SiteLabel`]s and [`NamespaceName`], the Kubernetes [`labels`] that mark
//! what ttlab created, and the Kubernetes resource [`Quantity`] (exact, for memory sizes and
//! quota sums) that lessons, manifests and the simulators read.
//!
//! It owns no I/O, no clock and no policy: lifespans live in `ttlab-lifespan`, persistence in
//! `ttlab-store`, manifests in `ttlab-vm-manifest`. Every constructor validates, so a value of
//! one of these types is always well formed.
//!
//! ```
//! use ttlab_model::{EnvName, SessionStatus};
//!
//! let env: EnvName = "prod".parse().unwrap();
//! assert_eq!(env.as_str(), "prod");
//! assert!(SessionStatus::Running.can_become(SessionStatus::Finishing));
//! assert!(!SessionStatus::Expired.can_become(SessionStatus::Running));
//! assert!("Prod!".parse::<EnvName>().is_err());
//! ```

mod error;
mod ids;
pub mod labels;
mod names;
mod quantity;
mod status;

pub use error::ModelError;
pub use ids::{ClassId, SessionId, UserId};
pub use names::{EnvName, LessonId, NamespaceName, NodeName, SiteLabel, SiteName};
pub use quantity::{
    MAX_QUANTITY_DIGITS, MAX_QUANTITY_UNITS, QUANTITY_EXPONENTS, Quantity, QuantityFault,
    QuantityParts, Suffix,
};
pub use status::{FinalStatus, Runtime, SessionStatus};
