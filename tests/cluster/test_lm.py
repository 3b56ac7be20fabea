"""bench/cluster/lm.py: the language model on an emulated cluster, one compression after the
other, auto among them; its arguments (options hold commas, so ';' separates them) and a short
run that writes the table."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "cluster"))
import lm  # noqa: E402


def test_compressions_are_separated_by_semicolons_so_options_keep_their_commas(tmp_path):
    args = lm.parse_args(["--out", str(tmp_path),
                          "--compressions", "none; qsgd:levels=15,block=512 ;auto;"])
    assert args.compressions == ["none", "qsgd:levels=15,block=512", "auto"]


def test_a_rate_per_host_is_read_in_host_order(tmp_path):
    args = lm.parse_args(["--out", str(tmp_path), "--workers", "3",
                          "--rate", "1gbit, 1gbit,100mbit"])
    assert args.rates == [1e9, 1e9, 1e8]
    assert lm.parse_args(["--out", str(tmp_path), "--rate", "300mbit"]).rates == 3e8
    args = lm.parse_args(["--out", str(tmp_path), "--workers", "3",
                          "--rate-change", "1gbit,1gbit,100mbit@40"])
    assert args.change == ([1e9, 1e9, 1e8], 40.0)


@pytest.mark.parametrize("argv, message", [
    (["--compressions", ";"], "--compressions names no compression"),
    (["--workers", "1"], "--workers must be at least 2"),
    (["--auto", "{not json"], "--auto"),
    (["--rate", "fast"], "--rate: rate 'fast' is not understood"),
    (["--workers", "3", "--rate", "1gbit,100mbit"], "--rate: 2 link rates given for 3 hosts"),
    (["--rate-change", "100mbit"], "is not RATE@SECONDS"),
    (["--rate-change", "100mbit@0"], "is not RATE@SECONDS"),
    (["--rate-change", "fast@10"], "--rate-change: rate 'fast' is not understood"),
    (["--workers", "3", "--rate-change", "1gbit,1gbit@5"],
     "--rate-change: 2 link rates given for 3 hosts"),
])
def test_bad_arguments_are_refused_with_a_reason(tmp_path, argv, message):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cluster" / "lm.py"),
                           "--out", str(tmp_path), *argv], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_short_run_writes_every_compression_and_auto_decision(tmp_path):
    settings = {"warmup_steps": 2, "profile_steps": 2, "trial_steps": 2, "verbose": False}
    subprocess.run(["/usr/bin/python3", str(ROOT / "bench" / "cluster" / "lm.py"), "--steps",
                    "30", "--batch-size", "2", "--rate", "1gbit,500mbit",
                    "--rate-change", "200mbit@0.5", "--compressions", "none;fp16;auto", "--auto",
                    json.dumps(settings), "--out", str(tmp_path)],
                   check=True, capture_output=True, text=True, timeout=900)
    result = json.loads((tmp_path / "lm.json").read_text())
    runs = {r["compression"]: r for r in result["runs"]}
    assert list(runs) == ["none", "fp16", "auto"]
    # fp16 halves the bytes of the compressed tensors; the same model, batches and seed give a
    # loss close to uncompressed.
    assert runs["fp16"]["bytes_sent_per_step"] < 0.6 * runs["none"]["bytes_sent_per_step"]
    assert abs(runs["fp16"]["val_loss"] / runs["none"]["val_loss"] - 1) < 0.01
    assert runs["auto"]["auto"] and runs["auto"]["auto"][0]["step"] <= 30
    assert result["auto_settings"] == settings and "--compressions" in result["command"]
    # The second host behind the slower link, as before each run: the change was undone.
    assert result["rates_bps"] == [1e9, 5e8]
    assert result["rate_change"] == {"rates_bps": 2e8, "after_seconds": 0.5}
    # Timed from rank 0's line before training; each run lasts longer (validation after).
    assert all(r["rate_changed_s"] >= 0.5 for r in runs.values()), runs
    table = (tmp_path / "lm.md").read_text()
    assert "| `fp16` |" in table and "`auto` at step" in table
    assert "2 hosts with links at 1gbit, 500mbit" in table
    assert "the links changed to 200mbit 0.5 s into each run's training" in table
