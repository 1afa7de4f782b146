/* Paged attention over the KV cache in place, for the CPU path.
 *
 * The pure-torch backend copies every request's K/V blocks into a dense tensor before
 * attending (index_select + SDPA), which on a CPU reads the cache once, writes a copy and
 * reads the copy again: decode is memory-bound, so that is most of the attention time. This
 * kernel walks each request's block table and reads K and V straight from the cache, once.
 *
 * Work items are query tokens: item i is row q_rows[i] of q, belongs to request reqs[i] and
 * sits at position pos[i], so it sees keys max(0, pos - window + 1) .. pos of that request
 * (window <= 0: no window). A decode token is pos = seq_len - 1; a prefill chunk is one item
 * per token, which gives the causal mask for free.
 *
 * One task handles a range of KV heads of one item, block by block, with an online softmax
 * (running max and sum per query head, the accumulator rescaled when the max grows), so each
 * block's K and V are read from memory once while they are hot. With many items a task takes
 * every head, reading whole cache rows; with few, heads are split across threads.
 *
 * Layout (engine/worker/attention/base.py): cache [num_blocks, 2, block_size, Hkv, D], K = 0, V = 1,
 * fp32 or bf16; q and out are [*, H, D] with the given row strides, both fp32 or both bf16
 * (the bf16 model's activations). Scores, softmax and the accumulator are fp32 either way. The library is
 * loaded after torch, so it shares torch's OpenMP runtime; the caller passes the thread count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "vec_math.h"

#define MAX_HEADS 64    /* query heads one task holds state for (the caller checks) */
#define MAX_BLOCK 64    /* tokens per cache block */
#define MAX_D 512
#define MAX_ACC 16384   /* query heads x head dim of one task */

typedef struct {
    const void *q; int64_t q_row_stride; int q_bf16; /* q and out share a dtype */
    const void *cache; int is_bf16;
    const int32_t *block_tables; int64_t bt_stride;
    const int64_t *q_rows, *reqs, *pos;
    int H, Hkv, D, block_size, window;
    float scale;
    void *out; int64_t out_row_stride;
} args_t;

static inline __attribute__((always_inline)) float dot(const float *restrict a,
                                                       const float *restrict b, const int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int d = 0; d < n; d++) s += a[d] * b[d];
    return s;
}

static inline __attribute__((always_inline)) const float *
load_row(const args_t *a, int64_t off, float *restrict tmp, const int D) {
    if (!a->is_bf16) return (const float *)a->cache + off;
    const uint16_t *src = (const uint16_t *)a->cache + off;
#pragma omp simd
    for (int d = 0; d < D; d++) { /* bf16 is the top half of an fp32; a union, not a cast */
        union { uint32_t u; float f; } x = {.u = (uint32_t)src[d] << 16};
        tmp[d] = x.f;
    }
    return tmp;
}

/* Heads [h0, h1) of item i, block by block: each block's K rows and then V rows are read
 * once, in address order, for every head of the range (better for the prefetchers than one
 * pass over the blocks per head). D is a literal at the call sites below, so loops unroll. */
static inline __attribute__((always_inline)) void
attend(const args_t *a, int64_t i, int h0, int h1, const int D) {
    const int G = a->H / a->Hkv, bs = a->block_size, nh = (h1 - h0) * G;
    const int64_t row = (int64_t)a->Hkv * D, kv_off = (int64_t)bs * row;
    const int64_t p = a->pos[i];
    const int64_t first = (a->window > 0 && p - a->window + 1 > 0) ? p - a->window + 1 : 0;
    const int32_t *table = a->block_tables + a->reqs[i] * a->bt_stride;
    const int64_t q0 = a->q_rows[i] * a->q_row_stride + (int64_t)h0 * G * D;
    const int64_t o0 = a->q_rows[i] * a->out_row_stride + (int64_t)h0 * G * D;

    /* per query head j of the range: running max m, sum l, accumulator acc[j*D..] */
    float m[MAX_HEADS], l[MAX_HEADS], s[MAX_HEADS * MAX_BLOCK];
    float acc[MAX_ACC] __attribute__((aligned(64)));
    float tmp[MAX_D] __attribute__((aligned(64)));
    float qbuf[MAX_ACC] __attribute__((aligned(64))); /* this range's queries in fp32 */
    const float *qi = qbuf;
    if (a->q_bf16) {
        const uint16_t *src = (const uint16_t *)a->q + q0;
#pragma omp simd
        for (int d = 0; d < nh * D; d++) qbuf[d] = bf16_to_f32(src[d]);
    } else {
        qi = (const float *)a->q + q0;
    }
    for (int j = 0; j < nh; j++) m[j] = -INFINITY, l[j] = 0.0f;
    memset(acc, 0, sizeof(float) * (size_t)nh * D);
    for (int64_t b = first / bs; b <= p / bs; b++) {
        const int t0 = b == first / bs ? (int)(first % bs) : 0;
        const int t1 = b == p / bs ? (int)(p % bs) + 1 : bs;
        const int64_t base = (int64_t)table[b] * 2 * kv_off + (int64_t)h0 * D;
        if (b < p / bs) { /* the next block sits elsewhere: start fetching its first rows */
            const int64_t next = (int64_t)table[b + 1] * 2 * kv_off + (int64_t)h0 * D;
            const char *nk = (const char *)a->cache + next * (a->is_bf16 ? 2 : 4);
            __builtin_prefetch(nk);
            __builtin_prefetch(nk + (a->is_bf16 ? 2 : 4) * kv_off);
        }
        for (int t = t0; t < t1; t++) { /* scores: one K row serves its G query heads */
            for (int h = 0; h < h1 - h0; h++) {
                const float *k = load_row(a, base + t * row + (int64_t)h * D, tmp, D);
                for (int g = 0; g < G; g++) {
                    const int j = h * G + g;
                    s[j * MAX_BLOCK + t] = dot(qi + (int64_t)j * D, k, D) * a->scale;
                }
            }
        }
        for (int j = 0; j < nh; j++) { /* online softmax: rescale what came before */
            float *sj = s + j * MAX_BLOCK, bmax = -INFINITY, sum = 0.0f;
            for (int t = t0; t < t1; t++) bmax = sj[t] > bmax ? sj[t] : bmax;
            const float m_new = bmax > m[j] ? bmax : m[j];
            /* 0 on the first block (m = -inf); vexpf clamps, so say it outright */
            const float c = m[j] == -INFINITY ? 0.0f : vexpf(m[j] - m_new);
#pragma omp simd reduction(+ : sum)
            for (int t = t0; t < t1; t++) sum += (sj[t] = vexpf(sj[t] - m_new));
            l[j] = l[j] * c + sum;
            m[j] = m_new;
            if (c != 1.0f) {
                float *aj = acc + (int64_t)j * D;
#pragma omp simd
                for (int d = 0; d < D; d++) aj[d] *= c;
            }
        }
        for (int t = t0; t < t1; t++) { /* values: one V row serves its G query heads */
            for (int h = 0; h < h1 - h0; h++) {
                const float *v = load_row(a, base + kv_off + t * row + (int64_t)h * D, tmp, D);
                for (int g = 0; g < G; g++) {
                    const int j = h * G + g;
                    const float w = s[j * MAX_BLOCK + t];
                    float *aj = acc + (int64_t)j * D;
#pragma omp simd
                    for (int d = 0; d < D; d++) aj[d] += w * v[d];
                }
            }
        }
    }
    for (int j = 0; j < nh; j++) {
        const float inv = 1.0f / l[j];
        const float *aj = acc + (int64_t)j * D;
        const int64_t o = o0 + (int64_t)j * D;
        if (a->q_bf16) {
#pragma omp simd
            for (int d = 0; d < D; d++) st(a->out, o + d, aj[d] * inv, 1);
        } else {
#pragma omp simd
            for (int d = 0; d < D; d++) st(a->out, o + d, aj[d] * inv, 0);
        }
    }
}

static void attend_any(const args_t *a, int64_t i, int h0, int h1) {
    switch (a->D) {
    case 64: attend(a, i, h0, h1, 64); break;
    case 128: attend(a, i, h0, h1, 128); break;
    case 256: attend(a, i, h0, h1, 256); break;
    default: attend(a, i, h0, h1, a->D);
    }
}

/* The work of `paged_attention`, shared out with an orphaned `omp for` (its caller's
 * parallel region: paged_attention's own, or decoder_stack.c's). `num_threads` is the
 * region's size, which decides the split (the values do not depend on it). Returns 0, or -1
 * for shapes past the stack buffers (the caller checks them first). */
int paged_attention_body(const void *q, int64_t q_row_stride, int q_bf16, const void *cache,
                         int is_bf16, const int32_t *block_tables, int64_t bt_stride,
                         const int64_t *q_rows, const int64_t *reqs, const int64_t *pos,
                         int64_t num_items, int H, int Hkv, int D, int block_size, int window,
                         float scale, void *out, int64_t out_row_stride, int num_threads) {
    const int G = H % Hkv ? 0 : H / Hkv;
    if (!G || G > MAX_HEADS || G * D > MAX_ACC || block_size > MAX_BLOCK || D > MAX_D)
        return -1;
    const args_t a = {q, q_row_stride, q_bf16, cache, is_bf16, block_tables, bt_stride,
                      q_rows, reqs, pos, H, Hkv, D, block_size, window, scale, out, out_row_stride};
    /* Whole items when there are enough to share out and their state fits one task;
     * else one task per (item, KV head). */
    const int per_head = num_items < 4 * (int64_t)num_threads || H > MAX_HEADS || H * D > MAX_ACC;
    const int64_t tasks = per_head ? num_items * Hkv : num_items;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; task++) {
        if (per_head)
            attend_any(&a, task / Hkv, (int)(task % Hkv), (int)(task % Hkv) + 1);
        else
            attend_any(&a, task, 0, Hkv);
    }
    return 0;
}

/* Returns 0, or -1 for shapes past the stack buffers (the caller checks them first). */
int paged_attention(const void *q, int64_t q_row_stride, int q_bf16, const void *cache,
                    int is_bf16, const int32_t *block_tables, int64_t bt_stride,
                    const int64_t *q_rows,
                    const int64_t *reqs, const int64_t *pos, int64_t num_items, int H,
                    int Hkv, int D, int block_size, int window, float scale, void *out,
                    int64_t out_row_stride, int num_threads) {
    const int G = H % Hkv ? 0 : H / Hkv;
    if (!G || G > MAX_HEADS || G * D > MAX_ACC || block_size > MAX_BLOCK || D > MAX_D)
        return -1;
#pragma omp parallel num_threads(num_threads)
    paged_attention_body(q, q_row_stride, q_bf16, cache, is_bf16, block_tables, bt_stride,
                         q_rows, reqs, pos, num_items, H, Hkv, D, block_size, window, scale,
                         out, out_row_stride, num_threads);
    return 0;
}
