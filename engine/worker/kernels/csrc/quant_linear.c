/* y = x @ W^T with W kept in 32-weight blocks (GGUF's own Q4_1 and Q8_0 byte layouts).
 *
 * Why our own: on an AVX2-only CPU torch 2.13's weight-only kernels
 * (_weight_int4pack_mm_for_cpu, _weight_int8pack_mm) with fp32 activations ran 8-100x
 * slower than the dense fp32 GEMM of the same shape (bench/linear_kernels.py), and
 * torchao's CPU weight-only configs call the same two ops. These kernels read each block
 * once per tile of activation rows and widen it to fp32 in registers, so one row costs the
 * bytes of the quantized weight and many rows cost about what the fp32 GEMM costs.
 *
 *   q4 block (20 bytes): fp16 d, fp16 m, 16 bytes: byte j holds weight j (low nibble) and
 *                        weight j + 16 (high nibble); w = d * q + m, q in 0..15
 *   q8 block (34 bytes): fp16 d, 32 int8; w = d * q
 *
 * x is fp32 [M, K] with row stride xs; y fp32 [M, N] with row stride ys; W [N, K / 32]
 * blocks, row after row. The dot product of a block is fp32 FMAs over the 32 products, then
 * scaled by d (and, for q4, m times the block's sum of x): the same value as dequantizing
 * the block to fp32 and multiplying, up to the order of the additions. Parallel over output
 * columns (OpenMP, torch's runtime, threads from the caller); AVX2 + FMA + F16C where the
 * compiler targets them (-march=native), plain C otherwise.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_blocks.h"
#include "quant_q4g.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QL_AVX2 1
#endif
#if defined(__AVX512F__) && defined(QL_AVX2)
#define QL_AVX512 1
#endif

#define ROW_TILE 4



#ifdef QL_AVX2
/* The 32 products of one block's widened weights with 32 values of x, in 8 lanes. */
static inline __m256 block_dot(__m256 q0, __m256 q1, __m256 q2, __m256 q3, const float *xp) {
    __m256 t = _mm256_mul_ps(q0, _mm256_loadu_ps(xp));
    t = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xp + 8), t);
    t = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xp + 16), t);
    return _mm256_fmadd_ps(q3, _mm256_loadu_ps(xp + 24), t);
}
#endif

/* Per row of x, the sum of each 32-wide block (for q4's m term): sums[r * nb + b]. */
static void block_sums(const float *x, int64_t xs, int64_t M, int64_t nb, float *sums) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *p = x + r * xs + b * QBLOCK;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int i = 0; i < QBLOCK; i++) s += p[i];
            sums[r * nb + b] = s;
        }
}

/* One output column n against rows [r0, r0 + rows) of x (rows <= ROW_TILE). */
static inline void q4_column(const float *x, int64_t xs, const uint8_t *wrow, int64_t nb,
                             const float *sums, int64_t r0, int rows, float *acc_out) {
#if defined(QL_AVX512)
    /* 16 lanes: a block is two vectors, widened and scaled by d once for the tile's rows,
     * then two FMAs per row. One row gets four accumulators (two blocks per iteration):
     * a single chain of 4-cycle FMAs would cap a core at ~8 cycles per block. */
    const __m128i low = _mm_set1_epi8(0x0f);
#define Q4_WIDEN(blk, qa, qb)                                                                \
    const __m512 d_##qa = _mm512_set1_ps(half_to_float(blk));                                \
    const __m128i raw_##qa = _mm_loadu_si128((const __m128i *)((blk) + 4));                  \
    const __m512 qa = _mm512_mul_ps(                                                         \
        d_##qa, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw_##qa, low))));     \
    const __m512 qb = _mm512_mul_ps(                                                         \
        d_##qa, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(                                     \
                    _mm_and_si128(_mm_srli_epi16(raw_##qa, 4), low))));
    if (rows == 1) {
        const float *xr = x + r0 * xs;
        const float *sr = sums + r0 * nb;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        float macc = 0.0f;
        int64_t b = 0;
        for (; b + 1 < nb; b += 2) {
            const uint8_t *blk = wrow + b * Q4_BYTES;
            Q4_WIDEN(blk, p0, p1)
            Q4_WIDEN(blk + Q4_BYTES, p2, p3)
            const float *xp = xr + b * QBLOCK;
            a0 = _mm512_fmadd_ps(p0, _mm512_loadu_ps(xp), a0);
            a1 = _mm512_fmadd_ps(p1, _mm512_loadu_ps(xp + 16), a1);
            a2 = _mm512_fmadd_ps(p2, _mm512_loadu_ps(xp + 32), a2);
            a3 = _mm512_fmadd_ps(p3, _mm512_loadu_ps(xp + 48), a3);
            macc += half_to_float(blk + 2) * sr[b] + half_to_float(blk + Q4_BYTES + 2) * sr[b + 1];
        }
        for (; b < nb; b++) {
            const uint8_t *blk = wrow + b * Q4_BYTES;
            Q4_WIDEN(blk, p0, p1)
            a0 = _mm512_fmadd_ps(p0, _mm512_loadu_ps(xr + b * QBLOCK), a0);
            a1 = _mm512_fmadd_ps(p1, _mm512_loadu_ps(xr + b * QBLOCK + 16), a1);
            macc += half_to_float(blk + 2) * sr[b];
        }
        acc_out[0] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))) + macc;
        return;
    }
    __m512 acc[ROW_TILE];
    float macc[ROW_TILE];
    for (int r = 0; r < ROW_TILE; r++) acc[r] = _mm512_setzero_ps(), macc[r] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wrow + b * Q4_BYTES;
        Q4_WIDEN(blk, qa, qb)
        const float m = half_to_float(blk + 2);
        for (int r = 0; r < rows; r++) {
            const float *xp = x + (r0 + r) * xs + b * QBLOCK;
            acc[r] = _mm512_fmadd_ps(qa, _mm512_loadu_ps(xp), acc[r]);
            acc[r] = _mm512_fmadd_ps(qb, _mm512_loadu_ps(xp + 16), acc[r]);
            macc[r] += m * sums[(r0 + r) * nb + b];
        }
    }
#undef Q4_WIDEN
    for (int r = 0; r < rows; r++) acc_out[r] = _mm512_reduce_add_ps(acc[r]) + macc[r];
#elif defined(QL_AVX2)
    __m256 acc[ROW_TILE];
    float macc[ROW_TILE];
    for (int r = 0; r < ROW_TILE; r++) acc[r] = _mm256_setzero_ps(), macc[r] = 0.0f;
    const __m128i low = _mm_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wrow + b * Q4_BYTES;
        const __m256 d = _mm256_set1_ps(half_to_float(blk));
        const float m = half_to_float(blk + 2);
        const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 4));
        const __m128i lo = _mm_and_si128(raw, low);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        const __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        const __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        for (int r = 0; r < rows; r++) {
            const float *xp = x + (r0 + r) * xs + b * QBLOCK;
            acc[r] = _mm256_fmadd_ps(d, block_dot(q0, q1, q2, q3, xp), acc[r]);
            macc[r] += m * sums[(r0 + r) * nb + b];
        }
    }
    for (int r = 0; r < rows; r++) acc_out[r] = hsum(acc[r]) + macc[r];
#else
    for (int r = 0; r < rows; r++) {
        float total = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = wrow + b * Q4_BYTES;
            const float *xp = x + (r0 + r) * xs + b * QBLOCK;
            float t = 0.0f;
            for (int j = 0; j < 16; j++)
                t += (float)(blk[4 + j] & 0x0f) * xp[j] + (float)(blk[4 + j] >> 4) * xp[j + 16];
            total += half_to_float(blk) * t + half_to_float(blk + 2) * sums[(r0 + r) * nb + b];
        }
        acc_out[r] = total;
    }
#endif
}

static inline void q8_column(const float *x, int64_t xs, const uint8_t *wrow, int64_t nb,
                             int64_t r0, int rows, float *acc_out) {
    prefetch_weights(wrow, (int)(nb * Q8_BYTES)); /* this column's bytes, 2 KB on */
#if defined(QL_AVX512)
#define Q8_WIDEN(blk, qa, qb)                                                                \
    const __m512 d_##qa = _mm512_set1_ps(half_to_float(blk));                                \
    const __m512 qa = _mm512_mul_ps(d_##qa, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(        \
                                                _mm_loadu_si128((const __m128i *)((blk) + 2))))); \
    const __m512 qb = _mm512_mul_ps(d_##qa, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(        \
                                                _mm_loadu_si128((const __m128i *)((blk) + 18)))));
    if (rows == 1) { /* as q4_column: four accumulators, two blocks per iteration */
        const float *xr = x + r0 * xs;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int64_t b = 0;
        for (; b + 1 < nb; b += 2) {
            const uint8_t *blk = wrow + b * Q8_BYTES;
            Q8_WIDEN(blk, p0, p1)
            Q8_WIDEN(blk + Q8_BYTES, p2, p3)
            const float *xp = xr + b * QBLOCK;
            a0 = _mm512_fmadd_ps(p0, _mm512_loadu_ps(xp), a0);
            a1 = _mm512_fmadd_ps(p1, _mm512_loadu_ps(xp + 16), a1);
            a2 = _mm512_fmadd_ps(p2, _mm512_loadu_ps(xp + 32), a2);
            a3 = _mm512_fmadd_ps(p3, _mm512_loadu_ps(xp + 48), a3);
        }
        for (; b < nb; b++) {
            const uint8_t *blk = wrow + b * Q8_BYTES;
            Q8_WIDEN(blk, p0, p1)
            a0 = _mm512_fmadd_ps(p0, _mm512_loadu_ps(xr + b * QBLOCK), a0);
            a1 = _mm512_fmadd_ps(p1, _mm512_loadu_ps(xr + b * QBLOCK + 16), a1);
        }
        acc_out[0] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
        return;
    }
    __m512 acc[ROW_TILE];
    for (int r = 0; r < ROW_TILE; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wrow + b * Q8_BYTES;
        Q8_WIDEN(blk, qa, qb)
        for (int r = 0; r < rows; r++) {
            const float *xp = x + (r0 + r) * xs + b * QBLOCK;
            acc[r] = _mm512_fmadd_ps(qa, _mm512_loadu_ps(xp), acc[r]);
            acc[r] = _mm512_fmadd_ps(qb, _mm512_loadu_ps(xp + 16), acc[r]);
        }
    }
#undef Q8_WIDEN
    for (int r = 0; r < rows; r++) acc_out[r] = _mm512_reduce_add_ps(acc[r]);
#elif defined(QL_AVX2)
    __m256 acc[ROW_TILE];
    for (int r = 0; r < ROW_TILE; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wrow + b * Q8_BYTES;
        const __m256 d = _mm256_set1_ps(half_to_float(blk));
        const __m128i a = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m128i c = _mm_loadu_si128((const __m128i *)(blk + 18));
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
        const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
        const __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
        const __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8)));
        for (int r = 0; r < rows; r++) {
            const float *xp = x + (r0 + r) * xs + b * QBLOCK;
            acc[r] = _mm256_fmadd_ps(d, block_dot(q0, q1, q2, q3, xp), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) acc_out[r] = hsum(acc[r]);
#else
    for (int r = 0; r < rows; r++) {
        float total = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = wrow + b * Q8_BYTES;
            const int8_t *q = (const int8_t *)(blk + 2);
            const float *xp = x + (r0 + r) * xs + b * QBLOCK;
            float t = 0.0f;
            for (int j = 0; j < QBLOCK; j++) t += (float)q[j] * xp[j];
            total += half_to_float(blk) * t;
        }
        acc_out[r] = total;
    }
#endif
}

void quant_linear_body(const float *x, int64_t xs, const uint8_t *w, int kind, int64_t N,
                       int64_t K, const float *bias, float *y, int64_t ys, int64_t M,
                       const float *sums);

/* kind 4: q4 blocks, kind 8: q8 blocks, Q4G_KIND: q4 in column groups (quant_linear_q4g.c).
 * bias (fp32 [N]) may be NULL. Returns 0, or -1 when K is not a multiple of 32 or the
 * scratch allocation fails. */
int quant_linear(const float *x, int64_t xs, const uint8_t *w, int kind, int64_t N, int64_t K,
                 const float *bias, float *y, int64_t ys, int64_t M, int num_threads) {
    if (kind == Q4G_KIND) return q4g_linear_f32(x, xs, w, N, K, bias, y, ys, M, num_threads);
    if (K % QBLOCK || M <= 0 || N <= 0) return (K % QBLOCK) ? -1 : 0;
    const int64_t nb = K / QBLOCK;
    float *sums = NULL;
    if (kind == 4) {
        sums = (float *)malloc(sizeof(float) * (size_t)(M * nb));
        if (!sums) return -1;
        block_sums(x, xs, M, nb, sums);
    }
#pragma omp parallel num_threads(num_threads) if (N * nb * M > 4096)
    quant_linear_body(x, xs, w, kind, N, K, bias, y, ys, M, sums);
    free(sums);
    return 0;
}

/* Kinds 4 and 8 shared out with an orphaned `omp for` (decoder_stack.c calls it inside its
 * region); `sums` holds x's block sums for q4 (`quant_block_sums`), NULL for q8. */
void quant_linear_body(const float *x, int64_t xs, const uint8_t *w, int kind, int64_t N,
                       int64_t K, const float *bias, float *y, int64_t ys, int64_t M,
                       const float *sums) {
    const int64_t nb = K / QBLOCK;
    const int64_t row_bytes = nb * (kind == 4 ? Q4_BYTES : Q8_BYTES);
    /* Columns in chunks of 8 per thread step: few enough to balance, many enough that a
     * tile of x stays in L1 across them. */
    const int64_t chunks = (N + 7) / 8;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * 8, n1 = n0 + 8 < N ? n0 + 8 : N;
        for (int64_t r0 = 0; r0 < M; r0 += ROW_TILE) {
            const int rows = (int)(M - r0 < ROW_TILE ? M - r0 : ROW_TILE);
            for (int64_t n = n0; n < n1; n++) {
                float out[ROW_TILE];
                const uint8_t *wrow = w + n * row_bytes;
                if (kind == 4)
                    q4_column(x, xs, wrow, nb, sums, r0, rows, out);
                else
                    q8_column(x, xs, wrow, nb, r0, rows, out);
                const float b = bias ? bias[n] : 0.0f;
                for (int r = 0; r < rows; r++) y[(r0 + r) * ys + n] = out[r] + b;
            }
        }
    }
}

void quant_block_sums(const float *x, int64_t xs, int64_t M, int64_t nb, float *sums) {
    block_sums(x, xs, M, nb, sums);
}

/* W in blocks -> fp32 [N, K] (row stride K): the large-batch path multiplies that with the
 * dense GEMM, whose cache blocking wins once the rows amortize one pass over the weight. */
/* One row of blocks -> K fp32 values. */
static inline void dequantize_row(const uint8_t *wrow, int kind, int64_t nb, float *o) {
    for (int64_t b = 0; b < nb; b++) {
        float *ob = o + b * QBLOCK;
        if (kind == 4) {
            const uint8_t *blk = wrow + b * Q4_BYTES;
            const float d = half_to_float(blk), m = half_to_float(blk + 2);
#pragma omp simd
            for (int j = 0; j < 16; j++) {
                ob[j] = d * (float)(blk[4 + j] & 0x0f) + m;
                ob[j + 16] = d * (float)(blk[4 + j] >> 4) + m;
            }
        } else {
            const uint8_t *blk = wrow + b * Q8_BYTES;
            const int8_t *q = (const int8_t *)(blk + 2);
            const float d = half_to_float(blk);
#pragma omp simd
            for (int j = 0; j < QBLOCK; j++) ob[j] = d * (float)q[j];
        }
    }
}

void quant_dequantize(const uint8_t *w, int kind, int64_t N, int64_t K, float *out,
                      int num_threads) {
    if (kind == Q4G_KIND) {
        q4g_dequantize(w, N, K, out, 0, num_threads);
        return;
    }
    const int64_t nb = K / QBLOCK;
    const int64_t row_bytes = nb * (kind == 4 ? Q4_BYTES : Q8_BYTES);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++) dequantize_row(w + n * row_bytes, kind, nb, out + n * K);
}

/* W in blocks -> bf16 [N, K] (round to nearest even): the large-batch path with bf16
 * activations multiplies that with the bf16 GEMM (AVX512-BF16 / AMX where the CPU has
 * them), which writes and reads half the bytes of the fp32 copy and runs ~2x its FLOPs. */
void quant_dequantize_bf16(const uint8_t *w, int kind, int64_t N, int64_t K, uint16_t *out,
                           int num_threads) {
    if (kind == Q4G_KIND) {
        q4g_dequantize(w, N, K, out, 1, num_threads);
        return;
    }
    const int64_t nb = K / QBLOCK;
    const int64_t row_bytes = nb * (kind == 4 ? Q4_BYTES : Q8_BYTES);
#pragma omp parallel num_threads(num_threads)
    {
        float *row = (float *)malloc(sizeof(float) * (size_t)K);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            uint16_t *o = out + n * K;
            if (!row) { /* no scratch: write zeros rather than garbage (never seen) */
                memset(o, 0, sizeof(uint16_t) * (size_t)K);
                continue;
            }
            dequantize_row(w + n * row_bytes, kind, nb, row);
#pragma omp simd
            for (int64_t i = 0; i < K; i++) {
                uint32_t u;
                memcpy(&u, row + i, 4);
                o[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
            }
        }
        free(row);
    }
}
