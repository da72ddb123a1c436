//! Authentication: HS256 JWTs (`sub`, `role`, `exp`) in `Authorization: Bearer …`, and,
//! optionally, a user header set by a trusted authenticating proxy.
//!
//! [`CurrentUser`] and [`AdminUser`] are axum extractors usable by any router whose state
//! gives an [`AuthConfig`] (`FromRef`), so other route modules (the console) reuse them.
//! Only HS256 is accepted: `alg: none`, any other algorithm, a wrong signature, an expired
//! token or missing claims are all 401.

use std::fmt;
use std::time::Duration;

use axum::extract::{FromRef, FromRequestParts};
use axum::http::HeaderName;
use axum::http::request::Parts;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use ttlab_model::UserId;

use crate::ApiError;

/// The shortest secret accepted, in bytes.
pub const MIN_SECRET_BYTES: usize = 32;

/// The HMAC secret tokens are signed with. Its `Debug` never shows it.
#[derive(Clone)]
pub struct AuthSecret(Vec<u8>);

impl AuthSecret {
    /// Accepts a secret of at least [`MIN_SECRET_BYTES`] bytes.
    pub fn new(secret: impl Into<Vec<u8>>) -> Result<Self, ApiError> {
        let secret = secret.into();
        if secret.len() < MIN_SECRET_BYTES {
            return Err(ApiError::Config(format!(
                "TTLAB_AUTH_SECRET is {} bytes; it must be at least {MIN_SECRET_BYTES} \
                 (e.g. `openssl rand -hex 32`)",
                secret.len()
            )));
        }
        Ok(Self(secret))
    }
}

impl fmt::Debug for AuthSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AuthSecret(*** {} bytes)", self.0.len())
    }
}

/// What a user may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Opens, uses and finishes their own session.
    Student,
    /// Also reads every session and uses the admin routes.
    Admin,
}

impl Role {
    /// Lowercase name, as in the `role` claim.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Student => "student",
            Self::Admin => "admin",
        }
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "student" => Ok(Self::Student),
            "admin" => Ok(Self::Admin),
            other => Err(format!(
                "unknown role {other:?}: expected `student` or `admin`"
            )),
        }
    }
}

/// The claims of a ttlab token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    /// The user id.
    pub sub: String,
    /// The role.
    pub role: Role,
    /// Expiry, seconds since the Unix epoch.
    pub exp: u64,
    /// Issued at, seconds since the Unix epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iat: Option<u64>,
}

/// How requests are authenticated.
#[derive(Debug, Clone)]
pub struct AuthConfig {
    secret: AuthSecret,
    trusted_header: Option<HeaderName>,
}

impl AuthConfig {
    /// Bearer tokens signed with `secret`; no proxy header.
    pub fn new(secret: AuthSecret) -> Self {
        Self {
            secret,
            trusted_header: None,
        }
    }

    /// Also trusts `header` (set by an authenticating proxy in front of the server) as the
    /// user id of a student when no bearer token is sent. Only enable this when every
    /// request passes through that proxy, which must strip the header from clients.
    pub fn with_trusted_header(mut self, header: &str) -> Result<Self, ApiError> {
        let name = HeaderName::from_bytes(header.trim().as_bytes()).map_err(|_| {
            ApiError::Config(format!("TTLAB_AUTH_HEADER {header:?} is not a header name"))
        })?;
        self.trusted_header = Some(name);
        Ok(self)
    }

    /// Signs a token for `user` with `role`, valid for `ttl` from `now_unix`.
    pub fn mint(
        &self,
        user: &UserId,
        role: Role,
        now_unix: u64,
        ttl: Duration,
    ) -> Result<String, ApiError> {
        mint_token(&self.secret, user, role, now_unix, ttl)
    }

    /// Checks a bearer token and returns who it names.
    pub fn verify(&self, token: &str) -> Result<CurrentUser, ApiError> {
        let mut validation = Validation::new(Algorithm::HS256);
        validation.leeway = 5;
        validation.set_required_spec_claims(&["exp", "sub"]);
        let data = jsonwebtoken::decode::<Claims>(
            token,
            &DecodingKey::from_secret(&self.secret.0)
                .map_err(|e| ApiError::Internal(format!("the signing key: {e}")))?,
            &validation,
        )
        .map_err(|e| {
            use jsonwebtoken::errors::ErrorKind;
            let why = match e.kind() {
                ErrorKind::ExpiredSignature => "the token has expired",
                ErrorKind::InvalidSignature => "the token's signature is not valid",
                ErrorKind::InvalidAlgorithm => "the token must be signed with HS256",
                ErrorKind::MissingRequiredClaim(_) => "the token lacks a required claim",
                _ => "the token is not a valid ttlab token",
            };
            ApiError::Unauthorized(why.to_owned())
        })?;
        let user = UserId::new(data.claims.sub)
            .map_err(|e| ApiError::Unauthorized(format!("the token's subject: {e}")))?;
        Ok(CurrentUser {
            user,
            role: data.claims.role,
        })
    }

    fn authenticate(&self, parts: &Parts) -> Result<CurrentUser, ApiError> {
        if let Some(value) = parts.headers.get(axum::http::header::AUTHORIZATION) {
            let text = value
                .to_str()
                .map_err(|_| ApiError::Unauthorized("malformed Authorization header".into()))?;
            let token = text
                .strip_prefix("Bearer ")
                .or_else(|| text.strip_prefix("bearer "))
                .ok_or_else(|| {
                    ApiError::Unauthorized("use `Authorization: Bearer <token>`".into())
                })?;
            return self.verify(token.trim());
        }
        if let Some(header) = &self.trusted_header
            && let Some(value) = parts.headers.get(header)
        {
            let text = value
                .to_str()
                .map_err(|_| ApiError::Unauthorized(format!("malformed {header} header")))?;
            let user = UserId::new(text.trim())
                .map_err(|e| ApiError::Unauthorized(format!("{header}: {e}")))?;
            return Ok(CurrentUser {
                user,
                role: Role::Student,
            });
        }
        Err(ApiError::Unauthorized(
            "sign in first: send `Authorization: Bearer <token>`".into(),
        ))
    }
}

/// Signs an HS256 token with claims `sub`, `role`, `iat` and `exp = now + ttl`.
pub fn mint_token(
    secret: &AuthSecret,
    user: &UserId,
    role: Role,
    now_unix: u64,
    ttl: Duration,
) -> Result<String, ApiError> {
    let claims = Claims {
        sub: user.as_str().to_owned(),
        role,
        exp: now_unix.saturating_add(ttl.as_secs()),
        iat: Some(now_unix),
    };
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(&secret.0)
            .map_err(|e| ApiError::Internal(format!("the signing key: {e}")))?,
    )
    .map_err(|e| ApiError::Internal(format!("signing a token: {e}")))
}

/// The authenticated caller of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CurrentUser {
    /// Who.
    pub user: UserId,
    /// With which role.
    pub role: Role,
}

impl CurrentUser {
    /// Whether this is an admin.
    pub fn is_admin(&self) -> bool {
        self.role == Role::Admin
    }
}

impl<S> FromRequestParts<S> for CurrentUser
where
    S: Send + Sync,
    AuthConfig: FromRef<S>,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        AuthConfig::from_ref(state).authenticate(parts)
    }
}

/// An authenticated admin; a student gets 403.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminUser(pub CurrentUser);

impl<S> FromRequestParts<S> for AdminUser
where
    S: Send + Sync,
    AuthConfig: FromRef<S>,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let user = AuthConfig::from_ref(state).authenticate(parts)?;
        if user.is_admin() {
            Ok(Self(user))
        } else {
            Err(ApiError::Forbidden)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> AuthConfig {
        AuthConfig::new(AuthSecret::new(vec![7u8; 32]).unwrap())
    }

    fn now() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
    }

    #[test]
    fn short_secrets_are_refused() {
        let err = AuthSecret::new(vec![1u8; 31]).unwrap_err();
        assert!(err.to_string().contains("at least 32"), "{err}");
        assert!(!format!("{:?}", AuthSecret::new(vec![b'x'; 40]).unwrap()).contains("xxx"));
    }

    #[test]
    fn minted_tokens_verify_and_others_do_not() {
        let c = config();
        let alice = UserId::new("alice").unwrap();
        let t = c
            .mint(&alice, Role::Admin, now(), Duration::from_secs(60))
            .unwrap();
        assert_eq!(
            c.verify(&t).unwrap(),
            CurrentUser {
                user: alice.clone(),
                role: Role::Admin
            }
        );
        let other = AuthConfig::new(AuthSecret::new(vec![8u8; 32]).unwrap());
        assert!(matches!(other.verify(&t), Err(ApiError::Unauthorized(_))));
        let expired = c
            .mint(&alice, Role::Student, now() - 3600, Duration::from_secs(60))
            .unwrap();
        assert!(
            matches!(c.verify(&expired), Err(ApiError::Unauthorized(m)) if m.contains("expired"))
        );
    }
}
