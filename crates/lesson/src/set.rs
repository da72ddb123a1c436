//! Loading lessons from a file or a directory, with located errors.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use ttlab_model::LessonId;

use crate::error::{LessonError, SourceLocation};
use crate::lesson::Lesson;

/// Every lesson a backend offers, by id, each with where it was defined.
#[derive(Debug, Clone, Default)]
pub struct LessonSet {
    lessons: BTreeMap<LessonId, (Lesson, SourceLocation)>,
}

impl LessonSet {
    /// Loads lessons from `path`: a YAML file (one lesson per document, documents separated by
    /// `---`), or a directory whose `*.yaml` and `*.yml` files (not hidden, not in
    /// subdirectories) are read in name order. Fails on the first bad file, naming the file,
    /// the line and what is wrong; fails if two lessons share an id or none is found.
    pub fn load(path: &Path) -> Result<Self, LessonError> {
        let io = |source| LessonError::Io {
            path: path.to_owned(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(io)?;
        let files = if meta.is_dir() {
            let mut files = Vec::new();
            for entry in std::fs::read_dir(path).map_err(io)? {
                let entry = entry.map_err(io)?;
                let p = entry.path();
                let name = entry.file_name();
                let name = name.to_string_lossy();
                let is_yaml = name.ends_with(".yaml") || name.ends_with(".yml");
                if is_yaml && !name.starts_with('.') && p.is_file() {
                    files.push(p);
                }
            }
            files.sort();
            files
        } else {
            vec![path.to_owned()]
        };
        let mut sources = Vec::with_capacity(files.len());
        for file in files {
            let text = std::fs::read_to_string(&file).map_err(|source| LessonError::Io {
                path: file.clone(),
                source,
            })?;
            sources.push((file, text));
        }
        let set = Self::from_sources(sources)?;
        if set.is_empty() {
            return Err(LessonError::Empty {
                path: path.to_owned(),
            });
        }
        Ok(set)
    }

    /// Builds a set from in-memory files (name, YAML text), with the same rules as
    /// [`LessonSet::load`] except that an empty result is allowed.
    pub fn from_sources(
        sources: impl IntoIterator<Item = (PathBuf, String)>,
    ) -> Result<Self, LessonError> {
        let mut set = Self::default();
        for (file, text) in sources {
            for (lesson, at) in parse_file(&file, &text)? {
                set.insert(lesson, at)?;
            }
        }
        Ok(set)
    }

    fn insert(&mut self, lesson: Lesson, at: SourceLocation) -> Result<(), LessonError> {
        if let Some((_, first)) = self.lessons.get(&lesson.id) {
            return Err(LessonError::DuplicateId {
                id: lesson.id.clone(),
                at: Box::new(at),
                first: Box::new(first.clone()),
            });
        }
        self.lessons.insert(lesson.id.clone(), (lesson, at));
        Ok(())
    }

    /// The lesson with this id.
    pub fn get(&self, id: &LessonId) -> Option<&Lesson> {
        self.lessons.get(id).map(|(l, _)| l)
    }

    /// Where the lesson with this id was defined (file and line of its `id:`).
    pub fn source_of(&self, id: &LessonId) -> Option<&SourceLocation> {
        self.lessons.get(id).map(|(_, at)| at)
    }

    /// Every lesson, by id.
    pub fn iter(&self) -> impl Iterator<Item = &Lesson> {
        self.lessons.values().map(|(l, _)| l)
    }

    /// Every lesson id, in order.
    pub fn ids(&self) -> impl Iterator<Item = &LessonId> {
        self.lessons.keys()
    }

    /// Number of lessons.
    pub fn len(&self) -> usize {
        self.lessons.len()
    }

    /// Whether there is no lesson.
    pub fn is_empty(&self) -> bool {
        self.lessons.is_empty()
    }
}

/// Parses one lesson from YAML text (a single document), for tests and tools. Errors name
/// `<inline>` as the file.
pub fn parse_lesson(text: &str) -> Result<Lesson, LessonError> {
    let file = PathBuf::from("<inline>");
    let mut lessons = parse_file(&file, text)?;
    match lessons.len() {
        1 => Ok(lessons.remove(0).0),
        0 => Err(LessonError::Empty { path: file }),
        n => Err(LessonError::Invalid {
            at: SourceLocation {
                file,
                line: None,
                column: None,
            },
            message: format!("expected one lesson, found {n} documents"),
        }),
    }
}

/// Every lesson of one file, each with the location of its `id:` line.
fn parse_file(file: &Path, text: &str) -> Result<Vec<(Lesson, SourceLocation)>, LessonError> {
    let mut out: Vec<(Lesson, SourceLocation)> = Vec::new();
    for document in serde_norway::Deserializer::from_str(text) {
        let lesson = Option::<Lesson>::deserialize(document).map_err(|e| located(file, &e))?;
        if let Some(lesson) = lesson {
            let occurrence = out.iter().filter(|(l, _)| l.id == lesson.id).count();
            let line = id_line(text, lesson.id.as_str(), occurrence);
            let at = SourceLocation {
                file: file.to_owned(),
                line,
                column: line.map(|_| 1),
            };
            out.push((lesson, at));
        }
    }
    Ok(out)
}

/// Turns a YAML error into a located load error: the message without serde_norway's own
/// " at line L column C" suffix, and the location as fields.
fn located(file: &Path, e: &serde_norway::Error) -> LessonError {
    let mut message = e.to_string();
    let (line, column) = match e.location() {
        Some(loc) => {
            let suffix = format!(" at line {} column {}", loc.line(), loc.column());
            if let Some(pos) = message.find(&suffix) {
                message.replace_range(pos..pos + suffix.len(), "");
            }
            (Some(loc.line()), Some(loc.column()))
        }
        None => (None, None),
    };
    LessonError::Invalid {
        at: SourceLocation {
            file: file.to_owned(),
            line,
            column,
        },
        message,
    }
}

/// The 1-based line of the `occurrence`-th (0-based) top-level `id: <id>` in `text`, if it can
/// be found by a plain scan (block-style mapping, the usual way lessons are written).
fn id_line(text: &str, id: &str, occurrence: usize) -> Option<usize> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| {
            let Some(rest) = line.strip_prefix("id:") else {
                return false;
            };
            let value = rest.split(" #").next().unwrap_or("").trim();
            let value = value
                .strip_prefix(['"', '\''])
                .and_then(|v| v.strip_suffix(['"', '\'']))
                .unwrap_or(value);
            value == id
        })
        .nth(occurrence)
        .map(|(i, _)| i + 1)
}
