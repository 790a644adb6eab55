//! `megac scope serve DIR`: it listens on 127.0.0.1 only, serves DIR's files, and refuses
//! every path that leaves DIR (raw or percent-encoded `..`, a symbolic link to a file
//! outside) and every method but GET and HEAD.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};

/// One raw request (the target is sent as written, never normalised by a client); the
/// status code and the body.
fn request(port: u16, line: &str) -> (u16, Vec<u8>) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "{line}\r\nHost: 127.0.0.1\r\n\r\n").unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let text = String::from_utf8_lossy(&out);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = match out.windows(4).position(|w| w == b"\r\n\r\n") {
        Some(i) => out[i + 4..].to_vec(),
        None => Vec::new(),
    };
    (status, body)
}

/// Whether a socket listening on `port` is bound to 127.0.0.1, from /proc/net/tcp (IPv4)
/// and /proc/net/tcp6: (listening sockets on the port, those on 127.0.0.1).
fn listeners(port: u16) -> (usize, usize) {
    let (mut all, mut loopback) = (0, 0);
    for file in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // local_address is HEXIP:HEXPORT; state 0A is LISTEN.
            let (Some(local), Some(state)) = (f.get(1), f.get(3)) else {
                continue;
            };
            let Some((ip, p)) = local.split_once(':') else {
                continue;
            };
            if *state == "0A" && u16::from_str_radix(p, 16) == Ok(port) {
                all += 1;
                if ip == "0100007F" {
                    loopback += 1;
                }
            }
        }
    }
    (all, loopback)
}

#[test]
fn serves_dir_only_on_loopback() {
    let base = std::env::temp_dir().join(format!("megac-scope-serve-{}", std::process::id()));
    let dir = base.join("served");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("view.html"), "<!doctype html><p>the viewer</p>").unwrap();
    std::fs::write(dir.join("r.json"), "{\"kl\": 0}").unwrap();
    std::fs::write(base.join("secret.txt"), "not to be served").unwrap();
    #[cfg(unix)]
    std::os::unix::fs::symlink(base.join("secret.txt"), dir.join("link.txt")).unwrap();

    let mut child = Command::new(env!("CARGO_BIN_EXE_megac"))
        .args(["scope", "serve", dir.to_str().unwrap(), "--port", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let result = std::panic::catch_unwind(|| {
        // "serving DIR at http://127.0.0.1:PORT/ ..."
        let port: u16 = first
            .split("http://127.0.0.1:")
            .nth(1)
            .and_then(|r| r.split('/').next())
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no loopback address in {first:?}"));

        let (status, body) = request(port, "GET /view.html HTTP/1.1");
        assert_eq!(status, 200);
        assert_eq!(body, b"<!doctype html><p>the viewer</p>");
        let (status, body) = request(port, "GET /r.json?x=1 HTTP/1.1");
        assert_eq!((status, body), (200, b"{\"kl\": 0}".to_vec()));
        let (status, body) = request(port, "GET / HTTP/1.1");
        assert_eq!(status, 200);
        let listing = String::from_utf8_lossy(&body);
        assert!(
            listing.contains("view.html") && listing.contains("r.json"),
            "{listing}"
        );
        let (status, body) = request(port, "HEAD /view.html HTTP/1.1");
        assert_eq!((status, body.len()), (200, 0));

        for target in [
            "/../secret.txt",
            "/%2e%2e/secret.txt",
            "/%2E%2E%2Fsecret.txt",
            "/a/../../secret.txt",
            "/..%5csecret.txt",
            "/link.txt",
        ] {
            let (status, body) = request(port, &format!("GET {target} HTTP/1.1"));
            assert_eq!(status, 403, "{target}");
            assert!(!String::from_utf8_lossy(&body).contains("not to be served"));
        }
        assert_eq!(request(port, "GET /missing.html HTTP/1.1").0, 404);
        assert_eq!(request(port, "GET http://example.com/ HTTP/1.1").0, 400);
        for method in ["POST", "PUT", "DELETE"] {
            assert_eq!(
                request(port, &format!("{method} /view.html HTTP/1.1")).0,
                405
            );
        }

        // Bound to 127.0.0.1 only: the one listening socket on the port is the loopback one.
        if std::path::Path::new("/proc/net/tcp").exists() {
            assert_eq!(listeners(port), (1, 1), "port {port}");
        }
    });
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&base);
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}
