//! Kernel and collective costs against hand calculations.

use megac_ir::mesh::Mesh;
use megac_ir::types::{Axis, DType};
use megac_sim::cluster::Cluster;
use megac_sim::cost::{Coll, CostModel, Group};

/// Round numbers: NVLink 100 GB/s and 10 µs, network 10 GB/s and 20 µs per GPU, no
/// derating, no kernel overhead, 8 GPUs per node; 100 TFLOP/s bf16, 1 TB/s.
fn toy() -> CostModel {
    let text = r#"
gpus_per_node = 8
[device]
memory_gib = 80
hbm_tb_per_s = 1.0
[device.peak_tflops]
bf16 = 100
[intra_node]
gb_per_s = 100
latency_us = 10
[inter_node]
gb_per_s = 10
latency_us = 20
[cost]
link_efficiency = 1.0
kernel_overhead_us = 0
memory_efficiency = 1.0
gemm_efficiency = 0.5
gemm_half_k = 0
gemm_fill_elements = 0
"#;
    CostModel::new(Cluster::parse("toy.toml", text).unwrap().fit(1024).unwrap())
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * b.abs().max(1e-30)
}

#[test]
fn ring_all_reduce_inside_a_node() {
    let c = toy();
    let g = Group {
        size: 8,
        per_node: 8,
    };
    let s = 1e9;
    // Ring: 2(n−1)α + 2(n−1)/n · S/β = 14 · 10 µs + 1.75 · 10 ms.
    let ring = 14.0 * 10e-6 + 2.0 * 7.0 / 8.0 * s / 100e9;
    assert!(close(c.ring_all_reduce(s, g), ring));
    // Tree: 2⌈log₂ 8⌉α + 2S/β = 60 µs + 20 ms, slower here: the ring is chosen.
    let tree = 6.0 * 10e-6 + 2.0 * s / 100e9;
    assert!(close(c.tree_all_reduce(s, g), tree));
    assert!(close(c.collective(Coll::AllReduce, s, g), ring));
}

#[test]
fn small_all_reduce_across_nodes_takes_the_tree() {
    let c = toy();
    let g = Group {
        size: 64,
        per_node: 1,
    };
    let s = 1e3;
    let ring = 2.0 * 63.0 * 20e-6 + 2.0 * 63.0 / 64.0 * s / 10e9;
    let tree = 2.0 * 6.0 * 20e-6 + 2.0 * s / 10e9;
    assert!(tree < ring);
    assert!(close(c.collective(Coll::AllReduce, s, g), tree));
}

#[test]
fn gathers_and_scatters_use_the_network_times_members_per_node() {
    let c = toy();
    // 16 ranks, 2 per node: the network carries 2 × 10 GB/s (below NVLink's 100).
    let g = Group {
        size: 16,
        per_node: 2,
    };
    let s = 4e9;
    let t = 15.0 * 20e-6 + 15.0 / 16.0 * s / 20e9;
    assert!(close(c.collective(Coll::AllGather, s, g), t));
    assert!(close(c.collective(Coll::ReduceScatter, s, g), t));
    assert!(close(c.collective(Coll::AllToAll, s, g), t));
    // 16 per node on 8-GPU nodes cannot happen, but the cap holds: min(NVLink, k·network).
    let wide = Group {
        size: 32,
        per_node: 16,
    };
    let t = 31.0 * 20e-6 + 31.0 / 32.0 * s / 100e9;
    assert!(close(c.collective(Coll::AllGather, s, wide), t));
    // Point to point across nodes.
    let p = Group {
        size: 2,
        per_node: 1,
    };
    assert!(close(
        c.collective(Coll::SendRecv, 1e6, p),
        20e-6 + 1e6 / 10e9
    ));
    // A group of one costs nothing.
    assert_eq!(
        c.collective(
            Coll::AllReduce,
            1e9,
            Group {
                size: 1,
                per_node: 1
            }
        ),
        0.0
    );
}

#[test]
fn groups_follow_the_rank_order() {
    // tp=2, dp=8 on 8-GPU nodes: tp inside a node; dp ranks 2 apart, 4 per node.
    let mesh = Mesh {
        axes: vec![
            (Axis::Tp, 2),
            (Axis::Cp, 1),
            (Axis::Ep, 1),
            (Axis::Dp, 8),
            (Axis::Pp, 1),
        ],
    };
    assert_eq!(
        Group::of_mesh(&mesh, &[Axis::Tp], 8),
        Group {
            size: 2,
            per_node: 2
        }
    );
    assert_eq!(
        Group::of_mesh(&mesh, &[Axis::Dp], 8),
        Group {
            size: 8,
            per_node: 4
        }
    );
    assert_eq!(
        Group::of_mesh(&mesh, &[Axis::Dp], 8),
        Group::strided(8, 2, 8)
    );
    assert_eq!(
        Group::of_mesh(&mesh, &[Axis::Tp, Axis::Dp], 8),
        Group {
            size: 16,
            per_node: 8
        }
    );
}

#[test]
fn matmuls_are_a_roofline() {
    let c = toy();
    // Compute-bound: 2·4096³ FLOPs at 50% of 100 TFLOP/s.
    let n = 4096.0;
    let flops = 2.0 * n * n * n;
    assert!(close(
        c.matmul(n, n, n, 3.0 * n * n * 2.0, DType::Bf16),
        flops / 50e12
    ));
    // Memory-bound: a matrix-vector product reads the whole matrix at 1 TB/s.
    let bytes = n * n * 2.0 + 2.0 * n * 2.0;
    assert!(close(c.matmul(1.0, n, n, bytes, DType::Bf16), bytes / 1e12));
    assert!(close(c.memory(5e9), 5e-3));
}

#[test]
fn efficiency_grows_with_depth_and_output_size() {
    let c = CostModel::new(Cluster::preset("h100-sxm").unwrap().fit(8).unwrap());
    let rate = |m: f64, n: f64, k: f64| 2.0 * m * n * k / c.matmul(m, n, k, 0.0, DType::Bf16);
    assert!(rate(4096.0, 4096.0, 512.0) < rate(4096.0, 4096.0, 8192.0));
    assert!(rate(128.0, 256.0, 8192.0) < rate(4096.0, 4096.0, 8192.0));
    let big = rate(16384.0, 16384.0, 16384.0) / 989.4e12;
    assert!(big > 0.5 && big < 0.66, "{big}");
}
