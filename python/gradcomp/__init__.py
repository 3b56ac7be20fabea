"""gradcomp: compressed gradient exchange for data-parallel training.

    import gradcomp.torch
    optimizer = gradcomp.torch.DistributedOptimizer(
        optimizer, model.named_parameters(), compression="dither")

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
    stop_servers,
    transport_names,
)

from gradcomp._C import recommendations as _recommendations  # noqa: E402
from gradcomp._C import recommended_options as _recommended_options  # noqa: E402

__version__ = "0.1.0"
__all__ = ["Error", "SpecError", "CommError", "TimeoutError", "codec_names", "feedback_names",
           "route_names", "stop_servers", "transport_names", "recommended"]


def recommended(optimizer=None):
    """The compression options the accuracy tables back (docs/recommended.md): a list of dicts
    {codec, option, sgd, adam, changes_optimizer, lans, recommended}, one per codec, with the
    option as measured, whether it held under SGD (Fashion-MNIST CNN, within 0.5 pp) and under
    AdamW (a small language model, within 2% of the validation loss), the option that held
    under LANS where AdamW lost (a CLAN recipe, docs/optimizers-accuracy.md; else None), and
    whether it is recommended (held under SGD and AdamW, the optimizer unchanged). With
    optimizer="sgd", "adam" or "lans", the options that held under it and need no change of
    the optimizer, "none" first."""
    table = _recommendations()
    if optimizer is None:
        return table
    if optimizer not in ("sgd", "adam", "lans"):
        raise SpecError(f"optimizer must be 'sgd', 'adam' (an Adam-family optimizer) or "
                        f"'lans', not {optimizer!r}")
    return _recommended_options(optimizer)
