"""The main job on a built-in default: export a small local Gemma4 to QNN, then generate on the x86 HTP emulator.

1. builds (once, cached) a small Gemma4 text model with every Gemma4 trait on and its own tokenizer, trained for a
   minute on the Python reference docs that CPython ships (examples/tiny_gemma4.py);
2. exports it with the same pipeline as `optimum-cli export qnn` (SM8650, hybrid prefill + decode, calibrated
   16-bit activation / 8-bit weight quantization);
3. loads the artifact with `QNNModelForCausalLM`, generates from a prompt on the HTP emulator, and prints the text,
   tokens/s and a parity line against the fp32 Hugging Face model (greedy, teacher-forced top-1, logits SQNR).

Run with `make demo` (or `python examples/demo.py [--quant fp16] [--out DIR]`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

PROMPT = "The for statement is used to"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE.parent / "out" / "demo")
    parser.add_argument("--quant", default="16a8w", help="quant scheme (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("-v", "--verbose", action="store_true", help="log every stage and show what the libraries print")
    args = parser.parse_args()

    # The commands' console control: without -v, what the libraries print (their warnings, the QNN runtime's
    # "[INFO] [Qnn ExecuTorch]" lines) is held back.
    from optimum_qnn.console import configure_logging, third_party_quiet

    configure_logging(args.verbose)
    print("== 1/3 building the demo Gemma4 (cached after the first run)")
    with third_party_quiet(args.verbose, keep_stdout=True):
        import tiny_gemma4  # transformers' Gemma4 imports torchao, which prints as it loads

        model_dir = tiny_gemma4.build(args.out / "model")

    print(f"== 2/3 exporting to QNN: SM8650, hybrid, {args.quant}")
    with third_party_quiet(args.verbose):
        from optimum_qnn.quantization.calibration import CalibrationSource
        from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
        from optimum_qnn.exporter.pipeline import export

        calib = args.out / "calibration.txt"
        calib.write_text("\n\n".join(tiny_gemma4.corpus().split("\n\n")[:64]))
        config = ExportConfig(
            socs=(Soc.SM8650,),
            quant=QuantScheme.parse(args.quant),
            mode=ExportMode.HYBRID,
            shapes=ShapeConfig(max_seq_len=128, prefill_ar_len=16),
            # 8-bit tables, one group per row, with zero points: per row, a zero point costs 4 bytes in 2 KB.
            embedding_quant=EmbeddingQuant(8, 0, symmetric=False),
            weight_sharing=False,  # the x86 emulator cannot load weight-shared contexts
        )
        t0 = time.time()
        result = export(model_dir, args.out / "artifact", config, calibration=CalibrationSource(file=calib, limit=16))
    print(result.stage_table())
    print(f"export took {time.time() - t0:.0f} s -> {result.variants[0]}")

    print("== 3/3 generating on the x86 HTP emulator")
    with third_party_quiet(args.verbose, keep_stdout=True):
        return _generate(model_dir, args.out / "artifact", config, args.max_new_tokens)


def _generate(model_dir: Path, artifact: Path, config, max_new_tokens: int) -> int:
    from transformers import AutoTokenizer

    from optimum_qnn import StaticCausalLM
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM
    from optimum_qnn.models.gemma4.loading import load_text_model

    tok = AutoTokenizer.from_pretrained(model_dir)
    qnn = QNNModelForCausalLM.from_pretrained(artifact, soc="SM8650", quant=config.quant_tag)
    ids = torch.tensor([tok.bos_token_id] + tok(PROMPT)["input_ids"])
    out = qnn.generate(ids, max_new_tokens=max_new_tokens)
    s = qnn.stats
    print(f"\nprompt : {PROMPT!r}")
    print(f"output : {tok.decode(out[0, len(ids):], skip_special_tokens=True)!r}")
    print(
        f"speed  : time to first token {s.time_to_first_token_s * 1000:.0f} ms, prefill {s.prefill_tokens_per_s:.1f} tok/s, "
        f"decode {s.decode_tokens_per_s:.1f} tok/s (x86 emulator; host overhead {s.host_overhead_share:.1%})"
    )

    hf = load_text_model(model_dir)[0]
    with torch.no_grad():
        ref = hf.generate(ids.unsqueeze(0), max_new_tokens=out.shape[1] - len(ids), do_sample=False, pad_token_id=0, eos_token_id=None)
    new_ref, new_got = ref[0, len(ids):], out[0, len(ids):]
    n = min(len(new_ref), len(new_got))
    same = (new_ref[:n] == new_got[:n]).tolist()
    first = same.index(False) if False in same else n  # greedy tokens equal before the first difference
    static = StaticCausalLM.from_hf(hf, max_context_len=128)
    qnn.backend.session.reset()
    got_logits = qnn.backend.session.feed(ref[0, :-1])
    ref_logits = static.session().feed(ref[0, :-1])
    sqnr = 10 * torch.log10(ref_logits.pow(2).mean() / (got_logits - ref_logits).pow(2).mean())
    # Teacher-forced: at each of the n positions the reference generated, fed the same tokens, do both pick the same
    # next token? A greedy run drifts for good after one near-tie; this counts every position on its own.
    new = slice(len(ids) - 1, len(ids) - 1 + n)
    forced = int((got_logits[new].argmax(-1) == ref_logits[new].argmax(-1)).sum())
    line = f"parity : greedy tokens equal to fp32 Hugging Face for {first} of {n}"
    gap = None
    if first < n:
        top2 = ref_logits[len(ids) - 1 + first].topk(2).values
        gap = float(top2[0] - top2[1])
        line += f" (where they part, fp32's top two logits are {gap:.3f} apart)"
    print(f"{line}; teacher-forced top-1 {forced}/{n}; logits SQNR {sqnr:.1f} dB")
    print(parity_meaning(first, n, gap))
    return 0


def parity_meaning(first: int, n: int, gap: float | None) -> str:
    """The parity line in plain words: which figures are stable, and what a greedy count that stops early means."""
    import textwrap

    text = ("The stable figures are the teacher-forced top-1 and the logits SQNR: at every position both models read "
            "the same tokens and each position counts on its own, so one close call moves them by one position at most. ")
    if first < n:
        text += (f"The greedy count stops at the first token that differs (token {first + 1} of {n}); after it the two "
                 f"texts differ and nothing later is compared. There fp32's own top two logits are {gap:.3f} apart: the "
                 "smaller that gap, the nearer a tie, where either token is a fair pick, and an early stop at a near "
                 "tie says little about the export.")
    else:
        text += f"The greedy count ran to the end: both models generated the same {n} tokens."
    return textwrap.fill(text, width=118, initial_indent=" " * 9, subsequent_indent=" " * 9)

if __name__ == "__main__":
    sys.exit(main())
