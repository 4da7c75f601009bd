//! The comparison of an ablation's runs: per variant, each figure's mean (and standard
//! deviation over seeds), against the base as a ratio (times, rates, bytes) or a difference
//! (shares, losses), the bottleneck, whether it saw the base's data order, and with seeds,
//! Welch's t-test of its score against the base's beside the challenge's bar (an improvement of
//! at least 0.005 nats at p < 0.01). Written as `ablation.json` and printed as a table.

use std::collections::BTreeMap;

use super::figures::Figures;
use super::plan::Variant;
use super::stats::{Welch, mean, std_dev, welch};

/// The challenge's significance bar: a record must improve the score by this many nats...
pub const BAR_NATS: f64 = 0.005;
/// ...at this p-value or below.
pub const BAR_P: f64 = 0.01;

/// How a figure is set against the base's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Against {
    /// `variant / base`.
    Ratio,
    /// `variant - base`.
    Diff,
}

/// Reads one figure of a run.
type Getter = fn(&Figures) -> Option<f64>;

/// The numeric figures compared, their names in `ablation.json` and how.
const FIGURES: [(&str, Getter, Against); 11] = [
    ("wall_s", |f| Some(f.wall_s), Against::Ratio),
    ("steps", |f| f.steps.map(|s| s as f64), Against::Ratio),
    ("tokens_per_s", |f| f.tokens_per_s, Against::Ratio),
    ("items_per_s", |f| Some(f.items_per_s), Against::Ratio),
    ("step_ms_p50", |f| f.step_ms_p50, Against::Ratio),
    ("step_ms_p99", |f| f.step_ms_p99, Against::Ratio),
    ("input_wait", |f| Some(f.input_wait), Against::Diff),
    ("val_bpb", |f| f.val_bpb, Against::Diff),
    ("ttt_bpb", |f| f.ttt_bpb, Against::Diff),
    ("score_loss", |f| f.score_loss, Against::Diff),
    ("artifact_bytes", |f| f.artifact_bytes.map(|b| b as f64), Against::Ratio),
];

/// One figure of a variant over its runs.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Stat {
    /// Mean over the runs that have it.
    pub mean: f64,
    /// Sample standard deviation (absent with one run).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub std: Option<f64>,
    /// Against the base: `ratio` (variant / base) or `diff` (variant - base).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio: Option<f64>,
    /// See `ratio`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub diff: Option<f64>,
}

/// The score's test against the base (seeded ablations).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Significance {
    /// Mean score difference, variant - base, nats per token (negative: better).
    pub diff_nats: f64,
    /// Welch's t-test of the variant's scores against the base's.
    pub welch: Welch,
    /// Whether the variant improves on the base by at least [`BAR_NATS`] at p <= [`BAR_P`].
    pub clears_bar: bool,
}

/// One variant's line of the comparison.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Line {
    /// The variant's name (`base`, or its settings).
    pub name: String,
    /// Runs planned (one per seed).
    pub runs: usize,
    /// Runs that completed (the figures are theirs).
    pub complete: usize,
    /// Each figure the runs have, by name.
    pub figures: BTreeMap<&'static str, Stat>,
    /// The bottleneck stage most runs named.
    pub bottleneck: Option<String>,
    /// Whether every run saw the same data order as the base's run with the same seed
    /// (`None`: no fingerprint to compare).
    pub same_data_as_base: Option<bool>,
    /// The score's test against the base (two or more seeds on both sides).
    pub significance: Option<Significance>,
}

/// Compares `runs` (every planned run and its figures, `None` where it did not complete): one
/// line per variant, base first.
pub fn compare(runs: &[(Variant, Option<Figures>)]) -> Vec<Line> {
    let mut names: Vec<&str> = Vec::new();
    for (v, _) in runs {
        if !names.contains(&v.name.as_str()) {
            names.push(&v.name);
        }
    }
    let of = |name: &str| -> Vec<(&Variant, &Figures)> {
        runs.iter()
            .filter(|(v, f)| v.name == name && f.as_ref().is_some_and(Figures::complete))
            .map(|(v, f)| (v, f.as_ref().unwrap()))
            .collect()
    };
    let base = of("base");
    let values =
        |rs: &[(&Variant, &Figures)], get: fn(&Figures) -> Option<f64>| rs.iter().filter_map(|(_, f)| get(f)).collect::<Vec<f64>>();
    names
        .iter()
        .map(|&name| {
            let mine = of(name);
            let mut figures = BTreeMap::new();
            for (key, get, against) in FIGURES {
                let xs = values(&mine, get);
                if xs.is_empty() {
                    continue;
                }
                let (m, b) = (mean(&xs), mean(&values(&base, get)));
                let ratio = (against == Against::Ratio && b.is_finite() && b != 0.0).then(|| m / b);
                let diff = (against == Against::Diff && b.is_finite()).then_some(m - b);
                figures.insert(key, Stat { mean: m, std: (xs.len() > 1).then(|| std_dev(&xs)), ratio, diff });
            }
            let mut votes: BTreeMap<&str, usize> = BTreeMap::new();
            for (_, f) in &mine {
                if let Some(b) = &f.bottleneck {
                    *votes.entry(b).or_default() += 1;
                }
            }
            let bottleneck = votes.iter().max_by_key(|(_, n)| **n).map(|(b, _)| b.to_string());
            let pairs: Vec<Option<bool>> = mine
                .iter()
                .map(|(v, f)| {
                    let twin = base.iter().find(|(bv, _)| bv.seed == v.seed)?;
                    f.same_data(twin.1)
                })
                .collect();
            let same_data_as_base =
                if pairs.is_empty() || pairs.iter().any(Option::is_none) { None } else { Some(pairs.iter().all(|p| *p == Some(true))) };
            let (s, sb) = (values(&mine, |f| f.score_loss), values(&base, |f| f.score_loss));
            let significance = (name != "base").then(|| welch(&s, &sb)).flatten().map(|w| {
                let diff_nats = mean(&s) - mean(&sb);
                Significance { diff_nats, welch: w, clears_bar: diff_nats <= -BAR_NATS && w.p <= BAR_P }
            });
            let runs_planned = runs.iter().filter(|(v, _)| v.name == name).count();
            Line { name: name.to_string(), runs: runs_planned, complete: mine.len(), figures, bottleneck, same_data_as_base, significance }
        })
        .collect()
}

/// The comparison's table, one row per variant: the header and each row's cells, columns that
/// every row leaves empty left out (what [`render`] prints and the HTML report shows).
pub fn table(lines: &[Line]) -> (Vec<&'static str>, Vec<Vec<String>>) {
    use std::fmt::Write;
    let cell = |l: &Line, key: &str, digits: usize, scale: f64| -> String {
        let Some(s) = l.figures.get(key) else { return "-".into() };
        let mut c = format!("{:.*}", digits, s.mean * scale);
        if let Some(sd) = s.std {
            let _ = write!(c, "±{:.*}", digits, sd * scale);
        }
        if l.name != "base" {
            if let Some(r) = s.ratio {
                let _ = write!(c, " ({r:.2}x)");
            } else if let Some(d) = s.diff {
                let _ = write!(c, " ({:+.*})", digits, d * scale);
            }
        }
        c
    };
    let header = [
        "variant",
        "runs",
        "wall s",
        "tokens/s",
        "items/s",
        "step p50 ms",
        "step p99 ms",
        "input wait %",
        "val_bpb",
        "TTT bpb",
        "artifact B",
        "bottleneck",
        "data",
    ];
    let rows: Vec<Vec<String>> = lines
        .iter()
        .map(|l| {
            let data = match (l.name == "base", l.same_data_as_base) {
                (true, _) => "-".into(),
                (_, Some(true)) => "same".into(),
                (_, Some(false)) => "DIFFERS".into(),
                (_, None) => "?".into(),
            };
            vec![
                l.name.clone(),
                format!("{}/{}", l.complete, l.runs),
                cell(l, "wall_s", 1, 1.0),
                cell(l, "tokens_per_s", 0, 1.0),
                cell(l, "items_per_s", 1, 1.0),
                cell(l, "step_ms_p50", 1, 1.0),
                cell(l, "step_ms_p99", 1, 1.0),
                cell(l, "input_wait", 2, 100.0),
                cell(l, "val_bpb", 4, 1.0),
                cell(l, "ttt_bpb", 4, 1.0),
                cell(l, "artifact_bytes", 0, 1.0),
                l.bottleneck.clone().unwrap_or_else(|| "-".into()),
                data,
            ]
        })
        .collect();
    // Columns every row leaves empty are left out.
    let keep: Vec<usize> = (0..header.len()).filter(|&c| c < 2 || rows.iter().any(|r| r[c] != "-")).collect();
    let header = keep.iter().map(|&c| header[c]).collect();
    let rows = rows.into_iter().map(|r| keep.iter().map(|&c| r[c].clone()).collect()).collect();
    (header, rows)
}

/// One sentence per variant with a significance test: its score against the base's and whether
/// it clears the bar.
pub fn significance(lines: &[Line]) -> Vec<String> {
    lines
        .iter()
        .filter_map(|l| {
            let s = l.significance.as_ref()?;
            let verdict = if s.clears_bar { "clears" } else { "does not clear" };
            Some(format!(
                "{}: score {:+.4} nats vs base (Welch t {:.2}, df {:.1}, p {:.3}): {verdict} the bar ({BAR_NATS} nats at p <= {BAR_P})",
                l.name, s.diff_nats, s.welch.t, s.welch.df, s.welch.p
            ))
        })
        .collect()
}

/// The comparison as a text table, one row per variant, then the significance sentences.
pub fn render(lines: &[Line]) -> String {
    use std::fmt::Write;
    let (header, rows) = table(lines);
    let widths: Vec<usize> =
        (0..header.len()).map(|c| rows.iter().map(|r| r[c].chars().count()).chain([header[c].len()]).max().unwrap_or(0)).collect();
    let mut out = String::new();
    let line = |cells: Vec<&str>| cells.iter().zip(&widths).map(|(c, w)| format!("{:<w$}", c, w = *w)).collect::<Vec<_>>().join("  ");
    let _ = writeln!(out, "{}", line(header.clone()).trim_end());
    for r in &rows {
        let _ = writeln!(out, "{}", line(r.iter().map(String::as_str).collect()).trim_end());
    }
    for s in significance(lines) {
        let _ = writeln!(out, "{s}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::ablation::plan::Vary;
    use crate::report::ablation::plan::plan;

    fn figures(wall: f64, score: f64, fp: &str) -> Figures {
        Figures {
            status: "completed".into(),
            wall_s: wall,
            items_per_s: 100.0 / wall,
            score_loss: Some(score),
            val_bpb: Some(score / 2.0),
            bottleneck: Some("train".into()),
            fingerprint: Some(fp.into()),
            fingerprint_at: Some(10),
            ..Figures::default()
        }
    }

    /// Three seeds of a base and one variant: means, standard deviations, ratios and
    /// differences, the data check, and Welch's test against the bar (a clear 0.02-nat gain
    /// over tight seeds clears it; the same gain with wide seeds does not).
    #[test]
    fn variants_against_the_base_with_seeds() {
        let q = Vary::parse("stages.sampler.queue=100").unwrap();
        let variants = plan(&[q], false, 3, 1).unwrap();
        let scores = [[3.000, 3.001, 2.999], [2.980, 2.981, 2.979]];
        let runs: Vec<(Variant, Option<Figures>)> = variants
            .iter()
            .map(|v| {
                let i = usize::from(v.name != "base");
                let fp = if i == 1 && v.seed == 2 { "other" } else { "fp" };
                let fp = format!("{fp}{}", v.seed);
                (v.clone(), Some(figures(10.0 * (1.0 + i as f64), scores[i][v.seed as usize], &fp)))
            })
            .collect();
        let lines = compare(&runs);
        assert_eq!(lines.len(), 2);
        let (b, v) = (&lines[0], &lines[1]);
        assert_eq!((b.runs, b.complete, v.complete), (3, 3, 3));
        assert!((v.figures["wall_s"].ratio.unwrap() - 2.0).abs() < 1e-12);
        assert!((v.figures["score_loss"].diff.unwrap() + 0.02).abs() < 1e-9);
        assert!((b.figures["score_loss"].std.unwrap() - 0.001).abs() < 1e-9);
        assert_eq!(v.same_data_as_base, Some(false), "seed 2 saw other data");
        let s = v.significance.as_ref().unwrap();
        assert!(s.clears_bar && s.welch.p < 1e-4, "{s:?}");
        assert!(b.significance.is_none());
        let text = render(&lines);
        assert!(text.contains("(2.00x)") && text.contains("DIFFERS") && text.contains("clears the bar"), "{text}");

        let wide = [[3.00, 3.05, 2.95], [2.98, 3.03, 2.93]];
        let runs: Vec<_> = runs
            .into_iter()
            .map(|(v, f)| {
                let i = usize::from(v.name != "base");
                let score = wide[i][v.seed as usize];
                (v, f.map(|f| Figures { score_loss: Some(score), ..f }))
            })
            .collect();
        let s = compare(&runs)[1].significance.clone().unwrap();
        assert!(!s.clears_bar && s.welch.p > 0.5, "{s:?}");
    }

    /// A run that did not complete counts as planned but not complete, and gives no figures.
    #[test]
    fn incomplete_runs_are_left_out_of_the_figures() {
        let variants = plan(&[Vary::parse("a.b=1").unwrap()], false, 1, 0).unwrap();
        let stopped = Figures { status: "interrupted".into(), exit_code: 130, ..figures(5.0, 3.0, "fp") };
        let lines = compare(&[(variants[0].clone(), Some(figures(10.0, 3.0, "fp"))), (variants[1].clone(), Some(stopped))]);
        assert_eq!((lines[1].runs, lines[1].complete), (1, 0));
        assert!(lines[1].figures.is_empty());
    }
}
