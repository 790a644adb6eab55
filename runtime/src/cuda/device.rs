//! The cuda executor: runs one rank's lowered programs ([`super::lower`]) on a GPU. It owns
//! the CUDA context and stream, the one device allocation ([`super::slab::SlabLayout`]),
//! the kernels compiled by NVRTC and loaded by the driver, and a cuBLAS handle; every
//! decision (which kernel, launch shape, GEMM arguments, staging) was made by the tested
//! host-side lowering, so this only resolves addresses and issues calls.
//!
//! Not run on a GPU yet (no machine was available); without a driver it is never reached:
//! [`check_libraries`] fails first with the library names it looked for. Multi-rank plans
//! need NCCL communicators ([`CudaExecutor::with_nccl`], from a unique id the caller shares
//! between the ranks); the MPI broadcast of that id and a multi-rank run around it are not
//! built, so nothing calls it yet.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::sys as cublas_sys;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use megac_ir::gate::CheckedPlan;
use megac_ir::plan::{BufId, BufferClass, Plan};

use super::gemm::Operand;
use super::lower::{self, Arg, DeviceOp, Lowered};
use super::moe::{self, Route, Table};
use super::nccl::{Communicators, NcclComms};
use super::slab::SlabLayout;
use super::CudaError;
use crate::exec::StepContext;
use crate::memory::Memory;

/// Check, before any call into them, that the CUDA driver, NVRTC and cuBLAS (and NCCL when
/// `nccl`) can be loaded; cudarc panics on a missing library, so this is the only way to a
/// clear error.
pub fn check_libraries(nccl: bool) -> Result<(), CudaError> {
    // SAFETY: each only tries to open its library.
    let present = [
        ("CUDA driver", "cuda", unsafe { cudarc::driver::sys::is_culib_present() }, "install the NVIDIA driver (libcuda.so.1), or run with --device cpu"),
        ("NVRTC", "nvrtc", unsafe { cudarc::nvrtc::sys::is_culib_present() }, "pip install nvidia-cuda-nvrtc==13.0.88 and put its nvidia/cu13/lib on LD_LIBRARY_PATH"),
        ("cuBLAS", "cublas", unsafe { cublas_sys::is_culib_present() }, "pip install nvidia-cublas (CUDA 13) and put its lib folder on LD_LIBRARY_PATH"),
        ("NCCL", "nccl", !nccl || unsafe { cudarc::nccl::sys::is_culib_present() }, "pip install nvidia-nccl-cu13 and link libnccl.so -> libnccl.so.2 in a folder on LD_LIBRARY_PATH"),
    ];
    for (what, name, ok, hint) in present {
        if !ok {
            return Err(CudaError::Missing {
                what,
                looked_for: super::candidates(name),
                hint,
            });
        }
    }
    Ok(())
}

fn driver(e: cudarc::driver::DriverError) -> CudaError {
    CudaError::Driver(e.to_string())
}

fn cublas(e: cudarc::cublas::result::CublasError) -> CudaError {
    CudaError::Driver(format!("cuBLAS: {e:?}"))
}

/// Which program to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Program {
    /// Forward and backward of one micro-batch.
    Microbatch,
    /// The optimizer step.
    Optimizer,
}

/// A resolved kernel argument.
enum Val {
    U64(u64),
    U32(u32),
    I32(i32),
    I64(i64),
    F32(f32),
    F64(f64),
}

/// One rank's GPU state.
pub struct CudaExecutor {
    plan: Plan,
    stream: Arc<CudaStream>,
    // Kept alive for the stream, the allocation and the functions.
    _ctx: Arc<CudaContext>,
    functions: HashMap<&'static str, CudaFunction>,
    handle: cublas_sys::cublasHandle_t,
    alloc: CudaSlice<u8>,
    slab: SlabLayout,
    lowered: Lowered,
    staging: Vec<(BufId, u64)>,
    norm_cache: Option<(BufId, f32)>,
    rank: usize,
    /// The communicators and the communication stream (multi-rank plans).
    nccl: Option<(NcclComms, Arc<CudaStream>)>,
    /// `--profile`: op name -> (seconds, matmul FLOPs, calls), from CUDA events.
    profile: Option<std::collections::BTreeMap<&'static str, (f64, f64, u64)>>,
    /// Free device memory just after the context was made, before anything of the setup.
    free_at_context: usize,
}

impl CudaExecutor {
    /// Set up rank `rank` of `plan` on device `ordinal`: check the libraries, lower the
    /// role, allocate its slabs once, upload the constant tables, compile and load the
    /// kernels, make a cuBLAS handle on the stream.
    pub fn new(plan: &CheckedPlan, rank: usize, ordinal: usize) -> Result<Self, CudaError> {
        let world = plan.mesh.world_size();
        if world > 1 {
            check_libraries(true)?;
            return Err(CudaError::Unsupported(format!(
                "a plan of {world} ranks needs NCCL communicators (CudaExecutor::with_nccl, \
                 from a unique id every rank shares); run it with --device cpu"
            )));
        }
        Self::setup(plan, rank, ordinal, None)
    }

    /// As [`CudaExecutor::new`] for rank `rank` of a plan of any size: after the setup, the
    /// NCCL communicators of the plan's groups from the world's unique id `id` (the same
    /// on every rank: rank 0's [`super::nccl::unique_id`], sent to the others), and a
    /// communication stream. Collectives over groups of more than one rank run there,
    /// ordered against the compute stream by events (the compute stream's work so far
    /// before the collective, the collective before the compute stream's next work).
    pub fn with_nccl(
        plan: &CheckedPlan,
        rank: usize,
        ordinal: usize,
        id: &[u8; 128],
    ) -> Result<Self, CudaError> {
        Self::setup(plan, rank, ordinal, Some(id))
    }

    fn setup(
        plan: &CheckedPlan,
        rank: usize,
        ordinal: usize,
        id: Option<&[u8; 128]>,
    ) -> Result<Self, CudaError> {
        check_libraries(id.is_some())?;
        let lowered =
            lower::lower_role(plan, rank).map_err(|e| CudaError::Unsupported(e.to_string()))?;
        let slab = SlabLayout::new(
            plan,
            rank,
            lowered.workspace_bytes + lowered.constants.len() as u64,
        )
        .map_err(|e| CudaError::Unsupported(e.to_string()))?;
        super::probe(ordinal)?;
        let ctx = CudaContext::new(ordinal).map_err(driver)?;
        let (free_at_context, _) = ctx.mem_get_info().map_err(driver)?;
        let stream = ctx.default_stream();
        let alloc = stream
            .alloc_zeros::<u8>(slab.total_bytes.max(1) as usize)
            .map_err(driver)?;
        let (major, minor) = ctx.compute_capability().map_err(driver)?;
        let arch = super::arch_for(major, minor);
        let mut functions = HashMap::new();
        for c in super::compile_kernels(arch)? {
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_src(c.ptx))
                .map_err(driver)?;
            for &k in c.kernels {
                let f = module
                    .load_function(k)
                    .map_err(|e| CudaError::Driver(format!("{}: {k}: {e}", c.file)))?;
                functions.insert(k, f);
            }
        }
        let handle = cudarc::cublas::result::create_handle().map_err(cublas)?;
        // SAFETY: a live handle and this context's stream.
        unsafe {
            cudarc::cublas::result::set_stream(handle, stream.cu_stream() as _).map_err(cublas)?;
        }
        let nccl = match id {
            Some(id) => {
                ctx.bind_to_thread().map_err(driver)?;
                let comms = NcclComms::init(&Communicators::of_plan(plan), rank, id)?;
                Some((comms, ctx.new_stream().map_err(driver)?))
            }
            None => None,
        };
        let exec = CudaExecutor {
            rank,
            nccl,
            profile: None,
            plan: (**plan).clone(),
            stream,
            _ctx: ctx,
            functions,
            handle,
            alloc,
            slab,
            lowered,
            staging: Vec::new(),
            norm_cache: None,
            free_at_context,
        };
        let constants = exec.lowered.constants.clone();
        if !constants.is_empty() {
            let at = exec.constants_base();
            // SAFETY: the constants region lies inside the allocation (SlabLayout sized it).
            unsafe {
                cudarc::driver::result::memcpy_htod_async(at, &constants, exec.stream.cu_stream())
                    .map_err(driver)?;
            }
        }
        Ok(exec)
    }

    /// Bytes of the device allocation.
    pub fn device_bytes(&self) -> u64 {
        self.slab.total_bytes
    }

    fn base(&self) -> u64 {
        let (ptr, _sync) = self.alloc.device_ptr(&self.stream);
        ptr
    }

    fn workspace_base(&self) -> u64 {
        self.base() + self.slab.workspace.start
    }

    fn constants_base(&self) -> u64 {
        self.workspace_base() + self.lowered.workspace_bytes
    }

    /// The storage address of buffer `b`.
    fn raw(&self, b: BufId) -> Result<u64, CudaError> {
        self.slab
            .offset(b)
            .map(|o| self.base() + o)
            .ok_or_else(|| CudaError::Unsupported(format!("buffer {b} is not held by this rank")))
    }

    /// The f32 view of buffer `b`: its staged copy if the current instruction staged it.
    fn f32_addr(&self, b: BufId) -> Result<u64, CudaError> {
        match self.staging.iter().find(|(id, _)| *id == b) {
            Some(&(_, at)) => Ok(self.base() + self.slab.staging.start + at * 4),
            None => self.raw(b),
        }
    }

    fn operand(&self, o: Operand, ins: &[BufId], outs: &[BufId]) -> Result<u64, CudaError> {
        match o {
            Operand::Input(i) => self.f32_addr(ins[i]),
            Operand::Output(i) => self.f32_addr(outs[i]),
            Operand::Workspace(e) => Ok(self.workspace_base() + e as u64 * 4),
        }
    }

    fn resolve(&self, a: &Arg, ctx: &StepContext) -> Result<Val, CudaError> {
        Ok(match a {
            Arg::Buf(b) => Val::U64(self.f32_addr(*b)?),
            Arg::Raw(b) => Val::U64(self.raw(*b)?),
            Arg::Work(o) => Val::U64(self.workspace_base() + o),
            Arg::Const(o) => Val::U64(self.constants_base() + o),
            Arg::Null => Val::U64(0),
            Arg::U32(x) => Val::U32(*x),
            Arg::U64(x) => Val::U64(*x),
            Arg::I32(x) => Val::I32(*x),
            Arg::I64(x) => Val::I64(*x),
            Arg::F32(x) => Val::F32(*x),
            Arg::F64(x) => Val::F64(*x),
            Arg::LossGradScale => {
                Val::F32((ctx.loss_scale / self.plan.batch.tokens_per_step as f64) as f32)
            }
            Arg::LossScale => Val::F64(ctx.loss_scale),
        })
    }

    fn launch(&self, name: &str, l: super::launch::Launch, vals: &[Val]) -> Result<(), CudaError> {
        let f = self
            .functions
            .get(name)
            .ok_or_else(|| CudaError::Driver(format!("kernel {name} was not loaded")))?;
        let mut b = self.stream.launch_builder(f);
        for v in vals {
            match v {
                Val::U64(x) => b.arg(x),
                Val::U32(x) => b.arg(x),
                Val::I32(x) => b.arg(x),
                Val::I64(x) => b.arg(x),
                Val::F32(x) => b.arg(x),
                Val::F64(x) => b.arg(x),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: l.grid,
            block_dim: (l.block, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the lowering gave the kernel its declared parameters in order, with
        // addresses inside the allocation (the slab layout holds every buffer the role
        // touches, the workspace and constants are sized by the lowering).
        unsafe { b.launch(cfg) }.map_err(driver)?;
        Ok(())
    }

    /// Run `program` (issued on the stream; returns after the last op is issued, or, when
    /// profiling, after the stream finished it).
    pub fn run(&mut self, program: Program, ctx: &StepContext) -> Result<(), CudaError> {
        let ops = match program {
            Program::Microbatch => std::mem::take(&mut self.lowered.microbatch),
            Program::Optimizer => std::mem::take(&mut self.lowered.optimizer),
        };
        self.norm_cache = None;
        let out = if self.profile.is_some() {
            self.run_timed(program, &ops, ctx)
        } else {
            ops.iter().try_for_each(|op| self.issue(op, ctx))
        };
        match program {
            Program::Microbatch => self.lowered.microbatch = ops,
            Program::Optimizer => self.lowered.optimizer = ops,
        }
        out
    }

    /// As `run`, with a CUDA event recorded on the compute stream where each instruction
    /// begins and after the last; the time between consecutive events is the instruction's
    /// (its collectives on the communication stream included, as the compute stream waits
    /// for them), added to the profile by op name.
    fn run_timed(
        &mut self,
        program: Program,
        ops: &[DeviceOp],
        ctx: &StepContext,
    ) -> Result<(), CudaError> {
        let marks = match program {
            Program::Microbatch => self.lowered.microbatch_marks.clone(),
            Program::Optimizer => self.lowered.optimizer_marks.clone(),
        };
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut events = Vec::with_capacity(marks.len() + 1);
        for (i, m) in marks.iter().enumerate() {
            let end = marks.get(i + 1).map_or(ops.len(), |n| n.start);
            events.push(self.stream.record_event(timing).map_err(driver)?);
            for op in &ops[m.start..end] {
                self.issue(op, ctx)?;
            }
        }
        events.push(self.stream.record_event(timing).map_err(driver)?);
        self.stream.synchronize().map_err(driver)?;
        let by_op = self.profile.get_or_insert_with(Default::default);
        for (i, m) in marks.iter().enumerate() {
            let ms = events[i].elapsed_ms(&events[i + 1]).map_err(driver)?;
            let e = by_op.entry(m.name).or_default();
            e.0 += f64::from(ms) / 1e3;
            e.1 += m.flops;
            e.2 += 1;
        }
        Ok(())
    }

    /// Time every instruction from now on with CUDA events (`--profile`).
    pub fn enable_profile(&mut self) {
        self.profile.get_or_insert_with(Default::default);
    }

    /// The per-op times so far (None unless [`CudaExecutor::enable_profile`] was called),
    /// as the cpu backend's profile: op name -> (seconds, matmul FLOPs, calls).
    pub fn profile(&self) -> Option<crate::exec::Profile> {
        self.profile.as_ref().map(|by_op| crate::exec::Profile {
            by_op: by_op.clone(),
            ..Default::default()
        })
    }

    fn issue(&mut self, op: &DeviceOp, ctx: &StepContext) -> Result<(), CudaError> {
        let s = self.stream.cu_stream();
        match op {
            DeviceOp::Stage(entries) => self.staging = entries.clone(),
            DeviceOp::Kernel { name, launch, args } => {
                let vals = args
                    .iter()
                    .map(|a| self.resolve(a, ctx))
                    .collect::<Result<Vec<_>, _>>()?;
                self.launch(name, *launch, &vals)?;
            }
            DeviceOp::Gemm {
                call,
                inputs,
                outputs,
            } => {
                // A and B from their 16-bit storage when both are 16-bit inputs (tensor
                // cores), else from their f32 views; C always its f32 view.
                let half = lower::gemm_half(call, inputs, outputs, &self.plan);
                let ab = |o: (Operand, usize)| -> Result<u64, CudaError> {
                    match (half, o.0) {
                        (Some(_), Operand::Input(i)) => Ok(self.raw(inputs[i])? + o.1 as u64 * 2),
                        _ => Ok(self.operand(o.0, inputs, outputs)? + o.1 as u64 * 4),
                    }
                };
                let a = ab(call.a)?;
                let b = ab(call.b)?;
                let c = self.operand(call.c.0, inputs, outputs)? + call.c.1 as u64 * 4;
                let op = |t: bool| {
                    if t {
                        cublas_sys::cublasOperation_t::CUBLAS_OP_T
                    } else {
                        cublas_sys::cublasOperation_t::CUBLAS_OP_N
                    }
                };
                let f32t = cublas_sys::cudaDataType::CUDA_R_32F;
                let abt = match half {
                    Some(megac_kernels::Half::Bf16) => cublas_sys::cudaDataType::CUDA_R_16BF,
                    Some(megac_kernels::Half::F16) => cublas_sys::cudaDataType::CUDA_R_16F,
                    None => f32t,
                };
                let (alpha, beta) = (call.alpha, call.beta);
                // SAFETY: addresses inside the allocation; `GemmCall::valid` holds for every
                // mapping (tested); host scalars outlive the call.
                unsafe {
                    cudarc::cublas::result::gemm_strided_batched_ex(
                        self.handle,
                        op(call.transa),
                        op(call.transb),
                        call.m as i32,
                        call.n as i32,
                        call.k as i32,
                        (&alpha as *const f32).cast(),
                        a as *const _,
                        abt,
                        call.lda as i32,
                        call.strides.0 as i64,
                        b as *const _,
                        abt,
                        call.ldb as i32,
                        call.strides.1 as i64,
                        (&beta as *const f32).cast(),
                        c as *mut _,
                        f32t,
                        call.ldc as i32,
                        call.strides.2 as i64,
                        call.batch as i32,
                        cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                    .map_err(cublas)?;
                }
            }
            DeviceOp::Route(route) => self.route(route)?,
            DeviceOp::Zero(b) => {
                let buf = &self.plan.buffers[*b as usize];
                let bytes = (buf.len() * buf.dtype.size_bytes()) as usize;
                let at = self.raw(*b)?;
                // SAFETY: the buffer's storage lies inside the allocation.
                unsafe { cudarc::driver::result::memset_d8_async(at, 0, bytes, s) }
                    .map_err(driver)?;
            }
            DeviceOp::ZeroWork { offset, bytes } => {
                let at = self.workspace_base() + offset;
                // SAFETY: inside the workspace the lowering sized.
                unsafe { cudarc::driver::result::memset_d8_async(at, 0, *bytes as usize, s) }
                    .map_err(driver)?;
            }
            DeviceOp::Copy { dst, src, bytes } => {
                let (Val::U64(d), Val::U64(f)) = (self.resolve(dst, ctx)?, self.resolve(src, ctx)?)
                else {
                    return Err(CudaError::Driver("a copy between non-addresses".into()));
                };
                // SAFETY: both ranges lie inside the allocation.
                unsafe { cudarc::driver::result::memcpy_dtod_async(d, f, *bytes as usize, s) }
                    .map_err(driver)?;
            }
            // A group of more than one rank: NCCL on the communication stream.
            DeviceOp::AllReduce { axes, .. }
            | DeviceOp::AllGather { axes, .. }
            | DeviceOp::ReduceScatter { axes, .. }
                if self.plan.mesh.group(self.rank, axes).len() > 1 =>
            {
                self.collective(op, ctx)?
            }
            // A group of this rank alone: an all-reduce is the identity, a gather or scatter
            // a copy.
            DeviceOp::AllReduce { .. } => {}
            DeviceOp::AllGather {
                send, recv, count, ..
            }
            | DeviceOp::ReduceScatter {
                send, recv, count, ..
            } => {
                if send != recv {
                    self.issue(
                        &DeviceOp::Copy {
                            dst: recv.clone(),
                            src: send.clone(),
                            bytes: count * 4,
                        },
                        ctx,
                    )?;
                }
            }
            DeviceOp::AdamW {
                p,
                g,
                m,
                v,
                n,
                norm,
                beta1,
                beta2,
                eps,
                weight_decay,
                max_norm,
                working,
            } => {
                let value = match self.norm_cache {
                    Some((b, x)) if b == *norm => x,
                    _ => {
                        let mut x = [0f32];
                        // SAFETY: a 4-byte f32 buffer inside the allocation.
                        unsafe {
                            cudarc::driver::result::memcpy_dtoh_async(&mut x, self.raw(*norm)?, s)
                                .map_err(driver)?;
                        }
                        self.stream.synchronize().map_err(driver)?;
                        self.norm_cache = Some((*norm, x[0]));
                        x[0]
                    }
                };
                if !value.is_finite() {
                    return Ok(());
                }
                let mut clip = (1.0 / ctx.loss_scale) as f32;
                if *max_norm > 0.0 {
                    let coef = max_norm / (value + 1e-6);
                    if coef < 1.0 {
                        clip *= coef;
                    }
                }
                let k = megac_kernels::step_scalars(
                    &megac_kernels::AdamW {
                        lr: ctx.lr as f32,
                        beta1: *beta1,
                        beta2: *beta2,
                        eps: *eps,
                        weight_decay: *weight_decay,
                    },
                    ctx.step,
                );
                let vals = [
                    Val::U64(self.raw(*p)?),
                    Val::U64(self.raw(*g)?),
                    Val::U64(self.raw(*m)?),
                    Val::U64(self.raw(*v)?),
                    Val::U64(*n),
                    Val::F32(clip),
                    Val::F32(if k.apply_decay { k.decay } else { 1.0 }),
                    Val::F32(k.w1),
                    Val::I32(k.w1_small as i32),
                    Val::F32(k.w2),
                    Val::F32(k.beta2),
                    Val::F32(k.bc2_sqrt),
                    Val::F32(k.eps),
                    Val::F32(k.neg_step_size),
                ];
                let l = super::launch::elementwise(*n)
                    .map_err(|e| CudaError::Unsupported(e.to_string()))?;
                self.launch("adamw_step", l, &vals)?;
                if let Some((w, half)) = working {
                    let name = match half {
                        megac_kernels::Half::Bf16 => "cast_f32_to_bf16",
                        megac_kernels::Half::F16 => "cast_f32_to_f16",
                    };
                    let vals = [
                        Val::U64(self.raw(*p)?),
                        Val::U64(self.raw(*w)?),
                        Val::U64(*n),
                    ];
                    self.launch(name, l, &vals)?;
                }
            }
        }
        Ok(())
    }

    /// A collective over a group of several ranks through its NCCL communicator, on the
    /// communication stream: it waits for the compute stream's work so far (an event), and
    /// the compute stream waits for it (another).
    fn collective(&self, op: &DeviceOp, ctx: &StepContext) -> Result<(), CudaError> {
        use cudarc::nccl::sys;
        let (comms, cs) = self.nccl.as_ref().ok_or_else(|| {
            CudaError::Unsupported(
                "a collective over several ranks without NCCL communicators".into(),
            )
        })?;
        let addr = |a: &Arg| match self.resolve(a, ctx)? {
            Val::U64(x) => Ok(x),
            _ => Err(CudaError::Driver(
                "a collective's buffer is not an address".into(),
            )),
        };
        let comm_of = |axes: &[megac_ir::Axis]| {
            comms.get(axes).ok_or_else(|| {
                CudaError::Unsupported(format!("no NCCL communicator over {axes:?}"))
            })
        };
        cs.join(&self.stream).map_err(driver)?;
        let stream = cs.cu_stream() as sys::cudaStream_t;
        let check = |what: &str, r: sys::ncclResult_t| {
            if r == sys::ncclResult_t::ncclSuccess {
                Ok(())
            } else {
                Err(CudaError::Driver(format!("NCCL {what}: {r:?}")))
            }
        };
        // SAFETY: addresses inside the allocation with `count` elements (per member) as the
        // lowering sized them; the communicators are live.
        unsafe {
            match op {
                DeviceOp::AllReduce {
                    axes,
                    buf,
                    count,
                    f64,
                    op: red,
                } => {
                    let p = addr(buf)?;
                    let dt = if *f64 {
                        sys::ncclDataType_t::ncclFloat64
                    } else {
                        sys::ncclDataType_t::ncclFloat32
                    };
                    let red = match red {
                        lower::Reduce::Sum => sys::ncclRedOp_t::ncclSum,
                        lower::Reduce::Max => sys::ncclRedOp_t::ncclMax,
                    };
                    let r = sys::ncclAllReduce(
                        p as *const _,
                        p as *mut _,
                        *count as usize,
                        dt,
                        red,
                        comm_of(axes)?,
                        stream,
                    );
                    check("ncclAllReduce", r)?;
                }
                DeviceOp::AllGather {
                    axes,
                    send,
                    recv,
                    count,
                } => {
                    let r = sys::ncclAllGather(
                        addr(send)? as *const _,
                        addr(recv)? as *mut _,
                        *count as usize,
                        sys::ncclDataType_t::ncclFloat32,
                        comm_of(axes)?,
                        stream,
                    );
                    check("ncclAllGather", r)?;
                }
                DeviceOp::ReduceScatter {
                    axes,
                    send,
                    recv,
                    count,
                } => {
                    let r = sys::ncclReduceScatter(
                        addr(send)? as *const _,
                        addr(recv)? as *mut _,
                        *count as usize,
                        sys::ncclDataType_t::ncclFloat32,
                        sys::ncclRedOp_t::ncclSum,
                        comm_of(axes)?,
                        stream,
                    );
                    check("ncclReduceScatter", r)?;
                }
                _ => return Err(CudaError::Driver("not a collective".into())),
            }
        }
        self.stream.join(cs).map_err(driver)
    }

    /// [`DeviceOp::Route`]: the indices to the host (waits for the stream), the routing and
    /// its tables built there ([`super::moe`]), the tables into the workspace.
    fn route(&self, route: &Route) -> Result<(), CudaError> {
        let s = self.stream.cu_stream();
        let n = self.plan.buffers[route.indices as usize].len() as usize;
        let mut indices = vec![0i32; n];
        // SAFETY: the i32 buffer's storage lies inside the allocation.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut indices, self.raw(route.indices)?, s)
                .map_err(driver)?;
        }
        self.stream.synchronize().map_err(driver)?;
        let r = route
            .routing(&indices)
            .map_err(|e| CudaError::Unsupported(e.to_string()))?;
        for table in &route.tables {
            let (at, bytes): (u64, Vec<u8>) = match table {
                Table::Sources { first, count, at } => (
                    self.workspace_base() + at,
                    le_bytes(&moe::sources(&r, *first, *count, route.rows)),
                ),
                Table::Rows { first, count, at } => (
                    self.workspace_base() + at,
                    le_bytes(&moe::rows(&r, *first, *count, route.rows)),
                ),
                Table::Counts { buf } => (self.raw(*buf)?, le_bytes(&moe::counts(&r))),
                Table::Addresses { bufs, h, at } => {
                    let bases = bufs
                        .iter()
                        .map(|&b| self.f32_addr(b))
                        .collect::<Result<Vec<_>, _>>()?;
                    // One buffer for several experts is the stacked [E, rows, h] (for one
                    // expert both readings are the same).
                    let stacked = bufs.len() == 1 && r.experts() > 1;
                    let addrs: Vec<u64> = moe::addresses(&r, stacked, route.rows, *h)
                        .into_iter()
                        .map(|a| a.map_or(0, |(b, off)| bases[b] + off * 4))
                        .collect();
                    let mut bytes = Vec::with_capacity(addrs.len() * 8);
                    for a in addrs {
                        bytes.extend_from_slice(&a.to_le_bytes());
                    }
                    (self.workspace_base() + at, bytes)
                }
            };
            if !bytes.is_empty() {
                // SAFETY: the lowering sized the table's region for these bytes.
                unsafe { cudarc::driver::result::memcpy_htod_async(at, &bytes, s) }
                    .map_err(driver)?;
            }
        }
        // The tables are host memory that goes out of scope here.
        self.stream.synchronize().map_err(driver)
    }

    /// Copy every arena of the host memory `mem` (initialised parameters, zeroed state)
    /// into the slabs.
    pub fn upload(&self, mem: &Memory) -> Result<(), CudaError> {
        for class in [
            BufferClass::Param,
            BufferClass::Grad,
            BufferClass::OptState,
            BufferClass::Activation,
            BufferClass::Input,
        ] {
            let host = mem.arena_bytes(class);
            let region = self.slab.slabs[class.index()];
            let n = host.len().min(region.bytes as usize);
            if n > 0 {
                // SAFETY: `n` bytes fit the slab (the same layout sized both).
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(
                        self.base() + region.start,
                        &host[..n],
                        self.stream.cu_stream(),
                    )
                    .map_err(driver)?;
                }
            }
        }
        self.stream.synchronize().map_err(driver)
    }

    /// Copy the slabs of `classes` back into the host memory `mem` (the trained parameters
    /// and master weights before saving); waits for the stream.
    pub fn download(&self, mem: &mut Memory, classes: &[BufferClass]) -> Result<(), CudaError> {
        for &class in classes {
            let region = self.slab.slabs[class.index()];
            let host = mem.arena_bytes_mut(class);
            let n = host.len().min(region.bytes as usize);
            if n > 0 {
                // SAFETY: `n` bytes lie inside the slab (the same layout sized both).
                unsafe {
                    cudarc::driver::result::memcpy_dtoh_async(
                        &mut host[..n],
                        self.base() + region.start,
                        self.stream.cu_stream(),
                    )
                    .map_err(driver)?;
                }
                self.stream.synchronize().map_err(driver)?;
            }
        }
        Ok(())
    }

    /// Zero the whole slab of `class` (every gradient at the start of a step, as the cpu
    /// backend's `Memory::zero_grads`).
    pub fn zero_class(&self, class: BufferClass) -> Result<(), CudaError> {
        let region = self.slab.slabs[class.index()];
        if region.bytes == 0 {
            return Ok(());
        }
        // SAFETY: the slab lies inside the allocation.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                self.base() + region.start,
                0,
                region.bytes as usize,
                self.stream.cu_stream(),
            )
        }
        .map_err(driver)
    }

    /// Zero buffer `b` if this rank holds it (the gradients at the start of a step).
    pub fn zero(&mut self, b: BufId) -> Result<(), CudaError> {
        if self.slab.offset(b).is_none() {
            return Ok(());
        }
        let ctx = StepContext {
            step: 1,
            lr: 0.0,
            microbatch: 0,
            loss_scale: 1.0,
        };
        self.issue(&DeviceOp::Zero(b), &ctx)
    }

    /// Write i32 values into buffer `b` (token ids, labels).
    pub fn write_i32(&self, b: BufId, values: &[i32]) -> Result<(), CudaError> {
        // SAFETY: the buffer's storage lies inside the allocation, `values` fits it (the
        // caller passes the buffer's own length).
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                self.raw(b)?,
                values,
                self.stream.cu_stream(),
            )
            .map_err(driver)?;
        }
        Ok(())
    }

    /// Read the f32 buffer `b` (waits for the stream).
    pub fn read_f32(&self, b: BufId) -> Result<Vec<f32>, CudaError> {
        let n = self.plan.buffers[b as usize].len() as usize;
        let mut out = vec![0f32; n];
        // SAFETY: the buffer's storage lies inside the allocation.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                &mut out,
                self.raw(b)?,
                self.stream.cu_stream(),
            )
            .map_err(driver)?;
        }
        self.stream.synchronize().map_err(driver)?;
        Ok(out)
    }

    /// Free device memory as the driver reports it, and the total (cudaMemGetInfo).
    pub fn mem_info(&self) -> Result<(usize, usize), CudaError> {
        self._ctx.mem_get_info().map_err(driver)
    }

    /// Free device memory lost since the context was made (`cudaMemGetInfo`): what this
    /// rank holds on the device now (the allocation, the kernels' modules, cuBLAS's and
    /// NCCL's memory), and the device's total.
    pub fn held_bytes(&self) -> Result<(u64, u64), CudaError> {
        let (free, total) = self.mem_info()?;
        Ok((
            self.free_at_context.saturating_sub(free) as u64,
            total as u64,
        ))
    }
}

impl Drop for CudaExecutor {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `new` and is destroyed once.
        unsafe {
            let _ = cudarc::cublas::result::destroy_handle(self.handle);
        }
    }
}

/// Little-endian bytes of i32 values (a table for the device).
fn le_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
