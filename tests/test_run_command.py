"""`python -m optimum_qnn run` as a user types it: text in, the text out as it is generated, then one stats line; on
this host by default. Run in this process (the commands' own code); the Hub's `--revision` is in tests/test_hub.py."""

from __future__ import annotations

import pytest

from tests.conftest import run_main

PROMPT = "The for statement"


@pytest.mark.parametrize("chat", [False, True])
def test_run_prompt_prints_the_text_then_one_stats_line(fp16_export, fp16_model, capsys, chat):
    """No --device: the host. The printed text is text_generation's, the last line its stats."""
    code, out, err = run_main(["run", fp16_export.output, "--prompt", PROMPT, "--max-new-tokens", "6",
                            *(["--chat"] if chat else [])], capsys)
    assert code == 0, err
    text, stats = out.rstrip("\n").rsplit("\n", 1)
    want = fp16_model.text_generation(fp16_model.tokenizer(), PROMPT, chat=chat, max_new_tokens=6)
    assert text == want and want.strip()
    prompt_tokens = fp16_model.stats.prompt_tokens
    assert stats.startswith(f"[{prompt_tokens} prompt + {fp16_model.stats.new_tokens} new tokens, stopped by ")
    assert stats.endswith(f"| {fp16_model.device_name}]") and "host" in fp16_model.device_name
    assert "Traceback" not in err and "[INFO]" not in out + err


def test_an_artifact_without_a_tokenizer_takes_ids_and_refuses_text(random_kv_export, capsys):
    """The tiny random model has no tokenizer files: --prompt-ids prints the new ids; text is refused with the fix."""
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    folder = random_kv_export.output
    model = QNNModelForCausalLM.from_pretrained(folder, soc="SM8650")
    want = model.generate([2, 40, 41], max_new_tokens=4)[0, 3:].tolist()
    code, out, err = run_main(["run", folder, "--soc", "SM8650", "--prompt-ids", "2,40,41", "--max-new-tokens", "4"], capsys)
    assert code == 0, err
    ids, stats = out.rstrip("\n").split("\n")
    assert ids == ",".join(map(str, want)) and stats.startswith("[3 prompt + 4 new tokens")
    for argv in (["run", folder, "--soc", "SM8650", "--prompt", "hi"], ["chat", folder, "--soc", "SM8650"],
                 ["serve", folder, "--soc", "SM8650"]):
        code, out, err = run_main(argv, capsys)
        assert code == 2 and "has no tokenizer files" in err and "--prompt-ids" in err, (argv, err)
        assert "Traceback" not in err


def test_the_runner_flag_chooses_the_runner_over_the_environment(fp16_export, capsys, tmp_path, monkeypatch):
    """`--device runner --runner PATH` runs the runner at PATH, not $QNN_LLAMA_RUNNER's: a missing one is named with
    where it came from; an executable without ExecuTorch's backend library beside it is refused with what is missing."""
    monkeypatch.setenv("QNN_LLAMA_RUNNER", str(tmp_path / "from-env"))
    base = ["run", fp16_export.output, "--device", "runner", "--prompt", PROMPT, "--max-new-tokens", "2"]
    code, out, err = run_main([*base, "--runner", tmp_path / "missing"], capsys)
    assert code == 2 and f"The runner {tmp_path / 'missing'} (from runner) does not exist" in err, err
    code, out, err = run_main(base, capsys)
    assert code == 2 and f"The runner {tmp_path / 'from-env'} (from QNN_LLAMA_RUNNER) does not exist" in err, err
    lone = tmp_path / "qnn_llama_runner"
    lone.write_text("#!/bin/sh\nexit 0\n")
    lone.chmod(0o755)
    code, out, err = run_main([*base, "--runner", lone], capsys)
    assert code == 2 and "libqnn_executorch_backend.so" in err and "Traceback" not in err, err
    assert out == ""
