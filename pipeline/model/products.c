/* Weight products for the native backend: the GGUF's 4- and 8-bit blocks times 8-bit activations.
 *
 * Activations are quantized per row and per block of 32 (int8 values, a float scale dx and the
 * block's integer sum, as llama.cpp's Q8_1), weights stay exactly the file's blocks:
 *   Q4_1  w = d q + m   (q 0..15):   sum w x = dx (d S(q xq) + m S(xq))
 *   Q4_0  w = d (q - 8):              stored as Q4_1 with m = -8 d (exact in float16)
 *   Q8_0  w = d q       (q -128..127): sum w x = dx d S(q xq)
 * The integer sums are exact, so how they are grouped cannot matter; the float part is one
 * fixed sequence per (row, output, block): t = fma(d, S, m * sum_x); acc = fma(t, dx, acc), blocks
 * in order, with explicit fused multiply-adds (one rounding each, on every path) and no other
 * contraction. The AVX512-VNNI path and the portable path below compute the
 * same integers and the same float operations, so they give the same bits, and neither depends
 * on how many rows a call carries: rows are independent all the way through.
 *
 * Weight layout, per tile of 16 outputs and block of 32 inputs (`pack_q4` in native_weights.py):
 * Q4: 4 x 64 bytes; byte 4c + j of part p holds input 8p + j (low nibble) and 8p + 4 + j (high
 *     nibble) of output c; then 16 float16 d and 16 float16 m.
 * Q8: 8 x 64 bytes; byte 4c + j of part g holds input 4g + j of output c; then 16 float16 d.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define VNNI 1
#endif

#define TILE 16
#define ROWS_PER_PASS 8

static inline float half_to_float(uint16_t h) {
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}

/* Per row and block of 32: xq = round(x * 127 / amax), dx = amax / 127, sx = sum of xq. */
void quantize_q8(const float *x, int rows, int k, int8_t *xq, float *dx, int32_t *sx) {
    const float shifter = 12582912.0f; /* adding and subtracting 1.5 * 2^23 rounds to nearest even */
    int blocks = k / 32;
    for (int r = 0; r < rows; r++) {
        for (int b = 0; b < blocks; b++) {
            const float *v = x + (size_t)r * k + b * 32;
            int8_t *q = xq + (size_t)r * k + b * 32;
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
            float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int32_t sum = 0;
            for (int i = 0; i < 32; i++) {
                float rounded = (v[i] * inv + shifter) - shifter;
                q[i] = (int8_t)rounded;
                sum += q[i];
            }
            dx[(size_t)r * blocks + b] = amax / 127.0f;
            sx[(size_t)r * blocks + b] = sum;
        }
    }
}

#ifdef VNNI
static inline void q4_weights(const uint8_t *part, __m512i w[8]) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int p = 0; p < 4; p++) {
        __m512i v = _mm512_loadu_si512(part + 64 * p);
        w[2 * p] = _mm512_and_si512(v, low);
        w[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
}
#endif

/* out (rows, n) = activations times a Q4_1-form matrix (stored with n padded up to a multiple of 16). */
void gemm_q4(const int8_t *xq, const float *dx, const int32_t *sx, int rows, int k, const uint8_t *w,
             int n, float *out) {
    int blocks = k / 32, tiles = (n + TILE - 1) / TILE;
    size_t tile_block = 4 * 64 + 2 * TILE * 2; /* nibbles, d, m */
#pragma omp parallel for schedule(static)
    for (int t = 0; t < tiles; t++) {
        for (int r0 = 0; r0 < rows; r0 += ROWS_PER_PASS) {
            int rn = rows - r0 < ROWS_PER_PASS ? rows - r0 : ROWS_PER_PASS;
            float acc[ROWS_PER_PASS][TILE];
            memset(acc, 0, sizeof acc);
            for (int b = 0; b < blocks; b++) {
                const uint8_t *part = w + ((size_t)t * blocks + b) * tile_block;
                const uint16_t *hd = (const uint16_t *)(part + 256), *hm = hd + TILE;
#ifdef VNNI
                __m512i wv[8];
                q4_weights(part, wv);
                __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)hd));
                __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)hm));
#else
                float d[TILE], m[TILE];
                for (int c = 0; c < TILE; c++) {
                    d[c] = half_to_float(hd[c]);
                    m[c] = half_to_float(hm[c]);
                }
#endif
                for (int i = 0; i < rn; i++) {
                    int r = r0 + i;
                    const int8_t *xb = xq + (size_t)r * k + b * 32;
                    float scale = dx[(size_t)r * blocks + b], sum_x = (float)sx[(size_t)r * blocks + b];
#ifdef VNNI
                    __m512i s = _mm512_setzero_si512();
                    for (int g = 0; g < 8; g++) {
                        int32_t four;
                        memcpy(&four, xb + 4 * g, 4);
                        s = _mm512_dpbusd_epi32(s, wv[g], _mm512_set1_epi32(four));
                    }
                    __m512 term = _mm512_fmadd_ps(dv, _mm512_cvtepi32_ps(s), _mm512_mul_ps(mv, _mm512_set1_ps(sum_x)));
                    __m512 a = _mm512_loadu_ps(acc[i]);
                    _mm512_storeu_ps(acc[i], _mm512_fmadd_ps(term, _mm512_set1_ps(scale), a));
#else
                    for (int c = 0; c < TILE; c++) {
                        int32_t s = 0;
                        for (int p = 0; p < 4; p++)
                            for (int j = 0; j < 4; j++) {
                                uint8_t byte = part[64 * p + 4 * c + j];
                                s += (byte & 0x0F) * xb[8 * p + j] + (byte >> 4) * xb[8 * p + 4 + j];
                            }
                        float term = fmaf(d[c], (float)s, m[c] * sum_x);
                        acc[i][c] = fmaf(term, scale, acc[i][c]);
                    }
#endif
                }
            }
            int width = n - t * TILE < TILE ? n - t * TILE : TILE; /* the last tile may be padding */
            for (int i = 0; i < rn; i++) memcpy(out + (size_t)(r0 + i) * n + t * TILE, acc[i], sizeof(float) * width);
        }
    }
}

/* out (rows, n) = activations times a Q8_0 matrix. vpdpbusd multiplies unsigned by signed bytes,
 * so the activations go in as xq + 128 and 128 * S(q) comes back out: exact integers either way. */
void gemm_q8(const int8_t *xq, const float *dx, int rows, int k, const uint8_t *w, int n, float *out) {
    int blocks = k / 32, tiles = (n + TILE - 1) / TILE;
    size_t tile_block = 8 * 64 + TILE * 2;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < tiles; t++) {
        for (int r0 = 0; r0 < rows; r0 += ROWS_PER_PASS) {
            int rn = rows - r0 < ROWS_PER_PASS ? rows - r0 : ROWS_PER_PASS;
            float acc[ROWS_PER_PASS][TILE];
            memset(acc, 0, sizeof acc);
            for (int b = 0; b < blocks; b++) {
                const uint8_t *part = w + ((size_t)t * blocks + b) * tile_block;
                const uint16_t *hd = (const uint16_t *)(part + 512);
#ifndef VNNI
                float d[TILE];
                for (int c = 0; c < TILE; c++) d[c] = half_to_float(hd[c]);
#else
                __m512i wv[8], wsum = _mm512_setzero_si512();
                const __m512i ones = _mm512_set1_epi8(1);
                for (int g = 0; g < 8; g++) {
                    wv[g] = _mm512_loadu_si512(part + 64 * g);
                    wsum = _mm512_dpbusd_epi32(wsum, ones, wv[g]);
                }
                wsum = _mm512_slli_epi32(wsum, 7);
                __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)hd));
#endif
                for (int i = 0; i < rn; i++) {
                    int r = r0 + i;
                    const int8_t *xb = xq + (size_t)r * k + b * 32;
                    float scale = dx[(size_t)r * blocks + b];
#ifdef VNNI
                    __m512i s = _mm512_setzero_si512();
                    for (int g = 0; g < 8; g++) {
                        uint32_t four;
                        memcpy(&four, xb + 4 * g, 4);
                        s = _mm512_dpbusd_epi32(s, _mm512_set1_epi32((int32_t)(four ^ 0x80808080u)), wv[g]);
                    }
                    s = _mm512_sub_epi32(s, wsum);
                    __m512 term = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(s));
                    __m512 a = _mm512_loadu_ps(acc[i]);
                    _mm512_storeu_ps(acc[i], _mm512_fmadd_ps(term, _mm512_set1_ps(scale), a));
#else
                    for (int c = 0; c < TILE; c++) {
                        int32_t s = 0;
                        for (int g = 0; g < 8; g++)
                            for (int j = 0; j < 4; j++) s += (int8_t)part[64 * g + 4 * c + j] * xb[4 * g + j];
                        float term = d[c] * (float)s;
                        acc[i][c] = fmaf(term, scale, acc[i][c]);
                    }
#endif
                }
            }
            int width = n - t * TILE < TILE ? n - t * TILE : TILE; /* the last tile may be padding */
            for (int i = 0; i < rn; i++) memcpy(out + (size_t)(r0 + i) * n + t * TILE, acc[i], sizeof(float) * width);
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
