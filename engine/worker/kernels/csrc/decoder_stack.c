/* Every decoder layer of a Llama-family model for one small step, in one C call.
 *
 * Why: on SmolLM2-135M (30 layers) a decode step of one row made ~10 calls into C per layer,
 * each with its Python, its tensor allocations and an OpenMP fork and join: ~4 ms of an
 * ~9 ms step on 2 cores of an AMD EPYC, once the quantized linears read their weights at
 * ~20 GB/s. Here the layers run inside one OpenMP parallel region; the steps of a layer
 * are the same kernel bodies the per-op path calls (csrc/fused_ops.c, quant_linear*.c,
 * paged_attention.c, cache_write.c), shared out with orphaned `omp for` and separated by
 * their implicit barriers, so every value is bitwise what the per-op path computes
 * (engine/worker/models/cpu_fused.py: the same functions, the same order of additions).
 *
 * Per layer (transformers' order, the residual stream carried apart as cpu_fused.py does):
 *
 *   x = rms_norm(res [+= out])  qkv = x W_qkv  rope(q, k)  cache <- k, v  a = attention
 *   out = a W_o  x = rms_norm(res += out)  gu = x W_gate_up  act = silu(g) * u
 *   out = act W_down
 *
 * `res` starts as the embeddings (the caller's tensor, updated in place) and `out` ends as
 * the last MLP output; the caller applies the final norm to both, as the per-op path does.
 * Linears are q4 column groups, q4 or q8 blocks, or bf16 weights on AMX tiles
 * (csrc/amx_linear.c; no LoRA, one tensor-parallel rank);
 * attention is the native paged kernel over every row of the step (decode rows and short
 * verify chunks); activations and the KV cache are fp32, or bf16 throughout.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "quant_q4g.h"

/* The bodies this file strings together (defined beside their public wrappers). */
void fused_add_rms_norm_body(const void *x, int64_t xs, void *residual, int64_t rs,
                             const void *weight, float eps, void *out, int64_t os,
                             int64_t rows, int n, int bf16);
void silu_and_mul_body(const void *gate_up, int64_t gs, void *out, int64_t os, int64_t rows,
                       int n, int bf16);
void rope_inplace_body(void *x, int64_t xs, int heads, int D, const int64_t *positions,
                       const void *cos_table, const void *sin_table, int64_t rows, int bf16);
void write_kv_body(const void *k, int64_t ks, const void *v, int64_t vs, void *cache,
                   const int64_t *slots, int64_t tokens, int64_t row, int block_size, int elem);
int paged_attention_body(const void *q, int64_t q_row_stride, int q_bf16, const void *cache,
                         int is_bf16, const int32_t *block_tables, int64_t bt_stride,
                         const int64_t *q_rows, const int64_t *reqs, const int64_t *pos,
                         int64_t num_items, int H, int Hkv, int D, int block_size, int window,
                         float scale, void *out, int64_t out_row_stride, int num_threads);
void quant_linear_body(const float *x, int64_t xs, const uint8_t *w, int kind, int64_t N,
                       int64_t K, const float *bias, float *y, int64_t ys, int64_t M,
                       const float *sums);
void quant_block_sums(const float *x, int64_t xs, int64_t M, int64_t nb, float *sums);
void amx_bf16_linear_body(const uint16_t *x, int64_t ldx, const uint16_t *wp,
                          const uint16_t *bias, uint16_t *out, int64_t ldo, int64_t M, int64_t N,
                          int64_t K);

/* A bf16 weight in csrc/amx_linear.c's tile layout (its bias, if any, bf16 too). */
#define AMX_BF16_KIND 32

enum { QKV, O, GATE_UP, DOWN };

typedef struct { /* engine/worker/models/cpu_stack.py: StackLayer */
    const void *ln1, *ln2; /* RMSNorm weights, in the activations' dtype */
    float eps1, eps2;
    const uint8_t *w[4]; /* qkv, o, gate_up, down: blocks of kind[i] */
    int kind[4];         /* 4 (q4), 8 (q8), Q4G_KIND, AMX_BF16_KIND */
    const void *bias[4]; /* fp32; bf16 for AMX_BF16_KIND */
    void *kv_cache; /* [blocks, 2, block_size, Hkv, D], the activations' dtype */
    int window;     /* <= 0: none */
} stack_layer_t;

typedef struct { /* cpu_stack.py: StackModel */
    int64_t n_layers, hidden, heads, kv_heads, head_dim, inter, block_size;
    int bf16;
    float scale;
    const void *cos, *sin; /* rope tables [P, D], the activations' dtype */
    const stack_layer_t *layers;
} stack_model_t;

typedef struct { /* cpu_stack.py: StackStep */
    int64_t T;
    void *res, *out; /* [T, hidden] each, see the top */
    const int64_t *positions, *slots;
    const int32_t *block_tables;
    int64_t bt_stride;
    const int64_t *q_rows, *reqs, *pos;
    int64_t n_items;
    void *work; /* decoder_stack_workspace() bytes, 64-byte aligned */
} stack_step_t;

typedef struct {
    void *x, *qkv, *attn, *gu, *act; /* activations' dtype */
    float *xf, *yf, *sums;           /* fp32: widened rows, fp32 outputs, block sums */
    int16_t *planes;                 /* bf16 rows as int16 planes (Q4G_BF16_I16): 2 x [T, K] */
    float *scales;                   /* ... their scales, 2 per row and block */
    uint8_t *two;                    /* ... whether a row's block uses the second plane */
    int *planes_ok;                  /* ... set by the thread that made them, read by all */
} buffers_t;

static int64_t widest_in(const stack_model_t *m) {
    int64_t k = m->hidden > m->heads * m->head_dim ? m->hidden : m->heads * m->head_dim;
    return k > m->inter ? k : m->inter;
}

static int64_t widest_out(const stack_model_t *m) {
    const int64_t qkv = (m->heads + 2 * m->kv_heads) * m->head_dim;
    const int64_t n = qkv > m->hidden ? qkv : m->hidden;
    return n > 2 * m->inter ? n : 2 * m->inter;
}

static int64_t align64(int64_t n) { return (n + 63) / 64 * 64; }

/* Lays the buffers out in `work` (or only counts, with work NULL); returns the bytes. */
static int64_t layout(const stack_model_t *m, int64_t T, char *work, buffers_t *b) {
    const int64_t e = m->bf16 ? 2 : 4, K = widest_in(m), N = widest_out(m);
    const int64_t qkv = (m->heads + 2 * m->kv_heads) * m->head_dim;
    const int64_t sizes[12] = {T * m->hidden * e, T * qkv * e, T * m->heads * m->head_dim * e,
                               T * 2 * m->inter * e, T * m->inter * e, T * K * 4, T * N * 4,
                               T * (K / 32 + 1) * 4, 2 * T * K * 2, T * (K / 32 + 1) * 8,
                               T * (K / 32 + 1), 4};
    void **slots[12] = {&b->x, &b->qkv, &b->attn, &b->gu, &b->act,
                        (void **)&b->xf, (void **)&b->yf, (void **)&b->sums,
                        (void **)&b->planes, (void **)&b->scales, (void **)&b->two,
                        (void **)&b->planes_ok};
    int64_t off = 0;
    for (int i = 0; i < 12; i++) {
        if (work) *slots[i] = work + off;
        off += align64(sizes[i]);
    }
    return off;
}

int64_t decoder_stack_workspace(const stack_model_t *m, int64_t T) {
    buffers_t b;
    return layout(m, T, NULL, &b);
}

/* y [T, N] = x [T, K] W^T + bias, x and y in the activations' dtype (rows contiguous). */
static void linear(const stack_model_t *m, const stack_layer_t *L, int which, const void *x,
                   int64_t K, int64_t N, void *y, int64_t T, const buffers_t *b) {
    const int kind = L->kind[which];
    const uint8_t *w = L->w[which];
    if (kind == AMX_BF16_KIND) { /* bf16 rows (the model is bf16 throughout) */
        amx_bf16_linear_body((const uint16_t *)x, K, (const uint16_t *)w,
                             (const uint16_t *)L->bias[which], (uint16_t *)y, N, T, N, K);
        return;
    }
    const float *bias = (const float *)L->bias[which];
    const int64_t nb = K / 32;
    if (m->bf16 && kind == Q4G_KIND && q4g_bf16_native() == Q4G_BF16_I16) {
        /* as quant_linear_bf16: the rows as int16 planes once, then every thread's groups */
#pragma omp single
        {
            q4g_block_sums(x, K, T, nb, 1, b->sums);
            *b->planes_ok = q4g_i16_prep((const uint16_t *)x, K, T, nb, b->planes,
                                         b->planes + T * K, b->scales, b->two);
        }
        if (*b->planes_ok) {
            q4g_linear_i16_body(b->planes, b->planes + T * K, b->scales, b->two, w, N, K, bias,
                                (uint16_t *)y, N, T, b->sums);
            return;
        }
        /* an infinity or a NaN in the rows: widened below, as quant_linear_bf16 does */
    } else if (m->bf16 && kind == Q4G_KIND && q4g_bf16_native()) {
#pragma omp single
        q4g_block_sums(x, K, T, nb, 1, b->sums);
        q4g_linear_bf16_body((const uint16_t *)x, K, w, N, K, bias, (uint16_t *)y, N, T,
                             b->sums);
        return;
    }
    const float *xf = (const float *)x;
    float *yf = (float *)y;
    if (m->bf16) { /* as quant_linear_bf16 without the native kernel: widen, fp32, round */
        xf = b->xf, yf = b->yf;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < T * K; i++) b->xf[i] = bf16_to_f32(((const uint16_t *)x)[i]);
    }
#pragma omp single
    {
        if (kind == Q4G_KIND)
            q4g_block_sums(xf, K, T, nb, 0, b->sums);
        else if (kind == 4)
            quant_block_sums(xf, K, T, nb, b->sums);
    }
    if (kind == Q4G_KIND)
        q4g_linear_f32_body(xf, K, w, N, K, bias, yf, N, T, b->sums);
    else
        quant_linear_body(xf, K, w, kind, N, K, bias, yf, N, T, kind == 4 ? b->sums : NULL);
    if (m->bf16) {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < T * N; i++) ((uint16_t *)y)[i] = f32_to_bf16(b->yf[i]);
    }
}

static void layer(const stack_model_t *m, const stack_step_t *s, const stack_layer_t *L,
                  int first, const buffers_t *b, int nthreads) {
    const int bf16 = m->bf16, elem = bf16 ? 2 : 4;
    const int64_t T = s->T, hid = m->hidden, H = m->heads, Hkv = m->kv_heads, D = m->head_dim;
    const int64_t qs = H * D, kvs = Hkv * D, qkv = qs + 2 * kvs, I = m->inter;
    /* attention */
    fused_add_rms_norm_body(first ? s->res : s->out, hid, first ? NULL : s->res,
                            first ? 0 : hid, L->ln1, L->eps1, b->x, hid, T, (int)hid, bf16);
    linear(m, L, QKV, b->x, hid, qkv, b->qkv, T, b);
    rope_inplace_body(b->qkv, qkv, (int)(H + Hkv), (int)D, s->positions, m->cos, m->sin, T,
                      bf16);
    const char *k = (const char *)b->qkv + qs * elem, *v = k + kvs * elem;
    write_kv_body(k, qkv, v, qkv, L->kv_cache, s->slots, T, kvs, (int)m->block_size, elem);
    paged_attention_body(b->qkv, qkv, bf16, L->kv_cache, bf16, s->block_tables, s->bt_stride,
                         s->q_rows, s->reqs, s->pos, s->n_items, (int)H, (int)Hkv, (int)D,
                         (int)m->block_size, L->window, m->scale, b->attn, qs, nthreads);
    linear(m, L, O, b->attn, qs, hid, s->out, T, b);
    /* MLP */
    fused_add_rms_norm_body(s->out, hid, s->res, hid, L->ln2, L->eps2, b->x, hid, T, (int)hid,
                            bf16);
    linear(m, L, GATE_UP, b->x, hid, 2 * I, b->gu, T, b);
    silu_and_mul_body(b->gu, 2 * I, b->act, I, T, (int)I, bf16);
    linear(m, L, DOWN, b->act, I, hid, s->out, T, b);
}

/* Runs every layer; 0, or -1 when the step has no rows. */
int decoder_stack(const stack_model_t *m, const stack_step_t *s, int num_threads) {
    if (s->T <= 0) return -1;
    buffers_t b;
    layout(m, s->T, (char *)s->work, &b);
#pragma omp parallel num_threads(num_threads)
    {
        const int nthreads = omp_get_num_threads();
        for (int64_t l = 0; l < m->n_layers; l++) layer(m, s, &m->layers[l], l == 0, &b, nthreads);
    }
    return 0;
}
