"""Running a Triton kernel test on the CPU under TRITON_INTERPRET=1, in a child process.

The interpreter must be on when a kernel module is first imported (a reloaded module's nested @triton.jit
helpers are not interpreted), so a test file runs itself as a script in a child process with the variable
set, and the test checks the child's exit code and the line it prints on success.
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_interpreted(script: str, ok_line: str, timeout_s: float = 600) -> None:
    """Run `script` (a test file's own path) with TRITON_INTERPRET=1 from the repository root; it must exit 0
    and print `ok_line`."""
    # the repository root on the path, so the script can import tests.helpers as pytest's process does
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, os.path.abspath(script)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ok_line in done.stdout


def patch_interpreter_index() -> None:
    """Two fixes to Triton 3.6's interpreter (call in the child, before running a kernel).

    numpy >= 2.4 refuses int() of a one-element 1-D array, which the interpreter does for loop bounds loaded from
    memory: read the element instead. And its `tl.dot` is numpy's matmul, whose BLAS kernel on some CPUs (an AVX2
    AMD EPYC, seen here) sums a row's products in an order that depends on the row's place in the tile, so a
    batch-invariant kernel stops being batch invariant on the CPU only; a GPU's MMA does not do that. The dot
    is computed in float64 and rounded to the accumulator's type: float32 products are exact in float64 and
    their sum rounds to the same float32 whatever the order."""
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    dot = interpreter.InterpreterBuilder.create_dot

    def order_free_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        plain = (np.float32, np.float16)  # numpy floats as they are (not another type's bits in an integer array)
        if a.data.dtype not in plain or b.data.dtype not in plain or d.data.dtype != np.float32:
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = order_free_dot
