"""The reward stage: the task's verifier scores each response; in RL, rewards become advantages.

It runs where the sampling runs (a rollout thread or a rollout process), right after a
group is sampled: a verifier is a string check, cheap next to decoding, so it needs no
process of its own. For reward-driven RL (``algorithm: rl``) every prompt of a group is
answered G times (rows ``g·G … g·G + G − 1`` answer prompt g) and the stage attaches each
response's group-relative advantage to the batch (``RolloutBatch.advantages``), so the
learner needs nothing but the batch — under every schedule and placement, and when
staleness drops a group it drops the advantages computed from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.config import RunConfig
from asyncopd_jax.estimators import group_advantages
from asyncopd_jax.estimators.advantages import StdKind

# (problems, sampled batch) → per-sample reward (1 solved, 0 not, NaN uncheckable)
RewardFn = Callable[[list, RolloutBatch], list]


@dataclasses.dataclass(frozen=True)
class RewardStage:
    """Rewards, and for RL group-relative advantages, of a sampled group.

    Attributes:
      rewards: the task's verifier, ``(problems, batch) → [B]`` rewards.
      samples_per_prompt: G, answers per prompt (1 for distillation).
      advantages: attach ``group_advantages`` of the rewards to the batch (RL).
      normalize_std: GRPO's division by the group's reward std (False: Dr. GRPO).
      std: which std: ``"unbiased"`` (G − 1, the peers') or ``"population"`` (G).
    """

    rewards: RewardFn
    samples_per_prompt: int = 1
    advantages: bool = False
    normalize_std: bool = True
    std: StdKind = "unbiased"

    @classmethod
    def from_config(cls, cfg: RunConfig, rewards: RewardFn) -> RewardStage:
        return cls(
            rewards,
            samples_per_prompt=cfg.samples_per_prompt,
            advantages=cfg.algorithm == "rl",
            normalize_std=cfg.rl.normalize_std,
            std=cfg.rl.advantage_std,
        )

    def prompts_per_group(self, group_size: int) -> int:
        """Distinct prompts in a group of ``group_size`` samples."""
        if group_size % self.samples_per_prompt:
            raise ValueError(
                f"a rollout group of {group_size} samples cannot hold whole groups of "
                f"{self.samples_per_prompt} answers per prompt"
            )
        return group_size // self.samples_per_prompt

    def repeat(self, items: list) -> list:
        """Each item G times in a row: ``[a, b] → [a, a, …, b, b, …]``."""
        return [item for item in items for _ in range(self.samples_per_prompt)]

    def __call__(self, problems: list, batch: RolloutBatch) -> tuple[RolloutBatch, np.ndarray]:
        """``(batch, rewards [B] fp32)``; with ``advantages`` the batch carries them ``[B, T]``."""
        rewards = np.asarray(self.rewards(problems, batch), np.float32)
        if self.advantages:
            advantage = np.asarray(
                group_advantages(rewards, self.samples_per_prompt, normalize_std=self.normalize_std, std=self.std)
            )
            batch = dataclasses.replace(
                batch, advantages=jnp.asarray(np.broadcast_to(advantage[:, None], batch.response_tokens.shape))
            )
        return batch, rewards


__all__ = ["RewardFn", "RewardStage"]
