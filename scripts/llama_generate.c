/*
 * llama_generate: llama.cpp's own tokenizer, chat template and greedy generation (with a LoRA
 * adapter), for the cross-checks against a real model.
 *
 * Why: pytrain's tokenizer, chat rendering and adapted model must agree with llama.cpp, where
 * users run the adapter (`llama-cli -m MODEL --lora ADAPTER --temp 0`).  This program calls
 * the same libllama functions those tools call, built by scripts/build_llama_cpp.py from the
 * pinned source, and prints nothing but results.
 *
 * Usage:
 *   llama_generate tokenize MODEL TEXTS OUT ADD_SPECIAL PARSE_SPECIAL
 *       TEXTS: texts separated by "\n__ggml_vocab_test__\n" (llama.cpp's test-vector format);
 *       OUT: one line of space-separated ids per text (llama_tokenize)
 *   llama_generate template MODEL MESSAGES OUT ADD_ASSISTANT [TEMPLATE]
 *       MESSAGES: messages separated by \x1e, each "role\x1fcontent"; OUT: the text that
 *       llama_chat_apply_template makes of them with the model's tokenizer.chat_template, or
 *       with TEMPLATE, the name of one of llama.cpp's built-in formats (e.g. gemma)
 *   llama_generate generate MODEL ADAPTER|- PROMPTS N_MAX OUT [N_THREADS]
 *       PROMPTS: one prompt per line as comma-separated token ids; for each, greedy decoding
 *       (llama_sampler_init_greedy) until an end-of-generation token or N_MAX tokens, with
 *       the adapter at scale 1 (what --lora does); OUT: the generated ids per line, the
 *       end-of-generation token included when one ended the answer
 *
 * Weights stay in the plain CPU buffer (`use_extra_bufts = false`, llama.cpp's --no-repack),
 * as in llama_logits.c: the AMX buffer type of Intel CPUs dies with SIGILL in the pinned
 * source.  K/V cache F32, flash attention off, as in llama_logits.c.
 * Exit codes: 0 ok, 1 usage or input, 2 model load failed, 3 adapter load failed, 4 decode
 * failed, 5 output write failed.
 */
#include "llama.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void log_cb(enum ggml_log_level level, const char * text, void * user) {
    (void) user;
    if (level == GGML_LOG_LEVEL_ERROR || strstr(text, "model buffer size") != NULL) {
        fputs(text, stderr);
    }
}

static char * read_file(const char * path, long * len) {
    FILE * f = fopen(path, "rb");
    if (!f) {
        return NULL;
    }
    fseek(f, 0, SEEK_END);
    *len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char * buf = malloc((size_t) *len + 1);
    if (fread(buf, 1, (size_t) *len, f) != (size_t) *len) {
        fclose(f);
        free(buf);
        return NULL;
    }
    buf[*len] = 0;
    fclose(f);
    return buf;
}

static struct llama_model * load(const char * path, int vocab_only) {
    struct llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    mparams.use_extra_bufts = 0;
    mparams.vocab_only = vocab_only;
    return llama_model_load_from_file(path, mparams);
}

static int tokenize(const struct llama_vocab * vocab, const char * text, int len,
                    int add_special, int parse_special, llama_token ** out) {
    int cap = len + 16;
    llama_token * toks = malloc(sizeof(*toks) * (size_t) cap);
    int n = llama_tokenize(vocab, text, len, toks, cap, add_special, parse_special);
    if (n < 0) {
        cap = -n;
        toks = realloc(toks, sizeof(*toks) * (size_t) cap);
        n = llama_tokenize(vocab, text, len, toks, cap, add_special, parse_special);
    }
    *out = toks;
    return n;
}

static int cmd_tokenize(int argc, char ** argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s tokenize MODEL TEXTS OUT ADD_SPECIAL PARSE_SPECIAL\n", argv[0]);
        return 1;
    }
    struct llama_model * model = load(argv[2], 1);
    if (!model) {
        return 2;
    }
    const struct llama_vocab * vocab = llama_model_get_vocab(model);
    long len = 0;
    char * all = read_file(argv[3], &len);
    FILE * out = fopen(argv[4], "w");
    if (!all || !out) {
        return 1;
    }
    const char * sep = "\n__ggml_vocab_test__\n";
    const size_t sep_len = strlen(sep);
    char * p = all;
    char * end = all + len;
    while (p <= end) {
        char * next = strstr(p, sep);
        int n_chars = (int) ((next ? next : end) - p);
        llama_token * toks = NULL;
        int n = tokenize(vocab, p, n_chars, atoi(argv[5]), atoi(argv[6]), &toks);
        for (int i = 0; i < n; i++) {
            fprintf(out, i ? " %d" : "%d", toks[i]);
        }
        fputc('\n', out);
        free(toks);
        if (!next) {
            break;
        }
        p = next + sep_len;
    }
    free(all);
    llama_model_free(model);
    return fclose(out) == 0 ? 0 : 5;
}

static int cmd_template(int argc, char ** argv) {
    if (argc != 6 && argc != 7) {
        fprintf(stderr, "usage: %s template MODEL MESSAGES OUT ADD_ASSISTANT [TEMPLATE]\n",
                argv[0]);
        return 1;
    }
    struct llama_model * model = load(argv[2], 1);
    if (!model) {
        return 2;
    }
    long len = 0;
    char * all = read_file(argv[3], &len);
    if (!all) {
        return 1;
    }
    struct llama_chat_message msgs[256];
    size_t n_msg = 0;
    for (char * rec = strtok(all, "\x1e"); rec && n_msg < 256; rec = strtok(NULL, "\x1e")) {
        char * us = strchr(rec, '\x1f');
        if (!us) {
            return 1;
        }
        *us = 0;
        msgs[n_msg].role = rec;
        msgs[n_msg].content = us + 1;
        n_msg++;
    }
    // TEMPLATE: one of llama.cpp's built-in template names (e.g. gemma) instead of the model's
    const char * tmpl = argc == 7 ? argv[6] : llama_model_chat_template(model, NULL);
    int cap = (int) len * 2 + 4096;
    char * buf = malloc((size_t) cap);
    int n = llama_chat_apply_template(tmpl, msgs, n_msg, atoi(argv[5]), buf, cap);
    if (n > cap) {
        buf = realloc(buf, (size_t) n);
        n = llama_chat_apply_template(tmpl, msgs, n_msg, atoi(argv[5]), buf, n);
    }
    if (n < 0) {
        fprintf(stderr, "llama_chat_apply_template failed (%d)\n", n);
        return 1;
    }
    FILE * out = fopen(argv[4], "wb");
    if (!out || fwrite(buf, 1, (size_t) n, out) != (size_t) n) {
        return 5;
    }
    free(buf);
    free(all);
    llama_model_free(model);
    return fclose(out) == 0 ? 0 : 5;
}

static int parse_ids(char * line, llama_token * toks, int cap) {
    int n = 0;
    for (char * t = strtok(line, ",\n"); t && n < cap; t = strtok(NULL, ",\n")) {
        toks[n++] = (llama_token) atoi(t);
    }
    return n;
}

static int cmd_generate(int argc, char ** argv) {
    if (argc < 7 || argc > 8) {
        fprintf(stderr, "usage: %s generate MODEL ADAPTER|- PROMPTS N_MAX OUT [N_THREADS]\n",
                argv[0]);
        return 1;
    }
    const int n_max = atoi(argv[5]);
    const int n_threads = argc == 8 ? atoi(argv[7]) : 1;
    struct llama_model * model = load(argv[2], 0);
    if (!model) {
        return 2;
    }
    struct llama_adapter_lora * adapter = NULL;
    if (strcmp(argv[3], "-") != 0) {
        adapter = llama_adapter_lora_init(model, argv[3]);
        if (!adapter) {
            fprintf(stderr, "failed to load LoRA adapter '%s'\n", argv[3]);
            return 3;
        }
    }
    struct llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = 4096;
    cparams.n_batch = 2048;
    cparams.n_ubatch = 2048;
    cparams.n_seq_max = 1;
    cparams.n_threads = n_threads;
    cparams.n_threads_batch = n_threads;
    cparams.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cparams.type_k = GGML_TYPE_F32;
    cparams.type_v = GGML_TYPE_F32;
    cparams.no_perf = true;
    struct llama_context * ctx = llama_init_from_model(model, cparams);
    if (!ctx) {
        return 2;
    }
    if (adapter) {
        float scale = 1.0f;
        if (llama_set_adapters_lora(ctx, &adapter, 1, &scale) != 0) {
            return 3;
        }
    }
    const struct llama_vocab * vocab = llama_model_get_vocab(model);
    struct llama_sampler * smpl = llama_sampler_chain_init(llama_sampler_chain_default_params());
    llama_sampler_chain_add(smpl, llama_sampler_init_greedy());

    long len = 0;
    char * all = read_file(argv[4], &len);
    FILE * out = fopen(argv[6], "w");
    if (!all || !out) {
        return 1;
    }
    llama_token * toks = malloc(sizeof(*toks) * 4096);
    char * save = NULL;
    for (char * line = strtok_r(all, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        int n = parse_ids(line, toks, 4096 - n_max);
        llama_memory_clear(llama_get_memory(ctx), true);
        llama_sampler_reset(smpl);
        struct llama_batch batch = llama_batch_get_one(toks, n);
        for (int i = 0; i < n_max; i++) {
            if (llama_decode(ctx, batch) != 0) {
                fprintf(stderr, "llama_decode failed\n");
                return 4;
            }
            llama_token next = llama_sampler_sample(smpl, ctx, -1);
            fprintf(out, i ? ",%d" : "%d", next);
            if (llama_vocab_is_eog(vocab, next)) {
                break;
            }
            toks[n] = next;
            batch = llama_batch_get_one(&toks[n], 1);
            n++;
        }
        fputc('\n', out);
    }
    free(toks);
    free(all);
    llama_sampler_free(smpl);
    llama_free(ctx);
    llama_model_free(model);
    return fclose(out) == 0 ? 0 : 5;
}

int main(int argc, char ** argv) {
    llama_log_set(log_cb, NULL);
    llama_backend_init();
    int rc = 1;
    if (argc > 1 && strcmp(argv[1], "tokenize") == 0) {
        rc = cmd_tokenize(argc, argv);
    } else if (argc > 1 && strcmp(argv[1], "template") == 0) {
        rc = cmd_template(argc, argv);
    } else if (argc > 1 && strcmp(argv[1], "generate") == 0) {
        rc = cmd_generate(argc, argv);
    } else {
        fprintf(stderr, "usage: %s tokenize|template|generate ...\n", argv[0]);
    }
    llama_backend_free();
    return rc;
}
