//! `megac scan DIR --svg FILE`: the merged, aligned timeline as an SVG: two lanes per rank
//! (compute above, communication below), step boundaries, the ranks a finding names in red.

use megac_runtime::scan::analyze::{RankTrace, Scan};
use megac_runtime::scan::Kind;

/// Draw `ranks` on `scan`'s aligned clock.
pub fn render_svg(ranks: &[RankTrace], scan: &Scan) -> String {
    let clock = &scan.clock;
    let times = ranks.iter().flat_map(|r| {
        r.events
            .iter()
            .filter(|e| e.kind != Kind::Sync)
            .flat_map(move |e| {
                [
                    clock.align(r.header.rank, e.t0),
                    clock.align(r.header.rank, e.t1),
                ]
            })
    });
    let (t0, t1) = times.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), t| {
        (a.min(t), b.max(t))
    });
    let span = (t1 - t0).max(1.0);
    let (left, width, lane, gap) = (190.0, 1400.0, 14.0, 10.0);
    let row = 2.0 * lane + gap;
    let height = 40.0 + row * ranks.len() as f64 + 30.0;
    let x = |t: f64| left + (t - t0) / span * width;
    let slow: Vec<usize> = scan.findings.iter().flat_map(|f| f.ranks.clone()).collect();
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{height}\" font-family=\"monospace\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"10\" y=\"18\">megac scan: {} ranks, {} steps, {:.1} ms; compute (blue), collectives (orange), sends/receives (green)</text>\n",
        left + width + 20.0,
        ranks.len(),
        scan.steps,
        span / 1e6
    );
    for (i, r) in ranks.iter().enumerate() {
        let y = 30.0 + row * i as f64;
        let colour = if slow.contains(&r.header.rank) {
            "#c00"
        } else {
            "#000"
        };
        s.push_str(&format!(
            "<text x=\"6\" y=\"{:.1}\" fill=\"{colour}\">{}</text>\n",
            y + lane + 4.0,
            scan.labels[i]
        ));
        for e in &r.events {
            let (lane_y, fill) = match e.kind {
                Kind::Compute => (y, "#4a7fc1"),
                Kind::Collective => (y + lane, "#e8912d"),
                Kind::Send | Kind::Recv => (y + lane, "#3a9a4a"),
                Kind::Step => {
                    let sx = x(clock.align(r.header.rank, e.t0));
                    s.push_str(&format!(
                        "<line x1=\"{sx:.1}\" x2=\"{sx:.1}\" y1=\"{y:.1}\" y2=\"{:.1}\" stroke=\"#999\" stroke-width=\"0.5\"/>\n",
                        y + 2.0 * lane
                    ));
                    continue;
                }
                _ => continue,
            };
            let a = x(clock.align(r.header.rank, e.t0));
            let b = x(clock.align(r.header.rank, e.t1));
            s.push_str(&format!(
                "<rect x=\"{a:.1}\" y=\"{lane_y:.1}\" width=\"{:.2}\" height=\"{:.1}\" fill=\"{fill}\"/>\n",
                (b - a).max(0.3),
                lane - 2.0
            ));
        }
    }
    s.push_str("</svg>\n");
    s
}
