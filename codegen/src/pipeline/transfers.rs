//! Transfers (step 2 of the split): every activation one chunk produces and another reads
//! gets a copy in the reader and a tagged `send`/`recv` pair; the micro-batch program is cut
//! into per-(chunk, phase) segments with each chunk's buffers rewritten to its copies.

use std::collections::BTreeMap;

use megac_ir::mesh::chunk_owner;
use megac_ir::plan::{BufId, Instr};

use super::placement::Usage;
use super::tied::Tied;
use super::{unsupported, Geometry, Phase};
use crate::{CodegenError, Emitter};

/// An activation one chunk produces and another reads: `src` in the producer's segment,
/// received into the copy `dst` of the consumer.
pub(super) struct Transfer {
    /// The producer's activation.
    pub(super) src: BufId,
    /// The producing chunk.
    pub(super) from: u32,
    /// The producer's segment that sends it.
    pub(super) from_phase: Phase,
    /// The consumer's copy.
    pub(super) dst: BufId,
    /// The consuming chunk.
    pub(super) to: u32,
    /// The consumer's first segment that reads it (where the `recv` goes).
    pub(super) to_phase: Phase,
}

/// Every activation read by another chunk gets a copy there (with copies of its views) and a
/// transfer. Forward-pass transfers go to later chunks, backward-pass ones to earlier chunks;
/// anything else is refused. Every activation buffer is labelled with its chunk.
#[allow(clippy::type_complexity)]
pub(super) fn cut_transfers(
    e: &mut Emitter,
    usage: &Usage,
) -> Result<(BTreeMap<(BufId, u32), BufId>, Vec<Transfer>), CodegenError> {
    let mut copy: BTreeMap<(BufId, u32), BufId> = BTreeMap::new();
    let mut transfers = Vec::new();
    for (&(r, c), &ph) in &usage.first_use {
        let o = usage.owner[&r];
        let pw = usage.last_write.get(&r).copied().unwrap_or(Phase::F);
        let ok = match (pw, ph) {
            (Phase::F, Phase::F) => c > o,
            (Phase::F, _) => true,
            (Phase::B, Phase::B | Phase::W) => c < o,
            _ => false,
        };
        if !ok {
            return Err(unsupported(format!(
                "activation {} flows from chunk {o} ({pw:?}) to chunk {c} ({ph:?}), against the pipeline",
                e.buffers[r as usize].name
            )));
        }
        let mut buf = e.buffers[r as usize].clone();
        buf.name = format!("{}@{c}", buf.name);
        let id = e.buffers.len() as BufId;
        e.buffers.push(buf);
        copy.insert((r, c), id);
        transfers.push(Transfer {
            src: r,
            from: o,
            from_phase: pw,
            dst: id,
            to: c,
            to_phase: ph,
        });
    }
    let views: Vec<(BufId, BufId)> = e.view_of.iter().map(|(&v, &r)| (v, r)).collect();
    for (v, r) in views {
        let chunks: Vec<u32> = copy
            .keys()
            .filter(|(cr, _)| *cr == r)
            .map(|(_, c)| *c)
            .collect();
        for c in chunks {
            let mut buf = e.buffers[v as usize].clone();
            buf.name = format!("{}@{c}", buf.name);
            let id = e.buffers.len() as BufId;
            e.buffers.push(buf);
            copy.insert((v, c), id);
            e.view_of.insert(id, copy[&(r, c)]);
        }
    }
    for (&r, &c) in &usage.owner {
        e.buffers[r as usize].chunk = Some(c);
    }
    for (&(_, c), &id) in &copy {
        e.buffers[id as usize].chunk = Some(c);
    }
    let view_list: Vec<(BufId, BufId)> = e.view_of.iter().map(|(&v, &r)| (v, r)).collect();
    for (v, r) in view_list {
        if let Some(c) = e.buffers[r as usize].chunk {
            e.buffers[v as usize].chunk = Some(c);
        }
    }
    Ok((copy, transfers))
}

/// The segments (chunk, phase) with each chunk's buffers rewritten to its copies, the
/// `recv`s first and the `send`s last.
pub(super) fn segments(
    program: Vec<Instr>,
    place: &[(u32, Phase)],
    copy: &BTreeMap<(BufId, u32), BufId>,
    tied: &Tied,
    transfers: &[Transfer],
    geo: &Geometry,
) -> BTreeMap<(u32, Phase), Vec<Instr>> {
    let mut segs: BTreeMap<(u32, Phase), Vec<Instr>> = BTreeMap::new();
    for c in 0..geo.nc {
        for ph in [Phase::F, Phase::B, Phase::W] {
            segs.insert((c, ph), Vec::new());
        }
    }
    for (t, x) in transfers.iter().enumerate() {
        segs.entry((x.to, x.to_phase))
            .or_default()
            .push(Instr::Recv {
                buffer: x.dst,
                chunk: x.from,
                transfer: t as u32,
                twin: false,
            });
    }
    for (i, instr) in program.into_iter().enumerate() {
        let (c, ph) = place[i];
        let map = |b: BufId| {
            *copy
                .get(&(b, c))
                .or_else(|| tied.copy.get(&(b, chunk_owner(c, geo.pp))))
                .unwrap_or(&b)
        };
        let instr = match instr {
            Instr::Kernel {
                op,
                inputs,
                outputs,
                path,
            } => Instr::Kernel {
                op,
                inputs: inputs.into_iter().map(map).collect(),
                outputs: outputs.into_iter().map(map).collect(),
                path,
            },
            Instr::Zero { buffer } => Instr::Zero {
                buffer: map(buffer),
            },
            other => other,
        };
        segs.entry((c, ph)).or_default().push(instr);
    }
    for (t, x) in transfers.iter().enumerate() {
        segs.entry((x.from, x.from_phase))
            .or_default()
            .push(Instr::Send {
                buffer: x.src,
                chunk: x.to,
                transfer: t as u32,
                twin: false,
            });
    }
    segs
}
