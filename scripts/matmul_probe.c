// One GEMM shape timed through one library, for scripts/bench_onednn.py: oneDNN's matmul
// (whichever libdnnl.so.3 the loader finds: the pinned 3.2 or a candidate) in bf16 x bf16 ->
// f32 or f32, or OpenBLAS's cblas_sgemm (a library path, opened at run time, so one binary
// serves every library).  Prints one JSON line.
//
//   matmul_probe onednn bf16|f32 M N K transb reps
//   matmul_probe openblas:/path/libscipy_openblas.so f32 M N K transb reps
//
// c (M x N, f32) = a (M x K) * b (K x N); transb = 1: b stored as N rows of K (a ggml weight in
// the forward, MUL_MAT), 0: K rows of N (the same weight in the backward, OUT_PROD's grad_x).
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "oneapi/dnnl/dnnl.h"

#define CK(x) do { dnnl_status_t s_ = (x); \
    if (s_ != dnnl_success) { fprintf(stderr, "%s: status %d\n", #x, (int) s_); exit(2); } } while (0)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static int by_value(const void * a, const void * b) {
    const double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

// deterministic operands of ordinary magnitude (no zeros, no denormals)
static void fill(void * p, long n, int bf16, int seed) {
    for (long i = 0; i < n; i++) {
        const float v = 0.5f + 0.01f * (float) ((i * 7 + seed) % 97);
        if (bf16) {
            unsigned int u;
            memcpy(&u, &v, 4);
            ((unsigned short *) p)[i] = (unsigned short) (u >> 16);
        } else {
            ((float *) p)[i] = v;
        }
    }
}

typedef void (*sgemm_t)(int, int, int, int, int, int, float, const float *, int,
                        const float *, int, float, float *, int);

int main(int argc, char ** argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: %s onednn|openblas:LIB bf16|f32 M N K transb reps\n", argv[0]);
        return 1;
    }
    const int bf16 = strcmp(argv[2], "bf16") == 0;
    const long M = atol(argv[3]), N = atol(argv[4]), K = atol(argv[5]);
    const int transb = atoi(argv[6]), reps = atoi(argv[7]);
    const size_t es = bf16 ? 2 : 4;
    void * a = malloc(M * K * es), * b = malloc(K * N * es);
    float * c = calloc(M * N, sizeof(float));
    fill(a, M * K, bf16, 1);
    fill(b, K * N, bf16, 2);
    double * t = malloc(sizeof(double) * reps);
    char impl[256] = "", lib[64] = "";

    if (strncmp(argv[1], "openblas:", 9) == 0) {
        if (bf16) { fprintf(stderr, "openblas: f32 only\n"); return 1; }
        void * h = dlopen(argv[1] + 9, RTLD_NOW);
        sgemm_t sgemm = h ? (sgemm_t) dlsym(h, "scipy_cblas_sgemm") : NULL;
        const char * (*corename)(void) = h ? dlsym(h, "scipy_openblas_get_corename") : NULL;
        if (!sgemm) { fprintf(stderr, "no scipy_cblas_sgemm in %s\n", argv[1] + 9); return 2; }
        snprintf(lib, sizeof lib, "OpenBLAS");
        snprintf(impl, sizeof impl, "sgemm:%s", corename ? corename() : "?");
        for (int r = -2; r < reps; r++) {     // CblasRowMajor 101, NoTrans 111, Trans 112
            const double t0 = now();
            sgemm(101, 111, transb ? 112 : 111, (int) M, (int) N, (int) K, 1.0f, a, (int) K,
                  b, transb ? (int) K : (int) N, 0.0f, c, (int) N);
            if (r >= 0) t[r] = now() - t0;
        }
    } else {
        const dnnl_data_type_t dt = bf16 ? dnnl_bf16 : dnnl_f32;
        dnnl_engine_t eng;
        dnnl_stream_t st;
        CK(dnnl_engine_create(&eng, dnnl_cpu, 0));
        CK(dnnl_stream_create(&st, eng, dnnl_stream_default_flags));
        dnnl_dims_t da = {M, K}, db = {K, N}, dc = {M, N};
        dnnl_dims_t sa = {K, 1}, sbn = {N, 1}, sbt = {1, K}, sc = {N, 1};
        dnnl_memory_desc_t ma, mb, mc;
        CK(dnnl_memory_desc_create_with_strides(&ma, 2, da, dt, sa));
        CK(dnnl_memory_desc_create_with_strides(&mb, 2, db, dt, transb ? sbt : sbn));
        CK(dnnl_memory_desc_create_with_strides(&mc, 2, dc, dnnl_f32, sc));
        dnnl_primitive_desc_t pd;
        CK(dnnl_matmul_primitive_desc_create(&pd, eng, ma, mb, NULL, mc, NULL));
        const char * name = "";
        dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &name);
        snprintf(impl, sizeof impl, "%s", name);
        const dnnl_version_t * v = dnnl_version();
        snprintf(lib, sizeof lib, "oneDNN %d.%d.%d", v->major, v->minor, v->patch);
        dnnl_primitive_t p;
        CK(dnnl_primitive_create(&p, pd));
        dnnl_memory_t xa, xb, xc;
        CK(dnnl_memory_create(&xa, ma, eng, a));
        CK(dnnl_memory_create(&xb, mb, eng, b));
        CK(dnnl_memory_create(&xc, mc, eng, c));
        dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, xa}, {DNNL_ARG_WEIGHTS, xb}, {DNNL_ARG_DST, xc}};
        for (int r = -2; r < reps; r++) {
            const double t0 = now();
            CK(dnnl_primitive_execute(p, st, 3, args));
            CK(dnnl_stream_wait(st));
            if (r >= 0) t[r] = now() - t0;
        }
    }
    qsort(t, reps, sizeof(double), by_value);
    const double med = t[reps / 2];
    // c[0] is a sum of K equal-magnitude products: a check that the product ran
    printf("{\"library\": \"%s\", \"impl\": \"%s\", \"type\": \"%s\", \"M\": %ld, \"N\": %ld, "
           "\"K\": %ld, \"transb\": %d, \"median_s\": %.6g, \"min_s\": %.6g, \"gflops\": %.2f, "
           "\"c00\": %.6g}\n", lib, impl, argv[2], M, N, K, transb, med, t[0],
           2.0 * M * N * K / med * 1e-9, c[0]);
    return 0;
}
