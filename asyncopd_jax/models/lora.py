"""LoRA adapters on the decoder's projections (Hu et al., 2021):
``y = x W + b + (α / r) · (dropout(x) A) B``, ``A [in, r]``, ``B [r, out]``.

The base weights ``W``, ``b`` stay where a plain projection keeps them (``…q_proj.kernel``),
so checkpoints, the partition rules and every reader of the base are unchanged; the
adapters are ``…q_proj.lora_a`` and ``…q_proj.lora_b``, held as Flax's own
``nnx.LoRAParam`` (a subclass of ``nnx.Param``), which is how the learner tells what it
trains (:func:`split_adapters`) and how a snapshot ships only them.

Beside the adapters, ``student.lora.modules_to_save`` names modules trained whole (PEFT's
``modules_to_save``: the embedding, the norms): their weights stay where they are, retyped
:class:`WholeParam`, so they train, ship with every version and export as PEFT saves them.
A small student needs them: the built-in student's frozen embedding and norms held rank 16
and rank 64 alike at ~90 % of the teacher (docs/lora.md).

Why our module and not ``nnx.LoRALinear`` or qwix: ``nnx.LoRA`` computes ``x A B`` with
neither the α / r scale nor dropout, which PEFT (and every recipe quoting a rank and an
alpha) assumes, and nests its adapters one module deeper (``…q_proj.lora.lora_a``); qwix
intercepts the model's operations at call time by module path, a second dependency whose
adapters lie outside our one table of partition rules. The low-rank path is one line; the
variable type is Flax's.

``B`` starts at zero (both inits), so a model with fresh adapters computes exactly what its
base does: training starts from the base student.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterator
from typing import Any, Literal, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from asyncopd_jax.config_checks import ConfigError, check_fields
from asyncopd_jax.models.shape_keys import shape_keys

Array = jax.Array
M = TypeVar("M", bound=nnx.Module)

#: The projections an adapter may sit on (PEFT's ``target_modules`` names for Qwen / Llama).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoRAParams:
    """``student.lora``: rank 0 trains the whole student (no adapters).

    Attributes:
      rank: r, the adapters' inner width.
      alpha: α; the adapters' output is scaled by α / r (PEFT's ``lora_alpha``).
      dropout: the probability an input feature is dropped on the adapter's path (the
        learner's forward only: sampling, π_prox and evaluation run without it).
      targets: regular expressions, each matched in full against a projection's name
        (``q_proj``) or its whole path (``layers.3.self_attn.q_proj``); a pattern that matches
        no projection is an error (the default, every projection the model has: a mixture of
        experts' attention).
      init: ``A``'s initialisation: ``kaiming`` (uniform in ±1 / √in, PEFT's default) or
        ``gaussian`` (normal, standard deviation 1 / r); ``B`` starts at zero either way.
      sampler: how the rollout stages apply each version's adapters: ``merged`` into the
        base weights once, at the swap (then decoding a plain model), or ``unmerged``, as
        two thin products per projection in every decode step
        (:mod:`~asyncopd_jax.pipeline.adapter_snapshots`; docs/lora.md measures both).
      modules_to_save: regular expressions, each matched in full against a module's name
        (``norm``, ``embed_tokens``) or its whole path (``layers.0.input_layernorm``), whose
        weights are trained whole beside the adapters (PEFT's ``modules_to_save``); a pattern
        matching no module, or a module holding an adapter, is an error. A tied head trains
        with its embedding.
      loraplus_lr_ratio: λ of LoRA+ (Hayou et al., 2024; the name of PEFT's
        ``create_loraplus_optimizer`` argument): ``B`` learns at λ × the learning rate, ``A`` and the
        modules trained whole at the rate itself (1: plain LoRA;
        :func:`~asyncopd_jax.learner.optimizer.make_optimizer`).
    """

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = PROJECTIONS
    init: Literal["kaiming", "gaussian"] = "kaiming"
    sampler: Literal["merged", "unmerged"] = "merged"
    modules_to_save: tuple[str, ...] = ()
    loraplus_lr_ratio: float = 1.0

    def __post_init__(self) -> None:
        check_fields(
            "student.lora",
            [
                ("rank", self.rank, self.rank >= 0, ">= 0 (0: no adapters)"),
                ("alpha", self.alpha, self.alpha > 0, "> 0"),
                ("dropout", self.dropout, 0 <= self.dropout < 1, "in [0, 1)"),
                ("targets", self.targets, bool(self.targets), "at least one pattern"),
                ("loraplus_lr_ratio", self.loraplus_lr_ratio, self.loraplus_lr_ratio > 0, "> 0"),
            ],
        )
        given_fields = {"modules_to_save": bool(self.modules_to_save), "loraplus_lr_ratio": self.loraplus_lr_ratio != 1}
        for field, given in given_fields.items():
            if given and not self.enabled:
                raise ConfigError(
                    f"student.lora.{field}: set with rank 0, which trains the whole student without adapters; "
                    f"give student.lora.rank > 0 or drop {field}"
                )
        patterns = [("targets", p) for p in self.targets] + [("modules_to_save", p) for p in self.modules_to_save]
        for field, pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ConfigError(f"student.lora.{field}: {pattern!r} is not a regular expression ({err})") from None

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def merged_at_swap(self) -> bool:
        """Whether the rollout stages fold the adapters into the base at each swap (and
        decode a plain model) rather than decode them unmerged."""
        return self.enabled and self.sampler == "merged"

    @property
    def scale(self) -> float:
        """α / r, the factor on the adapters' output."""
        return self.alpha / self.rank


NO_ADAPTERS = LoRAParams()  # rank 0: the whole model is trained


class WholeParam(nnx.Param):
    """A weight of a LoRA student trained whole beside its adapters (a module of
    ``student.lora.modules_to_save``): a ``Param`` still, so every reader of the model's
    weights sees it as one, told apart only where the trained set is chosen."""


#: The variables a LoRA student's learner trains and each version ships: :func:`split_adapters`.
TRAINED = nnx.Any(nnx.LoRAParam, WholeParam)


class LoRALinear(nnx.Module):
    """A projection with an adapter: ``y = x W + b + scale · (dropout(x) A) B``.

    ``kernel [in, out]`` and ``bias [out]`` are the base projection's own variables (the
    same objects, not copies); ``lora_a [in, r]``, ``lora_b [r, out]`` the adapter's.
    """

    # The key of this forward's dropout (None: no dropout), set by :func:`with_dropout` on a
    # model merged inside the learner's traced loss; never part of the model's state.
    dropout_key: Array | None = None

    def __init__(self, base: nnx.Linear, params: LoRAParams, rngs: nnx.Rngs):
        self.kernel = base.kernel
        self.bias = base.bias
        fan_in, fan_out = base.kernel.shape
        # fp32 over any base (PEFT's autocast_adapter_dtype does the same): the adapters are
        # what the learner trains, and AdamW's steps on bf16 weights round away; the frozen
        # base may be bf16 (no master copy needed, half the bytes)
        dtype = jnp.promote_types(base.kernel[...].dtype, jnp.float32)
        if params.init == "kaiming":
            bound = 1 / math.sqrt(fan_in)
            a = jax.random.uniform(rngs.params(), (fan_in, params.rank), dtype, -bound, bound)
        else:
            a = jax.random.normal(rngs.params(), (fan_in, params.rank), dtype) / params.rank
        self.lora_a = nnx.LoRAParam(a)
        self.lora_b = nnx.LoRAParam(jnp.zeros((params.rank, fan_out), dtype))
        self.scale = params.scale
        self.dropout = params.dropout

    def __call__(self, x: Array) -> Array:
        """``x [..., in]`` → ``[..., out]``, in the dtype of the weights (mixed precision casts
        them; fp32 adapters over a bf16 base compute in the base's dtype)."""
        kernel = self.kernel[...]
        y = jnp.dot(x, kernel)
        if self.bias is not None:
            y = y + self.bias[...]
        if self.dropout and self.dropout_key is not None:
            keep = jax.random.bernoulli(self.dropout_key, 1 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1 - self.dropout), 0).astype(x.dtype)
        a, b = self.lora_a[...].astype(kernel.dtype), self.lora_b[...].astype(kernel.dtype)
        return y + (self.scale * jnp.dot(jnp.dot(x, a), b)).astype(y.dtype)


def _paths(model: nnx.Module) -> Iterator[tuple[str, nnx.Module, str, nnx.Module]]:
    """``(dotted path, parent, attribute, module)`` for every submodule of ``model``."""
    for path, module in nnx.iter_graph(model):
        if not isinstance(module, nnx.Module) or not path:
            continue
        parent: Any = model
        for key in path[:-1]:
            parent = parent[key] if isinstance(key, int) else getattr(parent, str(key))
        yield ".".join(str(k) for k in path), parent, str(path[-1]), module


def _matches(patterns: tuple[str, ...], path: str) -> list[str]:
    """The patterns that match a module's dotted ``path`` or its name in full."""
    name = path.rsplit(".", 1)[-1]
    return [p for p in patterns if re.fullmatch(p, name) or re.fullmatch(p, path)]


def add_adapters(model: M, params: LoRAParams, rngs: nnx.Rngs) -> M:
    """``model`` with an adapter on every projection ``params.targets`` names (in place; the
    model is returned), and the weights of the modules ``params.modules_to_save`` names
    retyped :class:`WholeParam`. Only the attention and MLP projections of
    :data:`PROJECTIONS` take adapters: a pattern matching anything else (a mixture's
    experts or router, the LM head), or nothing at all, is an error naming it."""
    if not params.enabled:
        return model
    matched = {pattern: False for pattern in params.targets}
    chosen = []
    for path, parent, attribute, module in list(_paths(model)):
        name = path.rsplit(".", 1)[-1]
        hits = _matches(params.targets, path)
        if not hits:
            continue
        if name not in PROJECTIONS or not isinstance(module, nnx.Linear):
            raise ValueError(
                f"student.lora.targets: {hits[0]!r} matches {path}, which cannot take an adapter; "
                f"allowed: the attention and MLP projections ({', '.join(PROJECTIONS)}) of dense layers"
            )
        matched.update(dict.fromkeys(hits, True))
        chosen.append((parent, attribute, module))
    missing = [p for p, hit in matched.items() if not hit]
    if missing and params.targets != PROJECTIONS:  # the default: whichever projections the model has
        raise ValueError(f"student.lora.targets: {missing[0]!r} matches no projection of the student")
    for parent, attribute, module in chosen:
        setattr(parent, attribute, LoRALinear(module, params, rngs))
    _train_whole(model, params.modules_to_save)
    return model


def _train_whole(model: nnx.Module, patterns: tuple[str, ...]) -> None:
    """Retype every ``Param`` of the modules ``patterns`` name, and of their submodules, as
    :class:`WholeParam` (in place; metadata kept); an error names a pattern matching nothing
    or a module that holds an adapter."""
    matched = dict.fromkeys(patterns, False)
    for path, _, _, module in list(_paths(model)):
        hits = _matches(patterns, path)
        if not hits:
            continue
        if adapters(module) or isinstance(module, LoRALinear):
            raise ValueError(
                f"student.lora.modules_to_save: {hits[0]!r} matches {path}, which holds an adapter; "
                "name the modules to train whole (the embedding, the norms), not an adapted projection or its parents"
            )
        matched.update(dict.fromkeys(hits, True))
        for owner in [module, *(inner for _, _, _, inner in _paths(module))]:  # its submodules' weights too
            for attribute, variable in list(vars(owner).items()):
                if type(variable) is nnx.Param:  # not a subtype: an adapter, or retyped already
                    setattr(owner, attribute, WholeParam(variable[...], **variable.get_metadata()))
    missing = [p for p, hit in matched.items() if not hit]
    if missing:
        raise ValueError(f"student.lora.modules_to_save: {missing[0]!r} matches no module of the student")


def adapters(model: nnx.Module) -> list[tuple[str, LoRALinear]]:
    """The model's adapted projections with their dotted paths, in the model's order."""
    return [(path, module) for path, _, _, module in _paths(model) if isinstance(module, LoRALinear)]


def projections(model: nnx.Module) -> list[str]:
    """The dotted paths of the projections that can take an adapter (those of
    :data:`PROJECTIONS` in dense layers), adapted or not."""
    kinds = (nnx.Linear, LoRALinear)
    return [p for p, _, _, m in _paths(model) if p.rsplit(".", 1)[-1] in PROJECTIONS and isinstance(m, kinds)]


def has_adapters(state: nnx.State) -> bool:
    """Whether a model state holds adapters (``nnx.LoRAParam`` variables; any other tree: no)."""
    return isinstance(state, nnx.State) and bool(jax.tree_util.tree_leaves(nnx.filter_state(state, nnx.LoRAParam)))


def split_adapters(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """``(trained, frozen)``: with adapters, the adapters and the weights trained whole
    (:data:`TRAINED`) and everything else; without, the whole state and an empty one (a
    student without adapters trains all its weights)."""
    if has_adapters(state):
        trained, frozen = nnx.split_state(state, TRAINED, ...)
        return trained, frozen
    return state, nnx.State({})


def without_adapters(state: nnx.State) -> nnx.State:
    """``state`` without its adapters' variables: the structure of its merged state
    (:func:`merged_state`), weights trained whole included."""
    return nnx.split_state(state, nnx.LoRAParam, ...)[1] if has_adapters(state) else state


def join(trained: nnx.State, frozen: nnx.State) -> nnx.State:
    """The whole state again from :func:`split_adapters`' two parts."""
    return nnx.merge_state(trained, frozen)


def with_dropout(model: M, key: Array | None) -> M:
    """``model`` (merged inside a traced function) with this forward's dropout keys, one per
    adapter (``key`` None: none); a model without adapters or dropout is unchanged."""
    if key is None:
        return model
    for i, (_, module) in enumerate(adapters(model)):
        if module.dropout:
            module.dropout_key = jax.random.fold_in(key, i)
    return model


def _adapted(state: nnx.State) -> tuple[nnx.State, dict[tuple, tuple[Any, Any]]]:
    """``(rest, {path of an adapted kernel: (its lora_a, its lora_b)})`` of ``state``: every
    variable but the adapters and, for each kernel that has an adapter, the adapter's two
    variables."""
    pieces = dict(nnx.to_flat_state(nnx.filter_state(state, nnx.LoRAParam))) if has_adapters(state) else {}
    pairs = {
        (*path[:-1], "kernel"): (a, pieces[(*path[:-1], "lora_b")])
        for path, a in pieces.items()
        if path[-1] == "lora_a"
    }
    return without_adapters(state), pairs


def adapted_kernels(state: nnx.State) -> nnx.State:
    """The base kernels of ``state``'s adapted projections: what a merge rewrites (arrays or
    shapes)."""
    frozen, pairs = _adapted(state)
    return nnx.from_flat_state([(p, v) for p, v in nnx.to_flat_state(frozen) if p in pairs])


def merged_kernel(kernel: Array, a: Array, b: Array, scale: float) -> Array:
    """``W + scale · A B`` (``kernel [in, out]``, ``a [in, r]``, ``b [r, out]``), computed in
    fp32 and cast to ``W``'s dtype."""
    f32 = jnp.float32
    return (kernel.astype(f32) + scale * (a.astype(f32) @ b.astype(f32))).astype(kernel.dtype)


def merged_state(state: nnx.State, scale: float) -> nnx.State:
    """The state of the merged model (:func:`merge_adapters`) from a LoRA model's state:
    each adapted ``kernel`` replaced by :func:`merged_kernel`, the adapters dropped, weights
    trained whole (:class:`WholeParam`) as they are. A pure
    function of its arrays (jit it: a sampler merging at every swap), always from the base
    ``W``: merging version after version never accumulates. A state without adapters is
    returned as it is."""
    if not has_adapters(state):
        return state
    frozen, pairs = _adapted(state)
    flat = []
    for path, variable in nnx.to_flat_state(frozen):
        if path in pairs:
            a, b = pairs[path]
            variable = variable.replace(merged_kernel(variable[...], a[...], b[...], scale))
        flat.append((path, variable))
    return nnx.from_flat_state(flat)


def merge_adapters(model: M) -> M:
    """A copy of ``model`` with each adapter folded into its base (:func:`merged_kernel`)
    and replaced by a plain projection: the merged student, as a checkpoint holds it
    (``model`` is left as it was; the copy shares its other arrays)."""
    found = adapters(model)
    if not found:
        return model
    merged = merged_state(nnx.state(model), found[0][1].scale)  # one LoRAParams: one scale
    model = nnx.clone(model)
    for _, parent, attribute, module in list(_paths(model)):
        if isinstance(module, LoRALinear):
            setattr(parent, attribute, _plain_like(module))
    nnx.update(model, merged)
    return model


def _plain_like(module: LoRALinear) -> nnx.Linear:
    """A plain projection of ``module``'s shape (its weights set by the caller)."""
    shape = module.kernel.shape
    make = functools.partial(nnx.Linear, *shape, use_bias=module.bias is not None, dtype=None)
    plain = nnx.eval_shape(lambda: make(rngs=shape_keys()))
    plain.kernel = nnx.Param(module.kernel[...])
    plain.bias = module.bias
    return plain


__all__ = [
    "NO_ADAPTERS",
    "PROJECTIONS",
    "TRAINED",
    "LoRALinear",
    "LoRAParams",
    "WholeParam",
    "adapted_kernels",
    "add_adapters",
    "adapters",
    "has_adapters",
    "join",
    "merge_adapters",
    "merged_kernel",
    "merged_state",
    "projections",
    "split_adapters",
    "with_dropout",
    "without_adapters",
]
