//! ttlab-agent: the grading agent that runs inside the guest VM.
//!
//! `ttlab-agent [--root DIR] [--listen ADDR:PORT]`; see the `ttlab-agent` library for the
//! protocol. Prints `ttlab-agent listening on ADDR:PORT` once bound, then serves for ever.
//! Exit status: 2 for a bad command line, 1 when it cannot listen.

use std::io::Write;
use std::process::ExitCode;

use ttlab_agent::protocol::LISTENING_PREFIX;
use ttlab_agent::{Agent, AgentConfig};

fn main() -> ExitCode {
    let config = match AgentConfig::from_args(std::env::args_os().skip(1)) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("ttlab-agent: {e}");
            return ExitCode::from(2);
        }
    };
    let agent = match Agent::bind(config) {
        Ok(agent) => agent,
        Err(e) => {
            eprintln!("ttlab-agent: {e}");
            return ExitCode::from(1);
        }
    };
    match agent.local_addr() {
        Ok(addr) => {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{LISTENING_PREFIX}{addr}");
            let _ = out.flush();
        }
        Err(e) => {
            eprintln!("ttlab-agent: cannot read the bound address: {e}");
            return ExitCode::from(1);
        }
    }
    agent.run()
}
