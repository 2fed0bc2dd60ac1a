"""``--torchmem-timeline``: the estimated timeline as a ``torch.cuda.memory._snapshot()`` pickle.

Read back with torch's own ``torch.cuda._memory_viz`` (functions and command
line), and checked against what the viewer's JavaScript (``MemoryViz.js``,
``process_alloc_data.js``) needs of a file: the pickle opcodes its unpickler
knows, alloc/free pairs by address, segments that tile their blocks, a trace
that undoes back to nothing from the final segments.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import pickletools
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from torch.cuda import _memory_viz

from pytest_torchmem.engine.figures.report import Category
from pytest_torchmem.engine.figures.timeline import Frame, Phase, StorageInfo, Timeline
from pytest_torchmem.engine.tracing.devices.cuda.allocator import AllocatorConfig, CachingAllocator
from pytest_torchmem.plugin.exports.memory_viz import (
    CPU_BASE_ADDRESS,
    EXPANDABLE_BASE_ADDRESS,
    EXPANDABLE_WINDOW,
    snapshot,
    timeline_filename,
    write_timeline,
)

MiB = 1 << 20

# -- what the viewer's JavaScript needs of a file -------------------------------------

#: The opcodes MemoryViz.js's ``unpickle`` reads (protocols 2 to 4); any other throws.
JS_OPCODES = frozenset(
    {
        "PROTO", "FRAME", "STOP", "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET",
        "LONG_BINGET", "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_LIST", "LIST",
        "APPEND", "APPENDS", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
        "SHORT_BINUNICODE", "BINUNICODE", "BININT", "BININT1", "BININT2", "LONG1",
        "BINFLOAT", "NEWTRUE", "NEWFALSE", "NONE",
    }
)  # fmt: skip


def assert_viewer_reads(payload: bytes) -> dict[str, Any]:
    """Check a pickled snapshot the way the viewer's JavaScript reads it; return it."""
    ops = {op.name for op, _, _ in pickletools.genops(payload)}
    assert ops <= JS_OPCODES, f"MemoryViz.js cannot unpickle {sorted(ops - JS_OPCODES)}"
    data = pickle.loads(payload)
    trace = data["device_traces"][0]
    # annotate_snapshot: a legend without "unknown" makes it throw (a typo in the JS).
    categories = {e["category"] for e in trace if "category" in e}
    assert not categories or "unknown" in categories
    # JavaScript numbers hold integers exactly up to 2**53.
    assert all(e["addr"] + e["size"] < 2**53 for e in trace)
    # annotate_snapshot gives each block the address of the sum of the sizes before it.
    for segment in data["segments"]:
        assert segment["device"] == 0
        address = segment["address"]
        for block in segment["blocks"]:
            assert block["address"] == address
            address += block["size"]
        assert address == segment["address"] + segment["total_size"]
    # process_alloc_data pairs each alloc with the next free_completed at its address;
    # the blocks active at the end are those never freed (else they count twice).
    open_: dict[int, int] = {}
    for e in trace:
        if e["action"] == "alloc":
            assert e["addr"] not in open_
            open_[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            assert open_.pop(e["addr"]) == e["size"]
    active = {
        b["address"]: b["size"]
        for s in data["segments"]
        for b in s["blocks"]
        if b["state"] == "active_allocated"
    }
    assert open_ == active
    assert_undoes_to_nothing(data)
    return data


def assert_undoes_to_nothing(data: dict[str, Any]) -> None:
    """MemoryView.simulate_memory (Allocator State History): from the final segments,
    undo the trace back to its start; every block stays inside a segment on the way."""
    segments = {s["address"]: s["total_size"] for s in data["segments"]}
    blocks = {
        b["address"]: b["size"]
        for s in data["segments"]
        for b in s["blocks"]
        if b["state"] == "active_allocated"
    }

    def inside(address: int) -> bool:
        return any(start <= address < start + size for start, size in segments.items())

    for e in reversed(data["device_traces"][0]):
        action, address, size = e["action"], e["addr"], e["size"]
        if action == "alloc":
            assert blocks.pop(address) == size
        elif action == "free_completed":
            assert address not in blocks and inside(address)
            blocks[address] = size
        elif action in ("segment_free", "segment_unmap"):
            segments[address] = size
        elif action in ("segment_alloc", "segment_map"):
            if action == "segment_alloc":
                assert segments.pop(address) == size
            else:  # pages come off the run that holds them
                start = next(s for s, n in segments.items() if s <= address < s + n)
                total = segments.pop(start)
                if address > start:
                    segments[start] = address - start
                if address + size < start + total:
                    segments[address + size] = start + total - address - size
            assert not any(address <= b < address + size for b in blocks)
    assert blocks == {}
    assert segments == {}


def trace_peak(data: dict[str, Any]) -> tuple[int, dict[str, int]]:
    """The largest sum of live allocations of the trace, and its categories then."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[str, int] = {}
    for e in data["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e["category"])
            total += e["size"]
            if total > peak:
                peak = total
                at_peak = {}
                for size, category in live.values():
                    at_peak[category] = at_peak.get(category, 0) + size
        elif e["action"] == "free_completed":
            total -= live.pop(e["addr"])[0]
    return peak, at_peak


def reserved_peak(data: dict[str, Any]) -> int:
    total = peak = 0
    for e in data["device_traces"][0]:
        if e["action"] in ("segment_alloc", "segment_map"):
            total += e["size"]
            peak = max(peak, total)
        elif e["action"] in ("segment_free", "segment_unmap"):
            total -= e["size"]
    return peak


def no_flamegraph(lines: str) -> str:
    """Stands in for flamegraph.pl (``_memory_viz`` downloads it): the folded lines."""
    return lines


def run_torch_viewers(data: dict[str, Any]) -> dict[str, str]:
    """Every function of ``torch.cuda._memory_viz`` that reads a snapshot."""
    return {
        "segments": _memory_viz.segments(data, format_flamegraph=no_flamegraph),
        "memory": _memory_viz.memory(data, format_flamegraph=no_flamegraph),
        "compare": _memory_viz.compare(data["segments"], [], format_flamegraph=no_flamegraph),
        "segsum": _memory_viz.segsum(data),
        "trace": _memory_viz.trace(data),
        "trace_plot": _memory_viz.trace_plot(data),
        "segment_plot": _memory_viz.segment_plot(data),
        "trace_plot_segments": _memory_viz.trace_plot(data, plot_segments=True),
    }


# -- file names ------------------------------------------------------------------------


def test_file_name_is_readable_and_tells_every_check_apart() -> None:
    name = timeline_filename("tests/test_model.py::test_vit", "default", "cuda")
    assert re.fullmatch(
        r"tests\.test_model\.py__test_vit__default__cuda-[0-9a-f]{12}\.pickle", name
    )
    assert name == timeline_filename("tests/test_model.py::test_vit", "default", "cuda")
    keys = [
        ("tests/test_model.py::test_vit", "default", "cuda"),
        ("tests/test_model.py::test_vit", "default", "cpu"),
        ("tests/test_model.py::test_vit", "small", "cuda"),
        ("tests/test_model.py::TestVit::test_vit", "default", "cuda"),
        # readable parts that agree: the digest tells them apart
        ("tests/test_model.py::test_vit[a/b]", "default", "cuda"),
        ("tests/test_model.py::test_vit[a.b]", "default", "cuda"),
        ("tests.test_model.py::test_vit", "default", "cuda"),
        ("tests/test_model.py::test_vit", "x y", "cuda"),
        ("tests/test_model.py::test_vit", "x?y", "cuda"),
    ]
    names = [timeline_filename(*key) for key in keys]
    assert len(set(names)) == len(keys)
    assert timeline_filename(*keys[3]).startswith("tests.test_model.py__TestVit__test_vit__")


def test_file_name_is_safe_on_every_filesystem() -> None:
    nodeid = 'tests/test_m.py::test_x[<a>:"b"|c?*\\d é ' + "x" * 400 + "]"
    name = timeline_filename(nodeid, "check/1", "cuda:1")
    assert re.fullmatch(r"[A-Za-z0-9._\-\[\]]+", name)
    assert len(name.encode()) <= 255
    assert not name.startswith(".")


# -- conversion of a hand-made timeline -----------------------------------------------

MODEL_FRAME = Frame("/src/model.py", 12, "forward")
TEST_FRAME = Frame("/src/test_model.py", 30, "test_model")


def hand_made() -> tuple[Timeline, list[int]]:
    """Parameters (1000 B) live before the step; forward makes 3000 B and 5 MiB,
    backward a 600 B gradient and frees the forward's two; the step ends; then the
    tracer lets the parameters go (not part of the step)."""
    t = Timeline(module_names=["(model)", "encoder"])
    params = t.new_storage(StorageInfo(1000, Category.PARAMETERS))
    frames = (MODEL_FRAME, TEST_FRAME)
    act = t.new_storage(
        StorageInfo(3000, phase=Phase.FORWARD, module=1, op="aten.mm.default", frames=frames)
    )
    big = t.new_storage(
        StorageInfo(5 * MiB, phase=Phase.FORWARD, module=1, op="aten.relu.default", frames=frames)
    )
    grad = t.new_storage(
        StorageInfo(600, phase=Phase.BACKWARD, module=1, op="aten.mm.default", node="MmBackward0")
    )
    t.assign_role(grad, Category.GRADIENTS)
    t.phase(Phase.FORWARD)  # event 0
    t.alloc(act)  # 1
    t.alloc(big)  # 2
    t.phase(Phase.BACKWARD)  # 3
    t.alloc(grad)  # 4
    t.free(act)  # 5
    t.free(big)  # 6
    t.phase(None)  # 7: the end of the step
    t.free(params)  # 8
    return t, [params]


def rows(data: dict[str, Any]) -> list[tuple[str, int, int, int]]:
    return [(e["action"], e["addr"], e["size"], e["time_us"]) for e in data["device_traces"][0]]


def blocks(data: dict[str, Any]) -> list[list[tuple[int, int, int, str]]]:
    return [
        [(b["address"], b["size"], b["requested_size"], b["state"]) for b in s["blocks"]]
        for s in data["segments"]
    ]


def test_cpu_each_storage_is_a_segment_at_a_new_64_byte_aligned_address() -> None:
    t, baseline = hand_made()
    data = assert_viewer_reads(pickle.dumps(snapshot(t, baseline), protocol=4))
    b = CPU_BASE_ADDRESS
    act, big, grad = (
        b + 1024,
        b + 1024 + 3008,
        b + 1024 + 3008 + 5 * MiB,
    )  # 1000 -> 1024, 3000 -> 3008
    assert rows(data) == [
        ("segment_alloc", b, 1000, 0),
        ("alloc", b, 1000, 0),
        ("segment_alloc", act, 3000, 2),
        ("alloc", act, 3000, 2),
        ("segment_alloc", big, 5 * MiB, 3),
        ("alloc", big, 5 * MiB, 3),
        ("segment_alloc", grad, 600, 5),
        ("alloc", grad, 600, 5),
        ("free_requested", act, 3000, 6),
        ("free_completed", act, 3000, 6),
        ("segment_free", act, 3000, 6),
        ("free_requested", big, 5 * MiB, 7),
        ("free_completed", big, 5 * MiB, 7),
        ("segment_free", big, 5 * MiB, 7),
        ("snapshot", 0, 0, 8),
    ]
    assert blocks(data) == [
        [(b, 1000, 1000, "active_allocated")],
        [(grad, 600, 600, "active_allocated")],
    ]
    assert trace_peak(data) == (
        1000 + 3000 + 5 * MiB + 600,
        {"parameters": 1000, "activations": 3000 + 5 * MiB, "gradients": 600},
    )
    assert "allocator_settings" not in data


def test_cuda_blocks_and_segments_follow_the_caching_allocator() -> None:
    """Hand-computed from the allocator's rules: requests rounded to 512 B; up to 1 MiB
    from 2 MiB small-pool segments, split; 5 MiB from a new 20 MiB large segment (a
    request under 10 MiB), split; frees merge with free neighbours."""
    t, baseline = hand_made()
    allocator = CachingAllocator(AllocatorConfig())
    data = assert_viewer_reads(pickle.dumps(snapshot(t, baseline, allocator), protocol=4))
    a = 1 << 40  # the simulator's first segment
    large = a + 2 * MiB  # the next 2 MiB-aligned address after a 2 MiB segment
    assert rows(data) == [
        ("segment_alloc", a, 2 * MiB, 0),
        ("alloc", a, 1024, 0),
        ("alloc", a + 1024, 3072, 2),
        ("segment_alloc", large, 20 * MiB, 3),
        ("alloc", large, 5 * MiB, 3),
        ("alloc", a + 4096, 1024, 5),
        ("free_requested", a + 1024, 3072, 6),
        ("free_completed", a + 1024, 3072, 6),
        ("free_requested", large, 5 * MiB, 7),
        ("free_completed", large, 5 * MiB, 7),
        ("snapshot", 0, 0, 8),
    ]
    assert blocks(data) == [
        [
            (a, 1024, 1000, "active_allocated"),
            (a + 1024, 3072, 0, "inactive"),
            (a + 4096, 1024, 600, "active_allocated"),
            (a + 5120, 2 * MiB - 5120, 0, "inactive"),
        ],
        [(large, 20 * MiB, 0, "inactive")],
    ]
    small, big = data["segments"]
    assert (small["segment_type"], small["allocated_size"], small["requested_size"]) == (
        "small",
        2048,
        1600,
    )
    assert (big["segment_type"], big["allocated_size"], big["is_expandable"]) == ("large", 0, False)
    assert trace_peak(data)[0] == 1024 + 3072 + 5 * MiB + 1024
    assert reserved_peak(data) == 22 * MiB
    assert data["allocator_settings"]["expandable_segments"] is False


def test_cuda_a_side_streams_segment_and_blocks_are_on_that_stream() -> None:
    """A storage charged to a side stream (FSDP2's all-gather copy-in stream, pool 2)
    gets a segment of that stream: its ``segment_alloc``, its block's ``alloc`` and the
    segment at the end all name stream 2 (the segment's entry said 0)."""
    t = Timeline()
    gathered = t.new_storage(StorageInfo(4 * MiB, phase=Phase.FORWARD, op="aten.empty.memory_format", pool=2))
    t.phase(Phase.FORWARD)
    t.alloc(gathered)
    t.phase(None)
    data = assert_viewer_reads(pickle.dumps(snapshot(t, [], CachingAllocator(AllocatorConfig())), protocol=4))
    assert [(e["action"], e["size"], e["stream"]) for e in data["device_traces"][0][:2]] == [
        ("segment_alloc", 20 * MiB, 2),
        ("alloc", 4 * MiB, 2),
    ]
    assert [(s["stream"], s["total_size"]) for s in data["segments"]] == [(2, 20 * MiB)]


def test_cuda_expandable_segments_map_pages_in_windows_the_viewer_can_address() -> None:
    """With expandable segments the allocator maps 2 MiB (small pool) and 20 MiB (large
    pool) pages into address ranges of 2**62 bytes; each is shown in its own window."""
    t, baseline = hand_made()
    allocator = CachingAllocator(AllocatorConfig.parse("expandable_segments:True"))
    data = assert_viewer_reads(pickle.dumps(snapshot(t, baseline, allocator), protocol=4))
    a, large = EXPANDABLE_BASE_ADDRESS, EXPANDABLE_BASE_ADDRESS + EXPANDABLE_WINDOW
    assert [r for r in rows(data) if r[0].startswith("segment")] == [
        ("segment_map", a, 2 * MiB, 0),
        ("segment_map", large, 20 * MiB, 3),
    ]
    assert [(s["address"], s["total_size"], s["is_expandable"]) for s in data["segments"]] == [
        (a, 2 * MiB, True),
        (large, 20 * MiB, True),
    ]
    assert blocks(data)[0][2] == (a + 4096, 1024, 600, "active_allocated")
    assert reserved_peak(data) == 22 * MiB


def test_frames_say_phase_op_node_category_module_then_the_users() -> None:
    t, baseline = hand_made()
    trace = snapshot(t, baseline)["device_traces"][0]
    allocs = [e for e in trace if e["action"] == "alloc"]
    model = {"filename": "/src/model.py", "line": 12, "name": "forward"}
    test = {"filename": "/src/test_model.py", "line": 30, "name": "test_model"}
    assert [(e["category"], e["frames"]) for e in allocs] == [
        ("parameters", [{"filename": "<before the step>", "line": 0, "name": "parameters"}]),
        (
            "activations",
            [
                {
                    "filename": "<forward>",
                    "line": 0,
                    "name": "aten.mm.default -> activations, module encoder",
                },
                model,
                test,
            ],
        ),
        (
            "activations",
            [
                {
                    "filename": "<forward>",
                    "line": 0,
                    "name": "aten.relu.default -> activations, module encoder",
                },
                model,
                test,
            ],
        ),
        (
            "gradients",
            [
                {
                    "filename": "<backward>",
                    "line": 0,
                    "name": "aten.mm.default (MmBackward0) -> gradients, module encoder",
                }
            ],
        ),
    ]
    # the flame graphs read them outermost first
    folded = _memory_viz.memory(snapshot(t, baseline), format_flamegraph=no_flamegraph)
    assert folded.splitlines() == [
        "stream_0;active_allocated;<before the step>:0:parameters 1000",
        (
            "stream_0;active_allocated;<backward>:0:aten.mm.default (MmBackward0) -> gradients, "
            "module encoder 600"
        ),
    ]


# -- a real pytest run ------------------------------------------------------------------

MODEL_TEST = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x):
        hidden = self.fc1(x).relu()  # the line the forward's frames point at
        return self.fc2(hidden)


def test_train(torchmem):
    torchmem.check(Net(), torch.randn(8, 16), optimizer=lambda p: torch.optim.Adam(p))


def test_infer(torchmem):
    torchmem.check(Net(), torch.randn(4, 16), train=False)
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real pytest session over two tests, both devices, writing timelines into ``out``
    (which does not exist yet) and the snapshot entries the figures are checked against."""
    root = tmp_path_factory.mktemp("timeline")
    (root / "test_m.py").write_text(MODEL_TEST)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTORCH_CUDA"))}
    result = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
            "-p", "no:hypothesispytest", "--torchmem-update", "--torchmem-timeline", "out",
        ],
        cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return root


def entry(root: Path, test: str, device: str) -> dict[str, Any]:
    return json.loads((root / "__torchmem__" / "test_m.json").read_text())["tests"][test][
        "default"
    ][device]


def load(root: Path, test: str, device: str) -> dict[str, Any]:
    path = root / "out" / timeline_filename(f"test_m.py::{test}", "default", device)
    return assert_viewer_reads(path.read_bytes())


def test_one_file_per_check_and_device(run: Path) -> None:
    names = sorted(path.name for path in (run / "out").iterdir())
    assert len(names) == 4  # nothing else: no temporary file left
    for name, (test, device) in zip(
        names, [("infer", "cpu"), ("infer", "cuda"), ("train", "cpu"), ("train", "cuda")]
    ):
        assert re.fullmatch(
            rf"test_m\.py__test_{test}__default__{device}-[0-9a-f]{{12}}\.pickle", name
        )


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("test", ["test_train", "test_infer"])
def test_torch_reads_it_and_its_peak_is_the_estimates(run: Path, test: str, device: str) -> None:
    data = load(run, test, device)
    outputs = run_torch_viewers(data)
    assert "Memory accounting error" not in outputs["segsum"]
    expected = entry(run, test, device)
    peak, categories = trace_peak(data)
    assert peak == expected["peak"]
    assert categories == {k: v for k, v in expected["breakdown"].items() if v}
    if device == "cuda":
        assert reserved_peak(data) == expected["reserved_peak"]
    assert data["torchmem"]["nodeid"] == f"test_m.py::{test}"


def test_frames_point_at_the_model_and_phases_are_told_apart(run: Path) -> None:
    source = (run / "test_m.py").read_text().splitlines()
    line = next(i for i, text in enumerate(source, 1) if "hidden = self.fc1(x).relu()" in text)
    module = (run / "test_m.py").resolve()

    def at_line(frame: dict[str, Any]) -> bool:
        return (frame["line"], frame["name"]) == (line, "forward") and Path(
            frame["filename"]
        ).resolve() == module

    for device in ("cpu", "cuda"):
        allocs = [
            e for e in load(run, "test_train", device)["device_traces"][0] if e["action"] == "alloc"
        ]
        first = [(e["frames"][0]["filename"], e["frames"][0]["name"]) for e in allocs]
        # fc1's output, made on that line in forward
        assert any(
            f == ("<forward>", "aten.addmm.default -> activations, module fc1")
            and any(at_line(frame) for frame in e["frames"])
            for f, e in zip(first, allocs)
        )
        # backward runs autograd's nodes; the Adam step makes its state
        assert any(p == "<backward>" and "(AddmmBackward0)" in n for p, n in first)
        assert any(
            p == "<optimizer step>" and e["category"] == "optimizer_state"
            for (p, _), e in zip(first, allocs)
        )
        assert {p for p, _ in first} == {
            "<before the step>",
            "<forward>",
            "<backward>",
            "<optimizer step>",
        }


def test_torch_command_line_plots_it(run: Path) -> None:
    """``python -m torch.cuda._memory_viz trace_plot|segment_plot FILE -o OUT.html``."""
    path = run / "out" / timeline_filename("test_m.py::test_train", "default", "cuda")
    plots = {"trace_plot": "Active Memory Timeline", "segment_plot": "Allocator State History"}
    jobs = {
        action: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.cuda._memory_viz",
                action,
                str(path),
                "-o",
                f"{action}.html",
            ],
            cwd=run,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for action in plots
    }
    try:
        outputs = {action: job.communicate(timeout=600)[0] for action, job in jobs.items()}
    finally:  # a bound for a hang, not for a loaded machine's slowness; none left running
        for job in jobs.values():
            if job.poll() is None:
                job.kill()
                job.wait()
    for action, job in jobs.items():
        output = outputs[action]
        assert job.returncode == 0, output
        html = (run / f"{action}.html").read_text()
        assert repr(plots[action]) in html
        embedded = json.loads(re.search(r"const local_files = (\[.*\])", html).group(1))
        payload = base64.b64decode(embedded[0]["base64"])
        assert pickle.loads(payload) == pickle.loads(path.read_bytes())
        assert {op.name for op, _, _ in pickletools.genops(payload)} <= JS_OPCODES


def test_write_replaces_the_file_whole_and_refuses_a_file_as_directory(tmp_path: Path) -> None:
    import torch
    from torch import nn

    from pytest_torchmem.engine.tracing.devices import device_model
    from pytest_torchmem.engine.tracing.trace import trace
    from pytest_torchmem.plugin.snapshots import Key

    traced = trace(
        nn.Linear(4, 2), (torch.randn(3, 4),), {}, device=device_model("cpu"),
        loss_fn=None, optimizer=None, train=True, record_frames=True,
    )  # fmt: skip
    result = SimpleNamespace(nodeid="t.py::test_x", key=Key("test_x", "default", "cpu"))
    folder = tmp_path / "new" / "timelines"
    path = write_timeline(folder, result, traced)  # type: ignore[arg-type]
    path.write_bytes(b"an older file")
    assert write_timeline(folder, result, traced) == path  # type: ignore[arg-type]
    assert os.listdir(folder) == [path.name]
    data = assert_viewer_reads(path.read_bytes())
    assert trace_peak(data)[0] == traced.report.peak
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    with pytest.raises(OSError):
        write_timeline(blocked, result, traced)  # type: ignore[arg-type]
    assert blocked.read_text() == ""
