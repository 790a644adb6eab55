#!/usr/bin/env bash
# The project's test command (README; `.ci/run` calls exactly this). On a fresh Debian machine
# with the Rust toolchain it first sets up what the tests need, then runs everything:
#
#   1. System packages for the `mpi` feature and its tests: openmpi-bin (mpirun),
#      libopenmpi-dev (mpicc and headers, for the `mpi` crate's build script), libclang-dev
#      (bindgen, in that build script), iproute2 (`ip`, for scripts/two-nodes.sh, as root),
#      chromium (as root; the viewer's browser test, tests/scope_view.rs, then fails rather
#      than skips without it: MEGAC_REQUIRE_CHROMIUM=1).
#      LLVM/MLIR 22 for the `mlir` feature (melior's build scripts; see .cargo/config.toml):
#      llvm-22-dev, libmlir-22-dev, mlir-22-tools (mlir-opt-22, which tests/mlir.rs runs),
#      libclang-22-dev, libpolly-22-dev and libzstd-dev (llvm-config's static link lists).
#      Only what is missing is installed, with apt-get, and only as root; without root and
#      with something missing it stops at once and prints the install line.
#      Then NVRTC for the CUDA kernel test: the PyPI wheel nvidia-cuda-nvrtc, into
#      target/nvrtc, put on LD_LIBRARY_PATH (pip itself is installed with apt-get if missing).
#   2. The rustfmt and clippy components (rustup component add, when missing).
#   3. cargo fmt --check; then clippy -D warnings and every test of the workspace, first for
#      the default build (no MPI, no LLVM), then with --features mpi,mlir (the MPI tests:
#      tests/mpi.rs, runtime/tests/mpi_collectives.rs; MLIR emission: tests/mlir.rs; the fused
#      kernels: tests/fusion.rs, and the golden, layout and mixed-precision tests with fusion on). The
#      two opt-in features share one build, so MLIR costs no third build of the workspace,
#      only melior's crates and the link of MLIR's static libraries. Both builds keep their
#      own artifacts in target/, so a rerun recompiles nothing; but the second build compiles most of the workspace
#      again: bindgen (the `mpi` crate's build script) turns on features of crates that every
#      proc-macro uses (syn), so the crates above them are different builds.
#   4. scripts/two-nodes.sh (root only: network namespaces) with the MPI binary the tests
#      built. Not root: it is not run, and the last line says so.
set -euo pipefail
cd "$(dirname "$0")/.."

start=$SECONDS
step() { echo "== $* [$((SECONDS - start)) s]"; }

root=false
[[ $(id -u) == 0 ]] && root=true

# 1. System packages.
have_libclang() {
  # clang-sys (bindgen) finds libclang through LIBCLANG_PATH or in /usr/lib/llvm-*/lib;
  # the unversioned libclang.so and the clang headers come with the -dev package.
  [[ -n ${LIBCLANG_PATH:-} ]] || compgen -G '/usr/lib/llvm-*/lib/libclang.so' >/dev/null
}
missing=()
command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
command -v mpicc >/dev/null 2>&1 || missing+=(libopenmpi-dev)
have_libclang || missing+=(libclang-dev)
if $root; then
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  # Debian's Chromium, for the viewer's browser test (tests/scope_view.rs), which then must
  # run rather than skip.
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  export MEGAC_REQUIRE_CHROMIUM=1
fi
# LLVM/MLIR 22 (feature `mlir`), each package by a file it installs.
llvm22=/usr/lib/llvm-22
[[ -x $llvm22/bin/llvm-config ]] || missing+=(llvm-22-dev)
[[ -e $llvm22/include/mlir-c/IR.h ]] || missing+=(libmlir-22-dev)
[[ -x $llvm22/bin/mlir-opt ]] || missing+=(mlir-22-tools)
[[ -e $llvm22/include/clang-c/Index.h ]] || missing+=(libclang-22-dev)
[[ -e $llvm22/lib/libPolly.a ]] || missing+=(libpolly-22-dev)
[[ -e /usr/include/zstd.h ]] || missing+=(libzstd-dev)
if ((${#missing[@]})); then
  if ! $root; then
    echo "scripts/test.sh: the tests need these packages, which are missing: ${missing[*]}" >&2
    echo "Install them as root, then run this again:" >&2
    echo "  apt-get update && apt-get install -y --no-install-recommends ${missing[*]}" >&2
    exit 1
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "scripts/test.sh: missing ${missing[*]}, and there is no apt-get to install them" >&2
    exit 1
  fi
  step "installing ${missing[*]} (apt-get)"
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
fi

# 1b. NVRTC, for tests/cuda.rs (every CUDA kernel compiles, no GPU needed): the PyPI wheel,
# unpacked into target/nvrtc (once), on LD_LIBRARY_PATH for the tests; MEGAC_REQUIRE_NVRTC
# makes the test fail rather than skip when it cannot be loaded.
nvrtc_dir=${CARGO_TARGET_DIR:-$PWD/target}/nvrtc
if [[ ! -e $nvrtc_dir/nvidia/cu13/lib/libnvrtc.so.13 ]]; then
  if ! python3 -m pip --version >/dev/null 2>&1; then
    if ! $root; then
      echo "scripts/test.sh: the CUDA kernel test needs pip (python3 -m pip) to fetch NVRTC" >&2
      echo "  apt-get install -y --no-install-recommends python3-pip" >&2
      exit 1
    fi
    step "installing python3-pip (apt-get)"
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-pip
  fi
  step "pip install nvidia-cuda-nvrtc==13.0.88 (into $nvrtc_dir)"
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --target "$nvrtc_dir" \
    nvidia-cuda-nvrtc==13.0.88
fi
export LD_LIBRARY_PATH="$nvrtc_dir/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MEGAC_REQUIRE_NVRTC=1
# tests/mlir.rs sends every module it verifies through mlir-opt-22 (installed above); with
# this set, a missing mlir-opt fails the test rather than skipping the round trips.
export MEGAC_REQUIRE_MLIR_OPT=1
# The fused kernels' disk cache (feature `mlir`, docs/mlir.md) inside the build folder, so the
# tests neither write to the user's ~/.cache nor reuse kernels compiled by another checkout.
export MEGAC_KERNEL_CACHE=${CARGO_TARGET_DIR:-$PWD/target}/kernel-cache

# 2. Rust components.
for component in rustfmt clippy; do
  subcommand=${component/rustfmt/fmt}
  if ! cargo "$subcommand" --version >/dev/null 2>&1; then
    step "rustup component add $component"
    rustup component add "$component"
  fi
done
cargo --version
rustc --version
mpirun --version 2>&1 | sed -n 1p

# 3. Formatting, lints and tests of both builds.
step "cargo fmt --all -- --check"
cargo fmt --all -- --check
step "default build (no MPI): cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings
step "default build (no MPI): cargo test --workspace"
cargo test --workspace
step "--features mpi,mlir: cargo clippy --workspace --all-targets --features mpi,mlir -- -D warnings"
cargo clippy --workspace --all-targets --features mpi,mlir -- -D warnings
# The second build runs the tests whose code differs under these features: every crate's unit
# tests, and the test files that are feature-gated or hold feature-gated cases (the default
# build above already ran every other test file against the same code). A new test file with
# `cfg(feature = "mpi")` or `cfg(feature = "mlir")` cases belongs in this list. The golden,
# layout and mixed-precision tests run here too: their code is the same, but in this build
# every run goes through the fused kernels (on by default with `mlir`, docs/mlir.md), which
# round differently from the Rust kernels. Together 40 to 55 s with an empty kernel cache
# and 19 to 24 s with it filled (a loaded 2-core machine).
feature_tests=(--lib --test mpi --test mlir --test fusion --test cli --test examples --test mpi_collectives
  --test golden --test layouts --test mixed_precision)
step "--features mpi,mlir: cargo test --workspace --features mpi,mlir ${feature_tests[*]}"
cargo test --workspace --features mpi,mlir "${feature_tests[@]}"

# 4. Two "nodes" (network namespaces): a tp2 x dp2 run across them matches the local-thread
# run bit for bit. Uses the binary `cargo test --features mpi,mlir` just built (test profile).
if $root; then
  step "scripts/two-nodes.sh"
  MEGAC=${CARGO_TARGET_DIR:-target}/debug/megac bash scripts/two-nodes.sh
  step "all passed"
else
  step "all passed but scripts/two-nodes.sh, which was NOT run: it needs root (network namespaces)"
fi
