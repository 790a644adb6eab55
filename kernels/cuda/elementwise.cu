// Element-wise and copy kernels in f32 (kernels/src/elementwise.rs, activation.rs, and the
// copies of runtime/src/exec/dense.rs and attention.rs). One element per thread unless said.

#define IDX unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x

// y = a + b.
extern "C" __global__ void add_fwd(const float* a, const float* b, float* y, unsigned long long n) {
    IDX;
    if (i < n) y[i] = a[i] + b[i];
}

// y += x (grad_sum's contributions, gradient accumulation).
extern "C" __global__ void accumulate(float* y, const float* x, unsigned long long n) {
    IDX;
    if (i < n) y[i] += x[i];
}

// x *= c (the gradient norm's clipping, fp16's unscaling).
extern "C" __global__ void scale_in_place(float* x, float c, unsigned long long n) {
    IDX;
    if (i < n) x[i] *= c;
}

// y[r, j] = x[r, j] + b[j] for rows of `cols`.
extern "C" __global__ void bias_add(const float* x, const float* b, float* y, unsigned int cols,
                                    unsigned long long n) {
    IDX;
    if (i < n) y[i] = x[i] + b[i % cols];
}

// db[j] += Σ_r dy[r, j] (row order, f64), one thread per column.
extern "C" __global__ void column_sum_acc(const float* dy, float* db, unsigned int rows,
                                          unsigned int cols) {
    unsigned int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cols) return;
    double s = 0.0;
    for (unsigned int r = 0; r < rows; ++r) s += (double)dy[(unsigned long long)r * cols + j];
    db[j] += (float)s;
}

// GPT-2's GELU, tanh approximation: y = 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³))).
extern "C" __global__ void gelu_tanh_fwd(const float* x, float* y, unsigned long long n) {
    IDX;
    if (i < n) {
        float v = x[i];
        float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
        y[i] = 0.5f * v * (1.0f + tanhf(u));
    }
}

// dx += dy · gelu'(x).
extern "C" __global__ void gelu_tanh_bwd(const float* x, const float* dy, float* dx,
                                         unsigned long long n) {
    IDX;
    if (i < n) {
        float v = x[i];
        float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
        float t = tanhf(u);
        float du = 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * v * v);
        dx[i] += dy[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
    }
}

// Qwen2-MoE's shared-expert gate: y[t, :] = sigmoid(gate[t]) x[t, :], one block per row.
extern "C" __global__ void sigmoid_mul_fwd(const float* gate, const float* x, float* y,
                                           unsigned int h) {
    unsigned long long t = blockIdx.x;
    float s = 1.0f / (1.0f + expf(-gate[t]));
    for (unsigned int j = threadIdx.x; j < h; j += blockDim.x) y[t * h + j] = s * x[t * h + j];
}

// dx += s dy, dgate[t] += s (1 - s) Σ_j dy x, one block per row.
extern "C" __global__ void sigmoid_mul_bwd(const float* gate, const float* x, const float* dy,
                                           float* dgate, float* dx, unsigned int h) {
    unsigned long long t = blockIdx.x;
    float s = 1.0f / (1.0f + expf(-gate[t]));
    float dot = 0.0f;
    for (unsigned int j = threadIdx.x; j < h; j += blockDim.x) {
        dx[t * h + j] += s * dy[t * h + j];
        dot += dy[t * h + j] * x[t * h + j];
    }
    dot = block_sum(dot);
    if (threadIdx.x == 0) dgate[t] += s * (1.0f - s) * dot;
}

// Column block copy: dst[r, dst_col + j] = src[r, src_col + j] for j < cols (split, concat,
// and their gradients with accumulate = 1: +=).
extern "C" __global__ void copy_columns(const float* src, float* dst, unsigned int rows,
                                        unsigned int cols, unsigned int src_width,
                                        unsigned int src_col, unsigned int dst_width,
                                        unsigned int dst_col, int accumulate) {
    IDX;
    if (i >= (unsigned long long)rows * cols) return;
    unsigned long long r = i / cols, j = i % cols;
    float v = src[r * src_width + src_col + j];
    float* d = dst + r * dst_width + dst_col + j;
    *d = accumulate ? *d + v : v;
}

// Hugging Face's repeat_kv on [b, s, nkv, d] -> [b, s, nkv·group, d]: query head h reads
// kv head h / group.
extern "C" __global__ void repeat_kv_fwd(const float* x, float* y, unsigned int nkv,
                                         unsigned int group, unsigned int d,
                                         unsigned long long n) {
    IDX;
    if (i >= n) return;
    unsigned long long e = i % d, rest = i / d;
    unsigned int nh = nkv * group;
    unsigned long long h = rest % nh, row = rest / nh;
    y[i] = x[(row * nkv + h / group) * d + e];
}

// dx[b, s, kh] += Σ_{h of kh's group} dy[b, s, h] (group order), one thread per dx element.
extern "C" __global__ void repeat_kv_bwd(const float* dy, float* dx, unsigned int nkv,
                                         unsigned int group, unsigned int d,
                                         unsigned long long n) {
    IDX;
    if (i >= n) return;
    unsigned long long e = i % d, rest = i / d;
    unsigned long long kh = rest % nkv, row = rest / nkv;
    float acc = 0.0f;
    for (unsigned int g = 0; g < group; ++g)
        acc += dy[(row * nkv * group + kh * group + g) * d + e];
    dx[i] += acc;
}

// [b, s, nh, d] (sequence-major) to [b, nh, s, d] (head-major) and back, for the batched
// attention GEMMs. `inverse` (and `accumulate`) for the way back into gradients.
extern "C" __global__ void transpose_heads(const float* x, float* y, unsigned int s,
                                           unsigned int nh, unsigned int d, int inverse,
                                           int accumulate, unsigned long long n) {
    IDX;
    if (i >= n) return;
    unsigned long long e = i % d, rest = i / d;
    unsigned long long a = rest % nh, rest2 = rest / nh;  // seq-major: (b, s, h)
    unsigned long long pos = rest2 % s, b = rest2 / s;
    unsigned long long hm = ((b * nh + a) * s + pos) * d + e;
    unsigned long long src = inverse ? hm : i, dst = inverse ? i : hm;
    y[dst] = accumulate ? y[dst] + x[src] : x[src];
}
