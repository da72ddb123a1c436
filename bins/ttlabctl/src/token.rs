//! `ttlabctl token`: mints a bearer token for the ttlab API (the token format is
//! `ttlab-auth`'s; nothing of the server is linked).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use clap::Args;
use ttlab_auth::{AuthSecret, Role};
use ttlab_model::UserId;

/// Arguments of `ttlabctl token`.
#[derive(Debug, Args)]
pub struct TokenArgs {
    /// The user id (the token's `sub`).
    #[arg(long)]
    user: UserId,
    /// `student` or `admin`.
    #[arg(long, default_value = "student")]
    role: Role,
    /// How long the token is valid (e.g. 8h, 30m).
    #[arg(long, default_value = "8h", value_parser = humantime::parse_duration)]
    ttl: Duration,
    /// The server's HMAC secret (at least 32 bytes).
    #[arg(long, env = "TTLAB_AUTH_SECRET", hide_env_values = true)]
    auth_secret: String,
}

/// Prints the token on standard output.
pub fn run(args: TokenArgs) -> anyhow::Result<()> {
    let secret = AuthSecret::new(args.auth_secret.into_bytes())?;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .context("the system clock is before 1970")?
        .as_secs();
    let token = secret.mint(&args.user, args.role, now, args.ttl)?;
    println!("{token}");
    Ok(())
}
