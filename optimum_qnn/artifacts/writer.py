"""The artifact folder: shared root files, one folder per SoC/quant variant, an index of variants.

```
out/
  config.json  generation_config.json  tokenizer.json ...   (shared by every variant)
  qnn_index.json                                           (the variants, for runners and the Hub loader)
  README.md                                                (model card)
  qnn/sm8750/16a4w_block64-ctx1024/model.pte
  qnn/sm8750/16a4w_block64-ctx1024/manifest.json
```

Every write is atomic: a variant is built in a staging folder and renamed into place only when complete (an
existing variant of the same name is replaced only then), and root files are replaced with ``os.replace``.
An interrupted export therefore leaves nothing that looks complete, and never damages the other variants.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import json
import logging
import os
import shutil
import signal
import sys
import threading
import uuid
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

from optimum_qnn.config import ExportConfig, ExportMode, Soc
from optimum_qnn.contract import DRAFT_METHOD
from optimum_qnn.errors import OptimumQnnError
from optimum_qnn.artifacts.manifest import (
    MANIFEST_NAME,
    PROGRAM_NAME,
    SCHEMA_VERSION,
    Manifest,
    Quantization,
    QuantRecipeRow,
    Source,
    Target,
    TokenizerInfo,
    Versions,
    file_entry,
    sha256_file,
)
from optimum_qnn.artifacts.sections import contract_section, mixed_precision_section

logger = logging.getLogger(__name__)

INDEX_NAME = "qnn_index.json"
INDEX_FORMAT = "optimum-qnn/variants"
INDEX_VERSION = 1
ROOT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
)


class ArtifactError(OptimumQnnError):
    """The artifact folder cannot be written or read."""


def _layout(config: ExportConfig) -> str:
    """The cache layout's name; a layout left to the exporter (None) that reached the writer is the full one."""
    return getattr(config.shapes.cache_layout, "value", "full")


def variant_name(soc: Soc, config: ExportConfig) -> str:
    """``qnn/<soc>/<quant>-ctx<C>`` (``-ring`` or ``-blocks`` appended for those cache layouts, then ``-kv`` for
    decode-only exports, ``-lhdNwWgG`` for lookahead ones, ``-asstK`` for those with an assistant drafting K tokens a
    round, ``-imgN`` for image variants of N soft tokens an image): a ring variant never takes the name, or the place, of the full-layout one a C++ runner reads."""
    mode = {ExportMode.HYBRID: "", ExportMode.KV: "-kv"}.get(config.mode, "")
    if config.lookahead is not None:  # its decode graph differs with N, W and G
        mode = f"-lhd{config.lookahead.ngram}w{config.lookahead.window}g{config.lookahead.gcap}"
    if config.draft_len is not None:  # its decode graph verifies K + 1 tokens, and it holds the drafter
        mode = f"-asst{config.draft_len}"
    layout = {"ring": "-ring", "blocks": "-blocks"}.get(_layout(config), "")
    images = "" if config.image_tokens is None else f"-img{config.image_tokens}"  # its prefill takes soft tokens
    return f"qnn/{soc.value.lower()}/{config.quant_tag}-ctx{config.shapes.max_seq_len}{layout}{mode}{images}"


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def atomic_copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex}.tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def read_index(output: Path) -> dict[str, Any]:
    path = Path(output) / INDEX_NAME
    if not path.is_file():
        return {"format": INDEX_FORMAT, "version": INDEX_VERSION, "variants": []}
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ArtifactError(f"Cannot read the variant index {path}: {e}") from None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT or not isinstance(index.get("variants"), list):
        raise ArtifactError(f"{path} is not an optimum-qnn variant index")
    if index.get("version") != INDEX_VERSION:
        raise ArtifactError(f"{path} has index version {index.get('version')}; this optimum-qnn reads {INDEX_VERSION}")
    return index


def check_output_folder(output: Path) -> None:
    """Create ``output`` if needed and make sure it can take an export, before any long work starts.

    Also removes the staging folders of exports that were killed (their process no longer exists).

    Raises:
        ArtifactError: the folder cannot be created or written, or holds a foreign or corrupt variant index.
    """
    output = Path(output)
    try:
        output.mkdir(parents=True, exist_ok=True)
        probe = output / f".write-probe-{uuid.uuid4().hex}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ArtifactError(
            f"Cannot write to the output folder {output}: {e.strerror or e}. Choose a writable --output folder."
        ) from None
    read_index(output)  # refuse a foreign or corrupt index before doing any work
    for stale in output.glob(f"{_STAGING_PREFIX}*"):
        pid = stale.name[len(_STAGING_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _process_exists(int(pid)):
            logger.info("Removing %s, left by an interrupted export", stale)
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


_STAGING_PREFIX = ".staging-"
LOCK_NAME = ".qnn_index.lock"
LOCK_TIMEOUT_ENV = "OPTIMUM_QNN_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT_S = 600.0


@contextlib.contextmanager
def folder_lock(output: Path, timeout: float | None = None) -> Iterator[None]:
    """Hold the artifact folder's lock while updating what its variants share: the index, the root files and the
    model card. Exports into one folder at once (one per SoC, say) take turns here; their long work is not locked.

    The lock is an OS file lock (`filelock`): a process that dies releases it. ``timeout`` defaults to
    ``$OPTIMUM_QNN_LOCK_TIMEOUT`` or 600 s.

    Raises:
        ArtifactError: another process held the lock for longer than ``timeout``.
    """
    from filelock import FileLock, Timeout

    if timeout is None:
        from optimum_qnn.environment import env_number

        timeout = env_number(LOCK_TIMEOUT_ENV, DEFAULT_LOCK_TIMEOUT_S)
    path = Path(output) / LOCK_NAME
    lock = FileLock(path)
    try:
        try:
            lock.acquire(timeout=0)
        except Timeout:
            logger.warning("Waiting for %s: another export is writing into %s (up to %g s)", path, output, timeout)
            lock.acquire(timeout=timeout)
    except Timeout:
        raise ArtifactError(
            f"Another process has held {path} for more than {timeout:g} s while writing into {output}: wait for that "
            f"export to finish (or stop it) and retry, or raise {LOCK_TIMEOUT_ENV}"
        ) from None
    try:
        yield
    finally:
        lock.release()


def staging_path(output: Path, suffix: str = "") -> Path:
    """A fresh name in `output` for work in progress (a variant being staged, a program being lowered); what an
    export that was killed leaves under such a name is removed by the next `check_output_folder`."""
    return Path(output) / f"{_STAGING_PREFIX}{os.getpid()}-{uuid.uuid4().hex}{suffix}"


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class BackgroundDigests:
    """The manifest entries (size, SHA-256) of a checkpoint's weight files, hashed in a thread while the export
    goes on, so the write stage does not read them again on one core. Gemma-4-E2B's checkpoint is 9.5 GB: hashed when
    its variant was written, it was most of that stage (21 s in a 16 GB cgroup, at 93 % CPU; 2 s without it).

    The export starts it after the swap: the files were just read (their pages are in the page cache, where the
    loaded weights are mapped from) and calibration leaves a core mostly idle (120 % of 200 % at that size). On Linux
    the thread runs at the lowest priority (nice 19, this thread only), so it takes what the export leaves idle."""

    def __init__(self, folder: Path, names: list[str]) -> None:
        self._entries: list | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._hash, args=(Path(folder), list(names)), name="optimum-qnn-digests",
                                        daemon=True)
        self._thread.start()

    def _hash(self, folder: Path, names: list[str]) -> None:
        if sys.platform.startswith("linux"):  # per-thread niceness is Linux's: elsewhere the whole process would yield
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            self._entries = [file_entry(folder, name) for name in names]
        except BaseException as e:  # noqa: BLE001 - raised in `entries`, in the thread that needs them
            self._error = e

    def entries(self) -> list:
        """The entries, once hashed (waits for the thread); what it raised, if it failed."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return list(self._entries or [])


@dataclass
class VariantWriter:
    """Writes variants (and the shared root files) into one artifact folder. ``weight_digests``: the checkpoint's
    weight files being hashed since they were loaded (`BackgroundDigests`); without it they are hashed when the first
    variant is written."""

    output: Path
    source_folder: Path
    model_id: str
    revision: str | None
    load_report: Any
    tokenizer: Any
    text_config: Any
    weight_digests: BackgroundDigests | None = None

    def __post_init__(self) -> None:
        self.output = Path(self.output)
        check_output_folder(self.output)
        self._weights = None
        self._root_files: list[str] | None = None

    def _weight_entries(self):
        if self._weights is None:
            if self.weight_digests is not None:
                self._weights = self.weight_digests.entries()
            else:
                self._weights = [file_entry(self.source_folder, name) for name in self.load_report.files]
        return self._weights

    def _write_root(self) -> list[str]:
        """Copy the shared root files once per export (every variant of a multi-SoC export shares them)."""
        if self._root_files is None:
            copied = []
            for name in ROOT_FILES:
                src = self.source_folder / name
                if src.is_file():
                    atomic_copy(src, self.output / name)
                    copied.append(name)
            self._root_files = copied
        return self._root_files

    def write_variant(
        self, name: str, lowered, contract, config: ExportConfig, quant_rows: list | None = None, evaluate=None,
        inspection=None, mixed_plan=None, assistant=None, images=None,
    ) -> Path:
        """Write one variant atomically; returns its folder.

        ``evaluate(folder, manifest) -> Evaluation``, when given, runs on the complete staged variant; its result
        goes into the manifest before the variant is put in place. ``assistant``: the manifest's `AssistantInfo` of
        a variant with a drafter (its method is in ``contract``).
        """
        from optimum_qnn.sdk import ensure_qnn_sdk

        with folder_lock(self.output):
            root_files = self._write_root()
        target = self.output / name
        # The pid in the name lets a later export remove the folder if this process gets killed.
        staging = staging_path(self.output)
        try:
            staging.mkdir(parents=True)
            lowered.write(staging / PROGRAM_NAME)
            program = file_entry(staging, PROGRAM_NAME)  # hashed once: 2.6 GB for Gemma-4-E2B
            manifest = Manifest(
                schema_version=SCHEMA_VERSION,
                source=Source(self.model_id, self.revision, self._weight_entries()),
                versions=Versions(
                    optimum_qnn=_version("optimum-qnn"),
                    executorch=_version("executorch"),
                    torch=_version("torch"),
                    transformers=_version("transformers"),
                    qairt_build_id=ensure_qnn_sdk().build_id,
                ),
                target=Target(lowered.soc.value, lowered.soc.htp_arch),
                quantization=Quantization(
                    scheme=config.quant.value,
                    block_size=config.block_size if config.quant.value == "16a4w_block" else None,
                    embedding=str(config.embedding_quant),
                    kv_io_bits=contract.kv_io_bits,
                    recipe=[QuantRecipeRow(r.module, r.op, r.activation, r.weight, r.count) for r in quant_rows or []],
                    named_recipe=config.recipe, weight_ranges=config.weight_ranges.value,
                    weight_rounding=config.weight_rounding.value,
                    mixed_precision=mixed_precision_section(mixed_plan),
                ),
                contract=contract_section(contract, weight_sharing=lowered.weight_sharing, shards=lowered.shards,
                                          lookahead=config.lookahead, assistant=assistant, images=images),
                tokenizer=self._tokenizer_info(root_files),
                program=program,
                files=[program],
                inspection=inspection,
                root_files=[file_entry(self.output, f) for f in root_files],
            )
            manifest.write(staging)
            if evaluate is not None:
                manifest = dataclasses.replace(manifest, evaluation=evaluate(staging, manifest))
                manifest.write(staging)
            target.parent.mkdir(parents=True, exist_ok=True)
            _stop_point("variant-staged")
            with folder_lock(self.output):
                _replace_dir(staging, target)
                self._update_index(name, lowered.soc, config)
        except OSError as e:
            shutil.rmtree(staging, ignore_errors=True)
            raise ArtifactError(f"Writing variant {name} into {self.output} failed: {e.strerror or e}; earlier variants are intact") from None
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return target

    def _tokenizer_info(self, root_files: list[str]) -> TokenizerInfo:
        cfg = self.text_config
        gen_path = self.source_folder / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        eos = gen.get("eos_token_id", cfg.eos_token_id)
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        template = getattr(self.tokenizer, "chat_template", None) if self.tokenizer is not None else None
        return TokenizerInfo(
            files=[f for f in root_files if f.startswith(("tokenizer", "special_tokens", "chat_template"))],
            bos_id=gen.get("bos_token_id", cfg.bos_token_id),
            eos_ids=[int(e) for e in eos_ids],
            pad_id=gen.get("pad_token_id", cfg.pad_token_id),
            chat_template=template if isinstance(template, str) else None,
        )

    def _update_index(self, name: str, soc: Soc, config: ExportConfig) -> None:
        index = read_index(self.output)
        _stop_point("index-read")
        entry = {
            "path": name,
            "soc": soc.value,
            "quant": config.quant_tag,
            "context_len": config.shapes.max_seq_len,
            "mode": config.mode.value,
            "cache_layout": _layout(config),  # an index without it: every variant is full
            "manifest_sha256": sha256_file(self.output / name / MANIFEST_NAME),
        }
        if config.draft_len is not None:  # an index without it: no variant has an assistant
            entry["assistant"] = {"method": DRAFT_METHOD, "draft_len": config.draft_len}
        if config.image_tokens is not None:  # an index without it: no variant takes images
            entry["images"] = {"soft_tokens": config.image_tokens}
        index["variants"] = [v for v in index["variants"] if v.get("path") != name] + [entry]
        index["variants"].sort(key=lambda v: v["path"])
        atomic_write_text(self.output / INDEX_NAME, json.dumps(index, indent=2) + "\n")


STOP_AT_ENV = "OPTIMUM_QNN_TEST_STOP_AT"


def _stop_point(name: str) -> None:
    """A test hook: with ``OPTIMUM_QNN_TEST_STOP_AT=<name>`` the process stops itself (SIGSTOP) here, so a test can
    SIGKILL it at an exact point of the write/swap window (tests/test_reliability.py); a timed kill would land there
    only by luck, the window lasting microseconds. Does nothing when the variable is unset."""
    if os.environ.get(STOP_AT_ENV) == name and hasattr(signal, "SIGSTOP"):
        os.kill(os.getpid(), signal.SIGSTOP)


def _replace_dir(new: Path, target: Path) -> None:
    """Put ``new`` at ``target``. An existing ``target`` is swapped out in one atomic exchange where the file
    system supports it (Linux ``renameat2(RENAME_EXCHANGE)``), so a reader or a kill never sees no variant;
    elsewhere it is moved aside first. The old folder is deleted after."""
    if target.exists() and _exchange(new, target):
        _stop_point("variant-swapped")
        shutil.rmtree(new, ignore_errors=True)  # ``new`` now holds the old variant
        return
    old = None
    if target.exists():
        old = target.with_name(f".old-{target.name}-{uuid.uuid4().hex}")
        os.replace(target, old)
    os.replace(new, target)
    _stop_point("variant-swapped")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths; False where the platform or file system cannot."""
    if sys.platform != "linux":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"
