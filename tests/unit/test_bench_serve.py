"""bench/serve.py's global batch: every row trains the same prompts per step, so the default splits into whole
prompts over the colocated ranks and over the split rows' trainer ranks, and a --prompts that does not is
refused before anything launches (it once failed only inside the server rows' torchrun)."""

from __future__ import annotations

import pytest
from tests.helpers.bench_modules import load_bench


@pytest.fixture(scope="module")
def serve():
    return load_bench("serve.py", "serve_bench")  # serve.py imports its sibling scale.py


@pytest.mark.parametrize(("gpus", "engines", "prompts"), [(2, 1, 64), (4, 1, 132), (4, 2, 128), (4, 3, 128)])
def test_default_prompts_split_over_every_row(serve, gpus, engines, prompts):
    args = serve.parse_args(["--device", "cpu", "--gpus", str(gpus), "--engine-gpus", str(engines)])
    assert args.prompts == prompts
    assert args.prompts % gpus == 0 and args.prompts % (gpus - engines) == 0


def test_prompts_that_do_not_split_over_the_trainers_are_refused(serve, capsys):
    with pytest.raises(SystemExit):
        serve.parse_args(["--device", "cpu", "--gpus", "4", "--engine-gpus", "1", "--prompts", "128"])
    err = capsys.readouterr().err
    assert "--prompts=128" in err and "multiple of 12" in err
