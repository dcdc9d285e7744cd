/* Row-invariant kernels for the torch backend: everything in a layer that is not a weight product.
 *
 * The rule that makes a position's logits independent of how many rows share a forward: every
 * value a row produces is computed by the same instructions in the same order, whatever the
 * other rows are. So
 *   - element-wise work (RoPE, SiLU, bf16 rounding) is plain IEEE arithmetic, compiled with
 *     -ffp-contract=off so that a vectorised body and its scalar tail compute bit-identical values;
 *   - every reduction has an order fixed by this source: over head_dim in index order, over keys
 *     either in index order or into 16 lanes chosen by the key's index, then a fixed tree;
 *   - a query row attends to keys 0..p of its own sequence, where p is its position, and never
 *     sees a mask or a padding that depends on the block it came in;
 *   - threads split whole (kv head, row) units, never a reduction.
 * No -ffast-math: the compiler may not reassociate anything written here.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 conversion does (NaN kept quiet). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* exp by range reduction and a Cephes polynomial: branch-free, so it vectorises, and each input's
 * value is the same in a vector lane or in a scalar tail. Relative error about 2 ulp. */
static inline float exp_rowinv(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    float n = (x * 1.44269504088896341f + shifter) - shifter;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * (r * r) + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return y * scale;
}

/* Sum of a[0..n) into 16 lanes by index, then a fixed pairwise tree: the order depends on n only. */
static float lane_sum(const float *a, int n) {
    float acc[LANES] = {0};
    int j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[j + l];
    for (int l = 0; j + l < n; l++) acc[l] += a[j + l];
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) acc[l] += acc[l + width];
    return acc[0];
}

/* 1 / sqrt(mean(x^2) + eps) of one row, summed in lanes (sq is dim floats of scratch). */
static float rms_inverse(const float *x, int dim, float eps, float *sq) {
    for (int i = 0; i < dim; i++) sq[i] = x[i] * x[i];
    return 1.0f / sqrtf(lane_sum(sq, dim) / (float)dim + eps);
}

/* out[r] = bf16(x[r] * rms_inverse * w); the weight is the norm's own, not folded. */
void rms_norm_bf16(const float *x, int rows, int dim, const float *w, float eps, uint16_t *out) {
    float *sq = malloc(sizeof(float) * dim);
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * dim;
        float inv = rms_inverse(xr, dim, eps, sq);
        for (int i = 0; i < dim; i++) out[(size_t)r * dim + i] = f32_to_bf16(xr[i] * inv * w[i]);
    }
    free(sq);
}

/* The same in float32, for the final norm ahead of the head. */
void rms_norm_f32(const float *x, int rows, int dim, const float *w, float eps, float *out) {
    float *sq = malloc(sizeof(float) * dim);
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * dim;
        float inv = rms_inverse(xr, dim, eps, sq);
        for (int i = 0; i < dim; i++) out[(size_t)r * dim + i] = xr[i] * inv * w[i];
    }
    free(sq);
}

/* x += bf16 delta, then the next norm: the residual add and the norm that reads it, in one pass. */
void add_rms_norm_bf16(float *x, const uint16_t *delta, int rows, int dim, const float *w, float eps,
                       uint16_t *out) {
    size_t n = (size_t)rows * dim;
    for (size_t i = 0; i < n; i++) x[i] += bf16_to_f32(delta[i]);
    rms_norm_bf16(x, rows, dim, w, eps, out);
}

/* x += bf16 delta (the last layer's residual, before the final norm is taken in float32). */
void add_bf16(float *x, const uint16_t *delta, int n) {
    for (int i = 0; i < n; i++) x[i] += bf16_to_f32(delta[i]);
}

/* gate_up (rows, 2*ff) bf16 -> bf16(silu(gate) * up) (rows, ff). */
void silu_mul_bf16(const uint16_t *gate_up, int rows, int ff, uint16_t *out) {
    for (int r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + (size_t)r * 2 * ff, *u = g + ff;
        uint16_t *o = out + (size_t)r * ff;
        for (int i = 0; i < ff; i++) {
            float gv = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(gv / (1.0f + exp_rowinv(-gv)) * bf16_to_f32(u[i]));
        }
    }
}

/* Rotate-half RoPE of one head in place, at a position's cos/sin row. */
static void rope_head(float *v, const float *cos, const float *sin, int hd) {
    int half = hd / 2;
    for (int i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half] = b * cos[i] + a * sin[i];
    }
}

/* One sequence's causal GQA attention for one layer.
 *
 * qkv: (rows, (n_heads + 2 n_kv) hd) bf16, the fused projection; bias: its float32 bias or NULL. Row r sits at
 * position start + r. Its K/V are rotated and written into the cache (kt: (n_kv, hd, cap), keys
 * transposed; v: (n_kv, cap, hd)), then every row attends to keys 0..start+r. out: (rows, n_heads
 * hd) bf16. cos/sin: (context, hd/2) tables. scale: 1/sqrt(hd).
 */
void rope_attend_bf16(const uint16_t *qkv, const float *bias, int rows, int start, const float *cos,
                      const float *sin, float *kt, float *v, int cap, int n_heads, int n_kv, int hd, float scale,
                      uint16_t *out) {
    int half = hd / 2, group = n_heads / n_kv, width = (n_heads + 2 * n_kv) * hd;
    float *q = malloc(sizeof(float) * (size_t)rows * n_heads * hd);
    float *kv = malloc(sizeof(float) * hd), *row = malloc(sizeof(float) * width);
    for (int r = 0; r < rows; r++) {
        int pos = start + r;
        for (int i = 0; i < width; i++) row[i] = bf16_to_f32(qkv[(size_t)r * width + i]) + (bias ? bias[i] : 0.0f);
        const float *src = row;
        const float *c = cos + (size_t)pos * half, *s = sin + (size_t)pos * half;
        for (int h = 0; h < n_heads; h++) {
            float *qh = q + ((size_t)r * n_heads + h) * hd;
            for (int i = 0; i < hd; i++) qh[i] = src[h * hd + i];
            rope_head(qh, c, s, hd);
            for (int i = 0; i < hd; i++) qh[i] *= scale;
        }
        for (int h = 0; h < n_kv; h++) {
            for (int i = 0; i < hd; i++) kv[i] = src[(n_heads + h) * hd + i];
            rope_head(kv, c, s, hd);
            for (int i = 0; i < hd; i++) kt[((size_t)h * hd + i) * cap + pos] = kv[i];
            for (int i = 0; i < hd; i++)
                v[((size_t)h * cap + pos) * hd + i] = src[(n_heads + n_kv + h) * hd + i];
        }
    }
    free(kv);
    free(row);
    int units = n_kv * rows;
#pragma omp parallel for schedule(static) if (units > 1 && (size_t)rows * (start + rows) > 4096)
    for (int unit = 0; unit < units; unit++) {
        int h = unit / rows, r = unit % rows, n = start + r + 1;
        const float *kth = kt + (size_t)h * hd * cap, *vh = v + (size_t)h * cap * hd;
        float *scores = malloc(sizeof(float) * (size_t)n);
        float *acc = malloc(sizeof(float) * hd);
        for (int g = 0; g < group; g++) {
            int head = h * group + g;
            const float *qh = q + ((size_t)r * n_heads + head) * hd;
            for (int j = 0; j < n; j++) scores[j] = 0.0f;
            for (int i = 0; i < hd; i++) {
                float qi = qh[i];
                const float *krow = kth + (size_t)i * cap;
                for (int j = 0; j < n; j++) scores[j] += qi * krow[j];
            }
            float m = scores[0];
            for (int j = 1; j < n; j++) m = scores[j] > m ? scores[j] : m;
            for (int j = 0; j < n; j++) scores[j] = exp_rowinv(scores[j] - m);
            float inv = 1.0f / lane_sum(scores, n);
            for (int i = 0; i < hd; i++) acc[i] = 0.0f;
            for (int j = 0; j < n; j++) {
                float wj = scores[j];
                const float *vj = vh + (size_t)j * hd;
                for (int i = 0; i < hd; i++) acc[i] += wj * vj[i];
            }
            uint16_t *o = out + ((size_t)r * n_heads + head) * hd;
            for (int i = 0; i < hd; i++) o[i] = f32_to_bf16(acc[i] * inv);
        }
        free(acc);
        free(scores);
    }
    free(q);
}

/* The LM head: logits (rows, vocab) float32 = x (rows, dim) float32 times W^T, W held as Q8_0
 * (int8 values q (vocab, dim), one float32 scale per 32 of a row), so the weights are exactly the
 * file's. Each logit is one dot product in 16 lanes by index and a fixed tree, whatever the row
 * count; threads split the vocabulary, never a dot product. */
void head_q8_0(const float *x, int rows, int dim, const int8_t *q, const float *scale, int vocab,
               float *out) {
    int blocks = dim / 32;
#pragma omp parallel
    {
        float *w = malloc(sizeof(float) * dim);
#pragma omp for schedule(static)
        for (int n = 0; n < vocab; n++) {
            const int8_t *qn = q + (size_t)n * dim;
            const float *sn = scale + (size_t)n * blocks;
            for (int b = 0; b < blocks; b++)
                for (int i = 0; i < 32; i++) w[b * 32 + i] = sn[b] * (float)qn[b * 32 + i];
            for (int r = 0; r < rows; r++) {
                const float *xr = x + (size_t)r * dim;
                float acc[LANES] = {0};
                int i = 0;
                for (; i + LANES <= dim; i += LANES)
                    for (int l = 0; l < LANES; l++) acc[l] += xr[i + l] * w[i + l];
                for (int l = 0; i + l < dim; l++) acc[l] += xr[i + l] * w[i + l];
                for (int width = LANES / 2; width > 0; width /= 2)
                    for (int l = 0; l < width; l++) acc[l] += acc[l + width];
                out[(size_t)r * vocab + n] = acc[0];
            }
        }
        free(w);
    }
}
