# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Whether the sampled tokens were drawn from the distribution the loss scores."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from torchrl_gspo import _arguments

__all__ = ["SamplerAudit", "SamplerFinding"]

RANKS = (1, 5, 10, 20, 40, 50, 64, 100, 200, 500, 1000)
MASSES = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
TEMPERATURES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.1, 1.25, 1.5)


@dataclass(frozen=True)
class SamplerFinding:
    """What the audit found: the sampler that explains the tokens best, and its fix.

    Attributes:
        cause (str): ``"top_k"``, ``"top_p"`` or ``"temperature"``.
        estimate (float): the fitted ``k``, ``p`` or temperature.
        statistic (str): the test that rejected full sampling, e.g. ``"rank <= 50"``.
        message (str): the warning's text, with the fix.
    """

    cause: str
    estimate: float
    statistic: str
    message: str


class SamplerAudit:
    r"""Sequential tests that the sampled tokens came from the scored distribution.

    A sampler that truncates (top-k, top-p) or sharpens (temperature below 1) the
    distribution the loss scores biases every importance ratio by the mass it cut, and
    nothing in the batch shows it (:doc:`/real_model`). The audit reads the scored
    logits at each sampled position and the sampled token, accumulates over calls, and
    tests full sampling at temperature 1 with three nonnegative martingales under that
    null, so checking after every batch keeps the false-alarm rate below ``alpha``
    (Ville's inequality), split evenly over the tests of the grids (Bonferroni):

    - **rank**: for each :math:`k` of ``ranks``, :math:`M_n(k) = \mathbb{1}[\text{no
      sampled rank} > k] / \prod_{t \le n} S_t(k)`, :math:`S_t(k)` the mass of the
      :math:`k` likeliest tokens at position :math:`t`; a token beyond rank :math:`k`
      refutes truncation at :math:`k` for good;
    - **mass**: the same for each :math:`q` of ``masses``, on the mass strictly before
      the sampled token (sorted by probability), :math:`R_t(q)` the mass of the
      tokens whose preceding mass is below :math:`q`;
    - **temperature**: the mixture over ``temperatures`` of :math:`\prod_t
      \pi_\tau(y_t) / \pi(y_t)`, :math:`\pi_\tau = \operatorname{softmax}(z / \tau)`.

    When one exceeds its threshold the cause is named by likelihood: the sampler of
    the three families (top-k renormalized at the smallest grid :math:`k` above every
    sampled rank, top-p at the smallest grid :math:`q` above every preceding mass, the
    temperature of the grid with the highest likelihood) that gives the sampled
    tokens the highest likelihood. ``banned_ids`` (tokens generation never samples,
    e.g. the pad) are left out of every distribution. The state is a few sums per
    grid point: the audit holds it, the losses stay stateless.

    Keyword Args:
        alpha (float, optional): the false-alarm probability over a whole run.
            Defaults to ``1e-6``: a run checks after every batch for thousands of
            batches, and a false warning costs a user a wrong fix.
        ranks (Sequence[int], optional): the grid of :math:`k`. Defaults to 1, 5,
            10, 20, 40, 50, 64, 100, 200, 500, 1000.
        masses (Sequence[float], optional): the grid of :math:`q`. Defaults to
            0.5, 0.7, 0.8, 0.9, 0.95, 0.99.
        temperatures (Sequence[float], optional): the alternatives' temperatures.
            Defaults to 0.5, 0.6, 0.7, 0.8, 0.9, 1.1, 1.25, 1.5.
        banned_ids (Collection[int], optional): ids generation never samples.
            Defaults to none.

    Examples:
        >>> import torch
        >>> from torchrl_gspo import SamplerAudit
        >>> _ = torch.manual_seed(0)
        >>> logits = torch.randn(300, 1000)
        >>> top = logits.topk(50, -1)  # transformers' default: top_k=50
        >>> tokens = top.indices.gather(-1, torch.multinomial(top.values.softmax(-1), 1))
        >>> audit = SamplerAudit()
        >>> audit.update(logits, tokens.squeeze(-1))
        >>> finding = audit.finding()
        >>> finding.cause, finding.estimate
        ('top_k', 50.0)
    """

    def __init__(
        self,
        *,
        alpha: float = 1e-6,
        ranks: Sequence[int] = RANKS,
        masses: Sequence[float] = MASSES,
        temperatures: Sequence[float] = TEMPERATURES,
        banned_ids: Collection[int] = (),
    ) -> None:
        if not 0 < alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {alpha!r}.")
        if not ranks or any(int(k) != k or k < 1 for k in ranks):
            raise ValueError(f"ranks must be integers >= 1, got {ranks!r}.")
        if not masses or any(not 0 < q < 1 for q in masses):
            raise ValueError(f"masses must lie in (0, 1), got {masses!r}.")
        if not temperatures or any(t <= 0 or t == 1 for t in temperatures):
            raise ValueError(f"temperatures must be > 0 and not 1, got {temperatures!r}.")
        self.alpha = float(alpha)
        self.ranks = torch.tensor(sorted(set(int(k) for k in ranks)))
        self.masses = torch.tensor(sorted(set(float(q) for q in masses)), dtype=torch.float64)
        self.temperatures = torch.tensor([float(t) for t in temperatures], dtype=torch.float64)
        self.banned_ids = torch.tensor(sorted(set(int(i) for i in banned_ids)), dtype=torch.long)
        self.reset()

    def reset(self) -> None:
        """Forgets every batch seen."""
        self.warned = False  # warn once per run
        self.positions = 0
        self.log_likelihood = torch.zeros((), dtype=torch.float64)  # sum log pi(y)
        self.max_rank = 0
        self.max_mass_before = torch.zeros((), dtype=torch.float64)
        self.log_top_mass = torch.zeros(len(self.ranks), dtype=torch.float64)  # sum log S(k)
        self.log_nucleus = torch.zeros(len(self.masses), dtype=torch.float64)  # sum log R(q)
        self.log_ratio = torch.zeros(len(self.temperatures), dtype=torch.float64)

    def update(self, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """Adds the sampled positions of a batch.

        Args:
            logits (torch.Tensor): ``[N, V]`` the scored logits at each sampled
                position (temperature 1, no truncation).
            tokens (torch.Tensor): ``[N]`` the sampled ids.
        """
        if logits.ndim != 2 or tokens.shape != logits.shape[:1]:
            raise ValueError(
                f"SamplerAudit.update expects logits [N, V] and tokens [N], got "
                f"{tuple(logits.shape)} and {tuple(tokens.shape)}."
            )
        z = logits.detach().double()
        if self.banned_ids.numel():
            z = z.index_fill(-1, self.banned_ids.to(z.device), -math.inf)
        tokens = tokens.to(z.device).long().unsqueeze(-1)
        log_p = z.log_softmax(-1)
        chosen = log_p.gather(-1, tokens).squeeze(-1)
        probs = log_p.exp().sort(-1, descending=True).values
        mass = probs.cumsum(-1)  # mass of the i + 1 likeliest tokens
        preceding = mass - probs  # mass strictly before each, nondecreasing
        # the sampled token's rank (1 = likeliest) and the mass strictly before it
        rank = (log_p > chosen.unsqueeze(-1)).sum(-1) + 1
        before = preceding.gather(-1, (rank - 1).unsqueeze(-1)).squeeze(-1)
        top = mass[:, (self.ranks.to(z.device) - 1).clamp(max=z.shape[-1] - 1)]
        # R(q): the mass of the tokens whose preceding mass is below q
        cut = self.masses.to(z.device).expand(z.shape[0], -1).contiguous()
        nucleus = mass.gather(-1, torch.searchsorted(preceding, cut) - 1)
        ratio = torch.stack(
            [
                (z / t).log_softmax(-1).gather(-1, tokens).squeeze(-1)
                for t in self.temperatures.tolist()
            ]
        )
        self.positions += z.shape[0]
        self.log_likelihood += chosen.sum().cpu()
        self.max_rank = max(self.max_rank, int(rank.max()))
        self.max_mass_before = torch.maximum(self.max_mass_before, before.max().cpu())
        self.log_top_mass += top.clamp(max=1.0).log().sum(0).cpu()
        self.log_nucleus += nucleus.clamp(max=1.0).log().sum(0).cpu()
        self.log_ratio += (ratio - chosen).sum(-1).cpu()

    def statistics(self) -> dict[str, torch.Tensor | float | int]:
        """The running statistics, for a trainer to log: each test's log-martingale
        (``-inf`` once refuted) against its log-threshold."""
        alive_k = self.ranks >= self.max_rank
        alive_q = self.masses > self.max_mass_before
        log_rank = torch.where(alive_k, -self.log_top_mass, -math.inf)
        log_mass = torch.where(alive_q, -self.log_nucleus, -math.inf)
        return {
            "positions": self.positions,
            "log_threshold": math.log(self._tests() / self.alpha),
            "rank_log_evidence": log_rank,
            "mass_log_evidence": log_mass,
            "temperature_log_evidence": self.log_ratio.logsumexp(0)
            - math.log(len(self.temperatures)),
            "max_rank": self.max_rank,
            "max_mass_before": float(self.max_mass_before),
        }

    def _tests(self) -> int:
        return len(self.ranks) + len(self.masses) + 1

    def finding(self) -> SamplerFinding | None:
        """The sampler that explains the tokens, once a test rejects full sampling;
        ``None`` before."""
        stats = self.statistics()
        threshold = stats["log_threshold"]
        rejected = []
        k = int(stats["rank_log_evidence"].argmax())
        if stats["rank_log_evidence"][k] >= threshold:
            rejected.append(f"rank <= {int(self.ranks[k])}")
        q = int(stats["mass_log_evidence"].argmax())
        if stats["mass_log_evidence"][q] >= threshold:
            rejected.append(f"mass before < {float(self.masses[q]):g}")
        if stats["temperature_log_evidence"] >= threshold:
            rejected.append("temperature")
        if not rejected:
            return None
        cause, estimate = self._best_fit()
        fixes = {
            "top_k": f"top_k={estimate:g}",
            "top_p": f"top_p={estimate:g}",
            "temperature": f"temperature={estimate:g}",
        }
        message = (
            f"The sampled tokens were not drawn from the distribution the loss scores: "
            f"over {self.positions} sampled positions, full sampling at temperature 1 is "
            f"rejected ({', '.join(rejected)}; false-alarm level {self.alpha:g} per run). "
            f"The sampler that explains them best: {fixes[cause]}. Every importance "
            "ratio is then biased by the mass the sampler cut. Fix: sample the scored "
            "distribution, generate(do_sample=True, top_k=0, top_p=1.0, temperature=1.0) "
            "(transformers keeps the 50 likeliest tokens by default)."
        )
        return SamplerFinding(cause, estimate, rejected[0], message)

    def _best_fit(self) -> tuple[str, float]:
        """The family and parameter whose sampler gives the tokens the highest likelihood."""
        fits = {}
        inside_k = (self.ranks >= self.max_rank).nonzero()
        if inside_k.numel():
            i = int(inside_k[0])
            fits["top_k"] = (float(self.ranks[i]), -float(self.log_top_mass[i]))
        inside_q = (self.masses > self.max_mass_before).nonzero()
        if inside_q.numel():
            i = int(inside_q[0])
            fits["top_p"] = (float(self.masses[i]), -float(self.log_nucleus[i]))
        i = int(self.log_ratio.argmax())
        fits["temperature"] = (float(self.temperatures[i]), float(self.log_ratio[i]))
        cause = max(fits, key=lambda name: fits[name][1])
        return cause, fits[cause][0]

    def check(self, mode: Literal["warn", "raise", "ignore"] = "warn") -> SamplerFinding | None:
        """:meth:`finding`, acted on: warn once per run, raise, or neither.

        ``"raise"`` agrees across the ranks of an initialized process group first
        (every rank raises when one has a finding), so one rank's error does not
        leave the others waiting in the next collective.

        Args:
            mode (str, optional): ``"warn"``, ``"raise"`` or ``"ignore"``. Defaults to
                ``"warn"``.

        Returns:
            SamplerFinding | None: the finding.
        """
        _arguments.choice("sampler_check", mode, ("warn", "raise", "ignore"))
        finding = self.finding()
        if mode == "raise":
            found = torch.tensor(float(finding is not None))
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(found, op=dist.ReduceOp.MAX)
            if found:
                message = finding.message if finding else "another rank's sampler audit failed"
                raise RuntimeError(f"SamplerAudit: {message}")
        elif mode == "warn" and finding is not None and not self.warned:
            _arguments.warn(finding.message)
            self.warned = True
        return finding
