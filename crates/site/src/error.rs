use std::fmt;

use ttlab_model::SiteName;

/// Which site an error is about: by its name, or by its 1-based position in the file when
/// the name itself is missing or not a valid [`SiteName`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SiteRef {
    /// The site has a valid name.
    Named(SiteName),
    /// The site's name is missing or invalid: its 1-based position in the `sites` list.
    Position(usize),
}

impl fmt::Display for SiteRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SiteRef::Named(name) => write!(f, "site `{name}`"),
            SiteRef::Position(n) => write!(f, "site #{n}"),
        }
    }
}

/// Why a sites configuration was refused. Every variant about one site names it and, where
/// there is one, the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SiteError {
    /// The text is not YAML, or not the shape of a sites file: a syntax error, an unknown
    /// field, a missing field, a value of the wrong type.
    #[error("{}", yaml_message(*line, *column, site.as_ref(), field.as_deref(), message))]
    Yaml {
        /// 1-based line, where known.
        line: Option<usize>,
        /// 1-based column, where known.
        column: Option<usize>,
        /// The site the error is in, when it is inside one.
        site: Option<SiteRef>,
        /// The field the error is about, when known (the unknown one, for an unknown field).
        field: Option<String>,
        /// What is wrong, without the location.
        message: String,
    },
    /// The file lists no site at all.
    #[error("the sites file lists no site: `sites` needs at least one")]
    NoSites,
    /// Two sites have the same name.
    #[error(
        "site `{name}`, field `name`: defined twice (sites #{first} and #{second}); names must be unique"
    )]
    DuplicateName {
        /// The repeated name.
        name: SiteName,
        /// 1-based position of the first definition.
        first: usize,
        /// 1-based position of the second definition.
        second: usize,
    },
    /// One field of one site breaks a rule (a bad name, namespace or label, a zero limit or
    /// weight, both or neither of `kubeconfig` and `in_cluster`).
    #[error("{site}, field `{field}`: {message}")]
    Invalid {
        /// The site.
        site: SiteRef,
        /// The field, as written in the file.
        field: &'static str,
        /// What is wrong with it.
        message: String,
    },
}

impl SiteError {
    /// The site the error is about, if it is about one.
    pub fn site(&self) -> Option<SiteRef> {
        match self {
            SiteError::Yaml { site, .. } => site.clone(),
            SiteError::NoSites => None,
            SiteError::DuplicateName { name, .. } => Some(SiteRef::Named(name.clone())),
            SiteError::Invalid { site, .. } => Some(site.clone()),
        }
    }

    /// The field the error is about, if it is about one.
    pub fn field(&self) -> Option<&str> {
        match self {
            SiteError::Yaml { field, .. } => field.as_deref(),
            SiteError::NoSites => Some("sites"),
            SiteError::DuplicateName { .. } => Some("name"),
            SiteError::Invalid { field, .. } => Some(field),
        }
    }
}

fn yaml_message(
    line: Option<usize>,
    column: Option<usize>,
    site: Option<&SiteRef>,
    field: Option<&str>,
    message: &str,
) -> String {
    let mut out = String::from("sites file");
    if let Some(line) = line {
        out.push_str(&format!(" line {line}"));
        if let Some(column) = column {
            out.push_str(&format!(" column {column}"));
        }
    }
    out.push_str(": ");
    if let Some(site) = site {
        out.push_str(&site.to_string());
        if let Some(field) = field {
            out.push_str(&format!(", field `{field}`"));
        }
        out.push_str(": ");
    }
    out.push_str(message);
    out
}
