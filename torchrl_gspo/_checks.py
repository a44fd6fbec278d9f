# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""The input rules on values, each written once.

A rule is one function that returns the rows that break it and the error that names
them, the key and the fix. The rules themselves are stated in the documentation's
"Inputs" page. :func:`check_scored` enforces the rules on scored values with one
synchronization, or in-graph under ``torch.compile``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from torchrl_gspo._arguments import Options, warn

RESPONSE_KEY = ("tokens", "response")
PROMPT_KEY, FULL_KEY = ("tokens", "prompt"), ("tokens", "full")


class Rule(NamedTuple):
    """One rule on a batch's values.

    Attributes:
        bad: ``[B]`` the rows that break it (a boolean tensor, no synchronization).
        error: the error naming those rows, built only when some row breaks it.
        warns: whether a broken rule warns instead of raising.
    """

    bad: torch.Tensor
    error: Callable[[], Exception]
    warns: bool = False


def enforce(error: Exception | None, mode: str) -> None:
    """Raises ``error`` (``mode="raise"``), warns with it (``"warn"``), or ignores it."""
    if error is None or mode == "ignore":
        return
    if mode == "raise":
        raise error
    warn(str(error))


def check_scored(owner: str, rules: Sequence[Rule]) -> None:
    """Enforces ``rules``: the first broken one raises, then the broken warnings warn.

    In eager mode one synchronization reads every rule's flag; under ``torch.compile``
    the rules that raise are checked in-graph with ``torch._assert_async`` (no
    data-dependent branch, no graph break) and the eager run gives the details.
    """
    if torch.compiler.is_compiling():
        broken = torch.stack([rule.bad.any() for rule in rules if not rule.warns])
        torch._assert_async(
            broken.logical_not().all(),
            f"{owner}: invalid input (non-finite old or rollout log-probabilities on "
            "response tokens, NaN current log-probabilities, advantages that are "
            "missing, not finite or varying within a sequence, or a sequence scale that "
            "is not finite and >= 0); run the loss eagerly for the details.",
        )
        return
    broken = torch.stack([rule.bad for rule in rules]).any(-1).tolist()
    for rule, bad in zip(rules, broken, strict=True):
        if bad and not rule.warns:
            raise rule.error()
    for rule, bad in zip(rules, broken, strict=True):
        if bad:
            warn(str(rule.error()))


def _where(bad: torch.Tensor) -> str:
    rows = bad.any(-1).nonzero().squeeze(-1).tolist()
    return f"{int(bad.sum())} valid token(s), in batch row(s) {rows}"


def _rows(bad: torch.Tensor) -> list[int]:
    return bad.nonzero().squeeze(-1).tolist()


def finite_log_probs(
    options: Options,
    old: torch.Tensor,
    rollout: torch.Tensor | None,
    valid: torch.Tensor,
    kept: torch.Tensor,
) -> list[Rule]:
    """The old and the rollout log-probabilities are finite on the loss mask.

    Non-finite values are accepted on the prompt only: before a row's first kept
    token, and outside the ``"sft"`` mask.
    """
    keys = options.keys
    if rollout is None:  # kept is then exactly the valid tokens with finite old ones
        roles = [(valid & ~kept, keys.sample_log_prob, "old")]
    else:
        finite_old = valid & old.isfinite()
        roles = [(valid & ~finite_old, keys.old_log_prob, "old")]
        roles.append((finite_old & ~kept, keys.sample_log_prob, "rollout"))
    if options.masking_strategy != "sft":
        after_first = kept.cumsum(-1) > 0
        roles = [(bad & after_first, key, role) for bad, key, role in roles]
    return [
        Rule(
            bad.any(-1),
            lambda bad=bad, key=key, role=role: ValueError(
                f"{options.owner}: the {role} log-probabilities at {key!r} are NaN or "
                f"infinite on {_where(bad)} of the loss mask "
                f"(masking_strategy={options.masking_strategy!r}). Non-finite "
                "log-probabilities are accepted only on the prompt, where vLLM writes "
                "NaN: before the first finite value of a row, and outside the 'sft' "
                "mask. Store a finite log-probability for every response token."
            ),
        )
        for bad, key, role in roles
    ]


def finite_current(options: Options, current: torch.Tensor, mask: torch.Tensor) -> Rule:
    """The actor's log-probabilities are neither NaN nor +inf on the loss mask."""
    bad = mask & ~(current < math.inf)  # NaN or +inf
    return Rule(
        bad.any(-1),
        lambda: ValueError(
            f"{options.owner}: the actor returned NaN or +inf log-probabilities on "
            f"{_where(bad)}. Log-probabilities are at most 0; check the model's "
            "logits (e.g. for overflow in half precision)."
        ),
    )


def finite_advantage(options: Options, has_value: torch.Tensor, mask: torch.Tensor) -> Rule:
    """Every sequence (``has_value`` ``[B]``) or every masked token (``[B, T]``) has a
    finite advantage."""
    key = options.keys.advantage
    if has_value.ndim == 1:
        return Rule(
            ~has_value,
            lambda: ValueError(
                f"{options.owner}: the advantage at {key!r} is NaN or infinite in batch "
                f"row(s) {_rows(~has_value)}. Every sequence needs a finite advantage "
                "(GRPO-style group advantages are finite: check the reward and the group "
                "statistics)."
            ),
        )
    uncovered = mask & ~has_value
    return Rule(
        uncovered.any(-1),
        lambda: ValueError(
            f"{options.owner}: the advantage at {key!r} is NaN, infinite or padding at "
            f"{_where(uncovered)}. Every token of the loss mask needs a finite "
            "advantage; ragged rows are read left-padded, aligned with the end of the "
            "tokens."
        ),
    )


def constant_advantage(options: Options, varies: torch.Tensor) -> Rule:
    """A loss with one advantage per sequence gets advantages constant over each one."""
    return Rule(
        varies,
        lambda: ValueError(
            f"{options.owner}: the advantage at {options.keys.advantage!r} varies across "
            f"the valid tokens of batch row(s) {_rows(varies)}. GSPO needs one "
            "advantage per sequence; for per-token advantages use GSPOTokenLoss "
            "(GSPO-token, paper section 4.3)."
        ),
    )


def valid_scale(options: Options, scale: torch.Tensor) -> Rule:
    """The sequence scale of the global normalization is finite and >= 0."""
    return Rule(
        ~(scale.isfinite() & (scale >= 0)),
        lambda: ValueError(
            f"{options.owner}: the sequence scale at {options.keys.sequence_scale!r} "
            f"must be finite and >= 0, got {scale.tolist()}."
        ),
    )


def response_mask(options: Options, lengths: torch.Tensor, expected: torch.Tensor) -> Rule:
    """The ``"sft"`` mask counts the sampled response's tokens; it warns with
    ``response_mask_check="warn"``."""
    wrong = lengths != expected
    return Rule(
        wrong,
        lambda: ValueError(
            f"{options.owner}: the 'sft' loss mask does not match the sampled responses "
            f"at {RESPONSE_KEY!r} in batch row(s) {_rows(wrong)}: valid tokens "
            f"{lengths[wrong].tolist()} vs response lengths {expected[wrong].tolist()}. "
            "GSPO divides each sequence log-ratio by this count, so those ratios are "
            "wrong. Known cause: a training wrapper with pad_output=True on ragged rows. "
            "Working configuration: TransformersWrapper(input_mode='tokens', "
            "generate=False, return_log_probs=True, pad_output=False) on lazily stacked "
            "data. Pass response_mask_check='warn' or 'ignore' to override."
        ),
        warns=options.response_mask_check == "warn",
    )


def finite_log_ratio(options: Options, log_ratio: torch.Tensor) -> Rule:
    """The sequence log-ratio is not NaN or +inf once every log-probability is finite."""
    bad = ~(log_ratio < math.inf)  # True for NaN and +inf
    return Rule(
        bad,
        lambda: ValueError(
            f"{options.owner}: the sequence log-ratio is not finite in batch row(s) "
            f"{_rows(bad)} although every log-probability is: the current minus the old "
            "log-probabilities overflow. Check the old log-probabilities at "
            f"{options.keys.sample_log_prob!r} (and {options.keys.old_log_prob!r})."
        ),
    )


class ContextCause(NamedTuple):
    """One way a row's ``full`` can differ from its prompt followed by its response.

    Attributes:
        seen: what the row shows, as the error says it.
        applies: ``(full, prompt + response, same ids)`` -> whether the row shows it;
            ``same ids`` is only read when the lengths are equal.
        cause: the cause and its fix for the loss' options, as the error says them.
    """

    seen: str
    applies: Callable[[int, int, bool], bool]
    cause: Callable[[Options], str]


def _removed(options: Options) -> str:
    """Tokens removed after sampling: pad = eos when the actor's tokenizer shows it."""
    tokenizer = options.tokenizer
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is not None and pad == getattr(tokenizer, "eos_token_id", None):
        return (
            f"the actor's tokenizer pads with its end of turn (id {pad}), and TorchRL "
            "strips pad ids from the sampled tokens, every end of turn included. Fix: "
            "give the tokenizer a pad token distinct from its end of turn (e.g. "
            "tokenizer.pad_token = '<|endoftext|>'), set it as the model's "
            "generation_config.pad_token_id, and ban it in generation (bad_words_ids)"
        )
    pad_id = "" if pad is None else f" (id {pad})"
    seen = "its pad token is not its end of turn" if tokenizer is not None else "no tokenizer"
    return (
        f"not known here (the actor's tokenizer: {seen}). TorchRL strips pad ids{pad_id} "
        "from the sampled tokens: if the model can sample the pad token, ban it in "
        "generation (bad_words_ids); otherwise find what removed ids between sampling "
        "and the loss"
    )


def _rewritten(options: Options) -> str:
    """The sequence re-rendered or re-tokenized: the working configuration's fix."""
    by = []
    if options.input_mode == "history":
        by.append(
            "this loss' actor is in history mode: it renders the dialog with its chat "
            "template and tokenizes it again"
        )
    if options.masking_strategy == "rlhf":
        by.append(
            "masking_strategy='rlhf' masks that re-rendered sequence's assistant turns, "
            "which are not the sampled ids"
        )
    here = (
        "; ".join(by) if by else "e.g. a history-mode wrapper's output written back into the batch"
    )
    return (
        f"the sequence was re-rendered or re-tokenized after sampling ({here}). Fix the "
        "data, not only the loss: generate in history mode, keeping the sampled tokens; "
        "score those tokens with a tokens-mode training wrapper (TransformersWrapper(model, "
        "tokenizer=tokenizer, input_mode='tokens', generate=False, return_log_probs=True, "
        "pad_output=False)) and masking_strategy='sft'; compute the old log-probabilities "
        "with RecomputeOldLogProbs(that wrapper); never write a history-mode wrapper's "
        f"{FULL_KEY!r} back into the batch"
    )


CONTEXT_CAUSES = (
    ContextCause(
        "shorter than prompt + response: ids were removed after sampling",
        lambda full, both, same: full < both,
        _removed,
    ),
    ContextCause(
        "longer than prompt + response: ids were added after sampling",
        lambda full, both, same: full > both,
        _rewritten,
    ),
    ContextCause(
        "as long as prompt + response, with other ids",
        lambda full, both, same: full == both and not same,
        _rewritten,
    ),
)


def _same_ids(rows: list[tuple], sizes: list[tuple[int, int]]) -> list[bool]:
    """Whether each row of equal lengths holds the same ids (all at once, row by row
    only when they differ); ``True`` for the others and under ``torch.compile``."""
    same = [True] * len(rows)
    equal = [i for i, (length, both) in enumerate(sizes) if length == both]
    if not equal or torch.compiler.is_compiling():
        return same
    full = torch.cat([rows[i][2] for i in equal], -1)
    if not torch.equal(full, torch.cat([t for i in equal for t in rows[i][:2]], -1)):
        for i in equal:
            prompt, response, full = rows[i]
            same[i] = torch.equal(full, torch.cat([prompt, response], -1))
    return same


def context_mismatch(
    prompts: list, responses: list, fulls: list, options: Options
) -> tuple[list[int], ValueError | None]:
    """Rows whose sequence is not their prompt followed by their response.

    TorchRL's ``Tokens`` hold ``full = prompt + response``, by id. A row that breaks it
    would be scored in a context that was not sampled. Each group of rows is named with
    its cause (:data:`CONTEXT_CAUSES`): shorter rows lost ids after sampling, longer
    rows and rows of other ids were re-rendered or re-tokenized. The ids are compared
    in eager mode, all rows of equal lengths at once (row by row only when they
    differ); under ``torch.compile`` only the lengths are.

    Args:
        prompts (list): each row's tensor at ``("tokens", "prompt")``, ``None`` where
            the row lacks it; so are ``responses`` and ``fulls``.
        responses (list): the rows' ``("tokens", "response")``.
        fulls (list): the rows' ``("tokens", "full")``.
        options (Options): the loss' options (its name, tokenizer, masking strategy
            and actor's input mode name the cause).

    Returns:
        tuple[list[int], ValueError | None]: the bad rows and the error naming them
        (``None`` when every row holds the three keys consistently or a row lacks one).
    """
    rows = list(zip(prompts, responses, fulls, strict=True))
    if any(value is None for row in rows for value in row):
        return [], None
    sizes = [
        (full.shape[-1], prompt.shape[-1] + response.shape[-1]) for prompt, response, full in rows
    ]
    same = _same_ids(rows, sizes)
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for i, (length, both) in enumerate(sizes):
        for k, kind in enumerate(CONTEXT_CAUSES):
            if kind.applies(length, both, same[i]):
                groups.setdefault(k, []).append((i, length, both))
    if not groups:
        return [], None
    lines, given = [], set()
    for k, found in sorted(groups.items()):
        kind = CONTEXT_CAUSES[k]
        cause = "as above" if kind.cause in given else kind.cause(options)
        given.add(kind.cause)
        lines.append(
            f"- row(s) {[i for i, _, _ in found]}: {kind.seen} ({[f for _, f, _ in found]} "
            f"tokens vs {[b for _, _, b in found]}). Cause: {cause}."
        )
    bad = sorted(i for found in groups.values() for i, _, _ in found)
    return bad, ValueError(
        f"{options.owner}: the tokens at {FULL_KEY!r} are not the prompt at "
        f"{PROMPT_KEY!r} followed by the response at {RESPONSE_KEY!r} in batch row(s) "
        f"{bad}, so the loss would score a context that was not sampled.\n"
        + "\n".join(lines)
        + "\nPass response_mask_check='warn' or 'ignore' to override."
    )
