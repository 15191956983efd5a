//! A picture of a traced run: the spans of [`crate::trace`] drawn as a timeline, to PNG or SVG,
//! for people who would rather look than read a Chrome trace. Built with the cargo feature
//! `timeline` (on by default), which brings plotters and the font below.
//!
//! One row per (rank, lane), top to bottom by rank then lane (compute, all-gather,
//! reduce-scatter, collective), labelled `rank R compute`, `rank R all_gather`, …; the x axis is
//! milliseconds since the earliest span. Every span is a rectangle coloured by its
//! [`SpanKind`] (see [`span_color`]): waits of the compute thread on a collective — exposed
//! communication — are red; [`SpanKind::Issue`] markers are thin vertical ticks. A legend of the
//! kinds present sits under the chart, and the title carries the overlap figures of
//! [`crate::trace::overlap_summary`] (mean overlap fraction, exposed communication as a share of
//! step time).
//!
//! Text is drawn with DejaVu Sans, shipped in `assets/` (Bitstream Vera licence, see
//! `assets/DejaVuSans-LICENSE.txt`) and compiled in, so rendering needs no system font library.
//!
//! ```no_run
//! # fn demo(spans: &[candle_fsdp::trace::Span]) -> candle_fsdp::Result<()> {
//! candle_fsdp::timeline::render_timeline(spans, std::path::Path::new("step.png"))?;
//! candle_fsdp::timeline::render_timeline(spans, std::path::Path::new("step.svg"))?;
//! # Ok(()) }
//! ```

use std::path::Path;
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::FontStyle;

use crate::error::{Error, Result};
use crate::trace::{overlap_summary, Span, SpanKind};

/// Width of a rendered timeline, pixels.
pub const TIMELINE_WIDTH: u32 = 1600;

const ROW_PX: u32 = 26;
const TITLE_PX: u32 = 40;
const X_LABEL_PX: u32 = 45;
const LEGEND_PX: u32 = 36;
const MARGIN_PX: u32 = 12;
const LABEL_AREA_PX: u32 = 190;
const FONT: &str = "sans-serif";

static DEJAVU_SANS: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");
static FONT_INIT: Once = Once::new();

/// Registers the bundled font under the family name the chart uses (once per process).
fn ensure_font() {
    FONT_INIT.call_once(|| {
        // The bundled file is a valid TrueType font; a failure would only leave text undrawn.
        let _ = plotters::style::register_font(FONT, FontStyle::Normal, DEJAVU_SANS);
    });
}

/// Kinds in legend (and drawing) order.
const KINDS: [SpanKind; 8] = [
    SpanKind::Forward,
    SpanKind::Backward,
    SpanKind::OptimizerStep,
    SpanKind::AllGather,
    SpanKind::ReduceScatter,
    SpanKind::Collective,
    SpanKind::Wait,
    SpanKind::Issue,
];

/// The RGB colour a span of `kind` is drawn with (also its legend swatch): forward blue,
/// backward green, optimizer step brown, all-gather orange, reduce-scatter purple, other
/// collectives grey, waits (exposed communication) red, issue markers dark navy.
pub fn span_color(kind: SpanKind) -> (u8, u8, u8) {
    match kind {
        SpanKind::Forward => (0x1F, 0x77, 0xB4),
        SpanKind::Backward => (0x2C, 0xA0, 0x2C),
        SpanKind::OptimizerStep => (0x8C, 0x56, 0x4B),
        SpanKind::AllGather => (0xFF, 0x7F, 0x0E),
        SpanKind::ReduceScatter => (0x94, 0x67, 0xBD),
        SpanKind::Collective => (0x7F, 0x7F, 0x7F),
        SpanKind::Wait => (0xD6, 0x27, 0x28),
        SpanKind::Issue => (0x17, 0x17, 0x5A),
    }
}

fn legend_name(kind: SpanKind) -> &'static str {
    match kind {
        SpanKind::Forward => "forward",
        SpanKind::Backward => "backward",
        SpanKind::OptimizerStep => "optimizer step",
        SpanKind::AllGather => "all-gather",
        SpanKind::ReduceScatter => "reduce-scatter",
        SpanKind::Collective => "collective",
        SpanKind::Wait => "wait (exposed comm)",
        SpanKind::Issue => "issue",
    }
}

fn rgb(kind: SpanKind) -> RGBColor {
    let (r, g, b) = span_color(kind);
    RGBColor(r, g, b)
}

/// Rows of the timeline, top to bottom: distinct (rank, lane tid), with their labels.
fn rows(spans: &[Span]) -> Vec<((usize, u32), String)> {
    let mut keys: Vec<(usize, u32, &'static str)> = spans
        .iter()
        .map(|s| (s.rank, s.lane.tid(), s.lane.name()))
        .collect();
    keys.sort_unstable();
    keys.dedup();
    keys.into_iter()
        .map(|(rank, tid, name)| ((rank, tid), format!("rank {rank} {name}")))
        .collect()
}

/// Size in pixels (width, height) of the picture [`render_timeline`] draws for `spans`: width
/// [`TIMELINE_WIDTH`], height growing with the number of (rank, lane) rows.
pub fn timeline_dimensions(spans: &[Span]) -> (u32, u32) {
    let n = rows(spans).len().max(1) as u32;
    (
        TIMELINE_WIDTH,
        TITLE_PX + n * ROW_PX + X_LABEL_PX + LEGEND_PX + 3 * MARGIN_PX,
    )
}

/// Title text: what is shown and the mean overlap figures.
fn title(spans: &[Span]) -> String {
    let summaries = overlap_summary(spans);
    let n = summaries.len().max(1) as f64;
    let mean_overlap = summaries.iter().map(|s| s.overlap_fraction).sum::<f64>() / n;
    let step_s: f64 = summaries.iter().map(|s| s.step_s).sum();
    let exposed_s: f64 = summaries.iter().map(|s| s.exposed_s).sum();
    let exposed = if step_s > 0.0 {
        exposed_s / step_s
    } else {
        0.0
    };
    let (s0, s1) = spans
        .iter()
        .fold((u64::MAX, 0), |(a, b), s| (a.min(s.step), b.max(s.step)));
    let steps = if s0 == s1 {
        format!("step {s0}")
    } else {
        format!("steps {s0}-{s1}")
    };
    let ranks = spans.iter().map(|s| s.rank).max().unwrap_or(0) + 1;
    format!(
        "FSDP timeline, {steps}, {ranks} rank{}: mean overlap {:.1} %, exposed communication {:.1} % of step time",
        if ranks == 1 { "" } else { "s" },
        100.0 * mean_overlap,
        100.0 * exposed
    )
}

fn draw_error(e: impl std::fmt::Display) -> String {
    format!("cannot draw the timeline: {e}")
}

/// Draws the whole picture onto `root` (any plotters backend).
fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    spans: &[Span],
) -> std::result::Result<(), String> {
    let rows = rows(spans);
    let n = rows.len() as f64;
    let row_of = |s: &Span| {
        rows.iter()
            .position(|(k, _)| *k == (s.rank, s.lane.tid()))
            .expect("every span has a row")
    };
    // Row 0 is drawn at the top: it covers y in [n - 1, n].
    let band = |row: usize| (n - 1.0 - row as f64, n - row as f64);

    let t0 = spans
        .iter()
        .map(|s| s.start_us)
        .fold(f64::INFINITY, f64::min);
    let t1 = spans
        .iter()
        .map(|s| s.start_us + s.dur_us.max(0.0))
        .fold(f64::NEG_INFINITY, f64::max);
    let ms = |us: f64| (us - t0) / 1000.0;
    let x_max = (ms(t1) * 1.01).max(1e-3);

    root.fill(&WHITE).map_err(draw_error)?;
    let (_, h) = root.dim_in_pixel();
    let (chart_area, legend_area) = root.split_vertically(h - LEGEND_PX - MARGIN_PX);

    let mut chart = ChartBuilder::on(&chart_area)
        .caption(title(spans), (FONT, 18))
        .margin(MARGIN_PX)
        .x_label_area_size(X_LABEL_PX)
        .y_label_area_size(LABEL_AREA_PX)
        .build_cartesian_2d(0f64..x_max, 0f64..n)
        .map_err(draw_error)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(0)
        .y_label_formatter(&|_| String::new())
        .x_desc("time (ms)")
        .x_label_style((FONT, 13))
        .axis_desc_style((FONT, 14))
        .light_line_style(WHITE.mix(0.0))
        .bold_line_style(BLACK.mix(0.12))
        .draw()
        .map_err(draw_error)?;

    // Row labels, right-aligned in the label area, and faint row separators.
    let label_style =
        TextStyle::from((FONT, 13).into_font()).pos(Pos::new(HPos::Right, VPos::Center));
    for (i, (_, label)) in rows.iter().enumerate() {
        let (lo, hi) = band(i);
        let (px, py) = chart.backend_coord(&(0.0, (lo + hi) / 2.0));
        root.draw(&Text::new(label.clone(), (px - 8, py), label_style.clone()))
            .map_err(draw_error)?;
    }
    chart
        .draw_series((1..rows.len()).map(|i| {
            let y = band(i).1;
            PathElement::new(vec![(0.0, y), (x_max, y)], BLACK.mix(0.08))
        }))
        .map_err(draw_error)?;

    // Spans: kind by kind (waits over everything else, issue ticks last).
    for kind in KINDS {
        let color = rgb(kind);
        let of_kind = spans.iter().filter(|s| s.kind == kind);
        if kind == SpanKind::Issue {
            chart
                .draw_series(of_kind.map(|s| {
                    let (lo, hi) = band(row_of(s));
                    let x = ms(s.start_us);
                    PathElement::new(vec![(x, lo + 0.08), (x, hi - 0.08)], color.stroke_width(1))
                }))
                .map_err(draw_error)?;
        } else {
            // A filled rectangle with a darker outline, so that back-to-back spans of one kind
            // (consecutive units) stay apart and very short spans still show.
            let (r, g, b) = span_color(kind);
            let dark = |c: u8| (c as f64 * 0.6) as u8;
            let edge = RGBColor(dark(r), dark(g), dark(b)).stroke_width(1);
            let rects: Vec<_> = of_kind
                .map(|s| {
                    let (lo, hi) = band(row_of(s));
                    let x0 = ms(s.start_us);
                    let x1 = ms(s.start_us + s.dur_us.max(0.0));
                    [(x0, lo + 0.15), (x1, hi - 0.15)]
                })
                .collect();
            chart
                .draw_series(rects.iter().map(|c| Rectangle::new(*c, color.filled())))
                .map_err(draw_error)?;
            chart
                .draw_series(rects.iter().map(|c| Rectangle::new(*c, edge)))
                .map_err(draw_error)?;
        }
    }

    // Legend: one swatch per kind present, in a strip under the chart.
    let legend_font =
        TextStyle::from((FONT, 14).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
    let mut x = (MARGIN_PX + LABEL_AREA_PX) as i32;
    let y = (LEGEND_PX / 2) as i32;
    for kind in KINDS
        .into_iter()
        .filter(|k| spans.iter().any(|s| s.kind == *k))
    {
        let color = rgb(kind);
        if kind == SpanKind::Issue {
            legend_area
                .draw(&PathElement::new(
                    vec![(x + 7, y - 8), (x + 7, y + 8)],
                    color.stroke_width(2),
                ))
                .map_err(draw_error)?;
        } else {
            legend_area
                .draw(&Rectangle::new(
                    [(x, y - 7), (x + 14, y + 7)],
                    color.filled(),
                ))
                .map_err(draw_error)?;
        }
        legend_area
            .draw(&Text::new(
                legend_name(kind),
                (x + 20, y),
                legend_font.clone(),
            ))
            .map_err(draw_error)?;
        x += 175;
    }
    root.present().map_err(draw_error)?;
    Ok(())
}

fn check_spans(spans: &[Span]) -> Result<()> {
    if spans.is_empty() {
        return Err(Error::missing(
            "spans to render a timeline of",
            "was a tracer set and enabled while the steps ran?",
        ));
    }
    if let Some(s) = spans
        .iter()
        .find(|s| !s.start_us.is_finite() || !s.dur_us.is_finite())
    {
        return Err(Error::value(
            format!("timeline span {:?} of rank {}", s.name, s.rank),
            "a finite start and duration (µs)",
            format!("start {} µs, duration {} µs", s.start_us, s.dur_us),
        ));
    }
    Ok(())
}

/// Renders the timeline of `spans` as an SVG document and returns it.
///
/// Errors: [`Error::Missing`] when `spans` is empty, [`Error::Value`] when a span has a
/// non-finite time.
pub fn render_timeline_to_svg_string(spans: &[Span]) -> Result<String> {
    check_spans(spans)?;
    ensure_font();
    let mut svg = String::new();
    {
        let root =
            SVGBackend::with_string(&mut svg, timeline_dimensions(spans)).into_drawing_area();
        draw(&root, spans).map_err(Error::InvalidArgument)?;
    }
    Ok(svg)
}

/// Renders the timeline of `spans` (one or more steps, any ranks) to `path`: a PNG when the path
/// ends in `.png`, an SVG when it ends in `.svg` (case-insensitive). The picture is
/// [`timeline_dimensions`] pixels large.
///
/// Errors: [`Error::Missing`] when `spans` is empty; [`Error::Value`] when a span has a
/// non-finite time or the extension is neither; [`Error::Io`] / [`Error::File`] when the file cannot be written.
pub fn render_timeline(spans: &[Span], path: &Path) -> Result<()> {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(|e| e.to_ascii_lowercase());
    match ext.as_deref() {
        Some("svg") => {
            let svg = render_timeline_to_svg_string(spans)?;
            std::fs::write(path, svg).map_err(|e| Error::io(path, e))
        }
        Some("png") => {
            check_spans(spans)?;
            ensure_font();
            let root = BitMapBackend::new(path, timeline_dimensions(spans)).into_drawing_area();
            draw(&root, spans).map_err(|m| Error::file(path, m))
        }
        _ => Err(Error::value(
            format!("the extension of the timeline file {}", path.display()),
            ".png or .svg",
            format!("{ext:?}"),
        )),
    }
}
