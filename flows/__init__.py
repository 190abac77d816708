"""Prefect flows: thin orchestration over the plain stage functions."""
