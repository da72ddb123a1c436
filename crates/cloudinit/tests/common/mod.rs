//! Parsing rendered user-data back with a YAML parser, as cloud-init would.

#![allow(dead_code)]

use std::io::Read as _;

use base64::Engine as _;
use chrono::{DateTime, TimeZone, Utc};
use serde_norway::Value;
use ttlab_agent::protocol::AgentToken;
use ttlab_cloudinit::{AgentPayload, UserData, UserDataInput, render_user_data};
use ttlab_lesson::Lesson;
use ttlab_model::NodeName;

/// Stand-in for the agent binary (the real one is measured in its own test).
pub const FAKE_AGENT: &[u8] = b"\x7fELF\x02\x01\x01\0 stand-in for the ttlab-agent binary\n";

/// One `write_files` entry, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestFile {
    pub path: String,
    pub owner: String,
    pub permissions: String,
    pub content: Vec<u8>,
}

/// The user-data as cloud-init sees it.
#[derive(Debug)]
pub struct Parsed {
    pub keys: Vec<String>,
    pub hostname: String,
    pub files: Vec<GuestFile>,
    pub runcmd: Vec<Vec<String>>,
}

impl Parsed {
    pub fn file(&self, path: &str) -> &GuestFile {
        self.files
            .iter()
            .find(|f| f.path == path)
            .unwrap_or_else(|| panic!("no file {path}"))
    }

    pub fn text(&self, path: &str) -> String {
        String::from_utf8(self.file(path).content.clone()).unwrap()
    }
}

fn string(v: &Value) -> String {
    v.as_str()
        .unwrap_or_else(|| panic!("not a string: {v:?}"))
        .to_owned()
}

/// Parses user-data with serde_norway (libyaml), strictly: any shape other than the expected
/// one panics.
pub fn parse(user_data: &str) -> Parsed {
    assert!(user_data.starts_with("#cloud-config\n"));
    let doc: Value = serde_norway::from_str(user_data).expect("user-data is one YAML document");
    let map = doc.as_mapping().expect("a mapping at the top");
    let keys = map.keys().map(string).collect();
    let hostname = string(&map["hostname"]);
    let files = map["write_files"]
        .as_sequence()
        .expect("write_files is a list")
        .iter()
        .map(|f| {
            let f = f.as_mapping().expect("a write_files entry is a mapping");
            let entry_keys: Vec<String> = f.keys().map(string).collect();
            assert_eq!(
                entry_keys,
                ["path", "owner", "permissions", "encoding", "content"]
            );
            let b64 = string(&f["content"]);
            let raw = base64::engine::general_purpose::STANDARD
                .decode(b64)
                .expect("base64");
            let content = match string(&f["encoding"]).as_str() {
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
            GuestFile {
                path: string(&f["path"]),
                owner: string(&f["owner"]),
                permissions: string(&f["permissions"]),
                content,
            }
        })
        .collect();
    let runcmd = map["runcmd"]
        .as_sequence()
        .expect("runcmd is a list")
        .iter()
        .map(|c| c.as_sequence().expect("argv").iter().map(string).collect())
        .collect();
    Parsed {
        keys,
        hostname,
        files,
        runcmd,
    }
}

pub fn token() -> AgentToken {
    AgentToken::from_random_bytes(*b"0123456789abcdefghijklmnopqrstuv")
}

pub fn deadline() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 10, 16, 15, 15, 0).unwrap()
}

pub fn render(lesson: &Lesson, node: &str) -> UserData {
    let agent = AgentPayload::new(FAKE_AGENT).unwrap();
    let node: NodeName = node.parse().unwrap();
    render_user_data(&UserDataInput {
        lesson,
        node: &node,
        agent: &agent,
        token: &token(),
        power_off_at: deadline(),
    })
    .unwrap()
}
