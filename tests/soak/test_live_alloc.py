"""The live-allocation counter of bench/soak (docs/soak.md): a process's blocks appear in its
dumps by size and thread while they live, and leave when freed."""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "build" / "lib" / "libgradcomp_live_alloc.so"
REPORT = ROOT / "bench" / "soak" / "live_alloc_report.py"

# Eight blocks of 300,001 bytes (CPython asks malloc for a bytearray's size plus one), held
# across one dump, then freed before the next; the small allocations after each pause write
# the dump (a dump is written by the first allocation LIVE_EVERY seconds after the last).
PROGRAM = """
import time
def pause():
    time.sleep(0.1)
    [str(i) for i in range(2000)]
held = [bytearray(300000) for _ in range(8)]
pause()
del held
pause()
"""


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """The dump files of one run of PROGRAM under the counter, in order."""
    assert LIBRARY.exists(), f"{LIBRARY} is missing: build the tree (scripts/setup.sh)"
    directory = tmp_path_factory.mktemp("live")
    env = dict(os.environ, LD_PRELOAD=str(LIBRARY), LIVE_EVERY="0.05", LIVE_DIR=str(directory))
    subprocess.run(["/usr/bin/python3", "-c", PROGRAM], env=env, check=True, timeout=60)
    return sorted(directory.glob("*.txt"))


def blocks_of_size(path, size):
    return sum(int(line.split()[3]) for line in path.read_text().splitlines()
               if line.startswith("S ") and int(line.split()[2]) == size)


def test_blocks_are_counted_while_they_live(dumps):
    assert len(dumps) >= 2, f"expected a dump while the blocks lived and one after: {dumps}"
    counts = [blocks_of_size(path, 300001) for path in dumps]
    assert 8 in counts, f"no dump saw the 8 held blocks: {counts}"
    assert counts[-1] == 0, f"the freed blocks still count in the last dump: {counts}"
    held = counts.index(8)
    thread_line = next(line for line in dumps[held].read_text().splitlines()
                       if line.startswith("T "))
    assert int(thread_line.split()[3]) >= 8 * 300001, thread_line


def test_report_shows_the_blocks_come_and_go(dumps):
    out = subprocess.run([sys.executable, str(REPORT), str(dumps[0].parent)],
                         capture_output=True, text=True, check=True).stdout
    totals = next(line for line in out.splitlines() if "all threads" in line).split()[2:]
    kib = [int(t) for t in totals]  # every dump (fewer than the report's 12 columns)
    assert max(kib) - kib[-1] >= 8 * 300001 // 1024 - 1, out
