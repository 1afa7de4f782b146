/* Fused elementwise ops of a decoder layer, for the CPU path.
 *
 * In eager torch each of these is 4-8 separate ops (RMSNorm: add, pow, mean, add, rsqrt,
 * mul, mul; rotary: mul, slice, neg, cat, mul, add; SiLU-and-mul: chunk, silu, mul), every
 * one a full pass over memory plus a Python dispatch. A decode step of a small model runs
 * hundreds of them, so fusing them is worth as much as a faster GEMM. Each function here is
 * one pass, parallel over rows with OpenMP (torch's runtime, thread count from the caller).
 * Arithmetic follows transformers' order: statistics and products in fp32.
 */
#include <math.h>
#include <stdint.h>

#include "vec_math.h"

/* x [rows, n] (row stride xs) optionally plus residual [rows, n] (stride rs, updated in
 * place to x + residual), then out = weight * (h / sqrt(mean(h^2) + eps)) with h the sum. */
void fused_add_rms_norm(const float *x, int64_t xs, float *residual, int64_t rs,
                        const float *weight, float eps, float *out, int64_t os, int64_t rows,
                        int n, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 4)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * xs;
        float *o = out + r * os;
        const float *h = xr;
        if (residual) {
            float *res = residual + r * rs;
#pragma omp simd
            for (int i = 0; i < n; i++) res[i] = xr[i] + res[i];
            h = res;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < n; i++) ss += h[i] * h[i];
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
        for (int i = 0; i < n; i++) o[i] = weight[i] * (h[i] * inv);
    }
}

/* gate_up [rows, 2 * n] (gate columns then up columns) -> out [rows, n] = silu(gate) * up. */
void silu_and_mul(const float *gate_up, int64_t gs, float *out, int64_t os, int64_t rows,
                  int n, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 4)
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict g = gate_up + r * gs;
        const float *restrict u = g + n;
        float *restrict o = out + r * os;
#pragma omp simd
        for (int i = 0; i < n; i++) {
            /* sigmoid from e = exp(-|g|) <= 1, so exp never overflows and no lane divides
             * by a huge number (GCC evaluates both sides of a clamp; a denormal quotient
             * there cost 10x through microcode assists) */
            const float gi = g[i], e = vexpf(gi < 0.0f ? gi : -gi);
            const float sig = (gi < 0.0f ? e : 1.0f) / (1.0f + e);
            o[i] = gi * sig * u[i];
        }
    }
}

/* Rotary embedding in place on `heads` heads of D values starting at x (row stride xs):
 * with half = D / 2, c = cos[pos], s = sin[pos] (tables [P, D], the two halves equal),
 *   x[d]        <- x[d] * c[d] - x[d + half] * s[d]
 *   x[d + half] <- x[d + half] * c[d + half] + x[d] * s[d + half]        (d < half) */
void rope_inplace(float *x, int64_t xs, int heads, int D, const int64_t *positions,
                  const float *cos_table, const float *sin_table, int64_t rows,
                  int num_threads) {
    const int half = D / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 4)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_table + positions[r] * D, *s = sin_table + positions[r] * D;
        for (int h = 0; h < heads; h++) {
            float *v = x + r * xs + (int64_t)h * D;
#pragma omp simd
            for (int d = 0; d < half; d++) {
                const float a = v[d], b = v[d + half];
                v[d] = a * c[d] - b * s[d];
                v[d + half] = b * c[d + half] + a * s[d + half];
            }
        }
    }
}
