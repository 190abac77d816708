"""Teacher targets against a dense log-softmax; packed vs flat training gradients; resume."""

from __future__ import annotations

import math

import torch

from cartridges.core.cartridge import Cartridge
from cartridges.core.prefix import capture_rows
from cartridges.core.targets import teacher_targets, truncate_topk
from cartridges.core.train import Example, group_backward, lr_at, make_optimizer
from tests.tiny import VOCAB, tiny_llama


def test_truncation_keeps_descending_entries_up_to_the_one_reaching_the_mass():
    probs = torch.tensor([0.5, 0.3, 0.195] + [0.005 / 257] * 257)
    (ids, lps), = truncate_topk(probs.log().view(1, -1), k=20, mass=0.99)
    assert ids == [0, 1, 2]  # 0.5, 0.8, 0.995: the entry reaching 0.99 is included
    assert lps == sorted(lps, reverse=True)
    assert math.isclose(sum(math.exp(x) for x in lps), 0.995, rel_tol=1e-5)  # not renormalized


def test_truncation_keeps_all_k_when_mass_is_never_reached():
    (ids, lps), = truncate_topk(torch.zeros(1, VOCAB), k=20, mass=0.99)
    assert len(ids) == 20 and len(set(ids)) == 20
    assert all(math.isclose(x, -math.log(VOCAB), rel_tol=1e-5) for x in lps)


def test_teacher_targets_equal_dense_log_softmax_and_batching_does_not_matter():
    lm = tiny_llama()
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (14, 9, 20)]
    starts = [6, 3, 11]
    batched = teacher_targets(lm.model, seqs, starts, k=7, mass=0.99)
    for seq, start, got in zip(seqs, starts, batched, strict=True):
        with torch.no_grad():
            dense = torch.log_softmax(lm.model(input_ids=torch.tensor([seq])).logits[0], -1)
        assert len(got) == len(seq) - start
        for j, (ids, lps) in enumerate(got):
            row = dense[start - 1 + j]
            ref_vals, ref_ids = row.topk(7)
            assert 1 <= len(ids) <= 7 and len(set(ids)) == len(ids)
            assert ids == ref_ids[: len(ids)].tolist()
            assert torch.allclose(torch.tensor(lps), ref_vals[: len(ids)], atol=1e-5)
            cum = ref_vals.exp().cumsum(0)
            expected = int((cum < 0.99).sum().item()) + 1 if cum[-1] >= 0.99 else 7
            assert len(ids) == expected
        alone = teacher_targets(lm.model, [seq], [start], k=7, mass=0.99)[0]
        assert [i for i, _ in alone] == [i for i, _ in got]


def random_examples(n: int, seed: int = 0) -> list[Example]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for c in range(n):
        length = 6 + 3 * c
        ids = torch.randint(0, 256, (length,), generator=gen).tolist()
        positions = list(range(2, length, 2))
        topk_ids = [torch.randperm(VOCAB, generator=gen)[:5].tolist() for _ in positions]
        topk_lps = [torch.log_softmax(torch.randn(5, generator=gen), 0).sort(descending=True).values.tolist() for _ in positions]
        out.append(Example(c, ids, positions, topk_ids, topk_lps))
    return out


def test_packed_and_flat_training_paths_give_equal_gradients():
    lm = tiny_llama()
    base = Cartridge.from_rows(capture_rows(lm.model, torch.arange(10) + 30))
    examples = random_examples(3)
    grads = {}
    for packed in (True, False):
        cart = Cartridge.from_rows(base.detached_rows())
        loss = group_backward(lm.model, [cart], examples, packed=packed)
        grads[packed] = (loss, [p.grad.clone() for p in cart.parameters()])
    assert abs(grads[True][0] - grads[False][0]) < 1e-5
    for a, b in zip(grads[True][1], grads[False][1], strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in grads[True][1])


def test_recomputing_activations_gives_the_same_gradients():
    lm = tiny_llama()
    base = Cartridge.from_rows(capture_rows(lm.model, torch.arange(10) + 30))
    examples = random_examples(3, seed=2)
    grads, calls = [], []
    attention = lm.model.model.layers[0].self_attn
    for checkpoint in (False, True):
        count = [0]
        hook = attention.register_forward_hook(lambda *_, c=count: c.__setitem__(0, c[0] + 1))
        cart = Cartridge.from_rows(base.detached_rows())
        group_backward(lm.model, [cart], examples, packed=True, checkpoint=checkpoint)
        hook.remove()
        grads.append([p.grad.clone() for p in cart.parameters()])
        calls.append(count[0])
    assert calls == [1, 2]  # the layer really ran again in the backward
    for a, b in zip(*grads, strict=True):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-6)
    assert all(not hasattr(layer, "__dict__") or "forward" not in layer.__dict__ for layer in lm.model.model.layers)


def test_optimizer_roundtrip_continues_bit_identically(tmp_path):
    from cartridges.core.files import load_cartridge, load_optimizer, save_cartridge, save_optimizer

    lm = tiny_llama()
    examples = random_examples(4, seed=1)
    a = Cartridge.from_rows(capture_rows(lm.model, torch.arange(10) + 30))
    opt_a = make_optimizer(a, 1e-2)
    for ex in examples[:2]:
        opt_a.zero_grad()
        group_backward(lm.model, [a], [ex])
        opt_a.step()
    save_cartridge(tmp_path / "c.safetensors", a, lm.fingerprint)
    save_optimizer(tmp_path / "o.safetensors", opt_a, 2)
    b = load_cartridge(tmp_path / "c.safetensors")
    opt_b = make_optimizer(b, 1e-2)
    assert load_optimizer(tmp_path / "o.safetensors", opt_b)["step"] == 2
    for cart, opt in ((a, opt_a), (b, opt_b)):
        for ex in examples[2:]:
            opt.zero_grad()
            group_backward(lm.model, [cart], [ex])
            opt.step()
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y)


def test_lr_schedule_matches_torch_warmup_and_cosine_schedulers():
    """Warm-up then cosine, against torch's own LinearLR and CosineAnnealingLR stepped by hand."""
    total, warmup, lr = 20, 0.2, 3e-2
    ramp = 4
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / ramp, end_factor=1.0, total_iters=ramp - 1)
    expected = []
    for _ in range(ramp):
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        warm.step()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - ramp, eta_min=0.0)
    for _ in range(total - ramp):
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        cosine.step()
    got = [lr_at(i, total, lr, "cosine", warmup) for i in range(total)]
    assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(got, expected, strict=True))
    assert [lr_at(i, total, lr, "constant", warmup) for i in range(total)] == expected[:ramp] + [lr] * (total - ramp)
    assert [lr_at(i, total, lr) for i in range(total)] == [lr] * total
