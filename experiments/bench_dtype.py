"""bfloat16 against float32 on the default model: speed of each pipeline part, and what it costs.

Both dtypes load the same weights in this process and run the same work side by side:
- speed: chunk prefill, lockstep decode at several batch widths, the teacher pass and
  the training forward/backward behind a float32 cartridge;
- fidelity: the equivalence gate in bfloat16 (judged against the model's own shape
  sensitivity), and the teacher's top-k targets against float32's (top-1 agreement and
  the mean KL over float32's kept entries, which is what the distillation loss reads).

Run: `python -m experiments.bench_dtype [--corpus FILE] [--json]`; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from cartridges.core.batch import Stream
from cartridges.core.cartridge import init_from_corpus
from cartridges.core.generate import generate
from cartridges.core.models import LoadedModel, load_model
from cartridges.core.speed import choose_dtype, cpu_capability, cpu_name, model_shape
from cartridges.core.targets import teacher_targets
from cartridges.core.train import Example, group_backward
from cartridges.evaluation.equiv import equivalence


def timed(fn) -> tuple[object, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def speeds(lm: LoadedModel, ids: list[int], text: str, widths: list[int], max_new: int) -> dict:
    """Tokens per second of each part, on slices of the corpus."""
    out: dict[str, float] = {}
    prompts = [ids[i * 37 : i * 37 + 400] for i in range(8)]
    _, s = timed(lambda: generate(lm.model, [Stream(p, max_new=1) for p in prompts], batch_size=8))
    out["prefill_tokens_per_s"] = 8 * 400 / s
    for width in widths:
        streams = [Stream(ids[i * 11 : i * 11 + 300], max_new=max_new) for i in range(width)]
        gens, s = timed(lambda: generate(lm.model, streams, batch_size=width))  # noqa: B023
        out[f"decode_{width}_tokens_per_s"] = sum(len(g.tokens) for g in gens) / s
    seqs = [ids[i * 53 : i * 53 + 520] for i in range(8)]
    _, s = timed(lambda: teacher_targets(lm.model, seqs, [400] * 8))
    out["teacher_tokens_per_s"] = 8 * 120 / s
    cart = init_from_corpus(lm, text, 256)
    examples = [Example(i, ids[i * 71 : i * 71 + 160], list(range(40, 160)), [[ids[i * 71 + j]] for j in range(40, 160)],
                        [[0.0]] * 120) for i in range(4)]
    _, s = timed(lambda: group_backward(lm.model, [cart], examples))
    out["train_tokens_per_s"] = 4 * 120 / s
    return out


def teacher_agreement(f32: LoadedModel, bf16: LoadedModel, ids: list[int], n: int = 8) -> dict:
    """Top-1 agreement of kept targets, and KL(f32 kept || bf16) over f32's kept ids."""
    seqs = [ids[i * 97 : i * 97 + 520] for i in range(n)]
    ref = teacher_targets(f32.model, seqs, [400] * n)
    got = teacher_targets(bf16.model, seqs, [400] * n)
    agree = total = 0
    kls = []
    with torch.no_grad():
        for seq, r_rows, g_rows in zip(seqs, ref, got, strict=True):
            logq = torch.log_softmax(bf16.model(input_ids=torch.tensor([seq])).logits[0, 399:519].float(), -1)
            for j, ((r_ids, r_lp), (g_ids, _)) in enumerate(zip(r_rows, g_rows, strict=True)):
                agree += int(r_ids[0] == g_ids[0])
                total += 1
                p = torch.tensor(r_lp)
                kls.append(float((p.exp() * (p - logq[j, r_ids])).sum()))
    return {"teacher_top1_agreement": agree / total, "teacher_mean_kl": sum(kls) / len(kls), "positions": total}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="docs/eval/raft.md")
    ap.add_argument("--widths", default="16,32,64", help="decode batch widths")
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the cores this process may use)")
    ap.add_argument("--json", action="store_true", help="the last line is JSON (always so here)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",")]
    with open(args.corpus, encoding="utf-8") as f:
        text = f.read()
    f32, bf16 = load_model(None, "cpu", "float32"), load_model(None, "cpu", "bfloat16")
    ids = f32.tokenizer(text, add_special_tokens=False)["input_ids"]
    generate(f32.model, [Stream(ids[:8], max_new=2)])
    generate(bf16.model, [Stream(ids[:8], max_new=2)])
    speed = {"float32": speeds(f32, ids, text, widths, args.max_new), "bfloat16": speeds(bf16, ids, text, widths, args.max_new)}
    gates = {parts: equivalence(bf16, text, 256, 128, parts) for parts in (1, 2)}
    agreement = teacher_agreement(f32, bf16, ids)
    auto = choose_dtype(torch.device("cpu"), model_shape(f32.model.config))
    print(f"CPU {cpu_name()} ({cpu_capability()}), {torch.get_num_threads()} threads; "
          f"--dtype auto picks {auto.record()['dtype']}: {auto.reason}")
    for key in speed["float32"]:
        a, b = speed["float32"][key], speed["bfloat16"][key]
        print(f"{key:28s} float32 {a:8.1f}  bfloat16 {b:8.1f}  = {b / a:.2f}x")
    for parts, g in gates.items():
        print(f"bf16 equivalence gate, {parts} part(s): max |dlogit| {g['max_abs_dlogit']:.3f} (tolerance "
              f"{g['tolerance']:.3f}, own shape sensitivity {g['own_shape_sensitivity']:.3f}), greedy "
              f"{g['greedy_agree']}/{g['n']}: {'PASS' if g['pass'] else 'FAIL'}")
    print(f"teacher targets bf16 vs f32: top-1 agreement {agreement['teacher_top1_agreement']:.1%}, "
          f"mean KL over kept entries {agreement['teacher_mean_kl']:.4f} nats ({agreement['positions']} positions)")
    result = {
        "speed": speed,
        "bf16_over_f32": {k: round(speed["bfloat16"][k] / speed["float32"][k], 3) for k in speed["float32"]},
        "equivalence": {str(p): {k: g[k] for k in ("max_abs_dlogit", "tolerance", "own_shape_sensitivity",
                                                  "greedy_agree", "n", "pass")} for p, g in gates.items()},
        **agreement,
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(), "cpu_capability": cpu_capability(), "auto": auto.record(),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
