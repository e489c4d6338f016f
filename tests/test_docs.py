"""The examples of docs/estimators.md and README.md run as written and compute what the pages
say, and every relative link in README.md and docs/*.md points to a file (and heading) that
exists."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from asyncopd_jax import estimators as est

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "estimators.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
README_EXAMPLES = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_the_train_step_example_trains_on_the_aggregated_top_k_kl():
    B, T, V, K = 3, 5, 17, 4
    rng = np.random.default_rng(0)
    teacher = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(B, T, V)), jnp.float32))
    topk_logp, topk_ids = jax.lax.top_k(teacher, K)
    batch = {
        "tokens": jnp.asarray(rng.integers(0, V, size=(B, T))),
        "topk_ids": topk_ids,
        "topk_logp": topk_logp,
        "mask": jnp.asarray(np.arange(T)[None] < np.array([5, 2, 4])[:, None]),
    }
    namespace = {"my_model": lambda params, tokens: params["w"][tokens], "optimizer": optax.sgd(0.5)}
    exec(EXAMPLES[0], namespace)
    params = {"w": jnp.zeros((V, V))}
    opt_state = namespace["optimizer"].init(params)
    losses = []
    for _ in range(5):
        params, opt_state, loss = namespace["train_step"](params, opt_state, batch)
        losses.append(float(loss))
    want = est.aggregate(
        est.forward_kl_topk(est.gather_logprobs(jnp.zeros((B, T, V)), topk_ids), topk_logp),
        batch["mask"],
        "seq-mean-token-mean",
    )
    assert losses[0] == pytest.approx(float(want), rel=1e-6)
    assert losses[-1] < losses[0]


def test_the_shard_map_example_gives_every_device_the_whole_batch_loss():
    namespace: dict = {}
    exec(EXAMPLES[1], namespace)
    devices = jax.device_count()
    rows, T = 2 * devices, 6
    rng = np.random.default_rng(1)
    behavior = jnp.asarray(np.log(rng.uniform(0.05, 0.9, size=(rows, T))), jnp.float32)
    student = behavior + jnp.asarray(rng.normal(scale=0.3, size=(rows, T)), jnp.float32)
    advantages = jnp.asarray(rng.normal(size=(rows, T)), jnp.float32)
    mask = jnp.asarray(np.arange(T)[None] < rng.integers(1, T + 1, size=rows)[:, None])
    reference = behavior - 0.1
    got = namespace["loss"](student, behavior, advantages, mask, reference)
    whole = est.m2po_loss(student, behavior, advantages, mask) + 0.01 * est.reference_kl(student, reference, "k3")
    np.testing.assert_allclose(got, est.aggregate(whole, mask), rtol=1e-5)
    kept = est.m2po_mask(student, behavior, mask)
    assert 0 < int(kept.sum()) < int(mask.sum())  # the budget bites: a per-device budget would differ


def test_the_readme_example_is_the_token_mean_of_the_mc_reverse_kl():
    namespace: dict = {}
    exec(README_EXAMPLES[0], namespace)
    B, T, H, V, N = 2, 5, 8, 19, 3
    rng = np.random.default_rng(2)
    hidden = jnp.asarray(rng.normal(size=(B, T, H)), jnp.float32)
    lm_head = jnp.asarray(rng.normal(size=(H, V)), jnp.float32)
    cand_ids = jnp.asarray(rng.integers(0, V, size=(B, T, N)))
    behavior = est.gather_logprobs(jnp.asarray(rng.normal(size=(B, T, V)), jnp.float32), cand_ids)
    teacher = est.gather_logprobs(jnp.asarray(rng.normal(size=(B, T, V)), jnp.float32), cand_ids)
    mask = jnp.asarray(np.arange(T)[None] < np.array([5, 3])[:, None])
    got = namespace["loss_fn"](hidden, lm_head, cand_ids, behavior, teacher, mask, 8.0)
    per_token = est.reverse_kl_mc(est.gather_logprobs(hidden @ lm_head, cand_ids), behavior, teacher)
    want = jnp.sum(jnp.where(mask, per_token, 0.0)) / 8.0
    np.testing.assert_allclose(got, want, rtol=1e-5)


# Relative links in the pages a reader opens: README.md, docs/*.md and the dated logs.
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "log").glob("*.md"))]
# The studies' reports are generated (asyncopd study NAME), each as long as its tables.
STUDY_REPORTS = ROOT / "docs" / "study"
MAX_LINES = 400
_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The page without fenced code blocks and code spans, where brackets are not links."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _anchors(page: Path) -> set[str]:
    """The ids GitHub gives the page's headings: lower case, punctuation dropped (letters of
    any script, digits, `_` and `-` kept), spaces to hyphens, repeats numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    for heading in _HEADING.findall(_FENCE.sub("", page.read_text())):
        text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
        slug = re.sub(r"[^\w\- ]", "", text.replace("`", "").lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def broken_links(page: Path) -> list[str]:
    """Every relative link of ``page`` whose file, or heading in a Markdown file, does not exist."""
    text = _prose(page.read_text())
    broken = []
    for target in _INLINE_LINK.findall(text) + _REFERENCE_LINK.findall(text):
        if not target or re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor} in {resolved.name})")
    return broken


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_no_page_is_longer_than_a_newcomer_reads():
    """README.md and every page under docs/ but the generated study reports: at most
    MAX_LINES lines (the current figures lead; how they moved goes to docs/log/, itself
    in parts)."""
    pages = [ROOT / "README.md", *(p for p in (ROOT / "docs").rglob("*.md") if STUDY_REPORTS not in p.parents)]
    long = {str(p.relative_to(ROOT)): n for p in pages if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_link_check_sees_a_broken_file_a_broken_anchor_and_skips_code(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "there.md").write_text("# A `code` heading: here\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#a-code-heading-here) [ok](there.md#twice-1) "
        "[ok](#own) [web](https://example.com/x.md)\n`[in code](nowhere.md)`\n"
        "```\n[in a block](nowhere.md)\n```\n# Own\n"
        "[gone](missing.md) [bad anchor](there.md#nope)\n[ref]: also-missing.md\n"
    )
    assert broken_links(page) == [
        "page.md: missing.md (no such file)",
        "page.md: there.md#nope (no heading #nope in there.md)",
        "page.md: also-missing.md (no such file)",
    ]
