//! `report.html`: the report as one self-contained page (inline SVG and CSS, no script, nothing
//! fetched), written beside `report.json` by every run and beside `ablation.json` by every
//! ablation.
//!
//! A run's page ([`run`]) has the verdict in words, the stage graph coloured by busy and blocked
//! shares ([`graph`]), per stage and per channel the latency percentile plots and the channel
//! occupancy over time, and for a training run its losses and step times against steps
//! ([`train`]). An ablation's page ([`ablation`]) has the comparison table and every run's plots
//! overlaid. The plots are drawn by plotters' SVG backend ([`plots`]).

pub mod ablation;
pub mod graph;
pub mod plots;
pub mod run;
pub mod train;

use std::path::{Path, PathBuf};

use crate::report::ablation::figures::Figures;
use crate::report::ablation::plan::Variant;
use crate::report::ablation::summary::Line;
use crate::report::document::Report;
use crate::runtime::rundir;

/// The page's file name, beside `report.json` (a run) or `ablation.json` (an ablation).
pub const FILE: &str = "report.html";

/// `text` with `&`, `<`, `>`, `"` and `'` escaped, safe in HTML text and attribute values.
pub fn escape(text: &str) -> String {
    let mut o = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

/// A name as an element id (`stage-NAME`, `channel-A-B`): letters and digits kept, anything
/// else a `-`.
pub fn anchor(prefix: &str, name: &str) -> String {
    let tail: String = name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '-' }).collect();
    format!("{prefix}-{tail}")
}

/// A relative path as a link target: characters outside a safe set percent-encoded.
pub fn href(path: &str) -> String {
    let mut o = String::new();
    for b in path.bytes() {
        if b.is_ascii_alphanumeric() || b"/._-=,~".contains(&b) {
            o.push(b as char);
        } else {
            o.push_str(&format!("%{b:02X}"));
        }
    }
    o
}

/// A chart in its `<figure>`, or in words why there is none: `empty` when it had nothing to
/// draw, the error when plotters failed (the rest of the page stands).
pub fn figure(chart: anyhow::Result<Option<String>>, empty: &str) -> String {
    match chart {
        Ok(Some(svg)) => format!("<figure>{svg}</figure>\n"),
        Ok(None) => format!("<p class=\"none\">{}</p>\n", escape(empty)),
        Err(e) => format!("<p class=\"error\">this chart could not be drawn: {}</p>\n", escape(&format!("{e:#}"))),
    }
}

/// The page around `body`: the title, the style sheet, nothing else.
pub fn shell(title: &str, body: &str) -> String {
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>{}</title>\n<style>\n{STYLE}</style>\n</head>\n<body>\n{body}<footer>written by <code>pipeline</code> {}; every plot \
         is drawn from report.json (and steps.tsv), and <code>pipeline report RUN_DIR --html</code> writes it again.</footer>\n</body>\n</html>\n",
        escape(title),
        env!("CARGO_PKG_VERSION"),
    )
}

/// The style sheet: a readable column, cards in a grid, charts scaled to their box.
const STYLE: &str = r#"body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; margin: 0 auto; max-width: 1240px; padding: 16px 24px 40px; color: #1b1b1b; background: #fafafa; line-height: 1.4; }
h1 { font-size: 1.5em; margin: 0.3em 0; }
h2 { font-size: 1.2em; margin: 1.6em 0 0.5em; border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
h3 { font-size: 1em; margin: 0 0 0.4em; }
h3 small { font-weight: normal; color: #666; }
code { background: #eee; padding: 0 3px; border-radius: 3px; }
table { border-collapse: collapse; font-size: 0.85em; background: #fff; margin: 0.4em 0; }
th, td { border: 1px solid #ddd; padding: 3px 7px; text-align: right; white-space: nowrap; }
th { background: #f0f0f0; }
td.l, th.l { text-align: left; }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: 2px 14px; margin: 0.5em 0; font-size: 0.92em; }
dl.facts dt { color: #555; }
dl.facts dd { margin: 0; }
.verdict { background: #fff; border-left: 6px solid #888; padding: 10px 16px; margin: 12px 0; }
.verdict.not { border-color: #2ca02c; } .verdict.moderately { border-color: #ff7f0e; } .verdict.highly { border-color: #d62728; }
.verdict .class { font-size: 1.15em; font-weight: bold; }
.status { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 0.8em; font-weight: bold; vertical-align: middle; color: #fff; background: #888; }
.status.completed { background: #2ca02c; } .status.failed { background: #d62728; } .status.interrupted { background: #ff7f0e; }
.error { color: #a00; background: #fff0f0; border: 1px solid #e4b4b4; padding: 6px 10px; white-space: pre-wrap; }
.none { color: #666; font-style: italic; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(440px, 1fr)); gap: 14px; }
.card { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 10px 12px; }
.card p { margin: 0.2em 0; font-size: 0.9em; }
figure { margin: 6px 0; }
.legend { font-size: 0.8em; display: flex; flex-wrap: wrap; gap: 2px 14px; margin: 0 0 4px 66px; }
.legend i { display: inline-block; width: 18px; height: 3px; margin-right: 5px; vertical-align: middle; }
.legend i.dash { height: 0; border-top: 3px dashed; background: none; }
.legend .off { color: #888; }
svg { max-width: 100%; height: auto; display: block; }
.graph-box { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 8px; overflow-x: auto; }
footer { margin-top: 3em; color: #777; font-size: 0.8em; }
nav { font-size: 0.9em; margin: 0.4em 0; }
nav a { margin-right: 1em; }
"#;

/// Writes `RUN_DIR/report.html` for `report` (with `RUN_DIR/steps.tsv` when the run wrote one);
/// returns its path.
pub fn write_run(run_dir: &Path, report: &Report) -> anyhow::Result<PathBuf> {
    let steps = std::fs::read_to_string(run_dir.join("steps.tsv")).ok();
    let path = run_dir.join(FILE);
    rundir::write_atomic(&path, run::page(report, steps.as_deref()).as_bytes())?;
    Ok(path)
}

/// Writes `ABL_DIR/report.html`: the comparison `lines` of `runs` (each run's report and
/// `steps.tsv` read from its directory under `dir`, where it has them); returns its path.
pub fn write_ablation(dir: &Path, config: &Path, runs: &[(Variant, Option<Figures>)], lines: &[Line]) -> anyhow::Result<PathBuf> {
    let loaded: Vec<ablation::Run> = runs
        .iter()
        .map(|(v, f)| {
            let run_dir = dir.join(&v.dir);
            ablation::Run {
                variant: v.clone(),
                figures: f.clone(),
                report: Report::load(&run_dir).ok(),
                steps: std::fs::read_to_string(run_dir.join("steps.tsv")).ok(),
            }
        })
        .collect();
    let path = dir.join(FILE);
    rundir::write_atomic(&path, ablation::page(&config.display().to_string(), &loaded, lines).as_bytes())?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_and_names() {
        assert_eq!(escape(r#"<a href="x">&'"#), "&lt;a href=&quot;x&quot;&gt;&amp;&#39;");
        assert_eq!(anchor("channel", "pin->upload"), "channel-pin--upload");
        assert_eq!(href("stages.sampler.queue=2/report.html"), "stages.sampler.queue=2/report.html");
        assert_eq!(href("a b#c"), "a%20b%23c");
        assert!(figure(Ok(None), "no <samples>").contains("no &lt;samples&gt;"));
        assert!(figure(Err(anyhow::anyhow!("bad")), "").contains("could not be drawn: bad"));
    }
}
