"""The SoCs an export can target: every chipset of the pinned ExecuTorch (1.5.1) and what each HTP arch can do.

Plain Python (no torch, no executorch import) so the CLI, `doctor` and the runtime read it cheaply. The facts come
from the pinned stack and are checked against it by tests/test_socs.py:

- the SoC model id, HTP arch and VTCM size of each chipset: `QcomChipset` and `_soc_info_table` in
  executorch/backends/qualcomm/serialization/qc_schema.py;
- what an arch cannot do (`ARCH_LIMITS`): each row names where the limit comes from (ExecuTorch's quantizer rules,
  its compiler-spec docstring) and the test that measures it on the x86 HTP emulator, which runs every arch from
  v68 to v81 inside onnxruntime-qnn 2.5.0's libQnnHtp.so.

The marketing names and device classes are Qualcomm's product names, not ExecuTorch's; "" where the part number
is all the pinned stack tells.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from optimum_qnn.errors import UnsupportedOnSocError, parse_enum


@dataclass(frozen=True)
class SocInfo:
    """One chipset: its QNN SoC model id, HTP arch, VTCM (MB), and what people call it."""

    soc_model: int
    htp_arch: int
    vtcm_mb: int
    marketing: str
    device: str


# name -> SocInfo, in ExecuTorch's QcomChipset order. Ids, arches and VTCM: qc_schema.py (ExecuTorch 1.5.1).
_TABLE: dict[str, SocInfo] = {
    "SA8295": SocInfo(39, 68, 8, "Snapdragon Cockpit Gen 4 (SA8295P)", "automotive"),
    "SA8797": SocInfo(72, 81, 16, "", "automotive"),
    "SC8380XP": SocInfo(60, 73, 8, "Snapdragon X Elite", "Windows laptop"),
    "SM8350": SocInfo(30, 68, 4, "Snapdragon 888", "phone"),
    "SM8450": SocInfo(36, 69, 8, "Snapdragon 8 Gen 1", "phone"),
    "SM8475": SocInfo(42, 69, 8, "Snapdragon 8+ Gen 1", "phone"),
    "SM8550": SocInfo(43, 73, 8, "Snapdragon 8 Gen 2", "phone"),
    "SM8650": SocInfo(57, 75, 8, "Snapdragon 8 Gen 3", "phone"),
    "SM8750": SocInfo(69, 79, 8, "Snapdragon 8 Elite", "phone"),
    "SM8850": SocInfo(87, 81, 8, "Snapdragon 8 Elite Gen 5", "phone"),
    "SSG2115P": SocInfo(46, 73, 2, "Snapdragon AR1 Gen 1", "smart glasses"),
    "SSG2125P": SocInfo(58, 73, 2, "Snapdragon AR1+ Gen 1", "smart glasses"),
    "SXR1230P": SocInfo(45, 73, 2, "", "XR headset"),
    "SXR2230P": SocInfo(53, 69, 8, "Snapdragon XR2 Gen 2", "XR headset"),
    "SXR2330P": SocInfo(75, 79, 8, "", "XR headset"),
    "QCS9100": SocInfo(77, 73, 8, "Dragonwing IQ-9 (IQ-9075)", "Linux board"),
    "SAR2230P": SocInfo(95, 81, 4, "", "AR glasses"),
    "SA8255": SocInfo(52, 73, 8, "Snapdragon Cockpit (SA8255P)", "automotive"),
    "SW6100": SocInfo(96, 81, 4, "", "wearable"),
    "QCM6490": SocInfo(93, 68, 2, "Dragonwing QCM6490 (RB3 Gen 2)", "Linux board"),
    "SM8845": SocInfo(97, 81, 8, "Snapdragon 8 Gen 5", "phone"),
}


class Soc(enum.Enum):
    """Snapdragon SoCs whose Hexagon HTP the exporter targets (value: ExecuTorch's `QcomChipset` name)."""

    SA8295 = "SA8295"
    SA8797 = "SA8797"
    SC8380XP = "SC8380XP"
    SM8350 = "SM8350"
    SM8450 = "SM8450"
    SM8475 = "SM8475"
    SM8550 = "SM8550"
    SM8650 = "SM8650"
    SM8750 = "SM8750"
    SM8850 = "SM8850"
    SSG2115P = "SSG2115P"
    SSG2125P = "SSG2125P"
    SXR1230P = "SXR1230P"
    SXR2230P = "SXR2230P"
    SXR2330P = "SXR2330P"
    QCS9100 = "QCS9100"
    SAR2230P = "SAR2230P"
    SA8255 = "SA8255"
    SW6100 = "SW6100"
    QCM6490 = "QCM6490"
    SM8845 = "SM8845"

    @classmethod
    def parse(cls, value: object) -> "Soc":
        return parse_enum(cls, value, "SoC")

    @classmethod
    def from_soc_model(cls, soc_model: int) -> "Soc | None":
        """The SoC of a QNN SoC model id (what a context binary records), or None when this table lacks it."""
        return next((s for s in cls if s.info.soc_model == soc_model), None)

    @property
    def info(self) -> SocInfo:
        return _TABLE[self.value]

    @property
    def htp_arch(self) -> int:
        """Hexagon architecture version (68, 69, 73, 75, 79 or 81)."""
        return self.info.htp_arch

    @property
    def description(self) -> str:
        """``Snapdragon 8 Gen 3, phone, HTP v75``."""
        info = self.info
        return f"{', '.join(filter(None, (info.marketing, info.device)))}, HTP v{info.htp_arch}"

    @property
    def label(self) -> str:
        """``SM8650 (Snapdragon 8 Gen 3, phone, HTP v75)``: for help text and messages."""
        return f"{self.value} ({self.description})"


HTP_ARCHS = (68, 69, 73, 75, 79, 81)


@dataclass(frozen=True)
class ArchLimit:
    """A feature the HTP archs before `min_arch` lack: what it is, why, where that comes from, and what to use."""

    feature: str
    min_arch: int
    source: str
    instead: str


# Keyed by feature; `scheme_features` says which a quant scheme uses. Each limit is measured on the x86 emulator
# (QAIRT 2.49.40) by tests/test_socs_emulator.py.
ARCH_LIMITS: dict[str, ArchLimit] = {
    "16-bit activations": ArchLimit(
        "16-bit activations (the attention's activation-by-activation MatMul)", 73,
        "QNN's op validation, measured on the emulator: a MatMul of two 16-bit activations fails on v68 and v69 "
        "with 'has incorrect Value 68, expected >= 73' (QnnBackend_validateOpConfig 3110)",
        "--quant 8a8w",
    ),
    "fp16": ArchLimit(
        "HTP fp16 precision", 69,
        "ExecuTorch generate_htp_compiler_spec: 'Only premium tier SoC like Snapdragon 8 Gen 1 or newer can support "
        "HTP fp16' (backends/qualcomm/utils/utils.py); on the emulator a v68 fp16 MLP's linears and GELU fall to "
        "the CPU, or its compile fails ('no properties registered for q::QNN_Gelu')",
        "--quant 8a8w",
    ),
    "16-bit weights": ArchLimit(
        "16-bit activations with 16-bit weights", 73,
        "ExecuTorch validate_16a16w_support: htp_arch >= V73 (backends/qualcomm/quantizer/annotators/htp_rules.py)",
        "--quant 16a8w",
    ),
    "LPBQ": ArchLimit(
        "block-wise 4-bit weights (LPBQ)", 69,
        "ExecuTorch validate_lpbq_support: htp_arch >= V69 (backends/qualcomm/quantizer/annotators/htp_rules.py); "
        "on the emulator a v68 block-quantized linear compiled and ran, but 16a4w_block's 16-bit activations are "
        "refused on v68 first",
        "--quant 16a4w (per-channel 4-bit weights)",
    ),
}


_SCHEME_FEATURES = {"16a16w": ["16-bit weights"], "16a4w_block": ["LPBQ"]}


def scheme_features(scheme: str) -> list[str]:
    """The ARCH_LIMITS features a quant scheme's value uses: ``16a4w_block`` -> 16-bit activations and LPBQ."""
    if scheme == "fp16":
        return ["fp16"]
    return (["16-bit activations"] if scheme.startswith("16a") else []) + _SCHEME_FEATURES.get(scheme, [])


def arch_supports(arch: int, feature: str) -> bool:
    """Whether HTP `arch` can run `feature`: a key of ARCH_LIMITS, or a quant scheme's value (all it uses)."""
    features = [feature] if feature in ARCH_LIMITS else scheme_features(feature)
    return all(arch >= ARCH_LIMITS[f].min_arch for f in features)


def check_supported(soc: Soc, schemes: list[str]) -> None:
    """Refuse the first feature of `schemes` (quant scheme values) that `soc`'s HTP lacks, naming the fix.

    Raises:
        UnsupportedOnSocError: naming the SoC, the reason with its source, and the nearest working choice.
    """
    lacking = [(s, f) for s in schemes for f in scheme_features(s) if not arch_supports(soc.htp_arch, f)]
    if lacking:
        scheme, feature = lacking[0]
        limit = ARCH_LIMITS[feature]
        able = [s.value for s in Soc if s.htp_arch >= limit.min_arch][:4]
        raise UnsupportedOnSocError(
            f"{soc.label} cannot run {scheme}'s {limit.feature}: it needs HTP v{limit.min_arch} or newer "
            f"[{limit.source}]. Use {limit.instead} for {soc.value}, or target a v{limit.min_arch}+ SoC such as "
            f"{', '.join(able)}"
        )


def soc_table_markdown() -> str:
    """The SoC table of docs/exporting.md: one row per chipset, grouped by HTP arch."""
    lines = [
        "| `--soc` | chip | device | HTP | VTCM | 8a8w | fp16 | 16a8w, 16a4w | 16a16w | 16a4w_block |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for soc in sorted(Soc, key=lambda s: (s.htp_arch, s.value)):
        info = soc.info
        marks = ["yes" if arch_supports(info.htp_arch, f) else "no" for f in ("8a8w", "fp16", "16a8w", "16a16w", "16a4w_block")]
        lines.append(
            f"| {soc.value} | {info.marketing or '-'} | {info.device} | v{info.htp_arch} | {info.vtcm_mb} MB | "
            + " | ".join(marks) + " |"
        )
    return "\n".join(lines)
