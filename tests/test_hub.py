"""Publishing to and loading from the Hub, against a real Hub-protocol server (olah) on 127.0.0.1.

olah serves git repositories from its ``mirrors-path`` (``<mirrors>/models/<org>/<name>``, any branch, tag or
commit as revision) with ``offline = true`` so it never contacts huggingface.co. The repositories are built here
from a real two-SoC export. Clients run in fresh processes, so ``HF_ENDPOINT`` / ``HF_HUB_OFFLINE`` / ``HF_HOME``
take effect before huggingface_hub is imported, and every cache is a tmp folder.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from optimum_qnn.artifacts.writer import INDEX_NAME

# The repositories olah serves are git repositories built here (README: `make test` needs git).
pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="the Hub tests build git repositories: install git")

ORG = "optimum-qnn-test"
REPO = f"{ORG}/gemma4-tiny-qnn"
PUSHED_REPO = f"{ORG}/gemma4-tiny-pushed"
SOURCE_REPO = f"{ORG}/gemma4-tiny-source"  # the random model's checkpoint, exported by Hub id
PROMPT = [2, 5, 7, 11]
V8650 = "qnn/sm8650/fp16-ctx32-kv"
V8750 = "qnn/sm8750/fp16-ctx32-kv"
NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


# --- the artifact and the server ------------------------------------------------------------------------------


def _keep_variants(folder: Path, keep: set[str]) -> None:
    """Delete every variant of ``folder`` but ``keep`` and list only those in its index."""
    from optimum_qnn.artifacts.writer import atomic_write_text, read_index

    index = read_index(folder)
    for v in index["variants"]:
        if v["path"] not in keep:
            shutil.rmtree(folder / v["path"])
    index["variants"] = [v for v in index["variants"] if v["path"] in keep]
    atomic_write_text(folder / INDEX_NAME, json.dumps(index, indent=2) + "\n")


@pytest.fixture(scope="module")
def artifacts(random_kv_export, tmp_path_factory):
    """The session's export of the random model (shared with test_export): ``v1`` holds its SM8650 variant only,
    ``full`` SM8650 and SM8750."""
    from optimum_qnn.artifacts.model_card import write_model_card

    base = tmp_path_factory.mktemp("hub-artifacts")
    full, v1 = base / "full", base / "v1"
    shutil.copytree(random_kv_export.output, full)
    _keep_variants(full, {V8650, V8750})
    write_model_card(full)
    shutil.copytree(full, v1)
    _keep_variants(v1, {V8650})
    write_model_card(v1)
    return {"v1": v1, "full": full}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env={**os.environ, **GIT_ENV}
    ).stdout.strip()


def _commit_tree(repo: Path, source: Path, message: str) -> str:
    """Make the work tree of ``repo`` equal to ``source`` (minus dotfiles) and commit it; returns the sha."""
    for child in repo.iterdir():
        if child.name != ".git":
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    shutil.copytree(source, repo, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".*"))
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def hub(artifacts, random_model_dir, tmp_path_factory):
    """olah on 127.0.0.1 serving ``REPO``: tag ``v1`` (SM8650 only), ``main`` (both SoCs), branch ``tampered``
    (main with one byte of the SM8750 model.pte flipped), branch ``tampered-config`` (main with another
    config.json); and ``SOURCE_REPO``: the random checkpoint plus a pickle file the exporter must not download."""
    base = tmp_path_factory.mktemp("olah")
    mirrors = base / "mirrors"
    repo = mirrors / "models" / REPO
    repo.mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    v1_sha = _commit_tree(repo, artifacts["v1"], "v1: SM8650")
    _git(repo, "tag", "v1")
    main_sha = _commit_tree(repo, artifacts["full"], "v2: SM8650 + SM8750")
    _git(repo, "switch", "-q", "-c", "tampered")
    pte = repo / V8750 / "model.pte"
    data = bytearray(pte.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pte.write_bytes(bytes(data))
    _git(repo, "commit", "-q", "-am", "tamper")
    _git(repo, "switch", "-q", "main")
    _git(repo, "switch", "-q", "-c", "tampered-config")
    (repo / "config.json").write_text((repo / "config.json").read_text().replace("{", '{"edited": true, ', 1))
    _git(repo, "commit", "-q", "-am", "tamper the config")
    _git(repo, "switch", "-q", "main")

    source = mirrors / "models" / SOURCE_REPO
    source.mkdir(parents=True)
    _git(source, "init", "-q", "-b", "main")
    shutil.copytree(random_model_dir, source, dirs_exist_ok=True)
    (source / "pytorch_model.bin").write_bytes(b"not to be downloaded")
    _git(source, "add", "-A")
    _git(source, "commit", "-q", "-m", "random Gemma4")

    port = _free_port()
    olah_config = base / "olah.toml"
    olah_config.write_text(
        "[basic]\n"
        f'host = "127.0.0.1"\nport = {port}\n'
        f'repos-path = "{base / "cache"}"\nmirrors-path = ["{mirrors}"]\n'
        # Upstream points at a closed loopback port: nothing can leave this machine.
        'hf-scheme = "http"\nhf-netloc = "127.0.0.1:9"\nhf-lfs-netloc = "127.0.0.1:9"\n'
        f'mirror-netloc = "127.0.0.1:{port}"\nmirror-lfs-netloc = "127.0.0.1:{port}"\n'
        "[accessibility]\noffline = true\n"
    )
    with open(base / "olah.out", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "olah.server", "--config", str(olah_config), "--log-path", str(base / "logs")],
            stdout=log, stderr=subprocess.STDOUT, cwd=base,
        )
        endpoint = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    with NO_PROXY_OPENER.open(f"{endpoint}/api/models/{REPO}/revision/main", timeout=2) as r:
                        assert json.load(r)["sha"] == main_sha
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"olah did not start:\n{(base / 'olah.out').read_text()}") from None
                    time.sleep(0.3)
            yield {"endpoint": endpoint, "mirrors": mirrors, "repo": repo, "v1_sha": v1_sha, "main_sha": main_sha}
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def hub_env(hub, hf_home: Path, *, offline: bool = False) -> dict[str, str]:
    """The environment of a child process that talks to ``hub`` (or, offline, to nothing) with cache ``hf_home``."""
    return {
        **{k: os.environ[k] for k in ("QNN_SDK_ROOT", "OPTIMUM_QNN_CACHE") if k in os.environ},
        "HF_HOME": str(hf_home),
        "HF_HUB_CACHE": str(hf_home / "hub"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
        "HF_TOKEN": "",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        # Offline runs get a dead endpoint too: a network request would fail loudly rather than succeed.
        "HF_ENDPOINT": "http://127.0.0.1:9" if offline else hub["endpoint"],
        "HF_HUB_OFFLINE": "1" if offline else "0",
    }


@pytest.fixture(scope="module")
def client(hub, run_python):
    """``client(actions, hf_home, offline=False)``: run the actions in a fresh process; returns their results."""
    script = Path(__file__).with_name("hub_client.py")

    def run(actions: list[dict], hf_home: Path, *, offline: bool = False) -> list[dict]:
        proc = run_python(str(script), json.dumps(actions), env=hub_env(hub, hf_home, offline=offline), timeout=600)
        results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        assert len(results) == len(actions), proc.stdout + proc.stderr
        return results

    return run


@pytest.fixture(scope="module")
def local_tokens(artifacts, qnn_sdk):
    """Greedy tokens of each SoC's variant, loaded from the local folder (the reference for Hub loads)."""
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    out = {}
    for soc in ("SM8650", "SM8750"):
        model = QNNModelForCausalLM.from_pretrained(artifacts["full"], soc=soc)
        out[soc] = model.generate(PROMPT, max_new_tokens=4).reshape(-1).tolist()
    return out


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf-home-shared")


def _root_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))


def _variant_files(folder: Path, variant: str) -> list[str]:
    return sorted(f"{variant}/{p.name}" for p in (folder / variant).iterdir())


# --- loading ------------------------------------------------------------------------------------------------


def test_download_only_the_chosen_variant_and_generate(client, artifacts, hub, shared_cache, local_tokens):
    (res,) = client([{"kind": "load", "repo": REPO, "soc": "SM8750", "revision": "main", "prompt": PROMPT}], shared_cache)
    assert "error" not in res, res
    full = artifacts["full"]
    expected = sorted([*_root_files(full), *_variant_files(full, V8750)])
    expected.remove("README.md")  # the card is not needed to run
    assert res["files"] == expected
    assert not any(f.startswith("qnn/sm8650") for f in res["files"])
    assert Path(res["root"]).name == hub["main_sha"]
    assert res["name"] == REPO.split("/")[1]  # what serve and chat call it: the repo's name, not the snapshot's sha
    for name in res["files"]:
        assert (Path(res["root"]) / name).read_bytes() == (full / name).read_bytes(), name
    assert res["soc"] == "SM8750"
    assert res["tokens"][: len(PROMPT)] == PROMPT and len(res["tokens"]) == len(PROMPT) + 4
    assert res["tokens"] == local_tokens["SM8750"]


def test_offline_reload_from_cache(client, shared_cache, local_tokens, tmp_path):
    # Needs the cache filled by the test above (same module-scoped HF_HOME); fill it here if run alone.
    if not (shared_cache / "hub").exists():
        client([{"kind": "load", "repo": REPO, "soc": "SM8750", "revision": "main", "prompt": PROMPT}], shared_cache)
    ok, missing, empty = client(
        [
            {"kind": "load", "repo": REPO, "soc": "SM8750", "revision": "main", "prompt": PROMPT},
            {"kind": "load", "repo": REPO, "soc": "SM8650", "revision": "main", "prompt": PROMPT},
            {"kind": "load", "repo": f"{ORG}/never-downloaded", "soc": "SM8750", "revision": "main", "prompt": PROMPT},
        ],
        shared_cache,
        offline=True,
    )
    assert "error" not in ok, ok
    assert ok["tokens"] == local_tokens["SM8750"]
    # A variant never downloaded is not in the cache: a clear error, not a half-empty folder.
    assert missing["error"] == "HubError" and "cache" in missing["message"], missing
    assert empty["error"] == "HubError" and "cache" in empty["message"] and "never-downloaded" in empty["message"], empty


def test_revision_pinning(client, artifacts, hub, tmp_path):
    old, old_by_sha, old_8750 = client(
        [
            {"kind": "load", "repo": REPO, "soc": "SM8650", "revision": "v1", "prompt": PROMPT},
            {"kind": "load", "repo": REPO, "soc": "SM8650", "revision": hub["v1_sha"], "prompt": PROMPT},
            {"kind": "load", "repo": REPO, "soc": "SM8750", "revision": "v1", "prompt": PROMPT},
        ],
        tmp_path / "hf",
    )
    assert "error" not in old, old
    assert Path(old["root"]).name == hub["v1_sha"] == Path(old_by_sha["root"]).name
    index = Path(old["root"]) / INDEX_NAME
    assert index.read_bytes() == (artifacts["v1"] / INDEX_NAME).read_bytes()
    assert index.read_bytes() != (artifacts["full"] / INDEX_NAME).read_bytes()
    assert [v["soc"] for v in json.loads(index.read_text())["variants"]] == ["SM8650"]
    # SM8750 was added after v1: the pinned revision does not have it, and the error lists what it has.
    assert old_8750["error"] == "VariantNotFoundError", old_8750
    assert "SM8650/fp16/ctx32/kv" in old_8750["message"] and "SM8750/" not in old_8750["message"]


def test_run_command_takes_a_repo_and_its_revision(hub, run_python, local_tokens, tmp_path):
    """`python -m optimum_qnn run REPO --revision v1`: the command downloads the pinned revision and generates what
    the local folder does; a SoC the revision does not have is refused with the variants it has."""

    def run(soc: str):
        return run_python("-m", "optimum_qnn", "run", REPO, "--revision", "v1", "--soc", soc, "--prompt-ids",
                          ",".join(map(str, PROMPT)), "--max-new-tokens", "4", env=hub_env(hub, tmp_path / "hf"), timeout=600)

    proc = run("SM8650")
    assert proc.returncode == 0, proc.stderr[-3000:]
    new_ids, stats = proc.stdout.splitlines()[-2:]  # the tiny model has no tokenizer: the new ids are printed
    assert new_ids == ",".join(map(str, local_tokens["SM8650"][len(PROMPT):])), (new_ids, local_tokens)
    assert stats.startswith(f"[{len(PROMPT)} prompt + 4 new tokens"), proc.stdout
    (snapshot,) = (tmp_path / "hf" / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots").iterdir()
    assert snapshot.name == hub["v1_sha"]
    proc = run("SM8750")
    assert proc.returncode == 2 and "No variant for soc=SM8750" in proc.stderr and "SM8650/fp16/ctx32/kv" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_tampered_file_in_served_repo_fails_sha256(client, tmp_path):
    (res,) = client([{"kind": "load", "repo": REPO, "soc": "SM8750", "revision": "tampered", "prompt": PROMPT}], tmp_path / "hf")
    assert res["error"] == "ManifestError", res
    assert "model.pte" in res["message"] and "sha256" in res["message"]


def test_tampered_root_file_in_served_repo_fails_sha256(client, tmp_path):
    """The manifest also hashes the shared root files a variant reads: a changed config.json is refused by name."""
    (res,) = client([{"kind": "load", "repo": REPO, "soc": "SM8650", "revision": "tampered-config", "prompt": PROMPT}], tmp_path / "hf")
    assert res["error"] == "ManifestError", res
    assert "config.json" in res["message"] and "sha256" in res["message"]


def test_tampered_file_in_cache_fails_sha256(client, shared_cache, tmp_path):
    if not (shared_cache / "hub").exists():
        client([{"kind": "load", "repo": REPO, "soc": "SM8750", "revision": "main", "prompt": PROMPT}], shared_cache)
    cache = tmp_path / "hf"
    shutil.copytree(shared_cache, cache, symlinks=True)
    (snapshot,) = (cache / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots").iterdir()
    blob = (snapshot / V8750 / "model.pte").resolve()
    assert cache in blob.parents  # the copy, never the shared cache
    data = bytearray(blob.read_bytes())
    data[100] ^= 0x01
    blob.write_bytes(bytes(data))
    (res,) = client([{"kind": "load", "repo": REPO, "soc": "SM8750", "revision": "main", "prompt": PROMPT}], cache, offline=True)
    assert res["error"] == "ManifestError", res
    assert "model.pte" in res["message"] and "sha256" in res["message"]


def test_not_found_errors_are_clear(client, tmp_path):
    no_repo, no_revision, no_variant = client(
        [
            {"kind": "load", "repo": f"{ORG}/does-not-exist", "soc": "SM8650", "revision": "main", "prompt": PROMPT},
            {"kind": "load", "repo": REPO, "soc": "SM8650", "revision": "no-such-branch", "prompt": PROMPT},
            {"kind": "load", "repo": REPO, "soc": "SM8550", "revision": "main", "prompt": PROMPT},
        ],
        tmp_path / "hf",
    )
    assert no_repo["error"] == "HubError" and f"{ORG}/does-not-exist" in no_repo["message"], no_repo
    assert no_revision["error"] == "HubError" and "no-such-branch" in no_revision["message"], no_revision
    assert no_variant["error"] == "VariantNotFoundError", no_variant
    assert "soc=SM8550" in no_variant["message"]
    assert "SM8650/fp16/ctx32/kv" in no_variant["message"] and "SM8750/fp16/ctx32/kv" in no_variant["message"]


# --- exporting from a Hub model id -----------------------------------------------------------------------------


# `optimum-cli export qnn` in a child process, with `GitHubApi` (below) in place of `HfApi`: pushes become commits in
# olah's mirrors. Called as `python -c CLI_WITH_GIT_HUB export ARGS...`.
CLI_WITH_GIT_HUB = r"""
import os, sys
from pathlib import Path
import huggingface_hub
from tests.test_hub import GitHubApi
GitHubApi.root, GitHubApi.calls = Path(os.environ["GIT_HUB_MIRRORS"]), []
huggingface_hub.HfApi = GitHubApi
from optimum.commands.optimum_cli import main
sys.argv = ["optimum-cli", "export", "qnn", *sys.argv[2:]]
main()
"""


def test_export_from_a_hub_model_id_and_push(hub, client, random_model_dir, local_tokens, run_python, tmp_path):
    """`optimum-cli export qnn --model <repo id> --push-to-hub <repo>` end to end: the checkpoint comes through the Hub
    client (only the files the exporter reads), the manifest records the repo and revision, the variant generates
    what the local export does, and the pushed repo downloads back byte for byte."""
    from huggingface_hub import ModelCard

    from optimum_qnn.artifacts.manifest import read_manifest, sha256_file
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    out, hf_home, pushed = tmp_path / "out", tmp_path / "hf", f"{ORG}/gemma4-tiny-cli-pushed"
    proc = run_python(
        "-c", CLI_WITH_GIT_HUB, "export", "--model", SOURCE_REPO, "--revision", "main", "--output", str(out),
        "--soc", "SM8650", "--quant", "fp16", "--mode", "kv", "--max-seq-len", "32", "--prefill-ar-len", "4",
        "--embedding-quant", "none", "--push-to-hub", pushed,
        env={**hub_env(hub, hf_home), "GIT_HUB_MIRRORS": str(hub["mirrors"]), **GIT_ENV}, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (snapshot,) = (hf_home / "hub" / f"models--{SOURCE_REPO.replace('/', '--')}" / "snapshots").iterdir()
    downloaded = sorted(p.name for p in snapshot.iterdir())
    assert "pytorch_model.bin" not in downloaded and "model.safetensors" in downloaded, downloaded
    manifest = read_manifest(out / V8650)
    assert (manifest.source.model_id, manifest.source.revision) == (SOURCE_REPO, "main")
    assert [(e.path, e.sha256) for e in manifest.source.weight_files] == [
        ("model.safetensors", sha256_file(random_model_dir / "model.safetensors"))
    ]
    model = QNNModelForCausalLM.from_pretrained(out)
    assert model.generate(PROMPT, max_new_tokens=4).reshape(-1).tolist() == local_tokens["SM8650"]

    # --push-to-hub: a root commit and one per variant, printed by the CLI; the repo reads back as the folder.
    assert proc.stdout.count("pushed ") == 2, proc.stdout[-2000:]
    assert ModelCard((out / "README.md").read_text()).data.base_model == SOURCE_REPO  # the source was a Hub id
    (res,) = client([{"kind": "snapshot", "repo": pushed, "revision": "main"}], tmp_path / "hf-read")
    assert "error" not in res, res
    local = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and not p.name.startswith("."))
    assert res["files"] == local
    for name in local:
        assert (Path(res["root"]) / name).read_bytes() == (out / name).read_bytes(), name


# --- publishing -----------------------------------------------------------------------------------------------


class GitHubApi:
    """Stands in for `HfApi` in `push_to_hub`: each `create_commit` becomes a git commit in a repo olah serves."""

    root: Path
    calls: list

    def __init__(self, token=None):
        self.token = token

    def create_repo(self, repo_id, repo_type="model", private=False, exist_ok=False):
        self.calls.append(("create_repo", repo_id, private, exist_ok))
        repo = self.root / "models" / repo_id
        if not repo.exists():
            repo.mkdir(parents=True)
            _git(repo, "init", "-q", "-b", "main")

    def create_branch(self, repo_id, branch, exist_ok=False):  # pragma: no cover - push without revision here
        raise AssertionError("no branch expected")

    def create_commit(self, repo_id, operations, commit_message, revision=None):
        from types import SimpleNamespace

        repo = self.root / "models" / repo_id
        for op in operations:
            target = repo / op.path_in_repo
            target.parent.mkdir(parents=True, exist_ok=True)
            with op.as_file() as f:
                target.write_bytes(f.read())
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", commit_message)
        sha = _git(repo, "rev-parse", "HEAD")
        self.calls.append(("create_commit", repo_id, [op.path_in_repo for op in operations], revision))
        return SimpleNamespace(commit_url=f"http://hub/{repo_id}/commit/{sha}", oid=sha)


def test_push_commits_one_variant_at_a_time_and_round_trips(artifacts, hub, client, monkeypatch, tmp_path):
    import huggingface_hub

    from optimum_qnn.artifacts.hub import push_to_hub

    folder = tmp_path / "out"
    shutil.copytree(artifacts["full"], folder)
    (folder / "README.md").unlink()  # push writes the card
    GitHubApi.root, GitHubApi.calls = hub["mirrors"], []
    monkeypatch.setattr(huggingface_hub, "HfApi", GitHubApi, raising=False)
    plan = push_to_hub(folder, PUSHED_REPO, token="hf_test", private=True)

    assert (folder / "README.md").read_text() == (artifacts["full"] / "README.md").read_text()
    assert GitHubApi.calls[0] == ("create_repo", PUSHED_REPO, True, True)
    assert [c[2] for c in GitHubApi.calls[1:]] == [list(c.files) for c in plan.commits]
    assert len(plan.commit_urls) == 3
    repo = hub["mirrors"] / "models" / PUSHED_REPO
    assert _git(repo, "log", "--format=%s").splitlines() == [c.message for c in reversed(plan.commits)]
    # After commit k the remote index lists exactly the k variants pushed so far.
    listed = [
        [v["path"] for v in json.loads(_git(repo, "show", f"HEAD~{n}:{INDEX_NAME}"))["variants"]] for n in (1, 0)
    ]
    assert listed == [[V8650], [V8650, V8750]]
    assert "qnn_index.json" not in _git(repo, "show", "--name-only", "--format=", "HEAD~2").split()

    # Download the pushed repo back through olah: byte-identical to the artifact folder.
    (res,) = client([{"kind": "snapshot", "repo": PUSHED_REPO, "revision": "main"}], tmp_path / "hf")
    assert "error" not in res, res
    assert res["files"] == plan.files
    for name in plan.files:
        assert (Path(res["root"]) / name).read_bytes() == (folder / name).read_bytes(), name
