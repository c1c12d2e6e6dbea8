"""The runner manifest: round trip, schema file, and rejection of anything malformed or escaping its folder."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import optimum_qnn
from optimum_qnn.errors import OptimumQnnError
from optimum_qnn.artifacts.manifest import (
    Contract,
    FileEntry,
    Layer,
    Manifest,
    ManifestError,
    Method,
    Quantization,
    QuantRecipeRow,
    Source,
    Target,
    TensorIO,
    TokenizerInfo,
    Versions,
    json_schema,
    manifest_from_dict,
    read_manifest,
    resolve_inside,
)


def sample() -> Manifest:
    entry = FileEntry("model.pte", 10, "ab" * 32)
    return Manifest(
        schema_version="1.1",
        source=Source("google/gemma-4-e2b", "main", [FileEntry("model.safetensors", 5, "cd" * 32)]),
        versions=Versions("0.1.0", "1.5.1", "2.13.0", "5.23.0", "v2.49.40.260810104044"),
        target=Target("SM8650", 75),
        quantization=Quantization("16a8w", None, "4,32", 32, [QuantRecipeRow("layers.*", "linear", "uint16", "int8 per-channel", 7)]),
        contract=Contract(
            64, 256, 8, 0.0, -255.0, "tables", "smart_mask", False,
            [Layer(0, "sliding_attention", 16, 2, 0, 0)],
            [Method("kv_forward", 1, [TensorIO("tokens", [1, 1], "int64")], [TensorIO("logits", [1, 1, 256], "float32")])],
        ),
        tokenizer=TokenizerInfo(["tokenizer.json"], 2, [1], 0, None),
        program=entry,
        files=[entry],
        root_files=[FileEntry("config.json", 3, "ef" * 32), FileEntry("tokenizer.json", 4, "01" * 32)],
    )


def as_dict(m: Manifest) -> dict:
    return json.loads(m.to_json())


def test_round_trip(tmp_path):
    m = sample()
    m.write(tmp_path)
    assert read_manifest(tmp_path) == m
    contract = m.runner_contract()
    assert contract.method("kv_forward").ar_len == 1 and contract.layers[0].head_dim == 16


def test_schema_file_matches_the_dataclasses():
    shipped = json.loads((Path(optimum_qnn.__file__).parent / "artifacts" / "manifest.schema.json").read_text())
    assert shipped == json_schema(), "regenerate optimum_qnn/artifacts/manifest.schema.json from manifest.json_schema()"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(schema_version="2.0"), "schema version 2.0 is not readable"),
        (lambda d: d.pop("target"), "missing field 'target'"),
        (lambda d: d.update(extra=1), "unexpected field"),
        (lambda d: d["target"].update(htp_arch="75"), "manifest.target.htp_arch: expected an integer"),
        (lambda d: d["program"].update(path="../../etc/passwd"), "points outside"),
        (lambda d: d["files"][0].update(path="/etc/passwd"), "points outside"),
        (lambda d: d["tokenizer"].update(files=["..\\x"]), "points outside"),
        (lambda d: d["root_files"][0].update(path="../config.json"), "points outside"),
        (lambda d: d["contract"].update(weight_sharing="no"), "expected true/false"),
    ],
)
def test_rejects_malformed(mutate, message):
    d = as_dict(sample())
    mutate(d)
    with pytest.raises(ManifestError, match=message):
        manifest_from_dict(d)


def test_a_1_0_manifest_without_root_files_still_reads():
    """Manifests written before schema 1.1 did not list the artifact root's files; they load, unverified there."""
    d = as_dict(sample())
    d["schema_version"] = "1.0"
    del d["root_files"]
    m = manifest_from_dict(d)
    assert m.root_files is None and m.files == sample().files


def test_unreadable_file(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="Cannot read manifest"):
        read_manifest(tmp_path)
    with pytest.raises(ManifestError, match="No manifest"):
        read_manifest(tmp_path / "nowhere")


def test_symlink_leaving_the_folder_is_refused(tmp_path):
    outside = tmp_path / "secret"
    outside.write_text("x")
    variant = tmp_path / "variant"
    variant.mkdir()
    (variant / "model.pte").symlink_to(outside)
    with pytest.raises(ManifestError, match="outside the variant folder"):
        resolve_inside(variant, "model.pte")


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_fuzzed_manifests_only_raise_manifest_error(data):
    d = as_dict(sample())
    # Replace one field somewhere in the tree with arbitrary JSON.
    path = data.draw(st.sampled_from(_paths(d)))
    target = d
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = data.draw(_json)
    try:
        manifest_from_dict(copy.deepcopy(d))
    except OptimumQnnError as e:
        assert isinstance(e, ManifestError)


def _paths(node, prefix=()):
    out = []
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return out
    for k, v in items:
        out.append(prefix + (k,))
        out += _paths(v, prefix + (k,))
    return out
