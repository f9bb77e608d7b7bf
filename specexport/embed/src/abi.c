/* libspecexport's C ABI (include/specexport.h): argument checks, thread-local errors, engine handles, running
 * generations and their cancellation. Nothing here touches Python; python.c does.
 *
 * Handles. An engine handle is its id (a counter that never repeats) cast to a pointer, looked up in a registry
 * on every call: a handle used after specexport_close finds nothing and gets SPECEXPORT_E_CLOSED, never freed
 * memory, and a later engine cannot reuse its value.
 *
 * Locking. One mutex guards the registry, each engine's count of calls in flight and its list of running
 * generations; it is held only for a few pointer operations, never while Python runs or while waiting for the
 * interpreter lock, so the two locks cannot deadlock.
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#ifndef SPECEXPORT_VERSION_STRING
#define SPECEXPORT_VERSION_STRING "0.0.0"
#endif

/* ---- errors: one message per thread ------------------------------------------------------------------- */

static _Thread_local char last_error[512];

specexport_status se_fail(specexport_status code, const char* format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(last_error, sizeof last_error, format, args);
    va_end(args);
    for (char* c = last_error; *c; c++) /* one line, whatever the message held */
        if (*c == '\n' || *c == '\r') *c = ' ';
    return code;
}

static specexport_status succeed(void) {
    last_error[0] = '\0';
    return SPECEXPORT_OK;
}

uint32_t specexport_abi_version(void) { return SPECEXPORT_ABI_VERSION; }

const char* specexport_version(void) { return SPECEXPORT_VERSION_STRING; }

const char* specexport_last_error(void) { return last_error; }

const char* specexport_status_name(int status) {
    static const char* const names[] = {
        "SPECEXPORT_OK", "SPECEXPORT_E_INVALID_ARGUMENT", "SPECEXPORT_E_BUNDLE", "SPECEXPORT_E_CLOSED",
        "SPECEXPORT_E_CALLBACK", "SPECEXPORT_E_NOT_FOUND", "SPECEXPORT_E_PYTHON", "SPECEXPORT_E_RUNTIME"};
    if (status < 0 || (size_t)status >= sizeof names / sizeof names[0]) return "SPECEXPORT_E_UNKNOWN";
    return names[status];
}

/* ---- versioned structs ---------------------------------------------------------------------------------- */

/* Copy a caller's struct of `size` bytes over `defaults` (which the library's own *_init filled). A smaller
 * struct is an older caller: its missing fields keep their defaults. `oldest` is the size of the struct's first
 * version; a larger size than ours comes from a newer header than this library. */
static specexport_status read_struct(void* defaults, size_t ours, size_t oldest, const void* given,
                                     const char* name) {
    size_t size = *(const size_t*)given;
    if (size < oldest || size > ours)
        return se_fail(SPECEXPORT_E_INVALID_ARGUMENT, "%s.size is %zu, this library expects %zu (set it to sizeof, "
                       "or call %s_init)", name, size, ours, name);
    memcpy(defaults, given, size);
    return SPECEXPORT_OK;
}

void specexport_open_options_init(specexport_open_options* o) {
    if (o == NULL) return;
    memset(o, 0, sizeof *o);
    o->size = sizeof *o;
    o->device = "auto";
    o->verify = 1;
}

void specexport_generate_options_init(specexport_generate_options* o) {
    if (o == NULL) return;
    memset(o, 0, sizeof *o);
    o->size = sizeof *o;
    o->max_new_tokens = 128;
    o->top_p = 1.0;
    o->seed = -1;
    o->repetition_penalty = 1.0;
}

/* ---- the registry of engines -------------------------------------------------------------------------- */

struct generation {
    uint64_t request_id;
    atomic_int cancelled;
    struct generation* next;
};

struct engine {
    uint64_t id;
    void* py;                    /* the bridge's engine (python.c); released once no call uses it */
    int active;                  /* specexport_generate calls in flight, each in `running` */
    pthread_cond_t idle;         /* signalled when active drops to 0 */
    struct generation* running;  /* for specexport_cancel and specexport_close */
    struct engine* next;
};

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static struct engine* engines;   /* open engines */
static uint64_t last_id;
static _Thread_local uint64_t in_callback_of; /* the engine whose callback this thread runs, 0 if none */

static uint64_t handle_id(const specexport_engine* handle) { return (uint64_t)(uintptr_t)handle; }

/* The open engine of this handle with `g` registered as running on it, in one step, so that a close either
 * finds the generation (and cancels it) or the generation finds the engine closed. NULL: closed or unknown.
 * Caller: release(). */
static struct engine* acquire(const specexport_engine* handle, struct generation* g) {
    pthread_mutex_lock(&registry_lock);
    struct engine* e = engines;
    while (e != NULL && e->id != handle_id(handle)) e = e->next;
    if (e != NULL) {
        e->active++;
        g->next = e->running;
        e->running = g;
    }
    pthread_mutex_unlock(&registry_lock);
    return e;
}

static void release(struct engine* e, struct generation* g) {
    pthread_mutex_lock(&registry_lock);
    struct generation** link = &e->running;
    while (*link != g) link = &(*link)->next;
    *link = g->next;
    if (--e->active == 0) pthread_cond_broadcast(&e->idle);
    pthread_mutex_unlock(&registry_lock);
}

specexport_status specexport_open(const char* bundle_path, const specexport_open_options* options,
                                  specexport_engine** engine) {
    if (engine == NULL) return se_fail(SPECEXPORT_E_INVALID_ARGUMENT, "engine (the handle to fill) is NULL");
    *engine = NULL;
    if (bundle_path == NULL || *bundle_path == '\0')
        return se_fail(SPECEXPORT_E_INVALID_ARGUMENT, "the bundle path is NULL or empty");
    specexport_open_options o;
    specexport_open_options_init(&o);
    if (options != NULL && read_struct(&o, sizeof o, offsetof(specexport_open_options, max_batch), options,
                                       "specexport_open_options") != SPECEXPORT_OK)
        return SPECEXPORT_E_INVALID_ARGUMENT;
    void* py = NULL;
    specexport_status rc = se_py_open(bundle_path, &o, &py);
    if (rc != SPECEXPORT_OK) return rc;
    struct engine* e = calloc(1, sizeof *e);
    if (e == NULL) {
        se_py_release(py);
        return se_fail(SPECEXPORT_E_RUNTIME, "out of memory");
    }
    e->py = py;
    pthread_cond_init(&e->idle, NULL);
    pthread_mutex_lock(&registry_lock);
    e->id = ++last_id;
    e->next = engines;
    engines = e;
    pthread_mutex_unlock(&registry_lock);
    *engine = (specexport_engine*)(uintptr_t)e->id;
    return succeed();
}

specexport_status specexport_close(specexport_engine* engine) {
    if (engine == NULL) return succeed();
    if (in_callback_of == handle_id(engine))
        return se_fail(SPECEXPORT_E_INVALID_ARGUMENT, "an engine cannot be closed from one of its own callbacks");
    void* gil = se_py_unlock();
    pthread_mutex_lock(&registry_lock);
    struct engine** link = &engines;
    while (*link != NULL && (*link)->id != handle_id(engine)) link = &(*link)->next;
    struct engine* e = *link;
    if (e == NULL) {
        pthread_mutex_unlock(&registry_lock);
        se_py_relock(gil);
        return se_fail(SPECEXPORT_E_CLOSED, "the engine is closed");
    }
    *link = e->next; /* from now on every call with this handle finds nothing */
    for (struct generation* g = e->running; g != NULL; g = g->next) atomic_store(&g->cancelled, 1);
    while (e->active > 0) pthread_cond_wait(&e->idle, &registry_lock);
    pthread_mutex_unlock(&registry_lock);
    se_py_relock(gil);
    se_py_release(e->py);
    pthread_cond_destroy(&e->idle);
    free(e);
    return succeed();
}

/* ---- generation ----------------------------------------------------------------------------------------- */

int se_stream(struct se_call* call, const int32_t* ids, size_t n_ids, const char* text, size_t text_len) {
    uint64_t outer = in_callback_of;
    in_callback_of = call->engine_id;
    int result = call->stream(call->user, ids, n_ids, text, text_len);
    in_callback_of = outer;
    if (result < 0) call->callback_error = result;
    return result != SPECEXPORT_STREAM_CONTINUE;
}

specexport_status specexport_generate(specexport_engine* engine, const specexport_generate_options* options,
                                      specexport_stream_fn stream, void* user, specexport_stats* stats) {
    specexport_stats out = {0};
    if (stats != NULL && stats->size != sizeof *stats)
        return se_fail(SPECEXPORT_E_INVALID_ARGUMENT, "specexport_stats.size is %zu, this library expects %zu",
                       stats->size, sizeof *stats);
    if (options == NULL) return se_fail(SPECEXPORT_E_INVALID_ARGUMENT, "options is NULL");
    specexport_generate_options o;
    specexport_generate_options_init(&o);
    if (read_struct(&o, sizeof o, offsetof(specexport_generate_options, min_p), options,
                    "specexport_generate_options") != SPECEXPORT_OK)  /* (a struct from before the knobs: defaults) */
        return SPECEXPORT_E_INVALID_ARGUMENT;
    if ((o.constraint_kind == NULL) != (o.constraint == NULL))
        return se_fail(SPECEXPORT_E_INVALID_ARGUMENT, "give constraint_kind and constraint together, or neither");
    if ((o.n_stop > 0 && o.stop == NULL) || (o.n_stop_ids > 0 && o.stop_ids == NULL) ||
        (o.n_prompt_ids > 0 && o.prompt_ids == NULL))
        return se_fail(SPECEXPORT_E_INVALID_ARGUMENT, "a list has a count but a NULL pointer");
    for (size_t i = 0; i < o.n_stop; i++)
        if (o.stop[i] == NULL) return se_fail(SPECEXPORT_E_INVALID_ARGUMENT, "stop[%zu] is NULL", i);
    struct generation g = {.request_id = o.request_id, .cancelled = 0, .next = NULL};
    struct engine* e = acquire(engine, &g);
    if (e == NULL) return se_fail(SPECEXPORT_E_CLOSED, "the engine is closed");
    struct se_call call = {.stream = stream, .user = user, .engine_id = e->id, .cancelled = &g.cancelled};
    specexport_status rc = se_py_generate(e->py, &o, &call, &out);
    release(e, &g);

    if (rc == SPECEXPORT_OK && call.callback_error != 0)
        rc = se_fail(SPECEXPORT_E_CALLBACK, "the stream callback returned %d (an error)", call.callback_error);
    if (stats != NULL) *stats = out, stats->size = sizeof *stats;
    return rc == SPECEXPORT_OK ? succeed() : rc;
}

specexport_status specexport_cancel(specexport_engine* engine, uint64_t request_id) {
    if (request_id == 0) return se_fail(SPECEXPORT_E_INVALID_ARGUMENT, "request_id 0 names no generation");
    pthread_mutex_lock(&registry_lock);
    struct engine* e = engines;
    while (e != NULL && e->id != handle_id(engine)) e = e->next;
    int found = 0;
    for (struct generation* g = e != NULL ? e->running : NULL; g != NULL; g = g->next)
        if (g->request_id == request_id) atomic_store(&g->cancelled, 1), found = 1;
    pthread_mutex_unlock(&registry_lock);
    if (e == NULL) return se_fail(SPECEXPORT_E_CLOSED, "the engine is closed");
    if (!found)
        return se_fail(SPECEXPORT_E_NOT_FOUND, "no generation with request id %llu is running",
                       (unsigned long long)request_id);
    return succeed();
}
