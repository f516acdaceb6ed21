"""An MoE layer's form: the grouped GEMMs' masked form for few tokens, the contiguous form above
(``tileq.moe.fused_moe`` runs the form chosen here; docs/moe.md)."""

from __future__ import annotations

from . import thresholds

# The masked form's buffers and grid scale with E x C rows (C = T), the contiguous form's with
# T*k rows plus one tile per expert: the masked form only while E x T stays this small (decode
# batches: T <= 32 at E = 128, T <= 16 at E = 256). The value lives in the thresholds table.
MASKED_MAX_ROWS = int(thresholds.for_arch(None).MOE_MASKED_MAX_ROWS)


def choose_form(tokens: int, num_experts: int) -> tuple[str, str]:
    """('masked' | 'contiguous', why) for T tokens over E experts (shapes only)."""
    rows = tokens * num_experts
    if rows <= MASKED_MAX_ROWS:
        return "masked", (f"E x T = {rows} <= MASKED_MAX_ROWS={MASKED_MAX_ROWS}: masked form (decode: a fixed "
                          "[E, T, K] layout, small buffers)")
    return "contiguous", f"E x T = {rows} > MASKED_MAX_ROWS={MASKED_MAX_ROWS}: contiguous form (T*k sorted rows)"
