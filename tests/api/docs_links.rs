//! Every relative link of the README and `docs/` points at a file of the
//! repository, and every `#anchor` at a heading of its target page (GitHub's
//! anchors: lower case, punctuation dropped, spaces as `-`, `-1`, `-2` for
//! repeated headings); every repository path the pages name in backticks
//! (`src/…`, `tests/…`, `deploy/…`, …) exists, so moved code shows up here.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn pages() -> Vec<PathBuf> {
    let mut pages = vec![PathBuf::from("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/ exists")
        .filter_map(|e| e.ok())
        .map(|e| PathBuf::from("docs").join(e.file_name()))
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// The text outside fenced code blocks.
fn prose(text: &str) -> Vec<&str> {
    let mut fenced = false;
    text.lines()
        .filter(|l| {
            if l.trim_start().starts_with("```") {
                fenced = !fenced;
                return false;
            }
            !fenced
        })
        .collect()
}

fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for line in prose(text) {
        let hashes = line.chars().take_while(|c| *c == '#').count();
        if (1..=6).contains(&hashes) && line[hashes..].starts_with(' ') {
            let s = slug(&line[hashes + 1..]);
            let n = seen.entry(s.clone()).or_insert(0);
            out.insert(if *n == 0 {
                s.clone()
            } else {
                format!("{s}-{n}")
            });
            *n += 1;
        }
    }
    out
}

/// `](target)` links, without inline code spans.
fn links(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_code = false;
    let chars: Vec<char> = line.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        if chars[i] == '`' {
            in_code = !in_code;
        } else if !in_code && chars[i] == ']' && chars.get(i + 1) == Some(&'(') {
            let end = chars[i + 2..].iter().position(|c| *c == ')');
            if let Some(end) = end {
                let target: String = chars[i + 2..i + 2 + end].iter().collect();
                if !target.contains(char::is_whitespace) {
                    out.push(target);
                }
                i += 2 + end;
            }
        }
        i += 1;
    }
    out
}

fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

#[test]
fn every_link_of_the_readme_and_docs_resolves() {
    let pages = pages();
    assert!(pages.len() >= 7, "README.md and docs/*.md: {pages:?}");
    let texts: BTreeMap<PathBuf, String> = pages
        .iter()
        .map(|p| {
            let text = std::fs::read_to_string(root().join(p)).expect("readable page");
            (p.clone(), text)
        })
        .collect();
    let mut broken = Vec::new();
    for (page, text) in &texts {
        for line in prose(text) {
            for target in links(line) {
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (path, fragment) = match target.split_once('#') {
                    Some((p, f)) => (p, Some(f)),
                    None => (target.as_str(), None),
                };
                let file = if path.is_empty() {
                    page.clone()
                } else {
                    normalize(&page.parent().unwrap_or(Path::new("")).join(path))
                };
                if !root().join(&file).exists() {
                    broken.push(format!(
                        "{}: {target} (no file {})",
                        page.display(),
                        file.display()
                    ));
                    continue;
                }
                if let Some(fragment) = fragment {
                    let target_text = texts
                        .get(&file)
                        .cloned()
                        .or_else(|| std::fs::read_to_string(root().join(&file)).ok())
                        .unwrap_or_default();
                    if !anchors(&target_text).contains(fragment) {
                        broken.push(format!(
                            "{}: {target} (no heading #{fragment})",
                            page.display()
                        ));
                    }
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// Inline code spans of a line.
fn code_spans(line: &str) -> Vec<&str> {
    line.split('`').skip(1).step_by(2).collect()
}

#[test]
fn every_repository_path_the_docs_name_exists() {
    const TOP: &[&str] = &[
        "src/",
        "tests/",
        "migrations/",
        "config/",
        "deploy/",
        "scripts/",
        "fuzz/",
        "docs/",
        "clients/",
    ];
    let mut missing = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(root().join(&page)).expect("readable page");
        for line in prose(&text) {
            for span in code_spans(line) {
                let named = TOP.iter().any(|t| span.starts_with(t))
                    && !span.contains(|c: char| c.is_whitespace() || "*<>…".contains(c))
                    && !span.starts_with("fuzz/artifacts/");
                if named && !root().join(span).exists() {
                    missing.push(format!("{}: {span}", page.display()));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "paths named by the docs that do not exist:\n{}",
        missing.join("\n")
    );
}

#[test]
fn anchors_follow_github() {
    let a = anchors("# A B\n## Orders: the payment state machine\n```\n# not a heading\n```\n## A B\n### `POST /v1/tokens`\n");
    for want in [
        "a-b",
        "orders-the-payment-state-machine",
        "a-b-1",
        "post-v1tokens",
    ] {
        assert!(a.contains(want), "{want} in {a:?}");
    }
    assert!(!a.contains("not-a-heading"));
    assert_eq!(
        links("see [x](a.md#b) and `[y](not)` [z](#c)"),
        vec!["a.md#b", "#c"]
    );
}
