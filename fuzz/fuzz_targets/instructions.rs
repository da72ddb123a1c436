//! Lesson instructions: any Markdown renders to HTML that holds no active markup (read by the
//! same check as the instructions' tests: only inert elements and attributes, links only to
//! `http:`, `https:` and `mailto:`, images only from `https:`, after entity decoding), and to
//! the same HTML every time. Never a panic.

#![no_main]

use libfuzzer_sys::fuzz_target;
use ttlab_lesson::Instructions;
use ttlab_lesson::instructions::render;

#[path = "../../crates/lesson/tests/inert/mod.rs"]
mod inert;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let html = render(text);
    if let Some(active) = inert::active_markup(&html) {
        panic!("{text:?} rendered active markup ({active}):\n{html}");
    }
    assert_eq!(render(text), html, "{text:?}");
    if let Ok(instructions) = Instructions::new(text.to_owned()) {
        assert_eq!(instructions.html(), html);
    }
});
