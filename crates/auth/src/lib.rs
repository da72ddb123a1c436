//! The ttlab API token: an HS256 JWT whose claims are the user id (`sub`), the [`Role`],
//! when it was issued (`iat`) and when it expires (`exp`), signed with the deployment's shared
//! [`AuthSecret`]. This crate owns the format: the claims, the secret's rules, minting
//! ([`AuthSecret::mint`]) and verifying ([`AuthSecret::verify`]), with HMAC-SHA256 as the
//! only algorithm signed or accepted.
//!
//! It refuses to own HTTP: reading the token from a request, believing an authenticating
//! proxy's header, and answering 401 or 403 are `ttlab-api`'s. So `ttlabctl token` mints a
//! token with this crate alone, without linking the server.
//!
//! ```
//! use std::time::Duration;
//! use ttlab_auth::{AuthError, AuthSecret, Role};
//!
//! // Secrets shorter than 32 bytes are refused.
//! assert!(matches!(AuthSecret::new("short"), Err(AuthError::SecretTooShort { bytes: 5 })));
//!
//! let secret = AuthSecret::new(vec![42u8; 32]).unwrap();
//! let alice = "alice".parse().unwrap();
//! let token = secret.mint(&alice, Role::Student, 1_900_000_000, Duration::from_secs(3600)).unwrap();
//! // Valid until 2030: verifies now.
//! let verified = secret.verify(&token).unwrap();
//! assert_eq!((verified.user, verified.role), (alice, Role::Student));
//! assert!(matches!(secret.verify("not.a.token"), Err(AuthError::Rejected(_))));
//! ```

mod error;
mod hs256;

use std::fmt;
use std::time::Duration;

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use ttlab_model::UserId;

pub use error::AuthError;

/// The shortest secret accepted, in bytes.
pub const MIN_SECRET_BYTES: usize = 32;

/// The HMAC secret tokens are signed with. Its `Debug` never shows it.
#[derive(Clone)]
pub struct AuthSecret(Vec<u8>);

impl AuthSecret {
    /// Accepts a secret of at least [`MIN_SECRET_BYTES`] bytes.
    pub fn new(secret: impl Into<Vec<u8>>) -> Result<Self, AuthError> {
        let secret = secret.into();
        if secret.len() < MIN_SECRET_BYTES {
            return Err(AuthError::SecretTooShort {
                bytes: secret.len(),
            });
        }
        Ok(Self(secret))
    }

    /// Signs an HS256 token with claims `sub`, `role`, `iat = now_unix` and
    /// `exp = now_unix + ttl`.
    pub fn mint(
        &self,
        user: &UserId,
        role: Role,
        now_unix: u64,
        ttl: Duration,
    ) -> Result<String, AuthError> {
        let claims = Claims {
            sub: user.as_str().to_owned(),
            role,
            exp: now_unix.saturating_add(ttl.as_secs()),
            iat: Some(now_unix),
        };
        hs256::install();
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &EncodingKey::from_secret(&self.0).map_err(|e| AuthError::Key(e.to_string()))?,
        )
        .map_err(|e| AuthError::Sign(e.to_string()))
    }

    /// Checks a token (HS256 only, signed with this secret, not expired — five seconds of
    /// leeway —, with a `sub` and an `exp`) and returns who it names.
    pub fn verify(&self, token: &str) -> Result<Verified, AuthError> {
        let mut validation = Validation::new(Algorithm::HS256);
        validation.leeway = 5;
        validation.set_required_spec_claims(&["exp", "sub"]);
        hs256::install();
        let data = jsonwebtoken::decode::<Claims>(
            token,
            &DecodingKey::from_secret(&self.0).map_err(|e| AuthError::Key(e.to_string()))?,
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
            AuthError::Rejected(why.to_owned())
        })?;
        let user = UserId::new(data.claims.sub)
            .map_err(|e| AuthError::Rejected(format!("the token's subject: {e}")))?;
        Ok(Verified {
            user,
            role: data.claims.role,
        })
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
#[derive(strum::Display, strum::EnumString, strum::IntoStaticStr)]
#[strum(
    serialize_all = "lowercase",
    parse_err_ty = String,
    parse_err_fn = unknown_role
)]
pub enum Role {
    /// Opens, uses and finishes their own session.
    Student,
    /// Also reads every session and uses the admin routes.
    Admin,
}

impl Role {
    /// Lowercase name, as in the `role` claim.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

fn unknown_role(s: &str) -> String {
    format!("unknown role {s:?}: expected `student` or `admin`")
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

/// Who a verified token names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// The user (the `sub` claim).
    pub user: UserId,
    /// Their role.
    pub role: Role,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret() -> AuthSecret {
        AuthSecret::new(vec![7u8; 32]).unwrap()
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
    fn minted_tokens_verify_with_their_secret_only_and_until_they_expire() {
        let s = secret();
        let bob = UserId::new("bob").unwrap();
        let t = s
            .mint(&bob, Role::Student, now(), Duration::from_secs(60))
            .unwrap();
        assert_eq!(
            s.verify(&t).unwrap(),
            Verified {
                user: bob.clone(),
                role: Role::Student
            }
        );
        let other = AuthSecret::new(vec![8u8; 32]).unwrap();
        assert!(matches!(other.verify(&t), Err(AuthError::Rejected(m)) if m.contains("signature")));
        let expired = s
            .mint(&bob, Role::Admin, now() - 3600, Duration::from_secs(60))
            .unwrap();
        assert!(matches!(s.verify(&expired), Err(AuthError::Rejected(m)) if m.contains("expired")));
    }

    #[test]
    fn tokens_of_another_algorithm_or_none_are_refused() {
        // `alg: none` with the same claims: no signature at all.
        let claims = r#"{"sub":"eve","role":"admin","exp":4000000000}"#;
        let b64 = |s: &str| {
            use base64::Engine as _;
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s)
        };
        let none = format!("{}.{}.", b64(r#"{"alg":"none","typ":"JWT"}"#), b64(claims));
        assert!(matches!(
            secret().verify(&none),
            Err(AuthError::Rejected(_))
        ));
        let hs512 = format!(
            "{}.{}.c2ln",
            b64(r#"{"alg":"HS512","typ":"JWT"}"#),
            b64(claims)
        );
        assert!(matches!(
            secret().verify(&hs512),
            Err(AuthError::Rejected(_))
        ));
    }

    #[test]
    fn role_names_read_back_and_an_unknown_one_is_named() {
        for (role, name) in [(Role::Student, "student"), (Role::Admin, "admin")] {
            assert_eq!(role.as_str(), name);
            assert_eq!(role.to_string(), name);
            assert_eq!(name.parse::<Role>(), Ok(role));
        }
        assert_eq!(
            "root".parse::<Role>(),
            Err("unknown role \"root\": expected `student` or `admin`".to_owned())
        );
    }
}
