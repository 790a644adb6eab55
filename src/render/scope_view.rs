//! The page of `megac scope view`: one self-contained HTML file (`scope_view.html`: inline
//! CSS and vanilla JavaScript drawing on canvases), with the data as JSON in a script element.
//! It loads nothing from anywhere (no fonts, scripts or images), so it opens from disk.

use serde_json::Value;

/// The page's template; `__MEGAC_DATA__` is replaced by the data.
const TEMPLATE: &str = include_str!("scope_view.html");

/// The page for `data` (see commands::scope_view for its fields).
pub fn page(data: &Value) -> String {
    // `<` only occurs inside JSON strings, where `\u003c` means the same: no `</script>`
    // in a prompt can end the script element early.
    let json = data.to_string().replace('<', "\\u003c");
    TEMPLATE.replacen("__MEGAC_DATA__", &json, 1)
}

/// `values` as little-endian float32 bytes in base64 (the page decodes them into a
/// Float32Array).
pub fn base64_f32(values: &[f32]) -> String {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    base64(&bytes)
}

/// Standard base64 (RFC 4648, with padding).
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc4648_vectors() {
        for (input, want) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(input.as_bytes()), want);
        }
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
    }

    #[test]
    fn data_cannot_close_the_script() {
        let html = page(&serde_json::json!({"prompt": "</script><b>"}));
        assert!(!html.contains("</script><b>"));
        assert!(html.contains("\\u003c/script>\\u003cb>"));
    }
}
