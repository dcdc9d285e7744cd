/* Row-invariant kernels for the torch backend: everything in a layer that is not a weight product.
 *
 * The rule that makes a position's logits independent of how many rows share a forward: every
 * value a row produces is computed by the same instructions in the same order, whatever the
 * other rows are. So
 *   - element-wise work (RoPE, SiLU) is plain IEEE arithmetic, compiled with
 *     -ffp-contract=off so that a vectorised body and its scalar tail compute bit-identical values;
 *   - every reduction has an order fixed by this source: over head_dim in index order, over keys
 *     either in index order or into 16 lanes chosen by the key's index, then a fixed tree; the
 *     dot products are explicit fmaf chains, one rounding per step in the vector body and the
 *     scalar tail alike;
 *   - a query row attends to keys 0..p of its own sequence, where p is its position (on a
 *     sliding-window layer p - window + 1..p, counted by position, never by buffer offset), and never
 *     sees a mask or a padding that depends on the block it came in;
 *   - threads split whole (kv head, row) units or whole rows, never a reduction.
 * No -ffast-math: the compiler may not reassociate anything written here.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define LANES 16

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

/* The largest of a[0..n), n >= 1, in 16 lanes: max is exact, so any order gives the same value (a NaN
 * score gives NaN attention outputs either way). */
static float lane_max(const float *a, int n) {
    float acc[LANES];
    for (int l = 0; l < LANES; l++) acc[l] = a[0];
    int j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = a[j + l] > acc[l] ? a[j + l] : acc[l];
    for (int l = 0; j + l < n; l++) acc[l] = a[j + l] > acc[l] ? a[j + l] : acc[l];
    float m = acc[0];
    for (int l = 1; l < LANES; l++) m = acc[l] > m ? acc[l] : m;
    return m;
}

/* 1 / sqrt(mean(x^2) + eps) of one row, summed in lanes (sq is dim floats of scratch). */
static float rms_inverse(const float *x, int dim, float eps, float *sq) {
    for (int i = 0; i < dim; i++) sq[i] = x[i] * x[i];
    return 1.0f / sqrtf(lane_sum(sq, dim) / (float)dim + eps);
}

/* out[r] = x[r] * rms_inverse * w; the weight is the norm's own, not folded. */
void rms_norm_f32(const float *x, int rows, int dim, const float *w, float eps, float *out) {
#pragma omp parallel if (rows >= ROWS_PARALLEL)
    {
        float *sq = malloc(sizeof(float) * dim);
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++) {
            const float *xr = x + (size_t)r * dim;
            float inv = rms_inverse(xr, dim, eps, sq);
            for (int i = 0; i < dim; i++) out[(size_t)r * dim + i] = xr[i] * inv * w[i];
        }
        free(sq);
    }
}

/* x += delta, then the next norm: the residual add and the norm that reads it, in one pass. */
void add_rms_norm_f32(float *x, const float *delta, int rows, int dim, const float *w, float eps, float *out) {
#pragma omp parallel for schedule(static) if (rows >= ROWS_PARALLEL)
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < dim; i++) x[(size_t)r * dim + i] += delta[(size_t)r * dim + i];
    rms_norm_f32(x, rows, dim, w, eps, out);
}

/* x += delta (the last layer's residual, before the final norm). */
void add_f32(float *x, const float *delta, int n) {
    for (int i = 0; i < n; i++) x[i] += delta[i];
}

/* gate_up (rows, 2 ff) -> silu(gate) * up (rows, ff). */
void silu_mul_f32(const float *gate_up, int rows, int ff, float *out) {
#pragma omp parallel for schedule(static) if (rows >= ROWS_PARALLEL)
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (size_t)r * 2 * ff, *u = g + ff;
        float *o = out + (size_t)r * ff;
        for (int i = 0; i < ff; i++) o[i] = g[i] / (1.0f + exp_rowinv(-g[i])) * u[i];
    }
}

/* gate_up (rows, 2 ff) -> gelu_tanh(gate) * up (rows, ff), Gemma's GeGLU. 0.5 x (1 + tanh(u)) is
 * x sigmoid(2u) exactly, so it is the SiLU's form with u = sqrt(2/pi) (x + 0.044715 x^3): the same
 * branch-free exp for every element, in a vector lane or the scalar tail. */
void gelu_mul_f32(const float *gate_up, int rows, int ff, float *out) {
#pragma omp parallel for schedule(static) if (rows >= ROWS_PARALLEL)
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (size_t)r * 2 * ff, *u = g + ff;
        float *o = out + (size_t)r * ff;
        for (int i = 0; i < ff; i++) {
            float x = g[i], t = -1.5957691216057308f * (x + 0.044715f * (x * x * x));
            o[i] = x / (1.0f + exp_rowinv(t)) * u[i];
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

/* The queries of one kv head's group (G heads, one row) against keys [j0, j0 + width), width <=
 * KEYS: each key block is loaded once for all G queries. Every score is the fma chain over
 * head_dim in index order: the same chain in the vector body and in a scalar tail, and the same
 * whatever G is, so grouping changes speed, not bits. */
#define KEYS 32
#define MAX_GROUP 8
#define INLINE static inline __attribute__((always_inline))
INLINE void score_block_g(const float *const *q, const int G, const kv_t *kt, int cap, int hd, int j0,
                          int width, float *const *scores) {
    float s[MAX_GROUP][KEYS];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < KEYS; j++) s[g][j] = 0.0f;
    for (int i = 0; i < hd; i++) {
        const kv_t *krow = kt + (size_t)i * cap + j0;
        /* The next block's keys in this row: head_dim rows far apart are more streams than the
         * hardware prefetchers follow, and without this the loads wait on memory. */
        __builtin_prefetch(krow + KEYS);
        __builtin_prefetch(krow + KEYS + 16);
        float k[KEYS];
        if (width == KEYS)
            for (int j = 0; j < KEYS; j++) k[j] = (float)krow[j];
        else
            for (int j = 0; j < KEYS; j++) k[j] = j < width ? (float)krow[j] : 0.0f;
        for (int g = 0; g < G; g++) {
            float qi = q[g][i];
            for (int j = 0; j < KEYS; j++) s[g][j] = fmaf(qi, k[j], s[g][j]);
        }
    }
    for (int g = 0; g < G; g++) memcpy(scores[g] + j0, s[g], sizeof(float) * width);
}

/* One copy of the body per group size, so the compiler keeps the G x 32 sums in registers. */
static void score_block(const float *const *q, int G, const kv_t *kt, int cap, int hd, int j0, int width,
                        float *const *scores) {
    switch (G) {
    case 1: score_block_g(q, 1, kt, cap, hd, j0, width, scores); break;
    case 2: score_block_g(q, 2, kt, cap, hd, j0, width, scores); break;
    case 3: score_block_g(q, 3, kt, cap, hd, j0, width, scores); break;
    case 4: score_block_g(q, 4, kt, cap, hd, j0, width, scores); break;
    default: score_block_g(q, G, kt, cap, hd, j0, width, scores); break;
    }
}

/* out[g] = inv[g] * sum_j weights[g][j] v_j: an fma chain over keys in index order per element,
 * each value row loaded once for the G heads (head_dim <= MAX_HEAD_DIM). Where head_dim is a
 * multiple of VALUES, the elements are taken VALUES at a time (every element's chain the same), so
 * the G x VALUES sums stay in registers. */
#define MAX_HEAD_DIM 256
#define VALUES 32
INLINE void weigh_values_g(float *const *weights, const int G, const kv_t *v, int n, const int *tail,
                           int n_tail, int hd, const float *inv, float *out) {
    for (int c = 0; c < hd; c += VALUES) {
        float acc[MAX_GROUP][VALUES];
        for (int g = 0; g < G; g++)
            for (int i = 0; i < VALUES; i++) acc[g][i] = 0.0f;
        for (int j = 0; j < n + n_tail; j++) {
            const kv_t *vj = v + (size_t)(j < n ? j : tail[j - n]) * hd + c;
            if (j + 8 < n) {
                __builtin_prefetch(vj + 8 * (size_t)hd);
                __builtin_prefetch(vj + 8 * (size_t)hd + 16);
            }
            for (int g = 0; g < G; g++) {
                float w = weights[g][j];
                for (int i = 0; i < VALUES; i++) acc[g][i] = fmaf(w, (float)vj[i], acc[g][i]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int i = 0; i < VALUES; i++) out[(size_t)g * hd + c + i] = acc[g][i] * inv[g];
    }
}

static void weigh_values(float *const *weights, int G, const kv_t *v, int n, const int *tail, int n_tail,
                         int hd, const float *inv, float *out) {
    if (hd % VALUES == 0 && G <= 4) {
        switch (G) {
        case 1: weigh_values_g(weights, 1, v, n, tail, n_tail, hd, inv, out); return;
        case 2: weigh_values_g(weights, 2, v, n, tail, n_tail, hd, inv, out); return;
        case 3: weigh_values_g(weights, 3, v, n, tail, n_tail, hd, inv, out); return;
        default: weigh_values_g(weights, 4, v, n, tail, n_tail, hd, inv, out); return;
        }
    }
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    for (int g = 0; g < G; g++)
        for (int i = 0; i < hd; i++) acc[g][i] = 0.0f;
    for (int j = 0; j < n + n_tail; j++) {
        const kv_t *vj = v + (size_t)(j < n ? j : tail[j - n]) * hd;
        for (int g = 0; g < G; g++) {
            float w = weights[g][j];
            for (int i = 0; i < hd; i++) acc[g][i] = fmaf(w, (float)vj[i], acc[g][i]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < hd; i++) out[(size_t)g * hd + i] = acc[g][i] * inv[g];
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* 16 stored halves as floats: exact, as (float) is in the scalar code. */
static inline __m512 halves16(const kv_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* SmolLM2's shape (3 heads per kv head, head_dim 64) in AVX-512 registers: the same fma chains as
 * score_block and weigh_values (a masked load zeroes the lanes past the last key), so the same bits. */
static void scores_3x64(const float *const *q, const kv_t *kt, int cap, int n, float *const *scores) {
    /* 32 keys a step: six independent fma chains, enough to hide the fma latency that three
     * chains of 64 dependent steps would wait on */
    for (int j0 = 0; j0 < n; j0 += 32) {
        __mmask16 lanes[2];
        for (int h = 0; h < 2; h++) {
            int left = n - j0 - 16 * h;
            lanes[h] = left >= 16 ? (__mmask16)0xFFFF : (left > 0 ? (__mmask16)((1u << left) - 1) : 0);
        }
        __m512 s[2][3];
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 3; g++) s[h][g] = _mm512_setzero_ps();
        for (int i = 0; i < 64; i++) {
            __m512 q0 = _mm512_set1_ps(q[0][i]), q1 = _mm512_set1_ps(q[1][i]), q2 = _mm512_set1_ps(q[2][i]);
            for (int h = 0; h < 2; h++) {
                __m512 k = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes[h], kt + (size_t)i * cap + j0 + 16 * h));
                s[h][0] = _mm512_fmadd_ps(q0, k, s[h][0]);
                s[h][1] = _mm512_fmadd_ps(q1, k, s[h][1]);
                s[h][2] = _mm512_fmadd_ps(q2, k, s[h][2]);
            }
        }
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 3; g++) _mm512_mask_storeu_ps(scores[g] + j0 + 16 * h, lanes[h], s[h][g]);
    }
}

static void values_3x64(float *const *weights, const kv_t *v, int n, const int *tail, int n_tail,
                        const float *inv, float *out) {
    __m512 acc[3][4];
    for (int g = 0; g < 3; g++)
        for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_ps();
    for (int j = 0; j < n + n_tail; j++) {
        const kv_t *vj = v + (size_t)(j < n ? j : tail[j - n]) * 64;
        __m512 v0 = halves16(vj), v1 = halves16(vj + 16), v2 = halves16(vj + 32), v3 = halves16(vj + 48);
        for (int g = 0; g < 3; g++) {
            __m512 w = _mm512_set1_ps(weights[g][j]);
            acc[g][0] = _mm512_fmadd_ps(w, v0, acc[g][0]);
            acc[g][1] = _mm512_fmadd_ps(w, v1, acc[g][1]);
            acc[g][2] = _mm512_fmadd_ps(w, v2, acc[g][2]);
            acc[g][3] = _mm512_fmadd_ps(w, v3, acc[g][3]);
        }
    }
    for (int g = 0; g < 3; g++)
        for (int c = 0; c < 4; c++)
            _mm512_storeu_ps(out + (size_t)g * 64 + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])));
}
#define FAST_3x64 1
#endif

/* The score of one key slot: the same fma chain over head_dim as a lane of score_block or
 * scores_3x64, so a key reached through a tree's slot list scores exactly as in a contiguous run. */
static float score_slot(const float *q, const kv_t *kt, int cap, int hd, int slot) {
    float s = 0.0f;
    for (int i = 0; i < hd; i++) s = fmaf(q[i], (float)kt[(size_t)i * cap + slot], s);
    return s;
}

/* softmax(q K^T) V for the G heads of one kv head and one row, q already scaled, over the keys in
 * slots 0..n-1 followed by the slots listed in tail (a tree row's ancestors and itself): in that
 * order, so a row whose tail is its contiguous chain computes the same bits as without a tail. */
static void attend_group(const float *q, int G, const kv_t *kt, const kv_t *v, int n, const int *tail,
                         int n_tail, int cap, int hd, float *out) {
    const float *qs[MAX_GROUP];
    float *scores[MAX_GROUP];
    int total = n + n_tail;
    for (int g = 0; g < G; g++) {
        qs[g] = q + (size_t)g * hd;
        scores[g] = malloc(sizeof(float) * ((size_t)total + KEYS));
    }
#ifdef FAST_3x64
    int fast = G == 3 && hd == 64;
#else
    int fast = 0;
#endif
    if (fast) {
#ifdef FAST_3x64
        scores_3x64(qs, kt, cap, n, scores);
#endif
    } else {
        for (int j0 = 0; j0 < n; j0 += KEYS) score_block(qs, G, kt, cap, hd, j0, n - j0 < KEYS ? n - j0 : KEYS, scores);
    }
    for (int t = 0; t < n_tail; t++)
        for (int g = 0; g < G; g++) scores[g][n + t] = score_slot(qs[g], kt, cap, hd, tail[t]);
    float inv[MAX_GROUP];
    for (int g = 0; g < G; g++) {
        float m = lane_max(scores[g], total);
        for (int j = 0; j < total; j++) scores[g][j] = exp_rowinv(scores[g][j] - m);
        inv[g] = 1.0f / lane_sum(scores[g], total);
    }
    if (fast) {
#ifdef FAST_3x64
        values_3x64(scores, v, n, tail, n_tail, inv, out);
#endif
    } else {
        weigh_values(scores, G, v, n, tail, n_tail, hd, inv, out);
    }
    for (int g = 0; g < G; g++) free(scores[g]);
}

/* One head in place: RMS-normed with weight w (if any), then rotated. The same instructions for
 * every row, whatever the block: the norm's sum is rms_inverse's lane order over head_dim. */
static void norm_rope_head(float *x, const float *w, float eps, float *sq, const float *c, const float *s, int hd) {
    if (w != NULL) {
        float inv = rms_inverse(x, hd, eps, sq);
        for (int i = 0; i < hd; i++) x[i] = x[i] * inv * w[i];
    }
    rope_head(x, c, s, hd);
}

/* Row r's bias, QK-norm and RoPE: its queries (scaled) into q, its K/V into slot `slot`. */
static void project_row(const float *src_in, const AttendSpec *a, int pos, int slot, float *q, kv_t *kt,
                        kv_t *v, int cap, int n_heads, int n_kv, int hd, float scale, float *row, float *sq) {
    int half = hd / 2, width = (n_heads + 2 * n_kv) * hd;
    for (int i = 0; i < width; i++) row[i] = src_in[i] + (a->bias ? a->bias[i] : 0.0f);
    const float *c = a->cos + (size_t)pos * half, *s = a->sin + (size_t)pos * half;
    for (int h = 0; h < n_heads; h++) {
        float *qh = q + (size_t)h * hd;
        for (int i = 0; i < hd; i++) qh[i] = row[h * hd + i];
        norm_rope_head(qh, a->q_norm, a->eps, sq, c, s, hd);
        for (int i = 0; i < hd; i++) qh[i] *= scale;
    }
    for (int h = 0; h < n_kv; h++) {
        float *kh = row + (size_t)(n_heads + h) * hd;
        norm_rope_head(kh, a->k_norm, a->eps, sq, c, s, hd);
        for (int i = 0; i < hd; i++) kt[((size_t)h * hd + i) * cap + slot] = (kv_t)kh[i];
        for (int i = 0; i < hd; i++) v[((size_t)h * cap + slot) * hd + i] = (kv_t)row[(n_heads + n_kv + h) * hd + i];
    }
}

/* One sequence's causal GQA attention for one layer.
 *
 * qkv: (rows, (n_heads + 2 n_kv) hd), the fused projection. scale: the query scale. out: (rows,
 * n_heads hd). kt: (n_kv, hd, cap), keys transposed; v: (n_kv, cap, hd); slot s holds position
 * a->base + s (base 0 but in a sliding-window layer's buffer, row_cache.py).
 *
 * parents NULL: a chain. Row r sits at position start + r; its K/V are rotated and written at
 * position start + r, and it attends to positions lo..start+r, lo = 0, or in a windowed layer
 * max(0, start + r - window + 1).
 * parents given: a token tree. parents[r] is the row r descends from (-1: from the cache, and
 * parents[r] < r). Row r sits at position start + depth(r) and writes at start + r; it attends
 * to positions lo..start-1, then its ancestors' slots from the root down (those at depth >=
 * lo - start), then its own. Those are the keys, in the order, that a chain through the same
 * tokens gives that row, so a tree row's values are bit for bit the chain's
 * (tests/test_tree_attention.py).
 * Every key list is handed to attend_group from its first position lo, so the 32-key blocks and
 * the lanes of the sums are fixed by the positions alone, never by `base` or the block: a row's
 * bits do not depend on whether a window buffer was compacted.
 */
void rope_attend_f32(const float *qkv, const AttendSpec *a, int rows, int start, const int *parents,
                     kv_t *kt, kv_t *v, int cap, int n_heads, int n_kv, int hd, float scale, float *out) {
    AttendJob job = {qkv, *a, rows, start, parents, kt, v, cap, out};
    rope_attend_batch(&job, 1, n_heads, n_kv, hd, scale);
}

/* A job's own arrays: its rows' depths and scaled queries. */
static void job_prepare(AttendJob *j, int n_heads, int hd) {
    j->q = malloc(sizeof(float) * (size_t)j->rows * n_heads * hd);
    j->depth = malloc(sizeof(int) * (size_t)j->rows);
    for (int r = 0; r < j->rows; r++)
        j->depth[r] = j->parents == NULL ? r : (j->parents[r] < 0 ? 0 : j->depth[j->parents[r]] + 1);
}

/* Each row's first visible position; a tree row's tail: the slots of its path from the first
 * visible ancestor (root first) down to itself, as offsets from that first position. Then the
 * job's units: one row's queries of one kv head, or half of them where there would be only one
 * unit (one row, one kv head: Gemma 3's decode step), so both threads attend. A head's bits do not
 * depend on which heads share its group (score_block, weigh_values). Splitting SmolLM2's 3 units of
 * a decode step so as to balance two threads was measured slower (0.3-0.6 ms a step at 150-600
 * positions): each part reads its kv head's keys and values again. */
static void job_layout(AttendJob *j, int n_heads, int n_kv) {
    int rows = j->rows, start = j->start, group = n_heads / n_kv;
    j->lo = malloc(sizeof(int) * (size_t)rows);
    j->paths = j->skip = NULL;
    for (int r = 0; r < rows; r++) {
        int pos = start + j->depth[r];
        j->lo[r] = j->a.window > 0 && pos - j->a.window + 1 > 0 ? pos - j->a.window + 1 : 0;
    }
    if (j->parents != NULL) {
        j->paths = malloc(sizeof(int) * (size_t)rows * rows);
        j->skip = malloc(sizeof(int) * (size_t)rows);
        for (int r = 0; r < rows; r++) {
            j->skip[r] = j->lo[r] > start ? j->lo[r] - start : 0;
            for (int x = r, d = j->depth[r]; x >= 0; x = j->parents[x], d--)
                j->paths[(size_t)r * rows + d] = start + x - j->lo[r];
        }
    }
    j->chunk = n_kv * rows == 1 && group > 1 ? (group + 1) / 2 : MAX_GROUP;
    j->per_kv = (group + j->chunk - 1) / j->chunk;
    j->units = n_kv * rows * j->per_kv;
}

/* One unit of a laid-out job: its row's queries of one kv head (or part of them), over the keys. */
static void job_unit(const AttendJob *j, int unit, int n_heads, int n_kv, int hd) {
    int group = n_heads / n_kv, per_kv = j->per_kv, chunk = j->chunk, start = j->start;
    int part = unit % per_kv, h = unit / per_kv % n_kv, r = unit / per_kv / n_kv, first = j->lo[r] - j->a.base;
    int n = j->paths ? (start > j->lo[r] ? start - j->lo[r] : 0) : start + r + 1 - j->lo[r];
    int n_tail = j->paths ? j->depth[r] + 1 - j->skip[r] : 0;
    const int *tail = j->paths ? j->paths + (size_t)r * j->rows + j->skip[r] : NULL;
    int g_end = (part + 1) * chunk < group ? (part + 1) * chunk : group;
    for (int g0 = part * chunk; g0 < g_end; g0 += MAX_GROUP) {
        int G = g_end - g0 < MAX_GROUP ? g_end - g0 : MAX_GROUP, head = h * group + g0;
        attend_group(j->q + ((size_t)r * n_heads + head) * hd, G, j->kt + (size_t)h * hd * j->cap + first,
                     j->v + ((size_t)h * j->cap + first) * hd, n, tail, n_tail, j->cap, hd,
                     j->out + ((size_t)r * n_heads + head) * hd);
    }
}

/* Several sequences' attention in one layer, as rope_attend_f32 would give each alone. Their rows'
 * projections, then their units, are each one pool of work that the threads share: a decode step
 * of N sequences is N x n_kv units in one parallel loop, not N loops of n_kv units (3 units on 2
 * threads left one idle a third of the time, and each loop paid its own start and barrier). A
 * unit's bits do not depend on the thread or on the other units, so neither does anything here.
 * The units go dynamically: sequences of different lengths make units of different sizes. */
void rope_attend_batch(AttendJob *jobs, int n_jobs, int n_heads, int n_kv, int hd, float scale) {
    int width = (n_heads + 2 * n_kv) * hd, rows = 0;
    for (int i = 0; i < n_jobs; i++) {
        job_prepare(&jobs[i], n_heads, hd);
        rows += jobs[i].rows;
    }
    int *row_job = malloc(sizeof(int) * (size_t)rows), *row_index = malloc(sizeof(int) * (size_t)rows);
    for (int i = 0, k = 0; i < n_jobs; i++)
        for (int r = 0; r < jobs[i].rows; r++, k++) row_job[k] = i, row_index[k] = r;
#pragma omp parallel if (rows >= ROWS_PARALLEL)
    {
        float *row = malloc(sizeof(float) * width), *sq = malloc(sizeof(float) * hd);
#pragma omp for schedule(static)
        for (int k = 0; k < rows; k++) {
            AttendJob *j = &jobs[row_job[k]];
            int r = row_index[k];
            project_row(j->qkv + (size_t)r * width, &j->a, j->start + j->depth[r], j->start + r - j->a.base,
                        j->q + (size_t)r * n_heads * hd, j->kt, j->v, j->cap, n_heads, n_kv, hd, scale, row, sq);
        }
        free(sq);
        free(row);
    }
    int units = 0;
    size_t work = 0;
    for (int i = 0; i < n_jobs; i++) {
        job_layout(&jobs[i], n_heads, n_kv);
        units += jobs[i].units;
        work += (size_t)n_kv * jobs[i].rows * (n_heads / n_kv) * (jobs[i].start + jobs[i].rows) * hd;
    }
    int *unit_job = malloc(sizeof(int) * (size_t)units), *unit_index = malloc(sizeof(int) * (size_t)units);
    for (int i = 0, k = 0; i < n_jobs; i++)
        for (int u = 0; u < jobs[i].units; u++, k++) unit_job[k] = i, unit_index[k] = u;
#pragma omp parallel for schedule(dynamic) if (units > 1 && work > 32768)
    for (int k = 0; k < units; k++) job_unit(&jobs[unit_job[k]], unit_index[k], n_heads, n_kv, hd);
    free(unit_index);
    free(unit_job);
    free(row_index);
    free(row_job);
    for (int i = 0; i < n_jobs; i++) {
        AttendJob *j = &jobs[i];
        free(j->skip);
        free(j->paths);
        free(j->lo);
        free(j->depth);
        free(j->q);
    }
}
