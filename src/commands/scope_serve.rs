//! `megac scope serve DIR`: serve the files of one folder (the viewer pages and probe files
//! of `megac scope`) over HTTP on the loopback interface only.
//!
//! It binds 127.0.0.1 (never another interface), answers `GET` and `HEAD` with a file of DIR
//! or, for `/`, a listing of DIR's files, and executes nothing a client sends: a request is
//! only ever mapped to a path, and a path that leaves DIR (a `..` segment, raw or
//! percent-encoded, a backslash, a NUL, or a symbolic link whose target lies outside DIR)
//! is refused with 403. Any other method is 405. One connection at a time, closed after
//! each answer.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Options of `megac scope serve`.
#[derive(clap::Args)]
pub struct ServeArgs {
    /// The folder whose files are served (e.g. the one holding view.html and its probes).
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
    /// The port on 127.0.0.1 (0: any free port; the first line printed says which).
    #[arg(long, default_value_t = 8000, value_name = "P")]
    pub port: u16,
}

/// The longest request head read (request line and headers).
const MAX_HEAD: u64 = 16 * 1024;

/// `megac scope serve`: serve until the process is stopped (returns only on an error
/// before serving).
pub fn run(args: &ServeArgs) -> Result<(), String> {
    let root = args
        .dir
        .canonicalize()
        .map_err(|e| format!("error: {}: {e}", args.dir.display()))?;
    if !root.is_dir() {
        return Err(format!("error: {}: not a folder", args.dir.display()));
    }
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, args.port))
        .map_err(|e| format!("error: cannot listen on 127.0.0.1:{}: {e}", args.port))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("error: cannot listen on 127.0.0.1:{}: {e}", args.port))?;
    println!(
        "serving {} at http://{addr}/ (loopback only; Ctrl-C stops)",
        root.display()
    );
    let _ = std::io::stdout().flush();
    loop {
        match listener.accept() {
            // A failed answer is the client's business; keep serving.
            Ok((stream, _)) => {
                let _ = answer(stream, &root);
            }
            // E.g. out of file descriptors: wait a little rather than spin.
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// An HTTP answer: status, content type, body.
struct Reply {
    status: u16,
    kind: &'static str,
    body: Vec<u8>,
}

impl Reply {
    fn text(status: u16, message: &str) -> Reply {
        Reply {
            status,
            kind: "text/plain; charset=utf-8",
            body: format!("{status} {message}\n").into_bytes(),
        }
    }
}

/// Read one request from `stream` and answer it.
fn answer(stream: TcpStream, root: &Path) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut reader = BufReader::new((&stream).take(MAX_HEAD));
    let mut line = String::new();
    reader.read_line(&mut line)?;
    // The headers, up to the blank line (none is used).
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h == "\r\n" || h == "\n" {
            break;
        }
    }
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let reply = match method {
        "GET" | "HEAD" => serve(root, target),
        "" => Reply::text(400, "Bad Request"),
        _ => Reply::text(405, "Method Not Allowed (only GET and HEAD)"),
    };
    let reason = match reply.status {
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        _ => "Method Not Allowed",
    };
    let mut out = &stream;
    write!(
        out,
        "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\nX-Content-Type-Options: nosniff\r\nCache-Control: no-store\r\nConnection: close\r\n{}\r\n",
        reply.status,
        reply.kind,
        reply.body.len(),
        if reply.status == 405 { "Allow: GET, HEAD\r\n" } else { "" },
    )?;
    if method != "HEAD" {
        out.write_all(&reply.body)?;
    }
    out.flush()
}

/// The answer to `GET target`: a file of `root`, the listing of `root`, or an error.
fn serve(root: &Path, target: &str) -> Reply {
    let path = target.split(['?', '#']).next().unwrap_or("");
    let Some(rel) = path.strip_prefix('/') else {
        return Reply::text(400, "Bad Request");
    };
    let Some(rel) = percent_decode(rel) else {
        return Reply::text(400, "Bad Request");
    };
    if rel.contains(['\\', '\0']) || rel.split('/').any(|s| s == "..") {
        return Reply::text(403, "Forbidden (outside the served folder)");
    }
    if rel.is_empty() {
        return listing(root);
    }
    let Ok(file) = root.join(&rel).canonicalize() else {
        return Reply::text(404, "Not Found");
    };
    // A symbolic link may point anywhere: what it resolves to must lie inside root.
    if !file.starts_with(root) {
        return Reply::text(403, "Forbidden (outside the served folder)");
    }
    if !file.is_file() {
        return Reply::text(404, "Not Found");
    }
    match std::fs::read(&file) {
        Ok(body) => Reply {
            status: 200,
            kind: content_type(&file),
            body,
        },
        Err(_) => Reply::text(404, "Not Found"),
    }
}

/// A page linking the files directly in `root` (names HTML-escaped and percent-encoded).
fn listing(root: &Path) -> Reply {
    let mut names: Vec<String> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_file())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort();
    let mut html = String::from(
        "<!doctype html><meta charset=\"utf-8\"><title>megac scope serve</title><ul>\n",
    );
    for n in &names {
        let href: String = n
            .bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                    (b as char).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect();
        html.push_str(&format!("<li><a href=\"{href}\">{}</a></li>\n", escape(n)));
    }
    html.push_str("</ul>\n");
    Reply {
        status: 200,
        kind: "text/html; charset=utf-8",
        body: html.into_bytes(),
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// `%XX` decoded (None: a malformed escape or bytes that are not UTF-8).
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

fn content_type(path: &Path) -> &'static str {
    match path.extension().and_then(|e| e.to_str()).unwrap_or("") {
        "html" | "htm" => "text/html; charset=utf-8",
        "json" => "application/json",
        "svg" => "image/svg+xml",
        "png" => "image/png",
        "txt" | "md" => "text/plain; charset=utf-8",
        _ => "application/octet-stream",
    }
}
