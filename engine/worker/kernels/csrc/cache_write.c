/* Store a step's new K and V rows into their paged-cache slots, for the CPU path.
 *
 * The torch version is an advanced-indexing assignment per tensor (`cache[blocks, 0,
 * offsets] = k`), which builds index tensors, checks them and scatters element by element;
 * at decode it costs about as much as the attention itself. Here each token is two memcpy
 * calls of one cache row (Hkv * D elements), K at cache[b, 0, o] and V at cache[b, 1, o] for
 * slot s = b * block_size + o; slot -1 (a padding token) stores nothing.
 *
 * k and v are [T, row] with their own row strides (views into the fused qkv output), in the
 * cache's dtype; `elem` is its size in bytes. */
#include <stdint.h>
#include <string.h>

/* The copies shared out with an orphaned `omp for` (see fused_ops.c). */
void write_kv_body(const void *k, int64_t ks, const void *v, int64_t vs, void *cache,
                   const int64_t *slots, int64_t tokens, int64_t row, int block_size, int elem) {
    const int64_t row_bytes = row * elem, half = (int64_t)block_size * row_bytes;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t s = slots[t];
        if (s < 0) continue;
        char *dst = (char *)cache + (s / block_size) * 2 * half + (s % block_size) * row_bytes;
        memcpy(dst, (const char *)k + t * ks * elem, (size_t)row_bytes);
        memcpy(dst + half, (const char *)v + t * vs * elem, (size_t)row_bytes);
    }
}

void write_kv(const void *k, int64_t ks, const void *v, int64_t vs, void *cache,
              const int64_t *slots, int64_t tokens, int64_t row, int block_size, int elem,
              int num_threads) {
#pragma omp parallel num_threads(num_threads) if (tokens > 64)
    write_kv_body(k, ks, v, vs, cache, slots, tokens, row, block_size, elem);
}
