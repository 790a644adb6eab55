// Mixture of experts: the router and the token movement of dispatch/combine
// (kernels/src/moe.rs). Which token goes to which expert row (the capacity, the drop order)
// is decided on the host from the router's indices by the CPU backend's own `Routing`, and
// handed to these kernels as tables: for dispatch, each expert row's source token (-1: an
// unused row, zeroed); for combine, each (token, slot)'s expert row as a device address
// (0: a dropped slot), so separate per-expert buffers and stacked ones look the same.

// Mixtral's router, one thread per token: p = softmax(logits[t]) (max-shifted, summed in
// f64), the top_k most probable experts in descending order (ties to the lower index), their
// probabilities renormalised to sum to one when `renorm`.
extern "C" __global__ void router_fwd(const float* logits, float* weights, int* indices,
                                      unsigned int tokens, unsigned int experts,
                                      unsigned int top_k, int renorm) {
    unsigned int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= tokens) return;
    const float* z = logits + (unsigned long long)t * experts;
    float mx = -__int_as_float(0x7f800000);
    for (unsigned int e = 0; e < experts; ++e) mx = fmaxf(mx, z[e]);
    double s = 0.0;
    for (unsigned int e = 0; e < experts; ++e) s += (double)expf(z[e] - mx);
    float* w = weights + (unsigned long long)t * top_k;
    int* ix = indices + (unsigned long long)t * top_k;
    double chosen = 0.0;
    for (unsigned int k = 0; k < top_k; ++k) {
        int best = -1;
        float bp = 0.0f;
        for (unsigned int e = 0; e < experts; ++e) {
            bool taken = false;
            for (unsigned int q = 0; q < k; ++q) taken = taken || ix[q] == (int)e;
            if (taken) continue;
            float p = (float)((double)expf(z[e] - mx) / s);
            if (best < 0 || p > bp) { best = (int)e; bp = p; }
        }
        ix[k] = best;
        w[k] = bp;
        chosen += (double)bp;
    }
    if (renorm)
        for (unsigned int k = 0; k < top_k; ++k) w[k] = (float)((double)w[k] / chosen);
}

// Backward of router_fwd, the choice held fixed, one thread per token (accumulates):
// renorm: dlogits[i] += w_i (g_i - ḡ) for chosen i, ḡ = Σ g_j w_j over the chosen;
// otherwise dlogits[i] += p_i (g_i [i chosen] - ḡ) for every expert, ḡ = Σ_chosen g_j p_j.
extern "C" __global__ void router_bwd(const float* logits, const int* indices,
                                      const float* dweights, float* dlogits,
                                      unsigned int tokens, unsigned int experts,
                                      unsigned int top_k, int renorm) {
    unsigned int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= tokens) return;
    const float* z = logits + (unsigned long long)t * experts;
    const int* ix = indices + (unsigned long long)t * top_k;
    const float* g = dweights + (unsigned long long)t * top_k;
    float* dz = dlogits + (unsigned long long)t * experts;
    float mx = -__int_as_float(0x7f800000);
    for (unsigned int e = 0; e < experts; ++e) mx = fmaxf(mx, z[e]);
    if (renorm) {
        double s = 0.0;
        for (unsigned int k = 0; k < top_k; ++k) s += (double)expf(z[ix[k]] - mx);
        double gbar = 0.0;
        for (unsigned int k = 0; k < top_k; ++k) gbar += (double)g[k] * expf(z[ix[k]] - mx) / s;
        for (unsigned int k = 0; k < top_k; ++k) {
            double w = (double)expf(z[ix[k]] - mx) / s;
            dz[ix[k]] += (float)(w * ((double)g[k] - gbar));
        }
    } else {
        double s = 0.0;
        for (unsigned int e = 0; e < experts; ++e) s += (double)expf(z[e] - mx);
        double gbar = 0.0;
        for (unsigned int k = 0; k < top_k; ++k) gbar += (double)g[k] * expf(z[ix[k]] - mx) / s;
        for (unsigned int e = 0; e < experts; ++e) {
            double p = (double)expf(z[e] - mx) / s, gi = 0.0;
            for (unsigned int k = 0; k < top_k; ++k) if (ix[k] == (int)e) gi = (double)g[k];
            dz[e] += (float)(p * (gi - gbar));
        }
    }
}

// Dispatch: out[r] = x[src[r]] (src[r] < 0: a row no token fills, zeroed), one block per row.
extern "C" __global__ void moe_gather_rows(const float* x, const int* src, float* out,
                                           unsigned int h) {
    unsigned long long r = blockIdx.x;
    int t = src[r];
    for (unsigned int j = threadIdx.x; j < h; j += blockDim.x)
        out[r * h + j] = t >= 0 ? x[(unsigned long long)t * h + j] : 0.0f;
}

// Backward of dispatch, one block per token: dx[t] += Σ_slot dy[row[t, slot]] over the
// token's rows in this expert's buffer (row < 0: the slot goes elsewhere or was dropped).
extern "C" __global__ void moe_scatter_add_rows(const float* dy, const int* row, float* dx,
                                                unsigned int top_k, unsigned int h) {
    unsigned long long t = blockIdx.x;
    for (unsigned int j = threadIdx.x; j < h; j += blockDim.x) {
        float acc = dx[t * h + j];
        for (unsigned int k = 0; k < top_k; ++k) {
            int r = row[t * top_k + k];
            if (r >= 0) acc += dy[(unsigned long long)r * h + j];
        }
        dx[t * h + j] = acc;
    }
}

// Combine, one block per token: out[t] = Σ_slot weights[t, slot] · *rows[t, slot] (f64 sum;
// a 0 address is a dropped slot). Overwrites out.
extern "C" __global__ void moe_combine_fwd(const float* weights,
                                           const unsigned long long* rows, float* out,
                                           unsigned int top_k, unsigned int h) {
    unsigned long long t = blockIdx.x;
    for (unsigned int j = threadIdx.x; j < h; j += blockDim.x) {
        double acc = 0.0;
        for (unsigned int k = 0; k < top_k; ++k) {
            const float* y = (const float*)rows[t * top_k + k];
            if (y) acc += (double)weights[t * top_k + k] * (double)y[j];
        }
        out[t * h + j] = (float)acc;
    }
}

// Backward of combine, one block per token (accumulates): dweights[t, slot] += dout[t] ·
// *rows[t, slot] and *drows[t, slot] += weights[t, slot] dout[t]; each expert row belongs to
// one (token, slot), so no two blocks write the same row.
extern "C" __global__ void moe_combine_bwd(const float* weights,
                                           const unsigned long long* rows,
                                           const unsigned long long* drows, const float* dout,
                                           float* dweights, unsigned int top_k,
                                           unsigned int h) {
    unsigned long long t = blockIdx.x;
    const float* g = dout + t * h;
    for (unsigned int k = 0; k < top_k; ++k) {
        const float* y = (const float*)rows[t * top_k + k];
        float* dy = (float*)drows[t * top_k + k];
        float dot = 0.0f;
        if (y)
            for (unsigned int j = threadIdx.x; j < h; j += blockDim.x) dot += g[j] * y[j];
        dot = block_sum(dot);
        if (y) {
            float w = weights[t * top_k + k];
            for (unsigned int j = threadIdx.x; j < h; j += blockDim.x) dy[j] += w * g[j];
            if (threadIdx.x == 0) dweights[t * top_k + k] += dot;
        }
        __syncthreads();
    }
}

// The load-balancing loss's statistics (kernels/src/moe.rs `moe_aux_stats`), one thread per
// expert e, tokens in order: stats[e] = assignments to e in `indices` [t, top_k],
// stats[E + e] = Σ_t softmax(logits[t])[e] (f64), stats[2E] = t. Each token's softmax is
// the cpu's: max-shifted f32 exponentials, their f64 sum, rounded to f32.
extern "C" __global__ void moe_aux_stats(const float* logits, const int* indices,
                                         double* stats, unsigned int tokens,
                                         unsigned int experts, unsigned int top_k) {
    unsigned int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= experts) return;
    double count = 0.0, psum = 0.0;
    for (unsigned long long i = 0; i < (unsigned long long)tokens * top_k; ++i)
        count += indices[i] == (int)e ? 1.0 : 0.0;
    for (unsigned int t = 0; t < tokens; ++t) {
        const float* z = logits + (unsigned long long)t * experts;
        float mx = -__int_as_float(0x7f800000);
        for (unsigned int j = 0; j < experts; ++j) mx = fmaxf(mx, z[j]);
        double s = 0.0;
        for (unsigned int j = 0; j < experts; ++j) s += (double)expf(z[j] - mx);
        psum += (double)(float)((double)expf(z[e] - mx) * (1.0 / s));
    }
    stats[e] = count;
    stats[experts + e] = psum;
    if (e == 0) stats[2 * experts] = (double)tokens;
}

// The loss from (global) statistics, one thread: out[0] = share · coeff · E · Σ_e counts_e ·
// prob_sums_e / (n² · top_k) (0 without tokens), as `moe_aux_loss_from_stats`.
extern "C" __global__ void moe_aux_loss_finish(const double* stats, float* out,
                                               unsigned int experts, unsigned int top_k,
                                               double coeff, double share) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double n = stats[2 * experts], dot = 0.0;
    for (unsigned int e = 0; e < experts; ++e) dot += stats[e] * stats[experts + e];
    double l = n <= 0.0 ? 0.0 : coeff * (double)experts * dot / (n * n * (double)top_k);
    out[0] = (float)(l * share);
}

// Backward, one thread per token (accumulates, `moe_aux_loss_bwd_from_stats`): with p the
// token's softmax, g_e = c · counts_e, c = s · coeff · E / (n² · top_k) and s the f32 of
// scale · loss_scale: dlogits[t, i] += p_i (g_i - Σ_j p_j g_j).
extern "C" __global__ void moe_aux_loss_bwd(const float* logits, const double* stats,
                                            float* dlogits, unsigned int tokens,
                                            unsigned int experts, unsigned int top_k,
                                            double coeff, double scale, double loss_scale) {
    unsigned int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= tokens) return;
    double n = stats[2 * experts];
    if (n <= 0.0) return;
    double s = (double)(float)(scale * loss_scale);
    double c = s * coeff * (double)experts / (n * n * (double)top_k);
    const float* z = logits + (unsigned long long)t * experts;
    float* dz = dlogits + (unsigned long long)t * experts;
    float mx = -__int_as_float(0x7f800000);
    for (unsigned int j = 0; j < experts; ++j) mx = fmaxf(mx, z[j]);
    double sum = 0.0;
    for (unsigned int j = 0; j < experts; ++j) sum += (double)expf(z[j] - mx);
    double inv = 1.0 / sum, pg = 0.0;
    for (unsigned int j = 0; j < experts; ++j)
        pg += (double)(float)((double)expf(z[j] - mx) * inv) * (c * stats[j]);
    for (unsigned int j = 0; j < experts; ++j) {
        double p = (double)(float)((double)expf(z[j] - mx) * inv);
        dz[j] += (float)(p * (c * stats[j] - pg));
    }
}
