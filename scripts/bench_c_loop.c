/* The baseline for `scripts/bench.py`'s C ABI driver overhead: the same mtp_step called in a plain C loop.
 *
 *   bench_c_loop WORK_DIR D H KV HD ROT I T EPS THETA
 *
 * WORK_DIR holds weights.bin (the 15 head tensors as float32, in mtp_weights field order), embed.bin and
 * hidden.bin (float32 [T, D]) and positions.bin (int32 [T]), written by bench.py. Like the probe, it reads the
 * weights, creates a context, runs T steps capturing all ten stages into [T, width] buffers, and destroys it.
 * It prints the step loop's own time (steps_s) next to the process's wall time that bench.py measures. */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c11 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mtp_probe.h"

static void *slurp(const char *dir, const char *name, size_t bytes) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    void *buf = malloc(bytes);
    if (!f || !buf || fread(buf, 1, bytes, f) != bytes) { fprintf(stderr, "cannot read %s\n", path); exit(2); }
    fclose(f);
    return buf;
}

int main(int argc, char **argv) {
    if (argc != 11) { fprintf(stderr, "usage: bench_c_loop WORK D H KV HD ROT I T EPS THETA\n"); return 2; }
    mtp_config cfg = {MTP_PROBE_ABI_VERSION, atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), atoi(argv[5]),
                      atoi(argv[6]), atoi(argv[7]), atoi(argv[8]), atof(argv[9]), atof(argv[10])};
    size_t D = cfg.hidden_size, Q = (size_t)cfg.num_heads * cfg.head_dim, KV = (size_t)cfg.num_kv_heads * cfg.head_dim;
    size_t I = cfg.intermediate_size, T = cfg.max_steps, HD = cfg.head_dim;
    size_t sizes[15] = {D, D, D * 2 * D, D, 2 * Q * D, KV * D, KV * D, HD, HD, D * Q, D, I * D, I * D, D * I, D};
    size_t total = 0;
    for (int i = 0; i < 15; i++) total += sizes[i];
    float *all = slurp(argv[1], "weights.bin", total * sizeof(float));
    const float *ptr[15];
    for (int i = 0, off = 0; i < 15; off += (int)sizes[i], i++) ptr[i] = all + off;
    mtp_weights w;
    memcpy(&w, ptr, sizeof w); /* mtp_weights is 15 const float pointers, in this order */
    float *embed = slurp(argv[1], "embed.bin", T * D * sizeof(float));
    float *hidden = slurp(argv[1], "hidden.bin", T * D * sizeof(float));
    int *pos = slurp(argv[1], "positions.bin", T * sizeof(int));
    float *stage[10], *out = malloc(T * D * sizeof(float));
    for (int s = 0; s < 10; s++) stage[s] = calloc(T * D * (s == 2 ? 2 : 1), sizeof(float));
    void *ctx = NULL;
    if (mtp_create(&cfg, &w, &ctx) != MTP_OK) { fprintf(stderr, "mtp_create failed\n"); return 1; }
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (size_t t = 0; t < T; t++) {
        mtp_trace tr;
        float **f = (float **)&tr;
        for (int s = 0; s < 10; s++) f[s] = stage[s] + t * D * (s == 2 ? 2 : 1);
        if (mtp_step(ctx, pos[t], embed + t * D, hidden + t * D, out + t * D, &tr) != MTP_OK) return 1;
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    mtp_destroy(ctx);
    printf("steps_s %.6f check %g\n", (double)(b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) * 1e-9, out[0]);
    return 0;
}
