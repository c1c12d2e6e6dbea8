"""`--size-budget`: how much of a 4-bit export may stay at 8-bit weights (a choice of `optimum_qnn.config`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from optimum_qnn.errors import InvalidInputError

_GB = 2**30


@dataclass(frozen=True)
class SizeBudget:
    """How much of a 4-bit export may stay at 8-bit weights (the most logit-sensitive linears first).

    Exactly one of: `share`, the fraction (0, 1] of the HTP linear weights' parameters kept at 8 bits; or
    `gigabytes`, the most the HTP linear weights may take (4-bit ones plus the 8-bit ones kept).
    """

    share: float | None = None
    gigabytes: float | None = None

    def __post_init__(self) -> None:
        given = [v for v in (self.share, self.gigabytes) if v is not None]
        if len(given) != 1 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in given):
            raise InvalidInputError(
                f"A size budget is one number: a share of the linear weights such as '25%', or gigabytes such as "
                f"'1.3GB'; got share={self.share!r}, gigabytes={self.gigabytes!r}"
            )
        if self.share is not None and not 0 < self.share <= 1:
            raise InvalidInputError(f"--size-budget share must lie in (0%, 100%]; got {self.share * 100:g}%; e.g. '25%'")
        if self.gigabytes is not None and self.gigabytes <= 0:
            raise InvalidInputError(f"--size-budget must be a positive number of GB, e.g. '1.3GB'; got {self.gigabytes!r}")

    @classmethod
    def parse(cls, text: str) -> "SizeBudget":
        """`"25%"` (share of the linear weights at 8 bits) or `"1.3GB"` / `"1.3"` (GB of HTP linear weights)."""
        value = str(text).strip().lower()
        share = value.endswith("%")
        try:
            number = float(value[:-1] if share else value.removesuffix("gb"))
        except ValueError:
            raise InvalidInputError(
                f"Cannot parse --size-budget {text!r}; expected a share of the linear weights kept at 8 bits such as "
                "'25%', or the gigabytes the HTP linear weights may take such as '1.3GB'"
            ) from None
        return cls(share=number / 100) if share else cls(gigabytes=number)

    def upgradable(self, params: int, low_bits: int, high_bits: int) -> int:
        """How many of `params` linear weight parameters may go from `low_bits` to `high_bits`.

        Raises:
            InvalidInputError: a GB budget below the size of every weight at `low_bits`.
        """
        if self.share is not None:
            return int(self.share * params)
        floor = params * low_bits / 8
        if self.gigabytes * _GB < floor:
            raise InvalidInputError(
                f"--size-budget {self}: this model's HTP linear weights take {floor / _GB:.4g} GB at {low_bits} bits "
                f"already; give at least that, or a share of them to keep at {high_bits} bits such as '25%'"
            )
        return min(params, int((self.gigabytes * _GB - floor) * 8 / (high_bits - low_bits)))

    def __str__(self) -> str:
        return f"{self.share * 100:g}%" if self.share is not None else f"{self.gigabytes:g}GB"
