"""An image variant end to end: `export --task image-text-to-text` (fp16, SM8650, 70 soft tokens an image) of a
multimodal Gemma 4 made of the demo model's decoder and a small random vision tower, run on the x86 HTP emulator
through both host backends against Hugging Face's `Gemma4ForConditionalGeneration` in fp32: the same greedy ids for
an image prompt, the text variant's ids for a text prompt, a later turn that reuses the image's K/V, the processor
and pipeline, the runtime install, and the refusals (a text variant, a checkpoint without a tower, the runner,
audio)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from optimum_qnn.artifacts.variants import VariantNotFoundError
from optimum_qnn.errors import InvalidInputError, UnsupportedModelError
from tests.conftest import built_once, run_main
from tests.test_images import photo_like
from tests.test_runtime_venv import NO_FULL_STACK, _venv_env, runtime_venv  # noqa: F401  (the venv fixture, shared)

# Placeholder ids inside the demo tokenizer's 512: ordinary tokens the test prompts never hold.
IMAGE_ID, BOI_ID, EOI_ID = 511, 510, 509
CTX, AR, SOFT = 128, 16, 70
TEXT = [2, 40, 41, 42, 43]
PROMPT = "The for statement"  # text whose tokens are none of the placeholder ids


@pytest.fixture(scope="module")
def multimodal_dir(demo_model_dir, tmp_path_factory) -> Path:
    """The demo decoder with a random vision tower (every trait of the published one on), saved as a checkpoint."""

    def build(folder: Path) -> Path:
        from transformers import AutoModelForCausalLM, Gemma4Config

        from tests.gemma4_vision_tiny import tiny_multimodal_model, tiny_vision_config

        text = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
        config = Gemma4Config(text_config=text.config, vision_config=tiny_vision_config(), audio_config=None,
                              image_token_id=IMAGE_ID, boi_token_id=BOI_ID, eoi_token_id=EOI_ID)
        model = tiny_multimodal_model(config, seed=3)
        model.model.language_model.load_state_dict(text.model.state_dict())
        out = folder / "model"
        model.save_pretrained(out)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            if (demo_model_dir / name).is_file():
                shutil.copy(demo_model_dir / name, out / name)
        return out

    return built_once(tmp_path_factory, "image-checkpoint", build)


@pytest.fixture(scope="module")
def image_export(multimodal_dir, tmp_path_factory, qnn_sdk) -> Path:
    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
    from optimum_qnn.exporter.pipeline import export

    config = ExportConfig(socs=(Soc.SM8650,), quant=QuantScheme.FP16, mode=ExportMode.HYBRID,
                          shapes=ShapeConfig(CTX, AR), embedding_quant=EmbeddingQuant(0, 0), weight_sharing=False,
                          image_tokens=SOFT)
    return built_once(tmp_path_factory, "image-fp16", lambda folder: export(multimodal_dir, folder / "out", config).output)


@pytest.fixture(scope="module")
def hf_model(multimodal_dir):
    from transformers import Gemma4ForConditionalGeneration

    return Gemma4ForConditionalGeneration.from_pretrained(multimodal_dir, dtype=torch.float32).eval()


def image_prompt(model, size=(640, 480), seed=0):
    """A prompt of text, an image (BOI, its placeholders, EOI) and text, with the image's inputs from optimum-qnn's
    own processing (equal to transformers' `Gemma4ImageProcessorPil`: tests/test_images.py)."""
    inputs = model.image_inputs([photo_like(*size, seed=seed)])
    n = int(inputs["num_soft_tokens_per_image"][0])
    ids = np.array([[*TEXT, BOI_ID, *[IMAGE_ID] * n, EOI_ID, 50, 51]], dtype=np.int64)
    return ids, inputs["pixel_values"], inputs["image_position_ids"]


def hf_greedy(hf_model, ids, pixel_values, positions, new: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.ones_like(torch.from_numpy(ids)),
                                pixel_values=torch.from_numpy(pixel_values), image_position_ids=torch.from_numpy(positions),
                                max_new_tokens=new, do_sample=False, eos_token_id=None)
    return out[0, ids.shape[1]:].tolist()


def test_the_variant_records_what_the_runtime_needs(image_export):
    from optimum_qnn.artifacts.manifest import read_manifest

    (variant,) = [p.parent for p in image_export.glob("qnn/*/*/manifest.json")]
    assert variant.relative_to(image_export).as_posix() == f"qnn/sm8650/fp16-ctx{CTX}-img{SOFT}"
    manifest = read_manifest(variant)
    images = manifest.contract.images
    assert (images.method, images.soft_tokens, images.image_token_id, images.boi_token_id, images.eoi_token_id) == (
        "vision_encoder", SOFT, IMAGE_ID, BOI_ID, EOI_ID)
    methods = {m.name: m for m in manifest.contract.methods}
    for name in ("prefill_forward", "kv_forward"):  # decode takes them too (zeros): one graph for both
        assert [t.name for t in methods[name].inputs[-2:]] == ["image_embeds", "image_mask"]
    assert methods["vision_encoder"].outputs[0].shape[1] == SOFT
    # The index says so too: a folder holding a text twin loads each with its own class (`select_variant`).
    from optimum_qnn.artifacts.writer import read_index

    (entry,) = read_index(image_export)["variants"]
    assert entry["images"] == {"soft_tokens": SOFT}


@pytest.mark.parametrize("device", ["host:executorch", "host:onnxruntime"])
def test_an_image_prompt_gives_hugging_faces_greedy_ids(image_export, hf_model, device):
    from optimum_qnn.runtime.images import QNNModelForImageTextToText

    model = QNNModelForImageTextToText.from_pretrained(image_export, device=device)
    for size, seed in (((640, 480), 0), ((91, 300), 1)):
        ids, pixel_values, positions = image_prompt(model, size, seed)
        want = hf_greedy(hf_model, ids, pixel_values, positions, 12)
        got = model.generate(input_ids=ids, attention_mask=np.ones_like(ids), pixel_values=pixel_values,
                             image_position_ids=positions, max_new_tokens=12, eos_token_id=[])
        print(f"{device} {size}: ours {got[0, ids.shape[1]:].tolist()} theirs {want}")
        assert got[0, : ids.shape[1]].tolist() == ids[0].tolist() and got[0, ids.shape[1]:].tolist() == want
    # A text prompt on the image variant: the text model's tokens.
    text = np.array([TEXT + [44, 45]], dtype=np.int64)
    with torch.no_grad():
        want = hf_model.generate(input_ids=torch.from_numpy(text), max_new_tokens=8, do_sample=False,
                                 eos_token_id=None)[0, text.shape[1]:].tolist()
    assert model.generate(input_ids=text, max_new_tokens=8, eos_token_id=[])[0, text.shape[1]:].tolist() == want


_VENV_SCRIPT = NO_FULL_STACK + r"""
import json, sys
from optimum_qnn import QNNModelForImageTextToText
args = json.loads(sys.argv[1])
model = QNNModelForImageTextToText.from_pretrained(args["folder"])
text = model.image_text_generation(model.tokenizer(), args["prompt"], [args["photo"]], max_new_tokens=8,
                                   eos_token_id=[])
print("RESULT " + json.dumps({"text": text, "device": model.device_name, "new": model.stats.new_tokens}))
"""


def test_the_runtime_install_runs_an_image_prompt(image_export, runtime_venv, tmp_path):
    """The runtime install (no torch, transformers or ExecuTorch: onnxruntime-qnn, numpy, Pillow) reads an image file
    and gives the full install's text for it."""
    import subprocess

    from optimum_qnn.runtime.images import QNNModelForImageTextToText

    photo = tmp_path / "photo.png"
    photo_like(300, 200, seed=2).save(photo)
    args = {"folder": str(image_export), "prompt": PROMPT, "photo": str(photo)}
    proc = subprocess.run([str(runtime_venv), "-c", _VENV_SCRIPT, json.dumps(args)], capture_output=True, text=True,
                          timeout=600, env=_venv_env(), cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    model = QNNModelForImageTextToText.from_pretrained(image_export, device="host:executorch")
    want = model.image_text_generation(model.tokenizer(), PROMPT, [photo], max_new_tokens=8, eos_token_id=[])
    print(f"runtime install: {got}; full install (ExecuTorch): {want!r}")
    assert got == {"text": want, "device": "host:onnxruntime", "new": 8}


def test_a_later_turn_reuses_the_images_cache(image_export):
    from optimum_qnn.runtime.images import QNNModelForImageTextToText

    model = QNNModelForImageTextToText.from_pretrained(image_export, device="host:onnxruntime")
    ids, pixel_values, positions = image_prompt(model)
    first = model.generate(input_ids=ids, pixel_values=pixel_values, image_position_ids=positions, max_new_tokens=4,
                           eos_token_id=[], reuse_cache=True)
    follow = np.concatenate([first, [[60, 61]]], axis=1)
    fresh = QNNModelForImageTextToText.from_pretrained(image_export, device="host:onnxruntime")
    want = fresh.generate(input_ids=follow, pixel_values=pixel_values, image_position_ids=positions, max_new_tokens=4,
                          eos_token_id=[])
    got = model.generate(input_ids=follow, pixel_values=pixel_values, image_position_ids=positions, max_new_tokens=4,
                         eos_token_id=[], reuse_cache=True)
    assert model.stats.reused_tokens == first.shape[1] - 1 and got.tolist() == want.tolist()
    # Another image at the same places reuses only the text before it.
    other = model.image_inputs([photo_like(640, 480, seed=7)])
    model.generate(input_ids=follow, pixel_values=other["pixel_values"], image_position_ids=other["image_position_ids"],
                   max_new_tokens=1, eos_token_id=[], reuse_cache=True)
    assert model.stats.reused_tokens == len(TEXT) + 1


def _until_eos(ids: list[int], eos: list[int]) -> list[int]:
    return next((ids[:i] for i, t in enumerate(ids) if t in eos), ids)


def test_run_with_an_image_prints_the_greedy_text_of_the_image_before_the_prompt(image_export, hf_model, tmp_path,
                                                                                  capsys):
    """`run --image PATH --prompt TEXT`: the image's block, then the text (after BOS where the tokenizer adds one); the
    printed text is Hugging Face's greedy continuation of those ids (with the same pixels), up to the artifact's EOS,
    and one stats line follows."""
    from optimum_qnn.runtime.images import QNNModelForImageTextToText

    photo = tmp_path / "photo.png"
    photo_like(640, 480, seed=0).save(photo)  # lossless: the pixels photo_like made
    code, out, err = run_main(["run", image_export, "--image", photo, "--prompt", PROMPT, "--max-new-tokens", 8,
                               "--device", "host:onnxruntime"], capsys)
    assert code == 0, err
    model = QNNModelForImageTextToText.from_pretrained(image_export, device="host:onnxruntime")
    tok = model.tokenizer()
    inputs = model.image_inputs([photo])
    n = int(inputs["num_soft_tokens_per_image"][0])
    ids = model.image_prompt_ids(tok, PROMPT, [n])
    text = tok(PROMPT, add_special_tokens=True)["input_ids"]  # BOS if the tokenizer adds one (the demo's does not)
    head = 1 if text[:1] == [model.manifest.tokenizer.bos_id] else 0
    assert ids == [*text[:head], BOI_ID, *[IMAGE_ID] * n, EOI_ID, *text[head:]]
    want = _until_eos(hf_greedy(hf_model, np.array([ids]), inputs["pixel_values"], inputs["image_position_ids"], 8),
                      model.eos_token_ids)
    text, stats = out.rstrip("\n").rsplit("\n", 1)
    print(f"run --image: {text!r}; Hugging Face: {want}")
    assert text == tok.decode(want, skip_special_tokens=True)
    assert stats.startswith(f"[{len(ids)} prompt + {len(want)} new tokens")


def test_with_chat_the_images_open_the_users_turn(image_export):
    """``chat=True``: the template's ids with the images' blocks where the user's text begins (two images, in order;
    the conversation test below generates from such a prompt against Hugging Face)."""
    from optimum_qnn.runtime.images import QNNModelForImageTextToText

    model = QNNModelForImageTextToText.from_pretrained(image_export, device="host:onnxruntime")
    tok = model.tokenizer()
    photos = [photo_like(91, 300, seed=1), photo_like(300, 200, seed=2)]
    inputs = model.image_inputs(photos)
    counts = [int(c) for c in inputs["num_soft_tokens_per_image"]]
    ids = model.image_prompt_ids(tok, PROMPT, counts, chat=True)
    rendered = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    opening = rendered[: rendered.index(PROMPT)]  # the template up to the user's text
    before, rest = (tok(part, add_special_tokens=False)["input_ids"] for part in (opening, rendered[len(opening):]))
    blocks = [t for n in counts for t in (BOI_ID, *[IMAGE_ID] * n, EOI_ID)]
    assert ids == [*before, *blocks, *rest]
    assert opening.endswith("user\n")


def test_the_processor_and_pipeline_give_the_models_ids_and_hugging_faces_greedy_text(image_export, hf_model):
    """`QNNProcessor` (transformers' processor cannot load here: its video processor needs torchvision): an image
    token in the text becomes the image's block, a chat message's image part opens its text as `chat` places it, and
    ``pipeline("image-text-to-text")`` gives Hugging Face's greedy text for the same ids and pixels, plain and chat."""
    from transformers import pipeline

    from optimum_qnn import QNNModelForImageTextToText, QNNProcessor

    model = QNNModelForImageTextToText.from_pretrained(image_export, device="host:onnxruntime")
    processor = QNNProcessor(model)
    tok = processor.tokenizer
    photo = photo_like(640, 480, seed=0)
    expected = model.image_inputs([photo])
    n = int(expected["num_soft_tokens_per_image"][0])
    inputs = processor(images=photo, text=f"{processor.image_token}{PROMPT}", return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == model.image_prompt_ids(tok, PROMPT, [n])
    assert np.array_equal(inputs["pixel_values"].numpy(), expected["pixel_values"])
    messages = [{"role": "user", "content": [{"type": "image", "image": photo}, {"type": "text", "text": PROMPT}]}]
    chat = processor.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True)
    assert chat["input_ids"][0].tolist() == model.image_prompt_ids(tok, PROMPT, [n], chat=True)
    with pytest.raises(InvalidInputError, match="1 image tokens .* and 2 images"):
        processor(images=[photo, photo], text=f"{processor.image_token}{PROMPT}")

    pipe = pipeline("image-text-to-text", model=model, processor=processor)
    for prompt, args in ((inputs, dict(images=photo, text=f"{processor.image_token}{PROMPT}")),
                         (chat, dict(text=messages))):
        ids = np.asarray(prompt["input_ids"])
        want = tok.decode(hf_greedy(hf_model, ids, expected["pixel_values"], expected["image_position_ids"], 6),
                          skip_special_tokens=True)
        (out,) = pipe(**args, max_new_tokens=6, generate_kwargs={"do_sample": False, "eos_token_id": []},
                      return_full_text=False)
        print(f"pipeline: {out['generated_text']!r}; Hugging Face: {want!r}")
        assert out["generated_text"] == want


def test_a_conversation_keeps_its_images_reuses_their_cache_and_drops_them_with_their_turns(image_export, hf_model):
    """`chat().send(text, images=...)`: the image opens its turn; a later text turn reuses everything read before it
    (the image's K/V too) and gives Hugging Face's greedy reply to the whole conversation with the image's pixels;
    a second image that no longer fits beside the first drops the oldest turns, the first image with them."""
    from optimum_qnn.runtime.images import QNNModelForImageTextToText

    model = QNNModelForImageTextToText.from_pretrained(image_export, device="host:onnxruntime")
    model.clear_cache()
    tok = model.tokenizer()
    chat = model.chat(max_new_tokens=4, eos_token_id=[])
    photos = [photo_like(640, 480, seed=0), photo_like(300, 200, seed=2)]
    inputs = [model.image_inputs([p]) for p in photos]
    counts = [int(i["num_soft_tokens_per_image"][0]) for i in inputs]

    def hf_reply(prompt, which):
        pixels = np.concatenate([inputs[i]["pixel_values"] for i in which])
        positions = np.concatenate([inputs[i]["image_position_ids"] for i in which])
        return tok.decode(hf_greedy(hf_model, np.array([prompt]), pixels, positions, 4), skip_special_tokens=True)

    reply = chat.send(PROMPT, images=[photos[0]])
    prompt = chat.input_ids[: chat.stats.prompt_tokens]
    assert prompt == model.image_prompt_ids(tok, PROMPT, counts[:1], chat=True)
    assert reply == hf_reply(prompt, [0]) and chat.stats.reused_tokens == 0
    read = chat.stats.prompt_tokens + chat.stats.new_tokens - 1  # all but the reply's last token, never fed
    reply = chat.send("if x:")
    prompt = chat.input_ids[: chat.stats.prompt_tokens]
    assert prompt.count(IMAGE_ID) == counts[0] and chat.stats.reused_tokens == read
    assert reply == hf_reply(prompt, [0])
    assert all(set(m) == {"role", "content"} for m in chat.history)
    reply = chat.send("a list", images=[photos[1]])  # two images do not fit a context of 128 tokens
    prompt = chat.input_ids[: chat.stats.prompt_tokens]
    assert chat.stats.dropped_turns >= 1 and chat.history[0]["content"] != PROMPT and chat.history[-2:] == [
        {"role": "user", "content": "a list"}, {"role": "assistant", "content": reply}]
    assert prompt.count(IMAGE_ID) == counts[1] and prompt.count(BOI_ID) == 1
    assert reply == hf_reply(prompt, [1])


def test_the_terminal_chat_takes_images_with_slash_image(image_export, tmp_path):
    import io

    from optimum_qnn.runtime import repl
    from optimum_qnn.runtime.images import QNNModelForImageTextToText

    photo = tmp_path / "photo.png"
    photo_like(640, 480, seed=0).save(photo)
    model = QNNModelForImageTextToText.from_pretrained(image_export, device="host:onnxruntime")
    model.clear_cache()
    chat = model.chat(max_new_tokens=1)
    out = io.StringIO()
    lines = f"/image {tmp_path / 'missing.png'}\n/image {photo}\n{PROMPT}\n/exit\n"
    assert repl.run(chat, stdin=io.StringIO(lines), out=out) == 0
    text = out.getvalue()
    assert "/image PATH adds an image to the next message" in text.splitlines()[0]
    assert "No such image file" in text and "(image 1 of the next message" in text
    n = int(model.image_inputs([photo])["num_soft_tokens_per_image"][0])
    assert chat.input_ids[: chat.stats.prompt_tokens] == model.image_prompt_ids(model.tokenizer(), PROMPT, [n], chat=True)


def test_the_server_reads_image_parts_as_data_urls_and_refuses_what_it_cannot_read(image_export, hf_model, fp16_model):
    """`serve --images` through the official client: an ``image_url`` part (a data: URL) before the text gives Hugging
    Face's greedy reply to the image's chat prompt; a remote URL, bytes that are no image, and an image sent to a
    server of a text variant are 400s that say why."""
    import base64
    import io

    import openai

    from optimum_qnn.runtime.images import QNNModelForImageTextToText
    from optimum_qnn.runtime.stops import conversation_stop_ids
    from tests.test_server import client, running

    model = QNNModelForImageTextToText.from_pretrained(image_export, device="host:onnxruntime")
    model.clear_cache()
    tok = model.tokenizer()
    photo = photo_like(640, 480, seed=0)
    png = io.BytesIO()
    photo.save(png, format="PNG")

    def ask(url: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": PROMPT}]}]

    inputs = model.image_inputs([photo])
    ids = model.image_prompt_ids(tok, PROMPT, [int(inputs["num_soft_tokens_per_image"][0])], chat=True)
    want = _until_eos(hf_greedy(hf_model, np.array([ids]), inputs["pixel_values"], inputs["image_position_ids"], 4),
                      conversation_stop_ids(model.manifest.tokenizer.eos_ids, tok))
    with running(model) as url:
        c = client(url)
        out = c.chat.completions.create(model="demo", messages=ask("data:image/png;base64," +
                                                                   base64.b64encode(png.getvalue()).decode()),
                                        max_tokens=4, temperature=0)
        assert out.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
        assert out.usage.prompt_tokens == len(ids)
        for bad, words in (("https://example.com/cat.png", "only data: URLs are read"),
                           ("data:image/png;base64," + base64.b64encode(b"no image").decode(), "cannot be read")):
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model="demo", messages=ask(bad), max_tokens=2)
            assert words in e.value.message, e.value.message
    with running(fp16_model) as url:
        with pytest.raises(openai.BadRequestError) as e:
            client(url).chat.completions.create(model="demo", messages=ask("data:image/png;base64,AAAA"), max_tokens=2)
        assert "takes no images" in e.value.message and "serve --images" in e.value.message


def test_run_refuses_images_it_cannot_read_before_loading(tmp_path, capsys):
    code, _, err = run_main(["run", tmp_path / "no-artifact", "--image", tmp_path / "missing.png", "--prompt", "x"],
                            capsys)
    assert code == 2 and "no such image file" in err and "missing.png" in err
    code, _, err = run_main(["run", tmp_path / "no-artifact", "--image", tmp_path / "x.png", "--prompt-ids", "2,3"],
                            capsys)
    assert code == 2 and "--image goes with --prompt" in err
    code, _, err = run_main(["chat", tmp_path / "no-artifact", "--image", tmp_path / "missing.png"], capsys)
    assert code == 2 and "no such image file" in err


def test_the_phone_build_shares_one_context_and_its_weights_between_text_and_vision(multimodal_dir, tmp_path_factory,
                                                                                  qnn_sdk):
    """The default build for a phone (weights shared): decode, prefill and the vision encoder compile into one QNN
    context with one weight pool, and the encoder's graph takes what the contract says. The x86 emulator cannot load
    weight-shared contexts, so it is inspected, and its load is refused before anything is loaded."""
    from optimum_qnn.artifacts.inspection import inspect_pte
    from optimum_qnn.artifacts.manifest import read_manifest
    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
    from optimum_qnn.errors import OptimumQnnError
    from optimum_qnn.exporter.pipeline import export
    from optimum_qnn.runtime.images import QNNModelForImageTextToText

    config = ExportConfig(socs=(Soc.SM8650,), quant=QuantScheme.FP16, mode=ExportMode.HYBRID,
                          shapes=ShapeConfig(CTX, AR), embedding_quant=EmbeddingQuant(0, 0), image_tokens=SOFT)
    assert config.weight_sharing  # the default
    out = built_once(tmp_path_factory, "image-fp16-shared",
                     lambda folder: export(multimodal_dir, folder / "out", config).output)
    (variant,) = [p.parent for p in out.glob("qnn/*/*/manifest.json")]
    (context,) = inspect_pte(variant / "model.pte").contexts
    assert sorted(context.delegates) == ["kv_forward[0]", "prefill_forward[0]", "vision_encoder[0]"]
    assert context.weight_sharing and context.shared_weights_bytes > 0
    encoder = read_manifest(variant).runner_contract().method("vision_encoder")
    (graph,) = [g for g in context.graphs if g.name == "vision_encoder"]
    assert [(t.dtype, tuple(t.shape)) for t in graph.inputs] == [(t.dtype, tuple(t.shape)) for t in encoder.inputs]
    assert [tuple(t.shape) for t in graph.outputs] == [tuple(encoder.outputs[0].shape)]
    with pytest.raises(OptimumQnnError, match="shares weights .* x86 HTP emulator cannot load"):
        QNNModelForImageTextToText.from_pretrained(out, device="host:executorch")


def test_what_cannot_take_images_is_refused_by_name(image_export, fp16_export, multimodal_dir, demo_model_dir, tmp_path):
    from optimum_qnn.artifacts.manifest import read_manifest
    import argparse

    from optimum_qnn.cli import add_export_arguments, config_from_args
    from optimum_qnn.config import ExportConfig, ExportMode, QuantScheme, ShapeConfig
    from optimum_qnn.exporter.preflight import preflight
    from optimum_qnn.runtime.backends.runner import check_runner_layout
    from optimum_qnn.runtime.images import QNNModelForImageTextToText

    with pytest.raises(VariantNotFoundError, match="takes images .*: exported for text generation.*--task image-text-to-text"):
        QNNModelForImageTextToText.from_pretrained(fp16_export.output, device="host:onnxruntime")
    (variant,) = [p.parent for p in image_export.glob("qnn/*/*/manifest.json")]
    with pytest.raises(InvalidInputError, match="takes images.*qnn_llama_runner feeds token ids only"):
        check_runner_layout(variant, read_manifest(variant).runner_contract())
    with pytest.raises(InvalidInputError, match="audio is not part"):
        parser = argparse.ArgumentParser()
        add_export_arguments(parser)
        config_from_args(parser.parse_args(["-m", "x", "-o", "y", "--task", "audio-text-to-text"]))
    with pytest.raises(InvalidInputError, match="needs --mode hybrid, not --mode kv"):
        ExportConfig(quant=QuantScheme.A16W8, image_tokens=SOFT, mode=ExportMode.KV)
    with pytest.raises(InvalidInputError, match="--image-tokens must be one of"):
        ExportConfig(quant=QuantScheme.FP16, image_tokens=100)
    with pytest.raises(InvalidInputError, match="--image-tokens 280 takes 283 positions .* --max-seq-len 256"):
        ExportConfig(quant=QuantScheme.FP16, image_tokens=280, shapes=ShapeConfig(256, 32))
    with pytest.raises(UnsupportedModelError, match="no vision tower"):
        from optimum_qnn.quantization.calibration import CalibrationSource

        preflight(str(demo_model_dir), demo_model_dir, ExportConfig(quant=QuantScheme.FP16, image_tokens=SOFT), None,
                  CalibrationSource(), False, None)


def test_a_graph_that_fails_on_the_htp_raises_the_qnn_error_without_a_cpu_retry(image_export):
    """Positions outside the encoder's RoPE tables make its QNN graph fail on the emulator (code 1100). onnxruntime's
    Python session would rebuild itself on the CPU provider alone from a model file already gone, and raise that
    retry's error instead; the backend raises the QNN error, names the method, and the program keeps working."""
    import warnings

    from optimum_qnn.artifacts.manifest import read_manifest
    from optimum_qnn.runtime.backends.onnxruntime import OrtProgram
    from optimum_qnn.sdk.onnxruntime_ep import OrtBackendError
    from tests.runtime.backends.ort_helpers import variant_dirs

    (folder,) = variant_dirs(image_export)
    manifest = read_manifest(folder)
    program = OrtProgram(folder / "model.pte", manifest)
    specs = next(m for m in manifest.contract.methods if m.name == "vision_encoder").inputs
    zeros = [np.zeros(t.shape, dtype=t.dtype) for t in specs]
    outside = [np.full_like(x, 10**6) if t.name.startswith("position") else x for t, x in zip(specs, zeros)]
    with warnings.catch_warnings(record=True) as caught, pytest.raises(OrtBackendError) as error:
        warnings.simplefilter("always")
        program.methods["vision_encoder"](outside)
    assert "vision_encoder" in str(error.value) and "QNN failed to run it" in str(error.value), error.value
    assert "1100" in str(error.value) and "NO_SUCHFILE" not in str(error.value), error.value
    assert not [w for w in caught if "Falling back" in str(w.message)]
    (soft,) = program.methods["vision_encoder"](zeros)
    assert soft.shape == (1, SOFT, soft.shape[-1])
