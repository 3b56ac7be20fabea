"""A user's script of a dozen lines (workers/user_script.py: model, optimizer,
DistributedOptimizer, loop) runs under `gradcomp launch`, alone and after
torch.distributed.init_process_group("gloo"), and its loss goes down."""
import math
import re

import pytest


@pytest.mark.parametrize("extra", [[], ["--process-group"]], ids=["own-gloo", "process-group"])
def test_user_script_trains(run_workers, extra):
    # The script takes no --out; it ignores it (argv is only searched for --process-group).
    job = run_workers("user_script.py", *extra).check()
    losses = {}
    # The ranks share one stdout, so a line may run on into another rank's ("19.9187rank 1 ..."):
    # the loss is the number, nan or inf right after "loss".
    number = r"[-+]?(?:nan|inf|[0-9.]+(?:e[-+]?[0-9]+)?)"
    for rank, step, loss in re.findall(rf"rank (\d) step (\d+) loss ({number})", job.stdout):
        losses[(int(rank), int(step))] = float(loss)
    assert set(losses) == {(r, s) for r in range(2) for s in (0, 29)}, job.describe()
    for rank in range(2):
        first, last = losses[(rank, 0)], losses[(rank, 29)]
        assert math.isfinite(last)
        assert last < first / 2, f"rank {rank}: loss {first} -> {last}"
