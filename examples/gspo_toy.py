# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""GSPO on a real (tiny) transformer, trained by TorchRL's own GRPO pipeline, on a CPU.

The task: the prompt is one letter (``"c"``); the reward of a response is the fraction
of its characters (end-of-turn token excluded) equal to that letter, so partial credit
makes the signal dense, and an empty response scores 0. A randomly initialized two-layer
Qwen2 with a character-level ChatML tokenizer, both built in code (no download), learns
it from scratch in about 4 minutes on 2 CPU cores (both losses).

The pipeline is TorchRL's GRPO recipe with ``GRPOLoss`` swapped for ``GSPOLoss``:

- :class:`~torchrl.envs.llm.ChatEnv` (``ChatEnv.from_dataloader``, history mode) draws a
  prompt letter from a seeded in-code dataset and repeats it ``--group-size`` times;
  ``StepCounter(max_steps=1)`` ends each dialog after one answer, and a small reward
  transform (the task itself) scores the sampled tokens.
- :class:`~torchrl.collectors.llm.LLMCollector` runs the generation wrapper,
  :class:`~torchrl.modules.llm.TransformersWrapper` (``input_mode="history"``,
  ``generate=True``, ``pad_output=False``, sampling restricted to the answer letters and
  the end-of-turn token), and writes each batch into a
  :class:`~torchrl.data.ReplayBuffer` (``LazyStackStorage``) whose
  :class:`~torchrl.objectives.llm.MCAdvantage` transform computes the group-normalized
  advantages.
- :class:`~torchrl.trainers.algorithms.grpo.GRPOTrainer` with ``loss_module=GSPOLoss(...)``
  splits each batch into ``--minibatches`` (4, as in the paper) random minibatches, one
  optimizer step each, so the later minibatches are off-policy and clipping matters. The
  training wrapper is ``TransformersWrapper(input_mode="tokens", generate=False,
  return_log_probs=True, pad_output=False)`` with ``masking_strategy="sft"``: it reads the
  sampled tokens (``("tokens", "full")``), so the mask is exactly the sampled response.

Old log-probs: the generation wrapper's log-probs (``return_log_probs=True`` with
``generate=True``) report 0 for the first response token, which would bias every
sequence ratio by ``|log p(first token)| / |y|``, far beyond GSPO's clip range. The
collector's ``postproc``, :class:`~torchrl_gspo.RecomputeOldLogProbs`, scores the
sampled tokens with a no-grad forward of the training wrapper before the batch enters
the buffer. Here the generator shares the training model, so those are also the
rollout log-probs (written at ``("log_probs", "full")``). With a separate inference
engine, see ``examples/engine_mismatch.py``, which builds this pipeline with a bfloat16
engine (``build_pipeline(..., engine_dtype=torch.bfloat16)``).

Two configuration choices: the environment and the generator run in history mode, as in
TorchRL's recipe, because ``ChatEnv``'s tokens mode (TorchRL 0.14.1) cannot step ragged
responses (it stacks ``("tokens", "full")``); and the generator and the training wrapper
share one model, so no weight synchronization is needed (``weight_sync_sender=None``).

Usage::

    python examples/gspo_toy.py                     # GSPO then GRPO, plots both
    python examples/gspo_toy.py --loss gspo --steps 50 --out outputs/run
    # data-parallel on 2 CPU processes (gloo): DDP and GSPO's global normalization
    torchrun --nproc-per-node 2 examples/gspo_toy.py --loss gspo --out outputs/ddp

Under ``torchrun`` each rank samples its own prompts (seed + rank) and responses, the
whole model is wrapped in ``DistributedDataParallel`` for scoring and training (the
generator runs the unwrapped model: DDP has no ``generate``), and GRPOTrainer steps with
:class:`~torchrl_gspo.GlobalBatchStepper`, so that each step's loss is the mean over
the sequences of all ranks; rank 0 writes the summary and plot from its own batches,
each rank its ``metrics_<loss>_rank<r>.jsonl``, and the summary reports the largest
difference between the ranks' weights at the end (0 when they stayed in sync).
``--untie-head`` gives the model an output head of its own (``Qwen2Config``'s
default) instead of one tied to the embeddings.

``--warm-start N`` first takes N supervised steps on in-code demonstrations (each
letter the prompt's with probability ``--demo-accuracy``), so that RL starts from a
partly competent policy, the regime of the GSPO paper's pretrained models
(``examples/seeds.py paper-regime``).

Outputs in ``--out``: ``metrics_<loss>.jsonl`` (one line per step: reward, loss,
clip_fraction, ESS, mean sequence log-ratio, response length, ...), ``summary.json``
and a plot, ``gspo_vs_grpo.png`` (``gspo.png`` etc. for a single loss).

GRPO's ``clip_fraction`` is an average over all ``B * T`` positions, padding
included; the example rescales it to the fraction of valid response tokens
(masked positions have log-weight 0 and are never clipped, so the rescaling is
exact) so that both losses report the same quantity.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset
from torchrl.collectors.llm import LLMCollector
from torchrl.data import (
    Composite,
    LazyStackStorage,
    ReplayBuffer,
    SamplerWithoutReplacement,
    Unbounded,
)
from torchrl.envs import Compose, EnvBase, InitTracker, StepCounter, Transform
from torchrl.envs.llm import ChatEnv
from torchrl.modules.llm import TransformersWrapper
from torchrl.objectives.llm import GRPOLoss, MCAdvantage
from torchrl.trainers.algorithms.grpo import GRPOTrainer
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from torchrl_gspo import (
    GlobalBatchStepper,
    GMPOLoss,
    GSPOLoss,
    GSPOTokenLoss,
    LUSPOLoss,
    RecomputeOldLogProbs,
    SAPOLoss,
    SubsequenceLoss,
    VESPOLoss,
)

LETTERS = "abcdefgh"  # what a response may contain
PROMPT_LETTERS = "abcd"  # what a prompt asks for
SPECIALS = ("<pad>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = "chatml_format"  # TorchRL's ChatML template (roles "user", "assistant")
# GSPO and its family, each with its paper's defaults; GRPO with TorchRL's
FAMILY = {
    "gspo": GSPOLoss,
    "gspo-token": GSPOTokenLoss,
    "luspo": LUSPOLoss,
    "gmpo": GMPOLoss,
    "sapo": SAPOLoss,
    "vespo": VESPOLoss,
    "sspo": SubsequenceLoss,  # one ratio per segment (SSPO's subsentence ratio)
}
LOSSES = (*FAMILY, "grpo")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level ChatML tokenizer, built in code.

    Its characters are the answer letters and those of the ChatML role names
    ("user", "assistant") and newline, so that TorchRL's template renders exactly.
    """
    chars = sorted(set(LETTERS) | set("user") | set("assistant")) + ["\n"]
    vocab = {token: i for i, token in enumerate([*SPECIALS, *chars])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )


def build_model(
    tokenizer: PreTrainedTokenizerFast, seed: int, tie: bool = True
) -> Qwen2ForCausalLM:
    """A randomly initialized two-layer Qwen2, seeded; ``seed`` also seeds sampling."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=tie,
    )
    return Qwen2ForCausalLM(config).eval()  # eval: no dropout, deterministic ratios


def demonstrations(
    tokenizer: PreTrainedTokenizerFast, rng: random.Random, count: int, args: argparse.Namespace
) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` demonstrations as right-padded tokens and the mask of their responses.

    A prompt is rendered as TorchRL's ChatML template renders a one-turn history; its
    response holds 1 to ``--max-new-tokens`` - 1 letters, each the prompt's letter with
    probability ``--demo-accuracy`` (another letter otherwise), then the end of turn. A
    policy imitating them is partly competent: its expected reward is the accuracy.
    """
    rows, masks = [], []
    for _ in range(count):
        query = rng.choice(PROMPT_LETTERS)
        others = [c for c in LETTERS if c != query]
        length = rng.randint(1, args.max_new_tokens - 1)
        response = "".join(
            query if rng.random() < args.demo_accuracy else rng.choice(others)
            for _ in range(length)
        )
        prompt = tokenizer(f"<|im_start|>user\n{query}<|im_end|>\n<|im_start|>assistant\n")
        answer = tokenizer(response + tokenizer.eos_token)
        rows.append(torch.tensor(prompt["input_ids"] + answer["input_ids"]))
        masks.append(torch.arange(rows[-1].numel()) >= len(prompt["input_ids"]))
    tokens = torch.nn.utils.rnn.pad_sequence(rows, True, tokenizer.pad_token_id)
    return tokens, torch.nn.utils.rnn.pad_sequence(masks, True, False)


def warm_start(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, args) -> None:
    """``--warm-start`` supervised steps (Adam, lr 1e-3, 32 demonstrations each) on
    in-code demonstrations, so that RL starts from a partly competent policy, as the
    GSPO paper's pretrained models do."""
    rng = random.Random(args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(args.warm_start):
        tokens, mask = demonstrations(tokenizer, rng, 32, args)
        logits = model(tokens, attention_mask=(tokens != tokenizer.pad_token_id).long()).logits
        targets = tokens[:, 1:].masked_fill(~mask[:, 1:], -100)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.zero_grad(set_to_none=True)  # RL's first step must not add the last SFT gradient


def banned_token_ids(tokenizer: PreTrainedTokenizerFast) -> list[list[int]]:
    """Everything but the answer letters and the end-of-turn token.

    Banning the pad id is part of TorchRL's recipe (a sampled pad token would be
    silently dropped from the response); whitespace would not survive the history
    round trip; the other template characters are not answers.
    """
    allowed = {tokenizer.convert_tokens_to_ids(c) for c in LETTERS} | {tokenizer.eos_token_id}
    return [[i] for i in range(len(tokenizer)) if i not in allowed]


class LetterPrompts(IterableDataset):
    """An endless, seeded stream of prompts: ``{"query": letter}``."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __iter__(self) -> Iterator[dict[str, str]]:
        while True:
            yield {"query": self.rng.choice(PROMPT_LETTERS)}


def _collate(rows: list[dict[str, str]]) -> TensorDictBase:
    return torch.stack([TensorDict.from_dict(row) for row in rows])


def letter_reward(letter_id: int, response: torch.Tensor, eos_id: int) -> float:
    """Fraction of the response's tokens equal to the prompt letter's (EOS excluded)."""
    chars = response[response != eos_id]
    if chars.numel() == 0:
        return 0.0
    return (chars == letter_id).float().mean().item()


class LetterReward(Transform):
    """The task's verifiable reward, read from the sampled tokens ``("tokens", "response")``."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        super().__init__()
        self.tokenizer = tokenizer

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        responses = tensordict.get(("tokens", "response"), as_list=True)
        letter_ids = self.tokenizer.convert_tokens_to_ids(list(tensordict["query"]))
        rewards = [
            letter_reward(letter_id, response, self.tokenizer.eos_token_id)
            for letter_id, response in zip(letter_ids, responses, strict=True)
        ]
        next_tensordict.set("reward", torch.tensor(rewards).reshape(-1, 1, 1))
        return next_tensordict

    def transform_reward_spec(self, reward_spec: Composite) -> Composite:
        reward_spec.update(Composite(reward=Unbounded(reward_spec.shape + (1, 1))))
        return reward_spec


def inference_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of ``model`` in ``dtype``, standing in for an inference engine.

    Its logits are cast to float32 before any log-softmax or sampling, as inference
    engines compute log-probabilities (vLLM does so from bfloat16 weights).
    """
    engine = copy.deepcopy(model).to(dtype)
    engine.lm_head.register_forward_hook(lambda module, args, output: output.float())
    return engine


def scoring_wrapper(model: torch.nn.Module, tokenizer) -> TransformersWrapper:
    """The training configuration of TransformersWrapper: it scores the sampled tokens."""
    return TransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode="tokens",
        generate=False,
        return_log_probs=True,
        pad_output=False,
    )


def data_parallel() -> tuple[int, int]:
    """``(rank, world size)``; joins the gloo process group when launched by torchrun."""
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def make_env(
    args: argparse.Namespace, tokenizer: PreTrainedTokenizerFast, seed: int | None = None
) -> EnvBase:
    """``--prompts`` prompts per batch, each repeated ``--group-size`` times, one turn each."""
    seed = args.seed if seed is None else seed
    dataloader = DataLoader(LetterPrompts(seed), batch_size=1, collate_fn=_collate)
    env = ChatEnv.from_dataloader(
        dataloader,
        repeats=args.group_size,
        batch_size=(args.prompts * args.group_size,),
        input_mode="history",
    )
    env.append_transform(StepCounter(max_steps=1))
    env.append_transform(InitTracker())  # LLMCollector warns without it; nothing reads it
    env.append_transform(LetterReward(tokenizer))
    return env


def build_loss(name: str, policy: TransformersWrapper, **kwargs) -> GRPOLoss:
    if name in FAMILY:
        return FAMILY[name](policy, entropy_bonus=False, **kwargs)  # paper defaults
    return GRPOLoss(
        policy, clip_epsilon=(0.2, 0.27), aggregation="prompt_mean", entropy_bonus=False
    )


@dataclass
class Task:
    """What :func:`build_pipeline` takes from a task and its model.

    ``make_env(seed)`` builds the environment (prompts, groups, reward);
    ``generate_kwargs`` configure the generator's sampling; ``chat_template_name`` is
    TorchRL's template the generator renders histories with.
    """

    tokenizer: PreTrainedTokenizerFast
    model: torch.nn.Module
    make_env: Callable[[int], EnvBase]
    generate_kwargs: dict
    chat_template_name: str = CHAT_TEMPLATE


def toy_task(
    args: argparse.Namespace,
    model_fn: Callable[[PreTrainedTokenizerFast, int], torch.nn.Module] | None = None,
) -> Task:
    """The letter task: the in-code tokenizer, the model (``build_model`` unless
    ``model_fn(tokenizer, seed)`` builds another), warm-started when asked."""
    tokenizer = build_tokenizer()
    model_fn = model_fn or functools.partial(build_model, tie=not args.untie_head)
    model = model_fn(tokenizer, args.seed)
    if args.warm_start:  # the same demonstrations on every rank: the same weights
        warm_start(model, tokenizer, args)
    generate_kwargs = {
        "max_new_tokens": args.max_new_tokens,
        "do_sample": True,
        "temperature": 1.0,
        "bad_words_ids": banned_token_ids(tokenizer),
    }
    return Task(tokenizer, model, functools.partial(make_env, args, tokenizer), generate_kwargs)


@dataclass
class Pipeline:
    """The TorchRL pieces of one training run."""

    model: torch.nn.Module
    engine: torch.nn.Module  # the generator's model: ``model`` itself, or a copy
    generator: TransformersWrapper  # the collector's policy, generating with ``engine``
    buffer: ReplayBuffer
    collector: LLMCollector
    loss_fn: GRPOLoss
    trainer: GRPOTrainer


def build_pipeline(
    loss_name: str,
    args: argparse.Namespace,
    *,
    engine_dtype: torch.dtype | None = None,
    trainer_key: str = "old_log_probs",
    loss_kwargs: dict | None = None,
    model_fn: Callable[[PreTrainedTokenizerFast, int], torch.nn.Module] | None = None,
    postproc_fn: Callable[[Transform], Transform] | None = None,
    task: Task | None = None,
) -> Pipeline:
    """Environment, collector, replay buffer, loss and trainer for one run.

    With ``engine_dtype=None`` the generator shares the training model, and the
    training wrapper's no-grad forward writes the rollout log-probs
    (``("log_probs", "full")``). With a dtype, the generator runs a copy of the model
    in that dtype (:func:`inference_copy`), an inference engine: its own log-probs are
    the rollout ones, the trainer's recomputed ones go to ``trainer_key`` (the loss'
    old key for GSPOLoss' decoupled mode, another key to leave them unused), and the
    copy takes the trainer's weights after each batch's updates (a state-dict copy:
    TorchRL's weight-sync schemes serve engines in other processes and do not cast).
    ``task`` is the task and model (the letter task, :func:`toy_task`, by default,
    whose model ``model_fn(tokenizer, seed)`` builds), and ``postproc_fn`` wraps the
    collector's postproc (e.g. to record MoE routes). Only the parameters that require
    a gradient are optimized.
    """
    task = task or toy_task(args, model_fn)
    tokenizer, model = task.tokenizer, task.model
    rank, world = data_parallel()
    scored = model
    if world > 1:
        # Data-parallel: each rank samples its own prompts and responses; DDP averages
        # the gradients of the whole model (an untied output head included), and
        # GlobalBatchStepper makes the step's loss the mean over all ranks' sequences.
        torch.manual_seed(args.seed + rank)
        # No buffer sync at each forward: generation runs a different number of
        # forwards on each rank, and every DDP collective must be matched across ranks.
        scored = DistributedDataParallel(model, forward_sync_buffers=False)
    engine = model if engine_dtype is None else inference_copy(model, engine_dtype)
    policy = scoring_wrapper(scored, tokenizer)
    if engine is model:
        postproc = RecomputeOldLogProbs(policy, out_key="log_probs")
    else:
        postproc = Compose(
            RecomputeOldLogProbs(scoring_wrapper(engine, tokenizer), out_key="log_probs"),
            RecomputeOldLogProbs(policy, out_key=trainer_key),
        )
    if postproc_fn is not None:
        postproc = postproc_fn(postproc)
    generator = TransformersWrapper(
        engine,
        tokenizer=tokenizer,
        input_mode="history",
        chat_template_name=task.chat_template_name,
        generate=True,
        pad_output=False,
        return_log_probs=False,
        generate_kwargs=task.generate_kwargs,
    )
    batch_size = args.prompts * args.group_size
    buffer = ReplayBuffer(
        storage=LazyStackStorage(batch_size),
        sampler=SamplerWithoutReplacement(),
        batch_size=batch_size // args.minibatches,
        transform=MCAdvantage(grpo_size=args.group_size),
    )
    total = args.steps * batch_size
    collector = LLMCollector(
        task.make_env(args.seed + rank),
        policy=generator,
        dialog_turns_per_batch=batch_size,
        total_dialog_turns=total,
        replay_buffer=buffer,
        postproc=postproc,
    )
    loss_fn = build_loss(loss_name, policy, **(loss_kwargs or {}))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=args.lr)
    stepper = None  # TorchRL's default stepper
    if world > 1:
        stepper = GlobalBatchStepper(optimizer, clip_norm=None, model=scored)
    trainer = GRPOTrainer(
        collector=collector,
        total_frames=total,
        loss_module=loss_fn,
        optimizer=optimizer,
        optimization_stepper=stepper,
        replay_buffer=buffer,
        weight_sync_sender=None,  # same process: the engine is synced below
        empty_replay_buffer_on_weight_update=True,  # on-policy batches: flush after use
        clip_norm=None,  # plain Adam steps
        progress_bar=False,  # StepMetrics shows its own, with reward and clip fraction
        log_rewards=False,  # logged per step by StepMetrics instead
        log_kl=False,
    )
    if engine is not model:
        trainer.register_op("post_steps", lambda: engine.load_state_dict(model.state_dict()))
    return Pipeline(model, engine, generator, buffer, collector, loss_fn, trainer)


def valid_token_clip_fraction(out: TensorDictBase, data: TensorDictBase, loss_name: str) -> float:
    """``clip_fraction`` over the valid response tokens of ``data``.

    GSPO's already is; GRPO's averages over all ``B * T`` positions of the padded
    ``("tokens", "full")``, and its masked positions (log-weight 0) are never clipped.
    """
    if loss_name != "grpo":
        return float(out.clip_fraction)
    lengths = [r.numel() for r in data.get(("tokens", "response"), as_list=True)]
    width = max(r.numel() for r in data.get(("tokens", "full"), as_list=True))
    return float(out.clip_fraction) * len(lengths) * width / max(sum(lengths), 1)


class StepMetrics:
    """Writes one JSONL record per collected batch from two trainer hooks.

    ``on_loss`` is a forward hook on the loss module (one call per minibatch) and
    ``on_step_end`` a ``"post_steps_log"`` trainer hook, which also moves the progress bar.
    """

    def __init__(self, loss_name: str, file: IO[str], bar: tqdm) -> None:
        self.loss_name = loss_name
        self.file = file
        self.bar = bar
        self.records: list[dict] = []
        self._minibatches: list[dict] = []
        self._start = time.perf_counter()

    def on_loss(self, module: GRPOLoss, args: tuple, out: TensorDictBase) -> None:
        (data,) = args
        seq = getattr(out, "sequence_log_ratio", None)
        own = getattr(out, "objective_diagnostic", None)  # GMPO, SAPO, VESPO's own
        # the share of responses clipped whole: every segment (SubsequenceLoss), the
        # one sequence ratio (GSPO's family); none for GRPO
        whole = getattr(out, "whole_clip_fraction", None)
        whole = getattr(out, "sequence_clip_fraction", None) if whole is None else whole
        segments = getattr(out, "segments_per_sequence", None)
        self._minibatches.append(
            {
                "loss": sum(v.item() for k, v in out.items() if k.startswith("loss_")),
                "clip_fraction": valid_token_clip_fraction(out, data, self.loss_name),
                "ESS": float(out.ESS),
                "sequence_log_ratio": None if seq is None else float(seq),
                "objective_diagnostic": None if own is None else float(own),
                "whole_clip_fraction": None if whole is None else float(whole),
                "segments_per_sequence": None if segments is None else float(segments),
                "rewards": data.get(("next", "reward"), as_list=True),
                "lengths": [r.numel() for r in data.get(("tokens", "response"), as_list=True)],
            }
        )

    def extra_fields(self, minibatches: list[dict]) -> dict:
        """More fields of the record, from this batch's minibatch entries (none here)."""
        return {}

    def on_step_end(self, batch: TensorDictBase | None) -> None:
        mbs, self._minibatches = self._minibatches, []
        rewards = torch.cat([r.reshape(-1) for mb in mbs for r in mb["rewards"]])
        lengths = [n for mb in mbs for n in mb["lengths"]]
        record = {
            "step": len(self.records),
            "loss_name": self.loss_name,
            "reward": rewards.mean().item(),
            "response_length": sum(lengths) / len(lengths),
            **{
                k: _mean([mb[k] for mb in mbs])
                for k in ("loss", "clip_fraction", "ESS", "sequence_log_ratio")
            },
            **{
                k: _mean([mb[k] for mb in mbs])
                for k in ("objective_diagnostic", "whole_clip_fraction", "segments_per_sequence")
            },
            # the first minibatch of the batch, and the later, off-policy ones
            "clip_fraction_first": mbs[0]["clip_fraction"],
            "clip_fraction_off_policy": _mean([mb["clip_fraction"] for mb in mbs[1:]]),
            **self.extra_fields(mbs),
            "elapsed_s": time.perf_counter() - self._start,
        }
        self.records.append(record)
        self.file.write(json.dumps(record) + "\n")
        self.bar.set_postfix(
            reward=f"{record['reward']:.3f}", clip=f"{record['clip_fraction']:.4f}", refresh=False
        )
        self.bar.update()


def train(loss_name: str, args: argparse.Namespace, out_dir: Path) -> list[dict]:
    pipeline = build_pipeline(loss_name, args)
    rank, world = data_parallel()
    suffix = f"_rank{rank}" if world > 1 else ""
    with (
        (out_dir / f"metrics_{loss_name}{suffix}.jsonl").open("w") as file,
        tqdm(total=args.steps, desc=loss_name, disable=args.no_progress) as bar,
    ):
        metrics = StepMetrics(loss_name, file, bar)
        handle = pipeline.loss_fn.register_forward_hook(metrics.on_loss)
        pipeline.trainer.register_op("post_steps_log", metrics.on_step_end)
        try:
            pipeline.trainer.train()
        finally:
            handle.remove()
    if world > 1:
        metrics.records[-1]["rank_divergence"] = rank_divergence(pipeline.model)
    return metrics.records


def rank_divergence(model: torch.nn.Module) -> float:
    """The largest difference between a weight and rank 0's copy of it, over all ranks
    (0 when data parallelism kept the ranks in sync)."""
    worst = torch.zeros((), dtype=torch.float64)
    for param in model.parameters():
        reference = param.detach().clone()
        dist.broadcast(reference, src=0)
        worst = torch.maximum(worst, (param.detach() - reference).abs().max().double())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def _mean(values: list[float | None]) -> float | None:
    """Mean of the values, ``None`` (JSON null) when there are none (GRPO's log-ratio)."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def window_mean(records: list[dict], key: str, first: bool) -> float:
    n = max(len(records) // 10, 1)
    chunk = records[:n] if first else records[-n:]
    return sum(r[key] for r in chunk) / len(chunk)


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("reward", "clip_fraction", "ESS", "response_length")
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4))
    for name, records in runs.items():
        steps = [r["step"] for r in records]
        for ax, key in zip(axes, keys, strict=True):
            ax.plot(steps, [r[key] for r in records], label=name, linewidth=1.2)
    titles = {
        "reward": "mean reward",
        "clip_fraction": "clip fraction (valid tokens)",
        "ESS": "ESS (GSPO: sequences, GRPO: tokens)",
        "response_length": "response length (tokens)",
    }
    for ax, key in zip(axes, keys, strict=True):
        ax.set_title(titles[key])
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if any(r["clip_fraction"] > 0 for records in runs.values() for r in records):
        axes[1].set_yscale("log")  # GSPO's and GRPO's fractions differ by decades
    axes[0].legend()
    labels = {"gspo": "GSPO (clip 3e-4/4e-4)", "grpo": "GRPO (clip 0.2/0.27)"}
    labels["gspo-token"] = "GSPO-token (clip 3e-4/4e-4)"
    fig.suptitle(" vs ".join(labels.get(n, n.upper()) for n in runs) + ", tiny Qwen2")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(runs: dict[str, list[dict]]) -> dict:
    summary = {}
    for name, records in runs.items():
        summary[name] = {
            "steps": len(records),
            "reward_first_10pct": window_mean(records, "reward", True),
            "reward_last_10pct": window_mean(records, "reward", False),
            "clip_fraction_mean": sum(r["clip_fraction"] for r in records) / len(records),
            "clip_fraction_off_policy_mean": _mean(
                [r["clip_fraction_off_policy"] for r in records]
            ),
            **{
                f"{k}_mean": _mean([r.get(k) for r in records])
                for k in ("objective_diagnostic", "whole_clip_fraction", "segments_per_sequence")
            },
            "seconds": records[-1]["elapsed_s"],
        }
        if "rank_divergence" in records[-1]:  # under torchrun
            summary[name]["rank_divergence"] = records[-1]["rank_divergence"]
    if "gspo" in summary and "grpo" in summary and summary["grpo"]["clip_fraction_mean"] > 0:
        summary["clip_fraction_ratio_gspo_over_grpo"] = (
            summary["gspo"]["clip_fraction_mean"] / summary["grpo"]["clip_fraction_mean"]
        )
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--loss",
        choices=[*LOSSES, "both"],
        default="both",
        help="which loss to train with; 'both' runs gspo then grpo (default)",
    )
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("outputs/gspo_toy"))
    parser.add_argument("--prompts", type=int, default=4, help="prompts per batch")
    parser.add_argument("--group-size", type=int, default=8, help="responses per prompt")
    parser.add_argument(
        "--minibatches", type=int, default=4, help="minibatches (optimizer steps) per batch"
    )
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--warm-start",
        type=int,
        default=0,
        help="supervised steps on demonstrations before RL (default 0: a random policy)",
    )
    parser.add_argument(
        "--demo-accuracy",
        type=float,
        default=0.5,
        help="share of the demonstrations' letters that are the prompt's (default 0.5)",
    )
    parser.add_argument(
        "--untie-head",
        action="store_true",
        help="an output head of its own (Qwen2Config's default), not tied to the embeddings",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    if args.minibatches < 1 or (args.prompts * args.group_size) % args.minibatches:
        parser.error(
            f"--minibatches ({args.minibatches}) must divide the batch, --prompts x "
            f"--group-size = {args.prompts * args.group_size} responses"
        )
    if args.warm_start < 0 or not 0 <= args.demo_accuracy <= 1 or args.max_new_tokens < 2:
        parser.error(
            f"--warm-start ({args.warm_start}) must be >= 0, --demo-accuracy "
            f"({args.demo_accuracy}) within [0, 1] and --max-new-tokens "
            f"({args.max_new_tokens}) at least 2 (a letter and the end of turn)"
        )
    if args.loss == "vespo" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        parser.error(  # GlobalBatchStepper writes a sequence scale; a token mean takes none
            "--loss vespo averages over tokens, which takes no sequence scale: it does not "
            "run data-parallel here (VESPOLoss(aggregation='prompt_mean') would)"
        )
    return args


def parse_runs(
    parser: argparse.ArgumentParser,
    runs: Sequence[str],
    argv: list[str] | None,
    *,
    steps: int,
    out: str,
    lr: float | None = None,
) -> argparse.Namespace:
    """The arguments of an example built on this one.

    Its own (``parser``), then ``--runs`` (a comma list of ``runs``), ``--steps``,
    ``--out``, ``--no-progress``, and every option of this example (the task, model and
    optimizer), ``--lr`` defaulting to ``lr`` when given.
    """
    parser.add_argument("--runs", default=",".join(runs), help="comma list of " + ", ".join(runs))
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--out", type=Path, default=Path(out))
    parser.add_argument("--no-progress", action="store_true")
    args, rest = parser.parse_known_args(argv)
    defaults = [] if lr is None else ["--lr", str(lr)]
    toy = parse_args([*defaults, *rest, "--steps", str(args.steps)])
    for key, value in vars(args).items():
        setattr(toy, key, value)
    unknown = set(args.runs.split(",")) - set(runs)
    if unknown:
        parser.error(f"unknown runs {sorted(unknown)}; choose from {list(runs)}")
    return toy


def write_summary(out: Path, summary: dict) -> dict:
    """Writes ``summary.json`` in ``out`` and prints it."""
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    names = ("gspo", "grpo") if args.loss == "both" else (args.loss,)
    runs = {name: train(name, args, args.out) for name in names}
    if data_parallel()[0] != 0:  # one summary and plot, from rank 0's batches
        return {}
    plot(runs, args.out / ("_vs_".join(n.replace("-", "_") for n in names) + ".png"))
    return write_summary(args.out, summarize(runs))


if __name__ == "__main__":
    main()
    if dist.is_initialized():  # under torchrun: leave the process group together
        # The trainer's hooks hold the DDP wrapper in reference cycles: free it while the group
        # lives, not at interpreter exit, where its gloo work aborts the process (SIGABRT).
        gc.collect()
        dist.barrier()  # rank 0 plots while the others are done: wait for it
        dist.destroy_process_group()
