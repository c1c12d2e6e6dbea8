"""The static decoder taking soft tokens (an image's embeddings) against `Gemma4ForConditionalGeneration`, in fp32:
an image prompt's logits within 1e-4 of Hugging Face's, its prefill chunks cut inside and around the image; a text-only
prompt on the image-taking graph gives the text graph's logits exactly; the contract and the session's refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

from optimum_qnn import StaticCausalLM
from optimum_qnn.contract import DECODE_METHOD, IMAGE_INPUTS, PREFILL_METHOD
from optimum_qnn.errors import InvalidInputError
from optimum_qnn.session import SoftTokens
from tests.gemma4_vision_tiny import BOI_TOKEN_ID, EOI_TOKEN_ID, IMAGE_TOKEN_ID, tiny_multimodal_model
from tests.test_images import photo_like

CONTEXT, AR = 96, 8


@pytest.fixture(scope="module")
def model():
    return tiny_multimodal_model()


def image_prompt(model, width: int, height: int, before: list[int], after: list[int]):
    """Hugging Face's inputs for ``before`` + BOI + the image's placeholders + EOI + ``after``, and the image's soft
    tokens as `get_image_features` gives them."""
    batch = Gemma4ImageProcessorPil(max_soft_tokens=70)(images=[photo_like(width, height)], return_tensors="pt")
    n = int(batch["num_soft_tokens_per_image"][0])
    ids = torch.tensor([[2, *before, BOI_TOKEN_ID, *[IMAGE_TOKEN_ID] * n, EOI_TOKEN_ID, *after]])
    with torch.no_grad():
        features = torch.cat(list(model.get_image_features(batch["pixel_values"], batch["image_position_ids"]).pooler_output))
    assert features.shape[0] == n
    return ids, batch, features


def static_logits(static: StaticCausalLM, ids: torch.Tensor, features: torch.Tensor, pad: int) -> np.ndarray:
    """The static model's logits for ``ids``: placeholders become the pad id, the soft tokens go in their rows."""
    ids = ids[0].numpy()
    mask = ids == IMAGE_TOKEN_ID
    embeds = np.zeros((ids.size, features.shape[1]), dtype=np.float32)
    embeds[mask] = features.numpy()
    return np.asarray(static.session().feed(np.where(mask, pad, ids), SoftTokens(embeds, mask)))


@pytest.mark.parametrize(("size", "before", "after"), [
    ((640, 480), [40, 41, 42], [60, 61, 62, 63, 64]),   # the image starts inside the first chunk
    ((91, 300), [40, 41, 42, 43, 44, 45, 46, 47], [60]),  # ... at a chunk's start, one token after it (decode)
])
def test_an_image_prompt_gives_hugging_faces_logits(model, size, before, after):
    ids, batch, features = image_prompt(model, *size, before, after)
    with torch.no_grad():
        theirs = model(input_ids=ids, pixel_values=batch["pixel_values"],
                       image_position_ids=batch["image_position_ids"]).logits[0].numpy()
    static = StaticCausalLM.from_hf(model, max_context_len=CONTEXT, ar_len=AR, image_inputs=True)
    ours = static_logits(static, ids, features, model.config.get_text_config().pad_token_id)
    assert ours.shape == theirs.shape and np.abs(theirs).max() > 0.5
    err = np.abs(ours - theirs).max()
    assert err < 1e-4, err
    # The image moves the logits: a graph that dropped the soft tokens would not pass the bound above.
    blind = np.asarray(StaticCausalLM.from_hf(model, max_context_len=CONTEXT, ar_len=AR).session().feed(ids[0].numpy() * (ids[0].numpy() != IMAGE_TOKEN_ID)))
    assert np.abs(blind - theirs).max() > 1e-2


def test_a_text_prompt_on_the_image_graph_is_the_text_graphs(model):
    ids = np.array([2, *range(40, 60)])
    text = StaticCausalLM.from_hf(model, max_context_len=CONTEXT, ar_len=AR).session().feed(ids)
    both = StaticCausalLM.from_hf(model, max_context_len=CONTEXT, ar_len=AR, image_inputs=True).session()
    assert np.array_equal(np.asarray(both.feed(ids)), np.asarray(text))


def test_every_method_takes_soft_tokens_so_prefill_and_decode_are_one_graph(model):
    """Decode takes the soft tokens too (the host gives it zeros): its graph is then prefill's op for op, which the
    shared quantization of an image variant needs (tests/test_image_quant.py)."""
    static = StaticCausalLM.from_hf(model, max_context_len=CONTEXT, ar_len=AR, image_inputs=True)
    prefill, decode = static.contract.method(PREFILL_METHOD), static.contract.method(DECODE_METHOD)
    hidden = model.config.get_text_config().hidden_size
    for spec, ar in ((prefill, AR), (decode, 1)):
        assert [(t.name, t.shape) for t in spec.inputs[-2:]] == [(IMAGE_INPUTS[0], (1, ar, hidden)),
                                                                 (IMAGE_INPUTS[1], (1, ar, 1))]
        assert spec.takes_images
        outputs = static.module(*static.example_inputs(spec.name))
        assert [tuple(t.shape) for t in outputs] == [t.shape for t in spec.outputs]
    ops = {name: [str(n.target) for n in static.export(name).graph.nodes if n.op == "call_function"]
           for name in (PREFILL_METHOD, DECODE_METHOD)}
    assert ops[PREFILL_METHOD] == ops[DECODE_METHOD]
    with pytest.raises(InvalidInputError, match="ar_len > 1"):
        StaticCausalLM.from_hf(model, max_context_len=CONTEXT, ar_len=None, image_inputs=True)


def test_soft_tokens_are_refused_by_a_text_variant(model):
    session = StaticCausalLM.from_hf(model, max_context_len=CONTEXT, ar_len=AR).session()
    mask = np.zeros(6, dtype=bool)
    mask[2] = True
    with pytest.raises(InvalidInputError, match="takes no images.*image-text-to-text"):
        session.feed(np.array([2, 40, 0, 41, 42, 43]), SoftTokens(np.zeros((6, 32), np.float32), mask))
