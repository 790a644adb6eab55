//! Parameter initialisation without `--init`: every element is a pure function of
//! (seed, parameter name, global element index), so every layout and every rank that holds
//! an element computes the same value.

use megac_ir::plan::Init;

/// splitmix64: a well-mixed 64-bit hash step.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a hash of a parameter name.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

/// A uniform in (0, 1) from a hash.
fn unit(h: u64) -> f64 {
    ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// Fill `out` with elements `first..first + out.len()` of parameter `name`.
pub fn init_param(seed: u64, name: &str, init: &Init, first: u64, out: &mut [f32]) {
    for (i, x) in out.iter_mut().enumerate() {
        *x = init_value(seed, name, init, first + i as u64);
    }
}

/// Fill `out[i]` with global element `indices[i]` of parameter `name` (a rank's shard).
pub fn init_at(seed: u64, name: &str, init: &Init, indices: &[usize], out: &mut [f32]) {
    for (x, &i) in out.iter_mut().zip(indices) {
        *x = init_value(seed, name, init, i as u64);
    }
}

/// Global element `index` of parameter `name`.
pub fn init_value(seed: u64, name: &str, init: &Init, index: u64) -> f32 {
    match init {
        Init::Zeros => 0.0,
        Init::Ones => 1.0,
        Init::Normal { std } => {
            let base = mix(seed ^ mix(name_hash(name)));
            let h = mix(base ^ index.wrapping_mul(0xD1B5_4A32_D192_ED03));
            let (u1, u2) = (unit(h), unit(mix(h)));
            // Box-Muller.
            let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
            (z * std) as f32
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elements_depend_only_on_seed_name_and_index() {
        let init = Init::Normal { std: 0.02 };
        let mut whole = vec![0.0; 1000];
        init_param(7, "w", &init, 0, &mut whole);
        let mut tail = vec![0.0; 400];
        init_param(7, "w", &init, 600, &mut tail);
        assert_eq!(&whole[600..], &tail[..]);
        let mut other = vec![0.0; 1000];
        init_param(7, "v", &init, 0, &mut other);
        assert_ne!(whole, other);
        init_param(8, "w", &init, 0, &mut other);
        assert_ne!(whole, other);
    }

    #[test]
    fn normal_has_the_requested_moments() {
        let mut x = vec![0.0f32; 200_000];
        init_param(1, "m", &Init::Normal { std: 0.5 }, 0, &mut x);
        let n = x.len() as f64;
        let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
        let var = x
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / n;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var.sqrt() - 0.5).abs() < 0.01, "std {}", var.sqrt());
    }
}
