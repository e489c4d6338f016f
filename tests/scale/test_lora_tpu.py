"""The shipped LoRA config (``qwen3_8b_lora_from_30b_a3b_v6e8``: Qwen3-8B, a bf16 base,
rank 16 on the 7 projections) compiled by XLA's TPU compiler for its learner's 2 v6e chips,
as ``asyncopd plan`` compiles it, reduced to one layer at Qwen3-8B's widths and the whole
vocabulary, on short rows (the state, not the activations, is what is compared): the
learner's arguments are the bf16 base and the adapters with their fp32 moments, a sixth of
full training's (fp32 master weights and two moments) on the same chips. Two compiles: 144 s
on this project's 2-core machine (2026-11-29). The full-depth
figures, and the merging sampler's, are in docs/scaling.md (``asyncopd plan``).

Skipped where libtpu is not installed; CI installs it (``.ci/run``) and runs this file.
"""

from __future__ import annotations

import jax
import pytest

from asyncopd_jax.config import load_config
from asyncopd_jax.models.decoder import abstract_decoder
from asyncopd_jax.scale.chips import get_topology, libtpu_available
from asyncopd_jax.scale.learner_inputs import architecture
from asyncopd_jax.scale.plan import Shapes, compile_learner_step
from tests.tpu_compiler import REASON

pytestmark = [pytest.mark.tpu_compiler, pytest.mark.skipif(not libtpu_available(), reason=REASON)]

CONFIG = "qwen3_8b_lora_from_30b_a3b_v6e8"
SHAPES = Shapes(32, 96, layers=1)


def _weights(config) -> int:
    return sum(x.size for x in jax.tree_util.tree_leaves(abstract_decoder(config, "float32")[1]))


@pytest.mark.timeout(600)
def test_the_lora_learner_holds_a_sixth_of_full_trainings_state_on_its_chips():
    chips = list(get_topology("v6e-8").devices)[:2]
    lora = load_config(CONFIG)
    config, _ = architecture(lora.student, SHAPES.layers)
    full = load_config(CONFIG, ["student.lora.rank=0", "student.dtype=float32"])
    adapted, whole = (compile_learner_step(cfg, config, chips, SHAPES) for cfg in (lora, full))
    assert adapted.error is None and whole.error is None, (adapted.error, whole.error)
    weights = _weights(config)
    # per chip (FSDP over 2): full training 12 bytes a weight (fp32 weights, μ, ν), LoRA 2 (bf16)
    assert whole.argument_bytes > 0.95 * 12 * weights / 2
    assert adapted.argument_bytes < 1.2 * 2 * weights / 2
    assert whole.argument_bytes > 5 * adapted.argument_bytes
