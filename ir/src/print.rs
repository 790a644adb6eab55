//! Deterministic text form of a graph, for people first (aligned, one op per line,
//! layouts and provenance shown). `parse::parse_graph` reads it back.
//!
//! ```text
//! graph "llama-tiny" {
//!   mesh tp=1 cp=1 ep=1 dp=1 pp=1
//!   input %0 "tokens": i32[b=8, s=64] {R}
//!   param %2 "model.embed_tokens.weight": f32[vocab=256, h=64] {R}
//!   %3: f32[b=8, s=64, h=64] {R} = embedding(%0, %2)   # model.embed_tokens
//!   output "loss" = %41
//! }
//! ```

use std::fmt::Write;

use crate::graph::{Graph, ValueDef, ValueId};

/// Columns beyond which alignment padding is not added (keeps long lines from pushing
/// every other line to the right).
const MAX_ALIGN: usize = 56;

/// Print `graph` in its text form.
pub fn print_graph(graph: &Graph) -> String {
    let mut lines: Vec<Line> = Vec::new();
    for (i, value) in graph.values.iter().enumerate() {
        let id = ValueId(i as u32);
        match &value.def {
            ValueDef::Input(name) => lines.push(Line::Plain(format!(
                "input %{} \"{}\": {}",
                id.0, name, value.ty
            ))),
            ValueDef::Param(name) => lines.push(Line::Plain(format!(
                "param %{} \"{}\": {}",
                id.0, name, value.ty
            ))),
            ValueDef::Op(op_id, 0) => {
                let op = &graph.ops[op_id.0 as usize];
                let lhs: Vec<String> = op
                    .outputs
                    .iter()
                    .map(|&v| format!("%{}: {}", v.0, graph.ty(v)))
                    .collect();
                let args: Vec<String> = op.inputs.iter().map(|v| format!("%{}", v.0)).collect();
                let mut rhs = format!("{}({})", op.kind.name(), args.join(", "));
                let attrs = op.kind.attrs();
                if !attrs.is_empty() {
                    let kv: Vec<String> = attrs.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    write!(rhs, " {{{}}}", kv.join(", ")).expect("write to String");
                }
                lines.push(Line::Op {
                    lhs: lhs.join(", "),
                    rhs,
                    path: op.path.clone(),
                });
            }
            ValueDef::Op(..) => {}
        }
    }

    let lhs_width = column_width(lines.iter().filter_map(|l| match l {
        Line::Op { lhs, .. } => Some(lhs.len()),
        Line::Plain(_) => None,
    }));
    let rhs_width = column_width(lines.iter().filter_map(|l| match l {
        Line::Op { rhs, .. } => Some(rhs.len()),
        Line::Plain(_) => None,
    }));

    let mut out = String::new();
    writeln!(out, "graph \"{}\" {{", graph.name).expect("write to String");
    let mesh: Vec<String> = graph
        .mesh
        .axes
        .iter()
        .map(|(a, n)| format!("{}={}", a.as_str(), n))
        .collect();
    writeln!(out, "  mesh {}", mesh.join(" ")).expect("write to String");
    for line in &lines {
        match line {
            Line::Plain(s) => writeln!(out, "  {s}"),
            Line::Op { lhs, rhs, path } => {
                writeln!(out, "  {lhs:lhs_width$} = {rhs:rhs_width$}  # {path}")
            }
        }
        .expect("write to String");
    }
    for (name, v) in &graph.outputs {
        writeln!(out, "  output \"{}\" = %{}", name, v.0).expect("write to String");
    }
    out.push_str("}\n");
    out
}

enum Line {
    Plain(String),
    Op {
        lhs: String,
        rhs: String,
        path: String,
    },
}

fn column_width(lens: impl Iterator<Item = usize>) -> usize {
    lens.filter(|&n| n <= MAX_ALIGN).max().unwrap_or(0)
}
