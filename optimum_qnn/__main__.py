"""`python -m optimum_qnn <command>`.

Each command is one `_add_<name>` function that registers its parser and sets `handler` (a function taking the
parsed arguments and returning an exit code); list it in `_COMMANDS`. Handlers import their heavy modules
themselves so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def _add_doctor(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor", help="show versions, the QNN libraries and ExecuTorch backend in use, and what this host can run"
    )
    parser.add_argument("path", nargs="?", help="an artifact folder: say which of its variants this host can run")
    parser.add_argument("--adb", nargs="?", const="", default=None, metavar="SERIAL",
                        help="judge for the adb phone (its getprop ro.soc.model) instead of this machine")
    _add_verbose(parser)

    def handler(args: argparse.Namespace) -> int:
        from optimum_qnn.console import configure_logging, third_party_quiet
        from optimum_qnn.errors import OptimumQnnError

        configure_logging(args.verbose)
        try:
            with third_party_quiet(args.verbose, keep_stdout=True):  # the report prints as it goes
                from optimum_qnn.doctor import run_doctor

                return run_doctor(args.path, adb_serial=args.adb)
        except OptimumQnnError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    parser.set_defaults(handler=handler)


def _add_export(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("export", help="export a Gemma4 model to QNN (same as `optimum-cli export qnn`)")
    from optimum_qnn.cli import add_export_arguments, run_export

    add_export_arguments(parser)
    parser.set_defaults(handler=run_export)


def _add_inspect(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect", help="show the QNN context binaries of a .pte: target, graphs, IO, encodings, weight sharing, size"
    )
    parser.add_argument("path", help="a .pte file, or a variant folder holding model.pte")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_verbose(parser)

    def handler(args: argparse.Namespace) -> int:
        import json
        import os
        from pathlib import Path

        from optimum_qnn.console import configure_logging, third_party_quiet
        from optimum_qnn.errors import OptimumQnnError

        configure_logging(args.verbose)
        path = Path(args.path) / "model.pte" if Path(args.path).is_dir() else Path(args.path)
        try:
            with third_party_quiet(args.verbose):
                from optimum_qnn.artifacts.inspection import inspect_pte

                stdout = os.dup(1)
                os.dup2(2, 1)  # with -v the QNN libraries print to the process's stdout: keep it for the report
                try:
                    report = inspect_pte(path)
                finally:
                    os.dup2(stdout, 1)
                    os.close(stdout)
        except OptimumQnnError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        assistant = _assistant_of(Path(args.path))
        if args.json:
            print(json.dumps({**report.to_dict(), **({"assistant": assistant} if assistant else {})}, indent=2))
        else:
            print(report.to_text() + (f"\n\n{_assistant_line(assistant)}" if assistant else ""))
        return 0

    parser.set_defaults(handler=handler)


def _assistant_of(path) -> dict | None:
    """The manifest's assistant record of a variant folder (`inspect` of a folder), or None."""
    import dataclasses

    from optimum_qnn.artifacts.manifest import MANIFEST_NAME, ManifestError, read_manifest

    if not (path / MANIFEST_NAME).is_file():
        return None
    try:
        info = read_manifest(path).contract.assistant
    except ManifestError:
        return None  # the report is of the .pte; `doctor` and `run` say what is wrong with a manifest
    return None if info is None else dataclasses.asdict(info)


def _assistant_line(a: dict) -> str:
    return (f"assistant: method {a['method']}, draft_len {a['draft_len']} (kv_forward verifies {a['verify_ar']} tokens "
            f"a call), drafter {a['model_id']}, reads the K/V of layers {a['source_layers']['full_attention']} (full) "
            f"and {a['source_layers']['sliding_attention']} (sliding)")


def _add_run(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run", help="generate text with an exported model, on this host or on a phone over adb",
        description="Generate with one variant of an artifact folder or Hub repo: on this host (QNN runtime), or on "
        "ExecuTorch's qnn_llama_runner on this machine (--device runner) or on an Android phone (--device adb). Prints the text as it comes, then "
        "one line of stats.",
    )
    _add_variant_args(parser)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, tokenized with the artifact's tokenizer")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids, used as they are (e.g. 2,651,1234)")
    parser.add_argument("--chat", action="store_true",
                        help="wrap --prompt in the tokenizer's chat template; the reply stops at the end of its turn")
    parser.add_argument("--image", action="append", metavar="PATH",
                        help="an image the prompt reads before its text (repeat for several): an image variant "
                        "(export --task image-text-to-text) on a host device")
    parser.add_argument("--max-new-tokens", type=int, default=None, help=_MAX_NEW_HELP)
    parser.add_argument("--speculative", choices=["lookahead", "assistant"], default=None,
                        help="lookahead: decode with lookahead decoding (a variant exported with --mode lookahead); "
                        "assistant: with the variant's drafter (exported with --assistant; host devices only). The "
                        "same greedy text in fewer decode calls; the stats line adds tokens per call and acceptance")
    _add_verbose(parser)

    def handler(args: argparse.Namespace) -> int:
        from optimum_qnn.console import configure_logging, third_party_quiet
        from optimum_qnn.errors import OptimumQnnError

        if args.chat and args.prompt_ids:
            print("error: --chat formats text with the chat template and --prompt-ids are used as they are: pass "
                  "--chat with --prompt, or --prompt-ids without --chat", file=sys.stderr)
            return 2
        try:
            ids = [int(t) for t in args.prompt_ids.replace(",", " ").split()] if args.prompt_ids else None
        except ValueError:
            print(f"error: --prompt-ids takes integers separated by commas; got {args.prompt_ids!r}", file=sys.stderr)
            return 2
        if args.image and ids is not None:
            print("error: --image goes with --prompt (the images' placeholders are placed in its tokens); --prompt-ids "
                  "are used as they are", file=sys.stderr)
            return 2
        if _missing_images(args.image):  # before the variant is loaded
            return 2
        configure_logging(args.verbose)
        try:
            with third_party_quiet(args.verbose, keep_stdout=True):  # the text streams as it comes
                from optimum_qnn.runtime.text_stream import PrintingStreamer

                model = _load_variant(args, speculative=args.speculative, images=bool(args.image))
                try:
                    tokenizer = model.tokenizer()
                except OptimumQnnError:
                    if ids is None:  # text needs the tokenizer; ids do not (the new ids are printed instead)
                        raise
                    tokenizer = None
                streamer = PrintingStreamer(tokenizer, sys.stdout) if tokenizer is not None else None
                options = {"max_new_tokens": args.max_new_tokens, "streamer": streamer, "speculative": args.speculative}
                if args.image:
                    model.image_text_generation(tokenizer, args.prompt, args.image, chat=args.chat, **options)
                elif ids is None:
                    model.text_generation(tokenizer, args.prompt, chat=args.chat, **options)
                else:
                    out = model.generate_tokens(ids, **options)
                    if tokenizer is None:
                        print(",".join(str(t) for t in out[0, len(ids):].tolist()), flush=True)
        except OptimumQnnError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        s = model.stats
        print(
            f"[{s.prompt_tokens} prompt + {s.new_tokens} new tokens, stopped by {s.stopped_by} | first token "
            f"{s.time_to_first_token_s:.2f} s | prefill {s.prefill_tokens_per_s:.1f} tok/s | decode "
            f"{s.decode_tokens_per_s:.1f} tok/s{_speculative_stats(s)} | {model.device_name}]"
        )
        return 0

    parser.set_defaults(handler=handler)


def _speculative_stats(s) -> str:
    """`` | lookahead: T tokens per call, acceptance A %`` after a speculative generation (with an assistant, then
    its target and drafter calls), else nothing."""
    if not s.speculative:
        return ""
    rate = "n/a" if s.acceptance_rate is None else f"{100 * s.acceptance_rate:.0f} %"
    calls = f", {s.target_calls} target + {s.drafter_calls} drafter calls" if s.speculative == "assistant" else ""
    return f" | {s.speculative}: {s.tokens_per_target_call:.2f} tokens per call, acceptance {rate}{calls}"


def _add_variant_args(parser: argparse.ArgumentParser) -> None:
    """Which variant of which artifact, and where it runs (shared by run, chat and serve)."""
    parser.add_argument("model", help="artifact folder or Hub repo id")
    parser.add_argument("--soc", help="the variant's SoC, e.g. SM8650 (needed when the artifact has several)")
    parser.add_argument("--quant", help="the variant's quant scheme, e.g. 16a8w (needed when several)")
    parser.add_argument("--max-seq-len", "--context-len", dest="context_len", type=int, metavar="N",
                        help="the variant's context, as exported with --max-seq-len (default: of the artifact's "
                        "contexts, the largest whose estimated memory fits this host's available memory or --max-memory)")
    parser.add_argument("--cache-layout", choices=("full", "ring", "blocks"),
                        help="the variant's cache layout when the artifact has several (default: ring on the host, fewer "
                        "bytes per call for the same output; full on a runner, which reads no other)")
    parser.add_argument("--max-memory", metavar="GB",
                        help="the memory the variant may take when its context is chosen (default: what this host has "
                        "available, less 10 %% and at least 1 GB)")
    parser.add_argument("--revision", help="Hub revision")
    parser.add_argument("--device", default="host",
                        help="host (ExecuTorch's Python runtime here: in a conversation the cache is kept between "
                        "turns), runner (ExecuTorch's qnn_llama_runner here: a Snapdragon board or laptop, or x86 with "
                        "the emulator) or adb / adb:SERIAL (that runner on a phone); a runner reads the whole "
                        "conversation again each turn (default: %(default)s)")
    parser.add_argument("--runner", help="ExecuTorch's qnn_llama_runner built for the device (default: $QNN_LLAMA_RUNNER)")


def _add_speculative_choice(parser: argparse.ArgumentParser) -> None:
    """``--speculative`` of chat and serve: which variant to load where the artifact has one SoC, scheme and context
    exported for several decodings (by default the fastest: the assistant's, else lookahead's, else plain)."""
    parser.add_argument("--speculative", choices=["lookahead", "assistant"], default=None,
                        help="load the variant exported for this decoding and decode with it (default: the "
                        "artifact's variant with an assistant, else with lookahead, else the plain one)")


def _missing_images(paths: Sequence[str] | None) -> bool:
    """Whether an ``--image`` file does not exist (said on stderr)."""
    missing = [path for path in paths or () if not Path(path).is_file()]
    if missing:
        print(f"error: no such image file: {', '.join(missing)}", file=sys.stderr)
    return bool(missing)


def _load_variant(args: argparse.Namespace, speculative: str | None = None, fastest: bool = False,
                  images: bool = False):
    """The variant the arguments select; one without the ``speculative`` decoding asked for is refused first.
    ``fastest`` with no ``speculative``: among variants exported for several decodings, the fastest's. ``images``:
    an image variant, as `QNNModelForImageTextToText`."""
    from optimum_qnn.artifacts.variants import AUTO_SPECULATIVE
    from optimum_qnn.host_memory import parse_max_memory
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    if fastest and speculative is None:
        speculative = AUTO_SPECULATIVE
    model_class = QNNModelForCausalLM
    if images:
        from optimum_qnn.runtime.images import QNNModelForImageTextToText as model_class

    options = {"runner": args.runner} if args.runner else {}
    return model_class.from_pretrained(
        args.model, soc=args.soc, quant=args.quant, context_len=args.context_len, cache_layout=args.cache_layout,
        max_memory=None if args.max_memory is None else parse_max_memory(args.max_memory), revision=args.revision,
        device=args.device, speculative=speculative, **options,
    )


def _add_chat(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "chat", help="chat with an exported model in the terminal (the cache is kept between turns on the host)",
        description="An interactive conversation with one variant: the reply is printed as it is generated. /reset "
        "starts over, /exit or Ctrl-D quits, Ctrl-C stops the current reply and keeps the conversation.",
    )
    _add_variant_args(parser)
    _add_speculative_choice(parser)
    parser.add_argument("--system", help="a system prompt (kept when old turns are dropped to fit the context)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help=f"per reply {_MAX_NEW_HELP}")
    parser.add_argument("--image", action="append", metavar="PATH",
                        help="an image the first message reads before its text (repeat for several): loads the image "
                        "variant (export --task image-text-to-text), where /image PATH adds one to a later message")
    _add_verbose(parser, also="a line of stats after each reply")

    def handler(args: argparse.Namespace) -> int:
        from optimum_qnn.console import configure_logging, third_party_quiet
        from optimum_qnn.errors import OptimumQnnError

        if _missing_images(args.image):  # before the variant is loaded
            return 2
        configure_logging(args.verbose)
        try:
            with third_party_quiet(args.verbose):
                model = _load_variant(args, speculative=args.speculative, fastest=True, images=bool(args.image))
                options = {} if args.max_new_tokens is None else {"max_new_tokens": args.max_new_tokens}
                chat = model.chat(args.system, **options)
        except OptimumQnnError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        from optimum_qnn.runtime import repl

        with third_party_quiet(args.verbose, keep_stdout=True):
            return repl.run(chat, verbose=args.verbose, images=args.image or ())

    parser.set_defaults(handler=handler)


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="an OpenAI-compatible HTTP endpoint for an exported model (chat and text completions)",
        description="Serve one variant over HTTP with OpenAI's API (GET /v1/models, POST /v1/chat/completions and "
        "/v1/completions, streaming as server-sent events; GET /health). One generation at a time, a bounded queue "
        "behind it (429 when full); prompts that begin with the previous request's tokens reuse its cache. A request "
        "without max_tokens gets up to 256 new tokens, at most what the context leaves after the prompt.",
    )
    _add_variant_args(parser)
    _add_speculative_choice(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' (default: $OPTIMUM_QNN_API_KEY; unset: no check)")
    parser.add_argument("--queue-size", type=int, default=8, help="requests that may wait behind the running one (default: %(default)s)")
    parser.add_argument("--name", help="the model id clients send (default: the artifact folder's or Hub repo's name)")
    parser.add_argument("--images", action="store_true",
                        help="serve the image variant (export --task image-text-to-text): chat messages may hold "
                        "image_url parts, as data: URLs")
    parser.add_argument("--shutdown-grace", type=float, default=None, metavar="SECONDS",
                        help="on SIGTERM/Ctrl-C, how long the running generation may go on before it is cancelled "
                        "(default: 10)")
    _add_verbose(parser, also="uvicorn's access log and its INFO lines")

    def handler(args: argparse.Namespace) -> int:
        import os

        from optimum_qnn.console import configure_logging, third_party_quiet
        from optimum_qnn.errors import OptimumQnnError

        if not 0 < args.port < 65536 or args.queue_size < 0 or (args.shutdown_grace or 0) < 0:
            print("error: --port must be in 1..65535, --queue-size and --shutdown-grace >= 0", file=sys.stderr)
            return 2
        api_key = args.api_key or os.environ.get("OPTIMUM_QNN_API_KEY") or None
        configure_logging(args.verbose)
        try:
            with third_party_quiet(args.verbose):
                model = _load_variant(args, speculative=args.speculative, fastest=True, images=args.images)
                tokenizer = model.tokenizer()  # requests are text: an artifact without one is refused here
        except OptimumQnnError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
            print(f"warning: listening on {args.host} without --api-key: anyone who can reach it can use the model",
                  file=sys.stderr)
        try:
            from optimum_qnn.runtime.server.app import GRACE_SECONDS, serve
        except ImportError as e:
            print(f"error: serve needs its HTTP stack ({e.name} is missing): pip install 'optimum-qnn[serve]'",
                  file=sys.stderr)
            return 2
        with third_party_quiet(args.verbose, keep_stdout=True):
            serve(model, tokenizer, host=args.host, port=args.port, api_key=api_key, queue_size=args.queue_size, name=args.name,
                  verbose=args.verbose, grace=GRACE_SECONDS if args.shutdown_grace is None else args.shutdown_grace)
        return 0

    parser.set_defaults(handler=handler)


def _add_verbose(parser: argparse.ArgumentParser, also: str = "") -> None:
    """``-v``: the same meaning on every command (`console.VERBOSE_HELP`); ``also`` says what this one adds."""
    from optimum_qnn.console import VERBOSE_HELP

    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP + (f"; {also}" if also else ""))


# One rule for max_new_tokens on every face (`runtime.limits`).
_MAX_NEW_HELP = "(default: 256, at most what the context leaves after the prompt)"


_COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_doctor, _add_export, _add_inspect, _add_run, _add_chat, _add_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m optimum_qnn",
        description="Export Gemma 4 models (text, and images with --task image-text-to-text) to Qualcomm HTP, and run them.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
