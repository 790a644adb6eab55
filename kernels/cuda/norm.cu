// Row norms in f32, one block per row of `h` elements.

// RMSNorm: y = x / sqrt(mean(x^2) + eps) * w.
extern "C" __global__ void rms_norm_fwd(const float* x, const float* w, float* y,
                                        unsigned int h, float eps) {
    const float* xr = x + (unsigned long long)blockIdx.x * h;
    float* yr = y + (unsigned long long)blockIdx.x * h;
    float ss = 0.0f;
    for (unsigned int j = threadIdx.x; j < h; j += blockDim.x) ss += xr[j] * xr[j];
    float rstd = rsqrtf(block_sum(ss) / (float)h + eps);
    for (unsigned int j = threadIdx.x; j < h; j += blockDim.x) yr[j] = xr[j] * rstd * w[j];
}

// LayerNorm: y = (x - mean) / sqrt(var + eps) * w + b (biased variance).
extern "C" __global__ void layer_norm_fwd(const float* x, const float* w, const float* b,
                                          float* y, unsigned int h, float eps) {
    const float* xr = x + (unsigned long long)blockIdx.x * h;
    float* yr = y + (unsigned long long)blockIdx.x * h;
    float s = 0.0f;
    for (unsigned int j = threadIdx.x; j < h; j += blockDim.x) s += xr[j];
    float mean = block_sum(s) / (float)h;
    float v = 0.0f;
    for (unsigned int j = threadIdx.x; j < h; j += blockDim.x) {
        float d = xr[j] - mean;
        v += d * d;
    }
    float rstd = rsqrtf(block_sum(v) / (float)h + eps);
    for (unsigned int j = threadIdx.x; j < h; j += blockDim.x)
        yr[j] = (xr[j] - mean) * rstd * w[j] + b[j];
}

// RMSNorm backward, one block per row: dx += w ⊙ rstd (dy - x̂ mean(dy ⊙ w ⊙ x̂)) with
// x̂ = x rstd; writes each row's rstd into `stats[row]` for norm_dw (the weight gradient,
// summed over rows in row order by a second kernel: deterministic).
extern "C" __global__ void rms_norm_bwd_dx(const float* x, const float* w, const float* dy,
                                           float* dx, float* stats, unsigned int h, float eps) {
    unsigned long long o = (unsigned long long)blockIdx.x * h;
    float ss = 0.0f;
    for (unsigned int j = threadIdx.x; j < h; j += blockDim.x) ss += x[o + j] * x[o + j];
    float rstd = rsqrtf(block_sum(ss) / (float)h + eps);
    float dot = 0.0f;
    for (unsigned int j = threadIdx.x; j < h; j += blockDim.x)
        dot += dy[o + j] * w[j] * x[o + j] * rstd;
    float c = block_sum(dot) / (float)h;
    for (unsigned int j = threadIdx.x; j < h; j += blockDim.x)
        dx[o + j] += rstd * (dy[o + j] * w[j] - x[o + j] * rstd * c);
    if (threadIdx.x == 0) stats[blockIdx.x] = rstd;
}

// LayerNorm backward, one block per row: dx += rstd (g - mean(g) - x̂ mean(g x̂)), g = dy ⊙ w;
// writes (mean, rstd) into stats[2 row ..] for norm_dw.
extern "C" __global__ void layer_norm_bwd_dx(const float* x, const float* w, const float* dy,
                                             float* dx, float* stats, unsigned int h,
                                             float eps) {
    unsigned long long o = (unsigned long long)blockIdx.x * h;
    float s = 0.0f;
    for (unsigned int j = threadIdx.x; j < h; j += blockDim.x) s += x[o + j];
    float mean = block_sum(s) / (float)h;
    float v = 0.0f;
    for (unsigned int j = threadIdx.x; j < h; j += blockDim.x) {
        float d = x[o + j] - mean;
        v += d * d;
    }
    float rstd = rsqrtf(block_sum(v) / (float)h + eps);
    float sg = 0.0f, sgx = 0.0f;
    for (unsigned int j = threadIdx.x; j < h; j += blockDim.x) {
        float g = dy[o + j] * w[j];
        sg += g;
        sgx += g * (x[o + j] - mean) * rstd;
    }
    float mg = block_sum(sg) / (float)h;
    float mgx = block_sum(sgx) / (float)h;
    for (unsigned int j = threadIdx.x; j < h; j += blockDim.x) {
        float xh = (x[o + j] - mean) * rstd;
        dx[o + j] += rstd * (dy[o + j] * w[j] - mg - xh * mgx);
    }
    if (threadIdx.x == 0) {
        stats[2 * blockIdx.x] = mean;
        stats[2 * blockIdx.x + 1] = rstd;
    }
}

// The norms' parameter gradients, one thread per column, rows in order (f64):
// dw[j] += Σ_r dy[r, j] x̂[r, j] and, for LayerNorm (db not null), db[j] += Σ_r dy[r, j].
// x̂ = (x - mean) rstd from `stats`: per row (rstd) when `layer` is 0, (mean, rstd) when 1.
extern "C" __global__ void norm_dw(const float* x, const float* dy, const float* stats,
                                   float* dw, float* db, unsigned int rows, unsigned int h,
                                   int layer) {
    unsigned int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= h) return;
    double aw = 0.0, ab = 0.0;
    for (unsigned int r = 0; r < rows; ++r) {
        unsigned long long o = (unsigned long long)r * h + j;
        float mean = layer ? stats[2 * r] : 0.0f;
        float rstd = layer ? stats[2 * r + 1] : stats[r];
        aw += (double)(dy[o] * ((x[o] - mean) * rstd));
        ab += (double)dy[o];
    }
    dw[j] += (float)aw;
    if (db) db[j] += (float)ab;
}
