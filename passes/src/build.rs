//! The `build` pass: ModelSpec -> Graph IR (forward of one training step, global view).
//!
//! Parameter names and shapes follow Hugging Face transformers: LlamaForCausalLM for
//! `arch = "llama"`, MixtralForCausalLM for llama with `[model.moe]`, MistralForCausalLM,
//! Qwen2ForCausalLM (q/k/v biases) and Qwen3ForCausalLM (`q_norm`/`k_norm`) for `mistral`,
//! `qwen2` and `qwen3`, GPT2LMHeadModel for `arch = "gpt"` (whose Conv1D weights are stored
//! `[in, out]`). The batch dim is the global
//! batch; micro-batching is the scheduler's business.

use megac_ir::spec::{Arch, ModelSpec};
use megac_ir::{DType, Dim, Graph, IrError, Mesh, OpKind, TensorType, ValueId, WeightLayout};

/// Build the forward graph of `spec`.
pub fn build_graph(spec: &ModelSpec) -> Result<Graph, IrError> {
    let mut b = Builder::new(spec);
    b.build()?;
    Ok(b.g)
}

struct Builder<'a> {
    spec: &'a ModelSpec,
    g: Graph,
    act: DType,
}

fn t(dtype: DType, dims: &[(&str, u64)]) -> TensorType {
    TensorType::new(dtype, dims.iter().map(|&(n, s)| Dim::new(n, s)).collect())
}

impl<'a> Builder<'a> {
    fn new(spec: &'a ModelSpec) -> Self {
        let p = &spec.parallel;
        let mut mesh = Mesh {
            axes: p.order.iter().map(|&a| (a, p.size(a))).collect(),
        };
        if p.fbd {
            // MegaFBD's forward roles: a second copy of the grid, outermost.
            mesh.axes.push((megac_ir::Axis::Fbd, 2));
        }
        let act = spec.train.precision.storage();
        Builder {
            spec,
            g: Graph::new(spec.name.clone(), mesh),
            act,
        }
    }

    /// A parameter: its working weight in the storage dtype (f32, or bf16/f16 under mixed
    /// precision, whose f32 master copy codegen adds beside the optimizer state).
    fn param(&mut self, name: &str, dims: &[(&str, u64)]) -> ValueId {
        self.g.add_param(name, t(self.act, dims))
    }

    fn op(&mut self, kind: OpKind, ins: &[ValueId], path: &str) -> Result<ValueId, IrError> {
        self.g.add_op1(kind, ins, path)
    }

    fn build(&mut self) -> Result<(), IrError> {
        let spec: &'a ModelSpec = self.spec;
        let m = &spec.model;
        let (bsz, s) = (self.spec.train.global_batch, m.seq_len);
        let tokens = self
            .g
            .add_input("tokens", t(DType::I32, &[("b", bsz), ("s", s)]));
        let labels = self
            .g
            .add_input("labels", t(DType::I32, &[("b", bsz), ("s", s)]));
        // With tensor parallelism the vocabulary is padded as Megatron pads it (a multiple of
        // 128·tp) so it splits evenly; the padding rows are zero, never looked up, and the
        // cross-entropy ignores their logits, so the loss is unchanged.
        let vocab = if spec.parallel.tp > 1 {
            spec.padded_vocab()
        } else {
            m.vocab
        };
        let h = m.hidden;
        let (embed_name, prefix, final_norm) = match m.arch {
            Arch::Gpt => ("transformer.wte", "transformer.h", "transformer.ln_f"),
            _ => ("model.embed_tokens", "model.layers", "model.norm"),
        };
        let wte = self.param(
            &format!("{embed_name}.weight"),
            &[("vocab", vocab), ("h", h)],
        );
        let mut x = self.op(OpKind::Embedding, &[tokens, wte], embed_name)?;
        if m.arch == Arch::Gpt {
            let wpe = self.param("transformer.wpe.weight", &[("pos", s), ("h", h)]);
            x = self.op(OpKind::PosEmbedding, &[x, wpe], "transformer.wpe")?;
        }
        let mut aux_losses = Vec::new();
        for i in 0..m.layers {
            let p = format!("{prefix}.{i}");
            x = match m.arch {
                Arch::Gpt => self.gpt_layer(&p, x)?,
                _ => self.llama_layer(&p, i, x, &mut aux_losses)?,
            };
        }
        x = self.norm(final_norm, x)?;
        let head = if m.tie_embeddings {
            wte
        } else {
            self.param("lm_head.weight", &[("vocab", vocab), ("h", h)])
        };
        let logits = self.op(
            OpKind::Linear {
                weight: WeightLayout::OutIn,
            },
            &[x, head],
            "lm_head",
        )?;
        let loss = self.op(OpKind::CrossEntropy, &[logits, labels], "loss")?;
        self.g.add_output("loss", loss);
        if !aux_losses.is_empty() {
            let mut total = loss;
            for aux in aux_losses {
                total = self.op(OpKind::Add, &[total, aux], "loss.total")?;
            }
            self.g.add_output("total_loss", total);
        }
        Ok(())
    }

    /// RMSNorm (llama-like) or LayerNorm with bias (gpt) at `path`.
    fn norm(&mut self, path: &str, x: ValueId) -> Result<ValueId, IrError> {
        let spec: &'a ModelSpec = self.spec;
        let m = &spec.model;
        let h = m.hidden;
        match m.arch {
            Arch::Gpt => {
                let w = self.param(&format!("{path}.weight"), &[("h", h)]);
                let b = self.param(&format!("{path}.bias"), &[("h", h)]);
                self.op(OpKind::LayerNorm { eps: m.norm_eps }, &[x, w, b], path)
            }
            _ => {
                let w = self.param(&format!("{path}.weight"), &[("h", h)]);
                self.op(OpKind::RmsNorm { eps: m.norm_eps }, &[x, w], path)
            }
        }
    }

    /// `nn.Linear`: weight `[out, in]` and, with `bias`, bias `[out]` (Qwen2's q, k, v).
    fn linear_with(
        &mut self,
        path: &str,
        x: ValueId,
        out: (&str, u64),
        inp: (&str, u64),
        bias: bool,
    ) -> Result<ValueId, IrError> {
        let mut ins = vec![x, self.param(&format!("{path}.weight"), &[out, inp])];
        if bias {
            ins.push(self.param(&format!("{path}.bias"), &[out]));
        }
        self.op(
            OpKind::Linear {
                weight: WeightLayout::OutIn,
            },
            &ins,
            path,
        )
    }

    /// `nn.Linear` without bias: weight `[out, in]`.
    fn linear(
        &mut self,
        path: &str,
        x: ValueId,
        out: (&str, u64),
        inp: (&str, u64),
    ) -> Result<ValueId, IrError> {
        self.linear_with(path, x, out, inp, false)
    }

    /// GPT-2 `Conv1D`: weight `[in, out]` and bias `[out]`.
    fn conv1d(
        &mut self,
        path: &str,
        x: ValueId,
        inp: (&str, u64),
        out: (&str, u64),
    ) -> Result<ValueId, IrError> {
        let w = self.param(&format!("{path}.weight"), &[inp, out]);
        let b = self.param(&format!("{path}.bias"), &[out]);
        self.op(
            OpKind::Linear {
                weight: WeightLayout::InOut,
            },
            &[x, w, b],
            path,
        )
    }

    /// Split `[.., heads*head_dim]` into heads, (Qwen3) RMSNorm each head's q and k, attend
    /// causally, merge back.
    fn attention_core(
        &mut self,
        path: &str,
        q: ValueId,
        k: ValueId,
        v: ValueId,
        rope: bool,
    ) -> Result<ValueId, IrError> {
        let spec: &'a ModelSpec = self.spec;
        let m = &spec.model;
        let (heads, kv, theta) = (m.heads, m.kv_heads, m.rope_theta);
        let mut q = self.op(OpKind::SplitHeads { n: heads }, &[q], path)?;
        let mut k = self.op(OpKind::SplitHeads { n: kv }, &[k], path)?;
        let mut v = self.op(OpKind::SplitHeads { n: kv }, &[v], path)?;
        if m.qk_norm {
            // Qwen3: RMSNorm over head_dim, one weight shared by every head.
            let hd = ("head_dim", m.head_dim());
            let eps = m.norm_eps;
            let wq = self.param(&format!("{path}.q_norm.weight"), &[hd]);
            q = self.op(OpKind::RmsNorm { eps }, &[q, wq], &format!("{path}.q_norm"))?;
            let wk = self.param(&format!("{path}.k_norm.weight"), &[hd]);
            k = self.op(OpKind::RmsNorm { eps }, &[k, wk], &format!("{path}.k_norm"))?;
        }
        if rope {
            let rp = format!("{path}.rotary_emb");
            let scaling = m.rope_scaling;
            q = self.op(OpKind::Rope { theta, scaling }, &[q], &rp)?;
            k = self.op(OpKind::Rope { theta, scaling }, &[k], &rp)?;
        }
        if spec.parallel.tp > kv {
            // More tensor-parallel ranks than key/value heads: repeat them (transformers'
            // repeat_kv) so attention splits over query heads; k and v stay whole on every rank.
            let n = heads / kv;
            k = self.op(OpKind::RepeatKv { n }, &[k], path)?;
            v = self.op(OpKind::RepeatKv { n }, &[v], path)?;
        }
        let window = m.sliding_window.unwrap_or(0);
        let a = self.op(
            OpKind::CausalAttention { window },
            &[q, k, v],
            &format!("{path}.core"),
        )?;
        self.op(OpKind::MergeHeads, &[a], path)
    }

    fn llama_layer(
        &mut self,
        p: &str,
        i: u64,
        x: ValueId,
        aux_losses: &mut Vec<ValueId>,
    ) -> Result<ValueId, IrError> {
        let spec: &'a ModelSpec = self.spec;
        let m = &spec.model;
        let h = m.hidden;
        let hd = m.head_dim();
        let q_dim = ("heads*head_dim", m.heads * hd);
        let kv_dim = ("kv_heads*head_dim", m.kv_heads * hd);
        let ffn = m.ffn_hidden;

        let xn = self.norm(&format!("{p}.input_layernorm"), x)?;
        let a = format!("{p}.self_attn");
        let bias = m.qkv_bias;
        let q = self.linear_with(&format!("{a}.q_proj"), xn, q_dim, ("h", h), bias)?;
        let k = self.linear_with(&format!("{a}.k_proj"), xn, kv_dim, ("h", h), bias)?;
        let v = self.linear_with(&format!("{a}.v_proj"), xn, kv_dim, ("h", h), bias)?;
        let attn = self.attention_core(&a, q, k, v, true)?;
        let o = self.linear(&format!("{a}.o_proj"), attn, ("h", h), q_dim)?;
        let x = self.op(OpKind::Add, &[x, o], &format!("{p}.residual.attn"))?;

        let xn = self.norm(&format!("{p}.post_attention_layernorm"), x)?;
        let y = match &m.moe {
            Some(moe) if m.is_moe_layer(i) => {
                // Hugging Face's names: Mixtral's `block_sparse_moe.experts.{j}.w1/w3/w2`,
                // Qwen2-MoE's `mlp.experts.{j}.gate_proj/up_proj/down_proj`.
                let qwen = m.arch == Arch::Qwen2Moe;
                let (mp, w1n, w3n, w2n) = if qwen {
                    (format!("{p}.mlp"), "gate_proj", "up_proj", "down_proj")
                } else {
                    (format!("{p}.block_sparse_moe"), "w1", "w3", "w2")
                };
                let ffn = moe.ffn_hidden;
                let logits = self.linear(
                    &format!("{mp}.gate"),
                    xn,
                    ("experts", moe.experts),
                    ("h", h),
                )?;
                let routed = self.g.add_op(
                    OpKind::Router {
                        top_k: moe.top_k,
                        renorm: moe.norm_topk_prob,
                    },
                    &[logits],
                    format!("{mp}.router"),
                )?;
                let (weights, indices) = (routed[0], routed[1]);
                if moe.aux_loss_coeff > 0.0 {
                    aux_losses.push(self.op(
                        OpKind::MoeAuxLoss {
                            coeff: moe.aux_loss_coeff,
                        },
                        &[logits, indices],
                        &format!("{mp}.aux_loss"),
                    )?);
                }
                // Capacity is per micro-batch, as Megatron computes it: the token count a
                // dispatch sees at run time.
                let tokens = spec.train.micro_batch * m.seq_len;
                let capacity = if moe.capacity_factor > 0.0 {
                    let c = moe.capacity_factor * (tokens * moe.top_k) as f64 / moe.experts as f64;
                    (c.ceil() as u64).min(tokens)
                } else {
                    0
                };
                let experts_out = if spec.parallel.ep > 1 {
                    // Expert parallelism: every expert's weights stacked along an `experts`
                    // dim (split over ep by the shard pass; Hugging Face's per-expert tensors
                    // on --init and --save-params), tokens dispatched to all experts at once.
                    let ex = ("experts", moe.experts);
                    let ep = format!("{mp}.experts");
                    let routed = self.g.add_op(
                        OpKind::DispatchExperts {
                            experts: moe.experts,
                            capacity,
                        },
                        &[xn, indices],
                        format!("{mp}.dispatch"),
                    )?;
                    let xe = routed[0];
                    let f = ("ffn", ffn);
                    let w1 = self.param(&format!("{ep}.{w1n}.weight"), &[ex, f, ("h", h)]);
                    let w3 = self.param(&format!("{ep}.{w3n}.weight"), &[ex, f, ("h", h)]);
                    let w2 = self.param(&format!("{ep}.{w2n}.weight"), &[ex, ("h", h), f]);
                    let lin = OpKind::Linear {
                        weight: WeightLayout::OutIn,
                    };
                    let g = self.op(lin.clone(), &[xe, w1], &format!("{ep}.{w1n}"))?;
                    let u = self.op(lin.clone(), &[xe, w3], &format!("{ep}.{w3n}"))?;
                    let act = self.op(OpKind::SwiGlu, &[g, u], &format!("{ep}.act"))?;
                    let y = self.op(lin, &[act, w2], &format!("{ep}.{w2n}"))?;
                    self.op(
                        OpKind::CombineExperts,
                        &[weights, indices, y],
                        &format!("{mp}.combine"),
                    )?
                } else {
                    let mut outs = vec![weights, indices];
                    for e in 0..moe.experts {
                        let ep = format!("{mp}.experts.{e}");
                        let xe = self.op(
                            OpKind::Dispatch {
                                expert: e,
                                capacity,
                            },
                            &[xn, indices],
                            &format!("{mp}.dispatch"),
                        )?;
                        let f = ("ffn", ffn);
                        let g = self.linear(&format!("{ep}.{w1n}"), xe, f, ("h", h))?;
                        let u = self.linear(&format!("{ep}.{w3n}"), xe, f, ("h", h))?;
                        let act = self.op(OpKind::SwiGlu, &[g, u], &format!("{ep}.act"))?;
                        outs.push(self.linear(&format!("{ep}.{w2n}"), act, ("h", h), f)?);
                    }
                    self.op(OpKind::Combine, &outs, &format!("{mp}.combine"))?
                };
                if moe.shared_ffn_hidden == 0 {
                    experts_out
                } else {
                    // Qwen2-MoE's shared expert: a dense SwiGLU MLP every token passes
                    // through, scaled by sigmoid(x · w) with `shared_expert_gate` `[1, h]`.
                    let sp = format!("{mp}.shared_expert");
                    let sf = ("ffn", moe.shared_ffn_hidden);
                    let mut s = self.dense_mlp(&sp, xn, sf)?;
                    if moe.shared_expert_gate {
                        let gp = format!("{mp}.shared_expert_gate");
                        let gl = self.linear(&gp, xn, ("one", 1), ("h", h))?;
                        s = self.op(OpKind::SigmoidMul, &[gl, s], &gp)?;
                    }
                    self.op(OpKind::Add, &[experts_out, s], &format!("{mp}.shared_add"))?
                }
            }
            _ => self.dense_mlp(&format!("{p}.mlp"), xn, ("ffn", ffn))?,
        };
        self.op(OpKind::Add, &[x, y], &format!("{p}.residual.mlp"))
    }

    /// Llama's SwiGLU MLP (`gate_proj`, `up_proj`, `down_proj`) under `mp`.
    fn dense_mlp(&mut self, mp: &str, xn: ValueId, ffn: (&str, u64)) -> Result<ValueId, IrError> {
        let h = self.spec.model.hidden;
        let g = self.linear(&format!("{mp}.gate_proj"), xn, ffn, ("h", h))?;
        let u = self.linear(&format!("{mp}.up_proj"), xn, ffn, ("h", h))?;
        let act = self.op(OpKind::SwiGlu, &[g, u], &format!("{mp}.act_fn"))?;
        self.linear(&format!("{mp}.down_proj"), act, ("h", h), ffn)
    }

    fn gpt_layer(&mut self, p: &str, x: ValueId) -> Result<ValueId, IrError> {
        let spec: &'a ModelSpec = self.spec;
        let m = &spec.model;
        let h = m.hidden;
        let q_dim = ("heads*head_dim", h);
        let ffn = m.ffn_hidden;

        let xn = self.norm(&format!("{p}.ln_1"), x)?;
        let a = format!("{p}.attn");
        let qkv = self.conv1d(
            &format!("{a}.c_attn"),
            xn,
            ("h", h),
            ("3*heads*head_dim", 3 * h),
        )?;
        let parts = self.g.add_op(OpKind::Split { n: 3 }, &[qkv], a.clone())?;
        let attn = self.attention_core(&a, parts[0], parts[1], parts[2], false)?;
        let o = self.conv1d(&format!("{a}.c_proj"), attn, q_dim, ("h", h))?;
        let x = self.op(OpKind::Add, &[x, o], &format!("{p}.residual.attn"))?;

        let xn = self.norm(&format!("{p}.ln_2"), x)?;
        let mp = format!("{p}.mlp");
        let f = self.conv1d(&format!("{mp}.c_fc"), xn, ("h", h), ("ffn", ffn))?;
        let f = self.op(OpKind::GeluTanh, &[f], &format!("{mp}.act"))?;
        let y = self.conv1d(&format!("{mp}.c_proj"), f, ("ffn", ffn), ("h", h))?;
        self.op(OpKind::Add, &[x, y], &format!("{p}.residual.mlp"))
    }
}
