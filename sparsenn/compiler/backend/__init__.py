"""Back end: C++ generation and the JIT that builds and caches kernels."""
