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
 * With AVX-512 the fp32 and the bf16 cache each have explicit vector loops (scores by FMA or
 * VDPBF16PS reduced 16 tokens at a time, one vector softmax per block and head, values by
 * FMA with the accumulator in registers), and the next block's lines are prefetched a few
 * per token visited. Decode at 64 rows (W64 on llama50m: 4 KV heads x 64, ~210 tokens, a
 * Xeon's 2 cores; bench/paged_attention.py) went from 1.20-1.29 to 0.75-0.98 ms a layer in
 * bf16 and from 2.19-2.44 to 1.47-1.64 ms in fp32: 0.66-0.71x and 0.89-0.94x of what
 * `torch.sum` reads on those cores (docs/benchmarks.md, 2026-12-06).
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
#include "vec512.h"
#include "vec_math.h"

#if defined(HAVE_VEC512) /* vec512.h: AVX-512 F, BW and VL */
#define PA_F32_VEC 1
#define PA_HAS_F32_VEC 1
#else
#define PA_HAS_F32_VEC 0
#endif
#if defined(HAVE_VEC512) && defined(__AVX512BF16__)
#define PA_BF16_DOT 1
#define PA_HAS_BF16_DOT 1
#else
#define PA_HAS_BF16_DOT 0
#endif

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

/* The next block's cache lines, prefetched a few at a time from inside this block's loops
 * (`per` lines per token visited) rather than all at its start: a burst of 256 prefetches
 * (a bf16 block's K and V at 4 heads x 64) fills the core's load buffers and stalls it until
 * they land, so the block's arithmetic never overlapped its successor's fetch. */
typedef struct {
    const char *p, *end;
    int per;
} pf_stream;

static inline __attribute__((always_inline)) void pf_step(pf_stream *f) {
    for (int i = 0; i < f->per && f->p < f->end; i++, f->p += 64) __builtin_prefetch(f->p);
}

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

#ifdef PA_F32_VEC
/* The permutes of sum16, level by level (P = 16, 8, 4, 2 partial sums per token in, a
 * vector holding 16 / P tokens): output lane L takes token L / (P/2)'s partials L % (P/2)
 * ("lo") and L % (P/2) + P/2 ("hi") from the first vector (lane values 0-15) or the
 * second (16-31), and adds them. */
static const int32_t SUM16_IDX[8][16] __attribute__((aligned(64))) = {
    {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
    {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
    {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
    {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31},
    {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
    {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31},
    {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
    {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31},
};

/* p[u] holds token u's 16 partial sums; returns the 16 totals, lane u = token u. */
static inline __attribute__((always_inline)) __m512 sum16(__m512 *p) {
    for (int level = 0, n = 16; level < 4; level++, n /= 2) {
        const __m512i lo = _mm512_load_si512(SUM16_IDX[2 * level]);
        const __m512i hi = _mm512_load_si512(SUM16_IDX[2 * level + 1]);
        for (int u = 0; u < n / 2; u++)
            p[u] = _mm512_add_ps(_mm512_permutex2var_ps(p[2 * u], lo, p[2 * u + 1]),
                                 _mm512_permutex2var_ps(p[2 * u], hi, p[2 * u + 1]));
    }
    return p[0];
}

/* scores s[j * MAX_BLOCK + t] = scale * q_j . k_t for tokens [t0, t1) of one block, with
 * AVX-512: each token's dot product is one vector of partial sums (fp32: D/16 FMAs; bf16
 * with AVX512-BF16: D/32 VDPBF16PS, whose bf16 products are exact in fp32), and 16 tokens'
 * vectors are reduced together by sum16: a horizontal sum per token was most of the step.
 * `bf16` is a literal at the call sites. */
static inline __attribute__((always_inline)) void
scores_vec(const void *kblock, int64_t row, int t0, int t1, int nkv, int G, const void *q,
           float scale, float *s, pf_stream *pf, const int D, const int bf16) {
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int h = 0; h < nkv; h++) {
        for (int g = 0; g < G; g++) {
            const int j = h * G + g;
            __m512 qv[MAX_D / 16];
#ifdef PA_BF16_DOT
            __m512bh qb[MAX_D / 32];
            if (bf16)
                for (int c = 0; c < D / 32; c++)
                    qb[c] = (__m512bh)_mm512_loadu_si512((const uint16_t *)q + (int64_t)j * D +
                                                         c * 32);
            else
#endif
                for (int c = 0; c < D / 16; c++)
                    qv[c] = _mm512_loadu_ps((const float *)q + (int64_t)j * D + c * 16);
            for (int t = t0; t < t1; t += 16) {
                const int m = t1 - t < 16 ? t1 - t : 16;
                __m512 p[16];
                for (int u = 0; u < 16; u++) {
                    __m512 acc = _mm512_setzero_ps();
                    if (u < m) {
                        pf_step(pf);
                        const int64_t off = (int64_t)(t + u) * row + (int64_t)h * D;
#ifdef PA_BF16_DOT
                        if (bf16)
                            for (int c = 0; c < D / 32; c++)
                                acc = _mm512_dpbf16_ps(
                                    acc, qb[c],
                                    (__m512bh)_mm512_loadu_si512((const uint16_t *)kblock + off +
                                                                 c * 32));
                        else
#endif
                            for (int c = 0; c < D / 16; c++)
                                acc = _mm512_fmadd_ps(
                                    qv[c], _mm512_loadu_ps((const float *)kblock + off + c * 16),
                                    acc);
                    }
                    p[u] = acc;
                }
                _mm512_mask_storeu_ps(s + j * MAX_BLOCK + t, tail16(m),
                                      _mm512_mul_ps(sum16(p), vscale));
            }
        }
    }
}

/* acc_j += sum over tokens [t0, t1) of s[j][t] * v_t, the weights in fp32, the
 * accumulator in registers across the block's tokens. A bf16 V row is widened in two
 * halves, its even elements (a shift) and its odd ones (a mask), so one shift or AND and
 * one FMA cover 16 elements; acc holds each 32-element chunk as 16 even then 16 odd
 * elements (unpermute_acc restores the order at the end). Widening element by element cost
 * a shuffle per 16 elements on the one shuffle port, and VDPBF16PS on token pairs (the
 * weights rounded to bf16) ran 1.25x slower than this on a Xeon, where it issues at half
 * the FMA rate. */
static inline __attribute__((always_inline)) void
values_vec(const void *vblock, int64_t row, int t0, int t1, int nkv, int G, const float *s,
           float *acc, pf_stream *pf, const int D, const int bf16) {
    const __m512i hi_mask = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int h = 0; h < nkv; h++) {
        for (int g = 0; g < G; g++) {
            const int j = h * G + g;
            float *aj = acc + (int64_t)j * D;
            __m512 av[MAX_D / 16];
            for (int c = 0; c < D / 16; c++) av[c] = _mm512_loadu_ps(aj + c * 16);
            for (int t = t0; t < t1; t++) {
                pf_step(pf);
                const __m512 w = _mm512_set1_ps(s[j * MAX_BLOCK + t]);
                const int64_t off = (int64_t)t * row + (int64_t)h * D;
                if (bf16) { /* (even, odd) halves of each 32-element chunk */
                    const uint16_t *v = (const uint16_t *)vblock + off;
                    for (int c = 0; c < D / 32; c++) {
                        const __m512i x = _mm512_loadu_si512(v + c * 32);
                        av[2 * c] = _mm512_fmadd_ps(
                            w, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), av[2 * c]);
                        av[2 * c + 1] = _mm512_fmadd_ps(
                            w, _mm512_castsi512_ps(_mm512_and_si512(x, hi_mask)), av[2 * c + 1]);
                    }
                } else {
                    const float *v = (const float *)vblock + off;
                    for (int c = 0; c < D / 16; c++)
                        av[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + c * 16), av[c]);
                }
            }
            for (int c = 0; c < D / 16; c++) _mm512_storeu_ps(aj + c * 16, av[c]);
        }
    }
}

#endif

#ifdef PA_BF16_DOT
/* EO_PERM[0] / [1]: elements 0-15 / 16-31 of a chunk from its (even, odd) vector pair
 * (lanes 16-31 = odd). */
static const int32_t EO_PERM[2][16] __attribute__((aligned(64))) = {
    {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23},
    {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31},
};

/* acc rows from values_vec's bf16 even/odd layout back into element order, in place. */
static inline __attribute__((always_inline)) void unpermute_acc(float *acc, int nh, const int D) {
    const __m512i p0 = _mm512_load_si512(EO_PERM[0]), p1 = _mm512_load_si512(EO_PERM[1]);
    for (int j = 0; j < nh; j++)
        for (int c = 0; c < D / 32; c++) {
            float *a = acc + (int64_t)j * D + c * 32;
            const __m512 ev = _mm512_loadu_ps(a), od = _mm512_loadu_ps(a + 16);
            _mm512_storeu_ps(a, _mm512_permutex2var_ps(ev, p0, od));
            _mm512_storeu_ps(a + 16, _mm512_permutex2var_ps(ev, p1, od));
        }
}
#endif

/* One block's online-softmax step for query heads [0, nh): scores s[j][t0..t1) become
 * exp(s - m_new) in place, the running max m and sum l move on, and the accumulator is
 * rescaled when the max grew. */
static inline __attribute__((always_inline)) void
block_softmax(float *s, int t0, int t1, int nh, float *m, float *l, float *acc, const int D) {
    for (int j = 0; j < nh; j++) {
        float *sj = s + j * MAX_BLOCK, bmax = -INFINITY, sum = 0.0f;
#ifdef PA_F32_VEC
        for (int t = t0; t < t1; t += 16) {
            const __mmask16 k = tail16(t1 - t);
            const float cm = _mm512_mask_reduce_max_ps(k, _mm512_maskz_loadu_ps(k, sj + t));
            bmax = cm > bmax ? cm : bmax;
        }
#else
#pragma omp simd reduction(max : bmax)
        for (int t = t0; t < t1; t++) bmax = sj[t] > bmax ? sj[t] : bmax;
#endif
        const float m_new = bmax > m[j] ? bmax : m[j];
        /* 0 on the first block (m = -inf); vexpf clamps, so say it outright */
        const float c = m[j] == -INFINITY ? 0.0f : vexpf(m[j] - m_new);
#ifdef PA_F32_VEC
        const __m512 vm = _mm512_set1_ps(m_new);
        __m512 vsum = _mm512_setzero_ps();
        for (int t = t0; t < t1; t += 16) {
            const __mmask16 k = tail16(t1 - t);
            const __m512 e = vexp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sj + t), vm));
            _mm512_mask_storeu_ps(sj + t, k, e);
            vsum = _mm512_mask_add_ps(vsum, k, vsum, e);
        }
        sum = _mm512_reduce_add_ps(vsum);
#else
#pragma omp simd reduction(+ : sum)
        for (int t = t0; t < t1; t++) sum += (sj[t] = vexpf(sj[t] - m_new));
#endif
        l[j] = l[j] * c + sum;
        m[j] = m_new;
        if (c != 1.0f) {
            float *aj = acc + (int64_t)j * D;
#pragma omp simd
            for (int d = 0; d < D; d++) aj[d] *= c;
        }
    }
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
    /* D a literal multiple of 32 at the call sites that take the AVX512-BF16 path */
    const int dot_bf16 = PA_HAS_BF16_DOT && a->is_bf16 && a->q_bf16 && D % 32 == 0;
    /* fp32 cache and queries, D a literal multiple of 16: the AVX-512 loops */
    const int vec_f32 = PA_HAS_F32_VEC && !a->is_bf16 && !a->q_bf16 && D % 16 == 0;
    const int whole = h1 - h0 == a->Hkv;
    if (a->q_bf16 && !dot_bf16) { /* (scores_vec reads bf16 queries as they are) */
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
        /* the next block sits elsewhere: start fetching it (see pf_stream) */
        pf_stream pk = {NULL, NULL, 0}, pv = {NULL, NULL, 0};
        if (b < p / bs) {
            const int64_t elt = a->is_bf16 ? 2 : 4;
            const char *nk = (const char *)a->cache +
                             ((int64_t)table[b + 1] * 2 * kv_off + (int64_t)h0 * D) * elt;
            const char *nv = nk + kv_off * elt;
            if (whole && (dot_bf16 || vec_f32)) {
                /* a whole item's heads: the block's K then V, each one run of lines, spread
                 * over the token visits of the scores and of the values loop */
                const int64_t lines = ((int64_t)bs * row * elt + 63) / 64;
                const int64_t visits = (int64_t)nh * (t1 - t0);
                const int per = (int)((lines + visits - 1) / visits);
                pk = (pf_stream){nk, nk + lines * 64, per};
                pv = (pf_stream){nv, nv + lines * 64, per};
            } else {
                /* a head range (a run per token) or the scalar loops: each run's first line
                 * now (bf16: every line of it) */
                const int64_t len = whole ? (int64_t)bs * row * elt : (int64_t)(h1 - h0) * D * elt;
                const int64_t run = a->is_bf16 ? len : 1;
                for (int t = 0; t < (whole || !a->is_bf16 ? 1 : bs); t++)
                    for (int64_t off = 0; off < run; off += 64) {
                        __builtin_prefetch(nk + t * row * elt + off);
                        __builtin_prefetch(nv + t * row * elt + off);
                    }
            }
        }
#ifdef PA_BF16_DOT
        if (dot_bf16) {
            scores_vec((const uint16_t *)a->cache + base, row, t0, t1, h1 - h0, G,
                       (const uint16_t *)a->q + q0, a->scale, s, &pk, D, 1);
        } else
#endif
#ifdef PA_F32_VEC
        if (vec_f32) {
            scores_vec((const float *)a->cache + base, row, t0, t1, h1 - h0, G, qi, a->scale, s,
                       &pk, D, 0);
        } else
#endif
        for (int t = t0; t < t1; t++) { /* scores: one K row serves its G query heads */
            for (int h = 0; h < h1 - h0; h++) {
                const float *k = load_row(a, base + t * row + (int64_t)h * D, tmp, D);
                for (int g = 0; g < G; g++) {
                    const int j = h * G + g;
                    s[j * MAX_BLOCK + t] = dot(qi + (int64_t)j * D, k, D) * a->scale;
                }
            }
        }
        block_softmax(s, t0, t1, nh, m, l, acc, D);
#ifdef PA_BF16_DOT
        if (dot_bf16) {
            values_vec((const uint16_t *)a->cache + base + kv_off, row, t0, t1, h1 - h0, G, s,
                       acc, &pv, D, 1);
        } else
#endif
#ifdef PA_F32_VEC
        if (vec_f32) {
            values_vec((const float *)a->cache + base + kv_off, row, t0, t1, h1 - h0, G, s, acc,
                       &pv, D, 0);
        } else
#endif
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
#ifdef PA_BF16_DOT
    if (dot_bf16) unpermute_acc(acc, nh, D); /* values_vec's bf16 even/odd layout */
#endif
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
