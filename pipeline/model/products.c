/* Weight products for the native backend: the GGUF's 4- and 8-bit blocks times 8-bit activations.
 *
 * Activations are quantized per row and per block of 32 (int8 values, a float scale dx and the
 * block's integer sum, as llama.cpp's Q8_1), weights stay exactly the file's blocks:
 *   Q4_1  w = d q + m   (q 0..15):   sum w x = dx (d S(q xq) + m S(xq))
 *   Q4_0  w = d (q - 8):              stored as Q4_1 with m = -8 d (exact in float16)
 *   Q8_0  w = d q       (q -128..127): sum w x = dx d S(q xq)
 * Both kinds are stored as unsigned bytes u (Q4: q; Q8: q + 128), because vpdpbusd multiplies
 * unsigned by signed bytes: one integer product S(u xq) serves both, and for Q8
 * S(q xq) = S(u xq) - 128 S(xq), the activations' block sum being at hand already.
 * The integer sums are exact, so how they are grouped cannot matter; the float part is one
 * fixed sequence per (row, output, block), blocks in order:
 *   Q4: t = fma(d, S, m * sum_x);  Q8: t = d * S;  then acc = fma(t, dx, acc)
 * with explicit fused multiply-adds (one rounding each, on every path) and no other
 * contraction. The AVX512-VNNI path and the portable path below compute the same integers and
 * the same float operations, so they give the same bits, and neither depends on how many rows a
 * call carries or how they are grouped into passes: rows are independent all the way through.
 *
 * Weight layout, per tile of 16 outputs and block of 32 inputs (`pack` in native_weights.py):
 * Q4: 4 x 64 bytes; byte 4c + j of part p holds input 8p + j (low nibble) and 8p + 4 + j (high
 *     nibble) of output c; then 16 float16 d and 16 float16 m.
 * Q8: 8 x 64 bytes; byte 4c + j of part g holds q + 128 of input 4g + j of output c; then 16
 *     float16 d.
 * Either way "group" g (inputs 4g..4g+3) is 64 bytes, 4 per output: one vpdpbusd operand.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VNNI 1
#endif

#define TILE 16
#define GROUPS 8   /* groups of 4 inputs per block of 32 */
#define MAX_PASS 8 /* rows per pass over a tile: each block's weights are decoded once for them */
#define PREFETCH 8 /* blocks ahead: a call's weights come from memory, rarely from cache */
#define INLINE static inline __attribute__((always_inline))

enum { Q4 = 0, Q8 = 1 }; /* layers.c's Matrix.kind */

static inline size_t block_bytes(int kind) { return kind == Q8 ? 8 * 64 + TILE * 2 : 4 * 64 + 2 * TILE * 2; }

typedef struct {
    const int8_t *q;   /* (rows, k) */
    const float *dx;   /* (rows, k / 32) */
    const int32_t *sx; /* (rows, k / 32) */
    int k, blocks;
} Activations;

/* One block of 32: xq = round(x * 127 / amax), dx = amax / 127, sx = sum of xq. The AVX-512 version
 * does the same IEEE operations per value (max is exact and ignores a NaN the same way, the
 * rounding is the same multiply, add and subtract), so it gives the same bytes. */
static const float SHIFTER = 12582912.0f; /* adding and subtracting 1.5 * 2^23 rounds to nearest even */

#ifndef __AVX512F__
static inline void quantize_block(const float *v, int8_t *q, float *dx, int32_t *sx) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < 32; i++) {
        float rounded = (v[i] * inv + SHIFTER) - SHIFTER;
        q[i] = (int8_t)rounded;
        sum += q[i];
    }
    *dx = amax / 127.0f;
    *sx = sum;
}
#else
static inline void quantize_block(const float *v, int8_t *q, float *dx, int32_t *sx) {
    __m512 lo = _mm512_loadu_ps(v), hi = _mm512_loadu_ps(v + 16);
    /* max(x, m) returns m when x is NaN, as the scalar comparison does */
    __m512 m = _mm512_max_ps(_mm512_abs_ps(hi), _mm512_max_ps(_mm512_abs_ps(lo), _mm512_setzero_ps()));
    float amax = _mm512_reduce_max_ps(m);
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m512 scale = _mm512_set1_ps(inv), shift = _mm512_set1_ps(SHIFTER);
    __m512i a = _mm512_cvttps_epi32(_mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(lo, scale), shift), shift));
    __m512i b = _mm512_cvttps_epi32(_mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(hi, scale), shift), shift));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(a));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(b));
    *dx = amax / 127.0f;
    *sx = _mm512_reduce_add_epi32(_mm512_add_epi32(a, b));
}
#endif

void quantize_q8(const float *x, int rows, int k, int8_t *xq, float *dx, int32_t *sx) {
    long blocks = (long)rows * (k / 32);
    /* blocks are independent: a split across threads (kernels.h, ROWS_PARALLEL) changes no byte */
#pragma omp parallel for schedule(static) if (rows >= ROWS_PARALLEL)
    for (long i = 0; i < blocks; i++) quantize_block(x + 32 * i, xq + 32 * i, dx + i, sx + i);
}

#ifdef VNNI
typedef __m512 Acc; /* one row's 16 outputs */

INLINE __m512 halves(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* Rows r0.. r0 + R - 1 through one block: its weights unpacked once into the 8 group vectors, then
 * per row 8 vpdpbusd and the float sequence of the header. R is a constant at every call
 * (tile_pass), so the row loops unroll and the accumulators live in registers. */
INLINE void block_step(const uint8_t *part, int kind, const Activations *a, int r0, const int R, int b,
                       Acc *acc) {
    __m512i w[GROUPS];
    __m512 d, m = _mm512_setzero_ps();
    if (kind == Q8) {
        for (int g = 0; g < GROUPS; g++) w[g] = _mm512_loadu_si512(part + 64 * g);
        d = halves(part + 512);
    } else {
        const __m512i low = _mm512_set1_epi8(0x0F);
        for (int p = 0; p < 4; p++) {
            __m512i v = _mm512_loadu_si512(part + 64 * p);
            w[2 * p] = _mm512_and_si512(v, low);
            w[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        d = halves(part + 256);
        m = halves(part + 256 + 2 * TILE);
    }
    __m512i s[MAX_PASS];
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) s[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int g = 0; g < GROUPS; g++) {
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) {
            int32_t four;
            memcpy(&four, a->q + (size_t)(r0 + i) * a->k + 32 * b + 4 * g, 4);
            s[i] = _mm512_dpbusd_epi32(s[i], w[g], _mm512_set1_epi32(four));
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) {
        size_t at = (size_t)(r0 + i) * a->blocks + b;
        __m512 term;
        if (kind == Q8)
            term = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(s[i], _mm512_set1_epi32(128 * a->sx[at]))));
        else
            term = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(m, _mm512_set1_ps((float)a->sx[at])));
        acc[i] = _mm512_fmadd_ps(term, _mm512_set1_ps(a->dx[at]), acc[i]);
    }
}

INLINE void acc_zero(Acc *acc) { *acc = _mm512_setzero_ps(); }
INLINE void acc_store(const Acc *acc, float *out, int width) {
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << width) - 1), *acc);
}

#else
typedef struct {
    float v[TILE];
} Acc;

static inline float half_to_float(uint16_t h) {
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}

/* The same integers and float operations as the VNNI block_step, in plain C that the compiler
 * vectorises for whatever the CPU has. */
INLINE void block_step(const uint8_t *part, int kind, const Activations *a, int r0, const int R, int b,
                       Acc *acc) {
    const uint8_t *scales = part + (kind == Q8 ? 512 : 256);
    float d[TILE], m[TILE];
    for (int c = 0; c < TILE; c++) {
        uint16_t h;
        memcpy(&h, scales + 2 * c, 2);
        d[c] = half_to_float(h);
        m[c] = 0.0f;
        if (kind == Q4) { /* Q8 blocks have no m: the next bytes are the next block's */
            memcpy(&h, scales + 2 * TILE + 2 * c, 2);
            m[c] = half_to_float(h);
        }
    }
    for (int i = 0; i < R; i++) {
        const int8_t *x = a->q + (size_t)(r0 + i) * a->k + 32 * b;
        size_t at = (size_t)(r0 + i) * a->blocks + b;
        float scale = a->dx[at], sum_x = (float)a->sx[at];
        for (int c = 0; c < TILE; c++) {
            int32_t s = 0; /* S(u xq), in the loop shapes the compiler vectorises best */
            if (kind == Q8)
                for (int g = 0; g < GROUPS; g++)
                    for (int j = 0; j < 4; j++) s += part[64 * g + 4 * c + j] * x[4 * g + j];
            else
                for (int p = 0; p < 4; p++)
                    for (int j = 0; j < 4; j++) {
                        uint8_t byte = part[64 * p + 4 * c + j];
                        s += (byte & 0x0F) * x[8 * p + j] + (byte >> 4) * x[8 * p + 4 + j];
                    }
            float term = kind == Q8 ? d[c] * (float)(s - 128 * a->sx[at]) : fmaf(d[c], (float)s, m[c] * sum_x);
            acc[i].v[c] = fmaf(term, scale, acc[i].v[c]);
        }
    }
}

INLINE void acc_zero(Acc *acc) { memset(acc, 0, sizeof *acc); }
INLINE void acc_store(const Acc *acc, float *out, int width) { memcpy(out, acc->v, sizeof(float) * width); }
#endif

/* Rows r0 .. r0 + R - 1 against one tile of 16 outputs, over every block in order. */
INLINE void tile_pass(const uint8_t *tile, int kind, const Activations *a, int r0, const int R, float *out,
                      int n, int width) {
    Acc acc[MAX_PASS];
    size_t bytes = block_bytes(kind);
    for (int i = 0; i < R; i++) acc_zero(&acc[i]);
    for (int b = 0; b < a->blocks; b++) {
        const uint8_t *part = tile + b * bytes;
        /* past the last block this prefetches beyond the matrix: harmless, a prefetch never faults */
        for (size_t line = 0; line < bytes; line += 64) __builtin_prefetch(part + PREFETCH * bytes + line);
        block_step(part, kind, a, r0, R, b, acc);
    }
    for (int i = 0; i < R; i++) acc_store(&acc[i], out + (size_t)(r0 + i) * n, width);
}

/* One instance of tile_pass per kind and row count, so each gets its own registers and unrolled
 * loops without a branch inside. */
static void tile_rows(const uint8_t *tile, int kind, const Activations *a, int r0, int R, float *out, int n,
                      int width) {
    switch (R) {
#define PASS(rows)                                                 \
    case rows:                                                     \
        if (kind == Q8)                                            \
            tile_pass(tile, Q8, a, r0, rows, out, n, width);       \
        else                                                       \
            tile_pass(tile, Q4, a, r0, rows, out, n, width);       \
        break;
        PASS(1) PASS(2) PASS(3) PASS(4) PASS(5) PASS(6) PASS(7) PASS(8)
#undef PASS
    }
}

/* out (rows, n) = activations times a matrix of `kind` (stored with n padded up to a multiple of
 * 16). Threads take whole tiles; a tile's rows go in passes of equal size (9 rows: 5 + 4, not
 * 8 + 1), each pass re-reading the tile's few kilobytes from cache rather than memory. */
void gemm_blocks(const int8_t *xq, const float *dx, const int32_t *sx, int rows, int k, const uint8_t *w,
                 int kind, int n, float *out) {
    Activations a = {xq, dx, sx, k, k / 32};
    int tiles = (n + TILE - 1) / TILE, passes = (rows + MAX_PASS - 1) / MAX_PASS;
    size_t tile_bytes = (size_t)a.blocks * block_bytes(kind);
#pragma omp parallel for schedule(static)
    for (int t = 0; t < tiles; t++) {
        int width = n - t * TILE < TILE ? n - t * TILE : TILE; /* the last tile may be padding */
        for (int p = 0, r0 = 0; p < passes; p++) {
            int rn = (rows - r0) / (passes - p);
            tile_rows(w + (size_t)t * tile_bytes, kind, &a, r0, rn, out + (size_t)t * TILE, n, width);
            r0 += rn;
        }
    }
}

/* Which path this build took (printed by `bench model` and `status`). */
int has_vnni(void) {
#ifdef VNNI
    return 1;
#else
    return 0;
#endif
}
