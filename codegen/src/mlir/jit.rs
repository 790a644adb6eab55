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
use std::path::{Path, PathBuf};

/// LLVM's optimization level for the JIT (O3: loop vectorization and unrolling).
pub const OPT_LEVEL: usize = 3;

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

/// A compiled module: in MLIR's ExecutionEngine, or a shared object of the disk cache
/// ([`compile_cached`]).
pub struct Jit {
    backend: Backend,
    arena_bytes: [u64; 5],
    extras: usize,
}

/// Where a module's code lives.
enum Backend {
    /// Compiled now by MLIR's ExecutionEngine. The engine holds its own LLVM module; the
    /// MLIR context stays alive beside it.
    Engine {
        engine: ExecutionEngine,
        _context: Context,
    },
    /// Loaded from the disk cache (`dlopen`).
    Library(Library),
}

/// A `dlopen`ed shared object, closed on drop.
struct Library(*mut libc::c_void);

impl Drop for Library {
    fn drop(&mut self) {
        // SAFETY: the handle came from a successful `dlopen` and is closed once.
        unsafe { libc::dlclose(self.0) };
    }
}

impl Library {
    /// `dlopen` `path` (every symbol resolved now, none exported to later loads).
    fn open(path: &Path) -> Result<Library, String> {
        use std::os::unix::ffi::OsStrExt as _;
        let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
        // SAFETY: `c` is a NUL-terminated path; a shared object written by `store` has no
        // initializers besides the C runtime's.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            // SAFETY: dlerror returns a NUL-terminated message or null.
            let e = unsafe { libc::dlerror() };
            let msg = if e.is_null() {
                "dlopen failed".to_string()
            } else {
                // SAFETY: non-null, NUL-terminated (above).
                unsafe { std::ffi::CStr::from_ptr(e) }
                    .to_string_lossy()
                    .into_owned()
            };
            return Err(msg);
        }
        Ok(Library(h))
    }

    /// The packed entry point of function `name` (what the ExecutionEngine's
    /// `invoke_packed` calls: `_mlir__mlir_ciface_<name>`, taking an array of argument
    /// pointers).
    fn packed(&self, name: &str) -> Option<unsafe extern "C" fn(*mut *mut ())> {
        let c = std::ffi::CString::new(format!("_mlir__mlir_ciface_{name}")).ok()?;
        // SAFETY: a live handle and a NUL-terminated name.
        let p = unsafe { libc::dlsym(self.0, c.as_ptr()) };
        if p.is_null() {
            return None;
        }
        // SAFETY: the ExecutionEngine emits this symbol as `void (void **)`.
        Some(unsafe {
            std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn(*mut *mut ())>(p)
        })
    }
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
        // MLIR's pass registry is global and not safe to fill from two threads at once.
        static PASSES: std::sync::Once = std::sync::Once::new();
        PASSES.call_once(register_all_passes);
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
        // Object dump and position-independent code: the object can then be linked into
        // a shared object for the disk cache ([`compile_cached`]).
        let engine = ExecutionEngine::new(&module, OPT_LEVEL, &[], true, true);
        Ok(Jit {
            backend: Backend::Engine {
                engine,
                _context: context,
            },
            arena_bytes,
            extras,
        })
    }

    /// Call the packed form of function `name` on `args` (pointers to the arguments).
    ///
    /// # Safety
    /// `args` must match the function's C interface.
    unsafe fn invoke(&self, name: &str, args: &mut [*mut ()]) -> Result<(), JitError> {
        match &self.backend {
            // SAFETY: the caller's guarantee.
            Backend::Engine { engine, .. } => unsafe { engine.invoke_packed(name, args) }
                .map_err(|_| JitError::Call(name.to_string())),
            Backend::Library(lib) => {
                let f = lib
                    .packed(name)
                    .ok_or_else(|| JitError::Call(name.to_string()))?;
                // SAFETY: the caller's guarantee; `f` is the packed wrapper of `name`.
                unsafe { f(args.as_mut_ptr()) };
                Ok(())
            }
        }
    }

    /// Write this module's machine code as a shared object at `path` (through an object
    /// file beside it, linked by the system C compiler `cc`).
    fn write_shared_object(&self, entry: &str, path: &Path) -> Result<(), String> {
        let Backend::Engine { engine, .. } = &self.backend else {
            return Err("not compiled in this process".into());
        };
        // The JIT compiles on the first lookup; the object cache holds the code afterwards.
        if engine.lookup(&format!("_mlir_ciface_{entry}")).is_null() {
            return Err(format!("no function `{entry}`"));
        }
        let obj = path.with_extension("o");
        engine.dump_to_object_file(&obj.to_string_lossy());
        let out = std::process::Command::new("cc")
            .arg("-shared")
            .arg("-o")
            .arg(path)
            .arg(&obj)
            .output();
        let _ = std::fs::remove_file(&obj);
        match out {
            Ok(o) if o.status.success() => Ok(()),
            Ok(o) => Err(format!(
                "cc -shared failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            Err(e) => Err(format!("cannot run cc: {e}")),
        }
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
        unsafe { self.invoke(name, &mut args) }
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
        unsafe { self.invoke(name, &mut args) }
    }
}

/// 64-bit FNV-1a.
fn fnv(bytes: &[u8], mut h: u64) -> u64 {
    for &b in bytes {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

const FNV_START: u64 = 0xcbf2_9ce4_8422_2325;

/// The first line of the metadata file of a cached kernel.
const META_MAGIC: &str = "megac compiled kernel v1";

/// A directory of compiled kernels shared by processes ([`compile_cached`]).
///
/// Entry `<key>` (16 hex digits: a hash of the MLIR text, the lowering pipeline, the
/// optimization level, megac's version and the host CPU) is two files: `<key>.meta`, which
/// names the shared object and holds the whole MLIR text (compared on a hit, so a hash
/// collision is a miss), and the shared object `<key>-<hash of its bytes>.so`, checked
/// against its name before it is loaded, so a truncated or corrupted file is a miss too.
/// Both are written to temporary names and renamed into place: a reader never sees a half
/// file, and processes compiling the same kernel at once each write a complete entry (the
/// last rename wins; the objects they name are content-addressed).
#[derive(Clone, Debug)]
pub struct DiskCache {
    dir: PathBuf,
}

/// How [`compile_cached`] got its module.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// Loaded from the disk cache: no compilation.
    Loaded,
    /// Compiled by MLIR now; `stored` says why it was not written to the cache, if not
    /// (`None`: written, or no cache).
    Compiled {
        /// Why the entry was not written (no `cc`, an unwritable directory, ...).
        not_stored: Option<String>,
    },
}

impl DiskCache {
    /// A cache in `dir` (created when the first entry is written).
    pub fn new(dir: impl Into<PathBuf>) -> DiskCache {
        DiskCache { dir: dir.into() }
    }

    /// The cache the environment names: `$MEGAC_KERNEL_CACHE` (`off` or empty: none), else
    /// `$XDG_CACHE_HOME/megac/kernels`, else `$HOME/.cache/megac/kernels`.
    pub fn from_env() -> Option<DiskCache> {
        if let Some(v) = std::env::var_os("MEGAC_KERNEL_CACHE") {
            if v.is_empty() || v == "off" {
                return None;
            }
            return Some(DiskCache::new(v));
        }
        let base = match std::env::var_os("XDG_CACHE_HOME") {
            Some(x) if !x.is_empty() => PathBuf::from(x),
            _ => PathBuf::from(std::env::var_os("HOME").filter(|h| !h.is_empty())?).join(".cache"),
        };
        Some(DiskCache::new(base.join("megac").join("kernels")))
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn meta_path(&self, key: u64) -> PathBuf {
        self.dir.join(format!("{key:016x}.meta"))
    }

    /// The module of `source` from the cache, if a sound entry holds it.
    fn load(&self, key: u64, source: &str, entry: &str) -> Option<Library> {
        let meta = std::fs::read_to_string(self.meta_path(key)).ok()?;
        let mut lines = meta.splitn(3, '\n');
        if lines.next()? != META_MAGIC {
            return None;
        }
        let so = lines.next()?.strip_prefix("so ")?;
        if lines.next()? != source {
            return None;
        }
        // The object's name carries the hash of its bytes.
        let want = u64::from_str_radix(
            so.strip_prefix(&format!("{key:016x}-"))?
                .strip_suffix(".so")?,
            16,
        )
        .ok()?;
        let path = self.dir.join(so);
        let bytes = std::fs::read(&path).ok()?;
        if fnv(&bytes, FNV_START) != want {
            return None;
        }
        let lib = Library::open(&path).ok()?;
        lib.packed(entry)?;
        Some(lib)
    }

    /// Write `jit`'s code as entry `key` of `source`.
    fn store(&self, key: u64, source: &str, entry: &str, jit: &Jit) -> Result<(), String> {
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| format!("cannot create {}: {e}", self.dir.display()))?;
        let tmp = |ext: &str| {
            static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.dir
                .join(format!("{key:016x}.tmp-{}-{n}.{ext}", std::process::id()))
        };
        let so_tmp = tmp("so");
        let result = (|| {
            jit.write_shared_object(entry, &so_tmp)?;
            let bytes = std::fs::read(&so_tmp).map_err(|e| e.to_string())?;
            let so = format!("{key:016x}-{:016x}.so", fnv(&bytes, FNV_START));
            std::fs::rename(&so_tmp, self.dir.join(&so)).map_err(|e| e.to_string())?;
            let meta_tmp = tmp("meta");
            std::fs::write(&meta_tmp, format!("{META_MAGIC}\nso {so}\n{source}"))
                .and_then(|()| std::fs::rename(&meta_tmp, self.meta_path(key)))
                .map_err(|e| {
                    let _ = std::fs::remove_file(&meta_tmp);
                    e.to_string()
                })
        })();
        let _ = std::fs::remove_file(&so_tmp);
        result
    }
}

/// What the machine code depends on besides the MLIR text: the host CPU (LLVM compiles for
/// its features), megac's version and the LLVM it was built against.
fn host_key() -> u64 {
    let mut h = fnv(env!("CARGO_PKG_VERSION").as_bytes(), FNV_START);
    h = fnv(b"mlir-22", h);
    if let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") {
        for l in info.lines().take_while(|l| !l.is_empty()) {
            if l.starts_with("vendor_id") || l.starts_with("model name") || l.starts_with("flags") {
                h = fnv(l.as_bytes(), h);
            }
        }
    }
    h
}

/// Compile `source` with `pipeline` ([`Jit::compile_with`]) as a module of function `entry`
/// without arenas (a fused kernel), or load it from `cache` when an earlier process
/// compiled it: a cache hit skips MLIR and LLVM entirely. A miss compiles and writes the
/// entry; when that fails (no `cc` on PATH, an unwritable directory) the compiled module
/// is used all the same and [`Origin::Compiled`] says why.
pub fn compile_cached(
    source: &str,
    pipeline: &str,
    entry: &str,
    cache: Option<&DiskCache>,
) -> Result<(Jit, Origin), JitError> {
    let key = {
        let mut h = fnv(META_MAGIC.as_bytes(), host_key());
        h = fnv(pipeline.as_bytes(), h);
        h = fnv(&[OPT_LEVEL as u8], h);
        fnv(source.as_bytes(), h)
    };
    if let Some(c) = cache {
        if let Some(lib) = c.load(key, source, entry) {
            let jit = Jit {
                backend: Backend::Library(lib),
                arena_bytes: [0; 5],
                extras: 0,
            };
            return Ok((jit, Origin::Loaded));
        }
    }
    let jit = Jit::compile_with(source, pipeline, [0; 5], 0)?;
    let not_stored = match cache {
        Some(c) => c.store(key, source, entry, &jit).err(),
        None => None,
    };
    Ok((jit, Origin::Compiled { not_stored }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `a1 += a0` on 16 floats; `k` makes distinct texts.
    fn source(k: f64) -> String {
        format!(
            "module {{
  func.func @fused(%a0: memref<16xf32>, %a1: memref<16xf32>) attributes {{llvm.emit_c_interface}} {{
    %c = arith.constant {k:.1} : f32
    linalg.generic {{indexing_maps = [affine_map<(d0) -> (d0)>, affine_map<(d0) -> (d0)>], iterator_types = [\"parallel\"]}} ins(%a0 : memref<16xf32>) outs(%a1 : memref<16xf32>) {{
    ^bb0(%x: f32, %y: f32):
      %s = arith.addf %x, %y : f32
      %t = arith.addf %s, %c : f32
      linalg.yield %t : f32
    }}
    return
  }}
}}
"
        )
    }

    /// Run `jit` on a0 = 0..16, a1 = 1: a1 becomes i + 1 + k.
    fn run(jit: &Jit) -> Vec<f32> {
        let mut a0: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let mut a1 = vec![1.0f32; 16];
        // SAFETY: both buffers hold the 16 floats the function's types say.
        unsafe {
            jit.call_buffers(
                "fused",
                &[(a0.as_mut_ptr().cast(), 16), (a1.as_mut_ptr().cast(), 16)],
            )
        }
        .unwrap();
        a1
    }

    fn files(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .map(|r| {
                r.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    #[test]
    fn disk_cache_skips_the_compile_and_survives_corruption() {
        let dir = std::env::temp_dir().join(format!("megac-kcache-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cache = DiskCache::new(&dir);
        let src = source(0.5);
        let want: Vec<f32> = (0..16).map(|i| i as f32 + 1.5).collect();
        let (jit, origin) = compile_cached(&src, FUSED_PIPELINE, "fused", Some(&cache)).unwrap();
        assert_eq!(run(&jit), want);
        if let Origin::Compiled {
            not_stored: Some(why),
        } = &origin
        {
            // No C compiler to link the shared object: the JIT still works, nothing cached.
            assert!(why.contains("cc"), "{why}");
            eprintln!("disk cache not tested: {why}");
            return;
        }
        assert_eq!(origin, Origin::Compiled { not_stored: None });
        let f = files(&dir);
        assert_eq!(f.len(), 2, "{f:?}");
        assert!(f[0].ends_with(".meta") || f[1].ends_with(".meta"), "{f:?}");

        // A second compile of the same text loads the shared object.
        let (jit2, origin) = compile_cached(&src, FUSED_PIPELINE, "fused", Some(&cache)).unwrap();
        assert_eq!(origin, Origin::Loaded);
        assert_eq!(run(&jit2), want);
        // Another text is another entry.
        let (jit3, origin) =
            compile_cached(&source(2.0), FUSED_PIPELINE, "fused", Some(&cache)).unwrap();
        assert!(matches!(origin, Origin::Compiled { not_stored: None }));
        assert_eq!(run(&jit3)[0], 3.0);
        assert_eq!(files(&dir).len(), 4);

        // A corrupted shared object is a miss, compiled again and replaced. (Close the
        // loaded ones first: `dlopen` of a loaded path returns the mapping it has.)
        drop((jit, jit2, jit3));
        let so = files(&dir)
            .into_iter()
            .find(|n| n.ends_with(".so"))
            .unwrap();
        let (so_path, meta) = (dir.join(&so), dir.join(format!("{}.meta", &so[..16])));
        let text = std::fs::read_to_string(&meta).unwrap();
        let src_of = text.splitn(3, '\n').nth(2).unwrap().to_string();
        let mut bytes = std::fs::read(&so_path).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0xff;
        std::fs::write(&so_path, &bytes).unwrap();
        let (jit4, origin) =
            compile_cached(&src_of, FUSED_PIPELINE, "fused", Some(&cache)).unwrap();
        assert!(matches!(origin, Origin::Compiled { not_stored: None }));
        let _ = run(&jit4);
        drop(jit4);
        let (_, origin) = compile_cached(&src_of, FUSED_PIPELINE, "fused", Some(&cache)).unwrap();
        assert_eq!(origin, Origin::Loaded);
        // A truncated shared object too.
        std::fs::write(&so_path, &bytes[..100]).unwrap();
        let (_, origin) = compile_cached(&src_of, FUSED_PIPELINE, "fused", Some(&cache)).unwrap();
        assert!(matches!(origin, Origin::Compiled { not_stored: None }));
        let (_, origin) = compile_cached(&src_of, FUSED_PIPELINE, "fused", Some(&cache)).unwrap();
        assert_eq!(origin, Origin::Loaded);

        // Metadata holding another text (a hash collision) or garbage is a miss.
        std::fs::write(&meta, format!("{META_MAGIC}\nso {so}\nother text")).unwrap();
        let (_, origin) = compile_cached(&src_of, FUSED_PIPELINE, "fused", Some(&cache)).unwrap();
        assert!(matches!(origin, Origin::Compiled { .. }));
        std::fs::write(&meta, b"\xff\xfe garbage").unwrap();
        let (jit5, origin) =
            compile_cached(&src_of, FUSED_PIPELINE, "fused", Some(&cache)).unwrap();
        assert!(matches!(origin, Origin::Compiled { not_stored: None }));
        let _ = run(&jit5);
        drop(jit5);

        // Writers racing on one entry (threads here, processes alike): each leaves a
        // complete entry, and the survivor loads.
        let srcs = source(7.0);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    let (j, _) =
                        compile_cached(&srcs, FUSED_PIPELINE, "fused", Some(&cache)).unwrap();
                    assert_eq!(run(&j)[1], 9.0);
                });
            }
        });
        let (j, origin) = compile_cached(&srcs, FUSED_PIPELINE, "fused", Some(&cache)).unwrap();
        assert_eq!(origin, Origin::Loaded);
        assert_eq!(run(&j)[1], 9.0);
        assert!(
            !files(&dir).iter().any(|n| n.contains(".tmp-")),
            "{:?}",
            files(&dir)
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
