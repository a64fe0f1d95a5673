/* The baseline for `scripts/bench.py`'s C ABI v2 driver overhead: the same mtp2_step called in a plain C loop, on
 * the same stored bf16 weights the probe hands over (the checkpoint shard, mapped; nothing widened).
 *
 *   bench_c_loop_v2 WORK_DIR SHARD T [i:KEY=INT | d:KEY=DOUBLE]...
 *
 * WORK_DIR holds weights_v2.txt (one line per head tensor: name, mtp2_dtype, ndim, shape[0], shape[1], the byte
 * offset of its data in SHARD), embed.bin and hidden.bin (float32 [T, D]) and positions.bin (int32 [T]), written by
 * bench.py; the KEY=VALUE arguments are the config table's entries. Like the probe, it maps the shard, creates a
 * context from the table, runs T steps capturing all ten stages into [T, width] buffers, and destroys it. It prints
 * the step loop's own time (steps_s) next to the process's wall time that bench.py measures. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, strdup under -std=c11 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "mtp_probe_v2.h"

#define MAX_TENSORS 64
#define MAX_ENTRIES 64

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
    if (argc < 4) { fprintf(stderr, "usage: bench_c_loop_v2 WORK SHARD T [i:KEY=INT|d:KEY=DOUBLE]...\n"); return 2; }
    size_t T = (size_t)atol(argv[3]);
    int fd = open(argv[2], O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) { fprintf(stderr, "cannot open %s\n", argv[2]); return 2; }
    const char *base = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (base == MAP_FAILED) { fprintf(stderr, "cannot map %s\n", argv[2]); return 2; }

    mtp2_tensor w[MAX_TENSORS];
    int n = 0;
    char path[4096], name[256];
    snprintf(path, sizeof path, "%s/weights_v2.txt", argv[1]);
    FILE *m = fopen(path, "r");
    long long d0, d1, offset;
    int dtype, ndim;
    while (m && n < MAX_TENSORS &&
           fscanf(m, "%255s %d %d %lld %lld %lld", name, &dtype, &ndim, &d0, &d1, &offset) == 6) {
        w[n] = (mtp2_tensor){strdup(name), dtype, ndim, {d0, d1}, base + offset};
        n++;
    }
    if (!m || n == 0) { fprintf(stderr, "cannot read %s\n", path); return 2; }
    fclose(m);

    mtp2_config_entry e[MAX_ENTRIES];
    int ne = 0;
    size_t D = 0;
    for (int a = 4; a < argc && ne < MAX_ENTRIES; a++) {
        char *eq = strchr(argv[a], '=');
        if (strlen(argv[a]) < 3 || argv[a][1] != ':' || !eq) { fprintf(stderr, "bad entry %s\n", argv[a]); return 2; }
        *eq = '\0';
        int is_int = argv[a][0] == 'i';
        e[ne] = (mtp2_config_entry){argv[a] + 2, is_int ? MTP2_INT : MTP2_DOUBLE, is_int ? atoll(eq + 1) : 0,
                                    atof(eq + 1)};
        if (strcmp(e[ne].key, "hidden_size") == 0) D = (size_t)e[ne].i;
        ne++;
    }
    mtp2_config cfg = {MTP2_ABI_VERSION, ne, e, "qwen3_5", "{}"};

    static const char *const names[10] = {"e", "h", "fc_in", "fc", "ah", "attn", "res1", "mh", "mlp", "res2"};
    float *embed = slurp(argv[1], "embed.bin", T * D * sizeof(float));
    float *hidden = slurp(argv[1], "hidden.bin", T * D * sizeof(float));
    int *pos = slurp(argv[1], "positions.bin", T * sizeof(int));
    float *stage[10], *out = malloc(T * D * sizeof(float));
    mtp2_stage table[10];
    for (int s = 0; s < 10; s++) {
        int width = (int)D * (s == 2 ? 2 : 1);
        stage[s] = calloc(T * (size_t)width, sizeof(float));
        table[s] = (mtp2_stage){names[s], MTP2_F32, width, NULL};
    }
    char err[1024] = "";
    void *ctx = mtp2_create(&cfg, w, n, err, sizeof err);
    if (!ctx) { fprintf(stderr, "mtp2_create failed: %s\n", err); return 1; }
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (size_t t = 0; t < T; t++) {
        for (int s = 0; s < 10; s++) table[s].data = stage[s] + t * (size_t)table[s].width;
        if (mtp2_step(ctx, pos[t], embed + t * D, hidden + t * D, out + t * D, table, 10) != MTP2_OK) return 1;
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    mtp2_destroy(ctx);
    printf("steps_s %.6f check %g\n", (double)(b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) * 1e-9, out[0]);
    return 0;
}
