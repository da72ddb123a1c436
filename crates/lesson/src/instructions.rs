//! A lesson's instructions: Markdown written by the lesson's author, rendered to HTML that can
//! hold nothing the author did not write as text.
//!
//! The renderer knows a small, fixed part of Markdown — headings, paragraphs, bulleted and
//! numbered lists, fenced code blocks, inline code, bold, italics and links — and emits only
//! its own tags. Everything the author wrote is HTML-escaped first, so HTML in a lesson file
//! (`<script>`, `<img onerror=…>`, an `<a href="javascript:…">`) shows as text; a link's
//! target must be `http:`, `https:` or `mailto:` (anything else is shown as plain text). The
//! output is deterministic and safe to put into a page with `innerHTML`.

use std::fmt::Write as _;

/// The longest instructions a lesson may carry, in bytes of Markdown.
pub const MAX_INSTRUCTIONS_BYTES: usize = 64 * 1024;

/// A lesson's instructions, as Markdown (validated: not blank, at most
/// [`MAX_INSTRUCTIONS_BYTES`], no control characters but tabs and newlines).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instructions(String);

impl Instructions {
    /// Checks `markdown` as instructions; the error says what is wrong.
    pub fn new(markdown: String) -> Result<Self, String> {
        if markdown.trim().is_empty() {
            return Err("`instructions` is empty; leave it out instead".into());
        }
        if markdown.len() > MAX_INSTRUCTIONS_BYTES {
            return Err(format!(
                "`instructions` is {} bytes; the most allowed is {MAX_INSTRUCTIONS_BYTES}",
                markdown.len()
            ));
        }
        if let Some(c) = markdown
            .chars()
            .find(|&c| c.is_control() && !matches!(c, '\n' | '\t' | '\r'))
        {
            return Err(format!(
                "`instructions` holds the control character U+{:04X}",
                u32::from(c)
            ));
        }
        Ok(Self(markdown))
    }

    /// The Markdown as written.
    pub fn markdown(&self) -> &str {
        &self.0
    }

    /// The instructions as HTML (see the [module docs](self) for what is rendered).
    pub fn html(&self) -> String {
        render(&self.0)
    }
}

/// Renders `markdown` (the subset of the [module docs](self)) to safe HTML.
pub fn render(markdown: &str) -> String {
    let mut out = String::new();
    let mut paragraph: Vec<&str> = Vec::new();
    let mut list: Option<(&'static str, Vec<String>)> = None;
    let mut lines = markdown.lines().peekable();

    fn flush_paragraph(out: &mut String, paragraph: &mut Vec<&str>) {
        if !paragraph.is_empty() {
            let text = paragraph
                .iter()
                .map(|l| l.trim())
                .collect::<Vec<_>>()
                .join(" ");
            let _ = writeln!(out, "<p>{}</p>", inline(&text));
            paragraph.clear();
        }
    }
    fn flush_list(out: &mut String, list: &mut Option<(&'static str, Vec<String>)>) {
        if let Some((tag, items)) = list.take() {
            let _ = write!(out, "<{tag}>");
            for item in items {
                let _ = write!(out, "<li>{}</li>", inline(item.trim()));
            }
            let _ = writeln!(out, "</{tag}>");
        }
    }

    while let Some(line) = lines.next() {
        let trimmed = line.trim_start();
        if let Some(fence) = trimmed.strip_prefix("```") {
            let _ = fence; // the info string (a language) is not used
            flush_paragraph(&mut out, &mut paragraph);
            flush_list(&mut out, &mut list);
            let mut code = String::new();
            for inner in lines.by_ref() {
                if inner.trim_start().starts_with("```") {
                    break;
                }
                code.push_str(inner);
                code.push('\n');
            }
            let _ = writeln!(out, "<pre><code>{}</code></pre>", escape(&code));
            continue;
        }
        if trimmed.is_empty() {
            flush_paragraph(&mut out, &mut paragraph);
            // A list goes on over a blank line only if the next line is one of its items.
            let next_is_item = lines
                .peek()
                .is_some_and(|next| list_item(next.trim_start()).is_some());
            if !next_is_item {
                flush_list(&mut out, &mut list);
            }
            continue;
        }
        if let Some((level, text)) = heading(trimmed) {
            flush_paragraph(&mut out, &mut paragraph);
            flush_list(&mut out, &mut list);
            // `#` is the panel's top level (h2: the page has its own h1).
            let tag = (level + 1).min(6);
            let _ = writeln!(out, "<h{tag}>{}</h{tag}>", inline(text));
            continue;
        }
        if let Some((tag, text)) = list_item(trimmed) {
            flush_paragraph(&mut out, &mut paragraph);
            match &mut list {
                Some((current, items)) if *current == tag => items.push(text.to_owned()),
                _ => {
                    flush_list(&mut out, &mut list);
                    list = Some((tag, vec![text.to_owned()]));
                }
            }
            continue;
        }
        // An indented line right after an item continues it.
        if let Some((_, items)) = &mut list
            && line.starts_with("  ")
            && paragraph.is_empty()
        {
            if let Some(last) = items.last_mut() {
                last.push(' ');
                last.push_str(trimmed);
            }
            continue;
        }
        flush_list(&mut out, &mut list);
        paragraph.push(line);
    }
    flush_paragraph(&mut out, &mut paragraph);
    flush_list(&mut out, &mut list);
    out
}

/// `# Title` → (1, "Title").
fn heading(line: &str) -> Option<(usize, &str)> {
    let level = line.bytes().take_while(|&b| b == b'#').count();
    if !(1..=6).contains(&level) {
        return None;
    }
    let rest = &line[level..];
    if rest.is_empty() {
        return Some((level, ""));
    }
    rest.strip_prefix(' ')
        .map(|t| (level, t.trim().trim_end_matches('#').trim_end()))
}

/// `- item`, `* item`, `+ item` → ("ul", "item"); `1. item` or `1) item` → ("ol", "item").
fn list_item(line: &str) -> Option<(&'static str, &str)> {
    for bullet in ["- ", "* ", "+ "] {
        if let Some(rest) = line.strip_prefix(bullet) {
            return Some(("ul", rest));
        }
    }
    let digits = line.bytes().take_while(u8::is_ascii_digit).count();
    if (1..=9).contains(&digits) {
        let rest = &line[digits..];
        if let Some(text) = rest.strip_prefix(". ").or_else(|| rest.strip_prefix(") ")) {
            return Some(("ol", text));
        }
    }
    None
}

/// Inline Markdown: `code`, **bold**, *italics* or _italics_, [text](url).
fn inline(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        match c {
            '`' => {
                let ticks = rest.bytes().take_while(|&b| b == b'`').count();
                let fence = &rest[..ticks];
                if let Some(end) = rest[ticks..].find(fence) {
                    let code = &rest[ticks..ticks + end];
                    let _ = write!(out, "<code>{}</code>", escape(code.trim()));
                    rest = &rest[ticks + end + ticks..];
                } else {
                    out.push_str(&escape(fence));
                    rest = &rest[ticks..];
                }
            }
            '*' | '_' if rest.starts_with("**") || rest.starts_with("__") => {
                let mark = &rest[..2];
                match rest[2..].find(mark) {
                    Some(end) if end > 0 => {
                        let _ = write!(out, "<strong>{}</strong>", inline(&rest[2..2 + end]));
                        rest = &rest[2 + end + 2..];
                    }
                    _ => {
                        out.push_str(&escape(mark));
                        rest = &rest[2..];
                    }
                }
            }
            '*' | '_' => {
                let mark = &rest[..1];
                // `snake_case` words keep their underscores.
                let closing = rest[1..].find(mark).filter(|&end| {
                    end > 0
                        && !rest[1..].starts_with(' ')
                        && !(c == '_' && out.chars().last().is_some_and(char::is_alphanumeric))
                });
                match closing {
                    Some(end) => {
                        let _ = write!(out, "<em>{}</em>", inline(&rest[1..1 + end]));
                        rest = &rest[1 + end + 1..];
                    }
                    None => {
                        out.push_str(&escape(mark));
                        rest = &rest[1..];
                    }
                }
            }
            '[' => match link(rest) {
                Some((label, target, used)) => {
                    if safe_target(target) {
                        let _ = write!(
                            out,
                            "<a href=\"{}\" rel=\"noopener noreferrer\" target=\"_blank\">{}</a>",
                            escape(target),
                            inline(label)
                        );
                    } else {
                        out.push_str(&inline(label));
                    }
                    rest = &rest[used..];
                }
                None => {
                    out.push('[');
                    rest = &rest[1..];
                }
            },
            _ => {
                let n = c.len_utf8();
                out.push_str(&escape(&rest[..n]));
                rest = &rest[n..];
            }
        }
    }
    out
}

/// `[label](target)` at the start of `text`: (label, target, bytes used).
fn link(text: &str) -> Option<(&str, &str, usize)> {
    let close = text.find("](")?;
    let label = &text[1..close];
    if label.contains('[') {
        return None;
    }
    let after = &text[close + 2..];
    let end = after.find(')')?;
    let target = after[..end].trim();
    if target.is_empty() || target.contains(char::is_whitespace) {
        return None;
    }
    Some((label, target, close + 2 + end + 1))
}

/// Only web and mail links: never `javascript:`, `data:` or anything a browser would run.
fn safe_target(target: &str) -> bool {
    let lower = target.to_ascii_lowercase();
    ["https://", "http://", "mailto:"]
        .iter()
        .any(|p| lower.starts_with(p))
}

/// HTML-escapes text for element content and double-quoted attributes.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_markdown_subset_renders() {
        let md = "# Restart a service\n\nStart **nginx** with `systemctl start nginx`,\nthen check it.\n\n- one\n- two `x<y`\n  continued\n\n1. first\n2. second\n\n```sh\necho <hi> & bye\n```\nSee [the docs](https://example.org/a?b=1&c=2).\n";
        assert_eq!(
            render(md),
            "<h2>Restart a service</h2>\n\
             <p>Start <strong>nginx</strong> with <code>systemctl start nginx</code>, then check it.</p>\n\
             <ul><li>one</li><li>two <code>x&lt;y</code> continued</li></ul>\n\
             <ol><li>first</li><li>second</li></ol>\n\
             <pre><code>echo &lt;hi&gt; &amp; bye\n</code></pre>\n\
             <p>See <a href=\"https://example.org/a?b=1&amp;c=2\" rel=\"noopener noreferrer\" target=\"_blank\">the docs</a>.</p>\n"
        );
    }

    #[test]
    fn html_in_a_lesson_is_shown_as_text_and_unsafe_links_are_not_links() {
        for (md, never) in [
            ("<script>alert(1)</script>", "<script"),
            ("<img src=x onerror=alert(1)>", "<img"),
            ("[click](javascript:alert(1))", "href"),
            ("[click](JaVaScRiPt:alert(1))", "href"),
            ("[x](data:text/html,<script>)", "href"),
            (
                "[x](https://a.example/\"onmouseover=\"alert(1))",
                "\"onmouseover",
            ),
            ("**<b>bold</b>**", "<b>"),
            ("`</code><script>`", "<script"),
            ("# <h1>t</h1>", "<h1>"),
            ("- <li onclick=x>", "<li onclick"),
        ] {
            let html = render(md);
            assert!(!html.contains(never), "{md:?} → {html}");
            assert!(
                !html.contains("<script") && !html.contains("javascript:"),
                "{md:?} → {html}"
            );
        }
        assert_eq!(
            render("[x](javascript:void)"),
            "<p>x</p>\n",
            "an unsafe link keeps its text"
        );
    }

    #[test]
    fn snake_case_and_lone_marks_are_left_alone() {
        assert_eq!(
            render("set max_conn_count to 2 * 3"),
            "<p>set max_conn_count to 2 * 3</p>\n"
        );
    }

    #[test]
    fn instructions_are_validated() {
        assert!(Instructions::new("  \n".into()).is_err());
        assert!(Instructions::new("a\u{0}b".into()).is_err());
        assert!(Instructions::new("x".repeat(MAX_INSTRUCTIONS_BYTES + 1)).is_err());
        let ok = Instructions::new("# Hi\n\ttab\r\n".into()).unwrap();
        assert_eq!(ok.markdown(), "# Hi\n\ttab\r\n");
    }
}
