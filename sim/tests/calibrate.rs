//! The calibration targets: Megatron-LM's H100 weak-scaling table (megatron-lm.md §10.1)
//! predicted within 10% per row and 5% on average (`bench/calibrate.sh` prints the table).

#[test]
fn megatron_weak_scaling_table_within_targets() {
    let cluster = megac_sim::Cluster::preset("h100-sxm").unwrap();
    let rows = megac_sim::calibrate::calibrate(&cluster);
    let report = megac_sim::calibrate::report(&rows);
    assert_eq!(rows.len(), 9);
    for r in &rows {
        assert!(
            r.error.abs() < 0.10,
            "{} off by {:.1}%\n{report}",
            r.row.name,
            100.0 * r.error
        );
    }
    let mean = rows.iter().map(|r| r.error.abs()).sum::<f64>() / rows.len() as f64;
    assert!(mean < 0.05, "mean {mean}\n{report}");
}
