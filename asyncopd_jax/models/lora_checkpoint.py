"""LoRA adapters in Hugging Face PEFT's layout, where ``peft`` and vLLM (``--enable-lora``)
load them: a directory with ``adapter_config.json`` and ``adapter_model.safetensors``.

PEFT names a projection's adapter after the module it wraps, under its own prefix, and
stores both matrices as ``torch.nn.Linear`` weights, ``[out, in]``:

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   [r, in]  = our A.T
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   [out, r] = our B.T

and scales ``B A x`` by ``lora_alpha / r`` itself (without ``use_rslora``), which is our
scale: the matrices are written unscaled. ``target_modules`` lists the projections' names
when every projection of those names has an adapter, else each adapted module's full name
(PEFT matches an entry against a module's name or its dotted ending).

Modules trained whole (``student.lora.modules_to_save``) are PEFT's ``modules_to_save``,
listed by full name (PEFT matches them by ending, and ``norm`` ends ``q_norm`` too), their
weights under the same prefix as transformers names them (``…model.norm.weight``). A tied
head follows its embedding: ``ensure_weight_tying`` makes PEFT tie its copy of the head to
its copy of the embedding. vLLM (0.32) loads such an adapter's projections only: it takes
full modules for a classifier's head alone (``vllm/lora/model_manager.py``,
``_validate_modules_to_save``), so serve the merged model there.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from asyncopd_jax.models.decoder import Decoder
from asyncopd_jax.models.hf_checkpoint import hf_tensors
from asyncopd_jax.models.lora import LoRAParams, WholeParam, adapters, projections

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT = "base_model.model."  # PEFT's wrapper around transformers' CausalLM
_PREFIX = _PEFT + "model."  # the CausalLM's decoder


def _targets(model: Decoder) -> list[str]:
    """``target_modules``: the projections' names where every projection of each name is
    adapted, else every adapted module's full name in transformers' model."""
    adapted = {path for path, _ in adapters(model)}
    names = sorted({path.rsplit(".", 1)[1] for path in adapted})
    if adapted == {path for path in projections(model) if path.rsplit(".", 1)[1] in names}:
        return names
    return [f"model.{path}" for path in sorted(adapted)]


def save_adapters(model: Decoder, path: str | Path, params: LoRAParams, base_model: str = "") -> None:
    """Write ``model``'s adapters to the directory ``path`` (created) in PEFT's layout, in
    fp32; ``base_model``: the base's location, recorded as ``base_model_name_or_path``."""
    adapted = adapters(model)
    if not adapted:
        raise ValueError("the model has no LoRA adapters to save (student.lora.rank is 0)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, module in adapted:
        a = np.asarray(module.lora_a[...].astype(jnp.float32))  # [in, r]
        b = np.asarray(module.lora_b[...].astype(jnp.float32))  # [r, out]
        tensors[f"{_PREFIX}{name}.lora_A.weight"] = np.ascontiguousarray(a.T)
        tensors[f"{_PREFIX}{name}.lora_B.weight"] = np.ascontiguousarray(b.T)
    # the weights trained whole, fp32, by their transformers names (model.norm.weight)
    whole = {name: np.asarray(t) for name, t in hf_tensors(nnx.state(model, WholeParam), jnp.float32).items()}
    tied = "model.embed_tokens.weight" in whole and model.config.tie_word_embeddings
    if tied:  # PEFT saves its tied copy of the head too, and loads it by that name
        whole["lm_head.weight"] = whole["model.embed_tokens.weight"]
    tensors.update({f"{_PEFT}{name}": value for name, value in whole.items()})
    saved = sorted({name.rsplit(".", 1)[0] for name in whole} - ({"lm_head"} if tied else set()))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": params.rank,
        "lora_alpha": params.alpha,
        "lora_dropout": params.dropout,
        "target_modules": _targets(model),
        "modules_to_save": saved or None,
        "ensure_weight_tying": tied,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})


__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "save_adapters"]
