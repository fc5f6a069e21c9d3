"""`make test` runs the suite on two pytest-xdist workers with `--dist loadgroup`, and tests/conftest.py marks every
module whose tests share a module-scoped fixture (a server, a trained model) with one xdist_group, so the fixture is
set up once. pytest 9.2 broke that grouping silently (pytest-xdist issue #1386; pyproject.toml pins below it): this
runs a small grouped module on two workers, as `make test` does, and checks the group stayed on one worker."""

from __future__ import annotations

import json
import subprocess
import sys


def test_loadgroup_keeps_a_groups_tests_on_one_worker(tmp_path):
    (tmp_path / "test_grouped.py").write_text('''
import json, os, pytest

def _note(name):
    with open(os.path.join(os.path.dirname(__file__), name + ".json"), "w") as f:
        json.dump(os.environ.get("PYTEST_XDIST_WORKER"), f)

@pytest.mark.xdist_group("shared")
@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    _note(f"grouped{i}")

@pytest.mark.parametrize("i", range(6))
def test_free(i):
    _note(f"free{i}")
''')
    got = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p",
                          "no:cacheprovider", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == 0, got.stdout + got.stderr
    grouped = {json.loads((tmp_path / f"grouped{i}.json").read_text()) for i in range(6)}
    free = {json.loads((tmp_path / f"free{i}.json").read_text()) for i in range(6)}
    assert len(grouped) == 1 and None not in grouped, grouped
    assert free <= {"gw0", "gw1"}  # the others ran under xdist too
