//! ttlab-server: the student-facing HTTP service.
//!
//! Not built yet: this binary refuses to run rather than pretend to work.

fn main() {
    eprintln!("ttlab-server: not available in this build yet");
    std::process::exit(2);
}
