// Rotary position embedding on [b, s, heads, d] (Hugging Face's rotate_half layout: element
// i < d/2 pairs with i + d/2), one block per (batch, position, head) row. The angles come as
// tables `cos`, `sin` `[s, d/2]` that the host computes once with the cpu backend's own
// `rope_tables_freq` (scaled RoPE and context-parallel positions included). `inverse`
// rotates by the opposite angle (the backward, accumulating into y).
extern "C" __global__ void rope_apply(const float* x, float* y, const float* cos_t,
                                      const float* sin_t, unsigned int s, unsigned int heads,
                                      unsigned int d, int inverse) {
    unsigned long long row = blockIdx.x;  // (batch, position, head)
    unsigned long long pos = (row / heads) % s;
    unsigned int half = d / 2;
    const float* xr = x + row * d;
    float* yr = y + row * d;
    for (unsigned int i = threadIdx.x; i < half; i += blockDim.x) {
        float c = cos_t[pos * half + i], sn = sin_t[pos * half + i];
        float a = xr[i], bb = xr[i + half];
        if (inverse) {
            yr[i] += a * c + bb * sn;
            yr[i + half] += bb * c - a * sn;
        } else {
            yr[i] = a * c - bb * sn;
            yr[i + half] = bb * c + a * sn;
        }
    }
}
