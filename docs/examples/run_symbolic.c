/* run_symbolic.c: run a model exported by cuvil for several values of its symbolic sizes, from C.
 *
 *   sess.export_library("model.so", input_shapes=[{"x": (1, 64)}, {"x": (4, 64)}])   # Python, once
 *   cc -O2 -o run_symbolic run_symbolic.c -I. -L. -l:model.so -Wl,-rpath,'$ORIGIN'
 *   ./run_symbolic [--threads N] [--runs N] [--out DIR] NAME=VALUE ... [input0.bin input1.bin ...]
 *
 * Every symbolic size of the model (MODEL_SIZE_NAMES, e.g. N) is given as NAME=VALUE. Each input
 * is read from a raw file (row-major, native byte order, exactly the bytes its shape has with
 * these sizes); an input without a file is filled with 0.01 * (k % 100) for float32 inputs (zero
 * bytes otherwise). The program runs the model, prints every output's size, first values and sum,
 * and with --out writes output j to DIR/output<j>.bin. Sizes the library was not compiled for
 * make model_run_array return MODEL_ERR_NO_SIGNATURE: the program prints the sizes it has and
 * exits with that status (3).
 *
 * It uses the pointer-array entry point, so it works for any model with symbolic sizes exported as
 * "model.so"; with a known model the typed entry point reads better, e.g.
 *   int32_t status = model_run(N, x, logits);            // x: float[N][64], logits: float[N][10]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model.h"

static const char *size_names[] = MODEL_SIZE_NAMES;
static const char *input_names[] = MODEL_INPUT_NAMES;
static const char *output_names[] = MODEL_OUTPUT_NAMES;
static const char *input_dtypes[] = MODEL_INPUT_DTYPES;
static const char *output_dtypes[] = MODEL_OUTPUT_DTYPES;
static const int64_t signature_sizes[MODEL_NUM_SIGNATURES][MODEL_NUM_SIZES] = MODEL_SIGNATURE_SIZES;
static const int64_t signature_input_bytes[MODEL_NUM_SIGNATURES][MODEL_NUM_INPUTS] = MODEL_SIGNATURE_INPUT_BYTES;
static const int64_t signature_output_bytes[MODEL_NUM_SIGNATURES][MODEL_NUM_OUTPUTS] = MODEL_SIGNATURE_OUTPUT_BYTES;
static const int64_t signature_workspace[MODEL_NUM_SIGNATURES] = MODEL_SIGNATURE_WORKSPACE_BYTES;

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

static int64_t item_bytes(const char *dtype) {
    if (!strcmp(dtype, "float64") || !strcmp(dtype, "int64") || !strcmp(dtype, "uint64")) return 8;
    if (!strcmp(dtype, "float32") || !strcmp(dtype, "int32") || !strcmp(dtype, "uint32")) return 4;
    if (!strcmp(dtype, "float16") || !strcmp(dtype, "int16") || !strcmp(dtype, "uint16")) return 2;
    return 1;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

int main(int argc, char **argv) {
    int64_t sizes[MODEL_NUM_SIZES];
    int given[MODEL_NUM_SIZES] = {0};
    void *inputs[MODEL_NUM_INPUTS];
    void *outputs[MODEL_NUM_OUTPUTS];
    int64_t in_bytes[MODEL_NUM_INPUTS] = {0}, out_bytes[MODEL_NUM_OUTPUTS] = {0};
    const char *files[MODEL_NUM_INPUTS] = {0};
    const char *out_dir = NULL;
    int runs = 0, n_files = 0;

    for (int a = 1; a < argc; a++) {
        const char *eq = strchr(argv[a], '=');
        if (!strcmp(argv[a], "--threads") && a + 1 < argc) {
            model_set_num_threads(atoi(argv[++a]));  /* <= 0: libgomp's default */
        } else if (!strcmp(argv[a], "--runs") && a + 1 < argc) {
            runs = atoi(argv[++a]);
        } else if (!strcmp(argv[a], "--out") && a + 1 < argc) {
            out_dir = argv[++a];
        } else if (eq) {
            int s = 0;
            while (s < MODEL_NUM_SIZES && (strlen(size_names[s]) != (size_t)(eq - argv[a]) ||
                                           strncmp(size_names[s], argv[a], (size_t)(eq - argv[a]))))
                s++;
            if (s == MODEL_NUM_SIZES) {
                fprintf(stderr, "the model has no size %.*s\n", (int)(eq - argv[a]), argv[a]);
                return 2;
            }
            sizes[s] = atoll(eq + 1);
            given[s] = 1;
        } else if (n_files < MODEL_NUM_INPUTS) {
            files[n_files++] = argv[a];
        } else {
            fprintf(stderr, "the model has %d input(s); unexpected argument %s\n", MODEL_NUM_INPUTS, argv[a]);
            return 2;
        }
    }
    for (int s = 0; s < MODEL_NUM_SIZES; s++) {
        if (!given[s]) {
            fprintf(stderr, "give the size %s as %s=VALUE\n", size_names[s], size_names[s]);
            return 2;
        }
    }

    /* The signature with these sizes gives each tensor's bytes; for sizes without one, buffers of the
     * largest signature's bytes show the library's answer (MODEL_ERR_NO_SIGNATURE). */
    int sig = -1;
    for (int k = 0; k < MODEL_NUM_SIGNATURES && sig < 0; k++)
        if (!memcmp(signature_sizes[k], sizes, sizeof sizes)) sig = k;
    for (int k = 0; k < MODEL_NUM_SIGNATURES; k++) {
        if (sig >= 0 && k != sig) continue;
        for (int i = 0; i < MODEL_NUM_INPUTS; i++)
            if (signature_input_bytes[k][i] > in_bytes[i]) in_bytes[i] = signature_input_bytes[k][i];
        for (int j = 0; j < MODEL_NUM_OUTPUTS; j++)
            if (signature_output_bytes[k][j] > out_bytes[j]) out_bytes[j] = signature_output_bytes[k][j];
    }
    for (int i = 0; i < MODEL_NUM_INPUTS; i++) {
        inputs[i] = malloc(in_bytes[i] ? (size_t)in_bytes[i] : 1);
        if (!inputs[i]) return 1;
        if (files[i] && sig >= 0) {
            if (read_input(files[i], inputs[i], in_bytes[i])) return 1;
        } else if (!strcmp(input_dtypes[i], "float32")) {
            for (int64_t k = 0; k < in_bytes[i] / 4; k++) ((float *)inputs[i])[k] = 0.01f * (float)(k % 100);
        } else {
            memset(inputs[i], 0, (size_t)in_bytes[i]);
        }
        printf("input %s: %lld bytes from %s\n", input_names[i], (long long)in_bytes[i],
               files[i] ? files[i] : "a pattern");
    }
    for (int j = 0; j < MODEL_NUM_OUTPUTS; j++) {
        outputs[j] = malloc(out_bytes[j] ? (size_t)out_bytes[j] : 1);
        if (!outputs[j]) return 1;
    }

    /* NULL workspace: the library allocates the workspace of the signature for this call. */
    int32_t status = model_run_array(sizes, (const void *const *)inputs, outputs, NULL);
    if (status == MODEL_ERR_NO_SIGNATURE) {
        fprintf(stderr, "model_run_array: status %d, no compiled signature for these sizes; compiled:", status);
        for (int k = 0; k < MODEL_NUM_SIGNATURES; k++) {
            for (int s = 0; s < MODEL_NUM_SIZES; s++)
                fprintf(stderr, "%s%s=%lld", s ? ", " : " ", size_names[s], (long long)signature_sizes[k][s]);
            fprintf(stderr, "%s", k + 1 < MODEL_NUM_SIGNATURES ? ";" : "\n");
        }
        return status;
    }
    if (status != MODEL_OK) {
        fprintf(stderr, "model_run_array failed with status %d\n", status);
        return 1;
    }

    for (int j = 0; j < MODEL_NUM_OUTPUTS; j++) {
        int64_t n = out_bytes[j] / item_bytes(output_dtypes[j]);
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
            if (!f || fwrite(outputs[j], 1, (size_t)out_bytes[j], f) != (size_t)out_bytes[j]) {
                fprintf(stderr, "cannot write %s\n", path);
                return 1;
            }
            fclose(f);
        }
    }

    if (runs > 0) {
        /* one workspace for every timed call: no allocation inside the loop */
        void *workspace = malloc((size_t)signature_workspace[sig] + 64);
        double t0 = now();
        for (int r = 0; r < runs && status == MODEL_OK; r++)
            status = model_run_array(sizes, (const void *const *)inputs, outputs, workspace);
        double dt = now() - t0;
        free(workspace);
        if (status != MODEL_OK) return 1;
        printf("latency: %.3f ms per run (mean of %d)\n", 1e3 * dt / runs, runs);
    }
    for (int i = 0; i < MODEL_NUM_INPUTS; i++) free(inputs[i]);
    for (int j = 0; j < MODEL_NUM_OUTPUTS; j++) free(outputs[j]);
    return 0;
}
