/* Pass 1 of probe/_rowdiff.c, one vector wide: included once per VEC_BYTES (16: SSE2/NEON, 32: AVX2), each
 * copy compiled for its own target. Lanes keep their own maximum, its index and partial sums; strict '>' keeps
 * the first index within a lane, and the merge takes the lowest index among lanes holding the maximum, so the
 * result is the first index of the row's maximum. NaN differences never win here (pass 2 ranks them). */
#define PASTE_(a, b) a##b
#define PASTE(a, b) PASTE_(a, b)
#define LANES (VEC_BYTES / 8)
#define VD PASTE(vd_, VEC_BYTES)
#define VI PASTE(vi_, VEC_BYTES)
#define VF PASTE(vf_, VEC_BYTES)

typedef double VD __attribute__((vector_size(VEC_BYTES)));
typedef int64_t VI __attribute__((vector_size(VEC_BYTES)));
typedef float VF __attribute__((vector_size(VEC_BYTES / 2)));

static void PASTE(row_pass1_, VEC_BYTES)(const float *a, const float *e, int64_t n, row_sums *out) {
    const VI abs_mask = (VI){0} + INT64_MAX;
    VD top = {0}, top_at = {0}, e_top = {0}, aa = {0}, ee = {0}, dd = {0}, ae = {0}, at = {0};
    for (int k = 0; k < LANES; k++) at[k] = k;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        VF fa, fe;
        memcpy(&fa, a + i, sizeof fa);
        memcpy(&fe, e + i, sizeof fe);
        VD x = __builtin_convertvector(fa, VD), y = __builtin_convertvector(fe, VD), d = x - y;
        VD ad = (VD)((VI)d & abs_mask), ay = (VD)((VI)y & abs_mask);
        VI wins = ad > top, grows = ay > e_top;
        top = (VD)(((VI)ad & wins) | ((VI)top & ~wins));
        top_at = (VD)(((VI)at & wins) | ((VI)top_at & ~wins));
        e_top = (VD)(((VI)ay & grows) | ((VI)e_top & ~grows));
        aa += x * x;
        ee += y * y;
        dd += d * d;
        ae += x * y;
        at += (VD){0} + LANES;
    }
    double max_abs = 0, index = 0, e_max = 0, s_aa = 0, s_ee = 0, s_dd = 0, s_ae = 0;
    for (int k = 0; k < LANES; k++) {
        if (top[k] > max_abs || (top[k] == max_abs && top_at[k] < index)) {
            max_abs = top[k];
            index = top_at[k];
        }
        e_max = e_top[k] > e_max ? e_top[k] : e_max;
        s_aa += aa[k];
        s_ee += ee[k];
        s_dd += dd[k];
        s_ae += ae[k];
    }
    for (; i < n; i++) {  /* the tail, fewer than LANES elements */
        double x = a[i], y = e[i], d = x - y, ad = fabs(d), ay = fabs(y);
        if (ad > max_abs) {
            max_abs = ad;
            index = (double)i;
        }
        e_max = ay > e_max ? ay : e_max;
        s_aa += x * x;
        s_ee += y * y;
        s_dd += d * d;
        s_ae += x * y;
    }
    out->max_abs = max_abs;
    out->index = (int64_t)index;
    out->e_max = e_max;
    out->aa = s_aa;
    out->ee = s_ee;
    out->dd = s_dd;
    out->ae = s_ae;
}

#undef VF
#undef VI
#undef VD
#undef LANES
