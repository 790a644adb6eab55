//! `megac schedule --format svg` and the bubble formulas under unit costs (issue 5): the SVG
//! is well-formed XML with one lane per pipeline rank and one box per compute action, the
//! same input gives the same bytes, the picture in docs/ is what the documented command
//! prints, and `--format json` reports the bubble fractions and peaks of the formulas for
//! p = 2, 4, 8; the text and JSON renderers print the documented tokens.

mod common;
use common::{megac, stderr, stdout};

use megac_ir::pipeline::{
    schedule, simulate, simulate_by, Action, ActionKind, Costs, DppPolicy, ScheduleKind, Timeline,
};

// The renderers live in the binary (`src/render/schedule.rs`), which has no library target:
// the test compiles the module itself.
#[path = "../src/render/schedule.rs"]
mod render;
use render::{render_json, render_svg, render_text};

// ---------------------------------------------------------------------------------------
// A small XML reader: enough to prove well-formedness (one root, matched tags, quoted and
// unique attributes, only the predefined and numeric entities, no raw `<` or `&` in text).

#[derive(Debug)]
struct Element {
    name: String,
    attrs: Vec<(String, String)>,
    children: Vec<Element>,
    text: String,
}

impl Element {
    fn attr(&self, name: &str) -> Option<&str> {
        self.attrs
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Every descendant (depth first, document order), self included.
    fn all(&self) -> Vec<&Element> {
        let mut out = vec![self];
        for c in &self.children {
            out.extend(c.all());
        }
        out
    }
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | ':' | '.')
}

/// Decodes entities in text or an attribute value; rejects a raw `<` and a bare `&`.
fn unescape(s: &str) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find(['&', '<']) {
        out.push_str(&rest[..i]);
        if rest[i..].starts_with('<') {
            return Err(format!("raw `<` in {s:?}"));
        }
        let end = rest[i..]
            .find(';')
            .ok_or_else(|| format!("unterminated entity in {s:?}"))?;
        let ent = &rest[i + 1..i + end];
        out.push(match ent {
            "amp" => '&',
            "lt" => '<',
            "gt" => '>',
            "quot" => '"',
            "apos" => '\'',
            _ if ent.starts_with('#') => {
                let n = if let Some(h) = ent.strip_prefix("#x") {
                    u32::from_str_radix(h, 16)
                } else {
                    ent[1..].parse()
                };
                n.ok()
                    .and_then(char::from_u32)
                    .ok_or_else(|| format!("bad character reference &{ent};"))?
            }
            _ => return Err(format!("unknown entity &{ent};")),
        });
        rest = &rest[i + end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Parses a document: an optional `<?xml ...?>` declaration, then exactly one root element.
fn parse_xml(doc: &str) -> Result<Element, String> {
    let mut s = doc.trim_start();
    if let Some(r) = s.strip_prefix("<?xml") {
        let end = r.find("?>").ok_or("unterminated XML declaration")?;
        s = r[end + 2..].trim_start();
    }
    let mut stack: Vec<Element> = Vec::new();
    let mut root: Option<Element> = None;
    while !s.is_empty() {
        if root.is_some() {
            if s.trim().is_empty() {
                break;
            }
            return Err(format!("content after the root element: {:.40}", s));
        }
        if let Some(r) = s.strip_prefix("</") {
            let end = r.find('>').ok_or("unterminated end tag")?;
            let name = r[..end].trim();
            let el = stack.pop().ok_or_else(|| format!("stray </{name}>"))?;
            if el.name != name {
                return Err(format!("<{}> closed by </{name}>", el.name));
            }
            s = &r[end + 1..];
            match stack.last_mut() {
                Some(parent) => parent.children.push(el),
                None => root = Some(el),
            }
        } else if let Some(r) = s.strip_prefix('<') {
            let name_len = r.find(|c: char| !is_name_char(c)).unwrap_or(r.len());
            if name_len == 0 {
                return Err(format!("bad tag: <{:.20}", r));
            }
            let mut el = Element {
                name: r[..name_len].to_string(),
                attrs: Vec::new(),
                children: Vec::new(),
                text: String::new(),
            };
            let mut r = &r[name_len..];
            let self_closing;
            loop {
                let t = r.trim_start();
                if let Some(x) = t.strip_prefix("/>") {
                    self_closing = true;
                    r = x;
                    break;
                }
                if let Some(x) = t.strip_prefix('>') {
                    self_closing = false;
                    r = x;
                    break;
                }
                if t.len() == r.len() {
                    return Err(format!("<{}>: no space before an attribute", el.name));
                }
                let n = t.find(|c: char| !is_name_char(c)).unwrap_or(t.len());
                if n == 0 {
                    return Err(format!("<{}>: bad attribute at {:.20}", el.name, t));
                }
                let key = t[..n].to_string();
                let t = t[n..]
                    .strip_prefix("=\"")
                    .ok_or_else(|| format!("<{}>: attribute {key} is not =\"...\"", el.name))?;
                let end = t.find('"').ok_or("unterminated attribute value")?;
                if el.attrs.iter().any(|(k, _)| *k == key) {
                    return Err(format!("<{}>: duplicate attribute {key}", el.name));
                }
                el.attrs.push((key, unescape(&t[..end])?));
                r = &t[end + 1..];
            }
            s = r;
            if self_closing {
                match stack.last_mut() {
                    Some(parent) => parent.children.push(el),
                    None => root = Some(el),
                }
            } else {
                stack.push(el);
            }
        } else {
            let end = s.find('<').unwrap_or(s.len());
            let text = unescape(&s[..end])?;
            match stack.last_mut() {
                Some(el) => el.text.push_str(&text),
                None if text.trim().is_empty() => {}
                None => return Err(format!("text outside the root: {text:.40}")),
            }
            s = &s[end..];
        }
    }
    if let Some(el) = stack.last() {
        return Err(format!("<{}> is never closed", el.name));
    }
    root.ok_or_else(|| "no root element".to_string())
}

#[test]
fn the_xml_reader_rejects_malformed_documents() {
    assert!(parse_xml("<a><b/></a>").is_ok());
    for bad in [
        "<a><b></a>",
        "<a>",
        "<a></a><b/>",
        "<a x=1/>",
        "<a x=\"1\" x=\"2\"/>",
        "<a>1 < 2</a>",
        "<a>R&D</a>",
        "<a>&nbsp;</a>",
        "",
    ] {
        assert!(parse_xml(bad).is_err(), "{bad:?} was accepted");
    }
    assert_eq!(parse_xml("<a>&lt;&amp;&#65;</a>").unwrap().text, "<&A");
}

// ---------------------------------------------------------------------------------------
// The SVG.

fn run(kind: ScheduleKind, pp: u32, vpp: u32, m: u32) -> (Vec<Vec<Action>>, Timeline) {
    let l = schedule(kind, pp, vpp, m).unwrap();
    let t = simulate(&l, Costs::unit()).unwrap();
    (l, t)
}

/// Checks the structure of a rendered chart against its lists and timeline.
fn check_svg(svg: &str, lists: &[Vec<Action>], vpp: u32, t: &Timeline, what: &str) {
    let root = parse_xml(svg).unwrap_or_else(|e| panic!("{what}: not well-formed: {e}"));
    assert_eq!(root.name, "svg", "{what}");
    assert_eq!(
        root.attr("xmlns"),
        Some("http://www.w3.org/2000/svg"),
        "{what}"
    );
    let vb: Vec<f64> = root
        .attr("viewBox")
        .expect("viewBox")
        .split(' ')
        .map(|x| x.parse().unwrap())
        .collect();
    assert_eq!(vb.len(), 4);
    // Nothing external: no scripts, images, links, style sheets or font files.
    for el in root.all() {
        assert!(
            !matches!(
                el.name.as_str(),
                "script" | "image" | "a" | "style" | "foreignObject" | "use"
            ),
            "{what}: <{}>",
            el.name
        );
        for (k, v) in &el.attrs {
            assert!(
                !k.contains("href") && !v.contains("url("),
                "{what}: {k}={v}"
            );
        }
    }
    let lanes: Vec<&Element> = root
        .all()
        .into_iter()
        .filter(|e| e.name == "g" && e.attr("class") == Some("lane"))
        .collect();
    assert_eq!(lanes.len(), lists.len(), "{what}: one lane per rank");
    let pp = lists.len() as u32;
    for (r, lane) in lanes.iter().enumerate() {
        assert_eq!(lane.attr("id"), Some(format!("rank-{r}").as_str()));
        let label = lane
            .children
            .iter()
            .find(|e| e.attr("class") == Some("rank"))
            .expect("rank label");
        assert_eq!(label.text, format!("rank {r}"), "{what}");
        let idle = lane
            .children
            .iter()
            .find(|e| e.attr("class") == Some("idle"))
            .expect("lane background");
        assert_eq!(idle.attr("fill"), Some("#ffffff"), "idle time is white");
        let boxes: Vec<&Element> = lane
            .children
            .iter()
            .filter(|e| e.name == "rect" && matches!(e.attr("class"), Some("F" | "B" | "W" | "BW")))
            .collect();
        let compute: Vec<(&Action, &(f64, f64))> = lists[r]
            .iter()
            .zip(&t.ranks[r].spans)
            .filter(|(a, _)| a.is_compute())
            .collect();
        assert_eq!(
            boxes.len(),
            compute.len(),
            "{what}: rank {r}: one rect per compute action"
        );
        let x0: f64 = idle.attr("x").unwrap().parse().unwrap();
        let lane_w: f64 = idle.attr("width").unwrap().parse().unwrap();
        let px = lane_w / t.makespan;
        for (b, (a, &(start, end))) in boxes.iter().zip(&compute) {
            let kind = match a.kind {
                ActionKind::F => "F",
                ActionKind::B => "B",
                ActionKind::W => "W",
                _ => "BW",
            };
            assert_eq!(b.attr("class"), Some(kind), "{what}");
            assert_eq!(b.attr("data-chunk"), Some(a.chunk.to_string().as_str()));
            assert_eq!(
                b.attr("data-microbatch"),
                Some(a.microbatch.to_string().as_str())
            );
            let x: f64 = b.attr("x").unwrap().parse().unwrap();
            let w: f64 = b.attr("width").unwrap().parse().unwrap();
            assert!((x - (x0 + start * px)).abs() < 0.01, "{what}: {a} at {x}");
            assert!(
                (w - (end - start) * px).abs() < 0.02,
                "{what}: {a} width {w}"
            );
        }
        // The microbatch (chunk.microbatch when vpp > 1) id is written inside the boxes.
        let want: Vec<String> = compute
            .iter()
            .map(|(a, _)| {
                if vpp > 1 {
                    format!("{}.{}", a.chunk, a.microbatch)
                } else {
                    a.microbatch.to_string()
                }
            })
            .collect();
        let texts: Vec<&str> = lane
            .children
            .iter()
            .filter(|e| e.name == "text" && e.attr("class").is_none())
            .map(|e| e.text.as_str())
            .collect();
        assert_eq!(texts, want, "{what}: rank {r} box labels");
        let stats = lane
            .children
            .iter()
            .find(|e| e.attr("class") == Some("stats"))
            .expect("per-lane stats");
        let rt = &t.ranks[r];
        assert_eq!(
            stats.text,
            format!(
                "{:.1}% · peak {}",
                100.0 * rt.bubble_fraction,
                rt.peak_inflight
            ),
            "{what}"
        );
    }
    // A legend entry per (kind, local chunk) present, plus idle.
    let legend = root
        .all()
        .into_iter()
        .find(|e| e.attr("class") == Some("legend"))
        .expect("legend");
    let mut kinds: Vec<(String, u32)> = lists
        .iter()
        .flatten()
        .filter(|a| a.is_compute())
        .map(|a| (format!("{:?}", a.kind), a.chunk / pp))
        .collect();
    kinds.sort();
    kinds.dedup();
    let entries: Vec<&str> = legend
        .children
        .iter()
        .filter(|e| e.name == "text")
        .map(|e| e.text.as_str())
        .collect();
    assert_eq!(entries.len(), kinds.len() + 1, "{what}: {entries:?}");
    assert_eq!(entries.last(), Some(&"idle"));
    // Ticks on the time axis, starting at 0.
    let axis = root
        .all()
        .into_iter()
        .find(|e| e.attr("class") == Some("axis"))
        .expect("axis");
    let ticks: Vec<&str> = axis
        .children
        .iter()
        .filter(|e| e.name == "text")
        .map(|e| e.text.as_str())
        .collect();
    assert!(ticks.len() >= 3, "{what}: {ticks:?}");
    assert_eq!(ticks[0], "0");
}

#[test]
fn svg_has_one_lane_per_rank_and_one_box_per_compute_action() {
    let cases = [
        (ScheduleKind::GPipe, 2, 1, 4),
        (ScheduleKind::OneFOneB, 4, 1, 8),
        (ScheduleKind::OneFOneB, 8, 1, 3),
        (ScheduleKind::Interleaved, 4, 2, 8),
        (ScheduleKind::Interleaved, 2, 3, 4),
        (ScheduleKind::ZbH1, 4, 1, 6),
        (ScheduleKind::Dpp(DppPolicy::Bfs), 2, 2, 3),
        (
            ScheduleKind::Dpp(DppPolicy::Adaptive { cap: None }),
            4,
            2,
            5,
        ),
        (ScheduleKind::OneFOneB, 1, 1, 2),
    ];
    for (kind, pp, vpp, m) in cases {
        let (l, t) = run(kind, pp, vpp, m);
        let what = format!("{} pp{pp} vpp{vpp} m{m}", kind.name());
        let svg = render_svg(&l, vpp, &t, &what);
        check_svg(&svg, &l, vpp, &t, &what);
        assert_eq!(svg, render_svg(&l, vpp, &t, &what), "{what}: deterministic");
    }
}

#[test]
fn svg_boxes_follow_per_action_costs() {
    // Chunk 1 twice as slow as chunk 0: the boxes are placed at the simulated times.
    let l = schedule(ScheduleKind::OneFOneB, 2, 1, 4).unwrap();
    let t = simulate_by(&l, 0.0, |a| {
        let k = if a.chunk == 1 { 2.0 } else { 1.0 };
        k * if a.kind == ActionKind::BW { 2.0 } else { 1.0 }
    })
    .unwrap();
    assert_eq!(t.makespan, 1.0 + 4.0 * 6.0 + 2.0);
    check_svg(&render_svg(&l, 1, &t, "slow"), &l, 1, &t, "slow last stage");
}

#[test]
fn svg_escapes_the_title_and_survives_empty_input() {
    let (l, t) = run(ScheduleKind::OneFOneB, 2, 1, 2);
    let title = "a <b> & \"c\" 'd'\u{1}";
    let svg = render_svg(&l, 1, &t, title);
    let root = parse_xml(&svg).unwrap();
    let got = root
        .children
        .iter()
        .find(|e| e.name == "title")
        .unwrap()
        .text
        .clone();
    assert_eq!(got, "a <b> & \"c\" 'd' ");
    // Lists without a timeline (or an empty one) render empty lanes, not a panic.
    let empty = Timeline {
        ranks: Vec::new(),
        makespan: 0.0,
        bubble_fraction: 0.0,
    };
    let root = parse_xml(&render_svg(&l, 1, &empty, "empty")).unwrap();
    assert!(root.all().iter().all(|e| e.attr("class") != Some("lane")));
    parse_xml(&render_svg(&[], 1, &empty, "")).unwrap();
}

// ---------------------------------------------------------------------------------------
// The command.

/// `--set`s for a pp-way pipeline of llama3-8b (32 layers) with `m` micro-batches.
fn layout(schedule: &str, pp: u32, vpp: u32, m: u32) -> Vec<String> {
    [
        "parallel.tp=1".to_string(),
        "parallel.dp=1".to_string(),
        format!("parallel.pp={pp}"),
        format!("parallel.vpp={vpp}"),
        format!("parallel.schedule=\"{schedule}\""),
        "train.micro_batch=1".to_string(),
        format!("train.global_batch={m}"),
    ]
    .into_iter()
    .flat_map(|s| ["--set".to_string(), s])
    .collect()
}

fn schedule_cmd(schedule: &str, pp: u32, vpp: u32, m: u32, extra: &[&str]) -> std::process::Output {
    let sets = layout(schedule, pp, vpp, m);
    let mut args = vec!["schedule", "examples/llama3-8b.toml"];
    args.extend(sets.iter().map(String::as_str));
    args.extend(extra);
    megac(&args)
}

#[test]
fn cli_svg_is_well_formed_and_byte_identical_across_runs() {
    let a = schedule_cmd("interleaved", 4, 2, 8, &["--format", "svg"]);
    assert!(a.status.success(), "{}", stderr(&a));
    let b = schedule_cmd("interleaved", 4, 2, 8, &["--format", "svg"]);
    assert_eq!(a.stdout, b.stdout, "same input, same bytes");
    let svg = stdout(&a);
    let (l, t) = run(ScheduleKind::Interleaved, 4, 2, 8);
    check_svg(&svg, &l, 2, &t, "cli interleaved");
    assert!(svg
        .contains("<title>interleaved schedule: pp=4 vpp=2, 8 micro-batches, unit costs</title>"));
    // -o FILE writes the same bytes.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.svg");
    let c = schedule_cmd(
        "interleaved",
        4,
        2,
        8,
        &["--format", "svg", "-o", path.to_str().unwrap()],
    );
    assert!(c.status.success(), "{}", stderr(&c));
    assert!(c.stdout.is_empty());
    assert_eq!(std::fs::read(&path).unwrap(), a.stdout);
    // Model costs: also well-formed, one lane per rank, and the title says so.
    let d = schedule_cmd("1f1b", 8, 1, 16, &["--format", "svg", "--costs", "model"]);
    assert!(d.status.success(), "{}", stderr(&d));
    let root = parse_xml(&stdout(&d)).unwrap();
    let lanes = root
        .all()
        .into_iter()
        .filter(|e| e.attr("class") == Some("lane"))
        .count();
    assert_eq!(lanes, 8);
    assert!(stdout(&d).contains("model costs"));
}

#[test]
fn the_picture_in_the_docs_is_what_the_documented_command_prints() {
    let docs =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/schedules.md")).unwrap();
    let cmd = "megac schedule examples/llama3-8b.toml --set parallel.tp=1 --set parallel.dp=1 \
               --set parallel.pp=4 --set parallel.vpp=2 --set parallel.schedule=\\\"interleaved\\\" \
               --set train.global_batch=8 --format svg -o docs/img/interleaved-pp4-vpp2-m8.svg";
    assert!(
        docs.contains(cmd),
        "docs/schedules.md shows the command:\n{cmd}"
    );
    assert!(docs.contains("](img/interleaved-pp4-vpp2-m8.svg)"));
    let o = megac(&[
        "schedule",
        "examples/llama3-8b.toml",
        "--set",
        "parallel.tp=1",
        "--set",
        "parallel.dp=1",
        "--set",
        "parallel.pp=4",
        "--set",
        "parallel.vpp=2",
        "--set",
        "parallel.schedule=\"interleaved\"",
        "--set",
        "train.global_batch=8",
        "--format",
        "svg",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let committed = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/img/interleaved-pp4-vpp2-m8.svg"
    ))
    .unwrap();
    assert!(
        committed == stdout(&o),
        "docs/img/interleaved-pp4-vpp2-m8.svg is stale: rerun the command in docs/schedules.md"
    );
}

#[test]
fn cli_headers_name_the_costs_and_bad_options_are_errors() {
    let o = schedule_cmd("1f1b", 4, 1, 8, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let first = stdout(&o).lines().next().unwrap().to_string();
    assert!(first.ends_with("unit costs (F = B = W = 1)"), "{first}");
    let o = schedule_cmd("1f1b", 4, 1, 8, &["--costs", "model"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let first = out.lines().next().unwrap();
    assert!(first.contains("model costs (per-layer FLOPs"), "{first}");
    // 8 layers per chunk: chunks 0-2 alike, the last one carries the head.
    assert!(first.contains("chunks 0-2 "), "{first}");
    assert!(first.contains("chunk 3 "), "{first}");
    // The heavier last stage stretches the step: more bubble than under unit costs.
    let bubble = |s: &str| -> f64 {
        s.lines()
            .last()
            .unwrap()
            .split_whitespace()
            .nth(2)
            .unwrap()
            .parse()
            .unwrap()
    };
    assert!(bubble(&out) > 3.0 / 11.0, "{out}");
    for (args, want) in [
        (
            vec!["--format", "pdf"],
            "--format pdf: expected text, json or svg",
        ),
        (
            vec!["--costs", "magic"],
            "--costs magic: expected unit or model",
        ),
        (
            vec!["--format", "svg", "-o", "README.md/x.svg"],
            "error: -o README.md/x.svg: cannot create the folder README.md: README.md is a file",
        ),
    ] {
        let o = schedule_cmd("1f1b", 4, 1, 8, &args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        assert!(stderr(&o).contains(want), "{args:?}: {}", stderr(&o));
    }
}

// ---------------------------------------------------------------------------------------
// Bubble formulas and peaks under unit costs, p = 2, 4, 8; the text and JSON renderers print the documented tokens.

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-12
}

#[test]
fn library_bubble_formulas_at_p_2_4_8() {
    for p in [2u32, 4, 8] {
        let pf = f64::from(p);
        for m in [1, 2, 3, p, p + 1, 2 * p, 16, 32] {
            let mf = f64::from(m);
            for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
                let (_, t) = run(kind, p, 1, m);
                let want = (pf - 1.0) / (mf + pf - 1.0);
                assert!(close(t.bubble_fraction, want), "{kind:?} p{p} m{m}");
                for r in &t.ranks {
                    assert!(close(r.bubble_fraction, want), "{kind:?} p{p} m{m}");
                }
            }
            if m >= p {
                let (_, t) = run(ScheduleKind::ZbH1, p, 1, m);
                let want = (pf - 1.0) / (3.0 * mf + pf - 1.0);
                assert!(close(t.bubble_fraction, want), "zb-h1 p{p} m{m}");
            }
            // Peaks on the first stage: p for 1f1b (m when fewer), m for gpipe.
            let (_, o) = run(ScheduleKind::OneFOneB, p, 1, m);
            assert_eq!(o.ranks[0].peak_inflight, p.min(m), "1f1b p{p} m{m}");
            let (_, g) = run(ScheduleKind::GPipe, p, 1, m);
            assert_eq!(g.ranks[0].peak_inflight, m, "gpipe p{p} m{m}");
        }
        for v in [2u32, 4] {
            for m in [p, 2 * p, 4 * p] {
                let (_, t) = run(ScheduleKind::Interleaved, p, v, m);
                let want = (pf - 1.0) / (f64::from(v * m) + pf - 1.0);
                assert!(close(t.bubble_fraction, want), "interleaved p{p} v{v} m{m}");
            }
        }
    }
}

/// Runs `--format json` and returns (bubble fraction, peak in-flight of rank 0, ranks).
fn json_bubble(schedule: &str, p: u32, v: u32, m: u32) -> (f64, u64, usize) {
    let o = schedule_cmd(schedule, p, v, m, &["--format", "json"]);
    assert!(
        o.status.success(),
        "{schedule} p{p} v{v} m{m}: {}",
        stderr(&o)
    );
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let ranks = j["ranks"].as_array().unwrap();
    (
        j["bubble_fraction"].as_f64().unwrap(),
        ranks[0]["peak_inflight"].as_u64().unwrap(),
        ranks.len(),
    )
}

#[test]
fn cli_json_bubble_formulas_at_p_2_4_8() {
    for p in [2u32, 4, 8] {
        let pf = f64::from(p);
        for m in [p, 2 * p, 24] {
            let mf = f64::from(m);
            let one = (pf - 1.0) / (mf + pf - 1.0);
            let (b, peak, n) = json_bubble("gpipe", p, 1, m);
            assert!(close(b, one), "gpipe p{p} m{m}: {b}");
            assert_eq!((peak, n), (u64::from(m), p as usize));
            let (b, peak, _) = json_bubble("1f1b", p, 1, m);
            assert!(close(b, one), "1f1b p{p} m{m}: {b}");
            assert_eq!(peak, u64::from(p));
            let (b, _, _) = json_bubble("zb-h1", p, 1, m);
            assert!(
                close(b, (pf - 1.0) / (3.0 * mf + pf - 1.0)),
                "zb-h1 p{p} m{m}: {b}"
            );
            let (b, _, _) = json_bubble("interleaved", p, 2, m);
            assert!(
                close(b, (pf - 1.0) / (2.0 * mf + pf - 1.0)),
                "interleaved p{p} m{m}: {b}"
            );
        }
    }
}

/// `megac schedule PLAN_DIR`: the action lists a compiled plan carries reproduce the bubble
/// formulas, and its SVG has one lane per pipeline stage.
#[test]
fn schedule_of_a_compiled_plan_directory() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, u32, u32, f64); 3] = [
        ("1f1b", 4, 1, 3.0 / (8.0 + 3.0)),
        ("zb-h1", 4, 1, 3.0 / (24.0 + 3.0)),
        ("interleaved", 4, 2, 3.0 / (16.0 + 3.0)),
    ];
    for (schedule, pp, vpp, want) in cases {
        let out = dir.path().join(format!("{schedule}-{pp}-{vpp}"));
        let sets = [
            "model.layers=8".to_string(),
            "train.micro_batch=1".to_string(),
            "train.global_batch=8".to_string(),
            format!("parallel.pp={pp}"),
            format!("parallel.vpp={vpp}"),
            format!("parallel.schedule={schedule}"),
        ];
        let mut args = vec!["compile", "examples/llama-tiny.toml"];
        for s in &sets {
            args.extend(["--set", s.as_str()]);
        }
        args.extend(["-o", out.to_str().unwrap()]);
        let o = megac(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let o = megac(&["schedule", out.to_str().unwrap(), "--format", "json"]);
        assert!(o.status.success(), "{}", stderr(&o));
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let b = j["bubble_fraction"].as_f64().unwrap();
        assert!(close(b, want), "{schedule} pp{pp} vpp{vpp}: {b} vs {want}");
        let o = megac(&["schedule", out.to_str().unwrap(), "--format", "svg"]);
        let svg = stdout(&o);
        parse_xml(&svg).unwrap();
        for r in 0..pp {
            assert!(svg.contains(&format!(">rank {r}<")), "{schedule}: lane {r}");
        }
        assert!(!svg.contains(&format!(">rank {pp}<")));
    }
    // Model costs on a plan: megac-sim's timeline of the same action lists, in seconds.
    let last = dir.path().join("interleaved-4-2");
    let o = megac(&[
        "schedule",
        last.to_str().unwrap(),
        "--costs",
        "model",
        "--format",
        "json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let b = j["bubble_fraction"].as_f64().unwrap();
    assert!(b > 0.0 && b < 1.0, "{b}");
    assert_eq!(j["ranks"].as_array().unwrap().len(), 4);
    let o = megac(&[
        "schedule",
        last.to_str().unwrap(),
        "--costs",
        "model",
        "--format",
        "svg",
    ]);
    parse_xml(&stdout(&o)).unwrap();
    let o = megac(&[
        "schedule",
        last.to_str().unwrap(),
        "--costs",
        "model",
        "--cluster",
        "nope",
    ]);
    assert_eq!(o.status.code(), Some(1));
    // A plan without pipeline parallelism: a clear error.
    let flat = dir.path().join("flat");
    let o = megac(&[
        "compile",
        "examples/llama-tiny.toml",
        "-o",
        flat.to_str().unwrap(),
    ]);
    assert!(o.status.success());
    let o = megac(&["schedule", flat.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("is not a pipelined plan"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn renders_text_and_json() {
    let l = schedule(ScheduleKind::OneFOneB, 2, 1, 3).unwrap();
    assert_eq!(
        render_text(&l, 1, false),
        "rank 0 | F0 F1 BW0 F2 BW1 BW2\nrank 1 | F0 BW0 F1 BW1 F2 BW2\n"
    );
    assert_eq!(
        render_text(&l, 1, true).lines().nth(1).unwrap(),
        "rank 1 | rA0<0 F0 BW0 sG0>0 rA1<0 F1 BW1 sG1>0 rA2<0 F2 BW2 sG2>0"
    );
    let l = schedule(ScheduleKind::GPipe, 2, 1, 1).unwrap();
    let t = simulate(&l, Costs::unit()).unwrap();
    assert_eq!(
        render_json(&l, 1, &t),
        "{\"bubble_fraction\": 0.5, \"ranks\": [\
         {\"rank\": 0, \"actions\": [\"F0\", \"sA0>1\", \"rG0<1\", \"BW0\"], \"bubble_fraction\": 0.5, \"peak_inflight\": 1}, \
         {\"rank\": 1, \"actions\": [\"rA0<0\", \"F0\", \"BW0\", \"sG0>0\"], \"bubble_fraction\": 0.5, \"peak_inflight\": 1}]}"
    );
}
