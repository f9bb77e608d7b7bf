/* abi_check: drives libspecexport's C ABI for tests/test_embed.py, one JSON object per line on stdout.
 *
 *   abi_check errors BUNDLE                      every bad input: its status and message
 *   abi_check concurrent BUNDLE THREADS N PROMPT...  greedy tokens of each prompt serially, then from THREADS threads
 *                                                sharing the engine at once; with each generation's start and end
 *   abi_check cancel BUNDLE AFTER PROMPT [close] cancel from another thread once AFTER ids have streamed (or
 *                                                close the engine under the running generation)
 *   abi_check lifecycle BUNDLE CYCLES            open, generate, close CYCLES times: RSS and threads before/after
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <stddef.h>

#include "specexport.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void print_string(const char* s) {
    putchar('"');
    for (; *s; s++) {
        if (*s == '"' || *s == '\\') printf("\\%c", *s);
        else if ((unsigned char)*s < 0x20) printf("\\u%04x", *s);
        else putchar(*s);
    }
    putchar('"');
}

static void report(const char* name, specexport_status status) {
    printf("{\"case\": \"%s\", \"status\": \"%s\", \"message\": ", name, specexport_status_name(status));
    print_string(specexport_last_error());
    printf("}\n");
    fflush(stdout);
}

/* A growing list of the ids streamed to a callback, and how many calls brought them. */
struct collected {
    int32_t ids[4096];
    size_t n;
    int calls;
    int answer; /* what the callback returns */
    specexport_engine* engine; /* for the callback that tries to close its own engine */
    specexport_status close_status;
};

static int collect(void* user, const int32_t* ids, size_t n, const char* text, size_t len) {
    (void)text, (void)len;
    struct collected* c = user;
    for (size_t i = 0; i < n && c->n < 4096; i++) c->ids[c->n++] = ids[i];
    c->calls++;
    if (c->engine != NULL) {
        c->close_status = specexport_close(c->engine);
        report("close_from_own_callback", c->close_status);
        c->engine = NULL;
    }
    return c->answer;
}

static void print_ids(const int32_t* ids, size_t n) {
    putchar('[');
    for (size_t i = 0; i < n; i++) printf(i ? ", %d" : "%d", ids[i]);
    putchar(']');
}

static specexport_engine* open_with_threads(const char* bundle, int threads) {
    specexport_engine* e = NULL;
    specexport_open_options o;
    specexport_open_options_init(&o);
    o.threads = threads;
    o.verify = 0;
    if (specexport_open(bundle, &o, &e) != SPECEXPORT_OK) {
        fprintf(stderr, "abi_check: %s\n", specexport_last_error());
        exit(1);
    }
    return e;
}

static specexport_engine* open_or_die(const char* bundle) { return open_with_threads(bundle, 1); }

static specexport_generate_options greedy(const char* prompt, uint32_t max_new_tokens) {
    specexport_generate_options g;
    specexport_generate_options_init(&g);
    g.prompt = prompt;
    g.raw = 1;
    g.max_new_tokens = max_new_tokens;
    return g;
}

/* ---- errors -------------------------------------------------------------------------------------------------- */

static void open_with(const char* name, const char* bundle, int threads, const char* device, const char* settings) {
    specexport_engine* e = NULL;
    specexport_open_options o;
    specexport_open_options_init(&o);
    o.threads = threads, o.device = device, o.settings = settings, o.verify = 0;
    report(name, specexport_open(bundle, &o, &e));
    specexport_close(e);
}

static int errors(const char* bundle) {
    specexport_engine* e = NULL;
    specexport_open_options o;
    specexport_open_options_init(&o);
    report("open_missing_bundle", specexport_open("/nonexistent/bundle", NULL, &e));
    report("open_null_handle", specexport_open(bundle, NULL, NULL));
    report("open_null_path", specexport_open(NULL, NULL, &e));
    o.size = 8;
    report("open_bad_struct_size", specexport_open(bundle, &o, &e));
    open_with("open_unknown_setting", bundle, 1, NULL, "{\"depth\": 3}");
    open_with("open_setting_wrong_type", bundle, 1, NULL, "{\"draft_length\": \"four\"}");
    open_with("open_settings_not_json", bundle, 1, NULL, "{draft_length: 4");
    open_with("open_settings_not_object", bundle, 1, NULL, "[1, 2]");
    open_with("open_negative_threads", bundle, -1, NULL, NULL);
    open_with("open_unknown_device", bundle, 1, "tpu", NULL);

    e = open_or_die(bundle);
    struct collected c = {0};
    specexport_stats stats = {.size = sizeof stats};
    specexport_generate_options g = greedy("the cat", 8);
    g.top_p = 0;
    report("top_p_zero", specexport_generate(e, &g, collect, &c, &stats));
    g = greedy("the cat", 8), g.temperature = -1;
    report("negative_temperature", specexport_generate(e, &g, collect, &c, &stats));
    g = greedy("the cat", 8), g.top_k = -2;
    report("negative_top_k", specexport_generate(e, &g, collect, &c, &stats));
    g = greedy("the cat", 8), g.temperature = 0.8, g.seed = -5;  /* only -1 means a fresh random stream */
    report("seed_below_minus_one", specexport_generate(e, &g, collect, &c, &stats));
    g = greedy("the cat", 0);
    report("zero_max_new_tokens", specexport_generate(e, &g, collect, &c, &stats));
    g = greedy("the cat", 8), g.constraint = "ab";  /* a constraint's text without its kind */
    report("constraint_without_kind", specexport_generate(e, &g, collect, &c, &stats));
    g = greedy("the cat", 8), g.constraint_kind = "regex", g.constraint = "(ab";
    report("constraint_bad_regex", specexport_generate(e, &g, collect, &c, &stats));
    g = greedy("the cat", 8), g.constraint_kind = "xml", g.constraint = "<a/>";
    report("constraint_unknown_kind", specexport_generate(e, &g, collect, &c, &stats));
    g = greedy("the cat", 8), g.repetition_penalty = 0;
    report("repetition_penalty_zero", specexport_generate(e, &g, collect, &c, &stats));
    g = greedy("the cat", 8), g.size = offsetof(specexport_generate_options, min_p);  /* a caller built before them */
    report("struct_before_the_knobs", specexport_generate(e, &g, collect, &c, &stats));
    g = greedy(NULL, 8);
    report("no_prompt", specexport_generate(e, &g, collect, &c, &stats));
    int32_t ids[4] = {5, 6, 7, 8};
    g = greedy("the cat", 8), g.prompt_ids = ids, g.n_prompt_ids = 4;
    report("two_prompts", specexport_generate(e, &g, collect, &c, &stats));
    g = greedy("caf\xc3(", 8);
    report("prompt_not_utf8", specexport_generate(e, &g, collect, &c, &stats));
    static int32_t long_prompt[100000];
    for (size_t i = 0; i < 100000; i++) long_prompt[i] = 5 + (int32_t)(i % 7);
    g = greedy(NULL, 8), g.prompt_ids = long_prompt, g.n_prompt_ids = 100000;
    report("prompt_over_context", specexport_generate(e, &g, collect, &c, &stats));
    ids[0] = 1 << 30;
    g = greedy(NULL, 8), g.prompt_ids = ids, g.n_prompt_ids = 4;
    report("prompt_id_out_of_range", specexport_generate(e, &g, collect, &c, &stats));
    const char* empty_stop[] = {""};
    g = greedy("the cat", 8), g.stop = empty_stop, g.n_stop = 1;
    report("empty_stop_string", specexport_generate(e, &g, collect, &c, &stats));
    g = greedy("the cat", 8), g.stop = NULL, g.n_stop = 2;
    report("stop_count_without_list", specexport_generate(e, &g, collect, &c, &stats));
    int32_t bad_stop_id = -3;
    g = greedy("the cat", 8), g.stop_ids = &bad_stop_id, g.n_stop_ids = 1;
    report("stop_id_out_of_range", specexport_generate(e, &g, collect, &c, &stats));
    report("generate_null_options", specexport_generate(e, NULL, collect, &c, &stats));
    specexport_stats small = {.size = 16};
    g = greedy("the cat", 8);
    report("stats_bad_size", specexport_generate(e, &g, collect, &c, &small));
    report("cancel_request_0", specexport_cancel(e, 0));
    report("cancel_not_running", specexport_cancel(e, 42));

    /* the callback: NULL (no streaming), STOP, an error, closing its own engine */
    g = greedy("the cat", 8);
    specexport_status status = specexport_generate(e, &g, NULL, NULL, &stats);
    report("null_callback", status);
    printf("{\"case\": \"null_callback_stats\", \"new_tokens\": %llu, \"stop_reason\": %d}\n",
           (unsigned long long)stats.new_tokens, stats.stop_reason);
    memset(&c, 0, sizeof c), c.answer = SPECEXPORT_STREAM_STOP;
    g = greedy("the cat", 200);  /* room for the steps the engine may make before this thread runs the callback */
    status = specexport_generate(e, &g, collect, &c, &stats);
    g = greedy("the cat", 8);
    report("callback_stop", status);
    printf("{\"case\": \"callback_stop_stats\", \"calls\": %d, \"stop_reason\": %d, \"new_tokens\": %llu}\n", c.calls,
           stats.stop_reason, (unsigned long long)stats.new_tokens);
    memset(&c, 0, sizeof c), c.answer = -7;
    report("callback_error", specexport_generate(e, &g, collect, &c, &stats));
    printf("{\"case\": \"callback_error_calls\", \"calls\": %d}\n", c.calls);
    memset(&c, 0, sizeof c), c.engine = e;
    report("generate_after_close_from_callback", specexport_generate(e, &g, collect, &c, &stats));

    /* use after close */
    report("close", specexport_close(e));
    report("generate_after_close", specexport_generate(e, &g, collect, &c, &stats));
    report("cancel_after_close", specexport_cancel(e, 1));
    report("close_twice", specexport_close(e));
    report("close_null", specexport_close(NULL));
    report("bogus_handle", specexport_generate((specexport_engine*)(uintptr_t)0xdeadbeef, &g, NULL, NULL, NULL));
    return 0;
}

/* ---- concurrency ----------------------------------------------------------------------------------------- */

struct together { /* the generations started at once: how many, and how many have streamed */
    int count;
    atomic_int streamed;
};

struct job {
    specexport_engine* engine;
    const char* prompt;
    uint32_t n;
    struct collected out;
    specexport_status status;
    double start, first, end; /* first: when its first ids streamed */
    struct together* together; /* NULL: alone */
};

/* The job's first ids: with others started at once, wait (at most 60 s) until every one of them has streamed too,
 * so that none can end before all run, however fast this machine or late a thread. The callback runs without the
 * interpreter lock: the engine goes on meanwhile. With one generation at a time the others never stream, the wait
 * times out, and their first ids come after this one's end. */
static int collect_job(void* user, const int32_t* ids, size_t n, const char* text, size_t len) {
    struct job* j = user;
    if (j->first == 0.0) {
        j->first = now();
        if (j->together != NULL) {
            atomic_fetch_add(&j->together->streamed, 1);
            for (int waited = 0; atomic_load(&j->together->streamed) < j->together->count && waited < 60000; waited++)
                usleep(1000);
        }
    }
    return collect(&j->out, ids, n, text, len);
}

static void* run_job(void* arg) {
    struct job* j = arg;
    specexport_generate_options g = greedy(j->prompt, j->n);
    j->start = now();
    j->status = specexport_generate(j->engine, &g, collect_job, j, NULL);
    j->end = now();
    return NULL;
}

static void print_job(const char* mode, struct job* j) {
    printf("{\"mode\": \"%s\", \"status\": \"%s\", \"start\": %.6f, \"first\": %.6f, \"end\": %.6f, "
           "\"prompt\": ", mode, specexport_status_name(j->status), j->start, j->first, j->end);
    print_string(j->prompt);
    printf(", \"tokens\": ");
    print_ids(j->out.ids, j->out.n);
    printf("}\n");
}

static int concurrent(const char* bundle, int threads, uint32_t n, int count, char** prompts) {
    specexport_engine* e = open_or_die(bundle);
    struct job* jobs = calloc((size_t)count, sizeof *jobs);
    for (int i = 0; i < count; i++) { /* serial */
        jobs[i] = (struct job){.engine = e, .prompt = prompts[i], .n = n};
        run_job(&jobs[i]);
        print_job("serial", &jobs[i]);
    }
    for (int first = 0; first < count; first += threads) { /* `threads` at a time, one engine */
        pthread_t t[64];
        int k = count - first < threads ? count - first : threads;
        struct together group = {.count = k};
        atomic_init(&group.streamed, 0);
        for (int i = 0; i < k; i++) {
            jobs[first + i] = (struct job){.engine = e, .prompt = prompts[first + i], .n = n, .together = &group};
            pthread_create(&t[i], NULL, run_job, &jobs[first + i]);
        }
        for (int i = 0; i < k; i++) pthread_join(t[i], NULL);
        for (int i = 0; i < k; i++) print_job("concurrent", &jobs[first + i]);
    }
    free(jobs);
    return specexport_close(e) != SPECEXPORT_OK;
}

/* ---- cancel ------------------------------------------------------------------------------------------------ */

struct watched {
    atomic_size_t ids, calls;
    atomic_int done;
    double last; /* when the callback last ran (read after the threads are joined) */
};

static int count_ids(void* user, const int32_t* ids, size_t n, const char* text, size_t len) {
    (void)ids, (void)text, (void)len;
    struct watched* w = user;
    atomic_fetch_add(&w->ids, n);
    atomic_fetch_add(&w->calls, 1);
    w->last = now();
    return 0;
}

struct canceller {
    specexport_engine* engine;
    struct watched* watched;
    size_t after;
    int close; /* close the engine instead of cancelling */
    size_t calls_at_cancel;
    double at, returned;
    specexport_status status;
};

static void* cancel_later(void* arg) {
    struct canceller* c = arg;
    while (atomic_load(&c->watched->ids) < c->after)
        if (atomic_load(&c->watched->done)) return NULL; /* over before it streamed enough: no cancel */
        else usleep(200);
    c->calls_at_cancel = atomic_load(&c->watched->calls); /* close: before the call (it returns at the end) */
    c->at = now();
    c->status = c->close ? specexport_close(c->engine) : specexport_cancel(c->engine, 7);
    c->returned = now();
    /* cancel: counted once it is in, not before the call: a thread preempted between the two would have let
     * more steps stream and seem late */
    if (!c->close) c->calls_at_cancel = atomic_load(&c->watched->calls);
    return NULL;
}

static int cancel(const char* bundle, size_t after, const char* prompt, int close) {
    specexport_engine* e = open_or_die(bundle);
    struct watched w = {0};
    struct canceller c = {.engine = e, .watched = &w, .after = after, .close = close,
                          .status = SPECEXPORT_E_NOT_FOUND};
    specexport_generate_options g = greedy(prompt, 100000);
    g.raw = 0;
    g.request_id = 7;
    specexport_stats stats = {.size = sizeof stats};
    pthread_t t;
    pthread_create(&t, NULL, cancel_later, &c);
    specexport_status status = specexport_generate(e, &g, count_ids, &w, &stats);
    double end = now();
    atomic_store(&w.done, 1);
    pthread_join(t, NULL);
    printf("{\"status\": \"%s\", \"cancel_status\": \"%s\", \"stop_reason\": %d, \"new_tokens\": %llu, "
           "\"steps\": %llu, \"seconds\": %.6f, \"ids_streamed\": %zu, \"calls_at_cancel\": %zu, \"calls\": %zu, "
           "\"cancel_to_return_s\": %.6f, \"close_waited\": %d}\n",
           specexport_status_name(status), specexport_status_name(c.status), stats.stop_reason,
           (unsigned long long)stats.new_tokens, (unsigned long long)stats.steps, stats.seconds,
           atomic_load(&w.ids), c.calls_at_cancel, atomic_load(&w.calls), end - c.at, c.returned >= w.last);
    return close ? 0 : specexport_close(e) != SPECEXPORT_OK;
}

/* ---- lifecycle: leaks ------------------------------------------------------------------------------------- */

static long status_field(const char* field) { /* a "Name:   123 kB" line of /proc/self/status */
    FILE* f = fopen("/proc/self/status", "r");
    char line[256];
    long value = -1;
    size_t n = strlen(field);
    while (f != NULL && fgets(line, sizeof line, f) != NULL)
        if (strncmp(line, field, n) == 0 && line[n] == ':') value = atol(line + n + 1);
    if (f != NULL) fclose(f);
    return value;
}

static void one_cycle(const char* bundle) {
    specexport_engine* e = open_with_threads(bundle, 2); /* each session with a thread pool: a leak would show */
    specexport_generate_options g = greedy("the cat sat", 8);
    struct collected c = {0};
    if (specexport_generate(e, &g, collect, &c, NULL) != SPECEXPORT_OK || specexport_close(e) != SPECEXPORT_OK) {
        fprintf(stderr, "abi_check: %s\n", specexport_last_error());
        exit(1);
    }
}

static int lifecycle(const char* bundle, int cycles) {
    for (int i = 0; i < 5; i++) one_cycle(bundle); /* the interpreter, imports, allocator pools: once */
    long rss = status_field("VmRSS"), threads = status_field("Threads");
    double start = now();
    for (int i = 0; i < cycles; i++) one_cycle(bundle);
    printf("{\"cycles\": %d, \"seconds\": %.3f, \"rss_kb_before\": %ld, \"rss_kb_after\": %ld, "
           "\"threads_before\": %ld, \"threads_after\": %ld}\n",
           cycles, now() - start, rss, status_field("VmRSS"), threads, status_field("Threads"));
    return 0;
}

int main(int argc, char** argv) {
    if (argc >= 3 && strcmp(argv[1], "errors") == 0) return errors(argv[2]);
    if (argc >= 6 && strcmp(argv[1], "concurrent") == 0)
        return concurrent(argv[2], atoi(argv[3]), (uint32_t)atoi(argv[4]), argc - 5, argv + 5);
    if ((argc == 5 || argc == 6) && strcmp(argv[1], "cancel") == 0)
        return cancel(argv[2], (size_t)atol(argv[3]), argv[4], argc == 6 && strcmp(argv[5], "close") == 0);
    if (argc == 4 && strcmp(argv[1], "lifecycle") == 0) return lifecycle(argv[2], atoi(argv[3]));
    fprintf(stderr, "usage: abi_check errors|concurrent|cancel|lifecycle BUNDLE ...\n");
    return 2;
}
