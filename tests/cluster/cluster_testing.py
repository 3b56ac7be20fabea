"""What the cluster benchmark's tests share: a small replay profile (fast steps, real
exchanges) and a process check."""
import os

# Six tensors in backward order, two of them large enough to be compressed.
PROFILE = {
    "format": "gradcomp-profile", "version": 1, "model": "tiny", "source": "test",
    "batch_size": 8, "forward_ms": 4.0, "backward_ms": 8.0,
    "tensors": [
        {"name": "head.bias", "elements": 10, "ready_ms": 0.5},
        {"name": "head.weight", "elements": 40960, "ready_ms": 1.0},
        {"name": "body.1.bias", "elements": 256, "ready_ms": 2.0},
        {"name": "body.1.weight", "elements": 65536, "ready_ms": 5.0},
        {"name": "body.0.bias", "elements": 256, "ready_ms": 6.0},
        {"name": "body.0.weight", "elements": 2048, "ready_ms": 8.0},
    ],
}


# A command prefix that runs as user nobody, not root, but still able to read the checkout
# (CAP_DAC_READ_SEARCH only): a clone in a directory of mode 700 (mktemp -d) stays readable,
# and what the tests check, the refusal of a user who is not root, is the same.
NOT_ROOT = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
            "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]


def alive(pid):
    """Whether process `pid` still exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
