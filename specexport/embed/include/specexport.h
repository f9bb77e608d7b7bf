/* specexport.h: the C ABI of libspecexport, speculative decoding of a specexport bundle from C and C++.
 *
 * One library, one loop: libspecexport embeds CPython and drives the specexport runtime installed in a Python
 * environment (the one it was built against, or SPECEXPORT_PYTHON / SPECEXPORT_VENV), so C, C++ and Python run
 * the same implementation. The ABI says nothing about Python: a native backend can implement it later and
 * callers do not change.
 *
 * Conventions
 *   - Every function returns a specexport_status (0 = SPECEXPORT_OK) unless it says otherwise. On failure,
 *     specexport_last_error() holds a one-line message for the calling thread (thread-local; valid until the
 *     next specexport_* call on that thread). No exception, C++ type or Python object crosses the ABI, and
 *     nothing is printed.
 *   - Handles are opaque. A closed engine handle stays safe to pass: every call on it returns
 *     SPECEXPORT_E_CLOSED (handles are ids looked up in a registry, never reused, never dereferenced).
 *   - Structs are versioned by their size: set the first field, `size`, to sizeof(the struct) (the *_init
 *     functions do, and fill in the defaults). A library reads only the fields a caller's struct has.
 *   - Callers own their buffers: the library copies what it is given before returning, and what it hands to a
 *     callback is valid only during that call.
 *
 * Threads
 *   - Every function may be called from any thread. One engine may be shared by many threads: generations on
 *     one engine run concurrently, batched: one model call per step verifies every running generation's tokens
 *     (each has its own KV cache rows, proposer and random stream; a seeded generation gives the same tokens
 *     whatever runs with it). With max_batch -1, or on CUDA/TensorRT, each generation makes its own calls (the
 *     Python parts of their steps take turns on the interpreter lock while the model calls overlap).
 *   - specexport_cancel may be called from any thread, including a callback.
 *   - specexport_close waits for the engine's running generations to stop (it cancels them first); it must not
 *     be called from one of that engine's callbacks (that is an error, not a deadlock).
 *   - The callback runs on the thread that called specexport_generate, without the interpreter lock: it may
 *     block, and it may call specexport_* functions (except closing its own engine).
 *
 * Run-time needs (this implementation): libpython3 of the environment's interpreter (found through the
 * library's run path) and that environment with specexport installed. The interpreter starts on the first
 * specexport_open and lives until the process exits. In a process that already runs Python (ctypes), the
 * library uses that interpreter instead, which must be able to import specexport.
 */
#ifndef SPECEXPORT_H
#define SPECEXPORT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define SPECEXPORT_API __attribute__((visibility("default"))) /* the library hides everything else */
#else
#define SPECEXPORT_API
#endif

#define SPECEXPORT_ABI_VERSION 1u

typedef enum specexport_status {
    SPECEXPORT_OK = 0,
    SPECEXPORT_E_INVALID_ARGUMENT = 1, /* a null pointer, a bad struct size, a setting out of range, a setting
                                          that does not belong to the bundle's method, a prompt over the context */
    SPECEXPORT_E_BUNDLE = 2,           /* the bundle is missing, corrupt, or cannot run here */
    SPECEXPORT_E_CLOSED = 3,           /* the engine was closed (or the handle never came from specexport_open) */
    SPECEXPORT_E_CALLBACK = 4,         /* the stream callback returned an error (a negative value) */
    SPECEXPORT_E_NOT_FOUND = 5,        /* specexport_cancel: no generation with that request id is running */
    SPECEXPORT_E_PYTHON = 6,           /* the Python environment or its specexport cannot be found or started */
    SPECEXPORT_E_RUNTIME = 7           /* anything else the runtime failed at (the message says what) */
} specexport_status;

/* Why a generation stopped (specexport_stats.stop_reason). */
typedef enum specexport_stop_reason {
    SPECEXPORT_STOP_NONE = 0,       /* it did not run (an error) */
    SPECEXPORT_STOP_EOS = 1,        /* an end-of-sequence token or one of the stop_ids (included in the tokens) */
    SPECEXPORT_STOP_STRING = 2,     /* a stop string (cut from the text) */
    SPECEXPORT_STOP_LENGTH = 3,     /* max_new_tokens */
    SPECEXPORT_STOP_CONTEXT = 4,    /* the bundle's context is full */
    SPECEXPORT_STOP_CANCELLED = 5   /* specexport_cancel, or the callback returned SPECEXPORT_STREAM_STOP */
} specexport_stop_reason;

typedef struct specexport_engine specexport_engine; /* opaque */

/* ---- version and errors -------------------------------------------------------------------------------- */

SPECEXPORT_API uint32_t specexport_abi_version(void);       /* SPECEXPORT_ABI_VERSION of the library */
SPECEXPORT_API const char* specexport_version(void);        /* the specexport release, e.g. "0.1.0" (static) */
SPECEXPORT_API const char* specexport_last_error(void);     /* this thread's last message; "" after a success */
SPECEXPORT_API const char* specexport_status_name(int status); /* "SPECEXPORT_E_BUNDLE", ... (static) */

/* ---- engines ----------------------------------------------------------------------------------------- */

typedef struct specexport_open_options {
    size_t size;            /* sizeof(specexport_open_options) */
    int32_t threads;        /* threads per model call; 0 = every core this process may use */
    const char* device;     /* "auto" (default), "cpu" or "cuda"; NULL = "auto" */
    const char* settings;   /* the method's run-time settings over the bundle's, as a JSON object of the
                               method's field names, e.g. {"tree": "chain_3"} (medusa), {"draft_length": 4}
                               (ngram, draft), {"depth": 3, "top_k": 2, "total_tokens": 6} (eagle); NULL or ""
                               = the bundle's. A name the bundle's method does not have is an error. */
    int32_t verify;         /* 1 (default): check every file's sha256 at open; 0: sizes only (faster) */
    /* added after the fields above (a caller built with an older header leaves it out: the default) */
    int32_t max_batch;      /* the most generations decoded together in one model call (continuous batching;
                               more wait their turn); 0 (default) = 8; -1 = no batching: each generation makes
                               its own model calls on its calling thread. CPU bundles batch; on CUDA or TensorRT
                               each generation runs alone. */
} specexport_open_options;

SPECEXPORT_API void specexport_open_options_init(specexport_open_options* options);

/* Load a bundle (a folder with manifest.json). `options` may be NULL (the defaults). On success *engine is a
 * handle to pass to the other calls; on failure it is NULL. */
SPECEXPORT_API specexport_status specexport_open(const char* bundle_path, const specexport_open_options* options,
                                                 specexport_engine** engine);

/* Release an engine: running generations are cancelled and waited for. NULL is a no-op (SPECEXPORT_OK); a
 * handle closed before gives SPECEXPORT_E_CLOSED. */
SPECEXPORT_API specexport_status specexport_close(specexport_engine* engine);

/* ---- generation ------------------------------------------------------------------------------------- */

typedef struct specexport_generate_options {
    size_t size;                    /* sizeof(specexport_generate_options) */
    const char* prompt;             /* UTF-8 text (the chat template is applied unless raw) ... */
    const int32_t* prompt_ids;      /* ... or token ids: give exactly one of the two */
    size_t n_prompt_ids;
    int32_t raw;                    /* 1: text goes to the tokenizer as is, without the chat template */
    uint32_t max_new_tokens;        /* default 128; >= 1 */
    double temperature;             /* 0 (default) = greedy; up to 1000 */
    int32_t top_k;                  /* 0 (default) = off */
    double top_p;                   /* in (0, 1]; 1 (default) = off */
    int64_t seed;                   /* >= 0: a reproducible random stream; -1 (default): a fresh one */
    const char* const* stop;        /* stop strings (UTF-8, not empty): the text is cut before the first one */
    size_t n_stop;
    const int32_t* stop_ids;        /* token ids that end the generation, besides the model's end of sequence */
    size_t n_stop_ids;
    uint64_t request_id;            /* the caller's id for specexport_cancel; 0 = not cancellable */
    /* Sampling knobs and structured output (a caller's struct may end before them: the defaults apply). Under
     * speculation the output stays exact under each: the acceptance reads the distribution they make. */
    double min_p;                   /* keep tokens at least min_p x the likeliest's probability; 0 (default) = off */
    double repetition_penalty;      /* in (0, 2]; 1 (default) = off */
    double frequency_penalty;       /* in [-2, 2]; 0 (default) = off */
    double presence_penalty;        /* in [-2, 2]; 0 (default) = off */
    uint32_t min_tokens;            /* the end of sequence and stop_ids are kept out before this many new tokens */
    const char* constraint_kind;    /* structured output: "json_schema", "regex", "grammar" (Lark or GBNF) or
                                       "choice" (a JSON list of strings); NULL (default) = none */
    const char* constraint;         /* the schema, expression, grammar or list (UTF-8) */
} specexport_generate_options;

SPECEXPORT_API void specexport_generate_options_init(specexport_generate_options* options);

typedef struct specexport_stats {
    size_t size;                    /* sizeof(specexport_stats), set by the caller */
    uint64_t prompt_tokens;
    uint64_t new_tokens;
    uint64_t steps;                 /* model calls after the prompt's */
    uint64_t drafted;               /* draft tokens verified */
    uint64_t accepted;              /* draft tokens accepted */
    double ttft_s;                  /* prompt in -> first new token out */
    double seconds;                 /* the whole generation, the prompt included */
    double tokens_per_s;            /* new_tokens / seconds */
    double tau;                     /* mean accept length: tokens emitted per step (1 for plain decoding) */
    int32_t stop_reason;            /* a specexport_stop_reason */
} specexport_stats;

/* Return value of a stream callback: 0 continues, SPECEXPORT_STREAM_STOP stops the generation cleanly (it then
 * returns SPECEXPORT_OK with stop reason SPECEXPORT_STOP_CANCELLED), a negative value stops it with
 * SPECEXPORT_E_CALLBACK. */
#define SPECEXPORT_STREAM_CONTINUE 0
#define SPECEXPORT_STREAM_STOP 1

/* Called as tokens become final, with new token ids or new text (one of them empty: n_ids == 0 or
 * text_len == 0). All ids concatenated are the generation's tokens (an end-of-sequence token included), all
 * text concatenated its text (stop strings cut; `text` is UTF-8, not NUL-terminated). Ids arrive once the step
 * that made them is over; text a little later where a stop string could still begin. */
typedef int (*specexport_stream_fn)(void* user, const int32_t* ids, size_t n_ids, const char* text,
                                    size_t text_len);

/* Generate from a prompt with the engine's method; blocks until done. `stream` may be NULL (no streaming: the
 * stats only). `stats` may be NULL; it is filled whenever the generation ran (also when cancelled or stopped by
 * the callback). */
SPECEXPORT_API specexport_status specexport_generate(specexport_engine* engine,
                                                     const specexport_generate_options* options,
                                                     specexport_stream_fn stream, void* user,
                                                     specexport_stats* stats);

/* Stop the running generations of `engine` whose request_id is `request_id` (nonzero) before their next step;
 * they return SPECEXPORT_OK with stop reason SPECEXPORT_STOP_CANCELLED. SPECEXPORT_E_NOT_FOUND when none runs
 * (not started yet, or already over). Never blocks on a generation. */
SPECEXPORT_API specexport_status specexport_cancel(specexport_engine* engine, uint64_t request_id);

#ifdef __cplusplus
}
#endif

#endif /* SPECEXPORT_H */
