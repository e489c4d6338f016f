"""vLLM's offline engine kept running for a benchmark to time against ours, round after round.

Run by the interpreter of an environment with vLLM's CPU build (``ASYNCOPD_VLLM_PYTHON``;
docs/testing.md), not by ours: it imports vLLM and the standard library only, and is driven
over its stdin / stdout by :class:`benchmarks.bench_sampler.VLLMPeer`::

    $ASYNCOPD_VLLM_PYTHON benchmarks/vllm_peer.py MODEL_DIR --max-num-seqs 32 --max-model-len 560

It starts ``vllm.LLM`` on the model directory as it is (float32, no tokenizer: prompts go in
as token ids, answers come back as token ids), prints ``PEER {"ready": …}``, then answers
each JSON line on stdin::

    {"prompts": [[id, …], …], "max_tokens": T, "stop_token_ids": [eos], "temperature": 1.0}

with one line ``PEER {"seconds": s, "lengths": [n, …]}``: the wall time of one
``LLM.generate`` over every prompt (its scheduler holds at most ``--max-num-seqs`` sequences
at once, refilling as answers end), and each answer's token count (its stop token
included, as ours counts it). The draws are vLLM's (the engine's seed, no per-request
generator: its fast path), so its answers are other samples of the same model than ours, of
the same length distribution. vLLM's own logs go to stderr; the ``PEER`` prefix keeps its
stdout chatter apart from the answers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a Hugging Face model directory")
    parser.add_argument("--max-num-seqs", type=int, required=True, help="sequences decoded at once")
    parser.add_argument("--max-model-len", type=int, required=True, help="prompt + answer tokens at most")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model,
        dtype="float32",
        skip_tokenizer_init=True,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        seed=0,
    )
    print("PEER " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        params = SamplingParams(
            temperature=request["temperature"],
            top_p=1.0,
            top_k=0,
            max_tokens=request["max_tokens"],
            stop_token_ids=request["stop_token_ids"],
            detokenize=False,
        )
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        lengths = [len(out.outputs[0].token_ids) for out in outputs]
        print("PEER " + json.dumps({"seconds": seconds, "lengths": lengths}), flush=True)


if __name__ == "__main__":
    main()
