// Token and position embeddings, in f32 (kernels/src/embedding.rs; the vocab-parallel form
// of runtime/src/exec/dense.rs). One block per token row of `h` elements.

// out[r] = table[ids[r] - start] when 0 <= ids[r] - start < rows (this rank's vocabulary
// slice; start 0 and rows = the table's rows when the table is whole), else 0.
extern "C" __global__ void embedding_fwd(const int* ids, const float* table, float* out,
                                         unsigned int h, long long start, long long rows) {
    long long local = (long long)ids[blockIdx.x] - start;
    float* o = out + (unsigned long long)blockIdx.x * h;
    bool mine = local >= 0 && local < rows;
    const float* t = table + (mine ? local : 0) * (long long)h;
    for (unsigned int j = threadIdx.x; j < h; j += blockDim.x) o[j] = mine ? t[j] : 0.0f;
}

// dtable[ids[r] - start] += dy[r] for the rows of this rank's slice. One block per table
// row (`rows` blocks): each scans the token ids in order, so the sum is deterministic and
// in token order, as the CPU kernel adds.
extern "C" __global__ void embedding_bwd(const int* ids, const float* dy, float* dtable,
                                         unsigned int tokens, unsigned int h, long long start) {
    long long row = blockIdx.x;
    float* d = dtable + row * (long long)h;
    for (unsigned int j = threadIdx.x; j < h; j += blockDim.x) {
        float acc = d[j];
        for (unsigned int t = 0; t < tokens; ++t)
            if ((long long)ids[t] - start == row) acc += dy[(unsigned long long)t * h + j];
        d[j] = acc;
    }
}

// GPT-2's learned positions: y[b, i] = x[b, i] + wpe[pos[i]], one block per (b, i) row;
// `pos` holds the s positions of this rank's sequence (0..s, or context parallelism's).
extern "C" __global__ void pos_embedding_fwd(const float* x, const float* wpe,
                                             const unsigned int* pos, float* y, unsigned int s,
                                             unsigned int h) {
    unsigned long long row = blockIdx.x;
    const float* w = wpe + (unsigned long long)pos[row % s] * h;
    for (unsigned int j = threadIdx.x; j < h; j += blockDim.x) y[row * h + j] = x[row * h + j] + w[j];
}

// dx += dy and dwpe[pos[i]] += sum over the batch of dy[b, i] (batch order), one block per
// position i.
extern "C" __global__ void pos_embedding_bwd(const float* dy, const unsigned int* pos,
                                             float* dx, float* dwpe, unsigned int b,
                                             unsigned int s, unsigned int h) {
    unsigned int i = blockIdx.x;
    float* dw = dwpe + (unsigned long long)pos[i] * h;
    for (unsigned int j = threadIdx.x; j < h; j += blockDim.x) {
        float acc = dw[j];
        for (unsigned int bi = 0; bi < b; ++bi) {
            unsigned long long at = ((unsigned long long)bi * s + i) * h + j;
            dx[at] += dy[at];
            acc += dy[at];
        }
        dw[j] = acc;
    }
}
