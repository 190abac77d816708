"""The stage graph is declared once, and what reads it agrees with it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from schemas import PipelineConfig
from stages.graph import CARTRIDGE, NAMES, mermaid

REPO = Path(__file__).resolve().parent.parent


def test_every_stage_reads_only_stages_before_it_and_a_real_config_section():
    sections = {f.name for f in dataclasses.fields(PipelineConfig)}
    for i, stage in enumerate(CARTRIDGE):
        assert set(stage.inputs) <= set(NAMES[:i]), stage.name
        assert stage.config is None or stage.config in sections, stage.name
        assert stage.run.__module__ == stage.module and stage.module.endswith(stage.name)


def test_each_stage_module_names_its_catalog_stage_as_the_graph_does():
    import importlib

    for stage in CARTRIDGE:
        assert importlib.import_module(stage.module).NAME == stage.name


def test_the_design_doc_draws_the_graph_in_the_table():
    text = (REPO / "docs" / "DESIGN.md").read_text()
    drawn = re.search(r"<!-- stage-graph -->\n```mermaid\n(.*?)\n```\n<!-- /stage-graph -->", text, re.S)
    assert drawn and drawn.group(1) == mermaid(), "regenerate with `python -m stages.graph`"


def test_the_flow_file_shows_the_chain_it_walks():
    flow = (REPO / "flows" / "cartridge.py").read_text()
    assert " -> ".join(NAMES) in flow and "for stage in CARTRIDGE" in flow


def test_cli_stage_and_force_offer_exactly_the_graphs_stages():
    from cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    stage_names = next(a for a in sub.choices["stage"]._actions if a.dest == "name").choices
    force = next(a for a in sub.choices["train"]._actions if a.dest == "force").choices
    assert tuple(stage_names) == tuple(force) == NAMES


def test_the_fleet_flow_shows_the_steps_it_walks():
    from jobs.fleet import STEPS, FleetRun

    flow = (REPO / "flows" / "fleet.py").read_text()
    assert " -> ".join(STEPS) in flow and "for step in STEPS" in flow
    assert all(callable(getattr(FleetRun, step)) for step in STEPS)
