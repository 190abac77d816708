"""Batch stages: plain functions from input artifacts and a config to an artifact.

Each stage module has ``NAME`` (the stage, and the catalog's stage column),
``VERSION`` (its code version, part of the fingerprint), a pure helper that does
the work without a store, and ``run(store, ...)`` that hands the work to
``Store.run`` so it is skipped when the fingerprint already has a complete
artifact. Input validation happens before ``Store.run``, so bad input leaves no
artifact behind. Nothing here knows about Prefect.
"""
