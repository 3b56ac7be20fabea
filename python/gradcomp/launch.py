"""Starts N worker processes with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), for machines where torchrun does not run (Debian's
torch 1.13 on Python 3.11):

    /usr/bin/python3 -m gradcomp.launch -n 4 train.py --epochs 2

A script ending in .py runs under this Python. Everything else is `gradcomp launch` (the C++
launcher in build/bin: signal forwarding, a dead rank ends the job with its exit code); see
`build/bin/gradcomp launch --help` for --master-port, --timeout and --notice.
"""
import os
import shutil
import sys
from pathlib import Path


def _launcher():
    """build/bin/gradcomp of this checkout, else a gradcomp on PATH."""
    built = Path(__file__).resolve().parents[2] / "build" / "bin" / "gradcomp"
    if built.is_file() and os.access(built, os.X_OK):
        return str(built)
    found = shutil.which("gradcomp")
    if found:
        return found
    sys.exit(f"gradcomp.launch: the launcher is not built ({built} is missing); run "
             "scripts/setup.sh first")


def _command(args):
    """Splits launcher options from the worker command; a .py script gets this interpreter."""
    if "--" in args:
        split = args.index("--")
        options, worker = args[:split], args[split + 1:]
    else:
        options, worker, i = [], [], 0
        while i < len(args):
            if args[i].startswith("-"):
                options.append(args[i])
                takes_value = "=" not in args[i] and args[i] not in ("-h", "--help")
                if takes_value and i + 1 < len(args):
                    options.append(args[i + 1])
                    i += 1
                i += 1
            else:
                worker = args[i:]
                break
    if worker and worker[0].endswith(".py"):
        worker = [sys.executable] + worker
    return options, worker


def main(argv=None):
    options, worker = _command(list(sys.argv[1:] if argv is None else argv))
    launcher = _launcher()
    command = [launcher, "launch", *options]
    if worker:
        command += ["--", *worker]
    os.execv(launcher, command)


if __name__ == "__main__":
    main()
