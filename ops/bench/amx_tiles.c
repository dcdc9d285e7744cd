/* What AMX-INT8 tiles could save the native products, measured: `python ops/bench/amx_bound.py`.
 *
 * The native products need an exact integer sum per (row, output, block of 32 inputs), because
 * every block has its own float16 weight scale and activation scale (products.c). With tiles, a
 * block's sums for 16 rows x 16 outputs come from one TDPBSUD with K = 32 into an int32 tile that
 * must then be stored (TILESTORED) for the float sequence to read: per block, not once per
 * product as in an int8 GEMM with one scale per tensor (what oneDNN's flat M=1..16 times measure).
 * This times each tile instruction in a loop over 64 independent blocks (hot in L1: the best
 * case); amx_bound.py sets the result beside what a row costs the VNNI products. Prints one JSON
 * object.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int8_t activations[16 * 4096] __attribute__((aligned(64)));
static uint8_t weights[64][512] __attribute__((aligned(64)));
static int32_t sums[64][256] __attribute__((aligned(64)));

#define N 2000000L

int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
        printf("{\"error\": \"the kernel refused the AMX tile state\"}\n");
        return 1;
    }
    memset(weights, 3, sizeof weights);
    memset(activations, 1, sizeof activations);
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = 16, cfg.colsb[0] = 64; /* sums: 16 rows x 16 int32 */
    cfg.rows[1] = 16, cfg.colsb[1] = 32; /* activations: 16 rows x 32 int8 */
    cfg.rows[2] = 8, cfg.colsb[2] = 64;  /* weights: 8 groups of 4 inputs x 16 outputs */
    _tile_loadconfig(&cfg);
    double t0 = now();
    for (long i = 0; i < N; i++) {
        int j = i & 63;
        _tile_loadd(2, weights[j], 64);
        _tile_loadd(1, activations + 32 * (j & 7), 4096);
        _tile_zero(0);
        _tile_dpbsud(0, 1, 2);
        _tile_stored(0, sums[j], 64);
    }
    double block = (now() - t0) / N;
    t0 = now();
    for (long i = 0; i < N; i++) _tile_dpbsud(0, 1, 2);
    double dp = (now() - t0) / N;
    t0 = now();
    for (long i = 0; i < N; i++) _tile_stored(0, sums[i & 63], 64);
    double store = (now() - t0) / N;
    _tile_release();
    printf("{\"tile_block_ns\": %.3f, \"tdpbsud_ns\": %.3f, \"tilestored_ns\": %.3f, \"amx_per_row_block_ns\": %.3f}\n",
           block * 1e9, dp * 1e9, store * 1e9, block * 1e9 / 16);
    return 0;
}
