// MegaScope's `perturb` kernels (kernels/src/perturb.rs), in place on the first n f32
// elements of the perturbed copy (the lowering copies the point first; `probe` is a plain
// copy). Their random numbers are the cpu kernels' exactly: SplitMix64 from the stream's
// seed, whose k-th output (k from 1) is a function of seed + k * 0x9E3779B97F4A7C15 alone,
// so element i reads outputs 2i+1 and 2i+2 (the cpu kernels draw two per element in order).

// The k-th output of SplitMix64 seeded with `seed`.
__device__ unsigned long long splitmix_at(unsigned long long seed, unsigned long long k) {
    unsigned long long z = seed + k * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// The k-th output as a double in [0, 1) (its top 53 bits).
__device__ double splitmix_unit_at(unsigned long long seed, unsigned long long k) {
    return (double)(splitmix_at(seed, k) >> 11) / 9007199254740992.0;
}

// y = y * f in double, rounded once.
extern "C" __global__ void perturb_scale(float* y, double f, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = (float)((double)y[i] * f);
}

// out[0] = sum of y[i]^2 in double: one block of 256 threads (the launch), each summing a
// stride, then a tree in shared memory.
extern "C" __global__ void perturb_sum_squares(const float* y, double* out,
                                               unsigned long long n) {
    __shared__ double part[256];
    double acc = 0.0;
    for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
        double v = (double)y[i];
        acc += v * v;
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned int w = blockDim.x / 2; w > 0; w /= 2) {
        if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[0] = part[0];
}

// y += sigma * rms(y) * g, g standard normal by Box-Muller from outputs 2i+1, 2i+2;
// `sum_squares` is perturb_sum_squares' result over the same n elements.
extern "C" __global__ void perturb_noise(float* y, const double* sum_squares, double sigma,
                                         unsigned long long seed, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    double count = n > 0 ? (double)n : 1.0;
    float sd = (float)(sigma * sqrt(sum_squares[0] / count));
    double u1 = 1.0 - splitmix_unit_at(seed, 2 * i + 1);
    double u2 = splitmix_unit_at(seed, 2 * i + 2);
    float g = (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
    y[i] += sd * g;
}

// With probability `rate` (output 2i+1), flip bit first + (output 2i+2) % count of y[i].
extern "C" __global__ void perturb_bitflip(float* y, unsigned int first, unsigned int count,
                                           double rate, unsigned long long seed,
                                           unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned long long c = count > 0 ? count : 1;
    int hit = splitmix_unit_at(seed, 2 * i + 1) < rate;
    unsigned int bit = first + (unsigned int)(splitmix_at(seed, 2 * i + 2) % c);
    if (hit) y[i] = __uint_as_float(__float_as_uint(y[i]) ^ (1u << bit));
}

// Zero local head `head` (of `heads`, each d wide) in every row of y.
extern "C" __global__ void perturb_zero_head(float* y, unsigned int head, unsigned int heads,
                                             unsigned int d, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned long long within = i % ((unsigned long long)heads * d);
    if (within / d == head) y[i] = 0.0f;
}
