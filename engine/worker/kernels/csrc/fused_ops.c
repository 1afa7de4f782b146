/* Fused elementwise ops of a decoder layer, for the CPU path, in fp32 or bf16.
 *
 * In eager torch each of these is 4-8 separate ops (RMSNorm: add, pow, mean, add, rsqrt,
 * mul, mul; rotary: mul, slice, neg, cat, mul, add; SiLU-and-mul: chunk, silu, mul), every
 * one a full pass over memory plus a Python dispatch. A decode step of a small model runs
 * hundreds of them, so fusing them is worth as much as a faster GEMM. Each function here is
 * one pass, parallel with OpenMP (torch's runtime, thread count from the caller); the
 * `_body` variants share their work out with an orphaned `omp for`, so decoder_stack.c
 * runs them inside its own parallel region.
 *
 * Arithmetic follows transformers' order: statistics and products in fp32. With `bf16` set
 * every tensor argument is bf16 (weights, tables and the row data); values are widened to
 * fp32 on load and rounded back where transformers' bf16 forward rounds (bf16.h), so the
 * bf16 path reads and writes half the bytes and still tracks transformers in bf16.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "vec512.h"
#include "vec_math.h"

#ifdef HAVE_VEC512
/* add_rms_norm_rows' row with explicit 16-lane loops (GCC's own vectorization of the bf16
 * loads and roundings ran ~1 ns an element); the same roundings, sums in 16 lanes. */
static inline __attribute__((always_inline)) void
add_rms_norm_row16(const void *x, int64_t xo, void *residual, int64_t ro, const void *weight,
                   float eps, void *out, int64_t oo, int n, const int bf16) {
    __m512 ss = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        const __mmask16 k = tail16(n - i);
        __m512 h = ld16(x, xo + i, k, bf16);
        if (residual) {
            h = rnd16(_mm512_add_ps(h, ld16(residual, ro + i, k, bf16)), bf16);
            st16(residual, ro + i, h, k, bf16);
        }
        ss = _mm512_fmadd_ps(h, h, ss);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)n + eps));
    const void *hsrc = residual ? residual : x;
    const int64_t ho = residual ? ro : xo;
    for (int i = 0; i < n; i += 16) {
        const __mmask16 k = tail16(n - i);
        const __m512 y = rnd16(_mm512_mul_ps(ld16(hsrc, ho + i, k, bf16), inv), bf16);
        st16(out, oo + i, _mm512_mul_ps(ld16(weight, i, k, bf16), y), k, bf16);
    }
}
#endif

static inline __attribute__((always_inline)) void
add_rms_norm_rows(const void *x, int64_t xs, void *residual, int64_t rs, const void *weight,
                  float eps, void *out, int64_t os, int64_t rows, int n, const int bf16) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t xo = r * xs, ro = r * rs, oo = r * os;
#ifdef HAVE_VEC512
        add_rms_norm_row16(x, xo, residual, ro, weight, eps, out, oo, n, bf16);
#else
        float ss = 0.0f;
        if (residual) { /* h = x + residual (a bf16 add rounds), stored back as the stream */
#pragma omp simd reduction(+ : ss)
            for (int i = 0; i < n; i++) {
                const float h = rnd(ld(x, xo + i, bf16) + ld(residual, ro + i, bf16), bf16);
                st(residual, ro + i, h, bf16);
                ss += h * h;
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int i = 0; i < n; i++) {
                const float h = ld(x, xo + i, bf16);
                ss += h * h;
            }
        }
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        const void *h = residual ? (const void *)((const char *)residual + ro * (bf16 ? 2 : 4))
                                 : (const void *)((const char *)x + xo * (bf16 ? 2 : 4));
#pragma omp simd
        for (int i = 0; i < n; i++) /* transformers: weight * (h * inv).to(dtype) */
            st(out, oo + i, ld(weight, i, bf16) * rnd(ld(h, i, bf16) * inv, bf16), bf16);
#endif
    }
}

/* x [rows, n] (row stride xs) optionally plus residual [rows, n] (stride rs, updated in
 * place to x + residual), then out = weight * (h / sqrt(mean(h^2) + eps)) with h the sum. */
void fused_add_rms_norm_body(const void *x, int64_t xs, void *residual, int64_t rs,
                             const void *weight, float eps, void *out, int64_t os,
                             int64_t rows, int n, int bf16) {
    if (bf16)
        add_rms_norm_rows(x, xs, residual, rs, weight, eps, out, os, rows, n, 1);
    else
        add_rms_norm_rows(x, xs, residual, rs, weight, eps, out, os, rows, n, 0);
}

void fused_add_rms_norm(const void *x, int64_t xs, void *residual, int64_t rs,
                        const void *weight, float eps, void *out, int64_t os, int64_t rows,
                        int n, int num_threads, int bf16) {
#pragma omp parallel num_threads(num_threads) if (rows > 4)
    fused_add_rms_norm_body(x, xs, residual, rs, weight, eps, out, os, rows, n, bf16);
}

/* Work in pieces of (row, SILU_COLS columns): a decode step's one row still splits
 * across the threads (every output element is computed alone, so any split gives the
 * same values). */
#define SILU_COLS 512

static inline __attribute__((always_inline)) void
silu_mul_rows(const void *gate_up, int64_t gs, void *out, int64_t os, int64_t rows, int n,
              const int bf16) {
    const int64_t per_row = (n + SILU_COLS - 1) / SILU_COLS;
#pragma omp for schedule(static)
    for (int64_t piece = 0; piece < rows * per_row; piece++) {
        const int64_t r = piece / per_row;
        const int i0 = (int)(piece % per_row) * SILU_COLS;
        const int i1 = i0 + SILU_COLS < n ? i0 + SILU_COLS : n;
        const int64_t g0 = r * gs, u0 = g0 + n, o0 = r * os;
#ifdef HAVE_VEC512
        /* the same sigmoid, 16 lanes at a time; 1 / (1 + e) by a 14-bit reciprocal estimate
         * and two Newton steps (the division issued one lane a cycle and bounded the loop;
         * one step left last-bit errors that moved some bf16 results off torch's) */
        for (int i = i0; i < i1; i += 16) {
            const __mmask16 k = tail16(i1 - i);
            const __m512 g = ld16(gate_up, g0 + i, k, bf16);
            const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
            const __m512 e = vexp512(_mm512_or_ps(g, _mm512_set1_ps(-0.0f))); /* exp(-|g|) */
            const __m512 den = _mm512_add_ps(e, _mm512_set1_ps(1.0f));
            __m512 rcp = _mm512_rcp14_ps(den);
            const __m512 two = _mm512_set1_ps(2.0f);
            rcp = _mm512_mul_ps(rcp, _mm512_fnmadd_ps(den, rcp, two));
            rcp = _mm512_mul_ps(rcp, _mm512_fnmadd_ps(den, rcp, two));
            const __m512 num = _mm512_mask_blend_ps(neg, _mm512_set1_ps(1.0f), e);
            const __m512 sig = _mm512_mul_ps(num, rcp);
            const __m512 y = rnd16(_mm512_mul_ps(g, sig), bf16);
            st16(out, o0 + i, _mm512_mul_ps(y, ld16(gate_up, u0 + i, k, bf16)), k, bf16);
        }
#else
#pragma omp simd
        for (int i = i0; i < i1; i++) {
            /* sigmoid from e = exp(-|g|) <= 1, so exp never overflows and no lane divides
             * by a huge number (GCC evaluates both sides of a clamp; a denormal quotient
             * there cost 10x through microcode assists) */
            const float gi = ld(gate_up, g0 + i, bf16), e = vexpf(gi < 0.0f ? gi : -gi);
            const float sig = (gi < 0.0f ? e : 1.0f) / (1.0f + e);
            /* transformers: silu(gate) is one bf16 op, then a bf16 multiply */
            st(out, o0 + i, rnd(gi * sig, bf16) * ld(gate_up, u0 + i, bf16), bf16);
        }
#endif
    }
}

/* gate_up [rows, 2 * n] (gate columns then up columns) -> out [rows, n] = silu(gate) * up. */
void silu_and_mul_body(const void *gate_up, int64_t gs, void *out, int64_t os, int64_t rows,
                       int n, int bf16) {
    if (bf16)
        silu_mul_rows(gate_up, gs, out, os, rows, n, 1);
    else
        silu_mul_rows(gate_up, gs, out, os, rows, n, 0);
}

void silu_and_mul(const void *gate_up, int64_t gs, void *out, int64_t os, int64_t rows, int n,
                  int num_threads, int bf16) {
#pragma omp parallel num_threads(num_threads) if (rows * n > 4 * SILU_COLS)
    silu_and_mul_body(gate_up, gs, out, os, rows, n, bf16);
}

static inline __attribute__((always_inline)) void
rope_rows(void *x, int64_t xs, int heads, int D, const int64_t *positions,
          const void *cos_table, const void *sin_table, int64_t rows, const int bf16) {
    const int half = D / 2;
#pragma omp for schedule(static)
    for (int64_t rh = 0; rh < rows * heads; rh++) { /* (row, head) pieces: see SILU_COLS */
        const int64_t r = rh / heads;
        const int h = (int)(rh % heads);
        const int64_t t = positions[r] * D;
        {
            const int64_t v = r * xs + (int64_t)h * D;
#pragma omp simd
            for (int d = 0; d < half; d++) {
                const float a = ld(x, v + d, bf16), b = ld(x, v + d + half, bf16);
                const float c0 = ld(cos_table, t + d, bf16), s0 = ld(sin_table, t + d, bf16);
                const float c1 = ld(cos_table, t + d + half, bf16);
                const float s1 = ld(sin_table, t + d + half, bf16);
                /* transformers: x * cos + rotate_half(x) * sin, three bf16 ops */
                st(x, v + d, rnd(a * c0, bf16) - rnd(b * s0, bf16), bf16);
                st(x, v + d + half, rnd(b * c1, bf16) + rnd(a * s1, bf16), bf16);
            }
        }
    }
}

/* Rotary embedding in place on `heads` heads of D values starting at x (row stride xs):
 * with half = D / 2, c = cos[pos], s = sin[pos] (tables [P, D], the two halves equal),
 *   x[d]        <- x[d] * c[d] - x[d + half] * s[d]
 *   x[d + half] <- x[d + half] * c[d + half] + x[d] * s[d + half]        (d < half)
 * With bf16 set, x and both tables are bf16 (the tables rounded once, as transformers
 * casts cos/sin to the activations' dtype). */
void rope_inplace_body(void *x, int64_t xs, int heads, int D, const int64_t *positions,
                       const void *cos_table, const void *sin_table, int64_t rows, int bf16) {
    if (bf16)
        rope_rows(x, xs, heads, D, positions, cos_table, sin_table, rows, 1);
    else
        rope_rows(x, xs, heads, D, positions, cos_table, sin_table, rows, 0);
}

void rope_inplace(void *x, int64_t xs, int heads, int D, const int64_t *positions,
                  const void *cos_table, const void *sin_table, int64_t rows, int num_threads,
                  int bf16) {
#pragma omp parallel num_threads(num_threads) if (rows > 4)
    rope_inplace_body(x, xs, heads, D, positions, cos_table, sin_table, rows, bf16);
}

/* The first index of row p (n bf16 values) that is NaN (`want_nan`), else that equals m: a
 * vectorized test per chunk of 64, then the scalar search inside the chunk that hit. */
static inline __attribute__((always_inline)) int64_t
first_match(const uint16_t *p, int64_t n, float m, const int want_nan) {
    for (int64_t c0 = 0; c0 < n; c0 += 64) {
        const int64_t c1 = c0 + 64 < n ? c0 + 64 : n;
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t c = c0; c < c1; c++) {
            const float v = bf16_to_f32(p[c]);
            hit |= want_nan ? v != v : v == m;
        }
        if (!hit) continue;
        for (int64_t c = c0; c < c1; c++) {
            const float v = bf16_to_f32(p[c]);
            if (want_nan ? v != v : v == m) return c;
        }
    }
    return 0;
}

/* Greedy decoding of a bf16 model: out[r] = argmax of row r of x [rows, n] (row stride xs),
 * the first index on ties and the first NaN if there is one (NumPy's rules, which the fp32
 * path uses). Reading the bf16 logits in place saves widening them to an fp32 copy first
 * (64 x 49,152 logits: that copy and NumPy's argmax took ~2.8 ms of a ~28 ms step; this
 * ~0.25 ms on 2 threads). Two passes per row: the maximum, then its first index (the row is
 * in cache), both vectorized. */
void argmax_rows_bf16(const uint16_t *x, int64_t xs, int64_t rows, int64_t n, int64_t *out,
                      int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *p = x + r * xs;
        float m = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t c = 0; c < n; c++) {
            const float v = bf16_to_f32(p[c]);
            m = v > m ? v : m;
            nan |= v != v;
        }
        out[r] = nan ? first_match(p, n, 0.0f, 1) : first_match(p, n, m, 0);
    }
}

/* The greedy screen of an fp32 model's LM head (engine/worker/models/greedy_screen.py): x
 * [rows, n] are bf16 approximations of the logits; the exact logit of index c in row r lies
 * within e = alpha[r] * wn[c] + beta[r] * wr[c] + rel * |x[c]| of x[c]. Row r's candidates
 * are the indices whose upper bound x[c] + e reaches the largest lower bound x[c'] - e' of
 * the row: every index that may hold the exact maximum. They go, increasing, to
 * idx[r * cap ...]; count[r] is how many, or -1 when there are more than cap or the row holds
 * a NaN or an infinity (the caller then computes that step's logits in full). Two passes per
 * row: the largest lower bound, then a vectorized test per chunk of 64 and the scalar
 * collection inside the chunks that hit (a handful in a row of 49,152). */
static inline __attribute__((always_inline)) float
screen_err(float a, float alpha, float beta, float wn, float wr, float rel) {
    return alpha * wn + beta * wr + rel * fabsf(a);
}

void screen_rows_bf16(const uint16_t *x, int64_t xs, int64_t rows, int64_t n,
                      const float *alpha, const float *beta, const float *wn, const float *wr,
                      float rel, int64_t cap, int64_t *idx, int64_t *count, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *p = x + r * xs;
        const float al = alpha[r], be = beta[r];
        float lo = -INFINITY, hi = -INFINITY;
        int bad = 0;
#pragma omp simd reduction(max : lo, hi) reduction(| : bad)
        for (int64_t c = 0; c < n; c++) {
            const float a = bf16_to_f32(p[c]);
            const float e = screen_err(a, al, be, wn[c], wr[c], rel);
            lo = a - e > lo ? a - e : lo;
            hi = a > hi ? a : hi;
            bad |= !(fabsf(a) <= FLT_MAX); /* NaN or an infinity */
        }
        if (bad || !isfinite(lo)) {
            count[r] = -1;
            continue;
        }
        const float t = lo - fabsf(lo) * 1e-5f - 1e-30f; /* slack for this pass's roundings */
        int64_t k = 0, *out = idx + r * cap;
        for (int64_t c0 = 0; c0 < n && k >= 0; c0 += 64) {
            const int64_t c1 = c0 + 64 < n ? c0 + 64 : n;
            int hit = 0;
#pragma omp simd reduction(| : hit)
            for (int64_t c = c0; c < c1; c++) {
                const float a = bf16_to_f32(p[c]);
                hit |= a + screen_err(a, al, be, wn[c], wr[c], rel) >= t;
            }
            if (!hit) continue;
            for (int64_t c = c0; c < c1; c++) {
                const float a = bf16_to_f32(p[c]);
                if (a + screen_err(a, al, be, wn[c], wr[c], rel) < t) continue;
                if (k == cap) {
                    k = -1;
                    break;
                }
                out[k++] = c;
            }
        }
        count[r] = k;
    }
}
