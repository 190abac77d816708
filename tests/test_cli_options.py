"""The config flags of `train`, `stage` and `fleet` come from the config dataclasses: each option
field is a flag with its default and help, flags left out leave the preset alone, and the flags
users have always typed keep their meaning."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from cli.fleet import fleet_config
from cli.main import build_parser, main, pipeline_config
from schemas.configs import ConfigError, FleetConfig, PipelineConfig
from schemas.presets import FLEET_PRESETS, PRESETS, fleet_preset, preset

# Every config flag of `train` before the flags were read off the configs, and what it set: the
# reference the generated flags are held to (`--resume` was parsed and never read; it is gone).
PIPELINE_FLAGS: list[tuple[list[str], dict]] = [
    (["--conversations", "12"], {"chunks": {"conversations": 12}}),
    (["--heldout", "3"], {"chunks": {"heldout": 3}}),
    (["--chunk-min", "40"], {"chunks": {"chunk_min": 40}}),
    (["--chunk-max", "80"], {"chunks": {"chunk_max": 80}}),
    (["--per-chunk", "2"], {"chunks": {"per_chunk": 2}}),
    (["--seed-types", "question, fact_number"], {"chunks": {"seed_types": ("question", "fact_number")}}),
    (["--heldout-region", "tail"], {"chunks": {"heldout_region": "tail"}}),
    (["--max-q", "10"], {"synth": {"max_q": 10}}),
    (["--max-a", "20"], {"synth": {"max_a": 20}}),
    (["--temperature-a", "0.7"], {"synth": {"temperature_a": 0.7}}),
    (["--gen-batch", "3"], {"synth": {"gen_batch": 3}}),
    (["--keep-topk", "5"], {"synth": {"keep_topk": 5}}),
    (["--spec-b", "2"], {"synth": {"spec_b": 2}}),
    (["--teacher-context", "document"], {"synth": {"teacher_context": "document"}}),
    (["--turns", "2"], {"synth": {"turns": 2}}),
    (["--top-k", "5"], {"teacher": {"top_k": 5}}),
    (["--top-mass", "0.9"], {"teacher": {"top_mass": 0.9}}),
    (["--p", "32"], {"train": {"p": 32}}),
    (["--frozen", "3"], {"train": {"frozen": 3}}),
    (["--lr", "0.01"], {"train": {"lr": 0.01}}),
    (["--accum", "3"], {"train": {"accum": 3}}),
    (["--epochs", "3"], {"train": {"epochs": 3}}),
    (["--schedule", "cosine"], {"train": {"schedule": "cosine"}}),
    (["--warmup", "0.1"], {"train": {"warmup": 0.1}}),
    (["--average", "0.5"], {"train": {"average": 0.5}}),
    (["--init", "random"], {"train": {"init": "random"}}),
    (["--save-every", "5"], {"train": {"save_every": 5}}),
    (["--min-heldout-drop", "0.02"], {"health": {"min_heldout_drop": 0.02}}),
    (["--seed", "3"], {"chunks": {"seed": 3}, "synth": {"seed": 3}, "train": {"seed": 3}}),
    (["--no-filter"], {"synth": {"filter": False}}),
    (["--no-stop-at-question"], {"synth": {"stop_at_question": False}}),
    (["--focus"], {"synth": {"focus": True}}),
    (["--no-focus"], {"synth": {"focus": False}}),
    (["--no-pack"], {"train": {"pack": False}}),
    (["--checkpoint"], {"train": {"checkpoint": True}}),
    (["--draft-ref"], {"train": {"draft_ref": True}}),
]
FLEET_FLAGS: list[tuple[list[str], dict]] = [
    (["--budget", "3"], {"budget": 3}), (["--rotate-every", "3"], {"rotate_every": 3}),
    (["--evict-frac", "0.25"], {"evict_frac": 0.25}), (["--warmup", "3"], {"warmup": 3}),
    (["--p-iso", "1.0"], {"p_iso": 1.0}), (["--distract-max", "2"], {"distract_max": 2}),
    (["--rounds", "0"], {"rounds": 0}), (["--accum", "3"], {"accum": 3}), (["--lr", "0.01"], {"lr": 0.01}),
    (["--embed-chunk", "32"], {"embed_chunk": 32}), (["--rag-docs", "1"], {"rag_docs": 1}),
    (["--rag-chunks", "4"], {"rag_chunks": 4}), (["--p", "32"], {"p": 32}), (["--frozen", "2"], {"frozen": 2}),
    (["--chunk-min", "40"], {"chunk_min": 40}), (["--chunk-max", "80"], {"chunk_max": 80}),
    (["--heldout", "2"], {"heldout": 2}), (["--seed", "3"], {"seed": 3}),
    (["--max-q", "10"], {"synth": {"max_q": 10}}), (["--max-a", "20"], {"synth": {"max_a": 20}}),
    (["--gen-batch", "3"], {"synth": {"gen_batch": 3}}), (["--temperature-a", "0.7"], {"synth": {"temperature_a": 0.7}}),
    (["--top-k", "5"], {"teacher": {"top_k": 5}}), (["--top-mass", "0.9"], {"teacher": {"top_mass": 0.9}}),
    (["--distractors", "frozen"], {"distractors": "frozen"}), (["--targets", "balanced"], {"targets": "balanced"}),
    (["--no-filter"], {"synth": {"filter": False}}), (["--no-pack"], {"pack": False}),
]
# Switches only the quality studies turn (experiments/LAB.md, experiments/fleet_quality.py):
# they parse, and stay out of --help.
HIDDEN = {"train": {"--heldout-region", "--stop-at-question", "--no-stop-at-question", "--focus", "--no-focus",
                    "--teacher-context", "--schedule", "--warmup", "--turns", "--average"},
          "fleet": {"--distractors"}}

PARSER = build_parser()
SUB = next(a for a in PARSER._actions if isinstance(a, argparse._SubParsersAction)).choices


def train(*flags: str) -> argparse.Namespace:
    return PARSER.parse_args(["train", "--corpus", "x.md", *flags])


def fleet(*flags: str) -> argparse.Namespace:
    return PARSER.parse_args(["fleet", "--docs", "x.md", "--fleet", "f", *flags])


def option_fields(config: type, only: tuple[str, ...] | None = None) -> list[tuple[str, dataclasses.Field]]:
    """(flag, field) for each field a config marks as a command-line option, sections included."""
    out = []
    for f in dataclasses.fields(config):
        if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            out += option_fields(f.default_factory, f.metadata.get("options"))
        elif "help" in f.metadata and (only is None or f.name in only):
            out.append((f.metadata["flag"] or "--" + f.name.replace("_", "-"), f))
    return out


def action(command: str, flag: str) -> argparse.Action:
    return next(a for a in SUB[command]._actions if flag in a.option_strings)


@pytest.mark.parametrize(("command", "config"), [("train", PipelineConfig), ("stage", PipelineConfig),
                                                 ("fleet", FleetConfig)])
def test_every_option_field_is_a_flag_with_its_default_and_help(command, config):
    fields = option_fields(config)
    assert len(fields) >= 20
    for flag, f in fields:
        help_text = action(command, flag).help
        if f.metadata["ablation"]:
            assert help_text == argparse.SUPPRESS, flag
            continue
        assert f.metadata["help"] in help_text, flag
        if f.default is not None:
            shown = (("on" if f.default else "off") if isinstance(f.default, bool) else
                     ",".join(f.default) if isinstance(f.default, tuple) else str(f.default))
            assert help_text.endswith(f"(default: {shown})"), (flag, help_text)


@pytest.mark.parametrize(("command", "reference"), [("train", PIPELINE_FLAGS), ("fleet", FLEET_FLAGS)])
def test_every_flag_users_had_is_still_there(command, reference):
    options = {s for a in SUB[command]._actions for s in a.option_strings}
    assert {argv[0] for argv, _ in reference} <= options


@pytest.mark.parametrize("name", PRESETS)
def test_no_flags_give_exactly_the_preset(name):
    assert pipeline_config(train("--preset", name)) == preset(name)


@pytest.mark.parametrize("name", FLEET_PRESETS)
def test_no_flags_give_exactly_the_fleet_preset(name):
    assert fleet_config(fleet("--preset", name)) == fleet_preset(name)


@pytest.mark.parametrize(("argv", "overrides"), PIPELINE_FLAGS, ids=lambda x: " ".join(x) if isinstance(x, list) else "")
def test_a_given_flag_overrides_only_its_fields_of_the_preset(argv, overrides):
    assert pipeline_config(train("--preset", "smoke", *argv)) == preset("smoke", overrides)


@pytest.mark.parametrize(("argv", "overrides"), FLEET_FLAGS, ids=lambda x: " ".join(x) if isinstance(x, list) else "")
def test_a_given_fleet_flag_overrides_only_its_fields_of_the_preset(argv, overrides):
    assert fleet_config(fleet("--preset", "smoke", *argv)) == fleet_preset("smoke", overrides)


def test_flags_merge_into_a_preset_section_without_dropping_its_other_values():
    cfg = pipeline_config(train("--preset", "demo", "--lr", "0.03"))
    assert cfg.train.lr == 0.03
    assert (cfg.train.p, cfg.train.init) == (128, "corpus")  # the demo preset's, kept
    assert cfg.chunks == preset("demo").chunks


def test_seed_sets_the_chunk_plan_sampling_and_training_seeds_together():
    cfg = pipeline_config(train("--seed", "11"))
    assert (cfg.chunks.seed, cfg.synth.seed, cfg.train.seed) == (11, 11, 11)
    assert fleet_config(fleet("--seed", "11")).synth.seed == FleetConfig().synth.seed  # the fleet's is its own


def test_booleans_take_x_and_no_x_and_leave_the_preset_alone_without_either():
    # the fleet smoke preset turns the filter off; a flag can turn it back on
    assert fleet_config(fleet("--preset", "smoke")).synth.filter is False
    assert fleet_config(fleet("--preset", "smoke", "--filter")).synth.filter is True
    assert fleet_config(fleet("--preset", "smoke", "--no-filter")).synth.filter is False
    for argv, field in (([], None), (["--checkpoint"], True), (["--no-checkpoint"], False)):
        assert pipeline_config(train(*argv)).train.checkpoint is (False if field is None else field)
    for command in ("train", "fleet"):
        bools = [a for a in SUB[command]._actions if isinstance(a, argparse.BooleanOptionalAction)]
        assert bools
        for a in bools:
            assert len(a.option_strings) == 2 and a.option_strings[1] == "--no-" + a.option_strings[0][2:]


def test_a_bad_value_is_refused_naming_the_flag_and_the_field():
    with pytest.raises(ConfigError, match=r"^--top-mass 1.5: .*TeacherConfig\.top_mass: must be in \(0, 1\]"):
        pipeline_config(train("--top-mass", "1.5"))
    with pytest.raises(ConfigError, match=r"^--p-iso 2.0: .*FleetConfig\.p_iso"):
        fleet_config(fleet("--p-iso", "2"))
    # a value valid alone but not beside the preset's other values names the field it breaks
    with pytest.raises(ConfigError, match=r"ChunkConfig\.chunk_max: must be >= chunk_min \(600\)"):
        pipeline_config(train("--chunk-min", "600"))


def test_a_bad_value_is_one_error_line_at_the_command_line(capsys, tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("Some text.\n")
    assert main(["train", "--corpus", str(doc), "--store", str(tmp_path / "s"), "--top-mass", "1.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --top-mass 1.5: ") and "\n" not in err
    with pytest.raises(SystemExit):
        train("--p", "many")
    assert "argument --p: invalid int value: 'many'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "stage", "fleet"])
def test_ablation_switches_parse_but_stay_out_of_help(command):
    hidden = HIDDEN["fleet" if command == "fleet" else "train"]
    text = SUB[command].format_help()
    for flag in hidden:
        assert f"{flag} " not in text and f"{flag}," not in text and f"{flag}\n" not in text, flag
    marked = {flag for flag, f in option_fields(FleetConfig if command == "fleet" else PipelineConfig)
              if f.metadata["ablation"]}
    assert {f for f in hidden if not f.startswith("--no-")} == marked


def test_ablation_switches_stay_settable_by_flag_and_by_config():
    assert pipeline_config(train("--no-focus")).synth.focus is False
    assert pipeline_config(train("--schedule", "cosine", "--warmup", "0.05")).train.schedule == "cosine"
    assert pipeline_config(train("--average", "0.5")).train.average == 0.5
    assert preset("default", {"synth": {"focus": False, "teacher_context": "document"}}).synth.teacher_context == "document"
    assert PipelineConfig.from_dict({"chunks": {"heldout_region": "tail"}}).chunks.heldout_region == "tail"
    assert fleet_preset("default", {"distractors": "frozen"}).distractors == "frozen"
    assert fleet_config(fleet("--distractors", "frozen")).distractors == "frozen"


def test_train_resume_is_gone_and_fleet_resume_stays(capsys):
    with pytest.raises(SystemExit):
        train("--resume")
    assert "unrecognized arguments: --resume" in capsys.readouterr().err
    assert fleet("--resume").resume is True
