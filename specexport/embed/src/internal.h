/* What the two halves of libspecexport tell each other: abi.c (handles, errors, threads: no Python) and
 * python.c (the embedded interpreter and the calls into specexport.embed.bridge). */
#ifndef SPECEXPORT_INTERNAL_H
#define SPECEXPORT_INTERNAL_H

#include <stdatomic.h>

#include "specexport.h"

/* Set this thread's last error (printf-style, one line) and return `code`. */
specexport_status se_fail(specexport_status code, const char* format, ...) __attribute__((format(printf, 2, 3)));

/* One generation in flight, as python.c sees it: where to stream, and the flags it polls between steps. */
struct se_call {
    specexport_stream_fn stream; /* may be NULL */
    void* user;
    uint64_t engine_id;          /* whose callback this is (closing that engine from it is refused) */
    const atomic_int* cancelled; /* set by specexport_cancel / specexport_close, from any thread */
    int callback_error;          /* the callback's negative return value, 0 if none */
};

/* Hand new ids or text to the caller's callback (called without the interpreter lock); nonzero = stop. */
int se_stream(struct se_call* call, const int32_t* ids, size_t n_ids, const char* text, size_t text_len);

/* The interpreter side. Each takes the interpreter lock itself and returns with it released. `engine` is the
 * bridge's engine object, opaque here. */
specexport_status se_py_open(const char* path, const specexport_open_options* options, void** engine);
specexport_status se_py_generate(void* engine, const specexport_generate_options* options, struct se_call* call,
                                 specexport_stats* stats);
void se_py_release(void* engine);

/* For a thread about to block (closing an engine): drop the interpreter lock if this thread holds it (a Python
 * host calling through ctypes.PyDLL), so that the generations it waits for can finish; se_py_relock takes it back. */
void* se_py_unlock(void);
void se_py_relock(void* state);

#endif
