# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Engine routes (vLLM, SGLang) as per-row routes: replayed, they force exactly the
forward the engine ran on every position whose log-probability the loss scores."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from torchrl_gspo import RoutingReplay, decode_sglang_routes, routes_from_engine

LAYERS, MOE_LAYERS, TOP_K, VOCAB = 3, [0, 2], 2, 32


def model(seed):
    """A tiny Qwen3-MoE whose layer 1 is dense (as engines report it: zeros)."""
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=TOP_K,
        mlp_only_layers=[1],
    )
    return Qwen3MoeForCausalLM(config).eval()


def engine_and_trainer():
    """The engine: other weights, so that it routes some tokens elsewhere."""
    return model(1), model(2)


def log_probs(net, tokens):
    logits = net(tokens.unsqueeze(0)).logits.squeeze(0)
    return logits[:-1].log_softmax(-1).gather(-1, tokens[1:].unsqueeze(-1)).squeeze(-1)


def engine_output(engine, tokens):
    """What vLLM returns: the engine forward's routes on positions 0 .. n - 2, over
    all decoder layers (dense ones 0), uint8; and the routes of every position."""
    with RoutingReplay(engine) as replay, torch.no_grad(), replay.capture() as routes:
        engine(tokens.unsqueeze(0))
    full = torch.stack([r.squeeze(0) for r in routes], dim=1)  # [n, moe layers, k]
    array = np.zeros((tokens.numel() - 1, LAYERS, TOP_K), dtype=np.uint8)
    array[:, MOE_LAYERS] = full[:-1].numpy()
    return array, full


def replayed_log_probs(trainer, tokens, row_routes):
    with RoutingReplay(trainer) as replay, torch.no_grad():
        with replay.replay(replay.from_rows([row_routes])):
            return log_probs(trainer, tokens)


def test_vllm_routes_replay_the_engine_forward_on_every_scored_token():
    """The adapted routes (the last token's filled with 0 .. k - 1) force the same
    log-probabilities as the engine's own routes on every position, bit for bit."""
    engine, trainer = engine_and_trainer()
    tokens = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(0))
    array, full = engine_output(engine, tokens)
    routes = routes_from_engine(array, tokens.numel(), MOE_LAYERS)
    assert routes.shape == (9, len(MOE_LAYERS), TOP_K) and routes[-1, 0].tolist() == [0, 1]
    forced = replayed_log_probs(trainer, tokens, full)  # hand-forced: the engine's routes
    assert torch.equal(replayed_log_probs(trainer, tokens, routes), forced)
    with torch.no_grad():  # the replay matters: the trainer alone routes differently
        assert not torch.equal(log_probs(trainer, tokens), forced)


@pytest.mark.parametrize("dense", [0, -1])
def test_sglang_routes_decode_to_the_same_routes(dense):
    """SGLang's base64 int32 buffer; its dense layer holds 0 (SGLang 0.5.23) or the
    -1 placeholder of other builds: only the MoE layers are kept, so the placeholder
    never reaches the route check, and the replay is the engine's."""
    engine, trainer = engine_and_trainer()
    tokens = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(1))
    array, full = engine_output(engine, tokens)
    array = array.astype(np.int32)
    array[:, 1] = dense  # layer 1 is dense
    encoded = base64.b64encode(array.astype(np.int32).tobytes()).decode()
    decoded = decode_sglang_routes(encoded, LAYERS, TOP_K)
    assert decoded.dtype == torch.int32 and torch.equal(decoded, torch.from_numpy(array))
    routes = routes_from_engine(decoded, 7, MOE_LAYERS)
    assert torch.equal(routes[:-1], full[:-1])
    forced = replayed_log_probs(trainer, tokens, full)
    assert torch.equal(replayed_log_probs(trainer, tokens, routes), forced)


def test_a_later_turn_takes_its_first_rows_from_the_earlier_routes():
    """Multi-turn: the engine routes positions start .. n - 2 only; the earlier turn's
    routes give the rest, and the replay is the same."""
    engine, trainer = engine_and_trainer()
    tokens = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(2))
    array, full = engine_output(engine, tokens)
    start = 4
    routes = routes_from_engine(array[start:], 10, MOE_LAYERS, start=start, earlier=full[:6])
    assert torch.equal(routes[:-1], full[:-1])
    forced = replayed_log_probs(trainer, tokens, full)
    assert torch.equal(replayed_log_probs(trainer, tokens, routes), forced)


@pytest.mark.parametrize(
    "rows,kwargs,words",
    [
        (9, {}, r"expected \[8, >2, top_k\]"),  # a route for the last token too
        (6, {"start": 2}, r"start=2 needs the routes of the first 2 tokens"),
    ],
)
def test_engine_routes_of_the_wrong_shape_raise(rows, kwargs, words):
    array = np.zeros((rows, LAYERS, TOP_K), dtype=np.int32)
    with pytest.raises(ValueError, match=words):
        routes_from_engine(array, 9, MOE_LAYERS, **kwargs)


def test_float_engine_routes_are_refused_not_truncated():
    """Converting 2.7 to an expert would give 2: a float dtype is refused before, with
    the first row that holds a fraction."""
    array = np.zeros((8, LAYERS, TOP_K), dtype=np.float32)
    array[:, MOE_LAYERS] = [2.0, 3.0]
    array[3, 2] = [2.7, 5.9]
    fix = "Pass the integer expert ids as the engine returns them"
    where = r"row 3, the route of token 3, holds 2.7 at layer 2"
    with pytest.raises(ValueError, match=rf"float32, not integer expert ids \({where}\).*{fix}"):
        routes_from_engine(array, 9, MOE_LAYERS)
    with pytest.raises(ValueError, match=rf"torch.float64, not integer expert ids.*{fix}"):
        routes_from_engine(torch.from_numpy(array.round()).double(), 9, MOE_LAYERS)


def test_a_start_past_the_earlier_routes_is_refused():
    """The earlier turn's last row is the filler of its last token (experts 0 .. k - 1):
    start = len(earlier) would replay it as that token's route. An engine reports
    start <= len(earlier) - 1, re-feeding that token."""
    array = np.ones((5, LAYERS, TOP_K), dtype=np.int32) * [2, 3]
    earlier = routes_from_engine(array, 6, MOE_LAYERS)  # 6 rows, row 5 the filler
    with pytest.raises(ValueError, match=r"start=6 .* earlier holds 6 rows.*row 5.*start <= 5"):
        routes_from_engine(array[:3], 10, MOE_LAYERS, start=6, earlier=earlier)
    routes = routes_from_engine(array[:4], 10, MOE_LAYERS, start=5, earlier=earlier)
    assert routes[:-1, 0].tolist() == [[2, 3]] * 9


def test_a_missing_route_in_an_moe_layer_is_refused():
    """-1 inside an MoE layer (a route the engine did not record, NeMo-RL's marker)
    has no expert to force: the replay refuses it rather than routing afresh."""
    engine, trainer = engine_and_trainer()
    tokens = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(4))
    array, _ = engine_output(engine, tokens)
    array = array.astype(np.int32)
    array[2, MOE_LAYERS[1]] = -1
    routes = routes_from_engine(array, 6, MOE_LAYERS)
    with pytest.raises(ValueError, match=r"layer 1 must be expert indices in \[0, 4\)"):
        replayed_log_probs(trainer, tokens, routes)


def test_sglang_buffer_of_the_wrong_size_raises():
    encoded = base64.b64encode(np.zeros(7, dtype=np.int32).tobytes())
    with pytest.raises(ValueError, match="do not split into rows of 3 layers x top-2"):
        decode_sglang_routes(encoded, LAYERS, TOP_K)


def test_a_generation_is_captured_in_the_engine_layout():
    """capture(generation=True) around generate: the prefill's positions, then one per
    decode step, n - 1 in all; the same routes as a full forward of the sequence, and
    replayed, that forward's log-probs are the generation's own (from its logits)."""
    engine, _ = engine_and_trainer()
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(4)
    with RoutingReplay(engine) as replay, torch.no_grad():
        with replay.capture(generation=True) as routes:
            out = engine.generate(
                prompt,
                max_new_tokens=6,
                min_new_tokens=6,
                do_sample=True,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        tokens = out.sequences.squeeze(0)
        n = tokens.numel()
        captured = torch.stack([r.squeeze(0) for r in routes], dim=1)  # [n - 1, layers, k]
        assert captured.shape == (n - 1, len(MOE_LAYERS), TOP_K) and n == 11
        with replay.capture() as full_routes:
            engine(tokens.unsqueeze(0))
        full = torch.stack([r.squeeze(0) for r in full_routes], dim=1)
        assert torch.equal(captured, full[:-1])
        row = routes_from_engine(captured, n, range(len(MOE_LAYERS)))
        with replay.replay(replay.from_rows([row])):
            scored = log_probs(engine, tokens)[-6:]  # the generated tokens
    logits = torch.stack(out.logits).squeeze(1)  # the decode's own, one step per token
    generated = logits.log_softmax(-1).gather(-1, tokens[-6:].unsqueeze(-1)).squeeze(-1)
    # float32: the KV-cache decode and the full forward sum in different orders
    torch.testing.assert_close(scored, generated, rtol=0, atol=1e-5)


def test_engine_routes_replayed_in_the_recompute_and_the_loss():
    """R3 through TorchRL's wrapper: each row carries the engine's routes at
    ("routing", "experts"); the recompute gives the trainer's log-probs forced with
    them (hand-forced per row), and the loss replays the same routes, so the first
    update is on-policy, where the trainer's own routing is not."""
    from llm_testing import tiny_qwen_moe, training_wrapper, word_tokenizer
    from tensordict import TensorDict, lazy_stack

    from torchrl_gspo import GSPOLoss, RecomputeOldLogProbs

    tokenizer = word_tokenizer()
    engine, trainer = tiny_qwen_moe(tokenizer, 1), tiny_qwen_moe(tokenizer, 2)
    vocab, moe = trainer.config.vocab_size, list(range(trainer.config.num_hidden_layers))
    gen = torch.Generator().manual_seed(0)
    rows, expected = [], []
    replay = RoutingReplay(trainer)
    for i, (p, r) in enumerate(((4, 3), (2, 6), (5, 2))):
        full = torch.randint(3, vocab, (p + r,), generator=gen)
        with RoutingReplay(engine) as engine_replay, torch.no_grad():
            with engine_replay.capture() as routes:
                engine(full.unsqueeze(0))
        layout = torch.stack([x.squeeze(0) for x in routes], dim=1)[:-1]  # engine's
        row_routes = routes_from_engine(layout, p + r, moe)
        with torch.no_grad(), replay.replay(replay.from_rows([row_routes])):
            expected.append(log_probs(trainer, full))  # hand-forced, tokens 1 .. n - 1
        tokens = TensorDict(prompt=full[:p], response=full[p:], full=full)
        rows.append(
            TensorDict(
                tokens=tokens,
                advantage=torch.tensor([[(-1.0) ** i]]),
                routing=TensorDict(experts=row_routes),
            )
        )
    policy = training_wrapper(trainer, tokenizer)
    recompute = RecomputeOldLogProbs(policy, out_key="log_probs")
    replay.replay_for(recompute, tokens_key=("tokens", "full"))
    batch = recompute(lazy_stack(rows, 0))
    for old, want in zip(batch.get(("log_probs", "full"), as_list=True), expected, strict=True):
        torch.testing.assert_close(old[1:], want, rtol=0, atol=1e-6)  # padding differs
    replayed, own = GSPOLoss(policy), GSPOLoss(policy)
    replay.replay_for(replayed)
    assert replayed(batch).sequence_log_ratio_max_abs < 1e-6
    assert own(batch).sequence_log_ratio_max_abs > 1e-4  # the trainer routes otherwise
    replay.remove()


def _generator(engine, tokenizer, allowed, wrapper_kwargs=(), **kwargs):
    """TorchRL's generating wrapper, sampling only ``allowed`` token ids (and EOS)."""
    from torchrl.modules.llm import TransformersWrapper

    allowed = set(allowed) | {tokenizer.eos_token_id}
    banned = [[i] for i in range(len(tokenizer)) if i not in allowed]
    return TransformersWrapper(
        engine,
        tokenizer=tokenizer,
        input_mode="tokens",
        generate=True,
        return_log_probs=False,
        **{"pad_output": False, **dict(wrapper_kwargs)},
        generate_kwargs={"max_new_tokens": 7, "do_sample": True, "bad_words_ids": banned, **kwargs},
    )


def _prompts():
    from tensordict import TensorDict, lazy_stack

    gen = torch.Generator().manual_seed(5)
    lengths = (3, 6, 1, 4, 5, 2)  # left padding of 0 to 5 tokens
    prompts = [torch.randint(5, 24, (n,), generator=gen) for n in lengths]
    return lazy_stack([TensorDict(tokens=TensorDict(prompt=p)) for p in prompts])


def test_a_batched_generation_writes_each_row_its_routes():
    """record_generation on TorchRL's wrapper, left-padded prompts of 1 to 6 tokens,
    rows ending at different steps (later steps feed padding to the finished rows):
    each row gets the routes of its own n - 1 positions, as a forward of the row alone
    routes them (the last token 0 .. k - 1), and the tokens they were fed."""
    from llm_testing import tiny_qwen_moe, word_tokenizer

    from torchrl_gspo import record_generation

    tokenizer = word_tokenizer()
    engine = tiny_qwen_moe(tokenizer, 1)
    replay = RoutingReplay(engine)
    generator = _generator(engine, tokenizer, range(5, 9))
    stop = record_generation(replay, generator)
    torch.manual_seed(0)
    with torch.no_grad():
        out = generator(_prompts())
    stop()
    fulls = out.get(("tokens", "full"), as_list=True)
    responses = out.get(("tokens", "response"), as_list=True)
    lengths = {r.numel() for r in responses}
    assert min(lengths) < 7 == max(lengths), "some rows must end before the others"
    routes = out.get(("routing", "experts"), as_list=True)
    recorded = out.get(("routing", "tokens"), as_list=True)
    for full, row, fed in zip(fulls, routes, recorded, strict=True):
        with torch.no_grad(), replay.capture() as alone:
            engine(full.unsqueeze(0))
        alone = torch.stack([r.squeeze(0) for r in alone], dim=1)  # [n, layers, k]
        assert row.shape == alone.shape and torch.equal(fed, full)
        assert torch.equal(row[:-1], alone[:-1])
        assert row[-1].tolist() == [[0, 1]] * replay.num_layers
    # removed: the next generation records nothing
    assert ("routing", "experts") not in generator(_prompts()).keys(True)
    replay.remove()


def test_the_engine_log_probs_replay_the_decode_routes_and_match_the_decode():
    """The engine's log-probs come from a scoring pass on the engine that replays the
    generation's routes (TorchRL's generation wrapper reports 0 for the first response
    token): on every response token, the first included, they equal the decode's own
    log-probs (its logits at each step) to float32 rounding."""
    from llm_testing import tiny_qwen_moe, training_wrapper, word_tokenizer

    from torchrl_gspo import RecomputeOldLogProbs, record_generation

    tokenizer = word_tokenizer()
    engine = tiny_qwen_moe(tokenizer, 1)
    replay = RoutingReplay(engine)
    generator = _generator(engine, tokenizer, range(5, 9))
    record_generation(replay, generator)
    steps = []  # the logits of each forward's last position: one per sampled token
    engine.register_forward_hook(lambda m, a, out: steps.append(out.logits[:, -1].clone()))
    torch.manual_seed(1)
    with torch.no_grad():
        out = generator(_prompts())
    decode = torch.stack(steps, dim=1).log_softmax(-1)  # [B, steps, vocab]
    steps.clear()
    recompute = RecomputeOldLogProbs(training_wrapper(engine, tokenizer), out_key="log_probs")
    replay.replay_for(recompute, tokens_key=("tokens", "full"))
    scored = recompute(out).get(("log_probs", "full"), as_list=True)
    responses = out.get(("tokens", "response"), as_list=True)
    own = [
        decode[i, : r.numel()].gather(-1, r.unsqueeze(-1)).squeeze(-1)
        for i, r in enumerate(responses)
    ]
    for row, response, decoded in zip(scored, responses, own, strict=True):
        torch.testing.assert_close(row[-response.numel() :], decoded, rtol=0, atol=1e-5)
    # the comparison sees the routes: scored with other experts, the rows differ
    rolled = out.copy()
    for td in rolled.tensordicts:
        td.set(("routing", "experts"), (td.get(("routing", "experts")) + 1) % 8)
    other = recompute(rolled.exclude("log_probs")).get(("log_probs", "full"), as_list=True)
    gap = max((o[-d.numel() :] - d).abs().max() for o, d in zip(other, own, strict=True))
    assert gap > 1e-3
    replay.remove()


def test_routes_of_positions_no_valid_token_reads_change_nothing():
    """The last token's route (filled) and the padding's (from_rows') are never read
    by a valid token: replaced by other experts, the replayed log-probs of every token
    are unchanged."""
    from llm_testing import tiny_qwen_moe, word_tokenizer

    from torchrl_gspo import record_generation

    tokenizer = word_tokenizer()
    engine, trainer = tiny_qwen_moe(tokenizer, 1), tiny_qwen_moe(tokenizer, 2)
    replay = RoutingReplay(engine)
    record_generation(replay, generator := _generator(engine, tokenizer, range(5, 9)))
    torch.manual_seed(2)
    with torch.no_grad():
        out = generator(_prompts())
    fulls = out.get(("tokens", "full"), as_list=True)
    rows = out.get(("routing", "experts"), as_list=True)
    width = max(f.numel() for f in fulls)
    tokens = torch.stack([torch.cat([f.new_zeros(width - f.numel()), f]) for f in fulls])
    mask = torch.stack([torch.arange(width) >= width - f.numel() for f in fulls])
    other = [r.clone() for r in rows]
    for r in other:
        r[-1] = torch.tensor([6, 7])  # the last token: other experts
    trainer_replay = RoutingReplay(trainer)

    def scored(row_routes, pad_experts):
        laid = trainer_replay.from_rows(row_routes)
        laid = [
            torch.where(mask[..., None], r, torch.tensor(pad_experts, dtype=r.dtype)) for r in laid
        ]
        with torch.no_grad(), trainer_replay.replay(laid):
            logits = trainer(tokens, attention_mask=mask.long()).logits
        return logits[:, :-1].log_softmax(-1).gather(-1, tokens[:, 1:, None])[mask[:, 1:]]

    reference = scored(rows, [0, 1])
    # not bit for bit: each expert's matmul then sees another number of tokens
    torch.testing.assert_close(scored(other, [4, 5]), reference, rtol=0, atol=1e-6)
    changed = [r.clone() for r in rows]
    changed[0][0] = torch.tensor([6, 7])  # a prompt token's route does matter
    assert (scored(changed, [0, 1]) - reference).abs().max() > 1e-4


def test_a_generation_that_cannot_be_aligned_raises():
    """A sampled pad token, which TorchRL's wrapper drops from its row, raises (and
    leaves no capture running); a padded output or several samples per prompt are
    refused when hooked."""
    from llm_testing import tiny_qwen_moe, word_tokenizer

    from torchrl_gspo import record_generation

    tokenizer = word_tokenizer()
    engine = tiny_qwen_moe(tokenizer, 1)
    replay = RoutingReplay(engine)
    generator = _generator(engine, tokenizer, [tokenizer.pad_token_id, 5], min_new_tokens=7)
    record_generation(replay, generator)
    torch.manual_seed(0)
    with torch.no_grad(), pytest.raises(ValueError, match=r"row\(s\) \[.*ban the pad id"):
        generator(_prompts())
    with torch.no_grad(), replay.capture():  # the failed call left no capture running
        engine(torch.tensor([[5, 6]]))
    for kwargs in ({"pad_output": True}, {"num_samples": 2}, {"batching": True}):
        generator = _generator(engine, tokenizer, [5], wrapper_kwargs=kwargs)
        with pytest.raises(ValueError, match=r"\(pad_output=True, num_samples or batching"):
            record_generation(replay, generator)


def test_a_generation_inside_a_capture_raises_and_the_next_one_records():
    """A generation started inside another capture raises (captures do not nest) and
    leaves the hooks ready; RoutingReplay.remove() takes the generator's hooks off."""
    from llm_testing import tiny_qwen_moe, word_tokenizer

    from torchrl_gspo import record_generation

    tokenizer = word_tokenizer()
    engine = tiny_qwen_moe(tokenizer, 1)
    replay = RoutingReplay(engine)
    generator = _generator(engine, tokenizer, range(5, 9))
    record_generation(replay, generator)
    with torch.no_grad(), replay.capture():
        engine(torch.tensor([[5, 6]]))
        with pytest.raises(RuntimeError, match="does not nest"):
            generator(_prompts())
    with torch.no_grad():
        assert ("routing", "experts") in generator(_prompts()).keys(True)
    replay.remove()
    with torch.no_grad():  # no hook left: the generator runs and records nothing
        assert ("routing", "experts") not in generator(_prompts()).keys(True)
