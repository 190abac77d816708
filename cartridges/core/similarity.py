"""Text similarity shared by the fleet's index and retrieval arms: the model's own embedding and BM25.

The embedding of a text is the final-norm hidden state of the last token after the text
and a one-line topic instruction, L2-normalized; a set of chunk embeddings is centered
by its centroid (applied to queries too) and renormalized. BM25 scores a query's words
against each chunk's (stopwords dropped).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from cartridges.core.models import backbone

WORD = re.compile(r"[a-z0-9]+")
STOPWORDS = frozenset(
    "a an and are as at be by do does for from how in is it of on or that the this to what which with".split())
SUFFIX = "\nIn one word, the main topic of the text above is:"


@torch.no_grad()
def embed_ids(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """Final-norm hidden state of the last token of `ids` (float32, not normalized)."""
    device = next(model.parameters()).device
    hidden = backbone(model)(input_ids=torch.tensor([ids], device=device), use_cache=False).last_hidden_state
    return hidden[0, -1].float().cpu().numpy()


def suffix_ids(tokenizer) -> list[int]:
    return list(tokenizer(SUFFIX, add_special_tokens=False)["input_ids"])


def embed_text(model: torch.nn.Module, tokenizer, text: str) -> np.ndarray:
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + suffix_ids(tokenizer)
    return embed_ids(model, ids)


def l2(x: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.maximum(norm, 1e-12)


def center(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(centered unit rows, centroid) of raw chunk embeddings `[N, D]`."""
    unit = l2(raw.astype(np.float32))
    centroid = unit.mean(axis=0)
    return l2(unit - centroid).astype(np.float32), centroid.astype(np.float32)


def apply_centroid(raw: np.ndarray, centroid: np.ndarray) -> np.ndarray:
    return l2(l2(raw.astype(np.float32)) - centroid).astype(np.float32)


def words(text: str) -> list[str]:
    return [w for w in WORD.findall(text.lower()) if w not in STOPWORDS]


@dataclass
class BM25:
    """Okapi BM25 over the index's chunk texts (k1 1.2, b 0.75)."""

    chunks: list[Counter]
    lengths: np.ndarray
    df: Counter

    @classmethod
    def build(cls, texts: list[str]) -> BM25:
        chunks = [Counter(words(t)) for t in texts]
        return cls(chunks, np.array([sum(c.values()) for c in chunks], dtype=np.float64),
                   Counter(w for c in chunks for w in c))

    def scores(self, query: str, k1: float = 1.2, b: float = 0.75) -> np.ndarray:
        n = len(self.chunks)
        norm = k1 * (1 - b + b * self.lengths / max(self.lengths.mean(), 1e-9))
        out = np.zeros(n)
        for w in set(words(query)):
            if not self.df[w]:
                continue
            idf = math.log(1 + (n - self.df[w] + 0.5) / (self.df[w] + 0.5))
            tf = np.array([c[w] for c in self.chunks], dtype=np.float64)
            out += idf * tf * (k1 + 1) / (tf + norm)
        return out
