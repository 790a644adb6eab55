//! Perturbations during training (`megac train --perturb POINT:KIND[@STEP]`), for
//! fault-tolerance studies: the points and kinds of `megac scope --perturb`
//! ([`crate::infer::Perturbation`]), applied to a training run.
//!
//! - An activation point (`layers.1.out`, `layers.0.attn`, ...) is perturbed in the forward
//!   of every micro-batch (with `@STEP`: of that step only), right after the instruction
//!   that writes it, over the whole micro-batch; the backward then runs on what the forward
//!   computed from the perturbed value (the perturbation itself is not differentiated: its
//!   gradient is the identity).
//! - A weight (`weights.NAME`) is perturbed once, at the start of step STEP (without
//!   `@STEP`: of step 1), before its first micro-batch, and stays so: the optimizer goes on
//!   from the perturbed values (a fault in memory).
//! - The random numbers are a function of `--perturb-seed`, the point, the step and (for
//!   activations) the micro-batch, so a run repeats bit for bit.
//!
//! Layouts without pipeline parallelism (one device, tp, sp, dp, cp, ep), fp32 parameters
//! for weight perturbations; `patch` is for `megac scope` only. Every rank perturbs its own
//! shard of the point or weight with the same random stream, so replicas (a replicated
//! weight over dp or tp, the residual stream over tp) stay equal; a sharded tensor's
//! perturbation therefore differs from the one-device run's (and `noise` is relative to the
//! shard's RMS). `zero-head(HEAD)` names the global head: under tp the rank that holds it
//! zeroes it.

use megac_ir::gate::CheckedPlan;
use megac_ir::plan::BufId;

use crate::error::RuntimeError;
use crate::exec::StepContext;
use crate::infer::{apply, resolve, segments_of, stream_seed, ActPerturb, Perturbation};
use crate::infer::{PerturbKind, Segment};
use crate::train::Session;

/// A perturbation of a training run: what, and at which step (None: every step for an
/// activation, step 1 for a weight).
#[derive(Clone, Debug, PartialEq)]
pub struct TrainPerturbation {
    /// The point and kind.
    pub perturbation: Perturbation,
    /// The 1-based step, if one.
    pub step: Option<u64>,
}

impl TrainPerturbation {
    /// Parse `POINT:KIND` or `POINT:KIND@STEP`.
    pub fn parse(text: &str) -> Result<TrainPerturbation, String> {
        let (body, step) = match text.rsplit_once('@') {
            Some((body, step)) => {
                let s = step
                    .trim()
                    .parse::<u64>()
                    .ok()
                    .filter(|&s| s >= 1)
                    .ok_or_else(|| {
                        format!("--perturb {text}: `@{step}` is not a step (a number >= 1)")
                    })?;
                (body, Some(s))
            }
            None => (text, None),
        };
        let perturbation = Perturbation::parse(body)?;
        if matches!(perturbation.kind, PerturbKind::Patch(_)) {
            return Err(format!(
                "--perturb {text}: patch replaces one input's activations, for megac scope; \
                 training perturbations are noise, scale, bitflip and zero-head"
            ));
        }
        Ok(TrainPerturbation { perturbation, step })
    }
}

/// The perturbations of one rank's training run, resolved against its plan.
pub(crate) struct Perturber {
    /// Activations: resolved against the micro-batch program, with their steps.
    acts: Vec<(ActPerturb, Option<u64>)>,
    /// Weights: parameter buffer, point, kind, step.
    weights: Vec<(BufId, String, PerturbKind, u64)>,
    seed: u64,
}

impl Perturber {
    /// Resolve `perturbations` against `plan` (None when there are none).
    pub(crate) fn new(
        plan: &CheckedPlan,
        perturbations: &[TrainPerturbation],
        seed: u64,
        rank: usize,
    ) -> Result<Option<Perturber>, RuntimeError> {
        if perturbations.is_empty() {
            return Ok(None);
        }
        let role = plan
            .rank_to_role
            .get(rank)
            .and_then(|&r| plan.roles.get(r as usize))
            .ok_or_else(|| RuntimeError::Plan(format!("rank {rank} has no role")))?;
        if role.pipeline.is_some() {
            return Err(RuntimeError::Unsupported(
                "train --perturb supports plans without pipeline parallelism only so far".into(),
            ));
        }
        let (all, _): (Vec<Segment<'_>>, _) = segments_of(role);
        // zero-head names a global head: resolve it as head 0 (every rank holds one), then
        // place it on the rank that holds it.
        let ps: Vec<Perturbation> = perturbations
            .iter()
            .map(|p| match p.perturbation.kind {
                PerturbKind::ZeroHead(_) => Perturbation {
                    kind: PerturbKind::ZeroHead(0),
                    ..p.perturbation.clone()
                },
                _ => p.perturbation.clone(),
            })
            .collect();
        let (acts, weights) = resolve(plan, &all, &ps)?;
        // Both lists keep the order of `perturbations` within their kind.
        let act_of = perturbations
            .iter()
            .filter(|p| !p.perturbation.point.starts_with("weights."))
            .map(|p| match p.perturbation.kind {
                PerturbKind::ZeroHead(h) => (Some(h as usize), p.step),
                _ => (None, p.step),
            });
        let mut kept = Vec::new();
        for (mut a, (h, step)) in acts.into_iter().zip(act_of) {
            if let (Some(h), crate::infer::Action::ZeroHead { head, heads, .. }) =
                (h, &mut a.action)
            {
                // The heads dim's split over the mesh: this rank's part and the parts.
                let axes = plan.buffers[a.buf as usize]
                    .layout
                    .get(2)
                    .cloned()
                    .unwrap_or_default();
                let (part, parts) = axes.iter().fold((0usize, 1usize), |(p, n), &ax| {
                    let size = plan.mesh.size(ax) as usize;
                    (p * size + plan.mesh.coord(rank, ax), n * size)
                });
                if h >= *heads * parts {
                    return Err(RuntimeError::Unsupported(format!(
                        "--perturb {}:zero-head({h}): the layer has heads 0..{}",
                        a.name,
                        *heads * parts
                    )));
                }
                if h / *heads != part {
                    // Another rank holds the head.
                    continue;
                }
                *head = h % *heads;
            }
            kept.push((a, step));
        }
        let weight_steps = perturbations
            .iter()
            .filter(|p| p.perturbation.point.starts_with("weights."))
            .map(|p| p.step.unwrap_or(1));
        let mut out = Perturber {
            acts: kept,
            weights: Vec::new(),
            seed,
        };
        for ((b, name, kind), step) in weights.into_iter().zip(weight_steps) {
            let dtype = plan.buffers[b as usize].dtype;
            if dtype != megac_ir::DType::F32 {
                return Err(RuntimeError::Unsupported(format!(
                    "--perturb {name}: weight perturbations during training need fp32 \
                     parameters (this one is {dtype:?}: the optimizer's master copy would undo \
                     it)"
                )));
            }
            out.weights.push((b, name, kind, step));
        }
        Ok(Some(out))
    }

    /// Perturb the weights whose step is `step` (at its start).
    pub(crate) fn weights(&self, mem: &mut crate::memory::Memory, step: u64) {
        for (b, name, kind, at) in &self.weights {
            if *at == step {
                let mut w = mem.read_f32(*b);
                apply(
                    kind,
                    &mut w,
                    stream_seed(self.seed, &format!("{name}@{step}")),
                );
                mem.write_f32(*b, &w);
            }
        }
    }

    /// Run micro-batch `mb` of `step`'s program on `session`, perturbing the activations
    /// of this step after their writers.
    pub(crate) fn microbatch(
        &self,
        session: &mut Session<'_>,
        step: u64,
        mb: u64,
        ctx: &StepContext,
    ) -> Result<(), RuntimeError> {
        let program = &session.role().microbatch;
        let mut cuts: Vec<&ActPerturb> = self
            .acts
            .iter()
            .filter(|(_, s)| s.is_none_or(|s| s == step))
            .map(|(a, _)| a)
            .collect();
        cuts.sort_by_key(|a| a.at.1);
        let mut from = 0;
        for a in cuts {
            let end = a.at.1 + 1;
            if end > from {
                session.run(&program[from..end], ctx)?;
                from = end;
            }
            let mut x = session.mem.read_f32(a.buf);
            let seed = stream_seed(self.seed, &format!("{}@{step}.{mb}", a.name));
            a.action.apply(&mut x, seed)?;
            session.mem.write_f32(a.buf, &x);
        }
        session.run(&program[from..], ctx)
    }
}
