//! Per-layer costs: the kernels of one transformer layer as megac's passes emit them (the
//! same linears, norms, attention, elementwise ops, `zero`s and collectives, with the
//! rank-local shapes of tensor, sequence, context and expert parallelism), each costed with
//! the [`CostModel`] functions the plan simulator uses, and the bytes a layer keeps for its
//! backward (the tensors megac's autodiff saves; Korthikanti et al. for flash attention).

use megac_ir::spec::{Arch, ModelSection, ModelSpec};
use megac_ir::types::DType;

use super::ParallelLayout;
use crate::cost::{Coll, CostModel, Group};

/// Times of one stage for one micro-batch (all its chunks).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct Phases {
    /// Forward (with exposed forward communication).
    pub(super) f: f64,
    /// Input-gradient backward (with recomputation and exposed backward communication).
    pub(super) b: f64,
    /// Weight-gradient backward.
    pub(super) w: f64,
    /// Exposed in-layer communication (already inside f and b), for the breakdown.
    pub(super) comm: f64,
}

impl Phases {
    pub(super) fn add(&mut self, o: Phases, times: f64) {
        self.f += o.f * times;
        self.b += o.b * times;
        self.w += o.w * times;
        self.comm += o.comm * times;
    }
    /// Add a block's forward, backward and weight-gradient times and its exposed forward
    /// and backward communication (counted in `f` and `b` too).
    fn add_block(&mut self, f: f64, b: f64, w: f64, comm_f: f64, comm_b: f64) {
        self.f += f + comm_f;
        self.b += b + comm_b;
        self.w += w;
        self.comm += comm_f + comm_b;
    }
    pub(super) fn total(&self) -> f64 {
        self.f + self.b + self.w
    }
}

/// Rank-local geometry of one layout.
pub(super) struct Geo<'a> {
    pub(super) cost: &'a CostModel,
    pub(super) act: DType,
    /// Activation bytes per element.
    pub(super) a: f64,
    /// Tokens per rank and micro-batch (the cp shard of the sequence).
    pub(super) t: f64,
    /// Tokens of sequence-sharded tensors (t / tp with sequence parallelism).
    pub(super) tn: f64,
    pub(super) h: f64,
    /// Query width per rank.
    pub(super) q_l: f64,
    /// Key/value width per rank.
    pub(super) kv_l: f64,
    /// Query heads per rank.
    pub(super) heads_l: f64,
    /// MLP width per rank.
    pub(super) f_l: f64,
    /// Full sequence length.
    pub(super) s: f64,
    pub(super) sp: bool,
    pub(super) tp_group: Group,
    pub(super) cp_group: Group,
    pub(super) ep_group: Group,
    /// Context parallelism passes keys and values around a ring (else all-gathers them).
    pub(super) cp_ring: bool,
    /// Sequence parallelism keeps norm outputs sharded and gathers them again in backward.
    pub(super) tp_overlap: f64,
    /// The share of causal attention a sliding window keeps (1 without one).
    pub(super) window: f64,
}

impl<'a> Geo<'a> {
    /// The rank-local geometry of `layout` for `spec` on the cluster of `cost`.
    pub(super) fn new(spec: &ModelSpec, layout: &ParallelLayout, cost: &'a CostModel) -> Geo<'a> {
        let m = &spec.model;
        let gpn = cost.cluster.gpus_per_node;
        let (tp, cp) = (layout.tp, layout.cp);
        let sp = layout.sequence_parallel && tp > 1;
        let act = activation_dtype(spec);
        let a = act.size_bytes() as f64;
        let mb = layout.micro_batch as f64;
        let s = m.seq_len as f64;
        let t = mb * s / cp as f64;
        let tn = if sp { t / tp as f64 } else { t };
        let d = m.head_dim() as f64;
        let heads_l = m.heads as f64 / tp as f64;
        let kv_heads_l = (m.kv_heads as f64 / tp as f64).max(1.0).floor();
        let params = cost.params();
        Geo {
            cost,
            act,
            a,
            t,
            tn,
            h: m.hidden as f64,
            q_l: heads_l * d,
            kv_l: kv_heads_l * d,
            heads_l,
            f_l: m.ffn_hidden as f64 / tp as f64,
            s,
            sp,
            tp_group: Group::strided(tp, 1, gpn),
            cp_group: Group::strided(cp, tp, gpn),
            ep_group: Group::strided(layout.ep, tp, gpn),
            cp_ring: spec.parallel.cp_comm == megac_ir::spec::CpComm::Ring,
            tp_overlap: params.tp_comm_overlap,
            window: megac_ir::flops::window_fraction(m.seq_len, m.sliding_window),
        }
    }
}

/// The activation dtype of the spec's precision.
pub(super) fn activation_dtype(spec: &ModelSpec) -> DType {
    spec.train.precision.storage()
}

/// The bytes of an f32 weight or gradient element.
pub(super) const W: f64 = 4.0;

impl Geo<'_> {
    pub(super) fn lin(&self, m: f64, n: f64, k: f64) -> f64 {
        self.cost
            .matmul(m, n, k, (m * k + m * n) * self.a + k * n * W, self.act)
    }
    pub(super) fn lin_gi(&self, m: f64, n: f64, k: f64) -> f64 {
        // dx[m,k] = dy[m,n] · w[n,k]
        self.cost
            .matmul(m, k, n, (m * n + m * k) * self.a + n * k * W, self.act)
            + self.zero(m * k * self.a)
    }
    pub(super) fn lin_gw(&self, m: f64, n: f64, k: f64) -> f64 {
        // dw[n,k] += dy[m,n]ᵀ · x[m,k] (f32, accumulated)
        self.cost.matmul(
            n,
            k,
            m,
            (m * n + m * k) * self.a + 2.0 * n * k * W,
            self.act,
        )
    }
    /// A grouped linear: `groups` weights `[n, k]`, each applied to its block of the `m`
    /// stacked rows (MoE's local experts), one kernel.
    pub(super) fn grouped(&self, m: f64, n: f64, k: f64, groups: f64) -> f64 {
        self.cost.matmul(
            m,
            n,
            k,
            (m * k + m * n) * self.a + groups * k * n * W,
            self.act,
        )
    }
    /// [`Self::grouped`]'s input gradient (its output buffer is zeroed elsewhere).
    pub(super) fn grouped_gi(&self, m: f64, n: f64, k: f64, groups: f64) -> f64 {
        self.cost.matmul(
            m,
            k,
            n,
            (m * n + m * k) * self.a + groups * n * k * W,
            self.act,
        )
    }
    /// [`Self::grouped`]'s weight gradients (f32, accumulated).
    pub(super) fn grouped_gw(&self, m: f64, n: f64, k: f64, groups: f64) -> f64 {
        self.cost.matmul(
            n,
            k,
            m,
            (m * n + m * k) * self.a + 2.0 * groups * n * k * W,
            self.act,
        )
    }
    pub(super) fn mem(&self, bytes: f64) -> f64 {
        self.cost.memory(bytes)
    }
    pub(super) fn zero(&self, bytes: f64) -> f64 {
        self.cost.memory(bytes)
    }
    /// A tensor-parallel collective of a `[t, width]` activation (exposed part).
    pub(super) fn tp_coll(&self, coll: Coll, width: f64) -> f64 {
        self.cost
            .collective(coll, self.t * width * self.a, self.tp_group)
            * (1.0 - self.tp_overlap)
    }
    /// Entering a column-parallel region: all-gather with sequence parallelism, else nothing.
    pub(super) fn enter_f(&self) -> f64 {
        if self.sp {
            self.tp_coll(Coll::AllGather, self.h)
        } else {
            0.0
        }
    }
    /// Leaving a row-parallel region: reduce-scatter with sequence parallelism, else all-reduce.
    pub(super) fn exit_f(&self) -> f64 {
        if self.sp {
            self.tp_coll(Coll::ReduceScatter, self.h)
        } else {
            self.tp_coll(Coll::AllReduce, self.h)
        }
    }
    /// Backward of a column-parallel region's input: reduce-scatter with sequence
    /// parallelism, plus the re-gather of the saved sharded input (the `regather` pass, as
    /// Megatron), else all-reduce.
    pub(super) fn enter_b(&self) -> f64 {
        if self.sp {
            let regather = self.tp_coll(Coll::AllGather, self.h);
            self.tp_coll(Coll::ReduceScatter, self.h) + regather
        } else {
            self.tp_coll(Coll::AllReduce, self.h)
        }
    }
    /// Backward of a row-parallel output: all-gather with sequence parallelism.
    pub(super) fn exit_b(&self) -> f64 {
        if self.sp {
            self.tp_coll(Coll::AllGather, self.h)
        } else {
            0.0
        }
    }
    pub(super) fn norm_f(&self, params: f64) -> f64 {
        self.mem(2.0 * self.tn * self.h * self.a + params * self.h * W)
    }
    pub(super) fn norm_b(&self, params: f64) -> f64 {
        // x, dy in, dx out; weights in; weight gradients accumulated (read and written).
        self.mem(3.0 * self.tn * self.h * self.a + 3.0 * params * self.h * W)
            + self.zero(self.tn * self.h * self.a)
    }
    pub(super) fn grad_sum(&self, tokens: f64, width: f64) -> f64 {
        self.mem(3.0 * tokens * width * self.a) + self.zero(tokens * width * self.a)
    }
    /// Executed attention FLOPs forward (causal: half the square), per rank.
    pub(super) fn attn_flops(&self) -> f64 {
        let d = self.q_l / self.heads_l;
        2.0 * self.t * self.s * self.heads_l * d * self.window
    }
    /// Attention kernels per rank: one, or with ring context parallelism one per key/value
    /// block (the local queries meet each of the cp blocks in turn).
    pub(super) fn attn_blocks(&self) -> f64 {
        if self.cp_ring {
            self.cp_group.size.max(1) as f64
        } else {
            1.0
        }
    }
    pub(super) fn kv_bytes(&self) -> f64 {
        2.0 * self.t * self.kv_l * self.a
    }
    pub(super) fn attn_f(&self) -> f64 {
        let n = self.attn_blocks();
        let bytes =
            (2.0 * self.q_l + 2.0 * self.kv_l) * self.t * self.a + 4.0 * self.t * self.heads_l;
        let kernel = n * self.cost.attention(
            self.attn_flops() / n,
            self.t * self.q_l,
            bytes / n,
            false,
            self.act,
        );
        kernel
            + self
                .cost
                .cp_exchange(self.kv_bytes(), self.cp_group, self.cp_ring, false, kernel)
    }
    pub(super) fn attn_b(&self) -> f64 {
        let n = self.attn_blocks();
        let bytes =
            (4.0 * self.q_l + 4.0 * self.kv_l) * self.t * self.a + 4.0 * self.t * self.heads_l;
        let kernel = n * self.cost.attention(
            2.5 * self.attn_flops() / n,
            self.t * self.q_l,
            bytes / n,
            true,
            self.act,
        );
        kernel
            + self
                .cost
                .cp_exchange(self.kv_bytes(), self.cp_group, self.cp_ring, true, kernel)
            + self.zero(self.t * self.q_l * self.a)
            + 2.0 * self.zero(self.t * self.kv_l * self.a)
    }
}

/// Costs of one transformer layer for one micro-batch, and the bytes it keeps for backward.
pub(super) struct LayerCost {
    pub(super) phases: Phases,
    /// Forward time of the layer (recomputation replays it).
    pub(super) forward: f64,
    /// Forward time of the core attention (selective recomputation replays it).
    pub(super) attention: f64,
    /// Bytes kept for backward without recomputation.
    pub(super) saved: f64,
    /// Bytes kept with selective recomputation.
    pub(super) saved_selective: f64,
    /// The layer input (the checkpoint of full recomputation).
    pub(super) input: f64,
    /// What a zero-bubble plan keeps of the layer per micro-batch, by recomputation (none,
    /// selective, full): see [`ZeroBubbleKept`].
    pub(super) zb: [ZeroBubbleKept; 3],
}

/// A layer's share of a zero-bubble (split B/W) plan's per-micro-batch slot, which lives from
/// `F` to `W`. It holds what 1F1B keeps (`saved`: what `B` reads, of which the linears'
/// inputs also serve `W`), and `kw_bw`: the linears' inputs plus each linear's output
/// gradient, born in `B` and read by `W`. The backward walks the layers down, freeing what
/// only `B` reads and adding the gradients, so a stack of layers peaks either as `B` starts
/// (every `saved`, plus the first MLP's output gradients, `mlp_bw`, born before its inputs
/// die) or as it ends (every `kw_bw`).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct ZeroBubbleKept {
    pub(super) kw_bw: f64,
    pub(super) mlp_bw: f64,
}
/// The attention half of a layer (norm, projections, core attention, output projection,
/// residual, and their backward, with the tensor/context-parallel collectives): adds its
/// phases to `ph` and returns (forward time with its exposed communication, the core
/// attention kernel's forward time).
fn attention_block(g: &Geo, m: &ModelSection, ph: &mut Phases) -> (f64, f64) {
    let arch = m.arch;
    let (t, h, a) = (g.t, g.h, g.a);
    let mut f = 0.0;
    let mut b = 0.0;
    let mut w = 0.0;
    let mut comm_f = 0.0;
    let mut comm_b = 0.0;
    let norm_params = if arch == Arch::Gpt { 2.0 } else { 1.0 };
    f += g.norm_f(norm_params);
    comm_f += g.enter_f();
    let attn = g.attn_f();
    let attn_b = g.attn_b();
    match arch {
        Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen2Moe => {
            f += g.lin(t, g.q_l, h) + 2.0 * g.lin(t, g.kv_l, h);
            if m.qkv_bias {
                // Qwen2's biases: read with the projections' outputs; their gradients are a
                // sum over the tokens.
                f += g.mem((g.q_l + 2.0 * g.kv_l) * W);
                w += g.mem(t * (g.q_l + 2.0 * g.kv_l) * a + 2.0 * (g.q_l + 2.0 * g.kv_l) * W);
            }
            if m.qk_norm {
                // Qwen3's per-head RMSNorm of q and k: x in, y out; backward x, dy in, dx out.
                let width = g.q_l + g.kv_l;
                f += g.mem(2.0 * t * width * a);
                b += g.mem(3.0 * t * width * a) + g.zero(t * width * a);
            }
            f += g.mem(2.0 * t * g.q_l * a) + g.mem(2.0 * t * g.kv_l * a);
            f += attn;
            f += g.lin(t, h, g.q_l);
            comm_f += g.exit_f();
            f += g.mem(3.0 * g.tn * h * a);
            // Backward, in reverse.
            comm_b += g.exit_b();
            b += g.grad_sum(g.tn, h); // residual: the input feeds the norm and the add
            b += g.lin_gi(t, h, g.q_l);
            w += g.lin_gw(t, h, g.q_l);
            b += attn_b;
            b += g.mem(2.0 * t * g.q_l * a) + g.zero(t * g.q_l * a);
            b += g.mem(2.0 * t * g.kv_l * a) + g.zero(t * g.kv_l * a);
            b += g.lin_gi(t, g.q_l, h) + 2.0 * g.lin_gi(t, g.kv_l, h);
            b += 2.0 * g.grad_sum(t, h);
            w += g.lin_gw(t, g.q_l, h) + 2.0 * g.lin_gw(t, g.kv_l, h);
            comm_b += g.enter_b();
            b += g.norm_b(norm_params);
        }
        Arch::Gpt => {
            let qkv = 3.0 * g.q_l;
            f += g.lin(t, qkv, h) + g.mem(qkv * W);
            f += g.mem(2.0 * t * qkv * a); // split
            f += attn;
            f += g.lin(t, h, g.q_l);
            comm_f += g.exit_f();
            f += g.mem(2.0 * g.tn * h * a + h * W); // bias (after the reduction)
            f += g.mem(3.0 * g.tn * h * a);
            comm_b += g.exit_b();
            b += g.grad_sum(g.tn, h);
            b += g.lin_gi(t, h, g.q_l);
            w += g.lin_gw(t, h, g.q_l) + g.mem(t * h * a + 2.0 * h * W);
            b += attn_b;
            b += g.mem(2.0 * t * qkv * a) + g.zero(t * qkv * a); // concat
            b += g.lin_gi(t, qkv, h);
            w += g.lin_gw(t, qkv, h) + g.mem(t * qkv * a + 2.0 * qkv * W);
            comm_b += g.enter_b();
            b += g.norm_b(norm_params);
        }
    }
    ph.add_block(f, b, w, comm_f, comm_b);
    (f + comm_f, attn)
}

/// The MLP half of a layer (norm, dense or gated MLP, or the MoE router, dispatch, local
/// experts, combine and expert-parallel all-to-alls; residual; and their backward): adds
/// its phases to `ph` and returns its forward time with exposed communication.
fn mlp_block(
    g: &Geo,
    spec: &ModelSpec,
    layout: &ParallelLayout,
    moe: bool,
    ph: &mut Phases,
) -> f64 {
    let m = &spec.model;
    let (t, h, a, f_l) = (g.t, g.h, g.a, g.f_l);
    let mut f = 0.0;
    let mut b = 0.0;
    let mut w = 0.0;
    let mut comm_f = 0.0;
    let mut comm_b = 0.0;
    let norm_params = if m.arch == Arch::Gpt { 2.0 } else { 1.0 };
    f += g.norm_f(norm_params);
    comm_f += g.enter_f();
    match (m.arch, moe) {
        (Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen2Moe, false) => {
            f += 2.0 * g.lin(t, f_l, h) + g.mem(3.0 * t * f_l * a) + g.lin(t, h, f_l);
            b += g.lin_gi(t, h, f_l);
            w += g.lin_gw(t, h, f_l);
            b += g.mem(5.0 * t * f_l * a) + 2.0 * g.zero(t * f_l * a);
            b += 2.0 * g.lin_gi(t, f_l, h) + g.grad_sum(t, h);
            w += 2.0 * g.lin_gw(t, f_l, h);
        }
        (Arch::Gpt, _) => {
            f += g.lin(t, f_l, h) + g.mem(f_l * W);
            f += g.mem(2.0 * t * f_l * a);
            f += g.lin(t, h, f_l) + g.mem(2.0 * g.tn * h * a + h * W);
            b += g.lin_gi(t, h, f_l);
            w += g.lin_gw(t, h, f_l) + g.mem(t * h * a + 2.0 * h * W);
            b += g.mem(3.0 * t * f_l * a) + g.zero(t * f_l * a);
            b += g.lin_gi(t, f_l, h);
            w += g.lin_gw(t, f_l, h) + g.mem(t * f_l * a + 2.0 * f_l * W);
        }
        (Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen2Moe, true) => {
            let x = m.moe.as_ref().expect("moe layer has [model.moe]");
            // Each routed expert's width on this rank (model.moe.ffn_hidden over tp).
            let (f_l, s_l) = expert_widths(g, m, x);
            if x.shared_ffn_hidden > 0 {
                // The shared expert: a dense SwiGLU MLP on every token; its gate a [1, h]
                // linear and the sigmoid scaling.
                f += 2.0 * g.lin(t, s_l, h) + g.mem(3.0 * t * s_l * a) + g.lin(t, h, s_l);
                b += g.lin_gi(t, h, s_l);
                w += g.lin_gw(t, h, s_l);
                b += g.mem(5.0 * t * s_l * a) + 2.0 * g.zero(t * s_l * a);
                b += 2.0 * g.lin_gi(t, s_l, h) + g.grad_sum(t, h);
                w += 2.0 * g.lin_gw(t, s_l, h);
                if x.shared_expert_gate {
                    f += g.lin(t, 1.0, h) + g.mem(3.0 * t * h * a);
                    b += g.lin_gi(t, 1.0, h) + g.mem(4.0 * t * h * a);
                    w += g.lin_gw(t, 1.0, h);
                }
                f += g.mem(3.0 * t * h * a);
            }
            let (e, k) = (x.experts as f64, x.top_k as f64);
            let ep = layout.ep.max(1) as f64;
            let local = e / ep;
            let m_e = t * k * ep / e; // tokens per local expert (balanced routing)
                                      // Router, aux loss, dispatch / combine.
            f += g.lin(t, e, h) + g.mem(2.0 * t * e * 4.0 + t * k * 8.0) + g.mem(t * e * 4.0);
            b += g.lin_gi(t, e, h) + g.mem(3.0 * t * e * 4.0) + g.zero(t * e * 4.0);
            w += g.lin_gw(t, e, h);
            if layout.ep > 1 {
                // Under expert parallelism the local experts run as one grouped kernel per
                // op over their stacked token rows (the build pass stacks their weights
                // along `experts`; the buffers are [local experts, rows, width]): one
                // launch, `local · m_e` routed rows, `local` weight matrices. Their
                // input-gradient buffers are zeroed with the reserved rows below.
                let rows_l = local * m_e;
                f += g.mem(2.0 * rows_l * h * a);
                f += 2.0 * g.grouped(rows_l, f_l, h, local)
                    + g.mem(3.0 * rows_l * f_l * a)
                    + g.grouped(rows_l, h, f_l, local);
                b += g.mem(2.0 * rows_l * h * a);
                b += g.grouped_gi(rows_l, h, f_l, local) + g.mem(5.0 * rows_l * f_l * a);
                b += 2.0 * g.grouped_gi(rows_l, f_l, h, local) + g.grad_sum(rows_l, h);
                w +=
                    g.grouped_gw(rows_l, h, f_l, local) + 2.0 * g.grouped_gw(rows_l, f_l, h, local);
            } else {
                // Without it, one dispatch and one SwiGLU MLP per expert.
                for _ in 0..local as u64 {
                    f += g.mem(2.0 * m_e * h * a);
                    f += 2.0 * g.lin(m_e, f_l, h) + g.mem(3.0 * m_e * f_l * a) + g.lin(m_e, h, f_l);
                    b += g.mem(2.0 * m_e * h * a);
                    b += g.lin_gi(m_e, h, f_l) + g.mem(5.0 * m_e * f_l * a);
                    b += 2.0 * g.lin_gi(m_e, f_l, h) + g.grad_sum(m_e, h);
                    w += g.lin_gw(m_e, h, f_l) + 2.0 * g.lin_gw(m_e, f_l, h);
                }
            }
            f += g.mem((t * k * h + t * h) * a);
            b += g.mem((2.0 * t * k * h + t * h) * a);
            // The gradient buffers are zeroed whole, at the rows the plan reserves: the
            // combine's expert gradient, w2's input gradient, SwiGLU's two, w3's and w1's
            // input gradients and their sum; and the dispatch's token gradient.
            let rows = reserved_expert_rows(g, x);
            b += g.zero(rows * (3.0 * f_l + 4.0 * h) * a + t * h * a);
            if layout.ep > 1 {
                let bytes = t * k * h * a;
                let a2a =
                    g.cost.collective(Coll::AllToAll, bytes, g.ep_group) * (1.0 - g.tp_overlap);
                comm_f += 2.0 * a2a;
                comm_b += 2.0 * a2a;
            }
        }
    }
    comm_f += g.exit_f();
    f += g.mem(3.0 * g.tn * h * a);
    comm_b += g.exit_b();
    b += g.grad_sum(g.tn, h);
    comm_b += g.enter_b();
    b += g.norm_b(norm_params);
    ph.add_block(f, b, w, comm_f, comm_b);
    f + comm_f
}

/// A routed expert's and the shared expert's intermediate width on a rank (over tp).
fn expert_widths(g: &Geo, m: &ModelSection, x: &megac_ir::spec::MoeSpec) -> (f64, f64) {
    let per = g.f_l / m.ffn_hidden as f64;
    (per * x.ffn_hidden as f64, per * x.shared_ffn_hidden as f64)
}

/// Rows of expert token buffers a MoE layer's plan reserves on a rank for one micro-batch,
/// over all its local experts: each of the ep sources may send each expert all of its `t`
/// tokens (dropless) or the capacity, so `experts · rows per source` on either side of the
/// all-to-all.
fn reserved_expert_rows(g: &Geo, x: &megac_ir::spec::MoeSpec) -> f64 {
    let per_source = if x.capacity_factor > 0.0 {
        // As the build pass sizes it: per micro-batch, over the whole sequence (cp = 1).
        let c = (x.capacity_factor * g.t * x.top_k as f64 / x.experts as f64).ceil();
        c.min(g.t)
    } else {
        g.t
    };
    x.experts as f64 * per_source
}

/// Costs of one transformer layer (dense, or MoE with `moe`) for one micro-batch, and the
/// bytes it keeps for backward under each recomputation.
pub(super) fn layer_cost(
    g: &Geo,
    spec: &ModelSpec,
    layout: &ParallelLayout,
    moe: bool,
) -> LayerCost {
    let m = &spec.model;
    let mut ph = Phases::default();
    let (attn_fwd, attention) = attention_block(g, m, &mut ph);
    let mlp_fwd = mlp_block(g, spec, layout, moe, &mut ph);
    let (t, tn, h, a) = (g.t, g.tn, g.h, g.a);
    let lse = 4.0 * t * g.heads_l;
    let attn_out = t * g.q_l * a;
    let mlp_saved = match (m.arch, moe) {
        (Arch::Gpt, _) => 2.0 * t * g.f_l * a,
        (_, false) => 3.0 * t * g.f_l * a,
        (_, true) => {
            let x = m.moe.as_ref().expect("moe layer has [model.moe]");
            // The plan's static expert buffers hold every row a router could send (the
            // upper bound, or the capacity), not the balanced share the time assumes.
            let rows = reserved_expert_rows(g, x);
            let (e_l, s_l) = expert_widths(g, m, x);
            // The shared expert keeps what a dense MLP does; its gate the logits and the
            // shared expert's output.
            let gate = if x.shared_expert_gate {
                t * a + t * h * a
            } else {
                0.0
            };
            t * x.experts as f64 * 4.0
                + rows * (h + 3.0 * e_l) * a
                + rows * h * a
                + 3.0 * t * s_l * a
                + gate
        }
    };
    let qkv_saved = match m.arch {
        Arch::Gpt => 3.0 * g.q_l * t * a,
        // Qwen3 also keeps the normalised q and k (the rope's inputs).
        _ if m.qk_norm => (2.0 * g.q_l + 3.0 * g.kv_l) * t * a,
        _ => (g.q_l + 2.0 * g.kv_l) * t * a,
    };
    // Norm inputs and outputs (the linears' saved input), both sharded by sequence
    // parallelism (the gathered copy is made again in backward: the `regather` pass), q/k/v,
    // attention output and log-sum-exp, the MLP's saved tensors.
    let norm_out = tn;
    let saved = 2.0 * tn * h * a + 2.0 * norm_out * h * a + qkv_saved + attn_out + lse + mlp_saved;
    let saved_selective = saved - attn_out - lse;
    let input = tn * h * a;
    // Zero-bubble: the MLP's linear inputs `W` reads, and the output gradients of its linears.
    let (mlp_kw, mlp_bw) = match (m.arch, moe) {
        (Arch::Gpt, _) => (t * g.f_l * a, (t * g.f_l + t * h) * a),
        (_, false) => (t * g.f_l * a, (2.0 * t * g.f_l + t * h) * a),
        (_, true) => {
            let x = m.moe.as_ref().expect("moe layer has [model.moe]");
            let rows = reserved_expert_rows(g, x);
            let (e_l, s_l) = expert_widths(g, m, x);
            let shared = if s_l > 0.0 {
                (t * s_l * a, (2.0 * t * s_l + t * h) * a)
            } else {
                (0.0, 0.0)
            };
            (
                rows * (h + e_l) * a + shared.0,
                rows * (2.0 * e_l + h) * a + shared.1,
            )
        }
    };
    // Both norms' (sequence-sharded) outputs and the attention output are linear inputs;
    // q/k/v's, the output projection's and the MLP's output gradients are born in B.
    let kw = 2.0 * norm_out * h * a + attn_out + mlp_kw;
    // GPT's row-parallel biases read their output's gradient in W, sequence-sharded.
    let bias_grads = if m.arch == Arch::Gpt && tn < t {
        2.0 * tn * h * a
    } else {
        0.0
    };
    // The q/k/v projections' output gradients.
    let qkv_out = match m.arch {
        Arch::Gpt => 3.0 * g.q_l * t * a,
        _ => (g.q_l + 2.0 * g.kv_l) * t * a,
    };
    let bw = qkv_out + t * h * a + mlp_bw + bias_grads;
    // Selective recomputation makes the attention output in B; full recomputation makes
    // every linear input in B, the norms' outputs gathered (t rows, not tn).
    let gathered = 2.0 * (t - norm_out) * h * a;
    let kept = |kw_bw: f64| ZeroBubbleKept { kw_bw, mlp_bw };
    let zb = [kept(kw + bw), kept(kw + bw), kept(kw + bw + gathered)];
    LayerCost {
        phases: ph,
        forward: attn_fwd + mlp_fwd,
        attention,
        saved,
        saved_selective,
        input,
        zb,
    }
}
