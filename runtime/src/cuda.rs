//! The cuda backend: finding the CUDA driver and a device ([`probe`]), compiling megac's
//! CUDA kernels (`megac_kernels::cuda`) to PTX with NVRTC ([`compile_kernels`]), and the
//! executor of one rank's plan on a GPU, built from host-side pieces tested without one:
//! [`slab`] (the device memory layout from the plan's buffer table), [`launch`] (launch
//! configurations), [`gemm`] (the cuBLAS mapping of the row-major matmuls), [`nccl`] (the
//! communicators of the plan's groups), [`lower`] (instructions to device operations),
//! [`moe`] (the MoE routing tables, built on the host), and [`device`] (the executor that
//! issues them) with [`session`] (a single-rank training loop around it, `--device cuda`).
//! None of it has run on a GPU yet.
//!
//! The libraries are loaded at run time (cudarc's dynamic loading), so this builds without a
//! CUDA toolkit. cudarc panics when a library is missing, so every entry point checks
//! `is_culib_present()` first and returns [`CudaError`] instead.

pub mod device;
pub mod gemm;
pub mod launch;
pub mod lower;
pub mod moe;
pub mod nccl;
pub mod session;
pub mod slab;

use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions};

/// What went wrong finding CUDA or compiling for it.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// A CUDA library could not be loaded.
    #[error("no {what} library found (looked for {looked_for}); {hint}")]
    Missing {
        /// Which library (the CUDA driver, NVRTC).
        what: &'static str,
        /// The file names tried, as the dynamic loader sees them.
        looked_for: String,
        /// What to install or set.
        hint: &'static str,
    },
    /// The driver loaded but reported an error (no device, a driver too old ...).
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// The plan needs something the cuda backend does not do yet.
    #[error("{0}")]
    Unsupported(String),
    /// NVRTC rejected a kernel file.
    #[error("NVRTC could not compile kernels/cuda/{file} for {arch}: {log}")]
    Compile {
        /// The kernel file.
        file: &'static str,
        /// The target architecture.
        arch: &'static str,
        /// NVRTC's log (or error).
        log: String,
    },
}

/// The file names the dynamic loader is asked for, for library `name` (`cuda`, `nvrtc`).
fn candidates(name: &str) -> String {
    let names = cudarc::get_lib_name_candidates(name);
    // The versioned names are the ones that exist on Linux installs.
    let versioned: Vec<&String> = names.iter().filter(|n| n.contains(".so.")).collect();
    let shown: Vec<&String> = if versioned.is_empty() {
        names.iter().collect()
    } else {
        versioned
    };
    shown
        .iter()
        .map(|s| s.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A CUDA device the driver reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// The device's name as the driver reports it.
    pub name: String,
    /// Devices the driver sees.
    pub count: usize,
}

/// Find the CUDA driver and device `ordinal`.
pub fn probe(ordinal: usize) -> Result<DeviceInfo, CudaError> {
    // SAFETY: only tries to open the library (libloading), calling nothing in it.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::Missing {
            what: "CUDA driver",
            looked_for: candidates("cuda"),
            hint: "install the NVIDIA driver (libcuda.so.1), or run with --device cpu",
        });
    }
    let driver = |e: cudarc::driver::DriverError| CudaError::Driver(e.to_string());
    cudarc::driver::result::init().map_err(driver)?;
    let count = cudarc::driver::result::device::get_count().map_err(driver)? as usize;
    if ordinal >= count {
        return Err(CudaError::Driver(format!(
            "device {ordinal} requested, the driver sees {count}"
        )));
    }
    let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(driver)?;
    let name = ctx.name().map_err(driver)?;
    Ok(DeviceInfo {
        ordinal,
        name,
        count,
    })
}

/// One compiled kernel file.
#[derive(Clone, Debug)]
pub struct CompiledKernels {
    /// Its `kernels/cuda/` file name.
    pub file: &'static str,
    /// Its kernels, as named in the PTX.
    pub kernels: &'static [&'static str],
    /// The PTX text.
    pub ptx: String,
}

/// Whether NVRTC can be loaded (`libnvrtc.so.13`).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compile every kernel file for `arch` (a virtual architecture such as `compute_90`, so the
/// result is PTX the driver finishes for the device) with NVRTC.
pub fn compile_kernels(arch: &'static str) -> Result<Vec<CompiledKernels>, CudaError> {
    if !nvrtc_present() {
        return Err(CudaError::Missing {
            what: "NVRTC",
            looked_for: candidates("nvrtc"),
            hint: "pip install nvidia-cuda-nvrtc==13.0.88 and put its nvidia/cu13/lib on LD_LIBRARY_PATH",
        });
    }
    megac_kernels::cuda::SOURCES
        .iter()
        .map(|s| {
            let opts = CompileOptions {
                arch: Some(arch),
                name: Some(s.name.to_string()),
                ..Default::default()
            };
            let ptx = compile_ptx_with_opts(s.program(), opts).map_err(|e| CudaError::Compile {
                file: s.name,
                arch,
                log: match e {
                    CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
                    other => format!("{other:?}"),
                },
            })?;
            Ok(CompiledKernels {
                file: s.name,
                kernels: s.kernels,
                ptx: ptx.to_src(),
            })
        })
        .collect()
}

/// The virtual architecture NVRTC targets for a device of compute capability
/// `major.minor` (the newest listed one not above it).
pub fn arch_for(major: i32, minor: i32) -> &'static str {
    const ARCHS: &[((i32, i32), &str)] = &[
        ((12, 0), "compute_120"),
        ((10, 0), "compute_100"),
        ((9, 0), "compute_90"),
        ((8, 9), "compute_89"),
        ((8, 6), "compute_86"),
        ((8, 0), "compute_80"),
        ((7, 5), "compute_75"),
    ];
    ARCHS
        .iter()
        .find(|(cc, _)| *cc <= (major, minor))
        .map_or("compute_75", |(_, a)| a)
}

/// What [`check_on_device`] found.
#[derive(Clone, Debug)]
pub struct DeviceCheck {
    /// The device.
    pub device: DeviceInfo,
    /// The architecture the kernels were compiled for.
    pub arch: &'static str,
    /// Kernels the driver loaded from the compiled PTX.
    pub kernels_loaded: usize,
}

/// Find device `ordinal`, compile every kernel for its architecture, and have the driver load
/// each module and find each kernel in it (the driver JIT-compiles the PTX for the device).
pub fn check_on_device(ordinal: usize) -> Result<DeviceCheck, CudaError> {
    let device = probe(ordinal)?;
    let driver = |e: cudarc::driver::DriverError| CudaError::Driver(e.to_string());
    let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(driver)?;
    let (major, minor) = ctx.compute_capability().map_err(driver)?;
    let arch = arch_for(major, minor);
    let mut kernels_loaded = 0;
    for c in compile_kernels(arch)? {
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(c.ptx))
            .map_err(driver)?;
        for k in c.kernels {
            module
                .load_function(k)
                .map_err(|e| CudaError::Driver(format!("{}: {k}: {e}", c.file)))?;
            kernels_loaded += 1;
        }
    }
    Ok(DeviceCheck {
        device,
        arch,
        kernels_loaded,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn architectures_round_down_to_a_listed_one() {
        assert_eq!(arch_for(9, 0), "compute_90");
        assert_eq!(arch_for(8, 7), "compute_86");
        assert_eq!(arch_for(10, 3), "compute_100");
        assert_eq!(arch_for(6, 1), "compute_75");
        assert_eq!(arch_for(12, 1), "compute_120");
    }
}
