//! `--inject SPEC`: faults that change a run's timing, never its numbers.
//!
//! - `slow-rank:R:F`: rank R's compute is F times slower (after each compute segment, the
//!   rank waits (F−1)× the segment's measured duration).
//! - `slow-link:A-B:F`: transfers between ranks A and B are F times slower (each send and
//!   receive between them waits (F−1)× its wire time: the send's measured copy time, at least
//!   the nominal 5 µs + bytes / 1 GB/s).
//! - `jitter:S` or `jitter:S:SEED`: each compute segment is slowed by the factor 1 + S·|z|,
//!   z standard normal, drawn from a SplitMix64 stream seeded by (SEED, rank) (SEED 0 by
//!   default).
//! - `clock:R:MS:PPM`: rank R's *recorded* clock reads MS milliseconds ahead and runs PPM
//!   parts per million fast (for testing the alignment of `megac scan`); nothing else changes.

/// A malformed `--inject` spec: the spec as given and what is wrong.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("--inject {spec}: {message}")]
pub struct InjectError {
    /// The spec as the user gave it.
    pub spec: String,
    /// What is wrong, and the valid forms.
    pub message: String,
}

/// One parsed `--inject` spec.
#[derive(Clone, Debug, PartialEq)]
pub enum Inject {
    /// Rank `rank`'s compute `factor` times slower.
    SlowRank {
        /// World rank.
        rank: usize,
        /// Slowdown factor (≥ 1).
        factor: f64,
    },
    /// Transfers between ranks `a` and `b` `factor` times slower.
    SlowLink {
        /// One end.
        a: usize,
        /// The other end.
        b: usize,
        /// Slowdown factor (≥ 1).
        factor: f64,
    },
    /// Every compute segment slowed by 1 + `std`·|z|.
    Jitter {
        /// Relative standard deviation.
        std: f64,
        /// Seed of the random stream.
        seed: u64,
    },
    /// Rank `rank`'s recorded clock: `offset_ms` ahead, `drift_ppm` fast.
    Clock {
        /// World rank.
        rank: usize,
        /// Offset in milliseconds.
        offset_ms: f64,
        /// Drift in parts per million.
        drift_ppm: f64,
    },
}

const FORMS: &str =
    "expected slow-rank:R:F, slow-link:A-B:F, jitter:S[:SEED] or clock:R:MS:PPM (e.g. slow-rank:2:1.5)";

impl Inject {
    /// Parse one spec (`slow-rank:2:1.5`).
    pub fn parse(spec: &str) -> Result<Inject, InjectError> {
        let err = |message: String| InjectError {
            spec: spec.to_string(),
            message,
        };
        let parts: Vec<&str> = spec.split(':').collect();
        let rank = |s: &str| {
            s.parse::<usize>()
                .map_err(|_| err(format!("`{s}` is not a rank (a number from 0)")))
        };
        let num = |s: &str, what: &str| match s.parse::<f64>() {
            Ok(x) if x.is_finite() => Ok(x),
            _ => Err(err(format!("`{s}` is not a number ({what})"))),
        };
        let factor = |s: &str| {
            let f = num(s, "the slowdown factor")?;
            if f < 1.0 {
                return Err(err(format!(
                    "factor {s} is below 1 (injection only slows down)"
                )));
            }
            Ok(f)
        };
        match parts.as_slice() {
            ["slow-rank", r, f] => Ok(Inject::SlowRank {
                rank: rank(r)?,
                factor: factor(f)?,
            }),
            ["slow-link", pair, f] => {
                let (a, b) = pair
                    .split_once('-')
                    .ok_or_else(|| err(format!("`{pair}` is not a pair of ranks A-B")))?;
                let (a, b) = (rank(a)?, rank(b)?);
                if a == b {
                    return Err(err(format!(
                        "a link joins two different ranks, not {a}-{b}"
                    )));
                }
                Ok(Inject::SlowLink {
                    a,
                    b,
                    factor: factor(f)?,
                })
            }
            ["jitter", s, rest @ ..] if rest.len() <= 1 => {
                let std = num(s, "the relative standard deviation")?;
                if std < 0.0 {
                    return Err(err(format!("jitter {s} is negative")));
                }
                let seed = match rest {
                    [seed] => seed
                        .parse::<u64>()
                        .map_err(|_| err(format!("`{seed}` is not a seed (a number from 0)")))?,
                    _ => 0,
                };
                Ok(Inject::Jitter { std, seed })
            }
            ["clock", r, ms, ppm] => Ok(Inject::Clock {
                rank: rank(r)?,
                offset_ms: num(ms, "the offset in ms")?,
                drift_ppm: num(ppm, "the drift in ppm")?,
            }),
            _ => Err(err(FORMS.to_string())),
        }
    }

    /// The highest rank the spec names.
    pub fn max_rank(&self) -> Option<usize> {
        match self {
            Inject::SlowRank { rank, .. } | Inject::Clock { rank, .. } => Some(*rank),
            Inject::SlowLink { a, b, .. } => Some(*a.max(b)),
            Inject::Jitter { .. } => None,
        }
    }
}

/// Check every spec against a world of `world` ranks.
pub fn check_ranks(specs: &[(String, Inject)], world: usize) -> Result<(), InjectError> {
    for (spec, i) in specs {
        if let Some(r) = i.max_rank().filter(|&r| r >= world) {
            return Err(InjectError {
                spec: spec.clone(),
                message: format!("rank {r} is outside the plan's {world} ranks (0..{world})"),
            });
        }
    }
    Ok(())
}

/// What one rank applies: its compute factor, jitter, slow links and recorded clock.
#[derive(Clone, Debug, Default)]
pub struct RankFaults {
    /// Compute slowdown (1 = none).
    pub compute: f64,
    /// Jitter's relative standard deviation (0 = none).
    pub jitter: f64,
    /// Jitter's random stream.
    pub rng: SplitMix64,
    /// (peer, factor) for each slow link of this rank.
    pub links: Vec<(usize, f64)>,
    /// Recorded clock offset in ns.
    pub offset_ns: f64,
    /// Recorded clock drift (fraction: 1e-6 per ppm).
    pub drift: f64,
}

impl RankFaults {
    /// The faults of `rank` under `specs`.
    pub fn of(specs: &[Inject], rank: usize) -> RankFaults {
        let mut f = RankFaults {
            compute: 1.0,
            ..Default::default()
        };
        for s in specs {
            match *s {
                Inject::SlowRank { rank: r, factor } if r == rank => f.compute *= factor,
                Inject::SlowLink { a, b, factor } if a == rank || b == rank => {
                    f.links.push((if a == rank { b } else { a }, factor))
                }
                Inject::Jitter { std, seed } => {
                    f.jitter = std;
                    f.rng = SplitMix64::for_rank(seed, rank);
                }
                Inject::Clock {
                    rank: r,
                    offset_ms,
                    drift_ppm,
                } if r == rank => {
                    f.offset_ns = offset_ms * 1e6;
                    f.drift = drift_ppm * 1e-6;
                }
                _ => {}
            }
        }
        f
    }

    /// Whether any timing fault applies (clock faults change records only).
    pub fn slows(&self) -> bool {
        self.compute != 1.0 || self.jitter > 0.0 || !self.links.is_empty()
    }

    /// The factor by which this compute segment is slowed.
    pub fn compute_factor(&mut self) -> f64 {
        let j = if self.jitter > 0.0 {
            1.0 + self.jitter * self.rng.normal().abs()
        } else {
            1.0
        };
        self.compute * j
    }

    /// The slowdown of transfers to or from `peer` (1 when the link is healthy).
    pub fn link_factor(&self, peer: usize) -> f64 {
        self.links
            .iter()
            .filter(|l| l.0 == peer)
            .map(|l| l.1)
            .product()
    }
}

/// The seeded stream of jitter.
pub use crate::rng::SplitMix64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_errors_say_why() {
        assert_eq!(
            Inject::parse("slow-rank:2:1.5").unwrap(),
            Inject::SlowRank {
                rank: 2,
                factor: 1.5
            }
        );
        assert_eq!(
            Inject::parse("slow-link:0-3:2").unwrap(),
            Inject::SlowLink {
                a: 0,
                b: 3,
                factor: 2.0
            }
        );
        assert_eq!(
            Inject::parse("jitter:0.2:7").unwrap(),
            Inject::Jitter { std: 0.2, seed: 7 }
        );
        assert_eq!(
            Inject::parse("clock:1:-50:200").unwrap(),
            Inject::Clock {
                rank: 1,
                offset_ms: -50.0,
                drift_ppm: 200.0
            }
        );
        let e = |s: &str| Inject::parse(s).unwrap_err().to_string();
        assert_eq!(
            e("slow-rank:x:2"),
            "--inject slow-rank:x:2: `x` is not a rank (a number from 0)"
        );
        assert!(e("slow-rank:1:0.5").contains("below 1"));
        assert!(e("slow-link:1-1:2").contains("two different ranks"));
        assert!(e("slow-link:12:2").contains("not a pair"));
        assert!(e("fast:1").contains("expected slow-rank:R:F"));
        assert!(e("clock:1:nan:0").contains("not a number"));
        let specs = vec![(
            "slow-rank:4:2".to_string(),
            Inject::parse("slow-rank:4:2").unwrap(),
        )];
        assert!(check_ranks(&specs, 4)
            .unwrap_err()
            .to_string()
            .contains("outside"));
        assert!(check_ranks(&specs, 5).is_ok());
    }

    #[test]
    fn faults_per_rank() {
        let specs: Vec<Inject> = ["slow-rank:1:3", "slow-link:0-1:2", "clock:1:50:200"]
            .iter()
            .map(|s| Inject::parse(s).unwrap())
            .collect();
        let r0 = RankFaults::of(&specs, 0);
        let mut r1 = RankFaults::of(&specs, 1);
        assert_eq!(
            (r0.compute, r0.link_factor(1), r0.link_factor(2)),
            (1.0, 2.0, 1.0)
        );
        assert_eq!(r1.compute_factor(), 3.0);
        assert_eq!(r1.offset_ns, 50e6);
        assert!((r1.drift - 200e-6).abs() < 1e-12);
        assert!(RankFaults::of(&specs, 2).links.is_empty());
    }
}
