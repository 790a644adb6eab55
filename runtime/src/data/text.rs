//! Text data for a Hugging Face tokenizer: the documents of a `.txt` or `.jsonl` file, and the
//! token stream they make (each document's ids, then the end-of-document id).

use super::tokenizer::{TextTokenizer, TokenizerError};

/// Whether a line is blank: nothing but spaces, tabs and a carriage return.
fn blank(line: &str) -> bool {
    line.trim_matches([' ', '\t', '\r']).is_empty()
}

/// The documents of a `.txt` file: its paragraphs, i.e. the runs of non-blank lines (split at
/// `\n`, a trailing `\r` dropped from each line), each joined with `\n`. Blank lines separate
/// documents and belong to none.
pub fn txt_documents(text: &str) -> Vec<String> {
    let mut docs = Vec::new();
    let mut cur: Vec<&str> = Vec::new();
    for line in text.split('\n') {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if blank(line) {
            if !cur.is_empty() {
                docs.push(cur.join("\n"));
                cur.clear();
            }
        } else {
            cur.push(line);
        }
    }
    if !cur.is_empty() {
        docs.push(cur.join("\n"));
    }
    docs
}

/// The documents of a `.jsonl` file: the string field `text` of the JSON object on each
/// non-blank line, in order. An error says which line (1-based) and what is wrong.
pub fn jsonl_documents(text: &str) -> Result<Vec<String>, String> {
    let mut docs = Vec::new();
    for (i, line) in text.split('\n').enumerate() {
        if blank(line) {
            continue;
        }
        let n = i + 1;
        let value: serde_json::Value = serde_json::from_str(line).map_err(|e| {
            // serde_json's message ends with its own (single-line) position.
            let msg = e.to_string();
            let msg = msg.find(" at line ").map_or(msg.as_str(), |i| &msg[..i]);
            format!("line {n}, column {}: not JSON: {msg}", e.column())
        })?;
        let Some(obj) = value.as_object() else {
            return Err(format!(
                "line {n}: expected a JSON object with a \"text\" field"
            ));
        };
        match obj.get("text") {
            Some(serde_json::Value::String(s)) => docs.push(s.clone()),
            Some(other) => {
                return Err(format!(
                    "line {n}: the \"text\" field is {}, not a string",
                    json_kind(other)
                ))
            }
            None => return Err(format!("line {n}: the object has no \"text\" field")),
        }
    }
    Ok(docs)
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// The token stream of `docs`: each document encoded with the tokenizer's special tokens,
/// followed by `eos` unless its encoding already ends with it (a post-processor that appends
/// EOS), as Megatron's preprocess_data.py `--append-eod` lays documents out.
pub fn token_stream(
    tok: &TextTokenizer,
    docs: &[String],
    eos: u32,
) -> Result<Vec<u32>, TokenizerError> {
    let mut out = Vec::new();
    // Batches bound the memory of the encodings held at once.
    for chunk in docs.chunks(4096) {
        for ids in tok.encode_all(chunk)? {
            let ends_with_eos = ids.last() == Some(&eos);
            out.extend_from_slice(&ids);
            if !ends_with_eos {
                out.push(eos);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paragraphs() {
        let d = txt_documents("a\nb\r\n\n \t\nc\n\n\n");
        assert_eq!(d, vec!["a\nb".to_string(), "c".to_string()]);
        assert!(txt_documents("\n\n").is_empty());
    }

    #[test]
    fn jsonl_errors_name_the_line() {
        assert_eq!(
            jsonl_documents("{\"text\":\"x\"}\n\n{\"t\":1}\n").unwrap_err(),
            "line 3: the object has no \"text\" field"
        );
        assert!(jsonl_documents("{\"text\":1}")
            .unwrap_err()
            .contains("a number"));
        assert!(jsonl_documents("[1]").unwrap_err().contains("object"));
        assert!(jsonl_documents("{")
            .unwrap_err()
            .starts_with("line 1, column"));
    }
}
