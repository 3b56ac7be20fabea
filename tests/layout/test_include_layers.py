"""The layers of the code, as docs/architecture.md states them, checked on every include.

A folder of src/ includes private headers of lower layers only; front ends, tools, examples
and benchmarks include public headers only (include/gradcomp/); a public header includes
public headers only. A new arrow from a lower layer to a higher one fails here with the file
and line that drew it.
"""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Lower first; folders on one level do not include each other.
LAYERS = [
    {"common"},
    {"transport", "codec", "timeline", "optim"},
    {"feedback"},
    {"plan"},
    {"route"},
    {"engine", "model"},
    {"schedule"},
]
LEVEL = {folder: level for level, folders in enumerate(LAYERS) for folder in folders}
# The layer each public header belongs to (where its definitions live).
PUBLIC = {
    "error.h": "common", "spec.h": "common", "random.h": "common", "dtype.h": "common",
    "json_text.h": "common", "kept_thread.h": "common", "transport.h": "transport", "op_queue.h": "transport",
    "roll_call.h": "transport", "frame.h": "codec", "codec.h": "codec",
    "timeline.h": "timeline", "optimizer.h": "optim", "feedback.h": "feedback",
    "option.h": "plan", "plan.h": "plan", "recommended.h": "plan", "engine.h": "engine",
    "model": "model", "scheduler.h": "schedule", "server.h": "route", "torch": None,
}
PRIVATE = re.compile(r'#include "([a-z_]+)/[^"]+"')
PUBLIC_INCLUDE = re.compile(r'#include "gradcomp/([a-z_]+(?:\.h)?)')
SOURCES = ("*.h", "*.cpp")


def includes(folder):
    """(file, line number, included top folder) for every quoted include under `folder`."""
    for pattern in SOURCES:
        for path in sorted((ROOT / folder).rglob(pattern)):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                match = PRIVATE.match(line.strip())
                if match:
                    yield path.relative_to(ROOT), number, match.group(1)


def test_every_folder_of_src_has_a_layer():
    folders = {p.name for p in (ROOT / "src").iterdir() if p.is_dir()}
    assert folders == set(LEVEL), "add the new folder to LAYERS (and docs/architecture.md)"


def test_src_includes_only_its_own_or_lower_layers():
    wrong = []
    for path, number, target in includes("src"):
        own = path.parts[1]
        if target in (own, "gradcomp"):
            continue
        if target not in LEVEL or LEVEL[target] >= LEVEL[own]:
            wrong.append(f"{path}:{number}: {own} includes {target}")
    assert not wrong, "\n".join(wrong)


def test_every_public_header_has_a_layer():
    names = {p.name for p in (ROOT / "include" / "gradcomp").iterdir()}
    assert names == set(PUBLIC), "add the new header to PUBLIC"


def test_src_includes_public_headers_of_its_own_or_lower_layers():
    wrong = []
    for pattern in SOURCES:
        for path in sorted((ROOT / "src").rglob(pattern)):
            own = path.relative_to(ROOT).parts[1]
            for number, line in enumerate(path.read_text().splitlines(), 1):
                match = PUBLIC_INCLUDE.match(line.strip())
                if not match:
                    continue
                owner = PUBLIC[match.group(1)]
                if owner is None or (owner != own and LEVEL[owner] >= LEVEL[own]):
                    wrong.append(f"{path.relative_to(ROOT)}:{number}: {own} includes "
                                 f"gradcomp/{match.group(1)} of {owner}")
    assert not wrong, "\n".join(wrong)


def test_public_headers_and_users_of_the_library_include_public_headers_only():
    wrong = []
    for folder in ("include", "frontends", "tools", "examples", "bench"):
        for path, number, target in includes(folder):
            if target in LEVEL:
                wrong.append(f"{path}:{number}: includes the private {target}/")
    assert not wrong, "\n".join(wrong)
