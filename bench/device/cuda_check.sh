#!/usr/bin/env bash
# The one device check to run on a machine lent with an NVIDIA GPU (CUDA 13 libraries):
# NVRTC compiles every kernel of kernels/cuda/ for the device's architecture and the driver
# loads each one (tests/cuda.rs, including its ignored GPU test). It executes no plan: no
# plan runs on a GPU yet. Needs libnvrtc.so.13 and libcuda.so.1 on the loader's path.
#
#   bash bench/device/cuda_check.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || true
MEGAC_REQUIRE_NVRTC=1 cargo test --release --test cuda -- --include-ignored --nocapture
