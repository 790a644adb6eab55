//! Forward and backward kernels of every op megac emits (CPU in Rust, CUDA sources for
//! NVRTC). Empty until the single-device training issue lands; the crate exists so the
//! workspace has the shape of DESIGN.md from the start.
