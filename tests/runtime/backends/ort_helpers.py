"""Helpers shared by the onnxruntime backend's tests: variant folders, contract inputs, and the ExecuTorch reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def variant_dirs(output: Path) -> list[Path]:
    """Every variant folder (holding manifest.json and model.pte) of an export's output folder, sorted."""
    return sorted(p.parent for p in Path(output).glob("qnn/*/*/manifest.json"))


def contract_inputs(manifest, method: str, seed: int) -> list[np.ndarray]:
    """Random inputs of `method` in runner-contract order: token ids inside the vocabulary, positions 0.., and
    caches/masks drawn over their dtype's range (random bytes make a stronger identity check than zeros)."""
    rng = np.random.default_rng(seed)
    specs = next(m for m in manifest.contract.methods if m.name == method).inputs
    out = []
    for spec in specs:
        shape, dtype = tuple(spec.shape), np.dtype(spec.dtype)
        if spec.name == "tokens":
            out.append(rng.integers(0, manifest.contract.vocab_size, shape).astype(dtype))
        elif spec.name == "input_pos":
            out.append((np.arange(int(np.prod(shape))) + seed).reshape(shape).astype(dtype))
        elif dtype.kind == "f":
            out.append(rng.standard_normal(shape).astype(dtype))
        else:
            info = np.iinfo(dtype)
            out.append(rng.integers(info.min, info.max, shape, endpoint=True).astype(dtype))
    return out


def executorch_outputs(folder: Path, method: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """The same call through ExecuTorch's runtime (the project's `LoadedProgram`, loaded once per process)."""
    import torch

    from optimum_qnn.artifacts.manifest import read_manifest
    from optimum_qnn.program import LoadedProgram, ProgramFacts

    loaded = LoadedProgram.get(folder / "model.pte", ProgramFacts.of(read_manifest(folder)))
    with loaded.lock:
        outputs = loaded.methods[method].execute([torch.from_numpy(x.copy()) for x in inputs])
    return [o.numpy().copy() for o in outputs]


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
