"""What the framework suites share: an update compared with the reference's, and its table cell."""
from __future__ import annotations

RIGHT = 1e-4  # max |A - R| / max |R| below which an update is the reference's


def comparison(a, r) -> dict:
    """``a`` (an update, a flat float64 tensor) against the reference update ``r``."""
    return {"ratio": float(a @ r / (r @ r)), "cosine": float(a @ r / a.norm() / r.norm()),
            "rel": float((a - r).abs().max() / r.abs().max())}


def cell(result: dict, judged: bool) -> str:
    """``ratio / cosine`` and, for a judged row, right or wrong."""
    if "error" in result:
        return "error"
    verdict = "" if not judged else " right" if result["rel"] < RIGHT else " wrong"
    return f"{result['ratio']:.4f} / {result['cosine']:.4f}{verdict}"
