"""The transformers face of `QNNModelForCausalLM` (issue 64): `generate(**tokenizer(...))` gives transformers' own ids
for the same inputs and options, streamers and `pipeline()` agree with it, the attributes code reads are there, a
saved variant loads again, the Python API prints nothing, and the runtime install runs the numpy path.

All on the session's fp16 demo export (no new export), against `Gemma4ForCausalLM` loaded from the demo model.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from optimum_qnn.errors import InvalidInputError, UnsupportedParameterError
from tests.test_runtime_venv import NO_FULL_STACK, _venv_env, runtime_venv  # noqa: F401  (the venv fixture, shared)

PROMPT = "The for statement is used to"
BATCH = ["The for statement", "Assignment statements are used to bind"]


@pytest.fixture(scope="module")
def fp16_model(fp16_export):
    """This file's own load of the session's fp16 export (the tests here set generation options and caches on it)."""
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    return QNNModelForCausalLM.from_pretrained(fp16_export.output, soc="SM8650", quant="fp16")


@pytest.fixture(scope="module")
def tok(fp16_export):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(fp16_export.output)
    tokenizer.padding_side = "left"
    return tokenizer


@pytest.fixture(scope="module")
def hf(demo_model_dir, fp16_model):
    from optimum_qnn.models.gemma4.loading import load_text_model

    model = load_text_model(demo_model_dir)[0]
    model.generation_config = fp16_model.generation_config  # the artifact keeps the checkpoint's
    return model


CASES = {
    "greedy": dict(max_new_tokens=10),
    "min_new_tokens": dict(max_new_tokens=12, min_new_tokens=12),
    "repetition_penalty": dict(max_new_tokens=12, repetition_penalty=1.5),
    "max_length": dict(max_length=14),
    "stop_strings": dict(max_new_tokens=20, stop_strings=["the"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_generate_gives_transformers_ids(fp16_model, hf, tok, case):
    kwargs = dict(CASES[case], **({"tokenizer": tok} if "stop_strings" in CASES[case] else {}))
    inputs = tok(PROMPT, return_tensors="pt")
    with torch.no_grad():
        ref = hf.generate(**inputs, **kwargs)
    out = fp16_model.generate(**inputs, **kwargs)
    assert isinstance(out, torch.Tensor) and out.tolist() == ref.tolist()
    if case == "stop_strings":  # it stopped on the string, before max_new_tokens
        assert out.shape[1] - inputs["input_ids"].shape[1] < 20 and tok.decode(out[0]).endswith("the")
        assert fp16_model.stats.stopped_by == "stop_criteria"


def test_a_left_padded_batch_of_two_gives_transformers_ids(fp16_model, hf, tok):
    batch = tok(BATCH, return_tensors="pt", padding=True)
    assert (batch["attention_mask"] == 0).any()  # one row is padded
    with torch.no_grad():
        ref = hf.generate(**batch, max_new_tokens=8)
    assert fp16_model.generate(**batch, max_new_tokens=8).tolist() == ref.tolist()


def test_seeded_sampling_repeats_and_draws_as_transformers(fp16_model, hf, tok):
    from transformers import set_seed

    inputs = tok(PROMPT, return_tensors="pt")
    runs = []
    for seed_with in (torch.manual_seed, set_seed, torch.manual_seed):
        seed_with(3)
        runs.append(fp16_model.generate(**inputs, max_new_tokens=10, do_sample=True, top_k=0).tolist())
    torch.manual_seed(3)
    with torch.no_grad():
        ref = hf.generate(**inputs, max_new_tokens=10, do_sample=True, top_k=0).tolist()
    assert runs[0] == runs[1] == runs[2] == ref
    torch.manual_seed(4)
    assert fp16_model.generate(**inputs, max_new_tokens=10, do_sample=True, top_k=0).tolist() != ref
    torch.manual_seed(5)
    many = fp16_model.generate(**inputs, max_new_tokens=6, do_sample=True, num_return_sequences=3)
    assert many.shape[0] == 3 and len({tuple(r) for r in many.tolist()}) > 1  # sampled rows one after another


def test_streamers_text_equals_the_output(fp16_model, tok, capsys):
    from transformers import TextIteratorStreamer, TextStreamer

    inputs = tok(PROMPT, return_tensors="pt")
    out = fp16_model.generate(**inputs, max_new_tokens=10, min_new_tokens=10, streamer=TextStreamer(tok))
    assert capsys.readouterr().out == tok.decode(out[0]) + "\n"
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=fp16_model.generate(
        **inputs, max_new_tokens=10, min_new_tokens=10, streamer=streamer)))
    worker.start()
    text = "".join(streamer)
    worker.join()
    assert text == tok.decode(result["out"][0, inputs["input_ids"].shape[1]:]) and text.strip()


def test_calls_from_several_threads_take_turns(fp16_model, tok):
    """Three threads generating at once each get the ids one thread alone gets (interleaved calls would read each
    other's K/V)."""
    inputs = tok(BATCH, return_tensors="pt", padding=True)
    rows = [{k: v[i: i + 1][:, v.shape[1] - int(inputs["attention_mask"][i].sum()):] for k, v in inputs.items()}
            for i in range(2)]
    alone = [fp16_model.generate(**row, max_new_tokens=12, do_sample=False).tolist() for row in rows]
    got: dict[int, list] = {}
    threads = [threading.Thread(target=lambda i=i: got.update({i: fp16_model.generate(
        **rows[i % 2], max_new_tokens=12, do_sample=False).tolist()})) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(3)] == [alone[0], alone[1], alone[0]]


def test_pipeline_outputs_equal_generate_decoded(fp16_model, tok, caplog):
    from transformers import pipeline

    pipe = pipeline("text-generation", model=fp16_model, tokenizer=tok)
    options = dict(max_new_tokens=8, do_sample=False)

    def decoded(text: str, *, full: bool = True) -> str:
        ids = tok(text, return_tensors="pt")
        out = fp16_model.generate(**ids, **options)
        return tok.decode(out[0] if full else out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)

    assert pipe(PROMPT, **options) == [{"generated_text": decoded(PROMPT)}]
    assert pipe(BATCH, return_full_text=False, **options) == [[{"generated_text": decoded(t, full=False)}] for t in BATCH]
    messages = [{"role": "user", "content": "for"}]
    (chat,) = pipe(messages, **options)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = fp16_model.generate(**ids, **options)
    reply = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert chat["generated_text"][-1] == {"role": "assistant", "content": reply}
    assert not [r for r in caplog.records if "is not supported for text-generation" in r.getMessage()]


def test_the_attributes_code_reads(fp16_model, demo_model_dir):
    from transformers import GenerationConfig

    config = json.loads((demo_model_dir / "config.json").read_text())
    assert fp16_model.config.model_type == config["model_type"]
    assert fp16_model.config.vocab_size == fp16_model.contract.vocab_size
    assert isinstance(fp16_model.generation_config, GenerationConfig)
    assert fp16_model.generation_config.eos_token_id == 1  # the checkpoint's generation_config.json
    assert fp16_model.device == torch.device("cpu") and fp16_model.dtype == torch.float32
    assert fp16_model.device_name.startswith("host:")
    assert fp16_model.to("cpu") is fp16_model.eval() is fp16_model.cpu() is fp16_model
    assert fp16_model.can_generate()


def test_return_dict_with_scores(fp16_model, tok):
    inputs = tok(PROMPT, return_tensors="pt")
    out = fp16_model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, return_dict_in_generate=True,
                              output_scores=True, output_logits=True)
    new = out.sequences[0, inputs["input_ids"].shape[1]:]
    assert len(out.scores) == len(out.logits) == 4
    assert [int(s[0].argmax()) for s in out.scores] == new.tolist()


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_beams=2), "num_beams=2"),
    (dict(assistant_model=object()), "assistant_model"),
    (dict(output_attentions=True), "output_attentions"),
    (dict(typical_p=0.5, do_sample=True), "typical_p"),
    (dict(num_return_sequences=2), "needs do_sample=True"),
    (dict(stop_strings=["x"]), "needs the tokenizer"),
    (dict(max_new_tokens=3, frobnicate=1), "unexpected keyword argument.*frobnicate"),
    (dict(pixel_values=torch.zeros(1)), "unexpected keyword argument.*pixel_values"),
    (dict(past_key_values=object()), "past_key_values"),
])
def test_what_the_program_cannot_do_is_refused_by_name(fp16_model, tok, kwargs, match):
    with pytest.raises(InvalidInputError, match=match):
        fp16_model.generate(**tok(PROMPT, return_tensors="pt"), **kwargs)


def test_right_padding_and_speculative_history_are_refused(fp16_model, tok):
    ids = torch.tensor([[40, 41, 0]])
    with pytest.raises(InvalidInputError, match="left padding"):
        fp16_model.generate(ids, attention_mask=torch.tensor([[1, 1, 0]]), max_new_tokens=2)
    with pytest.raises(UnsupportedParameterError, match="repetition_penalty"):
        fp16_model.generate(**tok(PROMPT, return_tensors="pt"), repetition_penalty=1.2, speculative="lookahead")


def test_numpy_in_numpy_out_with_the_numpy_rules(fp16_model, tok):
    """A numpy generator selects the numpy rules (the runtime install's): the same ids as transformers' processors."""
    inputs = tok(PROMPT, return_tensors="np")
    rules = dict(max_new_tokens=10, min_new_tokens=10, repetition_penalty=1.5)
    torch_ids = fp16_model.generate(**tok(PROMPT, return_tensors="pt"), **rules)
    out = fp16_model.generate(**inputs, generation_config=rules, generator=np.random.default_rng(0))
    assert isinstance(out, np.ndarray) and out.tolist() == torch_ids.tolist()
    sampled = [fp16_model.generate(**inputs, max_new_tokens=8, do_sample=True, top_p=0.9,
                                   generator=np.random.default_rng(11)).tolist() for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_save_pretrained_loads_again(fp16_model, tok, tmp_path):
    from optimum_qnn import QNNModelForCausalLM

    folder = fp16_model.save_pretrained(tmp_path / "saved")
    again = QNNModelForCausalLM.from_pretrained(folder)
    inputs = tok(PROMPT, return_tensors="pt")
    assert again.generate(**inputs, max_new_tokens=6).tolist() == fp16_model.generate(**inputs, max_new_tokens=6).tolist()
    with pytest.raises(InvalidInputError, match="already holds an artifact"):
        fp16_model.save_pretrained(folder)
    plan = fp16_model.push_to_hub("me/gemma4-qnn", dry_run=True)  # the export's push, of the loaded variant
    variant = fp16_model.variant.resolve().relative_to(fp16_model.root.resolve()).as_posix()
    assert [c.variant for c in plan.commits] == [None, variant]
    assert {"config.json", "generation_config.json", "qnn_index.json"} <= set(plan.files)
    assert any(f.startswith(f"{variant}/") and f.endswith(".pte") for f in plan.files)


QUIET = """
import sys
from transformers import AutoTokenizer
from optimum_qnn import QNNModelForCausalLM
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = QNNModelForCausalLM.from_pretrained(sys.argv[1])
out = model.generate(**tok("The for statement is used to", return_tensors="pt"), max_new_tokens=4)
print(out.shape[1])
"""


def test_loading_and_generating_print_nothing_to_stderr(fp16_export, run_python):
    proc = run_python("-c", QUIET, str(fp16_export.output))
    assert proc.returncode == 0 and proc.stdout.strip().isdigit(), proc.stderr[-3000:]
    assert proc.stderr == ""


VENV_SCRIPT = r"""
import json, sys
import numpy as np
from optimum_qnn import QNNModelForCausalLM
args = json.loads(sys.argv[1])
model = QNNModelForCausalLM.from_pretrained(args["folder"])
ids, mask = np.array(args["ids"]), np.array(args["mask"])
out = model.generate(input_ids=ids, attention_mask=mask, generation_config=args["config"])
scored = model.generate(ids[1:], attention_mask=mask[1:], max_new_tokens=3, return_dict_in_generate=True,
                        output_scores=True)
stopped = model.generate(args["stop_ids"], max_new_tokens=20, stop_strings=["the"], tokenizer=model.tokenizer())
sampled = [model.generate(ids[1:], max_new_tokens=6, do_sample=True, generator=np.random.default_rng(5)).tolist()
           for _ in range(2)]
print("RESULT " + json.dumps({
    "type": type(out).__name__, "out": out.tolist(), "scores": len(scored.scores),
    "argmax": [int(s[0].argmax()) for s in scored.scores], "scored": scored.sequences.tolist(),
    "stopped": model.tokenizer().decode(stopped[0].tolist()), "sampled": sampled,
    "model_type": model.config.model_type, "eos": model.generation_config["eos_token_id"],
}))
"""


def test_the_runtime_install_runs_the_numpy_path(fp16_model, fp16_export, tok, runtime_venv):
    """In a venv with neither torch nor transformers: numpy in and out, a dict generation_config, the numpy rules
    giving transformers' ids (the processors here), scores, stop_strings and seeded sampling; nothing on stderr."""
    import subprocess

    python = runtime_venv
    batch = tok(BATCH, return_tensors="pt", padding=True)
    config = {"max_new_tokens": 8, "min_new_tokens": 8, "repetition_penalty": 1.3}
    ref = fp16_model.generate(**batch, **config).tolist()
    args = {"folder": str(fp16_export.output), "ids": batch["input_ids"].tolist(),
            "mask": batch["attention_mask"].tolist(), "config": config,
            "stop_ids": tok(PROMPT)["input_ids"]}  # its greedy continuation has "the" (the stop_strings case above)
    proc = subprocess.run([str(python), "-c", NO_FULL_STACK + VENV_SCRIPT, json.dumps(args)], capture_output=True, text=True,
                          timeout=1800, env=_venv_env(), cwd=python.parent)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert got["type"] == "ndarray" and got["out"] == ref
    assert got["scores"] == 3 and got["argmax"] == got["scored"][0][-3:]
    assert got["stopped"].endswith("the") and got["sampled"][0] == got["sampled"][1]
    assert got["model_type"] == fp16_model.config.model_type and got["eos"] == 1
    assert proc.stderr == ""


def test_defaults_are_transformers(fp16_model, hf, tok):
    """No length given: 20 new tokens whatever the prompt's length, as transformers counts its default max_length."""
    inputs = tok(BATCH[1], return_tensors="pt")
    with torch.no_grad():
        ref = hf.generate(**inputs, min_new_tokens=20)
    out = fp16_model.generate(**inputs, min_new_tokens=20)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 20 and out.tolist() == ref.tolist()


def test_on_the_runner_stop_strings_cut_and_what_it_cannot_apply_is_refused(fp16_export, tok, tmp_path, monkeypatch):
    """ExecuTorch's runner chooses its own tokens (a stand-in answers here, as test_device_runner's): stop_strings cut
    its output and its stream, and options it cannot apply are refused before it runs."""
    from optimum_qnn import QNNModelForCausalLM
    from tests.test_device_runner import _stand_in

    monkeypatch.setenv("OPTIMUM_QNN_RUNNER_WORKSPACE", str(tmp_path / "workspace"))
    runner, reply, record = _stand_in(tmp_path / "build")
    model = QNNModelForCausalLM.from_pretrained(fp16_export.output, device="runner", runner=runner)
    reply.write_text(json.dumps({"text": " the loop body runs for each item", "n": 18}))
    inputs = tok(PROMPT, return_tensors="pt")
    streamed = []

    class Collect:
        def put(self, value):
            streamed.extend(value.reshape(-1).tolist())

        def end(self):
            streamed.append("end")

    out = model.generate(**inputs, max_new_tokens=24, stop_strings=["body"], tokenizer=tok, streamer=Collect())
    assert tok.decode(out[0, inputs["input_ids"].shape[1]:]) == " the loop body"
    assert streamed == out[0].tolist() + ["end"] and model.stats.stopped_by == "stop_criteria"
    runs = record.stat().st_mtime_ns
    for kwargs, name in ((dict(do_sample=True), "top_k"), (dict(repetition_penalty=1.2), "repetition_penalty"),
                         (dict(min_new_tokens=3), "min_new_tokens"), (dict(output_scores=True), "output_scores")):
        with pytest.raises(UnsupportedParameterError, match=f"{name}.*temperature only") as e:
            model.generate(**inputs, max_new_tokens=4, return_dict_in_generate=True, **kwargs)
        assert e.value.param == name
    assert record.stat().st_mtime_ns == runs  # refused before the runner ran
    model.generate(**inputs, max_new_tokens=4, do_sample=True, top_k=0, temperature=0.7)
    args = json.loads(record.read_text())["args"]
    assert float(args[args.index("--temperature") + 1]) == 0.7
