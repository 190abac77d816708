"""The averaging experiment's readouts of one run, against sums taken by hand over the same rows."""

from __future__ import annotations

import torch

from cartridges.core.cartridge import Cartridge
from experiments.average import FINAL, Readouts


def test_readouts_are_the_snapshots_the_tail_means_and_the_exponential_averages():
    gen = torch.Generator().manual_seed(0)
    cart = Cartridge([torch.randn(2, 5, 4, generator=gen)], [torch.randn(2, 5, 4, generator=gen)], frozen=1)
    steps = 10
    start = [p.detach().clone() for p in cart.parameters()]
    reads = Readouts(cart, steps, tails=[0.25, 0.5], decays=[0.9])
    seen = []
    for step in range(steps):
        with torch.no_grad():
            for p in cart.parameters():
                p.add_(torch.randn(p.shape, generator=gen))
        seen.append([p.detach().clone() for p in cart.parameters()])
        reads.after(step)
    got = reads.all()
    assert list(got)[0] == FINAL
    assert set(got) == {FINAL, "epoch1", "tail0.25", "tail0.5", "epoch1_tail0.25", "epoch1_tail0.5", "ema0.9"}
    for i in range(2):  # keys, then values
        assert torch.equal(got[FINAL][i], seen[-1][i])
        assert torch.equal(got["epoch1"][i], seen[4][i])
        torch.testing.assert_close(got["tail0.25"][i], torch.stack([s[i] for s in seen[7:]]).mean(0))  # ceil(2.5) steps
        torch.testing.assert_close(got["tail0.5"][i], torch.stack([s[i] for s in seen[5:]]).mean(0))
        torch.testing.assert_close(got["epoch1_tail0.5"][i], torch.stack([s[i] for s in seen[2:5]]).mean(0))  # ceil(2.5)
        torch.testing.assert_close(got["epoch1_tail0.25"][i], torch.stack([s[i] for s in seen[3:5]]).mean(0))
        ema = start[i]
        for s in seen:
            ema = 0.9 * ema + 0.1 * s[i]
        torch.testing.assert_close(got["ema0.9"][i], ema)


def test_a_one_epoch_run_has_no_first_epoch_readouts():
    cart = Cartridge([torch.zeros(1, 3, 2)], [torch.zeros(1, 3, 2)], frozen=1)
    reads = Readouts(cart, 4, tails=[0.5], decays=[], epochs=1)
    for step in range(4):
        with torch.no_grad():
            for p in cart.parameters():
                p.fill_(step)
        reads.after(step)
    got = reads.all()
    assert set(got) == {FINAL, "tail0.5"}
    assert float(got["tail0.5"][0].mean()) == 2.5 and float(got[FINAL][0].mean()) == 3.0


def test_pair_reads_runs_and_records_and_gives_the_closure_change_by_hand(tmp_path, capsys):
    import json

    from experiments.average import pair_main

    lines = range(1, 9)
    bare, icl = {n: 5.0 + n for n in lines}, {n: 2.0 + n / 2 for n in lines}
    record = {"gold_nll_by_line": {str(n): {"bare": bare[n], "icl": icl[n], "cartridge": 4.0 + n} for n in lines}}
    (tmp_path / "r.jsonl").write_text("{}\n" + json.dumps(record) + "\n")  # the last line is the record
    run = {"gold_nll": {"8": {"tail0.5": {str(n): 3.5 + n + (0.2 if n % 2 else 0.0) for n in lines}}}}
    (tmp_path / "a.jsonl").write_text("progress\n" + json.dumps(run) + "\n")
    pair_main(["--record", str(tmp_path / "r.jsonl"), "--base", str(tmp_path / "r.jsonl"),
               "--other", f"{tmp_path / 'a.jsonl'}:8:tail0.5", "--json"])
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    diff = [(3.5 + n + (0.2 if n % 2 else 0.0)) - (4.0 + n) for n in lines]
    gap = sum(bare[n] - icl[n] for n in lines) / len(lines)
    want = -sum(diff) / len(diff) / gap
    assert abs(out["pairs"][0]["closure_change"] - want) < 1e-12
    assert abs(out["pooled"]["closure_change"] - want) < 1e-12
    assert out["pairs"][0]["better"] == 8
