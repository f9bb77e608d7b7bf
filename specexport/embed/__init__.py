"""Embedding the runtime in C and C++: libspecexport (a C ABI, include/specexport.h; a C++17 wrapper,
include/specexport.hpp) embeds CPython and drives this package's runtime through `bridge`.

The C and C++ sources, the headers, the CMake project and an example service ship here as package data, so an
installed wheel can build the library: `cmake -S $(specexport embed --source-dir) -B build`, or
`specexport embed --build`. This module imports nothing heavy; `bridge` (numpy, onnxruntime) loads only in the
library's interpreter.
"""

from pathlib import Path

SOURCE_DIR = Path(__file__).parent  # CMakeLists.txt, include/, src/, cmake/, examples/
