"""Command-line front ends: `optimum-cli export qnn ...` and `python -m optimum_qnn export|generate|doctor`.

Arguments map onto the frozen `ExportConfig`; nothing else is passed around. Heavy imports happen in the
handlers, so `--help` is fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from optimum_qnn.config import (
    BLOCK_SIZES,
    CacheLayout,
    DEFAULT_CONTEXT,
    DEFAULT_DRAFT_LEN,
    DEFAULT_IMAGE_TOKENS,
    EmbeddingQuant,
    IMAGE_TASK,
    TEXT_TASK,
    ExportConfig,
    ExportMode,
    Lookahead,
    RECIPES,
    QuantScheme,
    ShapeConfig,
    SizeBudget,
    Soc,
    WeightRanges,
    WeightRounding,
    recipe_fields,
)
from optimum_qnn.console import configure_logging, third_party_quiet
from optimum_qnn.errors import InvalidInputError, OptimumQnnError
from optimum_qnn.host_memory import parse_max_memory

logger = logging.getLogger(__name__)

_DEFAULTS = ExportConfig()


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Export a Gemma4 text model (Hugging Face Hub id or local folder) to a QNN .pte for Snapdragon HTPs.\n"
        "The model is loaded, calibrated and converted for QNN once per --quant scheme; each --soc adds only its own "
        "partitioning, compile and write, and gets one variant. --ray runs each (scheme, SoC) lowering on a Ray "
        "cluster."
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    req = parser.add_argument_group("required")
    req.add_argument("-m", "--model", required=True, help="Hub model id (e.g. google/gemma-4-e2b) or local checkpoint folder")
    req.add_argument("-o", "--output", required=True, type=Path, help="artifact folder (other variants in it are kept)")
    opt = parser.add_argument_group("target and precision")
    opt.add_argument(
        "--soc", nargs="+", default=[s.value for s in _DEFAULTS.socs], metavar="SOC",
        help="one or more target SoCs, named as ExecuTorch names them: "
        + ", ".join(f"{s.value} ({s.info.marketing or s.info.device}, v{s.htp_arch})" for s in Soc)
        + "; what each HTP arch supports: the SoC table in docs/exporting.md (default: %(default)s)",
    )
    opt.add_argument(
        "--quant", nargs="+", default=[_DEFAULTS.quant.value], metavar="SCHEME",
        help=f"quantization of the HTP graph: {', '.join(q.value for q in QuantScheme)}, or a recipe: "
             f"{', '.join(RECIPES)} (16a4w_e2b: 4-bit with an 8-bit sensitivity plan; default: %(default)s); "
             "several: each is calibrated once and gets a variant per --soc",
    )
    opt.add_argument(
        "--size-budget", default=None, metavar="SHARE%|GB",
        help="4-bit schemes: keep the linears whose 4-bit rounding most changes the logits at 8 bits, within this "
             "share of the linear weights (e.g. '25%%') or this size of the HTP linear weights (e.g. '1.3GB'); the "
             "plan and each linear's measured sensitivity are printed and recorded in the manifest",
    )
    opt.add_argument(
        "--weight-ranges", default=None, choices=[w.value for w in WeightRanges],
        help="4-bit weight scales: min-max, or clipped per channel by output error on the calibration text "
             "(default: minmax; output-mse in the 16a4w_e2b recipe)",
    )
    opt.add_argument(
        "--weight-rounding", default=None, choices=[w.value for w in WeightRounding],
        help="4-bit weights: round each to the nearest level, or by GPTQ (column by column, errors compensated on "
             "the calibration activations) (default: nearest)",
    )
    opt.add_argument("--block-size", type=int, default=_DEFAULTS.block_size, choices=BLOCK_SIZES, help="block size of 16a4w_block (default: %(default)s)")
    opt.add_argument(
        "--embedding-quant", default=None, metavar="BITS,GROUP",
        help="weight-only quantization of the CPU-side embedding tables: '4,32', '8,0' (per row) or 'none'; symmetric "
             "with fp16 scales, or with zero points and fp32 scales with ',asym' (e.g. '4,32,asym'; larger) (default: "
             "none for fp16; else 4-bit symmetric in groups of 32, or of 16 or 8 when 32 does not divide the model's width)",
    )
    opt.add_argument(
        "--quant-override", action="append", default=[], metavar="REGEX=SCHEME",
        help="keep modules whose path matches REGEX at SCHEME, e.g. 'lm_head=16a8w' (repeatable; first match wins)",
    )
    opt.add_argument("--mode", default=_DEFAULTS.mode.value, choices=[m.value for m in ExportMode],
                     help="hybrid: prefill + decode methods in one .pte; kv: decode only; lookahead: hybrid whose decode "
                          "call verifies guessed n-grams (ExecuTorch's runner: --eval_mode 2) (default: %(default)s)")
    for flag, default, what in (("--ngram", 5, "N, the length of the guessed n-grams"),
                                ("--window", 8, "W, future positions the lookahead branch guesses per call"),
                                ("--gcap", 8, "G, candidate n-grams verified per call")):
        opt.add_argument(flag, type=int, default=None,
                         help=f"--mode lookahead: {what} (default: {default}); the decode call takes next_pow2((W + G) * (N - 1)) tokens")
    opt.add_argument("--max-seq-len", type=int, default=None,
                     help=f"context length C (default: {DEFAULT_CONTEXT}, or the model's max_position_embeddings or the "
                          "largest context the target's HTP compiles where that is less; why 4096: docs/exporting.md)")
    opt.add_argument("--prefill-ar-len", type=int, default=_DEFAULTS.shapes.prefill_ar_len, help="tokens per prefill call (default: %(default)s)")
    opt.add_argument("--cache-layout", default=None, choices=[c.value for c in CacheLayout],
                     help="full: every KV cache holds C - ar slots (what ExecuTorch's C++ qnn_llama_runner reads); ring: "
                          "sliding-window layers keep only their window (a ring buffer), so each call moves fewer cache "
                          "bytes; blocks: the ring, and each other cache cut into column blocks that fit the HTP's TCM "
                          "(contexts the full layout cannot compile). ring and blocks are for optimum-qnn's own runtimes, "
                          "refused by the C++ runner (default: full, or blocks where the target's HTP cannot compile "
                          "the context in full; the export says so)")
    opt.add_argument("--task", default=TEXT_TASK, metavar="TASK",
                     help=f"{TEXT_TASK}: the text decoder; {IMAGE_TASK}: the vision encoder too, its soft tokens taken "
                          "by the decoder's prefill (audio is not built) (default: %(default)s)")
    opt.add_argument("--image-tokens", type=int, default=None, metavar="N",
                     help=f"--task {IMAGE_TASK}: soft tokens per image, one of 70, 140, 280, 560, 1120 (Hugging Face's "
                          f"budgets; default: {DEFAULT_IMAGE_TOKENS})")
    opt.add_argument("--no-weight-sharing", action="store_true",
                     help="give the prefill and decode graphs separate weights (needed to run a hybrid .pte on the x86 emulator)")
    opt.add_argument("--check-weight-sharing", action="store_true",
                     help="also lower without weight sharing and check with QNN's System library that both builds hold the "
                          "same graphs, IO and encodings, the shared one storing its weights once; the result goes into "
                          "the manifest (one more lowering per SoC)")
    opt.add_argument("--float-io", action="store_true",
                     help="quantized schemes: keep the masks, KV caches and logits float32 at the graph boundary "
                          "(default: uint16, as ExecuTorch's Qualcomm runner expects)")
    mem = parser.add_argument_group("memory")
    mem.add_argument("--shards", type=int, default=None, metavar="N",
                     help="split the decoder layers into N QNN contexts, compiled in worker processes (up to one per core, "
                          "while the estimated peak fits --max-memory): lower peak memory when lowering big models "
                          "(default: the fewest whose estimated peak fits --max-memory, at least ExecuTorch's "
                          "per-shard size: 4 for Gemma-4-E2B); the layers are split so the shards' parameters are "
                          "as even as contiguous layers allow")
    mem.add_argument("--max-memory", default=None, metavar="GB",
                     help="memory budget of the export; one whose estimated peak exceeds it is refused before loading "
                          "(default: this machine's available memory less 10%%, at least 1 GB)")
    cal = parser.add_argument_group("calibration (quantized schemes)")
    cal.add_argument("--calib-file", type=Path, help="plain text (paragraphs) or JSONL with a 'text' field")
    cal.add_argument("--calib-limit", type=int, default=32, help="number of samples (default: %(default)s)")
    ev = parser.add_argument_group("evaluation")
    ev.add_argument("--evaluate", type=Path, metavar="TEXT_FILE",
                    help="after lowering, run each variant on this text (plain or JSONL) on the HTP or the x86 emulator "
                         "and record perplexity (fp32 vs exported) and logits SQNR in its manifest and the model card")
    ev.add_argument("--evaluate-tokens", type=int, default=2048, metavar="N", help="score at most N tokens (default: %(default)s)")
    src_grp = parser.add_argument_group("source model")
    src_grp.add_argument("--revision", help="Hub revision (branch, tag or commit)")
    src_grp.add_argument("--allow-pickle", action="store_true", help="accept a checkpoint with only pickle .bin weights")
    src_grp.add_argument("--assistant", metavar="REPO_OR_DIR",
                         help="a Gemma 4 assistant (MTP drafter, e.g. google/gemma-4-e2b-it-assistant) for the target: "
                              "checked against it (vocabulary, width, attention heads) before any work, quantized "
                              "with the target's scheme and lowered into the target's variant as its method "
                              "draft_forward; the target's decode call then verifies K drafts (hybrid mode; "
                              "docs/assistant.md)")
    src_grp.add_argument("--draft-len", type=int, default=None, metavar="K",
                         help=f"--assistant: drafts per round (default: {DEFAULT_DRAFT_LEN}); kv_forward takes K + 1 "
                              "tokens (the last accepted one and the K drafts)")
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument(
        "--ray", nargs="?", const="", default=None, metavar="ADDRESS",
        help="lower each (scheme, SoC) on a Ray cluster (pip install 'optimum-qnn[ray]'): this machine calibrates "
             "and quantizes each scheme once, every cell is a task that reserves its estimated memory; ADDRESS: the "
             "head node (default: $OPTIMUM_QNN_RAY_ADDRESS, else what ray.init() finds)",
    )
    hub_grp = parser.add_argument_group("publishing")
    hub_grp.add_argument("--push-to-hub", metavar="REPO_ID",
                         help="after the export, upload the artifact folder to this Hub model repo (one commit per variant)")
    hub_grp.add_argument("--private", action="store_true", help="create the --push-to-hub repo private")
    from optimum_qnn.console import VERBOSE_HELP

    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP + "; the export logs every stage")


def configs_from_args(args: argparse.Namespace) -> list[ExportConfig]:
    """One export config per --quant scheme (duplicates dropped)."""
    schemes = [args.quant] if isinstance(args.quant, str) else list(dict.fromkeys(args.quant))
    return [config_from_args(args, scheme) for scheme in schemes]


def config_from_args(args: argparse.Namespace, scheme: str | None = None) -> ExportConfig:
    """Map parsed arguments onto the export config of one scheme (the first --quant by default); bad values raise
    InvalidInputError naming the allowed ones."""
    if scheme is None:
        scheme = args.quant if isinstance(args.quant, str) else args.quant[0]
    fields = recipe_fields(scheme) if scheme in RECIPES else {"quant": QuantScheme.parse(scheme)}
    if args.size_budget is not None:
        fields["size_budget"] = SizeBudget.parse(args.size_budget)
    if args.weight_ranges is not None:
        fields["weight_ranges"] = WeightRanges.parse(args.weight_ranges)
    if args.weight_rounding is not None:
        fields["weight_rounding"] = WeightRounding.parse(args.weight_rounding)
    return ExportConfig(
        **{**fields, "block_size": args.block_size},
        socs=tuple(dict.fromkeys(Soc.parse(s) for s in args.soc)),
        mode=ExportMode.parse(args.mode),
        shapes=ShapeConfig(max_seq_len=args.max_seq_len, prefill_ar_len=args.prefill_ar_len,
                           cache_layout=None if args.cache_layout is None else CacheLayout.parse(args.cache_layout)),
        embedding_quant=None if args.embedding_quant is None else EmbeddingQuant.parse(args.embedding_quant),
        weight_sharing=not args.no_weight_sharing,
        float_io=args.float_io,
        overrides=tuple(_parse_override(text) for text in args.quant_override),
        shards=args.shards,
        max_memory=None if args.max_memory is None else parse_max_memory(args.max_memory),
        lookahead=lookahead_from_args(args),
        # --draft-len without --assistant is passed on, so the export refuses it naming the fix.
        draft_len=args.draft_len if args.draft_len is not None or args.assistant is None else DEFAULT_DRAFT_LEN,
        image_tokens=image_tokens_from_args(args),
    )


def image_tokens_from_args(args: argparse.Namespace) -> int | None:
    """Soft tokens per image of ``--task image-text-to-text`` (None: text generation); any other task is refused
    naming the ones there are."""
    task = getattr(args, "task", TEXT_TASK)
    tokens = getattr(args, "image_tokens", None)
    if task == TEXT_TASK:
        if tokens is not None:
            raise InvalidInputError(f"--image-tokens sizes an image variant; it needs --task {IMAGE_TASK}")
        return None
    if task == IMAGE_TASK:
        return DEFAULT_IMAGE_TOKENS if tokens is None else tokens
    if "audio" in task or "speech" in task or task == "any-to-any":
        raise InvalidInputError(f"--task {task}: audio is not part of optimum-qnn's export (Gemma 4's audio tower stays "
                                f"out); export --task {IMAGE_TASK} or {TEXT_TASK}")
    raise InvalidInputError(f"Unknown --task {task!r}; expected {TEXT_TASK} or {IMAGE_TASK}")


def lookahead_from_args(args: argparse.Namespace) -> Lookahead | None:
    """N, W, G of --mode lookahead (ExecuTorch's defaults for the ones not given); any of them in another mode is
    passed on, so the config refuses it naming the fix."""
    given = {name: getattr(args, name) for name in ("ngram", "window", "gcap") if getattr(args, name) is not None}
    if args.mode != ExportMode.LOOKAHEAD.value and not given:
        return None
    shape = Lookahead(**given)
    refusal = shape.runner_refusal() if args.mode == ExportMode.LOOKAHEAD.value else None
    if refusal:
        logger.warning("This variant runs on the host backends only. %s.", refusal)
    return shape


def _parse_override(text: str) -> tuple[str, QuantScheme]:
    pattern, sep, scheme = text.rpartition("=")
    if not sep or not pattern:
        raise InvalidInputError(f"Cannot parse --quant-override {text!r}; expected REGEX=SCHEME such as 'lm_head=16a8w'")
    return pattern, QuantScheme.parse(scheme)


# What exporting needs beyond the runtime install (`pip install "optimum-qnn[export]"`).
EXPORT_STACK = ("torch", "executorch", "transformers", "torchao")
EXPORT_INSTALL = "pip install \"optimum-qnn[export]\""


def check_export_stack() -> None:
    """Refuse, before any work, an export on the runtime install (no torch, ExecuTorch or transformers)."""
    from optimum_qnn.sdk.backend import is_installed

    missing = [name for name in EXPORT_STACK if not is_installed(name)]
    if missing:
        raise InvalidInputError(
            f"Exporting needs {', '.join(missing)}, which the runtime install leaves out: install the exporter with "
            f"`{EXPORT_INSTALL}` (on Linux x86_64 with Python 3.11; running an export needs only `pip install optimum-qnn`)"
        )


def run_export(args: argparse.Namespace) -> int:
    configure_logging(args.verbose)
    try:
        check_export_stack()
        configs = configs_from_args(args)
        if args.push_to_hub is not None:
            _check_repo_id(args.push_to_hub)
        from optimum_qnn.quantization.calibration import CalibrationSource

        calibration = CalibrationSource(file=args.calib_file, limit=args.calib_limit)
        with third_party_quiet(args.verbose):
            from optimum_qnn.exporter.pipeline import export_matrix

            results = export_matrix(
                args.model, args.output, configs, revision=args.revision, calibration=calibration,
                allow_pickle=args.allow_pickle, evaluate=args.evaluate, evaluate_tokens=args.evaluate_tokens,
                check_weight_sharing=args.check_weight_sharing, ray=args.ray, assistant=args.assistant,
            )
    except OptimumQnnError as e:
        for result in getattr(e, "results", ()):  # a matrix whose failed cells did not stop the others
            for path in result.variants:
                print(f"wrote {path}")
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    for result in results:
        _print_result(result)
    if args.push_to_hub:
        from optimum_qnn.artifacts.hub import push_to_hub

        try:
            plan = push_to_hub(args.output, args.push_to_hub, private=args.private)
        except OptimumQnnError as e:
            print(f"error: the export is in {args.output}, but pushing it failed: {e}", file=sys.stderr)
            return 3
        for commit, url in zip(plan.commits, plan.commit_urls):
            print(f"pushed {commit.variant or 'root files + README.md'}: {url}")
    return 0


def _print_result(result) -> None:
    print("\nSwapped modules:\n" + result.swap_summary)
    if result.quant_rows:
        from optimum_qnn.quantization.summary import format_quant_summary

        print("\nQuantization:\n" + format_quant_summary(result.quant_rows))
    if result.mixed_plan is not None:
        print("\n" + result.mixed_plan.table())
    for soc, table in result.delegation.items():
        print(f"\nDelegation ({soc}):\n{table}")
    print("\nStages:\n" + result.stage_table())
    for path in result.variants:
        print(f"wrote {path}")


def _check_repo_id(repo_id: str) -> None:
    """A --push-to-hub id that the Hub would refuse fails now, not after an hour of export."""
    from optimum_qnn.artifacts.model_card import _REPO_ID

    if not _REPO_ID.match(repo_id) or len(repo_id) > 96 or ".." in repo_id or "--" in repo_id:
        raise InvalidInputError(
            f"--push-to-hub {repo_id!r} is not a Hub repo id; expected 'user/name' (letters, digits, '-', '_', '.')"
        )
