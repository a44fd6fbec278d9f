# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""GSPOLoss against TRL's own GRPOTrainer code, on the same tensors.

TRL has no standalone loss function: its rollout correction is a block of
``GRPOTrainer._generate_and_score_completions`` and its loss is
``GRPOTrainer._compute_loss(model, inputs)``. Both run here without a model: the
trainer is built with ``object.__new__`` around a real ``GRPOConfig``; the correction
block is read from TRL's installed source and executed on our tensors;
``_get_per_token_logps_and_entropies`` is replaced by a function that returns the
bigram actor's log-probabilities of the completion tokens, so that TRL's loss and
ours differentiate the same parameters. Run with ``bash scripts/test_peers.sh``.
"""

from __future__ import annotations

import inspect
import math
import os
import textwrap

import pytest
import torch
import trl
from accelerate import Accelerator
from gspo_testing import BigramActor, lazy_batch, make_rows, padded
from test_rollout import decoupled_batch, decoupled_rows
from trl import GRPOConfig, GRPOTrainer
from trl.experimental.gmpo import GMPOConfig, GMPOTrainer

from torchrl_gspo import GMPOLoss, GSPOLoss, LUSPOLoss, RolloutCorrection, SAPOLoss, VESPOLoss

BEGIN = "# Compute the importance sampling ratio when using vLLM"
END = "# Compute the per-token log probabilities for the reference model"
EPS = (3e-4, 4e-4)  # the paper's clip range: it binds on some sequences, not all
MISMATCH = 0.05  # engine noise per token: the correction bands bind on some rows
# TRL's vllm_importance_sampling_mode -> our (rollout_correction, form); the bands
# are (vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max)
TRL_MODES = {
    "sequence_truncate": ("truncate", "sequence"),
    "sequence_mask": ("masked_is", "sequence"),
    "token_truncate": ("truncate", "token"),
    "token_mask": ("masked_is", "token"),
}
TRL_DEFAULT_BAND = (None, 3.0)
BANDS = [TRL_DEFAULT_BAND, (0.95, 1.025), (None, 1.025), (0.95, None)]


def test_the_installed_trl_is_the_one_compared():
    assert trl.__version__ == os.environ.get("TRL_VERSION", "1.16.0")


def correction_block():
    """TRL's rollout-correction block, dedented, from its installed source."""
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    start = source.rindex("\n", 0, source.index(BEGIN)) + 1  # whole lines
    block = source[start : source.rindex("\n", 0, source.index(END)) + 1]
    return compile(textwrap.dedent(block), "trl-correction-block", "exec")


def trl_trainer(mode, clip_min, clip_max, accumulation, output_dir, **config):
    """A GRPOTrainer for GSPO with vLLM's correction (mode and band), without a model."""
    return trainer_of(
        output_dir,
        accumulation=accumulation,
        vllm=True,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=clip_min,
        vllm_importance_sampling_clip_max=clip_max,
        **config,
    )


def trainer_of(output_dir, *, cls=GRPOTrainer, config=GRPOConfig, accumulation=1, vllm=False, **kw):
    """A trainer of ``cls`` without a model: the attributes its correction and loss read.

    ``kw`` overrides GSPO's settings (``importance_sampling_level="sequence"``,
    ``loss_type="grpo"``, the paper's epsilons, no KL); ``vllm`` says whether the
    batch holds engine log-probs (vLLM itself is not needed).
    """
    gspo = {"importance_sampling_level": "sequence", "loss_type": "grpo", "beta": 0.0}
    if config is GRPOConfig:
        gspo.update(epsilon=EPS[0], epsilon_high=EPS[1])
    args = config(
        output_dir=str(output_dir),
        gradient_accumulation_steps=accumulation,
        report_to="none",
        use_cpu=True,
        bf16=False,
        **{**gspo, **kw},
    )
    trainer = object.__new__(cls)
    trainer.args = args
    trainer.use_vllm = vllm
    for name in (
        "loss_type",
        "importance_sampling_level",
        "beta",
        "top_entropy_quantile",
        "off_policy_mask_threshold",
        "vllm_importance_sampling_correction",
        "vllm_importance_sampling_mode",
        "vllm_importance_sampling_clip_max",
        "vllm_importance_sampling_clip_min",
    ):
        setattr(trainer, name, getattr(args, name))
    high = args.epsilon if args.epsilon_high is None else args.epsilon_high  # as TRL's init
    trainer.epsilon_low, trainer.epsilon_high = args.epsilon, high
    trainer.aux_loss_enabled = False
    trainer._entropy_bonus_enabled = False
    trainer.current_gradient_accumulation_steps = accumulation
    trainer.model = torch.nn.Module().train()
    trainer.accelerator = Accelerator(cpu=True)
    trainer._metrics = {"train": _Metrics(), "eval": _Metrics()}
    return trainer


class _Metrics(dict):
    def __missing__(self, key):
        self[key] = []
        return self[key]


def completion_tensors(rows, actor):
    """TRL's layout: each row's completion (its tokens from the first response token
    on) right-padded, with the response mask as completion mask."""
    tokens = padded(rows, "tokens", 0)
    response = padded(rows, "response", False)
    current = actor.token_log_probs(tokens)
    old, rollout = padded(rows, "old", 0.0), padded(rows, "rollout", float("nan"))
    start = torch.where(response.any(-1), response.int().argmax(-1), tokens.shape[-1])
    width = int((tokens.shape[-1] - start).max())
    index = (start.unsqueeze(-1) + torch.arange(width)).clamp(max=tokens.shape[-1] - 1)
    inside = start.unsqueeze(-1) + torch.arange(width) < tokens.shape[-1]
    mask = response.gather(-1, index) & inside

    def take(values, fill):
        return torch.where(inside, values.gather(-1, index), fill)

    return {
        "completion_ids": take(tokens, 0),
        "completion_mask": mask.long(),
        "current": take(current, 0.0),
        "old": take(old, 0.0),
        "rollout": take(rollout, 0.0),
    }


def trl_loss(trainer, rows, actor, advantages):
    """TRL's correction block (with vLLM), then TRL's _compute_loss, on our rows."""
    t = completion_tensors(rows, actor)
    ratio = None
    if trainer.use_vllm:
        scope = {
            "self": trainer,
            "torch": torch,
            "math": math,
            "completion_mask": t["completion_mask"],
            "tool_mask": None,
            "old_per_token_logps": t["old"],
            "sampling_per_token_logps": t["rollout"],
        }
        exec(correction_block(), scope)
        ratio = scope["vllm_importance_sampling_ratio"]

    def log_probs(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        return t["current"], torch.zeros_like(t["current"]), None

    trainer._get_per_token_logps_and_entropies = log_probs
    size = len(rows)
    inputs = {
        "prompt_ids": torch.zeros(size, 1, dtype=torch.long),
        "prompt_mask": torch.ones(size, 1, dtype=torch.long),
        "completion_ids": t["completion_ids"],
        "completion_mask": t["completion_mask"],
        "advantages": advantages,
        "old_per_token_logps": t["old"],
        "num_items_in_batch": t["completion_mask"].sum(),
    }
    if trainer.use_vllm:
        inputs.update(sampling_per_token_logps=t["rollout"], importance_sampling_ratio=ratio)
    return trainer._compute_loss(trainer.model, inputs), ratio


def grad(loss, actor):
    return torch.autograd.grad(loss, actor.table)[0]


@pytest.mark.parametrize("clip_min,clip_max", BANDS)
@pytest.mark.parametrize("mode", TRL_MODES)
@pytest.mark.parametrize("accumulation", [1, 3])
def test_gspo_loss_equals_trl(mode, clip_min, clip_max, accumulation, tmp_path):
    """TRL's loss with K accumulation steps (each micro-batch's mean divided by K) is
    GSPOLoss with the global normalization over K equal micro-batches: the sequence
    scale c_i = 1 / (K B). Loss and gradient to 1e-12 in float64."""
    actor = BigramActor()
    rows = decoupled_rows(actor, seed=1, mismatch=MISMATCH)
    advantages = torch.stack([r["advantage"].reshape(()) for r in rows])
    trainer = trl_trainer(mode, clip_min, clip_max, accumulation, tmp_path)
    expected, ratio = trl_loss(trainer, rows, actor, advantages)
    ours_mode, form = TRL_MODES[mode]
    loss_fn = GSPOLoss(
        actor,
        entropy_bonus=False,
        rollout_correction=ours_mode,
        rollout_correction_form=form,
        rollout_correction_threshold=(clip_min, clip_max),  # None: no bound, as TRL's
    )
    batch = decoupled_batch("lazy", rows)
    scale = torch.full((len(rows),), 1 / (accumulation * len(rows)), dtype=torch.float64)
    batch.set("sequence_scale", scale)
    out = loss_fn(batch)
    torch.testing.assert_close(out.loss_objective, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        grad(out.loss_objective, actor), grad(expected, actor), rtol=1e-12, atol=1e-12
    )
    # every band but TRL's default binds on some rows (tokens) and not on others;
    # the GSPO clip as well
    changed = (ratio != _unbounded_ratio(rows, form)) & _valid(rows, form)
    if (clip_min, clip_max) != TRL_DEFAULT_BAND:
        assert changed.any() and (~changed & _valid(rows, form)).any()
    assert 0 < out.sequence_clip_fraction < 1


def _unbounded_ratio(rows, form):
    """rho without a band, in TRL's layout ([B, 1] per sequence, [B, T] per token)."""
    t = completion_tensors(rows, BigramActor())
    delta = (t["old"] - t["rollout"]) * t["completion_mask"]
    return delta.sum(-1, keepdim=True).exp() if form == "sequence" else delta.exp()


def _valid(rows, form):
    mask = completion_tensors(rows, BigramActor())["completion_mask"].bool()
    return mask.any(-1, keepdim=True) if form == "sequence" else mask


def test_a_nan_engine_log_prob_is_ratio_one_in_trl_and_an_error_here(tmp_path):
    """The one intended difference: TRL reads a NaN engine log-prob inside a response
    as a token ratio of 1; GSPOLoss raises and names the key."""
    actor = BigramActor()
    rows = decoupled_rows(actor, seed=1, mismatch=MISMATCH)
    response = rows[0]["response"].nonzero().squeeze(-1)
    rows[0]["rollout"] = rows[0]["rollout"].clone()
    rows[0]["rollout"][response[0]] = float("nan")
    advantages = torch.stack([r["advantage"].reshape(()) for r in rows])
    trainer = trl_trainer("token_truncate", None, 3.0, 1, tmp_path)
    loss, ratio = trl_loss(trainer, rows, actor, advantages)
    assert loss.isfinite() and ratio[0, 0] == 1.0
    with pytest.raises(ValueError, match=r"rollout log-probabilities at .*'log_probs'"):
        GSPOLoss(actor, rollout_correction="truncate", rollout_correction_form="token")(
            decoupled_batch("lazy", rows)
        )


def test_trl_defaults_are_our_product_form_defaults(tmp_path):
    """TRL's defaults (sequence_mask, clip_max 3.0, no clip_min) are
    rollout_correction="masked_is" with the product form and its default band."""
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False)
    assert args.vllm_importance_sampling_correction
    assert args.vllm_importance_sampling_mode == "sequence_mask"
    band = (args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max)
    assert band == TRL_DEFAULT_BAND
    default = RolloutCorrection.from_arguments("masked_is", "sequence", None)
    assert (default.low, default.high) == (0.0, TRL_DEFAULT_BAND[1])


@pytest.mark.parametrize("delta", [1.0 + EPS[1], 1.01])
def test_trl_delta_is_max_log_ratio(delta, tmp_path):
    """TRL's two-sided clip (``delta``, the unclipped ratio clamped at delta) equals
    ``max_log_ratio=log(delta)`` when delta >= 1 + eps_high: loss and gradient. The
    ratio exceeds delta on some rows with a negative advantage (asserted)."""
    actor = BigramActor()
    signs = torch.tensor([-1.0, 0.5, 1.0, -0.8, 1.2, -0.4], dtype=torch.float64)
    rows = make_rows(actor=actor, noise=0.05, seed=4, nan_prompt=False, advantages=signs)
    for row in rows:
        row["rollout"] = row["old"]
    advantages = torch.stack([r["advantage"].reshape(()) for r in rows])
    trainer = trainer_of(tmp_path, delta=delta)  # no engine: old = rollout log-probs
    expected, _ = trl_loss(trainer, rows, actor, advantages)
    loss_fn = GSPOLoss(actor, entropy_bonus=False, max_log_ratio=math.log(delta))
    out = loss_fn(lazy_batch(rows))
    torch.testing.assert_close(out.loss_objective, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        grad(out.loss_objective, actor), grad(expected, actor), rtol=1e-12, atol=1e-12
    )
    t = completion_tensors(rows, actor)
    mask = t["completion_mask"].bool()
    log_s = ((t["current"] - t["old"]) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    above = (log_s > math.log(delta)) & mask.any(-1)
    assert (above & (advantages < 0)).any() and (~above & mask.any(-1)).any()


# ---------------------------------------------------------------------------------
# GSPO's family against TRL's loss types (no engine: the old log-probs sampled)
# ---------------------------------------------------------------------------------
FAMILY_ADVANTAGES = torch.tensor([1.0, -0.5, 1.2, 0.8, -1.0, -0.4], dtype=torch.float64)


def family_rows(noise, seed=0):
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=noise, seed=seed, advantages=FAMILY_ADVANTAGES)
    for row in rows:
        row["rollout"] = row["old"]
    return actor, rows


def assert_same(ours, theirs, actor):
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad(ours, actor), grad(theirs, actor), rtol=1e-12, atol=1e-12)


def test_luspo_equals_trl(tmp_path):
    actor, rows = family_rows(noise=5e-3)
    trainer = trainer_of(tmp_path, loss_type="luspo", epsilon=2e-3, epsilon_high=2.5e-3)
    expected, _ = trl_loss(trainer, rows, actor, FAMILY_ADVANTAGES)
    out = LUSPOLoss(actor, entropy_bonus=False)(lazy_batch(rows))
    assert_same(out.loss_objective, expected, actor)
    assert 0 < out.sequence_clip_fraction < 1


def test_sapo_equals_trl(tmp_path):
    """SAPO per token (TRL's importance_sampling_level="token"). TRL builds the
    temperatures as a float32 tensor (1.05 becomes 1.0499999523); a negative one exact
    in float32, 1.0625, compares the rest to 1e-12."""
    actor, rows = family_rows(noise=1.0)
    trainer = trainer_of(
        tmp_path, loss_type="sapo", importance_sampling_level="token", sapo_temperature_neg=1.0625
    )
    expected, _ = trl_loss(trainer, rows, actor, FAMILY_ADVANTAGES)
    out = SAPOLoss(actor, entropy_bonus=False, temperatures=(1.0, 1.0625))(lazy_batch(rows))
    assert_same(out.loss_objective, expected, actor)
    assert 0 < out.objective_diagnostic < 0.99  # some gates saturate


def test_vespo_equals_trl(tmp_path):
    """VESPO: TRL divides by the batch's tokens (num_items_in_batch), as token_mean."""
    actor, rows = family_rows(noise=0.3)
    trainer = trainer_of(tmp_path, loss_type="vespo", importance_sampling_level="token")
    expected, _ = trl_loss(trainer, rows, actor, FAMILY_ADVANTAGES)
    out = VESPOLoss(actor, entropy_bonus=False)(lazy_batch(rows))
    assert_same(out.loss_objective, expected, actor)
    assert out.objective_diagnostic < 0.95  # phi(W) away from 1 on some rows


def test_vespo_with_an_engine_equals_trl_when_its_band_does_not_bind(tmp_path):
    """TRL folds its (token_truncate) vLLM ratio into W; with a cap that never binds
    that is W against the engine's log-probs, VESPOLoss' W."""
    actor = BigramActor()
    rows = decoupled_rows(actor, seed=1, mismatch=MISMATCH)
    for row, advantage in zip(rows, FAMILY_ADVANTAGES, strict=True):
        row["advantage"] = advantage.reshape(1, 1)
    trainer = trainer_of(
        tmp_path,
        vllm=True,
        loss_type="vespo",
        importance_sampling_level="token",
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=1e9,
    )
    expected, _ = trl_loss(trainer, rows, actor, FAMILY_ADVANTAGES)
    out = VESPOLoss(actor, entropy_bonus=False)(decoupled_batch("lazy", rows))
    assert_same(out.loss_objective, expected, actor)


def test_gmpo_equals_trl_but_for_empty_rows(tmp_path):
    """TRL's experimental GMPO weighs an empty row by exp(0) = 1, adding -A_i / B to
    the loss value; GMPOLoss counts it 0 (the gradient is the same)."""
    actor, rows = family_rows(noise=0.6)
    trainer = trainer_of(tmp_path, cls=GMPOTrainer, config=GMPOConfig)
    expected, _ = trl_loss(trainer, rows, actor, FAMILY_ADVANTAGES)
    out = GMPOLoss(actor, entropy_bonus=False)(lazy_batch(rows))
    empty = torch.tensor([not row["response"].any() for row in rows])
    assert empty.sum() == 1
    shift = -(FAMILY_ADVANTAGES * empty).sum() / len(rows)
    assert_same(out.loss_objective + shift, expected, actor)
    assert 0 < out.objective_diagnostic < 1  # some tokens clipped


@pytest.mark.parametrize("vllm", [False, True])
def test_off_policy_masking_equals_trl(vllm, tmp_path):
    """OPSM's "sampling" log-probs: the engine's with vLLM (with TRL's default
    correction, sequence_mask), the old ones without."""
    actor = BigramActor()
    rows = decoupled_rows(actor, seed=2, mismatch=0.3 if vllm else 0.0)
    for row, advantage in zip(rows, FAMILY_ADVANTAGES, strict=True):
        row["advantage"] = advantage.reshape(1, 1)
        if not vllm:
            row["rollout"] = row["old"]
    delta = 0.0
    trainer = trainer_of(tmp_path, vllm=vllm, off_policy_mask_threshold=delta)
    expected, _ = trl_loss(trainer, rows, actor, FAMILY_ADVANTAGES)
    kwargs = {"rollout_correction": "masked_is", "rollout_correction_form": "sequence"}
    loss_fn = GSPOLoss(
        actor, entropy_bonus=False, off_policy_mask_threshold=delta, **(kwargs if vllm else {})
    )
    batch = decoupled_batch("lazy", rows) if vllm else lazy_batch(rows)
    out = loss_fn(batch)
    assert_same(out.loss_objective, expected, actor)
    assert 0 < out.off_policy_masked_fraction < 1
