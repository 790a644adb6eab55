//! Compile a module to machine code with MLIR's ExecutionEngine and call its functions on
//! byte arenas: linalg to loops, then to the LLVM dialect, then LLVM's JIT.
//!
//! Only functions whose instructions all have a linalg lowering can run: a call of a
//! runtime symbol (a collective, an unlowered kernel) has no definition to link.

use melior::ir::operation::OperationLike;
use melior::ir::Module;
use melior::pass::PassManager;
use melior::utility::{parse_pass_pipeline, register_all_llvm_translations, register_all_passes};
use melior::{Context, ExecutionEngine};

/// The lowering from linalg on memrefs to the LLVM dialect.
pub const PIPELINE: &str = "builtin.module(func.func(convert-linalg-to-loops),lower-affine,convert-scf-to-cf,expand-strided-metadata,finalize-memref-to-llvm,convert-math-to-llvm,convert-to-llvm,reconcile-unrealized-casts)";

/// The lowering of fused kernels ([`super::fused_source`]): [`PIPELINE`] after expanding
/// the bf16 conversions into integer arithmetic (round to nearest even, as the runtime's
/// narrowing), which LLVM would otherwise lower to library calls the JIT cannot resolve.
pub const FUSED_PIPELINE: &str = "builtin.module(func.func(arith-expand{include-bf16=true},convert-linalg-to-loops),lower-affine,convert-scf-to-cf,expand-strided-metadata,finalize-memref-to-llvm,convert-math-to-llvm,convert-to-llvm,reconcile-unrealized-casts)";

/// Why a module could not be compiled or called.
#[derive(Debug, thiserror::Error)]
pub enum JitError {
    /// The source did not parse, verify or lower.
    #[error("cannot compile the module ({stage}): {message}")]
    Compile {
        /// Which step failed.
        stage: &'static str,
        /// MLIR's message.
        message: String,
    },
    /// The call's arguments do not match the function.
    #[error("{0}")]
    Arguments(String),
    /// The engine could not run the function.
    #[error("calling `{0}` failed")]
    Call(String),
}

/// A compiled module.
pub struct Jit {
    engine: ExecutionEngine,
    arena_bytes: [u64; 5],
    extras: usize,
    // The engine holds its own LLVM module; the MLIR context stays alive beside it.
    _context: Context,
}

/// A rank-1 memref's descriptor, as the C interface passes it.
#[repr(C)]
struct Descriptor {
    allocated: *mut u8,
    aligned: *mut u8,
    offset: i64,
    size: i64,
    stride: i64,
}

impl Jit {
    /// Compile `source` (from [`super::function_source`]: functions on arenas of
    /// `arena_bytes`, each taking `extras` extra `index` arguments, with their C interface).
    pub fn compile(source: &str, arena_bytes: [u64; 5], extras: usize) -> Result<Jit, JitError> {
        Self::compile_with(source, PIPELINE, arena_bytes, extras)
    }

    /// [`Jit::compile`] with the lowering `pipeline` (MLIR's textual pass pipeline).
    pub fn compile_with(
        source: &str,
        pipeline: &str,
        arena_bytes: [u64; 5],
        extras: usize,
    ) -> Result<Jit, JitError> {
        let context = super::verify::context();
        register_all_llvm_translations(&context);
        register_all_passes();
        super::verify::canonical_in(&context, source)
            .map_err(|(stage, message)| JitError::Compile { stage, message })?;
        let mut module = Module::parse(&context, source).ok_or(JitError::Compile {
            stage: "parse",
            message: String::new(),
        })?;
        let pm = PassManager::new(&context);
        parse_pass_pipeline(pm.as_operation_pass_manager(), pipeline).map_err(|e| {
            JitError::Compile {
                stage: "pipeline",
                message: e.to_string(),
            }
        })?;
        pm.run(&mut module).map_err(|e| JitError::Compile {
            stage: "lower",
            message: e.to_string(),
        })?;
        if !module.as_operation().verify() {
            return Err(JitError::Compile {
                stage: "verify after lowering",
                message: String::new(),
            });
        }
        let engine = ExecutionEngine::new(&module, 2, &[], false, false);
        Ok(Jit {
            engine,
            arena_bytes,
            extras,
            _context: context,
        })
    }

    /// Call function `name` on `arenas` (param, grad, opt_state, activation, input; each
    /// at least the module's size) and `extras` (its extra `index` arguments).
    ///
    /// The function reads and writes only inside its arenas when the module came from a
    /// plan that passed the gate (`megac_ir::gate::CheckedPlan`), which proves every
    /// buffer inside its arena; the sizes are checked here.
    pub fn call(
        &self,
        name: &str,
        arenas: &mut [&mut [u8]; 5],
        extras: &[i64],
    ) -> Result<(), JitError> {
        for (i, a) in arenas.iter().enumerate() {
            if (a.len() as u64) < self.arena_bytes[i] {
                return Err(JitError::Arguments(format!(
                    "arena {i} holds {} bytes, the module's holds {}",
                    a.len(),
                    self.arena_bytes[i]
                )));
            }
        }
        if extras.len() != self.extras {
            return Err(JitError::Arguments(format!(
                "`{name}` takes {} extra arguments, not {}",
                self.extras,
                extras.len()
            )));
        }
        let mut descs: Vec<Descriptor> = arenas
            .iter_mut()
            .zip(self.arena_bytes)
            .map(|(a, n)| Descriptor {
                allocated: a.as_mut_ptr(),
                aligned: a.as_mut_ptr(),
                offset: 0,
                size: n as i64,
                stride: 1,
            })
            .collect();
        let mut desc_ptrs: Vec<*mut Descriptor> =
            descs.iter_mut().map(|d| d as *mut Descriptor).collect();
        let mut extra_vals: Vec<i64> = extras.to_vec();
        let mut args: Vec<*mut ()> = desc_ptrs
            .iter_mut()
            .map(|p| p as *mut *mut Descriptor as *mut ())
            .collect();
        args.extend(extra_vals.iter_mut().map(|v| v as *mut i64 as *mut ()));
        // SAFETY: every argument points at a live value of the type the C interface takes
        // (a descriptor pointer per arena, an i64 per index); the descriptors describe the
        // caller's arenas, which are at least as large as the module's types say.
        unsafe { self.engine.invoke_packed(name, &mut args) }
            .map_err(|_| JitError::Call(name.to_string()))
    }

    /// Call function `name` of a fused kernel ([`super::fused_source`]) on its buffers:
    /// each a (pointer, elements) pair, in the function's argument order.
    ///
    /// # Safety
    /// Each pointer must be valid for reads and writes of its count of elements of the
    /// type the function's argument has, and stay so during the call; buffers the
    /// function writes must not be accessed by anything else meanwhile.
    pub unsafe fn call_buffers(
        &self,
        name: &str,
        buffers: &[(*mut u8, i64)],
    ) -> Result<(), JitError> {
        let mut descs: Vec<Descriptor> = buffers
            .iter()
            .map(|&(p, n)| Descriptor {
                allocated: p,
                aligned: p,
                offset: 0,
                size: n,
                stride: 1,
            })
            .collect();
        let mut desc_ptrs: Vec<*mut Descriptor> =
            descs.iter_mut().map(|d| d as *mut Descriptor).collect();
        let mut args: Vec<*mut ()> = desc_ptrs
            .iter_mut()
            .map(|p| p as *mut *mut Descriptor as *mut ())
            .collect();
        // SAFETY: every argument points at a live descriptor pointer, as the C interface
        // takes them; the caller guarantees the buffers they describe.
        unsafe { self.engine.invoke_packed(name, &mut args) }
            .map_err(|_| JitError::Call(name.to_string()))
    }
}
