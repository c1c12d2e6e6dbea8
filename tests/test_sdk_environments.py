"""Two environments side by side (issue 27): each process keeps the QNN libraries of its own environment.

Two package folders stand for two virtual environments' `onnxruntime_qnn` (their files link to this venv's, so the
libraries really load); two processes set QNN up at once, each from its own folder, and each checks its link again
after the other has set up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from optimum_qnn.sdk import QnnSdkError
from optimum_qnn.sdk.finding import cache_name, find_package_dir
from tests.conftest import REPO_ROOT, child_env

# Sets QNN up, prints where its libraries are, waits for `go`, then prints where its link points now.
_CHILD = """
import json, os, sys, time
from pathlib import Path
from optimum_qnn.sdk import ensure_qnn_sdk
sdk = ensure_qnn_sdk()
link = Path(os.environ["QNN_SDK_ROOT"]) / "lib" / "x86_64-linux-clang"
print(json.dumps({"root": str(sdk.root), "lib_dir": str(sdk.lib_dir.resolve())}), flush=True)
go = Path(sys.argv[1])
for _ in range(1200):
    if go.exists():
        break
    time.sleep(0.1)
print(json.dumps({"after": str(link.resolve()), "htp": str((link / "libQnnHtp.so").resolve())}), flush=True)
"""


def _environment(site: Path) -> Path:
    """A site folder whose `onnxruntime_qnn/` is a folder of its own holding links to this venv's files."""
    real = find_package_dir("onnxruntime_qnn").resolve()
    package = site / "onnxruntime_qnn"
    package.mkdir(parents=True)
    for f in real.iterdir():
        (package / f.name).symlink_to(f)
    libs = real.parent / "onnxruntime_qnn.libs"  # the wheel's private libc++, found through $ORIGIN/../
    if libs.is_dir():
        (site / libs.name).symlink_to(libs, target_is_directory=True)
    return package


def _start(site: Path, cache: Path, go: Path) -> subprocess.Popen:
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    env["OPTIMUM_QNN_CACHE"] = str(cache)
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(go)], env=env, cwd=REPO_ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _json_line(stream) -> dict:
    """The next line of ours (libraries loading may print lines of their own before it)."""
    for line in stream:
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError("the child ended without its line")


def test_two_environments_set_up_at_once_keep_their_own_libraries(tmp_path):
    cache = tmp_path / "cache"
    packages = [_environment(tmp_path / f"venv{i}" / "site-packages") for i in (1, 2)]
    go = tmp_path / "go"
    first = _start(packages[0].parent, cache, go)
    before_first = _json_line(first.stdout)  # set up, alive, waiting
    second = _start(packages[1].parent, cache, go)
    before_second = _json_line(second.stdout)  # set up while the first one runs
    go.touch()
    after = [_json_line(p.stdout) for p in (first, second)]
    for p in (first, second):
        assert p.wait(timeout=120) == 0, p.stderr.read()[-2000:]
    assert before_first["lib_dir"] == str(packages[0]) and before_second["lib_dir"] == str(packages[1])
    assert before_first["root"] == str(cache / "qnn-sdk" / cache_name("2.5.0", packages[0]))
    assert before_first["root"] != before_second["root"]
    # After the other process set up, each link still points at its own environment.
    assert after[0]["after"] == str(packages[0]) and after[1]["after"] == str(packages[1])
    assert sorted(p.name for p in (cache / "qnn-sdk").iterdir()) == sorted(
        cache_name("2.5.0", p) for p in packages
    )


def test_a_removed_environment_s_link_is_replaced(tmp_path):
    """The root of a deleted environment is removed when another one sets up; re-created at the same path, the
    environment gets a working link again."""
    import shutil

    cache = tmp_path / "cache"
    gone, kept = (_environment(tmp_path / f"venv{i}" / "site-packages") for i in (1, 2))
    go = tmp_path / "go"
    go.touch()
    for package in (gone, kept):
        p = _start(package.parent, cache, go)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    shutil.rmtree(tmp_path / "venv1")
    p = _start(kept.parent, cache, go)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    assert [d.name for d in (cache / "qnn-sdk").iterdir()] == [cache_name("2.5.0", kept)]
    gone = _environment(tmp_path / "venv1" / "site-packages")
    p = _start(gone.parent, cache, go)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    assert json.loads(out.splitlines()[-1])["after"] == str(gone)


def test_cache_links_of_two_environments_are_never_repointed(tmp_path, monkeypatch):
    """Each package folder gets its own root; a root whose folder was deleted is removed, and re-made when a folder
    appears at that path again."""
    from optimum_qnn.sdk.loading import _link_cache_root

    monkeypatch.setenv("OPTIMUM_QNN_CACHE", str(tmp_path / "cache"))
    old, new = tmp_path / "old_venv", tmp_path / "new_venv"
    old.mkdir(), new.mkdir()
    root_old = _link_cache_root(old, cache_name("9.9.9", old))
    root_new = _link_cache_root(new, cache_name("9.9.9", new))
    link_old, link_new = (r / "lib" / "x86_64-linux-clang" for r in (root_old, root_new))
    assert root_old != root_new and root_old.parent == tmp_path / "cache" / "qnn-sdk"
    assert link_old.resolve() == old and link_new.resolve() == new  # the first one was not re-pointed
    assert _link_cache_root(old, cache_name("9.9.9", old)) == root_old and link_old.resolve() == old
    assert [p.name for p in link_old.parent.iterdir()] == ["x86_64-linux-clang"]  # no temporary link left behind
    # A tampered link (pointing at another live folder) is refused with the fix, not silently re-pointed.
    link_new.unlink()
    link_new.symlink_to(old, target_is_directory=True)
    with pytest.raises(QnnSdkError, match="remove"):
        _link_cache_root(new, cache_name("9.9.9", new))
    link_new.unlink()
    assert _link_cache_root(new, cache_name("9.9.9", new)) == root_new and link_new.resolve() == new
    # A deleted environment: its root goes when another one is set up; the same path, re-made, gets its link again.
    old.rmdir()
    third = tmp_path / "third_venv"
    third.mkdir()
    _link_cache_root(third, cache_name("9.9.9", third))
    assert not root_old.exists() and root_new.exists()
    old.mkdir()
    assert _link_cache_root(old, cache_name("9.9.9", old)) == root_old and link_old.resolve() == old
