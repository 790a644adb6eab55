// The masked softmax of unfused attention (scores = Q·Kᵀ and out = P·V run as cuBLAS
// batched GEMMs; kernels/src/attention.rs's meaning). Rows are (batch, head, query) of `sk`
// scores; one block per row. A key is visible to query `i` when
//   causal (positions null):  j <= i + (sk - sq)
//   with positions:           kpos[j] <= qpos[i] and (window == 0 or qpos[i] - kpos[j] < window)
//   full (causal == 0):       every key.
// `scale` multiplies the raw scores (1/sqrt(d)).

__device__ __forceinline__ bool visible(int causal, const unsigned int* qpos,
                                        const unsigned int* kpos, unsigned int window,
                                        unsigned int i, unsigned int j, unsigned int sq,
                                        unsigned int sk) {
    if (!causal) return true;
    if (qpos == 0) {
        if (window == 0) return j <= i + (sk - sq);
        unsigned int qi = i + (sk - sq);
        return j <= qi && qi - j < window;
    }
    unsigned int q = qpos[i], k = kpos[j];
    return k <= q && (window == 0 || q - k < window);
}

// p[r, j] = exp(scale s[r, j] - lse[r]) for visible keys, 0 otherwise; lse[r] the natural
// log-sum-exp of the visible scaled scores (-inf when none is visible, and then p = 0).
// `s` and `p` may be the same buffer (in place).
extern "C" __global__ void masked_softmax_fwd(const float* s, float* p, float* lse,
                                              unsigned int sq, unsigned int sk, float scale,
                                              int causal, const unsigned int* qpos,
                                              const unsigned int* kpos, unsigned int window) {
    unsigned long long r = blockIdx.x;
    unsigned int i = (unsigned int)(r % sq);
    const float* sr = s + r * sk;
    float* pr = p + r * sk;
    const float ninf = -__int_as_float(0x7f800000);
    float mx = ninf;
    for (unsigned int j = threadIdx.x; j < sk; j += blockDim.x)
        if (visible(causal, qpos, kpos, window, i, j, sq, sk)) mx = fmaxf(mx, sr[j] * scale);
    mx = block_max(mx);
    float sum = 0.0f;
    if (mx != ninf)
        for (unsigned int j = threadIdx.x; j < sk; j += blockDim.x)
            if (visible(causal, qpos, kpos, window, i, j, sq, sk)) sum += expf(sr[j] * scale - mx);
    sum = block_sum(sum);
    float l = mx == ninf ? ninf : mx + logf(sum);
    __syncthreads();
    for (unsigned int j = threadIdx.x; j < sk; j += blockDim.x)
        pr[j] = (l != ninf && visible(causal, qpos, kpos, window, i, j, sq, sk))
                    ? expf(sr[j] * scale - l) : 0.0f;
    if (threadIdx.x == 0) lse[r] = l;
}

// Backward through softmax and the scale: ds[r, j] = scale p (dp - Σ_j p dp), written over
// `ds` (which may be `dp`). Masked keys have p = 0, so they get 0.
extern "C" __global__ void masked_softmax_bwd(const float* p, const float* dp, float* ds,
                                              unsigned int sk, float scale) {
    unsigned long long r = blockIdx.x;
    const float* pr = p + r * sk;
    const float* dr = dp + r * sk;
    float* o = ds + r * sk;
    float dot = 0.0f;
    for (unsigned int j = threadIdx.x; j < sk; j += blockDim.x) dot += pr[j] * dr[j];
    dot = block_sum(dot);
    __syncthreads();
    for (unsigned int j = threadIdx.x; j < sk; j += blockDim.x) o[j] = scale * pr[j] * (dr[j] - dot);
}
