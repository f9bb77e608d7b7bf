"""specexport: speculative decoding exported to tree-attention ONNX bundles."""

__version__ = "0.1.0"
