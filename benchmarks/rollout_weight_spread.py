# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""How the rollout ratio spreads with the response length: product against geometric.

Each token's engine-to-trainer log-ratio is drawn i.i.d. from N(-sigma^2 / 2, sigma^2),
so that every token ratio has mean 1 (an unbiased engine with noise sigma). For each
length L, ``--rows`` sequences are scored by :func:`torchrl_gspo.rollout_terms`:

- the product ratio rho (``rollout_correction_form="sequence"``, TRL's, verl's and
  NeMo-RL's): log rho ~ N(-L sigma^2 / 2, L sigma^2), so its median exp(-L sigma^2 / 2)
  collapses on long rows while its mean stays 1;
- the geometric ratio (``"geometric"``, GSPO's own length normalization): its log has
  variance sigma^2 / L and concentrates at 1.

The table gives the median and the 5%-95% range of each, and the fraction of rows each
form's default band changes: rho outside (0, 3] (TRL's default ``sequence_mask``
zeroes them, ``sequence_truncate`` caps them) and the geometric ratio outside
(0.999, 1.001) (verl's ``seq_mean_k1`` band). Usage::

    python benchmarks/rollout_weight_spread.py               # sigma 0.01 and 0.025
    python benchmarks/rollout_weight_spread.py --quick       # a smoke run for CI
"""

from __future__ import annotations

import argparse

import torch

from torchrl_gspo import RolloutCorrection, rollout_terms

LENGTHS = (16, 256, 1024, 4096, 9000, 16384)


def spread(sigma: float, length: int, rows: int, generator: torch.Generator) -> dict:
    """The product and geometric weights of ``rows`` sequences of ``length`` tokens."""
    delta = torch.randn(rows, length, generator=generator, dtype=torch.float64) * sigma
    delta -= sigma**2 / 2
    old, rollout = torch.zeros_like(delta), -delta  # log pi_old - log pi_roll = delta
    mask = torch.ones_like(delta, dtype=torch.bool)
    out = {}
    for form, band in (("sequence", (0.0, 3.0)), ("geometric", (0.999, 1.001))):
        correction = RolloutCorrection.from_arguments("mask", form, band)
        terms = rollout_terms(old, rollout, mask, correction)
        log_ratio = terms.log_ratio * (length if form == "sequence" else 1)
        q = torch.quantile(log_ratio.exp(), torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64))
        out[form] = (q[1].item(), q[0].item(), q[2].item(), terms.corrected.mean().item())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sigmas", type=float, nargs="+", default=[0.01, 0.025])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="few rows, short lengths")
    args = parser.parse_args()
    lengths, rows = (LENGTHS[:2], 64) if args.quick else (LENGTHS, args.rows)
    generator = torch.Generator().manual_seed(args.seed)
    print(f"{rows} rows per cell; token log-ratios N(-sigma^2/2, sigma^2), seed {args.seed}")
    print(
        "| sigma | L | product rho: median [5%, 95%] | outside (0, 3] "
        "| geometric: median [5%, 95%] | outside (0.999, 1.001) |"
    )
    print("|---|---|---|---|---|---|")
    for sigma in args.sigmas:
        for length in lengths:
            cell = spread(sigma, length, rows, generator)
            (pm, p5, p95, pout), (gm, g5, g95, gout) = cell["sequence"], cell["geometric"]
            print(
                f"| {sigma} | {length} | {pm:.4g} [{p5:.3g}, {p95:.3g}] | {pout:.3f} "
                f"| {gm:.6f} [{g5:.6f}, {g95:.6f}] | {gout:.3f} |"
            )


if __name__ == "__main__":
    main()
