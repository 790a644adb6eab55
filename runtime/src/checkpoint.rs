//! Distributed checkpoints (docs/checkpoints.md): every rank writes its own shards of the
//! working weights, the fp32 master weights and the AdamW moments to one file; rank 0 writes
//! one index describing every global tensor and which slice of it each file holds. A
//! checkpoint loads into any layout of the same model: each rank assembles the global tensors
//! it needs from the index and takes its own shard with the plan's
//! [`ParamEntry::global_indices`], the same map `--init` and initialisation use.
//!
//! On disk: `DIR/step-000123/` holds `rank-00000.bin` ... (little-endian f32, the pieces one
//! after another) and `index.json`; `DIR/latest` names the last complete step folder. A save
//! writes into `DIR/step-000123.tmp/`, syncs every file, and only after every rank finished
//! (a collective) rank 0 writes the index, renames the folder into place and moves `latest`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use megac_ir::plan::{BufId, Init, Instr, LrSchedule, ParamEntry, Plan};
use megac_ir::{Axis, Mesh, OpKind};
use serde::{Deserialize, Serialize};

use crate::error::RuntimeError;
use crate::scaler::ScalerState;
use crate::train::Session;

/// The index's `format`.
pub const FORMAT: &str = "megac-checkpoint/1";
/// The index file in a step folder.
pub const INDEX: &str = "index.json";
/// The file naming the last complete step folder.
pub const LATEST: &str = "latest";
/// The model's Hugging Face config in a step folder (when the run knew it).
pub const HF_CONFIG: &str = "config.json";
/// The checksum algorithm of the index's files.
pub const CHECKSUM: &str = "fnv1a64-u32";
const MAX_INDEX_BYTES: u64 = 256 << 20;

/// What a piece of a checkpoint holds for its parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// The working weights (16-bit values widened exactly under mixed precision).
    Param,
    /// The fp32 master weights (mixed precision only).
    Master,
    /// AdamW's first moment.
    ExpAvg,
    /// AdamW's second moment.
    ExpAvgSq,
}

impl Kind {
    /// Every kind, in index order.
    pub const ALL: [Kind; 4] = [Kind::Param, Kind::Master, Kind::ExpAvg, Kind::ExpAvgSq];

    /// The kind's name in the index.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Param => "param",
            Kind::Master => "master",
            Kind::ExpAvg => "exp_avg",
            Kind::ExpAvgSq => "exp_avg_sq",
        }
    }
}

/// Why a checkpoint cannot be written, found or used; each names the file.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum CheckpointError {
    /// No checkpoint there (no folder, no complete step folder).
    #[error("{path}: {message}")]
    Missing {
        /// The path given or looked at.
        path: String,
        /// What is missing.
        message: String,
    },
    /// The index cannot be parsed or contradicts itself.
    #[error("{path}: malformed index: {message}")]
    Malformed {
        /// The index.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// A shard file is shorter than the index says.
    #[error("{path}: truncated: {message}")]
    Truncated {
        /// The shard file.
        path: String,
        /// The sizes.
        message: String,
    },
    /// A shard file's checksum (or size) is not the index's.
    #[error("{path}: corrupted: {message}")]
    Corrupted {
        /// The shard file.
        path: String,
        /// The checksums.
        message: String,
    },
    /// The checkpoint is of another model or cannot continue this run.
    #[error("{path}: {message}")]
    Mismatch {
        /// The index.
        path: String,
        /// The difference.
        message: String,
    },
    /// A file could not be read or written.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: String,
        /// What failed.
        message: String,
    },
}

fn io_err(path: &Path, e: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

/// The index of a step folder.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Index {
    /// [`FORMAT`].
    pub format: String,
    /// The last step trained before the save (1-based).
    pub step: u64,
    /// The model's name.
    pub model: String,
    /// `llama` or `gpt`.
    pub arch: String,
    /// Checksum of the saving plan's plan.json ([`fingerprint`]).
    pub plan_fingerprint: String,
    /// The layout it was saved in.
    pub mesh: Mesh,
    /// `fp32`, `bf16` or `fp16`.
    pub precision: String,
    /// Whether the saving plan sharded the optimizer state (ZeRO-1).
    pub distributed_optimizer: bool,
    /// Samples per step.
    pub global_batch: u64,
    /// Tokens per sample.
    pub seq_len: u64,
    /// The data position: samples drawn so far (step · global_batch).
    pub consumed_samples: u64,
    /// The initialisation and data seed.
    pub seed: u64,
    /// The base learning rate.
    pub lr: f64,
    /// The learning-rate schedule (a function of the step).
    pub lr_schedule: LrSchedule,
    /// The learning rate of the last step saved.
    pub last_lr: f64,
    /// fp16's loss scaler.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scaler: Option<ScalerState>,
    /// One file per rank.
    pub files: Vec<FileEntry>,
    /// Every global tensor (one per parameter of the saving plan).
    pub tensors: Vec<TensorEntry>,
}

/// One rank's shard file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Its name in the step folder.
    pub name: String,
    /// The rank that wrote it.
    pub rank: usize,
    /// Its size.
    pub bytes: u64,
    /// `fnv1a64-u32:<16 hex digits>` ([`Checksum`]).
    pub checksum: String,
}

/// A global tensor: the saving plan's parameter (its global shape and how it was sharded,
/// from which [`ParamEntry::global_indices`] gives every piece's elements) and its pieces.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// The parameter's name.
    pub name: String,
    /// Global shape (the vocabulary padded as the saving layout padded it).
    pub shape: Vec<u64>,
    /// Rows Hugging Face stores, when `shape` pads the vocabulary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hf_rows: Option<u64>,
    /// Per dim, the mesh axes that shard it in the saving layout.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shards: Vec<Vec<Axis>>,
    /// Per dim, the blocks a sharded dim is split block-wise into.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blocks: Vec<u64>,
    /// Stacked experts: Hugging Face's per-expert name with `{}` for the expert.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_expert: Option<String>,
    /// The working dtype of the saving plan (the files hold f32).
    pub dtype: String,
    /// Per kind (`param`, `master`, `exp_avg`, `exp_avg_sq`), the pieces.
    pub pieces: BTreeMap<String, Vec<PieceEntry>>,
}

/// Elements `lo..hi` of rank `rank`'s local shard (row-major) of a tensor, stored as f32 at
/// byte `offset` of file `file`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PieceEntry {
    /// Index into [`Index::files`].
    pub file: usize,
    /// The saving rank whose shard it is.
    pub rank: usize,
    /// First element of the rank's local shard.
    pub lo: u64,
    /// One past the last.
    pub hi: u64,
    /// Byte offset in the file.
    pub offset: u64,
}

impl TensorEntry {
    /// The parameter as a plan entry (buffers unset): for its shard map and HF tensors.
    fn param_entry(&self) -> ParamEntry {
        ParamEntry {
            name: self.name.clone(),
            shape: self.shape.clone(),
            hf_rows: self.hf_rows,
            shards: self.shards.clone(),
            blocks: self.blocks.clone(),
            per_expert: self.per_expert.clone(),
            buffer: 0,
            grad: None,
            exp_avg: None,
            exp_avg_sq: None,
            master: None,
            init: Init::Zeros,
            tied_copies: Vec::new(),
        }
    }

    /// Elements of one rank's local shard, if the shape divides over the mesh.
    fn local_len(&self, mesh: &Mesh) -> Option<u64> {
        let mut n = 1u64;
        for (d, &size) in self.shape.iter().enumerate() {
            let axes = self.shards.get(d).map_or(&[][..], |a| a.as_slice());
            let parts: u64 = axes.iter().map(|&a| mesh.size(a).max(1)).product();
            let blocks = self.blocks.get(d).copied().unwrap_or(1).max(1);
            if size % (parts * blocks) != 0 {
                return None;
            }
            n = n.checked_mul(size / parts)?;
        }
        Some(n)
    }
}

/// The checkpoint's checksum: FNV-1a (64 bits) over the file's little-endian u32 words.
#[derive(Clone, Copy, Debug)]
pub struct Checksum(u64);

impl Default for Checksum {
    fn default() -> Self {
        Checksum(0xcbf2_9ce4_8422_2325)
    }
}

impl Checksum {
    /// Add `bytes` (a multiple of 4 long; a trailing partial word is hashed as zero-padded).
    pub fn update(&mut self, bytes: &[u8]) {
        let mut h = self.0;
        let mut words = bytes.chunks_exact(4);
        for w in &mut words {
            let x = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
            h = (h ^ u64::from(x)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 4];
            w[..rest.len()].copy_from_slice(rest);
            h = (h ^ u64::from(u32::from_le_bytes(w))).wrapping_mul(0x0000_0100_0000_01b3);
        }
        self.0 = h;
    }

    /// The value.
    pub fn value(self) -> u64 {
        self.0
    }

    /// As the index writes it.
    pub fn render(value: u64) -> String {
        format!("{CHECKSUM}:{value:016x}")
    }
}

/// The fingerprint of a plan: the checksum of its plan.json.
pub fn fingerprint(plan: &Plan) -> String {
    let mut c = Checksum::default();
    c.update(plan.to_json().as_bytes());
    Checksum::render(c.value())
}

/// The step folder's name.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:06}")
}

fn rank_file_name(rank: usize) -> String {
    format!("rank-{rank:05}.bin")
}

/// A slice of one of a rank's buffers that holds elements `lo..hi` of parameter `param`'s
/// local shard, for one kind of state.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Piece {
    pub kind: Kind,
    /// Index into `plan.params`.
    pub param: usize,
    pub lo: u64,
    pub hi: u64,
    /// The buffer holding it, and the element where it starts there.
    pub buffer: BufId,
    pub at: u64,
}

/// Whether `rank` holds parameter `p` (a pipeline stage holds only its own).
fn holds_param(plan: &Plan, rank: usize, p: &ParamEntry) -> bool {
    let stage = plan.mesh.coord(rank, Axis::Pp) as u32;
    plan.buffers
        .get(p.buffer as usize)
        .is_some_and(|b| b.stage.is_none_or(|s| s == stage))
}

/// Element start of buffer `b` in its arena on `rank` (with its rank offset).
fn arena_start(plan: &Plan, rank: usize, b: BufId) -> u64 {
    let buf = &plan.buffers[b as usize];
    buf.offset
        + buf
            .rank_offset
            .as_ref()
            .map_or(0, |r| r.index(&plan.mesh, rank) * r.stride)
}

/// Every piece of state `rank` holds: each parameter's working weights, and the AdamW state
/// of each AdamW instruction of its role (`outputs = [param, exp_avg, exp_avg_sq, master?]`),
/// mapped to parameters through the parameter arena (one parameter's buffer, or the
/// distributed optimizer's flat shard over several).
pub(crate) fn pieces_of(plan: &Plan, rank: usize) -> Result<Vec<Piece>, RuntimeError> {
    let role = &plan.roles[plan.rank_to_role[rank] as usize];
    let mut out = Vec::new();
    let mut ranges = Vec::new();
    for (i, p) in plan.params.iter().enumerate() {
        if !holds_param(plan, rank, p) {
            continue;
        }
        let len = plan.buffers[p.buffer as usize].len();
        out.push(Piece {
            kind: Kind::Param,
            param: i,
            lo: 0,
            hi: len,
            buffer: p.buffer,
            at: 0,
        });
        let start = arena_start(plan, rank, p.buffer);
        ranges.push((start, start + len, i));
    }
    ranges.sort_unstable();
    if ranges.windows(2).any(|w| w[0].1 > w[1].0) {
        return Err(RuntimeError::Unsupported(
            "checkpoint: the plan's parameter buffers overlap in their arena".into(),
        ));
    }
    for instr in Plan::programs_of(role).into_iter().flatten() {
        let Instr::Kernel {
            op: OpKind::AdamW { .. },
            outputs,
            ..
        } = instr
        else {
            continue;
        };
        let Some(&w) = outputs.first() else { continue };
        let wb = &plan.buffers[w as usize];
        let start = arena_start(plan, rank, w);
        let end = start + wb.len();
        let states = [
            (Kind::ExpAvg, outputs.get(1)),
            (Kind::ExpAvgSq, outputs.get(2)),
            (Kind::Master, outputs.get(3)),
        ];
        for &(s, e, i) in ranges.iter().filter(|r| r.0 < end && r.1 > start) {
            if plan.buffers[plan.params[i].buffer as usize].dtype != wb.dtype {
                return Err(RuntimeError::Unsupported(format!(
                    "checkpoint: AdamW's `{}` and parameter `{}` differ in dtype",
                    wb.name, plan.params[i].name
                )));
            }
            let (a, z) = (s.max(start), e.min(end));
            for (kind, b) in states {
                if let Some(&b) = b {
                    out.push(Piece {
                        kind,
                        param: i,
                        lo: a - s,
                        hi: z - s,
                        buffer: b,
                        at: a - start,
                    });
                }
            }
        }
    }
    Ok(out)
}

/// What each rank writes: its pieces less those a lower rank holds too (replicas over dp, or
/// over tp for unsplit parameters), and the layout of its file.
#[derive(Clone, Debug)]
pub(crate) struct SaveLayout {
    /// Per rank, (piece, byte offset in its file).
    per_rank: Vec<Vec<(Piece, u64)>>,
    /// Per rank, its file's size.
    bytes: Vec<u64>,
    /// The model's Hugging Face `config.json`, written into every step folder (rank 0), so
    /// that `megac checkpoint export` can put it beside the weights.
    hf_config: Option<String>,
}

impl SaveLayout {
    /// The layout of `plan`'s checkpoints (the same on every rank).
    pub(crate) fn new(plan: &Plan, hf_config: Option<String>) -> Result<SaveLayout, RuntimeError> {
        let world = plan.mesh.world_size();
        let mut seen = HashSet::new();
        let mut per_rank = Vec::with_capacity(world);
        let mut bytes = Vec::with_capacity(world);
        for rank in 0..world {
            let mut mine = Vec::new();
            let mut offset = 0u64;
            for piece in pieces_of(plan, rank)? {
                let p = &plan.params[piece.param];
                // Two ranks with the same coordinates along the parameter's shard axes hold
                // the same global elements.
                let coords: Vec<usize> = p
                    .shards
                    .iter()
                    .flatten()
                    .map(|&a| plan.mesh.coord(rank, a))
                    .collect();
                if seen.insert((piece.kind, piece.param, piece.lo, piece.hi, coords)) {
                    let n = (piece.hi - piece.lo) * 4;
                    mine.push((piece, offset));
                    offset += n;
                }
            }
            per_rank.push(mine);
            bytes.push(offset);
        }
        Ok(SaveLayout {
            per_rank,
            bytes,
            hf_config,
        })
    }

    fn index(&self, plan: &Plan, step: u64, scaler: Option<ScalerState>, sums: &[u64]) -> Index {
        let mut tensors: Vec<TensorEntry> = plan
            .params
            .iter()
            .map(|p| TensorEntry {
                name: p.name.clone(),
                shape: p.shape.clone(),
                hf_rows: p.hf_rows,
                shards: p.shards.clone(),
                blocks: p.blocks.clone(),
                per_expert: p.per_expert.clone(),
                dtype: plan.buffers[p.buffer as usize].dtype.as_str().to_string(),
                pieces: BTreeMap::new(),
            })
            .collect();
        for (rank, pieces) in self.per_rank.iter().enumerate() {
            for (piece, offset) in pieces {
                tensors[piece.param]
                    .pieces
                    .entry(piece.kind.name().to_string())
                    .or_default()
                    .push(PieceEntry {
                        file: rank,
                        rank,
                        lo: piece.lo,
                        hi: piece.hi,
                        offset: *offset,
                    });
            }
        }
        Index {
            format: FORMAT.to_string(),
            step,
            model: plan.model.clone(),
            arch: plan.arch.clone(),
            plan_fingerprint: fingerprint(plan),
            mesh: plan.mesh.clone(),
            precision: plan.train.precision.clone(),
            distributed_optimizer: plan.params.iter().any(|p| p.exp_avg.is_none()),
            global_batch: plan.batch.global_batch,
            seq_len: plan.batch.seq_len,
            consumed_samples: step * plan.batch.global_batch,
            seed: plan.train.seed,
            lr: plan.train.lr,
            lr_schedule: plan.train.lr_schedule.clone(),
            last_lr: plan.train.lr_schedule.lr_at(plan.train.lr, step),
            loss_scaler: scaler,
            files: (0..self.bytes.len())
                .map(|rank| FileEntry {
                    name: rank_file_name(rank),
                    rank,
                    bytes: self.bytes[rank],
                    checksum: Checksum::render(sums[rank]),
                })
                .collect(),
            tensors,
        }
    }
}

/// A checkpoint written by [`save`] (or [`begin_async`] and [`finish`]).
#[derive(Clone, Debug, PartialEq)]
pub struct SavedCheckpoint {
    /// The step saved.
    pub step: u64,
    /// The step folder.
    pub path: PathBuf,
    /// Bytes of every shard file.
    pub bytes: u64,
    /// Wall time from the start of the save to `latest` moving (on this rank; an async save
    /// spans the steps its writes overlap).
    pub seconds: f64,
    /// The part of it training waited for (all of it for a synchronous save; an async save:
    /// the snapshot, and at the next save or the end the wait for the writes and the index).
    pub blocking_seconds: f64,
}

/// A save whose files are being written by a background thread (`--save-async`).
pub(crate) struct PendingSave {
    step: u64,
    t0: std::time::Instant,
    blocked: f64,
    writer: std::thread::JoinHandle<Result<u64, CheckpointError>>,
}

/// Save `session`'s state after `step` into `dir` (a collective: every rank calls it).
pub(crate) fn save(
    session: &mut Session,
    layout: &SaveLayout,
    dir: &Path,
    step: u64,
) -> Result<SavedCheckpoint, RuntimeError> {
    let t0 = std::time::Instant::now();
    let tmp = begin(session, dir, step)?;
    let values = snapshot(session, &layout.per_rank[session.comm.rank()]);
    let file = tmp.join(rank_file_name(session.comm.rank()));
    let written = write_values(&file, &values);
    let mut saved = finish_writes(session, layout, dir, step, written, t0)?;
    saved.blocking_seconds = saved.seconds;
    Ok(saved)
}

/// Start an asynchronous save (a collective): the rank's pieces are copied to host memory
/// and a background thread writes and syncs its file; [`finish`] completes the checkpoint.
pub(crate) fn begin_async(
    session: &mut Session,
    layout: &SaveLayout,
    dir: &Path,
    step: u64,
) -> Result<PendingSave, RuntimeError> {
    let t0 = std::time::Instant::now();
    let tmp = begin(session, dir, step)?;
    let values = snapshot(session, &layout.per_rank[session.comm.rank()]);
    let file = tmp.join(rank_file_name(session.comm.rank()));
    let writer = std::thread::Builder::new()
        .name(format!("checkpoint-{}", session.comm.rank()))
        .spawn(move || write_values(&file, &values))
        .map_err(|e| io_err(&tmp, format!("cannot start the writer thread: {e}")))?;
    Ok(PendingSave {
        step,
        t0,
        blocked: t0.elapsed().as_secs_f64(),
        writer,
    })
}

/// Complete an asynchronous save (a collective): wait for this rank's writes, then as a
/// synchronous save does, agree that every rank finished and mark the checkpoint complete.
pub(crate) fn finish(
    session: &mut Session,
    layout: &SaveLayout,
    dir: &Path,
    pending: PendingSave,
) -> Result<SavedCheckpoint, RuntimeError> {
    let waited = std::time::Instant::now();
    let written = pending.writer.join().unwrap_or_else(|_| {
        Err(CheckpointError::Io {
            path: dir.display().to_string(),
            message: "the checkpoint writer thread panicked".into(),
        })
    });
    let mut saved = finish_writes(session, layout, dir, pending.step, written, pending.t0)?;
    saved.blocking_seconds = pending.blocked + waited.elapsed().as_secs_f64();
    Ok(saved)
}

/// The first phase of a save (a collective): rank 0 clears what a crashed save may have
/// left and makes the temporary step folder, which every rank then writes into.
fn begin(session: &mut Session, dir: &Path, step: u64) -> Result<PathBuf, RuntimeError> {
    let rank = session.comm.rank();
    let all: Vec<usize> = (0..session.comm.size()).collect();
    let tmp = dir.join(format!("{}.tmp", step_dir_name(step)));
    let mut failed = [0f64];
    let mut own: Option<CheckpointError> = None;
    if rank == 0 {
        let made = (|| {
            if tmp.exists() {
                std::fs::remove_dir_all(&tmp).map_err(|e| io_err(&tmp, e))?;
            }
            std::fs::create_dir_all(&tmp).map_err(|e| io_err(&tmp, e))
        })();
        if let Err(e) = made {
            failed[0] = 1.0;
            own = Some(e);
        }
    }
    session.comm.all_reduce_sum_f64(&all, &mut failed)?;
    if failed[0] != 0.0 {
        return Err(own
            .map(RuntimeError::from)
            .unwrap_or_else(|| rank_failed(0, &tmp)));
    }
    Ok(tmp)
}

/// The last phase of a save (a collective): every rank reports whether its file is written
/// and its checksum; then rank 0 writes the index, renames the folder into place and moves
/// `latest`.
fn finish_writes(
    session: &mut Session,
    layout: &SaveLayout,
    dir: &Path,
    step: u64,
    written: Result<u64, CheckpointError>,
    t0: std::time::Instant,
) -> Result<SavedCheckpoint, RuntimeError> {
    let rank = session.comm.rank();
    let world = session.comm.size();
    let all: Vec<usize> = (0..world).collect();
    let name = step_dir_name(step);
    let tmp = dir.join(format!("{name}.tmp"));
    let done = dir.join(&name);
    // The table gathers (failed, checksum in 16-bit parts) of every rank.
    let width = 5;
    let mut table = vec![0f64; world * width];
    match &written {
        Ok(sum) => {
            for k in 0..4 {
                table[rank * width + 1 + k] = ((sum >> (16 * k)) & 0xffff) as f64;
            }
        }
        Err(_) => table[rank * width] = 1.0,
    }
    session.comm.all_reduce_sum_f64(&all, &mut table)?;
    if let Err(e) = written {
        return Err(e.into());
    }
    if let Some(r) = (0..world).find(|&r| table[r * width] != 0.0) {
        return Err(rank_failed(r, &tmp));
    }
    let bytes = layout.bytes.iter().sum();
    let saved = |t0: std::time::Instant| SavedCheckpoint {
        step,
        path: done.clone(),
        bytes,
        seconds: t0.elapsed().as_secs_f64(),
        blocking_seconds: 0.0,
    };
    if rank != 0 {
        return Ok(saved(t0));
    }
    let sums: Vec<u64> = (0..world)
        .map(|r| {
            (0..4).fold(0u64, |s, k| {
                s | ((table[r * width + 1 + k] as u64) << (16 * k))
            })
        })
        .collect();
    let scaler = session.scaler.as_ref().map(|s| s.state());
    let index = layout.index(session.plan, step, scaler, &sums);
    let text = serde_json::to_string_pretty(&index).expect("the index serializes") + "\n";
    if let Some(config) = &layout.hf_config {
        let path = tmp.join(HF_CONFIG);
        megac_ir::file::write_atomic(&path, config).map_err(|e| io_err(&path, e))?;
    }
    let index_path = tmp.join(INDEX);
    megac_ir::file::write_atomic(&index_path, text).map_err(|e| io_err(&index_path, e))?;
    // Mark complete: the step folder appears whole, then `latest` names it.
    if done.exists() {
        std::fs::remove_dir_all(&done).map_err(|e| io_err(&done, e))?;
    }
    std::fs::rename(&tmp, &done).map_err(|e| io_err(&done, e))?;
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    let latest = dir.join(LATEST);
    megac_ir::file::write_atomic(&latest, format!("{name}\n")).map_err(|e| io_err(&latest, e))?;
    Ok(saved(t0))
}

fn rank_failed(rank: usize, dir: &Path) -> RuntimeError {
    CheckpointError::Io {
        path: dir.display().to_string(),
        message: format!("rank {rank} could not write its part; the previous checkpoint stays"),
    }
    .into()
}

/// This rank's pieces of `session`'s memory, one after another (what its file holds).
fn snapshot(session: &Session, pieces: &[(Piece, u64)]) -> Vec<f32> {
    let total: u64 = pieces.iter().map(|(p, _)| p.hi - p.lo).sum();
    let mut out = Vec::with_capacity(total as usize);
    let mut cache: Option<(BufId, Vec<f32>)> = None;
    for (piece, _) in pieces {
        if cache.as_ref().is_none_or(|c| c.0 != piece.buffer) {
            cache = Some((piece.buffer, session.mem.read_f32(piece.buffer)));
        }
        let values = &cache.as_ref().expect("cached").1;
        let (a, z) = (piece.at as usize, (piece.at + piece.hi - piece.lo) as usize);
        out.extend_from_slice(&values[a..z]);
    }
    out
}

/// Write `values` to `path` as little-endian f32 (synced); returns the file's checksum.
fn write_values(path: &Path, values: &[f32]) -> Result<u64, CheckpointError> {
    let file = File::create(path).map_err(|e| io_err(path, e))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, &file);
    let mut sum = Checksum::default();
    let mut bytes = Vec::with_capacity(1 << 16);
    for chunk in values.chunks(1 << 14) {
        bytes.clear();
        for x in chunk {
            bytes.extend_from_slice(&x.to_le_bytes());
        }
        sum.update(&bytes);
        w.write_all(&bytes).map_err(|e| io_err(path, e))?;
    }
    w.flush().map_err(|e| io_err(path, e))?;
    drop(w);
    file.sync_all().map_err(|e| io_err(path, e))?;
    Ok(sum.value())
}

/// A Hugging Face tensor: name, shape, values.
pub type HfTensor = (String, Vec<usize>, Vec<f32>);

/// An opened, verified checkpoint.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    /// The step folder.
    pub dir: PathBuf,
    /// Its index.
    pub index: Index,
    /// Hugging Face tensor name -> (tensor, expert) in the index.
    hf: HashMap<String, (usize, Option<u64>)>,
}

impl Checkpoint {
    /// Open the checkpoint at `path`: a step folder, or a checkpoint folder (the step
    /// `latest` names, or the highest complete step folder when `latest` is missing or names
    /// an incomplete one). Every shard file's size and checksum is verified.
    pub fn open(path: &Path) -> Result<Checkpoint, CheckpointError> {
        let dir = resolve(path)?;
        let index_path = dir.join(INDEX);
        let shown = index_path.display().to_string();
        let malformed = |message: String| CheckpointError::Malformed {
            path: shown.clone(),
            message,
        };
        let text = megac_ir::file::read_text(&index_path, MAX_INDEX_BYTES)
            .map_err(|e| io_err(&index_path, e))?;
        let index: Index = serde_json::from_str(&text).map_err(|e| malformed(e.to_string()))?;
        if index.format != FORMAT {
            return Err(malformed(format!(
                "format `{}`, this build reads `{FORMAT}`",
                index.format
            )));
        }
        let sizes_ok = index
            .mesh
            .axes
            .iter()
            .try_fold(1u64, |n, &(_, k)| {
                (k >= 1).then(|| n.checked_mul(k)).flatten()
            })
            .is_some_and(|n| n <= 1 << 20);
        if !sizes_ok {
            return Err(malformed(format!("mesh {:?}", index.mesh.axes)));
        }
        let world = index.mesh.world_size();
        if world == 0 || world > 1 << 20 {
            return Err(malformed(format!("a mesh of {world} ranks")));
        }
        // The files first: their real sizes bound what the tensors may claim.
        for f in &index.files {
            if f.name.contains('/') || f.name.contains('\\') || f.name.starts_with('.') {
                return Err(malformed(format!("file name `{}`", f.name)));
            }
            verify_file(&dir.join(&f.name), f)?;
        }
        // Every tensor's real elements are in the files: no shape may claim more.
        let stored: u64 = index.files.iter().map(|f| f.bytes / 4).sum();
        let mut hf = HashMap::new();
        for (t, e) in index.tensors.iter().enumerate() {
            let total = e.shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
            let rows = e.shape.first().copied().unwrap_or(1).max(1);
            let real = total.map(|n| n / rows * e.hf_rows.unwrap_or(rows));
            let sane = match (total, real) {
                (Some(total), Some(real)) => {
                    // Vocabulary padding is a few rows: a tensor is never much larger
                    // than the elements the files hold.
                    e.hf_rows.is_none_or(|r| r <= rows)
                        && real <= stored
                        && total <= stored.saturating_mul(2).saturating_add(1 << 24)
                }
                _ => false,
            };
            if !sane {
                return Err(malformed(format!(
                    "tensor `{}`: shape {:?} (hf_rows {:?}) does not fit the {stored} elements the files hold",
                    e.name, e.shape, e.hf_rows
                )));
            }
            let local = e.local_len(&index.mesh).ok_or_else(|| {
                malformed(format!(
                    "tensor `{}`: shape {:?} does not divide over its shards",
                    e.name, e.shape
                ))
            })?;
            for (kind, pieces) in &e.pieces {
                if !Kind::ALL.iter().any(|k| k.name() == kind) {
                    return Err(malformed(format!(
                        "tensor `{}`: unknown kind `{kind}`",
                        e.name
                    )));
                }
                for p in pieces {
                    let file = index.files.get(p.file);
                    let ok = p.rank < world
                        && p.lo <= p.hi
                        && p.hi <= local
                        && file.is_some_and(|f| {
                            p.offset
                                .checked_add((p.hi - p.lo) * 4)
                                .is_some_and(|end| end <= f.bytes)
                        });
                    if !ok {
                        return Err(malformed(format!(
                            "tensor `{}` {kind}: piece {:?} is outside its shard or file",
                            e.name, p
                        )));
                    }
                }
            }
            let entry = e.param_entry();
            for (j, (name, _)) in entry.hf_tensors().into_iter().enumerate() {
                let expert = e.per_expert.is_some().then_some(j as u64);
                if hf.insert(name.clone(), (t, expert)).is_some() {
                    return Err(malformed(format!("tensor `{name}` appears twice")));
                }
            }
        }
        Ok(Checkpoint { dir, index, hf })
    }

    fn index_path(&self) -> String {
        self.dir.join(INDEX).display().to_string()
    }

    /// Whether it holds kind `kind` of state.
    pub fn has(&self, kind: Kind) -> bool {
        self.index
            .tensors
            .iter()
            .any(|t| t.pieces.get(kind.name()).is_some_and(|p| !p.is_empty()))
    }

    /// Check that the checkpoint holds this model's tensors, every one in the model's shape
    /// (for evaluating its weights; [`Checkpoint::check`] adds what resuming needs).
    pub fn check_model(&self, plan: &Plan) -> Result<(), CheckpointError> {
        let mismatch = |message: String| CheckpointError::Mismatch {
            path: self.index_path(),
            message,
        };
        let ix = &self.index;
        let ours = plan.hf_tensors();
        for (name, shape) in &ours {
            let Some(&(t, _)) = self.hf.get(name) else {
                return Err(mismatch(format!(
                    "not a checkpoint of this model: it has no tensor `{name}` (checkpoint of `{}`, {} tensors; model `{}`, {})",
                    ix.model,
                    self.hf.len(),
                    plan.model,
                    ours.len()
                )));
            };
            let theirs = self.index.tensors[t].param_entry();
            let saved = hf_shape_of(&theirs, name);
            if &saved != shape {
                return Err(mismatch(format!(
                    "not a checkpoint of this model: tensor `{name}` is {saved:?} in the checkpoint, {shape:?} in the model"
                )));
            }
        }
        if self.hf.len() != ours.len() {
            let extra = self
                .hf
                .keys()
                .find(|n| !ours.iter().any(|(m, _)| m == *n))
                .cloned()
                .unwrap_or_default();
            return Err(mismatch(format!(
                "not a checkpoint of this model: it holds tensor `{extra}`, which the model does not have"
            )));
        }
        Ok(())
    }

    /// Check that it can continue a run of `plan` for `steps` steps in total: the same
    /// model (tensor names and Hugging Face shapes), batch geometry and optimizer state.
    pub fn check(&self, plan: &Plan, steps: u64) -> Result<(), CheckpointError> {
        let mismatch = |message: String| CheckpointError::Mismatch {
            path: self.index_path(),
            message,
        };
        let ix = &self.index;
        self.check_model(plan)?;
        if (ix.global_batch, ix.seq_len) != (plan.batch.global_batch, plan.batch.seq_len) {
            return Err(mismatch(format!(
                "saved with global_batch {} and seq_len {}, this run has {} and {}: the data position (sample {}) would not continue",
                ix.global_batch, ix.seq_len, plan.batch.global_batch, plan.batch.seq_len, ix.consumed_samples
            )));
        }
        for kind in [Kind::Param, Kind::ExpAvg, Kind::ExpAvgSq] {
            if let Some(t) = ix
                .tensors
                .iter()
                .find(|t| !t.pieces.contains_key(kind.name()))
            {
                return Err(CheckpointError::Malformed {
                    path: self.index_path(),
                    message: format!("tensor `{}` has no {} pieces", t.name, kind.name()),
                });
            }
        }
        if ix.step >= steps {
            return Err(mismatch(format!(
                "the checkpoint is at step {} and the run has {steps} steps in total: nothing left to train (--steps counts from step 1)",
                ix.step
            )));
        }
        Ok(())
    }

    /// The global values of kind `kind` of the saved tensor `t` (its saved shape, vocabulary
    /// padding zero), assembled from every piece.
    fn assemble(&self, t: usize, kind: Kind) -> Result<Vec<f32>, CheckpointError> {
        let e = &self.index.tensors[t];
        let entry = e.param_entry();
        let total = e.shape.iter().product::<u64>() as usize;
        let real = entry
            .hf_tensors()
            .iter()
            .map(|(_, s)| s.iter().product::<u64>())
            .sum::<u64>() as usize;
        let mut global = vec![0f32; total];
        let mut covered = vec![false; total];
        let mut indices: Option<(usize, Option<Vec<usize>>)> = None;
        for piece in e.pieces.get(kind.name()).into_iter().flatten() {
            let values = self.read_piece(piece)?;
            if indices.as_ref().is_none_or(|c| c.0 != piece.rank) {
                indices = Some((piece.rank, shard_map(&entry, &self.index.mesh, piece.rank)));
            }
            let idx = &indices.as_ref().expect("computed").1;
            for (j, x) in values.iter().enumerate() {
                let g = global_of(idx, piece.lo as usize + j);
                if let (Some(v), Some(c)) = (global.get_mut(g), covered.get_mut(g)) {
                    *v = *x;
                    *c = true;
                }
            }
        }
        if let Some(i) = covered[..real.min(total)].iter().position(|c| !c) {
            return Err(CheckpointError::Malformed {
                path: self.index_path(),
                message: format!(
                    "tensor `{}` {}: element {i} is in no piece",
                    e.name,
                    kind.name()
                ),
            });
        }
        Ok(global)
    }

    fn read_piece(&self, piece: &PieceEntry) -> Result<Vec<f32>, CheckpointError> {
        let f = &self.index.files[piece.file];
        let path = self.dir.join(&f.name);
        let mut file = File::open(&path).map_err(|e| io_err(&path, e))?;
        file.seek(SeekFrom::Start(piece.offset))
            .map_err(|e| io_err(&path, e))?;
        let n = (piece.hi - piece.lo) as usize;
        let mut bytes = vec![0u8; n * 4];
        file.read_exact(&mut bytes)
            .map_err(|e| CheckpointError::Truncated {
                path: path.display().to_string(),
                message: format!("cannot read {} bytes at {}: {e}", n * 4, piece.offset),
            })?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// Kind `kind` of parameter `p`: its Hugging Face tensors one after another (stacked
    /// experts: expert after expert), as `--init` reads them.
    fn hf_values(&self, p: &ParamEntry, kind: Kind) -> Result<Vec<f32>, CheckpointError> {
        let mut out = Vec::new();
        let mut cache: Option<(usize, Vec<f32>)> = None;
        for (name, shape) in p.hf_tensors() {
            let &(t, expert) = self
                .hf
                .get(&name)
                .ok_or_else(|| CheckpointError::Mismatch {
                    path: self.index_path(),
                    message: format!("no tensor `{name}`"),
                })?;
            if cache.as_ref().is_none_or(|c| c.0 != t) {
                cache = Some((t, self.assemble(t, kind)?));
            }
            let global = &cache.as_ref().expect("assembled").1;
            let n = shape.iter().product::<u64>() as usize;
            let start = expert.map_or(0, |j| j as usize * n);
            out.extend_from_slice(&global[start..start + n]);
        }
        Ok(out)
    }

    /// Every Hugging Face tensor of kind `kind` (`(name, shape, values)`, in index order).
    pub fn hf_tensors(&self, kind: Kind) -> Result<Vec<HfTensor>, CheckpointError> {
        let mut out = Vec::new();
        for (t, e) in self.index.tensors.iter().enumerate() {
            let global = self.assemble(t, kind)?;
            let mut at = 0usize;
            for (name, shape) in e.param_entry().hf_tensors() {
                let shape: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
                let n: usize = shape.iter().product();
                out.push((name, shape, global[at..at + n].to_vec()));
                at += n;
            }
        }
        Ok(out)
    }
}

fn hf_shape_of(p: &ParamEntry, name: &str) -> Vec<u64> {
    p.hf_tensors()
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, s)| s)
        .unwrap_or_default()
}

/// The step folder `path` stands for.
fn resolve(path: &Path) -> Result<PathBuf, CheckpointError> {
    let missing = |p: &Path, message: String| CheckpointError::Missing {
        path: p.display().to_string(),
        message,
    };
    if !path.is_dir() {
        return Err(missing(path, "no such checkpoint folder".into()));
    }
    if path.join(INDEX).is_file() {
        return Ok(path.to_path_buf());
    }
    let latest = path.join(LATEST);
    if let Ok(text) = std::fs::read_to_string(&latest) {
        let name = text.trim();
        let plain = !name.is_empty() && !name.contains(['/', '\\']) && !name.starts_with('.');
        if plain && path.join(name).join(INDEX).is_file() {
            return Ok(path.join(name));
        }
    }
    // No `latest`, or it names an incomplete folder: the highest complete step.
    let entries = std::fs::read_dir(path).map_err(|e| io_err(path, e))?;
    let best = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let step: u64 = name.strip_prefix("step-")?.parse().ok()?;
            e.path().join(INDEX).is_file().then_some((step, e.path()))
        })
        .max();
    best.map(|(_, p)| p).ok_or_else(|| {
        missing(
            path,
            format!("no complete checkpoint here (no {LATEST} naming a step folder with an {INDEX}, and no step-NNNNNN folder with one)"),
        )
    })
}

/// Check a shard file's size and checksum against the index.
fn verify_file(path: &Path, f: &FileEntry) -> Result<(), CheckpointError> {
    let shown = path.display().to_string();
    let mut file = File::open(path).map_err(|e| CheckpointError::Missing {
        path: shown.clone(),
        message: format!("cannot open the shard file of rank {}: {e}", f.rank),
    })?;
    let size = file.metadata().map_err(|e| io_err(path, e))?.len();
    if size < f.bytes {
        return Err(CheckpointError::Truncated {
            path: shown,
            message: format!("{size} bytes, the index says {}", f.bytes),
        });
    }
    if size > f.bytes {
        return Err(CheckpointError::Corrupted {
            path: shown,
            message: format!("{size} bytes, the index says {}", f.bytes),
        });
    }
    let mut sum = Checksum::default();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| io_err(path, e))?;
        if n == 0 {
            break;
        }
        // Reads may return any length: hash whole words only, keep the rest for the next.
        let whole = n - n % 4;
        sum.update(&buf[..whole]);
        if whole != n {
            let rest = n - whole;
            let mut word = [0u8; 4];
            word[..rest].copy_from_slice(&buf[whole..n]);
            file.read_exact(&mut word[rest..])
                .map_err(|e| io_err(path, e))?;
            sum.update(&word);
        }
    }
    let got = Checksum::render(sum.value());
    if got != f.checksum {
        return Err(CheckpointError::Corrupted {
            path: shown,
            message: format!("checksum {got}, the index says {}", f.checksum),
        });
    }
    Ok(())
}

/// Rank `rank`'s map from its local shard of `p` to global elements
/// ([`ParamEntry::global_indices`]); None where the shard is the whole tensor (the identity).
fn shard_map(p: &ParamEntry, mesh: &Mesh, rank: usize) -> Option<Vec<usize>> {
    if p.shards.iter().all(|a| a.is_empty()) {
        None
    } else {
        Some(p.global_indices(mesh, rank))
    }
}

/// The global element of local element `local` under `map` (from [`shard_map`]).
fn global_of(map: &Option<Vec<usize>>, local: usize) -> usize {
    match map {
        Some(m) => m.get(local).copied().unwrap_or(usize::MAX),
        None => local,
    }
}

/// Where parameter `p`'s working weights load from: fp32 weights from the master copy
/// where the checkpoint has one, else the saved working weights.
fn weight_source(p: &ParamEntry, plan: &Plan, has_master: bool) -> Kind {
    let half = plan.buffers[p.buffer as usize].dtype.is_half();
    if !half && has_master {
        Kind::Master
    } else {
        Kind::Param
    }
}

/// Load checkpoint `ckpt` into `session` (this rank's shards of every kind of state).
pub(crate) fn load(session: &mut Session, ckpt: &Checkpoint) -> Result<(), RuntimeError> {
    let plan = session.plan;
    let rank = session.comm.rank();
    let pieces = pieces_of(plan, rank)?;
    let has_master = ckpt.has(Kind::Master);
    let mut by_param: BTreeMap<usize, Vec<&Piece>> = BTreeMap::new();
    for p in &pieces {
        by_param.entry(p.param).or_default().push(p);
    }
    // A tied parameter's copy on another stage (GPT-2's head reads the word embeddings on
    // the last stage): loaded like the parameter, though this rank holds no piece of it.
    let copies: Vec<(usize, BufId)> = plan
        .params
        .iter()
        .enumerate()
        .filter(|(i, _)| !by_param.contains_key(i))
        .flat_map(|(i, p)| p.tied_copies.iter().map(move |&b| (i, b)))
        .filter(|&(_, b)| session.mem.holds(b))
        .collect();
    for (i, b) in copies {
        let p = &plan.params[i];
        let v = ckpt.hf_values(p, weight_source(p, plan, has_master))?;
        session.load_shard(p, b, &v);
    }
    let mut state: BTreeMap<BufId, Vec<f32>> = BTreeMap::new();
    for (i, ps) in by_param {
        let p = &plan.params[i];
        let mut kinds: Vec<Kind> = ps.iter().map(|x| x.kind).collect();
        kinds.sort_unstable();
        kinds.dedup();
        let mut idx: Option<Option<Vec<usize>>> = None;
        for kind in kinds {
            // fp32 weights come from the master copy where there is one; a master copy
            // from the weights where there is none.
            let source = match kind {
                Kind::Param => weight_source(p, plan, has_master),
                Kind::Master if !has_master => Kind::Param,
                k => k,
            };
            let v = ckpt.hf_values(p, source)?;
            if kind == Kind::Param {
                for b in std::iter::once(p.buffer).chain(p.tied_copies.iter().copied()) {
                    if session.mem.holds(b) {
                        session.load_shard(p, b, &v);
                    }
                }
                continue;
            }
            let idx = idx.get_or_insert_with(|| shard_map(p, &plan.mesh, rank));
            for piece in ps.iter().filter(|x| x.kind == kind) {
                let len = session.mem.buffer(piece.buffer).len() as usize;
                let buf = state.entry(piece.buffer).or_insert_with(|| vec![0f32; len]);
                let n = (piece.hi - piece.lo) as usize;
                let out = &mut buf[piece.at as usize..piece.at as usize + n];
                for (j, x) in out.iter_mut().enumerate() {
                    let g = global_of(idx, piece.lo as usize + j);
                    *x = v.get(g).copied().unwrap_or(0.0);
                }
            }
        }
    }
    for (b, v) in state {
        session.mem.write_f32(b, &v);
    }
    if let (Some(s), Some(saved)) = (session.scaler.as_mut(), &ckpt.index.loss_scaler) {
        s.restore(saved);
    }
    Ok(())
}
