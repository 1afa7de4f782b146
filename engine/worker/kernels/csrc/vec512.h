/* AVX-512 forms of the scalar helpers in vec_math.h and bf16.h, 16 lanes at a time, for the
 * kernels whose hot loops GCC does not vectorize well on its own (a loop of at most 16
 * iterations with a variable bound, bf16 rows read through 16-bit loads, a division).
 * Every function computes what its scalar twin computes, lane by lane. */
#ifndef APPLIANCE_VEC512_H
#define APPLIANCE_VEC512_H
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#include <stdint.h>

#define HAVE_VEC512 1

/* vexpf (vec_math.h) on 16 lanes: the same range reduction and polynomial. */
static inline __attribute__((always_inline)) __m512 vexp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* 16 bf16 values (lanes under mask k; the others read as 0) widened to fp32. */
static inline __attribute__((always_inline)) __m512 ld_bf16x16(const uint16_t *p, __mmask16 k) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

/* fp32 to bf16 as f32_to_bf16 (bf16.h) rounds: nearest-even, NaN -> 0x7FC0. */
static inline __attribute__((always_inline)) __m256i to_bf16x16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q),
                              _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

/* round_bf16 (bf16.h) on 16 lanes: the value a bf16 tensor op would hold, as fp32. */
static inline __attribute__((always_inline)) __m512 round_bf16x16(__m512 f) {
    /* to_bf16x16's rounding kept in 32-bit lanes (the low half cleared), which spares the
     * narrowing and the widening back (port-5 shuffles) */
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb),
                                 _mm512_set1_epi32((int)0xFFFF0000u));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q),
                              _mm512_set1_epi32(0x7FC00000));
    return _mm512_castsi512_ps(r);
}

/* rnd (bf16.h): round_bf16x16 when `bf16`, else f (a literal at every call site). */
static inline __attribute__((always_inline)) __m512 rnd16(__m512 f, const int bf16) {
    return bf16 ? round_bf16x16(f) : f;
}

/* 16 lanes of a row that is fp32 or bf16 (ld in bf16.h), masked. */
static inline __attribute__((always_inline)) __m512 ld16(const void *p, int64_t i, __mmask16 k,
                                                         const int bf16) {
    return bf16 ? ld_bf16x16((const uint16_t *)p + i, k)
                : _mm512_maskz_loadu_ps(k, (const float *)p + i);
}

static inline __attribute__((always_inline)) void st16(void *p, int64_t i, __m512 v, __mmask16 k,
                                                       const int bf16) {
    if (bf16)
        _mm256_mask_storeu_epi16((uint16_t *)p + i, k, to_bf16x16(v));
    else
        _mm512_mask_storeu_ps((float *)p + i, k, v);
}

static inline __attribute__((always_inline)) __mmask16 tail16(int left) {
    return (__mmask16)(left >= 16 ? 0xFFFFu : (1u << left) - 1u);
}
#endif
#endif
