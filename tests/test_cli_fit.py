"""``python -m pytest_torchmem fit`` and ``rank`` (issue 26): real subprocesses on a
factory file, as a user writes one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import pytest_torchmem as tm

FACTORY = """
import torch
from torch import nn


def factory():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10))
    return model, lambda batch: torch.randn(batch, 64), {"optimizer": lambda p: torch.optim.AdamW(p)}


def big():
    with torch.device("meta"):
        model = nn.Linear(65536, 65536, bias=False)
    return model, lambda rows: torch.randn(rows, 65536, device="meta"), {"train": False}


def not_a_pair():
    return 3


def raising():
    raise FileNotFoundError("data/vocab.json")


def misspelt():
    model, inputs_for, _ = factory()
    return model, inputs_for, {"optimiser": lambda p: torch.optim.AdamW(p)}


def with_gpu():
    model, inputs_for, _ = factory()
    return model, inputs_for, {"gpu": "T4"}


def with_cpu():
    model, inputs_for, _ = factory()
    return model, inputs_for, {"cpu": "avx2:4"}
"""


def _factory_model() -> tuple[nn.Module, dict[str, object]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10))
    return model, {"optimizer": lambda p: torch.optim.AdamW(p)}


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "train.py").write_text(FACTORY)
    (tmp_path / "broken.py").write_text('import torch\n\nraise RuntimeError("no GPU config\\nfound")\n')
    return subprocess.run(
        [sys.executable, "-m", "pytest_torchmem", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )


def test_fit_names_the_size_and_prints_its_progress(tmp_path: Path) -> None:
    """The table's size is tm.fit's, with the same estimates; one progress line per
    estimate on stderr (not a terminal: no carriage returns)."""
    model, options = _factory_model()
    budget = tm.estimate(model, torch.randn(300, 64), device="cpu", **options).peak
    result = _run(tmp_path, "fit", "train.py:factory", "--budget", str(budget), "--device", "cpu",
                  "--name", "batch", "--sizes", "1:1000", "--format", "json")
    assert result.returncode == 0, result.stderr
    (found,) = json.loads(result.stdout)
    expected = tm.fit(model, lambda b: torch.randn(b, 64), sizes=range(1, 1001), budget=budget, device="cpu", **options)
    assert (found["size"], found["nbytes"], found["next_size"], found["next_nbytes"]) == (
        expected.size, expected.nbytes, expected.next_size, expected.next_nbytes
    )
    assert found["size"] >= 300
    lines = result.stderr.splitlines()
    assert len(lines) == len(found["estimates"]) and "\r" not in result.stderr
    assert lines[0].startswith(f"fit budget {tm.format_bytes(budget)}: estimate 1, batch 1: ")


def test_fit_over_several_gpus_is_a_table_largest_first(tmp_path: Path) -> None:
    result = _run(tmp_path, "fit", "train.py:big", "--gpu", "T4,A100-40GB", "--gpu", "H100", "--name", "rows",
                  "--sizes", "1:200000", "-q")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    header, rule, *rows = result.stdout.splitlines()
    assert header.split()[:3] == ["target", "usable", "rows"]
    assert [row.split()[0] for row in rows] == ["H100", "A100-40GB", "T4"]
    assert rows[2].split()[3] == "none"  # 16 GiB of weight does not fit a T4


def test_at_least_gates_ci(tmp_path: Path) -> None:
    result = _run(tmp_path, "fit", "train.py:big", "--gpu", "A100-40GB", "--sizes", "1:64", "--at-least", "65", "-q")
    assert result.returncode == 1
    assert "A100-40GB: the largest size that fits is 64, below --at-least 65" in result.stdout
    assert _run(tmp_path, "fit", "train.py:big", "--gpu", "A100-40GB", "--sizes", "1:64", "--at-least", "64", "-q").returncode == 0


def test_rank_orders_the_gpus_by_headroom(tmp_path: Path) -> None:
    result = _run(tmp_path, "rank", "train.py:big", "--size", "1", "--gpu", "T4,H100,A100-40GB", "--format", "json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(row["gpu"], row["fits"]) for row in rows] == [("H100", True), ("A100-40GB", True), ("T4", False)]
    assert all(row["headroom"] == row["usable"] - row["reserved_peak"] for row in rows)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["fit", "train.py:factory"], "fit needs a target: --gpu NAME"),
        (["fit", "train.py:factory", "--gpu", "GTX9999"], "--gpu: unknown GPU 'GTX9999'"),
        (["fit", "train.py:factory", "--budget", "lots"], "--budget: cannot read 'lots'"),
        (["fit", "train.py:factory", "--budget", "1GiB", "--sizes", "9:3"], "--sizes '9:3': give 1 <= FIRST <= LAST"),
        (["fit", "train.py:factory", "--budget", "1GiB", "--sizes", "a"], "--sizes must be FIRST:LAST"),
        (["fit", "train.py:factory", "--gpu", "T4", "--device", "cpu"], "--gpu is for --device cuda"),
        (["fit", "train", "--budget", "1GiB"], "FACTORY must be module:function"),
        (["fit", "nowhere.py:factory", "--budget", "1GiB"], "no such file: nowhere.py"),
        (["fit", "no_such_module:factory", "--budget", "1GiB"], "cannot import 'no_such_module'"),
        (["fit", "train.py:missing", "--budget", "1GiB"], "train.py has no function 'missing'"),
        (["fit", "train.py:not_a_pair", "--budget", "1GiB"], "must return (model, inputs_for) or (model, inputs_for, options), got int"),
        (["rank", "train.py:factory", "--size", "0"], "--size must be a positive integer"),
    ],
)
def test_bad_command_lines_are_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    result = _run(tmp_path, *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert message in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"python -m pytest_torchmem {args[0]}: error: ")


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["fit", "train.py:raising", "--budget", "1GiB"],
            "train.py:raising raised FileNotFoundError: data/vocab.json (at train.py:23)",
        ),
        (
            ["rank", "train:raising", "--size", "2"],
            "train:raising raised FileNotFoundError: data/vocab.json (at train.py:23)",
        ),
        (
            ["rank", "broken.py:factory", "--size", "2"],
            "cannot load broken.py: RuntimeError: no GPU config found (at broken.py:3)",
        ),
        (
            ["fit", "train.py:misspelt", "--gpu", "T4"],
            "train.py:misspelt: the options hold 'optimiser', which estimate() does not take; did you "
            "mean 'optimizer'? its options are compile, cpu, keep_output, loss_fn, optimizer, parallel, train",
        ),
        (
            ["rank", "train.py:with_gpu", "--size", "2"],
            "train.py:with_gpu: the options hold 'gpu', which the command sets: leave it out; give --gpu",
        ),
        (
            ["fit", "train.py:with_cpu", "--gpu", "T4"],
            "train.py:with_cpu: the options hold cpu='avx2:4', a CPU profile, and this command estimates "
            "on the fake cuda device: leave it out, or run fit with --device cpu",
        ),
    ],
    ids=["factory-raises", "module-factory-raises", "file-raises", "unknown-option", "command-option", "cpu-on-cuda"],
)
def test_a_factory_that_raises_or_holds_an_unknown_option_is_one_line_and_exit_2(
    tmp_path: Path, args: list[str], line: str
) -> None:
    """Regression guard (issue 36): a traceback and exit 1, the code the docs keep for
    --at-least."""
    result = _run(tmp_path, *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr == f"python -m pytest_torchmem {args[0]}: error: {line}\n"
    assert result.stdout == ""


GPT2_FACTORY = """
import sys

sys.path.insert(0, {tests!r})
from torchvision_import import import_torchvision  # transformers imports torchvision

import_torchvision()

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def gpt2():
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=32))

    def batch_of(size):
        tokens = torch.randint(0, 50257, (size, 32), device="meta")
        return {{"input_ids": tokens, "labels": tokens}}

    return model, batch_of
"""

AFTER_THE_COMMAND = """
import logging
import sys

from pytest_torchmem.cli.main import main

code = main(sys.argv[1:])
# the user's logging configuration is as it was: transformers' notices show again
logging.getLogger("transformers.modeling_utils").warning("a notice after the command")
sys.exit(code)
"""


@pytest.mark.parametrize("command", [["rank", "train.py:gpt2", "--size", "2", "--gpu", "T4"],
                                     ["fit", "train.py:gpt2", "--gpu", "T4", "--sizes", "1:8", "-q"]])
def test_the_output_carries_no_notice_of_transformers(tmp_path: Path, command: list[str]) -> None:
    """Regression guard (issue 36): transformers' "`loss_type=None` was set in the config but
    it is unrecognized" notice, logged as the estimates run a model with labels, was printed
    among the command's output."""
    pytest.importorskip("transformers")
    (tmp_path / "train.py").write_text(GPT2_FACTORY.format(tests=str(Path(__file__).parent)))
    (tmp_path / "run.py").write_text(AFTER_THE_COMMAND)
    result = subprocess.run(
        [sys.executable, "run.py", *command], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "loss_type" not in result.stderr + result.stdout
    assert "a notice after the command" in result.stderr
    assert result.stdout.splitlines()[0].split()[0] in ("gpu", "target")
