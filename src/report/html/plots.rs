//! The HTML report's charts, drawn by plotters' SVG backend as inline `<svg>` text: latency
//! percentile plots (a log "nines" axis of percentiles against log-scale µs, from the
//! hdrhistogram quantiles every [`Summary`] carries) and line charts of a value against steps or
//! seconds (losses, step times, channel occupancy). Each chart's legend is HTML under its SVG.

use anyhow::anyhow;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use super::escape;
use crate::runtime::metrics::Summary;

/// A chart's size in pixels (the page scales it to its box; the viewBox keeps the proportions).
pub const SIZE: (u32, u32) = (560, 300);

/// The colours of successive series (Tableau 10: distinct, readable on white).
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// The colour of the `i`-th series.
pub fn colour(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// The percentiles labelled on a percentile plot's axis (the quantiles run from 0.5% to 99.5%).
const PERCENTILE_TICKS: [f64; 5] = [0.0, 50.0, 90.0, 99.0, 99.5];

/// Where percentile `p` (0..100) sits on the "nines" axis: `-log10(1 - p/100)`, so 90%, 99%
/// and 99.9% are equally far apart and the tail gets as much room as the body.
fn nines(p: f64) -> f64 {
    -(1.0 - p / 100.0).max(1e-9).log10()
}

/// A duration in µs as a short axis label: µs below a millisecond, then ms, then s.
pub fn fmt_us(v: f64) -> String {
    let (x, unit) = if v >= 1e6 {
        (v / 1e6, "s")
    } else if v >= 1e3 {
        (v / 1e3, "ms")
    } else {
        (v, "µs")
    };
    format!("{} {unit}", short(x))
}

/// A number with at most three significant digits and no trailing zeros.
pub fn short(x: f64) -> String {
    if !x.is_finite() {
        return "-".into();
    }
    let digits = if x.abs() >= 100.0 {
        0
    } else if x.abs() >= 10.0 {
        1
    } else if x.abs() >= 1.0 {
        2
    } else {
        3
    };
    let s = format!("{x:.digits$}");
    if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_string() } else { s }
}

/// One line of a chart.
#[derive(Clone, Debug)]
pub struct Line {
    /// Its name in the legend.
    pub label: String,
    /// Its points, `(x, y)`, in order of x.
    pub points: Vec<(f64, f64)>,
    /// Drawn dashed (a bound such as a channel's capacity) rather than solid.
    pub dashed: bool,
    /// Marks on its points, for sparse series (validations).
    pub marks: bool,
}

impl Line {
    /// A solid line.
    pub fn solid(label: impl Into<String>, points: Vec<(f64, f64)>) -> Line {
        Line { label: label.into(), points, dashed: false, marks: false }
    }
}

/// How a line chart's y axis is scaled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum YAxis {
    /// Linear from 0.
    FromZero,
    /// Linear over the data's span.
    Span,
    /// Logarithmic over the data's span.
    Log,
}

/// What a chart shows: its title and the names of its axes.
pub struct Frame<'a> {
    /// Above the plot.
    pub title: &'a str,
    /// Under the x axis.
    pub x: &'a str,
    /// Beside the y axis.
    pub y: &'a str,
}

/// A percentile plot of latency histograms, one line per `(label, summary)`: x the percentile
/// on a "nines" axis, y the value in µs on a log scale, and its legend under it. A summary
/// without events, or whose every value is 0 (a wait that never happened), is not drawn and its
/// legend entry says so; other values of 0 are drawn at the floor of the axis. `Ok(None)` when
/// nothing is left to draw (the caller says so in words).
pub fn percentiles(title: &str, series: &[(String, &Summary)], size: (u32, u32)) -> anyhow::Result<Option<String>> {
    let positive = |s: &Summary| s.quantiles.iter().copied().filter(|v| v.is_finite() && *v > 0.0).collect::<Vec<f64>>();
    let values: Vec<f64> = series.iter().filter(|(_, s)| s.count > 0).flat_map(|(_, s)| positive(s)).collect();
    let Some(lowest) = values.iter().copied().min_by(f64::total_cmp) else { return Ok(None) };
    let highest = values.iter().copied().max_by(f64::total_cmp).unwrap_or(lowest);
    let (lo, hi) = log_span(lowest, highest);
    // A series not drawn keeps its place (and so every other series its colour).
    let lines: Vec<Line> = series
        .iter()
        .map(|(label, s)| {
            let n = s.quantiles.len() as f64;
            if s.count == 0 || n == 0.0 {
                return Line::solid(format!("{label}: no events"), Vec::new());
            }
            if positive(s).is_empty() {
                return Line::solid(format!("{label}: 0 throughout"), Vec::new());
            }
            let points = s.quantiles.iter().enumerate().map(|(k, v)| (nines((k as f64 + 0.5) / n * 100.0), v.max(lo))).collect();
            Line::solid(label.clone(), points)
        })
        .collect();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
        let ticks: Vec<f64> = PERCENTILE_TICKS.iter().map(|&p| nines(p)).collect();
        let x_max = nines(99.6);
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(66)
            .build_cartesian_2d(Ticked::<RangedCoordf64> { inner: (0.0..x_max).into(), ticks }, log_axis(lo, hi))
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .configure_mesh()
            .x_desc("percentile (log nines)")
            .y_desc("µs (log)")
            .x_label_formatter(&|x| {
                let p = (1.0 - 10f64.powf(-x)) * 100.0;
                format!("{}%", short((p * 10.0).round() / 10.0))
            })
            .y_label_formatter(&|y| fmt_us(*y))
            .label_style(("sans-serif", 13))
            .light_line_style(RGBColor(238, 238, 238))
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        draw_lines(&mut chart, &lines)?;
    }
    Ok(Some(with_legend(svg, &lines)))
}

/// A line chart of `lines` (each `(x, y)` points) against a linear x axis, and its legend under
/// it. Non-finite points are left out (on a log axis, non-positive ones too); `Ok(None)` when no
/// point is left.
pub fn lines(frame: &Frame, lines: &[Line], y_axis: YAxis, size: (u32, u32)) -> anyhow::Result<Option<String>> {
    let keep = |&(x, y): &(f64, f64)| x.is_finite() && y.is_finite() && (y_axis != YAxis::Log || y > 0.0);
    let lines: Vec<Line> = lines.iter().map(|l| Line { points: l.points.iter().copied().filter(keep).collect(), ..l.clone() }).collect();
    let all = || lines.iter().flat_map(|l| l.points.iter().copied());
    if all().next().is_none() {
        return Ok(None);
    }
    let (x_lo, x_hi) = span(all().map(|p| p.0), false);
    let x_digits = digits_for(x_hi - x_lo);
    let x_fmt = move |x: &f64| format!("{x:.x_digits$}");
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
        let mut builder = ChartBuilder::on(&root);
        builder.caption(frame.title, ("sans-serif", 16)).margin(10).x_label_area_size(36).y_label_area_size(66);
        if y_axis == YAxis::Log {
            let ys = || all().map(|p| p.1);
            let (lo, hi) = log_span(ys().fold(f64::INFINITY, f64::min), ys().fold(0.0, f64::max));
            let mut chart = builder.build_cartesian_2d(x_lo..x_hi, log_axis(lo, hi)).map_err(|e| anyhow!("{e}"))?;
            chart
                .configure_mesh()
                .x_desc(frame.x)
                .y_desc(frame.y)
                .x_label_formatter(&x_fmt)
                .y_label_formatter(&|y| short(*y))
                .label_style(("sans-serif", 13))
                .light_line_style(RGBColor(238, 238, 238))
                .draw()
                .map_err(|e| anyhow!("{e}"))?;
            draw_lines(&mut chart, &lines)?;
        } else {
            let (y_lo, y_hi) = span(all().map(|p| p.1), y_axis == YAxis::FromZero);
            let y_digits = digits_for(y_hi - y_lo);
            let mut chart = builder.build_cartesian_2d(x_lo..x_hi, y_lo..y_hi).map_err(|e| anyhow!("{e}"))?;
            chart
                .configure_mesh()
                .x_desc(frame.x)
                .y_desc(frame.y)
                .x_label_formatter(&x_fmt)
                .y_label_formatter(&|y| format!("{y:.y_digits$}"))
                .label_style(("sans-serif", 13))
                .light_line_style(RGBColor(238, 238, 238))
                .draw()
                .map_err(|e| anyhow!("{e}"))?;
            draw_lines(&mut chart, &lines)?;
        }
    }
    Ok(Some(with_legend(svg, &lines)))
}

/// Decimals that tell apart the ticks of an axis spanning `span` (about ten ticks).
fn digits_for(span: f64) -> usize {
    if !(span.is_finite() && span > 0.0) {
        return 0;
    }
    (-(span / 10.0).log10().floor()).clamp(0.0, 6.0) as usize
}

/// `svg` with the legend of `lines` under it, as HTML (it never covers the data, and long
/// names wrap): a swatch in each drawn line's colour, dashed for a dashed line; a line with no
/// points is listed without a swatch. None for a lone line: the chart's title names it.
fn with_legend(svg: String, lines: &[Line]) -> String {
    if lines.len() == 1 && !lines[0].points.is_empty() {
        return svg;
    }
    let mut o = svg;
    o.push_str("<div class=\"legend\">");
    for (i, l) in lines.iter().enumerate() {
        let RGBColor(r, g, b) = colour(i);
        if l.points.is_empty() {
            o.push_str(&format!("<span class=\"off\">{}</span>", escape(&l.label)));
        } else if l.dashed {
            o.push_str(&format!("<span><i class=\"dash\" style=\"border-color:rgb({r},{g},{b})\"></i>{}</span>", escape(&l.label)));
        } else {
            o.push_str(&format!("<span><i style=\"background:rgb({r},{g},{b})\"></i>{}</span>", escape(&l.label)));
        }
    }
    o.push_str("</div>");
    o
}

/// Draws `lines` on `chart`, each in its palette colour (a line with no points keeps its colour
/// unused, so the others keep theirs).
fn draw_lines<'a, X, Y>(chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>, lines: &[Line]) -> anyhow::Result<()>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    for (i, l) in lines.iter().enumerate() {
        if l.points.is_empty() {
            continue;
        }
        let c = colour(i);
        let style = c.stroke_width(2);
        if l.dashed {
            chart.draw_series(DashedLineSeries::new(l.points.iter().copied(), 6, 4, style)).map_err(|e| anyhow!("{e}"))?;
        } else {
            chart.draw_series(LineSeries::new(l.points.iter().copied(), style)).map_err(|e| anyhow!("{e}"))?;
        }
        if l.marks {
            chart.draw_series(l.points.iter().map(|&p| Circle::new(p, 3, c.filled()))).map_err(|e| anyhow!("{e}"))?;
        }
    }
    Ok(())
}

/// An f64 axis (linear or log) with its ticks and grid lines at given values only: plotters'
/// `WithKeyPoints` has no default label formatting on f64, which the mesh needs, and its log
/// axis labels a span of less than a decade with one tick or none.
struct Ticked<R> {
    inner: R,
    ticks: Vec<f64>,
}

impl<R: Ranged<ValueType = f64>> Ranged for Ticked<R> {
    type FormatOption = plotters::coord::ranged1d::DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        self.inner.map(value, limit)
    }

    fn key_points<Hint: plotters::coord::ranged1d::KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        if hint.weight().allow_light_points() { Vec::new() } else { self.ticks.clone() }
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.inner.range()
    }
}

/// A log axis from `lo` to `hi` (both > 0) with readable ticks: powers of ten over a wide span,
/// 1-2-5 steps (or finer) over a narrow one, at least four where the span allows.
fn log_axis(lo: f64, hi: f64) -> Ticked<LogCoord<f64>> {
    // Mantissas in tenths, so that every tick is a whole number over a power of ten (exact).
    const STEPS: [&[u32]; 5] =
        [&[10], &[10, 30], &[10, 20, 50], &[10, 15, 20, 30, 50, 70], &[10, 12, 15, 20, 25, 30, 40, 50, 60, 70, 80, 90]];
    let within = |steps: &[u32]| -> Vec<f64> {
        let first = lo.log10().floor() as i32 - 1;
        let last = hi.log10().ceil() as i32 - 1;
        (first..=last)
            .flat_map(|e| steps.iter().map(move |&m| if e >= 0 { m as f64 * 10f64.powi(e) } else { m as f64 / 10f64.powi(-e) }))
            .filter(|t| *t >= lo && *t <= hi)
            .collect()
    };
    let ticks = STEPS.iter().map(|s| within(s)).find(|t| t.len() >= 4).unwrap_or_else(|| within(STEPS[STEPS.len() - 1]));
    Ticked { inner: (lo..hi).log_scale().into(), ticks }
}

/// A linear axis's range over `xs`, widened a little (and from 0 when `from_zero`); never empty.
fn span(xs: impl Iterator<Item = f64>, from_zero: bool) -> (f64, f64) {
    let (mut lo, hi) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| (a.min(x), b.max(x)));
    if from_zero {
        lo = lo.min(0.0);
    }
    if hi - lo <= f64::EPSILON * hi.abs().max(1.0) {
        let pad = if hi == 0.0 { 1.0 } else { hi.abs() * 0.1 };
        return (lo - pad, hi + pad);
    }
    let pad = (hi - lo) * 0.04;
    (if from_zero && lo >= 0.0 { lo } else { lo - pad }, hi + pad)
}

/// A log axis's range from `lowest` to `highest` (both > 0), widened to whole decades' halves
/// so that the ends are visible; never empty.
fn log_span(lowest: f64, highest: f64) -> (f64, f64) {
    let lo = (lowest * 0.7).max(1e-6);
    let hi = (highest * 1.4).max(lo * 10.0);
    (lo, hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(values: impl Fn(f64) -> f64) -> Summary {
        let quantiles: Vec<f64> = (0..100).map(|k| values((k as f64 + 0.5) / 100.0)).collect();
        Summary { count: 1000, mean: 1.0, p50: quantiles[50], p90: quantiles[90], p99: quantiles[99], max: 1e4, total_ms: 1.0, quantiles }
    }

    #[test]
    fn nines_axis_spaces_the_tail_evenly() {
        assert!((nines(90.0) - 1.0).abs() < 1e-12);
        assert!((nines(99.0) - 2.0).abs() < 1e-12);
        assert_eq!(nines(0.0), 0.0);
    }

    #[test]
    fn numbers_and_durations_read_short() {
        assert_eq!(short(1234.0), "1234");
        assert_eq!(short(12.34), "12.3");
        assert_eq!(short(2.0), "2");
        assert_eq!(short(0.1234), "0.123");
        assert_eq!(fmt_us(250.0), "250 µs");
        assert_eq!(fmt_us(2500.0), "2.5 ms");
        assert_eq!(fmt_us(3.2e6), "3.2 s");
    }

    /// A percentile plot is one closed SVG with its title, and a legend naming every series
    /// (an all-zero one as such); empty and all-zero histograms give no plot.
    #[test]
    fn percentile_plot_of_histograms() {
        let (a, b) = (summary(|q| 100.0 + 1000.0 * q * q), summary(|q| if q < 0.5 { 0.0 } else { 50.0 * q }));
        let zeros = summary(|_| 0.0);
        let series = [("send".to_string(), &a), ("recv".to_string(), &b), ("never".to_string(), &zeros)];
        let html = percentiles("service <time>", &series, SIZE).unwrap().unwrap();
        assert!(html.starts_with("<svg") && html.contains("</svg>\n<div class=\"legend\">"), "{html}");
        assert!(html.contains("service &lt;time&gt;") && html.contains("</i>send</span>") && html.contains("</i>recv</span>"), "{html}");
        assert!(html.contains("<span class=\"off\">never: 0 throughout</span>"), "{html}");
        assert!(html.contains("99%") && html.contains("µs"), "{html}");
        let empty = Summary::default();
        assert!(percentiles("x", &[("e".into(), &empty)], SIZE).unwrap().is_none());
        assert!(percentiles("x", &[("z".into(), &zeros)], SIZE).unwrap().is_none());
    }

    #[test]
    fn line_chart_skips_what_it_cannot_draw() {
        let frame = Frame { title: "loss", x: "step", y: "nats" };
        let l = Line::solid("train", vec![(1.0, 5.0), (2.0, f64::NAN), (3.0, 4.0)]);
        let cap = Line { dashed: true, ..Line::solid("cap", vec![(1.0, 6.0), (3.0, 6.0)]) };
        let html = lines(&frame, &[l.clone(), cap], YAxis::Span, SIZE).unwrap().unwrap();
        assert!(html.contains("</i>train</span>") && html.contains("class=\"dash\""), "{html}");
        assert!(lines(&frame, &[Line::solid("none", vec![(1.0, f64::NAN)])], YAxis::FromZero, SIZE).unwrap().is_none());
        assert!(lines(&frame, &[Line::solid("neg", vec![(1.0, 0.0)])], YAxis::Log, SIZE).unwrap().is_none());
        let single = lines(&frame, &[l], YAxis::Log, SIZE).unwrap().unwrap();
        assert!(!single.contains("legend"), "one line needs no legend");
    }

    #[test]
    fn log_ticks_fit_the_span() {
        assert_eq!(log_axis(0.5, 2000.0).ticks, [1.0, 10.0, 100.0, 1000.0]);
        assert_eq!(log_axis(7.0, 17.0).ticks, [7.0, 8.0, 9.0, 10.0, 12.0, 15.0]);
        assert_eq!(log_axis(80.0, 700.0).ticks, [100.0, 150.0, 200.0, 300.0, 500.0, 700.0]);
    }

    #[test]
    fn axis_decimals_follow_the_span() {
        assert_eq!(digits_for(100.0), 0);
        assert_eq!(digits_for(1.0), 1);
        assert_eq!(digits_for(0.004), 4);
        assert_eq!(digits_for(0.0), 0);
    }
}
