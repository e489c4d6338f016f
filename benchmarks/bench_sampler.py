"""Decode throughput of our sampler against `transformers` `generate` (PyTorch), same weights.

Workload (issue default): a small Qwen3 configuration, batch 16, prompt 32 tokens,
128 new tokens, sampled at temperature 1 with no truncation, no early stop. Our sampler
runs jitted (compile excluded: a warm-up call first); PyTorch runs eagerly with its KV
cache, also after a warm-up. Both use this machine's threads. Also reported: our prefill
tokens/s, the extra cost of recording N Monte-Carlo candidates and the student top-K, the
continuous engine on the same batch (one slot per prompt: no refills, a paged cache), and
teacher-scoring tokens/s (prompt + response through the teacher, cache filled).

Second workload (``--long-tailed``, issue 27): the long-tailed built-in task
(``configs/long_tailed.yaml``: answers of 16 tokens at the median, 280 at p99, up to 494)
answered by its shipped student (``builtin:student_long``, loaded by all three engines from
the same safetensors) at temperature 1, each answer ending at its EOS. ``--prompts`` prompts
go through ``--slots`` sequences at a time (`transformers`: the first ``--hf-prompts``): our
static sampler in batches of ``--slots`` (each batch decodes until its longest answer ends),
our continuous engine with ``--slots`` slots over a paged cache of ``--kv-fraction`` of the
dense cache's pages (both engines with the same per-prompt keys: the same answers), and `transformers`
`generate` in batches of ``--slots`` (left-padded, stopping rows at EOS). Reported: answer
tokens/s (prefill included: the time to answer every prompt), slot utilisation (answer tokens
/ rows decoded: the continuous engine decodes only the slots in flight, bucketed to a power of
two, so the last answers' drain runs narrower), the ratios, and the KV cache's bytes per
sequence, paged against dense.

    python benchmarks/bench_sampler.py
    python benchmarks/bench_sampler.py --batch 4 --new 32    # quicker
    python benchmarks/bench_sampler.py --long-tailed          # 2048 prompts, 32 slots
    python benchmarks/bench_sampler.py --skip-transformers    # our engines only (minutes faster)

vLLM as the peer (issue 38): when ``ASYNCOPD_VLLM_PYTHON`` names an interpreter with vLLM's
CPU build (docs/testing.md), ``--long-tailed`` also runs vLLM's offline engine
(``benchmarks/vllm_peer.py``, kept running in its own process) on the same model directory
and prompts (token ids), ``--slots`` sequences at a time (``max_num_seqs``), interleaved
with ours round after round; vLLM's answers are its own draws of the same model, so each
engine's rate is of its own answers. ``--shape qwen3-0.6b`` answers ``--prompts`` random
prompts (16–128 tokens) with a Qwen3-0.6B-shaped model at its real widths and random
weights (written to a temporary directory for vLLM), up to ``--new`` tokens each::

    ASYNCOPD_VLLM_PYTHON=… python benchmarks/bench_sampler.py --long-tailed --model builtin:teacher_long \
        --prompts 512 --skip-transformers
    ASYNCOPD_VLLM_PYTHON=… python benchmarks/bench_sampler.py --long-tailed --shape qwen3-0.6b \
        --prompts 64 --new 256 --slots 64 --skip-transformers --skip-static --kv-fraction 1.0 --vllm-kv-gib 6
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asyncopd_jax.models import Decoder, DecoderConfig, save_pretrained
from asyncopd_jax.sampling import ContinuousSampler, Sampler, SamplingParams, left_pad, prompt_keys
from asyncopd_jax.teacher import ScoringParams, TeacherScorer


def small_qwen3(vocab: int) -> DecoderConfig:
    return DecoderConfig(
        model_type="qwen3",
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


VLLM_PYTHON = "ASYNCOPD_VLLM_PYTHON"


class VLLMPeer:
    """vLLM's offline engine in its own interpreter (``benchmarks/vllm_peer.py``), kept
    running between rounds so that its start-up (a minute or more) is paid once.

    Args:
      python: the interpreter of an environment with vLLM.
      model: the model directory.
      slots: sequences vLLM decodes at once (``max_num_seqs``).
      max_len: prompt + answer tokens at most (``max_model_len``).
      log: where vLLM's logs go.
      kv_gib: GiB of memory vLLM's CPU backend reserves for its KV cache.
    """

    def __init__(self, python: str, model: Path, slots: int, max_len: int, log: Path, kv_gib: int = 1):
        from asyncopd_jax.teacher import launch

        self.log = log.open("w")
        command = [python, str(Path(__file__).with_name("vllm_peer.py")), str(model)]
        command += ["--max-num-seqs", str(slots), "--max-model-len", str(max_len)]
        env = {**launch.vllm_env(), "VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env
        )
        self.path = log
        self._answer()  # ready

    def generate(self, prompts: list[list[int]], max_tokens: int, stop: int) -> tuple[float, int]:
        """Seconds of one ``LLM.generate`` over ``prompts`` at temperature 1, and the answer
        tokens it sampled."""
        request = {"prompts": prompts, "max_tokens": max_tokens, "stop_token_ids": [stop], "temperature": 1.0}
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = self._answer()
        return answer["seconds"], sum(answer["lengths"])

    def _answer(self) -> dict:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("PEER "):
                return json.loads(line[5:])
        self.log.flush()
        raise RuntimeError(f"the vLLM peer exited with {self.process.wait()}; its log: {self.path}")

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def qwen3_06b_workload(args: argparse.Namespace, directory: Path) -> tuple[Decoder, list[list[int]], int, int, int]:
    """A Qwen3-0.6B-shaped model at its real widths with random weights, written to
    ``directory`` (float32 safetensors, for vLLM), and ``--prompts`` random prompts of 16–128
    tokens: (model, prompts, eos id, pad id, prompt slots)."""
    from asyncopd_jax.models.config import read_hf_config
    from asyncopd_jax.scale.learner_inputs import ARCHITECTURES

    config = json.loads((ARCHITECTURES / "Qwen3-0.6B" / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    shape, _ = read_hf_config(directory)
    model = Decoder(shape, rngs=nnx.Rngs(args.seed))
    save_pretrained(model, directory, dtype="float32")
    rng = np.random.default_rng(args.seed)
    assert isinstance(shape.eos_token_id, int)
    eos, pad = shape.eos_token_id, shape.pad_token_id or 0
    prompts = [rng.integers(3, 150_000, size=int(n)).tolist() for n in rng.integers(16, 129, size=args.prompts)]
    return model, prompts, eos, pad, 128


def timed(fn, repeats: int) -> float:
    fn()  # warm-up (compiles)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def long_tailed(args: argparse.Namespace) -> None:
    """The long-tailed task: continuous batching against the static sampler and `transformers`."""
    import torch
    import transformers

    from asyncopd_jax.config import load_config
    from asyncopd_jax.pipeline.model_loading import load_model_and_tokenizer, resolve_model_path
    from asyncopd_jax.tasks.builtin import TaskData

    stack = contextlib.ExitStack()
    if args.shape == "qwen3-0.6b":
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        model, prompts, eos, pad, p_slots = qwen3_06b_workload(args, directory)
        t, what = args.new, f"Qwen3-0.6B shape, random weights, {args.prompts} random prompts"
    else:
        cfg = load_config("long_tailed")
        model, tokenizer = load_model_and_tokenizer(args.model, "float32")
        task = TaskData(cfg.task, tokenizer)
        prompts, _ = task.train_prompts(np.random.default_rng(args.seed), args.prompts)
        directory, eos, pad = resolve_model_path(args.model), task.eos_id, task.pad_id
        t, p_slots, what = task.max_new_tokens, task.prompt_slots, f"long-tailed task ({args.model})"
    graphdef, state = nnx.split(model)
    s = args.slots
    base = SamplingParams(
        temperature=1.0,
        max_new_tokens=t,
        stop_token_ids=(eos,),
        chunk_steps=args.chunk,
        recompute_chunk=args.recompute_chunk,
    )
    # the static sampler at its fastest: one chunk (no weight source to poll between chunks)
    static = Sampler(graphdef, dataclasses.replace(base, chunk_steps=t), pad_id=pad)
    dense_pages = s * -(-(p_slots + t) // args.page_size)
    kv_pages = int(args.kv_fraction * dense_pages)
    continuous = ContinuousSampler(
        graphdef,
        SamplingParams(
            **{**base.__dict__, "engine": "continuous", "slots": s, "page_size": args.page_size, "kv_pages": kv_pages}
        ),
        pad_id=pad,
    )

    # both engines key each prompt alike (prompt i: fold_in(key, i)), so they sample the same
    # answers: the same tokens, at the cost each engine's batching gives them
    keys = prompt_keys(jax.random.key(0), len(prompts))

    def run_static() -> tuple[int, int]:
        tokens = steps = 0
        for i in range(0, len(prompts), s):
            batch = static.generate(state, prompts[i : i + s], None, keys=keys[i : i + s], prompt_slots=p_slots)
            tokens += int(np.asarray(batch.response_mask).sum())
            steps += static.last_steps * s
        return tokens, steps

    def run_continuous() -> tuple[int, int]:
        batch = continuous.generate(state, prompts, None, keys=keys, prompt_slots=p_slots)
        stats = continuous.last_stats
        assert stats.tokens == int(np.asarray(batch.response_mask).sum())
        return stats.tokens, stats.row_steps

    hf = None
    if not args.skip_transformers:
        hf = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
        hf = hf.eval()
    torch.manual_seed(0)

    def run_hf() -> tuple[int, int]:
        assert hf is not None
        tokens = steps = 0
        for i in range(0, args.hf_prompts, s):
            ids, mask = left_pad(prompts[i : i + s], pad, p_slots)
            with torch.no_grad():
                out = hf.generate(
                    torch.as_tensor(ids, dtype=torch.long),
                    attention_mask=torch.as_tensor(mask, dtype=torch.long),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=t,
                    eos_token_id=eos,
                    pad_token_id=pad,
                )
            answers = out[:, p_slots:].numpy()
            ended = answers == eos
            lengths = np.where(ended.any(1), ended.argmax(1) + 1, answers.shape[1])
            tokens += int(lengths.sum())
            steps += answers.shape[1] * len(answers)
        return tokens, steps

    peer = None
    if os.environ.get(VLLM_PYTHON):
        log = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "vllm.log"
        start = time.perf_counter()
        peer = VLLMPeer(os.environ[VLLM_PYTHON], directory, s, p_slots + t, log, args.vllm_kv_gib)
        stack.callback(peer.close)
        print(f"vLLM up in {time.perf_counter() - start:.0f} s", flush=True)

    def run_vllm() -> tuple[int, None]:
        assert peer is not None
        _, tokens = peer.generate(prompts, t, eos)
        return tokens, None

    results = {}
    engines: list = (
        [("continuous", run_continuous)]
        if args.skip_static
        else [("static", run_static), ("continuous", run_continuous)]
    )
    if hf is not None:
        engines.append(("transformers", run_hf))
    if peer is not None:
        engines.append(("vLLM", run_vllm))
    compiles: list[tuple[str, float]] = []

    def compiled(event: str, seconds: float, *_, **meta) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append((str(meta.get("fun_name", "?")), seconds))

    for name, fn in engines:
        if name == "continuous":  # its compiles, timed by XLA's own event
            jax.monitoring.register_event_duration_secs_listener(compiled)
        fn()  # warm-up: compiles every shape the timed run meets (same prompts, same keys)
        if name == "continuous":
            jax.monitoring.unregister_event_duration_listener(compiled)
    for _ in range(args.repeats):  # interleaved: the machine's drift hits every engine alike
        for name, fn in engines:
            start = time.perf_counter()
            tokens, slot_steps = fn()
            results.setdefault(name, []).append((time.perf_counter() - start, tokens, slot_steps))
    stats = continuous.last_stats

    def rate(name: str) -> float:
        return statistics.median(tokens / seconds for seconds, tokens, _ in results[name])

    print(
        f"workload: {what}, H={model.config.hidden_size} L={model.config.num_hidden_layers}, "
        f"{len(prompts)} prompts through {s} slots, up to {t} new tokens after up to {p_slots} prompt tokens, "
        f"temperature 1, stop at EOS | jax {jax.__version__} ({jax.devices()[0].platform}), torch {torch.__version__} "
        f"({torch.get_num_threads()} threads) | medians of {args.repeats} interleaved runs"
    )
    for name, _ in engines:
        seconds, tokens, slot_steps = results[name][-1]
        steady = (
            f", {stats.steady_utilisation:.2f} while prompts waited, {tokens / (stats.decode_steps * s):.2f} "
            f"counting all {s} slots every step"
            if name == "continuous"
            else ""
        )
        used = f", slot utilisation {tokens / slot_steps:.2f}{steady}" if slot_steps is not None else ""
        print(
            f"{name:14} {statistics.median(r[0] for r in results[name]):7.2f} s {rate(name):8.0f} answer tokens/s | "
            f"{tokens} tokens{used}"
        )
    versus_hf = f"{rate('continuous') / rate('transformers'):.2f}x" if hf is not None else "(not run)"
    versus_vllm = f"{rate('continuous') / rate('vLLM'):.2f}x" if peer is not None else f"(not run: {VLLM_PYTHON} unset)"
    versus_static = f"{rate('continuous') / rate('static'):.2f}x" if not args.skip_static else "(not run)"
    print(
        f"continuous / static: {versus_static} (target >= 2.5) | continuous / "
        f"transformers: {versus_hf} (target >= 3) | continuous / vLLM: {versus_vllm} (target >= 1)"
    )
    listed = continuous.program_shapes(s, p_slots)
    per_fn: dict[str, list[float]] = {}  # the engine's programs (by their functions' names), not small ops
    programs = {"_run_fn": "run", "_recompute_fn": "recompute"}
    for fun, seconds in compiles:
        for name, program in programs.items():
            if name in fun:
                per_fn.setdefault(program, []).append(seconds)
    print(
        f"continuous engine compiles: {sum(continuous.compiled.values())} programs in the warm-up "
        f"({', '.join(f'{k} {v}' for k, v in continuous.compiled.items())}) of at most "
        f"{sum(map(len, listed.values()))} listed; XLA compile s per program: "
        + ", ".join(f"{program} {len(ts)}× {statistics.mean(ts):.2f} s" for program, ts in per_fn.items())
        + f"; {sum(ts for _, ts in compiles):.1f} s in all"
    )
    c = model.config
    token_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4  # keys + values, fp32
    dense = (p_slots + t) * token_bytes
    pool = stats.pool_pages * args.page_size * token_bytes
    print(
        f"KV cache per sequence: dense {dense / 1024:.1f} KiB ({p_slots + t} slots); paged pool {pool / s / 1024:.1f} "
        f"KiB ({stats.pool_pages} pages of {args.page_size} for {s} slots) = {pool / s / dense:.2f}x dense "
        f"(target <= 0.5); {stats.preemptions} preemptions; most pages in use at once {stats.peak_pages} "
        f"({stats.peak_pages * args.page_size * token_bytes / s / dense:.2f}x dense per sequence)"
    )
    stack.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--long-tailed", action="store_true", help="the long-tailed task workload instead")
    parser.add_argument("--skip-transformers", action="store_true", help="time our engines only")
    parser.add_argument(
        "--skip-static",
        action="store_true",
        help="--long-tailed: leave the static engine out (at the Qwen3-0.6B shape its dense cache is 5.6 GB more)",
    )
    parser.add_argument("--model", default="builtin:student_long", help="--long-tailed: the model answering")
    parser.add_argument("--prompts", type=int, default=2048, help="--long-tailed: prompts answered")
    parser.add_argument(
        "--hf-prompts", type=int, default=128, help="--long-tailed: the first prompts `transformers` answers (slow)"
    )
    parser.add_argument("--slots", type=int, default=32, help="--long-tailed: sequences decoded at once")
    parser.add_argument("--chunk", type=int, default=16, help="--long-tailed: decode steps per chunk at most")
    parser.add_argument("--page-size", type=int, default=16, help="--long-tailed: tokens per page")
    parser.add_argument(
        "--recompute-chunk",
        type=int,
        default=16,
        help="--long-tailed: prompt tokens per prefill chunk (sampling.recompute_chunk; long_tailed.yaml's)",
    )
    parser.add_argument("--kv-fraction", type=float, default=0.4, help="--long-tailed: pool pages / dense pages")
    parser.add_argument(
        "--shape", choices=["task", "qwen3-0.6b"], default="task", help="--long-tailed: the model's shape"
    )
    parser.add_argument("--vllm-kv-gib", type=int, default=4, help="GiB vLLM's CPU backend reserves for its KV cache")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.long_tailed:
        long_tailed(args)
        return

    config = small_qwen3(args.vocab)
    model = Decoder(config, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, args.vocab, size=(args.batch, args.prompt)).tolist()
    b, p, t = args.batch, args.prompt, args.new

    def ours(params: SamplingParams, engine=Sampler):
        sampler = engine(graphdef, params)
        return lambda: jax.block_until_ready(sampler.generate(state, prompts, jax.random.key(0)).response_tokens)

    plain = SamplingParams(temperature=1.0, max_new_tokens=t, chunk_steps=t)
    t_ours = timed(ours(plain), args.repeats)
    mc = SamplingParams(temperature=1.0, max_new_tokens=t, chunk_steps=t, num_candidates=8, student_topk=8)
    t_ours_mc = timed(ours(mc), args.repeats)
    chunked = SamplingParams(temperature=1.0, max_new_tokens=t, chunk_steps=16)
    t_ours_chunked = timed(ours(chunked), args.repeats)
    # the continuous engine on the same batch: a slot per prompt, so no refills (the static
    # engine's lockstep batch over a paged cache), in one chunk and in 16-step chunks
    paged = dict(engine="continuous", slots=b, page_size=16)
    t_paged = timed(ours(dataclasses.replace(plain, **paged), ContinuousSampler), args.repeats)
    t_paged_chunked = timed(ours(dataclasses.replace(chunked, **paged), ContinuousSampler), args.repeats)

    sampler = Sampler(graphdef, plain)
    ids = jnp.asarray(prompts, jnp.int32)
    mask = jnp.ones_like(ids, bool)
    keys = jax.random.split(jax.random.key(0), b)
    t_prefill = timed(lambda: jax.block_until_ready(sampler.prefill(state, ids, mask, keys).next_logits), args.repeats)

    batch = Sampler(graphdef, mc).generate(state, prompts, jax.random.key(0))
    scorer = TeacherScorer(model, ScoringParams(topk=16, num_samples=8, chunk_size=64))
    t_score = timed(lambda: jax.block_until_ready(scorer.score(batch).token_logp), args.repeats)

    import torch
    import transformers

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, local_files_only=True).eval()
    torch_ids = torch.as_tensor(prompts, dtype=torch.long)

    def hf_generate():
        with torch.no_grad():
            hf.generate(
                torch_ids,
                attention_mask=torch.ones_like(torch_ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=t,
                min_new_tokens=t,
                pad_token_id=0,
            )

    t_hf = float("nan") if args.skip_transformers else timed(hf_generate, args.repeats)

    new_tokens = b * t
    print(
        f"workload: Qwen3 H={config.hidden_size} L={config.num_hidden_layers} V={config.vocab_size}, "
        f"batch {b}, prompt {p}, {t} new tokens, temperature 1 | jax {jax.__version__} "
        f"({jax.devices()[0].platform}), torch {torch.__version__} ({torch.get_num_threads()} threads)"
    )
    rows = [
        ("ours: prefill + decode", t_ours, new_tokens),
        ("ours: + 8 MC candidates, top-8 ids", t_ours_mc, new_tokens),
        ("ours: interruptible, 16-step chunks", t_ours_chunked, new_tokens),
        ("ours, continuous engine (no refills)", t_paged, new_tokens),
        ("  interruptible, 16-step chunks", t_paged_chunked, new_tokens),
        ("transformers generate (PyTorch)", t_hf, new_tokens),
    ]
    for name, seconds, tokens in rows:
        print(f"{name:40} {seconds:8.3f} s {tokens / seconds:10.0f} new tokens/s")
    print(f"{'ours: prefill only':40} {t_prefill:8.3f} s {b * p / t_prefill:10.0f} prompt tokens/s")
    print(f"{'teacher scoring (top-16, 8 samples)':40} {t_score:8.3f} s {b * (p + t) / t_score:10.0f} tokens/s")
    print(f"decode throughput ratio ours / transformers: {t_hf / t_ours:.2f}x  (target >= 3)")


if __name__ == "__main__":
    main()
