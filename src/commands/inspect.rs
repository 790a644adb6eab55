//! `megac inspect`: memory by class and FLOPs of a compiled plan, or (`--program`) the whole
//! plan in its text form (`megac_ir::plan_text`).

use std::path::Path;

use megac_ir::gate::CheckedPlan;
use megac_ir::plan::{Instr, Plan};

/// Read and check `dir/plan.json` (the plan gate, `megac_ir::gate`): every command that
/// reads a plan gets a checked one, or one error naming the file, the JSON path and values.
pub fn read_plan(dir: &Path) -> Result<CheckedPlan, String> {
    let path = dir.join("plan.json");
    Plan::load(&path).map_err(|e| format!("error: {}: {e}", path.display()))
}

/// Bytes each collective kind moves per step and rank (the size of the buffer it reduces or
/// gathers, per call; micro-batch programs count once per micro-batch).
pub fn collective_bytes(plan: &Plan) -> std::collections::BTreeMap<&'static str, u64> {
    plan.roles
        .first()
        .map(|r| role_collective_bytes(plan, r))
        .unwrap_or_default()
}

/// Per-step communication bytes of one rank of `role` by kind; pipeline transfers count as
/// `pipeline_send` (the bytes the rank sends).
pub fn role_collective_bytes(
    plan: &Plan,
    role: &megac_ir::plan::Role,
) -> std::collections::BTreeMap<&'static str, u64> {
    use megac_ir::OpKind;
    let mut out = std::collections::BTreeMap::new();
    {
        let m = plan.batch.microbatches;
        let mut programs: Vec<(&[Instr], u64)> = vec![(&role.microbatch, m), (&role.optimizer, 1)];
        if let Some(p) = &role.pipeline {
            for c in &p.chunks {
                programs.extend([
                    (&c.forward[..], m),
                    (&c.backward[..], m),
                    (&c.weight[..], m),
                ]);
            }
        }
        for (program, times) in programs {
            for instr in program {
                if let Instr::Send { buffer, .. } = instr {
                    let buf = &plan.buffers[*buffer as usize];
                    *out.entry("pipeline_send").or_insert(0) +=
                        buf.len() * buf.dtype.size_bytes() * times;
                    continue;
                }
                if let Instr::Kernel {
                    op,
                    inputs,
                    outputs,
                    ..
                } = instr
                {
                    let size = |b: u32| {
                        let buf = &plan.buffers[b as usize];
                        buf.len() * buf.dtype.size_bytes()
                    };
                    let layout_has = |b: u32, dim: usize, axis: megac_ir::Axis| {
                        plan.buffers[b as usize]
                            .layout
                            .get(dim)
                            .is_some_and(|a| a.contains(&axis))
                    };
                    let (key, bytes) = match op {
                        OpKind::AllReduce { .. } => (op.name(), size(inputs[0])),
                        OpKind::ReduceScatter { .. } => (op.name(), size(inputs[0])),
                        OpKind::AllGather { .. } => (op.name(), size(outputs[0])),
                        // Vocab-parallel cross-entropy reduces a max (f32) and two sums (f64)
                        // per token over tp.
                        OpKind::CrossEntropy | OpKind::CrossEntropyGrad => {
                            let logits = &plan.buffers[inputs[0] as usize];
                            let last = logits.shape.len().saturating_sub(1);
                            if !layout_has(inputs[0], last, megac_ir::Axis::Tp) {
                                continue;
                            }
                            let rows = logits.len() / logits.shape[last].max(1);
                            ("vocab_parallel_loss", rows * (4 + 16))
                        }
                        // Context-parallel attention moves every other cp rank's K and V to
                        // each rank (ring or all-gather), and in backward also dK and dV back.
                        OpKind::CausalAttention { .. } | OpKind::AttentionGrad { .. } => {
                            if !layout_has(inputs[0], 1, megac_ir::Axis::Cp) {
                                continue;
                            }
                            let cp = plan.mesh.size(megac_ir::Axis::Cp);
                            let kv = size(inputs[1]) + size(inputs[2]);
                            let factor = if matches!(op, OpKind::AttentionGrad { .. }) {
                                2
                            } else {
                                1
                            };
                            ("context_parallel_kv", kv * (cp - 1) * factor)
                        }
                        // Expert parallelism: the token rows bound for the other ep members
                        // (at most: every expert buffer full; the actual rows depend on the
                        // routing), plus the exchange of per-expert token counts.
                        OpKind::AllToAll { axes, .. } => {
                            let n = axes
                                .iter()
                                .map(|&a| plan.mesh.size(a))
                                .product::<u64>()
                                .max(1);
                            let rows = size(inputs[0]) * (n - 1) / n;
                            ("all_to_all", rows + size(inputs[1]) * (n - 1))
                        }
                        _ => continue,
                    };
                    *out.entry(key).or_insert(0) += bytes * times;
                }
            }
        }
    }
    out
}

fn mib(bytes: u64) -> String {
    format!("{:>10.2} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// Print the plan's memory and FLOPs, as text or JSON, or with `program` the whole plan's
/// text form.
pub fn run(dir: &Path, json: bool, program: bool, cluster: Option<&str>) -> Result<(), String> {
    let plan = read_plan(dir)?;
    if program {
        let text = megac_ir::print_plan(&plan);
        // A closed pipe (`megac inspect P --program | head`) is not an error worth a message.
        let _ = std::io::Write::write_all(&mut std::io::stdout().lock(), text.as_bytes());
        return Ok(());
    }
    let world = plan.mesh.world_size() as u64;
    let cluster = super::simulate::cluster_for_plan(cluster, &plan, dir)?
        .fit(world)
        .map_err(|e| e.render())?;
    for r in &plan.roles {
        let bytes = r.memory.as_ref().unwrap_or(&plan.memory).total() as f64;
        if let Some(w) = super::simulate::memory_warning(&r.name, bytes, &cluster) {
            eprintln!("{w}");
        }
    }
    let m = &plan.memory;
    if json {
        let roles: Vec<serde_json::Value> = plan
            .roles
            .iter()
            .enumerate()
            .map(|(ri, r)| {
                let m = r.memory.as_ref().unwrap_or(&plan.memory);
                let pipeline = r.pipeline.as_ref().map(|p| {
                    serde_json::json!({
                        "schedule": p.schedule,
                        "dynamic": p.dpp.is_some(),
                        "actions": p.actions.len(),
                        "chunks": p.chunks.iter().map(|c| serde_json::json!({
                            "chunk": c.chunk,
                            "layers": c.layers,
                            "slots": c.slots,
                            "slot_bytes": c.activation_elems * 4,
                        })).collect::<Vec<_>>(),
                    })
                });
                let mut memory = serde_json::json!({
                        "parameters": m.param_bytes,
                        "gradients": m.grad_bytes,
                        "optimizer_state": m.opt_state_bytes,
                        "activations_peak": m.activation_bytes,
                        "activations_unplanned": m.activation_bytes_unplanned,
                        "activations_live": m.activation_bytes_live,
                        "inputs": m.input_bytes,
                        "total": m.total(),
                });
                if m.kv_cache_bytes > 0 {
                    memory["kv_cache"] = serde_json::json!(m.kv_cache_bytes);
                }
                if m.staging_bytes > 0 {
                    memory["staging"] = serde_json::json!(m.staging_bytes);
                    memory["total_cpu"] = serde_json::json!(m.cpu_total());
                }
                serde_json::json!({
                    "role": r.name,
                    "memory_bytes": memory,
                    "param_count": role_param_count(&plan, ri),
                    "collective_bytes_per_step": role_collective_bytes(&plan, r),
                    "instructions": { "microbatch": r.microbatch.len(), "optimizer": r.optimizer.len() },
                    "pipeline": pipeline,
                })
            })
            .collect();
        let v = serde_json::json!({
            "model": plan.model,
            "kind": plan.kind.name(),
            "schema_version": plan.schema_version,
            "ranks": plan.rank_to_role.len(),
            "flops_per_step": plan.flops_per_step,
            "roles": roles,
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    let b = &plan.batch;
    println!(
        "plan         {} (schema {}), {} rank(s)",
        plan.model,
        plan.schema_version,
        plan.rank_to_role.len()
    );
    println!(
        "batch        {} × {} tokens per step, micro-batch {} × {} micro-batches",
        b.global_batch, b.seq_len, b.micro_batch, b.microbatches
    );
    if !plan.kind.is_train() {
        println!(
            "kind         {}: the forward only, no gradients or optimizer state",
            plan.kind.name()
        );
    }
    if let Some(d) = &plan.decode {
        let caches = plan
            .buffers
            .iter()
            .filter(|b| b.class == megac_ir::plan::BufferClass::KvCache)
            .count();
        println!(
            "decode       KV cache: the prefill over {} positions, then steps of {} token(s); {} cache buffers (keys and values per attention layer)",
            b.seq_len, d.batch.seq_len, caches
        );
    }
    for r in &plan.roles {
        let kernels = |p: &[Instr]| {
            p.iter()
                .filter(|i| matches!(i, Instr::Kernel { .. }))
                .count()
        };
        match &r.pipeline {
            None => println!(
                "role {:<7} {} kernels per micro-batch, {} per step in the optimizer",
                r.name,
                kernels(&r.microbatch),
                kernels(&r.optimizer)
            ),
            Some(p) => {
                let chunks: Vec<String> = p
                    .chunks
                    .iter()
                    .map(|c| {
                        format!(
                            "chunk {}{} ({} F, {} B{} kernels, {} slot{} of {})",
                            c.chunk,
                            c.layers.map_or(String::new(), |[a, b]| if b == a + 1 {
                                format!(" layer {a}")
                            } else {
                                format!(" layers {a}-{}", b - 1)
                            }),
                            kernels(&c.forward),
                            kernels(&c.backward),
                            if c.weight.is_empty() {
                                String::new()
                            } else {
                                format!(", {} W", kernels(&c.weight))
                            },
                            c.slots,
                            if c.slots == 1 { "" } else { "s" },
                            mib(c.activation_elems * 4).trim_start()
                        )
                    })
                    .collect();
                println!(
                    "role {:<7} {} schedule{}: {}; {} kernels per step in the optimizer",
                    r.name,
                    p.schedule,
                    p.dpp.as_ref().map_or(String::new(), |d| format!(
                        " ({}, run dynamically)",
                        d.policy
                    )),
                    chunks.join(", "),
                    kernels(&r.optimizer)
                );
                let mem = r.memory.as_ref().unwrap_or(&plan.memory);
                println!(
                    "             memory {} (parameters {}, activations {}{}); sends {} per step",
                    mib(mem.total()).trim_start(),
                    mib(mem.param_bytes).trim_start(),
                    mib(mem.activation_bytes).trim_start(),
                    if mem.kv_cache_bytes > 0 {
                        format!(", KV cache {}", mib(mem.kv_cache_bytes).trim_start())
                    } else {
                        String::new()
                    },
                    mib(role_collective_bytes(&plan, r)
                        .get("pipeline_send")
                        .copied()
                        .unwrap_or(0))
                    .trim_start()
                );
            }
        }
    }
    println!("cluster      {}", cluster.describe());
    if plan.roles.iter().any(|r| r.memory.is_some()) {
        println!("memory per rank (the largest of each arena over the roles)");
    } else {
        println!("memory per rank");
    }
    println!("  parameters        {}", mib(m.param_bytes));
    println!("  gradients         {}", mib(m.grad_bytes));
    println!("  optimizer state   {}", mib(m.opt_state_bytes));
    println!(
        "  activations peak  {}   (live at once {}, without reuse {})",
        mib(m.activation_bytes),
        mib(m.activation_bytes_live).trim_start(),
        mib(m.activation_bytes_unplanned).trim_start()
    );
    println!("  inputs            {}", mib(m.input_bytes));
    if m.kv_cache_bytes > 0 {
        println!(
            "  kv cache          {}   (keys and values of every position, this rank's layers and kv heads)",
            mib(m.kv_cache_bytes)
        );
    }
    println!("  total             {}", mib(m.total()));
    if m.staging_bytes > 0 {
        println!(
            "  + staging         {}   (cpu backend only: f32 copies of one instruction's 16-bit operands; {} in all on cpu)",
            mib(m.staging_bytes),
            mib(m.cpu_total()).trim_start()
        );
    }
    let coll = collective_bytes(&plan);
    if coll.is_empty() {
        println!("collectives   none");
    } else {
        for (name, bytes) in &coll {
            println!(
                "collective   {name:<16} {} per step and rank",
                mib(*bytes).trim_start()
            );
        }
    }
    println!(
        "FLOPs        {:.3e} per step (Megatron model FLOPs), {:.3e} per token",
        plan.flops_per_step,
        plan.flops_per_step / b.tokens_per_step as f64
    );
    Ok(())
}

/// The parameter elements a rank of role `role` holds (its shards, its pipeline stage's).
fn role_param_count(plan: &megac_ir::plan::Plan, role: usize) -> u64 {
    let Some(rank) = plan.rank_to_role.iter().position(|&x| x as usize == role) else {
        return 0;
    };
    let stage = plan.mesh.coord(rank, megac_ir::Axis::Pp) as u32;
    plan.params
        .iter()
        .map(|p| &plan.buffers[p.buffer as usize])
        .filter(|b| b.stage.is_none_or(|s| s == stage))
        .map(|b| b.len())
        .sum()
}
