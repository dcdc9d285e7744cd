/* A token from one float64 probability row by the inverse CDF: the same index as numpy's
 * `searchsorted(cumsum(p), u * cumsum(p)[-1], side="right")` (sampling.draw), with the same bits.
 *
 * numpy's cumsum adds the row in index order, one rounding an element; this does the same
 * additions, in the same order, in plain IEEE doubles (-ffp-contract=off, no -ffast-math), so every
 * partial sum is the one numpy's would hold. Why here: a sampled row of a 49,152-token vocabulary
 * spent about 0.17 ms in cumsum's generic loop, which writes the whole running sum to memory, and
 * 0.02 ms more counting its nonzero entries; this takes one pass that keeps only every CHECKPOINT-th
 * partial sum, then re-adds one stretch of CHECKPOINT elements to find the index. */
#include <stdlib.h>

#define CHECKPOINT 64

/* Returns the index drawn with u in [0, 1); *nonzero: how many entries are nonzero (a row with one
 * has no randomness: the caller takes that entry, *last, without u). A row with a negative entry
 * (numpy's binary search assumes a sorted running sum) or whose total is not a finite positive
 * number (a NaN, all zeros) returns -1: the caller's own path decides those. */
long draw_f64(const double *p, long n, double u, long *nonzero, long *last) {
    long blocks = (n + CHECKPOINT - 1) / CHECKPOINT, count = 0, at = -1, negative = 0;
    double *ends = malloc((size_t)(blocks > 0 ? blocks : 1) * sizeof(double));
    if (ends == NULL) return -1;
    double sum = 0.0;
    for (long b = 0; b < blocks; b++) {
        long end = (b + 1) * CHECKPOINT < n ? (b + 1) * CHECKPOINT : n;
        for (long i = b * CHECKPOINT; i < end; i++) {
            sum += p[i];
            negative |= p[i] < 0.0;
            if (p[i] != 0.0) {
                count++;
                at = i;
            }
        }
        ends[b] = sum;
    }
    *nonzero = count;
    *last = at;
    if (negative || !(sum > 0.0) || sum - sum != 0.0) { /* sum - sum: NaN for NaN and the infinities */
        free(ends);
        return -1;
    }
    double x = u * sum;
    long b = 0;
    while (b < blocks && !(ends[b] > x)) b++;
    long index = n; /* no partial sum exceeds x (round-off at u near 1): numpy's searchsorted gives n */
    if (b < blocks) {
        double s = b > 0 ? ends[b - 1] : 0.0;
        long end = (b + 1) * CHECKPOINT < n ? (b + 1) * CHECKPOINT : n;
        for (long i = b * CHECKPOINT; i < end; i++) {
            s += p[i];
            if (s > x) {
                index = i;
                break;
            }
        }
    }
    free(ends);
    return index;
}
