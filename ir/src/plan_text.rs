//! Deterministic text form of a [`Plan`], for people: snapshot tests and diffs of compiled
//! plans (`megac inspect PLAN_DIR --program`). Print only; `plan.json` stays the contract.
//!
//! Sections, in order: a header (model, mesh, batch, train settings, memory, FLOPs, which
//! role each rank runs), the buffer table, the parameter map, then per role its inputs and
//! results, micro-batch and optimizer programs and, for a pipelined role, each chunk's
//! forward / backward / weight programs and the action list. Buffers are named by their
//! index in the buffer table as `bN` (the table's `name` column holds the IR value, `%42`,
//! or `grad:NAME`, ...). One instruction per line, the op's attributes in braces:
//!
//! ```text
//! plan "llama-tiny" arch=llama schema=1
//! mesh tp=1 cp=1 ep=1 dp=1 pp=1
//! buffers (5)
//!   id  name                        class       type           offset  place  layout
//!   b0  tokens                      input       i32[4, 64]          0
//!   b5  model.embed_tokens.weight   param       f32[256, 64]        0
//! role "main" ranks=0
//!   microbatch (3)
//!     b7 = embedding(b0, b5)           # model.embed_tokens
//!     b12 = linear{w=out_in}(b9, b11)  # model.layers.0.self_attn.q_proj
//!   actions (4)
//!     F0.0 F0.1 B0.0 B0.1
//! ```
//!
//! Same plan, same bytes: everything is printed in table or program order, maps are sorted
//! and floats use Rust's shortest round-trip form.

use std::fmt::Write;

use crate::plan::{Buffer, ChunkProgram, Instr, MemoryPlan, PipeKind, Plan, Role};
use crate::types::Axis;

/// Columns beyond which the `# path` column is not aligned further (as in `print_graph`).
const MAX_ALIGN: usize = 56;

/// Actions per line of an action list.
const ACTIONS_PER_LINE: usize = 16;

/// Print `plan` in its text form (see the module documentation).
pub fn print_plan(plan: &Plan) -> String {
    let mut out = String::new();
    header(&mut out, plan);
    if let Some(d) = &plan.decode {
        writeln!(
            out,
            "decode block={} position={}",
            d.batch.seq_len,
            buf(d.position)
        )
        .expect("write to String");
    }
    buffers(&mut out, &plan.buffers);
    params(&mut out, plan);
    for (index, role) in plan.roles.iter().enumerate() {
        print_role(&mut out, plan, index, role);
    }
    out
}

/// The name of buffer `id` in programs.
fn buf(id: u32) -> String {
    format!("b{id}")
}

fn bufs(ids: &[u32]) -> String {
    ids.iter().map(|&b| buf(b)).collect::<Vec<_>>().join(", ")
}

fn axes(axes: &[Axis]) -> String {
    axes.iter()
        .map(|a| a.as_str())
        .collect::<Vec<_>>()
        .join("+")
}

/// Per-dim sharding: `[., tp]` (`.` for a replicated dim); empty when fully replicated.
fn layout(dims: &[Vec<Axis>]) -> String {
    if dims.iter().all(|d| d.is_empty()) {
        return String::new();
    }
    let dims: Vec<String> = dims
        .iter()
        .map(|d| {
            if d.is_empty() {
                ".".to_string()
            } else {
                axes(d)
            }
        })
        .collect();
    format!("[{}]", dims.join(", "))
}

fn shape(dims: &[u64]) -> String {
    dims.iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn memory(m: &MemoryPlan) -> String {
    let mut staging = if m.staging_bytes > 0 {
        format!(" staging={}", m.staging_bytes)
    } else {
        String::new()
    };
    if m.kv_cache_bytes > 0 {
        write!(staging, " kv_cache={}", m.kv_cache_bytes).expect("write to String");
    }
    format!(
        "params={} grads={} opt_state={} activations={} (unplanned={} live={}) inputs={} total={}{staging}",
        m.param_bytes,
        m.grad_bytes,
        m.opt_state_bytes,
        m.activation_bytes,
        m.activation_bytes_unplanned,
        m.activation_bytes_live,
        m.input_bytes,
        m.total()
    )
}

fn header(out: &mut String, plan: &Plan) {
    let mesh: Vec<String> = plan
        .mesh
        .axes
        .iter()
        .map(|(a, n)| format!("{}={n}", a.as_str()))
        .collect();
    let b = &plan.batch;
    let t = &plan.train;
    let lr_schedule = match &t.lr_schedule {
        crate::plan::LrSchedule::Constant => "constant".to_string(),
        crate::plan::LrSchedule::Cosine {
            warmup_steps,
            decay_steps,
            min_lr,
        } => format!("cosine(warmup={warmup_steps}, decay={decay_steps}, min_lr={min_lr:?})"),
    };
    let ranks: Vec<String> = plan.rank_to_role.iter().map(u32::to_string).collect();
    let lines = [
        format!(
            "plan \"{}\" arch={} schema={}",
            plan.model, plan.arch, plan.schema_version
        ),
        format!(
            "mesh {} cp_comm={}",
            mesh.join(" "),
            serde_json::to_value(plan.cp_comm)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default()
        ),
        format!(
            "batch micro_batch={} global_batch={} seq_len={} vocab={} microbatches={} tokens_per_step={}",
            b.micro_batch, b.global_batch, b.seq_len, b.vocab, b.microbatches, b.tokens_per_step
        ),
        format!(
            "train steps={} seed={} lr={:?} lr_schedule={lr_schedule} precision={}",
            t.steps, t.seed, t.lr, t.precision
        ),
        format!("memory {}", memory(&plan.memory)),
        format!("flops_per_step {:?}", plan.flops_per_step),
        format!("rank_to_role {}", ranks.join(" ")),
    ];
    for line in lines {
        writeln!(out, "{line}").expect("write to String");
    }
}

/// Rows of cells printed as left-aligned columns (the last cell unpadded), two spaces apart.
fn table(out: &mut String, indent: &str, rows: &[Vec<String>], right: &[usize]) {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in rows {
        let mut line = indent.to_string();
        for (c, cell) in row.iter().enumerate() {
            if c > 0 {
                line.push_str("  ");
            }
            let w = widths[c];
            if right.contains(&c) {
                write!(line, "{cell:>w$}").expect("write to String");
            } else {
                write!(line, "{cell:<w$}").expect("write to String");
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
}

fn buffers(out: &mut String, buffers: &[Buffer]) {
    writeln!(out, "buffers ({})", buffers.len()).expect("write to String");
    let mut rows = vec![["id", "name", "class", "type", "offset", "place", "layout"]
        .map(str::to_string)
        .to_vec()];
    for (i, b) in buffers.iter().enumerate() {
        let mut offset = b.offset.to_string();
        if let Some(r) = &b.rank_offset {
            let axes: Vec<&str> = r.axes().iter().map(|a| a.as_str()).collect();
            write!(offset, "+{}*{}", axes.join("+"), r.stride).expect("write to String");
        }
        let mut place = Vec::new();
        if let Some(s) = b.stage {
            place.push(format!("stage={s}"));
        }
        if let Some(c) = b.chunk {
            place.push(format!("chunk={c}"));
        }
        rows.push(vec![
            buf(i as u32),
            b.name.clone(),
            b.class.name().to_string(),
            format!("{}[{}]", b.dtype.as_str(), shape(&b.shape)),
            offset,
            place.join(" "),
            layout(&b.layout),
        ]);
    }
    table(out, "  ", &rows, &[4]);
}

fn params(out: &mut String, plan: &Plan) {
    writeln!(out, "params ({})", plan.params.len()).expect("write to String");
    let mut rows = Vec::new();
    for p in &plan.params {
        let init = match &p.init {
            crate::plan::Init::Normal { std } => format!("normal({std:?})"),
            crate::plan::Init::Ones => "ones".to_string(),
            crate::plan::Init::Zeros => "zeros".to_string(),
        };
        let mut state = match p.grad {
            Some(g) => format!("buffer={} grad={}", buf(p.buffer), buf(g)),
            None => format!("buffer={}", buf(p.buffer)),
        };
        if let (Some(m), Some(v)) = (p.exp_avg, p.exp_avg_sq) {
            write!(state, " exp_avg={} exp_avg_sq={}", buf(m), buf(v)).expect("write to String");
        }
        if !p.tied_copies.is_empty() {
            write!(state, " tied_copies=[{}]", bufs(&p.tied_copies)).expect("write to String");
        }
        let mut extra = Vec::new();
        if !p.shards.is_empty() {
            extra.push(format!("shards={}", layout(&p.shards)));
        }
        if !p.blocks.is_empty() {
            extra.push(format!("blocks=[{}]", shape(&p.blocks)));
        }
        if let Some(rows) = p.hf_rows {
            extra.push(format!("hf_rows={rows}"));
        }
        if let Some(name) = &p.per_expert {
            extra.push(format!("per_expert={name}"));
        }
        rows.push(vec![
            p.name.clone(),
            format!("[{}]", shape(&p.shape)),
            init,
            state,
            extra.join(" "),
        ]);
    }
    table(out, "  ", &rows, &[]);
}

fn print_role(out: &mut String, plan: &Plan, index: usize, role: &Role) {
    let ranks: Vec<String> = plan
        .rank_to_role
        .iter()
        .enumerate()
        .filter(|(_, &r)| r as usize == index)
        .map(|(rank, _)| rank.to_string())
        .collect();
    writeln!(
        out,
        "role {index} \"{}\" ranks={}",
        role.name,
        ranks.join(",")
    )
    .expect("write to String");
    let named = |map: &std::collections::BTreeMap<String, u32>| {
        map.iter()
            .map(|(k, &v)| format!("{k}={}", buf(v)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    writeln!(out, "  inputs {}", named(&role.inputs)).expect("write to String");
    writeln!(out, "  results {}", named(&role.results)).expect("write to String");
    for (name, over) in &role.result_axes {
        writeln!(out, "  result {name} summed over {}", axes(over)).expect("write to String");
    }
    if let Some(m) = &role.memory {
        writeln!(out, "  memory {}", memory(m)).expect("write to String");
    }
    program(out, "  ", "microbatch", &role.microbatch);
    program(out, "  ", "optimizer", &role.optimizer);
    if let Some(d) = &role.decode {
        writeln!(
            out,
            "  decode inputs {} results {}",
            named(&d.inputs),
            named(&d.results)
        )
        .expect("write to String");
        program(out, "  ", "decode", &d.step);
    }
    let Some(p) = &role.pipeline else {
        return;
    };
    let mut line = format!(
        "  pipeline schedule={} chunks_total={}",
        p.schedule, p.chunks_total
    );
    if let Some(d) = &p.dpp {
        write!(line, " dpp={} cap={}", d.policy, d.cap).expect("write to String");
    }
    writeln!(out, "{line}").expect("write to String");
    for c in &p.chunks {
        chunk(out, c);
    }
    writeln!(out, "  actions ({})", p.actions.len()).expect("write to String");
    let tokens: Vec<String> = p
        .actions
        .iter()
        .map(|a| {
            let kind = match a.kind {
                PipeKind::F => "F",
                PipeKind::B => "B",
                PipeKind::W => "W",
                PipeKind::BW => "BW",
            };
            format!("{kind}{}.{}", a.chunk, a.microbatch)
        })
        .collect();
    for line in tokens.chunks(ACTIONS_PER_LINE) {
        writeln!(out, "    {}", line.join(" ")).expect("write to String");
    }
}

fn chunk(out: &mut String, c: &ChunkProgram) {
    let mut line = format!("  chunk {}", c.chunk);
    if let Some([a, b]) = c.layers {
        write!(line, " layers={a}..{b}").expect("write to String");
    }
    write!(
        line,
        " slots={} slot_elems={} base={}",
        c.slots, c.activation_elems, c.activation_base
    )
    .expect("write to String");
    if !c.inputs.is_empty() {
        write!(line, " inputs=[{}]", bufs(&c.inputs)).expect("write to String");
    }
    writeln!(out, "{line}").expect("write to String");
    program(out, "    ", "forward", &c.forward);
    program(out, "    ", "backward", &c.backward);
    program(out, "    ", "weight", &c.weight);
    if !c.decode.is_empty() {
        if !c.decode_inputs.is_empty() {
            writeln!(out, "    decode inputs=[{}]", bufs(&c.decode_inputs))
                .expect("write to String");
        }
        program(out, "    ", "decode", &c.decode);
    }
}

/// One program: its name and length, then one instruction per line, the `# path` column
/// aligned.
fn program(out: &mut String, indent: &str, name: &str, instrs: &[Instr]) {
    writeln!(out, "{indent}{name} ({})", instrs.len()).expect("write to String");
    let lines: Vec<(String, Option<&str>)> = instrs.iter().map(instr).collect();
    let width = lines
        .iter()
        .filter(|(_, p)| p.is_some())
        .map(|(s, _)| s.len())
        .filter(|&n| n <= MAX_ALIGN)
        .max()
        .unwrap_or(0);
    for (text, path) in lines {
        match path {
            Some(path) => writeln!(out, "{indent}  {text:width$}  # {path}"),
            None => writeln!(out, "{indent}  {text}"),
        }
        .expect("write to String");
    }
}

/// An instruction's text and, for kernels, its provenance path.
fn instr(i: &Instr) -> (String, Option<&str>) {
    match i {
        Instr::Kernel {
            op,
            inputs,
            outputs,
            path,
        } => {
            let attrs = op.attrs();
            let attrs = if attrs.is_empty() {
                String::new()
            } else {
                let kv: Vec<String> = attrs.iter().map(|(k, v)| format!("{k}={v}")).collect();
                format!("{{{}}}", kv.join(", "))
            };
            let call = format!("{}{attrs}({})", op.name(), bufs(inputs));
            let text = if outputs.is_empty() {
                call
            } else {
                format!("{} = {call}", bufs(outputs))
            };
            (text, Some(path))
        }
        Instr::Zero { buffer } => (format!("zero {}", buf(*buffer)), None),
        Instr::Send {
            buffer,
            chunk,
            transfer,
            twin,
        } => (
            format!(
                "send {} to chunk={chunk} transfer={transfer}{}",
                buf(*buffer),
                if *twin { " twin" } else { "" }
            ),
            None,
        ),
        Instr::Recv {
            buffer,
            chunk,
            transfer,
            twin,
        } => (
            format!(
                "{} = recv from chunk={chunk} transfer={transfer}{}",
                buf(*buffer),
                if *twin { " twin" } else { "" }
            ),
            None,
        ),
    }
}
