//! The three forms `megac schedule` prints a pipeline schedule in: text (one row of action
//! tokens per rank), JSON (tokens, bubble fractions and peaks) and SVG (the simulated
//! timeline as a Gantt chart).
//!
//! The schedules, their simulator and validator live in [`megac_ir::pipeline`];
//! this module only draws what they return. It uses nothing else from the binary, so
//! `tests/schedule_svg.rs` and `tests/schedule_render.rs` include it by path.

use megac_ir::mesh::local_chunk;
use megac_ir::pipeline::{Action, ActionKind, Timeline};

/// One row per rank: `rank 0 | F0 F1 B0 ...`. Chunks are shown (`F1.0` = chunk 1,
/// microbatch 0) when `vpp > 1`; `Send`/`Recv` tokens only when `with_comm`.
pub fn render_text(lists: &[Vec<Action>], vpp: u32, with_comm: bool) -> String {
    let width = lists.len().saturating_sub(1).to_string().len();
    let mut out = String::new();
    for (r, list) in lists.iter().enumerate() {
        let tokens: Vec<String> = list
            .iter()
            .filter(|a| with_comm || a.is_compute())
            .map(|a| a.token(vpp > 1))
            .collect();
        out.push_str(&format!("rank {r:>width$} | {}\n", tokens.join(" ")));
    }
    out
}

/// The `megac schedule --format json` form: `{"bubble_fraction": B, "ranks": [{"rank": r,
/// "actions": [...], "bubble_fraction": b, "peak_inflight": k}, ...]}`, actions as the
/// [`Action::token`] strings (communication included), numbers from `timeline`.
pub fn render_json(lists: &[Vec<Action>], vpp: u32, timeline: &Timeline) -> String {
    let ranks: Vec<String> = lists
        .iter()
        .zip(&timeline.ranks)
        .enumerate()
        .map(|(r, (list, t))| {
            let actions: Vec<String> = list
                .iter()
                .map(|a| format!("\"{}\"", a.token(vpp > 1)))
                .collect();
            format!(
                "{{\"rank\": {r}, \"actions\": [{}], \"bubble_fraction\": {}, \"peak_inflight\": {}}}",
                actions.join(", "),
                json_num(t.bubble_fraction),
                t.peak_inflight
            )
        })
        .collect();
    format!(
        "{{\"bubble_fraction\": {}, \"ranks\": [{}]}}",
        json_num(timeline.bubble_fraction),
        ranks.join(", ")
    )
}

/// A finite JSON number (non-finite values print as 0).
fn json_num(x: f64) -> String {
    if x.is_finite() {
        format!("{x}")
    } else {
        "0".into()
    }
}

/// Base colour (RGB) of a compute kind in [`render_svg`] (Tableau 10: F blue, B orange,
/// W green, BW red).
fn kind_rgb(kind: ActionKind) -> (u8, u8, u8) {
    match kind {
        ActionKind::F => (0x4e, 0x79, 0xa7),
        ActionKind::B => (0xf2, 0x8e, 0x2b),
        ActionKind::W => (0x59, 0xa1, 0x4f),
        _ => (0xe1, 0x57, 0x59),
    }
}

/// The SVG class (and legend name) of a compute kind.
fn kind_name(kind: ActionKind) -> &'static str {
    match kind {
        ActionKind::F => "F",
        ActionKind::B => "B",
        ActionKind::W => "W",
        ActionKind::BW => "BW",
        ActionKind::Send { .. } => "send",
        ActionKind::Recv { .. } => "recv",
    }
}

/// Fill of a compute action: the kind's colour, mixed with white by local chunk
/// (`local / vpp * 0.6`, so chunk 0 is the darkest), and a text colour that reads on it.
fn fill(kind: ActionKind, local_chunk: u32, vpp: u32) -> (String, &'static str) {
    let (r, g, b) = kind_rgb(kind);
    let k = if vpp > 1 {
        0.6 * f64::from(local_chunk.min(vpp - 1)) / f64::from(vpp - 1)
    } else {
        0.0
    };
    let mix = |c: u8| (f64::from(c) + (255.0 - f64::from(c)) * k).round() as u8;
    let (r, g, b) = (mix(r), mix(g), mix(b));
    let luma = 0.299 * f64::from(r) + 0.587 * f64::from(g) + 0.114 * f64::from(b);
    let text = if luma > 150.0 { "#000000" } else { "#ffffff" };
    (format!("#{r:02x}{g:02x}{b:02x}"), text)
}

/// XML text/attribute escaping.
fn xml_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            // Control characters are not allowed in XML 1.0.
            c if (c as u32) < 0x20 && !matches!(c, '\t' | '\n' | '\r') => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// A coordinate or time with at most 2 decimals, trailing zeros dropped (`12`, `3.5`).
fn num(x: f64) -> String {
    let x = if x.is_finite() { x } else { 0.0 };
    let s = format!("{x:.2}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" || s.is_empty() {
        "0".into()
    } else {
        s.to_string()
    }
}

/// A tick step of 1, 2 or 5 times a power of ten giving at most ~10 ticks over `span`.
fn tick_step(span: f64) -> f64 {
    if !(span.is_finite() && span > 0.0) {
        return 1.0;
    }
    let raw = span / 10.0;
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|k| k * p)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * p)
}

/// Width of one character of a box label (10 px sans-serif digits), for [`render_svg`].
const CHAR_PX: f64 = 6.0;

/// A Gantt chart of a simulated schedule as a self-contained SVG document: one lane per
/// pipeline rank (`rank r`, a `<g class="lane">`), one `<rect>` per compute action (class
/// `F`, `B`, `W` or `BW`) from its simulated start to its end with the microbatch id inside
/// (`chunk.microbatch` when `vpp > 1`), idle time white, a time axis with ticks, a legend
/// (kinds, and chunk shading when `vpp > 1`: the lower a rank's local chunk, the darker),
/// and per lane on the right the rank's bubble fraction and peak in-flight microbatches.
///
/// `timeline` must come from simulating `lists` ([`simulate`] or [`simulate_by`]); lanes or
/// actions without a span are left out rather than panicking. The output is a function of
/// the inputs only (same input, same bytes); `title` is escaped.
pub fn render_svg(lists: &[Vec<Action>], vpp: u32, timeline: &Timeline, title: &str) -> String {
    use std::fmt::Write as _;
    let vpp = vpp.max(1);
    let pp = lists.len().max(1) as u32;
    // One lane per rank that has both a list and a timeline.
    let lanes = lists.len().min(timeline.ranks.len());
    // Geometry (px).
    let (left, right_w) = (70.0, 190.0);
    let (top, lane_h, lane_gap) = (58.0, 30.0, 8.0);
    let makespan = if timeline.makespan.is_finite() && timeline.makespan > 0.0 {
        timeline.makespan
    } else {
        1.0
    };
    let label = |a: &Action| {
        if vpp > 1 {
            format!("{}.{}", a.chunk, a.microbatch)
        } else {
            a.microbatch.to_string()
        }
    };
    // Wide enough for every box's label (within 900..=2400 px).
    let label_px = |a: &Action| label(a).len() as f64 * CHAR_PX + 4.0;
    let needed = lists
        .iter()
        .zip(&timeline.ranks)
        .flat_map(|(list, rt)| list.iter().zip(&rt.spans))
        .filter(|(a, (t0, t1))| a.is_compute() && t1 > t0)
        .map(|(a, (t0, t1))| label_px(a) / (t1 - t0))
        .fold(0.0, f64::max);
    let chart_w = (needed * makespan).clamp(900.0, 2400.0);
    let scale = chart_w / makespan;
    let lane_y = |r: usize| top + r as f64 * (lane_h + lane_gap);
    let lanes_bottom = if lanes > 0 {
        lane_y(lanes) - lane_gap
    } else {
        top
    };
    let axis_y = lanes_bottom + 6.0;
    // Legend entries: (kind, local chunk) present in the lists, in a fixed order.
    let kinds = [ActionKind::F, ActionKind::B, ActionKind::W, ActionKind::BW];
    let mut entries: Vec<(ActionKind, u32)> = Vec::new();
    for kind in kinds {
        for lc in 0..vpp {
            let present = lists
                .iter()
                .flatten()
                .any(|a| a.kind == kind && local_chunk(a.chunk, pp) == lc);
            if present {
                entries.push((kind, lc));
            }
        }
    }
    // Legend items (name, fill, stroke), laid out left to right, wrapping at the chart's
    // right edge: 14 px swatch, 5 px gap, the name (~6.2 px a character), 24 px spacing.
    let mut items: Vec<(String, String, &'static str)> = entries
        .iter()
        .map(|&(kind, lc)| {
            let what = match kind {
                ActionKind::F => "forward",
                ActionKind::B => "input-gradient backward",
                ActionKind::W => "weight-gradient backward",
                _ => "full backward",
            };
            let name = if vpp > 1 {
                format!(
                    "{} chunks {}-{}",
                    kind_name(kind),
                    lc * pp,
                    lc * pp + pp - 1
                )
            } else {
                format!("{} {what}", kind_name(kind))
            };
            (name, fill(kind, lc, vpp).0, "#333333")
        })
        .collect();
    items.push(("idle".into(), "#ffffff".into(), "#999999"));
    let legend_y = axis_y + 36.0;
    let mut placed: Vec<(f64, f64)> = Vec::with_capacity(items.len());
    let (mut lx, mut ly) = (left, legend_y);
    for (name, _, _) in &items {
        let w = 19.0 + name.chars().count() as f64 * 6.2 + 24.0;
        if lx > left && lx + w > left + chart_w {
            lx = left;
            ly += 20.0;
        }
        placed.push((lx, ly));
        lx += w;
    }
    let width = left + chart_w + right_w;
    let height = ly + 30.0;

    let mut s = String::new();
    let _ = writeln!(s, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>");
    let _ = writeln!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {w} {h}\" width=\"{w}\" height=\"{h}\" font-family=\"Helvetica, Arial, sans-serif\" font-size=\"11\">",
        w = num(width),
        h = num(height)
    );
    let _ = writeln!(s, "<title>{}</title>", xml_escape(title));
    let _ = writeln!(
        s,
        "<rect class=\"background\" x=\"0\" y=\"0\" width=\"{}\" height=\"{}\" fill=\"#ffffff\"/>",
        num(width),
        num(height)
    );
    let _ = writeln!(
        s,
        "<text class=\"title\" x=\"{}\" y=\"20\" font-size=\"14\" font-weight=\"bold\">{}</text>",
        num(left),
        xml_escape(title)
    );
    let _ = writeln!(
        s,
        "<text class=\"subtitle\" x=\"{}\" y=\"38\">bubble fraction {} (idle over total time, all ranks), makespan {}</text>",
        num(left),
        format_args!("{:.4}", finite_or_zero(timeline.bubble_fraction)),
        num(timeline.makespan)
    );
    let _ = writeln!(
        s,
        "<text class=\"stats-header\" x=\"{}\" y=\"{}\" fill=\"#444444\">bubble · peak in-flight</text>",
        num(left + chart_w + 10.0),
        num(top - 6.0)
    );
    for (r, (list, rt)) in lists.iter().zip(&timeline.ranks).enumerate() {
        let y = lane_y(r);
        let _ = writeln!(s, "<g class=\"lane\" id=\"rank-{r}\">");
        let _ = writeln!(
            s,
            "<text class=\"rank\" x=\"{}\" y=\"{}\" text-anchor=\"end\" dominant-baseline=\"middle\">rank {r}</text>",
            num(left - 8.0),
            num(y + lane_h / 2.0)
        );
        let _ = writeln!(
            s,
            "<rect class=\"idle\" x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"#ffffff\" stroke=\"#999999\" stroke-width=\"0.5\"/>",
            num(left),
            num(y),
            num(chart_w),
            num(lane_h)
        );
        for (a, &(start, end)) in list.iter().zip(&rt.spans) {
            if !a.is_compute() {
                continue;
            }
            let x = left + start * scale;
            let w = ((end - start) * scale).max(0.0);
            let (color, text_color) = fill(a.kind, local_chunk(a.chunk, pp), vpp);
            let label = label(a);
            let _ = write!(
                s,
                "<rect class=\"{k}\" data-chunk=\"{c}\" data-microbatch=\"{j}\" x=\"{x}\" y=\"{y}\" width=\"{w}\" height=\"{h}\" fill=\"{color}\" stroke=\"#333333\" stroke-width=\"0.5\"><title>{k} chunk {c} microbatch {j}: {t0} to {t1}</title></rect>",
                k = kind_name(a.kind),
                c = a.chunk,
                j = a.microbatch,
                x = num(x),
                y = num(y),
                w = num(w),
                h = num(lane_h),
                t0 = num(start),
                t1 = num(end),
            );
            // The id inside the box when it fits.
            if w >= label.len() as f64 * CHAR_PX + 2.0 {
                let _ = write!(
                    s,
                    "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" dominant-baseline=\"middle\" font-size=\"10\" fill=\"{text_color}\">{label}</text>",
                    num(x + w / 2.0),
                    num(y + lane_h / 2.0)
                );
            }
            s.push('\n');
        }
        let _ = writeln!(
            s,
            "<text class=\"stats\" x=\"{}\" y=\"{}\" dominant-baseline=\"middle\">{:.1}% · peak {}</text>",
            num(left + chart_w + 10.0),
            num(y + lane_h / 2.0),
            100.0 * finite_or_zero(rt.bubble_fraction),
            rt.peak_inflight
        );
        let _ = writeln!(s, "</g>");
    }
    // Time axis.
    let _ = writeln!(s, "<g class=\"axis\" stroke=\"#333333\">");
    let _ = writeln!(
        s,
        "<line x1=\"{}\" y1=\"{ay}\" x2=\"{}\" y2=\"{ay}\" stroke-width=\"1\"/>",
        num(left),
        num(left + chart_w),
        ay = num(axis_y)
    );
    let step = tick_step(makespan);
    let ticks = (makespan / step + 1e-9).floor() as u64;
    for i in 0..=ticks {
        let t = i as f64 * step;
        let x = left + t * scale;
        let _ = writeln!(
            s,
            "<line x1=\"{x}\" y1=\"{}\" x2=\"{x}\" y2=\"{}\" stroke-width=\"1\"/><text x=\"{x}\" y=\"{}\" text-anchor=\"middle\" stroke=\"none\" fill=\"#333333\">{}</text>",
            num(axis_y),
            num(axis_y + 5.0),
            num(axis_y + 17.0),
            num(t),
            x = num(x)
        );
    }
    let _ = writeln!(
        s,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"end\" stroke=\"none\" fill=\"#333333\">time</text>",
        num(left - 8.0),
        num(axis_y + 17.0)
    );
    let _ = writeln!(s, "</g>");
    // Legend.
    let _ = writeln!(s, "<g class=\"legend\">");
    for ((name, color, stroke), &(x, y)) in items.iter().zip(&placed) {
        let _ = writeln!(
            s,
            "<rect x=\"{}\" y=\"{}\" width=\"14\" height=\"14\" fill=\"{color}\" stroke=\"{stroke}\" stroke-width=\"0.5\"/><text x=\"{}\" y=\"{}\" dominant-baseline=\"middle\">{}</text>",
            num(x),
            num(y),
            num(x + 19.0),
            num(y + 7.0),
            xml_escape(name)
        );
    }
    let _ = writeln!(s, "</g>");
    s.push_str("</svg>\n");
    s
}

/// `x`, or 0 when not finite.
fn finite_or_zero(x: f64) -> f64 {
    if x.is_finite() {
        x
    } else {
        0.0
    }
}
