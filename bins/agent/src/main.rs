//! ttlab-agent: the grading agent that runs inside the guest VM.
//!
//! Not built yet: this binary refuses to run rather than pretend to work.

fn main() {
    eprintln!("ttlab-agent: not available in this build yet");
    std::process::exit(2);
}
