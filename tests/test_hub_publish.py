"""Publishing without a server: the push plan (dry run) and its refusal of a corrupt variant, the model card's
metadata, and the CLI's push arguments. The pushes themselves run against the Hub-protocol server in test_hub.py."""

from __future__ import annotations

import os
import shutil

import pytest

from optimum_qnn.artifacts.writer import INDEX_NAME
from tests.test_hub import PUSHED_REPO, V8650, V8750, _root_files, _variant_files
from tests.test_hub import artifacts  # noqa: F401  (the module-scoped artifact folder fixture)


def test_dry_run_plan(artifacts):
    from optimum_qnn.artifacts.hub import push_to_hub

    full = artifacts["full"]
    card_before = (full / "README.md").read_bytes()
    plan = push_to_hub(full, PUSHED_REPO, dry_run=True, commit_message="Export")
    assert (full / "README.md").read_bytes() == card_before  # dry run writes nothing
    root = sorted(name for name in _root_files(full) if name != INDEX_NAME)
    assert "config.json" in root and "README.md" in root
    assert [c.files for c in plan.commits] == [
        tuple(root),
        tuple(sorted([INDEX_NAME, f"{V8650}/manifest.json", f"{V8650}/model.pte"])),
        tuple(sorted([INDEX_NAME, f"{V8750}/manifest.json", f"{V8750}/model.pte"])),
    ]
    assert [c.variant for c in plan.commits] == [None, V8650, V8750]
    assert all(c.message.startswith("Export: ") for c in plan.commits)
    assert plan.files == sorted(set(root) | {INDEX_NAME} | set(_variant_files(full, V8650)) | set(_variant_files(full, V8750)))
    assert plan.commit_urls == []


def test_dry_run_refuses_a_corrupt_variant(artifacts, tmp_path):
    from optimum_qnn.artifacts.hub import push_to_hub
    from optimum_qnn.artifacts.manifest import ManifestError

    folder = tmp_path / "out"
    shutil.copytree(artifacts["full"], folder)
    pte = folder / V8650 / "model.pte"
    data = bytearray(pte.read_bytes())
    data[-1] ^= 0xFF  # same size, other content
    pte.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=f"{V8650}/model.pte"):
        push_to_hub(folder, PUSHED_REPO, dry_run=True)


def test_model_card_metadata(artifacts, tmp_path):
    import dataclasses

    from huggingface_hub import ModelCard

    from optimum_qnn.artifacts.model_card import model_card
    from optimum_qnn.artifacts.manifest import read_manifest

    card = ModelCard((artifacts["full"] / "README.md").read_text())
    data = card.data.to_dict()
    assert data["library_name"] == "executorch"
    assert data["pipeline_tag"] == "text-generation"
    assert data["license"] == "gemma"
    assert data["tags"] == ["executorch", "qnn", "qualcomm", "gemma4", "sm8650", "sm8750", "fp16"]
    assert "base_model" not in data  # the source was a local folder, not a Hub id
    for soc, arch in (("SM8650", 75), ("SM8750", 79)):
        manifest = read_manifest(artifacts["full"] / f"qnn/{soc.lower()}/fp16-ctx32-kv")
        assert manifest.target.htp_arch == arch
        row = f"| `qnn/{soc.lower()}/fp16-ctx32-kv` | {soc} | v{arch} | fp16 | 32 | kv |"
        assert row in card.text and manifest.versions.qairt_build_id in card.text
    assert "](http" not in card.text  # no link out: the repository the card once linked does not exist
    # What the variant is, how to run it per host, its measured quality and size, the limits.
    assert "| `qnn/sm8650/fp16-ctx32-kv` | SM8650 | v75 | fp16 | 32 | kv | no |" in card.text  # weights not shared
    assert "not measured" in card.text  # exported without --evaluate
    run = card.text.split("## Run it", 1)[1].split("## Limits", 1)[0]
    assert "On a phone over adb" in run and "--soc SM8650 --quant fp16 --device adb" in run  # both SoCs are phones
    assert "On x86 Linux, the HTP emulator" in run  # the variants' weights are not shared
    assert "Windows on Snapdragon" not in run and "Linux board" not in run  # no SoC of theirs is one
    assert 'from_pretrained("<repo_id>", soc="SM8650", quant="fp16"' in run
    limits = card.text.split("## Limits", 1)[1]
    assert "only on the SoC it was compiled for" in limits and "QAIRT 2.49 or newer" in limits

    # A source given by Hub id becomes base_model.
    folder = tmp_path / "out"
    shutil.copytree(artifacts["full"], folder)
    for variant in (V8650, V8750):
        m = read_manifest(folder / variant)
        dataclasses.replace(m, source=dataclasses.replace(m.source, model_id="google/gemma-4-e2b-it")).write(folder / variant)
    assert ModelCard(model_card(folder)).data.base_model == "google/gemma-4-e2b-it"


def test_cli_push_to_hub_arguments():
    import argparse

    from optimum_qnn.cli import add_export_arguments

    parser = argparse.ArgumentParser()
    add_export_arguments(parser)
    args = parser.parse_args(["-m", "m", "-o", "out", "--push-to-hub", "org/name", "--private"])
    assert (args.push_to_hub, args.private) == ("org/name", True)
    args = parser.parse_args(["-m", "m", "-o", "out"])
    assert (args.push_to_hub, args.private) == (None, False)


@pytest.mark.skipif(
    not (os.environ.get("HF_TOKEN") and os.environ.get("OPTIMUM_QNN_TEST_REAL_HUB") == "1"),
    reason="pushes to the real Hub: set HF_TOKEN and OPTIMUM_QNN_TEST_REAL_HUB=1",
)
def test_push_to_real_hub(artifacts, tmp_path):  # pragma: no cover - needs network and a token
    import uuid

    from huggingface_hub import HfApi

    from optimum_qnn.artifacts.hub import push_to_hub

    api = HfApi(token=os.environ["HF_TOKEN"])
    repo_id = f"{api.whoami()['name']}/optimum-qnn-test-{uuid.uuid4().hex[:8]}"
    folder = tmp_path / "out"
    shutil.copytree(artifacts["full"], folder)
    try:
        plan = push_to_hub(folder, repo_id, token=os.environ["HF_TOKEN"], private=True)
        assert len(plan.commit_urls) == 3
        assert sorted(api.list_repo_files(repo_id)) == sorted([*plan.files, ".gitattributes"])
    finally:
        api.delete_repo(repo_id, missing_ok=True)
