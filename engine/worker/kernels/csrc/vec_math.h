/* expf that GCC can vectorize: glibc's expf is a scalar call inside `omp simd` loops (its
 * vector variants need -ffast-math), which made SiLU 5x slower than torch's.
 *
 * exp(x) = 2^n * e^r with n = round(x / ln 2) and r = x - n ln 2 (ln 2 split in two parts
 * for accuracy), e^r from a degree-6 minimax polynomial on |r| <= ln(2)/2 (the Cephes expf
 * coefficients); relative error about 2e-7 over the clamped range [-87.3, 88]. */
#ifndef APPLIANCE_VEC_MATH_H
#define APPLIANCE_VEC_MATH_H
#include <stdint.h>

static inline __attribute__((always_inline)) float vexpf(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.0f ? 88.0f : x);
    const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    __builtin_memcpy(&scale, &bits, sizeof scale); /* a bit cast the vectorizer can follow */
    return p * scale;
}
#endif
