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
