//! What a new user copies stays true: every `pipelines/*.toml` validates, every command the
//! README shows exists (the binary's subcommands and flags, the scripts), and every file and
//! page the README names is there.

mod common;

use std::path::PathBuf;

use common::{bin, root, text, tiny};
use pipeline::runtime::config::load_with_env;
use pipeline::runtime::graph;
use pipeline::stages::REGISTRY;
use pipeline::train::config::Config;

fn pipeline_configs() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(root().join("pipelines"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    v.sort();
    assert!(v.len() >= 4, "pipelines/ holds {} configs", v.len());
    v
}

/// The shell lines of the README's fenced `sh` blocks, comments cut.
fn readme_commands() -> Vec<String> {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let mut out = Vec::new();
    let mut in_sh = false;
    for line in readme.lines() {
        if let Some(info) = line.strip_prefix("```") {
            in_sh = !in_sh && info.trim() == "sh";
            continue;
        }
        if in_sh {
            let cmd = line.split(" #").next().unwrap().trim();
            if !cmd.is_empty() {
                out.push(cmd.to_string());
            }
        }
    }
    out
}

/// Every config plans (keys, types, stage graph) as it stands, and validates in full (files,
/// tokenizer, each stage's own checks) with its data pointed at a tiny corpus. A config for a
/// GPU is validated in full only by a `cuda` build; here its only refusal is the device.
#[test]
fn every_pipeline_config_validates() {
    let corpus = tiny::corpus("readme-configs");
    for path in pipeline_configs() {
        let name = path.display();
        let loaded = load_with_env::<Config>(&path, &[], false).unwrap_or_else(|e| panic!("{name} does not load:\n{e}"));
        graph::plan(&loaded, &REGISTRY).unwrap_or_else(|e| panic!("{name} does not plan:\n{e}"));
        let mut cmd = bin();
        cmd.arg("validate").arg(&path);
        let data = &loaded.config.data;
        let mut sets = Vec::new();
        if data.train.is_some() {
            sets.push(format!("data.train={}", tiny::lit(corpus.train_glob())));
        }
        if data.val.is_some() {
            sets.push(format!("data.val={}", tiny::lit(corpus.val_glob())));
        }
        if data.tokenizer.is_some() {
            sets.push(format!("data.tokenizer={}", tiny::lit(corpus.tokenizer.display().to_string())));
            sets.push(format!("model.vocab_size={}", corpus.vocab));
        }
        for s in &sets {
            cmd.arg("--set").arg(s);
        }
        let out = cmd.current_dir(root()).output().unwrap();
        let gpu = loaded.config.run.device != "cpu";
        if !gpu || pipeline::device::CUDA_BUILD {
            assert!(out.status.success(), "pipeline validate {name} {sets:?} failed:\n{}", text(&out));
        } else {
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success() && stderr.contains("run.device"), "{name}: {}", text(&out));
            for line in stderr.lines().filter(|l| l.contains("stages.") || l.contains("data.") || l.contains("model.")) {
                assert!(
                    line.contains("cuda") || line.contains("GPU") || line.contains("page-locked"),
                    "{name}: a refusal besides the device: {line}"
                );
            }
        }
    }
}

/// Each command line of the README: the binary's subcommands and flags parse (the line with
/// `--help` appended prints help and exits 0), and the scripts and configs it names exist.
#[test]
fn every_readme_command_exists() {
    let commands = readme_commands();
    assert!(commands.len() >= 5, "found only {commands:?}");
    let mut seen_binary = 0;
    for cmd in &commands {
        let words: Vec<&str> = cmd.split_whitespace().collect();
        for w in &words {
            let named = w.starts_with("pipelines/") || w.starts_with("scripts/");
            assert!(!named || root().join(w).exists(), "`{cmd}` names {w}, which does not exist");
        }
        match words[0] {
            "./target/release/pipeline" | "pipeline" => {
                seen_binary += 1;
                let out = bin().args(&words[1..]).arg("--help").output().unwrap();
                assert!(out.status.success(), "`{cmd} --help` does not parse:\n{}", text(&out));
            }
            "cargo" => assert!(matches!(words.get(1), Some(&"test" | &"build" | &"bench" | &"run")), "`{cmd}`"),
            script if script.starts_with("scripts/") => {
                let meta = std::fs::metadata(root().join(script)).unwrap();
                assert!(std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o111 != 0, "{script} is not executable");
            }
            other => panic!("`{cmd}`: the README runs `{other}`, which this test does not know"),
        }
    }
    assert!(seen_binary >= 3, "the README shows {seen_binary} commands of the binary");
}

/// The quick start is two commands: the demo and the tests.
#[test]
fn quick_start_is_the_demo_and_the_tests() {
    let commands = readme_commands();
    assert_eq!(commands[..2], ["scripts/demo.sh".to_string(), "scripts/test.sh".to_string()]);
    let ci = std::fs::read_to_string(root().join(".ci/run")).unwrap();
    assert!(ci.contains("\nscripts/test.sh"), "CI no longer runs the README's test command");
    let script = std::fs::read_to_string(root().join("scripts/test.sh")).unwrap();
    assert!(script.contains("exec cargo test --locked"), "scripts/test.sh no longer runs cargo test --locked");
}

/// Every relative link of the README and of the docs pages points at a file that exists.
#[test]
fn links_point_at_files() {
    let mut pages = vec![root().join("README.md")];
    pages.extend(
        std::fs::read_dir(root().join("docs")).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|x| x == "md")),
    );
    for page in pages {
        let text = std::fs::read_to_string(&page).unwrap();
        for (i, _) in text.match_indices("](") {
            let rest = &text[i + 2..];
            let target = rest[..rest.find(')').unwrap_or(0)].split('#').next().unwrap();
            if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let resolved = page.parent().unwrap().join(target);
            assert!(resolved.exists(), "{} links to {target}, which does not exist", page.display());
        }
    }
}
