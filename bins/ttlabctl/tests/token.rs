//! `ttlabctl token` mints a token the server accepts, from the token format alone.

use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use ttlab_auth::{AuthSecret, Role};

const SECRET: &str = "a token test secret, forty bytes or more";

fn ttlabctl_token(args: &[&str], secret: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ttlabctl"))
        .arg("token")
        .args(args)
        .env("TTLAB_AUTH_SECRET", secret)
        .env_remove("RUST_LOG")
        .output()
        .expect("ttlabctl runs")
}

#[test]
fn a_minted_token_names_the_user_and_role_and_expires_after_its_ttl() {
    let out = ttlabctl_token(
        &["--user", "alice", "--role", "admin", "--ttl", "30m"],
        SECRET,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let token = String::from_utf8(out.stdout).unwrap();
    let secret = AuthSecret::new(SECRET).unwrap();
    let verified = secret
        .verify(token.trim())
        .expect("the server's check accepts it");
    assert_eq!(verified.user.as_str(), "alice");
    assert_eq!(verified.role, Role::Admin);
    // Signed with another secret, it is refused.
    let other = AuthSecret::new(SECRET.replace('a', "b")).unwrap();
    assert!(other.verify(token.trim()).is_err());
    // It expires 30 minutes after it was minted.
    let claims = token.trim().split('.').nth(1).unwrap();
    let claims: serde_json::Value = serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(claims)
            .unwrap(),
    )
    .unwrap();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let (iat, exp) = (claims["iat"].as_u64(), claims["exp"].as_u64());
    let (Some(iat), Some(exp)) = (iat, exp) else {
        panic!("no iat or exp in {claims}");
    };
    assert_eq!(exp - iat, 30 * 60, "{claims}");
    assert!(now.abs_diff(iat) < 60, "issued at {iat}, now {now}");
}

#[test]
fn a_short_secret_is_refused_with_a_reason() {
    let out = ttlabctl_token(&["--user", "alice"], "too short");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("at least 32"), "{stderr}");
    assert!(out.stdout.is_empty());
}
