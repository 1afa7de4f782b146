/* Causal attention of prompt chunks that are their request's whole context, for the CPU path.
 *
 * A prefill step attends many short prompts (W64: 32-256 tokens each); torch's SDPA took
 * ~250 us (bf16) and ~530 us (fp32) for one of 150 tokens and 8 heads of 64, 43-92 GFLOP/s:
 * at these lengths its per-call set-up and small blocks cost more than the arithmetic. Here
 * one call takes every such chunk of a layer's step, and each task (a chunk and a KV head,
 * or one of its query heads when there are too few) works as a small GEMM would:
 *
 *   1. K of its KV head packed transposed, Kt [D][n] fp32, and V widened to fp32, [n][D];
 *   2. per block of 8 query tokens, the scores of the keys they see (0 .. the block's last
 *      token) with 32 keys x 8 rows of accumulators in registers, the query broadcast from a
 *      pre-scaled fp32 copy;
 *   3. a softmax per row over its own keys (the causal mask: keys past the row's position
 *      get weight 0), fp32;
 *   4. P V with 4 rows x 64 values of accumulators in registers, then divided by each row's
 *      sum and stored (bf16: rounded once, at the end).
 *
 * Scores, softmax and sums are fp32 whatever the activations (as SDPA's CPU kernel). Only
 * AVX-512 builds run it, and only head sizes that are multiples of 64; otherwise it returns
 * -1 and the caller keeps SDPA. q/out are [T, H, D] rows, k/v [T, Hkv, D] rows, each with its
 * own row stride (views into the step's fused QKV output); chunk c is tokens starts[c] ..
 * starts[c] + lens[c] - 1, at positions 0 .. lens[c] - 1.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "vec512.h"

#define QB 8  /* query tokens per block */
#define KB 32 /* keys per score tile (two vectors) */

#if defined(HAVE_VEC512)
static inline __attribute__((always_inline)) void load_row(float *dst, const void *src,
                                                           int64_t off, int D, const int bf16) {
    for (int d = 0; d < D; d += 16)
        _mm512_storeu_ps(dst + d, ld16(src, off + d, 0xFFFF, bf16));
}

/* K of KV head hk for chunk rows [start, start + n) transposed into Kt [D][np], V widened
 * into V [np][D], both zero past n (np: n rounded up to KB). */
static inline __attribute__((always_inline)) void
pack_kv(const void *k, int64_t ks, const void *v, int64_t vs, int64_t start, int64_t n, int hk,
        int D, float *Kt, float *V, const int bf16) {
    const int64_t np = (n + KB - 1) / KB * KB;
    float row[512];
    for (int64_t j = 0; j < n; j++) { /* K transposed, V widened */
        load_row(row, k, (start + j) * ks + (int64_t)hk * D, D, bf16);
        for (int d = 0; d < D; d++) Kt[(int64_t)d * np + j] = row[d];
        load_row(V + j * D, v, (start + j) * vs + (int64_t)hk * D, D, bf16);
    }
    for (int64_t j = n; j < np; j++) {
        for (int d = 0; d < D; d++) Kt[(int64_t)d * np + j] = 0.0f;
        memset(V + j * D, 0, sizeof(float) * D);
    }
}

/* Query head hq of chunk rows [start, start + n) against the packed Kt and V; S and Qb are
 * scratch. */
static inline __attribute__((always_inline)) void
attend_head(const void *q, int64_t qs, void *out, int64_t os, int64_t start, int64_t n, int hq,
            int D, float scale, const float *Kt, const float *V, float *S, float *Qb,
            const int bf16) {
    const int64_t np = (n + KB - 1) / KB * KB;
    for (int64_t t0 = 0; t0 < n; t0 += QB) {
        const int rows = n - t0 < QB ? (int)(n - t0) : QB;
        const int64_t kend = t0 + rows; /* keys this block sees */
        for (int r = 0; r < QB; r++) {
            if (r < rows) {
                load_row(Qb + r * D, q, (start + t0 + r) * qs + (int64_t)hq * D, D, bf16);
                for (int d = 0; d < D; d++) Qb[r * D + d] *= scale;
            } else {
                memset(Qb + r * D, 0, sizeof(float) * D);
            }
        }
        /* scores: S[r][j] = q_r . k_j (scaled), j < kend rounded up to KB */
        for (int64_t j0 = 0; j0 < kend; j0 += KB) {
            __m512 a0[QB], a1[QB];
            for (int r = 0; r < QB; r++) a0[r] = a1[r] = _mm512_setzero_ps();
            for (int d = 0; d < D; d++) {
                const __m512 k0 = _mm512_loadu_ps(Kt + (int64_t)d * np + j0);
                const __m512 k1 = _mm512_loadu_ps(Kt + (int64_t)d * np + j0 + 16);
                for (int r = 0; r < QB; r++) {
                    const __m512 qb = _mm512_set1_ps(Qb[r * D + d]);
                    a0[r] = _mm512_fmadd_ps(qb, k0, a0[r]);
                    a1[r] = _mm512_fmadd_ps(qb, k1, a1[r]);
                }
            }
            for (int r = 0; r < QB; r++) {
                _mm512_storeu_ps(S + r * np + j0, a0[r]);
                _mm512_storeu_ps(S + r * np + j0 + 16, a1[r]);
            }
        }
        /* softmax of row r over keys 0 .. t0 + r; the rest of the block's keys weigh 0 */
        const int64_t kpad = (kend + 15) / 16 * 16;
        float inv[QB];
        for (int r = 0; r < rows; r++) {
            float *s = S + r * np;
            const int64_t seen = t0 + r + 1;
            __m512 m = _mm512_set1_ps(-INFINITY);
            for (int64_t j = 0; j < seen; j += 16) {
                const __mmask16 km = tail16((int)(seen - j < 16 ? seen - j : 16));
                m = _mm512_mask_max_ps(m, km, m, _mm512_loadu_ps(s + j));
            }
            const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
            __m512 sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < kpad; j += 16) {
                const int64_t left = seen - j;
                const __mmask16 km = left <= 0 ? 0 : tail16((int)(left < 16 ? left : 16));
                const __m512 p =
                    _mm512_maskz_mov_ps(km, vexp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), mx)));
                sum = _mm512_add_ps(sum, p);
                _mm512_storeu_ps(s + j, p);
            }
            inv[r] = 1.0f / _mm512_reduce_add_ps(sum);
        }
        /* out_r = sum_j P[r][j] V[j] / sum_r, 4 rows x 64 values at a time */
        for (int r0 = 0; r0 < rows; r0 += 4) {
            const int rn = rows - r0 < 4 ? rows - r0 : 4;
            for (int d0 = 0; d0 < D; d0 += 64) {
                __m512 acc[4][4];
                for (int r = 0; r < 4; r++)
                    for (int x = 0; x < 4; x++) acc[r][x] = _mm512_setzero_ps();
                const int64_t jn = t0 + r0 + rn; /* the last of these rows sees jn keys */
                for (int64_t j = 0; j < jn; j++) {
                    const float *vr = V + j * D + d0;
                    const __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16);
                    const __m512 v2 = _mm512_loadu_ps(vr + 32), v3 = _mm512_loadu_ps(vr + 48);
                    for (int r = 0; r < 4; r++) {
                        const __m512 p = _mm512_set1_ps(r < rn ? S[(r0 + r) * np + j] : 0.0f);
                        acc[r][0] = _mm512_fmadd_ps(p, v0, acc[r][0]);
                        acc[r][1] = _mm512_fmadd_ps(p, v1, acc[r][1]);
                        acc[r][2] = _mm512_fmadd_ps(p, v2, acc[r][2]);
                        acc[r][3] = _mm512_fmadd_ps(p, v3, acc[r][3]);
                    }
                }
                for (int r = 0; r < rn; r++) {
                    const __m512 sc = _mm512_set1_ps(inv[r0 + r]);
                    const int64_t o = (start + t0 + r0 + r) * os + (int64_t)hq * D + d0;
                    for (int x = 0; x < 4; x++)
                        st16(out, o + 16 * x, _mm512_mul_ps(acc[r][x], sc), 0xFFFF, bf16);
                }
            }
        }
    }
}
#endif

int prefill_attention(const void *q, int64_t qs, const void *k, int64_t ks, const void *v,
                      int64_t vs, void *out, int64_t os, const int64_t *starts,
                      const int64_t *lens, int64_t nchunks, int H, int Hkv, int D, float scale,
                      int bf16, int num_threads) {
#if defined(HAVE_VEC512)
    if (D % 64 != 0 || D > 512 || H % Hkv != 0) return -1;
    const int G = H / Hkv;
    /* A task packs one KV head's K and V once and attends its query heads; with too few
     * such tasks to keep the threads busy, each query head is a task of its own. */
    const int split = nchunks * Hkv < 2 * num_threads ? G : 1;
    const int per_task = G / split;
    int failed = 0;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) reduction(| : failed)
    for (int64_t task = 0; task < nchunks * Hkv * split; task++) {
        const int64_t c = task / (Hkv * split);
        const int hk = (int)(task / split % Hkv);
        const int h0 = hk * G + (int)(task % split) * per_task;
        const int64_t n = lens[c];
        if (n <= 0) continue;
        const int64_t np = (n + KB - 1) / KB * KB;
        float *buf = (float *)malloc(sizeof(float) * ((size_t)np * D * 2 + (size_t)QB * np +
                                                      (size_t)QB * D));
        if (buf == NULL) {
            failed = 1;
            continue;
        }
        float *Kt = buf, *V = Kt + np * D, *S = V + np * D, *Qb = S + QB * np;
        if (bf16) {
            pack_kv(k, ks, v, vs, starts[c], n, hk, D, Kt, V, 1);
            for (int hq = h0; hq < h0 + per_task; hq++)
                attend_head(q, qs, out, os, starts[c], n, hq, D, scale, Kt, V, S, Qb, 1);
        } else {
            pack_kv(k, ks, v, vs, starts[c], n, hk, D, Kt, V, 0);
            for (int hq = h0; hq < h0 + per_task; hq++)
                attend_head(q, qs, out, os, starts[c], n, hq, D, scale, Kt, V, S, Qb, 0);
        }
        free(buf);
    }
    return failed ? -2 : 0;
#else
    (void)q, (void)qs, (void)k, (void)ks, (void)v, (void)vs, (void)out, (void)os, (void)starts;
    (void)lens, (void)nchunks, (void)H, (void)Hkv, (void)D, (void)scale, (void)bf16;
    (void)num_threads;
    return -1;
#endif
}
