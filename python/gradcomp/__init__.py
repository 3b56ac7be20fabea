"""gradcomp: compressed gradient exchange for data-parallel training.

    import gradcomp.torch
    optimizer = gradcomp.torch.DistributedOptimizer(
        optimizer, model.named_parameters(), compression="topk:ratio=0.01|ef")

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

__version__ = "0.1.0"
__all__ = ["Error", "SpecError", "CommError", "TimeoutError", "codec_names", "feedback_names",
           "route_names", "transport_names"]
