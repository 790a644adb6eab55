//! The pass manager: named passes run in a fixed order over a [`Module`]; each pass's output
//! can be printed (`megac dump --after PASS`), and the verifier can run after every pass.

use megac_ir::{print_graph, verify, Graph, ModelSpec};

use crate::autodiff::differentiate;
use crate::build::build_graph;
use crate::instrument::{self, Instrument};
use crate::optimizer::add_optimizer;
use crate::recompute::{recompute, regather};
use crate::shard::shard;
use crate::PassError;

/// What the passes transform: the spec and, once built, the graph.
#[derive(Clone, Debug)]
pub struct Module {
    /// The validated model description.
    pub spec: ModelSpec,
    /// The Graph IR, present after the `build` pass.
    pub graph: Option<Graph>,
    /// What the `perturb` and `probe` passes insert (nothing by default).
    pub instrument: Instrument,
}

impl Module {
    /// A module holding only the spec.
    pub fn new(spec: ModelSpec) -> Module {
        Module {
            spec,
            graph: None,
            instrument: Instrument::default(),
        }
    }

    /// The text form of the current IR.
    pub fn dump(&self) -> String {
        match &self.graph {
            Some(g) => print_graph(g),
            None => String::new(),
        }
    }
}

/// A named transformation of a [`Module`].
pub struct Pass {
    /// Name used by `--after` and `megac passes`.
    pub name: &'static str,
    /// One-line description for `megac passes`.
    pub description: &'static str,
    run: fn(&mut Module) -> Result<(), PassError>,
}

/// Every pass, in pipeline order.
pub fn pipeline() -> Vec<Pass> {
    vec![
        Pass {
            name: "build",
            description: "lower the model spec to the Graph IR: forward of one training step, global view, HF parameter names",
            run: |m| {
                m.graph = Some(build_graph(&m.spec)?);
                Ok(())
            },
        },
        Pass {
            name: "autodiff",
            description: "append the backward graph: gradient ops for every forward op, contributions summed with grad_sum",
            run: |m| differentiate(graph_mut(m)?),
        },
        Pass {
            name: "recompute",
            description: "activation recomputation (train.recompute): clone attention (selective) or whole layers (full) before their backward",
            run: |m| {
                let policy = m.spec.train.recompute;
                recompute(graph_mut(m)?, policy)
            },
        },
        Pass {
            name: "shard",
            description: "layouts over the device mesh (dp batch, Megatron tp with sequence parallelism placed by egg rewrites, cp sequence chunks, ep all-to-all for MoE experts) and the collectives they need",
            run: |m| {
                let spec = m.spec.clone();
                shard(graph_mut(m)?, &spec)
            },
        },
        Pass {
            name: "perturb",
            description: "megac scope / train --perturb only: perturb(point, kind, seed) ops right after the ops that write the perturbed points (or on weights), read by every reader of the point",
            run: |m| {
                let ins = m.instrument.clone();
                instrument::perturb(graph_mut(m)?, &ins)
            },
        },
        Pass {
            name: "probe",
            description: "megac scope only: probe(name) ops copying the probed points into buffers live to the end of the forward (pending tp sums all-reduced first)",
            run: |m| {
                let ins = m.instrument.clone();
                instrument::probe(graph_mut(m)?, &ins)
            },
        },
        Pass {
            name: "regather",
            description: "sequence parallelism: issue tp all-gathers again before the backward ops that read them, so gathered activations are not kept (Megatron)",
            run: |m| regather(graph_mut(m)?),
        },
        Pass {
            name: "optimizer",
            description: "global gradient norm, clipping and one AdamW step per parameter",
            run: |m| {
                let train = m.spec.train.clone();
                add_optimizer(graph_mut(m)?, &train)
            },
        },
    ]
}

fn graph_mut(m: &mut Module) -> Result<&mut Graph, PassError> {
    m.graph.as_mut().ok_or(PassError::NoGraph)
}

impl Pass {
    /// Run this pass alone on `module` (the file tests run one pass on a parsed graph);
    /// the verifier is not run here.
    pub fn run(&self, module: &mut Module) -> Result<(), PassError> {
        (self.run)(module)
    }
}

/// Run the single pass named `name` on `module`, then verify the graph it leaves.
pub fn run_pass(module: &mut Module, name: &str) -> Result<(), PassError> {
    let pass = pipeline()
        .into_iter()
        .find(|p| p.name == name)
        .ok_or_else(|| PassError::UnknownPass {
            name: name.to_string(),
            known: pass_names().join(", "),
        })?;
    pass.run(module)?;
    if let Some(g) = &module.graph {
        verify(g).map_err(|errors| PassError::Verify {
            pass: pass.name,
            errors,
        })?;
    }
    Ok(())
}

/// Names of every pass, in order.
pub fn pass_names() -> Vec<&'static str> {
    pipeline().iter().map(|p| p.name).collect()
}

/// Run the pipeline on `spec`, stopping after the pass named `after` (all passes when None).
/// With `verify_each`, the verifier checks the graph after every pass.
pub fn run_pipeline(
    spec: ModelSpec,
    after: Option<&str>,
    verify_each: bool,
) -> Result<Module, PassError> {
    run_pipeline_with(spec, Instrument::default(), after, verify_each)
}

/// [`run_pipeline`] with the probes and perturbations of `instrument`.
pub fn run_pipeline_with(
    spec: ModelSpec,
    instrument: Instrument,
    after: Option<&str>,
    verify_each: bool,
) -> Result<Module, PassError> {
    let passes = pipeline();
    if let Some(name) = after {
        if !passes.iter().any(|p| p.name == name) {
            return Err(PassError::UnknownPass {
                name: name.to_string(),
                known: pass_names().join(", "),
            });
        }
    }
    let mut module = Module::new(spec);
    module.instrument = instrument;
    for pass in &passes {
        (pass.run)(&mut module)?;
        if verify_each {
            if let Some(g) = &module.graph {
                verify(g).map_err(|errors| PassError::Verify {
                    pass: pass.name,
                    errors,
                })?;
            }
        }
        if after == Some(pass.name) {
            break;
        }
    }
    Ok(module)
}

/// The passes of an inference plan, in order: `build` and `shard` (the forward over the
/// mesh; no backward, recomputation or optimizer), then `perturb` and `probe` (no-ops unless
/// asked for).
pub const INFERENCE_PASSES: [&str; 4] = ["build", "shard", "perturb", "probe"];

/// Run the inference pipeline ([`INFERENCE_PASSES`]) on `spec`, verifying the graph after
/// every pass: the forward graph `megac_codegen::emit_inference_plan` lowers.
pub fn run_inference_pipeline(spec: ModelSpec) -> Result<Module, PassError> {
    run_inference_pipeline_with(spec, Instrument::default())
}

/// [`run_inference_pipeline`] with the probes and perturbations of `instrument`.
pub fn run_inference_pipeline_with(
    spec: ModelSpec,
    instrument: Instrument,
) -> Result<Module, PassError> {
    let mut module = Module::new(spec);
    module.instrument = instrument;
    for pass in pipeline()
        .into_iter()
        .filter(|p| INFERENCE_PASSES.contains(&p.name))
    {
        (pass.run)(&mut module)?;
        if let Some(g) = &module.graph {
            verify(g).map_err(|errors| PassError::Verify {
                pass: pass.name,
                errors,
            })?;
        }
    }
    Ok(module)
}
