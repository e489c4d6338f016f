"""Bad model directories fail with one clear line naming the file, the field and the fix.

Every bad input is built for real: checkpoints written by ``save_pretrained`` (safetensors)
and then truncated, overwritten or contradicted by an edited ``config.json``; tokenizers
built with the ``tokenizers`` library.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from flax import nnx

from asyncopd_jax.models import (
    Decoder,
    check_same_vocabulary,
    from_pretrained,
    load_tokenizer,
    save_pretrained,
    shared_vocab_size,
)
from asyncopd_jax.tasks.tokenizer import save_tokenizer
from tests.models.test_tokenizer import make_tokenizer
from tests.tiny_models import tiny_config, tiny_decoder


def _checkpoint(path: Path, family: str = "qwen3", **config) -> Path:
    """A tiny random checkpoint in the Hugging Face layout (``config.json`` + safetensors)."""
    cfg = dataclasses.replace(tiny_config(family), **config)
    save_pretrained(Decoder(cfg, rngs=nnx.Rngs(0)), path)
    return path


def _edit_config(path: Path, **changes) -> Path:
    """Rewrite ``path/config.json`` with ``changes`` (a value of ``...`` deletes the field)."""
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    raw = {k: v for k, v in raw.items() if v is not ...}
    (path / "config.json").write_text(json.dumps(raw))
    return path


def _one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


# --- 1. missing directory, config, weights, tokenizer ---


def test_missing_directory_config_weights_or_tokenizer_names_the_file_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"model directory not found: {re.escape(str(tmp_path / 'nope'))}"):
        from_pretrained(tmp_path / "nope")

    model = _checkpoint(tmp_path / "m")
    (model / "config.json").rename(tmp_path / "config.json.bak")
    with pytest.raises(FileNotFoundError, match=f"{re.escape(str(model / 'config.json'))} does not exist"):
        from_pretrained(model)
    (tmp_path / "config.json.bak").rename(model / "config.json")

    (model / "model.safetensors").rename(tmp_path / "weights.bak")
    with pytest.raises(FileNotFoundError) as err:
        from_pretrained(model)
    assert _one_line(err) == (
        f"no weights in {model}: expected model.safetensors or model.safetensors.index.json (found: config.json)"
    )
    (tmp_path / "weights.bak").rename(model / "model.safetensors")

    # save_pretrained writes no tokenizer: the model loads, its tokenizer does not
    from_pretrained(model)
    with pytest.raises(FileNotFoundError) as err:
        load_tokenizer(model)
    assert _one_line(err) == (
        f"no tokenizer in {model}: expected one of tokenizer.json, tokenizer.model, vocab.json "
        "(found: config.json, model.safetensors); copy the model's tokenizer files into it"
    )


def test_a_tokenizer_config_without_a_vocabulary_is_named_as_missing(tmp_path):
    tok = make_tokenizer(tmp_path / "t", ["a", "b"])
    (tok / "tokenizer.json").unlink()  # tokenizer_config.json alone holds no vocabulary
    with pytest.raises(
        FileNotFoundError,
        match=r"no tokenizer in .*/t: expected one of tokenizer.json, "
        r"tokenizer.model, vocab.json \(found: .*tokenizer_config.json\)",
    ):
        load_tokenizer(tok)


def test_a_sharded_checkpoint_missing_a_shard_names_it(tmp_path):
    save_pretrained(tiny_decoder(), tmp_path / "m", max_shard_bytes=4_000)
    shards = sorted((tmp_path / "m").glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    with pytest.raises(
        FileNotFoundError,
        match=f"model.safetensors.index.json lists shard\\(s\\) that do not exist: {re.escape(str(shards[1]))}",
    ):
        from_pretrained(tmp_path / "m")


# --- 2. truncated or corrupt files; tensors that do not fit config.json ---


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _garbage(file: Path) -> None:
    file.write_bytes(bytes(range(256)) * 4)


def _bad_header(file: Path) -> None:
    # the first 8 bytes give the header's length; the header itself is no longer JSON
    data = file.read_bytes()
    file.write_bytes(data[:8] + b"{not json" + data[17:])


@pytest.mark.parametrize("damage", [_truncate, _garbage, _bad_header], ids=["truncated", "garbage", "bad-header"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_a_truncated_or_corrupt_safetensors_file_is_named(tmp_path, damage, sharded):
    save_pretrained(tiny_decoder(), tmp_path / "m", max_shard_bytes=4_000 if sharded else 2**30)
    file = sorted((tmp_path / "m").glob("model*.safetensors"))[-1]
    damage(file)
    with pytest.raises(ValueError) as err:
        from_pretrained(tmp_path / "m")
    message = _one_line(err)
    assert message.startswith(f"{file} is truncated or corrupt (Error while deserializing header"), message
    assert message.endswith("; re-download or re-save it"), message


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_a_truncated_json_file_of_a_checkpoint_is_named(tmp_path, name):
    save_pretrained(tiny_decoder(), tmp_path / "m", max_shard_bytes=4_000)
    _truncate(tmp_path / "m" / name)
    with pytest.raises(ValueError) as err:
        from_pretrained(tmp_path / "m")
    assert re.fullmatch(
        f"{re.escape(str(tmp_path / 'm' / name))} is not valid JSON \\(line \\d+, column \\d+: .+\\); "
        "it is truncated or corrupt: re-download or re-save it",
        _one_line(err),
    ), str(err.value)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_a_truncated_tokenizer_file_is_named(tmp_path, name):
    tok = make_tokenizer(tmp_path / "t", ["a", "b"])
    _truncate(tok / name)
    with pytest.raises(ValueError, match=f"^{re.escape(str(tok / name))} is not valid JSON"):
        load_tokenizer(tok)


def test_a_tensor_of_the_wrong_shape_names_tensor_file_and_config(tmp_path):
    model = _edit_config(_checkpoint(tmp_path / "m"), intermediate_size=48)
    with pytest.raises(ValueError) as err:
        from_pretrained(model)
    assert re.fullmatch(
        f"{re.escape(str(model / 'model.safetensors'))}: tensor 'model.layers.0.mlp.\\w+_proj.weight' has shape "
        f"\\[(64, 32|32, 64)\\], but {re.escape(str(model / 'config.json'))} implies \\[(48, 32|32, 48)\\]; weights "
        "and config.json belong to different models",
        _one_line(err),
    ), str(err.value)


def test_weights_config_json_does_not_account_for_are_refused(tmp_path):
    # config.json says 1 layer, the weights hold 2: loading would silently drop layer 1
    model = _edit_config(_checkpoint(tmp_path / "layers"), num_hidden_layers=1)
    with pytest.raises(
        ValueError,
        match=r"layers: the weights hold tensor\(s\) that config.json does not account for: "
        r"'model.layers.1.input_layernorm.weight', .* and \d+ more; .*num_hidden_layers",
    ):
        from_pretrained(model)
    # Llama biases (attention_bias) that config.json switches off
    model = _edit_config(_checkpoint(tmp_path / "bias", "llama", attention_bias=True), attention_bias=False)
    with pytest.raises(
        ValueError, match=r"does not account for: 'model.layers.0.self_attn.k_proj.bias', .*attention_bias"
    ):
        from_pretrained(model)
    # ... and the other way round: a tensor config.json needs is missing
    model = _edit_config(_checkpoint(tmp_path / "nobias", "llama"), attention_bias=True)
    with pytest.raises(
        ValueError,
        match=r"nobias: the weights have no tensor 'model.layers.0.self_attn.k_proj.bias', "
        r"which config.json \(llama\) needs",
    ):
        from_pretrained(model)


def test_harmless_mismatches_still_load(tmp_path):
    # a tied model's stored copy of lm_head is redundant, not an error
    _edit_config(_checkpoint(tmp_path / "tied", tie_word_embeddings=False), tie_word_embeddings=True)
    assert from_pretrained(tmp_path / "tied").config.tie_word_embeddings
    # fields transformers ignores for Qwen (no MLP bias; Qwen2's fixed attention biases), a
    # window switched off, a Llama window covering the whole context, bookkeeping fields
    qwen2 = _edit_config(
        _checkpoint(tmp_path / "qwen2", "qwen2"),
        mlp_bias=True,
        attention_bias=True,
        use_sliding_window=False,
        sliding_window=16,
        max_window_layers=1,
    )
    assert from_pretrained(qwen2).config.model_type == "qwen2"
    qwen3 = _edit_config(_checkpoint(tmp_path / "qwen3"), mlp_bias=True, use_sliding_window=True, sliding_window=None)
    assert not from_pretrained(qwen3).config.mlp_bias
    llama = _edit_config(
        _checkpoint(tmp_path / "llama", "llama", max_position_embeddings=64),
        sliding_window=64,
        torch_dtype="float32",
        transformers_version="4.50.0",
        initializer_range=0.02,
        use_cache=True,
        attention_dropout=0.0,
        pretraining_tp=1,
        hidden_act="silu",
        num_experts=0,
    )
    assert from_pretrained(llama).config.max_position_embeddings == 64


# --- 3. config.json: other architectures and settings the decoder would silently ignore ---

UNSUPPORTED = {
    "gpt2": (
        {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
        "unsupported architecture: model_type='gpt2' architectures=['GPT2LMHeadModel']; "
        "allowed model_type: llama, qwen2, qwen3, qwen3_moe",
    ),
    "mixtral-head": (
        {"architectures": ["MixtralForCausalLM"]},
        "architectures = ['MixtralForCausalLM'] is not supported for model_type 'qwen3'; allowed: ['Qwen3ForCausalLM']",
    ),
    "experts": (
        {"num_experts": 8},
        "num_experts = 8 describes mixture-of-experts layers, which a qwen3 decoder does not "
        "have; allowed: absent, null or 0 (qwen3_moe has experts)",
    ),
    "local-experts": (
        {"num_local_experts": 8, "num_experts_per_tok": 2},
        "num_local_experts = 8 describes mixture-of-experts layers",
    ),
    "qwen-window": (
        {"use_sliding_window": True, "sliding_window": 64, "max_position_embeddings": 4096},
        "use_sliding_window = true with sliding_window = 64 (< max_position_embeddings = 4096) asks for "
        "sliding-window attention, which this decoder does not implement; allowed: a window of at least "
        "max_position_embeddings, or none (set use_sliding_window to false)",
    ),
    "llama-window": (
        {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "sliding_window": 4096,
            "max_position_embeddings": 32768,
        },
        "sliding_window = 4096 (< max_position_embeddings = 32768) asks for sliding-window attention, "
        "which this decoder does not implement; allowed: a window of at least max_position_embeddings, "
        "or none (set sliding_window to null if the model was trained with full attention)",
    ),
    "yarn": (
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        "rope_scaling.rope_type = 'yarn' is not implemented; allowed: default, llama3 (or no rope_scaling)",
    ),
    "linear-old-key": (
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
        "rope_scaling.rope_type = 'linear' is not implemented",
    ),
    "yarn-v5": (
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
        "rope_parameters.rope_type = 'yarn' is not implemented; allowed: default, llama3 (or no rope_parameters)",
    ),
    # transformers itself requires low_freq_factor and high_freq_factor (5 fills in the original context)
    "llama3-incomplete": (
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
        "transformers.AutoConfig refuses it: Missing required keys in `rope_",
    ),
    "rope-not-object": ({"rope_scaling": "linear"}, "rope_scaling = 'linear' is invalid; allowed: null or an object"),
    "gelu": ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not implemented; allowed: silu, swish"),
    "no-hidden-size": (
        {"hidden_size": ...},
        "missing field 'hidden_size' (a positive integer); is this the config.json of a Hugging Face model?",
    ),
    "string-size": ({"vocab_size": "61"}, "vocab_size = '61' is invalid; allowed: a positive integer"),
    "heads": ({"num_key_value_heads": 3}, "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
}


@pytest.mark.parametrize("case", UNSUPPORTED, ids=list(UNSUPPORTED))
def test_an_unsupported_config_json_names_file_field_value_and_allowed(tmp_path, case):
    changes, message = UNSUPPORTED[case]
    model = _edit_config(_checkpoint(tmp_path / "m"), **changes)
    with pytest.raises(ValueError) as err:
        from_pretrained(model)
    assert _one_line(err).startswith(f"{model / 'config.json'}: {message}"), str(err.value)


def test_a_config_json_that_is_not_an_object(tmp_path):
    model = _checkpoint(tmp_path / "m")
    (model / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json: expected a JSON object of model settings, found list"):
        from_pretrained(model)


# --- 4. teacher and student with different vocabularies ---


def test_a_vocabulary_mismatch_names_both_tokenizers(tmp_path):
    student = load_tokenizer(save_tokenizer(tmp_path / "student"))  # the built-in character tokenizer
    teacher = load_tokenizer(make_tokenizer(tmp_path / "teacher", ["x", "y"]))  # a word-level one
    with pytest.raises(ValueError) as err:
        check_same_vocabulary(student, teacher)
    message = _one_line(err)
    assert message.startswith(
        f"teacher and student vocabularies differ (student {tmp_path / 'student'}, "
        f"teacher {tmp_path / 'teacher'}): tokenizer sizes differ: student 19, teacher 8; "
    ), message
    assert message.endswith("; pick a teacher and student that share one tokenizer (the same model family)")


def test_models_padded_past_the_tokenizer_share_its_ids_and_no_fewer(tmp_path):
    tokenizer = load_tokenizer(save_tokenizer(tmp_path / "t"))  # the built-in tokenizer: ids 0 .. 18
    assert shared_vocab_size(tokenizer, 32, 32) is None
    assert shared_vocab_size(tokenizer, 32, 40) == 32 and shared_vocab_size(tokenizer, 40, 19) == 19
    with pytest.raises(ValueError) as err:
        shared_vocab_size(tokenizer, 18, 32)
    assert _one_line(err) == (
        "model vocab_size differs (student 18, teacher 32) and the tokenizer's ids reach 18, "
        "past the student's 18 rows: the two models do not have a row for every token; pick a "
        "teacher and student of one family"
    )


# --- 5. config.json is read by transformers.AutoConfig, locally, without remote code ---


def test_config_json_means_what_it_means_to_transformers(tmp_path):
    """A field the file leaves out takes transformers' default for the family (Qwen3's
    context is 32768 positions, not a default of ours), and a legacy key is translated
    (``rope_scaling.type``) as transformers translates it."""
    from transformers import AutoConfig

    qwen3 = _edit_config(_checkpoint(tmp_path / "qwen3"), max_position_embeddings=...)
    want = AutoConfig.from_pretrained(qwen3, local_files_only=True).max_position_embeddings
    assert from_pretrained(qwen3).config.max_position_embeddings == want == 32768
    llama = _edit_config(
        _checkpoint(tmp_path / "llama", "llama"),
        rope_scaling={
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    scaling = from_pretrained(llama).config.rope_scaling
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0 and "rope_theta" not in scaling


def test_loading_runs_no_code_of_the_checkpoint_and_opens_no_connection(tmp_path, monkeypatch):
    """``auto_map`` naming a configuration module in the directory is not imported (no
    remote code), and no socket is opened (nothing is looked up on a hub)."""
    import socket

    model = _edit_config(_checkpoint(tmp_path / "m"), auto_map={"AutoConfig": "configuration_evil.EvilConfig"})
    ran = tmp_path / "ran"
    (model / "configuration_evil.py").write_text(f"open({str(ran)!r}, 'w').write('x')\n")

    def no_network(*args, **kwargs):
        raise AssertionError("loading a local model opened a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    assert from_pretrained(model).config.model_type == "qwen3"
    assert not ran.exists()
