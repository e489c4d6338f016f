"""A random sample of the mutants of one area, for a score of a module whose mutants are
too many to run them all (docs/testing.md, "Sampled scores of the newer areas").

    python tools/mutation_sample.py K PREFIX [PREFIX ...] [--seed 36]

generates the mutants of ``[tool.mutmut] only_mutate`` (no test runs; a ``mutants/``
directory that exists is reused), takes every mutant whose name starts with one of the
prefixes (``asyncopd_jax.sampling.``, ``asyncopd_jax.pipeline.spool.``, ...), sorts them by
name and prints ``random.Random(seed).sample(names, K)``, one a line, in draw order: any
first k of them are themselves a uniform random sample of size k. Run them with
``bash tools/mutation.sh --resume $(cat sample.txt)``.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
from pathlib import Path


def all_mutants() -> list[str]:
    """Every mutant's name, after generating the mutants as ``mutmut run`` does first."""
    import mutmut.__main__ as mutmut_main
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.utils.file_utils import copy_also_copy_files, copy_src_dir, setup_source_paths, walk_mutatable_files

    Path("mutants").mkdir(exist_ok=True)
    with contextlib.redirect_stdout(sys.stderr):  # mutmut reports each file: keep stdout for the names
        copy_src_dir()
        copy_also_copy_files()
        setup_source_paths()
        mutmut_main.create_mutants(1)
    names: list[str] = []
    for path in walk_mutatable_files():
        data = SourceFileMutationData(path=path)
        data.load()
        names += data.exit_code_by_key
    return sorted(names)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("k", type=int, help="sample size")
    parser.add_argument("prefixes", nargs="+", help="mutant name prefixes of the area")
    parser.add_argument("--seed", type=int, default=36)
    args = parser.parse_args(argv)
    names = [n for n in all_mutants() if n.startswith(tuple(args.prefixes))]
    sample = random.Random(args.seed).sample(names, args.k)
    print(f"{len(names)} mutants, a sample of {len(sample)} (seed {args.seed})", file=sys.stderr)
    print("\n".join(sample))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
