//! `ttlabctl render`: prints, as a YAML stream like `helm template`, every object the server
//! would create for one session of a VM lesson — the cloud-init Secret and VirtualMachine of
//! each node, and for a multi-VM lesson the session Service and NetworkPolicy — so an operator
//! can review what a lesson does before students click.
//!
//! Nothing here talks to a cluster. The golden-disk state is simulated with `--golden` and fed
//! through the same observation and decision code the server uses. The agent token is a fixed
//! placeholder, never a real secret, and the hard deadline is computed from `--now` (fixed by
//! default), so the output is the same on every run.

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
use ttlab_vm_manifest::{SessionVms, secret_name};

/// The `--now` used when none is given: output stays the same from run to run.
pub const DEFAULT_NOW: &str = "2026-01-01T00:00:00Z";

/// The agent token placed in rendered user-data: all zeroes, obviously not a secret.
const PLACEHOLDER_TOKEN: [u8; AgentToken::BYTES] = [0; AgentToken::BYTES];

/// Lab files up to this size are shown decoded in the comments of their Secret.
const SHOW_FILE_MAX: usize = 16 * 1024;

/// Arguments of `ttlabctl render`.
#[derive(Debug, Args)]
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
    /// The session's start (RFC 3339); the guest's hard-deadline power-off derives from it.
    #[arg(long, default_value = DEFAULT_NOW)]
    pub now: DateTime<Utc>,
    /// Session time-to-live, as the server reads it (`60m`).
    #[arg(long, env = "TTLAB_SESSION_TTL")]
    pub session_ttl: Option<String>,
    /// Maximum session lifetime, as the server reads it (`180m`).
    #[arg(long, env = "TTLAB_SESSION_MAX")]
    pub session_max: Option<String>,
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

/// Runs `ttlabctl render`, writing the stream to stdout.
pub fn run(args: &RenderArgs) -> Result<()> {
    let out = render(args)?;
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

/// Renders the YAML stream.
pub fn render(args: &RenderArgs) -> Result<String> {
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
    let policy = Policy::from_settings(
        args.session_ttl.as_deref(),
        args.session_max.as_deref(),
        None,
    )
    .context("invalid session time settings")?;
    let power_off_at = Lifespan::open(args.now, &policy).hard_deadline(&policy);

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

    let manifests = ttlab_vm_manifest::render(&SessionVms {
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
    })
    .context("rendering the VirtualMachines")?;

    let disk_line = describe_disk(&disk);
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
    let _ = writeln!(
        out,
        "# agent token: a fixed placeholder (the server generates a random one per VM); \
         hard-deadline power-off at {} (from --now {})",
        power_off_at.to_rfc3339_opts(SecondsFormat::Secs, true),
        args.now.to_rfc3339_opts(SecondsFormat::Secs, true)
    );
    let _ = writeln!(
        out,
        "# agent binary: {} ({} bytes, {} bytes gzip+base64)",
        agent_path.display(),
        agent.binary_len(),
        agent.encoded_len()
    );

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
            &[format!("{disk_line}; {size}")],
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
            .filter(|t| bytes.len() <= SHOW_FILE_MAX && !t.contains('\0'));
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
    out.push_str(&serde_norway::to_string(object).context("writing YAML")?);
    Ok(())
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
