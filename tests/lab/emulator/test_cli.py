"""Command-line options: `fair-sched emulate` and `python -m fair_sched_plugin.lab.emulator`."""

from __future__ import annotations

import argparse

from fair_sched_plugin.lab.emulator import EmulatorConfig, FaultSwitches, add_emulate_parser
from fair_sched_plugin.lab.emulator.server import config_from_args, config_to_argv


def _emulate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fair-sched")
    add_emulate_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_emulate_subcommand_builds_the_config() -> None:
    argv = "emulate --port 0 --model tiny --max-num-seqs 4 --policy priority --step-ms 2.5"
    args = _emulate_parser().parse_args([*argv.split(), "--metrics-mode", "garbage"])
    config = config_from_args(args)
    assert args.port == 0
    assert callable(args.handler)
    assert config.models == ("tiny",)
    assert config.max_num_seqs == 4
    assert config.policy == "priority"
    assert config.base_step_ms == 2.5
    assert config.faults.metrics_mode == "garbage"


def test_config_survives_the_trip_through_argv() -> None:
    config = EmulatorConfig(
        models=("a", "b"),
        max_num_seqs=3,
        policy="priority",
        base_step_ms=1.5,
        step_ms_per_running_seq=0.25,
        prefill_ms_per_token=0.01,
        kv_capacity_tokens=999,
        metrics_profile="sglang",
        success_counter=False,
        default_max_tokens=7,
        max_new_tokens=5,
        speed=0.33,
        prefix_cache_blocks=100,
        block_tokens=32,
        faults=FaultSwitches(
            0.5,
            "missing",
            4,
            0.25,
            slow=2.0,
            metrics_filter=False,
            fail_prompt="p1",
            drop_prompt="p2",
        ),
    )
    args = _emulate_parser().parse_args(["emulate", *config_to_argv(config)])
    assert config_from_args(args) == config


def test_no_success_counter_switches_the_counter_off() -> None:
    args = _emulate_parser().parse_args(["emulate", "--no-success-counter"])
    assert config_from_args(args).success_counter is False
    assert config_from_args(_emulate_parser().parse_args(["emulate"])).success_counter is True
