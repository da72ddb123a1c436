//! ttlab-reaper: reclaims expired sessions and orphaned cluster objects.
//!
//! Not built yet: this binary refuses to run rather than pretend to work.

fn main() {
    eprintln!("ttlab-reaper: not available in this build yet");
    std::process::exit(2);
}
