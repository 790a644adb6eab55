// Rotary position embedding on [b, s, heads, d] (Hugging Face's rotate_half layout: element
// i < d/2 pairs with i + d/2). The angle pos * theta^(-2i/d) is computed in f32; `inverse`
// rotates by the opposite angle (the backward, accumulating into y).
extern "C" __global__ void rope_apply(const float* x, float* y, const unsigned int* positions,
                                      unsigned int s, unsigned int heads, unsigned int d,
                                      float theta, int inverse) {
    unsigned long long row = blockIdx.x;  // (batch, position, head)
    unsigned int pos = positions[(row / heads) % s];
    unsigned int half = d / 2;
    const float* xr = x + row * d;
    float* yr = y + row * d;
    for (unsigned int i = threadIdx.x; i < half; i += blockDim.x) {
        float inv_freq = powf(theta, -(2.0f * (float)i) / (float)d);
        float angle = (float)pos * inv_freq;
        float c = cosf(angle), sn = sinf(angle);
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
