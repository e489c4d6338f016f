"""The id sets an estimator scores the student on besides the sampled tokens, and where
each comes from.

An estimator's spec (:class:`~asyncopd_jax.estimator_registry.EstimatorSpec`) names the
:class:`~asyncopd_jax.cache.StudentLogProbs` fields it reads (``needs``), keys of
:data:`ID_SOURCES`: the rollout's MC candidates and the student's top-K, the teacher's top-K
and its samples. Each :class:`IdSource` says, by typed reference, which field of a data
contract holds the ids ``[B, T, n]``, which :class:`~asyncopd_jax.cache.TeacherScoreCache`
field holds the teacher's log-probs on them, and which count of the run's config makes the
rollout or scoring stage produce them. The names a message shows are read off the typed
accessors (:class:`ArrayField`, :class:`Setting`), so a rename cannot leave them behind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import jax

from asyncopd_jax.cache import RolloutBatch, TeacherScoreCache

if TYPE_CHECKING:  # the config imports this module
    from asyncopd_jax.config import RunConfig

Array = jax.Array
_O = TypeVar("_O", RolloutBatch, TeacherScoreCache)  # the data contracts an id set is read from


class _AttributePath:
    """Stands in for an object to record the attributes a reader follows (:func:`_attribute_path`)."""

    def __init__(self, names: tuple[str, ...] = ()) -> None:
        self._names = names

    def __getattr__(self, name: str) -> _AttributePath:
        return _AttributePath((*self._names, name))


def _attribute_path(read: Callable[[Any], object]) -> str:
    """The dotted attributes a pure attribute reader follows: ``lambda cfg:
    cfg.sampling.num_candidates`` → ``"sampling.num_candidates"``. The reader is typed (a
    type checker checks its attributes), and the name it is shown by is read off it, so the
    two cannot disagree."""
    path = read(_AttributePath())
    if not isinstance(path, _AttributePath) or not path._names:
        raise TypeError(f"{read!r} must only read attributes (e.g. lambda cfg: cfg.sampling.num_candidates)")
    return ".".join(path._names)


@dataclasses.dataclass(frozen=True)
class ArrayField(Generic[_O]):
    """One optional array field of a data contract (:class:`RolloutBatch`,
    :class:`TeacherScoreCache`), by typed reference: ``read`` is the field's accessor,
    ``str()`` names it (e.g. ``RolloutBatch.candidate_ids``)."""

    owner: type[_O]
    read: Callable[[_O], Array | None]
    name: str = dataclasses.field(init=False)  # read off ``read``

    def __post_init__(self) -> None:
        name = _attribute_path(self.read)
        if name not in {f.name for f in dataclasses.fields(self.owner)}:
            raise TypeError(f"{self.owner.__name__} has no field {name!r}")
        object.__setattr__(self, "name", name)

    def __str__(self) -> str:
        return f"{self.owner.__name__}.{self.name}"

    def read_from(self, *objects: object) -> Array | None:
        """The field of whichever of ``objects`` is an ``owner`` (None: none is, or it holds none)."""
        for obj in objects:
            if isinstance(obj, self.owner):
                return self.read(obj)
        return None


@dataclasses.dataclass(frozen=True)
class Setting:
    """A count of the run's config, by typed reference: ``read(cfg)`` its value, ``name`` (and
    ``str()``) its dotted name, as ``--set`` takes it (``sampling.num_candidates``)."""

    read: Callable[[RunConfig], int]
    name: str = dataclasses.field(init=False)  # read off ``read``

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", _attribute_path(self.read))

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class IdSource:
    """Where the ids of one :class:`StudentLogProbs` field come from.

    Attributes:
      ids: the field holding the ids ``[B, T, n]``, of the rollout or of the teacher's cache
        (``ids.owner``).
      scores: the :class:`TeacherScoreCache` field of the teacher's log-probs on them.
      setting: the run config's count that makes the rollout or scoring stage produce
        them; 0 makes none.
    """

    ids: ArrayField[RolloutBatch] | ArrayField[TeacherScoreCache]
    scores: ArrayField[TeacherScoreCache]
    setting: Setting


ID_SOURCES: dict[str, IdSource] = {
    "candidates": IdSource(
        ArrayField(RolloutBatch, lambda b: b.candidate_ids),
        ArrayField(TeacherScoreCache, lambda c: c.candidate_logp),
        Setting(lambda cfg: cfg.sampling.num_candidates),
    ),
    "student_topk": IdSource(
        ArrayField(RolloutBatch, lambda b: b.student_topk_ids),
        ArrayField(TeacherScoreCache, lambda c: c.student_topk_logp),
        Setting(lambda cfg: cfg.sampling.student_topk),
    ),
    "teacher_topk": IdSource(
        ArrayField(TeacherScoreCache, lambda c: c.topk_ids),
        ArrayField(TeacherScoreCache, lambda c: c.topk_logp),
        Setting(lambda cfg: cfg.scoring.topk),
    ),
    "teacher_samples": IdSource(
        ArrayField(TeacherScoreCache, lambda c: c.sample_ids),
        ArrayField(TeacherScoreCache, lambda c: c.sample_logp),
        Setting(lambda cfg: cfg.scoring.num_samples),
    ),
}
