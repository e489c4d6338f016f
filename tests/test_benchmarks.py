"""The sampler benchmark (both workloads) still runs against today's samplers (it reaches into the prefill, a
private method: the benchmark broke unnoticed once when the sampler was rewritten), and the scoring benchmark
against today's three teachers (in the vLLM step)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # the benchmarks run end to end: the end-to-end step (-m e2e)

ROOT = Path(__file__).resolve().parents[1]


def _bench_sampler(*args: str, timeout: float = 240) -> str:
    """``benchmarks/bench_sampler.py`` run with ``args``: its output (it must succeed).
    The default ``timeout``: healthy ~30 s, under the per-test limit (pyproject.toml), so
    that a failure shows the output."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_sampler.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_bench_sampler_runs_at_a_tiny_size():
    out = _bench_sampler("--batch", "2", "--prompt", "4", "--new", "4", "--vocab", "64", "--repeats", "1")
    assert "ours: prefill only" in out and "decode throughput ratio" in out


def test_bench_sampler_long_tailed_runs_at_a_tiny_size():
    """The continuous engine against the static one and `transformers` on the long-tailed task."""
    out = _bench_sampler("--long-tailed", "--prompts", "8", "--hf-prompts", "4", "--slots", "4", "--repeats", "1")
    assert "continuous / static" in out and "KV cache per sequence" in out
    assert "continuous engine compiles: 1 programs" in out and "run 1× " in out.split("XLA compile s per program: ")[1]


def test_bench_kv_precision_reports_each_cache_dtype_at_a_tiny_size():
    """bf16 against fp32 KV cache: each one's rate, bytes per token and learner gap."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_kv_precision.py"), "--prompts", "8", "--slots", "4"]
        + ["--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.split()}
    assert {"float32", "bfloat16"} <= rows.keys(), done.stdout
    # bytes per token: 2 · layers · kv heads · head dim · 4 (teacher_long: 4 · 2 · 32), halved
    assert (rows["float32"][3], rows["bfloat16"][3]) == ("2,048", "1,024"), done.stdout
    assert float(rows["float32"][6]) < float(rows["bfloat16"][6]), done.stdout  # the rounding shows in the gap


@pytest.mark.served  # starts vLLM: the vLLM step (-m served), where ASYNCOPD_VLLM_PYTHON is set
@pytest.mark.timeout(1200)
def test_bench_sampler_long_tailed_times_vllm_on_the_same_weights_and_prompts():
    """With ``ASYNCOPD_VLLM_PYTHON`` set, vLLM's offline engine (benchmarks/vllm_peer.py)
    answers the same prompts with the same model directory, interleaved with ours, and the
    continuous engine's ratio to it is reported."""
    from tests.teacher.vllm_server import vllm_python

    vllm_python()  # skips, saying why, without vLLM
    out = _bench_sampler(
        "--long-tailed", "--model", "builtin:teacher_long", "--prompts", "16", "--slots", "8", "--skip-transformers",
        "--repeats", "1", "--vllm-kv-gib", "1", timeout=900,
    )  # fmt: skip
    rows = {line.split()[0]: line for line in out.splitlines() if "answer tokens/s" in line}
    assert {"static", "continuous", "vLLM"} <= rows.keys(), out
    assert float(rows["vLLM"].split()[3]) > 0, out  # "vLLM  <s> s  <rate> answer tokens/s | …"
    ratio = out.split("continuous / vLLM: ")[1].split("x")[0]
    assert float(ratio) > 0, out


@pytest.mark.served  # starts vLLM: the vLLM step (-m served), where ASYNCOPD_VLLM_PYTHON is set
def test_bench_scoring_compares_the_three_teachers_in_one_run():
    """``benchmarks/bench_scoring.py`` scores a small demo batch in-process, behind
    ``serve-teacher`` and behind vLLM (from ``ASYNCOPD_VLLM_PYTHON``), and reports each one's
    positions/s and ratio to the in-process scorer; then the demo's samples/s with each."""
    from tests.teacher.vllm_server import vllm_python

    vllm_python()  # skips, saying why, without vLLM
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_scoring.py"), "--batch", "8", "--repeats", "1"]
        + ["--steps", "6", "--warmup-steps", "2"],
        capture_output=True,
        text=True,
        timeout=900,  # vLLM starts in 1-6 minutes here
    )
    assert done.returncode == 0, done.stderr[-3000:]
    scoring, _, training = done.stdout.partition("the demo with each teacher")
    teachers = {"in-process", "asyncopd serve-teacher", "vLLM"}
    for table, ratio in ((scoring, -1), (training, -3)):  # "… 1.00" / "… 1.00 × in-process"
        lines = {line.split("  ")[0].strip(): line.split() for line in table.splitlines()}
        assert teachers <= lines.keys(), done.stdout
        assert lines["in-process"][ratio] == "1.00", done.stdout
        assert all(float(lines[name][ratio]) > 0 for name in teachers), done.stdout


def test_bench_swaps_times_every_route_of_a_shipped_students_swap(tmp_path):
    """``benchmarks/bench_swaps.py`` publishes and loads the demo's student by each route the
    runs use and prints each one's seconds and GB/s."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_swaps.py"), "--configs", "demo", "--repeats", "1"]
        + ["--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row[2]: row for row in (line.split() for line in done.stdout.splitlines()) if row[:1] == ["demo"]}
    assert set(rows) == {"in-memory", "orbax", "safetensors"}, done.stdout
    assert all(float(row[1]) > 0 and float(row[3]) > 0 for row in rows.values()), done.stdout  # MB, seconds
    assert not list(tmp_path.iterdir())  # every snapshot directory removed


def test_bench_delta_sync_measures_a_delta_per_published_version(tmp_path):
    """``benchmarks/bench_delta_sync.py`` trains the demo's student for a few steps, diffs
    each published version against the one before, and checks the rebuilt weights' digest
    (it fails if a rebuilt version differs); bfloat16 at a tiny learning rate leaves most
    elements unchanged, so the delta is smaller than the full snapshot."""
    out = tmp_path / "delta.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_delta_sync.py"), "--model", "demo", "--lr", "1e-6"]
        + ["--warmup", "1", "--versions", "3", "--batch", "4", "--seq", "16", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    (result,) = json.loads(out.read_text())
    assert result["versions"] == 3 and len(result["rows"]) == 3 and result["publish_dtype"] == "bfloat16"
    assert 0 < result["delta_bytes_mean"] < result["full_bytes"], result


def test_bench_eval_times_no_eval_inline_and_background_in_one_run():
    """The demo three ways: each arm's learning steps/s and its evaluations (at 4, 8, 12)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_eval.py")]
        + ["--steps", "12", "--every", "4", "--rounds", "1", "--prompts", "32", "--skip", "2"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line[:12].strip(): line[12:].split() for line in done.stdout.splitlines()[2:5]}
    assert [rows[arm][2] for arm in ("no eval", "inline", "background")] == ["1", "3", "3"], done.stdout
    assert all(float(rows[arm][0]) > 0 for arm in rows), done.stdout
    assert "background / inline learning steps/s: " in done.stdout


def test_bench_byte_prefix_runs_at_a_tiny_size():
    """The byte-prefix teacher's cost against span alignment: its jitted calls are still the
    ones the benchmark counts FLOPs through (a renamed one would count nothing)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_byte_prefix.py"), "--rows", "4", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = {line.split()[0]: line for line in done.stdout.splitlines()[1:]}
    assert set(lines) == {"spans", "byte_prefix", "byte_prefix-from4"}
    for name in ("byte_prefix", "byte_prefix-from4"):  # each timed batch runs its answers anew, and its trees
        answers = int(lines[name].split("tree rows, ")[1].split()[0].replace(",", ""))
        trees = int(lines[name].split(" + ")[1].split()[0].replace(",", ""))
        assert answers > 0 and trees > 0, lines[name]


def test_bench_tool_overlap_reports_both_modes_at_a_tiny_size():
    """Tool calls overlapped with decoding against a group at a time: both modes, every
    call answered (the figures themselves are the benchmark's, docs/results.md)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_tool_overlap.py"), "--problems", "32", "--group", "8"]
        + ["--slots", "4", "--latency", "0.02"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines()]
    calls = [int(row[-1]) for row in rows if row[:1] in (["overlapped"], ["group"])]
    assert calls == [32, 32], done.stdout  # the shipped tool teacher calls once an answer
    assert "speed-up of overlapping tool calls with decoding" in done.stdout


def test_bench_lora_sampler_runs_on_the_demos_student():
    """Merged at the swap against unmerged in the decode (docs/lora.md), at a tiny size."""
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_lora_sampler.py"),
            "--shapes",
            "demo",
            "--new",
            "4",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.splitlines()[-1])
    assert figures["adapter_parameters"] == 38912  # rank 16 on the 7 projections of the demo's student
    assert set(figures["swap_s"]) == set(figures["decode_step_s"]) == {"merged", "unmerged"}
