# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""GRPOLoss, DAPO and CISPOLoss outputs of one torchrl, to compare across versions.

Two torchrl versions never share a process: ``dump`` runs once per version (the
installed release, and patched copies first on ``PYTHONPATH``) and writes every
output field and gradient of a fixed set of cases; ``compare`` reads the files.

    python upstream/checks/grpo_outputs.py dump stock.pt
    PYTHONPATH=<patched copy> python upstream/checks/grpo_outputs.py dump patched.pt
    python upstream/checks/grpo_outputs.py compare stock.pt patch1.pt series.pt

``compare`` checks that the first patch changes only what it lists, each to its
expected value, and that the rest of the series changes nothing, bit for bit:

- ``clip_fraction``: the release divides the clipped tokens by all ``B x T``
  positions (and counts the tokens that the KL mask drops); patched, it is the
  clipped share of the loss mask. Both are counted here from the token log-ratios;
- ``loss_objective`` (and its gradient) on lazily stacked ragged per-token
  advantages: patched, it equals the stock value on the same rows left-padded
  into a dense batch, where no padding is read;
- ``prompt_mean``: the ``loss_*`` terms' shape goes from ``(1,)`` to ``()``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "test"))

# a loss' options, by name; each runs on each batch below. KL_MASK drops about a third
# of the valid tokens of these batches (0.5 * log-ratio^2 above it).
KL_MASK = 0.05
LOSSES = {
    "grpo": ("GRPOLoss", {}),
    "grpo-prompt-mean": ("GRPOLoss", {"aggregation": "prompt_mean"}),
    "grpo-none": ("GRPOLoss", {"aggregation": "none"}),
    "grpo-kl": ("GRPOLoss", {"kl_to_inference_coeff": 0.1, "kl_mask_threshold": KL_MASK}),
    "dapo": ("DAPO", {"clip_epsilon": (0.2, 0.28)}),
    "cispo": ("CISPOLoss", {}),
    "cispo-prompt-mean": ("CISPOLoss", {"aggregation": "prompt_mean"}),
}
BATCHES = ("dense", "lazy", "dense-tokens", "lazy-tokens")
SHAPES = ((3, 5), (2, 1), (4, 0), (1, 7), (2, 3), (5, 4))


def batches() -> dict:
    """Ragged rows (holes, an empty row, NaN prompt log-probs), far enough off-policy
    that GRPO's 0.2 clips; per sequence or per token advantages, dense or lazy; and
    the rows' token log-ratios on the valid tokens, for the clip counts."""
    # imported here, as torchrl below: `compare` imports no torchrl
    from gspo_testing import BigramActor, make_rows, padded, ragged_batch

    out = {}
    for name in BATCHES:
        actor = BigramActor(seed=0)
        rows = make_rows(SHAPES, seed=0, actor=actor, noise=0.3)
        layout = "lazy" if name.startswith("lazy") else "dense"
        data = ragged_batch(rows, layout, per_token=name.endswith("tokens"), seed=1)
        old = padded(rows, "old", 0.0)
        valid = padded(rows, "response", False) & old.isfinite()
        with torch.no_grad():
            log_ratio = actor.token_log_probs(padded(rows, "tokens", 0)) - old
        out[name] = (actor, data, log_ratio[valid])
    return out


def clip_counts(log_ratio: torch.Tensor, positions: int, options: dict) -> dict:
    """The clip fraction over all positions (the release) and over the loss mask (the
    first patch), from the token log-ratios and GRPOLoss' float32 clip bounds."""
    eps = options.get("clip_epsilon", 0.2)
    low, high = eps if isinstance(eps, tuple) else (eps, eps)
    low, high = torch.tensor(-low).log1p().item(), torch.tensor(high).log1p().item()
    clipped = (log_ratio < low) | (log_ratio > high)
    kept = torch.ones_like(clipped)
    if "kl_mask_threshold" in options:
        kept = 0.5 * log_ratio**2 <= options["kl_mask_threshold"]
    return {
        "release": int(clipped.sum()) / positions,
        "patched": int((clipped & kept).sum()) / int(kept.sum()),
        "kl_dropped": int((~kept).sum()),
    }


def dump(path: str) -> None:
    import torchrl.objectives.llm as llm

    results = {"torchrl": llm.__file__}
    for batch_name, (actor, data, log_ratio) in batches().items():
        positions = data.get(("tokens", "full"), as_padded_tensor=True).numel()
        for loss_name, (cls, kwargs) in LOSSES.items():
            out = getattr(llm, cls)(actor, **kwargs)(data.copy())
            fields = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
            params = list(actor.parameters())
            total = sum(v.sum() for k, v in fields.items() if k.startswith("loss_"))
            results[f"{loss_name}/{batch_name}"] = {
                "fields": {k: v.detach() for k, v in fields.items()},
                "grad": torch.autograd.grad(
                    fields["loss_objective"].sum(), params, retain_graph=True
                )[0],
                "grad_total": torch.autograd.grad(total, params)[0],
                "clip": clip_counts(log_ratio, positions, kwargs),
            }
    torch.save(results, path)
    print(f"dumped {len(results) - 1} cases from {results['torchrl']}")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


def _expected(case: str, key: str, stock: dict, dense: dict) -> torch.Tensor:
    """The value the first patch must give to one field of one case."""
    value = stock["fields"][key]
    if key == "clip_fraction":  # the clipped tokens, over the loss mask
        return torch.tensor(stock["clip"]["patched"], dtype=value.dtype)
    if key in ("loss_objective", "loss_entropy"):
        if case.endswith("/lazy-tokens"):  # the stock value, read without padding
            value = dense["fields"][key]
        if "prompt-mean" in case:  # (1,) -> ()
            assert value.shape == (1,), (case, key, value.shape)
            value = value.reshape(())
    return value


def _first_patch(case: str, stock: dict, patched: dict, dense: dict) -> list[str]:
    """What the first patch changes in one case, each field against its expected value."""
    errors = []
    if stock["fields"].keys() != patched["fields"].keys():
        errors.append(f"{case}: the fields changed")
    release = torch.tensor(stock["clip"]["release"], dtype=stock["fields"]["clip_fraction"].dtype)
    close = 4 * torch.finfo(release.dtype).eps
    if not torch.allclose(stock["fields"]["clip_fraction"], release, rtol=close, atol=0):
        errors.append(f"{case}: the release's clip fraction is not the counted one")
    for key in stock["fields"].keys() & patched["fields"].keys():
        new, expected = patched["fields"][key], _expected(case, key, stock, dense)
        if key == "clip_fraction":  # one rounding apart at most
            same = torch.allclose(new, expected, rtol=close, atol=0)
        else:
            same = _same(new, expected)
        if not same:
            errors.append(f"{case}: {key} is {new}, expected {expected}")
    ragged = case.endswith("/lazy-tokens")
    for grad in ("grad", "grad_total"):
        if not _same(patched[grad], (dense if ragged else stock)[grad]):
            errors.append(f"{case}: the {grad} changed")
    return errors + _exercised(case, stock, dense)


def _exercised(case: str, stock: dict, dense: dict) -> list[str]:
    """Each fix is exercised: the two clip fractions differ, the KL mask drops
    tokens, and the release misreads the ragged advantages."""
    errors = []
    counts = stock["clip"]
    if not 0 < counts["patched"] != counts["release"]:
        errors.append(f"{case}: the clip fraction's fix is not exercised")
    if "kl" in case and counts["kl_dropped"] == 0:
        errors.append(f"{case}: the KL mask drops no token")
    if case.endswith("/lazy-tokens"):
        misread = stock["fields"]["loss_objective"], dense["fields"]["loss_objective"]
        if _same(*misread):
            errors.append(f"{case}: the stock loss reads the ragged advantages right")
    return errors


def compare(stock_path: str, patch1_path: str, series_path: str) -> int:
    stock, patch1, series = (
        torch.load(p, weights_only=False) for p in (stock_path, patch1_path, series_path)
    )
    errors = []
    cases = [k for k in stock if k != "torchrl"]
    for case in cases:
        dense_case = case.replace("/lazy-tokens", "/dense-tokens")
        errors += _first_patch(case, stock[case], patch1[case], stock[dense_case])
        a, b = patch1[case], series[case]
        if a["fields"].keys() != b["fields"].keys():
            errors.append(f"{case}: the series changed the fields")
        for key in a["fields"].keys() & b["fields"].keys():
            if not _same(a["fields"][key], b["fields"][key]):
                errors.append(f"{case}: the hooks changed {key}")
        for grad in ("grad", "grad_total"):
            if not _same(a[grad], b[grad]):
                errors.append(f"{case}: the hooks changed the {grad}")
    for error in errors:
        print(error)
    verdict = f"FAILED ({len(errors)} differences)" if errors else "passed"
    print(
        f"{len(cases)} cases: stock -> patch 1 changes only the listed fields, each to "
        f"its expected value; patch 1 -> the series changes nothing: {verdict}"
    )
    return 1 if errors else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("dump").add_argument("path")
    paths = sub.add_parser("compare")
    paths.add_argument("stock")
    paths.add_argument("patch1")
    paths.add_argument("series")
    args = parser.parse_args()
    if args.command == "dump":
        dump(args.path)
        return 0
    return compare(args.stock, args.patch1, args.series)


if __name__ == "__main__":
    sys.exit(main())
