/* Per-row comparison sums for `mtp-probe diff`: the fast path of probe/rowdiff.py, whose numpy code
 * (`row_sums_numpy`) is the specification this file must match and the fallback when it is not built.
 *
 * For each row r of two C-contiguous [rows, width] float32 arrays, a (candidate) and e (oracle), every element is
 * widened to float64 (exact) and, with d_i = |a_i - e_i|:
 *
 *   max_abs, index   the largest d_i and its first index (a NaN d_i counts as the largest, see pass 2)
 *   e_max            max |e_i|
 *   aa, ee, dd, ae   sums of a_i², e_i², (a_i - e_i)², a_i·e_i (summation order differs from numpy's: the
 *                    sums agree to rounding, ~1e-15 relative; max_abs, index, e_max and the counts are exact)
 *   n_mismatch       elements with d_i >= max(atol, rtol·e_max) or NaN, and d_i != 0
 *   n_poison         elements of a holding the poison bits 0x7FDEAD00 (probe/poison.py)
 *
 * Pass 1 (every row) is one vectorised sweep. Pass 2 runs only for rows that need it: a count of mismatches
 * when max_abs is at or over the limit, or a scalar sweep for a row with a non-finite element. A
 * within-tolerance row never needs it, so the counts cost nothing on the common path. Rows whose oracle side is non-finite are refused by the caller, so
 * e_max there is unspecified.
 *
 * Built by setuptools as the optional extension probe._rowdiff (pyproject.toml) and loaded with ctypes; it holds
 * no Python objects, so the call releases the GIL and the probe can read the next chunk meanwhile.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define POISON_BITS 0x7FDEAD00u

typedef struct {  /* one row; field order and types match ROW_SUMS in probe/rowdiff.py */
    double max_abs, e_max, aa, ee, dd, ae;
    int64_t index, n_mismatch, n_poison;
} row_sums;

/* Pass 1, one vector of lanes wide: _rowdiff_lanes.h defines row_pass1_<VEC_BYTES>. x86-64 compilers target
 * SSE2 only unless told otherwise, so a 32-byte (AVX2) copy is compiled too and chosen at run time. */
#define VEC_BYTES 16
#include "_rowdiff_lanes.h"
#undef VEC_BYTES

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2")
#define VEC_BYTES 32
#include "_rowdiff_lanes.h"
#undef VEC_BYTES
#pragma GCC pop_options
#define HAVE_AVX2_COPY 1
#endif

/* Pass 2 for a finite row at or over the limit: the mismatch count only (a loop the compiler vectorises). */
static int64_t count_mismatches(const float *a, const float *e, int64_t n, double limit) {
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)e[i]);
        count += (d >= limit) & (d != 0.0);
    }
    return count;
}

/* Pass 2 for a row holding NaN/Inf: the counts, and the maximum with NaN ranked first (pass 1 skips NaN). */
static void nonfinite_pass2(const float *a, const float *e, int64_t n, double limit, row_sums *out) {
    int64_t n_mismatch = 0, n_poison = 0, index = 0;
    double best = -1.0, max_abs = 0.0;  /* best: the rank (NaN -> +inf) of the maximum so far */
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)e[i]);
        double rank = isnan(d) ? INFINITY : d;
        if (rank > best) { best = rank; index = i; max_abs = d; }
        n_mismatch += !(d < limit) && d != 0.0;  /* a NaN d counts */
        uint32_t bits;
        memcpy(&bits, &a[i], sizeof bits);
        n_poison += bits == POISON_BITS;
    }
    out->n_mismatch = n_mismatch;
    out->n_poison = n_poison;
    out->index = index;
    out->max_abs = max_abs;
}

/* What probe/rowdiff.py checks before trusting this library: a stale build (the source changed, `pip install -e .`
 * not rerun) or another struct layout is not used. */
#define ROWDIFF_VERSION 1
int mtp_rowdiff_version(void) { return ROWDIFF_VERSION; }
int mtp_rowdiff_struct_bytes(void) { return (int)sizeof(row_sums); }

int mtp_rowdiff_vector_bytes(void) {
#ifdef HAVE_AVX2_COPY
    if (__builtin_cpu_supports("avx2")) return 32;
#endif
    return 16;
}

void mtp_rowdiff(const float *a, const float *e, int64_t rows, int64_t width, double rtol, double atol,
                 row_sums *out) {
    void (*pass1)(const float *, const float *, int64_t, row_sums *) = row_pass1_16;
#ifdef HAVE_AVX2_COPY
    if (mtp_rowdiff_vector_bytes() == 32) pass1 = row_pass1_32;
#endif
    for (int64_t r = 0; r < rows; r++) {
        const float *ar = a + r * width, *er = e + r * width;
        row_sums *o = out + r;
        pass1(ar, er, width, o);
        double limit = rtol * o->e_max > atol ? rtol * o->e_max : atol;
        int finite = isfinite(o->aa) && isfinite(o->ee);  /* squares of float32 values cannot overflow a double */
        o->n_mismatch = 0;
        o->n_poison = 0;  /* the poison pattern is a NaN: only a non-finite row can hold it */
        if (!finite)
            nonfinite_pass2(ar, er, width, limit, o);
        else if (o->max_abs >= limit && o->max_abs != 0.0)
            o->n_mismatch = count_mismatches(ar, er, width, limit);
    }
}
