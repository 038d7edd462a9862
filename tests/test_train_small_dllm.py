"""Training of the small dLLM on a CPU at toy size: objective, data, saving, loading, resuming.

The objective is checked against the engine's own semantics: the clean half of a training row
gives the logits of the naive block-causal forward (tests/naive_llada2.py), and a noised block
gives what the engine computes for that block over the clean blocks before it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from naive_llada2 import naive_llada2_logits

from dllm_serve.layers.moe import moe_dense, moe_reference, set_moe_backend
from dllm_serve.layers.moe_router import RoutingParams, route
from dllm_serve.model.config import ModelConfig
from dllm_serve.model.loader import load_model
from dllm_serve.tools.llada2_format import EOS, MASK, SPECIAL_TOKENS
from training.attention import training_batch
from training.batches import HostBatch, collate
from training.config import RunConfig, TrainConfig
from training.data import DataConfig
from training.objective import (
    CLEAN,
    NOISED,
    PAD,
    NoiseConfig,
    apply_noise,
    bd3_mask,
    build_layout,
    forward_loss,
)
from training.problems import final_number, generate_problems
from training.tokenizer import first_special_id, train_tokenizer
from training.trainer import Trainer

BLOCK = 8
TOY_DATA = DataConfig(num_generated=8, gsm8k_fraction=0.0, fewshot_fraction=0.0,
                      num_eval_generated=8, max_len=128, gsm8k_holdout=0)
TOY = TrainConfig(preset="toy", vocab_size=400, block_size=BLOCK, dtype="float32", data=TOY_DATA,
                  lr=1e-2, warmup_steps=2, tokens_per_batch=4096)


def toy_run(out: Path, steps: int, **kw) -> RunConfig:
    return RunConfig(out=out, device="cpu", max_steps=steps, max_minutes=5, reserve_seconds=0,
                     log_every_seconds=1e9, eval_every_seconds=1e9, **kw)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Trainer, dict]:
    out = tmp_path_factory.mktemp("toy_run")
    trainer = Trainer.setup(TOY, toy_run(out, 40))
    return trainer, trainer.train()


def fixed_noise_loss(trainer: Trainer, seed: int = 123) -> float:
    prep = trainer.prep
    batch = collate(prep.pool, torch.arange(len(prep.pool)).numpy(), BLOCK, prep.eos_id)
    with torch.no_grad():
        parts, _, _ = forward_loss(trainer.model, trainer.attn, batch, trainer.cfg.noise,
                                   prep.mask_id, prep.num_text_tokens,
                                   torch.Generator().manual_seed(seed))
    return parts.loss.item()


# ---------------------------------------------------------------- MoE, mask, noise

def test_moe_dense_equals_reference_with_grads() -> None:
    g = torch.Generator().manual_seed(0)
    t, e, inter, hidden = 40, 8, 12, 16
    x = torch.randn(t, hidden, generator=g, requires_grad=True)
    w13 = (0.2 * torch.randn(e, 2 * inter, hidden, generator=g)).requires_grad_()
    w2 = (0.2 * torch.randn(e, hidden, inter, generator=g)).requires_grad_()
    p = RoutingParams(top_k=2, score_function="sigmoid", n_group=4, topk_group=2,
                      renormalize=True, scaling=2.5)
    ids, weights = route(torch.randn(t, e, generator=g), torch.randn(e, generator=g), p)
    outs, grads = [], []
    for fn in (moe_reference, moe_dense):
        y = fn(x, w13, w2, ids, weights)
        outs.append(y)
        grads.append(torch.autograd.grad(y.square().sum(), (x, w13, w2)))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def _batch(rows: list[tuple[list[int], int]]) -> HostBatch:
    """(tokens, prompt_len) per row; tokens already a whole number of blocks."""
    width = max(len(t) for t, _ in rows)
    clean = torch.full((len(rows), width), 0)
    for i, (tokens, _) in enumerate(rows):
        clean[i, :len(tokens)] = torch.tensor(tokens)
    lens = torch.tensor([len(t) for t, _ in rows])
    prompt = torch.tensor([p for _, p in rows])
    noised = int((lens - prompt // BLOCK * BLOCK).max())
    return HostBatch(clean, lens, prompt, noised, BLOCK)


def test_layout_and_mask_follow_the_predicate() -> None:
    batch = _batch([(list(range(1, 25)), 11), (list(range(1, 17)), 3)])
    layout = build_layout(batch, BLOCK)
    assert layout.clean_len == 24 and layout.ids.shape == (2, 24 + 16)
    assert layout.positions[0, 24:].tolist() == list(range(8, 24))  # blocks 1, 2 of row 0
    assert layout.trainable[0].tolist() == [p >= 11 for p in range(8, 24)]
    assert layout.kind[1, 16:24].tolist() == [PAD] * 8  # row 1 is shorter
    mask = bd3_mask(layout.kind, layout.positions, BLOCK)[:, 0]
    kinds, pos = layout.kind.tolist(), layout.positions.tolist()
    for r in range(2):
        for q in range(40):
            for k in range(40):
                qk, kk, qb, kb = kinds[r][q], kinds[r][k], pos[r][q] // BLOCK, pos[r][k] // BLOCK
                want = ((qk == CLEAN and kk == CLEAN and kb <= qb)
                        or (qk == NOISED and kk == CLEAN and kb < qb)
                        or (qk == NOISED and kk == NOISED and kb == qb)
                        or (qk == PAD and q == k))
                assert bool(mask[r, q, k]) == want, (r, q, k)


def test_noise_masks_every_block_and_leaves_prompts_alone() -> None:
    batch = _batch([(list(range(1, 33)), 13)] * 64)
    layout = build_layout(batch, BLOCK)
    cfg = NoiseConfig(corrupt_max=0.5)
    noised = apply_noise(layout, cfg, BLOCK, mask_id=99, num_text_tokens=50,
                         gen=torch.Generator().manual_seed(0))
    new, old = noised.ids[:, 32:], layout.targets
    train = layout.trainable
    assert torch.equal(new[~train], old[~train])  # prompt tail and padding untouched
    per_block = noised.masked.view(64, -1, BLOCK).sum(-1)
    assert (per_block >= 1).all()  # every noised block has a mask
    assert torch.equal(noised.masked, (new == 99) & train)
    assert torch.equal(noised.corrupted, train & (new != 99) & (new != old))
    assert noised.corrupted.any() and noised.kept.any()
    assert not (noised.masked & noised.kept).any()
    assert ((noised.masked | noised.corrupted | noised.kept) == train).all()


def test_training_logits_match_the_engine_semantics(tmp_path: Path) -> None:
    """Clean half = naive block-causal forward; noised block b = the engine's forward of block
    b over the clean blocks before it."""
    trainer = Trainer(TOY, toy_run(tmp_path, 0), _prep(tmp_path))
    model_dir = _save_fp32(trainer, tmp_path / "ckpt")
    set_moe_backend(trainer.model, "torch")
    tokens = list(range(3, 3 + 24))
    batch = _batch([(tokens, 5)])
    layout = build_layout(batch, BLOCK)
    noised = apply_noise(layout, TOY.noise, BLOCK, trainer.prep.mask_id, 50,
                         torch.Generator().manual_seed(1))
    mask = bd3_mask(layout.kind, layout.positions, BLOCK)
    with torch.no_grad():
        fb = training_batch(noised.ids, layout.positions, mask, trainer.attn, BLOCK)
        logits = trainer.model.compute_logits(trainer.model(fb))  # (N, V)
    torch.testing.assert_close(logits[:24], naive_llada2_logits(model_dir, tokens, BLOCK),
                               atol=1e-4, rtol=1e-4)
    for b in range(3):
        block = noised.ids[0, 24 + b * BLOCK: 24 + (b + 1) * BLOCK].tolist()
        ref = naive_llada2_logits(model_dir, tokens[:b * BLOCK] + block, BLOCK)[-BLOCK:]
        torch.testing.assert_close(logits[24 + b * BLOCK: 24 + (b + 1) * BLOCK], ref,
                                   atol=1e-4, rtol=1e-4)


def _prep(tmp_path: Path):
    from training.setup import prepare

    return prepare(TOY, toy_run(tmp_path, 0), None)


def _save_fp32(trainer: Trainer, path: Path) -> Path:
    from training.checkpoint import save_hf_checkpoint

    return save_hf_checkpoint(path, trainer.model, trainer.prep.tok, trainer.prep.hf_config)


# ---------------------------------------------------------------- data and tokenizer

def test_problems_are_deterministic_and_their_arithmetic_is_right() -> None:
    problems = generate_problems(400, seed=7)
    assert problems == generate_problems(400, seed=7) != generate_problems(400, seed=8)
    for p in problems:
        assert re.search(r"The answer is \d+\.$", p.answer), p.answer
        for a, op, b, c in re.findall(r"(\d+) ([-+*/]) (\d+) = \$?(\d+)", p.answer):
            assert eval(f"{a} {op} {b}") == int(c), p.answer
        assert final_number(p.answer) == int(re.findall(r"\d+", p.answer)[-1])
    form = re.compile(r"^\w+ has \d+ \w+ and buys \d+ more\. How many \w+ does (he|she) have\?$")
    assert any(form.match(p.question) for p in problems)


def test_trained_tokenizer_splits_digits_and_appends_specials() -> None:
    texts = [f"Question: {p.question}\nAnswer: {p.answer}" for p in generate_problems(200, 0)]
    tok = train_tokenizer(texts, 400)
    assert tok.get_vocab_size() == 400
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(393, 400))
    assert first_special_id(tok) == 393
    ids = tok.encode("Tom has 135 apples.<|endoftext|>").ids
    assert tok.decode(ids, skip_special_tokens=False) == "Tom has 135 apples.<|endoftext|>"
    assert [tok.id_to_token(i) for i in ids][-6:-2] == ["1", "3", "5", "Ġapples"]


# ---------------------------------------------------------------- end to end

def test_loss_decreases_on_a_repeated_batch(trained, tmp_path: Path) -> None:
    trainer, summary = trained
    fresh = Trainer(TOY, toy_run(tmp_path, 0), trainer.prep)
    assert len(trainer.plan) == 1  # one batch: every step trains on the same sequences
    assert summary["steps"] == 40
    assert fixed_noise_loss(trainer) < 0.6 * fixed_noise_loss(fresh)


def test_checkpoint_loads_strictly_with_equal_logits(trained) -> None:
    trainer, summary = trained
    folder = Path(summary["checkpoint"])
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors",
                     "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    cfg = json.loads((folder / "config.json").read_text())
    tok = trainer.prep.tok
    assert cfg["architectures"] == ["LLaDA2MoeModelLM"] and cfg["dtype"] == "float32"
    assert (cfg["mask_token_id"], cfg["eos_token_id"]) == (tok.token_to_id(MASK),
                                                            tok.token_to_id(EOS))
    loaded = load_model(ModelConfig.load(folder), torch.float32, torch.device("cpu"))
    for m in (loaded, trainer.model):
        set_moe_backend(m, "torch")
    batch = collate(trainer.prep.pool, torch.arange(3).numpy(), BLOCK, trainer.prep.eos_id)
    layout = build_layout(batch, BLOCK)
    mask = bd3_mask(layout.kind, layout.positions, BLOCK)
    with torch.no_grad():
        a, b = (m.compute_logits(m(training_batch(layout.ids, layout.positions, mask,
                                                  trainer.attn, BLOCK)))
                for m in (trainer.model, loaded))
    assert torch.equal(a, b)


def test_resume_continues_from_the_saved_step(trained, tmp_path: Path) -> None:
    trainer, _ = trained
    more = Trainer.setup(TOY, toy_run(tmp_path / "more", 45),
                         resume=trainer.run.resolved_state_dir)
    assert more.progress.step == 40 and more.progress.horizon == 45
    assert all(torch.equal(a, b) for a, b in zip(more.model.state_dict().values(),
                                                 trainer.model.state_dict().values(),
                                                 strict=True))
    assert more.train()["steps"] == 45
    log = [json.loads(line) for line in (tmp_path / "more" / "train_log.jsonl").open()]
    assert log[-1]["step"] == 45


def test_split_run_equals_uninterrupted_run(tmp_path: Path) -> None:
    whole = Trainer.setup(TOY, toy_run(tmp_path / "whole", 8))
    whole.train()
    first = Trainer.setup(TOY, toy_run(tmp_path / "a", 8, stop_at_step=5))
    assert first.train()["steps"] == 5
    second = Trainer.setup(TOY, toy_run(tmp_path / "b", 8), resume=tmp_path / "a" / "state")
    assert second.train()["steps"] == 8
    for a, b in zip(whole.model.state_dict().values(), second.model.state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)
