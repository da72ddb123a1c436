//! cloud-init user-data for one lab VM, and the Secret that carries it.
//!
//! This crate owns what a stock cloud image (nothing pre-installed) receives on first boot:
//! the per-VM agent token (0600, root), the sha256 of the agent version the VM must run and
//! the agent's systemd unit, the lesson's files and setup script, root autologin on the serial
//! console `ttyS0` (the VM has no password), a power-off at the session's hard deadline, and
//! the first-boot sequence that ties them together — everything that is per session, and
//! nothing else. The agent binary itself is delivered once per version, not once per VM: this
//! crate also renders that version's ConfigMap ([`AgentPayload::config_map`],
//! `ttlab-agent-<digest prefix>`, the gzip of the binary, immutable), which every VM mounts as
//! a disk labelled [`AGENT_VOLUME_LABEL`]. It does not choose the disk, name or render the
//! VirtualMachine (`ttlab-vm-manifest`), generate tokens, read clocks or create the
//! ConfigMap: the caller passes the token and the deadline. It performs no I/O.
//!
//! # Injection-proof by construction
//!
//! The document is `#cloud-config` followed by the body as JSON, which is valid YAML. Every
//! file goes through `write_files` with `encoding: b64` (or `gz+b64`), so no byte a lesson
//! author wrote — file contents, setup script — appears raw; file paths are JSON strings with
//! every non-ASCII BMP character escaped. Whatever a lesson contains (`---`, `#cloud-config`,
//! `runcmd:`, quotes, NUL, invalid UTF-8), the top-level keys are exactly [`TOP_LEVEL_KEYS`]
//! and the files are exactly ttlab's [`OWN_PATHS`] plus the lesson's.
//!
//! # First boot
//!
//! cloud-init writes the files in its init stage; its final stage runs [`FIRSTBOOT_PATH`]
//! once, which:
//! 1. arms the hard deadline: enables `ttlab-poweroff.timer` (fires at the deadline in UTC,
//!    every minute, and whenever started, i.e. at every boot) whose service compares the Unix
//!    time with the deadline and powers off. Polling a fixed instant, rather than a one-shot
//!    `shutdown` or a single calendar time, survives reboots, a deadline already past at boot,
//!    and a guest clock corrected late by NTP; the run strategy keeps a powered-off VM off.
//!    First boot then starts that service itself (`systemctl start --no-block`), never the
//!    check directly: the timer's run and this one are one systemd job, so a deadline already
//!    past at first boot makes a single power-off request (two would race, and the forced
//!    fallback of the loser would cut the power). The check leaves a shutdown already under
//!    way alone. The agent can move the deadline later (`POST /v1/deadline`, when a warm-pool
//!    VM is claimed by a session) or earlier: the check prefers the Unix time in
//!    `/etc/ttlab/power-off-at` when that file holds ten digits, and otherwise (missing,
//!    empty, garbage) keeps the deadline baked in here, never "no deadline"; since it runs
//!    every minute, a moved deadline takes effect within a minute;
//! 2. checks glibc ≥ 2.34, finds the agent disk by its label (waiting at most
//!    [`AGENT_DISK_WAIT_SECS`] for udev), mounts it read-only, unpacks the agent, checks its
//!    sha256 against the one this user-data pins ([`AGENT_DIGEST_PATH`]), installs it and
//!    starts it (`systemctl enable --now`), before the long setup. On an older image, a
//!    missing disk or a digest that does not match it writes the failure marker, never the
//!    readiness marker, and says why on the console;
//! 3. restarts the serial getty with root autologin;
//! 4. runs the setup script as root with `$TTLAB_NODE`, `$TTLAB_NODES` and `$TTLAB_LESSON`,
//!    output in [`SETUP_LOG_PATH`], killed (with its process group) after the lesson's setup
//!    timeout;
//! 5. as its very last step, only if all of that succeeded, writes the readiness marker. On
//!    any failure it writes the failure marker (reason and the log's last lines) instead.
//!
//! ```
//! use chrono::{TimeZone, Utc};
//! use ttlab_agent::protocol::AgentToken;
//! use ttlab_cloudinit::{AgentPayload, UserDataInput, UserDataSecret, render_user_data};
//! use ttlab_model::labels::ObjectLabels;
//!
//! let lesson = ttlab_lesson::samples::systemd_basics();
//! let agent = AgentPayload::new(b"\x7fELF the agent binary").unwrap();
//! let token = AgentToken::from_random_bytes([7; 32]);
//! let user_data = render_user_data(&UserDataInput {
//!     lesson: &lesson,
//!     node: lesson.nodes.first(),
//!     agent: &agent,
//!     token: &token,
//!     power_off_at: Utc.with_ymd_and_hms(2026, 10, 16, 15, 15, 0).unwrap(),
//! })
//! .unwrap();
//! assert!(user_data.as_str().starts_with("#cloud-config\n{"));
//! assert!(!user_data.as_str().contains(token.reveal()));
//!
//! let labels = ObjectLabels::new(
//!     "6f1c1d2e-0b7a-4c2b-9a55-1f0e2d3c4b5a".parse().unwrap(),
//!     "dev".parse().unwrap(),
//!     lesson.id.clone(),
//!     Some(lesson.nodes.first().clone()),
//! );
//! let secret = UserDataSecret::new("ttlab-6f1c1d2e-vm-cloudinit", labels, user_data).unwrap();
//! assert!(secret.size_bytes() < 16 * 1024);
//!
//! // The binary travels once per version, in a ConfigMap every VM mounts.
//! let config_map = agent.config_map(&"dev".parse().unwrap());
//! assert_eq!(config_map.metadata.name, Some(agent.config_map_name()));
//! assert_eq!(config_map.immutable, Some(true));
//! let object = secret.to_secret(None);
//! assert!(object.data.unwrap().contains_key("userdata"));
//! ```

mod error;
mod payload;
mod render;
mod secret;

pub use error::CloudInitError;
pub use payload::{
    AGENT_CONFIG_MAP_PREFIX, AGENT_KEY, AGENT_NAME_DIGITS, AGENT_VOLUME_LABEL, AgentPayload,
};
pub use render::{
    AGENT_DIGEST_PATH, AGENT_DISK_MOUNT, AGENT_DISK_WAIT_SECS, AUTOLOGIN_DROPIN_PATH,
    FIRSTBOOT_PATH, HEADER, OWN_PATHS, POWEROFF_CHECK_PATH, POWEROFF_SERVICE_PATH,
    POWEROFF_TIMER_PATH, SETUP_LOG_PATH, SETUP_PATH, TOP_LEVEL_KEYS, UserData, UserDataInput,
    render_user_data,
};
pub use secret::{COMPONENT_VALUE, UserDataSecret};
