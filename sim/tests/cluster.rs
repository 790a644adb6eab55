//! cluster.toml parsing, presets and their errors.

use megac_sim::cluster::{Cluster, GIB};

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * b.abs()
}

#[test]
fn presets_carry_their_datasheet_numbers() {
    let h100 = Cluster::preset("h100-sxm").unwrap();
    assert_eq!(h100.device.peak("bf16"), 989.4e12);
    assert_eq!(h100.device.peak("fp8"), 1978.9e12);
    assert_eq!(h100.device.memory_bytes, 80.0 * GIB);
    assert!(close(h100.device.hbm_bytes_per_s, 3.35e12));
    assert_eq!(h100.intra_node.bytes_per_s, 450e9);
    assert_eq!(h100.inter_node.bytes_per_s, 50e9);
    assert_eq!(h100.gpus_per_node, 8);
    assert_eq!(h100.nodes, None);
    let a100 = Cluster::preset("a100-80g").unwrap();
    assert_eq!(a100.device.peak("bf16"), 312e12);
    assert!(close(a100.device.hbm_bytes_per_s, 2.039e12));
    // No fp8 on an A100: the fp32 peak stands in.
    assert_eq!(a100.device.peak("fp8"), 19.5e12);
    let h200 = Cluster::preset("h200").unwrap();
    assert_eq!(h200.device.peak("bf16"), 989.4e12);
    assert!(close(h200.device.hbm_bytes_per_s, 4.8e12));
    assert!(h200.device.memory_bytes > 140.0 * GIB);
}

#[test]
fn a_file_overrides_its_preset() {
    let text = "preset = \"h100-sxm\"\nname = \"eos\"\nnodes = 4\n\n[inter_node]\ngb_per_s = 25\n\n[cost]\ntp_comm_overlap = 0.0\n";
    let c = Cluster::parse("eos.toml", text).unwrap();
    assert_eq!(c.name, "eos");
    assert_eq!(c.nodes, Some(4));
    assert_eq!(c.inter_node.bytes_per_s, 25e9);
    // Untouched keys come from the preset.
    assert_eq!(c.inter_node.latency_s, 5e-6);
    assert_eq!(c.intra_node.bytes_per_s, 450e9);
    assert_eq!(c.device.peak("bf16"), 989.4e12);
    assert_eq!(c.cost.tp_comm_overlap, 0.0);
    assert_eq!(c.gpus(), 32);
}

#[test]
fn a_complete_file_needs_no_preset() {
    let text = r#"
name = "lab"
nodes = 2
gpus_per_node = 4

[device]
name = "toy"
memory_gib = 24
hbm_tb_per_s = 1.0

[device.peak_tflops]
bf16 = 100
fp32 = 25

[intra_node]
gb_per_s = 100
latency_us = 1

[inter_node]
gb_per_s = 10
latency_us = 10
"#;
    let c = Cluster::parse("lab.toml", text).unwrap();
    assert_eq!(c.device.peak("bf16"), 100e12);
    assert_eq!(c.device.memory_bytes, 24.0 * GIB);
    assert_eq!(c.inter_node.latency_s, 10e-6);
    assert_eq!(c.gpus(), 8);
}

#[test]
fn malformed_toml_points_at_line_and_column() {
    let text = "preset = \"h100-sxm\"\nnodes = = 4\n";
    let e = Cluster::parse("bad.toml", text).unwrap_err();
    let loc = e.location.as_ref().expect("a position");
    assert_eq!(loc.line, 2, "{}", e.render());
    let r = e.render();
    assert!(r.starts_with("error: bad.toml:2:"), "{r}");
    assert!(r.contains("nodes = = 4"), "{r}");
    assert!(r.contains('^'), "{r}");
}

#[test]
fn unknown_keys_and_values_are_errors_with_positions() {
    let e = Cluster::parse(
        "c.toml",
        "preset = \"h100-sxm\"\n\n[device]\nmemory_gb = 80\n",
    )
    .unwrap_err();
    assert_eq!(e.location.as_ref().unwrap().line, 4, "{}", e.render());
    assert!(e.render().contains("memory_gb"), "{}", e.render());

    let e = Cluster::parse(
        "c.toml",
        "preset = \"h100-sxm\"\n[device.peak_tflops]\nint4 = 3000\n",
    )
    .unwrap_err();
    assert!(
        e.message.contains("unknown number format `int4`"),
        "{}",
        e.render()
    );
    assert_eq!(e.location.as_ref().unwrap().line, 3);

    let e = Cluster::parse(
        "c.toml",
        "preset = \"h100-sxm\"\n[device]\nmemory_gib = -80\n",
    )
    .unwrap_err();
    assert!(
        e.message
            .contains("device.memory_gib = -80 must be a positive number"),
        "{}",
        e.render()
    );
    assert_eq!(e.location.as_ref().unwrap().line, 3);

    let e = Cluster::parse(
        "c.toml",
        "preset = \"h100-sxm\"\n[cost]\nlink_efficiency = 1.5\n",
    )
    .unwrap_err();
    assert!(
        e.message
            .contains("cost.link_efficiency = 1.5 is out of range"),
        "{}",
        e.render()
    );

    let e = Cluster::parse("c.toml", "preset = \"h100-sxm\"\ngpus_per_node = 0\n").unwrap_err();
    assert!(
        e.message
            .contains("gpus_per_node = 0 must be a positive integer"),
        "{}",
        e.render()
    );
}

#[test]
fn unknown_presets_list_the_known_ones() {
    let e = Cluster::load("h999").unwrap_err();
    assert!(
        e.message.contains("unknown cluster preset `h999`"),
        "{}",
        e.render()
    );
    let help = e.help.unwrap();
    assert!(help.contains("a100-80g, h100-sxm, h200"), "{help}");

    let e = Cluster::parse("c.toml", "nodes = 2\npreset = \"b300\"\n").unwrap_err();
    let loc = e.location.as_ref().unwrap();
    assert_eq!((loc.line, loc.col), (2, 10), "{}", e.render());
}

#[test]
fn a_file_without_a_preset_names_what_is_missing() {
    let e = Cluster::parse("c.toml", "gpus_per_node = 8\n[device]\nmemory_gib = 80\n").unwrap_err();
    assert!(
        e.message.contains("missing key `device.hbm_tb_per_s`"),
        "{}",
        e.render()
    );
    assert!(e.help.unwrap().contains("preset"));
}

#[test]
fn a_cluster_too_small_for_the_layout_is_an_error() {
    let c = Cluster::parse("c.toml", "preset = \"h100-sxm\"\nnodes = 2\n").unwrap();
    assert_eq!(c.fit(16).unwrap().nodes, Some(2));
    let e = c.fit(32).unwrap_err();
    assert!(e.message.contains("too small"), "{}", e.render());
    assert!(
        e.message.contains("2·8 = 16 GPUs, the layout needs 32"),
        "{}",
        e.render()
    );
    assert!(e.help.unwrap().contains("at least 4 nodes"));
    // A preset without a node count is sized to the job.
    assert_eq!(
        Cluster::preset("h200").unwrap().fit(20).unwrap().nodes,
        Some(3)
    );
}

#[test]
fn a_missing_file_is_a_clear_error() {
    let e = Cluster::load("/nonexistent/cluster.toml").unwrap_err();
    assert!(e
        .render()
        .starts_with("error: /nonexistent/cluster.toml: cannot read the cluster file"));
}
