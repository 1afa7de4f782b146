/* bfloat16 <-> float32 for the CPU kernels, written so GCC vectorizes them in `omp simd`.
 *
 * A bf16 value is the top 16 bits of an fp32, so widening is a shift. Narrowing rounds to
 * nearest-even the way torch does (`c10::BFloat16`'s round_to_nearest_even): add 0x7FFF plus
 * the lowest kept bit, then keep the top half; a NaN becomes the quiet NaN 0x7FC0.
 *
 * The kernels hold activations in bf16 between ops but compute in fp32; `round_bf16` marks
 * the points where transformers' bf16 forward rounds an intermediate (a bf16 tensor op), so
 * our bf16 path rounds at the same places and stays close to it token for token. */
#ifndef APPLIANCE_BF16_H
#define APPLIANCE_BF16_H
#include <stdint.h>

static inline __attribute__((always_inline)) float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } x = {.u = (uint32_t)h << 16};
    return x.f;
}

static inline __attribute__((always_inline)) uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } x = {.f = f};
    const uint32_t rounded = (x.u + 0x7FFFu + ((x.u >> 16) & 1u)) >> 16;
    return f != f ? (uint16_t)0x7FC0 : (uint16_t)rounded;
}

static inline __attribute__((always_inline)) float round_bf16(float f) {
    return bf16_to_f32(f32_to_bf16(f));
}

/* Element i of a row that is fp32 (bf16 == 0) or bf16; `bf16` is a literal at every call
 * site, so each kernel compiles into two specialised loops. */
static inline __attribute__((always_inline)) float ld(const void *p, int64_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline __attribute__((always_inline)) void st(void *p, int64_t i, float v, const int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* `f` rounded as a bf16 tensor op would round it (identity in fp32). */
static inline __attribute__((always_inline)) float rnd(float f, const int bf16) {
    return bf16 ? round_bf16(f) : f;
}
#endif
