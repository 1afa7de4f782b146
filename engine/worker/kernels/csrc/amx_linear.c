/* bf16 linear layers on AMX tiles: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), bf16 in and
 * out, fp32 sums; for the row counts a decode step has (1 to a few hundred rows).
 *
 * Why our own: at 64 rows and a small model's shapes oneDNN's packed bf16 GEMM ran
 * 0.5-0.7 TFLOP/s on 2 cores of an AMX Xeon: the per-call set-up and its blocking are built
 * for larger problems. Here each thread takes a run of 32 output columns at a time and, for
 * every 32 rows, keeps a 2 x 2 block of 16 x 16 fp32 tiles while it walks K 32 values at a
 * time: two x tiles (16 rows x 32 values, loaded from x as it lies) and two weight tiles
 * (16 value pairs x 16 columns, from the weight packed once at load), four TDPBF16PS.
 * The next column run's weights are prefetched into L2 during the walk (at decode sizes the
 * weights come from memory: the kernel is a stream over them). Large row counts go back to
 * the caller's dense path (models/cpu_linear.py picks by rows).
 *
 * Numerics: each tile product sums pairs of bf16 products in fp32 (TDPBF16PS), K in order of
 * 32-value steps; the sum (plus the bias, widened) is rounded to bf16 once, to nearest even,
 * as oneDNN's bf16 GEMM does. Only the order of the fp32 additions differs from oneDNN's, so
 * the two agree but for the last bit of a few outputs in 10^4.
 *
 * Linux hands AMX state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM);
 * `amx_bf16_ready()` asks once and says whether tiles may be used. Without AMX in the
 * build (-march without amx-tile/amx-bf16) every entry point is a stub that reports 0. */
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "vec512.h"

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define MCHUNK 256 /* rows per pass: the pass's x (<= 256 x K bf16) stays in L2 */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

int amx_bf16_ready(void) {
    unsigned long mask = 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &mask) != 0) return 0;
    return (mask >> XFEATURE_XTILEDATA) & 1;
}

/* W [N, K] bf16 -> blocks [N / 16][K / 32] of 1 KiB: row r holds, for the 16 columns c,
 * the pair W[c][2r], W[c][2r + 1] (TDPBF16PS's operand layout). N % 16 == 0, K % 32 == 0. */
void amx_bf16_pack(const uint16_t *w, int64_t N, int64_t K, uint16_t *out) {
    const int64_t KB = K / 32;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < N / 16; nb++)
        for (int64_t kb = 0; kb < KB; kb++) {
            uint16_t *blk = out + (nb * KB + kb) * 512;
            for (int r = 0; r < 16; r++)
                for (int c = 0; c < 16; c++) {
                    const uint16_t *src = w + (nb * 16 + c) * K + kb * 32 + 2 * r;
                    blk[(r * 16 + c) * 2] = src[0];
                    blk[(r * 16 + c) * 2 + 1] = src[1];
                }
        }
}

/* Tiles: 0-3 sums (rows 0-15 / 16-31 x columns 0-15 / 16-31), 4-5 x, 6-7 weights. */
static void configure(int rows0, int rows1) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.colsb[i] = 64;
    c.rows[0] = c.rows[1] = c.rows[4] = (uint8_t)rows0;
    c.rows[2] = c.rows[3] = c.rows[5] = (uint8_t)(rows1 ? rows1 : 1);
    c.rows[6] = c.rows[7] = 16;
    _tile_loadconfig(&c);
}

/* `rows` rows of 16 fp32 sums (+ bias) to bf16 at out (row stride ldo). */
static inline void store_rows(const float *sums, int rows, const uint16_t *bias, uint16_t *out,
                              int64_t ldo) {
    const __m512 b = bias ? ld_bf16x16(bias, 0xFFFF) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++)
        _mm256_storeu_si256((__m256i *)(out + r * ldo),
                            to_bf16x16(_mm512_add_ps(_mm512_loadu_ps(sums + r * 16), b)));
}

/* The body: every thread of the caller's parallel region takes its runs of 32 columns
 * (orphaned `omp for`, so decoder_stack.c calls it inside its own region), then all meet
 * at a barrier, as the other bodies' `omp for` do. */
void amx_bf16_linear_body(const uint16_t *x, int64_t ldx, const uint16_t *wp,
                          const uint16_t *bias, uint16_t *out, int64_t ldo, int64_t M, int64_t N,
                          int64_t K) {
    const int64_t KB = K / 32, NB = N / 16, runs = (NB + 1) / 2;
    float sums[4][256] __attribute__((aligned(64)));
    int config = -1; /* rows0 * 32 + rows1 of the loaded configuration */
    for (int64_t mc = 0; mc < M; mc += MCHUNK) {
        const int64_t mend = mc + MCHUNK < M ? mc + MCHUNK : M;
        /* static and nowait: a thread keeps the same columns in every pass */
#pragma omp for schedule(static) nowait
        for (int64_t run = 0; run < runs; run++) {
            const int64_t nb = 2 * run;
            const int two = nb + 1 < NB;
            const uint16_t *w0 = wp + nb * KB * 512, *w1 = w0 + KB * 512;
            const char *next = (const char *)(w0 + 2 * KB * 512);
            for (int64_t m0 = mc; m0 < mend; m0 += 32) {
                const int left = (int)(mend - m0);
                const int rows0 = left >= 16 ? 16 : left;
                const int rows1 = left >= 32 ? 16 : (left > 16 ? left - 16 : 0);
                if (rows0 * 32 + rows1 != config) {
                    configure(rows0, rows1);
                    config = rows0 * 32 + rows1;
                }
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                const uint16_t *a = x + m0 * ldx;
                const int prefetch = m0 == mc && run + 1 < runs;
                for (int64_t kb = 0; kb < KB; kb++) {
                    if (prefetch) /* the next run's two 1 KiB blocks at this kb */
                        for (int i = 0; i < 32; i++)
                            _mm_prefetch(next + kb * 2048 + i * 64, _MM_HINT_T1);
                    _tile_loadd(4, a + kb * 32, ldx * 2);
                    _tile_loadd(6, w0 + kb * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (two) {
                        _tile_loadd(7, w1 + kb * 512, 64);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                    if (rows1) {
                        _tile_loadd(5, a + 16 * ldx + kb * 32, ldx * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        if (two) _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, sums[0], 64);
                if (two) _tile_stored(1, sums[1], 64);
                if (rows1) {
                    _tile_stored(2, sums[2], 64);
                    if (two) _tile_stored(3, sums[3], 64);
                }
                uint16_t *o = out + m0 * ldo + nb * 16;
                const uint16_t *b0 = bias ? bias + nb * 16 : 0, *b1 = bias ? b0 + 16 : 0;
                store_rows(sums[0], rows0, b0, o, ldo);
                if (two) store_rows(sums[1], rows0, b1, o + 16, ldo);
                if (rows1) {
                    store_rows(sums[2], rows1, b0, o + 16 * ldo, ldo);
                    if (two) store_rows(sums[3], rows1, b1, o + 16 * ldo + 16, ldo);
                }
            }
        }
    }
    if (config != -1) _tile_release();
#pragma omp barrier
}

void amx_bf16_linear(const uint16_t *x, int64_t ldx, const uint16_t *wp, const uint16_t *bias,
                     uint16_t *out, int64_t ldo, int64_t M, int64_t N, int64_t K,
                     int num_threads) {
#pragma omp parallel num_threads(num_threads)
    amx_bf16_linear_body(x, ldx, wp, bias, out, ldo, M, N, K);
}

#else /* no AMX in this build: callers keep their other path */
int amx_bf16_ready(void) { return 0; }

void amx_bf16_linear_body(const uint16_t *x, int64_t ldx, const uint16_t *wp,
                          const uint16_t *bias, uint16_t *out, int64_t ldo, int64_t M, int64_t N,
                          int64_t K) {
    (void)x, (void)ldx, (void)wp, (void)bias, (void)out, (void)ldo, (void)M, (void)N, (void)K;
}

void amx_bf16_pack(const uint16_t *w, int64_t N, int64_t K, uint16_t *out) {
    (void)w, (void)N, (void)K, (void)out;
}

void amx_bf16_linear(const uint16_t *x, int64_t ldx, const uint16_t *wp, const uint16_t *bias,
                     uint16_t *out, int64_t ldo, int64_t M, int64_t N, int64_t K,
                     int num_threads) {
    (void)x, (void)ldx, (void)wp, (void)bias, (void)out, (void)ldo, (void)M, (void)N, (void)K,
        (void)num_threads;
}
#endif
