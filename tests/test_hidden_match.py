"""The hidden-state matching experiment: the student's layers behind rows against the teacher's."""

from __future__ import annotations

import torch

from cartridges.core.prefix import capture_rows
from experiments.hidden_match import hidden_states, relative_error
from tests.tiny import tiny_llama


def test_rows_of_the_head_itself_reproduce_the_teachers_layers_exactly():
    lm = tiny_llama(torch.float64, layers=3)
    gen = torch.Generator().manual_seed(0)
    head = torch.randint(0, 256, (9,), generator=gen).tolist()
    conversation = torch.randint(0, 256, (6,), generator=gen).tolist()
    with torch.no_grad():
        _, teacher = hidden_states(lm, head + conversation)  # reference: one plain forward over both
        own = capture_rows(lm.model, torch.tensor(head))
        _, student = hidden_states(lm, conversation, own)
        other = capture_rows(lm.model, torch.tensor(head[::-1]))
        _, elsewhere = hidden_states(lm, conversation, other)
    assert len(student) == len(teacher) == 3 + 1  # embeddings and each layer's output
    for mine, theirs in zip(student, teacher, strict=True):
        assert torch.allclose(mine, theirs[len(head):], atol=1e-10)
    assert float(relative_error(student, teacher, len(head))) < 1e-20
    assert float(relative_error(elsewhere, teacher, len(head))) > 1e-4


def test_the_error_is_the_mean_relative_squared_distance_over_the_inner_layers():
    teacher = tuple(torch.full((5, 2), float(i + 1)) for i in range(4))
    student = tuple(t[2:] * 1.5 for t in teacher)  # 0.25 relative squared error on every layer
    student = (student[0] * 0, student[1], student[2], student[3] * 9)  # the outer two are left out
    assert torch.isclose(relative_error(student, teacher, 2), torch.tensor(0.25))
