// AdamW (PyTorch's single-tensor formulation, decoupled weight decay), one element per
// thread, on f32 master weights, in the cpu kernel's order (kernels/src/optim.rs): the step
// scalars come from the host exactly as the cpu kernel derives them, `clip` scales the
// gradient (global-norm clipping and fp16's unscaling):
// p *= decay; m = lerp(m, g, w1) (ATen's two-sided fma form); v = fma(w2 g, g, v beta2);
// p += neg_step_size * m / (sqrt(v) / bc2_sqrt + eps).
__device__ __forceinline__ void adamw_one(float* p, const float* g, float* m, float* v,
                                          unsigned long long i, float clip, float decay,
                                          float w1, int w1_small, float w2, float beta2,
                                          float bc2_sqrt, float eps, float neg_step_size) {
    float gi = g[i] * clip;
    float pi = p[i] * decay;
    float mi = w1_small ? fmaf(w1, gi - m[i], m[i]) : fmaf(w1 - 1.0f, gi - m[i], gi);
    float vi = fmaf(w2 * gi, gi, v[i] * beta2);
    m[i] = mi;
    v[i] = vi;
    p[i] = pi + neg_step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
}

extern "C" __global__ void adamw_step(float* p, const float* g, float* m, float* v,
                                      unsigned long long n, float clip, float decay, float w1,
                                      int w1_small, float w2, float beta2, float bc2_sqrt,
                                      float eps, float neg_step_size) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n)
        adamw_one(p, g, m, v, i, clip, decay, w1, w1_small, w2, beta2, bc2_sqrt, eps,
                  neg_step_size);
}

// Sum of squares of `x` into `out[blockIdx.x]` (one partial per block; the host adds them in
// a fixed order, for the global gradient norm).
extern "C" __global__ void sum_squares(const float* x, float* out, unsigned long long n) {
    float s = 0.0f;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        s += x[i] * x[i];
    s = block_sum(s);
    if (threadIdx.x == 0) out[blockIdx.x] = s;
}

// The global gradient norm's last step: out[0] = Σ partials (f64, in index order, one
// thread), so the norm does not depend on how the blocks were scheduled.
// `scale` divides a replicated gradient's squares by its replica count (runtime/src/exec/
// optim.rs); `accumulate` adds to out[0] instead of overwriting it.
extern "C" __global__ void sum_partials(const float* partials, double* out, unsigned int n,
                                        double scale, int accumulate) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double s = 0.0;
    for (unsigned int i = 0; i < n; ++i) s += (double)partials[i];
    out[0] = (accumulate ? out[0] : 0.0) + s * scale;
}

// norm[0] = sqrt(total[0]) / loss_scale (after the all-reduce of the total over the group).
extern "C" __global__ void grad_norm_finish(const double* total, float* norm, double loss_scale) {
    if (blockIdx.x == 0 && threadIdx.x == 0) norm[0] = (float)(sqrt(total[0]) / loss_scale);
}

// AdamW over many tensors in one launch (multi-tensor apply): tensor `t` has n[t] elements at
// p[t], g[t], m[t], v[t] (device addresses); blockIdx.y picks the tensor, the x dimension
// strides over its elements. The same update as adamw_step.
extern "C" __global__ void adamw_multi(const unsigned long long* p, const unsigned long long* g,
                                       const unsigned long long* m, const unsigned long long* v,
                                       const unsigned long long* n, float clip, float decay,
                                       float w1, int w1_small, float w2, float beta2,
                                       float bc2_sqrt, float eps, float neg_step_size) {
    unsigned int t = blockIdx.y;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < n[t]; i += (unsigned long long)gridDim.x * blockDim.x)
        adamw_one((float*)p[t], (const float*)g[t], (float*)m[t], (float*)v[t], i, clip, decay,
                  w1, w1_small, w2, beta2, bc2_sqrt, eps, neg_step_size);
}
