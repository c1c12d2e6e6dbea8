"""optimum_qnn.socs: the SoC table against the pinned ExecuTorch, the refusals of what an arch lacks, the docs'
table (docs/exporting.md), and which SoC a host says it is (doctor)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from optimum_qnn.config import EmbeddingQuant, ExportConfig, QuantScheme, Soc
from optimum_qnn.errors import OptimumQnnError, UnsupportedOnSocError
from optimum_qnn.socs import ARCH_LIMITS, HTP_ARCHS, arch_supports, scheme_features, soc_table_markdown

SOC_PAGE = Path(__file__).resolve().parents[1] / "docs" / "exporting.md"


def test_every_chipset_of_the_pinned_executorch_is_a_soc_with_its_arch_vtcm_and_id():
    from executorch.backends.qualcomm.serialization.qc_schema import HtpArch, QcomChipset, _soc_info_table

    chipsets = {c.name: c for c in QcomChipset if c is not QcomChipset.UNKNOWN_SM}
    assert {s.value for s in Soc} == set(chipsets)
    for soc in Soc:
        info = _soc_info_table[chipsets[soc.value]]
        assert (soc.info.soc_model, soc.htp_arch, soc.info.vtcm_mb) == (
            int(chipsets[soc.value]), int(info.htp_info.htp_arch), info.htp_info.vtcm_size_in_mb
        ), soc
        assert Soc.from_soc_model(int(chipsets[soc.value])) is soc
    assert set(HTP_ARCHS) == {int(a) for a in HtpArch if a is not HtpArch.NONE}


def test_arch_limits_are_executorch_s_own_rules():
    """16a16w and LPBQ: the thresholds of ExecuTorch's quantizer (htp_rules.validate_*), for every chipset."""
    from executorch.backends.qualcomm.quantizer.annotators.htp_rules import (
        validate_16a16w_support,
        validate_lpbq_support,
    )
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset, _soc_info_table

    for soc in Soc:
        info = _soc_info_table[QcomChipset[soc.value]]
        assert arch_supports(soc.htp_arch, "16-bit weights") == validate_16a16w_support(info), soc
        assert arch_supports(soc.htp_arch, "LPBQ") == validate_lpbq_support(info), soc


def test_fp16_limit_is_the_one_executorch_documents():
    from executorch.backends.qualcomm.utils.utils import generate_htp_compiler_spec

    assert "Snapdragon 8 Gen 1 or newer can support HTP fp16" in " ".join(generate_htp_compiler_spec.__doc__.split())
    assert Soc.SM8450.info.marketing == "Snapdragon 8 Gen 1" and ARCH_LIMITS["fp16"].min_arch == Soc.SM8450.htp_arch


# Every (arch, scheme) the table says cannot run, refused by ExportConfig before anything is loaded.
_LACKING = [(arch, q.value) for arch in HTP_ARCHS for q in QuantScheme if not arch_supports(arch, q.value)]


def _first_limit(arch: int, scheme: str):
    return next(ARCH_LIMITS[f] for f in scheme_features(scheme) if not arch_supports(arch, f))


def test_the_lacking_pairs_are_the_measured_ones():
    assert sorted(_LACKING) == sorted(
        [(68, "fp16")] + [(arch, s) for arch in (68, 69) for s in ("16a16w", "16a8w", "16a4w", "16a4w_block")]
    )


@pytest.mark.parametrize("arch, scheme", _LACKING, ids=[f"v{a}-{s}" for a, s in _LACKING])
def test_what_an_arch_lacks_is_refused_with_the_reason_and_the_fix(arch, scheme):
    soc = next(s for s in Soc if s.htp_arch == arch)
    with pytest.raises(UnsupportedOnSocError) as caught:
        ExportConfig(socs=(soc,), quant=QuantScheme.parse(scheme))
    message = str(caught.value)
    limit = _first_limit(arch, scheme)
    assert soc.value in message and f"v{limit.min_arch} or newer" in message
    assert limit.instead in message and limit.source in message
    assert isinstance(caught.value, OptimumQnnError)
    instead = re.search(r"--quant (\S+)", limit.instead).group(1)
    ExportConfig(socs=(soc,), quant=QuantScheme.parse(instead))  # the suggested choice is accepted there


def test_an_override_the_arch_lacks_is_refused_too():
    with pytest.raises(UnsupportedOnSocError, match="16-bit activations"):
        ExportConfig(socs=(Soc.SM8450,), quant=QuantScheme.A8W8, overrides=(("lm_head", QuantScheme.A16W8),))


def test_one_soc_lacking_a_feature_refuses_a_multi_soc_export():
    with pytest.raises(UnsupportedOnSocError, match="QCM6490"):
        ExportConfig(socs=(Soc.SM8650, Soc.QCM6490), quant=QuantScheme.FP16, embedding_quant=EmbeddingQuant(0, 0))


def test_cli_refuses_before_the_model_is_looked_for(tmp_path, capsys):
    from optimum_qnn.__main__ import main

    status = main(["export", "-m", str(tmp_path / "no-such-model"), "-o", str(tmp_path / "out"),
                   "--soc", "qcm6490", "--quant", "fp16"])
    err = capsys.readouterr().err
    assert status != 0 and "QCM6490" in err and "HTP v69 or newer" in err and "--quant 8a8w" in err
    assert "no-such-model" not in err  # refused before the model folder was even looked for


def test_parse_accepts_executorch_s_names_in_any_case_and_lists_them_on_a_miss():
    assert Soc.parse("sc8380xp") is Soc.SC8380XP
    with pytest.raises(OptimumQnnError, match="expected one of: SA8295, SA8797, SC8380XP"):
        Soc.parse("X1E78100")


def test_the_docs_soc_table_is_the_generated_one():
    text = SOC_PAGE.read_text()
    block = text.split("<!-- soc-table:begin -->\n", 1)[1].split("\n<!-- soc-table:end -->", 1)[0]
    assert block == soc_table_markdown()


# --- which SoC a host is -------------------------------------------------------------------------------------------


def test_linux_host_reads_soc0(tmp_path):
    from optimum_qnn.runtime.backends.soc import host_soc, linux_soc

    (tmp_path / "machine").write_text("QCM6490\n")
    (tmp_path / "soc_id").write_text("497\n")
    assert linux_soc(tmp_path).soc is Soc.QCM6490 and host_soc(tmp_path) == "QCM6490"
    (tmp_path / "machine").write_text("SM7325\n")
    reading = linux_soc(tmp_path)
    assert reading.soc is None and "SM7325 (soc_id 497)" in reading.describe()
    assert linux_soc(tmp_path / "absent") is None


def test_windows_host_reads_the_processor_name():
    from optimum_qnn.runtime.backends.soc import windows_soc

    elite = windows_soc("Snapdragon(R) X Elite - X1E78100 - Qualcomm(R) Oryon(TM) CPU")
    assert elite.soc is Soc.SC8380XP and "Snapdragon X Elite" in elite.describe()
    assert windows_soc("Snapdragon(R) X Plus - X1P42100 - Qualcomm(R) Oryon(TM) CPU").soc is None


def test_doctor_says_a_host_runs_only_its_own_soc_variant(tmp_path):
    from types import SimpleNamespace

    from optimum_qnn import doctor
    from optimum_qnn.runtime.backends.availability import backend_checks

    for soc in ("SM8650", "QCM6490"):
        folder = tmp_path / soc
        folder.mkdir()
        (folder / "manifest.json").write_text("{}")
    manifests = {
        "SM8650": SimpleNamespace(target=SimpleNamespace(soc="SM8650", htp_arch=75)),
        "QCM6490": SimpleNamespace(target=SimpleNamespace(soc="QCM6490", htp_arch=68)),
    }
    for m in manifests.values():
        m.contract = SimpleNamespace(weight_sharing=True)
        m.quantization = SimpleNamespace(scheme="16a8w")
        m.versions = SimpleNamespace(qairt_build_id="v2.49.40")
    sdk = SimpleNamespace(build_id="v2.49.40", source="test")
    import optimum_qnn.artifacts.manifest as manifest_module

    original = manifest_module.read_manifest
    manifest_module.read_manifest = lambda folder: manifests[Path(folder).name]
    try:
        checks = backend_checks(sdk, ["QnnBackend"], machine="aarch64", system="Linux", soc=Soc.QCM6490)
        verdicts = {v.variant: v for v in doctor.judge_variants(tmp_path, checks)}
    finally:
        manifest_module.read_manifest = original
    assert verdicts["QCM6490"].runnable, verdicts["QCM6490"].reason
    assert not verdicts["SM8650"].runnable and "export it with --soc QCM6490" in verdicts["SM8650"].reason


def test_doctor_prints_this_host_s_soc(monkeypatch):
    from optimum_qnn import doctor
    from optimum_qnn.runtime.backends.soc import HostSoc

    monkeypatch.setattr(doctor, "detect_host_soc", lambda system: HostSoc("SM8750", "/sys/devices/soc0/machine", Soc.SM8750))
    out = io.StringIO()
    doctor.run_doctor(out=out, err=io.StringIO())
    text = out.getvalue()
    assert "This host" in text and "SM8750 (Snapdragon 8 Elite, phone, HTP v79)" in text
    assert "QCM6490" in text.split("Targetable SoCs", 1)[1]


def test_doctor_adb_reads_the_phone_s_ro_soc_model(tmp_path, monkeypatch):
    import json

    from optimum_qnn import doctor
    from tests.fake_adb import put_on_path

    put_on_path(tmp_path / "bin", monkeypatch)
    config = tmp_path / "fake_adb.json"
    config.write_text(json.dumps({"root": str(tmp_path), "devices": [["PHONE1", "device"]], "soc": "SM8845",
                                  "df_kb": 10**7, "env": {}, "log": str(tmp_path / "adb.log")}))
    monkeypatch.setenv("FAKE_ADB_CONFIG", str(config))
    reading = doctor._device_soc("", "Linux")
    assert reading.soc is Soc.SM8845 and "adb PHONE1: getprop ro.soc.model" in reading.describe()
