"""GradientReducer (2 gloo ranks on CPU): bucketed sums overlapped with backward equal a flat all-reduce."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tests.helpers.gloo_ranks import enter_rank, leave_rank
from torch import nn

from cohort.distributed.grad_sync import GradientReducer


class Net(nn.Module):
    """Two branches (the one computed last is differentiated first), a bf16 branch, a tied weight,
    a parameter only rank 1 uses, one nobody uses and a frozen one."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Parameter(torch.randn(7))  # first: its bucket is the last one
        self.only_rank1 = nn.Parameter(torch.randn(5))
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)
        self.inp = nn.Linear(4, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8).to(torch.bfloat16)
        self.out = nn.Linear(8, 8)
        self.out.weight = self.a.weight  # tied: reached twice, one gradient
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, order: str, use_b: bool, extra: bool) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        parts = []
        for name in order:
            if name == "a":
                parts.append(self.out(torch.tanh(self.a(h))))
            elif use_b:
                parts.append(self.b(h.bfloat16()).float())
        loss = (self.head(sum(parts)) ** 2).mean()
        if extra:
            loss = loss + (self.only_rank1 ** 2).sum()
        return loss


def _scenario(rank: int, step: int) -> list[dict]:
    """Three micro-batches of this rank's data; the last one's graph differs by rank (and by step)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    micro = [dict(x=torch.randn(6, 4, generator=gen), order="ab", use_b=True, extra=rank == 1) for _ in range(3)]
    if rank == 1:
        micro[-1]["order"] = "ba"  # hooks fire in another order than on rank 0
    if step == 2 and rank == 0:
        micro[-1]["use_b"] = False  # b gets no gradient in rank 0's armed backward: its bucket waits for finish()
    return micro


def _accumulate(model: Net, micro: list[dict], reducer: GradientReducer | None) -> None:
    model.zero_grad(set_to_none=True)
    for i, kw in enumerate(micro):
        if reducer is not None and i == len(micro) - 1:
            reducer.arm()
        model(**kw).backward()


def _reference(params: list[nn.Parameter]) -> list[torch.Tensor | None]:
    """The flat all-reduce of the local accumulated gradients, in fp32, cast to each gradient's dtype."""
    has = torch.tensor([float(p.grad is not None) for p in params])
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).float().reshape(-1) for p in params])
    dist.all_reduce(has)
    dist.all_reduce(flat)
    out, offset = [], 0
    for p, h in zip(params, has.tolist()):
        out.append(flat[offset:offset + p.numel()].view_as(p).to(p.dtype) if h else None)
        offset += p.numel()
    return out


def _ready_order(reducer: GradientReducer) -> tuple[list[int], list]:
    """Records, while armed, the order in which buckets become complete on this rank."""
    bucket_of = {id(p): b for b, bucket in enumerate(reducer.buckets) for p in bucket.params}
    missing = [len(bucket.params) for bucket in reducer.buckets]
    order: list[int] = []

    def hook(p):
        if reducer.armed:
            b = bucket_of[id(p)]
            missing[b] -= 1
            if missing[b] == 0:
                order.append(b)

    handles = [p.register_post_accumulate_grad_hook(hook) for p in reducer.params]
    return order, handles


def _run(rank: int, world: int, init_file: str, out: str) -> None:
    enter_rank()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)  # the same initial weights on both ranks
        model = Net()
        listed = [p for _, p in model.named_parameters(remove_duplicate=False)]
        assert len(listed) == len(list(model.parameters())) + 1  # the tied weight is listed twice
        reducer = GradientReducer(listed, bucket_bytes=64)
        params = list(reducer.params)
        assert len(params) == len({id(p) for p in params}) == len(list(model.parameters())) - 1  # no frozen
        assert len(reducer.buckets) > 4
        # reverse parameter order, about 64 bytes (16 fp32 elements) a bucket, a larger parameter alone:
        # [head.bias] [head.weight] [out.bias, b.bias] [b.weight] [a.bias] [a.weight] [inp.bias] [inp.weight]
        # [only_rank1, unused]
        assert [b.params for b in reducer.buckets[:3]] == [(model.head.bias,), (model.head.weight,),
                                                          (model.out.bias, model.b.bias)]
        assert reducer.buckets[-1].params == (model.only_rank1, model.unused)
        index = {id(p): i for i, p in enumerate(params)}
        results = {}
        buffers = None
        for step in (1, 2):
            micro = _scenario(rank, step)
            _accumulate(model, micro, None)  # unarmed: hooks do nothing, gradients stay local
            local = [None if p.grad is None else p.grad.clone() for p in params]
            expected = _reference(params)
            if rank == 0:
                assert model.only_rank1.grad is None and expected[index[id(model.only_rank1)]] is not None
            assert model.unused.grad is None and expected[index[id(model.unused)]] is None

            order, handles = _ready_order(reducer)
            _accumulate(model, micro, reducer)
            for h in handles:
                h.remove()
            for p, g in zip(params, local):  # the armed backward changed nothing before finish()
                assert (p.grad is None) == (g is None) and (g is None or torch.equal(p.grad, g))
            launched = reducer.launched_in_backward
            assert launched > 1, launched  # several buckets went out while backward ran
            assert reducer.armed
            reducer.finish()
            assert not reducer.armed
            for p, e in zip(params, expected):
                assert (p.grad is None) == (e is None), p.shape
                if e is not None:
                    assert p.grad.dtype == p.dtype
                    assert torch.equal(p.grad, e), (step, p.shape)
            assert model.b.weight.grad.dtype == torch.bfloat16
            ptrs = [b.buffer.data_ptr() for b in reducer.buckets]
            if buffers is not None:
                assert ptrs == buffers  # the second step reused the flat buffers
            buffers = ptrs
            results[step] = dict(grads=[None if p.grad is None else p.grad.clone() for p in params],
                                 ready=list(order), launched=launched)
        torch.save(results, f"{out}/rank{rank}.pt")

        # a second backward while armed would change gradients already sent: an error, and finish() recovers
        micro = _scenario(rank, 3)
        reducer.arm()
        model(**micro[0]).backward()
        try:
            model(**micro[1]).backward()
            raise AssertionError("a second armed backward must raise")
        except RuntimeError as exc:
            assert "changed after its bucket was reduced" in str(exc)
        reducer.finish()
        assert not reducer.armed
    finally:
        dist.destroy_process_group()
    leave_rank()


def test_bucketed_overlapped_sum_equals_flat_all_reduce(tmp_path):
    mp.spawn(_run, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    for step in (1, 2):
        for g0, g1 in zip(r0[step]["grads"], r1[step]["grads"]):  # identical gradients on both ranks
            assert (g0 is None) == (g1 is None) and (g0 is None or torch.equal(g0, g1))
    # the ranks' hooks completed buckets in different orders, out of index order on rank 0 (bucket 2 holds
    # a-branch and b-branch biases; b's own bucket was complete first), yet the collectives matched
    assert r0[1]["ready"] != r1[1]["ready"]
    assert r0[1]["ready"] != sorted(r0[1]["ready"])
    # step 2: rank 0's b got no gradient in the armed backward, so its bucket and all later ones waited
    assert r0[2]["launched"] == 2 and r1[2]["launched"] == 8


def test_one_process_is_a_no_op():
    assert not (dist.is_available() and dist.is_initialized())
    torch.manual_seed(0)
    model = Net()
    reducer = GradientReducer(model.parameters(), bucket_bytes=64)
    assert not reducer.enabled and not reducer._handles
    micro = _scenario(0, 1)
    _accumulate(model, micro, reducer)
    local = [None if p.grad is None else p.grad.clone() for p in reducer.params]
    reducer.finish()
    assert all(b.buffer is None for b in reducer.buckets)
    for p, g in zip(reducer.params, local):
        assert (p.grad is None) == (g is None) and (g is None or torch.equal(p.grad, g))
