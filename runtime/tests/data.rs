//! Training data: windowing, wrap-around, byte-level text, errors, synthetic determinism.

use std::path::PathBuf;

use megac_runtime::data::{step_samples, DataSource};
use megac_runtime::error::RuntimeError;

/// Write `bytes` to `name` in a fresh temporary directory (kept alive by the returned guard).
fn write(name: &str, bytes: &[u8]) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join(name);
    std::fs::write(&path, bytes).unwrap();
    (dir, path.to_str().unwrap().to_string())
}

fn bin(tokens: &[u32]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

fn sample(src: &DataSource, index: u64, seq_len: usize) -> (Vec<i32>, Vec<i32>) {
    let mut inputs = vec![-1; seq_len];
    let mut labels = vec![-1; seq_len];
    src.sample(index, seq_len, &mut inputs, &mut labels);
    (inputs, labels)
}

fn message(e: RuntimeError) -> String {
    e.to_string()
}

#[test]
fn bin_windows_and_wrap_around() {
    // 14 tokens, seq_len 3: windows of 4 -> 3 samples, tokens 12 and 13 unused.
    let tokens: Vec<u32> = (100..114).collect();
    let (_dir, path) = write("t.bin", &bin(&tokens));
    let src = DataSource::open(&path, 3, 1000, 0).unwrap();
    assert_eq!(src.name(), path);
    assert_eq!(src.samples_in_file(3), Some(3));
    assert_eq!(
        sample(&src, 0, 3),
        (vec![100, 101, 102], vec![101, 102, 103])
    );
    assert_eq!(
        sample(&src, 1, 3),
        (vec![104, 105, 106], vec![105, 106, 107])
    );
    assert_eq!(
        sample(&src, 2, 3),
        (vec![108, 109, 110], vec![109, 110, 111])
    );
    // Wrap-around: sample i uses window i mod 3.
    assert_eq!(sample(&src, 3, 3), sample(&src, 0, 3));
    assert_eq!(sample(&src, 7, 3), sample(&src, 1, 3));
    assert_eq!(sample(&src, u64::MAX, 3), sample(&src, u64::MAX % 3, 3));
}

#[test]
fn bin_exactly_one_window() {
    let (_dir, path) = write("one.bin", &bin(&[1, 2, 3]));
    let src = DataSource::open(&path, 2, 4, 0).unwrap();
    assert_eq!(src.samples_in_file(2), Some(1));
    assert_eq!(sample(&src, 5, 2), (vec![1, 2], vec![2, 3]));
}

#[test]
fn step_batches() {
    assert_eq!(step_samples(0, 4), 0..4);
    assert_eq!(step_samples(3, 4), 12..16);
    let tokens: Vec<u32> = (0..9).collect();
    let (_dir, path) = write("s.bin", &bin(&tokens));
    let src = DataSource::open(&path, 2, 16, 0).unwrap();
    // Three samples [0 1 2] [3 4 5] [6 7 8]; step 1 with G = 2 takes samples 2 and 3 (= 0).
    let mut inputs = vec![0; 4];
    let mut labels = vec![0; 4];
    src.fill_batch(step_samples(1, 2).start, 2, &mut inputs, &mut labels);
    assert_eq!(inputs, vec![6, 7, 0, 1]);
    assert_eq!(labels, vec![7, 8, 1, 2]);
}

#[test]
fn txt_is_byte_level() {
    let (_dir, path) = write("t.txt", "hé!\n".as_bytes());
    let src = DataSource::open(&path, 4, 256, 0).unwrap();
    // 'h', then é as UTF-8 (0xC3 0xA9), '!', '\n'.
    assert_eq!(
        sample(&src, 0, 4),
        (vec![104, 0xC3, 0xA9, 33], vec![0xC3, 0xA9, 33, 10])
    );
    assert!(DataSource::open(&path, 4, 50257, 0).is_ok());
}

#[test]
fn txt_needs_byte_vocab() {
    let (_dir, path) = write("t.txt", b"hello world");
    let e = message(DataSource::open(&path, 4, 255, 0).unwrap_err());
    assert!(
        e.contains("vocab must be at least 256, but it is 255"),
        "{e}"
    );
}

#[test]
fn unknown_extension() {
    let (_dir, path) = write("t.csv", b"1,2,3");
    let e = message(DataSource::open(&path, 1, 16, 0).unwrap_err());
    assert!(e.contains("unknown kind of data"), "{e}");
    assert!(
        e.contains("`synthetic`") && e.contains("`.bin`") && e.contains("`.txt`"),
        "{e}"
    );
    let e = message(DataSource::open("noext", 1, 16, 0).unwrap_err());
    assert!(e.contains("unknown kind of data"), "{e}");
}

#[test]
fn missing_file() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["none.bin", "none.txt"] {
        let path = dir.path().join(name);
        let e = message(DataSource::open(path.to_str().unwrap(), 4, 256, 0).unwrap_err());
        assert!(
            e.starts_with(&format!("data {}: cannot open", path.display())),
            "{e}"
        );
        assert!(e.contains("No such file"), "{e}");
    }
    // A directory is named as such, whatever its name looks like.
    for name in ["d.bin", "d.txt", "d"] {
        let sub = dir.path().join(name);
        std::fs::create_dir(&sub).unwrap();
        let e = message(DataSource::open(sub.to_str().unwrap(), 4, 256, 0).unwrap_err());
        assert_eq!(
            e,
            format!(
                "data {}: is a directory; expected `synthetic`, a `.bin` file (little-endian \
                 u32 token ids) or a `.txt` file (text, byte-level tokens)",
                sub.display()
            )
        );
    }
}

#[test]
fn bin_length_not_multiple_of_four() {
    let (_dir, path) = write("odd.bin", &[1, 0, 0, 0, 2, 0]);
    let e = message(DataSource::open(&path, 1, 16, 0).unwrap_err());
    assert!(e.contains("file is 6 bytes, not a multiple of 4"), "{e}");
}

#[test]
fn too_few_tokens() {
    let (_dir, path) = write("short.bin", &bin(&[1, 2, 3]));
    let e = message(DataSource::open(&path, 3, 16, 0).unwrap_err());
    assert!(
        e.contains("needs at least 4 tokens for one sample (seq_len 3 + 1), file has 3"),
        "{e}"
    );
    let (_dir, path) = write("empty.txt", b"");
    let e = message(DataSource::open(&path, 1, 256, 0).unwrap_err());
    assert!(e.contains("needs at least 2 tokens"), "{e}");
    assert!(e.contains("file has 0"), "{e}");
}

#[test]
fn token_out_of_vocab() {
    let (_dir, path) = write("big.bin", &bin(&[1, 2, 16, 3, 99]));
    let e = message(DataSource::open(&path, 1, 16, 0).unwrap_err());
    assert!(
        e.contains("token id 16 at position 2 is out of range for vocab 16"),
        "{e}"
    );
}

#[test]
fn bad_settings() {
    let e = message(DataSource::open("synthetic", 0, 16, 0).unwrap_err());
    assert!(e.contains("seq_len must be at least 1"), "{e}");
    let e = message(DataSource::open("synthetic", 4, 0, 0).unwrap_err());
    assert!(e.contains("vocab must be at least 1"), "{e}");
    let e = message(DataSource::open("synthetic", 4, u32::MAX, 0).unwrap_err());
    assert!(e.contains("too large"), "{e}");
}

#[test]
fn large_bin_streams_correctly() {
    // More than the 1 MiB read buffer, so reads cross chunk boundaries.
    let tokens: Vec<u32> = (0..700_001u32).map(|i| i % 1000).collect();
    let (_dir, path) = write("large.bin", &bin(&tokens));
    let src = DataSource::open(&path, 9, 1000, 0).unwrap();
    match &src {
        DataSource::Tokens { tokens: read, .. } => assert_eq!(read, &tokens),
        _ => panic!("expected tokens"),
    }
    assert_eq!(src.samples_in_file(9), Some(70_000));
}

#[test]
fn synthetic_is_deterministic_and_seeded() {
    let a = DataSource::open("synthetic", 32, 64, 7).unwrap();
    let b = DataSource::open("synthetic", 32, 64, 7).unwrap();
    let c = DataSource::open("synthetic", 32, 64, 8).unwrap();
    assert_eq!(a.name(), "synthetic");
    assert_eq!(a.samples_in_file(32), None);
    for i in [0u64, 1, 12345, u64::MAX] {
        assert_eq!(sample(&a, i, 32), sample(&b, i, 32));
        assert_ne!(sample(&a, i, 32), sample(&c, i, 32));
    }
    assert_ne!(sample(&a, 0, 32), sample(&a, 1, 32));
    // Labels are the inputs shifted by one.
    let (inputs, labels) = sample(&a, 3, 32);
    assert_eq!(inputs[1..], labels[..31]);
    // A longer sample extends the shorter one with the same index.
    let (long_in, long_lab) = sample(&a, 3, 64);
    assert_eq!(long_in[..32], inputs[..]);
    assert_eq!(long_lab[..32], labels[..]);
    // The batch it is drawn in does not matter.
    let mut inputs = vec![0; 3 * 32];
    let mut labels = vec![0; 3 * 32];
    a.fill_batch(10, 32, &mut inputs, &mut labels);
    assert_eq!(
        (inputs[32..64].to_vec(), labels[32..64].to_vec()),
        sample(&a, 11, 32)
    );
}

#[test]
fn synthetic_is_in_range_and_learnable() {
    let vocab = 50u32;
    let src = DataSource::open("synthetic", 128, vocab, 1).unwrap();
    let rules: Vec<(i64, i64)> = (0..8).map(|r| (1 + 2 * (r % 4), 1 + 4 * (r / 4))).collect();
    let (mut follow, mut total) = (0usize, 0usize);
    let mut seen = std::collections::HashSet::new();
    for i in 0..200 {
        let (inputs, labels) = sample(&src, i, 128);
        assert!(inputs
            .iter()
            .chain(&labels)
            .all(|&t| (0..vocab as i32).contains(&t)));
        // Find the rule this sequence follows: the one most transitions obey.
        let best = rules
            .iter()
            .map(|&(a, c)| {
                inputs
                    .iter()
                    .zip(&labels)
                    .filter(|(&x, &y)| (a * x as i64 + c) % vocab as i64 == y as i64)
                    .count()
            })
            .max()
            .unwrap();
        follow += best;
        total += labels.len();
        seen.extend(labels);
    }
    let frac = follow as f64 / total as f64;
    // One position in 16 is noise (some noise happens to match the rule).
    assert!(
        (0.90..0.97).contains(&frac),
        "fraction following the rule: {frac}"
    );
    assert_eq!(seen.len(), vocab as usize, "every token id occurs");
}
