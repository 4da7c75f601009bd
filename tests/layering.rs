//! The crate's layering, checked from its sources: each area of `src/` (and the `stages/`
//! folder) refers only to the areas below it, no module cycle exists, CUDA `cfg`s stay behind
//! the device and model areas, and no file grows past its size without saying why.
//!
//! A scan of `crate::` paths in the code (comments and `#[cfg(test)]` modules aside) is enough:
//! every cross-module reference in this crate is written that way.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use common::{root, rust_files};

/// The areas from the ground up; an area may refer to those on lower floors only. Areas on
/// the same floor do not refer to each other.
const FLOORS: &[(&str, u32)] = &[
    ("runtime", 0),
    ("report", 1),
    ("device", 1),
    ("dist", 2),
    ("data", 2),
    ("model", 3),
    ("optim", 4),
    ("engine", 5),
    ("eval", 5),
    ("train", 6),
    ("artifact", 7),
    ("check", 8),
    ("stages", 9),
    ("cli", 10),
];

/// Lines of code (not blank, not comments, tests aside) a file may hold before it must say at
/// its top why it is longer (a line `//! Long because ...`).
const MAX_CODE_LINES: usize = 700;

/// Lines of code a stage file (an adapter of a library type to the stage contract) may hold.
const MAX_STAGE_LINES: usize = 400;

struct Source {
    /// Module path inside the crate (`runtime::graph`, `stages::pin`).
    module: String,
    /// Its area (first path segment).
    area: String,
    path: PathBuf,
    /// The code before any `#[cfg(test)]`, with comment lines blanked.
    code: Vec<String>,
    text: String,
}

fn sources() -> Vec<Source> {
    let mut files = rust_files(&root().join("src"));
    files.extend(rust_files(&root().join("stages")));
    let mut out = Vec::new();
    for path in files {
        let rel = path.strip_prefix(root()).unwrap().with_extension("");
        let mut parts: Vec<String> = rel.iter().map(|s| s.to_string_lossy().into_owned()).collect();
        if parts[0] == "src" {
            parts.remove(0);
        }
        if parts.last().is_some_and(|p| p == "mod") {
            parts.pop();
        }
        if parts == ["lib"] || parts == ["main"] {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let code =
            without_test_items(&text).into_iter().map(|l| if l.trim_start().starts_with("//") { String::new() } else { l }).collect();
        out.push(Source { module: parts.join("::"), area: parts[0].clone(), path, code, text });
    }
    out
}

/// The lines of `text` with every `#[cfg(test)]` item blanked (a `mod x;` line, or an item up
/// to the end of its braces), so that what follows a test module is still read. Lines stay in
/// place (blank), so that line numbers hold.
fn without_test_items(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim() != "#[cfg(test)]" {
            i += 1;
            continue;
        }
        // Blank the attribute, any further attributes, then the item: up to a `;` ending the
        // line before any brace opens, or until the braces opened close.
        let mut depth = 0i64;
        let mut opened = false;
        let mut j = i;
        while j < lines.len() {
            let l = lines[j];
            out[j] = String::new();
            // Braces inside strings and chars are rare in item heads; comments are skipped.
            let code = l.split("//").next().unwrap_or("");
            for c in code.chars() {
                match c {
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            j += 1;
            let head = j - 1 > i && !l.trim_start().starts_with("#[");
            if (opened && depth <= 0) || (!opened && head && code.trim_end().ends_with(';')) {
                break;
            }
        }
        i = j;
    }
    out
}

/// The `crate::a::b::c` paths a line names.
fn crate_paths(line: &str) -> Vec<Vec<&str>> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().next_back();
        let tail = &rest[i + "crate::".len()..];
        let end = tail.find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')).unwrap_or(tail.len());
        if !before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            out.push(tail[..end].split("::").filter(|s| !s.is_empty()).collect());
        }
        rest = &tail[end..];
    }
    out
}

/// The paths a line of module `module` names, made absolute (without `crate::`): `crate::`
/// paths as they are, `self::` and `super::` (any number of them) from `module`'s place, and
/// one level of `{...}` groups after a relative path spread into its members.
fn module_paths(module: &str, line: &str) -> Vec<Vec<String>> {
    let mut out: Vec<Vec<String>> = crate_paths(line).into_iter().map(|p| p.into_iter().map(String::from).collect()).collect();
    let own: Vec<&str> = module.split("::").collect();
    let bytes = line.as_bytes();
    let mut i = 0;
    while i < line.len() {
        let at_word = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_' || bytes[i - 1] == b':');
        let rest = &line[i..];
        if !(at_word && (rest.starts_with("super::") || rest.starts_with("self::"))) {
            i += rest.chars().next().map_or(1, char::len_utf8);
            continue;
        }
        let mut base: Vec<&str> = own.clone();
        let mut tail = rest;
        if let Some(t) = tail.strip_prefix("self::") {
            tail = t;
        }
        while let Some(t) = tail.strip_prefix("super::") {
            base.pop();
            tail = t;
        }
        let end = tail.find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')).unwrap_or(tail.len());
        let path: Vec<String> =
            base.iter().map(|s| s.to_string()).chain(tail[..end].split("::").filter(|s| !s.is_empty()).map(String::from)).collect();
        if tail[end..].starts_with('{') {
            let group = &tail[end + 1..];
            let close = group.find('}').unwrap_or(group.len());
            for member in group[..close].split(',') {
                let m: Vec<String> = member
                    .trim()
                    .split(" as ")
                    .next()
                    .unwrap_or("")
                    .split("::")
                    .filter(|s| !s.is_empty() && *s != "self")
                    .map(String::from)
                    .collect();
                out.push(path.iter().cloned().chain(m).collect());
            }
        } else if !path.is_empty() {
            out.push(path);
        }
        i += rest.len() - tail.len() + end.max(1);
    }
    out
}

fn floor(area: &str) -> Option<u32> {
    FLOORS.iter().find(|(a, _)| *a == area).map(|&(_, f)| f)
}

#[test]
fn every_area_refers_only_to_lower_floors() {
    let mut wrong = Vec::new();
    for s in sources() {
        let Some(own) = floor(&s.area) else {
            wrong.push(format!("{}: area `{}` is not in FLOORS (tests/layering.rs): place it", s.path.display(), s.area));
            continue;
        };
        for (n, line) in s.code.iter().enumerate() {
            for path in module_paths(&s.module, line) {
                let Some(area) = path.first().map(String::as_str) else { continue };
                if area == s.area {
                    continue;
                }
                match floor(area) {
                    Some(f) if f < own => {}
                    _ => wrong.push(format!(
                        "{}:{}: `{}` ({}) refers to `{}`: {}",
                        s.path.display(),
                        n + 1,
                        s.module,
                        s.area,
                        area,
                        line.trim()
                    )),
                }
            }
        }
    }
    assert!(wrong.is_empty(), "references that go up or sideways:\n{}", wrong.join("\n"));
}

#[test]
fn the_runtime_knows_no_gpt() {
    // The floor check covers this; said again in words a failure can point at: the runtime's
    // sources name nothing of data, models, training or tensors.
    for s in sources().into_iter().filter(|s| s.area == "runtime") {
        for word in ["candle_core", "Gpt", "ModelConfig", "TrainConfig", "Checkpoint", "Tensor"] {
            let hit = s.code.iter().position(|l| l.contains(word));
            assert!(hit.is_none(), "{}:{}: the runtime names `{word}`", s.path.display(), hit.unwrap_or(0) + 1);
        }
    }
}

#[test]
fn no_module_cycle() {
    let all = sources();
    let modules: BTreeSet<&str> = all.iter().map(|s| s.module.as_str()).collect();
    let mut edges: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for s in &all {
        let out = edges.entry(s.module.as_str()).or_default();
        for line in &s.code {
            for path in module_paths(&s.module, line) {
                // The longest module prefix of the path is the module referred to.
                let target = (1..=path.len()).rev().map(|k| path[..k].join("::")).find(|m| modules.contains(m.as_str()));
                if let Some(t) = target {
                    let t = *modules.get(t.as_str()).unwrap();
                    // A module's own children and parents are not a cycle.
                    if t != s.module && !s.module.starts_with(&format!("{t}::")) && !t.starts_with(&format!("{}::", s.module)) {
                        out.insert(t);
                    }
                }
            }
        }
    }
    // Depth-first search for a back edge.
    fn visit<'a>(
        m: &'a str,
        edges: &BTreeMap<&'a str, BTreeSet<&'a str>>,
        state: &mut BTreeMap<&'a str, u8>,
        stack: &mut Vec<&'a str>,
    ) -> Option<Vec<&'a str>> {
        state.insert(m, 1);
        stack.push(m);
        for &n in edges.get(m).into_iter().flatten() {
            match state.get(n) {
                Some(1) => {
                    let at = stack.iter().position(|&x| x == n).unwrap();
                    let mut cycle = stack[at..].to_vec();
                    cycle.push(n);
                    return Some(cycle);
                }
                Some(_) => {}
                None => {
                    if let Some(c) = visit(n, edges, state, stack) {
                        return Some(c);
                    }
                }
            }
        }
        stack.pop();
        state.insert(m, 2);
        None
    }
    let mut state = BTreeMap::new();
    for &m in &modules {
        if !state.contains_key(m) {
            let cycle = visit(m, &edges, &mut state, &mut Vec::new());
            assert!(cycle.is_none(), "import cycle: {}", cycle.unwrap().join(" -> "));
        }
    }
}

#[test]
fn cuda_cfgs_stay_behind_the_device_model_and_engine_areas() {
    for s in sources() {
        // The areas that own GPU code: the device, the model's ops, the engine's backend, the
        // collectives' NCCL backend.
        if s.area == "device" || s.area == "model" || s.area == "engine" || s.area == "dist" {
            continue;
        }
        let hit = s.code.iter().position(|l| l.contains("feature = \"cuda\""));
        assert!(
            hit.is_none(),
            "{}:{}: a `cuda` cfg outside device/, model/, engine/ and dist/: use the device's API (it has a stand-in without the feature)",
            s.path.display(),
            hit.unwrap_or(0) + 1
        );
    }
}

#[test]
fn files_stay_short_or_say_why() {
    let mut long = Vec::new();
    for s in sources() {
        let lines = s.code.iter().filter(|l| !l.trim().is_empty()).count();
        let max = if s.area == "stages" && s.module != "stages" { MAX_STAGE_LINES } else { MAX_CODE_LINES };
        let says_why = s.text.lines().take_while(|l| l.starts_with("//!") || l.is_empty()).any(|l| l.starts_with("//! Long because"));
        if lines > max && !says_why {
            long.push(format!("{}: {lines} lines of code (at most {max}, or a `//! Long because ...` line at its top)", s.path.display()));
        }
    }
    assert!(long.is_empty(), "{}", long.join("\n"));
}

/// The same rule for the CUDA, C++ and C files (kernels/, cpp/, the warp emulator's), whose
/// code lines are those left without `//` and `/* */` comments; the reason goes in a
/// `// Long because ...` line at the top.
#[test]
fn kernel_and_cpp_files_stay_short_or_say_why() {
    let mut files = Vec::new();
    fn walk(dir: &std::path::Path, out: &mut Vec<PathBuf>) {
        for p in std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()) {
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|e| ["cu", "cuh", "cpp", "h", "hpp", "c"].contains(&e.to_str().unwrap_or(""))) {
                out.push(p);
            }
        }
    }
    for dir in ["kernels", "cpp", "tests/warp_emu"] {
        walk(&root().join(dir), &mut files);
    }
    assert!(files.iter().any(|f| f.ends_with("kernels/engine.cu")), "the scan found no kernels");
    let mut long = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let lines = c_code_lines(&text);
        let says_why = text.lines().take_while(|l| l.starts_with("//") || l.is_empty()).any(|l| l.starts_with("// Long because"));
        if lines > MAX_CODE_LINES && !says_why {
            long.push(format!(
                "{}: {lines} lines of code (at most {MAX_CODE_LINES}, or a `// Long because ...` line at its top)",
                f.display()
            ));
        }
    }
    assert!(long.is_empty(), "{}", long.join("\n"));
    assert_eq!(c_code_lines("// a\nint x; // b\n/* c\n d */ int y;\n\n  /* e */\n"), 2);
}

/// Lines of C-like `text` holding code once comments are removed (string literals are not
/// parsed: a `//` inside one ends the line's code early, which only undercounts).
fn c_code_lines(text: &str) -> usize {
    let mut in_block = false;
    let mut n = 0;
    for line in text.lines() {
        let mut code = String::new();
        let mut rest = line;
        loop {
            if in_block {
                match rest.find("*/") {
                    Some(i) => {
                        in_block = false;
                        rest = &rest[i + 2..];
                    }
                    None => break,
                }
            } else {
                let (line_c, block_c) = (rest.find("//"), rest.find("/*"));
                match (line_c, block_c) {
                    (Some(l), b) if b.is_none_or(|b| l < b) => {
                        code.push_str(&rest[..l]);
                        break;
                    }
                    (_, Some(b)) => {
                        code.push_str(&rest[..b]);
                        in_block = true;
                        rest = &rest[b + 2..];
                    }
                    _ => {
                        code.push_str(rest);
                        break;
                    }
                }
            }
        }
        if !code.trim().is_empty() {
            n += 1;
        }
    }
    n
}

#[test]
fn the_scan_sees_references() {
    // The checks above pass vacuously if the scan finds nothing: it must see the stages'
    // references to the runtime.
    assert_eq!(crate_paths("use crate::runtime::stage::{Source, Ctx};"), vec![vec!["runtime", "stage"]]);
    assert_eq!(crate_paths("let x = pipeline_crate::a; y(crate::data::batch::X)"), vec![vec!["data", "batch", "X"]]);
    // Test items are skipped, not everything after the first.
    let kept = without_test_items("use a;\n#[cfg(test)]\nmod emu;\nuse b;\n#[cfg(test)]\nmod tests {\n    use c;\n}\nuse d;");
    assert_eq!(kept, ["use a;", "", "", "use b;", "", "", "", "", "use d;"]);
    // `super::` and `self::` from the module's place, groups spread.
    let p = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(module_paths("model::cuda::flash_attn", "use super::super::flash_attn::TILE;"), vec![p(&["model", "flash_attn", "TILE"])]);
    assert_eq!(
        module_paths("engine::step", "use super::{layout::Layout, gpt as g}; self::x::y(); my_super::z"),
        vec![p(&["engine", "layout", "Layout"]), p(&["engine", "gpt"]), p(&["engine", "step", "x", "y"])]
    );
    let stages: Vec<Source> = sources().into_iter().filter(|s| s.area == "stages").collect();
    assert!(stages.len() > 5);
    assert!(stages.iter().any(|s| s.code.iter().any(|l| crate_paths(l).iter().any(|p| p.first() == Some(&"runtime")))));
}

/// Every repository file or folder a comment or a doc names (`src/...rs`, `kernels/...cu`,
/// `docs/...md`, `src/engine/gpu/`, ...) exists: a map that names moved or deleted files is a
/// wrong map.
#[test]
fn every_file_the_comments_and_docs_name_exists() {
    let mut files: Vec<PathBuf> = Vec::new();
    fn walk(dir: &std::path::Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for p in entries.map(|e| e.unwrap().path()) {
            if p.is_dir() {
                walk(&p, out);
            } else {
                out.push(p);
            }
        }
    }
    for d in ["src", "stages", "tests", "kernels", "docs", "scripts", "benches", "pipelines", ".ci"] {
        walk(&root().join(d), &mut files);
    }
    files.extend(["build.rs", "README.md", "Cargo.toml"].map(|f| root().join(f)));
    let prefixes = ["src/", "stages/", "kernels/", "tests/", "scripts/", "docs/", "pipelines/", "benches/"];
    let exts = [".rs", ".cu", ".cuh", ".cpp", ".h", ".md", ".sh", ".toml", ".py"];
    let mut missing = Vec::new();
    for f in files {
        let ext = f.extension().and_then(|e| e.to_str()).unwrap_or("");
        let Ok(text) = std::fs::read_to_string(&f) else { continue };
        for (n, line) in text.lines().enumerate() {
            let t = line.trim_start();
            // Comments only (a string in code may name a test's scratch file); all of a doc.
            let prose = match ext {
                "md" => true,
                "rs" | "cu" | "cuh" | "cpp" | "h" => t.starts_with("//"),
                "sh" | "py" | "toml" | "" => t.starts_with('#'),
                _ => false,
            };
            if !prose {
                continue;
            }
            for p in prefixes {
                let mut rest = line;
                while let Some(i) = rest.find(p) {
                    let before = rest[..i].chars().next_back();
                    let tail = &rest[i..];
                    let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || "_./-".contains(c))).unwrap_or(tail.len());
                    let name = tail[..end].trim_end_matches('.');
                    rest = &tail[end.max(1)..];
                    // A placeholder (`src/...rs`, `kernels/NAME.cu`) names no file.
                    let stem = std::path::Path::new(name).file_stem().and_then(|s| s.to_str()).unwrap_or("");
                    let placeholder = name.contains("...") || stem.chars().all(|c| c.is_ascii_uppercase() || c == '_');
                    // A folder (`src/engine/gpu/`) must exist too.
                    let folder = name.ends_with('/') && name.matches('/').count() >= 2;
                    if before.is_some_and(|c| c.is_ascii_alphanumeric() || "_/.-".contains(c))
                        || !(folder || exts.iter().any(|e| name.ends_with(e)))
                        || placeholder
                    {
                        continue;
                    }
                    if !root().join(name).exists() {
                        missing.push(format!(
                            "{}:{}: names {name}, which does not exist",
                            f.strip_prefix(root()).unwrap().display(),
                            n + 1
                        ));
                    }
                }
            }
        }
    }
    assert!(missing.is_empty(), "stale file names:\n{}", missing.join("\n"));
}
