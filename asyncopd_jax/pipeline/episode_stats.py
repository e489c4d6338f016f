"""A multi-turn rollout batch's episode figures for ``metrics.jsonl``: turns, tool calls,
tool errors and observation tokens per answer, the environments' seconds and the share of
them the rollout kept decoding through (the rest it waited on tools), and the turns and
calls per answer of each teacher's rows (multi-teacher tool use drifts toward over-calling
in one teacher's rows while the aggregate loss shows nothing: arXiv 2607.07050)."""

from __future__ import annotations

import numpy as np

from asyncopd_jax.pipeline.staleness import RolloutGroup


def turns(response_mask: np.ndarray) -> np.ndarray:
    """``[B]`` the student turns of each trajectory: the runs of its response mask ``[B, T]``."""
    mask = response_mask.astype(np.int8)
    return np.sum(np.diff(mask, axis=1, prepend=0) == 1, axis=1)


def episode_stats(groups: list[RolloutGroup]) -> dict[str, float]:
    """The batch's episode figures (module docstring; none for single-turn groups)."""
    multi = [g for g in groups if g.batch.tool_calls is not None]
    if not multi:
        return {}
    rows = {
        "turns": np.concatenate([turns(np.asarray(g.batch.response_mask, bool)) for g in multi]),
        "tool_calls": np.concatenate([np.asarray(g.batch.tool_calls) for g in multi]),
        "tool_errors": np.concatenate([np.asarray(g.batch.tool_errors) for g in multi]),
        "observation_tokens": np.concatenate([np.asarray(g.batch.environment_mask).sum(axis=1) for g in multi]),
    }
    stats = {f"{what}_per_answer": float(values.mean()) for what, values in rows.items()}
    seconds = float(sum(np.asarray(g.batch.environment_seconds).sum() for g in multi))
    blocked = float(sum(np.asarray(g.batch.environment_blocked_seconds).sum() for g in multi))
    stats["environment_s"] = seconds
    stats["environment_overlapped_s"] = seconds - blocked  # tool time during which the engine decoded
    if seconds > 0:
        stats["environment_overlap"] = 1.0 - blocked / seconds
    by_teacher: dict[str, list[np.ndarray]] = {}
    for g in multi:
        teacher = np.zeros(g.size, np.int32) if g.route is None else np.asarray(g.route.teacher)
        row_turns = turns(np.asarray(g.batch.response_mask, bool))
        for k, name in enumerate(g.teacher_uses):
            mine = teacher == k
            by_teacher.setdefault(name, []).append(np.stack([row_turns[mine], np.asarray(g.batch.tool_calls)[mine]]))
    for name, parts in by_teacher.items():
        both = np.concatenate(parts, axis=1)
        if both.shape[1]:
            stats[f"teacher/{name}/turns_per_answer"] = float(both[0].mean())
            stats[f"teacher/{name}/tool_calls_per_answer"] = float(both[1].mean())
    return stats
