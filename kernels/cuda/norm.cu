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
