//! Fused kernels on the cpu backend (feature `mlir`): at startup, every fused group of the
//! rank's programs (`megac_codegen::fuse`) is lowered through MLIR
//! (`megac_codegen::mlir::fused_source`: linalg on memrefs, then loops and LLVM) and
//! JIT-compiled by MLIR's ExecutionEngine; the executor then calls the compiled kernel
//! once instead of the group's instructions one by one.
//!
//! Kernels are cached in the process by the hash of their MLIR text: ranks running as
//! threads, and the groups of different layers with the same shapes, share one compiled
//! kernel. (The ExecutionEngine cannot load a compiled object back, so there is no cache
//! on disk: each process compiles its kernels once.) Fusion is off by default (the generated
//! kernels are not faster yet); [`set_enabled`] (`--fusion on`) turns it on for the process
//! in a build with the feature. A build without it has no fused kernels and runs every
//! instruction itself.

use std::sync::atomic::{AtomicBool, Ordering};

use megac_ir::plan::{BufId, Instr};

use crate::error::RuntimeError;
use crate::memory::Memory;

/// Off by default: the generated kernels are scalar loops and measured slower than the Rust
/// kernels they replace (docs/mlir.md), so fusion is opt-in (`--fusion on`) until they are
/// vectorised.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// Turn fusion on or off for sessions created afterwards in this process.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::SeqCst);
}

/// Whether sessions created now run fused kernels: built with the feature `mlir` and
/// turned on ([`set_enabled`]).
pub fn enabled() -> bool {
    cfg!(feature = "mlir") && ENABLED.load(Ordering::SeqCst)
}

/// One fused group of a program, ready to call.
#[cfg_attr(not(feature = "mlir"), allow(dead_code))]
pub(crate) struct Call {
    /// How many instructions it replaces.
    pub len: usize,
    /// The buffers it takes, in argument order.
    buffers: Vec<BufId>,
    #[cfg(feature = "mlir")]
    kernel: std::sync::Arc<jit::Kernel>,
}

impl Call {
    /// Run the group on `mem`.
    pub fn run(&self, mem: &Memory) -> Result<(), RuntimeError> {
        #[cfg(feature = "mlir")]
        {
            let bufs: Vec<(*mut u8, i64)> = self.buffers.iter().map(|&b| mem.raw(b)).collect();
            // SAFETY: every pointer is a buffer this rank holds, valid for its element
            // count (`Memory::raw`); the group's instructions are the executor's current
            // instructions, so nothing else reads or writes these buffers meanwhile, and
            // the group computes what they compute in their order.
            unsafe { self.kernel.jit.call_buffers("fused", &bufs) }
                .map_err(|e| RuntimeError::Plan(format!("fused kernel: {e}")))
        }
        #[cfg(not(feature = "mlir"))]
        {
            let _ = (mem, &self.buffers);
            Err(RuntimeError::Unsupported(
                "fused kernels need a build with the `mlir` feature".into(),
            ))
        }
    }
}

/// The fused groups of a rank's programs: per program (identified by its instructions'
/// address and length in the plan), one entry per instruction, `Some` where a group
/// starts.
#[derive(Default)]
pub(crate) struct Fused {
    programs: Vec<(usize, usize, Vec<Option<Call>>)>,
}

impl Fused {
    /// The entries of `program`, if it is one of the rank's programs with fused groups.
    pub fn program(&self, program: &[Instr]) -> Option<&[Option<Call>]> {
        let key = (program.as_ptr() as usize, program.len());
        self.programs
            .iter()
            .find(|(p, n, _)| (*p, *n) == key)
            .map(|(_, _, c)| &c[..])
    }

    /// Fused kernels for `rank`'s role of `plan` (none when fusion is off or the build has
    /// no `mlir` feature).
    pub fn build(plan: &megac_ir::gate::CheckedPlan, rank: usize) -> Result<Fused, RuntimeError> {
        if !enabled() {
            return Ok(Fused::default());
        }
        #[cfg(feature = "mlir")]
        {
            jit::build(plan, rank)
        }
        #[cfg(not(feature = "mlir"))]
        {
            let _ = (plan, rank);
            Ok(Fused::default())
        }
    }
}

/// Run `instrs` (a fused group of a program of `plan`, [`megac_codegen::fuse::groups`]) on
/// `mem` as one fused kernel, compiled now or taken from the cache. Returns false, running
/// nothing, when the group has no fused form. (For tests and tools; the executor runs the
/// kernels [`Fused::build`] prepared.)
#[cfg(feature = "mlir")]
pub fn run_group(
    plan: &megac_ir::gate::CheckedPlan,
    mem: &Memory,
    instrs: &[Instr],
) -> Result<bool, RuntimeError> {
    let Some((text, buffers)) = megac_codegen::mlir::fused_source(plan, instrs) else {
        return Ok(false);
    };
    if let Some(b) = buffers.iter().find(|&&b| !mem.holds(b)) {
        return Err(RuntimeError::Plan(format!(
            "this rank does not hold buffer {b}"
        )));
    }
    let call = Call {
        len: instrs.len(),
        buffers,
        kernel: jit::kernel(&text)?,
    };
    call.run(mem)?;
    Ok(true)
}

/// The MLIR text of the fused kernel of `instrs` (see [`run_group`]), if it has one.
#[cfg(feature = "mlir")]
pub fn group_source(plan: &megac_ir::plan::Plan, instrs: &[Instr]) -> Option<String> {
    megac_codegen::mlir::fused_source(plan, instrs).map(|(t, _)| t)
}

#[cfg(feature = "mlir")]
mod jit {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};

    use megac_codegen::mlir::jit::Jit;

    use super::{Call, Fused};
    use crate::error::RuntimeError;

    /// A compiled fused kernel.
    pub(super) struct Kernel {
        pub jit: Jit,
    }

    // SAFETY: after `Jit::compile` the engine and its context are never mutated: the only
    // use is `invoke_packed`, a symbol lookup in LLVM's ORC JIT (which supports concurrent
    // lookups) and a call of compiled code that touches only its arguments. Dropping it
    // from another thread than the one that compiled it is fine for both.
    unsafe impl Send for Kernel {}
    unsafe impl Sync for Kernel {}

    /// 64-bit FNV-1a of the kernel text.
    fn hash(s: &str) -> u64 {
        s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    }

    /// Compiled kernels by text hash, with the text (checked on a hit).
    type Cache = Mutex<HashMap<u64, (String, Arc<Kernel>)>>;

    /// The process's compiled kernels.
    fn cache() -> &'static Cache {
        static CACHE: OnceLock<Cache> = OnceLock::new();
        CACHE.get_or_init(Default::default)
    }

    pub(super) fn kernel(text: &str) -> Result<Arc<Kernel>, RuntimeError> {
        let h = hash(text);
        let mut c = cache().lock().unwrap_or_else(|e| e.into_inner());
        if let Some((t, k)) = c.get(&h) {
            if t == text {
                return Ok(k.clone());
            }
        }
        let jit = Jit::compile_with(text, megac_codegen::mlir::jit::FUSED_PIPELINE, [0; 5], 0)
            .map_err(|e| RuntimeError::Plan(format!("fused kernel: {e}")))?;
        let k = Arc::new(Kernel { jit });
        c.insert(h, (text.to_string(), k.clone()));
        Ok(k)
    }

    pub(super) fn build(
        plan: &megac_ir::gate::CheckedPlan,
        rank: usize,
    ) -> Result<Fused, RuntimeError> {
        let p: &megac_ir::plan::Plan = plan;
        let role = &p.roles[p.rank_to_role[rank] as usize];
        let mut out = Fused::default();
        for (_, program) in megac_codegen::fuse::programs(role) {
            let groups = megac_codegen::fuse::groups(program);
            if groups.is_empty() {
                continue;
            }
            let mut calls: Vec<Option<Call>> = (0..program.len()).map(|_| None).collect();
            for g in groups {
                let Some((text, buffers)) = megac_codegen::mlir::fused_source(p, g.instrs(program))
                else {
                    continue;
                };
                calls[g.start] = Some(Call {
                    len: g.len,
                    buffers,
                    kernel: kernel(&text)?,
                });
            }
            out.programs
                .push((program.as_ptr() as usize, program.len(), calls));
        }
        Ok(out)
    }
}
