//! Fused kernels on the cpu backend (feature `mlir`): at startup, every fused group of the
//! rank's programs (`megac_codegen::fuse`) is lowered through MLIR
//! (`megac_codegen::mlir::fused_source`: linalg on memrefs, then loops and LLVM) and
//! JIT-compiled by MLIR's ExecutionEngine; the executor then calls the compiled kernel
//! once instead of the group's instructions one by one.
//!
//! Kernels are cached in the process by the hash of their MLIR text: ranks running as
//! threads, and the groups of different layers with the same shapes, share one compiled
//! kernel. They are also cached on disk (`megac_codegen::mlir::jit::DiskCache`:
//! `$MEGAC_KERNEL_CACHE`, else `$XDG_CACHE_HOME/megac/kernels` or `~/.cache/megac/kernels`;
//! `MEGAC_KERNEL_CACHE=off` for none): a later process loads the shared object instead of
//! compiling. A group that `megac_codegen::fuse::split_rows` allows to cut into row ranges
//! runs as one call per rayon thread, at once. Fusion is on by default in a build with the
//! feature; [`set_enabled`] (`--fusion off`) turns it off for the process. A build without
//! it has no fused kernels and runs every instruction itself.

use std::sync::atomic::{AtomicBool, Ordering};

use megac_ir::plan::{BufId, Instr};

use crate::error::RuntimeError;
use crate::memory::Memory;

/// On by default (in a build with the feature: [`enabled`]); `--fusion off` turns it off.
static ENABLED: AtomicBool = AtomicBool::new(true);

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
    /// How many row ranges it runs as, at once (1: one call).
    #[cfg_attr(not(feature = "mlir"), allow(dead_code))]
    parts: usize,
    /// Per buffer: cut into `parts` row ranges (else passed whole to every part), and its
    /// element size in bytes.
    #[cfg_attr(not(feature = "mlir"), allow(dead_code))]
    cut: Vec<(bool, usize)>,
    /// A fused AdamW's hyperparameters (`beta1`, `beta2`, `eps`, `weight_decay`, as f32):
    /// the call passes the step's scalars ([`adamw_scalars`]) as a last argument.
    #[cfg_attr(not(feature = "mlir"), allow(dead_code))]
    adamw: Option<[f32; 4]>,
    #[cfg(feature = "mlir")]
    kernel: std::sync::Arc<jit::Kernel>,
}

/// The scalars a fused AdamW takes (`megac_codegen::mlir::ADAMW_SCALARS` of them, in the
/// order of its lowering): `megac_kernels::optim::step_scalars` of this step, then
/// `1 / loss_scale` rounded to f32, as the runtime's AdamW instruction computes them.
#[cfg_attr(not(feature = "mlir"), allow(dead_code))]
fn adamw_scalars(hp: [f32; 4], ctx: &crate::exec::StepContext) -> [f32; 8] {
    let k = megac_kernels::optim::step_scalars(
        &megac_kernels::optim::AdamW {
            lr: ctx.lr as f32,
            beta1: hp[0],
            beta2: hp[1],
            eps: hp[2],
            weight_decay: hp[3],
        },
        ctx.step,
    );
    [
        k.decay,
        k.w1,
        k.beta2,
        k.w2,
        k.bc2_sqrt,
        k.eps,
        k.neg_step_size,
        (1.0 / ctx.loss_scale) as f32,
    ]
}

impl Call {
    /// Run the group on `mem`, at step `ctx` (a fused AdamW's scalars).
    pub fn run(&self, mem: &Memory, ctx: &crate::exec::StepContext) -> Result<(), RuntimeError> {
        #[cfg(feature = "mlir")]
        {
            let mut bufs: Vec<(*mut u8, i64)> = self.buffers.iter().map(|&b| mem.raw(b)).collect();
            let mut scalars = self.adamw.map(|hp| adamw_scalars(hp, ctx));
            if let Some(sc) = scalars.as_mut() {
                bufs.push((sc.as_mut_ptr().cast::<u8>(), sc.len() as i64));
            }
            if self.parts <= 1 {
                // SAFETY: every pointer is a buffer this rank holds, valid for its element
                // count (`Memory::raw`); the group's instructions are the executor's
                // current instructions, so nothing else reads or writes these buffers
                // meanwhile, and the group computes what they compute in their order.
                return unsafe { self.kernel.jit.call_buffers("fused", &bufs) }
                    .map_err(|e| RuntimeError::Plan(format!("fused kernel: {e}")));
            }
            // Row ranges at once: part `k` gets rows `k/parts..(k+1)/parts` of every cut
            // buffer and the others whole (`megac_codegen::fuse::split_rows`).
            let parts = self.parts;
            let bufs: Vec<(usize, i64)> = bufs.iter().map(|&(p, n)| (p as usize, n)).collect();
            let part_bufs = |k: usize| -> Vec<(usize, i64)> {
                bufs.iter()
                    .zip(&self.cut)
                    .map(|(&(p, n), &(cut, size))| {
                        if cut {
                            let m = n / parts as i64;
                            (p + k * m as usize * size, m)
                        } else {
                            (p, n)
                        }
                    })
                    .collect()
            };
            let results: Vec<Result<(), RuntimeError>> = {
                use rayon::prelude::*;
                (0..parts)
                    .into_par_iter()
                    .map(|k| {
                        let b: Vec<(*mut u8, i64)> = part_bufs(k)
                            .into_iter()
                            .map(|(p, n)| (p as *mut u8, n))
                            .collect();
                        // SAFETY: as above, and the parts write disjoint row ranges: only
                        // cut buffers are written (`split_rows` leaves whole only buffers
                        // the group reads), each part its own rows.
                        unsafe { self.kernel.jit.call_buffers("fused", &b) }
                            .map_err(|e| RuntimeError::Plan(format!("fused kernel: {e}")))
                    })
                    .collect()
            };
            results.into_iter().collect()
        }
        #[cfg(not(feature = "mlir"))]
        {
            let _ = (mem, ctx, &self.buffers);
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

/// A fused group compiled (or taken from the cache) and ready to run on a rank's memory
/// ([`prepare_group`]; for tests and tools, the executor runs the kernels [`Fused::build`]
/// prepared).
#[cfg(feature = "mlir")]
pub struct Prepared(Call);

#[cfg(feature = "mlir")]
impl Prepared {
    /// Run the group's kernel on `mem` (a rank's memory holding every buffer it uses) at
    /// step `ctx`.
    pub fn run(&self, mem: &Memory, ctx: &crate::exec::StepContext) -> Result<(), RuntimeError> {
        if let Some(b) = self.0.buffers.iter().find(|&&b| !mem.holds(b)) {
            return Err(RuntimeError::Plan(format!(
                "this rank does not hold buffer {b}"
            )));
        }
        self.0.run(mem, ctx)
    }
}

/// The fused kernel of `instrs` (a fused group of a program of `plan`,
/// [`megac_codegen::fuse::groups`]), compiled now or taken from the cache; `None` when the
/// group has no fused form.
#[cfg(feature = "mlir")]
pub fn prepare_group(
    plan: &megac_ir::gate::CheckedPlan,
    instrs: &[Instr],
) -> Result<Option<Prepared>, RuntimeError> {
    Ok(jit::call(plan, instrs)?.map(Prepared))
}

/// Run `instrs` (a fused group of a program of `plan`) on `mem` as one fused kernel
/// ([`prepare_group`]) at step `ctx`. Returns false, running nothing, when the group has no
/// fused form.
#[cfg(feature = "mlir")]
pub fn run_group(
    plan: &megac_ir::gate::CheckedPlan,
    mem: &Memory,
    instrs: &[Instr],
    ctx: &crate::exec::StepContext,
) -> Result<bool, RuntimeError> {
    match prepare_group(plan, instrs)? {
        Some(p) => {
            p.run(mem, ctx)?;
            Ok(true)
        }
        None => Ok(false),
    }
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

    use megac_codegen::mlir::jit::{self, DiskCache, Jit};

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

    /// The disk cache of compiled kernels ([`DiskCache::from_env`]: `$MEGAC_KERNEL_CACHE`,
    /// else the XDG cache directory), looked up once per process.
    fn disk_cache() -> &'static Option<DiskCache> {
        static DISK: OnceLock<Option<DiskCache>> = OnceLock::new();
        DISK.get_or_init(DiskCache::from_env)
    }

    pub(super) fn kernel(text: &str) -> Result<Arc<Kernel>, RuntimeError> {
        let h = hash(text);
        let mut c = cache().lock().unwrap_or_else(|e| e.into_inner());
        if let Some((t, k)) = c.get(&h) {
            if t == text {
                return Ok(k.clone());
            }
        }
        let (jit, _origin) =
            jit::compile_cached(text, jit::FUSED_PIPELINE, "fused", disk_cache().as_ref())
                .map_err(|e| RuntimeError::Plan(format!("fused kernel: {e}")))?;
        let k = Arc::new(Kernel { jit });
        c.insert(h, (text.to_string(), k.clone()));
        Ok(k)
    }

    /// The fewest elements in a group's largest buffer for it to be split over threads.
    const SPLIT_MIN_ELEMS: u64 = 1 << 16;

    /// The call of the fused kernel of `instrs`: split into as many row ranges as rayon has
    /// threads where the group allows it and is large enough, else one call.
    pub(super) fn call(
        plan: &megac_ir::plan::Plan,
        instrs: &[megac_ir::plan::Instr],
    ) -> Result<Option<Call>, RuntimeError> {
        let threads = rayon::current_num_threads() as u64;
        let Some((_, all)) = megac_codegen::mlir::fused_source(plan, instrs) else {
            return Ok(None);
        };
        let largest = all
            .iter()
            .map(|&b| plan.buffers[b as usize].len())
            .max()
            .unwrap_or(0);
        let parts = if threads > 1 && largest >= SPLIT_MIN_ELEMS {
            megac_codegen::fuse::split_rows(plan, instrs, threads).map_or(1, |_| threads)
        } else {
            1
        };
        let Some((text, buffers)) = megac_codegen::mlir::fused_source_split(plan, instrs, parts)
        else {
            return Ok(None);
        };
        let cut = buffers
            .iter()
            .map(|&b| {
                let buf = &plan.buffers[b as usize];
                (buf.shape.len() >= 2, buf.dtype.size_bytes() as usize)
            })
            .collect();
        let adamw = match instrs {
            [megac_ir::plan::Instr::Kernel {
                op:
                    megac_ir::OpKind::AdamW {
                        beta1,
                        beta2,
                        eps,
                        weight_decay,
                        ..
                    },
                ..
            }] => Some([
                *beta1 as f32,
                *beta2 as f32,
                *eps as f32,
                *weight_decay as f32,
            ]),
            _ => None,
        };
        Ok(Some(Call {
            len: instrs.len(),
            buffers,
            parts: parts as usize,
            cut,
            adamw,
            kernel: kernel(&text)?,
        }))
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
                calls[g.start] = call(p, g.instrs(program))?;
            }
            out.programs
                .push((program.as_ptr() as usize, program.len(), calls));
        }
        Ok(out)
    }
}
