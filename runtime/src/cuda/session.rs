//! A single-rank training loop on the cuda executor, driven like the cpu backend's
//! [`crate::train::Session`] (which it uses for the data, the initial parameters and the
//! step's learning rate): per step the gradients are zeroed, every micro-batch's tokens are
//! copied in and its program run, then the optimizer program. Not run on a GPU yet.

use megac_ir::gate::CheckedPlan;
use megac_ir::plan::BufferClass;

use super::device::{CudaExecutor, Program};
use super::CudaError;
use crate::train::Session;

/// A cpu session (data, initialisation) and the GPU state of its one rank.
pub struct CudaSession<'p> {
    /// The cpu session: the data source, the initialised parameters.
    pub cpu: Session<'p>,
    /// The GPU.
    pub gpu: CudaExecutor,
}

impl<'p> CudaSession<'p> {
    /// Open the data, initialise the parameters on the host, set up the GPU and upload them.
    pub fn new(plan: &'p CheckedPlan, data: &str, ordinal: usize) -> Result<Self, CudaError> {
        super::device::check_libraries(plan.mesh.world_size() > 1)?;
        let cpu =
            Session::new(plan, data, None).map_err(|e| CudaError::Unsupported(e.to_string()))?;
        let gpu = CudaExecutor::new(plan, 0, ordinal)?;
        gpu.upload(&cpu.mem)?;
        Ok(CudaSession { cpu, gpu })
    }

    /// One optimizer step (1-based) on the GPU: (loss, gradient norm).
    pub fn step(&mut self, step: u64) -> Result<(f64, f64), CudaError> {
        let plan = self.cpu.plan;
        let grads = plan
            .buffers
            .iter()
            .enumerate()
            .filter(|(_, b)| b.class == BufferClass::Grad)
            .map(|(i, _)| i as u32);
        for g in grads {
            self.gpu.zero(g)?;
        }
        let ctx = self.cpu.context(step);
        let mut loss = 0.0;
        for mb in 0..plan.batch.microbatches {
            let (tokens, labels) = self.cpu.load(step, mb);
            if let Some(b) = self.cpu.tokens_buf {
                self.gpu.write_i32(b, &tokens)?;
            }
            if let Some(b) = self.cpu.labels_buf {
                self.gpu.write_i32(b, &labels)?;
            }
            self.gpu.run(Program::Microbatch, &ctx)?;
            if let Some(b) = self.cpu.loss_buf {
                loss += f64::from(self.gpu.read_f32(b)?[0]);
            }
        }
        self.gpu.run(Program::Optimizer, &ctx)?;
        let role = &plan.roles[plan.rank_to_role[0] as usize];
        let norm = match role.results.get("grad_norm") {
            Some(&b) => f64::from(self.gpu.read_f32(b)?[0]),
            None => 0.0,
        };
        Ok((loss, norm))
    }
}
