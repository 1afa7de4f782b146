/* y = x @ W^T for q4 weights kept in column groups: 16 output columns side by side, so a
 * vector lane is an output column and no dot product ever needs a horizontal sum.
 *
 * Why another layout: quant_linear.c reads GGUF's own q4 blocks (one column's 32 weights
 * at a time, two fp16 scales in front). At one row it is bound by instructions, not by
 * memory: per 32 weights it converts two fp16 scales, widens 32 nibbles, multiplies them by
 * d, and every column ends in a horizontal sum; on 2 cores of an AMD EPYC (Zen 4) that ran
 * at ~11 GB/s against ~31 GB/s of memory bandwidth, and the layers' linears were most of a
 * decode step. Here one 16-lane vector holds 16 columns: the scales of a block are two
 * vectors (one load and one conversion for 16 columns), each activation is broadcast once
 * for 16 columns, and each weight costs a byte shuffle, a conversion and one FMA lane.
 *
 * Layout (engine/worker/quant/blocks.py packs it from q4 blocks at load, byte for byte the
 * same d, m and q): columns in groups of 16 (the last group zero-padded), group after group;
 * within a group, block after block (32 input features each), 320 bytes per block:
 *
 *   [0, 32)    d of the 16 columns, fp16
 *   [32, 64)   m of the 16 columns, fp16          w = d * q + m, q in 0..15
 *   [64, 320)  8 chunks of 4 features (k = 4c .. 4c + 3), 32 bytes each: column i's two
 *              bytes are q[k] | q[k+2] << 4 and q[k+1] | q[k+3] << 4
 *
 * so one 32-byte chunk widened to 16 dwords gives, after (v | v << 12) & 0x0F0F0F0F, each
 * column's four q values as the four bytes of its lane, in order.
 *
 * Products: fp32 rows (`q4g_linear_f32`): q widened to fp32, an FMA per weight with the
 * broadcast activation, then d and m applied per block: d * sum(q x) + m * sum(x), the
 * dequantized weights' product up to the order of fp32 additions, as quant_linear.c.
 * bf16 rows (`quant_linear_bf16`): on AMD (AVX512-BF16) each q (0..15) is exact in bf16, so
 * the pairwise bf16 dot product (VDPBF16PS) of q with the bf16 activations is exact per
 * product and accumulates in fp32; on Intel (AVX512-VNNI) the rows become exact int16
 * planes and VPDPWSSD sums q x per block exactly (group_i16 below). Either way the result
 * gets d, m and the bias in fp32 and is rounded to bf16 once, as the fp32 kernel's result
 * rounded would be (VDPBF16PS treats bf16 denormals as zero). Otherwise the bf16 entry
 * widens the rows and runs the fp32 kernel.
 *
 * Both parallelize over groups of columns with an orphaned `omp for`, so the functions
 * ending in `_body` also run inside a caller's parallel region (csrc/decoder_stack.c).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "quant_blocks.h"
#include "quant_q4g.h"
#include "vec512.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#include <immintrin.h>
#define G_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define G_AVX2 1
#endif
#if defined(G_AVX512) && defined(__AVX512BF16__)
#define G_BF16 1
#endif
#if defined(G_AVX512) && defined(__AVX512VNNI__)
#define G_I16 1
#endif

#define RT 4 /* rows per pass over a group's blocks */

/* Row r's sum of each 32-feature block (for m): sums[r * nb + b]. */
void q4g_block_sums(const void *x, int64_t xs, int64_t M, int64_t nb, int bf16, float *sums) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < nb; b++) {
            float s = 0.0f;
            if (bf16) {
                const uint16_t *p = (const uint16_t *)x + r * xs + b * QBLOCK;
#pragma omp simd reduction(+ : s)
                for (int i = 0; i < QBLOCK; i++) s += bf16_to_f32(p[i]);
            } else {
                const float *p = (const float *)x + r * xs + b * QBLOCK;
#pragma omp simd reduction(+ : s)
                for (int i = 0; i < QBLOCK; i++) s += p[i];
            }
            sums[r * nb + b] = s;
        }
}

/* The q of column i, feature k of a block (for the plain C path and dequantizing). */
static inline int q_at(const uint8_t *blk, int i, int k) {
    const uint8_t *p = blk + Q4G_HEAD + (k >> 2) * 32 + 2 * i;
    const int j = k & 3; /* bytes: q0 | q2 << 4, q1 | q3 << 4 */
    const uint8_t byte = p[j & 1];
    return j < 2 ? (byte & 0x0f) : (byte >> 4);
}

/* ---- fp32 rows ------------------------------------------------------------------------ */

#if defined(G_AVX512)
static inline __m512i chunk_bytes(const uint8_t *p) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    /* (v | v << 12) & 0x0F0F0F0F: 0xA8 is (A | B) & C */
    return _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12),
                                     _mm512_set1_epi32(0x0F0F0F0F), 0xA8);
}

/* q = 0..15 as fp32: VPERMPS reads only an index's low 4 bits, so one permute of this
 * table turns a lane's low nibble into its q with no mask and no conversion. */
static const float Q_F32[16] __attribute__((aligned(64))) = {0, 1, 2,  3,  4,  5,  6,  7,
                                                             8, 9, 10, 11, 12, 13, 14, 15};

/* Each chunk's 16-bit lane holds q[k] | q[k+2] << 4 | q[k+1] << 8 | q[k+3] << 12 (the
 * layout above), so the four q vectors are four table permutes of the lane shifted by 0,
 * 8, 4 and 12 bits: 3 shifts + 4 permutes per 64 weights where masking and converting
 * (chunk_bytes' shift and merge, 3 shifts, 3 ANDs, 4 conversions) took 12 operations, most
 * of them on the port the FMAs need. The q values, and so every product and sum, are the
 * same bits. On a 2-core Xeon (6/207/2), SmolLM2's gate/up at one row: 82 -> 65 us
 * (1.25x), 4 rows 1.15x (docs/quantization.md). */
static void group_f32(const float *x, int64_t xs, const uint8_t *gp, int64_t nb,
                      const float *sums, int64_t r0, int R, __m512 *acc) {
    const __m512 qt = _mm512_load_ps(Q_F32);
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = gp + b * Q4G_BYTES;
        prefetch_weights(blk, Q4G_BYTES);
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
        /* four accumulators per row (one per byte of a lane): short FMA chains */
        __m512 t[RT][4];
        for (int r = 0; r < R; r++)
            for (int i = 0; i < 4; i++) t[r][i] = _mm512_setzero_ps();
        for (int c = 0; c < 8; c++) {
            const __m512i v = _mm512_cvtepu16_epi32(
                _mm256_loadu_si256((const __m256i *)(blk + Q4G_HEAD + 32 * c)));
            const __m512 q0 = _mm512_permutexvar_ps(v, qt);
            const __m512 q1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8), qt);
            const __m512 q2 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), qt);
            const __m512 q3 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 12), qt);
            for (int r = 0; r < R; r++) {
                const float *xp = x + (r0 + r) * xs + b * QBLOCK + 4 * c;
                t[r][0] = _mm512_fmadd_ps(q0, _mm512_set1_ps(xp[0]), t[r][0]);
                t[r][1] = _mm512_fmadd_ps(q1, _mm512_set1_ps(xp[1]), t[r][1]);
                t[r][2] = _mm512_fmadd_ps(q2, _mm512_set1_ps(xp[2]), t[r][2]);
                t[r][3] = _mm512_fmadd_ps(q3, _mm512_set1_ps(xp[3]), t[r][3]);
            }
        }
        for (int r = 0; r < R; r++) {
            const __m512 s = _mm512_add_ps(_mm512_add_ps(t[r][0], t[r][1]),
                                           _mm512_add_ps(t[r][2], t[r][3]));
            acc[r] = _mm512_fmadd_ps(dv, s, acc[r]);
            acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sums[(r0 + r) * nb + b]), acc[r]);
        }
    }
}
#elif defined(G_AVX2)
/* 8 columns (half a group) of one chunk: the bytes of each lane are q[k..k+3]. */
static inline __m256i chunk_bytes8(const uint8_t *p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_and_si256(_mm256_or_si256(v, _mm256_slli_epi32(v, 12)),
                            _mm256_set1_epi32(0x0F0F0F0F));
}

/* Columns [8h, 8h + 8) of the group; two rows per pass keep the accumulators in registers. */
static void half_group_f32(const float *x, int64_t xs, const uint8_t *gp, int64_t nb,
                           const float *sums, int64_t r0, int R, int h, __m256 *acc) {
    const __m256i ff = _mm256_set1_epi32(0xff);
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = gp + b * Q4G_BYTES;
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
        const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * h)));
        __m256 t[2][2];
        for (int r = 0; r < R; r++) t[r][0] = t[r][1] = _mm256_setzero_ps();
        for (int c = 0; c < 8; c++) {
            const __m256i D = chunk_bytes8(blk + Q4G_HEAD + 32 * c + 16 * h);
            const __m256 q0 = _mm256_cvtepi32_ps(_mm256_and_si256(D, ff));
            const __m256 q1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(D, 8), ff));
            const __m256 q2 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(D, 16), ff));
            const __m256 q3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(D, 24));
            for (int r = 0; r < R; r++) {
                const float *xp = x + (r0 + r) * xs + b * QBLOCK + 4 * c;
                t[r][0] = _mm256_fmadd_ps(q0, _mm256_set1_ps(xp[0]), t[r][0]);
                t[r][1] = _mm256_fmadd_ps(q1, _mm256_set1_ps(xp[1]), t[r][1]);
                t[r][0] = _mm256_fmadd_ps(q2, _mm256_set1_ps(xp[2]), t[r][0]);
                t[r][1] = _mm256_fmadd_ps(q3, _mm256_set1_ps(xp[3]), t[r][1]);
            }
        }
        for (int r = 0; r < R; r++) {
            acc[r] = _mm256_fmadd_ps(dv, _mm256_add_ps(t[r][0], t[r][1]), acc[r]);
            acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(sums[(r0 + r) * nb + b]), acc[r]);
        }
    }
}
#endif

/* Plain C: one output (row r, column i of the group). */
static float column_f32(const float *xr, const uint8_t *gp, int64_t nb, const float *sr, int i) {
    float total = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = gp + b * Q4G_BYTES;
        float t = 0.0f;
        for (int k = 0; k < QBLOCK; k++) t += (float)q_at(blk, i, k) * xr[b * QBLOCK + k];
        total += half_to_float(blk + 2 * i) * t + half_to_float(blk + 32 + 2 * i) * sr[b];
    }
    return total;
}

void q4g_linear_f32_body(const float *x, int64_t xs, const uint8_t *w, int64_t N, int64_t K,
                         const float *bias, float *y, int64_t ys, int64_t M,
                         const float *sums) {
    const int64_t nb = K / QBLOCK, G = (N + Q4G_COLS - 1) / Q4G_COLS;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *gp = w + g * nb * Q4G_BYTES;
        const int64_t n0 = g * Q4G_COLS;
        const int valid = N - n0 < Q4G_COLS ? (int)(N - n0) : Q4G_COLS;
        float out[Q4G_COLS];
#if defined(G_AVX512)
        for (int64_t r0 = 0; r0 < M; r0 += RT) {
            const int R = (int)(M - r0 < RT ? M - r0 : RT);
            __m512 acc[RT];
            group_f32(x, xs, gp, nb, sums, r0, R, acc);
            for (int r = 0; r < R; r++) {
                _mm512_storeu_ps(out, acc[r]);
                for (int i = 0; i < valid; i++)
                    y[(r0 + r) * ys + n0 + i] = out[i] + (bias ? bias[n0 + i] : 0.0f);
            }
        }
#elif defined(G_AVX2)
        for (int64_t r0 = 0; r0 < M; r0 += 2) {
            const int R = M - r0 < 2 ? 1 : 2;
            for (int h = 0; h < 2; h++) {
                __m256 acc[2];
                half_group_f32(x, xs, gp, nb, sums, r0, R, h, acc);
                for (int r = 0; r < R; r++) {
                    _mm256_storeu_ps(out, acc[r]);
                    for (int i = 0; i < 8 && 8 * h + i < valid; i++)
                        y[(r0 + r) * ys + n0 + 8 * h + i] =
                            out[i] + (bias ? bias[n0 + 8 * h + i] : 0.0f);
                }
            }
        }
#else
        (void)out;
        for (int64_t r = 0; r < M; r++)
            for (int i = 0; i < valid; i++)
                y[r * ys + n0 + i] = column_f32(x + r * xs, gp, nb, sums + r * nb, i) +
                                     (bias ? bias[n0 + i] : 0.0f);
#endif
    }
}

/* Returns 0, or -1 when K is not a multiple of 32 or the scratch allocation fails. */
int q4g_linear_f32(const float *x, int64_t xs, const uint8_t *w, int64_t N, int64_t K,
                   const float *bias, float *y, int64_t ys, int64_t M, int num_threads) {
    if (K % QBLOCK || M <= 0 || N <= 0) return (K % QBLOCK) ? -1 : 0;
    const int64_t nb = K / QBLOCK;
    float *sums = (float *)malloc(sizeof(float) * (size_t)(M * nb));
    if (!sums) return -1;
    q4g_block_sums(x, xs, M, nb, 0, sums);
#pragma omp parallel num_threads(num_threads) if (N * nb * M > 4096)
    q4g_linear_f32_body(x, xs, w, N, K, bias, y, ys, M, sums);
    free(sums);
    return 0;
}

/* ---- bf16 rows ------------------------------------------------------------------------ */

#if defined(G_AVX512)
/* One group's outputs for rows [r0, r0 + R) as bf16: the bias added in fp32, one rounding
 * (the bf16-row kernels' common end). */
static inline void store_bf16_rows(const __m512 *acc, int R, int64_t r0, uint16_t *y,
                                   int64_t ys, int64_t n0, int valid, const float *bias) {
    float out[Q4G_COLS];
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(out, acc[r]);
        for (int i = 0; i < valid; i++)
            y[(r0 + r) * ys + n0 + i] = f32_to_bf16(out[i] + (bias ? bias[n0 + i] : 0.0f));
    }
}
#endif

/* How bf16 rows are multiplied, chosen at load from the CPU's vendor (`q4g_use_bf16_dot`,
 * engine/worker/kernels/build.py): on AMD (Zen 4) VDPBF16PS (group_bf16 below); on Intel,
 * where VDPBF16PS issues at half the FMA rate (the bf16 decoder stack at one row ran 9.6 ms
 * against 7.2 ms widened on a Xeon with AMX), the rows as exact int16 planes and VPDPWSSD
 * (group_i16); with neither, the rows are widened to fp32 and FMA'd. */
static int q4g_bf16_mode = Q4G_BF16_DOT;

/* Q4G_BF16_WIDEN, Q4G_BF16_DOT or Q4G_BF16_I16 (quant_q4g.h); a mode this build cannot run
 * widens. */
void q4g_use_bf16_dot(int mode) { q4g_bf16_mode = mode; }

int q4g_bf16_native(void) {
#if defined(G_I16)
    if (q4g_bf16_mode == Q4G_BF16_I16) return Q4G_BF16_I16;
#endif
#if defined(G_BF16)
    if (q4g_bf16_mode == Q4G_BF16_DOT) return Q4G_BF16_DOT;
#endif
    return Q4G_BF16_WIDEN;
}

#if defined(G_BF16)
/* One group's 16 outputs for rows [r0, r0 + R): the byte lanes become bf16 words through
 * two 16-entry tables (the low and high byte of bf16(q), q = 0..15), interleaved: lanes of
 * the low half hold (q[k], q[k+1]) and (q[k+2], q[k+3]) of columns 4L and 4L + 1 of each
 * 128-bit lane L, the high half those of 4L + 2 and 4L + 3; the activations are broadcast as
 * four bf16 values, and each column's two partial sums are added per block. */
static void group_bf16(const uint16_t *x, int64_t xs, const uint8_t *gp, int64_t nb,
                       const float *sums, int64_t r0, int R, __m512 *acc) {
    static const uint8_t lo_t[16] = {0x00, 0x80, 0x00, 0x40, 0x80, 0xa0, 0xc0, 0xe0,
                                     0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70};
    static const uint8_t hi_t[16] = {0x00, 0x3f, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40,
                                     0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41};
    const __m512i LT = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)lo_t));
    const __m512i HT = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)hi_t));
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = gp + b * Q4G_BYTES;
        prefetch_weights(blk, Q4G_BYTES); /* as group_f32 (not measured on AMD) */
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
        __m512 tl[RT][2], th[RT][2]; /* two chains each: even and odd chunks */
        for (int r = 0; r < R; r++)
            tl[r][0] = tl[r][1] = th[r][0] = th[r][1] = _mm512_setzero_ps();
        for (int c = 0; c < 8; c++) {
            const __m512i D = chunk_bytes(blk + Q4G_HEAD + 32 * c);
            const __m512i L = _mm512_shuffle_epi8(LT, D), H = _mm512_shuffle_epi8(HT, D);
            const __m512bh wl = (__m512bh)_mm512_unpacklo_epi8(L, H);
            const __m512bh wh = (__m512bh)_mm512_unpackhi_epi8(L, H);
            for (int r = 0; r < R; r++) {
                int64_t four;
                memcpy(&four, x + (r0 + r) * xs + b * QBLOCK + 4 * c, 8);
                const __m512bh xv = (__m512bh)_mm512_set1_epi64(four);
                tl[r][c & 1] = _mm512_dpbf16_ps(tl[r][c & 1], wl, xv);
                th[r][c & 1] = _mm512_dpbf16_ps(th[r][c & 1], wh, xv);
            }
        }
        for (int r = 0; r < R; r++) {
            const __m512 l = _mm512_add_ps(tl[r][0], tl[r][1]);
            const __m512 h = _mm512_add_ps(th[r][0], th[r][1]);
            const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(l, h, _MM_SHUFFLE(2, 0, 2, 0)),
                                           _mm512_shuffle_ps(l, h, _MM_SHUFFLE(3, 1, 3, 1)));
            acc[r] = _mm512_fmadd_ps(dv, s, acc[r]);
            acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sums[(r0 + r) * nb + b]), acc[r]);
        }
    }
}
#endif

/* ---- bf16 rows as exact int16 planes (Q4G_BF16_I16) ----------------------------------- */

/* A bf16 value is an integer m (its 8-bit significand, the implicit bit included) times
 * 2^(E - 134) (E its biased exponent, 1 for subnormals). Per row and 32-value block, with
 * emax the largest E of the block's nonzero values and d = emax - E:
 *   plane 1: d <= 7        m << (7 - d)          (|.| <= 255 << 7), value = p1 * 2^(emax - 141)
 *   plane 2: 8 <= d <= 15  m << (15 - d)                            value = p2 * 2^(emax - 149)
 *            d >= 16       m * 2^(15 - d) rounded half away from zero (below 2^-23 of the
 *                          block's largest value; 0.5 % of the blocks of SmolLM2's layer inputs)
 * so VPDPWSSD multiplies q (0..15) with the planes exactly: a block's sum per plane is an
 * integer below 32 * 15 * 32640 < 2^24, exact in int32 and in fp32, and the block's q.x is
 * S1 * 2^(emax - 141) + S2 * 2^(emax - 149), one rounding (an FMA). The fp32 path it
 * replaces rounds every product's sum. Infinities and NaNs have no plane: the prep reports
 * them and the caller widens the rows to fp32 instead.
 *
 * Why: on an Intel Xeon (6/207/2) the fp32 kernel's table permutes and FMAs take 12
 * instructions per 64 weights; here a chunk costs a widening, 2 shifts, a ternary op, an
 * OR, an AND and 2 VPDPWSSD per row (2 more for the rows whose block needs plane 2); VPDPWSSD
 * issues on two ports, the permutes on one (docs/quantization.md). */

#if defined(G_I16)
/* scale 2^e as a float (0 below the smallest subnormal) */
static inline float pow2f(int e) {
    if (e >= -126) {
        const uint32_t bits = (uint32_t)(e + 127) << 23;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    return e >= -149 ? (float)(1.0 / (double)(1ULL << (-e - 126))) * 1.17549435e-38f : 0.0f;
}

int q4g_i16_prep(const uint16_t *x, int64_t xs, int64_t M, int64_t nb, int16_t *x1,
                 int16_t *x2, float *sc, uint8_t *two) {
    const __m512i ff = _mm512_set1_epi16(0xFF), lo7 = _mm512_set1_epi16(0x7F);
    const __m512i b80 = _mm512_set1_epi16(0x80), one = _mm512_set1_epi16(1);
    const __m512i c7 = _mm512_set1_epi16(7), c15 = _mm512_set1_epi16(15);
    const __m512i c16 = _mm512_set1_epi16(16), zero = _mm512_setzero_si512();
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < nb; b++) {
            const __m512i v = _mm512_loadu_si512(x + r * xs + b * QBLOCK);
            const __m512i e = _mm512_and_si512(_mm512_srli_epi16(v, 7), ff);
            if (_mm512_cmpeq_epi16_mask(e, ff)) return 0; /* inf or NaN */
            const __mmask32 normal = _mm512_cmpneq_epi16_mask(e, zero);
            const __m512i mant = _mm512_and_si512(v, lo7);
            /* m: the significand, with its implicit bit where the value is normal */
            const __m512i mm = _mm512_mask_mov_epi16(mant, normal, _mm512_or_si512(mant, b80));
            const __mmask32 nz = _mm512_cmpneq_epi16_mask(mm, zero);
            const __m512i E = _mm512_max_epu16(e, one);
            const __m512i En = _mm512_maskz_mov_epi16(nz, E);
            const __m512i e32 = _mm512_max_epu32(
                _mm512_cvtepu16_epi32(_mm512_castsi512_si256(En)),
                _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(En, 1)));
            const int emax = _mm512_reduce_max_epu32(e32);
            const int64_t rb = r * nb + b;
            int16_t *p1 = x1 + rb * QBLOCK, *p2 = x2 + rb * QBLOCK;
            if (!nz) { /* all zeros */
                _mm512_storeu_si512(p1, zero);
                _mm512_storeu_si512(p2, zero);
                sc[2 * rb] = sc[2 * rb + 1] = 0.0f;
                two[rb] = 0;
                continue;
            }
            const __m512i d = _mm512_sub_epi16(_mm512_set1_epi16((short)emax), E);
            const __mmask32 in1 = nz & _mm512_cmple_epu16_mask(d, c7);
            const __mmask32 in2 = nz & ~in1 & _mm512_cmple_epu16_mask(d, c15);
            const __mmask32 tiny = nz & ~in1 & ~in2;
            __m512i v1 = _mm512_maskz_sllv_epi16(in1, mm, _mm512_sub_epi16(c7, d));
            __m512i v2 = _mm512_maskz_sllv_epi16(in2, mm, _mm512_sub_epi16(c15, d));
            if (tiny) { /* (m + 2^(d - 16)) >> (d - 15): counts of 16 and more give 0 */
                const __m512i half = _mm512_sllv_epi16(one, _mm512_sub_epi16(d, c16));
                const __m512i rounded = _mm512_srlv_epi16(_mm512_add_epi16(mm, half),
                                                          _mm512_sub_epi16(d, c15));
                v2 = _mm512_mask_mov_epi16(v2, tiny, rounded);
            }
            const __mmask32 neg = _mm512_test_epi16_mask(v, _mm512_set1_epi16((short)0x8000));
            v1 = _mm512_mask_sub_epi16(v1, neg, zero, v1);
            v2 = _mm512_mask_sub_epi16(v2, neg, zero, v2);
            _mm512_storeu_si512(p1, v1);
            _mm512_storeu_si512(p2, v2);
            sc[2 * rb] = pow2f(emax - 141);
            sc[2 * rb + 1] = pow2f(emax - 149);
            two[rb] = _mm512_test_epi16_mask(v2, v2) != 0;
        }
    return 1;
}

#else
int q4g_i16_prep(const uint16_t *x, int64_t xs, int64_t M, int64_t nb, int16_t *x1,
                 int16_t *x2, float *sc, uint8_t *two) {
    (void)x, (void)xs, (void)M, (void)nb, (void)x1, (void)x2, (void)sc, (void)two;
    return 0; /* no int16 path in this build: the caller widens */
}
#endif

#if defined(G_I16)
#define RI 4 /* rows per pass of the int16 kernel (all its accumulators in registers) */

/* One chunk (4 features of 16 columns) as int16 word pairs: each lane holds
 * q[k] | q[k+2] << 4 | q[k+1] << 8 | q[k+3] << 12 widened to 32 bits; A gets the words
 * (q[k], q[k+1]), B (q[k+2], q[k+3]). */
static inline __attribute__((always_inline)) void chunk_words(const uint8_t *p, __m512i M4,
                                                              __m512i *A, __m512i *B) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    const __m512i t = _mm512_slli_epi32(v, 8);
    *A = _mm512_ternarylogic_epi32(v, t, M4, 0xA8); /* (v | t) & M4 */
    *B = _mm512_and_si512(_mm512_srli_epi32(_mm512_or_si512(v, t), 4), M4);
}

/* a row's two bf16-pair activations for a chunk, broadcast (x[k], x[k+1]) / (x[k+2], x[k+3]) */
static inline __attribute__((always_inline)) __m512i pair_at(const int16_t *p) {
    int32_t w;
    memcpy(&w, p, 4);
    return _mm512_set1_epi32(w);
}

/* Rows [r0, r0 + R) of one group (R a literal 1-4 at the call sites, so every accumulator
 * below is a register): two chunks a step, per row and plane four chains at 1-2 rows (the
 * VPDPWSSD latency), two at 3-4 (32 registers). */
static inline __attribute__((always_inline)) void
group_i16(const int16_t *x1, const int16_t *x2, const float *sc, const uint8_t *two,
          int64_t K, const uint8_t *gp, int64_t nb, const float *sums, int64_t r0, const int R,
          __m512 *acc) {
    const __m512i M4 = _mm512_set1_epi32(0x000F000F);
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = gp + b * Q4G_BYTES;
        prefetch_weights(blk, Q4G_BYTES);
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
        int any2 = 0;
        for (int r = 0; r < R; r++) any2 |= two[(r0 + r) * nb + b];
        const int h = R <= 2 ? 2 : 0; /* where the odd chunk's chains start */
        __m512i s1[RI][4], s2[RI][4];
        for (int r = 0; r < R; r++)
            for (int i = 0; i < 4; i++) s1[r][i] = s2[r][i] = _mm512_setzero_si512();
        for (int c = 0; c < 8; c += 2) {
            __m512i A0, B0, A1, B1;
            chunk_words(blk + Q4G_HEAD + 32 * c, M4, &A0, &B0);
            chunk_words(blk + Q4G_HEAD + 32 * (c + 1), M4, &A1, &B1);
            for (int r = 0; r < R; r++) {
                const int16_t *p = x1 + (r0 + r) * K + b * QBLOCK + 4 * c;
                s1[r][0] = _mm512_dpwssd_epi32(s1[r][0], A0, pair_at(p));
                s1[r][1] = _mm512_dpwssd_epi32(s1[r][1], B0, pair_at(p + 2));
                s1[r][h] = _mm512_dpwssd_epi32(s1[r][h], A1, pair_at(p + 4));
                s1[r][h + 1] = _mm512_dpwssd_epi32(s1[r][h + 1], B1, pair_at(p + 6));
            }
            if (any2)
                for (int r = 0; r < R; r++) {
                    const int16_t *p = x2 + (r0 + r) * K + b * QBLOCK + 4 * c;
                    s2[r][0] = _mm512_dpwssd_epi32(s2[r][0], A0, pair_at(p));
                    s2[r][1] = _mm512_dpwssd_epi32(s2[r][1], B0, pair_at(p + 2));
                    s2[r][h] = _mm512_dpwssd_epi32(s2[r][h], A1, pair_at(p + 4));
                    s2[r][h + 1] = _mm512_dpwssd_epi32(s2[r][h + 1], B1, pair_at(p + 6));
                }
        }
        for (int r = 0; r < R; r++) {
            const int64_t rb = (r0 + r) * nb + b;
            const __m512i i1 = _mm512_add_epi32(_mm512_add_epi32(s1[r][0], s1[r][1]),
                                                _mm512_add_epi32(s1[r][2], s1[r][3]));
            __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(i1), _mm512_set1_ps(sc[2 * rb]));
            if (two[rb]) {
                const __m512i i2 = _mm512_add_epi32(_mm512_add_epi32(s2[r][0], s2[r][1]),
                                                    _mm512_add_epi32(s2[r][2], s2[r][3]));
                t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i2), _mm512_set1_ps(sc[2 * rb + 1]), t);
            }
            acc[r] = _mm512_fmadd_ps(dv, t, acc[r]);
            acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sums[rb]), acc[r]);
        }
    }
}
#endif

/* bf16 [M, N] outputs (bias in fp32, one rounding) from q4g_i16_prep's planes (row stride K,
 * scales and flags per row and block). A build without the path does nothing: the caller
 * checks q4g_bf16_native() == Q4G_BF16_I16 first. */
void q4g_linear_i16_body(const int16_t *x1, const int16_t *x2, const float *sc,
                         const uint8_t *two, const uint8_t *w, int64_t N, int64_t K,
                         const float *bias, uint16_t *y, int64_t ys, int64_t M,
                         const float *sums) {
#if defined(G_I16)
    const int64_t nb = K / QBLOCK, G = (N + Q4G_COLS - 1) / Q4G_COLS;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *gp = w + g * nb * Q4G_BYTES;
        const int64_t n0 = g * Q4G_COLS;
        const int valid = N - n0 < Q4G_COLS ? (int)(N - n0) : Q4G_COLS;
        for (int64_t r0 = 0; r0 < M; r0 += RI) {
            const int R = (int)(M - r0 < RI ? M - r0 : RI);
            __m512 acc[RI];
            switch (R) { /* a literal row count each: see group_i16 */
            case 4: group_i16(x1, x2, sc, two, K, gp, nb, sums, r0, 4, acc); break;
            case 3: group_i16(x1, x2, sc, two, K, gp, nb, sums, r0, 3, acc); break;
            case 2: group_i16(x1, x2, sc, two, K, gp, nb, sums, r0, 2, acc); break;
            default: group_i16(x1, x2, sc, two, K, gp, nb, sums, r0, 1, acc);
            }
            store_bf16_rows(acc, R, r0, y, ys, n0, valid, bias);
        }
    }
#else
    (void)x1, (void)x2, (void)sc, (void)two, (void)w, (void)N, (void)K, (void)bias, (void)y;
    (void)ys, (void)M, (void)sums;
#endif
}

/* bf16 rows in, bf16 rows out (fp32 inside, one rounding). Native path only: the caller
 * checks q4g_bf16_native() (q4g_linear_bf16 below falls back by itself). */
void q4g_linear_bf16_body(const uint16_t *x, int64_t xs, const uint8_t *w, int64_t N,
                          int64_t K, const float *bias, uint16_t *y, int64_t ys, int64_t M,
                          const float *sums) {
#if defined(G_BF16)
    const int64_t nb = K / QBLOCK, G = (N + Q4G_COLS - 1) / Q4G_COLS;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *gp = w + g * nb * Q4G_BYTES;
        const int64_t n0 = g * Q4G_COLS;
        const int valid = N - n0 < Q4G_COLS ? (int)(N - n0) : Q4G_COLS;
        for (int64_t r0 = 0; r0 < M; r0 += RT) {
            const int R = (int)(M - r0 < RT ? M - r0 : RT);
            __m512 acc[RT];
            group_bf16(x, xs, gp, nb, sums, r0, R, acc);
            store_bf16_rows(acc, R, r0, y, ys, n0, valid, bias);
        }
    }
#else
    (void)x, (void)xs, (void)w, (void)N, (void)K, (void)bias, (void)y, (void)ys, (void)M;
    (void)sums;
#endif
}

/* Rows widened to fp32, the fp32 kernel, the result rounded: where there is no native bf16
 * dot product (and for the GGUF-layout kinds, through `quant_linear`). */
int quant_linear(const float *x, int64_t xs, const uint8_t *w, int kind, int64_t N, int64_t K,
                 const float *bias, float *y, int64_t ys, int64_t M, int num_threads);

static int widened_bf16(const uint16_t *x, int64_t xs, const uint8_t *w, int kind, int64_t N,
                        int64_t K, const float *bias, uint16_t *y, int64_t ys, int64_t M,
                        int num_threads) {
    float *xf = (float *)malloc(sizeof(float) * (size_t)(M * K));
    float *yf = (float *)malloc(sizeof(float) * (size_t)(M * N));
    int rc = -1;
    if (xf && yf) {
        for (int64_t r = 0; r < M; r++)
            for (int64_t i = 0; i < K; i++) xf[r * K + i] = bf16_to_f32(x[r * xs + i]);
        rc = quant_linear(xf, K, w, kind, N, K, bias, yf, N, M, num_threads);
        if (rc == 0)
            for (int64_t r = 0; r < M; r++)
                for (int64_t i = 0; i < N; i++) y[r * ys + i] = f32_to_bf16(yf[r * N + i]);
    }
    free(xf);
    free(yf);
    return rc;
}

/* bf16 [M, K] rows -> bf16 [M, N] for any block kind (4, 8 or Q4G_KIND). 0, or -1 as
 * quant_linear. */
int quant_linear_bf16(const uint16_t *x, int64_t xs, const uint8_t *w, int kind, int64_t N,
                      int64_t K, const float *bias, uint16_t *y, int64_t ys, int64_t M,
                      int num_threads) {
    if (K % QBLOCK || M <= 0 || N <= 0) return (K % QBLOCK) ? -1 : 0;
    if (kind != Q4G_KIND || !q4g_bf16_native())
        return widened_bf16(x, xs, w, kind, N, K, bias, y, ys, M, num_threads);
    const int64_t nb = K / QBLOCK;
    if (q4g_bf16_native() == Q4G_BF16_I16) {
        /* block sums, then the planes' two scales per row and block */
        float *sums = (float *)malloc(sizeof(float) * (size_t)(M * nb * 3));
        int16_t *planes = (int16_t *)malloc(sizeof(int16_t) * (size_t)(2 * M * K));
        uint8_t *two = (uint8_t *)malloc((size_t)(M * nb));
        int rc = -1;
        if (sums && planes && two) {
            float *sc = sums + M * nb;
            q4g_block_sums(x, xs, M, nb, 1, sums);
            if (q4g_i16_prep(x, xs, M, nb, planes, planes + M * K, sc, two)) {
#pragma omp parallel num_threads(num_threads) if (N * nb * M > 4096)
                q4g_linear_i16_body(planes, planes + M * K, sc, two, w, N, K, bias, y, ys, M,
                                    sums);
                rc = 0;
            } else { /* an infinity or a NaN: no plane holds it */
                rc = widened_bf16(x, xs, w, kind, N, K, bias, y, ys, M, num_threads);
            }
        }
        free(sums);
        free(planes);
        free(two);
        return rc;
    }
    float *sums = (float *)malloc(sizeof(float) * (size_t)(M * nb));
    if (!sums) return -1;
    q4g_block_sums(x, xs, M, nb, 1, sums);
#pragma omp parallel num_threads(num_threads) if (N * nb * M > 4096)
    q4g_linear_bf16_body(x, xs, w, N, K, bias, y, ys, M, sums);
    free(sums);
    return 0;
}

/* ---- dequantizing (the large-batch path's dense copy) --------------------------------- */

/* Q4G -> W^T [K, N] (row stride N), fp32 (bf16 == 0) or bf16 (rounded to nearest even):
 * in this layout a chunk is 16 columns at one feature, so the transposed copy is written
 * 16 values at a time; the large-batch path multiplies x @ W^T with the dense GEMM. */
void q4g_dequantize_t(const uint8_t *w, int64_t N, int64_t K, void *out, int bf16,
                      int num_threads) {
    const int64_t nb = K / QBLOCK, G = (N + Q4G_COLS - 1) / Q4G_COLS;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *gp = w + g * nb * Q4G_BYTES;
        const int64_t n0 = g * Q4G_COLS;
        const int valid = N - n0 < Q4G_COLS ? (int)(N - n0) : Q4G_COLS;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = gp + b * Q4G_BYTES;
#if defined(G_AVX512)
            const __m512 qt = _mm512_load_ps(Q_F32);
            const __mmask16 mask = (__mmask16)((1u << valid) - 1);
            const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
            const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
            for (int c = 0; c < 8; c++) {
                const __m512i raw = _mm512_cvtepu16_epi32(
                    _mm256_loadu_si256((const __m256i *)(blk + Q4G_HEAD + 32 * c)));
                for (int j = 0; j < 4; j++) { /* q[k + j]: bits 0, 8, 4, 12 (group_f32) */
                    const __m512i qi = _mm512_srli_epi32(raw, (j & 1) * 8 + (j >> 1) * 4);
                    const __m512 v = _mm512_fmadd_ps(dv, _mm512_permutexvar_ps(qi, qt), mv);
                    const int64_t row = (b * QBLOCK + 4 * c + j) * N + n0;
                    if (bf16) {
                        /* 16 lanes rounded as f32_to_bf16 (vec512.h): the scalar loop it
                         * replaced was most of the bf16 copy's time */
                        _mm256_mask_storeu_epi16((uint16_t *)out + row, mask, to_bf16x16(v));
                    } else {
                        _mm512_mask_storeu_ps((float *)out + row, mask, v);
                    }
                }
            }
#else
            for (int k = 0; k < QBLOCK; k++) {
                const int64_t row = (b * QBLOCK + k) * N + n0;
                for (int i = 0; i < valid; i++) {
                    const float v = half_to_float(blk + 2 * i) * (float)q_at(blk, i, k) +
                                    half_to_float(blk + 32 + 2 * i);
                    if (bf16)
                        ((uint16_t *)out)[row + i] = f32_to_bf16(v);
                    else
                        ((float *)out)[row + i] = v;
                }
            }
#endif
        }
    }
}

/* Q4G -> [N, K] fp32 (bf16 == 0) or bf16 (rounded to nearest even), row stride K. */
void q4g_dequantize(const uint8_t *w, int64_t N, int64_t K, void *out, int bf16,
                    int num_threads) {
    const int64_t nb = K / QBLOCK, G = (N + Q4G_COLS - 1) / Q4G_COLS;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *gp = w + g * nb * Q4G_BYTES;
        for (int i = 0; i < Q4G_COLS && g * Q4G_COLS + i < N; i++) {
            const int64_t n = g * Q4G_COLS + i;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = gp + b * Q4G_BYTES;
                const float d = half_to_float(blk + 2 * i), m = half_to_float(blk + 32 + 2 * i);
                for (int k = 0; k < QBLOCK; k++) {
                    const float v = d * (float)q_at(blk, i, k) + m;
                    if (bf16)
                        ((uint16_t *)out)[n * K + b * QBLOCK + k] = f32_to_bf16(v);
                    else
                        ((float *)out)[n * K + b * QBLOCK + k] = v;
                }
            }
        }
    }
}
