/* The native backend's whole stack of layers in one call: the same sequence of kernels as
 * fast_llama.FastModel.forward_layers (the torch backend's Python loop), without a Python call
 * per kernel. Row invariance is the kernels' own; this file only sequences them. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

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
} Matrix;

typedef struct {
    const float *attn_norm, *ffn_norm, *bias; /* bias: NULL unless the model has a QKV bias */
    Matrix qkv, o, gate_up, down;
} Layer;

typedef struct {
    int first_row, rows, start, cap; /* its rows in the batch, its cache length, its cache capacity */
    float *kt, *v;                    /* layer 0 of its cache; layer l is l * n_kv * hd * cap further */
    const int *parents;               /* NULL for a chain; a token tree's parent rows (rope_attend_f32) */
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
                    m->parts[p].n_out, out + column, m->n_out);
}

/* x (rows, d): embeddings in, the last layer's residual stream out. */
void forward_layers(float *x, int rows, int d, int ff, int n_heads, int n_kv, int hd, float eps,
                    const float *cos, const float *sin, const Layer *layers, int n_layers,
                    const Sequence *seqs, int n_seqs, Scratch *s) {
    int q_dim = n_heads * hd, width = (n_heads + 2 * n_kv) * hd;
    float scale = 1.0f / sqrtf((float)hd);
    rms_norm_f32(x, rows, d, layers[0].attn_norm, eps, s->h);
    for (int l = 0; l < n_layers; l++) {
        const Layer *L = &layers[l];
        product(s->h, rows, &L->qkv, s, s->qkv);
        for (int i = 0; i < n_seqs; i++) {
            const Sequence *q = &seqs[i];
            size_t layer_offset = (size_t)l * n_kv * hd * q->cap;
            rope_attend_f32(s->qkv + (size_t)q->first_row * width, L->bias, q->rows, q->start, q->parents, cos, sin,
                            q->kt + layer_offset, q->v + layer_offset, q->cap, n_heads, n_kv, hd, scale,
                            s->attn + (size_t)q->first_row * q_dim);
        }
        product(s->attn, rows, &L->o, s, s->out);
        add_rms_norm_f32(x, s->out, rows, d, L->ffn_norm, eps, s->h);
        product(s->h, rows, &L->gate_up, s, s->gate_up);
        silu_mul_f32(s->gate_up, rows, ff, s->act);
        product(s->act, rows, &L->down, s, s->out);
        if (l + 1 < n_layers)
            add_rms_norm_f32(x, s->out, rows, d, layers[l + 1].attn_norm, eps, s->h);
        else
            add_f32(x, s->out, rows * d);
    }
}
