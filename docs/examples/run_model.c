/* run_model.c: run a model exported by cuvil from C, with no Python.
 *
 *   sess.export_library("model.so")       # Python, once: writes model.so and model.h
 *   cc -O2 -o run_model run_model.c -I. -L. -l:model.so -Wl,-rpath,'$ORIGIN'
 *   ./run_model [--threads N] [--runs N] [--out DIR] [input0.bin input1.bin ...]
 *
 * Each input is read from a raw file (the tensor's bytes, row-major, native byte order, exactly
 * MODEL_INPUT_BYTES[i] bytes); an input without a file is filled with 0.01 * (k % 100) for
 * float32 inputs (zero bytes otherwise). The program runs the model, prints every output's name,
 * size, first values and sum, and with --out writes output j to DIR/output<j>.bin. With --runs N
 * it also runs N more times and prints the mean latency.
 *
 * It uses the pointer-array entry point, so it works for any model exported as "model.so"
 * (symbols prefixed model_); with a known model the typed entry point reads better, e.g.
 *   float x[MODEL_INPUT_X_ELEMENTS], logits[MODEL_OUTPUT_LOGITS_ELEMENTS];
 *   int32_t status = model_run(x, logits);
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model.h"

static const char *input_names[] = MODEL_INPUT_NAMES;
static const char *output_names[] = MODEL_OUTPUT_NAMES;
static const char *input_dtypes[] = MODEL_INPUT_DTYPES;
static const char *output_dtypes[] = MODEL_OUTPUT_DTYPES;
static const int64_t input_bytes[] = MODEL_INPUT_BYTES;
static const int64_t output_bytes[] = MODEL_OUTPUT_BYTES;

static int read_input(const char *path, void *dst, int64_t nbytes) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "cannot open %s\n", path);
        return -1;
    }
    size_t got = fread(dst, 1, (size_t)nbytes, f);
    int extra = fgetc(f) != EOF;
    fclose(f);
    if ((int64_t)got != nbytes || extra) {
        fprintf(stderr, "%s: expected exactly %lld bytes\n", path, (long long)nbytes);
        return -1;
    }
    return 0;
}

static double element(const void *data, const char *dtype, int64_t k) {
    if (!strcmp(dtype, "float32")) return ((const float *)data)[k];
    if (!strcmp(dtype, "float64")) return ((const double *)data)[k];
    if (!strcmp(dtype, "int64")) return (double)((const int64_t *)data)[k];
    if (!strcmp(dtype, "int32")) return ((const int32_t *)data)[k];
    return ((const uint8_t *)data)[k];  /* bool, uint8 and anything else: the bytes */
}

static int64_t elements(const char *dtype, int64_t nbytes) {
    if (!strcmp(dtype, "float64") || !strcmp(dtype, "int64")) return nbytes / 8;
    if (!strcmp(dtype, "float32") || !strcmp(dtype, "int32")) return nbytes / 4;
    return nbytes;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

int main(int argc, char **argv) {
    void *inputs[MODEL_NUM_INPUTS];
    void *outputs[MODEL_NUM_OUTPUTS];
    const char *files[MODEL_NUM_INPUTS] = {0};
    const char *out_dir = NULL;
    int runs = 0, n_files = 0;

    for (int a = 1; a < argc; a++) {
        if (!strcmp(argv[a], "--threads") && a + 1 < argc) {
            model_set_num_threads(atoi(argv[++a]));  /* <= 0: libgomp's default */
        } else if (!strcmp(argv[a], "--runs") && a + 1 < argc) {
            runs = atoi(argv[++a]);
        } else if (!strcmp(argv[a], "--out") && a + 1 < argc) {
            out_dir = argv[++a];
        } else if (n_files < MODEL_NUM_INPUTS) {
            files[n_files++] = argv[a];
        } else {
            fprintf(stderr, "the model has %d input(s); unexpected argument %s\n", MODEL_NUM_INPUTS, argv[a]);
            return 2;
        }
    }
    for (int i = 0; i < MODEL_NUM_INPUTS; i++) {
        inputs[i] = malloc(input_bytes[i] ? (size_t)input_bytes[i] : 1);
        if (!inputs[i]) return 1;
        if (files[i]) {
            if (read_input(files[i], inputs[i], input_bytes[i])) return 1;
        } else if (!strcmp(input_dtypes[i], "float32")) {
            for (int64_t k = 0; k < input_bytes[i] / 4; k++) ((float *)inputs[i])[k] = 0.01f * (float)(k % 100);
        } else {
            memset(inputs[i], 0, (size_t)input_bytes[i]);
        }
        printf("input %s: %lld bytes from %s\n", input_names[i], (long long)input_bytes[i],
               files[i] ? files[i] : "a pattern");
    }
    for (int j = 0; j < MODEL_NUM_OUTPUTS; j++) {
        outputs[j] = malloc(output_bytes[j] ? (size_t)output_bytes[j] : 1);
        if (!outputs[j]) return 1;
    }

    /* NULL workspace: the library allocates model_workspace_size() bytes for this call. */
    int32_t status = model_run_array((const void *const *)inputs, outputs, NULL);
    if (status != MODEL_OK) {
        fprintf(stderr, "model_run_array failed with status %d\n", status);
        return 1;
    }

    for (int j = 0; j < MODEL_NUM_OUTPUTS; j++) {
        int64_t n = elements(output_dtypes[j], output_bytes[j]);
        double sum = 0;
        printf("output %s: %s, %lld elements:", output_names[j], output_dtypes[j], (long long)n);
        for (int64_t k = 0; k < n; k++) {
            double v = element(outputs[j], output_dtypes[j], k);
            sum += v;
            if (k < 8) printf(" %.6g", v);
        }
        printf("%s sum %.6g\n", n > 8 ? " ..." : "", sum);
        if (out_dir) {
            char path[4096];
            snprintf(path, sizeof path, "%s/output%d.bin", out_dir, j);
            FILE *f = fopen(path, "wb");
            if (!f || fwrite(outputs[j], 1, (size_t)output_bytes[j], f) != (size_t)output_bytes[j]) {
                fprintf(stderr, "cannot write %s\n", path);
                return 1;
            }
            fclose(f);
        }
    }

    if (runs > 0) {
        /* one workspace for every timed call: no allocation inside the loop */
        void *workspace = malloc((size_t)model_workspace_size() + 64);
        double t0 = now();
        for (int r = 0; r < runs && status == MODEL_OK; r++)
            status = model_run_array((const void *const *)inputs, outputs, workspace);
        double dt = now() - t0;
        free(workspace);
        if (status != MODEL_OK) return 1;
        printf("latency: %.3f ms per run (mean of %d)\n", 1e3 * dt / runs, runs);
    }
    for (int i = 0; i < MODEL_NUM_INPUTS; i++) free(inputs[i]);
    for (int j = 0; j < MODEL_NUM_OUTPUTS; j++) free(outputs[j]);
    return 0;
}
