"""prorag.io.atomic_dir: durable, and a replaced directory is never missing, even when the process dies
between the steps; the JSONL journals resumed jobs read keep every whole row."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prorag import io

REPO = Path(__file__).resolve().parents[1]


def write_tree(root: Path, tag: str) -> None:
    (root / "sub").mkdir()
    (root / "a.txt").write_text(f"{tag}-a")
    (root / "sub" / "b.txt").write_text(f"{tag}-b")


def read_tree(root: Path) -> tuple[str, str]:
    return (root / "a.txt").read_text(), (root / "sub" / "b.txt").read_text()


@pytest.fixture
def old_dir(tmp_path):
    dest = tmp_path / "artifact"
    with io.atomic_dir(dest) as tmp:
        write_tree(tmp, "old")
    return dest


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_replacing_fsyncs_the_new_tree_before_it_is_renamed_in_and_the_parent_after(old_dir, monkeypatch, exchange):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", str(a))), real_replace(a, b))[1])
    if not exchange:
        monkeypatch.setattr(io, "_exchange", lambda a, b: False, raising=False)
    with io.atomic_dir(old_dir) as tmp:
        write_tree(tmp, "new")
        tmp_name = str(tmp)
    assert read_tree(old_dir) == ("new-a", "new-b")
    synced = [p for kind, p in events if kind == "fsync"]
    for p in (f"{tmp_name}/a.txt", f"{tmp_name}/sub/b.txt", f"{tmp_name}/sub", tmp_name):
        assert p in synced, (p, events)
    assert str(old_dir.parent) in synced[synced.index(tmp_name):]
    renames = [i for i, (kind, p) in enumerate(events) if kind == "rename" and p == tmp_name]
    assert not renames or events.index(("fsync", tmp_name)) < renames[0]


def test_a_failure_between_the_two_renames_leaves_the_old_copy_in_place(old_dir, monkeypatch):
    monkeypatch.setattr(io, "_exchange", lambda a, b: False, raising=False)  # the fallback where two renames exist
    real_replace, calls = os.replace, []

    def replace_then_fail(a, b):
        calls.append((a, b))
        if len(calls) == 2:
            raise OSError(5, "simulated I/O error")
        return real_replace(a, b)

    monkeypatch.setattr(os, "replace", replace_then_fail)
    with pytest.raises(OSError, match="simulated"):
        with io.atomic_dir(old_dir) as tmp:
            write_tree(tmp, "new")
    monkeypatch.setattr(os, "replace", real_replace)
    assert read_tree(old_dir) == ("old-a", "old-b")
    with io.atomic_dir(old_dir) as tmp:
        write_tree(tmp, "newer")
    assert read_tree(old_dir) == ("newer-a", "newer-b")
    assert sorted(p.name for p in old_dir.parent.iterdir()) == ["artifact"]


CRASH = textwrap.dedent("""
    import os, shutil, sys
    from pathlib import Path
    from prorag import io
    dest, where = Path(sys.argv[1]), sys.argv[2]
    if where == "between-renames":
        io._exchange = lambda a, b: False
        real, n = os.replace, []
        def replace(a, b):
            n.append(1)
            if len(n) == 2:
                os._exit(3)  # the process dies: no finally, no clean-up
            real(a, b)
        os.replace = replace
    else:  # after the swap, while the old copy is being removed
        shutil.rmtree = lambda *a, **k: os._exit(3)
    with io.atomic_dir(dest) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "a.txt").write_text("new-a")
        (tmp / "sub" / "b.txt").write_text("new-b")
""")


@pytest.mark.parametrize("where, expect", [("between-renames", ("old-a", "old-b")), ("after-swap", ("new-a", "new-b"))])
def test_a_process_dying_mid_replacement_leaves_a_complete_copy_and_the_next_call_succeeds(old_dir, where, expect):
    proc = subprocess.run([sys.executable, "-c", CRASH, str(old_dir), where], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 3, proc.stderr
    io.recover_dir(old_dir)  # what a reader that may follow a crash runs first
    assert read_tree(old_dir) == expect
    with io.atomic_dir(old_dir) as tmp:
        write_tree(tmp, "next")
    assert read_tree(old_dir) == ("next-a", "next-b")
    # only the dead process's own temporary tree may be left over, never a second copy of the artifact
    assert not (old_dir.parent / ".artifact.old").exists()


def test_the_next_atomic_dir_call_repairs_a_crash_between_the_renames_by_itself(old_dir):
    # the state a death between the two renames leaves: the old copy aside, nothing at the destination
    os.replace(old_dir, old_dir.parent / ".artifact.old")
    with io.atomic_dir(old_dir) as tmp:
        assert read_tree(old_dir) == ("old-a", "old-b")  # put back before anything else happens
        write_tree(tmp, "new")
    assert read_tree(old_dir) == ("new-a", "new-b")
    assert not (old_dir.parent / ".artifact.old").exists()


def test_a_journal_keeps_every_whole_row_and_skips_the_line_a_kill_tore(tmp_path):
    journal = tmp_path / "journal.jsonl"
    assert list(io.read_jsonl_journal(journal)) == []  # absent: nothing done yet
    io.append_jsonl_synced(journal, {"question_id": "q1", "n": 1})
    io.append_jsonl_synced(journal, {"question_id": "q2", "n": 2})
    with open(journal, "a", encoding="utf-8") as fh:
        fh.write('{"question_id": "q3", "n"')  # a kill in the middle of the third row
    assert list(io.read_jsonl_journal(journal)) == [{"question_id": "q1", "n": 1}, {"question_id": "q2", "n": 2}]
