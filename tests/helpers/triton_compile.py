"""Compiling a Triton kernel for an H100 (sm_90) on a machine without a GPU.

The interpreter (TRITON_INTERPRET=1) runs a kernel's Python, so it accepts what the compiler refuses (a
global read that is not a constexpr, for one); `triton.compile` for a CUDA target builds the kernel down to
its cubin with Triton's own LLVM and ptxas, no driver needed. CPU tests call both: the values under the
interpreter, the build here.
"""

from __future__ import annotations


def compile_for_h100(kernel, signature: dict[str, str], constexprs: dict[str, object]):
    """Build `kernel` (a @triton.jit function) for sm_90; signature maps every argument to its Triton type
    ("*i64", "i32", ..., "constexpr" for the constexprs). Raises triton's CompilationError on a bad kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32))
