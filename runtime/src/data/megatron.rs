//! Megatron-LM's indexed datasets (`PREFIX.bin` / `PREFIX.idx`, as written by
//! `tools/preprocess_data.py`) and the samples megatron-core's `GPTDataset` and
//! `BlendedDataset` draw from them: the same document, sample and shuffle indices from the
//! same seed, split and sequence length, so sample `i` here is sample `i` of Megatron's
//! training dataset (megatron-core 0.16; docs/data.md says which config it matches).
//!
//! The `.idx` file: the magic `MMIDIDX\0\0`, a version (`u64` 1), a dtype code (`u8`), the
//! sequence count `S` and the document count `D` (`u64`), then `S` sequence lengths (`i32`),
//! `S` byte offsets into the `.bin` file (`i64`) and `D` document boundaries (`i64`). The
//! `.bin` file holds the token ids of every sequence back to back, in the dtype. As in
//! `GPTDataset`, every *sequence* is a document (preprocess_data.py writes one sequence per
//! document unless it splits sentences).

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use super::numpy_rng::RandomState;

/// Where the token ids of an indexed dataset's `.bin` file live: a read-only memory map (as
/// megatron-core's `mmap_bin_files`), or nothing for an empty file.
enum BinBytes {
    Mapped(memmap2::Mmap),
    Empty,
}

impl BinBytes {
    fn bytes(&self) -> &[u8] {
        match self {
            BinBytes::Mapped(m) => m,
            BinBytes::Empty => &[],
        }
    }
}

/// The element type of a `.bin` file (the `.idx` dtype code).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenDtype {
    /// Code 1.
    U8,
    /// Code 2.
    I8,
    /// Code 3.
    I16,
    /// Code 4.
    I32,
    /// Code 5.
    I64,
    /// Code 8 (what preprocess_data.py writes for vocabularies under 65500).
    U16,
}

impl TokenDtype {
    fn from_code(code: u8) -> Result<TokenDtype, String> {
        Ok(match code {
            1 => TokenDtype::U8,
            2 => TokenDtype::I8,
            3 => TokenDtype::I16,
            4 => TokenDtype::I32,
            5 => TokenDtype::I64,
            8 => TokenDtype::U16,
            6 | 7 => {
                return Err(format!(
                    "dtype code {code} ({}) is not a token dtype: the .bin file holds floats",
                    if code == 6 { "float64" } else { "float32" }
                ))
            }
            _ => return Err(format!("unknown dtype code {code} (expected 1..=8)")),
        })
    }

    /// Bytes per token.
    pub fn size(self) -> usize {
        match self {
            TokenDtype::U8 | TokenDtype::I8 => 1,
            TokenDtype::I16 | TokenDtype::U16 => 2,
            TokenDtype::I32 => 4,
            TokenDtype::I64 => 8,
        }
    }

    /// The token at `b` (exactly `size()` bytes, little-endian) as an `i64`.
    fn read(self, b: &[u8]) -> i64 {
        match self {
            TokenDtype::U8 => i64::from(b[0]),
            TokenDtype::I8 => i64::from(b[0] as i8),
            TokenDtype::I16 => i64::from(i16::from_le_bytes([b[0], b[1]])),
            TokenDtype::U16 => i64::from(u16::from_le_bytes([b[0], b[1]])),
            TokenDtype::I32 => i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            TokenDtype::I64 => i64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
        }
    }
}

/// The magic bytes at the start of a `.idx` file.
pub const IDX_MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";

/// An error about one file: its path and what is wrong.
#[derive(Clone, Debug, PartialEq)]
pub struct FileError {
    /// The file (`PREFIX.idx`, `PREFIX.bin`) or the data spec the problem is in.
    pub file: String,
    /// What is wrong, with the numbers involved.
    pub message: String,
}

fn file_err(file: &str, message: String) -> FileError {
    FileError {
        file: file.to_string(),
        message,
    }
}

/// One `PREFIX.bin` / `PREFIX.idx` pair, checked: the index is whole, every sequence lies
/// inside the `.bin` file and every token id is in `0..vocab`.
pub struct IndexedDataset {
    prefix: String,
    dtype: TokenDtype,
    lengths: Vec<i32>,
    pointers: Vec<i64>,
    bin: BinBytes,
}

impl std::fmt::Debug for IndexedDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexedDataset")
            .field("prefix", &self.prefix)
            .field("dtype", &self.dtype)
            .field("sequences", &self.lengths.len())
            .finish()
    }
}

impl PartialEq for IndexedDataset {
    fn eq(&self, other: &Self) -> bool {
        self.prefix == other.prefix
            && self.dtype == other.dtype
            && self.lengths == other.lengths
            && self.pointers == other.pointers
            && self.bin.bytes() == other.bin.bytes()
    }
}

fn read_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl IndexedDataset {
    /// Open `PREFIX.idx` and `PREFIX.bin` and check them against `vocab`.
    pub fn open(prefix: &str, vocab: u32) -> Result<IndexedDataset, FileError> {
        let idx_name = format!("{prefix}.idx");
        let bin_name = format!("{prefix}.bin");
        let idx = std::fs::read(&idx_name)
            .map_err(|e| file_err(&idx_name, format!("cannot read the index: {e}")))?;
        let (dtype, lengths, pointers) = parse_idx(&idx).map_err(|m| file_err(&idx_name, m))?;
        let file = File::open(&bin_name)
            .map_err(|e| file_err(&bin_name, format!("cannot open the data: {e}")))?;
        let bin_len = file
            .metadata()
            .map_err(|e| file_err(&bin_name, format!("cannot read the data: {e}")))?
            .len();
        // Every sequence must lie inside the file, before anything is mapped.
        let size = dtype.size() as i64;
        for (i, (&len, &ptr)) in lengths.iter().zip(&pointers).enumerate() {
            let end = i64::from(len)
                .checked_mul(size)
                .and_then(|n| n.checked_add(ptr));
            match end {
                Some(end) if ptr >= 0 && end as u64 <= bin_len => {}
                _ => {
                    return Err(file_err(
                        &bin_name,
                        format!(
                            "is {bin_len} bytes, shorter than {idx_name} says: sequence {i} \
                             ({len} tokens of {size} bytes at byte {ptr}) ends at byte {}",
                            end.map_or_else(|| "beyond 2^63".to_string(), |e| e.to_string())
                        ),
                    ))
                }
            }
        }
        let bin = if bin_len == 0 {
            BinBytes::Empty
        } else {
            // SAFETY: the map is read-only and private to this process; like megatron-core,
            // the run expects the dataset files not to change while it reads them.
            let map = unsafe { memmap2::Mmap::map(&file) }
                .map_err(|e| file_err(&bin_name, format!("cannot map the data: {e}")))?;
            BinBytes::Mapped(map)
        };
        let ds = IndexedDataset {
            prefix: prefix.to_string(),
            dtype,
            lengths,
            pointers,
            bin,
        };
        ds.check_tokens(vocab).map_err(|m| file_err(&bin_name, m))?;
        Ok(ds)
    }

    /// Every token of every sequence in `0..vocab`.
    fn check_tokens(&self, vocab: u32) -> Result<(), String> {
        let size = self.dtype.size();
        let bytes = self.bin.bytes();
        for (seq, (&len, &ptr)) in self.lengths.iter().zip(&self.pointers).enumerate() {
            let start = ptr as usize;
            let chunk = &bytes[start..start + len as usize * size];
            for (pos, b) in chunk.chunks_exact(size).enumerate() {
                let id = self.dtype.read(b);
                if id < 0 || id >= i64::from(vocab) {
                    return Err(format!(
                        "token id {id} (sequence {seq}, position {pos}) is out of range for \
                         vocab {vocab} (ids must be in 0..{vocab})"
                    ));
                }
            }
        }
        Ok(())
    }

    /// The prefix as the user gave it.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The token dtype of the `.bin` file.
    pub fn dtype(&self) -> TokenDtype {
        self.dtype
    }

    /// The number of sequences (GPTDataset's documents).
    pub fn sequences(&self) -> usize {
        self.lengths.len()
    }

    /// The length of each sequence, in tokens.
    pub fn lengths(&self) -> &[i32] {
        &self.lengths
    }

    /// Append `len` tokens of sequence `seq` from token `offset` on (megatron-core's
    /// `IndexedDataset.get(seq, offset, len)`) to `out`.
    fn get(&self, seq: usize, offset: usize, len: usize, out: &mut Vec<u32>) {
        let size = self.dtype.size();
        let start = self.pointers[seq] as usize + offset * size;
        let bytes = &self.bin.bytes()[start..start + len * size];
        // Checked at open: every id is in 0..vocab <= 2^31.
        out.extend(bytes.chunks_exact(size).map(|b| self.dtype.read(b) as u32));
    }
}

/// Parse and check a `.idx` file: (dtype, sequence lengths, sequence pointers).
fn parse_idx(b: &[u8]) -> Result<(TokenDtype, Vec<i32>, Vec<i64>), String> {
    const HEADER: usize = 9 + 8 + 1 + 8 + 8;
    if b.len() < HEADER {
        return Err(format!(
            "truncated: {} bytes, shorter than the {HEADER}-byte header of a Megatron index",
            b.len()
        ));
    }
    if &b[..9] != IDX_MAGIC {
        return Err(
            "is not a Megatron index (MMIDIDX): its first bytes are not `MMIDIDX\\x00\\x00`"
                .to_string(),
        );
    }
    let version = read_u64(b, 9);
    if version != 1 {
        return Err(format!("index version {version}, expected 1"));
    }
    let dtype = TokenDtype::from_code(b[17])?;
    let seqs = read_u64(b, 18);
    let docs = read_u64(b, 26);
    let need = seqs
        .checked_mul(4 + 8)
        .and_then(|n| n.checked_add(docs.checked_mul(8)?))
        .and_then(|n| n.checked_add(HEADER as u64));
    let have = b.len() as u64;
    let Some(need) = need.filter(|&n| n <= have) else {
        return Err(format!(
            "truncated: the header says {seqs} sequences and {docs} document boundaries, which \
             need {} bytes, but the file has {have}",
            need.map_or_else(|| "more than 2^64".to_string(), |n| n.to_string())
        ));
    };
    // A multimodal index adds one mode byte per sequence.
    if have != need && have != need + seqs {
        return Err(format!(
            "is {have} bytes, but its header ({seqs} sequences, {docs} document boundaries) \
             describes {need}: the file is corrupt"
        ));
    }
    if seqs == 0 {
        return Err("holds no sequences".to_string());
    }
    let seqs = seqs as usize;
    let mut at = HEADER;
    let lengths: Vec<i32> = b[at..at + 4 * seqs]
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    at += 4 * seqs;
    let pointers: Vec<i64> = b[at..at + 8 * seqs]
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    at += 8 * seqs;
    if let Some((i, &len)) = lengths.iter().enumerate().find(|(_, &l)| l < 0) {
        return Err(format!("sequence {i} has a negative length ({len})"));
    }
    let bounds: Vec<i64> = b[at..at + 8 * docs as usize]
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    let mut prev = 0i64;
    for (i, &d) in bounds.iter().enumerate() {
        if d < prev || d > seqs as i64 {
            return Err(format!(
                "document boundary {i} is {d}: boundaries must rise from 0 to the sequence \
                 count {seqs}"
            ));
        }
        prev = d;
    }
    Ok((dtype, lengths, pointers))
}

/// Megatron's splits of a dataset (`Split` in megatron-core), in order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DataSplit {
    /// The first part: what training reads.
    #[default]
    Train,
    /// The second part (validation).
    Valid,
    /// The third part.
    Test,
}

impl DataSplit {
    fn index(self) -> usize {
        match self {
            DataSplit::Train => 0,
            DataSplit::Valid => 1,
            DataSplit::Test => 2,
        }
    }

    /// Megatron's name of the split.
    pub fn name(self) -> &'static str {
        match self {
            DataSplit::Train => "train",
            DataSplit::Valid => "valid",
            DataSplit::Test => "test",
        }
    }
}

/// numpy's `sum` of a float64 array (pairwise summation, blocks of 8 accumulators).
fn numpy_sum(a: &[f64]) -> f64 {
    let n = a.len();
    if n < 8 {
        let mut res = 0.0;
        for &x in a {
            res += x;
        }
        res
    } else if n <= 128 {
        let mut r = [0.0f64; 8];
        r.copy_from_slice(&a[..8]);
        let whole = n - n % 8;
        let mut i = 8;
        while i < whole {
            for (j, rj) in r.iter_mut().enumerate() {
                *rj += a[i + j];
            }
            i += 8;
        }
        let mut res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for &x in &a[whole..] {
            res += x;
        }
        res
    } else {
        let mut n2 = n / 2;
        n2 -= n2 % 8;
        numpy_sum(&a[..n2]) + numpy_sum(&a[n2..])
    }
}

/// megatron-core's `normalize`: each weight over numpy's sum of them.
fn normalize(w: &[f64]) -> Vec<f64> {
    let sum = numpy_sum(w);
    w.iter().map(|x| x / sum).collect()
}

/// megatron-core's split matrix for a split string (`parse_and_normalize_split` then
/// `convert_split_vector_to_split_matrix`): each split's (begin, end) fractions, None for an
/// empty one.
pub fn split_matrix(split: &str) -> Result<[Option<(f64, f64)>; 3], String> {
    let parts: Vec<&str> = split.split(',').map(str::trim).collect();
    if parts.len() > 3 {
        return Err(format!(
            "split `{split}` has {} parts; expected at most 3 (train,valid,test), e.g. 969,30,1",
            parts.len()
        ));
    }
    let mut v = [0.0f64; 3];
    for (i, p) in parts.iter().enumerate() {
        v[i] = match p.parse::<f64>() {
            Ok(x) if x.is_finite() && x >= 0.0 => x,
            _ => {
                return Err(format!(
                    "split `{split}`: part {} is `{p}`, not a number >= 0 (expected e.g. 969,30,1)",
                    i + 1
                ))
            }
        };
    }
    if numpy_sum(&v) <= 0.0 {
        return Err(format!("split `{split}`: the parts add up to 0"));
    }
    let v = normalize(&v);
    let mut out = [None; 3];
    let mut begin = 0.0f64;
    for (i, &x) in v.iter().enumerate() {
        let end = begin + x;
        if end > begin {
            out[i] = Some((begin, end));
        }
        begin = end;
    }
    Ok(out)
}

/// Python's `int(round(x))` for the non-negative, moderate `x` of split bookends (ties to even).
fn py_round(x: f64) -> u64 {
    x.round_ties_even() as u64
}

/// The samples megatron-core's `GPTDataset` draws from one split of an indexed dataset.
#[derive(Debug, PartialEq)]
pub struct GptDataset {
    dataset: Arc<IndexedDataset>,
    seq_len: usize,
    /// The split's first and one-past-last sequence.
    documents: (u64, u64),
    document_index: Vec<i32>,
    sample_index: Vec<[i64; 2]>,
    shuffle_index: Vec<u64>,
}

impl GptDataset {
    /// Build the indices of `split` of `dataset` for `num_samples` samples (None: one epoch)
    /// of `seq_len + 1` tokens, shuffled from `seed`, as `GPTDataset.__init__` does with
    /// `add_extra_token_to_sequence` and `drop_last_partial_validation_sequence` on.
    pub fn build(
        dataset: Arc<IndexedDataset>,
        split: &[Option<(f64, f64)>; 3],
        which: DataSplit,
        num_samples: Option<u64>,
        seq_len: usize,
        seed: u32,
    ) -> Result<GptDataset, String> {
        let n = dataset.sequences() as f64;
        let Some((b, e)) = split[which.index()] else {
            return Err(format!(
                "the split gives the {} part no documents (its weight is 0)",
                which.name()
            ));
        };
        let (begin, end) = (py_round(b * n), py_round(e * n));
        let lengths = dataset.lengths();
        let tokens_per_epoch: i64 = (begin..end).map(|d| i64::from(lengths[d as usize])).sum();
        let seq = seq_len as i64;
        let too_few = |what: &str| {
            format!(
                "the {} split (sequences {begin}..{end} of {}) holds {tokens_per_epoch} tokens, \
                 {what} (a sample is seq_len + 1 = {} tokens)",
                which.name(),
                dataset.sequences(),
                seq + 1
            )
        };
        // helpers.cpp asserts more than one token per epoch.
        if tokens_per_epoch < 2 {
            return Err(too_few("too few for any sample"));
        }
        // _get_num_epochs
        let mut num_epochs: i64 = 1;
        if let Some(ns) = num_samples {
            let requested = (ns as i64).saturating_mul(seq).saturating_add(1);
            num_epochs = ((requested + tokens_per_epoch - 1) / tokens_per_epoch).max(1);
        }
        let separate_final_epoch = match num_samples {
            Some(ns) if num_epochs > 1 => {
                let sans_final = ((num_epochs - 1) * tokens_per_epoch - 1) / seq;
                let from_final = ns as i64 - sans_final;
                let per_epoch = (tokens_per_epoch - 1) / seq;
                from_final < (0.80 * per_epoch as f64) as i64
            }
            _ => false,
        };
        let mut rng = RandomState::new(seed);
        let docs: Vec<i32> = (begin..end).map(|d| d as i32).collect();
        let document_index =
            build_document_index(&docs, num_epochs as usize, &mut rng, separate_final_epoch);
        let sample_index =
            build_sample_index(lengths, &document_index, seq, num_epochs * tokens_per_epoch);
        let total = sample_index.len() as u64 - 1;
        if total == 0 {
            return Err(too_few(
                "not one sample's worth in the epochs it is read for",
            ));
        }
        let first = if separate_final_epoch {
            ((num_epochs - 1) * tokens_per_epoch - 1) as u64 / seq as u64
        } else {
            total
        };
        let mut shuffle_index: Vec<u64> = (0..first).collect();
        rng.shuffle(&mut shuffle_index);
        if first < total {
            let mut last: Vec<u64> = (first..total).collect();
            rng.shuffle(&mut last);
            shuffle_index.extend(last);
        }
        Ok(GptDataset {
            dataset,
            seq_len,
            documents: (begin, end),
            document_index,
            sample_index,
            shuffle_index,
        })
    }

    /// How many samples the indices hold (`len(GPTDataset)`).
    pub fn len(&self) -> u64 {
        self.shuffle_index.len() as u64
    }

    /// Never: a built dataset holds at least one sample.
    pub fn is_empty(&self) -> bool {
        self.shuffle_index.is_empty()
    }

    /// The split's sequences (first, one past the last).
    pub fn documents(&self) -> (u64, u64) {
        self.documents
    }

    /// The document index: the split's sequences, once per epoch, shuffled.
    pub fn document_index(&self) -> &[i32] {
        &self.document_index
    }

    /// The sample index: where each sample starts (a position in the document index and a
    /// token offset in that document); one more entry than samples.
    pub fn sample_index(&self) -> &[[i64; 2]] {
        &self.sample_index
    }

    /// The shuffle index: sample `i` is built from sample-index entry `shuffle_index[i]`.
    pub fn shuffle_index(&self) -> &[u64] {
        &self.shuffle_index
    }

    /// The `seq_len + 1` tokens of sample `i` (`i < len()`), appended to `out`
    /// (`GPTDataset._query_document_sample_shuffle_indices`).
    pub fn sample_into(&self, i: u64, out: &mut Vec<u32>) {
        let start = out.len();
        let idx = self.shuffle_index[i as usize] as usize;
        let [beg, beg_off] = self.sample_index[idx];
        let [end, end_off] = self.sample_index[idx + 1];
        let doc = |k: i64| self.document_index[k as usize] as usize;
        if beg == end {
            let len = (end_off - beg_off + 1) as usize;
            self.dataset.get(doc(beg), beg_off as usize, len, out);
        } else {
            for k in beg..=end {
                let offset = if k > beg { 0 } else { beg_off as usize };
                let len = if k < end {
                    self.dataset.lengths()[doc(k)] as usize - offset
                } else {
                    end_off as usize + 1
                };
                self.dataset.get(doc(k), offset, len, out);
            }
        }
        // Megatron pads a short sample with its pad id and then maps pads to 0; with the last
        // partial sample dropped, no sample is short.
        out.resize(start + self.seq_len + 1, 0);
    }
}

/// `_build_document_index`.
fn build_document_index(
    docs: &[i32],
    num_epochs: usize,
    rng: &mut RandomState,
    separate_final_epoch: bool,
) -> Vec<i32> {
    if !separate_final_epoch || num_epochs == 1 {
        let mut index: Vec<i32> = Vec::with_capacity(docs.len() * num_epochs);
        for _ in 0..num_epochs {
            index.extend_from_slice(docs);
        }
        rng.shuffle(&mut index);
        return index;
    }
    let mut first = build_document_index(docs, num_epochs - 1, rng, false);
    first.extend(build_document_index(docs, 1, rng, false));
    first
}

/// helpers.cpp's `build_sample_idx` (drop the last partial sample, one extra token).
fn build_sample_index(
    sizes: &[i32],
    document_index: &[i32],
    seq: i64,
    total_tokens: i64,
) -> Vec<[i64; 2]> {
    const EXTRA: i64 = 1;
    let num_samples = (total_tokens - EXTRA) / seq;
    let mut out = Vec::with_capacity(num_samples as usize + 1);
    let mut doc_idx: usize = 0;
    let mut doc_offset: i64 = 0;
    out.push([0, 0]);
    while (out.len() as i64) <= num_samples {
        let mut remaining = seq + EXTRA;
        while remaining != 0 {
            let doc_len = i64::from(sizes[document_index[doc_idx] as usize]) - doc_offset;
            remaining -= doc_len;
            if remaining <= 0 {
                doc_offset += remaining + doc_len - EXTRA;
                remaining = 0;
            } else {
                if doc_idx == document_index.len() - 1 {
                    doc_offset = i64::from(sizes[document_index[doc_idx] as usize]) - EXTRA;
                    break;
                }
                doc_idx += 1;
                doc_offset = 0;
            }
        }
        out.push([doc_idx as i64, doc_offset]);
    }
    out
}

/// megatron-core's `mid_level_dataset_surplus`: how many more samples (as a fraction) each
/// dataset of a blend builds than the blend draws from it.
pub const BLEND_SURPLUS: f64 = 0.005;

/// A weighted blend of datasets (megatron-core's `BlendedDataset`).
#[derive(Debug, PartialEq)]
pub struct Blend {
    datasets: Vec<GptDataset>,
    weights: Vec<f64>,
    dataset_index: Vec<u16>,
    dataset_sample_index: Vec<u64>,
}

impl Blend {
    /// The blend's datasets, in the order given.
    pub fn datasets(&self) -> &[GptDataset] {
        &self.datasets
    }

    /// The normalised weights the blending indices were built from.
    pub fn weights(&self) -> &[f64] {
        &self.weights
    }

    /// Which dataset each sample comes from.
    pub fn dataset_index(&self) -> &[u16] {
        &self.dataset_index
    }

    /// Which sample of its dataset each sample is.
    pub fn dataset_sample_index(&self) -> &[u64] {
        &self.dataset_sample_index
    }
}

/// The data behind a Megatron `--data` spec: one dataset's split, or a blend.
#[derive(Debug, PartialEq)]
pub enum MegatronData {
    /// `--data PREFIX`.
    Single(GptDataset),
    /// `--data "W1 PREFIX1 W2 PREFIX2 ..."`.
    Blend(Blend),
}

/// What selects the samples of a Megatron spec besides the files.
#[derive(Clone, Debug)]
pub struct MegatronOptions<'a> {
    /// The split string (`969,30,1`).
    pub split: &'a str,
    /// Which part of the split.
    pub which: DataSplit,
    /// How many samples the run reads (Megatron's `train_samples`); None: one epoch.
    pub num_samples: Option<u64>,
    /// The sequence length.
    pub seq_len: usize,
    /// Megatron's `--seed` (numpy's RandomState takes 32 bits).
    pub seed: u32,
    /// The model's vocabulary: every token id must be below it.
    pub vocab: u32,
}

/// Parse a blend spec, `W1 PREFIX1 W2 PREFIX2 ...` (whitespace-separated, every weight a
/// finite number > 0): the (weight, prefix) pairs.
pub fn parse_blend(spec: &str) -> Result<Vec<(f64, String)>, String> {
    let items: Vec<&str> = spec.split_whitespace().collect();
    if items.is_empty() {
        return Err("empty blend: expected `WEIGHT PREFIX [WEIGHT PREFIX ...]`".to_string());
    }
    if items.len() % 2 == 1 {
        return Err(format!(
            "malformed blend: {} items; expected pairs `WEIGHT PREFIX [WEIGHT PREFIX ...]`, \
             e.g. \"0.3 data/a_text_document 0.7 data/b_text_document\"",
            items.len()
        ));
    }
    items
        .chunks_exact(2)
        .enumerate()
        .map(|(i, pair)| {
            let (w, p) = (pair[0], pair[1]);
            match w.parse::<f64>() {
                Ok(x) if x.is_finite() && x > 0.0 => Ok((x, p.to_string())),
                Ok(_) => Err(format!(
                    "blend weight {} (`{w}`, before {p}) must be a finite number > 0",
                    i + 1
                )),
                Err(_) => Err(format!(
                    "malformed blend: item {} is `{w}` where a weight was expected (before {p}); \
                     expected `WEIGHT PREFIX [WEIGHT PREFIX ...]`",
                    2 * i + 1
                )),
            }
        })
        .collect()
}

impl MegatronData {
    /// Open a single prefix.
    pub fn open_single(prefix: &str, o: &MegatronOptions) -> Result<MegatronData, FileError> {
        let split = split_matrix(o.split).map_err(|m| file_err(prefix, m))?;
        let ds = Arc::new(IndexedDataset::open(prefix, o.vocab)?);
        let gpt = GptDataset::build(ds, &split, o.which, o.num_samples, o.seq_len, o.seed)
            .map_err(|m| file_err(prefix, m))?;
        Ok(MegatronData::Single(gpt))
    }

    /// Open a weighted blend (`spec` as [`parse_blend`] reads it), as
    /// `BlendedMegatronDatasetBuilder` builds it for a `size` of `o.num_samples`.
    pub fn open_blend(blend: &str, o: &MegatronOptions) -> Result<MegatronData, FileError> {
        // Messages about the blend as a whole quote it.
        let quoted = format!("\"{blend}\"");
        let spec = quoted.as_str();
        let pairs = parse_blend(blend).map_err(|m| file_err(spec, m))?;
        let Some(size) = o.num_samples else {
            return Err(file_err(
                spec,
                "a blend needs the number of samples the run reads".to_string(),
            ));
        };
        if pairs.len() >= i16::MAX as usize {
            return Err(file_err(
                spec,
                format!("{} datasets: at most 32766", pairs.len()),
            ));
        }
        let split = split_matrix(o.split).map_err(|m| file_err(spec, m))?;
        let raw: Vec<f64> = pairs.iter().map(|p| p.0).collect();
        let weights = normalize(&raw);
        // _get_size_per_split_per_dataset, without and with the surplus.
        let target: Vec<u64> = weights
            .iter()
            .map(|w| (size as f64 * w).ceil() as u64)
            .collect();
        let mut datasets = Vec::with_capacity(pairs.len());
        for ((_, prefix), &t) in pairs.iter().zip(&target) {
            let buffer = (t as f64 * (1.0 + BLEND_SURPLUS)).ceil() as u64;
            let ds = Arc::new(IndexedDataset::open(prefix, o.vocab)?);
            let gpt = GptDataset::build(ds, &split, o.which, Some(buffer), o.seq_len, o.seed)
                .map_err(|m| file_err(prefix, m))?;
            datasets.push(gpt);
        }
        let size: u64 = target.iter().sum();
        // BlendedDataset normalises the (normalised) weights once more.
        let weights = normalize(&weights);
        let (dataset_index, dataset_sample_index) = blending_indices(&weights, size);
        let mut drawn = vec![0u64; datasets.len()];
        for &d in &dataset_index {
            drawn[d as usize] += 1;
        }
        for (i, (d, &n)) in datasets.iter().zip(&drawn).enumerate() {
            if d.len() < n {
                return Err(file_err(
                    &pairs[i].1,
                    format!(
                        "the blend draws {n} samples from it but it holds {} (Megatron's \
                         oversampling error)",
                        d.len()
                    ),
                ));
            }
        }
        Ok(MegatronData::Blend(Blend {
            datasets,
            weights,
            dataset_index,
            dataset_sample_index,
        }))
    }

    /// How many samples the data holds (`len()` of Megatron's dataset).
    pub fn len(&self) -> u64 {
        match self {
            MegatronData::Single(d) => d.len(),
            MegatronData::Blend(b) => b.dataset_index.len() as u64,
        }
    }

    /// Never: opened data holds at least one sample.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `seq_len + 1` tokens of sample `i mod len()`, appended to `out`.
    pub fn sample_into(&self, i: u64, out: &mut Vec<u32>) {
        let i = i % self.len();
        match self {
            MegatronData::Single(d) => d.sample_into(i, out),
            MegatronData::Blend(b) => {
                let d = b.dataset_index[i as usize] as usize;
                b.datasets[d].sample_into(b.dataset_sample_index[i as usize], out)
            }
        }
    }
}

/// helpers.cpp's `build_blending_indices`: each sample from the dataset furthest below its
/// share so far.
fn blending_indices(weights: &[f64], size: u64) -> (Vec<u16>, Vec<u64>) {
    let mut current = vec![0u64; weights.len()];
    let mut index = Vec::with_capacity(size as usize);
    let mut sample = Vec::with_capacity(size as usize);
    for s in 0..size {
        let s = (s as f64).max(1.0);
        let mut best = 0usize;
        let mut best_err = weights[0] * s - current[0] as f64;
        for (d, &w) in weights.iter().enumerate().skip(1) {
            let err = w * s - current[d] as f64;
            if err > best_err {
                best_err = err;
                best = d;
            }
        }
        index.push(best as u16);
        sample.push(current[best]);
        current[best] += 1;
    }
    (index, sample)
}

/// Whether `path` names an indexed dataset prefix: `path.idx` exists.
pub fn is_prefix(path: &str) -> bool {
    Path::new(&format!("{path}.idx")).is_file()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numpy_random_state_matches_numpy() {
        // numpy 2.4: RandomState(1234).randint(0, 2**32, size=3, dtype=uint32) and the
        // shuffle of arange(10).
        let mut r = RandomState::new(1234);
        let draws: Vec<u32> = (0..3).map(|_| r.next_u32()).collect();
        assert_eq!(draws, [822569775, 2137449171, 2671936806]);
        let mut a: Vec<i32> = (0..10).collect();
        RandomState::new(1234).shuffle(&mut a);
        assert_eq!(a, [7, 2, 9, 1, 0, 8, 4, 5, 6, 3]);
    }

    #[test]
    fn split_matrix_is_megatrons() {
        let m = split_matrix("99,1,0").unwrap();
        assert_eq!(m[0], Some((0.0, 0.99)));
        assert_eq!(m[1].map(|x| x.1), Some(1.0));
        assert_eq!(m[2], None);
        assert!(split_matrix("1,-1").is_err());
        assert!(split_matrix("0,0,0").is_err());
        assert!(split_matrix("1,2,3,4").is_err());
    }

    #[test]
    fn numpy_sum_blocks() {
        let v: Vec<f64> = (0..300).map(|i| 0.1 * i as f64).collect();
        let naive: f64 = v.iter().sum();
        assert!((numpy_sum(&v) - naive).abs() < 1e-9);
    }

    #[test]
    fn blends_parse() {
        assert_eq!(
            parse_blend("0.3 a 0.7 b").unwrap(),
            vec![(0.3, "a".to_string()), (0.7, "b".to_string())]
        );
        assert!(parse_blend("0.3 a b").is_err());
        assert!(parse_blend("0 a 1 b").is_err());
        assert!(parse_blend("-1 a 1 b").is_err());
        assert!(parse_blend("x a 1 b").is_err());
        assert!(parse_blend("nan a 1 b").is_err());
    }
}
