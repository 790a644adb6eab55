//! Placement (steps 1 and 3 of the split): the chunk and phase of every micro-batch
//! instruction from its provenance path, who touches which buffer (activation producers and
//! readers, the stages of persistent buffers, the chunks that read the data), and the stage
//! of every buffer.

use std::collections::{BTreeMap, BTreeSet};

use megac_ir::mesh::chunk_owner;
use megac_ir::plan::{BufId, BufferClass, Instr};

use super::tied::Tied;
use super::{unsupported, Geometry, Phase};
use crate::{CodegenError, Emitter};

/// The chunk of a micro-batch instruction, from its provenance path; `chunk_of_layer[l]` is
/// layer l's chunk.
pub(super) fn chunk_of_path(path: &str, chunk_of_layer: &[u32], chunks: u32) -> u32 {
    let layer = ["model.layers.", "transformer.h."]
        .iter()
        .find_map(|p| path.strip_prefix(p))
        .and_then(|rest| rest.split('.').next())
        .and_then(|n| n.parse::<usize>().ok());
    if let Some(l) = layer {
        return chunk_of_layer.get(l).copied().unwrap_or(chunks - 1);
    }
    let first = ["model.embed_tokens", "transformer.wte", "transformer.wpe"];
    if first
        .iter()
        .any(|p| path == *p || path.starts_with(&format!("{p}.")))
    {
        0
    } else {
        chunks - 1
    }
}

/// Who touches what in the micro-batch program.
#[derive(Default)]
pub(super) struct Usage {
    /// Activation root -> the chunk that produces it.
    pub(super) owner: BTreeMap<BufId, u32>,
    /// Activation root -> the producer's last writing phase.
    pub(super) last_write: BTreeMap<BufId, Phase>,
    /// (activation root, another chunk) -> the first phase of that chunk that reads it.
    pub(super) first_use: BTreeMap<(BufId, u32), Phase>,
    /// Parameter, gradient or state buffer -> the stages that touch it.
    pub(super) persistent_stage: BTreeMap<BufId, BTreeSet<u32>>,
    /// Chunk -> the data inputs it reads.
    pub(super) chunk_inputs: BTreeMap<u32, BTreeSet<BufId>>,
}

/// Step 1: the chunk and phase of every micro-batch instruction. Everything before the
/// first gradient kernel is forward; backward kernels that only write parameter gradients
/// are `W` under zero-bubble schedules, and so are backward kernels all of whose outputs
/// only `W` kernels of their own chunk read and whose inputs the forward wrote (sequence
/// parallelism's re-gathered linear inputs), so that those outputs live within `W` instead
/// of in the micro-batch's slot from `B` to `W`; a `zero`
/// goes with the kernel after it.
pub(super) fn place_instructions(
    e: &Emitter,
    program: &[Instr],
    geo: &Geometry,
) -> Vec<(u32, Phase)> {
    let nc = geo.nc;
    let first_backward = program
        .iter()
        .position(|i| matches!(i, Instr::Kernel { op, .. } if op.accumulates()))
        .unwrap_or(program.len());
    let root = |b: BufId| *e.view_of.get(&b).unwrap_or(&b);
    // Activation roots that the backward writes (the others are the forward's, kept for
    // the backward anyway).
    let backward_written: BTreeSet<BufId> = program[first_backward..]
        .iter()
        .flat_map(|i| match i {
            Instr::Kernel { outputs, .. } => outputs.clone(),
            _ => Vec::new(),
        })
        .map(root)
        .collect();
    // Activation root -> the chunk whose `W` kernels are all the instructions after the
    // current one that read it (None: another reads it; absent: none reads it).
    let mut read_only_by_w: BTreeMap<BufId, Option<u32>> = BTreeMap::new();
    let mut place: Vec<(u32, Phase)> = vec![(0, Phase::F); program.len()];
    for i in (0..program.len()).rev() {
        place[i] = match &program[i] {
            Instr::Kernel {
                path,
                inputs,
                outputs,
                ..
            } => {
                let chunk = chunk_of_path(path, &geo.chunk_of_layer, nc);
                let only_w = |o: &BufId| read_only_by_w.get(&root(*o)) == Some(&Some(chunk));
                let phase = if i < first_backward {
                    Phase::F
                } else if geo.split_bw
                    && (outputs
                        .iter()
                        .all(|&o| e.buffers[o as usize].class == BufferClass::Grad)
                        || (outputs.iter().all(only_w)
                            && !inputs.iter().any(|&b| backward_written.contains(&root(b)))))
                {
                    Phase::W
                } else {
                    Phase::B
                };
                let reader = (phase == Phase::W).then_some(chunk);
                for &b in inputs {
                    let entry = read_only_by_w.entry(root(b)).or_insert(reader);
                    if *entry != reader {
                        *entry = None;
                    }
                }
                (chunk, phase)
            }
            other => {
                let at = place.get(i + 1).copied().unwrap_or((nc - 1, Phase::B));
                if let Instr::Send { buffer, .. } = other {
                    read_only_by_w.insert(root(*buffer), None);
                }
                at
            }
        };
    }
    place
}

/// Step 2: which chunk produces each activation and which others read it, which stages
/// touch each persistent buffer, which chunks read the data.
pub(super) fn scan_usage(
    e: &Emitter,
    program: &[Instr],
    place: &[(u32, Phase)],
    pp: u32,
) -> Result<Usage, CodegenError> {
    let mut u = Usage::default();
    for (i, instr) in program.iter().enumerate() {
        let (c, ph) = place[i];
        let writes: Vec<BufId> = match instr {
            Instr::Kernel { outputs, .. } => outputs.clone(),
            Instr::Zero { buffer } => vec![*buffer],
            _ => Vec::new(),
        };
        for b in instr.buffers() {
            let r = *e.view_of.get(&b).unwrap_or(&b);
            match e.buffers[r as usize].class {
                BufferClass::Activation => {
                    let o = *u.owner.entry(r).or_insert(c);
                    if o == c {
                        if writes.contains(&b) {
                            u.last_write.insert(r, ph);
                        }
                    } else {
                        u.first_use.entry((r, c)).or_insert(ph);
                        if writes.contains(&b) {
                            return Err(unsupported(format!(
                                "activation {} is written by chunks {o} and {c}",
                                e.buffers[r as usize].name
                            )));
                        }
                    }
                }
                BufferClass::Input => {
                    u.chunk_inputs.entry(c).or_default().insert(r);
                }
                _ => {
                    u.persistent_stage
                        .entry(r)
                        .or_default()
                        .insert(chunk_owner(c, pp));
                }
            }
        }
    }
    Ok(u)
}

/// Step 3: the stage of every buffer: persistent ones where they are used (tied parameters
/// at home), activations with their chunk, optimizer state with its parameter.
pub(super) fn assign_stages(e: &mut Emitter, usage: &Usage, tied: &Tied, pp: u32) {
    for (&b, stages) in &usage.persistent_stage {
        e.buffers[b as usize].stage = tied.home.get(&b).or(stages.iter().next()).copied();
    }
    for (&r, &c) in &usage.owner {
        e.buffers[r as usize].stage = Some(chunk_owner(c, pp));
    }
    for i in 0..e.buffers.len() {
        if let Some(c) = e.buffers[i].chunk {
            e.buffers[i].stage = Some(chunk_owner(c, pp));
        }
    }
    for entry in &e.params {
        let s = e.buffers[entry.buffer as usize].stage;
        for b in entry
            .grad
            .into_iter()
            .chain(entry.exp_avg)
            .chain(entry.exp_avg_sq)
            .chain(entry.master)
        {
            e.buffers[b as usize].stage = s;
        }
    }
}
