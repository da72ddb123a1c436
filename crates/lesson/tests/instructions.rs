//! Lesson instructions as students see them: what authors write renders as they expect, and
//! nothing an author writes can run script in the page.

mod inert;

use std::path::Path;

use inert::active_markup;
use ttlab_lesson::instructions::render;
use ttlab_lesson::{Instructions, LessonSet};

/// Renders `markdown` and checks the result holds no active markup.
fn inert_render(markdown: &str) -> String {
    let html = render(markdown);
    if let Some(active) = active_markup(&html) {
        panic!("{markdown:?} rendered active markup ({active}):\n{html}");
    }
    html
}

#[test]
fn script_in_any_form_is_never_active() {
    for markdown in [
        "<script>alert(1)</script>",
        "<SCRIPT SRC=https://a.example/x.js></SCRIPT>",
        "text <script>alert(1)</script> text",
        "<img src=x onerror=alert(1)>",
        "text <img src=x onerror=alert(1)> text",
        "<iframe src=\"javascript:alert(1)\"></iframe>",
        "<iframe srcdoc=\"<script>alert(1)</script>\"></iframe>",
        "<svg onload=alert(1)><circle r=5/></svg>",
        "<math><mi xlink:href=\"javascript:alert(1)\">x</mi></math>",
        "<div style=\"position:fixed;inset:0\" onclick=alert(1)>x</div>",
        "<p style=\"color:red\">x</p>",
        "<a href=\"javascript:alert(1)\">x</a>",
        "<details open ontoggle=alert(1)>",
        "<object data=\"data:text/html,<script>alert(1)</script>\"></object>",
        "<!-- <script>alert(1)</script> -->",
        "<style>body{display:none}</style>",
        "<base href=\"javascript:alert(1)//\">",
        "[x](javascript:alert(1))",
        "[x](JaVaScRiPt:alert(1))",
        "[x](  javascript:alert(1))",
        "[x](<java\tscript:alert(1)>)",
        "[x](<javascript\n:alert(1)>)",
        "[x](jav&#x61;script:alert(1))",
        "[x](jav&#97;script:alert(1))",
        "[x](&#106;avascript:alert(1))",
        "[x](javascript&colon;alert(1))",
        "[x](java%73cript:alert(1))",
        "[x](\\javascript:alert(1))",
        "[x](vbscript:msgbox(1))",
        "[x](VBScript:msgbox(1))",
        "[x](data:text/html,<script>alert(1)</script>)",
        "[x](data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==)",
        "[x][r]\n\n[r]: javascript:alert(1)",
        "<javascript:alert(1)>",
        "![x](javascript:alert(1))",
        "![x](data:image/svg+xml,<svg onload=alert(1)>)",
        "![x](http://a.example/x.png)",
        "![x](https://a.example/x.png\"onerror=\"alert(1))",
        "[x](https://a.example/\"onmouseover=\"alert(1))",
        "[x](https://a.example/ \"title\\\" onmouseover=\\\"alert(1)\")",
        "# t {#id onclick=alert(1)}",
        "```html\n<script>alert(1)</script>\n```",
        "`<script>alert(1)</script>`",
        "| a |\n|---|\n| <script>alert(1)</script> |",
        "- [ ] <img src=x onerror=alert(1)>",
        "> <svg onload=alert(1)>",
        "**<b onmouseover=alert(1)>x</b>**",
    ] {
        let html = inert_render(markdown);
        for never in [
            "<script", "<iframe", "<svg", "<math", "<object", "<style", "<base",
        ] {
            assert!(!html.contains(never), "{markdown:?} → {html}");
        }
    }
}

#[test]
fn raw_html_is_shown_as_text() {
    assert_eq!(
        inert_render("<script>alert(1)</script>"),
        "<p>&lt;script&gt;alert(1)&lt;/script&gt;</p>\n"
    );
    assert_eq!(
        inert_render("a <b onclick=x>bold</b>"),
        "<p>a &lt;b onclick=x&gt;bold&lt;/b&gt;</p>\n"
    );
    assert_eq!(
        inert_render("<img src=x onerror=alert(1)>"),
        "<p>&lt;img src=x onerror=alert(1)&gt;</p>\n"
    );
}

#[test]
fn links_keep_their_text_when_their_target_is_refused() {
    assert_eq!(inert_render("[x](javascript:void)"), "<p>x</p>\n");
    assert_eq!(inert_render("[x](jav&#x61;script:alert(1))"), "<p>x</p>\n");
    assert_eq!(inert_render("[docs](/relative/path)"), "<p>docs</p>\n");
    assert_eq!(
        inert_render("![a diagram](http://a.example/x.png)"),
        "<p>a diagram</p>\n"
    );
    assert_eq!(
        inert_render("[mail](mailto:teacher@a.example) <teacher@a.example> <https://a.example>"),
        "<p><a href=\"mailto:teacher@a.example\" target=\"_blank\" rel=\"noopener noreferrer\">mail</a> \
         <a href=\"mailto:teacher@a.example\" target=\"_blank\" rel=\"noopener noreferrer\">teacher@a.example</a> \
         <a href=\"https://a.example\" target=\"_blank\" rel=\"noopener noreferrer\">https://a.example</a></p>\n"
    );
    assert_eq!(
        inert_render("![a diagram](https://a.example/x.png \"the lab\")"),
        "<p><img src=\"https://a.example/x.png\" alt=\"a diagram\" title=\"the lab\"></p>\n"
    );
}

#[test]
fn a_table_renders_as_a_table_and_nested_lists_nest() {
    assert_eq!(
        inert_render("| a | b |\n|:--|--:|\n| 1 | `x` |\n"),
        "<table><thead><tr><th>a</th><th>b</th></tr></thead><tbody>\n\
         <tr><td>1</td><td><code>x</code></td></tr>\n</tbody></table>\n"
    );
    assert_eq!(
        inert_render("1. one\n   - a\n     1. deep\n2. two\n"),
        "<ol>\n<li>one\n<ul>\n<li>a\n<ol>\n<li>deep</li>\n</ol>\n</li>\n</ul>\n</li>\n<li>two</li>\n</ol>\n"
    );
    assert_eq!(
        inert_render("3. three\n4. four\n"),
        "<ol start=\"3\">\n<li>three</li>\n<li>four</li>\n</ol>\n"
    );
    assert_eq!(
        inert_render("- [x] done\n- [ ] to do\n"),
        "<ul>\n<li>☑ done</li>\n<li>☐ to do</li>\n</ul>\n"
    );
    assert_eq!(
        inert_render("> ~~no~~ *yes*\n\n---\n\nline  \nbreak\n\n###### six\n"),
        "<blockquote>\n<p><del>no</del> <em>yes</em></p>\n</blockquote>\n<hr>\n\
         <p>line<br>\nbreak</p>\n<h6>six</h6>\n"
    );
}

/// The instructions of the showcase lesson the browser test opens.
fn showcase() -> Instructions {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../web/tests/lessons");
    let set = LessonSet::load(&dir).unwrap();
    let lesson = set.get(&"instructions-showcase".parse().unwrap()).unwrap();
    lesson.instructions.clone().unwrap()
}

#[test]
fn the_showcase_lesson_renders_everything_and_runs_nothing() {
    let html = showcase().html();
    assert_eq!(active_markup(&html), None, "{html}");
    for expected in [
        "<h2>Instructions showcase</h2>",
        "<th>service</th><th>port</th><th>protocol</th>",
        "<td>8080</td>",
        "<ol>\n<li>\n<p>Prepare the machine:</p>\n<ul>\n<li>update",
        "<li>install the server:\n<ol>\n<li><code>apt-get install -y nginx</code></li>",
        "<pre><code>curl -s http://localhost/ | head -n 5\n</code></pre>",
        "<li>☑ read the task</li>",
        "<blockquote>",
        "<del>a mistake</del>",
        "<a href=\"https://nginx.org/en/docs/\" target=\"_blank\" rel=\"noopener noreferrer\">",
        "<a href=\"mailto:teacher@ttlab.example\"",
        "<img src=\"https://ttlab.invalid/diagram.png\" alt=\"A diagram of the lab\">",
        "<p>&lt;script&gt;window.__pwned = 'a script block'; alert('script');&lt;/script&gt;</p>",
        "<p>&lt;!-- a comment --&gt;</p>",
        "Links: javascript,\ncase, entity,\ntab, vbscript,\ndata,\nrelative.",
        "Images: over http as data\nscript source",
    ] {
        assert!(html.contains(expected), "{expected:?} is not in:\n{html}");
    }
    assert_eq!(html.matches("<a ").count(), 2, "{html}");
    assert_eq!(html.matches("<img ").count(), 1, "{html}");
}

#[test]
fn rendering_is_deterministic() {
    let showcase = showcase();
    let first = render(showcase.markdown());
    for _ in 0..5 {
        assert_eq!(render(showcase.markdown()), first);
    }
}
