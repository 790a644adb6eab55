//! `megac scope view` in a real browser: the system's Chromium (Debian's `chromium`), headless,
//! driven over the DevTools protocol through `--remote-debugging-pipe` (JSON messages ended
//! by a NUL byte on file descriptors 3 and 4: no websocket, no port, no downloaded browser).
//!
//! A probe file and a perturbation report of examples/llama-tiny.toml (weights from one
//! training step) are rendered to view.html and opened from disk. Checked: no console error
//! and no exception; no network request but the page's own file; and each interaction (the
//! layer slider, hovering a query token, clicking a head, selecting a position in the lens
//! table, clicking the KL strip) changes what the page draws (hashes of every canvas's
//! pixels, the page's text). Pages of partial probe files (attention only, lens only) load
//! too and say what is missing. Without Chromium the test is skipped with a message, unless
//! MEGAC_REQUIRE_CHROMIUM=1 (scripts/test.sh sets it), where it fails.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::FromRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

fn megac(args: &[&str]) -> std::process::Output {
    let out = Command::new(env!("CARGO_BIN_EXE_megac"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "megac {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The system Chromium: $MEGAC_CHROMIUM, else `chromium` or `chromium-browser` on PATH.
fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MEGAC_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|d| [d.join("chromium"), d.join("chromium-browser")])
        .find(|p| p.is_file())
}

/// A DevTools protocol session with one headless Chromium over its debugging pipe.
struct Browser {
    child: Child,
    to_chrome: File,
    messages: Receiver<Value>,
    next_id: u64,
    session: Option<String>,
    /// Every event received so far (method and params), in order.
    events: Vec<Value>,
    _profile: tempfile::TempDir,
}

impl Browser {
    fn launch(exe: &Path) -> Browser {
        let profile = tempfile::tempdir().unwrap();
        // Two pipes: Chromium reads commands on fd 3 and writes replies and events on fd 4.
        let (mut to, mut from) = ([0; 2], [0; 2]);
        // SAFETY: pipe2 writes two fds into the arrays it is given.
        unsafe {
            assert_eq!(libc::pipe2(to.as_mut_ptr(), libc::O_CLOEXEC), 0);
            assert_eq!(libc::pipe2(from.as_mut_ptr(), libc::O_CLOEXEC), 0);
        }
        let (chrome_reads, chrome_writes) = (to[0], from[1]);
        let mut cmd = Command::new(exe);
        cmd.args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-extensions",
            "--hide-scrollbars",
            "--window-size=1280,1600",
            "--remote-debugging-pipe",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg("about:blank")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        // SAFETY: only async-signal-safe calls (fcntl, dup2, close) between fork and exec.
        // The pipe ends are first copied above fd 9, so that moving them onto 3 and 4 cannot
        // overwrite one with the other; the copies and dup2's targets are not close-on-exec.
        unsafe {
            cmd.pre_exec(move || {
                let a = libc::fcntl(chrome_reads, libc::F_DUPFD, 10);
                let b = libc::fcntl(chrome_writes, libc::F_DUPFD, 10);
                if a < 0 || b < 0 || libc::dup2(a, 3) < 0 || libc::dup2(b, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(a);
                libc::close(b);
                Ok(())
            });
        }
        let child = cmd.spawn().expect("start chromium");
        // SAFETY: each fd is owned here once: the child's ends are closed, ours wrapped.
        let (to_chrome, mut from_chrome) = unsafe {
            libc::close(chrome_reads);
            libc::close(chrome_writes);
            (File::from_raw_fd(to[1]), File::from_raw_fd(from[0]))
        };
        let (tx, messages) = channel();
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let mut chunk = [0u8; 1 << 16];
            loop {
                let n = match from_chrome.read(&mut chunk) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                buf.extend_from_slice(&chunk[..n]);
                while let Some(end) = buf.iter().position(|&b| b == 0) {
                    let message: Value = serde_json::from_slice(&buf[..end]).unwrap();
                    buf.drain(..=end);
                    if tx.send(message).is_err() {
                        return;
                    }
                }
            }
        });
        Browser {
            child,
            to_chrome,
            messages,
            next_id: 0,
            session: None,
            events: Vec::new(),
            _profile: profile,
        }
    }

    /// Send a command (to the attached page, once there is one) and wait for its result;
    /// events that arrive meanwhile are kept.
    fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let mut message = json!({ "id": id, "method": method, "params": params });
        if let Some(s) = &self.session {
            message["sessionId"] = json!(s);
        }
        let mut bytes = serde_json::to_vec(&message).unwrap();
        bytes.push(0);
        self.to_chrome.write_all(&bytes).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let m = self
                .messages
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("{method}: no reply from chromium ({e})"));
            if m["id"] == json!(id) {
                if let Some(e) = m.get("error") {
                    panic!("{method}: {e}");
                }
                return m["result"].clone();
            }
            if m.get("method").is_some() {
                self.events.push(m);
            }
        }
    }

    /// Wait for the event `method` (or one already received since `from`).
    fn wait_event(&mut self, method: &str, from: usize) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if self.events[from..].iter().any(|e| e["method"] == method) {
                return;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let m = self
                .messages
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("waiting for {method}: {e}"));
            if m.get("method").is_some() {
                self.events.push(m);
            }
        }
    }

    /// Evaluate a JavaScript expression in the page; its value (by value, as JSON).
    fn eval(&mut self, expr: &str) -> Value {
        let r = self.call(
            "Runtime.evaluate",
            json!({ "expression": expr, "returnByValue": true, "awaitPromise": true }),
        );
        if let Some(e) = r.get("exceptionDetails") {
            panic!("evaluating {expr}: {e}");
        }
        r["result"]["value"].clone()
    }

    /// The centre of the first element matching a CSS selector, in page coordinates,
    /// scrolled into view.
    fn centre(&mut self, selector: &str) -> (f64, f64) {
        let v = self.eval(&format!(
            "(() => {{ const e = document.querySelector({sel}); e.scrollIntoView({{block: 'center', inline: 'center'}}); const r = e.getBoundingClientRect(); return [r.left + r.width / 2, r.top + r.height / 2, r.left, r.width]; }})()",
            sel = json!(selector)
        ));
        (v[0].as_f64().unwrap(), v[1].as_f64().unwrap())
    }

    fn mouse(&mut self, kind: &str, (x, y): (f64, f64)) {
        let mut params = json!({ "type": kind, "x": x, "y": y, "button": "none" });
        if kind != "mouseMoved" {
            params["button"] = json!("left");
            params["clickCount"] = json!(1);
        }
        self.call("Input.dispatchMouseEvent", params);
    }

    fn click(&mut self, at: (f64, f64)) {
        self.mouse("mouseMoved", at);
        self.mouse("mousePressed", at);
        self.mouse("mouseReleased", at);
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the page draws: a hash of every canvas's pixels (`hidden` for one not shown) and
/// the text of the parts that change.
const DRAWN: &str = r#"(() => {
  const fnv = (s) => { let h = 2166136261; for (let i = 0; i < s.length; i++) { h ^= s.charCodeAt(i); h = Math.imul(h, 16777619) >>> 0; } return h.toString(16); };
  const canvases = {};
  document.querySelectorAll('canvas').forEach((c, i) => {
    const name = c.id || ('heads.' + (c.parentElement.dataset.head ?? ('other' + i)));
    canvases[name] = c.offsetParent === null ? 'hidden' : fnv(c.toDataURL());
  });
  const text = (id) => document.getElementById(id).textContent;
  return { canvases, layer: text('layer-label'), readout: text('readout'), lens: text('lens-detail'),
           dists: text('dist-head') + text('dists'), query: [...document.querySelectorAll('.tok.q')].map((e) => e.dataset.pos),
           big: [...document.querySelectorAll('.head.big')].map((e) => e.dataset.head) };
})()"#;

/// The names of the canvases whose pixels differ between two `DRAWN` states.
fn changed(a: &Value, b: &Value) -> Vec<String> {
    let (a, b) = (&a["canvases"], &b["canvases"]);
    let mut names: Vec<String> = a
        .as_object()
        .unwrap()
        .keys()
        .chain(b.as_object().unwrap().keys())
        .filter(|k| a.get(*k) != b.get(*k))
        .cloned()
        .collect();
    names.sort();
    names.dedup();
    names
}

#[test]
fn the_viewer_works_in_chromium_offline() {
    let Some(exe) = chromium() else {
        if std::env::var("MEGAC_REQUIRE_CHROMIUM").as_deref() == Ok("1") {
            panic!("MEGAC_REQUIRE_CHROMIUM=1 but no chromium on PATH (apt-get install chromium)");
        }
        eprintln!(
            "SKIPPED the_viewer_works_in_chromium_offline: no chromium on PATH \
             (apt-get install -y --no-install-recommends chromium; MEGAC_REQUIRE_CHROMIUM=1 \
             makes this a failure)"
        );
        return;
    };
    let started = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let p = |f: &str| tmp.path().join(f).display().to_string();
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/llama-tiny.toml");
    let model = model.to_str().unwrap();
    megac(&[
        "train",
        model,
        "--steps",
        "1",
        "--save-params",
        &p("init.safetensors"),
    ]);
    megac(&[
        "scope",
        model,
        "--init",
        &p("init.safetensors"),
        "--prompt",
        "The cat sat on the mat.",
        "--probe",
        "*",
        "--perturb",
        "layers.0.out:noise(0.5)",
        "--report",
        &p("r.json"),
        "-o",
        &p("probes.safetensors"),
    ]);
    let out = megac(&[
        "scope",
        "view",
        &p("probes.safetensors"),
        "--report",
        &p("r.json"),
        "-o",
        &p("view.html"),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("23 of 23 position(s), 2 layer(s), with the report"),
        "{stdout}"
    );
    let html = std::fs::read_to_string(p("view.html")).unwrap();
    for remote in ["http://", "https://", "//cdn", "<link", "src="] {
        assert!(!html.contains(remote), "the page mentions {remote}");
    }
    // Two partial pages: attention only (no lens, no logits, no report), and the lens only.
    for (name, probe) in [("attn", "layers.*.attn.probs"), ("lens", "layers.*.lens")] {
        megac(&[
            "scope",
            model,
            "--init",
            &p("init.safetensors"),
            "--prompt",
            "The cat",
            "--probe",
            probe,
            "-o",
            &p(&format!("{name}.safetensors")),
        ]);
        megac(&[
            "scope",
            "view",
            &p(&format!("{name}.safetensors")),
            "-o",
            &p(&format!("{name}.html")),
        ]);
    }
    let prepared = started.elapsed();

    let mut b = Browser::launch(&exe);
    let targets = b.call("Target.getTargets", json!({}));
    let page = targets["targetInfos"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["type"] == "page")
        .expect("a page target")["targetId"]
        .clone();
    let attached = b.call(
        "Target.attachToTarget",
        json!({ "targetId": page, "flatten": true }),
    );
    b.session = Some(attached["sessionId"].as_str().unwrap().to_string());
    for domain in ["Page", "Runtime", "Log", "Network"] {
        b.call(&format!("{domain}.enable"), json!({}));
    }
    let url = format!("file://{}", p("view.html"));
    let from = b.events.len();
    b.call("Page.navigate", json!({ "url": url }));
    b.wait_event("Page.loadEventFired", from);
    assert_eq!(b.eval("document.body.dataset.ready"), json!("1"));
    assert_eq!(
        b.eval("document.querySelectorAll('.tok').length"),
        json!(23)
    );
    assert_eq!(
        b.eval("document.querySelectorAll('#heads canvas').length"),
        json!(4)
    );
    assert_eq!(
        b.eval("document.querySelector('.tok').textContent"),
        json!("T84")
    );

    // The layer slider: a click at its right end moves it to the last layer.
    let s0 = b.eval(DRAWN);
    assert_eq!(s0["layer"], json!("layer 0 (4 heads)"));
    let rect = b.eval("(() => { const r = document.getElementById('layer').getBoundingClientRect(); return [r.right - 2, r.top + r.height / 2]; })()");
    b.click((rect[0].as_f64().unwrap(), rect[1].as_f64().unwrap()));
    let s1 = b.eval(DRAWN);
    assert_eq!(s1["layer"], json!("layer 1 (4 heads)"), "the slider moved");
    let heads = ["heads.0", "heads.1", "heads.2", "heads.3"];
    assert!(
        heads
            .iter()
            .all(|h| changed(&s0, &s1).contains(&h.to_string())),
        "every head's map is redrawn for layer 1: {:?}",
        changed(&s0, &s1)
    );

    // Hovering a query token frames its row in every head and shows its values.
    let at = b.centre(".tok[data-pos='3']");
    b.mouse("mouseMoved", at);
    let s2 = b.eval(DRAWN);
    assert_eq!(s2["query"], json!(["3"]));
    assert!(
        s2["readout"]
            .as_str()
            .unwrap()
            .starts_with("query 3 \u{2423}, layer 1"),
        "{}",
        s2["readout"]
    );
    assert!(heads
        .iter()
        .all(|h| changed(&s1, &s2).contains(&h.to_string())));

    // Clicking a head enlarges it.
    assert_eq!(s2["canvases"]["big"], json!("hidden"));
    let at = b.centre(".head[data-head='2'] canvas");
    b.click(at);
    let s3 = b.eval(DRAWN);
    assert_eq!(s3["big"], json!(["2"]));
    assert_ne!(s3["canvases"]["big"], json!("hidden"));
    // Hovering the enlarged map reads out one cell.
    let at = b.centre("#big");
    b.mouse("mouseMoved", at);
    let s4 = b.eval(DRAWN);
    assert!(
        s4["readout"]
            .as_str()
            .unwrap()
            .starts_with("head 2: query "),
        "{}",
        s4["readout"]
    );
    assert!(changed(&s3, &s4).contains(&"big".to_string()));

    // Selecting a position in the lens table: the lens detail, the distributions and the
    // KL strip follow it.
    assert!(s4["lens"].as_str().unwrap().starts_with("position 0 "));
    let at = b.centre("#lens tr:nth-child(2) td[data-pos='6']");
    b.click(at);
    let s5 = b.eval(DRAWN);
    assert!(
        s5["lens"].as_str().unwrap().starts_with("position 6 t:"),
        "{}",
        s5["lens"]
    );
    assert!(s5["dists"].as_str().unwrap().starts_with("position 6 "));
    let moved = changed(&s4, &s5);
    assert!(
        moved.contains(&"klstrip".to_string()) && moved.iter().any(|c| c.starts_with("heads.")),
        "{moved:?}"
    );
    let dist_canvases = b.eval("document.querySelectorAll('#dists canvas').length");
    assert_eq!(dist_canvases, json!(2), "clean and perturbed side by side");
    let before =
        b.eval("[...document.querySelectorAll('#dists canvas')].map((c) => c.toDataURL())");

    // Clicking the KL strip selects a position too.
    let rect = b.eval("(() => { const r = document.getElementById('klstrip').getBoundingClientRect(); return [r.left + 2, r.bottom - 2]; })()");
    b.click((rect[0].as_f64().unwrap(), rect[1].as_f64().unwrap()));
    let s6 = b.eval(DRAWN);
    assert!(s6["lens"].as_str().unwrap().starts_with("position 0 "));
    let after = b.eval("[...document.querySelectorAll('#dists canvas')].map((c) => c.toDataURL())");
    assert_ne!(before, after, "the distributions are redrawn");

    // The partial pages load and say what is missing.
    let mut urls = vec![json!(url)];
    for (name, missing, present) in [
        ("attn", "lens-section", "#heads canvas"),
        ("lens", "attn-section", "#lens td"),
    ] {
        let page = format!("file://{}", p(&format!("{name}.html")));
        let from = b.events.len();
        b.call("Page.navigate", json!({ "url": page }));
        b.wait_event("Page.loadEventFired", from);
        assert_eq!(b.eval("document.body.dataset.ready"), json!("1"), "{name}");
        let text = b.eval(&format!("document.getElementById('{missing}').textContent"));
        assert!(
            text.as_str().unwrap().contains("the probe file has no"),
            "{name}: {text}"
        );
        let count = b.eval(&format!("document.querySelectorAll('{present}').length"));
        assert!(count.as_u64().unwrap() > 0, "{name}: {present}");
        urls.push(json!(page));
    }

    // Nothing went wrong, and nothing was fetched but the pages themselves.
    b.eval("0");
    let mut errors = Vec::new();
    let mut requests = Vec::new();
    for e in &b.events {
        let m = e["method"].as_str().unwrap();
        let params = &e["params"];
        match m {
            "Runtime.exceptionThrown" => errors.push(params.to_string()),
            "Runtime.consoleAPICalled"
                if matches!(
                    params["type"].as_str(),
                    Some("error" | "assert" | "warning")
                ) =>
            {
                errors.push(params.to_string())
            }
            "Log.entryAdded" if params["entry"]["level"] != "verbose" => {
                errors.push(params.to_string())
            }
            "Network.requestWillBeSent" => requests.push(params["request"]["url"].clone()),
            "Network.webSocketCreated" | "Network.eventSourceMessageReceived" => {
                requests.push(params.clone())
            }
            _ => {}
        }
    }
    assert_eq!(requests, urls, "each page's only request is itself");
    assert!(errors.is_empty(), "console errors: {errors:#?}");
    eprintln!(
        "viewer test: {:.1} s preparing (train, scope, view), {:.1} s in chromium; page {} bytes",
        prepared.as_secs_f64(),
        (started.elapsed() - prepared).as_secs_f64(),
        html.len()
    );
}

/// The data the page embeds (the JSON of its `megac-data` script element).
fn page_data(html: &str) -> Value {
    let start = html.find(r#"id="megac-data">"#).unwrap() + r#"id="megac-data">"#.len();
    let end = start + html[start..].find("</script>").unwrap();
    serde_json::from_str(&html[start..end]).unwrap()
}

fn megac_fails(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_megac"))
        .args(args)
        .output()
        .unwrap();
    assert!(!out.status.success(), "megac {args:?} succeeded");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

/// `megac scope` records its input in the probe file's metadata and the report's top-10
/// distributions (checked against the softmax of the probed, perturbed logits); `scope view`
/// embeds what the page needs, cuts long inputs with a note, reads files without the
/// metadata, and refuses bad input with one error and no output file.
#[test]
fn scope_view_data_limits_and_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let p = |f: &str| tmp.path().join(f).display().to_string();
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/llama");
    let model = golden.join("model.toml").display().to_string();
    let init = golden.join("init.safetensors").display().to_string();
    let tokens = [3u32, 14, 15, 92, 65, 35, 89, 79];
    let ids = "3,14,15,92,65,35,89,79";
    megac(&[
        "scope",
        &model,
        "--init",
        &init,
        "--tokens",
        ids,
        "--probe",
        "*",
        "--perturb",
        "layers.0.out:noise(0.5)",
        "--seed",
        "7",
        "--report",
        &p("r.json"),
        "-o",
        &p("probes.safetensors"),
    ]);
    let bytes = std::fs::read(p("probes.safetensors")).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().clone().unwrap();
    assert_eq!(meta["format"], "pt");
    assert_eq!(meta["megac.tokens"], ids);
    assert_eq!(meta["megac.perturb"], "layers.0.out:noise(0.5)");
    assert_eq!(meta["megac.seed"], "7");
    assert!(!meta.contains_key("megac.prompt"));

    // The report's distributions: the perturbed run's are the softmax of the probed logits.
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let logits = st.tensor("logits").unwrap();
    let vocab = logits.shape()[2];
    let logits: Vec<f32> = logits
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(p("r.json")).unwrap()).unwrap();
    for key in ["clean_loss", "perturbed_loss", "kl", "top1_agreement"] {
        assert!(report[key].is_f64(), "{key}");
    }
    for (t, pos) in report["per_position"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        let row = &logits[t * vocab..(t + 1) * vocab];
        let max = row.iter().fold(f64::MIN, |m, &x| m.max(f64::from(x)));
        let z: f64 = row.iter().map(|&x| (f64::from(x) - max).exp()).sum();
        let prob = |i: usize| (f64::from(row[i]) - max).exp() / z;
        let ptop = pos["perturbed_top"].as_array().unwrap();
        let ctop = pos["clean_top"].as_array().unwrap();
        assert_eq!((ptop.len(), ctop.len()), (10, 10));
        assert_eq!(ptop[0]["token"], pos["perturbed_top1"]);
        assert_eq!(ctop[0]["token"], pos["clean_top1"]);
        let mut last = f64::INFINITY;
        for e in ptop {
            let (tok, pp) = (
                e["token"].as_u64().unwrap() as usize,
                e["perturbed"].as_f64().unwrap(),
            );
            assert!(
                (pp - prob(tok)).abs() < 1e-9,
                "position {t} token {tok}: {pp} vs {}",
                prob(tok)
            );
            assert!(pp <= last);
            last = pp;
        }
        // Nothing outside the list is more likely than its last entry.
        assert!((0..vocab).all(|i| prob(i) <= last + 1e-12 || ptop.iter().any(|e| e["token"] == i)));
        let mut last = f64::INFINITY;
        for e in ctop {
            let pc = e["clean"].as_f64().unwrap();
            assert!(pc <= last && pc > 0.0);
            last = pc;
        }
    }

    // The page's data: every layer's 4 heads of 8×8 (base64 float32), the lens, the logits'
    // top 5, the tokens, the report.
    megac(&[
        "scope",
        "view",
        &p("probes.safetensors"),
        "--report",
        &p("r.json"),
        "-o",
        &p("view.html"),
    ]);
    let data = page_data(&std::fs::read_to_string(p("view.html")).unwrap());
    assert_eq!(data["tokens"], json!(tokens));
    assert_eq!(
        (data["n"].clone(), data["shown"].clone()),
        (json!(8), json!(8))
    );
    assert_eq!(data["bytes"], json!(false));
    assert_eq!(data["notes"], json!([]));
    let layers = data["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 2);
    assert_eq!(layers[1]["heads"], json!(4));
    assert_eq!(
        layers[1]["attn"].as_str().unwrap().len(),
        (4 * 8 * 8 * 4usize).div_ceil(3) * 4
    );
    assert_eq!(layers[0]["lens"]["tokens"].as_array().unwrap().len(), 8 * 5);
    assert_eq!(data["logits"]["tokens"].as_array().unwrap().len(), 8 * 5);
    assert_eq!(
        data["logits"]["tokens"][0],
        report["per_position"][0]["perturbed_top1"]
    );
    assert_eq!(data["report"]["per_position"].as_array().unwrap().len(), 8);

    // A cut: the first 3 positions, said so on the page; the report follows.
    megac(&[
        "scope",
        "view",
        &p("probes.safetensors"),
        "--report",
        &p("r.json"),
        "--max-positions",
        "3",
        "-o",
        &p("cut.html"),
    ]);
    let data = page_data(&std::fs::read_to_string(p("cut.html")).unwrap());
    assert_eq!(data["shown"], json!(3));
    assert_eq!(data["tokens"], json!(tokens[..3]));
    assert_eq!(
        data["notes"],
        json!(["showing positions 0 to 2 of 8 (--max-positions 3)"])
    );
    assert_eq!(
        data["layers"][0]["attn"].as_str().unwrap().len(),
        (4 * 3 * 3 * 4usize).div_ceil(3) * 4
    );
    assert_eq!(data["report"]["per_position"].as_array().unwrap().len(), 3);

    // A probe file of another megac (no metadata), attention only: positions without ids.
    let attn = st.tensor("layers.1.attn.probs").unwrap();
    let values: Vec<f32> = attn
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    megac_runtime::hf::save_params(
        Path::new(&p("old.safetensors")),
        &[(
            "layers.1.attn.probs".to_string(),
            attn.shape().to_vec(),
            &values,
        )],
    )
    .unwrap();
    megac(&["scope", "view", &p("old.safetensors"), "-o", &p("old.html")]);
    let data = page_data(&std::fs::read_to_string(p("old.html")).unwrap());
    assert_eq!(data["tokens"], Value::Null);
    assert_eq!(data["layers"][0]["index"], json!(1));
    assert_eq!(data["report"], Value::Null);

    // Many heads: the positions are cut so that the maps fit the budget of 2^20 values.
    let (heads, n) = (700usize, 40usize);
    megac_runtime::hf::save_params(
        Path::new(&p("wide.safetensors")),
        &[(
            "layers.0.attn.probs".to_string(),
            vec![1, heads, n, n],
            &vec![0.0; heads * n * n],
        )],
    )
    .unwrap();
    megac(&[
        "scope",
        "view",
        &p("wide.safetensors"),
        "-o",
        &p("wide.html"),
    ]);
    let data = page_data(&std::fs::read_to_string(p("wide.html")).unwrap());
    let shown = ((1usize << 20) as f64 / heads as f64).sqrt().floor() as usize;
    assert_eq!(data["shown"], json!(shown));
    assert!(heads * shown * shown <= 1 << 20 && heads * (shown + 1) * (shown + 1) > 1 << 20);
    let notes = data["notes"].as_array().unwrap();
    assert_eq!(
        notes[0],
        json!(format!(
            "showing positions 0 to {} of {n} (--max-positions 128)",
            shown - 1
        ))
    );
    assert!(
        notes[1]
            .as_str()
            .unwrap()
            .contains("budget of 1048576 values"),
        "{notes:?}"
    );

    // Bad input: one error each, no page written.
    std::fs::write(p("junk.safetensors"), b"not a safetensors file").unwrap();
    let e = megac_fails(&[
        "scope",
        "view",
        &p("junk.safetensors"),
        "-o",
        &p("bad.html"),
    ]);
    assert!(e.contains("not a valid safetensors file"), "{e}");
    let e = megac_fails(&[
        "scope",
        "view",
        &p("missing.safetensors"),
        "-o",
        &p("bad.html"),
    ]);
    assert!(e.contains("missing.safetensors"), "{e}");
    std::fs::write(p("short.json"), r#"{"clean_loss": 1, "perturbed_loss": 1, "kl": 0, "top1_agreement": 1, "per_position": []}"#).unwrap();
    let e = megac_fails(&[
        "scope",
        "view",
        &p("probes.safetensors"),
        "--report",
        &p("short.json"),
        "-o",
        &p("bad.html"),
    ]);
    assert!(
        e.contains("it has 0 positions but the probe file 8: not the same run"),
        "{e}"
    );
    std::fs::write(p("broken.json"), "{\"kl\": \n").unwrap();
    let e = megac_fails(&[
        "scope",
        "view",
        &p("probes.safetensors"),
        "--report",
        &p("broken.json"),
        "-o",
        &p("bad.html"),
    ]);
    assert!(e.contains("broken.json:2:"), "{e}");
    megac_runtime::hf::save_params(
        Path::new(&p("embed.safetensors")),
        &[("embed".to_string(), vec![1, 8, 1], &[0.0; 8])],
    )
    .unwrap();
    let e = megac_fails(&[
        "scope",
        "view",
        &p("embed.safetensors"),
        "-o",
        &p("bad.html"),
    ]);
    assert!(e.contains("nothing to show"), "{e}");
    assert!(!Path::new(&p("bad.html")).exists());
}
