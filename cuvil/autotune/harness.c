/* cuvil's timing harness for a board reachable only by a command (cuvil/autotune/exec_board.py).
 *
 * cuvil cross-builds this file once per architecture; it works for any exported kernel without being
 * rebuilt: it dlopens each library and calls the entry point that the library's cuvil_module_meta()
 * names, int32_t NAME(void **args, int64_t *sizes) (cuvil/runtime/module.py, c_header).  Everything
 * travels on stdin and stdout, so the command prefix may be an emulator (qemu-aarch64 -L ...) or a remote
 * shell (ssh board): no file is shared with the caller.
 *
 *   harness facts
 *       prints "key value" lines: arch, host, system, cores, cache <level><type> <size>, hwcap (AArch64's
 *       AT_HWCAP and AT_HWCAP2, hex), cpuflags (/proc/cpuinfo's), governor.
 *   harness time MODE THREADS FLUSH_BYTES REPEAT MIN_RUN_S BUDGET_S BEST_REL ROUNDS LIMIT_S
 *       MODE: "run" (library 0 the candidate, library 1, if any, the untuned schedule timed in turns with it)
 *       or "final" (every library against library 0 in interleaved rounds).  BEST_REL < 0: none.
 *       LIMIT_S: the process ends itself (SIGALRM) after that many seconds, also on a remote board.
 *   stdin: records "<tag> <nbytes> <arg>\n" followed by nbytes bytes: "lib <n> -" (a library), "in <n> -"
 *       (an input), "out <n> -" (an output's initial contents: NaN shows an element left unwritten),
 *       "size 0 <value>" (sizes[j] in order), "end 0 -"; sizes, inputs and outputs come before the libraries.
 *   stdout: "meta <k> <json>" per library, then each library is called once (the check) and its outputs
 *       follow as "data <k> <j> <nbytes>\n" + bytes; then "checked".  The caller compares them and answers
 *       on stdin "go <k> ..." (the libraries to time, those that were right) or "quit"; each timed library
 *       gives "time <k> <median seconds per call> <median ratio to the reference, or nan>", then "done".
 * Exit status: 0 done, 2 bad input or library, 3 a kernel returned a non-zero status.
 *
 * The timing protocol is cuvil/autotune/worker.py's (_time, _final_round, _number): a buffer larger than
 * the last-level cache is written before each timed run, which starts with one untimed call; medians.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/auxv.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#define MAX_LIBS 16
#define MAX_BUFS 64
#define PLACE_OFFSET 16 /* bytes past a page boundary, as numpy's large arrays (worker.py _placed) */

typedef int32_t (*kernel_fn)(void **, int64_t *);
typedef void (*threads_fn)(int32_t);
typedef const char *(*meta_fn)(void);

typedef struct {
    kernel_fn call;
    void *args[MAX_BUFS];
} Lib;

static Lib libs[MAX_LIBS];
static int n_libs, n_in, n_out, n_sizes;
static void *inputs[MAX_BUFS], *out_init[MAX_BUFS];
static long in_bytes[MAX_BUFS], out_bytes[MAX_BUFS];
static int64_t sizes[MAX_BUFS];
static uint64_t *flush_buf;
static long flush_n;

static void fail(int code, const char *what, const char *detail) {
    fprintf(stderr, "harness: %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
    exit(code);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void *placed(long nbytes) {
    char *p = NULL;
    if (posix_memalign((void **)&p, 4096, (size_t)nbytes + 4096)) fail(2, "out of memory", NULL);
    return p + PLACE_OFFSET;
}

/* The entry point's name: the first string of "functions" in the library's cuvil_module_meta(). */
static void entry_name(const char *module_meta, char *name, size_t cap) {
    const char *p = module_meta ? strstr(module_meta, "\"functions\"") : NULL;
    p = p ? strchr(p, '[') : NULL;
    p = p ? strchr(p, '"') : NULL;
    const char *q = p ? strchr(p + 1, '"') : NULL;
    if (!q || (size_t)(q - p) >= cap) fail(2, "the library is not a cuvil kernel (no functions in cuvil_module_meta)", NULL);
    memcpy(name, p + 1, (size_t)(q - p - 1));
    name[q - p - 1] = 0;
}

static void load(Lib *lib, int k, const char *bytes, long n, int threads) {
    const char *dir = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    char path[4096], name[256], sym[300];
    snprintf(path, sizeof path, "%s/cuvil-lib-XXXXXX", dir);
    int fd = mkstemp(path);
    if (fd < 0 || write(fd, bytes, (size_t)n) != n || close(fd)) fail(2, "cannot write the library to", path);
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    unlink(path);
    if (!h) fail(2, "dlopen", dlerror());
    meta_fn module_meta = (meta_fn)dlsym(h, "cuvil_module_meta");
    entry_name(module_meta ? module_meta() : NULL, name, sizeof name);
    lib->call = (kernel_fn)dlsym(h, name);
    if (!lib->call) fail(2, "no entry point", name);
    snprintf(sym, sizeof sym, "%s_set_num_threads", name);
    threads_fn set_threads = (threads_fn)dlsym(h, sym);
    if (set_threads) set_threads(threads);
    snprintf(sym, sizeof sym, "cuvil_meta_%s", name);
    meta_fn meta = (meta_fn)dlsym(h, sym);
    printf("meta %d %s\n", k, meta ? meta() : "{}");
    for (int i = 0; i < n_in; i++) lib->args[i] = inputs[i]; /* inputs are shared, outputs are the library's */
    for (int j = 0; j < n_out; j++) {
        lib->args[n_in + j] = placed(out_bytes[j]);
        memcpy(lib->args[n_in + j], out_init[j], (size_t)out_bytes[j]);
    }
}

static void read_records(int threads) {
    char tag[16], arg[64];
    long n;
    for (;;) {
        if (scanf("%15s %ld %63s", tag, &n, arg) != 3 || getchar() != '\n' || n < 0) fail(2, "bad record on stdin", NULL);
        if (!strcmp(tag, "end")) return;
        char *buf = placed(n > 0 ? n : 1);
        if (n > 0 && fread(buf, 1, (size_t)n, stdin) != (size_t)n) fail(2, "short record on stdin", tag);
        if (!strcmp(tag, "in") && n_in < MAX_BUFS) inputs[n_in] = buf, in_bytes[n_in++] = n;
        else if (!strcmp(tag, "out") && n_in + n_out < MAX_BUFS) out_init[n_out] = buf, out_bytes[n_out++] = n;
        else if (!strcmp(tag, "size") && n_sizes < MAX_BUFS) sizes[n_sizes++] = atoll(arg);
        else if (!strcmp(tag, "lib") && n_libs < MAX_LIBS) load(&libs[n_libs], n_libs, buf, n, threads), n_libs++;
        else fail(2, "unknown or one too many record", tag);
    }
}

static void call(Lib *lib) {
    int32_t rc = lib->call(lib->args, sizes);
    if (rc != 0) {
        fprintf(stderr, "harness: the kernel returned status %d\n", rc);
        exit(3);
    }
}

/* Seconds per call of n calls, after writing the flush buffer if asked (worker.py _timed). */
static double timed(Lib *lib, int flush, int n) {
    if (flush)
        for (long i = 0; i < flush_n; i++) flush_buf[i] += 1; /* integers: quick under an emulator too */
    double t0 = now();
    for (int i = 0; i < n; i++) call(lib);
    return (now() - t0) / n;
}

/* From a flushed cache, one untimed call, then n timed ones: a kernel called in a loop. */
static double run(Lib *lib, int n) {
    timed(lib, 1, 1);
    return timed(lib, 0, n);
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    if (n == 0) return NAN;
    qsort(v, (size_t)n, sizeof *v, by_value);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Calls per timed run, one count for all the libraries compared (worker.py _number). */
static int number(const double *warm, int n, double min_run) {
    double lo = warm[0], hi = warm[0];
    for (int i = 1; i < n; i++) lo = fmin(lo, warm[i]), hi = fmax(hi, warm[i]);
    double a = min_run / fmax(lo, 1e-9), b = 10.0 * min_run / fmax(hi, 1e-9);
    double c = fmin(1000.0, fmin(floor(a), floor(b)));
    return c < 1 ? 1 : (int)c;
}

/* The candidate (library 0), timed in turns with the untuned schedule (library 1, if live) (worker.py _time). */
static void time_run(const int *live, int n_live, int repeat, double min_run, double budget, double best) {
    Lib *cand = &libs[0], *ref = n_live > 1 ? &libs[1] : NULL;
    if (n_live < 1 || live[0] != 0) return;
    double first = timed(cand, 0, 1), ref_first = ref ? timed(ref, 0, 1) : 0.0, warm[2] = {first, ref_first};
    int num = number(warm, ref_first > 0 ? 2 : 1, min_run);
    if (best > 0 && ref_first > 0 && first / ref_first > 3.0 * best) repeat = repeat < 2 ? repeat : 2;
    else if (best > 0 && ref_first > 0 && first / ref_first < 1.1 * best) repeat *= 2;
    double per_round = (first + ref_first) * num, fit = floor(budget / fmax(per_round, 1e-9));
    repeat = (int)fmax(1.0, fmin((double)repeat, fit));
    double *times = calloc((size_t)repeat, sizeof(double)), *ratios = calloc((size_t)repeat, sizeof(double));
    int n_ratios = 0;
    for (int k = 0; k < repeat; k++) { /* the two take turns going first */
        double r = ref && k % 2 == 0 ? run(ref, num) : 0.0;
        double t = run(cand, num);
        if (ref && k % 2) r = run(ref, num);
        times[k] = t;
        if (r > 0) ratios[n_ratios++] = t / r;
    }
    printf("time 0 %.9e %.9e\n", median(times, repeat), median(ratios, n_ratios));
}

/* Every live library against library 0, each round starting at the next one (worker.py _final_round). */
static void time_final(const int *live, int n_live, int rounds, double min_run, double budget) {
    double warm[MAX_LIBS] = {0}, per_round = 0.0, *times[MAX_LIBS];
    if (n_live == 0) return;
    for (int i = 0; i < n_live; i++) warm[i] = timed(&libs[live[i]], 0, 1);
    int num = number(warm, n_live, min_run);
    for (int i = 0; i < n_live; i++) per_round += warm[i] * num;
    double fit = floor(budget / fmax(per_round, 1e-9));
    rounds = (int)fmax(3.0, fmin((double)rounds, fit));
    for (int i = 0; i < n_live; i++) times[i] = calloc((size_t)rounds, sizeof(double));
    for (int r = 0; r < rounds; r++)
        for (int s = 0; s < n_live; s++) {
            int i = (r + s) % n_live;
            times[i][r] = run(&libs[live[i]], num);
        }
    double ratios[4096];
    for (int i = 0; i < n_live; i++) {
        int n_ratio = 0;
        for (int r = 0; r < rounds && r < 4096 && live[0] == 0; r++) ratios[n_ratio++] = times[i][r] / times[0][r];
        double ratio = median(ratios, n_ratio);
        printf("time %d %.9e %.9e\n", live[i], median(times[i], rounds), ratio);
    }
}

static void facts(void) {
    struct utsname u;
    if (uname(&u) == 0) printf("arch %s\nhost %s\nsystem %s\n", u.machine, u.nodename, u.sysname);
    printf("cores %ld\n", sysconf(_SC_NPROCESSORS_ONLN));
    char path[256], line[8192];
    for (int i = 0; i < 8; i++) {
        char level[16] = "", type[32] = "", size[32] = "";
        const char *keys[3] = {"level", "type", "size"};
        char *vals[3] = {level, type, size};
        for (int f = 0; f < 3; f++) {
            snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/%s", i, keys[f]);
            FILE *fp = fopen(path, "r");
            if (fp && fscanf(fp, "%15s", vals[f]) != 1) vals[f][0] = 0;
            if (fp) fclose(fp);
        }
        if (level[0] && size[0]) printf("cache L%s%s %s\n", level, type, size);
    }
#ifdef __aarch64__
    printf("hwcap %lx %lx\n", getauxval(AT_HWCAP), getauxval(AT_HWCAP2));
#endif
    FILE *fp = fopen("/proc/cpuinfo", "r");
    while (fp && fgets(line, sizeof line, fp))
        if (!strncmp(line, "flags", 5) || !strncmp(line, "Features", 8)) {
            printf("cpuflags %s", strchr(line, ':') ? strchr(line, ':') + 1 : "\n");
            break;
        }
    if (fp) fclose(fp);
    fp = fopen("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor", "r");
    if (fp && fgets(line, sizeof line, fp)) printf("governor %s", line);
    if (fp) fclose(fp);
}

int main(int argc, char **argv) {
    if (argc == 2 && !strcmp(argv[1], "facts")) {
        facts();
        return 0;
    }
    if (argc != 11 || strcmp(argv[1], "time")) fail(2, "usage: harness facts | harness time MODE THREADS FLUSH_BYTES "
                                                      "REPEAT MIN_RUN_S BUDGET_S BEST_REL ROUNDS LIMIT_S", NULL);
    int final = !strcmp(argv[2], "final"), threads = atoi(argv[3]), repeat = atoi(argv[5]), rounds = atoi(argv[9]);
    double min_run = atof(argv[6]), budget = atof(argv[7]), best = atof(argv[8]);
    alarm((unsigned)atoi(argv[10]));
    flush_n = atol(argv[4]) / 8;
    flush_buf = calloc((size_t)(flush_n > 0 ? flush_n : 1), sizeof(uint64_t));
    read_records(threads);
    for (int k = 0; k < n_libs; k++) { /* the check: one call on outputs holding NaN */
        if (final) timed(&libs[k], 1, 1);
        else call(&libs[k]);
        for (int j = 0; j < n_out; j++) {
            printf("data %d %d %ld\n", k, j, out_bytes[j]);
            fwrite(libs[k].args[n_in + j], 1, (size_t)out_bytes[j], stdout);
        }
    }
    printf("checked\n");
    fflush(stdout);
    int live[MAX_LIBS], n_live = 0, k, used;
    char word[16];
    if (scanf("%15s", word) != 1 || strcmp(word, "go")) return 0; /* "quit": nothing to time */
    char rest[1024];
    if (!fgets(rest, sizeof rest, stdin)) return 0;
    for (char *p = rest; n_live < MAX_LIBS && sscanf(p, "%d%n", &k, &used) == 1; p += used)
        if (k >= 0 && k < n_libs) live[n_live++] = k;
    if (final) time_final(live, n_live, rounds, min_run, budget);
    else time_run(live, n_live, repeat, min_run, budget, best);
    printf("done\n");
    return 0;
}
