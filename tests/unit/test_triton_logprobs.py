"""triton_logprobs.stats (one pass over each row: chosen logprob, logsumexp, entropy) and triton_logprobs.grad
(the backward's gradient of the logits, written over them) against the eager code of cohort.forward.logprobs on the CPU
under TRITON_INTERPRET=1: random rows, peaked rows (entropy near 0, where lse - E[z] would cancel), rows with
-inf logits, a vocabulary that is not a multiple of the block, and temperatures other than 1. The interpreter
must be on when the module is first imported, so the kernel runs in a child process (this file as a script).
Skips without Triton (not a project dependency)."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.triton_interpreter import run_interpreted


def _check() -> None:
    from cohort.forward import triton_logprobs
    from cohort.forward.logprobs import _stats_eager

    g = torch.Generator().manual_seed(0)
    for vocab, dtype in ((3000, torch.bfloat16), (2048, torch.float32), (777, torch.float32)):
        rows = torch.randn(6, vocab, generator=g) * 3
        rows[1] *= 40  # peaked: entropy ~ 0
        rows[4, -5] = 30.0  # the row's maximum in its last block
        rows[2, ::3] = -torch.inf  # masked tokens
        rows[3, : vocab - 1] = -torch.inf  # one token left: entropy 0
        logits = rows.to(dtype)
        labels = torch.randint(0, vocab, (6,), generator=g)
        labels[3] = vocab - 1
        labels[2] = 1
        for inv_t in (1.0, 1.0 / 0.7):
            want = _stats_eager(logits.clone(), labels, inv_t, True)  # it scales float32 logits in place
            # the eager entropy is NaN on -inf logits (0 * -inf); 0 log 0 = 0 is the right value
            p = torch.softmax(logits.double() * inv_t, dim=-1)
            entropy = torch.special.entr(p).sum(-1).float()
            # one block per row, and blocks of 512 (the running maximum rescaled between blocks; blocks of -inf
            # only before the one finite logit of row 3)
            for block in (triton_logprobs.BLOCK_V, 512):
                default, triton_logprobs.BLOCK_V = triton_logprobs.BLOCK_V, block
                try:
                    got = triton_logprobs.stats(logits, labels, inv_t, True)
                finally:
                    triton_logprobs.BLOCK_V = default
                for a, b in zip(got, (want[0], want[1], entropy)):
                    torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
            chosen, lse, no_entropy = triton_logprobs.stats(logits, labels, inv_t, False)
            assert no_entropy is None
            torch.testing.assert_close(chosen, want[0], atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(lse, want[1], atol=2e-5, rtol=2e-5)
            _check_grad(logits, labels, inv_t, g)


def _check_grad(logits, labels, inv_t: float, g: torch.Generator) -> None:
    """The gradient kernel == the eager one, with and without an entropy term, in the logits' dtype and in
    place; on rows with -inf logits as well (their p is 0: gradient 0 there)."""
    from cohort.forward import triton_logprobs
    from cohort.forward.logprobs import _grad_eager, _stats_eager

    rows = logits.shape[0]
    _, lse, entropy = _stats_eager(logits.clone(), labels, inv_t, True)
    entropy = torch.nan_to_num(entropy, nan=0.0)
    grad_lp = torch.randn(rows, generator=g)
    for grad_ent in (torch.zeros(rows), torch.randn(rows, generator=g)):
        # the eager code's 0 * inf on a -inf logit is NaN; the kernel gives that token's gradient, 0
        want = torch.nan_to_num(_grad_eager(logits.clone(), labels, lse, entropy, grad_lp, grad_ent, inv_t), nan=0.0)
        buffer = logits.clone()
        got = triton_logprobs.grad(buffer, labels, lse, entropy, grad_lp, grad_ent, inv_t)
        assert got.data_ptr() == buffer.data_ptr() and got.dtype == logits.dtype
        tol = 1e-2 if logits.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_one_pass_statistics_equal_the_eager_ones():
    pytest.importorskip("triton", reason="needs Triton (GPU kernels, run by its CPU interpreter here): pip install triton")
    run_interpreted(__file__, "stats ok")


if __name__ == "__main__":
    _check()
    print("stats ok")
