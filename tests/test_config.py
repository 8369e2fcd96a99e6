"""Settings: flags over the environment over defaults, their problems, the sandbox's."""

from __future__ import annotations

import argparse

from kerneleval_server import config as config_mod


def test_config_flags_over_env_over_defaults() -> None:
    parser = argparse.ArgumentParser()
    config_mod.add_arguments(parser)
    env = {
        "KERNELEVAL_PORT": "6000",
        "KERNELEVAL_WARM_SPARE": "false",
        "KERNELEVAL_HOST": "0.0.0.0",
    }
    cfg = config_mod.from_args(parser.parse_args(["--port", "7000"]), env)
    assert cfg.port == 7000 and cfg.warm_spare is False and cfg.host == "0.0.0.0"
    assert cfg.workers_per_device == 1 and cfg.database_path().name == "jobs.db"
    cfg = config_mod.from_args(parser.parse_args([]), {"XDG_STATE_HOME": "/x"})
    assert cfg.port == 50051 and cfg.host == "127.0.0.1"
    assert cfg.device_list() == [] and cfg.effective_xid_wait_s() == 2.5


def test_config_problems_are_reported() -> None:
    assert config_mod.Config().problems() == []
    bad = config_mod.Config(
        nvml="fake", tls_cert="c", port=70000, workers_per_device=0, devices="a",
        isolate_network=False, compile_cache_mib=-1, build_nice=20, reference_time_reuse_s=-1,
    )  # fmt: skip
    text = " ".join(bad.problems())
    for flag in (
        "--fake-nvml-path", "--tls-key", "--port", "--workers-per-device", "--devices",
        "--isolate-network false", "--compile-cache-mib", "--build-nice",
        "--reference-time-reuse-s",
    ):  # fmt: skip
        assert flag in text


def test_job_sandbox_flags() -> None:
    parser = argparse.ArgumentParser()
    config_mod.add_arguments(parser)
    ns = parser.parse_args(
        ["--worker-user", "alice", "--sandbox-path", "/a,/b", "--sandbox-path", "/c"]
    )
    cfg = config_mod.from_args(ns, {})
    assert cfg.job_user == "alice"  # --worker-user is the old spelling of --job-user
    assert cfg.sandbox_paths() == ["/a", "/b", "/c"]
    cfg = config_mod.from_args(parser.parse_args([]), {"KERNELEVAL_WORKER_USER": "bob"})
    assert cfg.job_user == "bob" and cfg.spare_count == 3 and cfg.job_memory_mib == 0  # auto
    bad = config_mod.Config(job_user="root", sandbox_path="rel", job_max_pids=0).problems()
    text = " ".join(bad)
    assert "--job-user" in text and "--sandbox-path" in text and "--job-max-pids" in text
