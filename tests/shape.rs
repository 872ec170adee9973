//! The shape of the code, in every crate of the workspace: modules in layers that import only
//! downwards (the tables below; the README states the daemon's), no import circle among the
//! files of a module folder, no source file over 600 lines before its tests, and no function
//! over 60 lines unless its body is one `match`.
//!
//! A reference is a `crate::MODULE` or `super::MODULE` outside comments. The crate roots
//! (`lib.rs`, `main.rs`, `build.rs`) declare the modules and are left out of the layering, as
//! are test modules and files (tests may reach anywhere). Functions are found as rustfmt lays
//! them out: a line `fn NAME` at some indentation, ending at the first later line that is
//! that indentation and `}`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const MAX_FILE_LINES: usize = 600;
const MAX_FN_LINES: usize = 60;

/// A crate: its name, its source folders (and files), and its layers, lowest first: a module
/// may refer only to modules of lower layers.
type Crate = (&'static str, &'static [&'static str], Layers);
type Layers = &'static [&'static [&'static str]];

const CRATES: &[Crate] = &[
    (
        "slurm",
        &["slurm/src", "slurm/build.rs"],
        &[&["bindings"], &["host", "job_record"], &["log", "spank", "srun"]],
    ),
    (
        "protocol",
        &["protocol/src"],
        &[&["gres", "spec", "srun", "user", "wire"], &["claim", "client", "model"]],
    ),
    // `rewrite` decides, purely; `lib.rs` is the FFI shell around it.
    (
        "jobsubmit",
        &["jobsubmit/src"],
        &[&["policy", "tres", "view"], &["plain"], &["rewrite"], &["modify"]],
    ),
    ("spank", &["spank/src"], &[&["args", "srun"], &["remote"], &["step"]]),
    (
        "daemon",
        &["daemon/src"],
        &[
            // The values placement decides on, the maths, and the plumbing: nothing of the
            // daemon.
            &["types", "learn", "command", "background", "metrics"],
            &["config", "placement"],
            // Slurm's one adapter; the claim's choice (purely); the history's database.
            &["slurm", "claim", "history", "gpus", "nodeconf"],
            &["lessons", "inspect", "admission", "put_back"],
            // A step's start, end or report, in the node's own terms.
            &["node"],
            // The background threads, and the one module that speaks the wire.
            &["claimer", "separate", "reconcile", "share", "telemetry", "server"],
            &["check"],
            // The commands: `serve` wires the threads together; `tools` the others.
            &["serve", "tools"],
        ],
    ),
    (
        "simulate",
        &["simulate/src"],
        &[
            &["input", "events"],
            &["model", "watchdog", "state"],
            &["world", "grade", "plot"],
            // The daemon's own code as policies (its claimer over Slurm's books), then every
            // policy by name.
            &["books"],
            &["learned"],
            &["oracle"],
            &["policy"],
            &["termination"],
        ],
    ),
    ("tests", &["tests/src", "tests/emulate"], &[]),
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// A source file of a crate: where, its module path below the crate (`history/jobs`), its code
/// lines before the test module (comments cut), and how many lines that is.
struct Source {
    path: PathBuf,
    module: Vec<String>,
    lines: Vec<String>,
    raw: Vec<String>,
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The lines before a file's `#[cfg(test)]`, as written and with comments cut.
fn code(text: &str) -> (Vec<String>, Vec<String>) {
    let mut raw = Vec::new();
    let mut cut = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("#[cfg(test)]") {
            break;
        }
        raw.push(line.to_string());
        let t = line.trim_start();
        cut.push(if t.starts_with("//") {
            String::new()
        } else {
            match line.find("//") {
                // A trailing comment (a `//` outside a string, near enough for this code).
                Some(i) if !line[..i].contains('"') => line[..i].to_string(),
                _ => line.to_string(),
            }
        });
    }
    (raw, cut)
}

fn is_test_file(p: &Path) -> bool {
    p.file_name().is_some_and(|n| n == "tests.rs")
}

fn sources(dirs: &[&str]) -> Vec<Source> {
    let mut out = Vec::new();
    for dir in dirs {
        let mut base = root().join(dir);
        let mut files = Vec::new();
        if base.is_file() {
            files.push(base.clone());
            base.pop();
        } else {
            rust_files(&base, &mut files);
        }
        files.sort();
        for path in files.into_iter().filter(|p| !is_test_file(p)) {
            let rel = path.strip_prefix(&base).unwrap().with_extension("");
            let mut module: Vec<String> = rel.iter().map(|c| c.to_string_lossy().into_owned()).collect();
            if module.last().is_some_and(|m| m == "mod") {
                module.pop();
            }
            let (raw, lines) = code(&std::fs::read_to_string(&path).unwrap());
            out.push(Source {
                path,
                module,
                lines,
                raw,
            });
        }
    }
    out
}

/// The names a line refers to after `prefix` (`crate::`, `super::`).
fn refs<'a>(line: &'a str, prefix: &str) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(i) = rest.find(prefix) {
        rest = &rest[i + prefix.len()..];
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        out.push(&rest[..end]);
    }
    out
}

fn is_root(module: &[String]) -> bool {
    matches!(module, [one] if one == "lib" || one == "main" || one == "build")
}

/// Each top-level module of a crate and the top-level modules it refers to.
fn top_graph(files: &[Source]) -> BTreeMap<String, BTreeSet<String>> {
    let tops: BTreeSet<&str> = files
        .iter()
        .filter(|s| !is_root(&s.module))
        .map(|s| s.module[0].as_str())
        .collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for s in files.iter().filter(|s| !is_root(&s.module)) {
        let me = &s.module[0];
        let entry = graph.entry(me.clone()).or_default();
        for line in &s.lines {
            let mut named = refs(line, "crate::");
            if s.module.len() == 1 {
                named.extend(refs(line, "super::"));
            }
            for name in named {
                if name != me && tops.contains(name) {
                    entry.insert(name.to_string());
                }
            }
        }
    }
    graph
}

/// For each module folder, its files (but `mod.rs`) and the siblings each refers to.
fn inner_graphs(files: &[Source]) -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let mut out: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for s in files.iter().filter(|s| s.module.len() == 2) {
        let (folder, me) = (&s.module[0], &s.module[1]);
        let siblings: BTreeSet<&str> = files
            .iter()
            .filter(|o| o.module.len() == 2 && &o.module[0] == folder)
            .map(|o| o.module[1].as_str())
            .collect();
        let graph = out.entry(folder.clone()).or_default();
        let entry = graph.entry(me.clone()).or_default();
        let via_crate = format!("crate::{folder}::");
        for line in &s.lines {
            for name in refs(line, "super::").into_iter().chain(refs(line, &via_crate)) {
                if name != me && siblings.contains(name) {
                    entry.insert(name.to_string());
                }
            }
        }
    }
    out
}

/// A circle in a graph, if any (depth-first).
fn circle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        m: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == m) {
            let mut c = path[i..].to_vec();
            c.push(m.to_string());
            return Some(c);
        }
        if !done.insert(m.to_string()) {
            return None;
        }
        path.push(m.to_string());
        for d in graph.get(m).into_iter().flatten() {
            if let Some(c) = visit(d, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|m| visit(m, graph, &mut Vec::new(), &mut done))
}

/// What breaks the layers: a module in no layer, or a reference that does not point down.
fn layer_faults(graph: &BTreeMap<String, BTreeSet<String>>, layers: Layers) -> Vec<String> {
    let layer = |m: &str| layers.iter().position(|l| l.contains(&m));
    let mut faults = Vec::new();
    for (m, deps) in graph {
        let Some(mine) = layer(m) else {
            if !layers.is_empty() {
                faults.push(format!("{m} is in no layer: place it in the table"));
            }
            continue;
        };
        for d in deps {
            match layer(d) {
                Some(theirs) if theirs < mine => {}
                _ => faults.push(format!("{m} (layer {mine}) refers to {d}, which is not below it")),
            }
        }
    }
    faults
}

/// A function's name, first line (1-based) and length in lines; whether its body is one
/// `match`.
struct Function {
    name: String,
    line: usize,
    len: usize,
    one_match: bool,
}

fn fn_name(line: &str) -> Option<&str> {
    let t = line.trim_start();
    let mut words = t.split_whitespace();
    loop {
        match words.next()? {
            "pub" | "pub(crate)" | "pub(super)" | "const" | "async" | "unsafe" | "extern" | "\"C\"" => {}
            "fn" => {
                let rest = words.next()?;
                let end = rest
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(rest.len());
                return Some(&rest[..end]).filter(|n| !n.is_empty());
            }
            _ => return None,
        }
    }
}

fn functions(raw: &[String]) -> Vec<Function> {
    let mut out = Vec::new();
    for (i, line) in raw.iter().enumerate() {
        let Some(name) = fn_name(line) else { continue };
        let indent = &line[..line.len() - line.trim_start().len()];
        // Its body opens on the signature's last line; a declaration without a body has none.
        let Some(open) = (i..raw.len()).find(|&j| raw[j].trim_end().ends_with('{') || raw[j].trim_end().ends_with(';'))
        else {
            continue;
        };
        if raw[open].trim_end().ends_with(';') {
            continue;
        }
        let close = format!("{indent}}}");
        let Some(end) = (open + 1..raw.len()).find(|&j| raw[j].trim_end() == close) else {
            continue;
        };
        let body: Vec<&str> = raw[open + 1..end]
            .iter()
            .map(|l| l.trim())
            .filter(|l| !l.is_empty())
            .collect();
        let inner = format!("{indent}    }}");
        let one_match = body
            .first()
            .is_some_and(|l| l.starts_with("match ") || l.starts_with("Ok(match "))
            && raw[end - 1].trim_end().starts_with(&inner)
            && raw[open + 2..end - 1]
                .iter()
                .all(|l| l.trim().is_empty() || l.starts_with(&format!("{indent}        ")));
        out.push(Function {
            name: name.to_string(),
            line: i + 1,
            len: end - i + 1,
            one_match,
        });
    }
    out
}

#[test]
fn every_crate_is_layered_downwards_and_no_module_folder_has_a_circle() {
    let mut faults = Vec::new();
    for (name, dirs, layers) in CRATES {
        let files = sources(dirs);
        assert!(!files.is_empty(), "{name}: no sources in {dirs:?}");
        let graph = top_graph(&files);
        if let Some(c) = circle(&graph) {
            faults.push(format!("{name}: an import circle: {}", c.join(" -> ")));
        }
        faults.extend(layer_faults(&graph, layers).into_iter().map(|f| format!("{name}: {f}")));
        for (folder, inner) in inner_graphs(&files) {
            if let Some(c) = circle(&inner) {
                faults.push(format!("{name}: an import circle in {folder}/: {}", c.join(" -> ")));
            }
        }
    }
    assert!(faults.is_empty(), "{}", faults.join("\n"));
}

#[test]
fn no_source_file_is_over_600_lines_before_its_tests() {
    let long: Vec<String> = CRATES
        .iter()
        .flat_map(|(_, dirs, _)| sources(dirs))
        .filter(|s| s.raw.len() > MAX_FILE_LINES)
        .map(|s| {
            format!(
                "{}: {} lines",
                s.path.strip_prefix(root()).unwrap().display(),
                s.raw.len()
            )
        })
        .collect();
    assert!(
        long.is_empty(),
        "over {MAX_FILE_LINES} lines before the tests:\n{}",
        long.join("\n")
    );
}

#[test]
fn no_function_is_over_60_lines_but_one_long_match() {
    let long: Vec<String> = CRATES
        .iter()
        .flat_map(|(_, dirs, _)| sources(dirs))
        .flat_map(|s| {
            let file = s.path.strip_prefix(root()).unwrap().display().to_string();
            functions(&s.raw)
                .into_iter()
                .filter(|f| f.len > MAX_FN_LINES && !f.one_match)
                .map(move |f| format!("{file}:{} {} is {} lines", f.line, f.name, f.len))
        })
        .collect();
    assert!(long.is_empty(), "over {MAX_FN_LINES} lines:\n{}", long.join("\n"));
}

#[test]
fn the_checks_find_what_they_look_for() {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    g.entry("a".into()).or_default().insert("b".into());
    g.entry("b".into()).or_default().insert("c".into());
    assert_eq!(circle(&g), None);
    assert!(layer_faults(&g, &[&["c"], &["b"], &["a"]]).is_empty());
    assert_eq!(
        layer_faults(&g, &[&["c", "b"], &["a"]]),
        vec!["b (layer 0) refers to c, which is not below it".to_string()]
    );
    assert_eq!(
        layer_faults(&g, &[&["c"], &["b"]]),
        vec!["a is in no layer: place it in the table".to_string()]
    );
    g.entry("c".into()).or_default().insert("a".into());
    assert_eq!(circle(&g).unwrap().join(" -> "), "a -> b -> c -> a");
    let (raw, cut) = code("use crate::x; // crate::y\n// crate::z\n#[cfg(test)]\nuse crate::w;\n");
    assert_eq!((raw.len(), cut), (2, vec!["use crate::x; ".to_string(), String::new()]));
    assert_eq!(refs("use crate::a::b; crate::c_d(1)", "crate::"), vec!["a", "c_d"]);
    let body = |n: usize| (0..n).map(|i| format!("    let x{i} = {i};\n")).collect::<String>();
    let text = format!(
        "pub fn short() {{\n{}}}\n\nfn long(\n    a: u32,\n) -> u32 {{\n{}}}\n\nfn fmt(&self) {{\n    match self {{\n{}    }}\n}}\n\ntrait T {{\n    fn decl(&self);\n}}\n",
        body(3),
        body(61),
        (0..70).map(|i| format!("        A{i} => 1,\n")).collect::<String>()
    );
    let raw: Vec<String> = text.lines().map(str::to_string).collect();
    let found: Vec<(String, usize, usize, bool)> = functions(&raw)
        .into_iter()
        .map(|f| (f.name, f.line, f.len, f.one_match))
        .collect();
    assert_eq!(
        found,
        vec![
            ("short".to_string(), 1, 5, false),
            ("long".to_string(), 7, 65, false),
            ("fmt".to_string(), 73, 74, true),
        ]
    );
}
