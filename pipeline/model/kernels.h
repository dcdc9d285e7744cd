/* The fast runtime's C kernels (rowkernels.c, products.c) and the layer driver (layers.c). */
#pragma once
#include <stdint.h>

/* Element-wise and per-row work (norms, SiLU, RoPE, activation quantizing) is split across threads
 * by whole rows once a forward carries ROWS_PARALLEL rows (a prefill chunk, a large verify block): a
 * row is computed by the same instructions on any thread, so the split changes speed, never bits.
 * Below that the work is smaller than waking a thread. */
#define ROWS_PARALLEL 32

/* A KV cache element: an IEEE half. Each key and value is rounded to it once, when its row writes
 * it (round to nearest even, the same on every path: F16C, AVX-512 or the compiler's own code), and
 * read back exactly. Attention over a long context is bound by reading the cache; halves read half
 * the bytes, and a cache takes half the memory. */
typedef _Float16 kv_t;

/* A layer's attention: where its K/V live and what it adds to the llama block. */
typedef struct {
    const float *bias;           /* the fused projection's bias, or NULL */
    const float *q_norm, *k_norm; /* per-head RMS-norm weights (hd floats) before RoPE, or NULL */
    float eps;                   /* the QK-norm's epsilon */
    const float *cos, *sin;      /* this layer's (context, hd/2) RoPE tables */
    int window;                  /* 0: every earlier key; else the keys of the last `window` positions */
    int base;                    /* the position the cache's slot 0 holds (a sliding-window buffer) */
} AttendSpec;

void rms_norm_f32(const float *x, int rows, int dim, const float *w, float eps, float *out);
void add_rms_norm_f32(float *x, const float *delta, int rows, int dim, const float *w, float eps, float *out);
void add_f32(float *x, const float *delta, int n);
void silu_mul_f32(const float *gate_up, int rows, int ff, float *out);
void gelu_mul_f32(const float *gate_up, int rows, int ff, float *out);
void rope_attend_f32(const float *qkv, const AttendSpec *a, int rows, int start, const int *parents,
                     kv_t *kt, kv_t *v, int cap, int n_heads, int n_kv, int hd, float scale, float *out);

/* One sequence's attention in one layer: rope_attend_f32's arguments, then what rope_attend_batch
 * lays out for its units (set there, freed there). */
typedef struct {
    const float *qkv;
    AttendSpec a;
    int rows, start;
    const int *parents;
    kv_t *kt, *v;
    int cap;
    float *out;
    float *q;                       /* the rows' rotated, scaled queries */
    int *depth, *lo, *paths, *skip; /* per row (paths: rows x rows; paths, skip: trees only) */
    int chunk, per_kv, units;
} AttendJob;

void rope_attend_batch(AttendJob *jobs, int n_jobs, int n_heads, int n_kv, int hd, float scale);
void quantize_q8(const float *x, int rows, int k, int8_t *xq, float *dx, int32_t *sx, int32_t *sh);
void gemm_blocks(const int8_t *xq, const float *dx, const int32_t *sx, const int32_t *sh, int rows, int k,
                 const uint8_t *w, int kind, int n, float *out, int ldo, int streamed);
