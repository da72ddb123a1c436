//! cloud-init rendering, with the round trip as the oracle: whatever files, modes, contents,
//! setup script, node and deadline a lesson has, parsing the rendered user-data back (as
//! cloud-init's YAML loader would) gives exactly ttlab's own files followed by the lesson's,
//! byte for byte, and nothing else: the same three top-level keys, one `runcmd` entry.

#![no_main]

use std::collections::BTreeSet;
use std::io::Read as _;
use std::sync::OnceLock;

use arbitrary::Arbitrary;
use base64::Engine as _;
use chrono::{TimeZone, Utc};
use libfuzzer_sys::fuzz_target;
use serde_norway::Value;
use ttlab_agent::protocol::AgentToken;
use ttlab_cloudinit::{
    AgentPayload, FIRSTBOOT_PATH, HEADER, OWN_PATHS, SETUP_PATH, TOP_LEVEL_KEYS, UserDataInput,
    UserDataSecret, render_user_data,
};
use ttlab_lesson::{FileMode, LabFile, LabPath, samples};
use ttlab_model::labels::ObjectLabels;

#[derive(Debug, Arbitrary)]
struct Input {
    files: Vec<(String, u16, Vec<u8>)>,
    setup: Option<String>,
    node: u8,
    token: [u8; 32],
    power_off_at: u32,
}

fn agent() -> &'static AgentPayload {
    static AGENT: OnceLock<AgentPayload> = OnceLock::new();
    AGENT.get_or_init(|| AgentPayload::new(b"\x7fELF stand-in for the agent").unwrap())
}

fuzz_target!(|input: Input| {
    // Two-node lesson, so the node (hostname, $TTLAB_NODE) varies too.
    let mut lesson = samples::kubeadm_cluster();
    let mut seen = BTreeSet::new();
    lesson.files = input
        .files
        .into_iter()
        .take(16)
        .filter_map(|(path, mode, content)| {
            let path = LabPath::new(path).ok()?;
            seen.insert(path.clone()).then(|| LabFile {
                path,
                mode: FileMode::new(u32::from(mode) & 0o7777).unwrap(),
                content,
            })
        })
        .collect();
    lesson.setup = input.setup.filter(|s| !s.trim().is_empty());
    let nodes = lesson.nodes.as_slice();
    let node = nodes[usize::from(input.node) % nodes.len()].clone();
    let token = AgentToken::from_random_bytes(input.token);
    // The renderer accepts deadlines from 1970 to 2100; later ones are a clear error.
    let power_off_at = Utc
        .timestamp_opt(i64::from(input.power_off_at % 4_102_444_801), 0)
        .single()
        .unwrap();

    let user_data = render_user_data(&UserDataInput {
        lesson: &lesson,
        node: &node,
        agent: agent(),
        token: &token,
        power_off_at,
    })
    .expect("every valid VM lesson renders");
    let text = user_data.as_str();
    assert!(text.starts_with(HEADER));
    // The token only ever travels base64-encoded inside its file. (Unless the lesson itself
    // happens to spell it: an all-zero token is 64 zeros, which a lesson's path may contain.)
    let secret = token.reveal();
    let in_lesson = lesson.setup.as_deref().is_some_and(|s| s.contains(secret))
        || lesson.files.iter().any(|f| {
            f.path.as_str().contains(secret)
                || f.content
                    .windows(secret.len())
                    .any(|w| w == secret.as_bytes())
        });
    assert!(in_lesson || !text.contains(secret));

    let doc: Value = serde_norway::from_str(text).expect("user-data is one YAML document");
    let map = doc.as_mapping().expect("a mapping at the top");
    let keys: Vec<&str> = map.keys().map(|k| k.as_str().unwrap()).collect();
    assert_eq!(keys, TOP_LEVEL_KEYS);
    assert_eq!(map["hostname"].as_str(), Some(node.as_str()));
    let runcmd = map["runcmd"].as_sequence().unwrap();
    assert_eq!(runcmd.len(), 1);
    let argv: Vec<&str> = runcmd[0]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(argv, ["/bin/sh", FIRSTBOOT_PATH]);

    let files: Vec<(String, String, String, Vec<u8>)> = map["write_files"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(decode)
        .collect();
    let own: Vec<&str> = OWN_PATHS
        .iter()
        .copied()
        .filter(|p| *p != SETUP_PATH || lesson.setup.is_some())
        .collect();
    let got_own: Vec<&str> = files[..own.len()].iter().map(|f| f.0.as_str()).collect();
    assert_eq!(got_own, own);
    if let Some(setup) = &lesson.setup {
        let written = files.iter().find(|f| f.0 == SETUP_PATH).unwrap();
        assert_eq!(written.3, setup.as_bytes());
    }
    let want: Vec<(String, String, String, Vec<u8>)> = lesson
        .files
        .iter()
        .map(|f| {
            (
                f.path.to_string(),
                "root:root".to_owned(),
                f.mode.to_octal_string(),
                f.content.clone(),
            )
        })
        .collect();
    assert_eq!(&files[own.len()..], &want[..]);

    // The Secret around it either fits or says why not; never panics.
    let labels = ObjectLabels::new(
        "6f1c1d2e-0b7a-4c2b-9a55-1f0e2d3c4b5a".parse().unwrap(),
        "dev".parse().unwrap(),
        lesson.id.clone(),
        Some(node.clone()),
    );
    if let Ok(secret) = UserDataSecret::new("ttlab-6f1c1d2e-cloudinit", labels, user_data) {
        assert!(secret.size_bytes() <= UserDataSecret::MAX_BYTES);
    }
});

/// One `write_files` entry: exactly the five keys ttlab writes, content decoded.
fn decode(entry: &Value) -> (String, String, String, Vec<u8>) {
    let f = entry
        .as_mapping()
        .expect("a write_files entry is a mapping");
    let keys: Vec<&str> = f.keys().map(|k| k.as_str().unwrap()).collect();
    assert_eq!(
        keys,
        ["path", "owner", "permissions", "encoding", "content"]
    );
    let s = |k: &str| f[k].as_str().unwrap().to_owned();
    let raw = base64::engine::general_purpose::STANDARD
        .decode(s("content"))
        .expect("base64");
    let content = match s("encoding").as_str() {
        "b64" => raw,
        "gz+b64" => {
            let mut out = Vec::new();
            flate2::read::GzDecoder::new(&raw[..])
                .read_to_end(&mut out)
                .expect("gzip");
            out
        }
        other => panic!("unexpected encoding {other}"),
    };
    (s("path"), s("owner"), s("permissions"), content)
}
