"""Triton Inference Server: a model repository over a bundle (repository.py writes it; model.py is the Python-backend
model Triton runs: decoupled, the batched engine inside) and a launcher for PyTriton's bundled `tritonserver`
(launch.py, the tritonserver extra). The model's inputs and outputs are named once, here."""

# (name, Triton type, dims): every input is optional to Triton; the model needs text_input or input_ids
INPUTS = (
    ("text_input", "TYPE_STRING", [1]),  # the prompt as text (the chat template applied unless raw)
    ("input_ids", "TYPE_INT32", [-1]),  # or as token ids (used as given)
    ("max_tokens", "TYPE_INT32", [1]),  # new tokens at most (default 128; the context bounds it)
    ("temperature", "TYPE_FP32", [1]),  # 0 (default): greedy
    ("top_p", "TYPE_FP32", [1]),
    ("top_k", "TYPE_INT32", [1]),
    ("seed", "TYPE_INT64", [1]),  # a seeded sampled request gives the same tokens whatever it is batched with
    ("min_p", "TYPE_FP32", [1]),  # 0 (default): off
    ("repetition_penalty", "TYPE_FP32", [1]),  # 1 (default): off
    ("frequency_penalty", "TYPE_FP32", [1]),
    ("presence_penalty", "TYPE_FP32", [1]),
    ("min_tokens", "TYPE_INT32", [1]),  # the end of sequence is kept out before this many new tokens
    # structured output, named as TensorRT-LLM's Triton backend names it: json (any JSON object), json_schema, regex,
    # ebnf_grammar (Lark or GBNF), with the schema, expression or grammar in guided_decoding_guide
    ("guided_decoding_guide_type", "TYPE_STRING", [1]),
    ("guided_decoding_guide", "TYPE_STRING", [1]),
    ("stop", "TYPE_STRING", [-1]),  # stop strings
    ("raw", "TYPE_BOOL", [1]),  # text_input without the chat template
    ("stream", "TYPE_BOOL", [1]),  # a response per step (generate_stream, gRPC streams); else one response
)
OUTPUTS = (
    ("text_output", "TYPE_STRING", [1]),  # the new text (streamed: this response's piece)
    ("output_ids", "TYPE_INT32", [-1]),  # the new token ids (streamed: this response's)
    ("finish_reason", "TYPE_STRING", [1]),  # eos, stop_string, length, context or cancelled; "" until the last
    ("tau", "TYPE_FP32", [1]),  # tokens per target step of the request (0 until the last response)
)
DEFAULT_MAX_TOKENS = 128
