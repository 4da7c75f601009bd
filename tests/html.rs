//! `report.html` through the binary: a failed run still writes its page, every string from the
//! run is escaped, `pipeline report --html` writes it again (and names the file it cannot
//! write), and a training run's page plots its losses and step times. (The page in a real
//! browser: `scripts/html-check.sh`.)

mod common;

use common::{Dir, bin, html_page, run, scratch, synthetic_toml, text, tiny};

/// A synthetic run whose config file and name hold markup, failed at its 30th item: exit 1,
/// report.json and report.html both written, the page has every stage, the error, and the
/// markup escaped; `pipeline report --html` writes the page again, and says which file it
/// could not write.
#[test]
fn failed_run_page_escapes_what_the_run_names_and_is_written_again() {
    let dir = Dir(scratch("html-failed"));
    let config = dir.join("<b>odd&name.toml");
    std::fs::copy(synthetic_toml(), &config).unwrap();
    let out = dir.join("run");
    let sets = ["run.name=\"<i>it</i>\"", "stages.source.count=80", "stages.mid.fail_at=30", "stages.source.delay_us=50"];
    let o = run(&config, &out, &sets);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(out.join("report.json").is_file(), "{}", text(&o));
    let page = html_page(&out.join("report.html"));
    for stage in ["source", "mid", "post", "sink"] {
        assert!(page.contains(&format!("id=\"stage-{stage}\"")), "no card for `{stage}`");
    }
    assert!(page.contains("&lt;b&gt;odd&amp;name.toml") && page.contains("&lt;i&gt;it&lt;/i&gt;"), "markup not escaped");
    assert!(!page.contains("<b>odd") && !page.contains("<i>it"), "markup left raw");
    assert!(page.contains("class=\"status failed\"") && page.contains("injected failure at item 30"), "the failure is not shown");
    assert!(page.contains("Stage graph") && page.contains("mid: service time per item") && page.contains("length over time"));
    assert!(!page.contains("id=\"training\""), "a run that trained nothing has no training part");

    std::fs::remove_file(out.join("report.html")).unwrap();
    let o = bin().arg("report").arg(&out).arg("--html").output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("report.html"), "{}", text(&o));
    assert_eq!(html_page(&out.join("report.html")).len(), page.len());

    // A page that cannot be written (a directory stands in its place) is an error naming it.
    std::fs::remove_file(out.join("report.html")).unwrap();
    std::fs::create_dir_all(out.join("report.html/in-the-way")).unwrap();
    let o = bin().arg("report").arg(&out).arg("--html").output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("report.html"), "{}", text(&o));
}

/// A tiny training run: its page has the training part, with the losses and step times
/// against steps.
#[test]
fn training_run_page_plots_losses_and_step_times() {
    let c = tiny::corpus("html-train");
    let config = tiny::config(&c);
    let out = Dir(scratch("html-train"));
    let (t, o) = tiny::train_ok(&config, &out, &["train.iterations=6", "train.val_every=3"]);
    assert_eq!(t["steps"].as_u64(), Some(6), "{}", text(&o));
    let page = html_page(&out.join("report.html"));
    for part in
        ["<h2 id=\"training\">Training</h2>", "loss against steps", "step time against steps", "val loss", "validation bits per byte"]
    {
        assert!(page.contains(part), "`{part}` not on the page");
    }
    assert!(page.contains("id=\"stage-train\""), "no card for the step executor");
}
