/* Weight products for the native backend: the GGUF's blocks times 8-bit activations.
 *
 * Activations are quantized per row and per block of 32 (int8 values xq, a float scale dx, the
 * block's integer sum sx and the sum sh of its first 16 values, as llama.cpp's Q8_1), weights
 * stay exactly the file's values. Every kind is held as unsigned integers u, because vpdpbusd
 * multiplies unsigned by signed bytes, and one block's exact integer sums S(u xq) feed one fixed
 * float sequence per (row, output, block of 32), blocks in order:
 *   Q4_0  w = d (u - 8):         A = d, B = -8 d (exact in float16): stored in the Q4_1 form
 *   Q4_1  w = d u + m:           A = d, B = m
 *   Q5_0  w = d (u - 16):        A = d, B = -16 d (exact in float16), u 0..31
 *   Q5_1  w = d u + m:           A = d, B = m, u 0..31
 *   Q4_K  w = d sc u - dmin mn:  A = d sc, B = -(dmin mn), both exact in float32 (11-bit float16
 *                                mantissas times 6-bit integers), per sub-block of 32
 *   Q5_K  as Q4_K, u 0..31
 *     all of these:  t = fma(A, S, B * sx)
 *   Q8_0  w = d (u - 128):       t = d * (S - 128 sx)              (integers: exact)
 *   Q6_K  w = d sc (u - 32), sc an int8 per 16 values, u 0..63: with the halves' sums S1, S2,
 *         t1 = S1 - 32 sh, t2 = S2 - 32 (sx - sh) (exact), A1 = d sc1, A2 = d sc2 (exact),
 *         t = fma(A2, t2, A1 * t1)
 *   then acc = fma(t, dx, acc)
 * with explicit fused multiply-adds (one rounding each, on every path) and no other contraction.
 * The AVX512-VNNI path and the portable path below compute the same integers and the same float
 * operations, so they give the same bits, and neither depends on how many rows a call carries or
 * how they are grouped into passes: rows are independent all the way through.
 *
 * Weight layout, per tile of 16 outputs (`pack` in native_weights.py). A "group" g (inputs
 * 4g..4g+3 of a block) is 64 bytes, 4 per output: byte 4c + j holds input 4g + j of output c, one
 * vpdpbusd operand. A block's values:
 *   4-bit: 4 x 64 bytes; part p holds group 2p in its low nibbles and group 2p + 1 in its high;
 *   5-bit: the 4-bit nibbles, then 64 bytes whose bit g is the fifth bit of group g's byte;
 *   6-bit: the 4-bit nibbles, then 2 x 64 bytes; bits 2j, 2j + 1 of vector h hold bits 4 and 5
 *          of group 4h + j's byte;
 *   8-bit: 8 x 64 bytes of u.
 * Per-block kinds (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0): each block is its values, then 16 float16 d and (not
 * Q8_0) 16 float16 B. K kinds, per super-block of 8 blocks: the 8 blocks' values, then
 *   Q4_K/Q5_K: sc and mn (8 x 16 bytes each, block-major), d and dmin (16 float16 each);
 *   Q6_K: sc (8 blocks x 2 halves x 16 int8), d (16 float16).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "kernels.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VNNI 1
#endif

#define TILE 16
#define GROUPS 8   /* groups of 4 inputs per block of 32 */
#define SUPER 8    /* blocks of 32 per K super-block of 256 */
#define MAX_PASS 8 /* rows per pass over a tile: each block's weights are decoded once for them */
#define PREFETCH 8 /* blocks ahead: a call's weights come from memory, rarely from cache */
#define INLINE static inline __attribute__((always_inline))

/* layers.c's Matrix.kind and native_weights.KINDS */
enum { Q4 = 0, Q8 = 1, Q5 = 2, Q4K = 3, Q5K = 4, Q6K = 5 };

INLINE int value_bits(int kind) {
    return kind == Q8 ? 8 : kind == Q6K ? 6 : (kind == Q5 || kind == Q5K) ? 5 : 4;
}
INLINE int is_super(int kind) { return kind >= Q4K; }
/* Bytes of one block's values. */
INLINE size_t value_bytes(int kind) { return (size_t)GROUPS * 64 * value_bits(kind) / 8; }
/* Bytes of one unit: a block (per-block kinds) or a super-block (K kinds), scales included. */
static inline size_t unit_bytes(int kind) {
    switch (kind) {
    case Q4: return 256 + 2 * TILE * 2;
    case Q8: return 512 + TILE * 2;
    case Q5: return 320 + 2 * TILE * 2;
    case Q4K: return SUPER * 256 + 2 * SUPER * TILE + 2 * TILE * 2;
    case Q5K: return SUPER * 320 + 2 * SUPER * TILE + 2 * TILE * 2;
    default: return SUPER * 384 + 2 * SUPER * TILE + TILE * 2; /* Q6K */
    }
}

typedef struct {
    const int8_t *q;   /* (rows, k) */
    const float *dx;   /* (rows, k / 32) */
    const int32_t *sx; /* (rows, k / 32) */
    const int32_t *sh; /* (rows, k / 32): the sum of each block's first 16 values */
    int k, blocks;
    int once; /* the weights are read once (gemm_blocks' `streamed`, one pass): prefetched non-temporally */
} Activations;

/* One block of 32: xq = round(x * 127 / amax), dx = amax / 127, sx = sum of xq, sh = sum of the
 * first 16. The AVX-512 version does the same IEEE operations per value (max is exact and ignores
 * a NaN the same way, the rounding is the same multiply, add and subtract), so it gives the same
 * bytes. */
static const float SHIFTER = 12582912.0f; /* adding and subtracting 1.5 * 2^23 rounds to nearest even */

#ifndef __AVX512F__
static inline void quantize_block(const float *v, int8_t *q, float *dx, int32_t *sx, int32_t *sh) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0, half = 0;
    for (int i = 0; i < 32; i++) {
        float rounded = (v[i] * inv + SHIFTER) - SHIFTER;
        q[i] = (int8_t)rounded;
        sum += q[i];
        if (i < 16) half += q[i];
    }
    *dx = amax / 127.0f;
    *sx = sum;
    *sh = half;
}
#else
static inline void quantize_block(const float *v, int8_t *q, float *dx, int32_t *sx, int32_t *sh) {
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
    *sh = _mm512_reduce_add_epi32(a);
    *sx = _mm512_reduce_add_epi32(_mm512_add_epi32(a, b));
}
#endif

void quantize_q8(const float *x, int rows, int k, int8_t *xq, float *dx, int32_t *sx, int32_t *sh) {
    long blocks = (long)rows * (k / 32);
    /* blocks are independent: a split across threads (kernels.h, ROWS_PARALLEL) changes no byte */
#pragma omp parallel for schedule(static) if (rows >= ROWS_PARALLEL)
    for (long i = 0; i < blocks; i++) quantize_block(x + 32 * i, xq + 32 * i, dx + i, sx + i, sh + i);
}

/* One block's scales for its 16 outputs, whatever the kind: the header's A and B (Q6_K: A1, A2). */
#ifdef VNNI
typedef __m512 Scale;
typedef __m512 Acc; /* one row's 16 outputs */

INLINE __m512 halves(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
INLINE __m512 bytes_u(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p))); }
INLINE __m512 bytes_s(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
INLINE Scale scale_mul(Scale a, Scale b) { return _mm512_mul_ps(a, b); }
INLINE Scale scale_neg(Scale a) { return _mm512_sub_ps(_mm512_setzero_ps(), a); }

/* A block's values as the 8 group vectors of unsigned bytes. */
INLINE void unpack_values(const uint8_t *v, int kind, __m512i *w) {
    if (kind == Q8) {
        for (int g = 0; g < GROUPS; g++) w[g] = _mm512_loadu_si512(v + 64 * g);
        return;
    }
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int p = 0; p < 4; p++) {
        __m512i n = _mm512_loadu_si512(v + 64 * p);
        w[2 * p] = _mm512_and_si512(n, low);
        w[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(n, 4), low);
    }
    if (value_bits(kind) == 5) { /* bit g of the plane's byte becomes bit 4 of group g's byte */
        const __m512i bit = _mm512_set1_epi8(0x10);
        __m512i h = _mm512_loadu_si512(v + 256);
        w[0] = _mm512_or_si512(w[0], _mm512_and_si512(_mm512_slli_epi16(h, 4), bit));
        w[1] = _mm512_or_si512(w[1], _mm512_and_si512(_mm512_slli_epi16(h, 3), bit));
        w[2] = _mm512_or_si512(w[2], _mm512_and_si512(_mm512_slli_epi16(h, 2), bit));
        w[3] = _mm512_or_si512(w[3], _mm512_and_si512(_mm512_slli_epi16(h, 1), bit));
        w[4] = _mm512_or_si512(w[4], _mm512_and_si512(h, bit));
        w[5] = _mm512_or_si512(w[5], _mm512_and_si512(_mm512_srli_epi16(h, 1), bit));
        w[6] = _mm512_or_si512(w[6], _mm512_and_si512(_mm512_srli_epi16(h, 2), bit));
        w[7] = _mm512_or_si512(w[7], _mm512_and_si512(_mm512_srli_epi16(h, 3), bit));
    } else if (value_bits(kind) == 6) { /* bits 2j, 2j + 1 of plane h become bits 4, 5 of group 4h + j */
        const __m512i bits = _mm512_set1_epi8(0x30);
        for (int hv = 0; hv < 2; hv++) {
            __m512i h = _mm512_loadu_si512(v + 256 + 64 * hv);
            __m512i *g = w + 4 * hv;
            g[0] = _mm512_or_si512(g[0], _mm512_and_si512(_mm512_slli_epi16(h, 4), bits));
            g[1] = _mm512_or_si512(g[1], _mm512_and_si512(_mm512_slli_epi16(h, 2), bits));
            g[2] = _mm512_or_si512(g[2], _mm512_and_si512(h, bits));
            g[3] = _mm512_or_si512(g[3], _mm512_and_si512(_mm512_srli_epi16(h, 2), bits));
        }
    }
}

/* Rows r0 .. r0 + R - 1 through one block whose values and scales are at hand: 8 vpdpbusd per row
 * into two sums of 4 groups (Q6_K's halves), then the header's float sequence. R is a constant at
 * every call (tile_pass), so the row loops unroll and the accumulators live in registers. Two
 * sums per row also halve the chain of dependent vpdpbusd that bounds a pass of few rows (one
 * decoding token); the integer sum of the two is the same whatever the grouping. With more rows
 * the chains of different rows overlap anyway, and the registers are needed elsewhere. */
INLINE void block_rows(const uint8_t *values, int kind, Scale A, Scale B, const Activations *a, int r0,
                       const int R, int b, Acc *acc) {
    __m512i w[GROUPS];
    unpack_values(values, kind, w);
    __m512i s[MAX_PASS], s2[MAX_PASS];
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) s[i] = s2[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int g = 0; g < GROUPS; g++) {
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) {
            int32_t four;
            memcpy(&four, a->q + (size_t)(r0 + i) * a->k + 32 * b + 4 * g, 4);
            if ((kind == Q6K || R <= 4) && g >= 4)
                s2[i] = _mm512_dpbusd_epi32(s2[i], w[g], _mm512_set1_epi32(four));
            else
                s[i] = _mm512_dpbusd_epi32(s[i], w[g], _mm512_set1_epi32(four));
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) {
        size_t at = (size_t)(r0 + i) * a->blocks + b;
        __m512 term;
        if (kind == Q8) {
            __m512i sum = R <= 4 ? _mm512_add_epi32(s[i], s2[i]) : s[i];
            term = _mm512_mul_ps(A, _mm512_cvtepi32_ps(_mm512_sub_epi32(sum, _mm512_set1_epi32(128 * a->sx[at]))));
        } else if (kind == Q6K) {
            __m512 t1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(s[i], _mm512_set1_epi32(32 * a->sh[at])));
            __m512 t2 = _mm512_cvtepi32_ps(_mm512_sub_epi32(s2[i], _mm512_set1_epi32(32 * (a->sx[at] - a->sh[at]))));
            term = _mm512_fmadd_ps(B, t2, _mm512_mul_ps(A, t1));
        } else {
            __m512i sum = R <= 4 ? _mm512_add_epi32(s[i], s2[i]) : s[i];
            term = _mm512_fmadd_ps(A, _mm512_cvtepi32_ps(sum), _mm512_mul_ps(B, _mm512_set1_ps((float)a->sx[at])));
        }
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
} Scale;
typedef Scale Acc;

static inline float half_to_float(uint16_t h) {
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}
INLINE Scale halves(const uint8_t *p) {
    Scale s;
    for (int c = 0; c < TILE; c++) {
        uint16_t h;
        memcpy(&h, p + 2 * c, 2);
        s.v[c] = half_to_float(h);
    }
    return s;
}
INLINE Scale bytes_u(const uint8_t *p) {
    Scale s;
    for (int c = 0; c < TILE; c++) s.v[c] = (float)p[c];
    return s;
}
INLINE Scale bytes_s(const uint8_t *p) {
    Scale s;
    for (int c = 0; c < TILE; c++) s.v[c] = (float)(int8_t)p[c];
    return s;
}
INLINE Scale scale_mul(Scale a, Scale b) {
    for (int c = 0; c < TILE; c++) a.v[c] *= b.v[c];
    return a;
}
INLINE Scale scale_neg(Scale a) {
    for (int c = 0; c < TILE; c++) a.v[c] = 0.0f - a.v[c];
    return a;
}

/* Output c's value u for input i of a block (the layout of the header). */
INLINE int value_at(const uint8_t *v, int kind, int c, int i) {
    int g = i / 4, j = i % 4;
    if (kind == Q8) return v[64 * g + 4 * c + j];
    uint8_t byte = v[64 * (g / 2) + 4 * c + j];
    int u = g % 2 ? byte >> 4 : byte & 0x0F;
    if (value_bits(kind) == 5) u |= ((v[256 + 4 * c + j] >> g) & 1) << 4;
    if (value_bits(kind) == 6) u |= ((v[256 + 64 * (g / 4) + 4 * c + j] >> (2 * (g % 4))) & 3) << 4;
    return u;
}

/* The same integers and float operations as the VNNI block_rows, in plain C that the compiler
 * vectorises for whatever the CPU has. */
INLINE void block_rows(const uint8_t *values, int kind, Scale A, Scale B, const Activations *a, int r0,
                       const int R, int b, Acc *acc) {
    uint8_t u[TILE][32];
    for (int c = 0; c < TILE; c++)
        for (int i = 0; i < 32; i++) u[c][i] = (uint8_t)value_at(values, kind, c, i);
    for (int r = 0; r < R; r++) {
        const int8_t *x = a->q + (size_t)(r0 + r) * a->k + 32 * b;
        size_t at = (size_t)(r0 + r) * a->blocks + b;
        float scale = a->dx[at], sum_x = (float)a->sx[at];
        for (int c = 0; c < TILE; c++) {
            int32_t s = 0, s2 = 0;
            for (int i = 0; i < 16; i++) s += u[c][i] * x[i];
            for (int i = 16; i < 32; i++) s2 += u[c][i] * x[i];
            float term;
            if (kind == Q8) {
                term = A.v[c] * (float)(s + s2 - 128 * a->sx[at]);
            } else if (kind == Q6K) {
                float t1 = (float)(s - 32 * a->sh[at]), t2 = (float)(s2 - 32 * (a->sx[at] - a->sh[at]));
                term = fmaf(B.v[c], t2, A.v[c] * t1);
            } else {
                term = fmaf(A.v[c], (float)(s + s2), B.v[c] * sum_x);
            }
            acc[r].v[c] = fmaf(term, scale, acc[r].v[c]);
        }
    }
}

INLINE void acc_zero(Acc *acc) { memset(acc, 0, sizeof *acc); }
INLINE void acc_store(const Acc *acc, float *out, int width) { memcpy(out, acc->v, sizeof(float) * width); }
#endif

/* The cache lines of `bytes` from p on, non-temporally where the weights are read once (`once`). */
INLINE void prefetch_lines(const uint8_t *p, size_t bytes, int once) {
    if (once)
        for (size_t line = 0; line < bytes; line += 64) __builtin_prefetch(p + line, 0, 0);
    else
        for (size_t line = 0; line < bytes; line += 64) __builtin_prefetch(p + line);
}

/* Rows r0 .. r0 + R - 1 against one tile of 16 outputs, over every block in order. */
INLINE void tile_pass(const uint8_t *tile, int kind, const Activations *a, int r0, const int R, float *out,
                      int ldo, int width) {
    Acc acc[MAX_PASS];
    size_t bytes = unit_bytes(kind), vbytes = value_bytes(kind);
    for (int i = 0; i < R; i++) acc_zero(&acc[i]);
    if (!is_super(kind)) {
        for (int b = 0; b < a->blocks; b++) {
            const uint8_t *part = tile + b * bytes;
            /* past the last block this prefetches beyond the matrix: harmless, a prefetch never faults */
            prefetch_lines(part + PREFETCH * bytes, bytes, a->once);
            Scale d = halves(part + vbytes), m = kind == Q8 ? d : halves(part + vbytes + 2 * TILE);
            block_rows(part, kind, d, m, a, r0, R, b, acc);
        }
    } else {
        for (int u = 0; u < a->blocks / SUPER; u++) {
            const uint8_t *unit = tile + u * bytes, *scales = unit + SUPER * vbytes;
            Scale d, dmin_neg;
            if (kind == Q6K) {
                d = halves(scales + 2 * SUPER * TILE);
                dmin_neg = d;
            } else {
                d = halves(scales + 2 * SUPER * TILE);
                dmin_neg = scale_neg(halves(scales + 2 * SUPER * TILE + 2 * TILE));
            }
            for (int j = 0; j < SUPER; j++) {
                const uint8_t *values = unit + j * vbytes;
                prefetch_lines(values + PREFETCH * vbytes, vbytes, a->once);
                Scale A, B;
                if (kind == Q6K) {
                    A = scale_mul(d, bytes_s(scales + 2 * TILE * j));
                    B = scale_mul(d, bytes_s(scales + 2 * TILE * j + TILE));
                } else {
                    A = scale_mul(d, bytes_u(scales + TILE * j));
                    B = scale_mul(dmin_neg, bytes_u(scales + SUPER * TILE + TILE * j));
                }
                block_rows(values, kind, A, B, a, r0, R, SUPER * u + j, acc);
            }
        }
    }
    for (int i = 0; i < R; i++) acc_store(&acc[i], out + (size_t)(r0 + i) * ldo, width);
}

/* One instance of tile_pass per kind and row count, so each gets its own registers and unrolled
 * loops without a branch inside. */
#define KIND_PASS(rows)                                                              \
    switch (kind) {                                                                  \
    case Q4: tile_pass(tile, Q4, a, r0, rows, out, ldo, width); break;               \
    case Q8: tile_pass(tile, Q8, a, r0, rows, out, ldo, width); break;               \
    case Q5: tile_pass(tile, Q5, a, r0, rows, out, ldo, width); break;               \
    case Q4K: tile_pass(tile, Q4K, a, r0, rows, out, ldo, width); break;             \
    case Q5K: tile_pass(tile, Q5K, a, r0, rows, out, ldo, width); break;             \
    default: tile_pass(tile, Q6K, a, r0, rows, out, ldo, width); break;              \
    }

static void tile_rows(const uint8_t *tile, int kind, const Activations *a, int r0, int R, float *out, int ldo,
                      int width) {
    switch (R) {
#define PASS(rows)       \
    case rows:           \
        KIND_PASS(rows); \
        break;
        PASS(1) PASS(2) PASS(3) PASS(4) PASS(5) PASS(6) PASS(7) PASS(8)
#undef PASS
    }
}

/* One tile's rows in passes of equal size (9 rows: 5 + 4, not 8 + 1), each pass re-reading the
 * tile's few kilobytes from cache rather than memory. */
static void tile_passes(const uint8_t *tile, int kind, const Activations *a, int rows, int passes, float *out,
                        int ldo, int width) {
    for (int p = 0, r0 = 0; p < passes; p++) {
        int rn = (rows - r0) / (passes - p);
        tile_rows(tile, kind, a, r0, rn, out, ldo, width);
        r0 += rn;
    }
}

#define CHUNK_BYTES 65536 /* about this much of the weights per claim of tiles */
#define MAX_SHARES 64

/* One thread's share of a product's tiles: next .. end - 1 not yet claimed. A cache line each, so
 * a thread's claims never move the line another thread is claiming from. */
typedef struct {
    int next, end;
    char pad[56];
} Share;

/* out (rows, n), rows ldo floats apart = activations times a matrix of `kind` (stored with n padded
 * up to a multiple of 16). Threads take whole tiles, so which thread computes a tile changes no bit.
 *
 * Each thread starts on its own contiguous share of the tiles, one stream of weights as a static
 * split gives, claiming a chunk at a time; one done with its share claims what is left of the
 * others'. Why not a static split: on these 2-core machines another process often takes a core for a
 * while in the middle of a forward, and a static split then leaves the other thread waiting at the
 * loop's end for the descheduled one's whole half. Why not dynamic chunks: the threads' claims
 * interleave across the matrix, and on the AMD VM a forward took 4% to 20% longer that way.
 *
 * `streamed`: the matrix belongs to weights read once a forward and larger than the caches (a target
 * model's). Where one pass reads each tile once, its blocks are prefetched non-temporally, so they
 * pass through without evicting what the next step reads again: the KV caches, and the few MB of a
 * draft head's weights (streamed 0), read between two target forwards. On the AMD VM a one-row forward
 * and a forward of 8 one-row sequences took 4-6% less time, and a prefill the same (docs/benchmarks.md,
 * kernel settings). With several passes a tile is read again from cache, so it is prefetched as
 * usual. */
void gemm_blocks(const int8_t *xq, const float *dx, const int32_t *sx, const int32_t *sh, int rows, int k,
                 const uint8_t *w, int kind, int n, float *out, int ldo, int streamed) {
    int tiles = (n + TILE - 1) / TILE, passes = (rows + MAX_PASS - 1) / MAX_PASS;
    Activations a = {xq, dx, sx, sh, k, k / 32, streamed && passes == 1};
    size_t tile_bytes = (size_t)(is_super(kind) ? a.blocks / SUPER : a.blocks) * unit_bytes(kind);
    int chunk = tile_bytes >= CHUNK_BYTES ? 1 : (int)(CHUNK_BYTES / tile_bytes);
    int shares = omp_get_max_threads();
    shares = shares < 1 ? 1 : shares > MAX_SHARES ? MAX_SHARES : shares;
    _Alignas(64) Share share[MAX_SHARES];
    for (int s = 0; s < shares; s++) {
        share[s].next = (int)((long)tiles * s / shares);
        share[s].end = (int)((long)tiles * (s + 1) / shares);
    }
    /* A team smaller than `shares` still covers every share: each thread goes round all of them. */
#pragma omp parallel
    {
        int first = omp_get_thread_num() % shares;
        for (int i = 0; i < shares; i++) {
            Share *from = &share[(first + i) % shares];
            for (;;) {
                int t0 = __atomic_fetch_add(&from->next, chunk, __ATOMIC_RELAXED);
                if (t0 >= from->end) break;
                int t1 = t0 + chunk < from->end ? t0 + chunk : from->end;
                for (int t = t0; t < t1; t++) {
                    int width = n - t * TILE < TILE ? n - t * TILE : TILE; /* the last tile may be padding */
                    tile_passes(w + (size_t)t * tile_bytes, kind, &a, rows, passes, out + (size_t)t * TILE, ldo,
                                width);
                }
            }
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
