"""Decode throughput of our sampler against `transformers` `generate` (PyTorch), same weights.

Workload (issue default): a small Qwen3 configuration, batch 16, prompt 32 tokens,
128 new tokens, sampled at temperature 1 with no truncation, no early stop. Our sampler
runs jitted (compile excluded: a warm-up call first); PyTorch runs eagerly with its KV
cache, also after a warm-up. Both use this machine's threads. Also reported: our prefill
tokens/s, the extra cost of recording N Monte-Carlo candidates and the student top-K,
and teacher-scoring tokens/s (prompt + response through the teacher, cache filled).

    python benchmarks/bench_sampler.py
    python benchmarks/bench_sampler.py --batch 4 --new 32    # quicker
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asyncopd_jax.models import Decoder, DecoderConfig, save_pretrained
from asyncopd_jax.sampling import Sampler, SamplingParams
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


def timed(fn, repeats: int) -> float:
    fn()  # warm-up (compiles)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    config = small_qwen3(args.vocab)
    model = Decoder(config, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, args.vocab, size=(args.batch, args.prompt)).tolist()
    b, p, t = args.batch, args.prompt, args.new

    def ours(params: SamplingParams):
        sampler = Sampler(graphdef, params)
        return lambda: jax.block_until_ready(sampler.generate(state, prompts, jax.random.key(0)).response_tokens)

    plain = SamplingParams(temperature=1.0, max_new_tokens=t, chunk_steps=t)
    t_ours = timed(ours(plain), args.repeats)
    mc = SamplingParams(temperature=1.0, max_new_tokens=t, chunk_steps=t, num_candidates=8, student_topk=8)
    t_ours_mc = timed(ours(mc), args.repeats)
    chunked = SamplingParams(temperature=1.0, max_new_tokens=t, chunk_steps=16)
    t_ours_chunked = timed(ours(chunked), args.repeats)

    sampler = Sampler(graphdef, plain)
    ids = jnp.asarray(prompts, jnp.int32)
    mask = jnp.ones_like(ids, bool)
    t_prefill = timed(lambda: jax.block_until_ready(sampler._prefill(state, ids, mask).next_logits), args.repeats)

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

    t_hf = timed(hf_generate, args.repeats)

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
        ("transformers generate (PyTorch)", t_hf, new_tokens),
    ]
    for name, seconds, tokens in rows:
        print(f"{name:40} {seconds:8.3f} s {tokens / seconds:10.0f} new tokens/s")
    print(f"{'ours: prefill only':40} {t_prefill:8.3f} s {b * p / t_prefill:10.0f} prompt tokens/s")
    print(f"{'teacher scoring (top-16, 8 samples)':40} {t_score:8.3f} s {b * (p + t) / t_score:10.0f} tokens/s")
    print(f"decode throughput ratio ours / transformers: {t_hf / t_ours:.2f}x  (target >= 3)")


if __name__ == "__main__":
    main()
