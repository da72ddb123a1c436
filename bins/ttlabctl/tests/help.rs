//! `ttlabctl migrate --help` and `ttlabctl token --help` never print a secret's value.

use std::process::Command;

#[test]
fn help_never_prints_the_database_password_or_the_auth_secret() {
    for (command, variable) in [
        ("migrate", "[env: DATABASE_URL]"),
        ("token", "[env: TTLAB_AUTH_SECRET]"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_ttlabctl"))
            .args([command, "--help"])
            .env("DATABASE_URL", "postgres://u:secret@h/db")
            .env(
                "TTLAB_AUTH_SECRET",
                "the-auth-secret-value-of-forty-bytes-or-more",
            )
            .env("TTLAB_DB_LOCK_TIMEOUT", "7s")
            .output()
            .expect("ttlabctl runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(help.contains(variable), "{command}: {help}");
        for secret in ["u:secret", "secret@h", "the-auth-secret-value"] {
            assert!(
                !help.contains(secret),
                "{command} --help printed {secret:?}:\n{help}"
            );
        }
    }
    // A value that is not secret is printed: the checks above can fail.
    let out = Command::new(env!("CARGO_BIN_EXE_ttlabctl"))
        .args(["migrate", "--help"])
        .env("TTLAB_DB_LOCK_TIMEOUT", "7s")
        .output()
        .expect("ttlabctl runs");
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("[env: TTLAB_DB_LOCK_TIMEOUT=7s]"), "{help}");
}
