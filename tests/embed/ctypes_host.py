"""A Python host driving libspecexport through ctypes, for tests/test_embed.py: the library must join this
interpreter (Py_IsInitialized) rather than start its own.

    python ctypes_host.py LIBSPECEXPORT BUNDLE PROMPT   -> one JSON line
"""

import ctypes
import json
import sys


class OpenOptions(ctypes.Structure):  # specexport_open_options
    _fields_ = [("size", ctypes.c_size_t), ("threads", ctypes.c_int32), ("device", ctypes.c_char_p),
                ("settings", ctypes.c_char_p), ("verify", ctypes.c_int32)]


class GenerateOptions(ctypes.Structure):  # specexport_generate_options
    _fields_ = [("size", ctypes.c_size_t), ("prompt", ctypes.c_char_p), ("prompt_ids", ctypes.c_void_p),
                ("n_prompt_ids", ctypes.c_size_t), ("raw", ctypes.c_int32), ("max_new_tokens", ctypes.c_uint32),
                ("temperature", ctypes.c_double), ("top_k", ctypes.c_int32), ("top_p", ctypes.c_double),
                ("seed", ctypes.c_int64), ("stop", ctypes.c_void_p), ("n_stop", ctypes.c_size_t),
                ("stop_ids", ctypes.c_void_p), ("n_stop_ids", ctypes.c_size_t), ("request_id", ctypes.c_uint64)]


STREAM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_size_t,
                          ctypes.c_char_p, ctypes.c_size_t)


def main(library: str, bundle: str, prompt: str) -> dict:
    lib = ctypes.CDLL(library)  # CDLL: the interpreter lock is released while the library runs
    lib.specexport_last_error.restype = ctypes.c_char_p
    tokens = []
    stream = STREAM(lambda user, ids, n, text, length: tokens.extend(ids[:n]) or 0)
    engine, options = ctypes.c_void_p(), OpenOptions()
    lib.specexport_open_options_init(ctypes.byref(options))
    options.threads = 1
    if lib.specexport_open(bundle.encode(), ctypes.byref(options), ctypes.byref(engine)) != 0:
        raise SystemExit(lib.specexport_last_error().decode())
    request = GenerateOptions()
    lib.specexport_generate_options_init(ctypes.byref(request))
    request.prompt, request.max_new_tokens = prompt.encode(), 12
    status = lib.specexport_generate(engine, ctypes.byref(request), stream, None, None)
    request.top_p = 0.0
    bad = lib.specexport_generate(engine, ctypes.byref(request), stream, None, None)
    return {"status": status, "tokens": tokens, "bad": bad, "message": lib.specexport_last_error().decode(),
            "same_interpreter": "specexport.embed.bridge" in sys.modules, "close": lib.specexport_close(engine)}


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])))
