"""optimum_qnn.quantization.weights: a quantized export keeps the checkpoint's bf16 matrices (no fp32 copy of the decoder) and
gets the same quantized program as from fp32 weights of the same values; table pages are handed back."""

from __future__ import annotations

import ctypes
import resource
from pathlib import Path

import pytest
import torch
from torch import nn

from optimum_qnn.config import ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
from optimum_qnn.quantization.weights import UpcastLinear, release_pages, resident_kb, upcast_in_graph
from tests.gemma4_tiny import tiny_config, tiny_model

_M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)


def test_upcast_linear_is_the_fp32_linear_of_the_same_values():
    torch.manual_seed(0)
    linear = nn.Linear(48, 24).to(torch.bfloat16)
    x = torch.randn(3, 48)
    reference = nn.functional.linear(x, linear.weight.float(), linear.bias.float())
    holder = nn.Sequential(linear, nn.LayerNorm(24).to(torch.bfloat16))
    kept = upcast_in_graph(holder)
    assert isinstance(holder[0], UpcastLinear) and holder[0].weight is linear.weight  # adopted, not copied
    assert holder[0].weight.dtype == torch.bfloat16 and kept == linear.weight.nbytes
    assert holder[1].weight.dtype == torch.float32  # anything else becomes fp32
    assert torch.equal(holder[0](x), reference)


def test_upcast_in_graph_keeps_the_modules_it_is_told_to_keep():
    holder = nn.Sequential(nn.Linear(8, 8), nn.Embedding(10, 8).to(torch.bfloat16))
    assert upcast_in_graph(holder, keep=(nn.Embedding,)) == 0  # the fp32 Linear stays a Linear
    assert type(holder[0]) is nn.Linear and holder[1].weight.dtype == torch.bfloat16


def test_release_pages_drops_a_mapped_checkpoint_from_rss_and_keeps_its_values(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    table = torch.randn(4096, 1024).to(torch.bfloat16)  # 8 MiB
    save_file({"t": table}, str(tmp_path / "t.safetensors"))
    with safe_open(str(tmp_path / "t.safetensors"), framework="pt") as f:
        mapped = f.get_tensor("t")
    before = _rss_file_kb()
    mapped.float().sum()  # touch every page
    touched = _rss_file_kb()
    assert touched - before > 6000
    assert release_pages(mapped)
    assert touched - _rss_file_kb() > 6000
    assert torch.equal(mapped, table)  # read back from the file


def test_quantizing_a_mapped_weight_hands_its_pages_back_and_never_reads_them_again(tmp_path):
    """The fold releases a bf16 weight's mapped pages as soon as it is quantized, and the second graph's fold (the
    weight is in the memo) does not read them back."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from optimum_qnn.quantization.pt2e import convert, make_quantizer, prepare
    from optimum_qnn.quantization.shared import copy_observer_state

    save_file({"w": torch.randn(1024, 4096).to(torch.bfloat16)}, str(tmp_path / "w.safetensors"))  # 8 MiB
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        mapped = f.get_tensor("w")
    linear = nn.Linear(4096, 1024, bias=False)
    linear.weight = nn.Parameter(mapped, requires_grad=False)
    model = nn.Sequential(UpcastLinear(linear))
    quantizer = make_quantizer("16a8w")
    prefill, decode = (prepare(torch.export.export(model, (torch.randn(1, n, 4096),)), quantizer) for n in (4, 1))
    with torch.no_grad():
        prefill(torch.randn(1, 4, 4096))  # calibration reads the weight: its pages are resident
    copy_observer_state(prefill, decode)
    assert _mapping_rss_kb(mapped) >= 8192  # all 8 MiB resident
    memo: dict = {}
    convert(prefill, memo)
    assert _mapping_rss_kb(mapped) < 100
    convert(decode, memo)
    assert _mapping_rss_kb(mapped) < 100
    assert torch.equal(mapped, linear.weight)  # the values are still there, read back from the file on demand


@pytest.mark.parametrize("scheme", ["16a8w", "16a4w_block"])
def test_no_prepared_graph_outlives_its_conversion(scheme):
    """Once converted, a prepared graph and its observers are freed: PyTorch's and torchao's device lookups are
    cached on the module they are given, which kept every prepared graph (a block-quantized weight's observer holds
    four tensors of its scales' shape) alive through lowering."""
    import gc
    import weakref

    from torchao.quantization.pt2e import ObserverBase

    from optimum_qnn.quantization.pt2e import convert, make_quantizer, prepare

    x = torch.randn(1, 2, 256)
    prepared = prepare(torch.export.export(nn.Sequential(nn.Linear(256, 512, bias=False)), (x,)), make_quantizer(scheme))
    with torch.no_grad():
        prepared(x)
    observers = [weakref.ref(m) for m in prepared.modules() if isinstance(m, ObserverBase)]
    graph, prepared_ref = convert(prepared), weakref.ref(prepared)
    del prepared
    gc.collect()
    assert len(observers) >= 2 and graph is not prepared_ref()  # an activation's and the weight's
    assert prepared_ref() is None and not [r for r in observers if r() is not None]


@pytest.mark.parametrize("scheme", ["16a8w", "16a4w_block"])
def test_folding_a_bf16_weight_makes_no_fp32_copy_of_it(scheme):
    """The fold quantizes a bf16 weight (`UpcastLinear`) chunk by chunk, casting each chunk as it reads it: no fp32
    copy of the whole weight, and no evaluation of the dequantize op after it (convert_pt2e writes the block-wise one
    as the op packet), which made two more (5 GB at Gemma-4-E4B's lm_head). The integers equal those of the same
    values stored as fp32."""
    from optimum_qnn.exporter.forked import run_forked
    from optimum_qnn.quantization.folding import tensor_attributes
    from optimum_qnn.quantization.pt2e import convert, make_quantizer, prepare

    torch.manual_seed(0)
    weight = (torch.randn(1 << 17, 1024) * 0.02).to(torch.bfloat16)  # 256 MB; 512 MB as fp32, 128 MB as int8
    stored = nn.Linear(1024, 1 << 17, bias=False)
    stored.weight = nn.Parameter(weight, requires_grad=False)
    reference = nn.Linear(1024, 1 << 17, bias=False)
    reference.weight = nn.Parameter(weight.float(), requires_grad=False)
    x = torch.randn(1, 2, 1024)

    def calibrated(module):
        prepared = prepare(torch.export.export(nn.Sequential(module), (x,)), make_quantizer(scheme))
        with torch.no_grad():
            prepared(x)
        return prepared

    ints = lambda g: [t for _, t in tensor_attributes(g) if not t.is_floating_point() and t.dim() == 2]  # noqa: E731

    def fold():
        """In a forked child: its peak RSS (ru_maxrss, exact: the kernel's high-water mark, not a sample) starts at its
        RSS at the fork, and the threads and children earlier tests left in this process add nothing to it. A fixed
        malloc mmap threshold: glibc's moving one let the freed chunks' memory stay in the heap for the next (the
        same fold peaked 272-348 MB above its start in identical children, 209-211 MB with the threshold fixed).
        A small fold first maps the library code the fold runs (21 MB of file pages measured alone; more when other
        work on the machine has taken the parent's code pages back, as in a CI run beside another suite: 264 MB), so
        that what is measured is the fold's own memory: the file pages it maps after that are returned and checked."""
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 1 << 20)
        convert(warm_up)
        file_kb = _status_kb("RssFile")
        start, (rss, _) = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resident_kb()
        assert start - rss < 8 << 10, (start, rss)  # the child's high-water mark starts at its RSS
        ours = convert(prepared)
        extra = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start) / 1024
        mapped = (_status_kb("RssFile") - file_kb) / 1024
        with torch.no_grad():
            return ints(ours), ours(x), extra, mapped

    small = nn.Linear(1024, 256, bias=False)
    small.weight = nn.Parameter(weight[:256].clone(), requires_grad=False)
    warm_up = calibrated(UpcastLinear(small))
    prepared = calibrated(UpcastLinear(stored))
    (got,), out, extra, mapped = run_forked(fold, "the fold")
    theirs = convert(calibrated(reference))
    (want,) = ints(theirs)  # the weight's integers (not its zero points)
    assert got.shape == weight.shape and torch.equal(got, want)
    # the integers (128 MB) and one chunk's temporaries (16 MB each): measured 173 / 187 MB after the warm-up
    # (197 / 211 MB before it, 21 MB of which the code it maps; sampled in the test process with 64 MB chunks: 321 /
    # 328 MB, and 778 / 1117 MB before the fold deferred the cast and skipped the packet-named dequantize); one fp32
    # copy of the weight alone is 512 MB
    assert mapped < 8, f"the fold mapped {mapped:.1f} MB of files after the warm-up: its peak ({extra:.1f} MB) is not its own"
    assert extra < 128 + 128, extra
    with torch.no_grad():
        assert torch.equal(out, theirs(x))


def _status_kb(field: str) -> int:
    """A ``/proc/self/status`` field in kB (``RssFile``: the resident pages of mapped files)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _mapping_rss_kb(tensor: torch.Tensor) -> int:
    """Resident kB of the memory mapping that holds ``tensor`` (/proc/self/smaps)."""
    address, rss, inside = tensor.data_ptr(), None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "Rss:":
            rss = int(line.split()[1])
    assert rss is not None, "no mapping holds the tensor"
    return rss


def _rss_file_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


@pytest.fixture(scope="module")
def bf16_and_fp32_checkpoints(tmp_path_factory):
    """One tiny model's weights rounded to bf16, stored once as bf16 and once as fp32 (the same values)."""
    root = tmp_path_factory.mktemp("stored-dtype")
    model = tiny_model(tiny_config()).to(torch.bfloat16)
    model.save_pretrained(root / "bf16")
    model.to(torch.float32).save_pretrained(root / "fp32")
    return root


def test_bf16_checkpoint_exports_the_program_of_its_fp32_values(bf16_and_fp32_checkpoints, tmp_path, qnn_sdk):
    """The quantized export of a bf16 checkpoint (matrices kept in bf16, cast in the graph) computes what the export
    of the same values stored in fp32 (the path without casts) computes.

    Not bit for bit: the integer weights are identical, but calibration's fp32 GEMMs read the cast weights from
    other buffers than the mapped fp32 ones, and the activation ranges they observe differ in the last bit
    (measured: scales 1 ulp apart, 2 of 1040 zero points 1 apart), so a logit may move by one quantization step.
    Measured logits SQNR between the two: 50.8 dB with asymmetric 4-bit tables, 49.9 dB with the symmetric ones
    (the default since), the same effect on other embedding values; equal tokens in both.
    """
    from optimum_qnn.exporter.pipeline import export
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    config = ExportConfig(
        socs=(Soc.SM8650,), quant=QuantScheme.parse("16a8w"), mode=ExportMode.KV, shapes=ShapeConfig(32, 1),
        weight_sharing=False,
    )
    logits, tokens = {}, {}
    ids = torch.tensor([[2, 5, 17, 99, 3, 41, 7]])
    for stored in ("bf16", "fp32"):
        export(bf16_and_fp32_checkpoints / stored, tmp_path / stored, config)
        model = QNNModelForCausalLM.from_pretrained(tmp_path / stored, soc="SM8650")
        tokens[stored] = model.generate(ids, max_new_tokens=12).tolist()
        session = model.backend.session
        session.reset()
        logits[stored] = session.feed(ids[0]).clone()
    noise = (logits["bf16"] - logits["fp32"]).pow(2).mean()
    sqnr = float("inf") if noise == 0 else 10 * torch.log10(logits["fp32"].pow(2).mean() / noise).item()
    print(f"bf16-stored vs fp32-stored export: logits SQNR {sqnr:.1f} dB")
    assert sqnr >= 48 and tokens["bf16"] == tokens["fp32"]


def _rss_anon_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


def test_embedding_tables_move_to_a_file_mapping_with_the_same_values(tmp_path):
    """map_tables_to_file: the lookups return the same rows, the tables no longer count as anonymous memory, the
    file is gone at once, and a file that cannot be written leaves the tables where they were."""
    from optimum_qnn.config import EmbeddingQuant
    from optimum_qnn.quantization.embedding import QuantizedEmbedding, map_tables_to_file

    torch.manual_seed(0)
    tables = [QuantizedEmbedding(torch.randn(1 << 16, 1024, dtype=torch.bfloat16), EmbeddingQuant(bits, 32))
              for bits in (4, 8)]  # 32 + 64 MiB of values, 4 MiB of fp16 scales each
    ids = torch.randint(0, 1 << 16, (1, 64))
    before = [t(ids) for t in tables]
    assert map_tables_to_file(tables, tmp_path / "missing" / "t.safetensors") == 0  # no such folder: left alone
    anon = _rss_anon_kb()
    moved = map_tables_to_file(tables, tmp_path / "t.safetensors")
    assert moved == sum(b.nbytes for t in tables for b in t.buffers() if b is not None)
    assert moved > 100 * 2**20 and not list(tmp_path.iterdir())
    assert anon - _rss_anon_kb() > 90 * 1024  # kB: the tables' anonymous pages were freed
    for table, rows in zip(tables, before):
        assert torch.equal(table(ids), rows)


def test_quantized_constants_move_to_a_file_mapping_and_stay_shared(tmp_path):
    """map_constants_to_file: the graphs compute the same, a tensor two graphs shared is still one tensor, the moved
    bytes leave anonymous memory, the file is gone at once; what is mapped already, or too small, is not moved, and
    a file that cannot be written leaves everything where it was."""
    from optimum_qnn.quantization.folding import map_constants_to_file, tensor_attributes

    class Head(torch.nn.Module):
        def __init__(self, weight, scale):
            super().__init__()
            self.weight = torch.nn.Parameter(weight, requires_grad=False)
            self.register_buffer("scale", scale)
            self.register_buffer("small", torch.ones(8))

        def forward(self, x):
            return (x @ self.weight.float().t()) * self.scale + self.small.sum()

    torch.manual_seed(0)
    weight = torch.randint(-8, 8, (4096, 16384), dtype=torch.int8)  # 64 MiB: above malloc's largest heap threshold
    graphs = [torch.fx.symbolic_trace(Head(weight, torch.rand(4096))) for _ in range(2)]
    graphs[1].weight = graphs[0].weight  # shared, as share_equal_constants leaves the prefill and decode weights
    x = torch.randn(3, 16384)
    before = [g(x) for g in graphs]
    assert map_constants_to_file(graphs, tmp_path / "missing" / "w") == 0  # no such folder: left alone
    assert graphs[0].weight.data_ptr() == weight.data_ptr()
    weight_bytes = weight.nbytes
    small = {name: t.data_ptr() for name, t in tensor_attributes(graphs[0]) if t.nbytes < 1024}
    assert small
    del weight
    anon = _rss_anon_kb()
    moved = map_constants_to_file(graphs, tmp_path / "w")
    assert moved == weight_bytes  # the weight, once; the scales (16 KiB) and the 32-byte constants are under 1 MiB
    assert not list(tmp_path.iterdir())
    assert anon - _rss_anon_kb() > 60 * 1024  # kB: the weight's anonymous pages were freed
    assert graphs[1].weight is graphs[0].weight and isinstance(graphs[0].weight, torch.nn.Parameter)
    assert map_constants_to_file(graphs, tmp_path / "scales", min_bytes=1024) == 2 * 4096 * 4
    assert graphs[0].scale.data_ptr() != graphs[1].scale.data_ptr()  # two tensors before, two after
    assert {name: t.data_ptr() for name, t in tensor_attributes(graphs[0]) if t.nbytes < 1024} == small
    for graph, out in zip(graphs, before):
        assert torch.equal(graph(x), out)
    assert map_constants_to_file(graphs, tmp_path / "again") == 0  # all in a file mapping now: nothing to move
