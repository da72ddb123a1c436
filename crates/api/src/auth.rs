//! Authentication: HS256 JWTs (`sub`, `role`, `exp`) in `Authorization: Bearer …`, and,
//! optionally, a user header set by a trusted authenticating proxy — believed only on
//! connections from that proxy's addresses ([`TrustedProxies`]), so a client going through
//! the Ingress cannot name itself.
//!
//! The token itself (its claims, the secret, minting and verifying) is `ttlab-auth`'s,
//! re-exported here; this module reads it from requests. [`CurrentUser`] and [`AdminUser`]
//! are axum extractors usable by any router whose state gives an [`AuthConfig`] (`FromRef`),
//! so other route modules (the console) reuse them. Only HS256 is accepted: `alg: none`, any
//! other algorithm, a wrong signature, an expired token or missing claims are all 401.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use axum::extract::{ConnectInfo, FromRef, FromRequestParts};
use axum::http::HeaderName;
use axum::http::request::Parts;
use ttlab_model::UserId;

pub use ttlab_auth::{AuthError, AuthSecret, Claims, MIN_SECRET_BYTES, Role};

use crate::ApiError;

/// The peers an authenticating proxy's user header is accepted from: addresses and CIDR
/// blocks (`10.1.2.3`, `10.0.0.0/8`, `fd00::/8`), comma-separated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrustedProxies(Vec<(IpAddr, u8)>);

impl TrustedProxies {
    /// Whether `peer` is one of them (an IPv4-mapped IPv6 address counts as its IPv4 one).
    pub fn contains(&self, peer: IpAddr) -> bool {
        let peer = peer.to_canonical();
        self.0.iter().any(|&(net, bits)| match (net, peer) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(bits)).unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(bits)).unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        })
    }
}

impl std::str::FromStr for TrustedProxies {
    type Err = ApiError;
    fn from_str(s: &str) -> Result<Self, ApiError> {
        let bad = |item: &str, why: &str| {
            ApiError::Config(format!(
                "TTLAB_AUTH_PROXIES: {item:?} {why}; expected addresses or CIDR blocks such \
                 as 10.0.0.0/8, comma-separated"
            ))
        };
        let mut nets = Vec::new();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (addr, bits) = match item.split_once('/') {
                Some((addr, bits)) => (addr, Some(bits)),
                None => (item, None),
            };
            let addr: IpAddr = addr
                .parse()
                .map_err(|_| bad(item, "is not an IP address"))?;
            let addr = addr.to_canonical();
            let max = if addr.is_ipv4() { 32 } else { 128 };
            let bits = match bits {
                None => max,
                Some(b) => b
                    .parse::<u8>()
                    .ok()
                    .filter(|b| *b <= max)
                    .ok_or_else(|| bad(item, "has an invalid prefix length"))?,
            };
            nets.push((addr, bits));
        }
        if nets.is_empty() {
            return Err(bad(s, "names no address"));
        }
        Ok(Self(nets))
    }
}

/// How requests are authenticated.
#[derive(Debug, Clone)]
pub struct AuthConfig {
    secret: AuthSecret,
    trusted_header: Option<(HeaderName, TrustedProxies)>,
}

impl AuthConfig {
    /// Bearer tokens signed with `secret`; no proxy header.
    pub fn new(secret: AuthSecret) -> Self {
        Self {
            secret,
            trusted_header: None,
        }
    }

    /// Also trusts `header`, set by an authenticating proxy in front of the server, as the
    /// user id of a student when no bearer token is sent — but only on connections from
    /// `proxies` (the proxy's own addresses). From any other peer, the Ingress controller
    /// included, the header is ignored, so a client cannot name itself by sending it.
    pub fn with_trusted_header(
        mut self,
        header: &str,
        proxies: TrustedProxies,
    ) -> Result<Self, ApiError> {
        let name = HeaderName::from_bytes(header.trim().as_bytes()).map_err(|_| {
            ApiError::Config(format!("TTLAB_AUTH_HEADER {header:?} is not a header name"))
        })?;
        if name == axum::http::header::AUTHORIZATION {
            return Err(ApiError::Config(
                "TTLAB_AUTH_HEADER cannot be Authorization".into(),
            ));
        }
        self.trusted_header = Some((name, proxies));
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
        Ok(self.secret.mint(user, role, now_unix, ttl)?)
    }

    /// Checks a bearer token and returns who it names.
    pub fn verify(&self, token: &str) -> Result<CurrentUser, ApiError> {
        let verified = self.secret.verify(token)?;
        Ok(CurrentUser {
            user: verified.user,
            role: verified.role,
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
        if let Some((header, proxies)) = &self.trusted_header
            && let Some(value) = parts.headers.get(header)
        {
            let peer = parts
                .extensions
                .get::<ConnectInfo<SocketAddr>>()
                .map(|c| c.0.ip());
            if !peer.is_some_and(|p| proxies.contains(p)) {
                tracing::warn!(
                    peer = ?peer,
                    %header,
                    "ignored the user header from a peer that is not a trusted proxy"
                );
                return Err(ApiError::Unauthorized(format!(
                    "the {header} header is only accepted from the authenticating proxy; sign \
                     in through it"
                )));
            }
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
    fn trusted_proxies_are_addresses_and_blocks() {
        let p: TrustedProxies = "10.0.0.0/8, 192.0.2.7,fd00::/8".parse().unwrap();
        for yes in ["10.1.2.3", "192.0.2.7", "::ffff:10.9.9.9", "fd00::1"] {
            assert!(p.contains(yes.parse().unwrap()), "{yes}");
        }
        for no in ["11.0.0.1", "192.0.2.8", "fe80::1", "127.0.0.1"] {
            assert!(!p.contains(no.parse().unwrap()), "{no}");
        }
        let all: TrustedProxies = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("8.8.8.8".parse().unwrap()));
        for bad in ["", "10.0.0.0/33", "nope", "10.0.0.1/x", " , "] {
            assert!(
                matches!(bad.parse::<TrustedProxies>(), Err(ApiError::Config(_))),
                "{bad:?}"
            );
        }
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
