/*
 * llama_logits: evaluate one token sequence with llama.cpp and write the logits of every
 * position as raw float32 ([n_tokens, n_vocab], row-major) to a file.
 *
 * Why: the cross-check test compares pytrain's logits (with and without a LoRA adapter that
 * pytrain wrote) against llama.cpp's own model loader, adapter loader and graph.  Built by
 * scripts/build_llama_cpp.py against the pinned libllama.
 *
 * Usage: llama_logits [--extra-bufts] [--load-only] MODEL.gguf ADAPTER.gguf|- TOKENS OUT.f32
 *                     [N_THREADS]
 *   TOKENS  comma-separated token ids, e.g. 1,2,3
 *   ADAPTER "-" for none; otherwise loaded with llama_adapter_lora_init and applied with
 *           scale 1 (what `--lora FILE` does).
 *   --extra-bufts  let llama.cpp put weights in ggml-cpu's extra buffer types (see below);
 *                  only for the test that shows the check of that would fire
 *   --load-only    stop after loading the model (and adapter): no decode, no output file
 *
 * Weights stay in the plain CPU buffer (`use_extra_bufts = false`, llama.cpp's `--no-repack`).
 * By default llama.cpp moves weights into ggml-cpu's "extra" buffer types where the CPU has
 * them: CPU_REPACK (Q4_0, Q4_K, IQ4_NL re-laid for AVX2), and on Intel CPUs with AMX an AMX
 * buffer for Q4_0/Q4_1/Q8_0/K-quants.  That AMX path dies with SIGILL at `tilezero` in
 * `tinygemm_kernel_amx<block_q8_0,...>` on this project's Intel machines, and repacked
 * weights run different kernels from pytrain's, which never uses extra buffer types.  With
 * the plain buffer both sides run ggml-cpu's ordinary MUL_MAT on any x86 CPU.  The buffers
 * llama.cpp used are always printed ("<name> model buffer size" lines on stderr), so the tests
 * check that no extra buffer type was used.
 * Exit codes: 0 ok, 1 usage, 2 model load failed, 3 adapter load failed, 4 decode failed,
 *             5 output write failed.  llama.cpp's log goes to stderr (errors always; all of
 *             it with LLAMA_LOGITS_VERBOSE=1).
 *
 * Precision choices, so the comparison measures kernels rather than storage: K/V cache in
 * F32 (the default F16 cache rounds K and V), flash attention off, one ubatch for the whole
 * sequence (the recurrent layers see it in one pass, like pytrain's graph).
 */
#include "llama.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_verbose = 0;

static void log_cb(enum ggml_log_level level, const char * text, void * user) {
    (void) user;
    if (g_verbose || level == GGML_LOG_LEVEL_ERROR || level == GGML_LOG_LEVEL_WARN ||
        strstr(text, "model buffer size") != NULL) {
        fputs(text, stderr);
    }
}

static int parse_tokens(const char * s, llama_token ** out) {
    int cap = 16, n = 0;
    llama_token * toks = malloc(sizeof(*toks) * cap);
    const char * p = s;
    while (*p) {
        char * end = NULL;
        long v = strtol(p, &end, 10);
        if (end == p) {
            free(toks);
            return -1;
        }
        if (n == cap) {
            cap *= 2;
            toks = realloc(toks, sizeof(*toks) * cap);
        }
        toks[n++] = (llama_token) v;
        p = end;
        if (*p == ',') {
            p++;
        } else if (*p) {
            free(toks);
            return -1;
        }
    }
    *out = toks;
    return n;
}

int main(int argc, char ** argv) {
    const char * prog = argv[0];
    int extra_bufts = 0, load_only = 0;
    while (argc > 1 && strncmp(argv[1], "--", 2) == 0) {
        if (strcmp(argv[1], "--extra-bufts") == 0) {
            extra_bufts = 1;
        } else if (strcmp(argv[1], "--load-only") == 0) {
            load_only = 1;
        } else {
            fprintf(stderr, "unknown option '%s'\n", argv[1]);
            return 1;
        }
        argv++;
        argc--;
    }
    if (argc < 5 || argc > 6) {
        fprintf(stderr, "usage: %s [--extra-bufts] [--load-only] MODEL.gguf ADAPTER.gguf|- "
                "TOKENS OUT.f32 [N_THREADS]\n", prog);
        return 1;
    }
    const char * model_path = argv[1];
    const char * adapter_path = argv[2];
    const char * out_path = argv[4];
    const int n_threads = argc == 6 ? atoi(argv[5]) : 1;
    const char * verbose = getenv("LLAMA_LOGITS_VERBOSE");
    g_verbose = verbose && strcmp(verbose, "0") != 0;

    llama_token * tokens = NULL;
    const int n_tokens = parse_tokens(argv[3], &tokens);
    if (n_tokens <= 0) {
        fprintf(stderr, "bad token list '%s'\n", argv[3]);
        return 1;
    }

    llama_log_set(log_cb, NULL);
    llama_backend_init();

    struct llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    mparams.use_extra_bufts = extra_bufts;   /* see the header comment */
    struct llama_model * model = llama_model_load_from_file(model_path, mparams);
    if (!model) {
        fprintf(stderr, "failed to load model '%s'\n", model_path);
        return 2;
    }

    struct llama_adapter_lora * adapter = NULL;
    if (strcmp(adapter_path, "-") != 0) {
        adapter = llama_adapter_lora_init(model, adapter_path);
        if (!adapter) {
            fprintf(stderr, "failed to load LoRA adapter '%s'\n", adapter_path);
            llama_model_free(model);
            return 3;
        }
    }

    if (load_only) {
        llama_model_free(model);
        llama_backend_free();
        free(tokens);
        return 0;
    }

    struct llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = (uint32_t) (n_tokens < 256 ? 256 : n_tokens);
    cparams.n_batch = (uint32_t) n_tokens;
    cparams.n_ubatch = (uint32_t) n_tokens;
    cparams.n_seq_max = 1;
    cparams.n_threads = n_threads;
    cparams.n_threads_batch = n_threads;
    cparams.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cparams.type_k = GGML_TYPE_F32;
    cparams.type_v = GGML_TYPE_F32;
    cparams.no_perf = true;
    struct llama_context * ctx = llama_init_from_model(model, cparams);
    if (!ctx) {
        fprintf(stderr, "failed to create a context\n");
        return 2;
    }
    if (adapter) {
        float scale = 1.0f;
        if (llama_set_adapters_lora(ctx, &adapter, 1, &scale) != 0) {
            fprintf(stderr, "failed to apply LoRA adapter '%s'\n", adapter_path);
            return 3;
        }
    }

    struct llama_batch batch = llama_batch_init(n_tokens, 0, 1);
    for (int i = 0; i < n_tokens; i++) {
        batch.token[i] = tokens[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n_tokens;
    const int rc = llama_decode(ctx, batch);
    if (rc != 0) {
        fprintf(stderr, "llama_decode failed (%d)\n", rc);
        return 4;
    }

    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE * f = fopen(out_path, "wb");
    if (!f) {
        fprintf(stderr, "cannot open '%s' for writing\n", out_path);
        return 5;
    }
    for (int i = 0; i < n_tokens; i++) {
        const float * row = llama_get_logits_ith(ctx, i);
        if (!row || fwrite(row, sizeof(float), (size_t) n_vocab, f) != (size_t) n_vocab) {
            fprintf(stderr, "cannot write logits of position %d\n", i);
            fclose(f);
            return 5;
        }
    }
    if (fclose(f) != 0) {
        fprintf(stderr, "cannot write '%s'\n", out_path);
        return 5;
    }
    fprintf(stderr, "n_tokens=%d n_vocab=%d adapter=%s\n", n_tokens, n_vocab,
            adapter ? adapter_path : "none");

    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);  /* also frees the adapter */
    llama_backend_free();
    free(tokens);
    return 0;
}
