// Cross-entropy over rows of `v` logits (one block per row): loss[r] = logsumexp(x) - x[label],
// in f32; the gradient kernel writes softmax(x) - onehot(label), scaled by `scale`.
extern "C" __global__ void cross_entropy_fwd(const float* x, const int* labels, float* loss,
                                             unsigned int v) {
    const float* xr = x + (unsigned long long)blockIdx.x * v;
    float mx = -__int_as_float(0x7f800000);
    for (unsigned int j = threadIdx.x; j < v; j += blockDim.x) mx = fmaxf(mx, xr[j]);
    mx = block_max(mx);
    float s = 0.0f;
    for (unsigned int j = threadIdx.x; j < v; j += blockDim.x) s += expf(xr[j] - mx);
    s = block_sum(s);
    if (threadIdx.x == 0) loss[blockIdx.x] = logf(s) + mx - xr[labels[blockIdx.x]];
}

extern "C" __global__ void cross_entropy_bwd(const float* x, const int* labels, float* dx,
                                             unsigned int v, float scale) {
    const float* xr = x + (unsigned long long)blockIdx.x * v;
    float* dr = dx + (unsigned long long)blockIdx.x * v;
    float mx = -__int_as_float(0x7f800000);
    for (unsigned int j = threadIdx.x; j < v; j += blockDim.x) mx = fmaxf(mx, xr[j]);
    mx = block_max(mx);
    float s = 0.0f;
    for (unsigned int j = threadIdx.x; j < v; j += blockDim.x) s += expf(xr[j] - mx);
    s = block_sum(s);
    int label = labels[blockIdx.x];
    for (unsigned int j = threadIdx.x; j < v; j += blockDim.x)
        dr[j] += scale * (expf(xr[j] - mx) / s - (j == (unsigned int)label ? 1.0f : 0.0f));
}

// Vocab-parallel cross-entropy (Megatron's; runtime/src/sharded.rs's vocab_parallel_stats):
// each tp rank holds `v` columns of the logits starting at global column `start`, of which
// the first `real` are real vocabulary (the padding beyond the model's vocabulary is
// ignored). Per row, in three steps with a collective between each:
//   1. ce_row_max: the local max               -> all-reduce(max) over tp
//   2. ce_row_sumexp: Σ exp(x - global max), and the label's logit if this rank holds it
//                                              -> all-reduce(sum) over tp of both
//   3. ce_rows_loss / ce_vp_bwd: loss = log(sum) + max - target; the gradient.
extern "C" __global__ void ce_row_max(const float* x, float* mx_out, unsigned int v,
                                      unsigned int real) {
    const float* xr = x + (unsigned long long)blockIdx.x * v;
    float mx = -__int_as_float(0x7f800000);
    for (unsigned int j = threadIdx.x; j < real; j += blockDim.x) mx = fmaxf(mx, xr[j]);
    mx = block_max(mx);
    if (threadIdx.x == 0) mx_out[blockIdx.x] = mx;
}

extern "C" __global__ void ce_row_sumexp(const float* x, const int* labels, const float* gmax,
                                         float* sum_out, float* target_out, unsigned int v,
                                         unsigned int real, long long start) {
    unsigned int r = blockIdx.x;
    const float* xr = x + (unsigned long long)r * v;
    float m = gmax[r];
    float s = 0.0f;
    for (unsigned int j = threadIdx.x; j < real; j += blockDim.x) s += expf(xr[j] - m);
    s = block_sum(s);
    if (threadIdx.x == 0) {
        long long local = (long long)labels[r] - start;
        sum_out[r] = s;
        target_out[r] = (local >= 0 && local < (long long)real) ? xr[local] : 0.0f;
    }
}

// loss_rows[r] = log(sum[r]) + max[r] - target[r] (the host, or ce_mean, sums the rows).
extern "C" __global__ void ce_rows_loss(const float* gmax, const float* gsum,
                                        const float* target, float* loss_rows,
                                        unsigned int rows) {
    unsigned int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < rows) loss_rows[r] = logf(gsum[r]) + gmax[r] - target[r];
}

// out[0] = Σ_r loss_rows[r] / tokens, summed by one block in a fixed order (f64).
extern "C" __global__ void ce_mean(const float* loss_rows, float* out, unsigned int rows,
                                   double tokens) {
    __shared__ double partial[1024];
    double s = 0.0;
    for (unsigned int r = threadIdx.x; r < rows; r += blockDim.x) s += (double)loss_rows[r];
    partial[threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (unsigned int i = 0; i < blockDim.x; ++i) t += partial[i];
        out[0] = (float)(t / tokens);
    }
}

// dx[r, j] += scale (softmax(x)[j] - onehot(label)[j]) over this rank's real columns, from
// the reduced statistics (padding columns get nothing).
extern "C" __global__ void ce_vp_bwd(const float* x, const int* labels, const float* gmax,
                                     const float* gsum, float* dx, unsigned int v,
                                     unsigned int real, long long start, float scale) {
    unsigned int r = blockIdx.x;
    const float* xr = x + (unsigned long long)r * v;
    float* dr = dx + (unsigned long long)r * v;
    float m = gmax[r], inv = 1.0f / gsum[r];
    long long local = (long long)labels[r] - start;
    for (unsigned int j = threadIdx.x; j < real; j += blockDim.x)
        dr[j] += scale * (expf(xr[j] - m) * inv - ((long long)j == local ? 1.0f : 0.0f));
}
