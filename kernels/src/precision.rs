//! Rounding between f32 and the 16-bit storage types of mixed precision (bf16, fp16).
//!
//! Under mixed precision every kernel computes in f32: its 16-bit operands are widened
//! exactly, and its results are rounded once, to nearest with ties to even (PyTorch's
//! `.to(torch.bfloat16)`, CUDA's `__float2bfloat16_rn`). Values out of fp16's range round
//! to ±infinity, which the fp16 loss scaler detects.

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

/// A 16-bit float format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Half {
    /// bfloat16: f32's exponent range, 8 significant bits (unit roundoff 2^-8).
    Bf16,
    /// IEEE binary16: 5 exponent bits (max 65504), 11 significant bits (unit roundoff 2^-11).
    F16,
}

impl Half {
    /// The unit roundoff: the largest relative error of one rounding to this format.
    pub fn unit_roundoff(self) -> f64 {
        match self {
            Half::Bf16 => 2f64.powi(-8),
            Half::F16 => 2f64.powi(-11),
        }
    }

    /// `x` rounded to this format (nearest, ties to even), as bits.
    pub fn from_f32(self, x: f32) -> u16 {
        match self {
            Half::Bf16 => bf16_bits(x),
            Half::F16 => f16::from_f32(x).to_bits(),
        }
    }

    /// The exact f32 value of `bits` in this format.
    pub fn to_f32(self, bits: u16) -> f32 {
        match self {
            Half::Bf16 => f32::from_bits(u32::from(bits) << 16),
            Half::F16 => f16::from_bits(bits).to_f32(),
        }
    }

    /// `x` rounded to this format and back to f32.
    pub fn round(self, x: f32) -> f32 {
        self.to_f32(self.from_f32(x))
    }
}

/// bf16 bits of `x`, rounded to nearest even (branch-free but for NaN, so the loops over
/// slices vectorise); NaN stays a quiet NaN.
#[inline]
fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

/// Widen `src` exactly into `dst` (same length).
pub fn widen(kind: Half, src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "widen: lengths differ");
    // One loop per format, so that each vectorises.
    match kind {
        Half::Bf16 => {
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = f32::from_bits(u32::from(s) << 16);
            }
        }
        // half's slice conversions use the CPU's F16C instructions when it has them.
        Half::F16 => src.reinterpret_cast::<f16>().convert_to_f32_slice(dst),
    }
}

/// Round `src` once into `dst` (same length).
pub fn narrow(kind: Half, src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len(), "narrow: lengths differ");
    match kind {
        Half::Bf16 => {
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = bf16_bits(s);
            }
        }
        Half::F16 => dst
            .reinterpret_cast_mut::<f16>()
            .convert_from_f32_slice(src),
    }
}

/// Round every element of `x` to `kind` in place (the values stay f32).
pub fn round_in_place(kind: Half, x: &mut [f32]) {
    for v in x {
        *v = kind.round(*v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn bf16_bits_agree_with_the_half_crate() {
        let mut x = 0x1234_5678u32;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let v = f32::from_bits(x);
            let want = bf16::from_f32(v);
            if v.is_nan() {
                assert!(bf16::from_bits(bf16_bits(v)).is_nan());
            } else {
                assert_eq!(bf16_bits(v), want.to_bits(), "{v:e}");
                assert_eq!(Half::Bf16.to_f32(want.to_bits()), want.to_f32());
            }
        }
        for v in [
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            -0.0,
            f32::MIN_POSITIVE / 3.0,
        ] {
            assert_eq!(bf16_bits(v), bf16::from_f32(v).to_bits(), "{v:e}");
        }
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even significand, 1.
        assert_eq!(Half::Bf16.round(1.0 + 2f32.powi(-8)), 1.0);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: even is 1 + 2^-6.
        assert_eq!(
            Half::Bf16.round(1.0 + 3.0 * 2f32.powi(-8)),
            1.0 + 2f32.powi(-6)
        );
        // Just above the tie rounds up.
        assert_eq!(
            Half::Bf16.round(1.0 + 2f32.powi(-8) + 2f32.powi(-20)),
            1.0 + 2f32.powi(-7)
        );
        assert_eq!(Half::Bf16.round(-3.0), -3.0);
        assert!(Half::Bf16.round(f32::NAN).is_nan());
        assert_eq!(Half::Bf16.round(f32::INFINITY), f32::INFINITY);
    }

    #[test]
    fn fp16_overflows_to_infinity_and_keeps_subnormals() {
        assert_eq!(Half::F16.round(65504.0), 65504.0);
        assert_eq!(Half::F16.round(70000.0), f32::INFINITY);
        assert_eq!(Half::F16.round(-70000.0), f32::NEG_INFINITY);
        // The smallest subnormal, 2^-24, is exact; half of it ties to zero.
        assert_eq!(Half::F16.round(2f32.powi(-24)), 2f32.powi(-24));
        assert_eq!(Half::F16.round(2f32.powi(-25)), 0.0);
        assert_eq!(Half::F16.round(1.0 + 2f32.powi(-11)), 1.0);
    }

    #[test]
    fn rounding_error_is_within_the_unit_roundoff() {
        let mut x = 0.1f32;
        for _ in 0..1000 {
            x = (x * 1.618_034 + 0.3).fract() * 100.0 - 50.0;
            for kind in [Half::Bf16, Half::F16] {
                let r = kind.round(x);
                let rel = ((r - x) / x).abs() as f64;
                assert!(rel <= kind.unit_roundoff(), "{kind:?} {x} -> {r}: {rel}");
                // Widening is exact: a second rounding changes nothing.
                assert_eq!(kind.round(r), r);
            }
        }
    }

    #[test]
    fn fp16_slices_agree_with_the_scalar_conversion() {
        let mut x = 0x9e37_79b9u32;
        let xs: Vec<f32> = (0..4099)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                // Values across fp16's range, its subnormals, and overflow.
                f32::from_bits(x) % 1e5
            })
            .filter(|v| !v.is_nan())
            .collect();
        let mut bits = vec![0u16; xs.len()];
        narrow(Half::F16, &xs, &mut bits);
        let mut back = vec![0f32; xs.len()];
        widen(Half::F16, &bits, &mut back);
        for ((&v, &b), &w) in xs.iter().zip(&bits).zip(&back) {
            assert_eq!(b, f16::from_f32(v).to_bits(), "{v:e}");
            assert_eq!(w, f16::from_bits(b).to_f32());
        }
    }

    #[test]
    fn widen_and_narrow_round_trip() {
        let xs = [0.0f32, -0.0, 1.5, -2.25, 1e-3, 3.0e4];
        for kind in [Half::Bf16, Half::F16] {
            let mut bits = [0u16; 6];
            narrow(kind, &xs, &mut bits);
            let mut back = [0f32; 6];
            widen(kind, &bits, &mut back);
            for (x, b) in xs.iter().zip(back) {
                assert_eq!(kind.round(*x), b);
            }
        }
    }
}
