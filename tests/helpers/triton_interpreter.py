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
    """numpy >= 2.4 refuses int() of a one-element 1-D array, which Triton 3.6's interpreter does for loop
    bounds loaded from memory; read the element instead (call in the child, before running a kernel)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def patch_interpreter_bf16_rounding() -> None:
    """Triton 3.6's interpreter converts float32 to bfloat16 by truncation where the GPU rounds to nearest
    even, and its tl.dot multiplies bfloat16 operands as their raw 16-bit patterns; give it the GPU's rounding
    (through torch) and products of the values (call in the child, before running a kernel)."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    cast = interpreter.InterpreterBuilder.cast_impl

    def cast_rne(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
            return interpreter.TensorHandle(bits.numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_rne
    dot = interpreter.InterpreterBuilder.create_dot

    def bf16_values(handle):
        bits = np.ascontiguousarray(handle.data).view(np.int16)
        return interpreter.TensorHandle(torch.from_numpy(bits).view(torch.bfloat16).float().numpy(), tl.float32)

    def dot_of_values(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (bf16_values(x) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = dot_of_values
