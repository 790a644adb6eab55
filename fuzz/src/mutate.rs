//! A seeded mutator: byte-level mutations (bit flips, byte insert/delete, splices, dictionary
//! tokens, numeric extremes, deep nesting) and structure-aware ones (JSON values for
//! plan.json and the safetensors header, the safetensors length prefix).
//!
//! Input `i` of a run is a pure function of (run seed, `i`, corpus), so a crash that kills
//! the process is reproduced from its index alone.

use serde_json::Value;

/// splitmix64: a small, fast, seedable generator; the one the fuzzer and the plan-mutation
/// tests (`tests/common/mutate.rs`, `bench/mutate.sh`) share.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed` (the mutation tests' seed `s` is `Rng::new(s)`).
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// A generator for input `index` of the run seeded `seed`.
    pub fn for_input(seed: u64, index: u64) -> Rng {
        let mut r = Rng(seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        r.next_u64();
        r
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n`; `below(0)` is 0 and still takes a draw (so no caller's later
    /// draws shift).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// True with probability `num / den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.next_u64() % den < num
    }

    /// One element of a non-empty slice.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Numbers at the edges of every integer and float type, as text.
pub const EXTREME_NUMBERS: &[&str] = &[
    "0",
    "-0",
    "1",
    "-1",
    "2",
    "3",
    "7",
    "255",
    "256",
    "65535",
    "65536",
    "2147483647",
    "2147483648",
    "-2147483648",
    "4294967295",
    "4294967296",
    "9007199254740993",
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775808",
    "-9223372036854775809",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999999999999",
    "1e15",
    "1e308",
    "1e309",
    "-1e308",
    "1e-308",
    "5e-324",
    "0.5",
    "-0.0",
    "nan",
    "+nan",
    "-nan",
    "inf",
    "+inf",
    "-inf",
    "0x7fffffffffffffff",
    "0xffffffffffffffff",
    "0o777",
    "0b1",
    "1_000",
];

/// Tokens of TOML and JSON syntax.
pub const SYNTAX_TOKENS: &[&str] = &[
    "[",
    "]",
    "[[",
    "]]",
    "{",
    "}",
    "=",
    ",",
    ".",
    "\"",
    "'",
    "\"\"\"",
    "'''",
    "\n",
    "#",
    " ",
    "\\",
    "\\u0000",
    "\\uD800",
    ":",
    "true",
    "false",
    "null",
    "1979-05-27T07:32:00Z",
    "\r\n",
    "\t",
    "\u{feff}",
    "\u{0}",
    "é",
    "a.b.c",
];

/// The words of `seeds` that look like keys or values (identifiers, quoted strings), for the
/// dictionary: so mutations write keys the schema knows.
pub fn dictionary(seeds: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let mut words = std::collections::BTreeSet::new();
    for seed in seeds {
        let text = String::from_utf8_lossy(seed);
        for w in
            text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.'))
        {
            if (2..=40).contains(&w.len()) && words.len() < 4096 {
                words.insert(w.to_string());
            }
        }
    }
    let mut dict: Vec<Vec<u8>> = words.into_iter().map(String::into_bytes).collect();
    dict.extend(EXTREME_NUMBERS.iter().map(|s| s.as_bytes().to_vec()));
    dict.extend(SYNTAX_TOKENS.iter().map(|s| s.as_bytes().to_vec()));
    dict
}

/// Interesting byte values.
const BYTES: &[u8] = &[
    0, 1, 0x7f, 0x80, 0xff, b'"', b'[', b'{', b'\n', b'=', b'.', b'-', b'9',
];

/// Interesting little-endian integers, for binary formats.
const INTS: &[u64] = &[
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    255,
    256,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    0x1_0000_0000,
    1 << 40,
    0x7fff_ffff_ffff_ffff,
    0x8000_0000_0000_0000,
    u64::MAX,
    u64::MAX - 7,
];

/// Depths of the nesting mutation: around parsers' recursion limits and far past them.
const DEPTHS: &[usize] = &[64, 127, 128, 129, 256, 1000, 10_000, 100_000];

/// Apply 1 to 8 random byte-level mutations to `data`, keeping it at most `max_len` long.
/// `dict` supplies tokens, `others` material for splices.
pub fn mutate_bytes(
    rng: &mut Rng,
    data: &mut Vec<u8>,
    dict: &[Vec<u8>],
    others: &[Vec<u8>],
    max_len: usize,
) {
    let most = if rng.chance(1, 4) { 8 } else { 2 };
    let rounds = 1 + rng.below(most);
    for _ in 0..rounds {
        let len = data.len();
        let pos = rng.below(len + 1);
        match rng.below(15) {
            0 if len > 0 => {
                let i = rng.below(len);
                data[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                data[i] = rng.next_u64() as u8;
            }
            2 if len > 0 => {
                let i = rng.below(len);
                data[i] = *rng.pick(BYTES);
            }
            3 => {
                let n = 1 + rng.below(8);
                for _ in 0..n {
                    data.insert(pos.min(data.len()), rng.next_u64() as u8);
                }
            }
            4 if len > 0 => {
                let most = if rng.chance(1, 8) { len } else { 16.min(len) };
                let n = 1 + rng.below(most);
                let start = rng.below(len);
                data.drain(start..(start + n).min(len));
            }
            5 if len > 0 => {
                let start = rng.below(len);
                let n = 1 + rng.below((len - start).min(256));
                let copy = data[start..start + n].to_vec();
                let at = rng.below(len + 1);
                data.splice(at..at, copy);
            }
            6 | 7 if !dict.is_empty() => {
                let token = rng.pick(dict).clone();
                if rng.chance(1, 2) {
                    data.splice(pos..pos, token);
                } else {
                    let end = (pos + token.len()).min(len);
                    data.splice(pos..end, token);
                }
            }
            8 if !others.is_empty() => {
                let other = rng.pick(others);
                if !other.is_empty() {
                    let start = rng.below(other.len());
                    let n = 1 + rng.below((other.len() - start).min(4096));
                    let cut = rng.below(len + 1);
                    data.truncate(cut);
                    data.extend_from_slice(&other[start..start + n]);
                }
            }
            9 => {
                // Replace a run of digits (or insert) with an extreme number.
                let number = rng.pick(EXTREME_NUMBERS).as_bytes().to_vec();
                match (pos..len).find(|&i| data[i].is_ascii_digit()) {
                    Some(s) => {
                        let e = (s..len).find(|&i| !data[i].is_ascii_digit()).unwrap_or(len);
                        data.splice(s..e, number);
                    }
                    None => {
                        data.splice(pos..pos, number);
                    }
                }
            }
            10 => {
                // Deep nesting: opening brackets (and sometimes their closers).
                let depth = *rng.pick(DEPTHS);
                let (open, close): (&[u8], &[u8]) = *rng.pick(&[
                    (&b"["[..], &b"]"[..]),
                    (b"{", b"}"),
                    (b"{a=", b"}"),
                    (b"{\"a\":", b"}"),
                    (b"[[", b"]]"),
                ]);
                let mut nest = Vec::with_capacity(depth * (open.len() + close.len()));
                for _ in 0..depth {
                    nest.extend_from_slice(open);
                }
                if rng.chance(1, 2) {
                    nest.push(b'1');
                    for _ in 0..depth {
                        nest.extend_from_slice(close);
                    }
                }
                data.splice(pos..pos, nest);
            }
            11 => data.truncate(pos),
            12 if len >= 4 => {
                let i = rng.below(len - 3);
                let v = *rng.pick(INTS) as u32;
                data[i..i + 4].copy_from_slice(&v.to_le_bytes());
            }
            13 if len >= 8 => {
                let i = if rng.chance(1, 2) {
                    0
                } else {
                    rng.below(len - 7)
                };
                let v = *rng.pick(INTS);
                data[i..i + 8].copy_from_slice(&v.to_le_bytes());
            }
            _ => {
                // Duplicate a line (keys and tables defined twice).
                if let Some(s) = data[..pos].iter().rposition(|&b| b == b'\n') {
                    let e = data[s + 1..]
                        .iter()
                        .position(|&b| b == b'\n')
                        .map_or(len, |e| s + 1 + e);
                    let line = data[s..e].to_vec();
                    data.splice(e..e, line);
                }
            }
        }
        if data.len() > max_len {
            data.truncate(max_len);
        }
    }
}

/// Values a JSON number or field is replaced with.
fn extreme_value(rng: &mut Rng) -> Value {
    match rng.below(20) {
        0 => Value::Null,
        1 => Value::Bool(rng.chance(1, 2)),
        2 => Value::String(String::new()),
        3 => Value::String("x".repeat(rng.below(3) * 100)),
        4 => Value::Array(vec![]),
        5 => Value::Object(Default::default()),
        6 => serde_json::json!(-1),
        7 => serde_json::json!(i64::MIN),
        8 => serde_json::json!(u64::MAX),
        9 => serde_json::json!(1e15),
        10 => serde_json::json!(1e308),
        11 => serde_json::json!(-1e308),
        12 => serde_json::json!(0.5),
        13 => serde_json::json!(1u64 << 53),
        14 => serde_json::json!((rng.below(4) as u64 + 1) << 32),
        15 => serde_json::json!(*rng.pick(INTS)),
        _ => serde_json::json!(rng.below(6) as u64),
    }
}

/// A random node of `v`: descend into a random child until stopping (more likely deeper).
fn random_node<'a>(rng: &mut Rng, v: &'a mut Value) -> &'a mut Value {
    let mut node = v;
    for _ in 0..12 {
        let n = match &*node {
            Value::Array(a) => a.len(),
            Value::Object(o) => o.len(),
            _ => 0,
        };
        if n == 0 || rng.chance(1, 6) {
            break;
        }
        let i = rng.below(n);
        node = match node {
            Value::Array(a) => &mut a[i],
            Value::Object(o) => o.values_mut().nth(i).expect("in range"),
            _ => unreachable!("containers only"),
        };
    }
    node
}

/// Apply 1 to 3 field-level mutations to a JSON value: numbers to extremes, other types,
/// deleted or duplicated array elements and object keys, swapped and truncated arrays.
pub fn mutate_json(rng: &mut Rng, v: &mut Value) {
    let rounds = 1 + rng.below(3);
    for _ in 0..rounds {
        let node = random_node(rng, v);
        match node {
            Value::Number(_) => {
                *node = if rng.chance(1, 3) {
                    let n = node.as_u64().unwrap_or(0);
                    serde_json::json!(n.wrapping_add(rng.below(3) as u64).wrapping_sub(1))
                } else {
                    extreme_value(rng)
                }
            }
            Value::Array(a) if !a.is_empty() => {
                let n = a.len();
                match rng.below(6) {
                    0 => {
                        a.remove(rng.below(n));
                    }
                    1 => {
                        let i = rng.below(n);
                        let x = a[i].clone();
                        a.insert(rng.below(n + 1), x);
                    }
                    2 => a.swap(rng.below(n), rng.below(n)),
                    3 => a.truncate(rng.below(n)),
                    4 => a.push(extreme_value(rng)),
                    _ => {
                        let i = rng.below(n);
                        a[i] = extreme_value(rng);
                    }
                }
            }
            Value::Object(o) if !o.is_empty() => {
                let keys: Vec<String> = o.keys().cloned().collect();
                let k = rng.pick(&keys).clone();
                match rng.below(4) {
                    0 => {
                        o.remove(&k);
                    }
                    1 => {
                        let k2 = rng.pick(&keys).clone();
                        let a = o[&k].clone();
                        let b = o[&k2].clone();
                        o.insert(k.clone(), b);
                        o.insert(k2, a);
                    }
                    2 => {
                        o.insert(format!("{k}_x"), extreme_value(rng));
                    }
                    _ => {
                        o.insert(k, extreme_value(rng));
                    }
                }
            }
            _ => *node = extreme_value(rng),
        }
    }
}
