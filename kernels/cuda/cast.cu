// Storage casts between f32 and the 16-bit formats (one element per thread).

extern "C" __global__ void cast_f32_to_bf16(const float* x, bf16_t* y, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = f32_to_bf16(x[i]);
}

extern "C" __global__ void cast_bf16_to_f32(const bf16_t* x, float* y, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = bf16_to_f32(x[i]);
}

extern "C" __global__ void cast_f32_to_f16(const float* x, f16_t* y, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = f32_to_f16(x[i]);
}

extern "C" __global__ void cast_f16_to_f32(const f16_t* x, float* y, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = f16_to_f32(x[i]);
}
