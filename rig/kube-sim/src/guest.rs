//! What a VMI's guest is ([`GuestBackend`]), as kube-sim hands it to its KubeVirt
//! (`ttlab-kubevirt-sim`). A simulated guest (`ttlab-sim-guest`, re-exported here): cloud-init
//! `write_files` from the NoCloud user-data into a per-VM directory, the VMI's `configMap`
//! volumes presented as KubeVirt presents them (one disk per volume, its files the ConfigMap's
//! keys, found by its `volumeLabel`), the real `ttlab-agent` binary installed from the agent
//! disk as ttlab's first boot does — unpacked, checked against the sha256 the user-data pins,
//! or the failure marker with the reason and no agent — and started, and the readiness /
//! failure markers the setup would write. A guest whose user-data pins no digest runs whatever
//! binary its `write_files` put in place.
//!
//! The agent runs as `ttlab-agent --root <guest dir> --listen <VMI address>:<agent port>`; its
//! standard error and output go to the guest's `/var/log/ttlab-agent.log`. As on KubeVirt,
//! the VMI turns Running first and the guest's agent starts later (the second half of
//! `Timings::boot`), so a client finds the agent's port refusing connections for a while
//! after Running and must retry (`AgentClient::wait_ready` does); the setup's marker follows
//! once the agent's `ttlab-agent listening on` line (awaited at most [`AGENT_START_TIMEOUT`])
//! is out. The agent is killed and reaped when its VMI ends, and at `KubeSim::shutdown`
//! (awaited) or drop (SIGKILL).
//!
//! [`GuestBackend::Qemu`] replaces all of that with a real guest (see `ttlab-qemu-guest`).

pub use ttlab_sim_guest::{
    AGENT_DIGEST_PATH, AGENT_KEY, AGENT_START_TIMEOUT, AGENT_VOLUME_LABEL, Applied, ConfigDisk,
    StartedAgent, agent_log, apply_cloud_config, guest_path, install_agent, start_agent,
    write_marker,
};

/// What a VMI's guest is.
#[derive(Debug, Clone, Default)]
pub enum GuestBackend {
    /// A directory and the agent started on the host, markers after the setup delay: boots in
    /// a moment.
    #[default]
    Simulated,
    /// A real qemu guest booting the given image.
    Qemu(Box<QemuSettings>),
}

pub use ttlab_qemu_guest::QemuSettings;
