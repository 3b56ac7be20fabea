"""gradcomp: compressed gradient exchange for data-parallel training.

    import gradcomp.torch
    optimizer = gradcomp.torch.DistributedOptimizer(
        optimizer, model.named_parameters(), compression="powersgd:rank=4|ef")

See docs/python.md. The C++ core is the extension module gradcomp._C.
"""
import torch as _torch  # loads libtorch before the extension that links it

from gradcomp._C import (  # noqa: E402
    CommError,
    Error,
    SpecError,
    TimeoutError,
    codec_names,
    feedback_names,
    route_names,
    transport_names,
)

from gradcomp._C import recommendations as _recommendations  # noqa: E402
from gradcomp._C import recommended_options as _recommended_options  # noqa: E402

__version__ = "0.1.0"
__all__ = ["Error", "SpecError", "CommError", "TimeoutError", "codec_names", "feedback_names",
           "route_names", "transport_names", "recommended"]


def recommended(optimizer=None):
    """The compression options the accuracy tables back (docs/recommended.md): a list of dicts
    {codec, option, sgd, adam, changes_optimizer, recommended}, one per codec, with the option
    as measured, whether it held under SGD (Fashion-MNIST CNN, within 0.5 pp) and under AdamW
    (a small language model, within 2% of the validation loss), and whether it is recommended
    (held under both, the optimizer unchanged). With optimizer="sgd" or "adam", the options
    that held under it and need no change of the optimizer, "none" first."""
    table = _recommendations()
    if optimizer is None:
        return table
    if optimizer not in ("sgd", "adam"):
        raise SpecError(f"optimizer must be 'sgd' or 'adam' (an Adam-family optimizer), not "
                        f"{optimizer!r}")
    return _recommended_options(optimizer)
