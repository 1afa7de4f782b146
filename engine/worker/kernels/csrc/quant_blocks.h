/* What both block-linear kernels (quant_linear.c, quant_linear_i8.c) share: the blocks'
 * byte sizes, an fp16 scale read from a block, and the horizontal sum of 8 lanes. */
#ifndef APPLIANCE_QUANT_BLOCKS_H
#define APPLIANCE_QUANT_BLOCKS_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define QBLOCK 32

/* How far ahead of the weight bytes being read the block kernels prefetch (a thread reads
 * its share of a layer's weights as one increasing run). On a 2-core Xeon VM (6/207/2)
 * with the weights coming from memory (a step reads 96 MiB; the VM streams 18-20 GB/s
 * from memory, 42 GB/s below ~32 MB), the hardware prefetchers left the kernels stalled
 * on their loads: one row of SmolLM2's q8 LM head went from 2.7-3.3 to 1.8 ms and the q4
 * column-group kernel from 8-9 to 12.5 GB/s with 2 KB (1 KB: the same, 4 KB: less);
 * docs/quantization.md. Prefetches never fault, so running past a buffer's end is safe. */
#define WEIGHT_PREFETCH_BYTES 2048

/* The cache lines of [p + WEIGHT_PREFETCH_BYTES, + n bytes): asked for now, used later. */
static inline __attribute__((always_inline)) void prefetch_weights(const uint8_t *p, int n) {
    for (int off = 0; off < n; off += 64)
        __builtin_prefetch(p + WEIGHT_PREFETCH_BYTES + off, 0, 3);
}
#define Q4_BYTES 20
#define Q8_BYTES 34

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f,
                   man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalize */
        int e = -1;
        uint32_t m = man;
        do {
            e++;
            m <<= 1;
        } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif
#endif
