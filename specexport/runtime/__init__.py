"""Bundle in, tokens out. Needs numpy, onnxruntime and tokenizers only (no torch, no transformers)."""
