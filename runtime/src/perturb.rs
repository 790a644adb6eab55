//! Perturbations during training (`megac train --perturb POINT:KIND[@STEP]`), for
//! fault-tolerance studies: the points and kinds of `megac scope --perturb`
//! ([`crate::infer::Perturbation`]), applied to a training run.
//!
//! - An activation point (`layers.1.out`, `layers.0.attn`, ...) is perturbed by a `perturb`
//!   instruction the `perturb` pass (megac-passes) compiled into the plan, right after the
//!   instruction that writes it, in the forward of every micro-batch (with `@STEP`: of that
//!   step only), over the whole micro-batch; every reader, the backward included, reads
//!   the perturbed copy (the perturbation itself is not differentiated: its gradient is the
//!   identity). This module only checks that the plan has it.
//! - A weight (`weights.NAME`) is perturbed once, at the start of step STEP (without
//!   `@STEP`: of step 1), before its first micro-batch, and stays so: the optimizer goes on
//!   from the perturbed values (a fault in memory).
//! - The random numbers are a function of `--perturb-seed`, the point, the step and (for
//!   activations) the micro-batch, so a run repeats bit for bit.
//!
//! Every layout (pipeline stages run their chunks' `perturb` instructions; a weight is
//! perturbed on each stage holding a copy); `patch` is for `megac scope` only. A 16-bit
//! working weight (bf16/fp16 mixed precision) is perturbed in the 16-bit copy the kernels
//! read, as a hardware fault of that memory would be; its fp32 master copy is left as it
//! is, so the step's optimizer update, which rounds the master into the working weight,
//! ends the fault: it lasts the forward and backward of every micro-batch of its step. Every rank perturbs its own
//! shard of the point or weight with the same random stream, so replicas (a replicated
//! weight over dp or tp, the residual stream over tp) stay equal; a sharded tensor's
//! perturbation therefore differs from the one-device run's (and `noise` is relative to the
//! shard's RMS). `zero-head(HEAD)` names the global head: under tp the rank that holds it
//! zeroes it.

use megac_ir::gate::CheckedPlan;
use megac_ir::plan::BufId;

use crate::error::RuntimeError;
use crate::infer::{apply, stream_seed, PerturbKind};

pub use megac_ir::perturb::TrainPerturbation;

/// The weight perturbations of one rank's training run, resolved against its plan (the
/// activations' are `perturb` instructions of the plan itself).
pub(crate) struct Perturber {
    /// Weights: the parameter's buffers this rank holds (its own and tied copies), point,
    /// kind, step.
    weights: Vec<(Vec<BufId>, String, PerturbKind, u64)>,
    seed: u64,
}

/// Whether `plan` has a training `perturb` instruction of `point` (the `perturb` pass
/// compiled it in).
fn compiled(plan: &CheckedPlan, point: &str) -> bool {
    let progs = plan.roles.iter().flat_map(|r| {
        std::iter::once(&r.microbatch[..]).chain(
            r.pipeline
                .iter()
                .flat_map(|p| p.chunks.iter().map(|c| &c.forward[..])),
        )
    });
    progs.flatten().any(|i| {
        matches!(i, megac_ir::plan::Instr::Kernel {
            op: megac_ir::OpKind::Perturb { point: p, train: true, .. }, ..
        } if p == point)
    })
}

impl Perturber {
    /// Resolve `perturbations` against `plan` (None when there are no weight
    /// perturbations). An activation perturbation must be compiled into the plan.
    pub(crate) fn new(
        plan: &CheckedPlan,
        perturbations: &[TrainPerturbation],
        seed: u64,
        rank: usize,
        mem: &crate::memory::Memory,
    ) -> Result<Option<Perturber>, RuntimeError> {
        let mut out = Perturber {
            weights: Vec::new(),
            seed,
        };
        for tp in perturbations {
            let p = &tp.perturbation;
            let Some(name) = p.point.strip_prefix("weights.") else {
                if !compiled(plan, &p.point) {
                    return Err(RuntimeError::Unsupported(format!(
                        "--perturb {}: activation perturbations are compiled into the plan \
                         by the perturb pass, and this plan has none of this point (megac \
                         train --perturb compiles them; a plan of megac compile has none)",
                        p.point
                    )));
                }
                continue;
            };
            let param = plan.params.iter().find(|q| q.name == name).ok_or_else(|| {
                RuntimeError::Unsupported(format!(
                    "--perturb {}: the model has no parameter `{name}` (the names are \
                     Hugging Face's, e.g. `weights.{}`)",
                    p.point,
                    plan.params.first().map_or("", |q| q.name.as_str())
                ))
            })?;
            if matches!(p.kind, PerturbKind::ZeroHead(_) | PerturbKind::Patch(_)) {
                return Err(RuntimeError::Unsupported(format!(
                    "--perturb {}: zero-head and patch change activations, not weights",
                    p.point
                )));
            }
            let _ = rank;
            let held: Vec<BufId> = std::iter::once(param.buffer)
                .chain(param.tied_copies.iter().copied())
                .filter(|&b| mem.holds(b))
                .collect();
            out.weights
                .push((held, p.point.clone(), p.kind.clone(), tp.step.unwrap_or(1)));
        }
        Ok((!out.weights.is_empty()).then_some(out))
    }

    /// Perturb the weights whose step is `step` (at its start): every copy this rank holds
    /// (a tied weight's on two stages) with the same stream. A 16-bit working weight (bf16
    /// or fp16 mixed precision) is perturbed in the working copy the kernels read
    /// ([`apply_working`]); its fp32 master copy is not touched.
    pub(crate) fn weights(&self, mem: &mut crate::memory::Memory, step: u64) {
        for (bufs, name, kind, at) in &self.weights {
            if *at == step {
                let seed = stream_seed(self.seed, &format!("{name}@{step}"));
                for &b in bufs {
                    if let Some((half, bits)) = mem.half_bits_mut(b) {
                        apply_working(kind, half, bits, seed);
                        continue;
                    }
                    let mut w = mem.read_f32(b);
                    apply(kind, &mut w, seed);
                    mem.write_f32(b, &w);
                }
            }
        }
    }
}

/// Apply `kind` to the bit patterns `bits` of a 16-bit working weight of format `half`, as
/// a fault of the 16-bit memory would: `bitflip` flips a bit of the named field of the
/// 16-bit format (bf16: sign bit 15, exponent bits 7-14, mantissa bits 0-6; fp16: sign 15,
/// exponent 10-14, mantissa 0-9) with the stream of the fp32 kind, so flipping the same
/// bit twice restores the weight bit for bit; `noise` and `scale` are computed in f32 on
/// the working values (widened exactly) and rounded once to the format.
pub fn apply_working(
    kind: &PerturbKind,
    half: megac_kernels::precision::Half,
    bits: &mut [u16],
    seed: u64,
) {
    use megac_ir::perturb::BitField;
    use megac_kernels::precision::Half;
    if let PerturbKind::Bitflip(field, rate) = kind {
        let (first, count) = match (field, half) {
            (BitField::Sign, _) => (15, 1),
            (BitField::Exponent, Half::Bf16) => (7, 8),
            (BitField::Mantissa, Half::Bf16) => (0, 7),
            (BitField::Exponent, Half::F16) => (10, 5),
            (BitField::Mantissa, Half::F16) => (0, 10),
        };
        megac_kernels::perturb::bitflip16(bits, first, count, *rate, seed);
        return;
    }
    let mut w: Vec<f32> = bits.iter().map(|&x| half.to_f32(x)).collect();
    apply(kind, &mut w, seed);
    megac_kernels::precision::narrow(half, &w, bits);
}
