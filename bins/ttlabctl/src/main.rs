//! ttlabctl: operator CLI (migrate, render, sim, demo, bench, soak).
//!
//! Not built yet: this binary refuses to run rather than pretend to work.

fn main() {
    eprintln!("ttlabctl: not available in this build yet");
    std::process::exit(2);
}
