//! The CUDA side as far as a machine without a GPU can check it: every kernel of
//! kernels/cuda/ compiles with NVRTC for the architectures megac targets, and `--device cuda`
//! without a driver is one clear error. (`scripts/test.sh` installs NVRTC from PyPI and sets
//! `MEGAC_REQUIRE_NVRTC`, so CI cannot skip the compile check.) On a machine with a GPU,
//! `bench/device/cuda_check.sh` also has the driver load every kernel.
#![cfg(feature = "cuda")]

use std::process::Command;

use megac_runtime::cuda;

#[test]
fn every_kernel_compiles_with_nvrtc() {
    if !cuda::nvrtc_present() {
        assert!(
            std::env::var_os("MEGAC_REQUIRE_NVRTC").is_none(),
            "MEGAC_REQUIRE_NVRTC is set but libnvrtc.so.13 cannot be loaded (LD_LIBRARY_PATH?)"
        );
        eprintln!("NVRTC not found: the kernels were not compiled (scripts/test.sh installs it)");
        return;
    }
    for arch in ["compute_80", "compute_90"] {
        let compiled = cuda::compile_kernels(arch).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(compiled.len(), megac_kernels::cuda::SOURCES.len());
        for c in &compiled {
            let target = format!(".target sm_{}", &arch["compute_".len()..]);
            assert!(c.ptx.contains(&target), "{}: {arch}: no `{target}`", c.file);
            for k in c.kernels {
                assert!(
                    c.ptx.contains(&format!(".entry {k}(")),
                    "{}: {arch}: kernel {k} is not in the PTX",
                    c.file
                );
            }
        }
    }
}

#[test]
fn a_kernel_that_does_not_compile_is_named_with_nvrtcs_log() {
    if !cuda::nvrtc_present() {
        return;
    }
    let bad = megac_kernels::cuda::CudaSource {
        name: "bad.cu",
        source: "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }",
        kernels: &["k"],
    };
    let err = cudarc::nvrtc::compile_ptx(bad.program()).unwrap_err();
    assert!(format!("{err:?}").contains("undefined_name"), "{err:?}");
}

#[test]
fn device_cuda_without_a_driver_is_one_clear_error() {
    let driver = cuda::probe(0);
    let out = Command::new(env!("CARGO_BIN_EXE_megac"))
        .args([
            "train",
            "examples/llama-tiny.toml",
            "--device",
            "cuda",
            "--steps",
            "1",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    match driver {
        Err(e) => {
            assert!(stderr.contains("libcuda.so.1"), "{stderr}");
            assert!(stderr.contains(&e.to_string()), "{stderr}");
        }
        Ok(d) => assert!(stderr.contains(&d.name), "{stderr}"),
    }
}

#[test]
fn megac_run_of_a_plan_on_cuda_without_a_driver_is_one_clear_error() {
    if cuda::probe(0).is_ok() {
        return; // a GPU machine runs it (bench/gpu/check.sh)
    }
    let dir = tempfile::tempdir().unwrap();
    let plan_dir = dir.path().join("plan");
    let bin = env!("CARGO_BIN_EXE_megac");
    let root = env!("CARGO_MANIFEST_DIR");
    let st = Command::new(bin)
        .args(["compile", "examples/llama-tiny.toml", "-o"])
        .arg(&plan_dir)
        .current_dir(root)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    for extra in [&[][..], &["--save-params", "x.safetensors"][..]] {
        let out = Command::new(bin)
            .arg("run")
            .arg(&plan_dir)
            .args(["--device", "cuda", "--steps", "2"])
            .args(extra)
            .current_dir(dir.path())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(
            stderr.starts_with("error: --device cuda: no CUDA driver library found")
                && stderr.contains("libcuda.so.1"),
            "{stderr}"
        );
        assert!(out.stdout.is_empty(), "nothing ran");
    }
}

/// On a machine with a GPU (`bench/device/cuda_check.sh`): the driver loads every compiled
/// kernel for the device's architecture.
#[test]
#[ignore = "needs a CUDA GPU: bench/device/cuda_check.sh"]
fn every_kernel_loads_on_the_device() {
    let check = cuda::check_on_device(0).unwrap_or_else(|e| panic!("{e}"));
    let kernels: usize = megac_kernels::cuda::SOURCES
        .iter()
        .map(|s| s.kernels.len())
        .sum();
    assert_eq!(check.kernels_loaded, kernels);
    println!(
        "{} ({} device(s)): {} kernels loaded for {}",
        check.device.name, check.device.count, check.kernels_loaded, check.arch
    );
}

// ---- host-side logic of the cuda backend, against the cpu backend's meaning ----

use megac_ir::gate::CheckedPlan;
use megac_ir::plan::{BufferClass, Plan};
use megac_runtime::cuda::lower::{self, Arg, DeviceOp};
use megac_runtime::cuda::nccl::Communicators;
use megac_runtime::cuda::slab::{SlabLayout, SLAB_ALIGN};

/// The plan of examples/`file` with `sets` (a small batch), gated.
fn plan(file: &str, sets: &[&str]) -> CheckedPlan {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(file);
    let mut all = vec![
        "train.micro_batch=2",
        "train.global_batch=4",
        "model.seq_len=16",
    ];
    all.extend_from_slice(sets);
    let all: Vec<String> = all.iter().map(|s| s.to_string()).collect();
    let spec = megac_frontend::load(&path, &all).unwrap_or_else(|e| panic!("{}", e.render()));
    let flops = megac_passes::flops::step_flops(&spec).total;
    let module = megac_passes::run_pipeline(spec, None, true).unwrap();
    let p = megac_codegen::emit_plan(&module.spec, module.graph.as_ref().unwrap(), flops)
        .unwrap_or_else(|e| panic!("{file} {sets:?}: {e}"));
    Plan::from_json(&p.to_json()).unwrap()
}

/// The layouts the host-side tests cover.
fn layouts() -> Vec<(&'static str, Vec<&'static str>)> {
    vec![
        ("llama-tiny.toml", vec![]),
        ("llama-tiny.toml", vec!["train.precision=\"bf16\""]),
        ("gpt-tiny.toml", vec![]),
        ("moe-tiny.toml", vec![]),
        ("llama-tiny.toml", vec!["parallel.tp=2", "parallel.dp=2"]),
        (
            "llama-tiny.toml",
            vec!["parallel.tp=2", "parallel.sequence_parallel=true"],
        ),
        (
            "llama-tiny.toml",
            vec!["parallel.dp=2", "parallel.distributed_optimizer=true"],
        ),
    ]
}

#[test]
fn device_slabs_hold_every_buffer_at_the_cpu_backends_offset() {
    for (file, sets) in layouts() {
        let plan = plan(file, &sets);
        for rank in 0..plan.mesh.world_size() {
            let slab = SlabLayout::new(&plan, rank, 1000).unwrap();
            let mem = megac_runtime::memory::Memory::new(&plan, rank).unwrap();
            let what = format!("{file} {sets:?} rank {rank}");
            // Slabs and regions: 256-aligned, in order, disjoint, inside the allocation.
            let mut regions: Vec<_> = slab.slabs.to_vec();
            regions.extend([slab.staging, slab.workspace]);
            let mut end = 0;
            for r in &regions {
                assert_eq!(r.start % SLAB_ALIGN, 0, "{what}");
                assert!(r.start >= end, "{what}: regions overlap");
                end = r.start + r.bytes;
            }
            assert!(end <= slab.total_bytes, "{what}");
            assert_eq!(slab.workspace.bytes, 1000);
            // Each arena's slab is the cpu arena's size (the cpu rounds up to 4-byte words).
            for (class, bytes) in mem.bytes().iter().enumerate() {
                let s = slab.slabs[class].bytes;
                assert_eq!(s.div_ceil(4) * 4, *bytes, "{what}: arena {class}");
            }
            // Every held buffer at its plan offset (bytes) inside its class's slab.
            for (id, b) in plan.buffers.iter().enumerate() {
                let Some(at) = slab.offset(id as u32) else {
                    assert!(
                        !mem.holds(id as u32),
                        "{what}: buffer {id} held on the cpu only"
                    );
                    continue;
                };
                assert!(mem.holds(id as u32), "{what}: buffer {id}");
                let region = slab.slabs[b.class.index()];
                let within = at - region.start;
                let bytes = b.len() * b.dtype.size_bytes();
                assert!(
                    within + bytes <= region.bytes,
                    "{what}: buffer {id} outside its slab"
                );
                if b.rank_offset.is_none() && b.chunk.is_none() {
                    assert_eq!(
                        within,
                        b.offset * b.dtype.size_bytes(),
                        "{what}: buffer {id}"
                    );
                }
            }
            let (aligned, held) = slab.aligned(SLAB_ALIGN);
            assert!(held > 0 && aligned <= held);
        }
    }
}

#[test]
fn nccl_communicators_are_the_plans_groups_in_group_order() {
    let p = plan("llama-tiny.toml", &["parallel.tp=2", "parallel.dp=2"]);
    let comms = Communicators::of_plan(&p);
    assert_eq!(comms.world, 4);
    let sets: Vec<_> = comms.splits.iter().map(|(a, _)| a.clone()).collect();
    use megac_ir::Axis;
    assert!(sets.contains(&vec![Axis::Tp]), "{sets:?}");
    assert!(sets.contains(&vec![Axis::Dp]), "{sets:?}");
    for (axes, groups) in &comms.splits {
        // A partition of the ranks, coloured in order, members sorted.
        let mut seen = vec![0; comms.world];
        for (i, g) in groups.iter().enumerate() {
            assert_eq!(g.color, i as i32);
            assert!(g.members.windows(2).all(|w| w[0] < w[1]), "{g:?}");
            for &m in &g.members {
                seen[m] += 1;
            }
        }
        assert!(seen.iter().all(|&n| n == 1), "{axes:?}: {seen:?}");
        // Each rank's communicator is the cpu backend's group (Mesh::group), NCCL rank =
        // position (the order local_comm and mpi_comm reduce in).
        for r in 0..comms.world {
            let g = comms.group_of(r, axes).unwrap();
            assert_eq!(g.members, p.mesh.group(r, axes), "{axes:?} rank {r}");
            assert_eq!(g.members[g.key(r).unwrap() as usize], r);
        }
    }
    // tp pairs neighbouring ranks, dp strides over them (tp is the fastest axis).
    assert_eq!(comms.group_of(0, &[Axis::Tp]).unwrap().members, vec![0, 1]);
    assert_eq!(comms.group_of(1, &[Axis::Dp]).unwrap().members, vec![1, 3]);
    // One rank: no communicator over a group larger than itself is needed.
    let single = Communicators::of_plan(&plan("llama-tiny.toml", &[]));
    for (_, groups) in &single.splits {
        assert!(groups.iter().all(|g| g.members.len() == 1));
    }
}

/// The parameters of every `extern "C"` kernel, as (name, C types).
fn kernel_signatures() -> std::collections::BTreeMap<String, Vec<String>> {
    let mut out = std::collections::BTreeMap::new();
    for s in megac_kernels::cuda::SOURCES {
        for part in s.source.split("extern \"C\" __global__ void ").skip(1) {
            let name = part.split('(').next().unwrap().trim().to_string();
            let params = part.split_once('(').unwrap().1.split_once(')').unwrap().0;
            let types = params
                .split(',')
                .map(|p| {
                    let p = p.trim();
                    let (ty, _name) = p.rsplit_once([' ', '*']).unwrap();
                    if p.contains('*') {
                        "ptr".to_string()
                    } else {
                        ty.trim().to_string()
                    }
                })
                .collect();
            out.insert(name, types);
        }
    }
    out
}

/// Whether a lowered argument passes as a kernel parameter of C type `ty`.
fn fits(a: &Arg, ty: &str) -> bool {
    match a {
        Arg::Buf(_) | Arg::Raw(_) | Arg::Work(_) | Arg::Const(_) | Arg::Null => ty == "ptr",
        Arg::U32(_) => ty == "unsigned int",
        Arg::U64(_) => ty == "unsigned long long",
        Arg::I32(_) => ty == "int",
        Arg::I64(_) => ty == "long long",
        Arg::F32(_) | Arg::LossGradScale => ty == "float",
        Arg::F64(_) | Arg::LossScale => ty == "double",
    }
}

#[test]
fn lowered_programs_call_kernels_with_their_declared_parameters() {
    let sigs = kernel_signatures();
    // adamw_step is issued by the executor from DeviceOp::AdamW with 14 arguments.
    assert_eq!(sigs["adamw_step"].len(), 14);
    for (file, sets) in [
        ("llama-tiny.toml", vec![]),
        ("llama-tiny.toml", vec!["train.precision=\"bf16\""]),
        ("gpt-tiny.toml", vec![]),
        ("moe-tiny.toml", vec![]),
        ("moe-tiny.toml", vec!["train.precision=\"bf16\""]),
        ("llama-tiny.toml", vec!["parallel.tp=2", "parallel.dp=2"]),
        (
            "llama-tiny.toml",
            vec!["parallel.tp=2", "parallel.sequence_parallel=true"],
        ),
    ] {
        let plan = plan(file, &sets);
        let what = format!("{file} {sets:?}");
        let l = lower::lower_role(&plan, 0).unwrap_or_else(|e| panic!("{what}: {e}"));
        let (mut kernels, mut gemms, mut stages, mut half_gemms) = (0, 0, 0, 0);
        for op in l.microbatch.iter().chain(&l.optimizer) {
            match op {
                DeviceOp::Kernel { name, launch, args } => {
                    kernels += 1;
                    let sig = sigs
                        .get(*name)
                        .unwrap_or_else(|| panic!("{what}: no kernel {name} in kernels/cuda"));
                    assert_eq!(args.len(), sig.len(), "{what}: {name}: {args:?}");
                    for (i, (a, ty)) in args.iter().zip(sig).enumerate() {
                        assert!(
                            fits(a, ty),
                            "{what}: {name} parameter {i} is {ty}, given {a:?}"
                        );
                    }
                    assert!(launch.block >= 1 && launch.block <= 1024, "{name}");
                    if launch.block > 1 {
                        assert_eq!(launch.block % 32, 0, "{name}");
                    }
                }
                DeviceOp::Gemm {
                    call,
                    inputs,
                    outputs,
                } => {
                    gemms += 1;
                    assert!(call.valid(), "{what}: {call:?}");
                    if let Some(h) = lower::gemm_half(call, inputs, outputs, &plan) {
                        half_gemms += 1;
                        // Both read from 16-bit inputs the instruction does not write.
                        for (o, _) in [call.a, call.b] {
                            let megac_runtime::cuda::gemm::Operand::Input(i) = o else {
                                panic!("{what}: a 16-bit GEMM operand that is not an input")
                            };
                            let b = inputs[i];
                            assert_eq!(lower::half_of(plan.buffers[b as usize].dtype), Some(h));
                            assert!(!outputs.contains(&b));
                        }
                    }
                }
                DeviceOp::Stage(_) => stages += 1,
                _ => {}
            }
        }
        assert!(
            kernels > 20 && gemms > 20,
            "{what}: {kernels} kernels, {gemms} GEMMs"
        );
        let bf16 = sets.iter().any(|s| s.contains("bf16"));
        assert_eq!(stages > 0, bf16, "{what}: 16-bit operands are staged");
        // bf16: the linear GEMMs read their bf16 operands directly (tensor cores).
        assert_eq!(half_gemms > 0, bf16, "{what}: {half_gemms} bf16 GEMMs");
        // --profile's marks: one per instruction, in order, named as the cpu profile names
        // them, the linear ops' FLOPs 2·m·k·n (2 · x elements · output width).
        let p: &Plan = &plan;
        let role = &p.roles[p.rank_to_role[0] as usize];
        for (program, ops, marks) in [
            (&role.microbatch, &l.microbatch, &l.microbatch_marks),
            (&role.optimizer, &l.optimizer, &l.optimizer_marks),
        ] {
            assert_eq!(marks.len(), program.len(), "{what}");
            assert!(marks.windows(2).all(|w| w[0].start <= w[1].start));
            assert!(marks.iter().all(|m| m.start <= ops.len()));
            for (m, instr) in marks.iter().zip(program.iter()) {
                use megac_ir::plan::Instr;
                let (name, flops) = match instr {
                    Instr::Kernel {
                        op,
                        inputs,
                        outputs,
                        ..
                    } => {
                        let linear = matches!(op.name(), "linear" | "linear_grad_input");
                        let (x, y) = if op.name() == "linear_grad_input" {
                            (outputs[0], inputs[0])
                        } else {
                            (inputs[0], outputs[0])
                        };
                        let f = if linear {
                            let n = *p.buffers[y as usize].shape.last().unwrap() as f64;
                            2.0 * p.buffers[x as usize].len() as f64 * n
                        } else {
                            m.flops // linear_grad_weight and the rest: checked below
                        };
                        (op.name(), f)
                    }
                    _ => ("zero", 0.0),
                };
                assert_eq!(m.name, name, "{what}");
                assert_eq!(m.flops, flops, "{what}: {name}");
                assert_eq!(m.flops > 0.0, name.starts_with("linear"), "{what}: {name}");
            }
        }
        if file.starts_with("moe") {
            let routes = l
                .microbatch
                .iter()
                .filter(|op| matches!(op, DeviceOp::Route(_)))
                .count();
            assert!(
                routes > 0,
                "{what}: dispatch and combine build routing tables"
            );
        }
        // The slab holds the workspace and constants the lowering asks for.
        let slab = SlabLayout::new(&plan, 0, l.workspace_bytes + l.constants.len() as u64).unwrap();
        assert!(slab.total_bytes >= slab.slabs[BufferClass::Param.index()].bytes);
    }
}

#[test]
fn what_is_not_lowered_is_one_error_naming_the_op() {
    let a2a = plan("moe-tiny.toml", &["parallel.dp=2", "parallel.ep=2"]);
    let err = lower::lower_role(&a2a, 0).unwrap_err().to_string();
    assert!(
        err.contains("`all_to_all`") && err.contains("no cuda lowering yet"),
        "{err}"
    );
    let pp = plan("llama-tiny.toml", &["parallel.pp=2"]);
    let err = lower::lower_role(&pp, 0).unwrap_err().to_string();
    assert!(err.contains("pipelined plans"), "{err}");
}

/// On a GPU (`bench/gpu/check.sh`): every op's output against the cpu kernel's, on the
/// model's own inputs: one micro-batch of each tiny model on both backends, then every
/// activation and gradient buffer compared (both backends lay them out alike, reuse
/// included); fp32 within 1e-4 of the buffer's largest magnitude, bf16 within 2e-2. Prints
/// the worst buffer and the instruction that wrote it.
#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/check.sh"]
fn every_buffer_matches_the_cpu_backend_after_one_microbatch() {
    use megac_ir::plan::Instr;
    for (file, sets, tol) in [
        ("llama-tiny.toml", vec![], 1e-4),
        ("gpt-tiny.toml", vec![], 1e-4),
        ("moe-tiny.toml", vec![], 1e-4),
        ("llama-tiny.toml", vec!["train.precision=\"bf16\""], 2e-2),
    ] {
        let plan = plan(file, &sets);
        let p: &Plan = &plan;
        let mut cpu = megac_runtime::train::Session::new(&plan, "synthetic", None).unwrap();
        let mut gpu = megac_runtime::cuda::session::CudaSession::new(&plan, "synthetic", 0)
            .unwrap_or_else(|e| panic!("{e}"));
        cpu.mem.zero_grads();
        let lc = cpu.microbatch(1, 0).unwrap();
        gpu.gpu.zero_class(BufferClass::Grad).unwrap();
        let lg = gpu.microbatch(1, 0).unwrap_or_else(|e| panic!("{e}"));
        let mut host = megac_runtime::memory::Memory::new(&plan, 0).unwrap();
        gpu.gpu
            .download(&mut host, &[BufferClass::Activation, BufferClass::Grad])
            .unwrap();
        let role = &p.roles[p.rank_to_role[0] as usize];
        let writer = |b: u32| {
            role.microbatch.iter().rev().find_map(|i| match i {
                Instr::Kernel {
                    op, outputs, path, ..
                } if outputs.contains(&b) => Some(format!("{} at {path}", op.name())),
                _ => None,
            })
        };
        let (mut worst, mut at, mut compared) = (0.0f64, String::new(), 0);
        for (b, buf) in p.buffers.iter().enumerate() {
            let b = b as u32;
            let float = matches!(
                buf.dtype,
                megac_ir::DType::F32 | megac_ir::DType::Bf16 | megac_ir::DType::F16
            );
            let class = matches!(buf.class, BufferClass::Activation | BufferClass::Grad);
            if !float || !class || !cpu.mem.holds(b) {
                continue;
            }
            let (want, got) = (cpu.mem.read_f32(b), host.read_f32(b));
            let scale = want.iter().fold(0f64, |m, &x| m.max(f64::from(x).abs()));
            let diff = want.iter().zip(&got).fold(0f64, |m, (&a, &g)| {
                m.max((f64::from(a) - f64::from(g)).abs())
            });
            let rel = diff / scale.max(1e-30);
            compared += 1;
            if rel > worst || rel.is_nan() {
                worst = rel;
                at = format!(
                    "buffer {b} {:?} ({})",
                    buf.shape,
                    writer(b).unwrap_or_default()
                );
            }
        }
        println!(
            "{file} {sets:?}: one micro-batch, loss cpu {lc:.6} cuda {lg:.6}; {compared} buffers, worst {worst:.2e} at {at}"
        );
        assert!(worst < tol, "{file} {sets:?}: {worst:.2e} at {at}");
    }
}

/// On a GPU (`bench/gpu/check.sh`): steps of a tiny model on the cuda executor against the
/// cpu backend, same plan, same data, same initial parameters. Prints both loss curves.
#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/check.sh"]
fn cuda_training_matches_the_cpu_backend() {
    let steps: u64 = std::env::var("MEGAC_GPU_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    for (file, sets, tol) in [
        ("llama-tiny.toml", vec![], 1e-4),
        ("gpt-tiny.toml", vec![], 1e-4),
        ("llama-tiny.toml", vec!["train.precision=\"bf16\""], 2e-2),
        ("moe-tiny.toml", vec![], 1e-4),
        ("moe-tiny.toml", vec!["train.precision=\"bf16\""], 2e-2),
    ] {
        let plan = plan(file, &sets);
        let mut cpu = megac_runtime::train::Session::new(&plan, "synthetic", None).unwrap();
        let mut gpu = megac_runtime::cuda::session::CudaSession::new(&plan, "synthetic", 0)
            .unwrap_or_else(|e| panic!("{e}"));
        let (free, total) = gpu.gpu.mem_info().unwrap();
        println!(
            "{file} {sets:?}: device allocation {} bytes (plan arenas {:?}); cudaMemGetInfo free {free} of {total}",
            gpu.gpu.device_bytes(),
            plan.memory,
        );
        let mut worst = 0.0f64;
        for step in 1..=steps {
            let (lc, nc) = cpu.step(step).unwrap();
            let t0 = std::time::Instant::now();
            let (lg, ng) = gpu.step(step).unwrap_or_else(|e| panic!("{e}"));
            let secs = t0.elapsed().as_secs_f64();
            let rel = ((lg - lc) / lc).abs();
            worst = worst.max(rel);
            println!(
                "step {step}: loss cpu {lc:.6} cuda {lg:.6} (rel {rel:.2e}); norm cpu {nc:.5} cuda {ng:.5}; cuda step {secs:.4} s"
            );
        }
        println!("{file} {sets:?}: worst relative loss difference {worst:.2e} over {steps} steps");
        assert!(worst < tol, "{file} {sets:?}: {worst} >= {tol}");
    }
}

#[test]
fn nccl_splits_are_the_same_calls_in_the_same_order_on_every_rank() {
    use megac_ir::Axis;
    for (file, sets) in [
        ("llama-tiny.toml", vec!["parallel.tp=2", "parallel.dp=2"]),
        (
            "llama-tiny.toml",
            vec!["parallel.tp=2", "parallel.sequence_parallel=true"],
        ),
        ("moe-tiny.toml", vec!["parallel.dp=2", "parallel.ep=2"]),
        ("llama-tiny.toml", vec!["parallel.dp=2", "parallel.cp=2"]),
    ] {
        let p = plan(file, &sets);
        let comms = Communicators::of_plan(&p);
        let world = comms.world;
        let calls: Vec<Vec<(Vec<Axis>, i32, i32)>> =
            (0..world).map(|r| comms.split_calls(r)).collect();
        assert!(
            !calls[0].is_empty(),
            "{file} {sets:?}: the plan communicates"
        );
        for (i, (axes, _, _)) in calls[0].iter().enumerate() {
            // The same axis set at the same position on every rank (NCCL's collective
            // split), and the ranks of one colour are exactly Mesh::group in key order.
            let mut by_color: std::collections::BTreeMap<i32, Vec<(i32, usize)>> =
                Default::default();
            for (r, c) in calls.iter().enumerate() {
                assert_eq!(&c[i].0, axes, "{file} {sets:?} rank {r}");
                assert!(
                    c[i].1 >= 0,
                    "{file} {sets:?}: rank {r} is in a group over {axes:?}"
                );
                by_color.entry(c[i].1).or_default().push((c[i].2, r));
            }
            for members in by_color.values_mut() {
                members.sort_unstable();
                let ranks: Vec<usize> = members.iter().map(|&(_, r)| r).collect();
                assert_eq!(
                    ranks,
                    p.mesh.group(ranks[0], axes),
                    "{file} {sets:?} {axes:?}"
                );
                let keys: Vec<i32> = members.iter().map(|&(k, _)| k).collect();
                assert_eq!(keys, (0..ranks.len() as i32).collect::<Vec<_>>());
            }
        }
    }
}

/// Per-rank device memory of the collective check: plan buffers as f32 and the workspace.
struct HostRank {
    bufs: std::collections::HashMap<u32, Vec<f32>>,
    work: Vec<f32>,
}

impl HostRank {
    fn slice(&mut self, a: &Arg) -> (&mut Vec<f32>, usize) {
        match a {
            Arg::Buf(b) | Arg::Raw(b) => (self.bufs.get_mut(b).expect("a plan buffer"), 0),
            Arg::Work(o) => (&mut self.work, *o as usize / 4),
            other => panic!("not an address: {other:?}"),
        }
    }

    fn read(&mut self, a: &Arg, n: usize) -> Vec<f32> {
        let (v, at) = self.slice(a);
        v[at..at + n].to_vec()
    }

    fn write(&mut self, a: &Arg, values: &[f32]) {
        let (v, at) = self.slice(a);
        v[at..at + values.len()].copy_from_slice(values);
    }
}

/// Evaluate rank-parallel lowered ops (`ops[r]` for rank r, the same sequence on every
/// rank) on the host: `copy_columns` as the kernel defines it, copies, and NCCL's
/// all-gather (member-major), reduce-scatter and all-reduce over the plan's groups.
#[allow(clippy::needless_range_loop)] // ranks run in lockstep: op i of every rank
fn eval_lowered(plan: &CheckedPlan, ops: &[Vec<DeviceOp>], ranks: &mut [HostRank]) {
    let u = |a: &Arg| match a {
        Arg::U32(x) => *x as usize,
        other => panic!("{other:?}"),
    };
    for i in 0..ops[0].len() {
        match &ops[0][i] {
            DeviceOp::Kernel { name, .. } => {
                assert_eq!(*name, "copy_columns", "only column copies here");
                for (r, rank) in ranks.iter_mut().enumerate() {
                    let DeviceOp::Kernel { args, .. } = &ops[r][i] else {
                        panic!("ranks disagree")
                    };
                    let (rows, cols) = (u(&args[2]), u(&args[3]));
                    let (sw, sc, dw, dc) = (u(&args[4]), u(&args[5]), u(&args[6]), u(&args[7]));
                    for row in 0..rows {
                        let (v, at) = rank.slice(&args[0]);
                        let part = v[at + row * sw + sc..at + row * sw + sc + cols].to_vec();
                        let (d, dat) = rank.slice(&args[1]);
                        d[dat + row * dw + dc..dat + row * dw + dc + cols].copy_from_slice(&part);
                    }
                }
            }
            DeviceOp::Copy { .. } => {
                for (r, rank) in ranks.iter_mut().enumerate() {
                    let DeviceOp::Copy { dst, src, bytes } = &ops[r][i] else {
                        panic!()
                    };
                    let v = rank.read(src, *bytes as usize / 4);
                    rank.write(dst, &v);
                }
            }
            DeviceOp::AllGather { axes, count, .. }
            | DeviceOp::ReduceScatter { axes, count, .. } => {
                let gather = matches!(&ops[0][i], DeviceOp::AllGather { .. });
                let n = *count as usize;
                let world = ranks.len();
                let mut sends = Vec::new();
                for r in 0..world {
                    let (DeviceOp::AllGather { send, .. } | DeviceOp::ReduceScatter { send, .. }) =
                        &ops[r][i]
                    else {
                        panic!()
                    };
                    let members = plan.mesh.group(r, axes).len();
                    sends.push(ranks[r].read(send, if gather { n } else { n * members }));
                }
                for r in 0..world {
                    let group = plan.mesh.group(r, axes);
                    let me = group.iter().position(|&m| m == r).unwrap();
                    let out: Vec<f32> = if gather {
                        group.iter().flat_map(|&m| sends[m].clone()).collect()
                    } else {
                        (0..n)
                            .map(|j| group.iter().map(|&m| sends[m][me * n + j]).sum())
                            .collect()
                    };
                    let (DeviceOp::AllGather { recv, .. } | DeviceOp::ReduceScatter { recv, .. }) =
                        &ops[r][i]
                    else {
                        panic!()
                    };
                    ranks[r].write(recv, &out);
                }
            }
            other => panic!("not evaluated here: {other:?}"),
        }
    }
}

#[test]
#[allow(clippy::needless_range_loop)]
fn collectives_around_a_dim_with_leading_dims_and_slice_match_the_cpu_backend() {
    use megac_ir::plan::Instr;
    use megac_ir::OpKind;
    let (mut reordered, mut slices) = (0, 0);
    let sp = ["parallel.tp=2", "parallel.sequence_parallel=true"];
    for (file, sets) in [
        ("llama-tiny.toml", sp.to_vec()),
        ("gpt-tiny.toml", sp.to_vec()),
        ("moe-tiny.toml", sp.to_vec()),
        (
            "llama-tiny.toml",
            vec![
                "parallel.tp=2",
                "parallel.dp=2",
                "parallel.sequence_parallel=true",
            ],
        ),
    ] {
        let plan = plan(file, &sets);
        let world = plan.mesh.world_size();
        let p: &Plan = &plan;
        let role = &p.roles[p.rank_to_role[0] as usize];
        let mut seen = std::collections::BTreeSet::new();
        for instr in role.microbatch.iter() {
            let Instr::Kernel {
                op,
                inputs,
                outputs,
                ..
            } = instr
            else {
                continue;
            };
            if !matches!(
                op,
                OpKind::AllGather { .. } | OpKind::ReduceScatter { .. } | OpKind::Slice { .. }
            ) {
                continue;
            }
            let key = format!(
                "{op:?} {:?} {:?}",
                p.buffers[inputs[0] as usize].shape, p.buffers[outputs[0] as usize].shape
            );
            if !seen.insert(key) {
                continue;
            }
            // Random inputs per rank; the cpu backend runs the instruction over local threads.
            let fill = |r: usize, b: u32| -> Vec<f32> {
                let n = p.buffers[b as usize].len() as usize;
                (0..n)
                    .map(|j| ((j * 7 + r * 13 + b as usize) % 17) as f32 * 0.25 - 2.0)
                    .collect()
            };
            let cpu = megac_runtime::local_comm::run_ranks(world, |mut comm| {
                use megac_runtime::comm::Communicator;
                let r = comm.rank();
                let mut mem = megac_runtime::memory::Memory::new(&plan, r)?;
                for &b in inputs.iter().chain(outputs) {
                    mem.write_f32(b, &fill(r, b));
                }
                let ctx = megac_runtime::exec::StepContext {
                    step: 1,
                    lr: 0.0,
                    microbatch: 0,
                    loss_scale: 1.0,
                };
                megac_runtime::exec::run_program(
                    std::slice::from_ref(instr),
                    &plan,
                    &mem,
                    &ctx,
                    &mut comm,
                    None,
                )?;
                Ok(mem.read_f32(outputs[0]))
            })
            .unwrap();
            let mut ops = Vec::new();
            let mut ranks = Vec::new();
            for r in 0..world {
                let (o, work, _) = lower::lower_instruction(&plan, r, instr).unwrap();
                ops.push(o);
                let mut bufs = std::collections::HashMap::new();
                for &b in inputs.iter().chain(outputs) {
                    bufs.insert(b, fill(r, b));
                }
                ranks.push(HostRank {
                    bufs,
                    work: vec![f32::NAN; work as usize / 4],
                });
            }
            // NCCL works in place only at the rank's own position (a gather's input in its
            // output, a reduce-scatter's output in its input): any other overlap would be
            // overwritten as it is read.
            for (r, o) in ops.iter().enumerate() {
                let slab = SlabLayout::new(&plan, r, 0).unwrap();
                let range = |a: &Arg, bytes: u64| match a {
                    Arg::Buf(b) => slab.offset(*b).map(|o| (o, o + bytes)),
                    _ => None,
                };
                for d in o {
                    if let DeviceOp::ReduceScatter {
                        axes,
                        send,
                        recv,
                        count,
                    } = d
                    {
                        let group = plan.mesh.group(r, axes);
                        let n = group.len() as u64;
                        let me = group.iter().position(|&m| m == r).unwrap() as u64;
                        if let (Some(s), Some(v)) =
                            (range(send, n * count * 4), range(recv, count * 4))
                        {
                            if s.0 < v.1 && v.0 < s.1 {
                                assert_eq!(
                                    v.0,
                                    s.0 + me * count * 4,
                                    "{file} {sets:?} rank {r}: {op:?} writes where it reads"
                                );
                            }
                        }
                    }
                    if let DeviceOp::AllGather {
                        axes,
                        send,
                        recv,
                        count,
                    } = d
                    {
                        let n = plan.mesh.group(r, axes).len() as u64;
                        let me = plan
                            .mesh
                            .group(r, axes)
                            .iter()
                            .position(|&m| m == r)
                            .unwrap() as u64;
                        if let (Some(s), Some(v)) =
                            (range(send, count * 4), range(recv, n * count * 4))
                        {
                            if s.0 < v.1 && v.0 < s.1 {
                                assert_eq!(s.0, v.0 + me * count * 4, "{file} {sets:?} rank {r}: {op:?} reads its input where it writes");
                            }
                        }
                    }
                }
            }
            if ops[0].iter().any(|o| matches!(o, DeviceOp::Kernel { .. })) {
                if matches!(op, OpKind::Slice { .. }) {
                    slices += 1;
                } else {
                    reordered += 1;
                }
            }
            eval_lowered(&plan, &ops, &mut ranks);
            for r in 0..world {
                assert_eq!(
                    ranks[r].bufs[&outputs[0]], cpu[r],
                    "{file} {sets:?} rank {r}: {op:?}"
                );
            }
        }
    }
    assert!(
        reordered > 0,
        "a gather or scatter around a dim with leading dims was checked"
    );
    assert!(slices > 0, "a slice was checked");
}

/// The one-sample llama-tiny plan with every probe and the perturbations `perturb` compiled
/// in (`megac scope`'s plan; 5 real tokens of 16, seed 9).
fn scope_plan(sets: &[&str], perturb: &[&str]) -> CheckedPlan {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/llama-tiny.toml");
    let mut all = vec![
        "train.micro_batch=1",
        "train.global_batch=1",
        "model.seq_len=16",
    ];
    all.extend_from_slice(sets);
    let all: Vec<String> = all.iter().map(|s| s.to_string()).collect();
    let spec = megac_frontend::load(&path, &all).unwrap_or_else(|e| panic!("{}", e.render()));
    let flops = megac_passes::flops::step_flops(&spec).total;
    let instrument = megac_passes::Instrument {
        probes: vec!["*".to_string()],
        perturbations: perturb
            .iter()
            .map(|p| megac_ir::perturb::TrainPerturbation::parse(p).unwrap())
            .collect(),
        seed: 9,
        tokens: 5,
        train: false,
    };
    let module = megac_passes::run_pipeline_with(spec, instrument, None, true).unwrap();
    let p = megac_codegen::emit_plan(&module.spec, module.graph.as_ref().unwrap(), flops).unwrap();
    Plan::from_json(&p.to_json()).unwrap()
}

/// MegaScope's `probe` and `perturb` lower (one device and tp2 with sequence parallelism):
/// every probe a copy, every perturbation a copy then its kernel of `kernels/cuda/scope.cu`
/// with the declared parameters, over the real tokens' elements of the rank's part
/// (5 tokens of the hidden 64: 320; under sp each rank's 8 positions hold 5 and 0 of them),
/// with the cpu backend's stream seed; zero-head only on the rank that holds the head.
#[test]
fn scope_ops_lower_to_their_kernels() {
    let sigs = kernel_signatures();
    let perturb = [
        "layers.0.out:noise(0.5)",
        "embed:bitflip(mantissa, 0.1)",
        "layers.1.mlp.out:scale(2)",
        "layers.0.attn:zero-head(3)",
    ];
    for (sets, rank, zero_heads) in [
        (&[][..], 0, 1),
        (
            &["parallel.tp=2", "parallel.sequence_parallel=true"][..],
            0,
            0,
        ),
        (
            &["parallel.tp=2", "parallel.sequence_parallel=true"][..],
            1,
            1,
        ),
    ] {
        let plan = scope_plan(sets, &perturb);
        let what = format!("{sets:?} rank {rank}");
        // The noise point's part: the whole [1, 16, 64] (320 real elements), or under sp
        // where the sequence is split over tp, rank r's 8 positions 8r.. (5 and 0 real).
        let point = plan.roles[plan.rank_to_role[rank] as usize]
            .microbatch
            .iter()
            .find_map(|i| match i {
                megac_ir::plan::Instr::Kernel {
                    op: megac_ir::OpKind::Perturb { point, .. },
                    outputs,
                    ..
                } if point == "layers.0.out" => Some(&plan.buffers[outputs[0] as usize]),
                _ => None,
            })
            .unwrap();
        let hidden_elements = if point.layout.get(1).is_none_or(|a| a.is_empty()) {
            320u64
        } else {
            assert_eq!(point.shape[1], 8, "{what}");
            (0..8).filter(|p| 8 * rank + p < 5).count() as u64 * 64
        };
        let l = lower::lower_role(&plan, rank).unwrap_or_else(|e| panic!("{what}: {e}"));
        let mut seen: std::collections::BTreeMap<&str, Vec<Vec<Arg>>> = Default::default();
        for op in &l.microbatch {
            if let DeviceOp::Kernel { name, args, .. } = op {
                let sig = &sigs[*name];
                assert_eq!(args.len(), sig.len(), "{what}: {name}");
                for (a, ty) in args.iter().zip(sig) {
                    assert!(fits(a, ty), "{what}: {name}: {ty} given {a:?}");
                }
                if name.starts_with("perturb_") {
                    seen.entry(name).or_default().push(args.clone());
                }
            }
        }
        let seed = |point: &str| Arg::U64(megac_kernels::perturb::stream_seed(9, point));
        let noise = &seen["perturb_noise"];
        assert_eq!(noise.len(), 1, "{what}");
        assert_eq!(noise[0][3], seed("layers.0.out"), "{what}");
        assert_eq!(noise[0][4], Arg::U64(hidden_elements), "{what}");
        assert_eq!(seen["perturb_sum_squares"].len(), 1, "{what}");
        // Under sp the embedding's output is whole on every rank (before the scatter) or a
        // shard: its element count is the cpu backend's for that layout.
        let flip = &seen["perturb_bitflip"][0];
        assert_eq!(flip[1..3], [Arg::U32(0), Arg::U32(23)], "{what}");
        assert_eq!(flip[4], seed("embed"), "{what}");
        assert_eq!(seen["perturb_scale"][0][1], Arg::F64(2.0), "{what}");
        assert_eq!(
            seen.get("perturb_zero_head").map_or(0, |v| v.len()),
            zero_heads,
            "{what}: head 3 of 4 lives on tp rank 1"
        );
        // Every probe is one copy at least (the perturbations copy too).
        let probes = plan.roles[plan.rank_to_role[rank] as usize]
            .microbatch
            .iter()
            .filter(|i| {
                matches!(
                    i,
                    megac_ir::plan::Instr::Kernel {
                        op: megac_ir::OpKind::Probe { .. },
                        ..
                    }
                )
            })
            .count();
        let copies = l
            .microbatch
            .iter()
            .filter(|o| matches!(o, DeviceOp::Copy { .. }))
            .count();
        assert!(
            probes > 10 && copies >= probes + perturb.len(),
            "{what}: {copies} copies, {probes} probes"
        );
    }
    // Training perturbations (per-step streams) are one error naming the op.
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/llama-tiny.toml");
    let spec = megac_frontend::load(&path, &[]).unwrap();
    let flops = megac_passes::flops::step_flops(&spec).total;
    let instrument = megac_passes::Instrument {
        perturbations: vec![
            megac_ir::perturb::TrainPerturbation::parse("layers.0.out:noise(0.1)").unwrap(),
        ],
        train: true,
        ..Default::default()
    };
    let module = megac_passes::run_pipeline_with(spec, instrument, None, true).unwrap();
    let p = megac_codegen::emit_plan(&module.spec, module.graph.as_ref().unwrap(), flops).unwrap();
    let p = Plan::from_json(&p.to_json()).unwrap();
    let err = lower::lower_role(&p, 0).unwrap_err().to_string();
    assert!(
        err.contains("`perturb`") && err.contains("training perturbations"),
        "{err}"
    );
}

/// The k-th SplitMix64 output as `kernels/cuda/scope.cu`'s `splitmix_at` computes it.
fn splitmix_at(seed: u64, k: u64) -> u64 {
    let mut z = seed.wrapping_add(k.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The perturb kernels' per-element random numbers (outputs 2i+1 and 2i+2 of the stream,
/// each computed alone, as one thread per element does on the device) are the cpu kernels'
/// sequential stream: a host mirror of `perturb_bitflip` and `perturb_noise` (the formulas of
/// `kernels/cuda/scope.cu`; not run on a GPU) gives `megac_kernels::perturb`'s values bit for
/// bit (noise with the RMS summed in the cpu's order: the device's tree sum may differ in
/// the last bits of the RMS).
#[test]
fn perturb_kernels_draw_the_cpu_stream() {
    let x: Vec<f32> = (0..777).map(|i| ((i as f32) * 0.731).sin() * 3.0).collect();
    let seed = megac_kernels::perturb::stream_seed(5, "layers.0.out");
    let unit = |k: u64| (splitmix_at(seed, k) >> 11) as f64 / (1u64 << 53) as f64;
    let mut want = x.clone();
    megac_kernels::perturb::bitflip(&mut want, 23, 8, 0.25, seed);
    let got: Vec<f32> = x
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let i = i as u64;
            let bit = 23 + (splitmix_at(seed, 2 * i + 2) % 8) as u32;
            if unit(2 * i + 1) < 0.25 {
                f32::from_bits(v.to_bits() ^ (1 << bit))
            } else {
                v
            }
        })
        .collect();
    assert!(got
        .iter()
        .zip(&want)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    assert!(got.iter().zip(&x).any(|(a, b)| a != b));
    let mut want = x.clone();
    megac_kernels::perturb::noise(&mut want, 0.3, seed);
    let sum: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let sd = (0.3 * (sum / x.len() as f64).sqrt()) as f32;
    let got: Vec<f32> = x
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let i = i as u64;
            let (u1, u2) = (1.0 - unit(2 * i + 1), unit(2 * i + 2));
            let g = ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32;
            v + sd * g
        })
        .collect();
    assert!(got
        .iter()
        .zip(&want)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}

/// `lower::perturbed_elements`: the real tokens' rows of a rank's part, as the cpu backend
/// counts them (under cp2 a rank's load-balanced chunks 0 and 3 of 4 hold positions 0-3
/// and 12-15 of 16).
#[test]
fn perturbed_elements_count_the_real_rows_of_the_part() {
    use megac_ir::{Axis, Mesh};
    let mesh = |cp: u64| Mesh {
        axes: vec![
            (Axis::Tp, 1),
            (Axis::Cp, cp),
            (Axis::Ep, 1),
            (Axis::Dp, 1),
            (Axis::Pp, 1),
        ],
    };
    let whole = vec![vec![], vec![], vec![]];
    assert_eq!(
        lower::perturbed_elements(&mesh(1), 0, &[1, 16, 8], &whole, 0),
        128
    );
    assert_eq!(
        lower::perturbed_elements(&mesh(1), 0, &[1, 16, 8], &whole, 5),
        40
    );
    let cp = vec![vec![], vec![Axis::Cp], vec![]];
    // Rank 0 holds 0..4 and 12..16: 14 real tokens -> 4 + 2 rows; rank 1 (4..12) all 8.
    assert_eq!(
        lower::perturbed_elements(&mesh(2), 0, &[1, 8, 8], &cp, 14),
        48
    );
    assert_eq!(
        lower::perturbed_elements(&mesh(2), 1, &[1, 8, 8], &cp, 14),
        64
    );
    assert_eq!(
        lower::perturbed_elements(&mesh(2), 1, &[1, 8, 8], &cp, 3),
        0
    );
}

/// The KV-cache plan of example `file` with `sets`, as `megac generate` builds it.
fn kv_cache_plan(file: &str, sets: &[&str]) -> CheckedPlan {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(file);
    let compile = |extra: &[String]| {
        let mut all: Vec<String> = [
            "train.micro_batch=1",
            "train.global_batch=1",
            "model.seq_len=16",
        ]
        .iter()
        .chain(sets)
        .map(|s| s.to_string())
        .collect();
        all.extend_from_slice(extra);
        let spec = megac_frontend::load(&path, &all).unwrap_or_else(|e| panic!("{}", e.render()));
        let flops = megac_passes::flops::step_flops(&spec).total;
        let module = megac_passes::run_inference_pipeline(spec).unwrap();
        let p =
            megac_codegen::emit_inference_plan(&module.spec, module.graph.as_ref().unwrap(), flops)
                .unwrap();
        CheckedPlan::check(p).unwrap()
    };
    let window = compile(&[]);
    let block = compile(&megac_runtime::kv::block_sets(&window));
    CheckedPlan::check(megac_codegen::kv::kv_plan(&window, &block).unwrap()).unwrap()
}

/// KV-cache decoding's `rope_at` and `pos_embedding_at` lower to `kernels/cuda/kv.cu`'s
/// kernels with their declared parameters: the plan's position input as the device's i32,
/// the block's rows, the RoPE frequencies as a constant table equal to the cpu backend's
/// (`rope_inv_freq`), the table's rows, and the rows of the rank's earlier sequence shards
/// (as the cpu backend's `step_positions`; in these plans, tp2 with sequence parallelism
/// included, the ops' operands are not split over the sequence, so that is 0).
/// `kv_attention` is one error naming the op. Not run on hardware.
#[test]
fn kv_position_ops_lower_to_their_kernels() {
    let sigs = kernel_signatures();
    for (file, sets, op_name, kernel) in [
        ("llama-tiny.toml", &[][..], "rope_at", "rope_at"),
        (
            "llama-tiny.toml",
            &["parallel.tp=2", "parallel.sequence_parallel=true"][..],
            "rope_at",
            "rope_at",
        ),
        (
            "gpt-tiny.toml",
            &[][..],
            "pos_embedding_at",
            "pos_embedding_at",
        ),
        (
            "gpt-tiny.toml",
            &["parallel.tp=2", "parallel.sequence_parallel=true"][..],
            "pos_embedding_at",
            "pos_embedding_at",
        ),
    ] {
        let plan = kv_cache_plan(file, sets);
        let position = plan.decode.as_ref().unwrap().position;
        let mut splits = 0;
        for rank in 0..plan.mesh.world_size() {
            let what = format!("{file} {sets:?} rank {rank}");
            let role = &plan.roles[plan.rank_to_role[rank] as usize];
            let step = &role.decode.as_ref().unwrap().step;
            let mut lowered = 0;
            for instr in step.iter() {
                let megac_ir::plan::Instr::Kernel { op, inputs, .. } = instr else {
                    continue;
                };
                if op.name() == "kv_attention" {
                    let err = lower::lower_instruction(&plan, rank, instr)
                        .unwrap_err()
                        .to_string();
                    assert!(err.contains("`kv_attention`"), "{what}: {err}");
                    continue;
                }
                if op.name() != op_name {
                    continue;
                }
                let (ops, _, constants) = lower::lower_instruction(&plan, rank, instr).unwrap();
                let [DeviceOp::Kernel { name, args, .. }] = &ops[..] else {
                    panic!("{what}: {ops:?}");
                };
                assert_eq!(*name, kernel);
                let sig = &sigs[*name];
                assert_eq!(args.len(), sig.len(), "{what}");
                for (a, ty) in args.iter().zip(sig) {
                    assert!(fits(a, ty), "{what}: {name}: {ty} given {a:?}");
                }
                let pos_arg = if kernel == "rope_at" { 3 } else { 2 };
                assert_eq!(args[pos_arg], Arg::Buf(position), "{what}");
                assert_eq!(inputs.last(), Some(&position), "{what}");
                let x = &plan.buffers[inputs[0] as usize];
                let rows = x.shape[1];
                assert_eq!(args[4], Arg::U32(rows as u32), "{what}");
                // The block's rows split over tp (sequence parallelism) start at rank·rows.
                let split = x
                    .layout
                    .get(1)
                    .is_some_and(|a| a.contains(&megac_ir::Axis::Tp));
                let shard = if split { rank as u32 * rows as u32 } else { 0 };
                assert_eq!(args[7], Arg::U32(shard), "{what}");
                if split {
                    splits += 1;
                }
                if let megac_ir::OpKind::RopeAt { theta, scaling } = op {
                    let d = x.shape[3] as usize;
                    let want = megac_ir::spec::rope_inv_freq(d, *theta, scaling.as_ref());
                    let Arg::Const(at) = args[2] else {
                        panic!("{what}")
                    };
                    let got: Vec<f32> = constants[at as usize..][..4 * want.len()]
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect();
                    assert_eq!(got, want, "{what}");
                } else {
                    let table = &plan.buffers[inputs[1] as usize];
                    assert_eq!(args[6], Arg::U32(table.shape[0] as u32), "{what}");
                }
                lowered += 1;
            }
            assert!(lowered > 0, "{what}: no {op_name} in the decode step");
        }
        eprintln!("{file} {sets:?}: {splits} sequence-split {op_name} lowered");
    }
}
