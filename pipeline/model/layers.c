/* The native backend's whole stack of layers in one call: the same sequence of kernels as
 * fast_llama.FastModel.forward_layers (the torch backend's Python loop), without a Python call
 * per kernel. Row invariance is the kernels' own; this file only sequences them. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

#define MAX_PARTS 3

/* A product's weights: one part per block kind, side by side along the outputs (a fused Q/K/V
 * whose V is Q6_K and Q/K Q4_K is two parts; one kind throughout is one part). */
typedef struct {
    const uint8_t *data; /* products.c's tiles */
    int kind;            /* products.c's enum */
    int n_out;
} Part;

typedef struct {
    Part parts[MAX_PARTS];
    int n_parts, n_out, n_in;
    int streamed; /* a target's weights, read once a forward (gemm_blocks) */
} Matrix;

typedef struct {
    const float *attn_norm, *ffn_norm, *bias; /* bias: NULL unless the model has a QKV bias */
    const float *q_norm, *k_norm;             /* per-head QK-norm weights (Gemma 3, Qwen 3), or NULL */
    const float *post_attn_norm, *post_ffw_norm; /* norms of the two outputs (Gemma 3), or NULL */
    const float *cos, *sin;                   /* this layer's RoPE tables (local layers have their own) */
    int window;                               /* 0: a global layer; else its sliding window */
    int cache_index;                          /* its place among the sequence's global or local layers */
    Matrix qkv, o, gate_up, down;
} Layer;

typedef struct {
    int first_row, rows, start;      /* its rows in the batch, its cache length */
    int cap, local_cap, base;        /* its buffers' capacities; the position local slot 0 holds */
    kv_t *kt, *v;                    /* global layer 0 of its cache; layer i is i * n_kv * hd * cap further */
    kv_t *local_kt, *local_v;        /* the sliding-window layers' buffer, as kt, v with local_cap */
    const int *parents;              /* NULL for a chain; a token tree's parent rows (rope_attend_f32) */
} Sequence;

typedef struct {
    float *h, *qkv, *attn, *gate_up, *act, *out; /* activations: rows x the widest use */
    int8_t *xq;                                   /* rows x the widest product input */
    float *dx;
    int32_t *sx, *sh;
} Scratch;

/* The activations are quantized once; each part writes its own columns of out. */
static void product(const float *x, int rows, const Matrix *m, Scratch *s, float *out) {
    quantize_q8(x, rows, m->n_in, s->xq, s->dx, s->sx, s->sh);
    for (int p = 0, column = 0; p < m->n_parts; column += m->parts[p].n_out, p++)
        gemm_blocks(s->xq, s->dx, s->sx, s->sh, rows, m->n_in, m->parts[p].data, m->parts[p].kind,
                    m->parts[p].n_out, out + column, m->n_out, m->streamed);
}

/* Every sequence's attention in layer L, each in the buffer (global or local) the layer's K/V live
 * in, as one batch of jobs (rope_attend_batch: the threads share all their units). */
static void attend(const Layer *L, const Sequence *seqs, int n_seqs, const float *qkv, float eps, int n_heads,
                   int n_kv, int hd, float scale, float *out, AttendJob *jobs) {
    int local = L->window > 0, width = (n_heads + 2 * n_kv) * hd, q_dim = n_heads * hd;
    for (int i = 0; i < n_seqs; i++) {
        const Sequence *q = &seqs[i];
        int cap = local ? q->local_cap : q->cap;
        size_t offset = (size_t)L->cache_index * n_kv * hd * cap;
        AttendSpec a = {L->bias, L->q_norm, L->k_norm, eps, L->cos, L->sin, L->window, local ? q->base : 0};
        AttendJob job = {qkv + (size_t)q->first_row * width, a, q->rows, q->start, q->parents,
                         (local ? q->local_kt : q->kt) + offset, (local ? q->local_v : q->v) + offset, cap,
                         out + (size_t)q->first_row * q_dim};
        jobs[i] = job;
    }
    rope_attend_batch(jobs, n_seqs, n_heads, n_kv, hd, scale);
}

/* x (rows, d): embeddings in, the last layer's residual stream out. gelu: GeGLU (else SwiGLU). */
void forward_layers(float *x, int rows, int d, int ff, int n_heads, int n_kv, int hd, float eps, float scale,
                    int gelu, const Layer *layers, int n_layers, const Sequence *seqs, int n_seqs, Scratch *s) {
    AttendJob *jobs = malloc(sizeof(AttendJob) * (size_t)n_seqs);
    rms_norm_f32(x, rows, d, layers[0].attn_norm, eps, s->h);
    for (int l = 0; l < n_layers; l++) {
        const Layer *L = &layers[l];
        product(s->h, rows, &L->qkv, s, s->qkv);
        attend(L, seqs, n_seqs, s->qkv, eps, n_heads, n_kv, hd, scale, s->attn, jobs);
        product(s->attn, rows, &L->o, s, s->out);
        if (L->post_attn_norm) rms_norm_f32(s->out, rows, d, L->post_attn_norm, eps, s->out);
        add_rms_norm_f32(x, s->out, rows, d, L->ffn_norm, eps, s->h);
        product(s->h, rows, &L->gate_up, s, s->gate_up);
        (gelu ? gelu_mul_f32 : silu_mul_f32)(s->gate_up, rows, ff, s->act);
        product(s->act, rows, &L->down, s, s->out);
        if (L->post_ffw_norm) rms_norm_f32(s->out, rows, d, L->post_ffw_norm, eps, s->out);
        if (l + 1 < n_layers)
            add_rms_norm_f32(x, s->out, rows, d, layers[l + 1].attn_norm, eps, s->h);
        else
            add_f32(x, s->out, rows * d);
    }
    free(jobs);
}
