//! Who a call comes from, as the call record ([`crate::CallRecord::user`]) names it: the user
//! of a bearer token kube-sim issued ([`crate::KubeSim::token_for`], written into kubeconfigs
//! by [`crate::KubeSim::write_kubeconfig_for`]), as a token names a user on a real cluster;
//! the user an `Impersonate-User` header (kubeconfig `as:`) acts as, which wins as it does
//! after a real server has allowed the impersonation; nobody without either. A token kube-sim
//! did not issue, or another scheme, is refused with `401 Unauthorized` as a real server
//! refuses a credential it cannot authenticate. What an identified user may do is
//! `crate::rbac`'s to decide.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use http::HeaderMap;

use crate::status::ApiError;

/// The tokens issued, both ways.
#[derive(Default)]
pub(crate) struct Tokens {
    inner: Mutex<(HashMap<String, String>, HashMap<String, String>)>,
}

impl Tokens {
    /// The token of `user` (the same one every time).
    pub(crate) fn issue(&self, user: &str) -> String {
        let mut guard = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let (by_token, by_user) = &mut *guard;
        if let Some(t) = by_user.get(user) {
            return t.clone();
        }
        let token = format!("kube-sim-{}", uuid::Uuid::new_v4().simple());
        by_user.insert(user.to_owned(), token.clone());
        by_token.insert(token.clone(), user.to_owned());
        token
    }

    fn user(&self, token: &str) -> Option<String> {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .0
            .get(token)
            .cloned()
    }

    /// The identity of a request: `Ok(None)` for one without credentials, `Err` (401) for
    /// credentials kube-sim cannot authenticate.
    pub(crate) fn identify(&self, headers: &HeaderMap) -> Result<Option<String>, ApiError> {
        let authenticated = match headers.get(http::header::AUTHORIZATION) {
            None => None,
            Some(v) => {
                let token = v
                    .to_str()
                    .ok()
                    .and_then(|v| v.split_once(' '))
                    .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
                    .map(|(_, t)| t.trim());
                match token.and_then(|t| self.user(t)) {
                    Some(user) => Some(user),
                    None => return Err(ApiError::unauthorized()),
                }
            }
        };
        let impersonated = headers
            .get("impersonate-user")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        Ok(impersonated.or(authenticated))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn tokens_name_their_user_and_impersonation_wins() {
        let t = Tokens::default();
        let server = t.issue("system:serviceaccount:ttlab:ttlab-server");
        assert_eq!(t.issue("system:serviceaccount:ttlab:ttlab-server"), server);
        assert_ne!(t.issue("reaper"), server);
        let bearer = format!("Bearer {server}");
        assert_eq!(
            t.identify(&headers(&[("authorization", &bearer)])).unwrap(),
            Some("system:serviceaccount:ttlab:ttlab-server".into())
        );
        assert_eq!(
            t.identify(&headers(&[
                ("authorization", &bearer),
                ("impersonate-user", "bob")
            ]))
            .unwrap(),
            Some("bob".into())
        );
        assert_eq!(t.identify(&headers(&[])).unwrap(), None);
        for bad in ["Bearer nope", "Basic dTpw", "Bearer"] {
            let e = t.identify(&headers(&[("authorization", bad)])).unwrap_err();
            assert_eq!((e.code, e.reason), (401, "Unauthorized"), "{bad}");
        }
    }
}
