/* The q4 column-group layout (quant_linear_q4g.c has the why and the byte layout): its
 * sizes, its kind number beside q4 (4) and q8 (8), and the entry points other kernels call
 * (quant_linear.c dispatches the kind; decoder_stack.c runs the bodies inside its own
 * parallel region). */
#ifndef APPLIANCE_QUANT_Q4G_H
#define APPLIANCE_QUANT_Q4G_H
#include <stdint.h>

#define Q4G_KIND 16  /* engine/worker/quant/blocks.py: Q4G */
#define Q4G_COLS 16  /* output columns per group */
#define Q4G_HEAD 64  /* 16 fp16 d, then 16 fp16 m */
#define Q4G_BYTES 320 /* one block (32 input features) of one group */

void q4g_block_sums(const void *x, int64_t xs, int64_t M, int64_t nb, int bf16, float *sums);
int q4g_linear_f32(const float *x, int64_t xs, const uint8_t *w, int64_t N, int64_t K,
                   const float *bias, float *y, int64_t ys, int64_t M, int num_threads);
void q4g_linear_f32_body(const float *x, int64_t xs, const uint8_t *w, int64_t N, int64_t K,
                         const float *bias, float *y, int64_t ys, int64_t M,
                         const float *sums);
/* How bf16 rows are multiplied (q4g_bf16_native(), set by q4g_use_bf16_dot at load) */
#define Q4G_BF16_WIDEN 0 /* widened to fp32, the fp32 kernel, rounded */
#define Q4G_BF16_DOT 1   /* VDPBF16PS (AMD) */
#define Q4G_BF16_I16 2   /* exact int16 planes and VPDPWSSD (Intel) */
int q4g_bf16_native(void);
int q4g_i16_prep(const uint16_t *x, int64_t xs, int64_t M, int64_t nb, int16_t *x1,
                 int16_t *x2, float *sc, uint8_t *two);
void q4g_linear_i16_body(const int16_t *x1, const int16_t *x2, const float *sc,
                         const uint8_t *two, const uint8_t *w, int64_t N, int64_t K,
                         const float *bias, uint16_t *y, int64_t ys, int64_t M,
                         const float *sums);
void q4g_linear_bf16_body(const uint16_t *x, int64_t xs, const uint8_t *w, int64_t N,
                          int64_t K, const float *bias, uint16_t *y, int64_t ys, int64_t M,
                          const float *sums);
void q4g_dequantize(const uint8_t *w, int64_t N, int64_t K, void *out, int bf16,
                    int num_threads);
void q4g_dequantize_t(const uint8_t *w, int64_t N, int64_t K, void *out, int bf16,
                      int num_threads);
#endif
