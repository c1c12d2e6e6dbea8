"""The static vision encoder against Hugging Face's `get_image_features` (fp32, within 1e-4, three aspect ratios),
its coverage of the Hugging Face vision classes, weight adoption, export, and the strict loading of a tower."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Gemma4ForConditionalGeneration
from transformers.models.gemma4 import modeling_gemma4 as hf
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

from optimum_qnn.errors import UnsupportedModelError
from optimum_qnn.images import encoder_inputs
from optimum_qnn.models.gemma4.loading import CheckpointError, load_text_model, load_vision_parts
from optimum_qnn.models.gemma4.vision import StaticImageEncoder, geometry_of
from optimum_qnn.swap import SWAPS
from tests.gemma4_vision_tiny import tiny_multimodal_config, tiny_multimodal_model
from tests.test_images import photo_like

# (width, height): a thin strip (one pooled row), landscape, portrait.
ASPECTS = [(500, 3), (640, 480), (91, 300)]


def hf_image_features(model: Gemma4ForConditionalGeneration, pixel_values, position_ids) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model.get_image_features(torch.from_numpy(pixel_values), torch.from_numpy(position_ids))
    return list(out.pooler_output)


def static_features(encoder: StaticImageEncoder, pixel_values, position_ids) -> list[torch.Tensor]:
    rows = []
    for pv, pos in zip(pixel_values, position_ids):
        inputs = encoder_inputs(pv, pos, encoder.geometry)
        with torch.no_grad():
            out = encoder(*map(torch.from_numpy, inputs.as_tuple()))
        rows.append(out[0, : inputs.num_soft_tokens])
    return rows


@pytest.fixture(scope="module")
def model():
    return tiny_multimodal_model()


def test_every_vision_module_class_is_swapped_or_passed_through():
    classes = [obj for name, obj in inspect.getmembers(hf, inspect.isclass)
               if issubclass(obj, nn.Module) and obj.__module__ == hf.__name__
               and (name.startswith("Gemma4Vision") or name in ("Gemma4ClippableLinear", "Gemma4MultimodalEmbedder"))]
    assert len(classes) >= 9
    uncovered = [c.__name__ for c in classes if c not in SWAPS.swapped_classes and c not in SWAPS.passed_classes]
    assert not uncovered, uncovered


@pytest.mark.parametrize("soft_tokens", [70, 280])
def test_static_encoder_matches_hugging_face_on_three_aspect_ratios(model, soft_tokens):
    geometry = geometry_of(model.config.vision_config, soft_tokens)
    encoder, report = StaticImageEncoder.from_hf(model, geometry)
    images = [photo_like(w, h, seed=i) for i, (w, h) in enumerate(ASPECTS)]
    batch = Gemma4ImageProcessorPil(max_soft_tokens=soft_tokens)(images=images, return_tensors="np")
    theirs = hf_image_features(model, batch["pixel_values"], batch["image_position_ids"])
    ours = static_features(encoder, batch["pixel_values"], batch["image_position_ids"])
    assert [len(t) for t in ours] == [len(t) for t in theirs] == list(batch["num_soft_tokens_per_image"])
    for a, b in zip(ours, theirs):
        assert b.abs().max() > 0.1  # the features are not trivially small
        assert (a - b).abs().max().item() < 1e-4, (a - b).abs().max().item()
    assert any(r.source == "Gemma4VisionAttention" for r in report.swapped)


def test_every_vision_parameter_is_adopted_not_copied(model):
    encoder, _ = StaticImageEncoder.from_hf(model, geometry_of(model.config.vision_config, 70))
    ours = {t.data_ptr() for t in [*encoder.parameters(), *encoder.buffers()]}
    for prefix, module in (("vision_tower", model.model.vision_tower), ("embed_vision", model.model.embed_vision)):
        for name, p in module.named_parameters():
            assert p.data_ptr() in ours, f"{prefix}.{name} was copied or dropped"
        for name, b in module.named_buffers():
            # Derived: RoPE frequencies become cos/sin tables, clip bounds constants of the graph (checked by parity).
            if "rotary_emb" not in name and not name.endswith(("_min", "_max")):
                assert b.data_ptr() in ours, f"{prefix}.{name} was copied or dropped"


def test_the_encoder_exports_with_static_shapes(model):
    encoder, _ = StaticImageEncoder.from_hf(model, geometry_of(model.config.vision_config, 70))
    inputs = encoder.example_inputs()
    program = torch.export.export(encoder, inputs, strict=True)
    assert tuple(program.module()(*inputs).shape) == (1, 70, model.config.get_text_config().hidden_size)
    assert not any(n.target in (torch.ops.aten.nonzero.default, torch.ops.aten.index.Tensor)
                   for n in program.graph.nodes), "a data-dependent op is in the graph"


def test_a_model_without_a_vision_tower_is_refused_by_name():
    config = tiny_multimodal_config()
    config.vision_config = None
    with pytest.raises(UnsupportedModelError, match="no vision tower"):
        StaticImageEncoder.from_hf(Gemma4ForConditionalGeneration(config), geometry_of(tiny_multimodal_config().vision_config, 70))


def test_a_budget_past_the_position_table_is_refused():
    model = tiny_multimodal_model(tiny_multimodal_config(vision=dict(position_embedding_size=512)))
    with pytest.raises(UnsupportedModelError, match="position embeddings; choose a smaller budget"):
        StaticImageEncoder.from_hf(model, geometry_of(model.config.vision_config, 280))


def test_the_loader_reads_the_vision_tower_strictly(model, tmp_path):
    folder = tmp_path / "mm"
    model.save_pretrained(folder)
    parts, report = load_vision_parts(folder)
    assert report.read and all(k.startswith(("model.vision_tower.", "model.embed_vision.")) for k in report.read)
    assert any(k.startswith("model.language_model.") for k in report.skipped)
    geometry = geometry_of(model.config.vision_config, 70)
    loaded, _ = StaticImageEncoder.from_hf(parts, geometry)
    batch = Gemma4ImageProcessorPil(max_soft_tokens=70)(images=[photo_like(640, 480)], return_tensors="np")
    theirs = hf_image_features(model, batch["pixel_values"], batch["image_position_ids"])
    ours = static_features(loaded, batch["pixel_values"], batch["image_position_ids"])
    assert (ours[0] - theirs[0]).abs().max().item() < 1e-4
    load_text_model(folder)  # the text loader still reads the same folder, towers skipped

    weights = folder / "model.safetensors"
    state = load_file(weights)
    key = next(k for k in state if k.startswith("model.vision_tower.") and k.endswith("q_proj.linear.weight"))
    broken = dict(state)
    broken[key] = broken[key][:, :-1].contiguous()
    save_file(broken, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="1 of another shape"):
        load_vision_parts(folder)
    broken = {k: v for k, v in state.items() if k != key}
    broken["model.vision_tower.extra.weight"] = torch.zeros(2)
    save_file(broken, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"1 missing .*q_proj.*1 unexpected .*extra"):
        load_vision_parts(folder)


def test_a_text_only_checkpoint_is_refused_when_images_are_asked_for(tmp_path):
    config = json.loads(tiny_multimodal_config().to_json_string())
    config["vision_config"] = None
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="has no vision tower .*vision_config absent"):
        load_vision_parts(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config["text_config"], "model_type": "gemma4_text"}))
    with pytest.raises(UnsupportedModelError, match="model_type 'gemma4_text'"):
        load_vision_parts(tmp_path)
