//! `ttlabctl render`: prints, as a YAML stream like `helm template`, every object the server
//! would create for one session of a VM lesson — the cloud-init Secret and VirtualMachine of
//! each node, and for a multi-VM lesson the session Service and NetworkPolicy — so an operator
//! can review what a lesson does before students click.
//!
//! Nothing here talks to a cluster. The golden-disk state is simulated with `--golden` and fed
//! through the same observation and decision code the server uses. The agent token is a fixed
//! placeholder, never a real secret, and the hard deadline is computed from `--now` (the
//! present by default; pass a fixed `--now` for output that is the same on every run) and the
//! lifespan settings the server reads (`TTLAB_SESSION_TTL`, `TTLAB_SESSION_MAX`,
//! `TTLAB_MAX_EXTENSIONS`, `TTLAB_EXTEND_WINDOW`, `TTLAB_HARD_DEADLINE_GRACE`, checked as it
//! checks them): start + maximum lifetime + grace. A deadline that has already passed is
//! refused unless `--allow-past-deadline` is given: a guest booted from that user-data would
//! power itself off during its first boot.
//!
//! The header says what a session really costs in memory: per VM the guest's memory,
//! KubeVirt's overhead and the launcher pod's request (`ttlab_vm_manifest::launcher`), and the
//! session's total, which a namespace quota's `requests.memory` and the nodes count.
//!
//! The stream is meant for `kubectl apply --server-side -f -` or `kubectl create -f -`: a
//! cloud-init Secret carries the whole guest agent, more than the 256 KiB that client-side
//! `kubectl apply` can keep in its last-applied annotation. Its YAML is written here (see
//! [`yaml`]) so that kubectl, which reads YAML 1.1, sees the same values this program wrote:
//! a string such as `on`, `no` or `1:20` is quoted, never left for kubectl to read as a boolean
//! or a number.

use std::fmt::Write as _;
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use base64::Engine as _;
use chrono::{DateTime, SecondsFormat, Utc};
use clap::{Args, ValueEnum};
use serde_json::Value;
use ttlab_agent::protocol::AgentToken;
use ttlab_cloudinit::{AgentPayload, HEADER, UserDataInput, UserDataSecret, render_user_data};
use ttlab_disk_select::{
    ANN_IMPORT_ENDPOINT, DataSourceFacts, DataVolumeFacts, DiskDecision, GoldenObservation, Lookup,
    PvcFacts, PvcRef, decide, observe, resolve_data_source,
};
use ttlab_lesson::{GoldenSource, Lesson, LessonSet, VmDisk};
use ttlab_lifespan::{Lifespan, Policy};
use ttlab_model::labels::ObjectLabels;
use ttlab_model::{EnvName, LessonId, Runtime, SessionId};
use ttlab_vm_manifest::launcher::{self, LauncherResources, LauncherSpec};
use ttlab_vm_manifest::{SessionVms, secret_name};

/// The agent token placed in rendered user-data: all zeroes, obviously not a secret.
const PLACEHOLDER_TOKEN: [u8; AgentToken::BYTES] = [0; AgentToken::BYTES];

/// Lab files up to this size are shown decoded in the comments of their Secret.
const SHOW_FILE_MAX: usize = 16 * 1024;

/// How the stream is to be applied, printed on stderr by every run and at the end of
/// `--help`.
pub const APPLY_NOTE: &str = "Apply the output with `kubectl apply --server-side -f -` or \
`kubectl create -f -`, not with plain `kubectl apply`: a cloud-init Secret is larger than the \
256 KiB last-applied annotation that client-side apply keeps.";

/// Arguments of `ttlabctl render`.
#[derive(Debug, Args)]
#[command(after_help = APPLY_NOTE)]
pub struct RenderArgs {
    /// The lesson to render.
    #[arg(long)]
    pub lesson: LessonId,
    /// A lesson file, or a directory of `*.yaml` lesson files.
    #[arg(long, env = "TTLAB_LESSONS", default_value = "lessons")]
    pub lessons: PathBuf,
    /// The session id (a UUID); object names derive from it.
    #[arg(long)]
    pub session_id: SessionId,
    /// The environment label of the backend (`dev`, `prod`, …).
    #[arg(long, env = "TTLAB_ENV")]
    pub env: EnvName,
    /// Namespace written into every object; unset leaves it to `kubectl -n`.
    #[arg(long, env = "TTLAB_NAMESPACE")]
    pub namespace: Option<String>,
    /// The golden-disk state to simulate, for a lesson that asks for the golden disk
    /// [default: ready].
    #[arg(long, value_enum)]
    pub golden: Option<GoldenCase>,
    /// The guest agent binary to embed [default: `ttlab-agent` next to this executable].
    #[arg(long, env = "TTLAB_AGENT_BINARY")]
    pub agent_binary: Option<PathBuf>,
    /// The session's start (RFC 3339) [default: the present]; the guest's hard-deadline
    /// power-off derives from it.
    #[arg(long)]
    pub now: Option<DateTime<Utc>>,
    /// Render even when the hard deadline is already past (the guest would power itself off
    /// during its first boot); a warning is printed instead of the refusal.
    #[arg(long)]
    pub allow_past_deadline: bool,
    /// Session time-to-live, as the server reads it (`60m`).
    #[arg(long, env = "TTLAB_SESSION_TTL")]
    pub session_ttl: Option<String>,
    /// Maximum session lifetime, as the server reads it (`180m`).
    #[arg(long, env = "TTLAB_SESSION_MAX")]
    pub session_max: Option<String>,
    /// How many extensions a session may have, as the server reads it (`3`).
    #[arg(long, env = "TTLAB_MAX_EXTENSIONS")]
    pub max_extensions: Option<String>,
    /// How long before the expiry a student may extend, as the server reads it (`15m`).
    #[arg(long, env = "TTLAB_EXTEND_WINDOW")]
    pub extend_window: Option<String>,
    /// How long after the maximum lifetime the guest powers itself off, as the server reads
    /// it (`15m`): the power-off time in the rendered user-data follows it.
    #[arg(long, env = "TTLAB_HARD_DEADLINE_GRACE")]
    pub hard_deadline_grace: Option<String>,
}

/// A golden-disk state to simulate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GoldenCase {
    /// Bound, ReadOnlyMany, import done, the expected image.
    Ready,
    /// The PVC (or DataSource) does not exist.
    Missing,
    /// CDI is still importing (DataVolume ImportInProgress).
    Importing,
    /// The PVC has a deletionTimestamp.
    Deleting,
    /// The PVC is ReadWriteOnce.
    Rwo,
    /// The PVC was imported from another image.
    WrongImage,
    /// The backend may not read the PVC.
    Forbidden,
}

/// Runs `ttlabctl render`, writing the stream to stdout (and how to apply it to stderr).
pub fn run(args: &RenderArgs) -> Result<()> {
    let present = Utc::now();
    let out = render(args, present)?;
    eprintln!("ttlabctl render: {APPLY_NOTE}");
    let start = args.now.unwrap_or(present);
    if let Some(deadline) = past_deadline(args, start, present)? {
        eprintln!(
            "ttlabctl render: warning: the hard-deadline power-off ({}) is already past: a \
             guest booted from this user-data powers itself off during its first boot",
            deadline.to_rfc3339_opts(SecondsFormat::Secs, true)
        );
    }
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(out.as_bytes())
        .and_then(|()| stdout.flush())
    {
        // The reader stopped early (`| head`): not an error of ours.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other.context("writing to stdout"),
    }
}

/// The hard deadline when it is not after `present`, else `None`.
fn past_deadline(
    args: &RenderArgs,
    start: DateTime<Utc>,
    present: DateTime<Utc>,
) -> Result<Option<DateTime<Utc>>> {
    let policy = policy(args)?;
    let deadline = Lifespan::open(start, &policy).hard_deadline(&policy);
    Ok((deadline <= present).then_some(deadline))
}

/// The lifespan policy, from the same settings and with the same checks as the server's.
fn policy(args: &RenderArgs) -> Result<Policy> {
    Policy::from_settings(
        args.session_ttl.as_deref(),
        args.session_max.as_deref(),
        args.max_extensions.as_deref(),
    )
    .and_then(|p| p.with_extend_window_setting(args.extend_window.as_deref()))
    .and_then(|p| p.with_hard_deadline_grace_setting(args.hard_deadline_grace.as_deref()))
    .context("invalid session time settings")
}

/// Renders the YAML stream; `present` is the current time (the default `--now`, and what the
/// hard deadline must lie after unless `--allow-past-deadline`).
pub fn render(args: &RenderArgs, present: DateTime<Utc>) -> Result<String> {
    let lessons = LessonSet::load(&args.lessons).with_context(|| {
        format!(
            "cannot load lessons from {} (set --lessons or TTLAB_LESSONS)",
            args.lessons.display()
        )
    })?;
    let Some(lesson) = lessons.get(&args.lesson) else {
        let known: Vec<String> = lessons.ids().map(ToString::to_string).collect();
        bail!(
            "unknown lesson `{}` in {}; known lessons: {}",
            args.lesson,
            args.lessons.display(),
            if known.is_empty() {
                "none".to_owned()
            } else {
                known.join(", ")
            }
        );
    };
    if lesson.runtime != Runtime::Vm {
        bail!(
            "lesson `{}` runs as a pod; `ttlabctl render` shows VM sessions only",
            lesson.id
        );
    }

    let (disk, disk_note) = simulate_disk(lesson, args.golden, args.namespace.as_deref());
    let policy = policy(args)?;
    let start = args.now.unwrap_or(present);
    if let Some(deadline) = past_deadline(args, start, present)?
        && !args.allow_past_deadline
    {
        bail!(
            "the hard-deadline power-off ({}, from --now {}) is already past: a guest booted \
             from this user-data would power itself off during its first boot; give a later \
             --now (default: the present), or --allow-past-deadline to render it anyway",
            deadline.to_rfc3339_opts(SecondsFormat::Secs, true),
            start.to_rfc3339_opts(SecondsFormat::Secs, true)
        );
    }
    let power_off_at = Lifespan::open(start, &policy).hard_deadline(&policy);

    let agent_path = match &args.agent_binary {
        Some(p) => p.clone(),
        None => default_agent_binary()?,
    };
    let agent = AgentPayload::new(&read_file(&agent_path)?)
        .with_context(|| format!("agent binary {}", agent_path.display()))?;
    let token = AgentToken::from_random_bytes(PLACEHOLDER_TOKEN);

    let mut secrets = Vec::new();
    for node in lesson.nodes.iter() {
        let user_data = render_user_data(&UserDataInput {
            lesson,
            node,
            agent: &agent,
            token: &token,
            power_off_at,
        })
        .with_context(|| format!("rendering the user-data of node `{node}`"))?;
        let labels = ObjectLabels::new(
            args.session_id,
            args.env.clone(),
            lesson.id.clone(),
            Some(node.clone()),
        );
        let secret = UserDataSecret::new(secret_name(args.session_id, node), labels, user_data)
            .with_context(|| format!("the cloud-init Secret of node `{node}`"))?;
        secrets.push(secret);
    }

    let manifests = ttlab_vm_manifest::render_with_agent(
        &SessionVms {
            session: args.session_id,
            env: args.env.clone(),
            lesson: lesson.id.clone(),
            namespace: args.namespace.clone(),
            image: lesson.image.clone(),
            memory: lesson.memory.as_str().to_owned(),
            cores: lesson.cores,
            nodes: lesson.nodes.as_slice().to_vec(),
            disk: disk.clone(),
            termination_grace_period_seconds:
                ttlab_vm_manifest::DEFAULT_TERMINATION_GRACE_PERIOD_SECONDS,
        },
        &ttlab_vm_manifest::AgentDisk {
            config_map: agent.config_map_name(),
            volume_label: agent.volume_label().to_owned(),
        },
    )
    .context("rendering the VirtualMachines")?;

    let disk_line = describe_disk(&disk);
    let cost = LauncherSpec::lab_vm(lesson.memory.bytes(), lesson.cores).resources();
    let vm_line = vm_memory_line(lesson, &cost);
    let total: usize = secrets.iter().map(UserDataSecret::size_bytes).sum();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# ttlabctl render: lesson {} ({} node{}), session {}, env {}",
        lesson.id,
        lesson.nodes.len(),
        if lesson.nodes.len() == 1 { "" } else { "s" },
        args.session_id,
        args.env
    );
    let _ = writeln!(out, "# golden disk: {disk_note}");
    for line in memory_lines(lesson, &cost) {
        let _ = writeln!(out, "# {line}");
    }
    let _ = writeln!(
        out,
        "# agent token: a fixed placeholder (the server generates a random one per VM); \
         hard-deadline power-off at {} (from --now {})",
        power_off_at.to_rfc3339_opts(SecondsFormat::Secs, true),
        start.to_rfc3339_opts(SecondsFormat::Secs, true)
    );
    let _ = writeln!(
        out,
        "# agent binary: {} ({} bytes, sha256 {}), delivered once per version in the shared \
         ConfigMap {} ({} bytes of {} allowed), not in the Secrets",
        agent_path.display(),
        agent.binary_len(),
        agent.digest(),
        agent.config_map_name(),
        agent.config_map_size_bytes(),
        UserDataSecret::MAX_BYTES
    );
    let mut config_map = serde_json::to_value(agent.config_map(&args.env))?;
    config_map["apiVersion"] = Value::from("v1");
    config_map["kind"] = Value::from("ConfigMap");
    if let Some(ns) = args.namespace.as_deref() {
        config_map["metadata"]["namespace"] = Value::String(ns.to_owned());
    }
    document(
        &mut out,
        &[format!(
            "the agent of this version, shared by every VM that runs it (the server creates it \
             if absent; immutable): {} bytes of {} allowed",
            agent.config_map_size_bytes(),
            UserDataSecret::MAX_BYTES
        )],
        &[],
        &config_map,
    )?;

    for (secret, vm) in secrets.iter().zip(&manifests.vms) {
        let size = secret_size(secret);
        document(
            &mut out,
            &[format!("{disk_line}; {size}")],
            &file_comments(secret)?,
            &secret_document(secret, args.namespace.as_deref())?,
        )?;
        document(
            &mut out,
            &[format!("{disk_line}; {size}"), vm_line.clone()],
            &[],
            &serde_json::to_value(vm)?,
        )?;
    }
    let session_size = format!(
        "cloud-init Secrets: {total} bytes in total ({} per Secret at most)",
        UserDataSecret::MAX_BYTES
    );
    if let Some(service) = &manifests.service {
        document(
            &mut out,
            &[format!("{disk_line}; {session_size}")],
            &[],
            &serde_json::to_value(service)?,
        )?;
    }
    if let Some(policy) = &manifests.network_policy {
        document(
            &mut out,
            &[format!("{disk_line}; {session_size}")],
            &[],
            &serde_json::to_value(policy)?,
        )?;
    }
    Ok(out)
}

/// Simulates what the cluster would show for `case` and runs it through the real observation
/// and decision code. Returns the decision and a one-line description of the simulation.
fn simulate_disk(
    lesson: &Lesson,
    case: Option<GoldenCase>,
    namespace: Option<&str>,
) -> (DiskDecision, String) {
    let golden = match &lesson.vm_disk {
        VmDisk::Container => {
            let note = match case {
                Some(c) => format!(
                    "not requested by the lesson (--golden {} has no effect)",
                    c.to_possible_value()
                        .map(|v| v.get_name().to_owned())
                        .unwrap_or_default()
                ),
                None => "not requested by the lesson".to_owned(),
            };
            return (decide(&GoldenObservation::NotRequested), note);
        }
        VmDisk::Golden(g) => g,
    };
    let case = case.unwrap_or(GoldenCase::Ready);
    let case_name = case
        .to_possible_value()
        .map(|v| v.get_name().to_owned())
        .unwrap_or_default();

    // A DataSource resolves to the PVC it currently points at (here: a simulated import).
    let vm_namespace = namespace.unwrap_or("default");
    let (claim, source_note) = match &golden.source {
        GoldenSource::Pvc(name) => (name.clone(), format!("PVC {name}")),
        GoldenSource::DataSource(name) => {
            let resolved = resolve_data_source(
                &lookup(
                    case,
                    DataSourceFacts {
                        pvc: Some(PvcRef {
                            namespace: vm_namespace.to_owned(),
                            name: format!("{name}-simulated-import"),
                        }),
                    },
                ),
                vm_namespace,
            );
            match resolved {
                Ok(claim) => {
                    let note = format!("DataSource {name} → PVC {claim}");
                    (claim, note)
                }
                Err(seen) => {
                    return (
                        decide(&seen),
                        format!("simulated `{case_name}`: DataSource {name} not readable"),
                    );
                }
            }
        }
    };

    let expected = golden.expected_image.as_deref();
    let recorded = match case {
        GoldenCase::WrongImage => format!(
            "docker://{}",
            other_image(expected.unwrap_or(&lesson.image))
        ),
        _ => format!("docker://{}", expected.unwrap_or(&lesson.image)),
    };
    let pvc = PvcFacts {
        name: claim,
        phase: Some("Bound".to_owned()),
        access_modes: vec![
            if case == GoldenCase::Rwo {
                "ReadWriteOnce"
            } else {
                "ReadOnlyMany"
            }
            .to_owned(),
        ],
        being_deleted: case == GoldenCase::Deleting,
        annotations: [(ANN_IMPORT_ENDPOINT.to_owned(), recorded)].into(),
    };
    let data_volume = Lookup::Found(DataVolumeFacts {
        phase: Some(
            if case == GoldenCase::Importing {
                "ImportInProgress"
            } else {
                "Succeeded"
            }
            .to_owned(),
        ),
        progress: Some(
            if case == GoldenCase::Importing {
                "42.00%"
            } else {
                "100.0%"
            }
            .to_owned(),
        ),
    });
    let seen = observe(&lookup(case, pvc), &data_volume, expected);
    let what = match &seen {
        GoldenObservation::Importing { phase, progress } => format!(
            "still importing (DataVolume {}, {})",
            phase.as_deref().unwrap_or("?"),
            progress.as_deref().unwrap_or("?")
        ),
        GoldenObservation::WrongImage { expected, found } => {
            format!("holds {found}, not {expected}")
        }
        other => format!("{other:?}"),
    };
    (
        decide(&seen),
        format!("simulated `{case_name}` for {source_note}: {what}"),
    )
}

/// What a read of the simulated object returns for `case`.
fn lookup<T>(case: GoldenCase, found: T) -> Lookup<T> {
    match case {
        GoldenCase::Missing => Lookup::NotFound,
        GoldenCase::Forbidden => Lookup::Forbidden,
        _ => Lookup::Found(found),
    }
}

/// An image reference that differs from `image` (for `--golden wrong-image`).
fn other_image(image: &str) -> String {
    format!("{image}-other")
}

/// What a session of `lesson` costs in memory, as the header says it: per VM the guest's
/// memory, KubeVirt's overhead, the launcher pod's request, and the session's total.
fn memory_lines(lesson: &Lesson, cost: &LauncherResources) -> Vec<String> {
    let vms = lesson.nodes.len() as u64;
    let session = cost.pod_memory.saturating_mul(vms);
    vec![
        format!(
            "memory per VM (KubeVirt {}): guest {} + KubeVirt's overhead {} = {} requested by \
             the launcher pod's compute container, + {} for its serial-console log sidecar = {} \
             counted by requests.memory quotas and the nodes",
            launcher::KUBEVIRT_RELEASE,
            lesson.memory,
            quantity(cost.overhead),
            quantity(cost.compute_memory),
            launcher::CONSOLE_LOG_CONTAINER
                .requests
                .iter()
                .find(|(k, _)| *k == "memory")
                .map_or("0", |(_, v)| v),
            quantity(cost.pod_memory),
        ),
        format!(
            "memory of a session: {vms} VM{} × {} bytes = {session} bytes ({:.2} GiB) of \
             requests.memory",
            if vms == 1 { "" } else { "s" },
            cost.pod_memory,
            session as f64 / f64::from(1u32 << 30),
        ),
    ]
}

/// The memory line of each VirtualMachine's document.
fn vm_memory_line(lesson: &Lesson, cost: &LauncherResources) -> String {
    format!(
        "memory: guest {} + KubeVirt's overhead {} = launcher pod request {} ({} with the \
         console log's sidecar)",
        lesson.memory,
        quantity(cost.overhead),
        quantity(cost.compute_memory),
        quantity(cost.pod_memory)
    )
}

/// `bytes` as a quantity when a binary suffix divides it (`292Mi`), else in bytes and MiB.
fn quantity(bytes: u64) -> String {
    let text = launcher::bytes_quantity(bytes).to_string();
    if text.ends_with('i') {
        text
    } else {
        format!(
            "{bytes} bytes ({:.1} MiB)",
            bytes as f64 / f64::from(1u32 << 20)
        )
    }
}

fn describe_disk(disk: &DiskDecision) -> String {
    match disk {
        DiskDecision::Golden { claim } => {
            format!(
                "disk: golden (claim {claim}), reason: {}",
                disk.reason_str()
            )
        }
        DiskDecision::ContainerDisk { .. } => {
            format!("disk: container disk, reason: {}", disk.reason_str())
        }
    }
}

fn secret_size(secret: &UserDataSecret) -> String {
    format!(
        "Secret {}: {} bytes of {} allowed",
        secret.name(),
        secret.size_bytes(),
        UserDataSecret::MAX_BYTES
    )
}

/// The Secret with its user-data as readable `stringData` block text instead of base64 `data`.
fn secret_document(secret: &UserDataSecret, namespace: Option<&str>) -> Result<Value> {
    let mut value = serde_json::to_value(secret.to_secret(None))?;
    let obj = value.as_object_mut().context("a Secret is an object")?;
    obj.remove("data");
    obj.insert(
        "stringData".to_owned(),
        serde_json::json!({ UserDataSecret::KEY: secret.user_data().as_str() }),
    );
    if let Some(ns) = namespace {
        value["metadata"]["namespace"] = Value::String(ns.to_owned());
    }
    Ok(value)
}

/// Comment lines listing the files the user-data writes, with small text files decoded (the
/// user-data carries every file base64-encoded, so no lesson byte can become a cloud-config key).
fn file_comments(secret: &UserDataSecret) -> Result<Vec<String>> {
    let text = secret.user_data().as_str();
    let body = text
        .strip_prefix(HEADER)
        .context("user-data without its header")?;
    let config: Value = serde_json::from_str(body).context("user-data body is not JSON")?;
    let mut lines = vec!["files written on first boot:".to_owned()];
    for file in config["write_files"].as_array().into_iter().flatten() {
        let path = file["path"].as_str().unwrap_or("?");
        let mode = file["permissions"].as_str().unwrap_or("?");
        let bytes = decode_file(file)?;
        let shown = std::str::from_utf8(&bytes)
            .ok()
            // A comment holds printable text only: a control character (an escape sequence of
            // a coloured message, say) would make the whole stream unreadable YAML.
            .filter(|t| {
                bytes.len() <= SHOW_FILE_MAX
                    && !t.chars().any(|c| {
                        (c.is_control() && c != '\n' && c != '\t')
                            || matches!(c, '\u{2028}' | '\u{2029}' | '\u{FEFF}')
                    })
            });
        match shown {
            Some(t) => {
                lines.push(format!("  {path} ({mode}, {} bytes):", bytes.len()));
                lines.extend(t.lines().map(|l| format!("  | {l}").trim_end().to_owned()));
            }
            None => lines.push(format!(
                "  {path} ({mode}, {} bytes, not shown)",
                bytes.len()
            )),
        }
    }
    Ok(lines)
}

fn decode_file(file: &Value) -> Result<Vec<u8>> {
    let content = file["content"].as_str().unwrap_or_default();
    let raw = base64::engine::general_purpose::STANDARD
        .decode(content)
        .context("user-data file content is not base64")?;
    if file["encoding"].as_str() == Some("gz+b64") {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(raw.as_slice())
            .read_to_end(&mut out)
            .context("user-data file content is not gzip")?;
        Ok(out)
    } else {
        Ok(raw)
    }
}

/// Appends one `---` document: `header` lines as comments, then `extra` comment lines, then the
/// object.
fn document(out: &mut String, header: &[String], extra: &[String], object: &Value) -> Result<()> {
    out.push_str("---\n");
    let kind = object["kind"].as_str().unwrap_or("?");
    let name = object["metadata"]["name"].as_str().unwrap_or("?");
    let _ = writeln!(out, "# {kind} {name}");
    for line in header.iter().chain(extra) {
        let _ = writeln!(out, "# {line}");
    }
    yaml::write_document(out, object);
    Ok(())
}

/// A YAML writer for JSON values whose every scalar reads back as the same value in YAML 1.2
/// (this program's tests) and in YAML 1.1 (kubectl): strings are plain only when no YAML
/// version could read them as anything but that string, multi-line strings are literal blocks
/// (the user-data stays readable), and everything else is double-quoted.
mod yaml {
    use serde_json::Value;

    /// Appends `value` (an object) as one document, keys in the object's order.
    pub fn write_document(out: &mut String, value: &Value) {
        match value {
            Value::Object(map) if !map.is_empty() => write_map(out, map, 0),
            other => {
                out.push_str(&inline(other));
                out.push('\n');
            }
        }
    }

    fn pad(out: &mut String, indent: usize) {
        out.extend(std::iter::repeat_n(' ', indent));
    }

    fn write_map(out: &mut String, map: &serde_json::Map<String, Value>, indent: usize) {
        for (key, value) in map {
            pad(out, indent);
            out.push_str(&scalar_str(key));
            out.push(':');
            write_value(out, value, indent, indent + 2);
        }
    }

    /// Items at `indent`; a mapping or sequence item starts on the line of its `-`.
    fn write_seq(out: &mut String, items: &[Value], indent: usize) {
        for item in items {
            pad(out, indent);
            out.push('-');
            let mut inner = String::new();
            match item {
                Value::Object(map) if !map.is_empty() => write_map(&mut inner, map, indent + 2),
                Value::Array(nested) if !nested.is_empty() => {
                    write_seq(&mut inner, nested, indent + 2);
                }
                other => {
                    write_value(out, other, indent + 2, indent + 2);
                    continue;
                }
            }
            out.push(' ');
            out.push_str(&inner[indent + 2..]);
        }
    }

    /// Writes `value` after a `key:` or `-` already on the line; `nested` is the indentation of
    /// a mapping or block below it, `seq_indent` that of a sequence below a key.
    fn write_value(out: &mut String, value: &Value, seq_indent: usize, nested: usize) {
        match value {
            Value::Object(map) if !map.is_empty() => {
                out.push('\n');
                write_map(out, map, nested);
            }
            Value::Array(items) if !items.is_empty() => {
                out.push('\n');
                write_seq(out, items, seq_indent);
            }
            Value::String(s) if literal_block(s) => write_block(out, s, nested),
            other => {
                out.push(' ');
                out.push_str(&inline(other));
                out.push('\n');
            }
        }
    }

    fn inline(value: &Value) -> String {
        match value {
            Value::Null => "null".to_owned(),
            Value::Bool(b) => b.to_string(),
            Value::Number(n) => n.to_string(),
            Value::String(s) => scalar_str(s),
            Value::Array(_) => "[]".to_owned(),
            Value::Object(_) => "{}".to_owned(),
        }
    }

    /// Words YAML 1.1 reads as booleans or null (in any case).
    const WORDS: [&str; 11] = [
        "y", "n", "yes", "no", "on", "off", "true", "false", "null", "nil", "none",
    ];

    /// Plain if it starts with a letter or `/`, holds only letters, digits, `-`, `.`, `_` and
    /// `/`, and is not a word YAML 1.1 takes for a boolean or null; double-quoted otherwise.
    fn scalar_str(s: &str) -> String {
        let plain = s
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'/')
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'/'))
            && !WORDS.iter().any(|w| w.eq_ignore_ascii_case(s));
        if plain { s.to_owned() } else { quoted(s) }
    }

    /// A YAML double-quoted scalar: `\\`, `"` and every character that is not printable or
    /// that some YAML version takes for a line break are escaped.
    fn quoted(s: &str) -> String {
        let mut q = String::with_capacity(s.len() + 2);
        q.push('"');
        for c in s.chars() {
            match c {
                '"' => q.push_str("\\\""),
                '\\' => q.push_str("\\\\"),
                '\n' => q.push_str("\\n"),
                '\t' => q.push_str("\\t"),
                c if needs_escape(c) => q.push_str(&format!("\\u{:04X}", u32::from(c))),
                c => q.push(c),
            }
        }
        q.push('"');
        q
    }

    fn needs_escape(c: char) -> bool {
        c.is_control() || matches!(c, '\u{2028}' | '\u{2029}' | '\u{FEFF}')
    }

    /// Whether `s` is written as a literal block: several lines of printable text, at least one
    /// of them not empty.
    fn literal_block(s: &str) -> bool {
        s.contains('\n')
            && s.lines().any(|l| !l.trim().is_empty())
            && !s.chars().any(|c| c != '\n' && c != '\t' && needs_escape(c))
    }

    /// `|`, `|-` or `|+` (with an indentation indicator when the text starts with a space), then
    /// the lines indented by `indent`.
    fn write_block(out: &mut String, s: &str, indent: usize) {
        let body = s.trim_end_matches('\n');
        let trailing = s.len() - body.len();
        out.push_str(" |");
        let first = body.lines().find(|l| !l.is_empty()).unwrap_or_default();
        if first.starts_with(' ') || first.starts_with('\t') {
            out.push('2');
        }
        out.push_str(match trailing {
            0 => "-",
            1 => "",
            _ => "+",
        });
        out.push('\n');
        for line in body.split('\n') {
            if !line.is_empty() {
                pad(out, indent);
                out.push_str(line);
            }
            out.push('\n');
        }
        for _ in 1..trailing {
            out.push('\n');
        }
    }

    #[cfg(test)]
    mod tests {
        use serde::Deserialize as _;
        use serde_json::{Value, json};

        fn written(value: &Value) -> String {
            let mut out = String::new();
            super::write_document(&mut out, value);
            out
        }

        fn read(text: &str) -> Value {
            Value::deserialize(serde_norway::Deserializer::from_str(text)).expect("valid YAML")
        }

        #[test]
        fn strings_yaml_1_1_would_misread_are_quoted() {
            let words = [
                "on",
                "off",
                "yes",
                "no",
                "y",
                "n",
                "Y",
                "NO",
                "On",
                "true",
                "null",
                "~",
                "1:20",
                "1_000",
                "0644",
                "012",
                "0x1F",
                "1e3",
                ".inf",
                "2026-01-01",
                "-1",
                "",
                " a",
                "a: b",
                "#x",
                "@x",
                "*x",
                "!x",
                "&x",
                "%x",
                "[x]",
                "{x}",
                "x\"y",
                "a\\b",
                "tab\there",
                "bell\u{7}",
                "line\u{2028}sep",
            ];
            let value = json!({ "labels": words.iter().map(|w| (w.to_string(), Value::from(*w))).collect::<serde_json::Map<_, _>>() });
            let text = written(&value);
            assert_eq!(read(&text), value, "{text}");
            for w in words {
                assert!(
                    !text.lines().any(|l| l.trim() == format!("{w}: {w}")),
                    "{w:?} left plain in {text}"
                );
            }
            // Words that mean only themselves stay plain.
            let plain = json!({"app.kubernetes.io/managed-by": "ttlab", "ttlab.io/node": "worker-1", "image": "/x/y"});
            assert_eq!(
                written(&plain),
                "app.kubernetes.io/managed-by: ttlab\nttlab.io/node: worker-1\nimage: /x/y\n"
            );
        }

        #[test]
        fn nested_values_and_text_blocks_read_back_unchanged() {
            let value = json!({
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "tt-a-vm-ci", "labels": {}, "finalizers": []},
                "stringData": {
                    "userdata": "#cloud-config\n{\n  \"a\": 1\n}",
                    "clip": "one\ntwo\n",
                    "keep": "one\n\n\n",
                    "indented": "  first\nsecond\n",
                    "blank lines": "a\n\n   \nb",
                    "tabs": "a\tb\n\tc"
                },
                "containers": [
                    {"name": "lab", "args": ["  spaced\nlines\n", "-c"], "env": [{"name": "A", "value": "yes"}]},
                    "plain"
                ],
                "spec": {
                    "list": [1, 2.5, true, null, "on", {"a": [], "b": {"c": "d"}}, [[1], []], "x\ny"],
                    "empty": "",
                    "number": -3
                }
            });
            let text = written(&value);
            assert_eq!(read(&text), value, "{text}");
            assert!(
                text.contains("  userdata: |-\n    #cloud-config\n    {\n      \"a\": 1\n    }\n"),
                "{text}"
            );
        }
    }
}

fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("cannot read the agent binary {}", path.display()))
}

/// `ttlab-agent` in the directory of the running executable.
fn default_agent_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot locate the ttlabctl executable")?;
    let path = exe
        .parent()
        .context("the ttlabctl executable has no directory")?
        .join("ttlab-agent");
    if !path.is_file() {
        bail!(
            "no agent binary at {} (the default: `ttlab-agent` next to ttlabctl); build it with \
             `cargo build -p ttlab-agent-bin` or pass --agent-binary PATH",
            path.display()
        );
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use clap::Args as _;
    use serde::Deserialize as _;

    use super::*;

    #[test]
    fn the_help_says_how_to_apply_the_output() {
        let help = RenderArgs::augment_args(clap::Command::new("render"))
            .render_long_help()
            .to_string();
        assert!(help.contains("kubectl apply --server-side -f -"), "{help}");
        assert!(help.contains("kubectl create -f -"), "{help}");
    }

    #[test]
    fn names_kubectl_would_misread_are_quoted_in_the_stream() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("yes.yaml"),
            "id: \"yes\"\ntitle: Tricky names\nruntime: vm\nimage: quay.io/containerdisks/debian:12\n\
             memory: 256Mi\nnodes: [\"on\", \"n\"]\n",
        )
        .unwrap();
        let agent = dir.path().join("ttlab-agent");
        std::fs::write(&agent, vec![7u8; 4096]).unwrap();
        let args = RenderArgs {
            lesson: "yes".parse().unwrap(),
            lessons: dir.path().to_owned(),
            session_id: "6f1c1d2e-0b7a-4c2b-9a55-1f0e2d3c4b5a".parse().unwrap(),
            env: "dev".parse().unwrap(),
            namespace: None,
            golden: None,
            agent_binary: Some(agent),
            now: Some("2026-01-01T00:00:00Z".parse().unwrap()),
            allow_past_deadline: false,
            session_ttl: None,
            session_max: None,
            max_extensions: None,
            extend_window: None,
            hard_deadline_grace: None,
        };
        let present = "2026-01-01T00:00:00Z".parse().unwrap();
        let stream = render(&args, present).unwrap();
        assert_eq!(stream, render(&args, present).unwrap(), "deterministic");
        for plain in [
            "ttlab.io/node: on",
            "ttlab.io/node: n",
            "ttlab.io/lesson: yes",
        ] {
            assert!(
                !stream.lines().any(|l| l.trim_end().ends_with(plain)),
                "{plain:?} is read as a boolean by kubectl"
            );
        }
        assert!(stream.contains("ttlab.io/node: \"on\""));
        let docs: Vec<Value> = serde_norway::Deserializer::from_str(&stream)
            .map(|d| Value::deserialize(d).expect("valid YAML"))
            .filter(|v| !v.is_null())
            .collect();
        let nodes: Vec<&str> = docs
            .iter()
            .filter(|d| d["kind"] == "VirtualMachine")
            .map(|d| d["metadata"]["labels"]["ttlab.io/node"].as_str().unwrap())
            .collect();
        assert_eq!(nodes, ["on", "n"]);
        assert_eq!(
            docs[0]["kind"], "ConfigMap",
            "the agent's shared ConfigMap first"
        );
        assert_eq!(docs[1]["metadata"]["labels"]["ttlab.io/lesson"], "yes");
    }
}
