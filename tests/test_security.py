"""Loading never runs code from a file: no pickle, no remote code, no eval of file contents.

A static check over the package's source: a model, dataset, snapshot or config file from
someone else must not be able to execute code when a run loads it.
"""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "asyncopd_jax"
FORBIDDEN = {
    r"\bimport pickle\b|\bpickle\.": "pickle runs code from the file it loads",
    r"allow_pickle\s*=\s*True": "np.load with pickles runs code from the file",
    r"trust_remote_code\s*=\s*True": "transformers would run a checkpoint's own Python",
    r"\byaml\.load\(|\byaml\.unsafe_load\(": "use yaml.safe_load",
    r"\btorch\.load\(": "torch.load unpickles",
    r"(?<![\w.])eval\(|(?<![\w.])exec\(": "eval / exec of text",
}


def test_no_loader_can_execute_code_from_a_file():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for pattern, why in FORBIDDEN.items():
                if re.search(pattern, code):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()} ({why})")
    assert not found, "\n".join(found)


def test_the_tokenizer_loader_refuses_remote_code_explicitly():
    source = (PACKAGE / "models" / "tokenizer.py").read_text()
    assert "trust_remote_code=False" in source and "local_files_only=True" in source


def test_the_model_config_loader_refuses_remote_code_explicitly():
    source = (PACKAGE / "models" / "config.py").read_text()
    assert "AutoConfig.from_pretrained" in source
    assert "trust_remote_code=False" in source and "local_files_only=True" in source
