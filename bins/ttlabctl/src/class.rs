//! `ttlabctl class add|list|cancel`: scheduled classes through the admin API
//! (`/api/admin/classes`), with an admin's token. A refusal is printed as the API's sentence.

use std::time::Duration;

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use http::Method;
use serde_json::{Value, json};

use crate::api::{Api, ApiArgs};

/// Arguments of `ttlabctl class`.
#[derive(Debug, Args)]
pub struct ClassArgs {
    #[command(flatten)]
    api: ApiArgs,
    #[command(subcommand)]
    command: ClassCommand,
}

#[derive(Debug, Subcommand)]
enum ClassCommand {
    /// Schedule a class: its lesson's labs are prepared to be ready at its start.
    Add(AddArgs),
    /// The upcoming and running classes, as a table.
    List,
    /// Cancel a class (its prepared labs become ordinary warm labs).
    Cancel {
        /// The class's id (from `list` or `add`).
        id: String,
    },
}

#[derive(Debug, Args)]
struct AddArgs {
    /// The lesson (a VM lesson).
    #[arg(long)]
    lesson: String,
    /// How many students.
    #[arg(long)]
    seats: i64,
    /// When it starts: an RFC 3339 time (`2026-12-02T10:00:00Z`), or `+` and a duration from
    /// now (`+2h`).
    #[arg(long)]
    starts_at: String,
    /// When it ends (RFC 3339, or `+` and a duration from now); default: `--minutes` after
    /// the start.
    #[arg(long, conflicts_with = "minutes")]
    ends_at: Option<String>,
    /// How long it lasts, in minutes.
    #[arg(long, default_value_t = 60)]
    minutes: i64,
    /// Its title (default: the lesson and the start's time of day).
    #[arg(long)]
    title: Option<String>,
    /// The join code its students enter (without one, everyone starting the lesson during
    /// the class is its student).
    #[arg(long)]
    code: Option<String>,
}

/// An RFC 3339 time, or `+<duration>` from `now`. The server judges whether it is acceptable.
fn instant(raw: &str, now: DateTime<Utc>) -> anyhow::Result<String> {
    if let Some(rel) = raw.strip_prefix('+') {
        let d: Duration = humantime::parse_duration(rel.trim())
            .with_context(|| format!("{raw:?} is not + and a duration (like +2h)"))?;
        let d = chrono::TimeDelta::from_std(d).context("the duration is too long")?;
        return Ok((now + d).to_rfc3339());
    }
    Ok(raw.to_owned())
}

/// Runs `ttlabctl class …`.
pub async fn run(args: ClassArgs) -> anyhow::Result<()> {
    let api = Api::new(&args.api)?;
    match args.command {
        ClassCommand::Add(add) => {
            let now = Utc::now();
            let starts_at = instant(&add.starts_at, now)?;
            let ends_at = match &add.ends_at {
                Some(e) => instant(e, now)?,
                None => {
                    let start = DateTime::parse_from_rfc3339(&starts_at)
                        .with_context(|| {
                            format!("--starts-at {starts_at:?} is not an RFC 3339 time")
                        })?
                        .with_timezone(&Utc);
                    (start + chrono::TimeDelta::minutes(add.minutes)).to_rfc3339()
                }
            };
            let mut body = json!({
                "lesson": add.lesson, "seats": add.seats,
                "starts_at": starts_at, "ends_at": ends_at,
            });
            if let Some(t) = add.title {
                body["title"] = json!(t);
            }
            if let Some(c) = add.code {
                body["join_code"] = json!(c);
            }
            let c = api
                .call(Method::POST, "/api/admin/classes", Some(&body))
                .await?;
            println!(
                "scheduled class {} {:?}: {} seats of {}, {} to {}, labs prepared from {}",
                c["id"].as_str().unwrap_or("?"),
                c["title"].as_str().unwrap_or("?"),
                c["seats"],
                c["lesson"].as_str().unwrap_or("?"),
                when(&c["starts_at"]),
                when(&c["ends_at"]),
                when(&c["lead_in_at"]),
            );
            match c["capacity_note"].as_str() {
                Some(note) => println!("{note}"),
                None => println!("capacity allows every seat warm at its start"),
            }
            if let Some(code) = c["join_code"].as_str() {
                println!("students enter the join code {code}");
            }
        }
        ClassCommand::List => {
            let v = api.call(Method::GET, "/api/admin/classes", None).await?;
            let classes = v["classes"].as_array().cloned().unwrap_or_default();
            if classes.is_empty() {
                println!("no upcoming or running class");
            } else {
                print!("{}", table(&classes));
            }
        }
        ClassCommand::Cancel { id } => {
            let c = api
                .call(
                    Method::DELETE,
                    &format!("/api/admin/classes/{}", id.trim()),
                    None,
                )
                .await?;
            println!(
                "cancelled class {} {:?}; labs prepared for it are ordinary warm labs now",
                c["id"].as_str().unwrap_or("?"),
                c["title"].as_str().unwrap_or("?"),
            );
        }
    }
    Ok(())
}

/// `2026-12-02 10:00 UTC` for an RFC 3339 value (as given if it does not parse).
fn when(v: &Value) -> String {
    let raw = v.as_str().unwrap_or_default();
    DateTime::parse_from_rfc3339(raw)
        .map(|t| {
            t.with_timezone(&Utc)
                .format("%Y-%m-%d %H:%M UTC")
                .to_string()
        })
        .unwrap_or_else(|_| raw.to_owned())
}

/// The classes as an aligned table, one line each.
fn table(classes: &[Value]) -> String {
    let head = [
        "ID",
        "TITLE",
        "LESSON",
        "STARTS",
        "ENDS",
        "PHASE",
        "SEATS",
        "STARTED",
        "WARM",
        "CAN BE WARM",
        "LEAD TIME",
        "CODE",
    ];
    let num = |v: &Value| match v.as_u64() {
        Some(n) => n.to_string(),
        None => "-".to_owned(),
    };
    let rows: Vec<Vec<String>> = classes
        .iter()
        .map(|c| {
            let warm = if c["warm"].is_object() {
                format!(
                    "{}+{}",
                    num(&c["warm"]["ready"]),
                    num(&c["warm"]["preparing"])
                )
            } else {
                "-".to_owned()
            };
            vec![
                c["id"].as_str().unwrap_or("?").to_owned(),
                c["title"].as_str().unwrap_or("?").to_owned(),
                c["lesson"].as_str().unwrap_or("?").to_owned(),
                when(&c["starts_at"]),
                when(&c["ends_at"]),
                c["phase"].as_str().unwrap_or("?").to_owned(),
                num(&c["seats"]),
                num(&c["started"]),
                warm,
                num(&c["seats_warm"]),
                match c["lead_time"]["seconds"].as_i64() {
                    Some(s) if s % 60 == 0 => format!("{} min", s / 60),
                    Some(s) => format!("{} min {} s", s / 60, s % 60),
                    None => "-".to_owned(),
                },
                c["join_code"].as_str().unwrap_or("-").to_owned(),
            ]
        })
        .collect();
    let widths: Vec<usize> = (0..head.len())
        .map(|i| {
            rows.iter()
                .map(|r| r[i].chars().count())
                .chain([head[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: Vec<String>| {
        let mut s = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ");
        s.truncate(s.trim_end().len());
        s.push('\n');
        s
    };
    let mut out = line(head.iter().map(|h| (*h).to_owned()).collect());
    for r in rows {
        out.push_str(&line(r));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339_or_relative_to_now() {
        let now = DateTime::parse_from_rfc3339("2026-12-02T08:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        assert_eq!(instant("+2h", now).unwrap(), "2026-12-02T10:00:00+00:00");
        assert_eq!(
            instant("2026-12-02T10:00:00Z", now).unwrap(),
            "2026-12-02T10:00:00Z"
        );
        assert!(instant("+soon", now).is_err());
    }

    #[test]
    fn the_table_aligns_its_columns() {
        let c = json!({"id": "c1", "title": "Intro 10:00", "lesson": "systemd-basics",
            "starts_at": "2026-12-02T10:00:00Z", "ends_at": "2026-12-02T11:00:00Z",
            "phase": "upcoming", "seats": 30, "started": 0,
            "warm": {"ready": 0, "preparing": 0}, "seats_warm": 22,
            "lead_time": {"seconds": 330}, "join_code": "ALPHA-7"});
        let t = table(&[c]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(lines[0].starts_with("ID  TITLE        LESSON"), "{t}");
        assert!(
            lines[1].ends_with("upcoming  30     0        0+0   22           5 min 30 s  ALPHA-7"),
            "{t}"
        );
    }
}
