//! The timeline picture (`candle_fsdp::timeline`): SVG content, PNG header, errors.

use std::path::PathBuf;

use candle_fsdp::timeline::{
    render_timeline, render_timeline_to_svg_string, span_color, timeline_dimensions, TIMELINE_WIDTH,
};
use candle_fsdp::trace::{Lane, Span, SpanKind};
use candle_fsdp::Error;

fn span(rank: usize, lane: Lane, kind: SpanKind, name: &str, start_ms: f64, dur_ms: f64) -> Span {
    Span {
        rank,
        lane,
        kind,
        name: name.to_string(),
        step: 0,
        start_us: start_ms * 1000.0,
        dur_us: dur_ms * 1000.0,
    }
}

/// Two ranks, one step of a 2-unit model: forward, backward, gathers, reduce-scatters, a wait,
/// issue markers, the optimizer step.
fn synthetic() -> Vec<Span> {
    let ag = Lane::comm("all_gather");
    let rs = Lane::comm("reduce_scatter");
    let c = Lane::Compute;
    let mut spans = Vec::new();
    for r in 0..2 {
        let o = r as f64 * 0.05;
        spans.extend([
            span(r, c, SpanKind::Issue, "FSDP::issue all_gather l0", o, 0.0),
            span(r, ag, SpanKind::AllGather, "all_gather #1", o + 0.1, 0.8),
            span(
                r,
                c,
                SpanKind::Wait,
                "FSDP::wait all_gather l0",
                o + 0.1,
                0.8,
            ),
            span(
                r,
                c,
                SpanKind::Issue,
                "FSDP::issue all_gather l1",
                o + 0.9,
                0.0,
            ),
            span(r, ag, SpanKind::AllGather, "all_gather #2", o + 0.95, 0.7),
            span(r, c, SpanKind::Forward, "FSDP::forward l0", o + 0.9, 1.5),
            span(r, c, SpanKind::Forward, "FSDP::forward l1", o + 2.4, 1.5),
            span(r, c, SpanKind::Backward, "FSDP::backward l1", o + 4.0, 2.5),
            span(
                r,
                rs,
                SpanKind::ReduceScatter,
                "reduce_scatter #1",
                o + 6.5,
                1.0,
            ),
            span(r, c, SpanKind::Backward, "FSDP::backward l0", o + 6.5, 2.5),
            span(
                r,
                rs,
                SpanKind::ReduceScatter,
                "reduce_scatter #2",
                o + 9.0,
                1.0,
            ),
            span(
                r,
                c,
                SpanKind::Wait,
                "FSDP::wait reduce_scatter l0",
                o + 9.0,
                1.0,
            ),
            span(
                r,
                c,
                SpanKind::OptimizerStep,
                "FSDP::optimizer_step",
                o + 10.0,
                0.7,
            ),
        ]);
    }
    spans
}

fn hex(kind: SpanKind) -> String {
    let (r, g, b) = span_color(kind);
    format!("#{r:02X}{g:02X}{b:02X}")
}

/// The contents of every `<text>` element of `svg`, trimmed, in document order.
fn texts(svg: &str) -> Vec<String> {
    svg.split("<text")
        .skip(1)
        .filter_map(|t| {
            let body = &t[t.find('>')? + 1..];
            Some(body[..body.find("</text>")?].trim().to_string())
        })
        .collect()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("candle-fsdp-timeline-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn svg_has_lane_labels_and_one_rect_per_span() {
    let spans = synthetic();
    let svg = render_timeline_to_svg_string(&spans).unwrap();
    assert!(svg.starts_with("<svg"), "{}", &svg[..100.min(svg.len())]);
    let texts = texts(&svg);
    let has = |t: &str| texts.iter().any(|x| x == t);
    for label in [
        "rank 0 compute",
        "rank 0 all_gather",
        "rank 0 reduce_scatter",
        "rank 1 compute",
        "rank 1 all_gather",
        "rank 1 reduce_scatter",
    ] {
        assert!(has(label), "no lane label {label:?} in {texts:?}");
    }
    assert!(!has("rank 0 collective"), "a row for a lane with no span");
    assert!(has("time (ms)"), "{texts:?}");
    assert!(
        texts.iter().any(|t| t.contains("mean overlap")),
        "title without the overlap summary: {texts:?}"
    );
    // Lanes are ordered rank by rank, compute first.
    let pos = |l: &str| texts.iter().position(|x| x == l).unwrap();
    assert!(pos("rank 0 compute") < pos("rank 0 all_gather"));
    assert!(pos("rank 0 reduce_scatter") < pos("rank 1 compute"));

    // Each span of a filled kind is one rectangle in its kind's colour, plus one legend swatch
    // per kind present; issue markers are ticks (polylines) in the issue colour.
    let tags = |name: &str, attr: String| {
        svg.match_indices(name)
            .filter(|(i, _)| {
                let tag = &svg[*i..*i + svg[*i..].find("/>").unwrap()];
                tag.contains(&attr)
            })
            .count()
    };
    for kind in [
        SpanKind::Forward,
        SpanKind::Backward,
        SpanKind::AllGather,
        SpanKind::ReduceScatter,
        SpanKind::OptimizerStep,
        SpanKind::Wait,
    ] {
        let n = spans.iter().filter(|s| s.kind == kind).count();
        let rects = tags("<rect", format!("fill=\"{}\"", hex(kind)));
        assert_eq!(rects, n + 1, "{kind:?}: {n} spans + 1 legend swatch");
    }
    let issues = spans.iter().filter(|s| s.kind == SpanKind::Issue).count();
    let ticks = tags("<polyline", format!("stroke=\"{}\"", hex(SpanKind::Issue)));
    assert_eq!(ticks, issues + 1, "issue ticks + 1 legend tick");
    // No collective span: no collective colour anywhere, and no legend entry for it.
    assert!(!svg.contains(&hex(SpanKind::Collective)));
    assert!(!has("collective"));
    for entry in [
        "forward",
        "backward",
        "optimizer step",
        "all-gather",
        "reduce-scatter",
        "wait (exposed comm)",
        "issue",
    ] {
        assert!(has(entry), "legend lacks {entry:?}");
    }
}

#[test]
fn svg_file_and_png_file_are_written() {
    let spans = synthetic();
    let (w, h) = timeline_dimensions(&spans);
    assert_eq!(w, TIMELINE_WIDTH);

    let svg_path = scratch("t.svg");
    render_timeline(&spans, &svg_path).unwrap();
    let svg = std::fs::read_to_string(&svg_path).unwrap();
    assert!(svg.contains(&format!("width=\"{w}\"")) && svg.contains(&format!("height=\"{h}\"")));

    let png_path = scratch("t.PNG");
    render_timeline(&spans, &png_path).unwrap();
    let png = std::fs::read(&png_path).unwrap();
    assert!(png.len() > 1000, "PNG of {} bytes", png.len());
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
    assert_eq!(&png[12..16], b"IHDR");
    let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    assert_eq!((be(&png[16..20]), be(&png[20..24])), (w, h));
    std::fs::remove_file(&svg_path).ok();
    std::fs::remove_file(&png_path).ok();
}

#[test]
fn height_grows_with_rows() {
    let spans = synthetic();
    let one: Vec<Span> = spans.iter().filter(|s| s.rank == 0).cloned().collect();
    let (_, h_all) = timeline_dimensions(&spans);
    let (_, h_one) = timeline_dimensions(&one);
    assert!(h_all > h_one, "6 rows {h_all} px vs 3 rows {h_one} px");
}

#[test]
fn bad_extension_and_empty_spans_are_clear_errors() {
    let spans = synthetic();
    for name in ["timeline.jpg", "timeline"] {
        let path = scratch(name);
        match render_timeline(&spans, &path) {
            Err(e @ Error::Value { .. }) => {
                let m = e.to_string();
                assert!(m.contains(&path.display().to_string()), "{m}");
                assert!(m.contains(".png") && m.contains(".svg"), "{m}");
            }
            other => panic!("expected Error::Value, got {other:?}"),
        }
        assert!(!path.exists());
    }
    match render_timeline(&[], &scratch("empty.png")) {
        Err(e @ Error::Missing { .. }) => assert!(e.to_string().contains("no spans"), "{e}"),
        other => panic!("expected Error::Missing, got {other:?}"),
    }
    match render_timeline_to_svg_string(&[]) {
        Err(e @ Error::Missing { .. }) => assert!(e.to_string().contains("no spans"), "{e}"),
        other => panic!("expected Error::Missing, got {other:?}"),
    }
}

#[test]
fn zero_length_spans_render() {
    // A single instant: the x axis still has a positive extent.
    let spans = vec![span(
        0,
        Lane::Compute,
        SpanKind::Issue,
        "FSDP::issue",
        3.0,
        0.0,
    )];
    let svg = render_timeline_to_svg_string(&spans).unwrap();
    assert!(texts(&svg).iter().any(|t| t == "rank 0 compute"));
}
