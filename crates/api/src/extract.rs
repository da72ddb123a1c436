//! Extractors whose rejections are the crate's JSON error body: a bad body or path is a 4xx
//! with `{"error", "message"}`, never axum's plain-text default.

use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;
use ttlab_model::SessionId;

use crate::ApiError;

/// A JSON body; malformed JSON, wrong types, unknown fields, an oversized body or a missing
/// `Content-Type: application/json` are 4xx with the error body.
#[derive(Debug, Clone, Copy, Default)]
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        match axum::Json::<T>::from_request(req, state).await {
            Ok(axum::Json(v)) => Ok(Self(v)),
            Err(rejection) => Err(json_rejection(&rejection)),
        }
    }
}

fn json_rejection(rejection: &JsonRejection) -> ApiError {
    match rejection {
        JsonRejection::MissingJsonContentType(_) => ApiError::UnsupportedMediaType,
        JsonRejection::JsonSyntaxError(_) => ApiError::bad_request(
            "invalid_json",
            format!("the body is not valid JSON: {}", rejection.body_text()),
        ),
        JsonRejection::JsonDataError(_) => {
            let text = rejection.body_text();
            let code = if text.contains("unknown field") {
                "unknown_field"
            } else {
                "invalid_body"
            };
            ApiError::bad_request(code, text)
        }
        other if other.status() == StatusCode::PAYLOAD_TOO_LARGE => ApiError::PayloadTooLarge,
        other => ApiError::bad_request("invalid_body", other.body_text()),
    }
}

/// The `{id}` of a session route, parsed as a UUID (400 `invalid_id` otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionPath(pub SessionId);

impl<S> FromRequestParts<S> for SessionPath
where
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Path(raw) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|e: PathRejection| ApiError::bad_request("invalid_id", e.body_text()))?;
        raw.parse::<SessionId>().map(Self).map_err(|_| {
            ApiError::bad_request(
                "invalid_id",
                format!("{raw:?} is not a session id (a UUID)"),
            )
        })
    }
}
