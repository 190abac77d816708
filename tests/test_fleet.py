"""Fleet mechanisms: the budget policy, round plans, per-document optimizers, composition, index math."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cartridges.core.similarity import center, embed_text
from cartridges.core.train import Example
from cartridges.fleet.budget import initial_residents, rotation, warmup_lr
from cartridges.fleet.index import build_index
from cartridges.fleet.manifest import DocEntry
from cartridges.fleet.plan import plan_round
from cartridges.fleet.residents import load_resident, new_resident, save_resident, train_group
from schemas import FleetConfig
from tests.tiny import tiny_llama

TEXTS = [
    "Apples grow on trees in orchards and ripen in the autumn sun. " * 6,
    "Rockets burn fuel to climb out of the atmosphere into orbit. " * 6,
    "Rivers carry water and silt from the mountains down to the sea. " * 6,
]


# --- budget policy (pure function of step counters) ---------------------------------------

def test_rotation_evicts_most_trained_and_admits_least_trained():
    steps = {0: 5, 1: 3, 2: 7, 3: 0, 4: 1}
    assert rotation([0, 1, 2], steps, 0.5) == ([2, 0], [3, 4])  # ceil(0.5 * 3) = 2


def test_rotation_ties_go_to_the_lower_doc_id():
    steps = {0: 4, 1: 4, 2: 4, 3: 2, 4: 2, 5: 2}
    assert rotation([0, 1, 2], steps, 0.5) == ([0, 1], [3, 4])


def test_rotation_evicts_only_as_many_as_can_be_replaced():
    steps = {0: 9, 1: 8, 2: 7, 3: 6, 4: 0}
    assert rotation([0, 1, 2, 3], steps, 0.5) == ([0], [4])  # wants 2, one document is absent
    assert rotation([0, 1, 2, 3, 4], steps, 0.5) == ([], [])  # everything is resident


def test_initial_residents_are_the_least_trained_and_warmup_ramps_on_own_counter():
    assert initial_residents({0: 3, 1: 0, 2: 0, 3: 1}, 2) == [1, 2]
    assert [warmup_lr(1.0, s, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_lr(2e-3, 0, 0) == 2e-3


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=2, max_size=9), st.data())
def test_rotation_matches_its_definition(counters, data):
    steps = dict(enumerate(counters))
    k = data.draw(st.integers(1, len(steps)))
    residents = sorted(data.draw(st.permutations(list(steps)))[:k])
    frac = data.draw(st.sampled_from([0.25, 0.5, 1.0]))
    evicted, entering = rotation(residents, steps, frac)
    absent = [d for d in steps if d not in residents]
    assert len(evicted) == len(entering) == min(math.ceil(frac * len(residents)), len(absent))
    stay = [d for d in residents if d not in evicted]
    out = [d for d in absent if d not in entering]
    # most-trained out, least-trained in, ties to the lower id: compare (steps, -id) orders
    assert all((steps[e], -e) >= (steps[s], -s) for e in evicted for s in stay)
    assert all((steps[e], e) <= (steps[o], o) for e in entering for o in out)


# --- round plans ----------------------------------------------------------------------------

def test_round_plans_are_a_function_of_seed_and_round():
    cfg = FleetConfig(chunk_min=16, chunk_max=32, accum=3)
    tokens = {0: 500, 1: 900, 2: 300, 3: 700}
    a = [plan_round(r, [0, 1, 2, 3], tokens, cfg) for r in range(50)]
    b = [plan_round(r, [3, 2, 1, 0], tokens, cfg) for r in range(50)]
    assert a == b
    assert a != [plan_round(r, [0, 1, 2, 3], tokens, cfg.replace(seed=8)) for r in range(50)]
    for plan in a:
        assert plan.target in plan.parts and len(set(plan.parts)) == len(plan.parts)
        assert len(plan.chunks) == 3 and all(c.doc_id == plan.target for c in plan.chunks)
        assert all(16 <= c.end - c.start <= 32 and c.end <= tokens[plan.target] for c in plan.chunks)


def test_isolation_rate_distractor_counts_and_token_weighting():
    cfg = FleetConfig(p_iso=0.75, distract_max=3, chunk_min=16, chunk_max=16, accum=1)
    tokens = {0: 100, 1: 300, 2: 200, 3: 400}
    n = 4000
    plans = [plan_round(r, [0, 1, 2, 3], tokens, cfg) for r in range(n)]
    iso = sum(p.isolated for p in plans) / n
    assert abs(iso - 0.75) < 4 * math.sqrt(0.75 * 0.25 / n)
    assert {len(p.parts) - 1 for p in plans if not p.isolated} == {1, 2, 3}
    share = Counter(p.target for p in plans)
    for d, t in tokens.items():
        assert abs(share[d] / n - t / 1000) < 0.03
    # the target's place among co-loaded parts is shuffled too
    assert len({p.parts.index(p.target) for p in plans if len(p.parts) == 4}) == 4


# --- per-document optimizers: evict/reload, co-loaded steps, frozen sinks, gradients --------

def _examples(seed: int, n: int = 2) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, 250, (12,), generator=g).tolist()
        positions = list(range(6, 12))
        topk = [torch.randint(0, 250, (3,), generator=g).tolist() for _ in positions]
        lps = [[-0.5, -1.5, -2.5] for _ in positions]
        out.append(Example(i, ids, positions, topk, lps))
    return out


def _resident(lm, doc_id: int, lr: float = 1e-2):
    entry = DocEntry(doc_id, f"d{doc_id}.md", f"{doc_id:064x}", 100)
    return entry, new_resident(lm, entry, TEXTS[doc_id], 16, 1, lr)


def _moments(res):
    return [(s["exp_avg"].clone(), s["exp_avg_sq"].clone(), float(s["step"])) for s in res.opt.state.values()]


def test_evict_and_reload_continues_bitwise_like_staying_resident(tmp_path):
    lm = tiny_llama()
    batches = [_examples(s) for s in range(6)]
    _, stay = _resident(lm, 0)
    _, other_a = _resident(lm, 1)
    for ex in batches:
        train_group(lm.model, [stay, other_a], ex, lr=1e-2, warmup=4)
    entry, moved = _resident(lm, 0)
    _, other_b = _resident(lm, 1)
    for i, ex in enumerate(batches):
        if i == 3:  # evict to disk, drop from memory, reload into fresh leaves and a fresh Adam
            save_resident(tmp_path, lm, entry, moved)
            del moved
            moved = load_resident(tmp_path, lm, entry, lr=1e-2)
        train_group(lm.model, [moved, other_b], ex, lr=1e-2, warmup=4)
    assert stay.steps == moved.steps == 6
    for a, b in zip(stay.cart.parameters(), moved.cart.parameters(), strict=True):
        assert torch.equal(a, b)
    for (ma, va, sa), (mb, vb, sb) in zip(_moments(stay), _moments(moved), strict=True):
        assert torch.equal(ma, mb) and torch.equal(va, vb) and sa == sb == 6
    for a, b in zip(other_a.cart.parameters(), other_b.cart.parameters(), strict=True):
        assert torch.equal(a, b)


def test_every_coloaded_cartridge_steps_and_sinks_stay_frozen():
    lm = tiny_llama()
    parts = [_resident(lm, d)[1] for d in range(3)]
    before = [[t.detach().clone() for t in r.cart.parameters()] for r in parts]
    sinks = [[k.clone() for k in r.cart.frozen_keys] + [v.clone() for v in r.cart.frozen_values] for r in parts]
    _, rates = train_group(lm.model, parts, _examples(0), lr=1e-2, warmup=2)
    assert sorted(rates) == [0, 1, 2] and all(r.steps == 1 for r in parts)
    for res, old, sink in zip(parts, before, sinks, strict=True):
        assert all(not torch.equal(a, b) for a, b in zip(res.cart.parameters(), old, strict=True))
        now = list(res.cart.frozen_keys) + list(res.cart.frozen_values)
        assert all(torch.equal(a, b) for a, b in zip(now, sink, strict=True))
        assert all(not t.requires_grad for t in now)
    # frozen distractors: only the target steps, the others stay bitwise constant
    frozen = [r.cart.parameters()[0].detach().clone() for r in parts]
    _, rates = train_group(lm.model, parts, _examples(1), lr=1e-2, warmup=2, trainable={1})
    assert list(rates) == [1] and [r.steps for r in parts] == [1, 2, 1]
    assert torch.equal(parts[0].cart.parameters()[0], frozen[0])
    assert torch.equal(parts[2].cart.parameters()[0], frozen[2])
    assert not torch.equal(parts[1].cart.parameters()[0], frozen[1])


def test_gradients_reach_every_coloaded_part_as_through_one_concatenated_prefix():
    from cartridges.core.loss import student_loss
    from cartridges.core.train import group_backward, packed_batch

    lm = tiny_llama()
    parts = [_resident(lm, d)[1].cart for d in range(3)]
    examples = _examples(3)
    group_backward(lm.model, parts, examples, packed=True)
    # reference: one prefix made by hand from every part's rows, gradients sliced back out
    layers = []
    for i in range(parts[0].n_layers):
        k = torch.cat([c.detached_rows()[i][0] for c in parts], dim=1).requires_grad_(True)
        v = torch.cat([c.detached_rows()[i][1] for c in parts], dim=1).requires_grad_(True)
        layers.append((k, v))
    ids, segments, targets = packed_batch(examples, "cpu")
    total = sum(ex.n for ex in examples)
    (student_loss(lm.model, layers, ids, targets, segment_ids=segments, reduction="sum") / total).backward()
    offset = 0
    for cart in parts:
        for i in range(cart.n_layers):
            ref_k = layers[i][0].grad[:, offset + cart.frozen: offset + cart.p]
            ref_v = layers[i][1].grad[:, offset + cart.frozen: offset + cart.p]
            assert cart.train_keys[i].grad.abs().sum() > 0 and cart.train_values[i].grad.abs().sum() > 0
            torch.testing.assert_close(cart.train_keys[i].grad, ref_k, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(cart.train_values[i].grad, ref_v, rtol=1e-5, atol=1e-7)
        offset += cart.p


# --- retrieval index -----------------------------------------------------------------------

def test_centering_matches_a_direct_numpy_computation():
    rng = np.random.default_rng(0)
    raw = rng.normal(size=(7, 5)).astype(np.float32) + 3.0
    unit = raw / np.sqrt((raw ** 2).sum(1, keepdims=True))
    mean = unit.sum(0) / len(unit)
    ref = (unit - mean) / np.sqrt(((unit - mean) ** 2).sum(1, keepdims=True))
    got, centroid = center(raw)
    np.testing.assert_allclose(centroid, mean, rtol=1e-6)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose((got ** 2).sum(1), 1.0, rtol=1e-6)


def test_index_vectors_are_centered_final_norm_last_states(tmp_path):
    import faiss

    lm = tiny_llama()
    docs = [{"doc_id": i, "name": f"d{i}.md", "text": t} for i, t in enumerate(TEXTS)]
    entry = build_index(lm.model, lm.tokenizer, docs, 64, tmp_path)
    suffix = lm.tokenizer("\nIn one word, the main topic of the text above is:", add_special_tokens=False)["input_ids"]
    raw = []
    for d in docs:
        ids = lm.tokenizer(d["text"], add_special_tokens=False)["input_ids"]
        for s in range(0, len(ids), 64):
            x = torch.tensor([ids[s:s + 64] + suffix])
            out = lm.model(input_ids=x, output_hidden_states=True)
            h = out.hidden_states[-1][0, -1]
            torch.testing.assert_close(lm.model.lm_head(h), out.logits[0, -1])  # post final norm
            raw.append(h.detach().numpy())
    raw = np.stack(raw)
    unit = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    ref = unit - unit.mean(0)
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    index = faiss.read_index(str(tmp_path / entry["faiss"]))
    assert entry["n_chunks"] == index.ntotal == len(raw)
    np.testing.assert_allclose(index.reconstruct_n(0, index.ntotal), ref, rtol=1e-4, atol=1e-5)
    q = embed_text(lm.model, lm.tokenizer, "some query")
    np.testing.assert_allclose(q, embed_text(lm.model, lm.tokenizer, "some query"))


def test_a_query_equal_to_a_chunk_retrieves_that_chunks_document(tmp_path):
    from cartridges.fleet.index import Index

    lm = tiny_llama()
    docs = [{"doc_id": i, "name": f"d{i}.md", "text": t} for i, t in enumerate(TEXTS)]
    entry = build_index(lm.model, lm.tokenizer, docs, 64, tmp_path)
    index = Index.open(tmp_path, entry)
    for d in docs:
        ids = lm.tokenizer(d["text"], add_special_tokens=False)["input_ids"]
        query = lm.tokenizer.decode(ids[64:128])
        found = index.search(embed_text(lm.model, lm.tokenizer, query), k_docs=3, k_chunks=8)
        assert found[0][0] == d["name"] and found[0][1] == pytest.approx(1.0, abs=1e-4)
        assert [s for _, s in found] == sorted((s for _, s in found), reverse=True)
        assert len({n for n, _ in found}) == len(found)


@pytest.mark.slow
def test_default_model_retrieves_each_questions_own_document(default_lm, tmp_path):
    from cartridges.fleet.index import Index

    docs = [
        {"doc_id": 0, "name": "bread.md", "text": (
            "Baking bread starts with flour, water, salt and yeast. The dough is kneaded until it is smooth "
            "and elastic, then left to rise in a warm place for an hour. Sourdough uses a starter culture of "
            "wild yeast instead of commercial yeast. The loaf is shaped, proofed again and baked in a hot oven "
            "until the crust is brown and the bottom sounds hollow when tapped.") * 2},
        {"doc_id": 1, "name": "orbits.md", "text": (
            "A satellite stays in orbit because its forward speed balances the pull of gravity. Low Earth "
            "orbit lies a few hundred kilometres up, where a spacecraft circles the planet in about ninety "
            "minutes. Geostationary satellites orbit at 35,786 kilometres and match the rotation of the Earth. "
            "Rockets change orbits with engine burns called manoeuvres, such as the Hohmann transfer.") * 2},
        {"doc_id": 2, "name": "castles.md", "text": (
            "Medieval castles were built by lords to defend their land. Stone walls, towers and a keep "
            "protected the people inside, and a moat filled with water surrounded many castles. The "
            "drawbridge could be raised during a siege. Knights and soldiers guarded the battlements, while "
            "the great hall was used for feasts and for the lord's court.") * 2},
    ]
    entry = build_index(default_lm.model, default_lm.tokenizer, docs, 64, tmp_path)
    index = Index.open(tmp_path, entry)
    questions = {
        "bread.md": "How long should the dough rise before baking the loaf?",
        "orbits.md": "At what altitude do geostationary satellites orbit the Earth?",
        "castles.md": "Why did medieval castles have a moat and a drawbridge?",
    }
    for name, question in questions.items():
        found = index.search(embed_text(default_lm.model, default_lm.tokenizer, question), 3, 8)
        assert found[0][0] == name, (question, found)


def test_bm25_scores_equal_the_okapi_formula_by_hand():
    import math

    from cartridges.core.similarity import BM25

    bm = BM25.build(["raft leader election leader", "deflate huffman blocks", "the leader of the band"])
    # lengths after stopwords: 4, 3, 2 (avg 3); "leader" in chunks 0 (tf 2) and 2 (tf 1): df 2 of 3
    idf = math.log(1 + (3 - 2 + 0.5) / (2 + 0.5))
    avg = 3

    def term(tf, length):
        return idf * tf * 2.2 / (tf + 1.2 * (0.25 + 0.75 * length / avg))

    np.testing.assert_allclose(bm.scores("Who is the leader?"), [term(2, 4), 0.0, term(1, 2)])
    assert not bm.scores("zebra").any()


def test_lexical_score_lifts_the_document_that_shares_the_querys_words(tmp_path):
    from cartridges.fleet.index import LEXICAL_WEIGHT, Index

    lm = tiny_llama()
    docs = [{"doc_id": i, "name": f"d{i}.md", "text": t} for i, t in enumerate(TEXTS)]
    entry = build_index(lm.model, lm.tokenizer, docs, 64, tmp_path)
    index = Index.open(tmp_path, entry)
    query = "orchards"  # a word of d0's text only
    vector = embed_text(lm.model, lm.tokenizer, query)
    dense = dict(index.search(vector, k_docs=3, k_chunks=100))
    hybrid = dict(index.search(vector, k_docs=3, k_chunks=100, query=query))
    assert next(iter(hybrid)) == "d0.md"
    # its best chunk holds the word, so it gains at most the full weight and more than nothing
    assert dense["d0.md"] < hybrid["d0.md"] <= dense["d0.md"] + LEXICAL_WEIGHT + 1e-6
    for name in ("d1.md", "d2.md"):
        assert hybrid[name] == pytest.approx(dense[name], abs=1e-6)
