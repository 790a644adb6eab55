// SwiGLU (LLaMA's MLP activation), in f32: y = silu(gate) * up, silu(g) = g / (1 + e^-g).
// Gradient kernels accumulate (+=) into their outputs, as the CPU kernels do.

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

extern "C" __global__ void swiglu_fwd(const float* gate, const float* up, float* y,
                                      unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) {
        float g = gate[i];
        y[i] = g * sigmoid(g) * up[i];
    }
}

// dgate += dy * up * silu'(g), silu'(g) = s (1 + g (1 - s)); dup += dy * silu(g).
extern "C" __global__ void swiglu_bwd(const float* gate, const float* up, const float* dy,
                                      float* dgate, float* dup, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) {
        float g = gate[i], s = sigmoid(g);
        dgate[i] += dy[i] * up[i] * (s * (1.0f + g * (1.0f - s)));
        dup[i] += dy[i] * g * s;
    }
}
