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
