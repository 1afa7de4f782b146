/* y = x @ W^T with W in 32-weight blocks (GGUF's Q4_1 and Q8_0 layouts, as quant_linear.c)
 * and x quantized to 8 bits per 32-value block: the integer dot-product path.
 *
 * Why: quant_linear.c widens every weight to fp32 in registers, ~20 instructions per
 * 32 weights, so at one row it is bound by that work, not by memory (measured on 2 cores
 * of an AMD EPYC with AVX-512: ~10 GB/s against ~31 GB/s of memory read bandwidth). Here
 * each row of x is first quantized per 32-value block (d_x = max|x| / 127, q_x =
 * round(x / d_x)), then a block's dot product is one byte-wise multiply-add of the 32
 * weight bytes with the 32 activation bytes (AVX2 `maddubs` + `madd`, or one VNNI `dpbusd` where the compiler targets it),
 * converted once and scaled by d_w * d_x:
 *
 *   q4: sum_j (d q_j + m) x~_j  =  d d_x sum_j q_j q_x,j  +  m d_x sum_j q_x,j
 *   q8: sum_j d q_j x~_j        =  d d_x sum_j q_j q_x,j
 *
 * with x~ = d_x q_x the rounded activations: the result is the blocks' exact weights times
 * x~ (what llama.cpp computes for these types), so the dense path for large batches, which
 * rounds x the same way before its GEMM (engine/worker/quant/linear.py), gives the same
 * answer up to the order of fp32 additions. Each row is quantized on its own, so a row's
 * result does not depend on the other rows in the batch. Same signature and
 * threading as quant_linear (OpenMP over output columns, threads from the caller).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_blocks.h"
#include "quant_q4g.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QI_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QI_DOT(w, x) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (w), (x))
#elif defined(__AVXVNNI__)
#define QI_DOT(w, x) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (w), (x))
#else
#define QI_DOT(w, x) _mm256_madd_epi16(_mm256_maddubs_epi16((w), (x)), _mm256_set1_epi16(1))
#endif
#endif

#define QB QBLOCK
#define Q4B Q4_BYTES
#define Q8B Q8_BYTES
#define RT 4

/* Row r of x -> qx[r * K ..] int8, dx[r * nb + b] its block scales, sx[r * nb + b] the
 * sums of the rounded blocks (d_x * sum q_x), so that q4's offset term too multiplies the
 * rounded activations and the whole result is W times the rounded x. */
static void quantize_rows(const float *x, int64_t xs, int64_t M, int64_t K, int8_t *qx,
                          float *dx, float *sx) {
    const int64_t nb = K / QB;
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *p = x + r * xs + b * QB;
            float amax = 0.0f;
            for (int i = 0; i < QB; i++) {
                const float a = fabsf(p[i]);
                amax = a > amax ? a : amax;
            }
            const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
            int8_t *q = qx + r * K + b * QB;
            int32_t s = 0;
            for (int i = 0; i < QB; i++) {
                q[i] = (int8_t)lrintf(p[i] * id);
                s += q[i];
            }
            dx[r * nb + b] = d;
            sx[r * nb + b] = d * (float)s;
        }
}


static inline void q4_col(const int8_t *qx, const float *dx, const float *sx, int64_t K,
                          const uint8_t *wrow, int64_t nb, int64_t r0, int rows, float *out) {
#ifdef QI_AVX2
    __m256 acc[RT];
    float macc[RT];
    for (int r = 0; r < RT; r++) acc[r] = _mm256_setzero_ps(), macc[r] = 0.0f;
    const __m128i low = _mm_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wrow + b * Q4B;
        const float d = half_to_float(blk), m = half_to_float(blk + 2);
        const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 4));
        const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low),
                                           _mm_and_si128(raw, low));
        for (int r = 0; r < rows; r++) {
            const int64_t i = (r0 + r) * nb + b;
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(qx + (r0 + r) * K + b * QB));
            const __m256 dot = _mm256_cvtepi32_ps(QI_DOT(w, xv));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[i]), dot, acc[r]);
            macc[r] += m * sx[i];
        }
    }
    for (int r = 0; r < rows; r++) out[r] = hsum(acc[r]) + macc[r];
#else
    for (int r = 0; r < rows; r++) {
        float total = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = wrow + b * Q4B;
            const int8_t *q = qx + (r0 + r) * K + b * QB;
            int32_t t = 0;
            for (int j = 0; j < 16; j++)
                t += (blk[4 + j] & 0x0f) * q[j] + (blk[4 + j] >> 4) * q[j + 16];
            const int64_t i = (r0 + r) * nb + b;
            total += half_to_float(blk) * dx[i] * (float)t + half_to_float(blk + 2) * sx[i];
        }
        out[r] = total;
    }
#endif
}

static inline void q8_col(const int8_t *qx, const float *dx, int64_t K, const uint8_t *wrow,
                          int64_t nb, int64_t r0, int rows, float *out) {
#ifdef QI_AVX2
    __m256 acc[RT];
    for (int r = 0; r < RT; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wrow + b * Q8B;
        const float d = half_to_float(blk);
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(blk + 2));
        const __m256i aw = _mm256_sign_epi8(wv, wv); /* |w| as unsigned bytes (-128 -> 128) */
        for (int r = 0; r < rows; r++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(qx + (r0 + r) * K + b * QB));
            const __m256i sxv = _mm256_sign_epi8(xv, wv); /* x with w's sign */
            const __m256 dot = _mm256_cvtepi32_ps(QI_DOT(aw, sxv));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[(r0 + r) * nb + b]), dot, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = hsum(acc[r]);
#else
    for (int r = 0; r < rows; r++) {
        float total = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = wrow + b * Q8B;
            const int8_t *w = (const int8_t *)(blk + 2), *q = qx + (r0 + r) * K + b * QB;
            int32_t t = 0;
            for (int j = 0; j < QB; j++) t += w[j] * q[j];
            total += half_to_float(blk) * dx[(r0 + r) * nb + b] * (float)t;
        }
        out[r] = total;
    }
#endif
}

int quant_linear(const float *x, int64_t xs, const uint8_t *w, int kind, int64_t N, int64_t K,
                 const float *bias, float *y, int64_t ys, int64_t M, int num_threads);

/* The rows rounded exactly as quant_linear_i8 rounds them, then quant_linear's fp32
 * products: the same result as the integer path, for row counts where the per-row scale
 * work of the integer path costs more than the fp32 FMAs (QuantLinear.forward picks). */
int quant_linear_rounded(const float *x, int64_t xs, const uint8_t *w, int kind, int64_t N,
                         int64_t K, const float *bias, float *y, int64_t ys, int64_t M,
                         int num_threads) {
    if (K % QB || M <= 0 || N <= 0) return (K % QB) ? -1 : 0;
    const int64_t nb = K / QB;
    float *xr = (float *)malloc(sizeof(float) * (size_t)(M * K));
    int8_t *q = (int8_t *)malloc((size_t)(M * K));
    float *d = (float *)malloc(sizeof(float) * (size_t)(2 * M * nb));
    int rc = -1;
    if (xr && q && d) {
        quantize_rows(x, xs, M, K, q, d, d + M * nb);
        for (int64_t i = 0; i < M * K; i++) xr[i] = d[i / QB] * (float)q[i];
        rc = quant_linear(xr, K, w, kind, N, K, bias, y, ys, M, num_threads);
    }
    free(xr);
    free(q);
    free(d);
    return rc;
}

/* As quant_linear: kind 4 (q4) or 8 (q8); bias may be NULL; 0, or -1 for K not a multiple
 * of 32 or a failed scratch allocation, -2 for the column-group layout (int8 activations keep
 * GGUF's layout: QuantLinear never regroups their layers). */
int quant_linear_i8(const float *x, int64_t xs, const uint8_t *w, int kind, int64_t N,
                    int64_t K, const float *bias, float *y, int64_t ys, int64_t M,
                    int num_threads) {
    if (kind == Q4G_KIND) return -2;
    if (K % QB || M <= 0 || N <= 0) return (K % QB) ? -1 : 0;
    const int64_t nb = K / QB;
    const int64_t row_bytes = nb * (kind == 4 ? Q4B : Q8B);
    int8_t *qx = (int8_t *)malloc((size_t)(M * K) + 32);
    float *dx = (float *)malloc(sizeof(float) * (size_t)(2 * M * nb));
    if (!qx || !dx) {
        free(qx);
        free(dx);
        return -1;
    }
    float *sx = dx + M * nb;
    quantize_rows(x, xs, M, K, qx, dx, sx);
    const int64_t chunks = (N + 7) / 8;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (N * nb * M > 4096)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * 8, n1 = n0 + 8 < N ? n0 + 8 : N;
        for (int64_t r0 = 0; r0 < M; r0 += RT) {
            const int rows = (int)(M - r0 < RT ? M - r0 : RT);
            for (int64_t n = n0; n < n1; n++) {
                float out[RT];
                const uint8_t *wrow = w + n * row_bytes;
                if (kind == 4)
                    q4_col(qx, dx, sx, K, wrow, nb, r0, rows, out);
                else
                    q8_col(qx, dx, K, wrow, nb, r0, rows, out);
                const float bb = bias ? bias[n] : 0.0f;
                for (int r = 0; r < rows; r++) y[(r0 + r) * ys + n] = out[r] + bb;
            }
        }
    }
    free(qx);
    free(dx);
    return 0;
}
