//! numpy's legacy `RandomState` (MT19937) as far as megatron-core's datasets use it:
//! seeding with an integer and `shuffle` of a 1-D array. Bit-for-bit the same permutations, so
//! the document and shuffle indices of [`super::megatron`] are Megatron's.

/// The Mersenne Twister MT19937 of `numpy.random.RandomState(seed)`.
pub struct RandomState {
    key: [u32; 624],
    pos: usize,
}

impl RandomState {
    /// `numpy.random.RandomState(seed)` for an integer seed (numpy's `mt19937_seed`, the
    /// reference `init_genrand`).
    pub fn new(seed: u32) -> RandomState {
        let mut key = [0u32; 624];
        let mut s = seed;
        for (pos, k) in key.iter_mut().enumerate() {
            *k = s;
            s = 1_812_433_253u32
                .wrapping_mul(s ^ (s >> 30))
                .wrapping_add(pos as u32 + 1);
        }
        RandomState { key, pos: 624 }
    }

    fn generate(&mut self) {
        const UPPER: u32 = 0x8000_0000;
        const LOWER: u32 = 0x7fff_ffff;
        const MATRIX_A: u32 = 0x9908_b0df;
        for i in 0..624 {
            let y = (self.key[i] & UPPER) | (self.key[(i + 1) % 624] & LOWER);
            let mag = if y & 1 == 1 { MATRIX_A } else { 0 };
            self.key[i] = self.key[(i + 397) % 624] ^ (y >> 1) ^ mag;
        }
        self.pos = 0;
    }

    /// The next 32 random bits (`mt19937_next32`).
    pub fn next_u32(&mut self) -> u32 {
        if self.pos == 624 {
            self.generate();
        }
        let mut y = self.key[self.pos];
        self.pos += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// The next 64 random bits: two 32-bit draws, the first one the high half.
    pub fn next_u64(&mut self) -> u64 {
        let hi = u64::from(self.next_u32());
        (hi << 32) | u64::from(self.next_u32())
    }

    /// A uniform integer in `0..=max` (numpy's `random_interval`: masked rejection sampling,
    /// 32-bit draws while `max` fits 32 bits).
    pub fn interval(&mut self, max: u64) -> u64 {
        if max == 0 {
            return 0;
        }
        let mut mask = max;
        for shift in [1, 2, 4, 8, 16, 32] {
            mask |= mask >> shift;
        }
        if max <= u64::from(u32::MAX) {
            loop {
                let v = u64::from(self.next_u32()) & mask;
                if v <= max {
                    return v;
                }
            }
        }
        loop {
            let v = self.next_u64() & mask;
            if v <= max {
                return v;
            }
        }
    }

    /// `RandomState.shuffle` of a 1-D array: Fisher-Yates from the last element down.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.interval(i as u64) as usize;
            items.swap(i, j);
        }
    }
}
