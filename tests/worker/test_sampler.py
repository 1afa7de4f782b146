"""Sampler: exact expectations on hand-made logits, seeded reproducibility, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.worker.logits_processing import _apply_penalties, _apply_top_k_top_p
from engine.worker.sampler import (
    Sampler,
    SamplingRow,
    compute_prompt_logprobs,
    make_generator,
)

NEG_INF = float("-inf")


def row(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: tuple[int, ...] = (),
    **params,
) -> SamplingRow:
    p = SamplingParams(**params)
    prompt, output = prompt or [0], list(output or [])
    gen = make_generator(p.seed, "cpu")
    return SamplingRow(p, [*prompt, *output], len(prompt), len(output), gen, eos)


def logits_of(probs: list[float], n: int = 1) -> torch.Tensor:
    return torch.tensor([probs] * n).log()


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    return Sampler()(logits, rows).token_ids


def test_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 0.0, 0.0], [-3.0, -2.0, -1.0, -4.0]])
    rows = [row(temperature=0.0) for _ in range(3)]
    assert sample(logits, rows) == [1, 0, 2]


def test_greedy_row_in_a_mixed_batch_still_takes_the_argmax():
    torch.manual_seed(0)
    logits = torch.tensor([[0.0, 1.0, 0.5, 0.9]] * 50)
    rows = [row(temperature=0.0 if i % 2 else 1.5, top_p=0.9) for i in range(50)]
    out = sample(logits, rows)
    assert all(t == 1 for t in out[1::2])
    assert len(set(out[0::2])) > 1


def test_top_k_1_equals_greedy():
    torch.manual_seed(0)
    logits = torch.randn(64, 100) * 3
    out = sample(logits, [row(temperature=1.3, top_k=1) for _ in range(64)])
    assert out == logits.argmax(-1).tolist()


def test_top_k_keeps_exactly_k_tokens():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    _apply_top_k_top_p(logits, [2], [1.0])
    assert logits.tolist() == [[NEG_INF, 4.0, 3.0, NEG_INF, NEG_INF]]


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = [0.05, 0.5, 0.15, 0.3]
    logits = logits_of(probs, 2)
    _apply_top_k_top_p(logits, [4, 4], [0.7, 0.82])
    kept = [[i for i, v in enumerate(r) if v != NEG_INF] for r in logits.tolist()]
    # 0.5 < 0.7 <= 0.5 + 0.3; 0.8 < 0.82 <= 0.8 + 0.15
    assert kept == [[1, 3], [1, 2, 3]]


def test_top_k_then_top_p_on_the_renormalized_survivors_in_a_mixed_batch():
    logits = logits_of([0.05, 0.5, 0.15, 0.3], 4)
    original = logits.clone()
    # Row 0: top-2 = {1, 3} renormalized to 0.625 / 0.375, so top_p=0.6 keeps only 1.
    # Row 1: top-p only. Row 2: untouched. Row 3: top-k only.
    _apply_top_k_top_p(logits, [2, 4, 4, 3], [0.6, 0.7, 2.0, 2.0])
    kept = [{i for i, v in enumerate(r) if v != NEG_INF} for r in logits.tolist()]
    assert kept == [{1}, {1, 3}, {0, 1, 2, 3}, {1, 2, 3}]
    survivors = logits != NEG_INF
    assert torch.equal(logits[survivors], original[survivors])


def test_top_p_sampling_never_leaves_the_nucleus():
    torch.manual_seed(0)
    probs = [0.05, 0.5, 0.15, 0.3]
    out = sample(logits_of(probs, 2000), [row(top_p=0.7) for _ in range(2000)])
    assert set(out) == {1, 3}
    assert out.count(1) / len(out) == pytest.approx(0.5 / 0.8, abs=0.04)


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    torch.manual_seed(0)
    probs = [0.6, 0.25, 0.1, 0.05]  # threshold 0.2 * 0.6 = 0.12 keeps tokens 0 and 1
    out = sample(logits_of(probs, 2000), [row(min_p=0.2) for _ in range(2000)])
    assert set(out) == {0, 1}
    assert out.count(0) / len(out) == pytest.approx(0.6 / 0.85, abs=0.04)


def test_penalty_values_follow_openai_and_hf_semantics():
    logits = torch.tensor([[2.0, -1.0, 1.5, 0.5, 1.0]])
    r = row(
        prompt=[1],
        output=[2, 2, 3],
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    _apply_penalties(logits, [r])
    # 0: unseen. 1: prompt only, negative -> *2. 2: seen, /2, count 2 -> -1.0 - 0.25.
    # 3: /2, count 1 -> -0.5 - 0.25. 4: unseen.
    assert logits.tolist() == [[2.0, -2.0, -0.5, -0.5, 1.0]]


def test_presence_and_frequency_penalties_ignore_prompt_tokens():
    logits = torch.tensor([[1.0, 1.0, 1.0]])
    _apply_penalties(logits, [row(prompt=[0, 0], output=[1], frequency_penalty=1.0)])
    assert logits.tolist() == [[1.0, 0.0, 1.0]]


def test_repetition_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    assert sample(logits, [row(temperature=0.0)]) == [0]
    assert sample(logits, [row(temperature=0.0, output=[0], repetition_penalty=2.0)]) == [1]


def test_only_penalized_rows_change():
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 2.0, 0.0]])
    rows = [
        row(temperature=0.0, output=[0], presence_penalty=2.0),
        row(temperature=0.0, output=[0]),
    ]
    assert sample(logits, rows) == [1, 0]


def test_logit_bias_flips_the_argmax():
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 2.0, 0.0]])
    rows = [row(temperature=0.0, logit_bias={2: 5.0}), row(temperature=0.0, logit_bias={0: -2.0})]
    assert sample(logits, rows) == [2, 1]


def test_allowed_token_ids_mask_everything_else():
    torch.manual_seed(0)
    logits = torch.tensor([[5.0, 0.0, 1.0, 0.5, 4.0]] * 500)
    rows = [row(temperature=0.0, allowed_token_ids=[1, 3])]
    rows += [row(temperature=1.0, allowed_token_ids=[1, 2]) for _ in range(498)]
    rows += [row(temperature=0.0)]
    out = sample(logits, rows)
    assert out[0] == 3 and out[-1] == 0
    assert set(out[1:-1]) == {1, 2}


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0]] * 3)
    rows = [
        row(temperature=0.0, min_tokens=2, output=[3], eos=(0,), stop_token_ids=[1]),
        row(temperature=0.0, min_tokens=2, output=[3, 3], eos=(0,), stop_token_ids=[1]),
        row(temperature=0.0, min_tokens=2, output=[], stop_token_ids=[1]),
    ]
    assert sample(logits, rows) == [2, 0, 0]


def _seeded_run(seed: int, neighbours: list[SamplingRow], position: int, steps: int = 12):
    """Samples `steps` tokens for one seeded request sitting among `neighbours`."""
    torch.manual_seed(1234 + len(neighbours))  # unrelated global state per composition
    me = row(seed=seed, temperature=0.9, top_p=0.95, top_k=50)
    base = torch.randn(1, 200, generator=torch.Generator().manual_seed(99)) * 2
    tokens = []
    for _ in range(steps):
        rows = list(neighbours)
        rows.insert(position, me)
        logits = torch.randn(len(rows), 200) * 2
        logits[position] = base[0]
        tok = sample(logits, rows)[position]
        me.token_ids.append(tok)
        me.num_output_tokens += 1
        tokens.append(tok)
    return tokens


def test_seeded_row_is_reproducible_across_batch_compositions():
    alone = _seeded_run(42, [], 0)
    crowded = _seeded_run(
        42,
        [
            row(temperature=1.0),
            row(seed=7),
            row(temperature=0.0),
            row(top_k=3),
            row(top_k=120, top_p=0.5),
            row(top_p=0.8, presence_penalty=1.0, output=[5]),
        ],
        2,
    )
    other_place = _seeded_run(42, [row(seed=42), row(min_p=0.1)], 1)
    assert alone == crowded == other_place
    assert len(set(alone)) > 1
    assert _seeded_run(43, [], 0) != alone


def test_unseeded_sampling_matches_the_distribution():
    torch.manual_seed(0)
    probs = [0.1, 0.2, 0.3, 0.4]
    n = 8000
    out = sample(logits_of(probs, n), [row() for _ in range(n)])
    freqs = [out.count(i) / n for i in range(4)]
    assert freqs == pytest.approx(probs, abs=0.02)


def test_temperature_sharpens_the_distribution():
    torch.manual_seed(0)
    probs = [0.2, 0.8]
    n = 8000
    out = sample(logits_of(probs, n), [row(temperature=0.5) for _ in range(n)])
    # T=0.5 squares the probabilities: 0.04 / 0.68 for token 0.
    assert out.count(0) / n == pytest.approx(0.04 / 0.68, abs=0.015)


def test_make_generator_is_none_without_seed_and_accepts_any_int():
    assert make_generator(None, "cpu") is None
    for seed in (0, -5, 2**70 + 3):
        a, b = make_generator(seed, "cpu"), make_generator(seed, "cpu")
        assert torch.rand(4, generator=a).tolist() == torch.rand(4, generator=b).tolist()


def test_logprobs_are_of_the_raw_distribution():
    torch.manual_seed(0)
    logits = torch.randn(4, 30) * 2
    rows = [
        row(temperature=0.0, logprobs=3),
        row(temperature=0.7, logprobs=0, output=[1, 2], repetition_penalty=1.5),
        row(temperature=0.0),
        row(temperature=0.0, logprobs=5, logit_bias={7: 100.0}),
    ]
    out = Sampler()(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    assert out.token_ids[3] == 7
    for i in (0, 1, 3):
        lp = out.logprobs[i]
        tok = out.token_ids[i]
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(raw[i, tok].item(), abs=1e-6)
        assert lp.rank == int((raw[i] > raw[i, tok]).sum()) + 1
        k = rows[i].params.logprobs
        top_v, top_i = raw[i].topk(k) if k else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in lp.top] == top_i.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_v.tolist(), abs=1e-6)
    assert out.logprobs[0].rank == 1
    assert out.logprobs[1].top == []


def test_no_logprobs_requested_gives_all_none():
    out = Sampler()(torch.randn(3, 10), [row(temperature=0.0) for _ in range(3)])
    assert out.logprobs == [None, None, None]


def test_prompt_logprobs_match_log_softmax_across_chunks():
    torch.manual_seed(0)
    logits = torch.randn(300, 17)
    targets = torch.randint(0, 17, (300,))
    out = compute_prompt_logprobs(logits, targets, 2)
    raw = torch.log_softmax(logits, dim=-1)
    assert len(out) == 300
    for i in (0, 150, 299):
        t = targets[i].item()
        assert out[i].token_id == t
        assert out[i].logprob == pytest.approx(raw[i, t].item(), abs=1e-6)
        assert out[i].rank == int((raw[i] > raw[i, t]).sum()) + 1
        assert [tid for tid, _ in out[i].top] == raw[i].topk(2).indices.tolist()
    assert all(math.isfinite(o.logprob) for o in out)


def test_prompt_logprobs_with_zero_top_list_only_the_target():
    out = compute_prompt_logprobs(torch.randn(3, 5), torch.tensor([0, 1, 2]), 0)
    assert [o.top for o in out] == [[], [], []]


def test_logits_shape_must_match_rows():
    with pytest.raises(ValueError):
        Sampler()(torch.randn(2, 5), [row()])


def test_row_argmax_keeps_torch_tie_and_nan_rules():
    """The NumPy fast path must pick what torch.argmax picks: first max, NaN wins."""
    from engine.worker.sampler import row_argmax

    x = torch.tensor(
        [
            [1.0, 3.0, 3.0, 2.0],  # tie: first index
            [float("nan"), 5.0, float("nan"), 1.0],  # NaN counts as the maximum
            [-float("inf"), -float("inf"), -1.0, -float("inf")],
            [2.0, float("inf"), float("inf"), 0.0],
        ]
    )
    assert row_argmax(x).tolist() == x.argmax(dim=-1).tolist() == [1, 0, 2, 1]
    assert row_argmax(x.double()).tolist() == [1, 0, 2, 1]  # other dtypes: torch itself
    assert row_argmax(x[:, 1:]).tolist() == x[:, 1:].argmax(dim=-1).tolist()  # strided view


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_whose_masks_leave_no_token_fails_and_never_gets_token_0(temperature):
    """allowed_token_ids=[2] with 2 an EOS id masked under min_tokens: nothing is left. The
    row is reported failed, naming its masks; its neighbours sample as usual."""
    logits = torch.tensor([[5.0, 0.0, 1.0, 0.5]] * 3)
    rows = [
        row(temperature=0.0),
        row(temperature=temperature, allowed_token_ids=[2], min_tokens=3, eos=(2,), logprobs=1),
        row(temperature=0.0, allowed_token_ids=[1, 3]),
    ]
    out = Sampler()(logits, rows)
    assert list(out.failed) == [1]
    assert "allowed_token_ids" in out.failed[1] and "min_tokens=3" in out.failed[1]
    assert out.token_ids == [0, -1, 3]
    assert out.logprobs[1] is None


def test_a_row_left_with_only_minus_inf_logits_by_the_model_fails_too():
    """The runtime-only case: the allowed ids are all -inf in the model's own logits."""
    logits = torch.tensor([[5.0, NEG_INF, NEG_INF, 0.5]])
    out = Sampler()(logits, [row(temperature=1.0, allowed_token_ids=[1, 2], seed=3)])
    assert out.failed and out.token_ids == [-1]


def test_bf16_logits_greedy_argmax_reads_them_in_place_with_numpys_rules():
    """A bf16 model's logits reach the sampler as they are (runner: keep_dtype): the greedy
    argmax (csrc/fused_ops.c) must pick what NumPy's argmax picks on their exact fp32
    widening: the first index on ties, the first NaN, -0 equal to +0."""
    from engine.worker.sampler import row_argmax

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 49152, generator=gen).bfloat16()
    x[0, 40000] = x[0, 7] = x[0].max() + 1  # a tie: 7 wins
    x[1, 123] = float("nan")
    x[1, 9000] = float("nan")
    special = torch.tensor([[-0.0, 0.0, -1.0], [NEG_INF] * 3, [NEG_INF, 1.0, 1.0]]).bfloat16()
    for t in (x, special, x[:, :1000]):  # the last: a row stride past the row length
        want = torch.from_numpy(t.float().numpy().argmax(axis=-1))
        assert torch.equal(row_argmax(t), want)
    assert row_argmax(x)[0] == 7 and row_argmax(x)[1] == 123
    greedy = dict(temperature=0.0)
    out = Sampler()(x[:3], [row(**greedy), row(logprobs=1, **greedy), row(**greedy)])
    assert out.token_ids == row_argmax(x[:3]).tolist()
    assert out.logprobs[0] is None and out.logprobs[1] is not None  # widened for logprobs
