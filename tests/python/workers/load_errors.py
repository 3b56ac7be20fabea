"""Loads checkpoints written by resume.py the wrong way and reports each error: the other
rank's state, a state saved under another plan, a state without gradcomp's part."""
import torch

import common
import gradcomp
import gradcomp.torch as gc


def wrapped(model, compression):
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return gc.DistributedOptimizer(sgd, model.named_parameters(), compression=compression,
                                   seed=7)


def attempt(load):
    """The error a load raises as [type name, message, is a gradcomp.Error]; None if none."""
    try:
        load()
    except Exception as e:  # noqa: BLE001  (the test judges the type)
        return [type(e).__name__, str(e), isinstance(e, gradcomp.Error)]
    return None


def plain_state_warning(opt, own):
    """A plain optimizer state_dict loads into the wrapped optimizer, with a warning."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error = attempt(lambda: opt.load_state_dict(
            {k: v for k, v in own.items() if k != "gradcomp"}))
    return {"error": error, "warnings": [str(w.message) for w in caught]}


def check(rank, world, prefix, compression, other_compression):
    """A collective (it builds optimizers): every rank calls it with the same arguments."""
    own = torch.load(f"{prefix}.rank{rank}.pt")["optimizer"]
    other = torch.load(f"{prefix}.rank{(rank + 1) % world}.pt")["optimizer"]
    opt = wrapped(common.make_model(), compression)
    before = opt.state_dict()["gradcomp"]["state"]
    results = {
        "other_rank": attempt(lambda: opt.load_state_dict(other)),
        "no_gradcomp": plain_state_warning(opt, own),
    }
    future = dict(own, gradcomp=dict(own["gradcomp"], version=99))
    results["version_99"] = attempt(lambda: opt.load_state_dict(future))
    flipped = bytearray(own["gradcomp"]["state"])
    flipped[len(flipped) // 2] ^= 0x10  # a byte of a residual
    results["flipped_byte"] = attempt(lambda: opt.load_state_dict(
        dict(own, gradcomp=dict(own["gradcomp"], state=bytes(flipped)))))
    # The wrapped optimizer refuses its part (another parameter count): nothing changes.
    broken = dict(own, param_groups=[dict(own["param_groups"][0], params=[0])])
    results["optimizer_refuses"] = attempt(lambda: opt.load_state_dict(broken))
    # A failed load changes nothing; the right one still loads afterwards.
    results["unchanged"] = opt.state_dict()["gradcomp"]["state"] == before
    results["own"] = attempt(lambda: opt.load_state_dict(own))
    results["own_loaded"] = opt.state_dict()["gradcomp"]["state"] == own["gradcomp"]["state"]
    # The same parameters under another compression: another plan.
    other_plan = wrapped(common.make_model(), other_compression)
    results["other_plan"] = attempt(lambda: other_plan.load_state_dict(own))
    return results
