/* A tiny driver for an exported cuvil library, cross-compiled for AArch64 and run under qemu.
 *
 *   harness <n_sizes> <size>... (in|out) <file> <bytes> ...
 *
 * Each buffer is read from its file (inputs) or left as zeros (outputs), the function `kernel`
 * (declared by the exported header kernel.h) is called once, and every output is written back to its file.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>

#include "kernel.h"

int main(int argc, char **argv) {
    int a = 1, n_sizes = atoi(argv[a++]);
    int64_t sizes[16];
    void *args[32];
    const char *paths[32];
    long nbytes[32];
    int is_out[32], n = 0;
    for (int j = 0; j < n_sizes; j++) sizes[j] = atoll(argv[a++]);
    while (a + 2 < argc) {
        is_out[n] = strcmp(argv[a++], "out") == 0;
        paths[n] = argv[a++];
        nbytes[n] = atol(argv[a++]);
        args[n] = calloc(nbytes[n] > 0 ? nbytes[n] : 1, 1);
        if (!is_out[n]) {
            FILE *f = fopen(paths[n], "rb");
            if (!f || fread(args[n], 1, nbytes[n], f) != (size_t)nbytes[n]) { fprintf(stderr, "read %s\n", paths[n]); return 2; }
            fclose(f);
        }
        n++;
    }
    kernel_set_num_threads(THREADS);
    int32_t rc = kernel(args, sizes);
    if (rc != 0) { fprintf(stderr, "kernel returned %d\n", rc); return 3; }
    for (int i = 0; i < n; i++) {
        if (!is_out[i]) continue;
        FILE *f = fopen(paths[i], "wb");
        if (!f || fwrite(args[i], 1, nbytes[i], f) != (size_t)nbytes[i]) { fprintf(stderr, "write %s\n", paths[i]); return 4; }
        fclose(f);
    }
    printf("ok %s\n", cuvil_meta_kernel() ? "meta" : "");
    return 0;
}
