//! The stage graph of the HTML report as an inline SVG: stages laid out left to right in layers
//! (a stage's layer is one past its deepest input's), each box filled by its busy share on a
//! white-to-red scale, each channel an arrow coloured and thickened by its blocked share (the
//! larger of the producer's send wait and the consumer's input wait) and labelled with its
//! capacity and which wait that is. Hovering a box or an arrow shows its figures (SVG `<title>`, no script).

use std::collections::BTreeMap;
use std::fmt::Write;

use super::escape;
use crate::report::document::Report;

/// A stage box's width and height, and the gaps between layers and between rows.
const BOX: (f64, f64) = (160.0, 66.0);
const GAP: (f64, f64) = (150.0, 34.0);
/// Layers side by side before the graph wraps onto a band below (a long chain stays readable).
const LAYERS_PER_BAND: usize = 5;
/// Space around the drawing, and under it for the legend.
const MARGIN: f64 = 16.0;
const LEGEND: f64 = 48.0;

/// White (0) to red (1).
fn heat(share: f64) -> (u8, u8, u8) {
    let s = share.clamp(0.0, 1.0);
    let mix = |from: f64, to: f64| (from + (to - from) * s).round() as u8;
    (mix(255.0, 214.0), mix(255.0, 39.0), mix(255.0, 40.0))
}

/// Grey (0) to red (1), for arrows (a white arrow would vanish).
fn wait_colour(share: f64) -> (u8, u8, u8) {
    let s = share.clamp(0.0, 1.0);
    let mix = |from: f64, to: f64| (from + (to - from) * s).round() as u8;
    (mix(160.0, 214.0), mix(160.0, 39.0), mix(160.0, 40.0))
}

fn rgb((r, g, b): (u8, u8, u8)) -> String {
    format!("#{r:02x}{g:02x}{b:02x}")
}

/// Each stage's `(layer, row)`, in the report's stage order (topological).
fn layout(report: &Report) -> BTreeMap<&str, (usize, usize)> {
    let mut layer: BTreeMap<&str, usize> = BTreeMap::new();
    for name in &report.run.stage_order {
        let inputs = report.stages.get(name).map(|s| s.inputs.as_slice()).unwrap_or_default();
        let l = inputs.iter().filter_map(|i| layer.get(i.as_str())).map(|l| l + 1).max().unwrap_or(0);
        layer.insert(name, l);
    }
    let mut rows: Vec<usize> = Vec::new();
    let mut at = BTreeMap::new();
    for name in &report.run.stage_order {
        let l = layer[name.as_str()];
        if rows.len() <= l {
            rows.resize(l + 1, 0);
        }
        at.insert(name.as_str(), (l, rows[l]));
        rows[l] += 1;
    }
    at
}

/// Where the boxes go: layer `l` in column `l % LAYERS_PER_BAND` of band `l / LAYERS_PER_BAND`,
/// the bands one under the other.
struct Grid {
    /// Rows of boxes in a band (the most any layer has).
    rows: usize,
    /// Bands.
    bands: usize,
    /// Columns in use.
    columns: usize,
}

impl Grid {
    fn band_height(&self) -> f64 {
        self.rows as f64 * BOX.1 + (self.rows as f64 - 1.0) * GAP.1 + 2.0 * GAP.1
    }

    /// The top-left corner of the box at `(layer, row)`.
    fn corner(&self, (l, r): (usize, usize)) -> (f64, f64) {
        let (band, col) = (l / LAYERS_PER_BAND, l % LAYERS_PER_BAND);
        (MARGIN + col as f64 * (BOX.0 + GAP.0), MARGIN + band as f64 * self.band_height() + r as f64 * (BOX.1 + GAP.1))
    }

    fn size(&self) -> (f64, f64) {
        let w = 2.0 * MARGIN + self.columns as f64 * BOX.0 + (self.columns as f64 - 1.0) * GAP.0;
        let h = 2.0 * MARGIN + self.bands as f64 * self.band_height() - 2.0 * GAP.1 + LEGEND;
        (w.max(520.0), h)
    }
}

/// An arrow between two boxes: its SVG path, where its label goes, its tip, and the direction
/// it points at the tip.
struct Arrow {
    path: String,
    label: (f64, f64),
    tip: (f64, f64),
    direction: (f64, f64),
}

/// The arrow from the box at `from` to the box at `to`: a horizontal curve from the right side
/// to the left side when `to` is to the right, else a vertical one from the bottom to the top
/// (onto a wrapped band, or back).
fn route(from: (f64, f64), to: (f64, f64)) -> Arrow {
    if to.0 > from.0 + BOX.0 {
        let (x1, y1, x2, y2) = (from.0 + BOX.0, from.1 + BOX.1 / 2.0, to.0 - 2.0, to.1 + BOX.1 / 2.0);
        let bend = ((x2 - x1) / 2.0).max(20.0);
        let path = format!("M {x1:.1} {y1:.1} C {:.1} {y1:.1}, {:.1} {y2:.1}, {:.1} {y2:.1}", x1 + bend, x2 - bend, x2 - 9.0);
        Arrow { path, label: ((x1 + x2) / 2.0, (y1 + y2) / 2.0 - 6.0), tip: (x2, y2), direction: (1.0, 0.0) }
    } else {
        let (x1, y1, x2, y2) = (from.0 + BOX.0 / 2.0, from.1 + BOX.1, to.0 + BOX.0 / 2.0, to.1 - 2.0);
        let bend = ((y2 - y1) / 2.0).max(20.0);
        let path = format!("M {x1:.1} {y1:.1} C {x1:.1} {:.1}, {x2:.1} {:.1}, {x2:.1} {:.1}", y1 + bend, y2 - bend, y2 - 9.0);
        Arrow { path, label: ((x1 + x2) / 2.0, (y1 + y2) / 2.0 - 6.0), tip: (x2, y2), direction: (0.0, 1.0) }
    }
}

/// The stage graph of `report` as an `<svg>` element.
pub fn svg(report: &Report) -> String {
    let at = layout(report);
    let layers = at.values().map(|p| p.0 + 1).max().unwrap_or(1);
    let grid = Grid {
        rows: at.values().map(|p| p.1 + 1).max().unwrap_or(1),
        bands: layers.div_ceil(LAYERS_PER_BAND),
        columns: layers.min(LAYERS_PER_BAND),
    };
    let (width, height) = grid.size();
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg class="graph" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" xmlns="http://www.w3.org/2000/svg" font-family="sans-serif" role="img" aria-label="stage graph">"#
    );
    // Arrows first, under the boxes.
    for name in &report.run.stage_order {
        let (Some(s), Some(&to)) = (report.stages.get(name), at.get(name.as_str())) else { continue };
        for input in &s.inputs {
            let Some(&from) = at.get(input.as_str()) else { continue };
            let Some(c) = report.channels.get(&format!("{input}->{name}")) else { continue };
            let share = c.send_blocked_fraction.max(c.recv_blocked_fraction);
            let colour = rgb(wait_colour(share));
            let Arrow { path: d, label: (mx, my), tip: (x2, y2), direction: (dx, dy) } = route(grid.corner(from), grid.corner(to));
            let _ = writeln!(
                o,
                r#"<g class="edge"><title>{} -&gt; {}: capacity {}, producer blocked sending {:.1}% of its time, consumer waiting for input {:.1}%, mean occupancy {:.2}</title>"#,
                escape(input),
                escape(name),
                c.capacity,
                c.send_blocked_fraction * 100.0,
                c.recv_blocked_fraction * 100.0,
                c.mean_occupancy
            );
            let _ = writeln!(o, r#"<path d="{d}" fill="none" stroke="{colour}" stroke-width="{:.1}"/>"#, 1.5 + 4.0 * share.clamp(0.0, 1.0));
            // The arrowhead: a triangle pointing along (dx, dy).
            let (bx, by) = (x2 - 10.0 * dx, y2 - 10.0 * dy);
            let _ = writeln!(
                o,
                r#"<polygon points="{x2:.1},{y2:.1} {:.1},{:.1} {:.1},{:.1}" fill="{colour}"/>"#,
                bx - 5.0 * dy,
                by + 5.0 * dx,
                bx + 5.0 * dy,
                by - 5.0 * dx
            );
            let _ = writeln!(
                o,
                r##"<text x="{mx:.1}" y="{my:.1}" font-size="10.5" text-anchor="middle" stroke="#fff" stroke-width="3" paint-order="stroke">cap {} · {:.0}% {}</text></g>"##,
                c.capacity,
                share * 100.0,
                if c.send_blocked_fraction >= c.recv_blocked_fraction { "send-blocked" } else { "recv-blocked" }
            );
        }
    }
    let bottleneck = report.verdict.bottleneck.as_deref();
    for name in &report.run.stage_order {
        let (Some(s), Some(&p)) = (report.stages.get(name), at.get(name.as_str())) else { continue };
        let (x, y) = grid.corner(p);
        let fill = heat(s.busy_fraction);
        let ink = if s.busy_fraction > 0.6 { "#fff" } else { "#111" };
        let is_bottleneck = bottleneck == Some(name.as_str());
        let (stroke, stroke_width) = match s.state.as_str() {
            "finished" if is_bottleneck => ("#111", 3.0),
            "finished" => ("#555", 1.0),
            _ => ("#b00", 3.0),
        };
        let _ = writeln!(
            o,
            r#"<g class="stage"><title>{}: {}/{}, busy {:.1}%, service p50 {:.1} µs, p99 {:.1} µs, {:.1} items/s, {}</title>"#,
            escape(name),
            escape(&s.kind),
            escape(&s.imp),
            s.busy_fraction * 100.0,
            s.service_us.p50,
            s.service_us.p99,
            s.throughput_per_s,
            escape(&s.state)
        );
        let _ = writeln!(
            o,
            r#"<rect x="{x:.1}" y="{y:.1}" width="{:.0}" height="{:.0}" rx="7" fill="{}" stroke="{stroke}" stroke-width="{stroke_width}"/>"#,
            BOX.0,
            BOX.1,
            rgb(fill)
        );
        let cx = x + BOX.0 / 2.0;
        let _ = writeln!(
            o,
            r#"<text x="{cx:.1}" y="{:.1}" font-size="14" font-weight="bold" text-anchor="middle" fill="{ink}">{}</text>"#,
            y + 20.0,
            escape(name)
        );
        let _ = writeln!(
            o,
            r#"<text x="{cx:.1}" y="{:.1}" font-size="11" text-anchor="middle" fill="{ink}">{}/{}</text>"#,
            y + 37.0,
            escape(&s.kind),
            escape(&s.imp)
        );
        let mut third = format!("busy {:.0}%", s.busy_fraction * 100.0);
        if is_bottleneck {
            third.push_str(" · bottleneck");
        }
        if s.state != "finished" {
            let _ = write!(third, " · {}", s.state);
        }
        let _ = writeln!(
            o,
            r#"<text x="{cx:.1}" y="{:.1}" font-size="12" text-anchor="middle" fill="{ink}">{}</text></g>"#,
            y + 55.0,
            escape(&third)
        );
    }
    legend(&mut o, MARGIN, height - LEGEND + 8.0);
    o.push_str("</svg>\n");
    o
}

/// The colour scale under the graph: busy share of a box, blocked share of an arrow.
fn legend(o: &mut String, x: f64, y: f64) {
    let _ = writeln!(
        o,
        "<defs><linearGradient id=\"busy-scale\"><stop offset=\"0\" stop-color=\"{}\"/><stop offset=\"1\" stop-color=\"{}\"/></linearGradient>\
         <linearGradient id=\"wait-scale\"><stop offset=\"0\" stop-color=\"{}\"/><stop offset=\"1\" stop-color=\"{}\"/></linearGradient></defs>",
        rgb(heat(0.0)),
        rgb(heat(1.0)),
        rgb(wait_colour(0.0)),
        rgb(wait_colour(1.0))
    );
    let _ =
        writeln!(o, r##"<rect x="{x:.1}" y="{y:.1}" width="90" height="12" fill="url(#busy-scale)" stroke="#555" stroke-width="0.5"/>"##);
    let _ = writeln!(
        o,
        r#"<text x="{:.1}" y="{:.1}" font-size="11">stage: busy share 0 → 100% (thick black border: the bottleneck)</text>"#,
        x + 98.0,
        y + 10.0
    );
    let _ = writeln!(o, r##"<rect x="{x:.1}" y="{:.1}" width="90" height="5" fill="url(#wait-scale)"/>"##, y + 22.0);
    let _ = writeln!(
        o,
        r#"<text x="{:.1}" y="{:.1}" font-size="11">channel: blocked share, sending or receiving, 0 → 100%</text>"#,
        x + 98.0,
        y + 28.0
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colour_scales_run_from_white_and_grey_to_red() {
        assert_eq!(rgb(heat(0.0)), "#ffffff");
        assert_eq!(rgb(heat(1.0)), "#d62728");
        assert_eq!(rgb(heat(7.0)), "#d62728");
        assert_eq!(rgb(wait_colour(0.0)), "#a0a0a0");
    }
}
