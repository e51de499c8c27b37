"""tools/mutate.py's mutants apply to the code as it is: each one's original text occurs
exactly once in its file, so that `make mutate` runs every mutant instead of refusing (a
change to the code that a mutant names must update the mutant in the same commit)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import mutate  # noqa: E402


def test_every_mutant_applies_to_the_code():
    assert mutate.check_mutants(mutate.MUTANTS) == []
    ids = [m.id for m in mutate.MUTANTS]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
