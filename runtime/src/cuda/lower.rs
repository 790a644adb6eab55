//! Lowering: each instruction of a role's programs becomes the device operations that
//! compute what the cpu backend computes for it (`crate::exec`): kernel launches of
//! `kernels/cuda/` with their launch configuration and arguments, cuBLAS GEMMs
//! ([`super::gemm`]), NCCL collectives over the plan's groups ([`super::nccl`]), and the
//! mixed-precision staging around them (16-bit operands widened into f32 scratch, results
//! rounded once, as `Memory::stage`/`unstage`). Lowering runs once at setup; the executor
//! ([`super::device`]) only issues the result, so everything decided here is host logic,
//! tested without a GPU.
//!
//! Not lowered yet (the executor refuses the plan naming the op): context parallelism, the
//! expert all-to-all, and pipeline transfers.

use std::collections::BTreeMap;

use megac_ir::gate::CheckedPlan;
use megac_ir::op::PerturbAction;
use megac_ir::plan::{BufId, Instr, Plan};
use megac_ir::{Axis, DType, OpKind, WeightLayout};
use megac_kernels::precision::Half;

use super::gemm::{self, GemmCall, MatmulShape, Operand};
use super::launch::{self, Launch, LaunchError};
use super::moe::{Route, Table};

/// A kernel argument, resolved to a value or an address when issued.
#[derive(Clone, Debug, PartialEq)]
pub enum Arg {
    /// The f32 view of a plan buffer: its storage, or its staged f32 copy if it is 16-bit.
    Buf(BufId),
    /// The storage of a plan buffer, whatever its dtype.
    Raw(BufId),
    /// An address in the workspace (byte offset).
    Work(u64),
    /// An address in the constants (byte offset).
    Const(u64),
    /// A null pointer.
    Null,
    /// Scalars.
    U32(u32),
    /// A 64-bit count.
    U64(u64),
    /// A signed 32-bit flag.
    I32(i32),
    /// A signed 64-bit offset.
    I64(i64),
    /// An f32 scalar.
    F32(f32),
    /// An f64 scalar.
    F64(f64),
    /// The cross-entropy gradient's scale of this step, `loss_scale / tokens`.
    LossGradScale,
    /// fp16's loss scale of this step (1 otherwise).
    LossScale,
}

/// Reduction of a collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    /// Sum.
    Sum,
    /// Maximum.
    Max,
}

/// One device operation.
#[derive(Clone, Debug, PartialEq)]
pub enum DeviceOp {
    /// The instruction's 16-bit operands and where their f32 copies lie in the staging area
    /// (f32 elements from its start): `Arg::Buf` of such a buffer means its copy until the
    /// next `Stage`.
    Stage(Vec<(BufId, u64)>),
    /// Launch kernel `name`.
    Kernel {
        /// Its `extern "C"` name.
        name: &'static str,
        /// Grid and block.
        launch: Launch,
        /// Its arguments, in order.
        args: Vec<Arg>,
    },
    /// A cuBLAS GEMM over f32 operands (`inputs`/`outputs` resolve its operands).
    Gemm {
        /// The call.
        call: GemmCall,
        /// The instruction's inputs and outputs.
        inputs: Vec<BufId>,
        /// (see `inputs`)
        outputs: Vec<BufId>,
    },
    /// Copy the router's indices to the host, build the routing there (the cpu backend's
    /// `Routing`) and copy its tables into the workspace (or a plan buffer): a
    /// synchronisation of the stream.
    Route(Route),
    /// Zero a buffer (its storage, whatever its dtype).
    Zero(BufId),
    /// Zero bytes of the workspace.
    ZeroWork {
        /// Byte offset.
        offset: u64,
        /// Bytes.
        bytes: u64,
    },
    /// Copy `bytes` from `src` to `dst` (device to device).
    Copy {
        /// Destination address.
        dst: Arg,
        /// Source address.
        src: Arg,
        /// Bytes.
        bytes: u64,
    },
    /// An in-place NCCL all-reduce of `count` elements at `buf` over `rank`'s group over
    /// `axes`.
    AllReduce {
        /// The group's axes.
        axes: Vec<Axis>,
        /// The data.
        buf: Arg,
        /// Elements.
        count: u64,
        /// f64 elements (the gradient norm's total) instead of f32.
        f64: bool,
        /// The reduction.
        op: Reduce,
    },
    /// NCCL all-gather (`send` `count` elements per member into `recv`, member-major).
    AllGather {
        /// The group's axes.
        axes: Vec<Axis>,
        /// This member's part.
        send: Arg,
        /// Every member's part, in group order.
        recv: Arg,
        /// Elements per member.
        count: u64,
    },
    /// NCCL reduce-scatter (sum; `count` elements per member).
    ReduceScatter {
        /// The group's axes.
        axes: Vec<Axis>,
        /// Every member's part, in group order.
        send: Arg,
        /// This member's summed part.
        recv: Arg,
        /// Elements per member.
        count: u64,
    },
    /// The AdamW update of one parameter: reads the norm (a device-to-host copy of
    /// `norm`, once per step), skips the step if it is not finite (fp16), else launches
    /// `adamw_step` with the step's scalars and the clipping/unscaling factor.
    AdamW {
        /// Parameter (or its f32 master), gradient, moments.
        p: BufId,
        /// (see `p`)
        g: BufId,
        /// (see `p`)
        m: BufId,
        /// (see `p`)
        v: BufId,
        /// Elements.
        n: u64,
        /// The gradient norm buffer.
        norm: BufId,
        /// Hyperparameters (the learning rate comes from the step).
        beta1: f32,
        /// (see `beta1`)
        beta2: f32,
        /// (see `beta1`)
        eps: f32,
        /// (see `beta1`)
        weight_decay: f32,
        /// Clipping threshold (0: none).
        max_norm: f32,
        /// The 16-bit working weight rounded from the master afterwards.
        working: Option<(BufId, Half)>,
    },
}

/// Why an instruction cannot be lowered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LowerError {
    /// The op (in this layout) has no device lowering yet.
    #[error("`{op}` at {path} has no cuda lowering yet ({why})")]
    Unsupported {
        /// The op's name.
        op: &'static str,
        /// Its provenance path.
        path: String,
        /// What is missing.
        why: &'static str,
    },
    /// A launch exceeds CUDA's limits.
    #[error("`{op}` at {path}: {source}")]
    Launch {
        /// The op's name.
        op: &'static str,
        /// Its provenance path.
        path: String,
        /// The limit.
        source: LaunchError,
    },
    /// A shape the op needs is not there.
    #[error("`{op}` at {path}: {why}")]
    Shape {
        /// The op's name.
        op: &'static str,
        /// Its provenance path.
        path: String,
        /// What is wrong.
        why: String,
    },
}

/// Where one instruction's device operations begin in a lowered program (`--profile`
/// times each instruction between CUDA events at these points).
#[derive(Clone, Debug, PartialEq)]
pub struct Mark {
    /// Index of its first operation.
    pub start: usize,
    /// The op's name (`zero` for a zeroing), as the cpu profile names it.
    pub name: &'static str,
    /// Its matmul FLOPs (2·m·n·k per GEMM of a linear op; 0 for other ops).
    pub flops: f64,
}

/// A role's programs lowered for one rank.
#[derive(Clone, Debug, Default)]
pub struct Lowered {
    /// The micro-batch program.
    pub microbatch: Vec<DeviceOp>,
    /// The optimizer program.
    pub optimizer: Vec<DeviceOp>,
    /// Where each instruction of the micro-batch program begins.
    pub microbatch_marks: Vec<Mark>,
    /// Where each instruction of the optimizer program begins.
    pub optimizer_marks: Vec<Mark>,
    /// Bytes of workspace the largest instruction needs (instructions run one after the
    /// other on one stream, so they share it).
    pub workspace_bytes: u64,
    /// Bytes of constant tables (RoPE's cos/sin), uploaded once.
    pub constants: Vec<u8>,
}

/// The 16-bit format of a dtype.
pub fn half_of(d: DType) -> Option<Half> {
    match d {
        DType::Bf16 => Some(Half::Bf16),
        DType::F16 => Some(Half::F16),
        _ => None,
    }
}

fn align(x: u64) -> u64 {
    x.div_ceil(256) * 256
}

/// Lowering state of one role.
struct Lowerer<'a> {
    plan: &'a Plan,
    rank: usize,
    workspace: u64,
    constants: Vec<u8>,
    tables: BTreeMap<(usize, usize, Vec<u32>), u64>,
}

/// One instruction being lowered: its operands, their staging, and the ops so far.
struct Ctx<'a> {
    op: &'a OpKind,
    ins: &'a [BufId],
    outs: &'a [BufId],
    path: &'a str,
    ops: Vec<DeviceOp>,
    /// Bytes of workspace taken (after the staging copies).
    work: u64,
}

impl Ctx<'_> {
    fn err(&self, why: &'static str) -> LowerError {
        LowerError::Unsupported {
            op: self.op.name(),
            path: self.path.to_string(),
            why,
        }
    }

    fn launch(&self, l: Result<Launch, LaunchError>) -> Result<Launch, LowerError> {
        l.map_err(|source| LowerError::Launch {
            op: self.op.name(),
            path: self.path.to_string(),
            source,
        })
    }

    fn kernel(&mut self, name: &'static str, launch: Launch, args: Vec<Arg>) {
        self.ops.push(DeviceOp::Kernel { name, launch, args });
    }

    /// An elementwise kernel over `n` elements whose parameters are `bufs`, then `n`.
    fn elementwise(
        &mut self,
        name: &'static str,
        n: u64,
        bufs: &[BufId],
    ) -> Result<(), LowerError> {
        let launch = self.launch(launch::elementwise(n))?;
        let mut args: Vec<Arg> = bufs.iter().map(|&b| Arg::Buf(b)).collect();
        args.push(Arg::U64(n));
        self.kernel(name, launch, args);
        Ok(())
    }

    /// `bytes` of workspace for this instruction; its byte offset.
    fn scratch(&mut self, bytes: u64) -> u64 {
        let at = self.work;
        self.work = align(at + bytes);
        at
    }

    fn gemm(&mut self, call: GemmCall) {
        self.ops.push(DeviceOp::Gemm {
            call,
            inputs: self.ins.to_vec(),
            outputs: self.outs.to_vec(),
        });
    }
}

impl Lowerer<'_> {
    fn buf(&self, b: BufId) -> &megac_ir::plan::Buffer {
        &self.plan.buffers[b as usize]
    }

    fn shape(&self, b: BufId) -> &[u64] {
        &self.buf(b).shape
    }

    fn last(&self, b: BufId) -> u64 {
        *self.shape(b).last().unwrap_or(&1)
    }

    fn numel(&self, b: BufId) -> u64 {
        self.buf(b).len()
    }

    /// This rank's (start, rows) of a dim split over tp, as `crate::sharded::tp_split`.
    fn tp_split(&self, b: BufId, dim: usize) -> Option<(u64, u64)> {
        let buf = self.buf(b);
        let split = buf.layout.get(dim).is_some_and(|a| a.contains(&Axis::Tp));
        if !split {
            return None;
        }
        let rows = buf.shape[dim];
        let coord = self.plan.mesh.coord(self.rank, Axis::Tp) as u64;
        Some((coord * rows, rows))
    }

    fn cp_split(&self, b: BufId, dim: usize) -> bool {
        self.buf(b)
            .layout
            .get(dim)
            .is_some_and(|a| a.contains(&Axis::Cp))
    }

    /// RoPE's cos/sin tables for positions 0..s, head dim d (deduplicated); their offset.
    fn rope_tables(&mut self, op: &OpKind, s: usize, d: usize) -> u64 {
        let (theta, scaling) = match op {
            OpKind::Rope { theta, scaling } | OpKind::RopeGrad { theta, scaling } => {
                (*theta, scaling.as_ref())
            }
            _ => unreachable!(),
        };
        let inv_freq = megac_ir::spec::rope_inv_freq(d, theta, scaling);
        let key = (s, d, inv_freq.iter().map(|f| f.to_bits()).collect());
        if let Some(&at) = self.tables.get(&key) {
            return at;
        }
        let positions: Vec<u32> = (0..s as u32).collect();
        let (cos, sin) = megac_kernels::rope::rope_tables_freq(&positions, &inv_freq);
        let at = self.constants.len() as u64;
        for x in cos.iter().chain(&sin) {
            self.constants.extend_from_slice(&x.to_le_bytes());
        }
        self.constants
            .resize(align(self.constants.len() as u64) as usize, 0);
        self.tables.insert(key, at);
        at
    }

    fn program(&mut self, program: &[Instr]) -> Result<Vec<DeviceOp>, LowerError> {
        Ok(self.program_marked(program)?.0)
    }

    /// The ops of `program` and where each instruction's begin ([`Mark`]).
    fn program_marked(
        &mut self,
        program: &[Instr],
    ) -> Result<(Vec<DeviceOp>, Vec<Mark>), LowerError> {
        let mut out = Vec::new();
        let mut marks = Vec::new();
        for instr in program {
            let start = out.len();
            match instr {
                Instr::Zero { buffer } => {
                    out.push(DeviceOp::Zero(*buffer));
                    marks.push(Mark {
                        start,
                        name: "zero",
                        flops: 0.0,
                    });
                }
                Instr::Kernel {
                    op,
                    inputs,
                    outputs,
                    path,
                } => {
                    out.extend(self.instruction(op, inputs, outputs, path)?);
                    // The matmul FLOPs of the linear ops (the cpu profile's `matmul_flops`).
                    let linear = matches!(
                        op,
                        OpKind::Linear { .. }
                            | OpKind::LinearGradInput { .. }
                            | OpKind::LinearGradWeight { .. }
                    );
                    let flops = if linear {
                        out[start..]
                            .iter()
                            .map(|o| match o {
                                DeviceOp::Gemm { call, .. } => {
                                    2.0 * (call.m * call.n * call.k * call.batch) as f64
                                }
                                _ => 0.0,
                            })
                            .sum()
                    } else {
                        0.0
                    };
                    marks.push(Mark {
                        start,
                        name: op.name(),
                        flops,
                    });
                }
                Instr::Send { .. } | Instr::Recv { .. } => {
                    return Err(LowerError::Unsupported {
                        op: "send/recv",
                        path: String::new(),
                        why: "pipeline transfers over NCCL point-to-point are not built yet",
                    })
                }
            }
        }
        Ok((out, marks))
    }

    /// The ops of one kernel instruction, staging included.
    fn instruction(
        &mut self,
        op: &OpKind,
        ins: &[BufId],
        outs: &[BufId],
        path: &str,
    ) -> Result<Vec<DeviceOp>, LowerError> {
        let mut c = Ctx {
            op,
            ins,
            outs,
            path,
            ops: Vec::new(),
            work: 0,
        };
        // AdamW handles its 16-bit working weight itself.
        let staged: Vec<BufId> = if matches!(op, OpKind::AdamW { .. }) {
            Vec::new()
        } else {
            let mut v: Vec<BufId> = Vec::new();
            for &b in ins.iter().chain(outs) {
                if half_of(self.buf(b).dtype).is_some() && !v.contains(&b) {
                    v.push(b);
                }
            }
            v
        };
        // Staging is the executor's (Arg::Buf of a 16-bit buffer resolves to its copy);
        // it is described by Stage ops here so the order is explicit.
        if !staged.is_empty() {
            let mut at = 0u64;
            let entries = staged
                .iter()
                .map(|&b| {
                    let e = (b, at);
                    at += self.numel(b);
                    e
                })
                .collect();
            c.ops.push(DeviceOp::Stage(entries));
        }
        for &b in &staged {
            let n = self.numel(b);
            let kind = half_of(self.buf(b).dtype).expect("16-bit");
            let name = match kind {
                Half::Bf16 => "cast_bf16_to_f32",
                Half::F16 => "cast_f16_to_f32",
            };
            let l = c.launch(launch::elementwise(n))?;
            c.kernel(name, l, vec![Arg::Raw(b), Arg::Buf(b), Arg::U64(n)]);
        }
        self.body(&mut c)?;
        for &b in outs {
            if let Some(kind) = half_of(self.buf(b).dtype) {
                if matches!(op, OpKind::AdamW { .. }) {
                    continue;
                }
                let n = self.numel(b);
                let name = match kind {
                    Half::Bf16 => "cast_f32_to_bf16",
                    Half::F16 => "cast_f32_to_f16",
                };
                let l = c.launch(launch::elementwise(n))?;
                c.kernel(name, l, vec![Arg::Buf(b), Arg::Raw(b), Arg::U64(n)]);
            }
        }
        self.workspace = self.workspace.max(c.work);
        Ok(c.ops)
    }

    fn body(&mut self, c: &mut Ctx) -> Result<(), LowerError> {
        let (ins, outs) = (c.ins, c.outs);
        let row = |c: &Ctx, rows: u64, w: u64| c.launch(launch::per_row(rows, w));
        let elem = |c: &Ctx, n: u64| c.launch(launch::elementwise(n));
        match c.op {
            OpKind::KvAttention { .. } => {
                return Err(c.err("KV-cache attention (the cpu backend runs KV-cache plans)"))
            }
            OpKind::RopeAt { theta, scaling } => {
                let s = self.shape(ins[0]).to_vec();
                if s.len() != 4 {
                    return Err(self.shape_err(c, "needs a 4-d operand"));
                }
                let (b, sl, nh, d) = (s[0], s[1], s[2], s[3]);
                let inv_freq = megac_ir::spec::rope_inv_freq(d as usize, *theta, scaling.as_ref());
                let freq = self.f32_table(&inv_freq);
                let shard = self.shard_start(ins[0]);
                let l = row(c, b * sl * nh, d / 2)?;
                c.kernel(
                    "rope_at",
                    l,
                    vec![
                        Arg::Buf(ins[0]),
                        Arg::Buf(outs[0]),
                        Arg::Const(freq),
                        Arg::Buf(ins[1]),
                        Arg::U32(sl as u32),
                        Arg::U32(nh as u32),
                        Arg::U32(d as u32),
                        Arg::U32(shard),
                    ],
                );
            }
            OpKind::PosEmbeddingAt => {
                let s = self.shape(ins[0]).to_vec();
                let h = self.last(ins[0]);
                let sl = s.get(1).copied().unwrap_or(1);
                let rows = self.numel(ins[0]) / h.max(1);
                let table_rows = self.numel(ins[1]) / h.max(1);
                let shard = self.shard_start(ins[0]);
                let l = row(c, rows, h)?;
                c.kernel(
                    "pos_embedding_at",
                    l,
                    vec![
                        Arg::Buf(ins[0]),
                        Arg::Buf(ins[1]),
                        Arg::Buf(ins[2]),
                        Arg::Buf(outs[0]),
                        Arg::U32(sl as u32),
                        Arg::U32(h as u32),
                        Arg::U32(table_rows as u32),
                        Arg::U32(shard),
                    ],
                );
            }
            OpKind::Embedding | OpKind::EmbeddingGrad => {
                let table = ins[1];
                let h = self.last(table);
                let (start, rows) = self.tp_split(table, 0).unwrap_or((0, self.shape(table)[0]));
                let tokens = self.numel(ins[0]);
                if matches!(c.op, OpKind::Embedding) {
                    let l = row(c, tokens, h)?;
                    c.kernel(
                        "embedding_fwd",
                        l,
                        vec![
                            Arg::Buf(ins[0]),
                            Arg::Buf(table),
                            Arg::Buf(outs[0]),
                            Arg::U32(h as u32),
                            Arg::I64(start as i64),
                            Arg::I64(rows as i64),
                        ],
                    );
                } else {
                    let l = row(c, rows, h)?;
                    c.kernel(
                        "embedding_bwd",
                        l,
                        vec![
                            Arg::Buf(ins[0]),
                            Arg::Buf(ins[2]),
                            Arg::Buf(outs[0]),
                            Arg::U32(tokens as u32),
                            Arg::U32(h as u32),
                            Arg::I64(start as i64),
                        ],
                    );
                }
            }
            OpKind::PosEmbedding | OpKind::PosEmbeddingGrad => {
                let x = if matches!(c.op, OpKind::PosEmbedding) {
                    ins[0]
                } else {
                    ins[1]
                };
                if self.cp_split(x, 1) {
                    return Err(c.err("context-parallel positions"));
                }
                let s = self.shape(x);
                let (b, sl, h) = (s[0], s[1], s[2]);
                // Positions 0..s as a constant table (u32).
                let pos = self.positions(sl as usize);
                if matches!(c.op, OpKind::PosEmbedding) {
                    let l = row(c, b * sl, h)?;
                    c.kernel(
                        "pos_embedding_fwd",
                        l,
                        vec![
                            Arg::Buf(ins[0]),
                            Arg::Buf(ins[1]),
                            Arg::Const(pos),
                            Arg::Buf(outs[0]),
                            Arg::U32(sl as u32),
                            Arg::U32(h as u32),
                        ],
                    );
                } else {
                    // outputs = [dwpe] (the residual's dx flows through grad_sum): the cpu
                    // backend adds dy over the batch into dwpe only.
                    let l = row(c, sl, h)?;
                    let scratch = c.scratch(b * sl * h * 4);
                    c.ops.push(DeviceOp::ZeroWork {
                        offset: scratch,
                        bytes: b * sl * h * 4,
                    });
                    c.kernel(
                        "pos_embedding_bwd",
                        l,
                        vec![
                            Arg::Buf(ins[1]),
                            Arg::Const(pos),
                            Arg::Work(scratch),
                            Arg::Buf(outs[0]),
                            Arg::U32(b as u32),
                            Arg::U32(sl as u32),
                            Arg::U32(h as u32),
                        ],
                    );
                }
            }
            OpKind::Linear { weight } => {
                let s = self.matmul(ins[0], ins[1], outs[0], *weight);
                // y = x·W (beta = 0), then y += bias: the one addition the cpu kernel makes
                // (bias + x·W), in the other operand order, which rounds the same.
                c.gemm(gemm::linear_fwd(s, false));
                if let Some(&bias) = ins.get(2) {
                    let n = self.numel(outs[0]);
                    let l = elem(c, n)?;
                    c.kernel(
                        "bias_add",
                        l,
                        vec![
                            Arg::Buf(outs[0]),
                            Arg::Buf(bias),
                            Arg::Buf(outs[0]),
                            Arg::U32(s.n as u32),
                            Arg::U64(n),
                        ],
                    );
                }
            }
            OpKind::LinearGradInput { weight } => {
                let s = self.matmul(outs[0], ins[1], ins[0], *weight);
                c.gemm(gemm::linear_grad_input(s));
            }
            OpKind::LinearGradWeight { weight } => {
                let s = self.matmul(ins[0], outs[0], ins[1], *weight);
                c.gemm(gemm::linear_grad_weight(s));
            }
            OpKind::RmsNorm { eps } | OpKind::LayerNorm { eps } => {
                let h = self.last(ins[0]);
                let rows = self.numel(ins[0]) / h.max(1);
                let l = row(c, rows, h)?;
                if matches!(c.op, OpKind::RmsNorm { .. }) {
                    c.kernel(
                        "rms_norm_fwd",
                        l,
                        vec![
                            Arg::Buf(ins[0]),
                            Arg::Buf(ins[1]),
                            Arg::Buf(outs[0]),
                            Arg::U32(h as u32),
                            Arg::F32(*eps as f32),
                        ],
                    );
                } else {
                    c.kernel(
                        "layer_norm_fwd",
                        l,
                        vec![
                            Arg::Buf(ins[0]),
                            Arg::Buf(ins[1]),
                            Arg::Buf(ins[2]),
                            Arg::Buf(outs[0]),
                            Arg::U32(h as u32),
                            Arg::F32(*eps as f32),
                        ],
                    );
                }
            }
            OpKind::RmsNormGrad { eps } | OpKind::LayerNormGrad { eps } => {
                let layer = matches!(c.op, OpKind::LayerNormGrad { .. });
                let h = self.last(ins[0]);
                let rows = self.numel(ins[0]) / h.max(1);
                let stats = c.scratch(rows * if layer { 8 } else { 4 });
                let l = row(c, rows, h)?;
                c.kernel(
                    if layer {
                        "layer_norm_bwd_dx"
                    } else {
                        "rms_norm_bwd_dx"
                    },
                    l,
                    vec![
                        Arg::Buf(ins[0]),
                        Arg::Buf(ins[1]),
                        Arg::Buf(ins[2]),
                        Arg::Buf(outs[0]),
                        Arg::Work(stats),
                        Arg::U32(h as u32),
                        Arg::F32(*eps as f32),
                    ],
                );
                let l = elem(c, h)?;
                c.kernel(
                    "norm_dw",
                    l,
                    vec![
                        Arg::Buf(ins[0]),
                        Arg::Buf(ins[2]),
                        Arg::Work(stats),
                        Arg::Buf(outs[1]),
                        if layer { Arg::Buf(outs[2]) } else { Arg::Null },
                        Arg::U32(rows as u32),
                        Arg::U32(h as u32),
                        Arg::I32(layer as i32),
                    ],
                );
            }
            OpKind::Split { n } => {
                let width = self.last(ins[0]);
                let d = width / (*n).max(1);
                let rows = self.numel(ins[0]) / width.max(1);
                for (p, &o) in outs.iter().enumerate() {
                    let l = elem(c, rows * d)?;
                    c.kernel(
                        "copy_columns",
                        l,
                        copy_args(ins[0], o, rows, d, width, p as u64 * d, d, 0, false),
                    );
                }
            }
            OpKind::Concat => {
                let width = self.last(outs[0]);
                let d = width / ins.len().max(1) as u64;
                let rows = self.numel(outs[0]) / width.max(1);
                for (p, &i) in ins.iter().enumerate() {
                    let l = elem(c, rows * d)?;
                    c.kernel(
                        "copy_columns",
                        l,
                        copy_args(i, outs[0], rows, d, d, 0, width, p as u64 * d, false),
                    );
                }
            }
            OpKind::Cast { .. } => {
                let n = self.numel(outs[0]);
                c.ops.push(DeviceOp::Copy {
                    dst: Arg::Buf(outs[0]),
                    src: Arg::Buf(ins[0]),
                    bytes: n * 4,
                });
            }
            OpKind::Add => {
                let n = self.numel(outs[0]);
                c.elementwise("add_fwd", n, &[ins[0], ins[1], outs[0]])?;
            }
            OpKind::BiasAdd => {
                let n = self.numel(outs[0]);
                let l = elem(c, n)?;
                c.kernel(
                    "bias_add",
                    l,
                    vec![
                        Arg::Buf(ins[0]),
                        Arg::Buf(ins[1]),
                        Arg::Buf(outs[0]),
                        Arg::U32(self.numel(ins[1]) as u32),
                        Arg::U64(n),
                    ],
                );
            }
            OpKind::GradSum => {
                let n = self.numel(outs[0]);
                for &x in ins {
                    c.elementwise("accumulate", n, &[outs[0], x])?;
                }
            }
            OpKind::BiasGrad => {
                let n = self.last(ins[0]);
                let rows = self.numel(ins[0]) / n.max(1);
                let l = elem(c, n)?;
                c.kernel(
                    "column_sum_acc",
                    l,
                    vec![
                        Arg::Buf(ins[0]),
                        Arg::Buf(outs[0]),
                        Arg::U32(rows as u32),
                        Arg::U32(n as u32),
                    ],
                );
            }
            OpKind::SwiGlu => {
                let n = self.numel(outs[0]);
                c.elementwise("swiglu_fwd", n, &[ins[0], ins[1], outs[0]])?;
            }
            OpKind::SwiGluGrad => {
                let n = self.numel(ins[0]);
                c.elementwise("swiglu_bwd", n, &[ins[0], ins[1], ins[2], outs[0], outs[1]])?;
            }
            OpKind::GeluTanh | OpKind::GeluTanhGrad => {
                let n = self.numel(ins[0]);
                let l = elem(c, n)?;
                if matches!(c.op, OpKind::GeluTanh) {
                    c.kernel(
                        "gelu_tanh_fwd",
                        l,
                        vec![Arg::Buf(ins[0]), Arg::Buf(outs[0]), Arg::U64(n)],
                    );
                } else {
                    c.kernel(
                        "gelu_tanh_bwd",
                        l,
                        vec![
                            Arg::Buf(ins[0]),
                            Arg::Buf(ins[1]),
                            Arg::Buf(outs[0]),
                            Arg::U64(n),
                        ],
                    );
                }
            }
            OpKind::SigmoidMul | OpKind::SigmoidMulGrad => {
                let h = self.last(ins[1]);
                let rows = self.numel(ins[0]);
                let l = row(c, rows, h)?;
                if matches!(c.op, OpKind::SigmoidMul) {
                    c.kernel(
                        "sigmoid_mul_fwd",
                        l,
                        vec![
                            Arg::Buf(ins[0]),
                            Arg::Buf(ins[1]),
                            Arg::Buf(outs[0]),
                            Arg::U32(h as u32),
                        ],
                    );
                } else {
                    c.kernel(
                        "sigmoid_mul_bwd",
                        l,
                        vec![
                            Arg::Buf(ins[0]),
                            Arg::Buf(ins[1]),
                            Arg::Buf(ins[2]),
                            Arg::Buf(outs[0]),
                            Arg::Buf(outs[1]),
                            Arg::U32(h as u32),
                        ],
                    );
                }
            }
            OpKind::CrossEntropy | OpKind::CrossEntropyGrad => self.cross_entropy(c)?,
            OpKind::Rope { .. } | OpKind::RopeGrad { .. } => {
                let s = self.shape(ins[0]).to_vec();
                if s.len() != 4 {
                    return Err(self.shape_err(c, "needs a 4-d operand"));
                }
                if self.cp_split(ins[0], 1) {
                    return Err(c.err("context-parallel positions"));
                }
                let (b, sl, nh, d) = (s[0], s[1], s[2], s[3]);
                let tables = self.rope_tables(c.op, sl as usize, d as usize);
                let half_bytes = sl * (d / 2) * 4;
                let l = row(c, b * sl * nh, d / 2)?;
                c.kernel(
                    "rope_apply",
                    l,
                    vec![
                        Arg::Buf(ins[0]),
                        Arg::Buf(outs[0]),
                        Arg::Const(tables),
                        Arg::Const(tables + half_bytes),
                        Arg::U32(sl as u32),
                        Arg::U32(nh as u32),
                        Arg::U32(d as u32),
                        Arg::I32(matches!(c.op, OpKind::RopeGrad { .. }) as i32),
                    ],
                );
            }
            OpKind::CausalAttention { window } | OpKind::AttentionGrad { window } => {
                self.attention(c, *window)?
            }
            OpKind::RepeatKv { .. } | OpKind::RepeatKvGrad { .. } => {
                let (x, y) = if matches!(c.op, OpKind::RepeatKv { .. }) {
                    (ins[0], outs[0])
                } else {
                    (outs[0], ins[0])
                };
                let (sx, sy) = (self.shape(x).to_vec(), self.shape(y).to_vec());
                if sx.len() != 4 || sy.len() != 4 {
                    return Err(self.shape_err(c, "needs 4-d operands"));
                }
                let (nkv, d) = (sx[2], sx[3]);
                let group = sy[2] / nkv.max(1);
                if matches!(c.op, OpKind::RepeatKv { .. }) {
                    let n = self.numel(y);
                    let l = elem(c, n)?;
                    c.kernel(
                        "repeat_kv_fwd",
                        l,
                        vec![
                            Arg::Buf(x),
                            Arg::Buf(y),
                            Arg::U32(nkv as u32),
                            Arg::U32(group as u32),
                            Arg::U32(d as u32),
                            Arg::U64(n),
                        ],
                    );
                } else {
                    let n = self.numel(x);
                    let l = elem(c, n)?;
                    c.kernel(
                        "repeat_kv_bwd",
                        l,
                        vec![
                            Arg::Buf(y),
                            Arg::Buf(x),
                            Arg::U32(nkv as u32),
                            Arg::U32(group as u32),
                            Arg::U32(d as u32),
                            Arg::U64(n),
                        ],
                    );
                }
            }
            OpKind::AllReduce { axes } => {
                let n = self.numel(outs[0]);
                if ins[0] != outs[0] {
                    c.ops.push(DeviceOp::Copy {
                        dst: Arg::Buf(outs[0]),
                        src: Arg::Buf(ins[0]),
                        bytes: n * 4,
                    });
                }
                c.ops.push(DeviceOp::AllReduce {
                    axes: axes.clone(),
                    buf: Arg::Buf(outs[0]),
                    count: n,
                    f64: false,
                    op: Reduce::Sum,
                });
            }
            OpKind::AllGather { axes, dim } | OpKind::ReduceScatter { axes, dim } => {
                let gather = matches!(c.op, OpKind::AllGather { .. });
                let local = if gather { ins[0] } else { outs[0] };
                let (outer, block) = self.around(c, local, *dim)?;
                let n = self.plan.mesh.group(self.rank, axes).len() as u64;
                let chunk = outer * block;
                if outer == 1 || n == 1 {
                    // The member-major order is the buffer's own.
                    c.ops.push(if gather {
                        DeviceOp::AllGather {
                            axes: axes.clone(),
                            send: Arg::Buf(ins[0]),
                            recv: Arg::Buf(outs[0]),
                            count: chunk,
                        }
                    } else {
                        DeviceOp::ReduceScatter {
                            axes: axes.clone(),
                            send: Arg::Buf(ins[0]),
                            recv: Arg::Buf(outs[0]),
                            count: chunk,
                        }
                    });
                } else {
                    // NCCL's buffers are member-major ([n, outer, block]); the plan's are
                    // [outer, n·block]: reorder through the workspace, as the cpu backend's
                    // scatter_member_major / gather_member_major.
                    let mm = c.scratch(n * chunk * 4);
                    let whole = if gather { outs[0] } else { ins[0] };
                    if gather {
                        c.ops.push(DeviceOp::AllGather {
                            axes: axes.clone(),
                            send: Arg::Buf(ins[0]),
                            recv: Arg::Work(mm),
                            count: chunk,
                        });
                    }
                    for m in 0..n {
                        let part = Arg::Work(mm + m * chunk * 4);
                        let (src, dst, sw, sc, dw, dc) = if gather {
                            (part, Arg::Buf(whole), block, 0, n * block, m * block)
                        } else {
                            (Arg::Buf(whole), part, n * block, m * block, block, 0)
                        };
                        columns(c, [src, dst], [outer, block, sw, sc, dw, dc], false)?;
                    }
                    if !gather {
                        c.ops.push(DeviceOp::ReduceScatter {
                            axes: axes.clone(),
                            send: Arg::Work(mm),
                            recv: Arg::Buf(outs[0]),
                            count: chunk,
                        });
                    }
                }
            }
            OpKind::Slice { axes, dim } => {
                // y[o] = x[o, me] over [outer, n, block]: this member's block of every row.
                let (outer, block) = self.around(c, outs[0], *dim)?;
                let members = self.plan.mesh.group(self.rank, axes);
                let n = members.len() as u64;
                let me = members.iter().position(|&r| r == self.rank).unwrap_or(0) as u64;
                columns(
                    c,
                    [Arg::Buf(ins[0]), Arg::Buf(outs[0])],
                    [outer, block, n * block, me * block, block, 0],
                    false,
                )?;
            }
            OpKind::AllToAll { .. } => return Err(c.err("expert all-to-all")),
            OpKind::GradNorm { axes } => self.grad_norm(c, axes)?,
            OpKind::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
                max_norm,
                ..
            } => {
                let (p, working) = match outs.get(3) {
                    Some(&master) => (
                        master,
                        half_of(self.buf(outs[0]).dtype).map(|h| (outs[0], h)),
                    ),
                    None => (outs[0], None),
                };
                c.ops.push(DeviceOp::AdamW {
                    p,
                    g: ins[1],
                    m: outs[1],
                    v: outs[2],
                    n: self.numel(p),
                    norm: ins[2],
                    beta1: *beta1 as f32,
                    beta2: *beta2 as f32,
                    eps: *eps as f32,
                    weight_decay: *weight_decay as f32,
                    max_norm: *max_norm as f32,
                    working,
                });
            }
            OpKind::Router { .. }
            | OpKind::RouterGrad { .. }
            | OpKind::MoeAuxLoss { .. }
            | OpKind::MoeAuxLossGrad { .. }
            | OpKind::Dispatch { .. }
            | OpKind::DispatchGrad { .. }
            | OpKind::DispatchExperts { .. }
            | OpKind::DispatchExpertsGrad
            | OpKind::CombineExperts
            | OpKind::CombineExpertsGrad
            | OpKind::Combine
            | OpKind::CombineGrad => self.moe(c)?,
            OpKind::SplitHeads { .. } | OpKind::MergeHeads => {
                return Err(self.shape_err(c, "a view is never an instruction"))
            }
            OpKind::Probe { .. } | OpKind::Perturb { .. } => self.scope(c)?,
        }
        Ok(())
    }

    fn shape_err(&self, c: &Ctx, why: &str) -> LowerError {
        LowerError::Shape {
            op: c.op.name(),
            path: c.path.to_string(),
            why: why.to_string(),
        }
    }

    /// MegaScope's ops (`exec/scope.rs` on the cpu backend): `probe` is a copy; `perturb`
    /// copies the point, then runs its kernel (`kernels/cuda/scope.cu`) in place on the
    /// real tokens' rows of this rank's part ([`perturbed_elements`]), with the stream seed
    /// computed here as the cpu backend does. Training perturbations (their stream depends
    /// on the step and micro-batch, and `@STEP` runs in one step only) are not lowered yet.
    fn scope(&mut self, c: &mut Ctx) -> Result<(), LowerError> {
        let (ins, outs) = (c.ins, c.outs);
        let n = self.numel(outs[0]);
        c.ops.push(DeviceOp::Copy {
            dst: Arg::Buf(outs[0]),
            src: Arg::Buf(ins[0]),
            bytes: n * 4,
        });
        let OpKind::Perturb {
            point,
            action,
            seed,
            tokens,
            step,
            train,
        } = c.op
        else {
            return Ok(());
        };
        if *train || *step != 0 {
            return Err(c.err("training perturbations (train --perturb)"));
        }
        let buf = self.buf(outs[0]);
        let n = perturbed_elements(&self.plan.mesh, self.rank, &buf.shape, &buf.layout, *tokens);
        let seed = megac_kernels::perturb::stream_seed(*seed, point);
        let y = Arg::Buf(outs[0]);
        let l = c.launch(launch::elementwise(n))?;
        match *action {
            PerturbAction::Scale(f) => {
                c.kernel("perturb_scale", l, vec![y, Arg::F64(f), Arg::U64(n)]);
            }
            PerturbAction::Noise(sigma) => {
                let sum = c.scratch(8);
                let one = Launch {
                    grid: (1, 1, 1),
                    block: 256,
                };
                c.kernel(
                    "perturb_sum_squares",
                    one,
                    vec![y.clone(), Arg::Work(sum), Arg::U64(n)],
                );
                c.kernel(
                    "perturb_noise",
                    l,
                    vec![
                        y,
                        Arg::Work(sum),
                        Arg::F64(sigma),
                        Arg::U64(seed),
                        Arg::U64(n),
                    ],
                );
            }
            PerturbAction::Bitflip { first, count, rate } => {
                c.kernel(
                    "perturb_bitflip",
                    l,
                    vec![
                        y,
                        Arg::U32(first),
                        Arg::U32(count),
                        Arg::F64(rate),
                        Arg::U64(seed),
                        Arg::U64(n),
                    ],
                );
            }
            PerturbAction::ZeroHead(h) => {
                let (heads, d) = match buf.shape[..] {
                    [_, _, heads, d] => (heads, d),
                    _ => return Err(self.shape_err(c, "zero-head needs a [b, s, heads, d] tensor")),
                };
                // The global head's rank: the part of the heads dim that holds it.
                let axes = buf.layout.get(2).cloned().unwrap_or_default();
                let part = axes.iter().fold(0u64, |p, &ax| {
                    p * self.plan.mesh.size(ax) + self.plan.mesh.coord(self.rank, ax) as u64
                });
                if h / heads.max(1) == part {
                    c.kernel(
                        "perturb_zero_head",
                        l,
                        vec![
                            y,
                            Arg::U32((h % heads.max(1)) as u32),
                            Arg::U32(heads as u32),
                            Arg::U32(d as u32),
                            Arg::U64(n),
                        ],
                    );
                }
            }
            PerturbAction::Patch => {
                c.ops.push(DeviceOp::Copy {
                    dst: y,
                    src: Arg::Buf(ins[1]),
                    bytes: n * 4,
                });
            }
        }
        Ok(())
    }

    /// The MoE ops: the router and the load-balancing loss as kernels; dispatch and
    /// combine as a [`Route`] (tables built on the host from the router's indices, as the
    /// cpu backend's `routing`) then the row-moving kernels over them.
    fn moe(&mut self, c: &mut Ctx) -> Result<(), LowerError> {
        let (ins, outs) = (c.ins, c.outs);
        let u32_of = |c: &Ctx, x: u64| {
            u32::try_from(x).map_err(|_| LowerError::Shape {
                op: c.op.name(),
                path: c.path.to_string(),
                why: format!("{x} does not fit the kernel's u32 parameter"),
            })
        };
        // Slots per token and tokens, from the indices (input 1 of every op but the router's).
        let slots = |b: BufId| {
            let k = self.last(b).max(1);
            (k, self.numel(b) / k)
        };
        let route =
            |indices: BufId, experts: Option<usize>, hint: usize, rows: u64, tables: Vec<Table>| {
                let (k, _) = slots(indices);
                DeviceOp::Route(Route {
                    indices,
                    top_k: k as usize,
                    experts,
                    hint,
                    rows: rows as usize,
                    tables,
                })
            };
        match c.op {
            OpKind::Router { top_k, renorm } | OpKind::RouterGrad { top_k, renorm } => {
                let e = self.last(ins[0]).max(1);
                let t = self.numel(ins[0]) / e;
                let l = c.launch(launch::elementwise(t))?;
                let dims = [
                    Arg::U32(u32_of(c, t)?),
                    Arg::U32(u32_of(c, e)?),
                    Arg::U32(u32_of(c, *top_k)?),
                    Arg::I32(*renorm as i32),
                ];
                if matches!(c.op, OpKind::Router { .. }) {
                    let mut args = vec![Arg::Buf(ins[0]), Arg::Buf(outs[0]), Arg::Raw(outs[1])];
                    args.extend(dims);
                    c.kernel("router_fwd", l, args);
                } else {
                    // The selection is recomputed from the logits, as the cpu backend does.
                    let w = c.scratch(t * top_k * 4);
                    let idx = c.scratch(t * top_k * 4);
                    let mut args = vec![Arg::Buf(ins[0]), Arg::Work(w), Arg::Work(idx)];
                    args.extend(dims.clone());
                    c.kernel("router_fwd", l, args);
                    let mut args = vec![
                        Arg::Buf(ins[0]),
                        Arg::Work(idx),
                        Arg::Buf(ins[1]),
                        Arg::Buf(outs[0]),
                    ];
                    args.extend(dims);
                    c.kernel("router_bwd", l, args);
                }
            }
            OpKind::MoeAuxLoss { coeff } | OpKind::MoeAuxLossGrad { coeff } => {
                let e = self.last(ins[0]).max(1);
                let t = self.numel(ins[0]) / e;
                let (k, _) = slots(ins[1]);
                let share = t as f64 / self.plan.batch.tokens_per_step as f64;
                let stats = c.scratch((2 * e + 1) * 8);
                let le = c.launch(launch::elementwise(e))?;
                c.kernel(
                    "moe_aux_stats",
                    le,
                    vec![
                        Arg::Buf(ins[0]),
                        Arg::Raw(ins[1]),
                        Arg::Work(stats),
                        Arg::U32(u32_of(c, t)?),
                        Arg::U32(u32_of(c, e)?),
                        Arg::U32(u32_of(c, k)?),
                    ],
                );
                // Context parallelism: the statistics are summed over the group.
                let split = c.op.implicit_collective().filter(|ic| {
                    ins.get(ic.operand)
                        .is_some_and(|&b| ic.applies(&self.buf(b).layout))
                });
                let members = match split {
                    Some(ic) => {
                        c.ops.push(DeviceOp::AllReduce {
                            axes: vec![ic.axis],
                            buf: Arg::Work(stats),
                            count: 2 * e + 1,
                            f64: true,
                            op: Reduce::Sum,
                        });
                        self.plan.mesh.group(self.rank, &[ic.axis]).len() as f64
                    }
                    None => 1.0,
                };
                if matches!(c.op, OpKind::MoeAuxLoss { .. }) {
                    c.kernel(
                        "moe_aux_loss_finish",
                        launch::single(),
                        vec![
                            Arg::Work(stats),
                            Arg::Buf(outs[0]),
                            Arg::U32(u32_of(c, e)?),
                            Arg::U32(u32_of(c, k)?),
                            Arg::F64(*coeff),
                            Arg::F64(share),
                        ],
                    );
                } else {
                    let lt = c.launch(launch::elementwise(t))?;
                    c.kernel(
                        "moe_aux_loss_bwd",
                        lt,
                        vec![
                            Arg::Buf(ins[0]),
                            Arg::Work(stats),
                            Arg::Buf(outs[0]),
                            Arg::U32(u32_of(c, t)?),
                            Arg::U32(u32_of(c, e)?),
                            Arg::U32(u32_of(c, k)?),
                            Arg::F64(*coeff),
                            Arg::F64(share * members),
                            Arg::LossScale,
                        ],
                    );
                }
            }
            OpKind::Dispatch { expert, .. }
            | OpKind::DispatchExperts {
                experts: expert, ..
            } => {
                let stacked = matches!(c.op, OpKind::DispatchExperts { .. });
                let s = self.shape(outs[0]).to_vec();
                let (count, rows, h) = if stacked {
                    (*expert, s[1], s[2])
                } else {
                    (1, s[0], self.last(ins[0]))
                };
                let (first, experts) = if stacked {
                    (0, Some(*expert as usize))
                } else {
                    (*expert as usize, None)
                };
                let src = c.scratch(count * rows * 4);
                let mut tables = vec![Table::Sources {
                    first,
                    count: count as usize,
                    at: src,
                }];
                if stacked {
                    tables.push(Table::Counts { buf: outs[1] });
                }
                c.ops.push(route(ins[1], experts, first, rows, tables));
                let l = c.launch(launch::per_row(count * rows, h))?;
                c.kernel(
                    "moe_gather_rows",
                    l,
                    vec![
                        Arg::Buf(ins[0]),
                        Arg::Work(src),
                        Arg::Buf(outs[0]),
                        Arg::U32(u32_of(c, h)?),
                    ],
                );
            }
            OpKind::DispatchGrad { .. } | OpKind::DispatchExpertsGrad => {
                let s = self.shape(ins[0]).to_vec();
                let (first, count, experts, rows) = match c.op {
                    OpKind::DispatchGrad { expert } => (*expert as usize, 1, None, s[0]),
                    _ => (0, s[0] as usize, Some(s[0] as usize), s[1]),
                };
                let h = self.last(ins[0]);
                let (k, t) = slots(ins[1]);
                let row = c.scratch(t * k * 4);
                let tables = vec![Table::Rows {
                    first,
                    count,
                    at: row,
                }];
                c.ops.push(route(ins[1], experts, first, rows, tables));
                let l = c.launch(launch::per_row(t, h))?;
                c.kernel(
                    "moe_scatter_add_rows",
                    l,
                    vec![
                        Arg::Buf(ins[0]),
                        Arg::Work(row),
                        Arg::Buf(outs[0]),
                        Arg::U32(u32_of(c, k)?),
                        Arg::U32(u32_of(c, h)?),
                    ],
                );
            }
            OpKind::Combine
            | OpKind::CombineExperts
            | OpKind::CombineGrad
            | OpKind::CombineExpertsGrad => {
                let grad = matches!(c.op, OpKind::CombineGrad | OpKind::CombineExpertsGrad);
                let stacked = matches!(c.op, OpKind::CombineExperts | OpKind::CombineExpertsGrad);
                // The expert outputs (and, backward, their gradients) and dout.
                let (ys, dys, dout): (Vec<BufId>, Vec<BufId>, Option<BufId>) = if stacked {
                    let dys = if grad { vec![outs[1]] } else { Vec::new() };
                    (vec![ins[2]], dys, grad.then(|| ins[3]))
                } else if grad {
                    let e = ins.len().saturating_sub(3);
                    (ins[2..2 + e].to_vec(), outs[1..].to_vec(), Some(ins[2 + e]))
                } else {
                    (ins[2..].to_vec(), Vec::new(), None)
                };
                let s = self.shape(ys[0]).to_vec();
                let (experts, rows, h) = if stacked {
                    (s[0] as usize, s[1], s[2])
                } else {
                    (ys.len(), s[0], *s.last().unwrap_or(&1))
                };
                let (k, t) = slots(ins[1]);
                let rows_at = c.scratch(t * k * 8);
                let mut tables = vec![Table::Addresses {
                    bufs: ys.clone(),
                    h,
                    at: rows_at,
                }];
                let drows_at = if grad {
                    let at = c.scratch(t * k * 8);
                    tables.push(Table::Addresses { bufs: dys, h, at });
                    Some(at)
                } else {
                    None
                };
                c.ops.push(route(ins[1], Some(experts), 0, rows, tables));
                let l = c.launch(launch::per_row(t, h))?;
                let (k32, h32) = (Arg::U32(u32_of(c, k)?), Arg::U32(u32_of(c, h)?));
                match (drows_at, dout) {
                    (Some(drows), Some(dout)) => c.kernel(
                        "moe_combine_bwd",
                        l,
                        vec![
                            Arg::Buf(ins[0]),
                            Arg::Work(rows_at),
                            Arg::Work(drows),
                            Arg::Buf(dout),
                            Arg::Buf(outs[0]),
                            k32,
                            h32,
                        ],
                    ),
                    _ => c.kernel(
                        "moe_combine_fwd",
                        l,
                        vec![
                            Arg::Buf(ins[0]),
                            Arg::Work(rows_at),
                            Arg::Buf(outs[0]),
                            k32,
                            h32,
                        ],
                    ),
                }
            }
            _ => return Err(c.err("not an MoE op")),
        }
        Ok(())
    }

    /// A buffer's (rows before `dim`, elements from `dim` on), as the cpu collectives
    /// read them.
    fn around(&self, c: &Ctx, b: BufId, dim: u64) -> Result<(u64, u64), LowerError> {
        let s = self.shape(b);
        let d = dim as usize;
        if d >= s.len() {
            return Err(self.shape_err(c, &format!("dim {d} of a {}-d buffer", s.len())));
        }
        Ok((s[..d].iter().product(), s[d..].iter().product()))
    }

    /// The f32 values `v` as a constant table (deduplicated); its offset.
    fn f32_table(&mut self, v: &[f32]) -> u64 {
        let key = (usize::MAX, v.len(), v.iter().map(|f| f.to_bits()).collect());
        if let Some(&at) = self.tables.get(&key) {
            return at;
        }
        let at = self.constants.len() as u64;
        for x in v {
            self.constants.extend_from_slice(&x.to_le_bytes());
        }
        self.constants
            .resize(align(self.constants.len() as u64) as usize, 0);
        self.tables.insert(key, at);
        at
    }

    /// The rows of this rank's earlier shards of `x`'s sequence dim (dim 1): its part
    /// index along the dim's axes times its local rows, as the cpu backend's
    /// `step_positions`.
    fn shard_start(&self, x: BufId) -> u32 {
        let buf = self.buf(x);
        let s = buf.shape.get(1).copied().unwrap_or(1);
        let part = buf.layout.get(1).map_or(0, |axes| {
            axes.iter().fold(0u64, |acc, &a| {
                acc * self.plan.mesh.size(a) + self.plan.mesh.coord(self.rank, a) as u64
            })
        });
        u32::try_from(part * s).unwrap_or(u32::MAX)
    }

    /// Positions 0..s as a u32 constant table; its offset.
    fn positions(&mut self, s: usize) -> u64 {
        let key = (s, 0, Vec::new());
        if let Some(&at) = self.tables.get(&key) {
            return at;
        }
        let at = self.constants.len() as u64;
        for p in 0..s as u32 {
            self.constants.extend_from_slice(&p.to_le_bytes());
        }
        self.constants
            .resize(align(self.constants.len() as u64) as usize, 0);
        self.tables.insert(key, at);
        at
    }

    /// The shape of a matmul from `x` (`[.., m, k]`), weight `w` and `y` (`[.., m, n]`),
    /// as the cpu backend reads it (`runtime/src/exec/dense.rs`): stacked experts when
    /// `w` (or, for the weight gradient, `dw`) is 3-d.
    fn matmul(&self, x: BufId, w: BufId, y: BufId, weight: WeightLayout) -> MatmulShape {
        let k = self.last(x) as usize;
        let n = self.last(y) as usize;
        let ws = self.shape(w);
        let g = if ws.len() == 3 {
            ws[0].max(1) as usize
        } else {
            1
        };
        let m = self.numel(x) as usize / k.max(1) / g;
        MatmulShape {
            m,
            k,
            n,
            g,
            layout: weight,
        }
    }

    /// Cross-entropy (the loss, mean over the step's tokens) and its gradient, whole or
    /// vocab-parallel over tp (statistics all-reduced, as `vocab_parallel_stats`).
    fn cross_entropy(&mut self, c: &mut Ctx) -> Result<(), LowerError> {
        let (ins, outs) = (c.ins, c.outs);
        let x = ins[0];
        let v = self.last(x);
        let rows = self.numel(x) / v.max(1);
        let dims = self.shape(x).len();
        let (start, real) = match self.tp_split(x, dims - 1) {
            // Whole logits: every column, as the cpu kernel.
            None => (0, v),
            Some((start, _)) => (start, v.min(self.plan.batch.vocab.saturating_sub(start))),
        };
        let tp_split = self.tp_split(x, dims - 1).is_some();
        let (gmax, gsum, target) = (
            c.scratch(rows * 4),
            c.scratch(rows * 4),
            c.scratch(rows * 4),
        );
        let l = c.launch(launch::per_row(rows, v))?;
        c.kernel(
            "ce_row_max",
            l,
            vec![
                Arg::Buf(x),
                Arg::Work(gmax),
                Arg::U32(v as u32),
                Arg::U32(real as u32),
            ],
        );
        if tp_split {
            c.ops.push(DeviceOp::AllReduce {
                axes: vec![Axis::Tp],
                buf: Arg::Work(gmax),
                count: rows,
                f64: false,
                op: Reduce::Max,
            });
        }
        c.kernel(
            "ce_row_sumexp",
            l,
            vec![
                Arg::Buf(x),
                Arg::Buf(ins[1]),
                Arg::Work(gmax),
                Arg::Work(gsum),
                Arg::Work(target),
                Arg::U32(v as u32),
                Arg::U32(real as u32),
                Arg::I64(start as i64),
            ],
        );
        if tp_split {
            // gsum and target are adjacent: one all-reduce of 2·rows (aligned regions).
            for at in [gsum, target] {
                c.ops.push(DeviceOp::AllReduce {
                    axes: vec![Axis::Tp],
                    buf: Arg::Work(at),
                    count: rows,
                    f64: false,
                    op: Reduce::Sum,
                });
            }
        }
        if matches!(c.op, OpKind::CrossEntropy) {
            let lr = c.launch(launch::elementwise(rows))?;
            let loss_rows = c.scratch(rows * 4);
            c.kernel(
                "ce_rows_loss",
                lr,
                vec![
                    Arg::Work(gmax),
                    Arg::Work(gsum),
                    Arg::Work(target),
                    Arg::Work(loss_rows),
                    Arg::U32(rows as u32),
                ],
            );
            c.kernel(
                "ce_mean",
                Launch {
                    grid: (1, 1, 1),
                    block: 1024,
                },
                vec![
                    Arg::Work(loss_rows),
                    Arg::Buf(outs[0]),
                    Arg::U32(rows as u32),
                    Arg::F64(self.plan.batch.tokens_per_step as f64),
                ],
            );
        } else {
            c.kernel(
                "ce_vp_bwd",
                l,
                vec![
                    Arg::Buf(x),
                    Arg::Buf(ins[1]),
                    Arg::Work(gmax),
                    Arg::Work(gsum),
                    Arg::Buf(outs[0]),
                    Arg::U32(v as u32),
                    Arg::U32(real as u32),
                    Arg::I64(start as i64),
                    Arg::LossGradScale,
                ],
            );
        }
        Ok(())
    }

    /// Unfused attention: head-major copies, cuBLAS batched QKᵀ, the masked softmax, P·V
    /// (and the backward), on workspace.
    fn attention(&mut self, c: &mut Ctx, window: u64) -> Result<(), LowerError> {
        let (ins, outs) = (c.ins, c.outs);
        let (qs, ks) = (self.shape(ins[0]).to_vec(), self.shape(ins[1]).to_vec());
        if qs.len() != 4 || ks.len() != 4 {
            return Err(self.shape_err(c, "needs 4-d operands"));
        }
        if self.cp_split(ins[0], 1) {
            return Err(c.err("context-parallel attention"));
        }
        let (b, s, nh, d) = (qs[0], qs[1], qs[2], qs[3]);
        let nkv = ks[2];
        let dims = (
            b as usize,
            s as usize,
            s as usize,
            nh as usize,
            nkv as usize,
            d as usize,
        );
        let window = u32::try_from(window).unwrap_or(u32::MAX);
        let scale = (d as f64).powf(-0.5) as f32;
        let (qn, kn, sn) = (b * s * nh * d, b * s * nkv * d, b * nh * s * s);
        let q_hm = c.scratch(qn * 4);
        let k_hm = c.scratch(kn * 4);
        let v_hm = c.scratch(kn * 4);
        let p = c.scratch(sn * 4);
        let o_hm = c.scratch(qn * 4);
        let w = |at: u64| Operand::Workspace(at as usize / 4);
        // [b, s, h, d] -> [b, h, s, d].
        let to_hm =
            |c: &mut Ctx, src: Arg, dst: Arg, heads: u64, n: u64, inverse: bool, acc: bool| {
                let l = c.launch(launch::elementwise(n))?;
                let (x, y) = if inverse { (dst, src) } else { (src, dst) };
                c.kernel(
                    "transpose_heads",
                    l,
                    vec![
                        x,
                        y,
                        Arg::U32(s as u32),
                        Arg::U32(heads as u32),
                        Arg::U32(d as u32),
                        Arg::I32(inverse as i32),
                        Arg::I32(acc as i32),
                        Arg::U64(n),
                    ],
                );
                Ok::<(), LowerError>(())
            };
        to_hm(c, Arg::Buf(ins[0]), Arg::Work(q_hm), nh, qn, false, false)?;
        to_hm(c, Arg::Buf(ins[1]), Arg::Work(k_hm), nkv, kn, false, false)?;
        to_hm(c, Arg::Buf(ins[2]), Arg::Work(v_hm), nkv, kn, false, false)?;
        let group = (nh / nkv.max(1)) as usize;
        let softmax_args = |lse: Arg| {
            vec![
                Arg::Work(p),
                Arg::Work(p),
                lse,
                Arg::U32(s as u32),
                Arg::U32(s as u32),
                Arg::F32(scale),
                Arg::I32(1),
                Arg::Null,
                Arg::Null,
                Arg::U32(window),
            ]
        };
        let rows = b * nh * s;
        let lrow = c.launch(launch::per_row(rows, s))?;
        if matches!(c.op, OpKind::CausalAttention { .. }) {
            for m in 0..group {
                c.gemm(gemm::attention_scores(dims, m, (w(q_hm), w(k_hm), w(p))));
            }
            // lse is [b, nh, s]: the softmax's row order.
            c.kernel("masked_softmax_fwd", lrow, softmax_args(Arg::Buf(outs[1])));
            for m in 0..group {
                c.gemm(gemm::attention_pv(dims, m, (w(p), w(v_hm), w(o_hm))));
            }
            to_hm(c, Arg::Buf(outs[0]), Arg::Work(o_hm), nh, qn, true, false)?;
        } else {
            // ins = [q, k, v, out, lse, dout], outs = [dq, dk, dv] (accumulated).
            let do_hm = c.scratch(qn * 4);
            let dp = c.scratch(sn * 4);
            let dq_hm = c.scratch(qn * 4);
            let dk_hm = c.scratch(kn * 4);
            let dv_hm = c.scratch(kn * 4);
            to_hm(c, Arg::Buf(ins[5]), Arg::Work(do_hm), nh, qn, false, false)?;
            // Recompute P from the scores and the forward's lse-free softmax (same kernel:
            // deterministic, so P equals the forward's).
            let lse_scratch = c.scratch(rows * 4);
            for m in 0..group {
                c.gemm(gemm::attention_scores(dims, m, (w(q_hm), w(k_hm), w(p))));
            }
            c.kernel(
                "masked_softmax_fwd",
                lrow,
                softmax_args(Arg::Work(lse_scratch)),
            );
            c.ops.push(DeviceOp::ZeroWork {
                offset: dk_hm,
                bytes: kn * 4,
            });
            c.ops.push(DeviceOp::ZeroWork {
                offset: dv_hm,
                bytes: kn * 4,
            });
            for m in 0..group {
                let [dp_call, dv_call, _, _] = gemm::attention_bwd(
                    dims,
                    m,
                    [
                        w(q_hm),
                        w(k_hm),
                        w(v_hm),
                        w(p),
                        w(do_hm),
                        w(dp),
                        w(dq_hm),
                        w(dk_hm),
                        w(dv_hm),
                    ],
                );
                c.gemm(dp_call);
                c.gemm(dv_call);
            }
            c.kernel(
                "masked_softmax_bwd",
                lrow,
                vec![
                    Arg::Work(p),
                    Arg::Work(dp),
                    Arg::Work(dp),
                    Arg::U32(s as u32),
                    Arg::F32(scale),
                ],
            );
            for m in 0..group {
                let [_, _, dq_call, dk_call] = gemm::attention_bwd(
                    dims,
                    m,
                    [
                        w(q_hm),
                        w(k_hm),
                        w(v_hm),
                        w(p),
                        w(do_hm),
                        w(dp),
                        w(dq_hm),
                        w(dk_hm),
                        w(dv_hm),
                    ],
                );
                c.gemm(dq_call);
                c.gemm(dk_call);
            }
            to_hm(c, Arg::Buf(outs[0]), Arg::Work(dq_hm), nh, qn, true, true)?;
            to_hm(c, Arg::Buf(outs[1]), Arg::Work(dk_hm), nkv, kn, true, true)?;
            to_hm(c, Arg::Buf(outs[2]), Arg::Work(dv_hm), nkv, kn, true, true)?;
        }
        Ok(())
    }

    /// The global gradient norm: per gradient a grid-stride sum of squares into partials
    /// and their fixed-order sum (divided by its replica count) into an f64 total, the
    /// total all-reduced over the group, then sqrt / loss scale.
    fn grad_norm(&mut self, c: &mut Ctx, axes: &[Axis]) -> Result<(), LowerError> {
        let mesh = &self.plan.mesh;
        let total = c.scratch(8);
        let largest = c.ins.iter().map(|&g| self.numel(g)).max().unwrap_or(0);
        let partials = c.scratch(u64::from(launch::grid_stride(largest).grid.0) * 4);
        for (i, &g) in c.ins.iter().enumerate() {
            let layout = &self.buf(g).layout;
            let has = |a: Axis| layout.iter().any(|d| d.contains(&a));
            let folded = has(Axis::Ep) && has(Axis::Edp);
            let replicas: u64 = axes
                .iter()
                .filter(|&&a| a != Axis::Pp)
                .filter(|&&a| !(has(a) || folded && matches!(a, Axis::Dp | Axis::Cp)))
                .map(|&a| mesh.size(a))
                .product();
            let n = self.numel(g);
            let l = launch::grid_stride(n);
            c.kernel(
                "sum_squares",
                l,
                vec![Arg::Buf(g), Arg::Work(partials), Arg::U64(n)],
            );
            c.kernel(
                "sum_partials",
                launch::single(),
                vec![
                    Arg::Work(partials),
                    Arg::Work(total),
                    Arg::U32(l.grid.0),
                    Arg::F64(1.0 / replicas as f64),
                    Arg::I32((i > 0) as i32),
                ],
            );
        }
        if c.ins.is_empty() {
            c.ops.push(DeviceOp::ZeroWork {
                offset: total,
                bytes: 8,
            });
        }
        if !axes.is_empty() {
            c.ops.push(DeviceOp::AllReduce {
                axes: axes.to_vec(),
                buf: Arg::Work(total),
                count: 1,
                f64: true,
                op: Reduce::Sum,
            });
        }
        c.kernel(
            "grad_norm_finish",
            launch::single(),
            vec![Arg::Work(total), Arg::Buf(c.outs[0]), Arg::LossScale],
        );
        Ok(())
    }
}

/// A `copy_columns` launch between two addresses: `[rows, cols, src_width, src_col,
/// dst_width, dst_col]` (the kernel's u32 parameters; larger is an error).
fn columns(c: &mut Ctx, [src, dst]: [Arg; 2], dims: [u64; 6], acc: bool) -> Result<(), LowerError> {
    let l = c.launch(launch::elementwise(dims[0] * dims[1]))?;
    let mut args = vec![src, dst];
    for x in dims {
        let x = u32::try_from(x).map_err(|_| LowerError::Shape {
            op: c.op.name(),
            path: c.path.to_string(),
            why: format!("a column copy of {x} elements per row does not fit its u32 parameters"),
        })?;
        args.push(Arg::U32(x));
    }
    args.push(Arg::I32(acc as i32));
    c.kernel("copy_columns", l, args);
    Ok(())
}

pub use crate::sharded::perturbed_elements;

#[allow(clippy::too_many_arguments)]
fn copy_args(
    src: BufId,
    dst: BufId,
    rows: u64,
    cols: u64,
    src_width: u64,
    src_col: u64,
    dst_width: u64,
    dst_col: u64,
    accumulate: bool,
) -> Vec<Arg> {
    vec![
        Arg::Buf(src),
        Arg::Buf(dst),
        Arg::U32(rows as u32),
        Arg::U32(cols as u32),
        Arg::U32(src_width as u32),
        Arg::U32(src_col as u32),
        Arg::U32(dst_width as u32),
        Arg::U32(dst_col as u32),
        Arg::I32(accumulate as i32),
    ]
}

/// Lower rank `rank`'s role of `plan` (its micro-batch and optimizer programs).
pub fn lower_role(plan: &CheckedPlan, rank: usize) -> Result<Lowered, LowerError> {
    let p: &Plan = plan;
    let role = &p.roles[p.rank_to_role[rank] as usize];
    if role.pipeline.is_some() {
        return Err(LowerError::Unsupported {
            op: "pipeline",
            path: role.name.clone(),
            why: "pipelined plans (chunks, slots, send/recv) are not lowered yet",
        });
    }
    let mut l = Lowerer {
        plan: p,
        rank,
        workspace: 0,
        constants: Vec::new(),
        tables: BTreeMap::new(),
    };
    let (microbatch, microbatch_marks) = l.program_marked(&role.microbatch)?;
    let (optimizer, optimizer_marks) = l.program_marked(&role.optimizer)?;
    Ok(Lowered {
        microbatch,
        optimizer,
        microbatch_marks,
        optimizer_marks,
        workspace_bytes: l.workspace,
        constants: l.constants,
    })
}

/// One instruction of `plan` lowered for rank `rank` on its own: its device operations,
/// the workspace bytes it needs and its constant tables (for tests that evaluate the
/// lowering of one op against the cpu backend's).
pub fn lower_instruction(
    plan: &CheckedPlan,
    rank: usize,
    instr: &Instr,
) -> Result<(Vec<DeviceOp>, u64, Vec<u8>), LowerError> {
    let mut l = Lowerer {
        plan,
        rank,
        workspace: 0,
        constants: Vec::new(),
        tables: BTreeMap::new(),
    };
    let ops = l.program(std::slice::from_ref(instr))?;
    Ok((ops, l.workspace, l.constants))
}

/// The 16-bit format in which a lowered GEMM reads `A` and `B` straight from their storage
/// (cuBLAS's bf16/fp16 inputs, f32 accumulation into the f32 view of `C`): when both are
/// instruction inputs (not outputs, so not rewritten during the instruction) of the same
/// 16-bit dtype. Their products are exact in f32, so this computes what the f32 GEMM over
/// the staged copies computes, up to the order of the sum. None: both from their f32 views.
pub fn gemm_half(call: &GemmCall, ins: &[BufId], outs: &[BufId], plan: &Plan) -> Option<Half> {
    let half = |o: Operand| match o {
        Operand::Input(i) => {
            let b = *ins.get(i)?;
            if outs.contains(&b) {
                return None;
            }
            half_of(plan.buffers.get(b as usize)?.dtype)
        }
        _ => None,
    };
    match (half(call.a.0), half(call.b.0)) {
        (Some(x), Some(y)) if x == y => Some(x),
        _ => None,
    }
}
