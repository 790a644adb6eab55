//! The op cost model: time of one kernel or collective on a [`Cluster`].
//!
//! - **Matmuls** `[m,k]·[k,n]` follow a roofline with a shape-dependent efficiency:
//!   `t = max(F / (peak · e), bytes / (hbm · e_mem)) + overhead`, where `F = 2mnk` and
//!   `e = gemm_efficiency · k/(k + gemm_half_k) · (1 − exp(−m·n / gemm_fill_elements))`:
//!   a short reduction depth pays each output tile's fixed prologue and epilogue, and a
//!   small output cannot fill the GPU's multiprocessors.
//! - **Attention** (flash-style, causal: the FLOPs are the executed ones, half the square)
//!   uses its own forward and backward efficiencies and the same fill term over its output.
//! - **Everything else** is memory-bound: `bytes / (hbm · memory_efficiency) + overhead`.
//! - **Collectives** use alpha-beta models of NCCL's ring and tree algorithms over the link
//!   the group spans: NVLink when all members share a node; otherwise the network, whose
//!   per-GPU bandwidth is multiplied by the members per node (one NIC per GPU, one ring per
//!   NIC), capped by NVLink. Bandwidths are derated by `link_efficiency`.
//!
//! The constants are [`CostParams`]; docs/cluster-toml.md says how they were fitted.

use megac_ir::mesh::Mesh;
use megac_ir::types::{Axis, DType};

use crate::cluster::Cluster;

/// Fitted constants of the cost model (`[cost]` in cluster.toml overrides them).
#[derive(Clone, Debug, PartialEq)]
pub struct CostParams {
    /// Fraction of peak FLOP/s large GEMMs reach.
    pub gemm_efficiency: f64,
    /// Reduction depth `k` at which a GEMM's efficiency is half of `gemm_efficiency`.
    pub gemm_half_k: f64,
    /// Output elements `m·n` over which a GEMM's fill term `1 − exp(−m·n / this)` saturates.
    pub gemm_fill_elements: f64,
    /// Fraction of peak the attention forward kernel reaches (large sizes).
    pub attention_fwd_efficiency: f64,
    /// Fraction of peak the attention backward kernel reaches (large sizes).
    pub attention_bwd_efficiency: f64,
    /// Fraction of HBM bandwidth memory-bound kernels reach.
    pub memory_efficiency: f64,
    /// Fixed time per kernel or collective call (launch, ramp, tail), microseconds.
    pub kernel_overhead_us: f64,
    /// Fraction of nominal link bandwidth collectives reach (NCCL bus bandwidth / nominal).
    pub link_efficiency: f64,
    /// Fraction of tensor/context/expert-parallel collective time hidden behind GEMMs
    /// (Megatron's `--tp-comm-overlap`); 0 for a runtime that does not overlap them.
    pub tp_comm_overlap: f64,
    /// Data-parallel gradient reduction overlaps the last micro-batch's backward and the
    /// distributed optimizer's parameter gather overlaps the next forward
    /// (`--overlap-grad-reduce --overlap-param-gather`).
    pub dp_comm_overlap: bool,
    /// Pipeline send/receive overlaps compute (Megatron's default); only the pipeline fill
    /// and drain wait for it.
    pub pp_comm_overlap: bool,
    /// Device memory not available to the plan (CUDA context, NCCL and library workspaces), GiB.
    pub reserved_memory_gib: f64,
}

impl Default for CostParams {
    /// The values fitted once on public figures (docs/cluster-toml.md, "Fitted constants").
    fn default() -> CostParams {
        CostParams {
            gemm_efficiency: 0.65,
            gemm_half_k: 1024.0,
            gemm_fill_elements: 2097152.0,
            attention_fwd_efficiency: 0.30,
            attention_bwd_efficiency: 0.24,
            memory_efficiency: 0.80,
            kernel_overhead_us: 8.0,
            link_efficiency: 0.90,
            tp_comm_overlap: 0.8,
            dp_comm_overlap: true,
            pp_comm_overlap: true,
            reserved_memory_gib: 2.0,
        }
    }
}

impl CostParams {
    /// A runtime that overlaps nothing (megac's executor today): every collective waits.
    pub fn serial(mut self) -> CostParams {
        self.tp_comm_overlap = 0.0;
        self.dp_comm_overlap = false;
        self.pp_comm_overlap = false;
        self
    }
}

/// How costs are assigned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CostMode {
    /// The roofline and alpha-beta models.
    Model,
    /// Every forward (F), input-gradient backward (B) and weight-gradient backward (W) of one
    /// pipeline chunk and micro-batch takes 1; communication and the optimizer take 0. The
    /// schedule formulas hold exactly in this mode.
    Unit,
}

/// A collective algorithm family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Coll {
    /// Sum over the group, everyone gets the result.
    AllReduce,
    /// Concatenate over the group (bytes: the gathered size).
    AllGather,
    /// Sum, each member keeps its slice (bytes: the full, unscattered size).
    ReduceScatter,
    /// Personalised exchange (bytes: what each member sends in total).
    AllToAll,
    /// One point-to-point transfer between two ranks.
    SendRecv,
}

/// Where a communication group's members sit: how many, and how many share a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Group {
    /// Members.
    pub size: u64,
    /// Members in the same node as any one member (the group is regular).
    pub per_node: u64,
}

impl Group {
    /// A group of `size` ranks `stride` apart (rank order: the first mesh axis varies fastest).
    pub fn strided(size: u64, stride: u64, gpus_per_node: u64) -> Group {
        let per_node = if stride >= gpus_per_node {
            1
        } else {
            (gpus_per_node / stride.max(1)).clamp(1, size.max(1))
        };
        Group {
            size,
            per_node: per_node.min(size.max(1)),
        }
    }

    /// Rank 0's group over `axes` of `mesh`, with `gpus_per_node` consecutive ranks per node.
    pub fn of_mesh(mesh: &Mesh, axes: &[Axis], gpus_per_node: u64) -> Group {
        let ranks = mesh.group(0, axes);
        let gpn = gpus_per_node.max(1) as usize;
        let per_node = ranks.iter().filter(|&&r| r / gpn == 0).count() as u64;
        Group {
            size: ranks.len() as u64,
            per_node: per_node.max(1),
        }
    }

    /// Whether all members share one node.
    pub fn intra_node(&self) -> bool {
        self.per_node >= self.size
    }
}

/// Kernel and collective times on one cluster.
#[derive(Clone, Debug)]
pub struct CostModel {
    /// The machine (sized: `nodes` is set).
    pub cluster: Cluster,
    /// Roofline or unit costs.
    pub mode: CostMode,
    /// Random slowdowns of pipeline actions (None: every action takes its cost).
    pub jitter: Option<Jitter>,
}

/// `megac simulate --jitter S[:SEED]`: each pipeline action of a stage takes its cost times
/// 1 + S·|z|, z standard normal from a SplitMix64 stream seeded by (SEED, the stage's first
/// rank), as `--inject jitter:S:SEED` slows a running rank's compute.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Jitter {
    /// Relative standard deviation S (≥ 0).
    pub std: f64,
    /// Seed of the streams.
    pub seed: u64,
}

impl Jitter {
    /// The stream of the stage whose first rank is `rank` (the runtime's per-rank stream).
    pub fn stream(&self, rank: usize) -> megac_ir::rng::SplitMix64 {
        megac_ir::rng::SplitMix64::for_rank(self.seed, rank)
    }
}

/// Number format name of a dtype for [`crate::cluster::Device::peak`].
pub fn dtype_name(d: DType) -> &'static str {
    match d {
        // fp16 and bf16 share the tensor cores' peak on every preset device.
        DType::Bf16 | DType::F16 => "bf16",
        DType::F32 | DType::I32 => "fp32",
    }
}

impl CostModel {
    /// The roofline model on `cluster`.
    pub fn new(cluster: Cluster) -> CostModel {
        CostModel {
            cluster,
            mode: CostMode::Model,
            jitter: None,
        }
    }

    /// Unit costs (schedule checks) on `cluster`.
    pub fn unit(cluster: Cluster) -> CostModel {
        CostModel {
            cluster,
            mode: CostMode::Unit,
            jitter: None,
        }
    }

    /// The constants.
    pub fn params(&self) -> &CostParams {
        &self.cluster.cost
    }

    /// Peak FLOP/s for compute in `dtype`.
    pub fn peak(&self, dtype: DType) -> f64 {
        self.cluster.device.peak(dtype_name(dtype))
    }

    fn overhead(&self) -> f64 {
        self.params().kernel_overhead_us * 1e-6
    }

    fn fill(&self, elements: f64) -> f64 {
        let f = self.params().gemm_fill_elements;
        if f <= 0.0 {
            1.0
        } else {
            1.0 - (-elements / f).exp()
        }
    }

    fn memory_time(&self, bytes: f64) -> f64 {
        bytes / (self.cluster.device.hbm_bytes_per_s * self.params().memory_efficiency)
    }

    /// `[m, k] · [k, n]` moving `bytes` to and from memory, computing in `dtype`.
    pub fn matmul(&self, m: f64, n: f64, k: f64, bytes: f64, dtype: DType) -> f64 {
        let flops = 2.0 * m * n * k;
        if flops <= 0.0 {
            return self.overhead();
        }
        let p = self.params();
        let depth = k / (k + p.gemm_half_k);
        let eff = p.gemm_efficiency * depth * self.fill(m * n);
        let compute = flops / (self.peak(dtype) * eff);
        compute.max(self.memory_time(bytes)) + self.overhead()
    }

    /// Flash-style attention executing `flops`, writing `out_elements` outputs and moving
    /// `bytes`.
    pub fn attention(
        &self,
        flops: f64,
        out_elements: f64,
        bytes: f64,
        backward: bool,
        dtype: DType,
    ) -> f64 {
        if flops <= 0.0 {
            return self.overhead();
        }
        let p = self.params();
        let e = if backward {
            p.attention_bwd_efficiency
        } else {
            p.attention_fwd_efficiency
        };
        let eff = e * self.fill(out_elements);
        let compute = flops / (self.peak(dtype) * eff);
        compute.max(self.memory_time(bytes)) + self.overhead()
    }

    /// A memory-bound kernel moving `bytes`.
    pub fn memory(&self, bytes: f64) -> f64 {
        self.memory_time(bytes) + self.overhead()
    }

    /// Latency (s) and bandwidth (bytes/s, derated) of the links `group` uses.
    pub fn link(&self, group: Group) -> (f64, f64) {
        let c = &self.cluster;
        let eff = self.params().link_efficiency;
        if group.intra_node() {
            (c.intra_node.latency_s, c.intra_node.bytes_per_s * eff)
        } else {
            let bw =
                (c.inter_node.bytes_per_s * group.per_node as f64).min(c.intra_node.bytes_per_s);
            (c.inter_node.latency_s, bw * eff)
        }
    }

    /// Ring all-reduce: `2(n-1)·α + 2(n-1)/n · S/β`.
    pub fn ring_all_reduce(&self, bytes: f64, group: Group) -> f64 {
        let n = group.size as f64;
        let (a, b) = self.link(group);
        2.0 * (n - 1.0) * a + 2.0 * (n - 1.0) / n * bytes / b
    }

    /// Tree all-reduce (reduce then broadcast along a binary tree, pipelined):
    /// `2⌈log₂ n⌉·α + 2·S/β`.
    pub fn tree_all_reduce(&self, bytes: f64, group: Group) -> f64 {
        let n = group.size as f64;
        let (a, b) = self.link(group);
        2.0 * n.log2().ceil() * a + 2.0 * bytes / b
    }

    /// Context-parallel key/value exchange around an attention kernel that takes `attn`
    /// seconds on this rank, whose local keys and values take `kv_bytes`. Ring (`ring`):
    /// cp−1 transfers of them to the next rank (of keys, values and their gradients in
    /// backward), overlapping the kernel, so only what exceeds it is exposed. All-gather:
    /// gather keys and values (and reduce-scatter their gradients in backward) before the
    /// kernel, all exposed.
    pub fn cp_exchange(
        &self,
        kv_bytes: f64,
        group: Group,
        ring: bool,
        backward: bool,
        attn: f64,
    ) -> f64 {
        if group.size <= 1 {
            return 0.0;
        }
        let n = group.size as f64;
        if ring {
            let per = if backward { 2.0 * kv_bytes } else { kv_bytes };
            let t = (n - 1.0) * self.collective(Coll::SendRecv, per, group);
            (t - attn).max(0.0)
        } else {
            let gather = self.collective(Coll::AllGather, kv_bytes * n, group);
            if backward {
                gather + self.collective(Coll::ReduceScatter, kv_bytes * n, group)
            } else {
                gather
            }
        }
    }

    /// Time of `coll` moving `bytes` over `group` (0 for a group of one), plus the call
    /// overhead. All-reduce takes the faster of ring and tree, as NCCL's tuner does.
    pub fn collective(&self, coll: Coll, bytes: f64, group: Group) -> f64 {
        if group.size <= 1 {
            return 0.0;
        }
        let n = group.size as f64;
        let (a, b) = self.link(group);
        let t = match coll {
            Coll::AllReduce => self
                .ring_all_reduce(bytes, group)
                .min(self.tree_all_reduce(bytes, group)),
            Coll::AllGather | Coll::ReduceScatter | Coll::AllToAll => {
                (n - 1.0) * a + (n - 1.0) / n * bytes / b
            }
            Coll::SendRecv => a + bytes / b,
        };
        t + self.overhead()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_groups() {
        // tp=8 inside a node; dp across nodes.
        assert_eq!(
            Group::strided(8, 1, 8),
            Group {
                size: 8,
                per_node: 8
            }
        );
        assert_eq!(
            Group::strided(16, 8, 8),
            Group {
                size: 16,
                per_node: 1
            }
        );
        // tp=2: dp ranks 2 apart, four of them per node.
        assert_eq!(
            Group::strided(48, 2, 8),
            Group {
                size: 48,
                per_node: 4
            }
        );
        assert_eq!(
            Group::strided(2, 2, 8),
            Group {
                size: 2,
                per_node: 2
            }
        );
    }
}
