//! The daemon's modules form layers: no module reaches, through the others, back to itself,
//! and no source file is over 600 lines before its test module. A reference is any
//! `crate::MODULE` outside comments (a `use`, or a path in code); the modules are the crate's
//! top-level ones (`history` with its submodules as one), and `main.rs` and the test modules
//! are left out (main is the crate's user; tests may reach anywhere).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const MAX_LINES: usize = 600;

/// Each module and the modules it refers to.
type Graph = BTreeMap<String, BTreeSet<String>>;

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The code of a file before its `#[cfg(test)]` module, without comments.
fn code(text: &str) -> (Vec<String>, usize) {
    let mut lines = Vec::new();
    let mut n = 0;
    for line in text.lines() {
        if line.trim_start().starts_with("#[cfg(test)]") {
            break;
        }
        n += 1;
        let t = line.trim_start();
        if t.starts_with("//") {
            continue;
        }
        // A trailing comment (a `//` outside a string, near enough for this crate's code).
        let cut = match line.find("//") {
            Some(i) if !line[..i].contains('"') => &line[..i],
            _ => line,
        };
        lines.push(cut.to_string());
    }
    (lines, n)
}

fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel
        .components()
        .next()?
        .as_os_str()
        .to_str()?
        .trim_end_matches(".rs")
        .to_string();
    match first.as_str() {
        "main" | "lib" => None,
        _ if rel.ends_with("history/tests.rs") => None,
        _ => Some(first),
    }
}

fn graph() -> (Graph, Vec<(PathBuf, usize)>) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut deps = Graph::new();
    let mut long = Vec::new();
    for f in files {
        let Some(m) = module_of(&src, &f) else { continue };
        let text = std::fs::read_to_string(&f).unwrap();
        let (lines, n) = code(&text);
        if n > MAX_LINES {
            long.push((f.clone(), n));
        }
        let entry = deps.entry(m.clone()).or_default();
        for line in &lines {
            let mut rest = line.as_str();
            while let Some(i) = rest.find("crate::") {
                rest = &rest[i + 7..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() && name != m {
                    entry.insert(name);
                }
            }
        }
    }
    (deps, long)
}

/// A cycle among the modules, if any (depth-first).
fn cycle(deps: &Graph) -> Option<Vec<String>> {
    fn visit(m: &str, deps: &Graph, path: &mut Vec<String>, done: &mut BTreeSet<String>) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == m) {
            let mut c = path[i..].to_vec();
            c.push(m.to_string());
            return Some(c);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_string());
        for d in deps.get(m).into_iter().flatten() {
            if let Some(c) = visit(d, deps, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for m in deps.keys() {
        if let Some(c) = visit(m, deps, &mut Vec::new(), &mut done) {
            return Some(c);
        }
    }
    None
}

#[test]
fn no_module_reaches_back_to_itself() {
    let (deps, _) = graph();
    assert!(deps.len() > 10, "the daemon's modules were found: {deps:?}");
    let all: Vec<String> = deps
        .iter()
        .map(|(m, d)| format!("{m} -> {}", d.iter().cloned().collect::<Vec<_>>().join(", ")))
        .collect();
    if let Some(c) = cycle(&deps) {
        panic!(
            "an import circle: {}\nevery module's:\n{}",
            c.join(" -> "),
            all.join("\n")
        );
    }
}

#[test]
fn no_source_file_is_over_600_lines_before_its_tests() {
    let (_, long) = graph();
    assert!(long.is_empty(), "over {MAX_LINES} lines before the tests: {long:?}");
}

#[test]
fn the_check_finds_a_circle() {
    let mut deps = Graph::new();
    deps.entry("a".into()).or_default().insert("b".into());
    deps.entry("b".into()).or_default().insert("c".into());
    assert_eq!(cycle(&deps), None);
    deps.entry("c".into()).or_default().insert("a".into());
    assert_eq!(cycle(&deps).unwrap().join(" -> "), "a -> b -> c -> a");
    let (lines, n) = code("use crate::x; // crate::y\n// crate::z\n#[cfg(test)]\nuse crate::w;\n");
    assert_eq!((lines, n), (vec!["use crate::x; ".to_string()], 2));
}
