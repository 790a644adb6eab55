#!/usr/bin/env bash
# megac's MPI communicator against raw MPI, in the same run and interleaved: all-reduce,
# reduce-scatter and all-gather of 4 MiB and 4 KiB f32 buffers, as raw MPI calls, through
# MpiComm with MPI's native collectives (the default) and with --deterministic (in-order
# sums); median of the slowest rank's times (bench/mpi_allreduce/main.rs), on 2 and 4 ranks
# of this machine (shared memory, OpenMPI's vader; more ranks than cores oversubscribe).
#
#   bash bench/mpi_allreduce.sh [NP...]      (default: 2 4)
#   MEGAC_BENCH_ITERS=3 bash bench/mpi_allreduce.sh   (3x the iterations)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# A crate of its own (bench/mpi_allreduce), pinned to the workspace's lock file.
build=$root/target/bench-mpi-allreduce
mkdir -p "$build"
cp bench/mpi_allreduce/Cargo.toml bench/mpi_allreduce/main.rs "$build/"
sed -i "s|path = \"../../runtime\"|path = \"$root/runtime\"|" "$build/Cargo.toml"
cp Cargo.lock "$build/Cargo.lock"
cargo build --release --quiet --manifest-path "$build/Cargo.toml" --target-dir "$root/target"
exe=$root/target/release/mpi_allreduce
root_flags=()
if [[ $(id -u) == 0 ]]; then
  root_flags=(--allow-run-as-root)
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export MEGAC_BENCH_ITERS=${MEGAC_BENCH_ITERS:-1}
cores=$(nproc)
for np in "${@:-2 4}"; do
  for n in $np; do
    extra=()
    ((n > cores)) && extra=(--oversubscribe --mca mpi_yield_when_idle 1)
    mpirun -np "$n" "${root_flags[@]}" "${extra[@]}" -x MEGAC_BENCH_ITERS --bind-to none --mca pml ob1 \
      --mca btl self,vader --mca btl_vader_single_copy_mechanism none "$exe"
  done
done
