"""The engine against real prefills, finite differences and a dense loss (tiny random models)."""

from __future__ import annotations

import pytest
import torch

from cartridges.core.cartridge import Cartridge, compose_rows, init_from_corpus
from cartridges.core.chat import system_ids
from cartridges.core.errors import CorpusError
from cartridges.core.loss import Targets, sparse_distill, student_loss
from cartridges.core.prefix import capture_rows, forward_behind
from cartridges.evaluation.equiv import cut
from tests.tiny import TINY, VOCAB, WINDOW, tiny_llama

SLIDING = ("gemma3", "mistral", "phi3")

P, S = 12, 9


def random_ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def real_logits(lm, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return lm.model(input_ids=ids.view(1, -1)).logits[0]


@pytest.mark.parametrize("family", sorted(TINY))
def test_untrained_cartridge_reproduces_real_prefill(family):
    lm = TINY[family]()
    ids = random_ids(P + S)
    cart = Cartridge.from_rows(capture_rows(lm.model, ids[:P]), frozen=1)
    with torch.no_grad():
        behind = forward_behind(lm.model, cart.rows(), ids[P:].view(1, -1), logits=True)[0]
    real = real_logits(lm, ids)[P:]
    assert (behind - real).abs().max().item() <= 1e-4
    assert torch.equal(behind.argmax(-1), real.argmax(-1))


@pytest.mark.parametrize("family", sorted(TINY))
def test_corpus_init_is_the_system_wrapped_corpus_prefill(family):
    lm = TINY[family]()
    text = "Cartridges replace a long document in context. " * 4
    cart = init_from_corpus(lm, text, p=P)
    wrapped = torch.tensor(system_ids(lm.tokenizer, text))
    assert wrapped.numel() > P + 4
    with torch.no_grad():
        behind = forward_behind(lm.model, cart.rows(), wrapped[P:].view(1, -1), logits=True)[0]
    real = real_logits(lm, wrapped)[P:]
    assert (behind - real).abs().max().item() <= 1e-4


def test_corpus_shorter_than_the_cartridge_is_refused_with_the_largest_p_that_fits():
    lm = TINY["llama"]()
    text = "A short note."
    n = len(system_ids(lm.tokenizer, text))
    with pytest.raises(CorpusError, match=rf"too short for p={n + 1}: .* {n} tokens.*p at most {n}\)"):
        init_from_corpus(lm, text, p=n + 1)
    assert init_from_corpus(lm, text, p=n).p == n


@pytest.mark.parametrize("family", sorted(TINY))
def test_two_parts_from_one_capture_reproduce_prefill_of_2p(family):
    lm = TINY[family]()
    ids = random_ids(2 * P + S, seed=2)
    whole = Cartridge.from_rows(capture_rows(lm.model, ids[: 2 * P]), frozen=1)
    parts = cut(whole, 2)
    assert [c.p for c in parts] == [P, P]
    with torch.no_grad():
        behind = forward_behind(lm.model, compose_rows(parts), ids[2 * P :].view(1, -1), logits=True)[0]
    real = real_logits(lm, ids)[2 * P :]
    assert (behind - real).abs().max().item() <= 1e-4
    assert torch.equal(behind.argmax(-1), real.argmax(-1))


def test_one_part_composition_is_bitwise_the_single_cartridge():
    lm = tiny_llama()
    ids = random_ids(P + S, seed=3)
    cart = Cartridge.from_rows(capture_rows(lm.model, ids[:P]))
    with torch.no_grad():
        single = forward_behind(lm.model, cart.rows(), ids[P:].view(1, -1), logits=True)
        composed = forward_behind(lm.model, compose_rows([cart]), ids[P:].view(1, -1), logits=True)
    assert torch.equal(single, composed)


@pytest.mark.parametrize("family", sorted(TINY))
def test_sliding_window_cuts_through_the_cartridge_like_a_real_prefix(family, monkeypatch):
    """Sliding layers see only the last WINDOW positions: the first real tokens see the
    cartridge's last rows, later ones none, exactly as behind a real prefix."""
    lm = TINY[family]()
    ids = random_ids(P + S, seed=21)
    rows = capture_rows(lm.model, ids[:P])
    with torch.no_grad():
        behind = forward_behind(lm.model, rows, ids[P:].view(1, -1), logits=True)[0]
        real = real_logits(lm, ids)[P:]
        assert (behind - real).abs().max().item() <= 1e-4
        if family in SLIDING:
            assert WINDOW < P  # the window really cuts through the rows
            monkeypatch.setattr(lm.model.config, "sliding_window", None)
            unwindowed = forward_behind(lm.model, rows, ids[P:].view(1, -1), logits=True)[0]
            assert (unwindowed - real).abs().max().item() > 1e-3  # so the window mattered


@pytest.mark.parametrize("family", sorted(TINY))
def test_left_padded_batch_equals_each_row_alone(family):
    lm = TINY[family](torch.float64)
    cart = Cartridge.from_rows(capture_rows(lm.model, random_ids(P, seed=4)))
    seqs = [random_ids(n, seed=10 + n) for n in (5, 9, 7)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), 257, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = s
        mask[i, width - len(s) :] = 1
    with torch.no_grad():
        batch = forward_behind(lm.model, cart.rows(), ids, attention_mask=mask, logits=True)
        for i, s in enumerate(seqs):
            alone = forward_behind(lm.model, cart.rows(), s.view(1, -1), logits=True)[0]
            assert torch.allclose(batch[i, width - len(s) :], alone, atol=1e-10, rtol=0)


@pytest.mark.parametrize("family", sorted(TINY))
def test_packed_segments_equal_each_sequence_alone(family):
    """Training packs sequences into one row; each segment restarts at position p."""
    lm = TINY[family](torch.float64)
    rows = capture_rows(lm.model, random_ids(P, seed=15))
    seqs = [random_ids(n, seed=30 + n) for n in (4, 8, 6)]
    ids = torch.cat(seqs).view(1, -1)
    segments = torch.cat([torch.full((len(s),), i) for i, s in enumerate(seqs)]).view(1, -1)
    with torch.no_grad():
        packed = forward_behind(lm.model, rows, ids, segment_ids=segments, logits=True)[0]
        start = 0
        for s in seqs:
            alone = forward_behind(lm.model, rows, s.view(1, -1), logits=True)[0]
            assert torch.allclose(packed[start : start + len(s)], alone, atol=1e-10, rtol=0)
            start += len(s)


@pytest.fixture
def exact_norms(monkeypatch):
    """HF RMSNorms compute in float32 even for float64 models; finite differences need
    the whole forward in float64, so the norms run in the input dtype here."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.phi3.modeling_phi3 import Phi3RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def gemma_forward(self, x):  # Gemma scales by (1 + w)
        return (1.0 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    for cls in (LlamaRMSNorm, Qwen3RMSNorm, MistralRMSNorm, Phi3RMSNorm):
        monkeypatch.setattr(cls, "forward", forward)
    monkeypatch.setattr(Gemma3RMSNorm, "forward", gemma_forward)


@pytest.mark.parametrize("family", sorted(TINY))
def test_gradcheck_attention_into_prefix_rows(family, exact_norms):
    """Finite differences through the attention (kv_seq > q_seq, GQA or one KV head) into
    the rows; for sliding families the window cuts through the 7 rows."""
    lm = TINY[family](torch.float64, layers=1)
    cart = Cartridge.from_rows(capture_rows(lm.model, random_ids(7, seed=5)), frozen=1)
    ids = random_ids(3, seed=6).view(1, -1)
    weight = torch.randn(1, 3, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def f(k, v):
        rows = [(torch.cat([cart.frozen_keys[0], k], 1), torch.cat([cart.frozen_values[0], v], 1))]
        return (forward_behind(lm.model, rows, ids) * weight).sum()

    assert torch.autograd.gradcheck(f, (cart.train_keys[0], cart.train_values[0]), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", SLIDING)
def test_rows_outside_every_window_get_no_gradient(family):
    """With only sliding layers, rows no query's window reaches get exactly zero gradient."""
    lm = TINY[family](torch.float64, layers=1)
    cart = Cartridge.from_rows(capture_rows(lm.model, random_ids(P, seed=16)), frozen=1)
    n = 3  # the earliest query (position P) sees keys P - WINDOW + 1 .. P; later ones fewer rows
    forward_behind(lm.model, cart.rows(), random_ids(n, seed=17).view(1, -1)).sum().backward()
    first_seen = P - WINDOW + 1
    grad = cart.train_keys[0].grad.abs().sum(dim=(0, 2))  # per trainable row (rows 1..P-1)
    assert torch.all(grad[: first_seen - 1] == 0)
    assert torch.all(grad[first_seen - 1 :] > 0)


def make_targets(rows: list[int], positions: list[int], k: int = 4, seed: int = 0) -> Targets:
    gen = torch.Generator().manual_seed(seed)
    n = len(rows)
    ids = torch.stack([torch.randperm(VOCAB, generator=gen)[:k] for _ in range(n)])
    ids[0, -1] = -1  # a padded entry must be ignored
    logprobs = torch.log_softmax(torch.randn(n, k, generator=gen, dtype=torch.float64), -1)
    logprobs = logprobs.sort(-1, descending=True).values
    return Targets(torch.tensor(rows), torch.tensor(positions), ids, logprobs)


@pytest.mark.parametrize("family", sorted(TINY))
def test_gradcheck_through_loss_with_duplicate_positions(family, exact_norms):
    lm = TINY[family](torch.float64, layers=1)
    cart = Cartridge.from_rows(capture_rows(lm.model, random_ids(4, seed=7)), frozen=1)
    ids = random_ids(5, seed=8).view(1, -1)
    targets = make_targets([0, 0, 0, 0], [2, 4, 2, 3])

    def f(k, v):
        rows = [(torch.cat([cart.frozen_keys[0], k], 1), torch.cat([cart.frozen_values[0], v], 1))]
        return student_loss(lm.model, rows, ids, targets)

    assert torch.autograd.gradcheck(f, (cart.train_keys[0], cart.train_values[0]), eps=1e-6, atol=1e-6)


def test_sparse_loss_equals_dense_reference_with_equal_gradients():
    lm = tiny_llama()
    base = Cartridge.from_rows(capture_rows(lm.model, random_ids(P, seed=9)))
    ids = torch.stack([random_ids(8, seed=11), random_ids(8, seed=12)])
    targets = make_targets([0, 0, 1, 1, 1], [1, 5, 2, 6, 7], k=6)
    targets.logprobs = targets.logprobs.float()

    sparse_cart = Cartridge.from_rows(base.detached_rows())
    sparse = student_loss(lm.model, sparse_cart.rows(), ids, targets)
    sparse.backward()

    dense_cart = Cartridge.from_rows(base.detached_rows())
    logits = forward_behind(lm.model, dense_cart.rows(), ids, logits=True)  # [B, L, V]: the reference
    logq = torch.log_softmax(logits, -1)[targets.row, targets.position - 1]
    teacher = torch.zeros(len(targets), VOCAB)
    valid = targets.ids >= 0
    for n in range(len(targets)):
        teacher[n, targets.ids[n][valid[n]]] = targets.logprobs[n][valid[n]].exp()
    dense = -(teacher * logq).sum(-1).mean()
    dense.backward()

    assert abs(sparse.item() - dense.item()) <= 1e-5
    for a, b in zip(sparse_cart.parameters(), dense_cart.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4)


def test_sink_rows_get_no_gradient_and_model_weights_never_change():
    lm = tiny_llama()
    weights = {n: w.detach().clone() for n, w in lm.model.named_parameters()}
    cart = Cartridge.from_rows(capture_rows(lm.model, random_ids(P, seed=13)), frozen=2)
    sinks = [k.clone() for k in cart.frozen_keys] + [v.clone() for v in cart.frozen_values]
    before = [t.detach().clone() for t in cart.parameters()]
    opt = torch.optim.Adam(cart.parameters(), lr=1e-2, weight_decay=0.0)
    loss = student_loss(lm.model, cart.rows(), random_ids(6, seed=14).view(1, -1), make_targets([0, 0], [2, 5]))
    loss.backward()
    assert all(not t.requires_grad and t.grad is None for t in cart.frozen_keys + cart.frozen_values)
    assert all(w.grad is None for w in lm.model.parameters())
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(sinks, cart.frozen_keys + cart.frozen_values, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(before, cart.parameters(), strict=True))
    for name, w in lm.model.named_parameters():
        assert torch.equal(w, weights[name]), name


def test_sparse_distill_ignores_padding_entries():
    lm = tiny_llama()
    hidden = torch.randn(3, 32)
    t = make_targets([0, 0, 0], [1, 2, 3], k=4)
    full = sparse_distill(hidden, lm.model, t.ids, t.logprobs)
    t.ids[1, 2:] = -1
    cut_loss = sparse_distill(hidden, lm.model, t.ids, t.logprobs)
    assert cut_loss.item() != pytest.approx(full.item())
    logq = torch.log_softmax(lm.model.lm_head(hidden), -1)
    ref = 0.0
    for n in range(3):
        keep = t.ids[n] >= 0
        ref += -(t.logprobs[n][keep].exp() * logq[n, t.ids[n][keep]]).sum().item()
    assert cut_loss.item() == pytest.approx(ref / 3, abs=1e-5)
