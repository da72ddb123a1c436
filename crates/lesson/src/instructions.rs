//! A lesson's instructions: Markdown written by the lesson's author, rendered to HTML that can
//! hold nothing the author did not write as text or as Markdown.
//!
//! The Markdown is CommonMark with the GitHub tables, strikethrough and task lists, parsed by
//! `pulldown-cmark`: headings (`#` becomes `<h2>`, as the page has its own `<h1>`),
//! paragraphs, bulleted and numbered lists (nested), block quotes, rules, fenced and indented
//! code blocks, inline code, emphasis, strong emphasis, strikethrough, tables (column
//! alignment is not kept), task list items (shown as ☐ and ☑), line breaks, links and images.
//!
//! What an author cannot do:
//! - **Raw HTML is text.** HTML in the Markdown, block or inline (`<script>`, `<img
//!   onerror=…>`, `<iframe>`, `<div style=…>`, comments), is shown as written, escaped, never
//!   parsed as markup.
//! - **Links** become links only to `http:`, `https:` or `mailto:` targets, judged as a browser
//!   reads the URL (entities decoded, tabs and newlines dropped, any case); any other target
//!   (`javascript:`, `vbscript:`, `data:`, a relative path) leaves the link's text, not a link.
//!   Links open in a new tab with `rel="noopener noreferrer"`.
//! - **Images** are shown only from `https:` sources; any other leaves the image's
//!   description as text.
//!
//! The HTML then passes through `ammonia` with an explicit allow-list ([`ALLOWED_TAGS`], the
//! attributes `href` and `title` on links, `src`, `alt` and `title` on images, `start` on
//! numbered lists; no `style`, no `class`, no event handler, the same URL rules), so that
//! nothing the renderer might let through can become active markup. The output is
//! deterministic and safe to put into a page with `innerHTML`.

use std::collections::{HashMap, HashSet};
use std::sync::LazyLock;

use pulldown_cmark::{
    Alignment, CowStr, Event, HeadingLevel, LinkType, Options, Parser, Tag, TagEnd,
};

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

/// The elements the rendered HTML may hold: everything else is removed by the sanitiser.
pub const ALLOWED_TAGS: [&str; 25] = [
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "p",
    "br",
    "hr",
    "blockquote",
    "ul",
    "ol",
    "li",
    "pre",
    "code",
    "em",
    "strong",
    "del",
    "a",
    "img",
    "table",
    "thead",
    "tbody",
    "tr",
    "th",
    "td",
];

/// The URL schemes a link may have.
const LINK_SCHEMES: [&str; 3] = ["http", "https", "mailto"];

/// The URL scheme an image may have.
const IMAGE_SCHEME: &str = "https";

/// Renders `markdown` (CommonMark and the extensions of the [module docs](self)) to safe HTML.
pub fn render(markdown: &str) -> String {
    let options =
        Options::ENABLE_TABLES | Options::ENABLE_STRIKETHROUGH | Options::ENABLE_TASKLISTS;
    let mut html = String::with_capacity(markdown.len() * 3 / 2);
    pulldown_cmark::html::push_html(&mut html, Author::new(Parser::new_ext(markdown, options)));
    SANITISER.clean(&html).to_string()
}

/// The author's Markdown events, with what an author may not do taken out (see the
/// [module docs](self)): raw HTML becomes text, links and images with a target they may not
/// have lose their tags and keep their text, headings move one level down, tables lose their
/// column alignment and task list markers become characters.
struct Author<'a, I> {
    events: I,
    /// Events to give before reading on, last first (an HTML block's text and end).
    pending: Vec<Event<'a>>,
    /// For each link or image open, whether its tags were kept.
    targets: Vec<bool>,
}

impl<'a, I> Author<'a, I> {
    fn new(events: I) -> Self {
        Self {
            events,
            pending: Vec::new(),
            targets: Vec::new(),
        }
    }
}

impl<'a, I: Iterator<Item = Event<'a>>> Iterator for Author<'a, I> {
    type Item = Event<'a>;

    fn next(&mut self) -> Option<Event<'a>> {
        loop {
            if let Some(event) = self.pending.pop() {
                return Some(event);
            }
            let event = match self.events.next()? {
                Event::InlineHtml(text) => Event::Text(text),
                // A block of HTML: a paragraph of its text, as written.
                Event::Start(Tag::HtmlBlock) => {
                    let mut text = String::new();
                    let mut after = None;
                    for inner in self.events.by_ref() {
                        match inner {
                            Event::Html(line) | Event::Text(line) => text.push_str(&line),
                            Event::End(TagEnd::HtmlBlock) => break,
                            other => {
                                after = Some(other);
                                break;
                            }
                        }
                    }
                    text.truncate(text.trim_end().len());
                    self.pending.extend(after);
                    self.pending.push(Event::End(TagEnd::Paragraph));
                    self.pending.push(Event::Text(text.into()));
                    Event::Start(Tag::Paragraph)
                }
                Event::Html(text) => Event::Text(text),
                Event::Start(Tag::Heading { level, .. }) => Event::Start(Tag::Heading {
                    level: lower(level),
                    id: None,
                    classes: Vec::new(),
                    attrs: Vec::new(),
                }),
                Event::End(TagEnd::Heading(level)) => Event::End(TagEnd::Heading(lower(level))),
                Event::Start(Tag::Table(columns)) => {
                    Event::Start(Tag::Table(vec![Alignment::None; columns.len()]))
                }
                Event::TaskListMarker(done) => {
                    Event::Text(CowStr::Borrowed(if done { "☑ " } else { "☐ " }))
                }
                // Links and images nest properly: one stack says whose tags were kept.
                Event::Start(tag @ (Tag::Link { .. } | Tag::Image { .. })) => {
                    let keep = allowed(&tag);
                    self.targets.push(keep);
                    if !keep {
                        continue;
                    }
                    Event::Start(tag)
                }
                Event::End(end @ (TagEnd::Link | TagEnd::Image)) => {
                    if !self.targets.pop().unwrap_or(false) {
                        continue;
                    }
                    Event::End(end)
                }
                other => other,
            };
            return Some(event);
        }
    }
}

/// `#` is the panel's top level: one level down (the page has its own `<h1>`).
fn lower(level: HeadingLevel) -> HeadingLevel {
    match level {
        HeadingLevel::H1 => HeadingLevel::H2,
        HeadingLevel::H2 => HeadingLevel::H3,
        HeadingLevel::H3 => HeadingLevel::H4,
        HeadingLevel::H4 => HeadingLevel::H5,
        HeadingLevel::H5 | HeadingLevel::H6 => HeadingLevel::H6,
    }
}

/// Whether a link or an image may keep its tags: a link to `http:`, `https:` or `mailto:`, an
/// image from `https:`.
fn allowed(tag: &Tag<'_>) -> bool {
    match tag {
        Tag::Link {
            link_type: LinkType::Email,
            dest_url,
            ..
        } => has_scheme(&format!("mailto:{dest_url}"), &LINK_SCHEMES),
        Tag::Link { dest_url, .. } => has_scheme(dest_url, &LINK_SCHEMES),
        Tag::Image { dest_url, .. } => has_scheme(dest_url, &[IMAGE_SCHEME]),
        _ => true,
    }
}

/// Whether `url`, read as a browser reads it, is absolute with one of `schemes`.
fn has_scheme(url: &str, schemes: &[&str]) -> bool {
    ammonia::Url::parse(url).is_ok_and(|u| schemes.contains(&u.scheme()))
}

/// The sanitiser every rendering passes through: the allow-list of the [module docs](self).
static SANITISER: LazyLock<ammonia::Builder<'static>> = LazyLock::new(|| {
    let mut builder = ammonia::Builder::empty();
    builder
        .tags(ALLOWED_TAGS.into_iter().collect())
        .generic_attributes(HashSet::new())
        .tag_attributes(HashMap::from([
            ("a", HashSet::from(["href", "title"])),
            ("img", HashSet::from(["src", "alt", "title"])),
            ("ol", HashSet::from(["start"])),
        ]))
        .url_schemes(LINK_SCHEMES.into_iter().collect())
        .url_relative(ammonia::UrlRelative::Deny)
        .attribute_filter(|element, attribute, value| {
            let allowed = match (element, attribute) {
                ("img", "src") => has_scheme(value, &[IMAGE_SCHEME]),
                _ => true,
            };
            allowed.then(|| value.into())
        })
        .link_rel(Some("noopener noreferrer"))
        .set_tag_attribute_value("a", "target", "_blank")
        .strip_comments(true);
    builder
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_markdown_subset_renders() {
        // CommonMark keeps a paragraph's line breaks (a browser shows them as spaces) and puts
        // each list item on a line of its own.
        let md = "# Restart a service\n\nStart **nginx** with `systemctl start nginx`,\nthen check it.\n\n- one\n- two `x<y`\n  continued\n\n1. first\n2. second\n\n```sh\necho <hi> & bye\n```\nSee [the docs](https://example.org/a?b=1&c=2).\n";
        assert_eq!(
            render(md),
            "<h2>Restart a service</h2>\n\
             <p>Start <strong>nginx</strong> with <code>systemctl start nginx</code>,\nthen check it.</p>\n\
             <ul>\n<li>one</li>\n<li>two <code>x&lt;y</code>\ncontinued</li>\n</ul>\n\
             <ol>\n<li>first</li>\n<li>second</li>\n</ol>\n\
             <pre><code>echo &lt;hi&gt; &amp; bye\n</code></pre>\n\
             <p>See <a href=\"https://example.org/a?b=1&amp;c=2\" target=\"_blank\" rel=\"noopener noreferrer\">the docs</a>.</p>\n"
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
    fn the_sanitiser_alone_keeps_only_the_allow_list() {
        // Raw HTML never reaches it from Markdown; should a renderer ever let some through,
        // the sanitiser still removes everything that is not inert.
        for (html, clean) in [
            ("<script>alert(1)</script><p>x</p>", "<p>x</p>"),
            ("<img src=x onerror=alert(1)>", "<img>"),
            ("<img src=\"http://a.example/x.png\">", "<img>"),
            ("<img src=\"data:image/png;base64,AAAA\">", "<img>"),
            (
                "<img src=\"https://a.example/x.png\" style=\"width:9999px\">",
                "<img src=\"https://a.example/x.png\">",
            ),
            (
                "<a href=\"jav&#x61;script:alert(1)\">x</a>",
                "<a target=\"_blank\" rel=\"noopener noreferrer\">x</a>",
            ),
            (
                "<a href=\" JavaScript:alert(1)\" onclick=\"x\">x</a>",
                "<a target=\"_blank\" rel=\"noopener noreferrer\">x</a>",
            ),
            (
                "<a href=\"vbscript:x\" target=\"_self\">x</a>",
                "<a target=\"_blank\" rel=\"noopener noreferrer\">x</a>",
            ),
            ("<iframe src=\"https://a.example/\"></iframe>t", "t"),
            ("<svg onload=alert(1)><circle r=5></circle></svg>t", "t"),
            (
                "<p style=\"color:red\" class=\"c\" id=\"i\">x</p>",
                "<p>x</p>",
            ),
            ("<h1>x</h1><div>y</div><!-- z -->", "xy"),
        ] {
            assert_eq!(SANITISER.clean(html).to_string(), clean, "{html}");
        }
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
