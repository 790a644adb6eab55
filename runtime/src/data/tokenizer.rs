//! Hugging Face tokenizers (`tokenizer.json`, the `tokenizers` crate): text to token ids for
//! `.txt` / `.jsonl` data and prompts, ids back to text for generated tokens.

use std::path::Path;

/// A Hugging Face tokenizer and what megac needs to know about it: the vocabulary it can
/// produce and its end-of-document token.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    path: String,
    vocab: u32,
    eos: Option<(u32, String)>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("path", &self.path)
            .field("vocab", &self.vocab)
            .field("eos", &self.eos)
            .finish()
    }
}

/// Names of end-of-document tokens, in order of preference, for a tokenizer that has no
/// `tokenizer_config.json` beside it saying which one it is.
pub const EOS_NAMES: &[&str] = &[
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<eos>",
    "<|eos|>",
    "[EOS]",
];

/// An error about the tokenizer file: its path and what is wrong.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenizerError {
    /// The tokenizer file.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl TextTokenizer {
    /// Load `path` (a `tokenizer.json`). The end-of-document token is `eos` when given (an
    /// id, i.e. a decimal number, or a token's text, e.g. `<|endoftext|>`); otherwise the `eos_token` of
    /// a `tokenizer_config.json` in the same folder; otherwise the first special added token
    /// named in [`EOS_NAMES`]; otherwise there is none ([`TextTokenizer::eos`] says so).
    pub fn open(path: &Path, eos: Option<&str>) -> Result<TextTokenizer, TokenizerError> {
        let name = path.display().to_string();
        let err = |message: String| TokenizerError {
            path: name.clone(),
            message,
        };
        let bytes = std::fs::read(path).map_err(|e| err(format!("cannot read: {e}")))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| err(format!("not a Hugging Face tokenizer.json: {e}")))?;
        let vocab = inner
            .get_vocab(true)
            .values()
            .copied()
            .max()
            .map_or(0, |m| m.saturating_add(1));
        let mut tok = TextTokenizer {
            inner,
            path: name.clone(),
            vocab,
            eos: None,
        };
        tok.eos = match eos {
            Some(e) => Some(tok.resolve(e).ok_or_else(|| {
                err(format!(
                    "--eos {e}: not a token of the tokenizer (give its id below {vocab}, or \
                     its text, e.g. <|endoftext|>)"
                ))
            })?),
            None => tok.config_eos(path).or_else(|| tok.named_eos()),
        };
        Ok(tok)
    }

    /// A token by id (a decimal number) or by text.
    fn resolve(&self, token: &str) -> Option<(u32, String)> {
        match token.parse::<u32>() {
            Ok(id) => self.inner.id_to_token(id).map(|t| (id, t)),
            Err(_) => self
                .inner
                .token_to_id(token)
                .map(|id| (id, token.to_string())),
        }
    }

    /// `eos_token` of `tokenizer_config.json` beside the tokenizer (a string or
    /// `{"content": ...}`), when it is a token of the vocabulary.
    fn config_eos(&self, path: &Path) -> Option<(u32, String)> {
        let config = path.parent()?.join("tokenizer_config.json");
        let text = std::fs::read_to_string(config).ok()?;
        let json: serde_json::Value = serde_json::from_str(&text).ok()?;
        let eos = match &json["eos_token"] {
            serde_json::Value::String(s) => s.clone(),
            v => v["content"].as_str()?.to_string(),
        };
        let id = self.inner.token_to_id(&eos)?;
        Some((id, eos))
    }

    /// The first special added token named in [`EOS_NAMES`].
    fn named_eos(&self) -> Option<(u32, String)> {
        let added = self.inner.get_added_tokens_decoder();
        EOS_NAMES.iter().find_map(|name| {
            added
                .iter()
                .find(|(_, t)| t.special && t.content == *name)
                .map(|(&id, t)| (id, t.content.clone()))
        })
    }

    /// The tokenizer file as the user gave it.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The ids it can produce are `0..vocab_size()` (its largest id, added tokens included,
    /// plus one).
    pub fn vocab_size(&self) -> u32 {
        self.vocab
    }

    /// The end-of-document token (id, text), if one is known.
    pub fn eos(&self) -> Option<(u32, &str)> {
        self.eos.as_ref().map(|(id, t)| (*id, t.as_str()))
    }

    /// Check that the model's vocabulary holds every id the tokenizer produces.
    pub fn check_vocab(&self, model_vocab: u32) -> Result<(), TokenizerError> {
        if self.vocab > model_vocab {
            return Err(TokenizerError {
                path: self.path.clone(),
                message: format!(
                    "its vocabulary has {} tokens (ids 0..{}), more than the model's vocab \
                     {model_vocab}: set model.vocab to at least {}",
                    self.vocab, self.vocab, self.vocab
                ),
            });
        }
        Ok(())
    }

    /// Encode `text` with the tokenizer's special tokens (its post-processor, e.g. a BOS), as
    /// `tokenizer(text)` in transformers and Megatron's preprocess_data.py do.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.inner
            .encode(text, true)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError {
                path: self.path.clone(),
                message: format!("cannot encode: {e}"),
            })
    }

    /// Encode many texts (in parallel), each as [`TextTokenizer::encode`].
    pub fn encode_all(&self, texts: &[String]) -> Result<Vec<Vec<u32>>, TokenizerError> {
        let inputs: Vec<&str> = texts.iter().map(String::as_str).collect();
        self.inner
            .encode_batch(inputs, true)
            .map(|v| v.iter().map(|e| e.get_ids().to_vec()).collect())
            .map_err(|e| TokenizerError {
                path: self.path.clone(),
                message: format!("cannot encode: {e}"),
            })
    }

    /// Decode ids to text, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner.decode(ids, false).map_err(|e| TokenizerError {
            path: self.path.clone(),
            message: format!("cannot decode: {e}"),
        })
    }
}
