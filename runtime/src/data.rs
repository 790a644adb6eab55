//! Training data: a synthetic generator or a token file, read as windows of `seq_len + 1`
//! tokens indexed by a *global sample index*.
//!
//! Every layout (any DP, PP, TP split) draws the same global samples for the same step, so
//! all layouts see the same global batch. Step `k` (counted from 0) uses the global samples
//! `k*G .. (k+1)*G - 1`, where `G` is the global batch size ([`step_samples`]). A rank that
//! owns part of the global batch fills its buffers with [`DataSource::fill_batch`] starting at
//! its first global sample.
//!
//! Kinds of data (the `--data` argument, see docs/data.md):
//! - `synthetic`: a deterministic, learnable generator (see [`DataSource::Synthetic`]).
//! - `FILE.bin`: raw little-endian `u32` token ids, back to back.
//! - `FILE.txt`: UTF-8 (or any) text, tokenized byte by byte: token id = byte value (0..=255);
//!   with a Hugging Face tokenizer ([`DataOptions::tokenizer`]), one document per paragraph.
//! - `FILE.jsonl` (needs a tokenizer): one document per line, its `text` field ([`text`]).
//! - `PREFIX` (`PREFIX.bin` + `PREFIX.idx`) or a blend `"W1 PREFIX1 W2 PREFIX2"`: Megatron's
//!   indexed datasets, sampled as megatron-core's GPTDataset / BlendedDataset ([`megatron`]).
//!
//! Sample `i` of a token file is the window `tokens[w*(S+1) .. (w+1)*(S+1)]` with
//! `w = i mod floor(len / (S+1))`: the inputs are its first `S` tokens, the labels its last
//! `S` (the inputs shifted by one). Tokens after the last whole window are never used.
//! Tokenized text is a token file too: the documents' ids, each followed by the EOS id.
//! Megatron data has its own samples (document-spanning, shuffled; see [`megatron`]).

pub mod megatron;
mod numpy_rng;
pub mod text;
pub mod tokenizer;

use std::fs::File;
use std::io::{ErrorKind, Read};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::RuntimeError;
pub use megatron::DataSplit;

/// The vocabulary the byte-level tokenizer of `.txt` files needs: one id per byte value.
pub const BYTE_VOCAB: u32 = 256;

/// The largest vocabulary the data path supports: token ids are handed to kernels as `i32`.
pub const MAX_VOCAB: u32 = 1 << 31;

/// Out of how many positions one is noise in synthetic data (see [`DataSource::Synthetic`]).
pub const SYNTHETIC_NOISE_ONE_IN: u64 = 16;

/// Where training samples come from.
#[derive(Clone, Debug, PartialEq)]
pub enum DataSource {
    /// Generated data, a pure function of `(seed, global sample index, position)`.
    ///
    /// Each sample is a sequence `x_0 .. x_S` (`S + 1` tokens) produced by a linear
    /// congruential rule chosen per sample: `r = h(seed, i, RULE) mod 8`, `a = 1 + 2*(r mod 4)`
    /// (1, 3, 5 or 7), `c = 1 + 4*(r div 4)` (1 or 5). `x_0 = h(seed, i, 0) mod vocab`, and
    /// for `t >= 1`, with `h_t = h(seed, i, t)`: if `h_t mod 16 == 0` then
    /// `x_t = (h_t >> 32) mod vocab` (noise, one position in 16), otherwise
    /// `x_t = (a * x_{t-1} + c) mod vocab`. `h` is a splitmix64 chain over
    /// `(seed, i, t)`. A model that learns the eight rules and infers which one a sequence uses
    /// from its context predicts 15 of 16 tokens: the loss falls from `ln(vocab)` towards
    /// the noise floor. Samples do not depend on the batch, the layout or `seq_len` (a longer
    /// sample extends a shorter one with the same index).
    Synthetic {
        /// The run's seed.
        seed: u64,
        /// Token ids are drawn from `0..vocab`.
        vocab: u32,
    },
    /// Token ids read from a `.bin` or `.txt` file, all checked to be `< vocab`, at least
    /// one window long.
    Tokens {
        /// The token ids, in file order.
        tokens: Vec<u32>,
        /// The file path as the user gave it (for messages and reports).
        name: String,
    },
    /// A Megatron indexed dataset's split or a blend of several, with megatron-core's
    /// indices (shared, read-only: clones are cheap).
    Megatron {
        /// The samples.
        data: Arc<megatron::MegatronData>,
        /// The spec as the user gave it.
        name: String,
    },
}

/// How to read a data spec besides the model's sizes: the tokenizer for text, and Megatron's
/// split and sample count. `Default` is plain `--data` (no tokenizer, Megatron's legacy split
/// `969,30,1`, its train part, one epoch).
#[derive(Clone, Debug, PartialEq)]
pub struct DataOptions {
    /// A Hugging Face `tokenizer.json` for `.txt` and `.jsonl` data (and, when given, checked
    /// against the model's vocab whatever the data).
    pub tokenizer: Option<PathBuf>,
    /// The end-of-document token (text or id) when the tokenizer does not say.
    pub eos: Option<String>,
    /// Megatron's split string (train,valid,test weights).
    pub split: String,
    /// Which part of the split Megatron data is read from.
    pub split_part: DataSplit,
    /// How many samples the run reads (global samples `0..n`; Megatron's `train_samples`),
    /// which decides how many epochs Megatron's indices hold. None: one epoch.
    pub samples: Option<u64>,
}

/// Megatron-LM's default `--split` when none is given (its legacy default).
pub const DEFAULT_SPLIT: &str = "969,30,1";

impl Default for DataOptions {
    fn default() -> Self {
        DataOptions {
            tokenizer: None,
            eos: None,
            split: DEFAULT_SPLIT.to_string(),
            split_part: DataSplit::Train,
            samples: None,
        }
    }
}

impl DataSource {
    /// Open the data named by `spec`: `synthetic`, or a path ending in `.bin` (little-endian
    /// u32 token ids) or `.txt` (text, byte-level tokens; needs `vocab >= 256`).
    ///
    /// Checks everything [`DataSource::sample`] relies on: the file is readable and well
    /// formed, holds at least `seq_len + 1` tokens (one sample), and every id is `< vocab`.
    pub fn open(
        spec: &str,
        seq_len: usize,
        vocab: u32,
        seed: u64,
    ) -> Result<DataSource, RuntimeError> {
        DataSource::open_with(spec, &DataOptions::default(), seq_len, vocab, seed)
    }

    /// Open the data named by `spec` with `opts` (see the module documentation and
    /// docs/data.md): besides [`DataSource::open`]'s kinds, `.txt` and `.jsonl` text for a
    /// tokenizer, a Megatron `PREFIX` (`PREFIX.idx` exists) and a Megatron blend
    /// (`"W1 PREFIX1 W2 PREFIX2 ..."`). Everything is checked here, before any training: a
    /// tokenizer larger than `vocab`, a token id `>= vocab`, a malformed index or blend.
    pub fn open_with(
        spec: &str,
        opts: &DataOptions,
        seq_len: usize,
        vocab: u32,
        seed: u64,
    ) -> Result<DataSource, RuntimeError> {
        let err = |message: String| RuntimeError::Data {
            source_name: spec.to_string(),
            message,
        };
        check_sizes(seq_len, vocab).map_err(err)?;
        let tokenizer = match &opts.tokenizer {
            Some(p) => {
                let t = tokenizer::TextTokenizer::open(p, opts.eos.as_deref())?;
                t.check_vocab(vocab)?;
                Some(t)
            }
            None => None,
        };
        if spec == "synthetic" {
            return Ok(DataSource::Synthetic { seed, vocab });
        }
        if spec.split_whitespace().count() > 1 || megatron::is_prefix(spec) {
            let mopts = megatron::MegatronOptions {
                split: &opts.split,
                which: opts.split_part,
                num_samples: opts.samples,
                seq_len,
                seed: u32::try_from(seed).map_err(|_| {
                    err(format!(
                        "Megatron datasets are shuffled with numpy's RandomState, which takes a                          32-bit seed; the run's seed is {seed}"
                    ))
                })?,
                vocab,
            };
            let data = if spec.split_whitespace().count() > 1 {
                megatron::MegatronData::open_blend(spec, &mopts)?
            } else {
                megatron::MegatronData::open_single(spec, &mopts)?
            };
            return Ok(DataSource::Megatron {
                data: Arc::new(data),
                name: spec.to_string(),
            });
        }
        let path = Path::new(spec);
        if path.is_dir() {
            return Err(err(
                "is a directory; expected `synthetic`, a `.bin` file (little-endian u32 token \
                 ids) or a `.txt` file (text, byte-level tokens)"
                    .to_string(),
            ));
        }
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(|e| e.to_ascii_lowercase());
        let format = match ext.as_deref() {
            Some("bin") => TokenFormat::Bin,
            Some("txt") => TokenFormat::Txt,
            Some("jsonl") => TokenFormat::Jsonl,
            _ => {
                return Err(err(format!(
                    "unknown kind of data: expected `synthetic`, a `.bin` file (little-endian \
                     u32 token ids), a `.txt` file (text), a `.jsonl` file (a \"text\" field \
                     per line, with --tokenizer), a Megatron dataset prefix (no {spec}.idx \
                     found) or a blend \"W1 PREFIX1 W2 PREFIX2\""
                )))
            }
        };
        if format == TokenFormat::Bin {
            if let Some(prefix) = spec.strip_suffix(".bin").filter(|p| megatron::is_prefix(p)) {
                return Err(err(format!(
                    "{prefix}.idx is beside it: a Megatron dataset is named by its prefix, \
                     --data {prefix} (a .bin file alone is read as raw u32 token ids)"
                )));
            }
        }
        if let Some(tok) = &tokenizer {
            if format != TokenFormat::Bin {
                return DataSource::open_text(spec, format, tok, seq_len);
            }
        } else if format == TokenFormat::Jsonl {
            return Err(err(
                "a .jsonl file is text: give its tokenizer with --tokenizer tokenizer.json"
                    .to_string(),
            ));
        }
        let kind = format.extension();
        let file = File::open(path).map_err(|e| err(format!("cannot open {kind} file: {e}")))?;
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        DataSource::from_reader(spec, format, file, size, seq_len, vocab)
    }

    /// Read a token file of `format` from `reader` (`size_hint`: its length in bytes, or 0 if
    /// unknown), with the checks of [`DataSource::open`]; `name` names it in messages.
    ///
    /// Never panics and never aborts on any input: a file too large for memory is an error
    /// (the memory is reserved fallibly), and so is every malformed or unusable file.
    pub fn from_reader<R: Read>(
        name: &str,
        format: TokenFormat,
        reader: R,
        size_hint: u64,
        seq_len: usize,
        vocab: u32,
    ) -> Result<DataSource, RuntimeError> {
        let err = |message: String| RuntimeError::Data {
            source_name: name.to_string(),
            message,
        };
        check_sizes(seq_len, vocab).map_err(err)?;
        let tokens = match format {
            TokenFormat::Bin => read_bin(reader, size_hint).map_err(err)?,
            TokenFormat::Txt => {
                if vocab < BYTE_VOCAB {
                    return Err(err(format!(
                        "a .txt file is tokenized byte by byte (token ids 0..=255), so the \
                         model's vocab must be at least {BYTE_VOCAB}, but it is {vocab}"
                    )));
                }
                read_txt(reader, size_hint).map_err(err)?
            }
            TokenFormat::Jsonl => {
                return Err(err(
                    "a .jsonl file is text: give its tokenizer with --tokenizer tokenizer.json"
                        .to_string(),
                ))
            }
        };
        // `check_sizes` bounds seq_len, so the window cannot overflow.
        let window = seq_len as u64 + 1;
        if (tokens.len() as u64) < window {
            return Err(err(format!(
                "needs at least {window} tokens for one sample (seq_len {seq_len} + 1), \
                 file has {}",
                tokens.len()
            )));
        }
        if let Some((pos, &id)) = tokens.iter().enumerate().find(|(_, &t)| t >= vocab) {
            return Err(err(format!(
                "token id {id} at position {pos} is out of range for vocab {vocab} \
                 (ids must be < {vocab})"
            )));
        }
        Ok(DataSource::Tokens {
            tokens,
            name: name.to_string(),
        })
    }

    /// Read `.txt` or `.jsonl` text and tokenize it with `tok` (see [`text`]).
    fn open_text(
        spec: &str,
        format: TokenFormat,
        tok: &tokenizer::TextTokenizer,
        seq_len: usize,
    ) -> Result<DataSource, RuntimeError> {
        let err = |message: String| RuntimeError::Data {
            source_name: spec.to_string(),
            message,
        };
        let kind = format.extension();
        let bytes =
            std::fs::read(spec).map_err(|e| err(format!("cannot read {kind} file: {e}")))?;
        let text = std::str::from_utf8(&bytes).map_err(|e| {
            let at = e.valid_up_to();
            let line = bytes[..at].iter().filter(|&&b| b == b'\n').count() + 1;
            err(format!(
                "line {line}: not UTF-8 (byte {at}); a tokenizer reads UTF-8 text"
            ))
        })?;
        let docs = match format {
            TokenFormat::Jsonl => text::jsonl_documents(text).map_err(err)?,
            _ => text::txt_documents(text),
        };
        let Some((eos, _)) = tok.eos() else {
            return Err(RuntimeError::Tokenizer {
                path: tok.path().to_string(),
                message: format!(
                    "cannot tell its end-of-document token (no tokenizer_config.json eos_token \
                     beside it, no special token named {}): give it with --eos TOKEN",
                    tokenizer::EOS_NAMES.join(", ")
                ),
            });
        };
        let tokens = text::token_stream(tok, &docs, eos)?;
        let window = seq_len as u64 + 1;
        if (tokens.len() as u64) < window {
            return Err(err(format!(
                "needs at least {window} tokens for one sample (seq_len {seq_len} + 1), its {} \
                 document(s) make {} with {}",
                docs.len(),
                tokens.len(),
                tok.path()
            )));
        }
        Ok(DataSource::Tokens {
            tokens,
            name: spec.to_string(),
        })
    }

    /// The source's name for messages and reports: `synthetic` or the file path.
    pub fn name(&self) -> &str {
        match self {
            DataSource::Synthetic { .. } => "synthetic",
            DataSource::Tokens { name, .. } | DataSource::Megatron { name, .. } => name,
        }
    }

    /// How many distinct samples of `seq_len` a token file holds (`floor(len / (seq_len+1))`;
    /// sample indices wrap around modulo this), or `None` for synthetic data (unbounded).
    /// Megatron data: the samples its indices hold (for the `seq_len` it was opened with).
    pub fn samples_in_file(&self, seq_len: usize) -> Option<u64> {
        match self {
            DataSource::Synthetic { .. } => None,
            DataSource::Megatron { data, .. } => Some(data.len()),
            DataSource::Tokens { tokens, .. } => {
                Some(tokens.len() as u64 / (seq_len as u64).saturating_add(1))
            }
        }
    }

    /// Write global sample `index` into `inputs` (its first `seq_len` tokens) and `labels`
    /// (its last `seq_len` tokens, i.e. the inputs shifted left by one).
    ///
    /// # Panics
    /// If `inputs` or `labels` is not exactly `seq_len` long, or (token files) if `seq_len` is
    /// longer than the file allows, i.e. larger than the `seq_len` checked by
    /// [`DataSource::open`]. Both are caller bugs, not data errors.
    pub fn sample(&self, index: u64, seq_len: usize, inputs: &mut [i32], labels: &mut [i32]) {
        assert_eq!(
            inputs.len(),
            seq_len,
            "inputs buffer must hold seq_len tokens"
        );
        assert_eq!(
            labels.len(),
            seq_len,
            "labels buffer must hold seq_len tokens"
        );
        match self {
            DataSource::Synthetic { seed, vocab } => {
                synthetic_sample(*seed, *vocab, index, inputs, labels)
            }
            DataSource::Tokens { tokens, name } => {
                let count = self.samples_in_file(seq_len).unwrap_or(0);
                assert!(
                    count > 0,
                    "data {name}: seq_len {seq_len} needs {} tokens, file has {}",
                    seq_len + 1,
                    tokens.len()
                );
                let start = (index % count) as usize * (seq_len + 1);
                let window = &tokens[start..start + seq_len + 1];
                for (dst, &src) in inputs.iter_mut().zip(&window[..seq_len]) {
                    *dst = src as i32;
                }
                for (dst, &src) in labels.iter_mut().zip(&window[1..]) {
                    *dst = src as i32;
                }
            }
            DataSource::Megatron { data, .. } => {
                let mut window = Vec::with_capacity(seq_len + 1);
                data.sample_into(index, &mut window);
                assert_eq!(
                    window.len(),
                    seq_len + 1,
                    "Megatron data opened for another seq_len"
                );
                for (dst, &src) in inputs.iter_mut().zip(&window[..seq_len]) {
                    *dst = src as i32;
                }
                for (dst, &src) in labels.iter_mut().zip(&window[1..]) {
                    *dst = src as i32;
                }
            }
        }
    }

    /// Fill `inputs` and `labels` (both `n * seq_len` long, row-major `[n, seq_len]`) with
    /// the `n` consecutive global samples `first .. first + n`. For a whole step `k` with
    /// global batch `G`, pass `first = step_samples(k, G).start` and buffers of `G * seq_len`;
    /// a rank holding a slice of the batch passes its own first sample.
    ///
    /// # Panics
    /// If the buffers differ in length or are not a multiple of `seq_len` long (and as
    /// [`DataSource::sample`]).
    pub fn fill_batch(&self, first: u64, seq_len: usize, inputs: &mut [i32], labels: &mut [i32]) {
        assert!(seq_len > 0, "seq_len must be at least 1");
        assert_eq!(
            inputs.len(),
            labels.len(),
            "inputs and labels must be as long"
        );
        assert!(
            inputs.len().is_multiple_of(seq_len),
            "buffers must hold whole samples"
        );
        for (row, (inp, lab)) in inputs
            .chunks_exact_mut(seq_len)
            .zip(labels.chunks_exact_mut(seq_len))
            .enumerate()
        {
            self.sample(first + row as u64, seq_len, inp, lab);
        }
    }
}

/// The global sample indices of step `step` (counted from 0) with global batch size
/// `global_batch`: `step*G .. (step+1)*G`. Token files wrap around (see
/// [`DataSource::samples_in_file`]); synthetic data never repeats.
pub fn step_samples(step: u64, global_batch: u64) -> Range<u64> {
    step * global_batch..(step + 1) * global_batch
}

/// splitmix64's output function applied to `x + gamma` (one step of the generator).
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The counter-based hash behind synthetic data: independent per `(seed, index, pos)`.
fn hash3(seed: u64, index: u64, pos: u64) -> u64 {
    splitmix64(splitmix64(splitmix64(seed) ^ index) ^ pos)
}

/// The `pos` used to draw a sample's rule (no token position reaches it).
const RULE_POS: u64 = u64::MAX;

/// Generate synthetic sample `index` (see [`DataSource::Synthetic`]).
fn synthetic_sample(seed: u64, vocab: u32, index: u64, inputs: &mut [i32], labels: &mut [i32]) {
    let seq_len = inputs.len();
    let vocab = u64::from(vocab);
    let rule = hash3(seed, index, RULE_POS) % 8;
    let a = 1 + 2 * (rule % 4);
    let c = 1 + 4 * (rule / 4);
    let mut prev = hash3(seed, index, 0) % vocab;
    if seq_len > 0 {
        inputs[0] = prev as i32;
    }
    for t in 1..=seq_len {
        let h = hash3(seed, index, t as u64);
        let token = if h.is_multiple_of(SYNTHETIC_NOISE_ONE_IN) {
            (h >> 32) % vocab
        } else {
            (a * prev + c) % vocab
        };
        if t < seq_len {
            inputs[t] = token as i32;
        }
        labels[t - 1] = token as i32;
        prev = token;
    }
}

/// The format of a token file, chosen by its extension (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenFormat {
    /// `.bin`: little-endian `u32` token ids, back to back.
    Bin,
    /// `.txt`: bytes, one token per byte (with a tokenizer: paragraphs of text).
    Txt,
    /// `.jsonl`: one JSON object per line, its `text` field a document (needs a tokenizer).
    Jsonl,
}

impl TokenFormat {
    /// The file extension, with its dot, for messages.
    pub fn extension(self) -> &'static str {
        match self {
            TokenFormat::Bin => ".bin",
            TokenFormat::Txt => ".txt",
            TokenFormat::Jsonl => ".jsonl",
        }
    }
}

/// The largest `seq_len` a data source accepts: a window of `seq_len + 1` tokens must be
/// addressable.
pub const MAX_SEQ_LEN: usize = 1 << 40;

/// The checks on the model sizes every data source relies on.
fn check_sizes(seq_len: usize, vocab: u32) -> Result<(), String> {
    if seq_len == 0 {
        return Err("seq_len must be at least 1".to_string());
    }
    if seq_len > MAX_SEQ_LEN {
        return Err(format!(
            "seq_len {seq_len} is too large (at most {MAX_SEQ_LEN})"
        ));
    }
    if vocab == 0 {
        return Err("vocab must be at least 1".to_string());
    }
    if vocab > MAX_VOCAB {
        return Err(format!(
            "vocab {vocab} is too large: token ids must fit in i32 (vocab <= {MAX_VOCAB})"
        ));
    }
    Ok(())
}

/// Reserve room for `n` more items (amortized, fallibly), or say that a file of at least
/// `size` bytes does not fit in memory.
fn reserve<T>(v: &mut Vec<T>, n: u64, size: u64, kind: &str) -> Result<(), String> {
    usize::try_from(n)
        .ok()
        .and_then(|n| v.try_reserve(n).ok())
        .ok_or_else(|| {
            format!(
                "the {kind} file is {size} bytes or more: not enough memory to read it \
                 ({} more bytes needed)",
                n.saturating_mul(std::mem::size_of::<T>() as u64)
            )
        })
}

/// Read a `.bin` token file: little-endian u32 ids, back to back.
fn read_bin<R: Read>(mut reader: R, size_hint: u64) -> Result<Vec<u32>, String> {
    let mut tokens = Vec::new();
    reserve(&mut tokens, size_hint / 4, size_hint, ".bin")?;
    // A read buffer of the file's size (plus room to see its end), within 4 KiB .. 1 MiB.
    let buf_len =
        usize::try_from(size_hint.saturating_add(8)).map_or(1 << 20, |n| n.clamp(1 << 12, 1 << 20));
    let mut buf = vec![0u8; buf_len];
    let mut pending = 0usize;
    let mut total = 0u64;
    loop {
        let n = match reader.read(&mut buf[pending..]) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("cannot read .bin file: {e}")),
        };
        total += n as u64;
        let filled = pending + n;
        let whole = filled / 4 * 4;
        if tokens.capacity() - tokens.len() < whole / 4 {
            reserve(&mut tokens, (whole / 4) as u64, total, ".bin")?;
        }
        tokens.extend(
            buf[..whole]
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        );
        buf.copy_within(whole..filled, 0);
        pending = filled - whole;
    }
    if pending != 0 {
        return Err(format!(
            "file is {total} bytes, not a multiple of 4: a .bin file holds little-endian u32 \
             token ids"
        ));
    }
    Ok(tokens)
}

/// Read a `.txt` file and tokenize it byte by byte (token id = byte value).
fn read_txt<R: Read>(mut reader: R, size_hint: u64) -> Result<Vec<u32>, String> {
    let mut bytes = Vec::new();
    reserve(&mut bytes, size_hint, size_hint, ".txt")?;
    let chunk_len =
        usize::try_from(size_hint.saturating_add(8)).map_or(1 << 16, |n| n.clamp(1 << 12, 1 << 16));
    let mut chunk = vec![0u8; chunk_len];
    loop {
        let n = match reader.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("cannot read .txt file: {e}")),
        };
        if bytes.capacity() - bytes.len() < n {
            let size = (bytes.len() + n) as u64;
            reserve(&mut bytes, n as u64, size, ".txt")?;
        }
        bytes.extend_from_slice(&chunk[..n]);
    }
    let mut tokens = Vec::new();
    reserve(&mut tokens, bytes.len() as u64, bytes.len() as u64, ".txt")?;
    tokens.extend(bytes.into_iter().map(u32::from));
    Ok(tokens)
}
