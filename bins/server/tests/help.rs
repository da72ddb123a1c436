//! `ttlab-server --help` names the variables it reads and never prints a secret's value.

use std::process::Command;

#[test]
fn help_never_prints_the_database_password() {
    let out = Command::new(env!("CARGO_BIN_EXE_ttlab-server"))
        .arg("--help")
        .env("DATABASE_URL", "postgres://u:secret@h/db")
        .env(
            "TTLAB_AUTH_SECRET",
            "the-auth-secret-value-of-forty-bytes-or-more",
        )
        .env("TTLAB_NAMESPACE", "labs-from-the-environment")
        .output()
        .expect("ttlab-server runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("--database-url"), "{help}");
    assert!(help.contains("[env: DATABASE_URL]"), "{help}");
    for secret in ["u:secret", "secret@h", "the-auth-secret-value"] {
        assert!(!help.contains(secret), "--help printed {secret:?}:\n{help}");
    }
    // A value that is not secret is printed: the checks above can fail.
    assert!(
        help.contains("[env: TTLAB_NAMESPACE=labs-from-the-environment]"),
        "{help}"
    );
}
