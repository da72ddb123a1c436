//! Lesson parsing: any text is either a set of lessons that keep every promise of the format,
//! or a located error. Never a panic.

#![no_main]

use std::path::PathBuf;

use libfuzzer_sys::fuzz_target;
use ttlab_lesson::{
    LabPath, LessonError, LessonSet, MAX_CORES, MAX_TIMEOUT, MIN_MEMORY_BYTES, Memory,
    is_reserved_path, parse_lesson,
};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // A memory quantity on its own (the lesson's rules over ttlab_model::Quantity).
    if let Ok(m) = text.parse::<Memory>() {
        assert!(m.bytes() >= MIN_MEMORY_BYTES, "{text:?}");
        assert_eq!(m.as_str(), text);
    }
    let _ = LabPath::new(text).map(|p| check_path(p.as_str()));

    let file = PathBuf::from("fuzz.yaml");
    match LessonSet::from_sources([(file.clone(), text.to_owned())]) {
        Ok(set) => {
            for lesson in set.iter() {
                assert!(!lesson.title.trim().is_empty());
                assert!(!lesson.nodes.is_empty());
                assert!((1..=MAX_CORES).contains(&lesson.cores));
                assert!(lesson.memory.bytes() >= MIN_MEMORY_BYTES);
                assert!(lesson.readiness_timeout <= MAX_TIMEOUT);
                assert!(lesson.setup_timeout <= MAX_TIMEOUT);
                for f in &lesson.files {
                    check_path(f.path.as_str());
                    assert!(f.mode.bits() <= 0o7777);
                }
                for step in &lesson.grading {
                    assert!(lesson.nodes.contains(&step.node));
                    assert!((0..=255).contains(&step.expect_exit));
                }
                assert_eq!(set.get(&lesson.id), Some(lesson));
                assert!(set.source_of(&lesson.id).is_some());
            }
        }
        Err(e) => {
            // Every error names the file, and renders.
            let shown = e.to_string();
            match &e {
                LessonError::Invalid { at, .. } => assert_eq!(at.file, file),
                LessonError::DuplicateId { at, .. } => assert_eq!(at.file, file),
                LessonError::Io { .. } | LessonError::Empty { .. } => {}
            }
            assert!(shown.starts_with("fuzz.yaml"), "{shown}");
        }
    }
    let _ = parse_lesson(text);
});

/// What every accepted lab file path must be.
fn check_path(path: &str) {
    assert!(path.starts_with('/'), "{path:?}");
    assert!(!path.ends_with('/'), "{path:?}");
    assert!(!path.chars().any(char::is_control), "{path:?}");
    for component in path[1..].split('/') {
        assert!(!matches!(component, "" | "." | ".."), "{path:?}");
    }
    assert!(!is_reserved_path(path), "{path:?}");
}
