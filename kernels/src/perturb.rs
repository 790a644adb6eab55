//! The kernels of the `perturb` op (docs/scope.md): seeded noise, scaling, bit flips and
//! head knockout on f32 tensors, in place. A perturbation's random numbers come from
//! SplitMix64 seeded by [`stream_seed`], so a run repeats bit for bit and the same bit flip
//! applied twice restores the tensor.

/// SplitMix64 (the runtime's generator, `megac_runtime::rng`; the same numbers for a seed).
struct Mix(u64);

impl Mix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The random stream of a perturbation: a function of the seed and a name only (the point,
/// and during training its step and micro-batch).
pub fn stream_seed(seed: u64, name: &str) -> u64 {
    let mut x = Mix(seed).next_u64();
    for b in name.bytes() {
        x = Mix(x ^ u64::from(b)).next_u64();
    }
    x
}

/// Multiply every element by `f` (in f64, rounded once).
pub fn scale(x: &mut [f32], f: f64) {
    x.iter_mut().for_each(|v| *v = (f64::from(*v) * f) as f32);
}

/// Add Gaussian noise (Box-Muller) of standard deviation `sigma` times the RMS of `x`.
pub fn noise(x: &mut [f32], sigma: f64, seed: u64) {
    let mut rng = Mix(seed);
    let n = x.len().max(1) as f64;
    let rms = (x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / n).sqrt();
    let std = (sigma * rms) as f32;
    for v in x.iter_mut() {
        let (u1, u2) = (1.0 - rng.next_f64(), rng.next_f64());
        let g = ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32;
        *v += std * g;
    }
}

/// The bit-flip stream: per element a draw against `rate`, then the bit among `count` from
/// `first` (drawn whether or not it is hit, so the stream is the same for every rate):
/// `Some(bit)` where the element is hit.
fn flips(first: u32, count: u32, rate: f64, seed: u64) -> impl Iterator<Item = Option<u32>> {
    let mut rng = Mix(seed);
    let count = u64::from(count.max(1));
    std::iter::repeat_with(move || {
        let hit = rng.next_f64() < rate;
        let bit = u64::from(first) + (rng.next_u64() % count);
        hit.then_some(bit as u32)
    })
}

/// In each element with probability `rate`, flip one uniformly chosen bit of the `count`
/// bits from bit `first` of its float32.
pub fn bitflip(x: &mut [f32], first: u32, count: u32, rate: f64, seed: u64) {
    for (v, flip) in x.iter_mut().zip(flips(first, count, rate, seed)) {
        if let Some(bit) = flip {
            *v = f32::from_bits(v.to_bits() ^ (1u32 << bit));
        }
    }
}

/// [`bitflip`] on 16-bit floats (bf16 or fp16 bit patterns): the same stream, so applied
/// twice with the same seed it restores `x` bit for bit.
pub fn bitflip16(x: &mut [u16], first: u32, count: u32, rate: f64, seed: u64) {
    for (v, flip) in x.iter_mut().zip(flips(first, count, rate, seed)) {
        if let Some(bit) = flip {
            *v ^= 1u16 << bit;
        }
    }
}

/// Zero head `head` (of `heads`, each `d` wide) in every row of `x`.
pub fn zero_head(x: &mut [f32], head: usize, heads: usize, d: usize) {
    for row in x.chunks_mut((heads * d).max(1)) {
        if let Some(h) = row.get_mut(head * d..(head + 1) * d) {
            h.fill(0.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bitflip_twice_restores_and_scale_is_exact() {
        let orig: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.37).collect();
        let mut x = orig.clone();
        bitflip(&mut x, 23, 8, 0.3, stream_seed(7, "p"));
        let changed = x
            .iter()
            .zip(&orig)
            .filter(|(a, b)| a.to_bits() != b.to_bits());
        assert!((200..400).contains(&changed.count()));
        bitflip(&mut x, 23, 8, 0.3, stream_seed(7, "p"));
        assert!(x.iter().zip(&orig).all(|(a, b)| a.to_bits() == b.to_bits()));
        scale(&mut x, 2.0);
        assert!(x.iter().zip(&orig).all(|(a, b)| *a == 2.0 * b));
        let mut z = orig.clone();
        noise(&mut z, 0.0, 1);
        assert!(z.iter().zip(&orig).all(|(a, b)| a == b));
    }
}
