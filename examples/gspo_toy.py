# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""GSPO on a real (tiny) transformer through TorchRL's LLM wrappers, on a CPU.

The task: the prompt is one letter followed by ``:`` (``"c:"``); the reward of a
response is the fraction of its characters (end-of-sequence excluded) equal to that
letter, so partial credit makes the signal dense, and an empty response scores 0.
A randomly initialised two-layer Qwen2 with a character-level tokenizer, both built
in code (no download), learns it from scratch in a few minutes.

Each step samples ``--group-size`` responses for each of ``--prompts`` prompts with
TorchRL's :class:`~torchrl.modules.llm.TransformersWrapper` (``generate=True``,
``pad_output=False``, the pad id banned so that no sampled token is dropped), scores
them, and writes them one trajectory at a time into a TorchRL
:class:`~torchrl.data.ReplayBuffer` whose :class:`~torchrl.objectives.llm.MCAdvantage`
transform computes the group-normalised advantages. The "old" log-probs come from a
no-grad forward of the training wrapper (``generate=False``, ``return_log_probs=True``,
``pad_output=False``) on the lazily stacked batch: TorchRL's recipe configuration,
which gives the exact response mask (the generation wrapper reports 0 for the first
response token's log-prob, which would bias every sequence ratio). As in the paper,
the rollout batch is then split into 4 minibatches, one optimizer step each, so the
later minibatches are off-policy and clipping matters.

The rollout and update loops are written out (about 40 lines) instead of running
through ``LLMEnv`` / ``LLMCollector`` and ``GRPOTrainer``. The task is single-turn
and scored on tokens, so an environment would only wrap the same generate-and-score
step; and ``GRPOTrainer`` needs a collector and drives the updates itself, which would
hide the one line this example is about: the loss, ``GRPOLoss`` swapped for
``GSPOLoss``. Running this example inside those TorchRL components is not done here.

Usage::

    python examples/gspo_toy.py                     # GSPO then GRPO, plots both
    python examples/gspo_toy.py --loss gspo --steps 50 --out outputs/run

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
import json
import time
from pathlib import Path

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack
from tokenizers import Tokenizer, models
from torchrl.data import LazyStackStorage, ReplayBuffer
from torchrl.modules.llm import TransformersWrapper
from torchrl.objectives.llm import GRPOLoss, MCAdvantage
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from torchrl_gspo import GSPOLoss, GSPOTokenLoss

LETTERS = "abcdefgh"
PROMPT_LETTERS = "abcd"
SPECIAL = {"<pad>": 0, "<eos>": 1, "<unk>": 2, ":": 3}
LOSSES = ("gspo", "gspo-token", "grpo")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer, built in code."""
    vocab = {**SPECIAL, **{c: i + len(SPECIAL) for i, c in enumerate(LETTERS)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
    )


def build_model(vocab_size: int, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=SPECIAL["<pad>"],
        eos_token_id=SPECIAL["<eos>"],
        bos_token_id=SPECIAL["<eos>"],
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config).eval()  # eval: no dropout, deterministic ratios


def build_loss(name: str, policy: TransformersWrapper):
    if name == "gspo":
        return GSPOLoss(policy, entropy_bonus=False)  # paper defaults
    if name == "gspo-token":
        return GSPOTokenLoss(policy, entropy_bonus=False)
    return GRPOLoss(
        policy, clip_epsilon=(0.2, 0.27), aggregation="prompt_mean", entropy_bonus=False
    )


def letter_reward(prompt_letter: int, response: torch.Tensor) -> float:
    """Fraction of the response's characters equal to the prompt letter (EOS excluded)."""
    chars = response[response != SPECIAL["<eos>"]]
    if chars.numel() == 0:
        return 0.0
    return (chars == prompt_letter).float().mean().item()


def rollout(
    generator: TransformersWrapper,
    trainer_policy: TransformersWrapper,
    buffer: ReplayBuffer,
    prompts: int,
    group_size: int,
    rng: torch.Generator,
) -> TensorDictBase:
    """Samples a group of responses per prompt and returns the scored, lazily stacked batch."""
    letters = torch.randint(
        len(SPECIAL), len(SPECIAL) + len(PROMPT_LETTERS), (prompts,), generator=rng
    )
    prompt_rows = [
        TensorDict(tokens=TensorDict(prompt=torch.stack([letter, torch.tensor(SPECIAL[":"])])))
        for letter in letters.repeat_interleave(group_size)
    ]
    with torch.no_grad():
        generated = generator(lazy_stack(prompt_rows))
    responses = generated.get(("tokens", "response"), as_list=True)
    prompts_tok = generated.get(("tokens", "prompt"), as_list=True)
    buffer.empty()
    for i, (prompt, response) in enumerate(zip(prompts_tok, responses, strict=True)):
        reward = letter_reward(int(prompt[0]), response)
        buffer.add(
            TensorDict(
                group_id=torch.tensor(i // group_size),
                tokens=TensorDict(
                    prompt=prompt, response=response, full=torch.cat([prompt, response])
                ),
                next=TensorDict(reward=torch.tensor([[reward]]), done=torch.tensor([[True]])),
            )
        )
    groups = buffer[:]
    data = lazy_stack([row for group in groups.unbind(0) for row in group.unbind(0)])
    with torch.no_grad():  # the "old" log-probs: the training wrapper, before the update
        data.set("log_probs", trainer_policy(data.copy()).get("log_probs"))
    return data


def valid_token_clip_fraction(out, data: TensorDictBase, loss_name: str) -> float:
    if loss_name != "grpo":
        return float(out.clip_fraction)
    lengths = [r.numel() for r in data.get(("tokens", "response"), as_list=True)]
    width = max(r.numel() for r in data.get(("tokens", "full"), as_list=True))
    return float(out.clip_fraction) * len(lengths) * width / max(sum(lengths), 1)


def train(loss_name: str, args: argparse.Namespace, out_dir: Path) -> list[dict]:
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), args.seed)
    generator = TransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode="tokens",
        generate=True,
        pad_output=False,
        return_log_probs=False,
        generate_kwargs={
            "max_new_tokens": args.max_new_tokens,
            "do_sample": True,
            "temperature": 1.0,
            "bad_words_ids": [[SPECIAL["<pad>"]]],
        },
    )
    policy = TransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode="tokens",
        generate=False,
        return_log_probs=True,
        pad_output=False,
    )
    loss_fn = build_loss(loss_name, policy)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    buffer = ReplayBuffer(
        storage=LazyStackStorage(args.prompts),
        transform=MCAdvantage(
            grpo_size=args.group_size, prompt_key="group_id", trajectory_return="sum"
        ),
        batch_size=args.prompts,
    )
    rng = torch.Generator().manual_seed(args.seed)
    batch_size = args.prompts * args.group_size
    records = []
    path = out_dir / f"metrics_{loss_name}.jsonl"
    start = time.perf_counter()
    with (
        path.open("w") as file,
        tqdm(range(args.steps), desc=loss_name, disable=args.no_progress) as bar,
    ):
        for step in bar:
            data = rollout(generator, policy, buffer, args.prompts, args.group_size, rng)
            rewards = data.get(("next", "reward"), as_padded_tensor=True).reshape(-1)
            stats = {k: [] for k in ("loss", "clip_fraction", "ESS", "sequence_log_ratio")}
            permutation = torch.randperm(batch_size, generator=rng)
            for chunk in permutation.chunk(args.minibatches):
                minibatch = lazy_stack([data[int(i)] for i in chunk])
                out = loss_fn(minibatch)
                loss = sum(v for k, v in out.items() if k.startswith("loss_"))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                stats["loss"].append(loss.item())
                stats["clip_fraction"].append(valid_token_clip_fraction(out, minibatch, loss_name))
                stats["ESS"].append(float(out.ESS))
                seq = getattr(out, "sequence_log_ratio", None)
                stats["sequence_log_ratio"].append(None if seq is None else float(seq))
            lengths = [r.numel() for r in data.get(("tokens", "response"), as_list=True)]
            record = {
                "step": step,
                "loss_name": loss_name,
                "reward": rewards.mean().item(),
                "response_length": sum(lengths) / len(lengths),
                **{k: _mean(v) for k, v in stats.items()},
                # the off-policy minibatches only (the first one has s_i = 1)
                "clip_fraction_off_policy": sum(stats["clip_fraction"][1:])
                / max(len(stats["clip_fraction"]) - 1, 1),
                "elapsed_s": time.perf_counter() - start,
            }
            records.append(record)
            file.write(json.dumps(record) + "\n")
            bar.set_postfix(reward=f"{record['reward']:.3f}", clip=f"{record['clip_fraction']:.4f}")
    return records


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
    axes[1].set_yscale("log")
    axes[0].legend()
    labels = {"gspo": "GSPO (clip 3e-4/4e-4)", "grpo": "GRPO (clip 0.2/0.27)"}
    labels["gspo-token"] = "GSPO-token (clip 3e-4/4e-4)"
    fig.suptitle(" vs ".join(labels[n] for n in runs) + ", tiny Qwen2")
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
            "clip_fraction_off_policy_mean": sum(r["clip_fraction_off_policy"] for r in records)
            / len(records),
            "seconds": records[-1]["elapsed_s"],
        }
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
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("outputs/gspo_toy"))
    parser.add_argument("--prompts", type=int, default=4, help="prompts per rollout")
    parser.add_argument("--group-size", type=int, default=8, help="responses per prompt")
    parser.add_argument("--minibatches", type=int, default=4, help="updates per rollout")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    names = ("gspo", "grpo") if args.loss == "both" else (args.loss,)
    runs = {name: train(name, args, args.out) for name in names}
    plot(runs, args.out / ("_vs_".join(n.replace("-", "_") for n in names) + ".png"))
    summary = summarize(runs)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
