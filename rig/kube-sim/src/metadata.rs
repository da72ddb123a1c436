//! Metadata-only answers, as the real API server gives them when asked with
//! `Accept: application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1` (a list) or
//! `…;as=PartialObjectMetadata;…` (one object, or the objects of a watch): each object is
//! reduced to `{"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata"}`
//! and a list becomes a `PartialObjectMetadataList`. kube-rs asks for these with
//! `Api::list_metadata`, `Api::get_metadata` and `Api::watch_metadata`.
//!
//! Only the metadata is written: a list of large objects (cloud-init Secrets carrying a guest
//! agent) costs what their names and labels cost.

use serde_json::{Value, json};

/// The group version of the partial kinds.
pub(crate) const API_VERSION: &str = "meta.k8s.io/v1";
/// The kind of one reduced object.
pub(crate) const PARTIAL: &str = "PartialObjectMetadata";
/// The kind of a list of reduced objects.
pub(crate) const PARTIAL_LIST: &str = "PartialObjectMetadataList";

/// What the body of an answer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Shape {
    /// The objects as stored.
    #[default]
    Full,
    /// Their metadata only.
    Metadata,
}

impl Shape {
    /// Reads the `Accept` header: its entries are tried in order, and the first one this
    /// server can produce decides. A collection (`list`) is reduced only for
    /// `as=PartialObjectMetadataList`, one object or a watch only for
    /// `as=PartialObjectMetadata`, both with `g=meta.k8s.io` and `v=v1`. Plain JSON (or any
    /// type) means the full objects; entries asking for other shapes (`as=Table`, protobuf)
    /// are passed over. Without any usable entry the objects are sent in full, as before.
    pub(crate) fn negotiate(accept: Option<&str>, list: bool) -> Self {
        let want = if list { PARTIAL_LIST } else { PARTIAL };
        for entry in accept.unwrap_or("").split(',') {
            let mut parts = entry.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let (mut as_, mut g, mut v) = (None, None, None);
            for param in parts {
                match param.split_once('=').map(|(k, v)| (k.trim(), v.trim())) {
                    Some(("as", x)) => as_ = Some(x),
                    Some(("g", x)) => g = Some(x),
                    Some(("v", x)) => v = Some(x),
                    _ => {}
                }
            }
            let json = matches!(media.as_str(), "application/json" | "application/*" | "*/*");
            match as_ {
                None if json => return Self::Full,
                Some(kind)
                    if media == "application/json"
                        && kind == want
                        && g == Some("meta.k8s.io")
                        && v == Some("v1") =>
                {
                    return Self::Metadata;
                }
                _ => {}
            }
        }
        Self::Full
    }
}

/// The `Content-Type` of a metadata-only answer.
pub(crate) fn content_type(list: bool) -> &'static str {
    if list {
        "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
    } else {
        "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
    }
}

/// Writes `object` reduced to its metadata, without copying it.
pub(crate) fn write_partial(out: &mut Vec<u8>, object: &Value) {
    out.extend_from_slice(b"{\"kind\":\"");
    out.extend_from_slice(PARTIAL.as_bytes());
    out.extend_from_slice(b"\",\"apiVersion\":\"");
    out.extend_from_slice(API_VERSION.as_bytes());
    out.extend_from_slice(b"\",\"metadata\":");
    match object.get("metadata") {
        Some(meta) => {
            let _ = serde_json::to_writer(&mut *out, meta);
        }
        None => out.extend_from_slice(b"{}"),
    }
    out.push(b'}');
}

/// `object` reduced to its metadata, as a value (one object, a watch event's object).
pub(crate) fn partial(object: &Value) -> Value {
    json!({
        "kind": PARTIAL,
        "apiVersion": API_VERSION,
        "metadata": object.get("metadata").cloned().unwrap_or_else(|| json!({})),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIST: &str = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1";
    const ONE: &str = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1";

    #[test]
    fn the_partial_kind_must_fit_the_request() {
        assert_eq!(Shape::negotiate(Some(LIST), true), Shape::Metadata);
        assert_eq!(Shape::negotiate(Some(ONE), false), Shape::Metadata);
        // The other kind of each: not produced, so the objects come in full.
        assert_eq!(Shape::negotiate(Some(ONE), true), Shape::Full);
        assert_eq!(Shape::negotiate(Some(LIST), false), Shape::Full);
        // Another group or version is not this one.
        assert_eq!(
            Shape::negotiate(
                Some("application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1beta1"),
                true
            ),
            Shape::Full
        );
    }

    #[test]
    fn entries_are_tried_in_order() {
        let table_then_json = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json";
        assert_eq!(Shape::negotiate(Some(table_then_json), true), Shape::Full);
        let json_first = format!("application/json, {LIST}");
        assert_eq!(Shape::negotiate(Some(&json_first), true), Shape::Full);
        let table_then_meta = format!("application/json;as=Table;v=v1;g=meta.k8s.io, {LIST}");
        assert_eq!(
            Shape::negotiate(Some(&table_then_meta), true),
            Shape::Metadata
        );
        assert_eq!(Shape::negotiate(None, true), Shape::Full);
        assert_eq!(Shape::negotiate(Some("*/*"), false), Shape::Full);
    }

    #[test]
    fn a_partial_object_keeps_the_metadata_and_nothing_else() {
        let secret = json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "s", "labels": {"a": "b"}, "uid": "u"},
            "data": {"userdata": "AAAA"},
        });
        let mut out = Vec::new();
        write_partial(&mut out, &secret);
        let written: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(written, partial(&secret));
        assert_eq!(
            written,
            json!({
                "kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                "metadata": {"name": "s", "labels": {"a": "b"}, "uid": "u"},
            })
        );
    }
}
