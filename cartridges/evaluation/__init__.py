"""Evaluation: answering questions with different things in front of the model, and scoring.

It owns question files (`qa`), the arms that answer them (`evaluate`, `ask`), the scores
and their intervals (`scoring`), and the equivalence gate that checks an untrained
cartridge against a real prefill (`equiv`).
"""
