//! The check that rendered instructions hold no active markup, shared by the instructions'
//! tests and the `instructions` fuzz target (`fuzz/fuzz_targets/instructions.rs` includes this
//! file). It reads HTML as the sanitiser writes it (tags with double-quoted attributes, `<`
//! in text always escaped) and knows nothing of the renderer: its own list of inert elements
//! and attributes, and its own reading of a URL's scheme.

/// The elements instructions may hold: none of them runs script or loads a frame.
const INERT_TAGS: [&str; 25] = [
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

/// The first thing in `html` that is, or could become, active markup: an element or an
/// attribute outside the inert ones (`<script>`, `<iframe>`, `<svg>`, `onerror=`, `style=`), a
/// link that is not `http:`, `https:` or `mailto:`, an image that is not `https:`, a link
/// without `rel="noopener noreferrer"`, or HTML it cannot read. `None` when all is inert.
pub fn active_markup(html: &str) -> Option<String> {
    let mut rest = html;
    while let Some(open) = rest.find('<') {
        rest = &rest[open + 1..];
        let closing = rest.starts_with('/');
        let name_start = usize::from(closing);
        let name_len = rest[name_start..]
            .find(|c: char| !c.is_ascii_alphanumeric())
            .unwrap_or(rest.len() - name_start);
        let name = &rest[name_start..name_start + name_len];
        if !INERT_TAGS.contains(&name) {
            return Some(format!("element <{}", &rest[..name_start + name_len]));
        }
        rest = &rest[name_start + name_len..];
        let mut attributes = Vec::new();
        loop {
            rest = rest.trim_start_matches([' ', '\t', '\n']);
            if let Some(after) = rest.strip_prefix('>').or_else(|| rest.strip_prefix("/>")) {
                rest = after;
                break;
            }
            let attr_len = rest
                .find(['=', '>', '/', ' ', '\t', '\n'])
                .unwrap_or(rest.len());
            if attr_len == 0 {
                return Some(format!("unreadable tag <{name} at {rest:.40?}"));
            }
            let attribute = &rest[..attr_len];
            rest = &rest[attr_len..];
            let value = match rest.strip_prefix("=\"") {
                Some(quoted) => {
                    let Some(end) = quoted.find('"') else {
                        return Some(format!("unterminated attribute {attribute} on <{name}>"));
                    };
                    rest = &quoted[end + 1..];
                    decode(&quoted[..end])
                }
                None if rest.starts_with('=') => {
                    return Some(format!("unquoted attribute {attribute} on <{name}>"));
                }
                None => String::new(),
            };
            if closing {
                return Some(format!("attribute {attribute} on </{name}>"));
            }
            if let Some(why) = attribute_problem(name, attribute, &value) {
                return Some(why);
            }
            attributes.push((attribute, value));
        }
        if name == "a" && !closing {
            let rel = attributes.iter().find(|(a, _)| *a == "rel");
            if rel.is_none_or(|(_, v)| v != "noopener noreferrer") {
                return Some(format!(
                    "a link without rel=\"noopener noreferrer\": {attributes:?}"
                ));
            }
        }
    }
    None
}

/// Why `attribute="value"` on `<element>` is not inert, if it is not.
fn attribute_problem(element: &str, attribute: &str, value: &str) -> Option<String> {
    let allowed: &[&str] = match element {
        "a" => &["href", "title", "rel", "target"],
        "img" => &["src", "alt", "title"],
        "ol" => &["start"],
        _ => &[],
    };
    if !allowed.contains(&attribute) {
        return Some(format!("attribute {attribute}={value:?} on <{element}>"));
    }
    let schemes: &[&str] = match (element, attribute) {
        ("a", "href") => &["http:", "https:", "mailto:"],
        ("img", "src") => &["https:"],
        ("a", "target") if value != "_blank" => {
            return Some(format!("target={value:?} on a link"));
        }
        _ => return None,
    };
    // As a browser reads a URL: leading and trailing spaces and controls, and every tab and
    // newline, do not count; the scheme is case-insensitive.
    let url: String = value
        .trim_matches(|c: char| c <= ' ')
        .chars()
        .filter(|c| !matches!(c, '\t' | '\n' | '\r'))
        .collect::<String>()
        .to_ascii_lowercase();
    if schemes.iter().any(|s| url.starts_with(s)) {
        None
    } else {
        Some(format!("{attribute}={value:?} on <{element}>"))
    }
}

/// An attribute value with its character references decoded (the named ones the sanitiser
/// writes, and any numeric one).
fn decode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    let mut rest = value;
    while let Some(amp) = rest.find('&') {
        out.push_str(&rest[..amp]);
        rest = &rest[amp..];
        let Some(semi) = rest.find(';') else { break };
        let entity = &rest[1..semi];
        let decoded = match entity {
            "amp" => Some('&'),
            "quot" => Some('"'),
            "lt" => Some('<'),
            "gt" => Some('>'),
            "nbsp" => Some('\u{a0}'),
            _ => entity
                .strip_prefix("#x")
                .or_else(|| entity.strip_prefix("#X"))
                .and_then(|hex| u32::from_str_radix(hex, 16).ok())
                .or_else(|| entity.strip_prefix('#').and_then(|d| d.parse().ok()))
                .and_then(char::from_u32),
        };
        match decoded {
            Some(c) => {
                out.push(c);
                rest = &rest[semi + 1..];
            }
            None => {
                out.push('&');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

#[test]
fn the_check_sees_active_markup() {
    for active in [
        "<script>alert(1)</script>",
        "<p onclick=\"x\">a</p>",
        "<img src=\"x\" onerror=\"alert(1)\">",
        "<a href=\"javascript:alert(1)\" rel=\"noopener noreferrer\">x</a>",
        "<a href=\"jav&#x61;script:alert(1)\" rel=\"noopener noreferrer\">x</a>",
        "<a href=\" JaVa\tScRiPt:alert(1)\" rel=\"noopener noreferrer\">x</a>",
        "<a href=\"https://a.example/\">no rel</a>",
        "<img src=\"http://a.example/x.png\">",
        "<img src=\"data:image/png;base64,AAAA\">",
        "<p style=\"color: red\">x</p>",
        "<iframe src=\"https://a.example/\"></iframe>",
        "<svg onload=\"alert(1)\"></svg>",
        "<p>ok</p><div>",
        "<a href=x rel=\"noopener noreferrer\">",
    ] {
        assert!(active_markup(active).is_some(), "{active}");
    }
    for inert in [
        "<p>&lt;script&gt;alert(1)&lt;/script&gt; javascript:alert(1)</p>",
        "<h2>t</h2><ul><li>a<ol start=\"3\"><li>b</li></ol></li></ul><hr><br>",
        "<a href=\"https://a.example/?a=1&amp;b=2\" target=\"_blank\" rel=\"noopener noreferrer\">x</a>",
        "<a href=\"mailto:a@b.example\" rel=\"noopener noreferrer\">x</a>",
        "<img src=\"https://a.example/x.png\" alt=\"a &lt;b&gt; &quot;c&quot;\" title=\"t\">",
        "<table><thead><tr><th>a</th></tr></thead><tbody><tr><td>b</td></tr></tbody></table>",
    ] {
        assert_eq!(active_markup(inert), None, "{inert}");
    }
}
