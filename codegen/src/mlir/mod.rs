//! MLIR emission (feature `mlir`): one module per role of a [`Plan`], verified by MLIR.
//!
//! Each role becomes a module with a `func.func` per program: `@microbatch`, `@optimizer`,
//! and per pipeline chunk `@chunk<c>_forward`, `@chunk<c>_backward`, `@chunk<c>_weight`.
//! A function takes one byte arena per buffer class (`memref<Nxi8>`, N the role's arena
//! bytes; `megac.arena` names the class), then `index` arguments for what depends on the
//! rank (its position in a group, `megac.rank_index`) and on the micro-batch (a pipeline
//! chunk's slot, `megac.slot`). Every buffer is a `memref.view` of its arena at the plan's
//! offset with its static shape; kernels are `linalg.generic` ops with `arith`/`math`
//! bodies ([`lower`]), collectives, transfers and the kernels without a lowering are
//! `func.call`s of declared runtime symbols carrying `megac.group`, `megac.bytes` and
//! `megac.tag`.
//!
//! The text is built here ([`text`], [`lower`]) and then parsed, verified and printed by
//! MLIR itself through melior ([`verify`]): what is written is MLIR's own printed form of
//! a module that passed its verifier.

pub mod jit;
mod lower;
mod text;
pub mod verify;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use megac_ir::plan::{BufId, Instr, Plan};
use megac_ir::types::DType;

pub use lower::{lowered, ADAMW_SCALARS};
use text::{arena_arg, memref_ty, str_attr, Extra, Func, CLASSES};

/// Why MLIR emission failed.
#[derive(Debug, thiserror::Error)]
pub enum MlirError {
    /// The emitted text did not parse or verify: a bug in the emitter, with MLIR's message.
    #[error("the MLIR module of role `{role}` does not {stage}: {message}")]
    Invalid {
        /// The role.
        role: String,
        /// `parse` or `verify`.
        stage: &'static str,
        /// MLIR's diagnostics.
        message: String,
    },
    /// Writing a module failed.
    #[error("cannot write {path}: {message}")]
    Write {
        /// The file.
        path: String,
        /// What failed.
        message: String,
    },
}

/// The file name of role `name`'s module: `role-<name>.mlir`.
pub fn file_name(role: &str) -> String {
    format!("role-{role}.mlir")
}

/// The role's arena sizes in bytes, by class index.
fn arena_bytes(plan: &Plan, role: usize) -> [u64; 5] {
    let r = &plan.roles[role];
    let mem = r.memory.as_ref().unwrap_or(&plan.memory);
    [
        mem.param_bytes,
        mem.grad_bytes,
        mem.opt_state_bytes,
        mem.activation_bytes,
        mem.input_bytes,
    ]
}

/// The text of one function `name` running `instrs`; with `c_interface`, MLIR also emits
/// its C interface (what the JIT calls).
fn function_text(
    plan: &Plan,
    arena_bytes: [u64; 5],
    name: &str,
    instrs: &[Instr],
    c_interface: bool,
    decls: &mut BTreeMap<String, Vec<String>>,
    collectives: &mut u64,
) -> (String, Vec<Extra>) {
    let mut f = Func::new(plan, arena_bytes, decls, collectives);
    for i in instrs {
        lower::instr(&mut f, i);
    }
    let mut args: Vec<String> = CLASSES
        .iter()
        .map(|&c| {
            format!(
                "{}: {} {{megac.arena = {}}}",
                arena_arg(c),
                memref_ty(&[arena_bytes[c.index()]], "i8"),
                str_attr(c.name())
            )
        })
        .collect();
    let mut extras = Vec::new();
    let mut by_name: Vec<(&String, &Extra)> = f.extras.iter().map(|(e, n)| (n, e)).collect();
    by_name.sort_by_key(|(n, _)| n[2..].parse::<usize>().unwrap_or(0));
    for (n, e) in by_name {
        let attr = match e {
            Extra::RankIndex(axes) => format!("megac.rank_index = {}", str_attr(axes)),
            Extra::Slot(c) => format!("megac.slot = {c} : i64"),
        };
        args.push(format!("{n}: index {{{attr}}}"));
        extras.push(e.clone());
    }
    let mut text = String::new();
    let ciface = if c_interface {
        ", llvm.emit_c_interface"
    } else {
        ""
    };
    let _ = writeln!(
        text,
        "  func.func @{name}({}) attributes {{megac.program = {}{ciface}}} {{",
        args.join(", "),
        str_attr(name)
    );
    for l in &f.lines {
        let _ = writeln!(text, "    {l}");
    }
    let _ = writeln!(text, "    return\n  }}");
    (text, extras)
}

/// A module of `funcs` (text) with the attributes of role `role` and the declarations.
fn module_text(
    plan: &Plan,
    role: usize,
    decls: &BTreeMap<String, Vec<String>>,
    funcs: &str,
) -> String {
    let r = &plan.roles[role];
    let ranks: Vec<String> = plan
        .rank_to_role
        .iter()
        .enumerate()
        .filter(|(_, &x)| x as usize == role)
        .map(|(i, _)| i.to_string())
        .collect();
    let mut out = String::new();
    let mesh: Vec<String> = plan
        .mesh
        .axes
        .iter()
        .map(|(a, n)| format!("{}={n}", a.as_str()))
        .collect();
    let _ = writeln!(
        out,
        "module attributes {{megac.model = {}, megac.role = {}, megac.ranks = {}, megac.mesh = {}}} {{",
        str_attr(&plan.model),
        str_attr(&r.name),
        str_attr(&ranks.join(",")),
        str_attr(&mesh.join(","))
    );
    for (name, tys) in decls {
        let _ = writeln!(
            out,
            "  func.func private @{}({})",
            str_attr(name),
            tys.join(", ")
        );
    }
    out.push_str(funcs);
    out.push_str("}\n");
    out
}

/// The MLIR source of role `role` of `plan`, as the emitter writes it (not yet verified;
/// [`emit_role`] returns MLIR's verified, printed form).
pub fn role_source(plan: &Plan, role: usize) -> String {
    let bytes = arena_bytes(plan, role);
    let mut decls = BTreeMap::new();
    let mut collectives = 0u64;
    let mut funcs = String::new();
    for (name, instrs) in crate::fuse::programs(&plan.roles[role]) {
        let (text, _) = function_text(
            plan,
            bytes,
            &name,
            instrs,
            false,
            &mut decls,
            &mut collectives,
        );
        funcs.push_str(&text);
    }
    module_text(plan, role, &decls, &funcs)
}

/// A module of one function `name` running `instrs` on role `role`'s arenas, with its C
/// interface (for [`jit`]): the arena sizes and the extra `index` arguments it takes.
pub fn function_source(
    plan: &Plan,
    role: usize,
    name: &str,
    instrs: &[Instr],
) -> (String, [u64; 5], Vec<String>) {
    let bytes = arena_bytes(plan, role);
    let mut decls = BTreeMap::new();
    let mut collectives = 0u64;
    let (text, extras) = function_text(
        plan,
        bytes,
        name,
        instrs,
        true,
        &mut decls,
        &mut collectives,
    );
    let extras = extras
        .iter()
        .map(|e| match e {
            Extra::RankIndex(a) => format!("rank_index:{a}"),
            Extra::Slot(c) => format!("slot:{c}"),
        })
        .collect();
    (module_text(plan, role, &decls, &text), bytes, extras)
}

/// Role `role`'s module, verified and printed by MLIR.
pub fn emit_role(plan: &Plan, role: usize) -> Result<String, MlirError> {
    let source = role_source(plan, role);
    verify::canonical(&source).map_err(|(stage, message)| MlirError::Invalid {
        role: plan.roles[role].name.clone(),
        stage,
        message,
    })
}

/// Every role's module: (file name, text), in role order.
pub fn emit_modules(plan: &Plan) -> Result<Vec<(String, String)>, MlirError> {
    (0..plan.roles.len())
        .map(|i| Ok((file_name(&plan.roles[i].name), emit_role(plan, i)?)))
        .collect()
}

/// Write every role's module into `dir` (each through a temporary file, renamed), after
/// all of them verified: an error writes nothing. Returns the paths written.
pub fn write_modules(plan: &Plan, dir: &Path) -> Result<Vec<PathBuf>, MlirError> {
    let modules = emit_modules(plan)?;
    let mut paths = Vec::new();
    for (name, text) in modules {
        let path = dir.join(name);
        megac_ir::file::write_atomic(&path, text).map_err(|e| MlirError::Write {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        paths.push(path);
    }
    Ok(paths)
}

/// The kernel of a fused group ([`crate::fuse`]): a module holding one function `@fused`
/// (with its C interface) that runs `instrs` in order, taking each buffer they use as an
/// argument of its own, a rank-1 memref of its elements (reshaped inside to the buffer's
/// shape). A `zero` of an f32 buffer is deferred: the first kernel that writes the buffer
/// elementwise starts from 0 instead of reading it ([`text::Func::materialize`] zeroes it
/// otherwise). A fused AdamW (a group of its own) takes one more argument after the
/// buffers, its step's [`ADAMW_SCALARS`] f32 scalars (`lower/adamw.rs`). Returns the text
/// and the buffers in argument order, or `None` when an instruction has no lowering in
/// this form (its text would call a runtime symbol).
pub fn fused_source(plan: &Plan, instrs: &[Instr]) -> Option<(String, Vec<BufId>)> {
    fused_source_split(plan, instrs, 1)
}

/// [`fused_source`] for one of `parts` row ranges of a group that
/// [`crate::fuse::split_rows`] allows to split: every buffer of rank 2 or more holds
/// `1 / parts` of its rows (the caller passes each part's rows; the others whole).
/// `None` also when the group cannot be split so.
pub fn fused_source_split(
    plan: &Plan,
    instrs: &[Instr],
    parts: u64,
) -> Option<(String, Vec<BufId>)> {
    if parts > 1 {
        crate::fuse::split_rows(plan, instrs, parts)?;
    }
    let mut decls = BTreeMap::new();
    let mut collectives = 0u64;
    let mut f = Func::new(plan, [0; 5], &mut decls, &mut collectives);
    f.buffer_args = Some(Vec::new());
    f.fast = true;
    f.split = parts.max(1);
    for i in instrs {
        match i {
            Instr::Zero { buffer } if plan.buffers[*buffer as usize].dtype == DType::F32 => {
                let v = f.view(*buffer);
                f.materialize(&v.name);
                f.fresh.insert(v.name.clone(), v);
            }
            _ => lower::instr(&mut f, i),
        }
    }
    let pending: Vec<String> = f.fresh.keys().cloned().collect();
    for n in pending {
        f.materialize(&n);
    }
    if !f.decls.is_empty() {
        return None;
    }
    let buffers = f.buffer_args.take().unwrap_or_default();
    let mut args: Vec<String> = buffers
        .iter()
        .enumerate()
        .map(|(k, &b)| {
            let buf = &plan.buffers[b as usize];
            let len = if buf.shape.len() >= 2 {
                buf.len() / parts.max(1)
            } else {
                buf.len()
            };
            format!("%a{k}: {}", memref_ty(&[len], text::elem(buf.dtype)))
        })
        .collect();
    if f.scalars {
        args.push(format!("%sc: memref<{}xf32>", lower::ADAMW_SCALARS));
    }
    let mut out = String::from("module {\n");
    for g in &f.globals {
        let _ = writeln!(out, "  {g}");
    }
    let _ = writeln!(
        out,
        "  func.func @fused({}) attributes {{llvm.emit_c_interface}} {{",
        args.join(", ")
    );
    for l in &f.lines {
        let _ = writeln!(out, "    {l}");
    }
    out.push_str("    return\n  }\n}\n");
    Some((out, buffers))
}
