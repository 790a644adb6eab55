// KV-cache decoding's position ops (kernels/src/kv.rs, runtime/src/exec/attention.rs and
// dense.rs): a block's rows at position `start + shard + i`, where `start` is the plan's
// position input (an i32 on the device, written by the runtime before each step; negative
// counts as 0), `shard` the rows of this rank's earlier sequence shards (the lowering
// computes it from the buffer's layout) and i the row's index in the block.

// RoPE at the step's positions on [b, s, heads, d] (rotate_half layout), one block per
// (batch, row, head): angle = float(position) * inv_freq[j] in f32, as the cpu backend's
// rope_tables_freq.
extern "C" __global__ void rope_at(const float* x, float* y, const float* inv_freq,
                                   const int* pos, unsigned int s, unsigned int heads,
                                   unsigned int d, unsigned int shard) {
    unsigned long long row = blockIdx.x;  // (batch, row, head)
    unsigned int i = (unsigned int)((row / heads) % s);
    int start = pos[0] > 0 ? pos[0] : 0;
    float p = (float)((unsigned int)start + shard + i);
    unsigned int half = d / 2;
    const float* xr = x + row * d;
    float* yr = y + row * d;
    for (unsigned int j = threadIdx.x; j < half; j += blockDim.x) {
        float a = p * inv_freq[j];
        float c = cosf(a), sn = sinf(a);
        float u = xr[j], v = xr[j + half];
        yr[j] = u * c - v * sn;
        yr[j + half] = v * c + u * sn;
    }
}

// y = x + wpe[position] per row of width h (x, y [rows, h], row r at block index r % s);
// a position past the table's `table_rows` takes its last row (padding).
extern "C" __global__ void pos_embedding_at(const float* x, const float* wpe, const int* pos,
                                            float* y, unsigned int s, unsigned int h,
                                            unsigned int table_rows, unsigned int shard) {
    unsigned long long r = blockIdx.x;
    int start = pos[0] > 0 ? pos[0] : 0;
    unsigned long long p = (unsigned long long)start + shard + (unsigned int)(r % s);
    if (p >= table_rows) p = table_rows > 0 ? table_rows - 1 : 0;
    for (unsigned int j = threadIdx.x; j < h; j += blockDim.x)
        y[r * h + j] = x[r * h + j] + wpe[p * h + j];
}
