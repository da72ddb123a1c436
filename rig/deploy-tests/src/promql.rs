//! What the monitoring test needs of PromQL and of the Prometheus text format: the metric
//! selectors an expression names (with their label matchers), and the metric names and
//! labelled series a `/metrics` answer exports.
//!
//! Not a PromQL parser: a scanner that knows enough of the language (functions and
//! aggregations are followed by `(` or are keywords, label lists follow `by`, `without`,
//! `on`, `ignoring` and `group_*`, ranges and strings hold no metric) to find every metric an
//! alert or a dashboard panel reads, so that a misspelled one fails a test instead of
//! charting nothing.
//!
//! ```
//! use ttlab_deploy_tests::promql::{Exposition, selectors};
//!
//! let expr = r#"sum by (outcome) (rate(ttlab_gradings_total{outcome="graded"}[5m])) > 0"#;
//! let found = selectors(expr);
//! assert_eq!(found.len(), 1);
//! assert_eq!(found[0].name, "ttlab_gradings_total");
//! assert_eq!(found[0].matchers, [("outcome".to_owned(), "=".to_owned(), "graded".to_owned())]);
//!
//! let text = "# TYPE ttlab_gradings counter\nttlab_gradings_total{outcome=\"graded\"} 3\n# EOF\n";
//! let exported = Exposition::parse(text);
//! assert!(exported.names.contains("ttlab_gradings_total"));
//! assert!(exported.problems(&found[0], &[]).is_empty());
//! ```

use std::collections::{BTreeMap, BTreeSet};

/// A metric selector found in an expression: the metric's name and its label matchers
/// (label, operator, value), in the order written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selector {
    /// The metric name.
    pub name: String,
    /// `(label, "=" | "!=" | "=~" | "!~", value)`.
    pub matchers: Vec<(String, String, String)>,
}

/// Aggregation operators, keywords and constants: identifiers that never name a metric.
const NOT_METRICS: &[&str] = &[
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "atan2",
    "inf",
    "nan",
    "Inf",
    "NaN",
];

/// Keywords followed by a parenthesised list of label names.
const LABEL_LISTS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// The metric selectors of a PromQL expression, in the order written.
pub fn selectors(expr: &str) -> Vec<Selector> {
    let chars: Vec<char> = expr.chars().collect();
    let mut found = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i = skip_string(&chars, i);
        } else if c == '[' {
            // A range or a subquery's resolution: durations and Grafana variables only.
            while i < chars.len() && chars[i] != ']' {
                i += 1;
            }
            i += 1;
        } else if c.is_ascii_digit() || c == '.' {
            // A number, or a duration after `offset`.
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
        } else if c == '$' {
            // A Grafana variable outside a string (`$__interval`).
            i += 1;
            while i < chars.len() && is_ident(chars[i]) {
                i += 1;
            }
        } else if is_ident_start(c) {
            let start = i;
            while i < chars.len() && is_ident(chars[i]) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let next = next_non_space(&chars, i);
            if LABEL_LISTS.contains(&word.as_str()) {
                if next.is_some_and(|j| chars[j] == '(') {
                    i = skip_parens(&chars, next.unwrap_or(i));
                }
            } else if NOT_METRICS.contains(&word.as_str()) || next.is_some_and(|j| chars[j] == '(')
            {
                // An aggregation, keyword or function.
            } else {
                let mut matchers = Vec::new();
                if let Some(j) = next.filter(|&j| chars[j] == '{') {
                    let (parsed, end) = label_matchers(&chars, j);
                    matchers = parsed;
                    i = end;
                }
                found.push(Selector {
                    name: word,
                    matchers,
                });
            }
        } else if c == '{' {
            // A selector without a name (`{__name__=…}`): its matchers hold no metric name
            // this scanner could check.
            i = label_matchers(&chars, i).1;
        } else {
            i += 1;
        }
    }
    found
}

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

fn next_non_space(chars: &[char], mut i: usize) -> Option<usize> {
    while i < chars.len() && chars[i].is_whitespace() {
        i += 1;
    }
    (i < chars.len()).then_some(i)
}

/// The index after the string starting at `i` (its quote).
fn skip_string(chars: &[char], i: usize) -> usize {
    string_at(chars, i).1
}

/// The string literal starting at `i` (unescaped) and the index after it.
fn string_at(chars: &[char], i: usize) -> (String, usize) {
    let quote = chars[i];
    let mut out = String::new();
    let mut j = i + 1;
    while j < chars.len() && chars[j] != quote {
        if chars[j] == '\\' && quote != '`' && j + 1 < chars.len() {
            j += 1;
        }
        out.push(chars[j]);
        j += 1;
    }
    (out, j + 1)
}

/// The index after the parenthesised group starting at `i` (its `(`).
fn skip_parens(chars: &[char], i: usize) -> usize {
    let mut depth = 0;
    let mut j = i;
    while j < chars.len() {
        match chars[j] {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return j + 1;
                }
            }
            _ => {}
        }
        j += 1;
    }
    j
}

/// The matchers of the `{…}` starting at `i`, and the index after its `}`.
fn label_matchers(chars: &[char], i: usize) -> (Vec<(String, String, String)>, usize) {
    let mut out = Vec::new();
    let mut j = i + 1;
    loop {
        let Some(k) = next_non_space(chars, j) else {
            return (out, chars.len());
        };
        j = k;
        match chars[j] {
            '}' => return (out, j + 1),
            ',' => j += 1,
            c if is_ident_start(c) => {
                let start = j;
                while j < chars.len() && is_ident(chars[j]) {
                    j += 1;
                }
                let label: String = chars[start..j].iter().collect();
                let Some(k) = next_non_space(chars, j) else {
                    return (out, chars.len());
                };
                j = k;
                let op_start = j;
                while j < chars.len() && matches!(chars[j], '=' | '!' | '~') {
                    j += 1;
                }
                let op: String = chars[op_start..j].iter().collect();
                let Some(k) = next_non_space(chars, j) else {
                    return (out, chars.len());
                };
                j = k;
                if matches!(chars[j], '"' | '\'' | '`') {
                    let (value, end) = string_at(chars, j);
                    out.push((label, op, value));
                    j = end;
                }
            }
            _ => j += 1,
        }
    }
}

/// What a `/metrics` answer (Prometheus or OpenMetrics text) exports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Exposition {
    /// Every name a query may use: each sample's name, and for each `# TYPE` the names its
    /// samples take (`_total` of a counter; `_bucket`, `_sum`, `_count` of a histogram), so a
    /// family without a series yet still counts as exported.
    pub names: BTreeSet<String>,
    /// The label values each sampled name carries, by label.
    pub labels: BTreeMap<String, BTreeMap<String, BTreeSet<String>>>,
}

impl Exposition {
    /// Reads a `/metrics` answer.
    pub fn parse(text: &str) -> Self {
        let mut out = Self::default();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut words = rest.split_whitespace();
                if let (Some(name), Some(kind)) = (words.next(), words.next()) {
                    let suffixes: &[&str] = match kind {
                        "counter" => &["_total", "_created"],
                        "histogram" | "gaugehistogram" => &["_bucket", "_sum", "_count"],
                        "summary" => &["", "_sum", "_count"],
                        "info" => &["_info"],
                        _ => &[""],
                    };
                    for suffix in suffixes {
                        // A Prometheus-format counter's TYPE already ends in _total.
                        let full = if name.ends_with(suffix) && !suffix.is_empty() {
                            name.to_owned()
                        } else {
                            format!("{name}{suffix}")
                        };
                        out.names.insert(full);
                    }
                }
                continue;
            }
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            let name_end = line
                .find(|c: char| c == '{' || c.is_whitespace())
                .unwrap_or(line.len());
            let name = &line[..name_end];
            out.names.insert(name.to_owned());
            let labels = out.labels.entry(name.to_owned()).or_default();
            if line[name_end..].starts_with('{') {
                let chars: Vec<char> = line[name_end..].chars().collect();
                for (label, _, value) in label_matchers(&chars, 0).0 {
                    labels.entry(label).or_default().insert(value);
                }
            }
        }
        out
    }

    /// What is wrong with `selector` against this exposition: its metric is not exported, or
    /// a label matcher names a label its series do not carry or an exact value (`=`, or each
    /// word of a `=~` alternation of plain words) none of them has. Labels in
    /// `target_labels` (added by Prometheus from the scrape target) and values holding a
    /// Grafana variable (`$…`) are not checked; nor are the labels of a family that has no
    /// series yet.
    pub fn problems(&self, selector: &Selector, target_labels: &[&str]) -> Vec<String> {
        let name = &selector.name;
        if !self.names.contains(name) {
            return vec![format!("{name} is not exported")];
        }
        let Some(labels) = self.labels.get(name) else {
            return Vec::new();
        };
        let mut problems = Vec::new();
        for (label, op, value) in &selector.matchers {
            if target_labels.contains(&label.as_str()) || value.contains('$') {
                continue;
            }
            let Some(values) = labels.get(label) else {
                problems.push(format!("{name} has no label {label}"));
                continue;
            };
            let wanted: Vec<&str> = match op.as_str() {
                "=" => vec![value.as_str()],
                "=~" if value
                    .split('|')
                    .all(|w| !w.is_empty() && w.chars().all(|c| is_ident(c) || c == '-')) =>
                {
                    value.split('|').collect()
                }
                _ => Vec::new(),
            };
            for w in wanted {
                if !values.contains(w) {
                    problems.push(format!(
                        "{name}{{{label}=\"{w}\"}} is not exported (its values: {values:?})"
                    ));
                }
            }
        }
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(expr: &str) -> Vec<String> {
        selectors(expr).into_iter().map(|s| s.name).collect()
    }

    #[test]
    fn metric_names_are_found_and_functions_keywords_labels_and_ranges_are_not() {
        assert_eq!(
            names("time() - max by (namespace) (ttlab_last_reaper_cycle_timestamp_seconds) > 180"),
            ["ttlab_last_reaper_cycle_timestamp_seconds"]
        );
        assert_eq!(
            names(
                r#"histogram_quantile(0.9, sum by (le, stage) (rate(ttlab_stage_seconds_bucket{namespace="$namespace"}[$__rate_interval])))"#
            ),
            ["ttlab_stage_seconds_bucket"]
        );
        assert_eq!(
            names(
                "sum by (namespace, lesson) (increase(a_total[30m])) / (sum without (pod) (b_total) \
                 or 0 * sum(c_total offset 5m)) > 0.5 and on (namespace) group_left (lesson) d >= 5 \
                 unless e == bool 1"
            ),
            ["a_total", "b_total", "c_total", "d", "e"]
        );
        assert_eq!(
            names(r#"max(x{a="sum(by)", b=~"y|z"}) + count_values("label", w)"#),
            ["x", "w"]
        );
    }

    #[test]
    fn matchers_are_read_with_their_operators_and_escapes() {
        let s = selectors(r#"m{a="1", b!="2",c=~"x|y", d!~'z', e="q\"uote"}"#);
        assert_eq!(
            s[0].matchers,
            [
                ("a".into(), "=".into(), "1".into()),
                ("b".into(), "!=".into(), "2".into()),
                ("c".into(), "=~".into(), "x|y".into()),
                ("d".into(), "!~".into(), "z".into()),
                ("e".into(), "=".into(), "q\"uote".into()),
            ]
        );
    }

    #[test]
    fn a_misspelled_metric_or_label_value_is_a_problem() {
        let text = "# HELP ttlab_reaper_items Items.\n# TYPE ttlab_reaper_items counter\n\
             ttlab_reaper_items_total{direction=\"Expired\",outcome=\"Done\"} 1\n\
             ttlab_reaper_items_total{direction=\"Expired\",outcome=\"Failed\"} 0\n\
             # TYPE ttlab_stage_seconds histogram\n# TYPE ttlab_pool_claims counter\n# EOF\n";
        let exported = Exposition::parse(text);
        let check = |expr: &str| -> Vec<String> {
            selectors(expr)
                .iter()
                .flat_map(|s| exported.problems(s, &["namespace"]))
                .collect()
        };
        assert!(
            check(
                r#"rate(ttlab_reaper_items_total{outcome="Failed", namespace="ttlab-prod"}[5m])"#
            )
            .is_empty()
        );
        assert!(check(r#"ttlab_reaper_items_total{outcome=~"Done|Failed"}"#).is_empty());
        // Families without a series yet are exported by name.
        assert!(check("ttlab_stage_seconds_bucket + ttlab_pool_claims_total").is_empty());
        assert_eq!(
            check("rate(ttlab_reaper_item_total[5m])"),
            ["ttlab_reaper_item_total is not exported"]
        );
        assert_eq!(check("ttlab_stage_seconds_buckets").len(), 1);
        assert_eq!(
            check(r#"ttlab_reaper_items_total{outcome="failed"}"#),
            [
                r#"ttlab_reaper_items_total{outcome="failed"} is not exported (its values: {"Done", "Failed"})"#
            ]
        );
        assert_eq!(
            check(r#"ttlab_reaper_items_total{result="Done"}"#),
            ["ttlab_reaper_items_total has no label result"]
        );
    }
}
