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

- ``clip_fraction``: the stock value counts the clipped tokens over all ``B x T``
  positions; patched, over the valid tokens;
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

# a loss' options, by name; each runs on each batch below
LOSSES = {
    "grpo": ("GRPOLoss", {}),
    "grpo-prompt-mean": ("GRPOLoss", {"aggregation": "prompt_mean"}),
    "grpo-none": ("GRPOLoss", {"aggregation": "none"}),
    "grpo-kl": ("GRPOLoss", {"kl_to_inference_coeff": 0.1, "kl_mask_threshold": 100.0}),
    "dapo": ("DAPO", {"clip_epsilon": (0.2, 0.28)}),
    "cispo": ("CISPOLoss", {}),
    "cispo-prompt-mean": ("CISPOLoss", {"aggregation": "prompt_mean"}),
}
BATCHES = ("dense", "lazy", "dense-tokens", "lazy-tokens")
SHAPES = ((3, 5), (2, 1), (4, 0), (1, 7), (2, 3), (5, 4))


def batches() -> dict:
    """Ragged rows (holes, an empty row, NaN prompt log-probs), far enough off-policy
    that GRPO's 0.2 clips; per sequence or per token advantages, dense or lazy."""
    # imported here, as torchrl below: `compare` imports no torchrl
    from gspo_testing import BigramActor, dense_batch, lazy_batch, left_pad, make_rows

    out = {}
    for name in BATCHES:
        actor = BigramActor(seed=0)
        rows = make_rows(SHAPES, seed=0, actor=actor, noise=0.3)
        valid = sum(int((r["response"] & r["old"].isfinite()).sum()) for r in rows)
        if name.endswith("tokens"):
            gen = torch.Generator().manual_seed(1)
            for row in rows:
                n = row["tokens"].shape[0]
                row["advantage"] = torch.randn(n, 1, generator=gen, dtype=torch.float64)
        if name.startswith("lazy"):
            data = lazy_batch(rows)
        elif name.endswith("tokens"):  # left-padded by hand: nothing is padded on read
            data = dense_batch([{**row, "advantage": torch.zeros(1, 1)} for row in rows])
            data["advantage"] = left_pad([row["advantage"] for row in rows], 0.0)
        else:
            data = dense_batch(rows)
        width = data.get(("tokens", "full"), as_padded_tensor=True).shape[-1]
        out[name] = (actor, data, valid, len(rows) * width)
    return out


def dump(path: str) -> None:
    import torchrl.objectives.llm as llm

    results = {"torchrl": llm.__file__}
    for batch_name, (actor, data, valid, positions) in batches().items():
        for loss_name, (cls, kwargs) in LOSSES.items():
            loss_fn = getattr(llm, cls)(actor, **kwargs)
            out = loss_fn(data.copy())
            loss = out.loss_objective.sum()
            grad = torch.autograd.grad(loss, list(actor.parameters()))[0]
            fields = {k: v.detach() for k, v in out.items() if isinstance(v, torch.Tensor)}
            results[f"{loss_name}/{batch_name}"] = {
                "fields": fields,
                "grad": grad,
                "valid": valid,
                "positions": positions,
            }
    torch.save(results, path)
    print(f"dumped {len(results) - 1} cases from {results['torchrl']}")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


def _expected(case: str, key: str, stock: dict, dense: dict) -> torch.Tensor:
    """The value the first patch must give to one field of one case."""
    value = stock["fields"][key]
    if key == "clip_fraction":  # the clipped tokens, over the valid ones
        clipped = torch.round(value * stock["positions"])
        return (clipped / stock["valid"]).to(value.dtype)
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
    for key in stock["fields"]:
        new, expected = patched["fields"][key], _expected(case, key, stock, dense)
        if key == "clip_fraction":  # one rounding apart at most
            same = torch.allclose(new, expected, rtol=4 * torch.finfo(new.dtype).eps, atol=0)
        else:
            same = _same(new, expected)
        if not same:
            errors.append(f"{case}: {key} is {new}, expected {expected}")
    grad = dense["grad"] if case.endswith("/lazy-tokens") else stock["grad"]
    if not _same(patched["grad"], grad):
        errors.append(f"{case}: the gradient changed")
    # each fix is exercised: some token clips, and the ragged advantages were misread
    if not (0 < stock["fields"]["clip_fraction"] and stock["valid"] < stock["positions"]):
        errors.append(f"{case}: no token clips, or no position is padding")
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
        if not _same(a["grad"], b["grad"]):
            errors.append(f"{case}: the hooks changed the gradient")
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
