/* libspecexport's interpreter side: find the Python environment, start CPython once (or join the interpreter of
 * a Python host), and call specexport.embed.bridge, which drives the runtime. Plain CPython C API only.
 *
 * The interpreter lock. Every entry point takes it with PyGILState_Ensure (any thread, a fresh one included) and
 * gives it back before it returns; the thread that starts the interpreter releases it at once. While a
 * generation runs, the runtime releases the lock inside each model call (ONNX Runtime), and this file releases it
 * around the caller's callback, so generations on other threads proceed meanwhile.
 *
 * Errors. No Python exception leaves this file and nothing is printed: each one becomes a status and a one-line
 * message. The bridge raises EmbedError with a `specexport_status` attribute for what it knows (a bad setting, a
 * missing bundle); anything else is SPECEXPORT_E_RUNTIME with the exception's type and first line.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

#ifndef SPECEXPORT_DEFAULT_PYTHON
#define SPECEXPORT_DEFAULT_PYTHON "" /* the interpreter recorded at build time (CMake sets it) */
#endif

static pthread_once_t started = PTHREAD_ONCE_INIT;
static specexport_status start_status;
static char start_error[600];
static PyObject* bridge; /* specexport.embed.bridge, for the life of the process */

/* ---- exceptions -> status + one line ----------------------------------------------------------------------- */

/* The pending Python exception as a status (its `specexport_status` attribute, else E_RUNTIME) and a one-line
 * message after `prefix`, written to `out`; the exception is cleared. */
static specexport_status describe_exception(const char* prefix, char* out, size_t size) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    specexport_status status = SPECEXPORT_E_RUNTIME;
    PyObject* code = value != NULL ? PyObject_GetAttrString(value, "specexport_status") : NULL;
    int known = code != NULL && PyLong_Check(code);
    if (known) status = (specexport_status)PyLong_AsLong(code);
    Py_XDECREF(code);
    PyErr_Clear();
    PyObject* text = value != NULL ? PyObject_Str(value) : NULL;
    const char* message = text != NULL ? PyUnicode_AsUTF8(text) : NULL;
    PyErr_Clear();
    const char* name = type != NULL ? ((PyTypeObject*)type)->tp_name : "error";
    if (known)
        snprintf(out, size, "%s%s", prefix, message != NULL ? message : name);
    else if (message != NULL && *message)
        snprintf(out, size, "%s%s: %s", prefix, name, message);
    else
        snprintf(out, size, "%s%s", prefix, name);
    out[strcspn(out, "\r\n")] = '\0'; /* the first line */
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    return status;
}

static specexport_status fail_from_exception(const char* prefix) {
    char message[600];
    specexport_status status = describe_exception(prefix, message, sizeof message);
    return se_fail(status, "%s", message);
}

/* ---- starting the interpreter -------------------------------------------------------------------------------- */

/* Why the interpreter could not start, kept: every later call fails the same way. */
static void start_failed(const char* format, ...) __attribute__((format(printf, 1, 2)));
static void start_failed(const char* format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(start_error, sizeof start_error, format, args);
    va_end(args);
    start_status = SPECEXPORT_E_PYTHON;
}

static void import_bridge(const char* python) {
    bridge = PyImport_ImportModule("specexport.embed.bridge");
    if (bridge == NULL) {
        char prefix[300];
        snprintf(prefix, sizeof prefix, "cannot import specexport with %.200s: ", python);
        start_status = SPECEXPORT_E_PYTHON;
        describe_exception(prefix, start_error, sizeof start_error);
    }
}

/* The interpreter to start: SPECEXPORT_PYTHON, else SPECEXPORT_VENV/bin/python, else the one recorded at build. */
static const char* choose_python(char* buffer, size_t size, const char** source) {
    const char* python = getenv("SPECEXPORT_PYTHON");
    *source = "SPECEXPORT_PYTHON";
    if (python == NULL || *python == '\0') {
        const char* venv = getenv("SPECEXPORT_VENV");
        if (venv != NULL && *venv != '\0') {
            snprintf(buffer, size, "%s/bin/python", venv);
            *source = "SPECEXPORT_VENV";
            return buffer;
        }
        *source = "the build";
        return SPECEXPORT_DEFAULT_PYTHON;
    }
    return python;
}

/* A virtual environment of another Python version would make this libpython load the wrong standard library
 * (and print to stderr on the way): read its pyvenv.cfg first. 1 = fine or not a venv. */
static int same_version(const char* python, char* found, size_t size) {
    char path[4200], line[256];
    snprintf(path, sizeof path, "%s", python);
    char* slash = strrchr(path, '/');
    if (slash == NULL) return 1;
    *slash = '\0'; /* .../venv/bin */
    slash = strrchr(path, '/');
    if (slash == NULL) return 1;
    snprintf(slash, sizeof path - (size_t)(slash - path), "/pyvenv.cfg");
    FILE* cfg = fopen(path, "r");
    if (cfg == NULL) return 1;
    int ok = 1, major, minor;
    while (fgets(line, sizeof line, cfg) != NULL)
        if (sscanf(line, "version = %d.%d", &major, &minor) == 2 ||
            sscanf(line, "version_info = %d.%d", &major, &minor) == 2) {
            ok = major == PY_MAJOR_VERSION && minor == PY_MINOR_VERSION;
            snprintf(found, size, "%d.%d", major, minor);
        }
    fclose(cfg);
    return ok;
}

static void start(void) {
    if (Py_IsInitialized()) { /* a Python host (ctypes): its interpreter and its sys.path */
        PyGILState_STATE gil = PyGILState_Ensure();
        import_bridge("the host's Python");
        PyGILState_Release(gil);
        return;
    }
    char buffer[4096], version[32] = "";
    const char* source;
    const char* python = choose_python(buffer, sizeof buffer, &source);
    if (*python == '\0' || access(python, X_OK) != 0) {
        start_failed("no Python interpreter at '%s' (from %s): set SPECEXPORT_PYTHON to the python of an environment "
                     "where specexport is installed", python, source);
        return;
    }
    if (!same_version(python, version, sizeof version)) {
        start_failed("%s is a Python %s environment; this libspecexport was built for Python %d.%d", python, version,
                     PY_MAJOR_VERSION, PY_MINOR_VERSION);
        return;
    }
    /* Isolated: the host's PYTHONPATH, PYTHONHOME and user site do not leak in; the interpreter's path comes from
     * `executable` (a venv's pyvenv.cfg leads to its base installation), and `site` adds the venv's packages.
     * No signal handlers: Ctrl-C stays the host's. */
    PyConfig config;
    PyConfig_InitIsolatedConfig(&config);
    config.install_signal_handlers = 0;
    config.site_import = 1;
    PyStatus status = PyConfig_SetBytesString(&config, &config.executable, python);
    if (!PyStatus_Exception(status)) status = PyConfig_SetBytesString(&config, &config.program_name, python);
    if (!PyStatus_Exception(status)) status = Py_InitializeFromConfig(&config);
    PyConfig_Clear(&config);
    if (PyStatus_Exception(status)) {
        start_failed("cannot start Python %s: %s", python, status.err_msg != NULL ? status.err_msg : "unknown error");
        return;
    }
    import_bridge(python);
    PyEval_SaveThread(); /* from now on each call takes the lock with PyGILState_Ensure */
}

/* Start once (every thread waits for the first), then take the interpreter lock. */
static specexport_status enter(PyGILState_STATE* gil) {
    pthread_once(&started, start);
    if (start_status != SPECEXPORT_OK) return se_fail(start_status, "%s", start_error);
    *gil = PyGILState_Ensure();
    return SPECEXPORT_OK;
}

static specexport_status leave(PyGILState_STATE gil, specexport_status status) {
    PyGILState_Release(gil);
    return status;
}

/* bridge.<function>(**kwargs): a new reference, or NULL with the exception set. Steals kwargs. */
static PyObject* call_bridge(const char* function, PyObject* kwargs) {
    if (kwargs == NULL) return NULL;
    PyObject* f = PyObject_GetAttrString(bridge, function);
    PyObject* args = PyTuple_New(0);
    PyObject* result = f != NULL && args != NULL ? PyObject_Call(f, args, kwargs) : NULL;
    Py_XDECREF(f);
    Py_XDECREF(args);
    Py_DECREF(kwargs);
    return result;
}

/* ---- engines ------------------------------------------------------------------------------------------------ */

specexport_status se_py_open(const char* path, const specexport_open_options* o, void** engine) {
    PyGILState_STATE gil = PyGILState_UNLOCKED;
    specexport_status status = enter(&gil);
    if (status != SPECEXPORT_OK) return status;
    PyObject* kwargs = Py_BuildValue("{s:N,s:i,s:z,s:z,s:O,s:i}", "path", PyUnicode_DecodeFSDefault(path),
                                     "threads", o->threads, "device", o->device, "settings", o->settings,
                                     "verify", o->verify ? Py_True : Py_False, "max_batch", o->max_batch);
    if (kwargs == NULL) {
        PyErr_Clear();
        return leave(gil, se_fail(SPECEXPORT_E_INVALID_ARGUMENT, "device and settings must be UTF-8 text"));
    }
    PyObject* result = call_bridge("open_engine", kwargs);
    if (result == NULL) return leave(gil, fail_from_exception(""));
    *engine = result; /* our reference, dropped by se_py_release */
    return leave(gil, SPECEXPORT_OK);
}

void se_py_release(void* engine) {
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject* closed = call_bridge("close_engine", Py_BuildValue("{s:O}", "engine", (PyObject*)engine));
    if (closed == NULL) PyErr_Clear(); /* stops its batching thread; nothing else can fail here */
    Py_XDECREF(closed);
    Py_DECREF((PyObject*)engine);
    PyObject* done = call_bridge("collect", PyDict_New()); /* frees its sessions (and their threads) now */
    if (done == NULL) PyErr_Clear();
    Py_XDECREF(done);
    PyGILState_Release(gil);
}

void* se_py_unlock(void) {
    if (!Py_IsInitialized() || !PyGILState_Check()) return NULL;
    return PyEval_SaveThread();
}

void se_py_relock(void* state) {
    if (state != NULL) PyEval_RestoreThread((PyThreadState*)state);
}

/* ---- generation: the two functions the bridge calls back ----------------------------------------------------- */

#define CALL_CAPSULE "specexport.call"

/* The capsule points here rather than at the call itself, so that a callable kept alive past the generation
 * (a traceback) finds call == NULL instead of a dead stack frame. */
struct holder {
    struct se_call* call;
};

static void free_holder(PyObject* capsule) { free(PyCapsule_GetPointer(capsule, CALL_CAPSULE)); }

/* stream(ids: list[int] | None, text: str | None) -> bool: hand them to the caller's callback; True = stop. */
static PyObject* stream(PyObject* capsule, PyObject* args) {
    struct holder* holder = PyCapsule_GetPointer(capsule, CALL_CAPSULE);
    PyObject *ids, *text;
    if (holder == NULL || !PyArg_ParseTuple(args, "OO", &ids, &text)) return NULL;
    if (holder->call == NULL) Py_RETURN_TRUE;
    int32_t small[64], *buffer = small;
    Py_ssize_t n = ids == Py_None ? 0 : PyList_Size(ids);
    if (n < 0) return NULL;
    if (n > 64 && (buffer = malloc((size_t)n * sizeof *buffer)) == NULL) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) buffer[i] = (int32_t)PyLong_AsLong(PyList_GET_ITEM(ids, i));
    Py_ssize_t length = 0;
    const char* utf8 = text == Py_None ? NULL : PyUnicode_AsUTF8AndSize(text, &length);
    if (PyErr_Occurred()) {
        if (buffer != small) free(buffer);
        return NULL;
    }
    int stop;
    Py_BEGIN_ALLOW_THREADS /* the callback may block; other generations go on */
    stop = se_stream(holder->call, buffer, (size_t)n, utf8 != NULL ? utf8 : "", (size_t)length);
    Py_END_ALLOW_THREADS
    if (buffer != small) free(buffer);
    return PyBool_FromLong(stop);
}

/* cancelled() -> bool: specexport_cancel or specexport_close asked this generation to stop. */
static PyObject* cancelled(PyObject* capsule, PyObject* unused) {
    (void)unused;
    struct holder* holder = PyCapsule_GetPointer(capsule, CALL_CAPSULE);
    if (holder == NULL) return NULL;
    return PyBool_FromLong(holder->call == NULL || atomic_load(holder->call->cancelled));
}

static PyMethodDef stream_def = {"stream", stream, METH_VARARGS, NULL};
static PyMethodDef cancelled_def = {"cancelled", cancelled, METH_NOARGS, NULL};

static PyObject* int_list(const int32_t* values, size_t n) {
    PyObject* list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list != NULL && i < n; i++) PyList_SET_ITEM(list, (Py_ssize_t)i, PyLong_FromLong(values[i]));
    return list;
}

/* Text from the caller as a str; NULL with this thread's error set (and no exception) when it is not UTF-8. */
static PyObject* utf8_text(const char* text, const char* name) {
    PyObject* s = PyUnicode_DecodeUTF8(text, (Py_ssize_t)strlen(text), "strict");
    if (s == NULL) {
        PyErr_Clear();
        se_fail(SPECEXPORT_E_INVALID_ARGUMENT, "%s is not valid UTF-8", name);
    }
    return s;
}

/* bridge.generate's keyword arguments in *kwargs, or a status with this thread's error set. */
static specexport_status generate_kwargs(PyObject* engine, const specexport_generate_options* o, PyObject* sink,
                                         PyObject* poll, PyObject** kwargs) {
    PyObject* prompt = o->prompt != NULL ? utf8_text(o->prompt, "the prompt") : Py_NewRef(Py_None);
    PyObject* ids = o->prompt_ids != NULL ? int_list(o->prompt_ids, o->n_prompt_ids) : Py_NewRef(Py_None);
    PyObject* stop = PyList_New(0);
    for (size_t i = 0; prompt != NULL && stop != NULL && i < o->n_stop; i++) {
        char name[40];
        snprintf(name, sizeof name, "stop[%zu]", i);
        PyObject* s = utf8_text(o->stop[i], name);
        if (s == NULL || PyList_Append(stop, s) < 0) Py_CLEAR(stop);
        Py_XDECREF(s);
    }
    PyObject* stop_ids = int_list(o->stop_ids, o->n_stop_ids);
    *kwargs = NULL;
    if (prompt != NULL && ids != NULL && stop != NULL && stop_ids != NULL)
        *kwargs = Py_BuildValue("{s:O,s:O,s:O,s:O,s:k,s:d,s:i,s:d,s:L,s:O,s:O,s:O,s:O,s:d,s:d,s:d,s:d,s:k,s:z,s:z}",
                                "engine", engine, "prompt", prompt, "prompt_ids", ids,
                                "raw", o->raw ? Py_True : Py_False, "max_new_tokens", (unsigned long)o->max_new_tokens,
                                "temperature", o->temperature, "top_k", (int)o->top_k, "top_p", o->top_p,
                                "seed", (long long)o->seed, "stop", stop, "stop_ids", stop_ids, "stream", sink,
                                "cancelled", poll, "min_p", o->min_p, "repetition_penalty", o->repetition_penalty,
                                "frequency_penalty", o->frequency_penalty, "presence_penalty", o->presence_penalty,
                                "min_tokens", (unsigned long)o->min_tokens, "constraint_kind", o->constraint_kind,
                                "constraint", o->constraint);
    Py_XDECREF(prompt);
    Py_XDECREF(ids);
    Py_XDECREF(stop);
    Py_XDECREF(stop_ids);
    if (*kwargs != NULL) return SPECEXPORT_OK;
    return PyErr_Occurred() ? fail_from_exception("") : SPECEXPORT_E_INVALID_ARGUMENT; /* else: utf8_text's */
}

specexport_status se_py_generate(void* engine, const specexport_generate_options* o, struct se_call* call,
                                 specexport_stats* stats) {
    PyGILState_STATE gil = PyGILState_UNLOCKED;
    specexport_status status = enter(&gil);
    if (status != SPECEXPORT_OK) return status;
    struct holder* holder = malloc(sizeof *holder);
    PyObject* capsule = holder != NULL ? PyCapsule_New(holder, CALL_CAPSULE, free_holder) : NULL;
    if (capsule == NULL) {
        free(holder);
        PyErr_Clear();
        return leave(gil, se_fail(SPECEXPORT_E_RUNTIME, "out of memory"));
    }
    holder->call = call;
    PyObject* sink = call->stream != NULL ? PyCFunction_New(&stream_def, capsule) : Py_NewRef(Py_None);
    PyObject* poll = PyCFunction_New(&cancelled_def, capsule);
    PyObject *kwargs = NULL, *result = NULL;
    if (sink == NULL || poll == NULL)
        status = fail_from_exception("");
    else if ((status = generate_kwargs((PyObject*)engine, o, sink, poll, &kwargs)) == SPECEXPORT_OK &&
             (result = call_bridge("generate", kwargs)) == NULL)
        status = fail_from_exception("");
    unsigned long long counts[5];
    if (result != NULL &&
        !PyArg_ParseTuple(result, "KKKKKddddi", &counts[0], &counts[1], &counts[2], &counts[3], &counts[4],
                          &stats->ttft_s, &stats->seconds, &stats->tokens_per_s, &stats->tau, &stats->stop_reason))
        status = fail_from_exception("the bridge returned unexpected stats: ");
    else if (result != NULL) {
        stats->prompt_tokens = counts[0], stats->new_tokens = counts[1], stats->steps = counts[2];
        stats->drafted = counts[3], stats->accepted = counts[4];
    }
    holder->call = NULL; /* the callables may outlive this frame; they must not reach `call` */
    Py_XDECREF(result);
    Py_XDECREF(sink);
    Py_XDECREF(poll);
    Py_DECREF(capsule);
    return leave(gil, status);
}
