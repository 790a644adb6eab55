//! megac's one seeded random stream: SplitMix64 (Steele et al.), the same numbers on every
//! machine for a seed. Sampling in `megac generate`, `--perturb`'s noise and bit flips,
//! `--inject`'s jitter (runtime) and `megac simulate --jitter` draw from it.

/// SplitMix64: a 64-bit state advanced by a constant and mixed.
#[derive(Clone, Debug, Default)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// Rank `rank`'s stream of seed `seed` (jitter: each rank, or simulated stage, its own).
    pub fn for_rank(seed: u64, rank: usize) -> SplitMix64 {
        SplitMix64(seed ^ (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in (0, 1): never 0, so its logarithm is finite.
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}
