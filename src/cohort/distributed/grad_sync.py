"""Sum gradients over data-parallel ranks while backward runs: bucketed, overlapped, DDP-style.

How it works. At construction the trainable parameters (``requires_grad``; a tied Parameter reached twice
counts once) are laid out, in reverse order, into buckets of about ``bucket_bytes`` (counted in
``reduce_dtype``), each with a flat buffer in ``reduce_dtype`` allocated on first use and reused every step.
A post-accumulate-grad hook on each parameter says when its gradient is final for the current backward.
Earlier micro-batches of an optimizer update accumulate locally, so the hooks do nothing until ``arm()``,
called before the update's last backward. During that backward, once every parameter of a bucket is ready
the bucket's gradients are copied into its buffer and ``all_reduce``d asynchronously, so communication runs
under the rest of the backward (gradients become ready roughly last layer first, hence the reverse order).
Buckets launch strictly in index order, whatever order a rank's hooks fire in: a ready bucket waits until
every earlier one has launched, so all ranks issue the same collectives in the same order (as DDP does).
``finish()`` launches the buckets left (a parameter with no gradient on this rank contributes zeros), waits
for every collective and writes the sums back into ``p.grad`` in the gradient's dtype, then disarms.
Called without ``arm()``, it reduces everything after the fact, like ``distributed.sum_gradients``.

Gradients are summed, not averaged (the loss is already normalised by counts summed over ranks; see the
package docstring), and summed in ``reduce_dtype`` (fp32) even for bf16 gradients. Each bucket carries one
extra element per parameter, 1 where this rank has a gradient: after the sum a parameter that no rank
produced a gradient for keeps ``p.grad = None`` (as with one process, so the optimizer skips it), and one
that some rank did gets the same summed gradient on every rank, so the ranks stay in lockstep.

Overlap is lost past a parameter that gets no gradient in the armed backward (its bucket waits for
``finish()``, and every later bucket with it); the result stays exact. A parameter whose gradient changes
after its bucket launched (a second backward while armed) is an error, as in DDP.

Why not ``DistributedDataParallel``: DDP prepares its reducer in the wrapper's ``forward``, and the trainer
never calls it: the packed forward goes through ``model.model`` and reads the LM head's weight directly
for the chunked logprob kernel. DDP would also average instead of sum, reduce in the gradients' dtype,
and need ``no_sync()`` around every earlier micro-batch; ``arm()``/``finish()`` say all that here.

With one process (``torch.distributed`` not initialised, or world size 1 when constructed) no hook is
registered and every method is a no-op.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch
import torch.distributed as dist


class _Bucket:
    __slots__ = ("buffer", "device", "numel", "offsets", "params", "pending", "work")

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = tuple(params)
        self.offsets: list[int] = []
        n = 0
        for p in self.params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n  # gradient elements; the buffer has one flag element per parameter after them
        self.device = self.params[0].device
        self.buffer: torch.Tensor | None = None
        self.pending = len(self.params)  # parameters not yet ready in the armed backward
        self.work: dist.Work | None = None


def _world_enabled() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class GradientReducer:
    """Sums gradients over data-parallel ranks while backward runs."""

    def __init__(self, params: Iterable[torch.nn.Parameter], *, bucket_bytes: int = 25 * 2**20,
                 reduce_dtype: torch.dtype = torch.float32):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.reduce_dtype = reduce_dtype
        self.bucket_bytes = bucket_bytes
        seen: set[int] = set()
        unique: list[torch.nn.Parameter] = []
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                unique.append(p)
        self.params: tuple[torch.nn.Parameter, ...] = tuple(unique)
        self.enabled = _world_enabled()
        self.buckets: tuple[_Bucket, ...] = self._layout(bucket_bytes, reduce_dtype.itemsize)
        self._bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket.params}
        self._ready: set[int] = set()  # ids of parameters ready in the armed backward
        self._next = 0  # the next bucket to launch
        self._lock = threading.Lock()  # hooks may run on autograd's device threads
        self.armed = False
        self.launched_in_backward = 0  # buckets launched by hooks during the last armed backward
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                         for p in self.params] if self.enabled else []

    def _layout(self, bucket_bytes: int, itemsize: int) -> tuple[_Bucket, ...]:
        buckets: list[_Bucket] = []
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(self.params):
            nbytes = p.numel() * itemsize
            if current and (size + nbytes > bucket_bytes or p.device != current[0].device):
                buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            buckets.append(_Bucket(current))
        return tuple(buckets)

    # -- the update's protocol ---------------------------------------------------------------------------
    def arm(self) -> None:
        """Reduce during the next backward: call before the last micro-batch's backward of an update."""
        if not self.enabled:
            return
        with self._lock:
            if self._next:
                raise RuntimeError("GradientReducer.arm() while buckets of the previous arm() are in flight; "
                                   "call finish() first")
            self._reset()
            self.launched_in_backward = 0
            self.armed = True

    def finish(self) -> None:
        """Launch the buckets left, wait for all, write the sums into `p.grad`; call before clipping."""
        if not self.enabled:
            return
        with self._lock:
            while self._next < len(self.buckets):
                self._launch(self.buckets[self._next])
                self._next += 1
            self.armed = False  # a hook firing from here on is a backward outside the protocol: ignored
        for bucket in self.buckets:
            assert bucket.work is not None  # every bucket was launched above
            bucket.work.wait()
        for bucket in self.buckets:
            self._write_back(bucket)
        with self._lock:
            self._reset()

    def remove(self) -> None:
        """Unregister the hooks (the reducer is then inert)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.enabled = False

    # -- internals -----------------------------------------------------------------------------------------
    def _reset(self) -> None:
        self._ready.clear()
        self._next = 0
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.work = None

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        with self._lock:
            if not self.armed:
                return
            b = self._bucket_of[id(p)]
            if id(p) in self._ready:
                if b < self._next:
                    raise RuntimeError(
                        f"a gradient ({tuple(p.shape)}) changed after its bucket was reduced: one backward "
                        "per arm(); accumulate earlier micro-batches before arm()")
                return  # its bucket has not launched: the copy will read the newest gradient
            self._ready.add(id(p))
            self.buckets[b].pending -= 1
            while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
                self._launch(self.buckets[self._next])
                self._next += 1
                self.launched_in_backward += 1

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.buffer is None:
            bucket.buffer = torch.empty(bucket.numel + len(bucket.params), dtype=self.reduce_dtype,
                                        device=bucket.device)
        buf = bucket.buffer
        buf[bucket.numel:].fill_(1.0)
        for k, (p, offset) in enumerate(zip(bucket.params, bucket.offsets)):
            g = p.grad
            part = buf[offset:offset + p.numel()]
            if g is None:
                part.zero_()
                buf[bucket.numel + k].zero_()
            else:
                part.view(g.shape).copy_(g)
        bucket.work = dist.all_reduce(buf, async_op=True)

    def _write_back(self, bucket: _Bucket) -> None:
        buf = bucket.buffer
        assert buf is not None  # _launch filled it
        flags = None
        for k, (p, offset) in enumerate(zip(bucket.params, bucket.offsets)):
            part = buf[offset:offset + p.numel()]
            if p.grad is not None:
                p.grad.copy_(part.view(p.grad.shape))
                continue
            if flags is None:  # read the flags once per bucket, and only when some local gradient is missing
                flags = buf[bucket.numel:].tolist()
            if flags[k] > 0:
                p.grad = torch.empty_like(p, memory_format=torch.contiguous_format).copy_(part.view(p.shape))
