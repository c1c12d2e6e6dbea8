"""QNNModelForCausalLM on the x86 emulator: streaming, sampling, stats, and bad input."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from optimum_qnn.errors import ContextOverflowError, InvalidInputError, OptimumQnnError
from optimum_qnn.artifacts.manifest import ManifestError
from optimum_qnn.runtime.generation import pick as _pick
from optimum_qnn.runtime.modeling import QNNModelForCausalLM, VariantNotFoundError
from tests.conftest import FP16_CTX, FP16_PREFILL
from tests.greedy import assert_greedy_agrees


class Collect:
    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, t):
        self.tokens += t.tolist()

    def end(self):
        self.ended = True


def test_streamer_sampling_and_stats(fp16_model):
    prompt = torch.tensor([2, 40, 41, 42])
    streamer = Collect()
    out = fp16_model.generate(prompt, max_new_tokens=8, streamer=streamer, eos_token_id=[])
    assert streamer.ended and streamer.tokens == out[0].tolist()  # the prompt first, as transformers streams
    s = fp16_model.stats
    assert s.new_tokens == 8 and s.stopped_by == "max_new_tokens"
    assert s.time_to_first_token_s > 0 and s.decode_tokens_per_s > 0
    # Host overhead is the decode steps' time outside the .pte's execute call. Time spent in the host per step (here
    # 50 ms before each decode call) is outside it by construction, so the share must cover at least that much.
    session, host_s = fp16_model.backend.session, 0.05
    feed = session.feed

    def slow_host_feed(ids, *rest):
        time.sleep(host_s)
        return feed(ids, *rest)

    session.feed = slow_host_feed
    try:
        fp16_model.generate(prompt, max_new_tokens=8, eos_token_id=[])
    finally:
        del session.feed
    s = fp16_model.stats
    # (the prefill call is slowed too, but is not a decode step)
    assert s.host_overhead_share >= host_s * len(s.step_times) / sum(s.step_times) - 1e-6 > 0, s
    runs = [
        fp16_model.generate(prompt, max_new_tokens=8, do_sample=True, temperature=0.9, top_k=20, top_p=0.9,
                            eos_token_id=[], generator=torch.Generator().manual_seed(7)).tolist()
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_constant_metadata_methods_read_back_from_the_pte(fp16_export, demo_model_dir):
    """The .pte's constant methods (what ExecuTorch's Qualcomm LLM runner reads) hold the demo model's values,
    read back through the ExecuTorch runtime and checked against its config.json, not the exporter's own code."""
    from executorch.runtime import Runtime

    config = json.loads((demo_model_dir / "config.json").read_text())
    program = Runtime.get().load_program(fp16_export.variants[0] / "model.pte")
    expected = {
        "get_max_seq_len": FP16_CTX, "get_max_context_len": FP16_CTX, "get_ar_len": FP16_PREFILL,
        "get_vocab_size": config["vocab_size"], "get_dim": config["hidden_size"], "get_n_layers": config["num_hidden_layers"],
        "get_head_dim": config["head_dim"], "get_global_head_dim": config["per_layer_config"]["2"]["head_dim"],
        "get_n_kv_heads": config["num_key_value_heads"], "get_sliding_window": config["sliding_window"],
        "get_n_self_layers": config["num_hidden_layers"] - config["num_kv_shared_layers"],
        "get_num_kv_shared_layers": config["num_kv_shared_layers"],
        "get_bos_id": config["bos_token_id"], "get_eos_id": config["eos_token_id"],
        "get_max_batch_size": 1, "get_use_kv_cache": True, "get_kv_io_bit_width": 32,
    }
    assert set(expected) <= set(program.method_names)
    got = {name: program.load_method(name).execute([])[0] for name in expected}
    assert got == expected


# A minimal template (the demo tokenizer ships none): what `chat=True` must render and tokenize.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}model:{% endif %}"


def test_text_generation_plain_and_chat(fp16_model, demo_model_dir):
    """The README's headline call: text in, text out, with and without the chat template, equal to Hugging Face
    greedy decoding of the same prompt ids."""
    from transformers import AutoTokenizer

    from optimum_qnn.models.gemma4.loading import load_text_model

    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    hf = load_text_model(demo_model_dir)[0]

    def hf_text(ids: list[int]) -> str:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        return tok.decode(ref[0, len(ids):], skip_special_tokens=True)

    prompt = "The for statement"
    plain = fp16_model.text_generation(tok, prompt, max_new_tokens=12, eos_token_id=[])
    assert fp16_model.stats.prompt_tokens == len(tok(prompt)["input_ids"])
    assert plain == hf_text(tok(prompt)["input_ids"]) and plain.strip()

    tok.chat_template = CHAT_TEMPLATE
    chat = fp16_model.text_generation(tok, prompt, chat=True, max_new_tokens=12, eos_token_id=[])
    chat_ids = tok(f"user: {prompt}\nmodel:", add_special_tokens=False)["input_ids"]
    assert fp16_model.stats.prompt_tokens == len(chat_ids)
    assert chat == hf_text(chat_ids) and chat.strip()
    print(f"text_generation: {plain!r}; chat: {chat!r}")


# --- sampling: `_pick` against the distributions it must draw from (synthetic logits, no export) --------------

SAMPLES = 4000


def draw(logits: torch.Tensor, seed: int = 0, **kwargs) -> torch.Tensor:
    """Token counts of SAMPLES draws of `_pick(logits, do_sample=True, **kwargs)`."""
    gen = torch.Generator().manual_seed(seed)
    args = {"temperature": 1.0, "top_k": None, "top_p": None, **kwargs}
    picks = [_pick(logits, True, args["temperature"], args["top_k"], args["top_p"], gen) for _ in range(SAMPLES)]
    return torch.bincount(torch.tensor(picks), minlength=logits.numel()).double()


def assert_frequencies(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Every token's count lies within 5 binomial standard deviations of ``probs`` (tokens of p=0 never drawn);
    the draws are seeded, so this either always passes or always fails."""
    expected = probs.double() * SAMPLES
    sd = (expected * (1 - probs.double())).sqrt()
    assert torch.equal(counts > 0, probs > 0), (counts.tolist(), probs.tolist())
    assert ((counts - expected).abs() <= 5 * sd + 1e-9).all(), (counts.tolist(), expected.tolist())


def entropy(counts: torch.Tensor) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def test_top_k_1_is_greedy():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(257, generator=gen) * 3
        for t in (0.3, 1.0, 5.0):
            assert _pick(logits, True, t, 1, None, gen) == _pick(logits, False, t, None, None, None) == int(logits.argmax())


def test_top_k_keeps_the_k_best_in_proportion():
    logits = torch.tensor([2.0, 0.5, 1.5, -1.0, 1.0, 0.0])
    probs = torch.zeros(6)
    probs[[0, 2, 4]] = torch.softmax(logits[[0, 2, 4]], -1)
    assert_frequencies(draw(logits, top_k=3), probs)


def test_top_p_keeps_exactly_the_nucleus():
    """Probabilities 0.5, 0.25, 0.15, 0.07, 0.03: top_p=0.8 keeps the smallest set reaching 0.8, i.e. the first
    three (0.5 + 0.25 = 0.75 falls short; the token that crosses is kept), renormalized to 0.5/0.9, ..."""
    probs = torch.tensor([0.03, 0.5, 0.07, 0.25, 0.15])  # shuffled: the nucleus is found by sorting
    logits = probs.log()
    nucleus = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.15]) / 0.9
    assert_frequencies(draw(logits, top_p=0.8), nucleus)
    assert_frequencies(draw(logits, top_p=0.4), torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]))  # the top token alone
    assert_frequencies(draw(logits, top_p=1.0), probs)  # 1.0 disables the filter


def test_temperature_scales_the_distribution():
    """Draws follow softmax(logits / T): T < 1 sharpens (lower entropy), T > 1 flattens."""
    logits = torch.tensor([1.0, 0.2, -0.5, 0.8, -1.5, 0.0])
    counts = {t: draw(logits, temperature=t) for t in (0.5, 1.0, 2.0)}
    for t, c in counts.items():
        assert_frequencies(c, torch.softmax(logits / t, -1))
    assert entropy(counts[0.5]) < entropy(counts[1.0]) < entropy(counts[2.0])
    with pytest.raises(InvalidInputError, match="temperature must be a finite number > 0"):
        _pick(logits, True, 0.0, None, None, None)


def test_kv_mode_greedy_matches_hf_for_32_tokens(demo_kv_export, demo_model_dir):
    """A kv-mode export (decode method only) of the demo Gemma4 (window 16): prompts shorter and longer than the
    window, 32 new tokens each, identical to Hugging Face `generate` up to a near tie of its fp32 logits (tests/greedy.py)."""
    from transformers import AutoTokenizer

    from optimum_qnn.models.gemma4.loading import load_text_model

    hf = load_text_model(demo_model_dir)[0]
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    model = QNNModelForCausalLM.from_pretrained(demo_kv_export)
    assert [m.name for m in model.contract.methods] == ["kv_forward"]
    texts = ["The for statement", "Assignment statements are used to (re)bind names to values and to modify attributes"]
    prompts = [torch.tensor([2] + tok(t)["input_ids"]) for t in texts]
    assert len(prompts[0]) < 16 < len(prompts[1])
    for prompt in prompts:
        with torch.no_grad():
            ref = hf.generate(prompt.unsqueeze(0), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        got = model.generate(prompt, max_new_tokens=32, eos_token_id=[])[0].tolist()
        assert_greedy_agrees(got, ref.sequences[0].tolist(), torch.cat(ref.logits), len(prompt))  # tests/greedy.py


def test_bad_input(fp16_model):
    with pytest.raises(InvalidInputError, match="empty"):
        fp16_model.generate(torch.tensor([], dtype=torch.long))
    with pytest.raises(ContextOverflowError, match=f"exported context holds {FP16_CTX}"):
        fp16_model.generate(torch.full((FP16_CTX + 1,), 5))
    with pytest.raises(InvalidInputError, match=r"Token ids must lie in \[0, 512\)"):
        fp16_model.generate(torch.tensor([2, 600]))


def test_generation_stops_at_the_context_end(fp16_model):
    prompt = torch.full((FP16_CTX - 3,), 7)
    out = fp16_model.generate(prompt, max_new_tokens=10, eos_token_id=[])
    assert out.shape[1] == (FP16_CTX - 3) + 4  # 3 free slots, plus the last token, which needs none
    assert fp16_model.stats.stopped_by == "context_full"


def test_variant_selection_errors(fp16_export):
    with pytest.raises(VariantNotFoundError, match=f"available: SM8650/fp16/ctx{FP16_CTX}/hybrid"):
        QNNModelForCausalLM.from_pretrained(fp16_export.output, soc="SM8750")


@pytest.fixture()
def artifact_copy(fp16_export, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(fp16_export.output, dst)
    return dst, dst / fp16_export.variants[0].relative_to(fp16_export.output)


def test_tampered_program_fails_the_sha256_check(artifact_copy):
    root, variant = artifact_copy
    data = bytearray((variant / "model.pte").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (variant / "model.pte").write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="model.pte does not match its manifest sha256"):
        QNNModelForCausalLM.from_pretrained(root)


def share_weights_in_manifest(variant) -> None:
    """Make a variant's manifest say its program shares weights (the phone build), the file left as it is."""
    d = json.loads((variant / "manifest.json").read_text())
    d["contract"]["weight_sharing"] = True
    (variant / "manifest.json").write_text(json.dumps(d))


def test_a_weight_shared_program_is_refused_on_x86_before_loading(artifact_copy, fp16_model):
    """The x86 emulator cannot load weight-shared contexts: such a variant is refused with the fix, even when the
    same file is loaded in this process already (fp16_model holds it, and the program cache would hand it out)."""
    root, variant = artifact_copy
    share_weights_in_manifest(variant)
    with pytest.raises(OptimumQnnError, match=r"shares weights .* x86 HTP emulator cannot load.*--no-weight-sharing"):
        QNNModelForCausalLM.from_pretrained(root)


def test_truncated_program_with_matching_manifest_is_refused_cleanly(artifact_copy):
    from optimum_qnn.artifacts.manifest import file_entry, read_manifest

    root, variant = artifact_copy
    pte = variant / "model.pte"
    pte.write_bytes(pte.read_bytes()[:4096])
    m = read_manifest(variant)
    entry = file_entry(variant, "model.pte")
    d = json.loads(m.to_json())
    d["program"] = d["files"][0] = {"path": entry.path, "size": entry.size, "sha256": entry.sha256}
    (variant / "manifest.json").write_text(json.dumps(d))
    index_before = (root / "qnn_index.json").read_bytes()
    with pytest.raises(OptimumQnnError, match="corrupt or not an ExecuTorch program"):
        QNNModelForCausalLM.from_pretrained(root)
    assert (root / "qnn_index.json").read_bytes() == index_before  # a refused load writes nothing


def test_generation_stops_at_a_callers_eos_on_the_host(fp16_model):
    """Every other host test passes eos_token_id=[]: here the first greedy token is made the end token."""
    prompt = torch.tensor([2, 40, 41, 42])
    free = fp16_model.generate(prompt, max_new_tokens=4, eos_token_id=[])
    first = int(free[0, prompt.numel()])
    stopped = fp16_model.generate(prompt, max_new_tokens=4, eos_token_id=[first])
    assert stopped[0, prompt.numel():].tolist() == [first]
    assert fp16_model.stats.stopped_by == "eos" and fp16_model.stats.new_tokens == 1
