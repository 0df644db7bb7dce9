"""Quiet by default (issue 50, finding 9): DeepSpeed's log lines below a warning, its note that a
CPU machine runs on the CPU and its zero-to-fp32 converter's prints stay off stdout unless
``--verbose`` / MPP_VERBOSE=1 asks for them."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys

from conftest import cli_env

from mpp.quiet import VERBOSE, add_verbose_argument, hush_deepspeed_log, hushed_prints


def test_deepspeeds_chatter_is_dropped_and_its_warnings_kept_unless_verbose(monkeypatch, capsys):
    monkeypatch.setenv(VERBOSE, "0")
    hush_deepspeed_log()
    hush_deepspeed_log()  # once, however often installed
    logger = logging.getLogger("DeepSpeed")
    assert len(logger.filters) == len(set(map(id, logger.filters)))
    handler = logging.StreamHandler(sys.stdout)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)  # as a config's deepspeed.log_level "info" sets it
    try:
        logger.info("DeepSpeed info: version=0.19.8")
        logger.warning("Setting accelerator to CPU. If you have GPU or other accelerator, ...")
        logger.warning("a warning that matters")
        assert capsys.readouterr().out == "a warning that matters\n"
        monkeypatch.setenv(VERBOSE, "1")
        logger.info("DeepSpeed info: version=0.19.8")
        assert capsys.readouterr().out == "DeepSpeed info: version=0.19.8\n"
    finally:
        logger.setLevel(level)
        logger.removeHandler(handler)


def test_a_librarys_prints_are_dropped_unless_verbose(monkeypatch, capsys):
    monkeypatch.setenv(VERBOSE, "0")  # and restored after, whatever --verbose sets below
    with hushed_prints():
        print("Processing zero checkpoint 'runs/x/checkpoints/step00000003'")
    print("ours")
    assert capsys.readouterr().out == "ours\n"
    p = argparse.ArgumentParser()
    add_verbose_argument(p)
    assert p.parse_args([]).verbose is False
    assert p.parse_args(["--verbose"]).verbose is True  # and sets MPP_VERBOSE for the ranks
    with hushed_prints():
        print("Processing zero checkpoint")
    assert capsys.readouterr().out == "Processing zero checkpoint\n"


def test_importing_mpp_then_deepspeed_on_a_cpu_prints_nothing():
    """Before: '[WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.
    ...' on stdout in every process (each rank, each command) of a machine without a GPU."""
    code = "import torch, mpp, deepspeed; print('gpu' if torch.cuda.is_available() else '')"
    env = cli_env({VERBOSE: ""})
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    if r.stdout.strip() != "gpu":
        assert r.stdout == "\n", r.stdout
