"""scripts/mutation_check.py, cheaply: every mutant's edit still finds its text exactly once in the code
(CI runs the check itself, each mutant against its tests), names are unique, and the CLI refuses an
unknown name. A refactor that moves a mutant's text fails here, in the normal suite, first."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "mutation_check.py"


def load():
    spec = importlib.util.spec_from_file_location("mutation_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up while creating the class
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("mutant", load().MUTANTS, ids=lambda m: m.name)
def test_each_mutant_edits_code_that_exists(mutant):
    text = (ROOT / mutant.path).read_text()
    assert text.count(mutant.old) == 1, f"{mutant.name}: its text is in {mutant.path} {text.count(mutant.old)} times"
    assert mutant.new != mutant.old and mutant.tests
    for arg in mutant.tests:
        if arg.startswith("tests/"):
            assert (ROOT / arg.split("::")[0]).is_file(), f"{mutant.name}: no test file {arg}"


def test_names_are_unique_and_the_cli_checks_them():
    names = [m.name for m in load().MUTANTS]
    assert len(names) == len(set(names)) >= 15
    listed = []
    for group in ("core", "sglang", "vllm"):  # --group picks the mutants a run takes; the groups cover them all
        out = subprocess.run([sys.executable, str(SCRIPT), "--list", "--group", group], capture_output=True, text=True,
                             check=True)  # fmt: skip
        listed += [line.split()[0] for line in out.stdout.splitlines()]
        assert {m.group for m in load().MUTANTS if m.name in listed[-1:]} == {group}
    assert sorted(listed) == sorted(names)
    bad = subprocess.run([sys.executable, str(SCRIPT), "--only", "no-such-mutant"], capture_output=True, text=True)
    assert bad.returncode == 2 and "no mutant named no-such-mutant" in bad.stderr
