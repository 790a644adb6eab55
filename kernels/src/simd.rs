//! Vector-friendly scalar math and CPU feature dispatch.
//!
//! The loops in this crate are written so LLVM can vectorize them (no libm calls in hot
//! loops, fixed-width lane accumulators for reductions). [`simd_dispatch!`] compiles a
//! kernel body twice, once for the x86-64 baseline and once with AVX2+FMA enabled, and
//! picks the right one at run time. Both copies perform the same IEEE operations in the
//! same order (Rust never contracts `a * b + c` into an FMA on its own), so results do not
//! depend on which copy runs.

/// Defines `fn $name(args) -> ret` whose body is compiled for the baseline and for
/// AVX2+FMA, dispatching on the CPU's features at run time.
macro_rules! simd_dispatch {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn generic($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    generic($($arg),*)
                }
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    // SAFETY: the CPU supports the features `avx2` was compiled for.
                    return unsafe { avx2($($arg),*) };
                }
            }
            generic($($arg),*)
        }
    };
}
pub(crate) use simd_dispatch;

const EXP_HI: f32 = 88.37;
const EXP_LO: f32 = -87.33;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// `e^x` in f32, within about 1 ulp of the exact value (Cephes `expf` polynomial), and
/// branch-free so loops over it vectorize. Returns +inf for `x > 88.37` (a few values
/// below f32::MAX are lost, which no caller here can produce), 0 for `x < -87.33` (no
/// subnormal results) and NaN for NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let xc = x.clamp(EXP_LO, EXP_HI);
    let t = xc * LOG2E + ROUND_MAGIC;
    let n = t - ROUND_MAGIC;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let r2 = r * r;
    let p = (((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2)
        * r
        + 1.666_666_5e-1)
        * r
        + 0.5)
        * r2
        + r
        + 1.0;
    let scale = f32::from_bits((t.to_bits() << 23).wrapping_add(127 << 23));
    let y = p * scale;
    if x > EXP_HI {
        f32::INFINITY
    } else if x < EXP_LO {
        0.0
    } else {
        y
    }
}

/// The logistic function `1 / (1 + e^-x)`.
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `(sigmoid(z), 1 - sigmoid(z))`, both to a few ulp even where one of them is tiny
/// (`1 - sigmoid(z)` is not formed by a cancelling subtraction).
#[inline(always)]
pub(crate) fn sigmoid_pair(z: f32) -> (f32, f32) {
    let e = exp(-z.abs());
    let r = 1.0 / (1.0 + e);
    let small = e * r;
    if z >= 0.0 {
        (r, small)
    } else {
        (small, r)
    }
}

/// Number of lanes used by the reductions below.
const LANES: usize = 8;

/// The maximum of `x` (`-inf` for an empty slice).
#[inline(always)]
pub(crate) fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            acc[l] = if c[l] > acc[l] { c[l] } else { acc[l] };
        }
    }
    let mut m = f32::NEG_INFINITY;
    for v in acc.iter().chain(tail) {
        m = if *v > m { *v } else { m };
    }
    m
}

/// `sum(x)` accumulated in f64 lanes.
#[inline(always)]
pub(crate) fn sum_f64(x: &[f32]) -> f64 {
    let mut acc = [0.0f64; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            acc[l] += c[l] as f64;
        }
    }
    finish(acc, tail.iter().map(|&v| v as f64))
}

/// `sum(x * x)` accumulated in f64 lanes.
#[inline(always)]
pub(crate) fn sum_sq_f64(x: &[f32]) -> f64 {
    let mut acc = [0.0f64; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            let v = c[l] as f64;
            acc[l] += v * v;
        }
    }
    finish(acc, tail.iter().map(|&v| (v as f64) * (v as f64)))
}

/// `sum(a * b)` accumulated in f64 lanes.
#[inline(always)]
pub(crate) fn dot_f64(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let mut acc = [0.0f64; LANES];
    let ca = a.chunks_exact(LANES);
    let cb = b.chunks_exact(LANES);
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] as f64 * y[l] as f64;
        }
    }
    finish(acc, ta.iter().zip(tb).map(|(&x, &y)| x as f64 * y as f64))
}

/// `Σ (a * b) * c`, each product `a * b` rounded to f32 and the rest in f64 lanes.
#[inline(always)]
pub(crate) fn dot3_f64(a: &[f32], b: &[f32], c: &[f32]) -> f64 {
    let n = a.len();
    let (a, b, c) = (&a[..n], &b[..n], &c[..n]);
    let mut acc = [0.0f64; LANES];
    let main = n - n % LANES;
    for i in (0..main).step_by(LANES) {
        for l in 0..LANES {
            acc[l] += (a[i + l] * b[i + l]) as f64 * c[i + l] as f64;
        }
    }
    finish(acc, (main..n).map(|i| (a[i] * b[i]) as f64 * c[i] as f64))
}

/// `Σ (x - mean)²` for an f64 `mean`, in f64 lanes.
#[inline(always)]
pub(crate) fn sum_sq_dev_f64(x: &[f32], mean: f64) -> f64 {
    let mut acc = [0.0f64; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            let d = c[l] as f64 - mean;
            acc[l] += d * d;
        }
    }
    finish(
        acc,
        tail.iter().map(|&v| (v as f64 - mean) * (v as f64 - mean)),
    )
}

#[inline(always)]
fn finish(acc: [f64; LANES], tail: impl Iterator<Item = f64>) -> f64 {
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for v in tail {
        s += v;
    }
    s
}
