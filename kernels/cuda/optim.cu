// AdamW (PyTorch's formulation, decoupled weight decay), one element per thread, on f32
// master weights; `clip` scales the gradient (global-norm clipping), the step scalars come
// from the host as the CPU kernel computes them (kernels/src/optim.rs):
// p *= decay; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
// p += neg_step_size * m / (sqrt(v) / bc2_sqrt + eps).
extern "C" __global__ void adamw_step(float* p, const float* g, float* m, float* v,
                                      unsigned long long n, float clip, float decay,
                                      float beta1, float beta2, float bc2_sqrt, float eps,
                                      float neg_step_size) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) {
        float gi = g[i] * clip;
        float pi = p[i] * decay;
        float mi = beta1 * m[i] + (1.0f - beta1) * gi;
        float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p[i] = pi + neg_step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
    }
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
