"""The benchmark runner's pure parts: system specs, command lines, budget arithmetic, the interleaving
schedule, status parsing, goal checks, and process cleanup (a real child process, no server)."""
from __future__ import annotations

import json
import sys
import time
from collections import Counter

import pytest
import torch
from safetensors.torch import save_file

from ops.bench import BenchmarkInputError
from ops.bench.bench_settings import APP_DEFAULT, BenchConfig, workload_spec
from ops.bench.goals import goal_lines
from ops.bench.served_quality import parse_label
from ops.bench.metrics import spread
from ops.bench.run_all import bench_config, parse_args
from ops.bench.process_cpu import CpuAccount, role_of
from ops.bench.server_process import ServerProcess, ServerStartError, free_port, session_pids
from ops.bench.systems import (ALL_SYSTEMS, FLEET_BASELINE, FLEET_PRESSURE, MIB, QUICK_SYSTEMS, STATIC_FP, STATIC_INT4,
                               VLLM, ModelFacts, fleet_note, fleet_switches_available, fleet_systems,
                               interleaved_schedule, morphserve_app_args, morphserve_command, morphserve_labels,
                               morphserve_status,
                               fleet_budget_layers, plan_budget, serve_config, system_specs, vllm_command, vllm_env, vllm_kv_tokens,
                               vllm_status_parser)


@pytest.fixture()
def facts(tmp_path) -> ModelFacts:
    cfg = {"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 256,
           "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"embed": torch.zeros(256, 64, dtype=torch.bfloat16), "w": torch.zeros(10, 7)},
              str(tmp_path / "model.safetensors"))
    return ModelFacts.from_hf_dir(tmp_path)


def test_model_facts_read_from_headers(facts):
    assert facts.num_params == 256 * 64 + 70
    assert facts.head_dim == 16 and facts.num_kv_heads == 2
    assert facts.kv_bytes_per_token() == 4 * 2 * 2 * 16 * 2  # layers x (k|v) x heads x dim x bf16


def test_model_facts_reject_a_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(BenchmarkInputError, match="safetensors"):
        ModelFacts.from_hf_dir(tmp_path)


def test_budget_adds_up_and_rounds_to_mib(facts):
    plan = plan_budget(facts, max_model_len=64, kv_sequences=2, block_size=16, max_num_batched_tokens=32)
    assert plan.budget_bytes % MIB == 0
    assert plan.weight_bytes + plan.reserve_bytes + plan.kv_bytes == plan.budget_bytes
    assert plan.reserve_bytes == 32 * (64 + 128 + 256) * 2
    assert plan.kv_tokens >= 2 * 64  # at least the asked sequences; rounding only adds KV
    assert plan.kv_tokens % 16 == 0


def test_budget_rejects_nonsense(facts):
    with pytest.raises(BenchmarkInputError, match="kv_sequences"):
        plan_budget(facts, max_model_len=64, kv_sequences=0)
    with pytest.raises(BenchmarkInputError, match="dtype"):
        plan_budget(facts, max_model_len=64, kv_sequences=2, dtype="fp8")


def test_an_fp32_budget_counts_four_bytes_everywhere_and_serves_fp32(facts):
    bf16 = plan_budget(facts, max_model_len=64, kv_sequences=2, block_size=16, max_num_batched_tokens=32)
    fp32 = plan_budget(facts, max_model_len=64, kv_sequences=2, block_size=16, max_num_batched_tokens=32, dtype="fp32")
    assert fp32.weight_bytes == 2 * bf16.weight_bytes and fp32.reserve_bytes == 2 * bf16.reserve_bytes
    assert fp32.kv_bytes_per_token == 2 * bf16.kv_bytes_per_token and fp32.kv_tokens >= 2 * 64
    assert "fp32 weights" in fp32.describe() and "x 4 B" in fp32.describe()
    assert morphserve_app_args(system_specs([STATIC_FP], 4)[0], fp32, "/m", "t")["dtype"] == "fp32"
    assert bench_config(parse_args(["--dtype", "fp32"])).dtype == "fp32"
    assert bench_config(parse_args(["--dtype", "auto"])).dtype in ("bf16", "fp32")
    assert bench_config(parse_args([])).dtype == "bf16"  # vLLM's default, so the KV bytes compare


def test_specs_in_the_given_order_with_their_settings():
    specs = system_specs([VLLM, STATIC_INT4, STATIC_FP, "morphserve-accuracy"], num_layers=30)
    assert [s.name for s in specs] == [VLLM, STATIC_INT4, STATIC_FP, "morphserve-accuracy"]
    assert specs[1].admin_updates() == ({"quantized_layers": 30, "precision": "int4"},)
    assert specs[2].enable_morphing is False and specs[2].admin_updates() == ()
    assert specs[3].mode == "accuracy" and specs[3].enable_morphing


@pytest.mark.parametrize("names", [["nope"], [], [STATIC_FP, STATIC_FP]])
def test_specs_reject_unknown_empty_or_repeated(names):
    with pytest.raises(BenchmarkInputError):
        system_specs(names, num_layers=4)


def test_schedule_rotates_so_every_system_takes_every_position():
    systems = ("a", "b", "c")
    schedule = interleaved_schedule(systems, repeats=3)
    assert len(schedule) == 9
    rounds = [[s for r, s in schedule if r == k] for k in range(3)]
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    positions = Counter((i, s) for rnd in rounds for i, s in enumerate(rnd))
    assert all(positions[(i, s)] == 1 for i in range(3) for s in systems)
    with pytest.raises(BenchmarkInputError):
        interleaved_schedule(systems, repeats=0)


def test_morphserve_args_and_config(facts):
    plan = plan_budget(facts, max_model_len=64, kv_sequences=2)
    fp, int4, bal = system_specs([STATIC_FP, STATIC_INT4, "morphserve-balanced"], facts.num_layers)
    args = morphserve_app_args(fp, plan, "/m", "secret")
    assert args["memory_budget"] == plan.budget_bytes and args["dtype"] == "bf16" and args["num_replicas"] == 1
    assert args["engine"]["enable_morphing"] is False and args["engine"]["max_model_len"] == 64
    assert morphserve_app_args(bal, plan, "/m", "t")["mode"] == "balanced"
    assert morphserve_app_args(int4, plan, "/m", "t")["engine"]["enable_morphing"] is True
    cfg = serve_config(args, 8123)
    assert cfg["http_options"] == {"host": "127.0.0.1", "port": 8123}
    assert cfg["applications"][0]["import_path"] == "deployments:build_app"
    assert morphserve_command("serve", "/c.json") == ["serve", "run", "--address", "local", "/c.json"]
    with pytest.raises(BenchmarkInputError):
        morphserve_app_args(system_specs([VLLM], 4)[0], plan, "/m", "t")


def test_morphserve_args_are_valid_app_args(facts):
    from deployments.app_args import parse_app_args

    plan = plan_budget(facts, max_model_len=64, kv_sequences=2)
    for spec in system_specs(ALL_SYSTEMS[:-1], facts.num_layers):
        parsed = parse_app_args(morphserve_app_args(spec, plan, facts.hf_dir, "t"))
        assert parsed.engine_config().memory_budget_bytes == plan.budget_bytes


def test_fleet_systems_are_two_replica_app_args(facts):
    from deployments.app_args import parse_app_args

    plan = plan_budget(facts, max_model_len=64, kv_sequences=2)
    names = fleet_systems()
    for spec in system_specs(names, facts.num_layers):
        args = morphserve_app_args(spec, plan, facts.hf_dir, "t")
        assert args["num_replicas"] == 2 and parse_app_args(args).num_replicas == 2
    base = morphserve_app_args(system_specs([FLEET_BASELINE], 4)[0], plan, "/m", "t")
    if fleet_switches_available():  # the build has the fleet's switches: both sides run
        assert names == (FLEET_BASELINE, FLEET_PRESSURE)
        assert (base["fleet_controller"], base["pressure_router"]) == (False, False)
        pressure = morphserve_app_args(system_specs([FLEET_PRESSURE], 4)[0], plan, "/m", "t")
        assert (pressure["fleet_controller"], pressure["pressure_router"]) == (True, True)
        # One accuracy budget for the fleet: one replica's balanced cap (60% of 4 layers = 2); none for the baseline.
        assert pressure["fleet_max_quantized_layers"] == 2 and "fleet_max_quantized_layers" not in base
        assert parse_app_args({**pressure, "model": facts.hf_dir}).fleet_config().fleet_max_quantized_layers == 2
        assert "fleet_controller" in fleet_note(names)
    else:  # only the baseline runs, and the report says why
        assert names == (FLEET_BASELINE,) and "fleet_controller" not in base
        assert "not measured" in fleet_note(names)
        with pytest.raises(BenchmarkInputError, match="lacks"):
            system_specs([FLEET_PRESSURE], 4)
    assert fleet_note([STATIC_FP]) is None


def test_the_fleet_a_b_halves_switch_one_part_each(facts):
    if not fleet_switches_available():
        pytest.skip("this build has no fleet switches")
    plan = plan_budget(facts, max_model_len=64, kv_sequences=2)
    args = {n: morphserve_app_args(system_specs([n], 4)[0], plan, "/m", "t")
            for n in ("fleet-controller-only", "fleet-router-only")}
    assert (args["fleet-controller-only"]["fleet_controller"], args["fleet-controller-only"]["pressure_router"]) == (True, False)
    assert args["fleet-controller-only"]["fleet_max_quantized_layers"] == 2  # the controller brings the fleet budget
    assert (args["fleet-router-only"]["fleet_controller"], args["fleet-router-only"]["pressure_router"]) == (False, True)
    assert "fleet_max_quantized_layers" not in args["fleet-router-only"]
    note = fleet_note(["fleet-serve-router", "fleet-router-only"])
    assert "fleet-router-only = {'fleet_controller': False, 'pressure_router': True}" in note


def test_the_fleet_budget_is_counted_in_replicas_caps_and_bounded():
    assert fleet_budget_layers(30, 1.0) == 18  # balanced: 60% of 30 layers
    assert fleet_budget_layers(30, 1.5) == 27 and fleet_budget_layers(30, 9.0) == 36  # never above both caps
    assert fleet_budget_layers(30, 0.01) == 1
    with pytest.raises(BenchmarkInputError, match="fleet_budget_replicas"):
        fleet_budget_layers(30, 0.0)


def test_vllm_gets_the_same_kv_bytes(facts):
    plan = plan_budget(facts, max_model_len=64, kv_sequences=2)
    cmd = vllm_command("/py", "/m", 9000, plan, "tiny")
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(plan.kv_bytes)
    assert cmd[cmd.index("--port") + 1] == "9000" and cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert "VLLM_CPU_KVCACHE_SPACE" not in vllm_env(2)
    # Its CPU attention needs blocks of a multiple of 32 tokens: capacity rounds down to whole blocks.
    assert cmd[cmd.index("--block-size") + 1] == "32"
    assert vllm_kv_tokens(plan) % 32 == 0 and plan.kv_tokens - 32 < vllm_kv_tokens(plan) <= plan.kv_tokens


def test_status_parsers_map_onto_the_plot_names():
    body = json.dumps({"morph_state": {"num_quantized": 7, "kv_capacity_blocks": 90},
                       "pressure": {"kv_usage": 0.5, "preemptions_total": 3}})
    assert morphserve_status(body) == {"quantized_layers": 7, "kv_capacity_blocks": 90, "kv_usage": 0.5,
                                       "preemptions_total": 3}
    with_precisions = json.dumps({"morph_state": {"precisions": ["bf16", "int4", "bf16", "int8", "int4"]}})
    assert morphserve_labels(with_precisions) == {"config": "int4:1,4;int8:3"}
    assert morphserve_labels(json.dumps({"morph_state": {"precisions": ["bf16"] * 3}})) == {"config": "full"}
    assert morphserve_labels(json.dumps({"morph_state": {"precisions": ["fp32", "int4", "fp32"]}})) == {"config": "int4:1"}
    assert parse_label("int4:1,4;int8:3") == {1: "int4", 4: "int4", 3: "int8"} and parse_label("full") == {}
    metrics = ("# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\n"
               "# TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total{model_name=\"m\"} 2.0\n")
    assert vllm_status_parser()(metrics) == {"kv_usage": 0.25, "preemptions_total": 2.0}


def test_quick_and_full_configs():
    quick = bench_config(parse_args(["--quick"]))
    assert quick.repeats == 1 and quick.systems == QUICK_SYSTEMS
    assert quick.num_windows == 1 and quick.probe.num_requests > quick.probe.concurrency
    full = bench_config(parse_args(["--repeats", "4", "--window-s", "10", "--systems", VLLM, STATIC_FP]))
    assert full.repeats == 4 and full.window_s == 10 and full.systems == (VLLM, STATIC_FP)
    assert full.min_requests >= 120 and full.num_windows >= 3
    assert full.fitting_repeats(replay_s=100.0, elapsed_s=0.0) == 4  # 2 systems x 160 s per repeat
    assert BenchConfig(time_budget_s=1000.0).fitting_repeats(replay_s=200.0, elapsed_s=0.0) == 1  # never below 1
    spec = workload_spec(full, time_scale=3.0)
    assert spec.window_s == 10 and spec.time_scale == 3.0 and spec.multi_window
    with pytest.raises(BenchmarkInputError):
        BenchConfig(repeats=0)


def _row(p95, misses, agreement=None, reaction=None, episodes=0):
    return {"ttft_s.p95": spread([p95]), "slo_violations": spread([misses]), "tf_agreement": spread([agreement]),
            "reaction_median_s": spread([reaction]), "reaction_max_s": spread([reaction]),
            "stall_episodes": spread([episodes])}


def test_goal_lines_judge_the_medians():
    table = {STATIC_FP: _row(10.0, 50, 0.99), STATIC_INT4: _row(2.0, 5, 0.89),
             "morphserve-performance": _row(2.5, 5, 0.95, 0.2, 3), "morphserve-accuracy": _row(6.0, 40, 0.985, 0.3, 2),
             VLLM: _row(3.0, 20)}
    text = "\n".join(goal_lines(table))
    assert "median 200 ms (max 200 ms, 3 episodes), under by 50 ms -> REACHED" in text
    assert "median 300 ms (max 300 ms, 2 episodes), over by 50 ms -> not reached" in text
    assert "= 4.00x lower (goal 3x); misses 50 -> 5 = 90% fewer (goal 90%) -> REACHED" in text
    assert "= 1.67x lower (goal 1.5x) -> REACHED" in text
    # quality loss: accuracy 0.005 vs INT4's 0.1 -> 95% lower
    assert "loss 95% lower -> REACHED" in text
    assert "P95 TTFT 2.5 s vs 3 s, misses 5 vs 20 -> REACHED" in text
    assert "P95 TTFT 6 s vs 3 s, misses 40 vs 20 -> not reached" in text
    table[STATIC_FP] = _row(10.0, 0, 0.99)
    assert "static FP missed no SLO" in "\n".join(goal_lines(table))


def test_server_process_cleans_up_its_whole_session(tmp_path):
    # A parent that starts a child which ignores SIGINT: both must be gone after stop().
    script = ("import subprocess, sys, time, signal\n"
              "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
              "signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(120)'])\n"
              "time.sleep(120)\n")
    server = ServerProcess([sys.executable, "-c", script], tmp_path / "log.txt")
    with server:
        sid = server.proc.pid
        deadline = time.monotonic() + 20
        while len(session_pids(sid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for the child to exist, not a timing assumption
        assert len(session_pids(sid)) == 2
        with pytest.raises(ServerStartError, match="not ready"):
            server.wait_ready(f"http://127.0.0.1:{free_port()}/health", deadline_s=0.5, poll_s=0.1)
    assert session_pids(sid) == []


def test_server_process_reports_an_early_exit(tmp_path):
    with ServerProcess([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "log.txt") as server:
        server.proc.wait()
        with pytest.raises(ServerStartError, match="exited"):
            server.wait_ready(f"http://127.0.0.1:{free_port()}/health", deadline_s=30)


def test_the_fleet_budget_is_a_command_line_setting():
    from ops.bench.run_all import bench_config, parse_args

    assert bench_config(parse_args(["--fleet", "--quick"])).fleet_budget_replicas == 1.0
    cfg = bench_config(parse_args(["--fleet", "--fleet-budget-replicas", "1.5"]))
    assert cfg.fleet_budget_replicas == 1.5 and cfg.systems == fleet_systems()


def test_the_fleet_restore_quiet_period_reaches_only_the_controller_systems():
    """--fleet-restore-quiet-s sets AppArgs.fleet_restore_quiet_s of the systems that run the controller
    (`off` = None: restores wait the engine's restore_quiet_s); unset, the app's default stands."""
    assert bench_config(parse_args(["--fleet"])).fleet_restore_quiet_s == APP_DEFAULT
    names = ("fleet-serve-router", "fleet-controller-only", "fleet-router-only")
    for flag, expected in (("off", None), ("1.5", 1.5)):
        cfg = bench_config(parse_args(["--fleet", "--fleet-restore-quiet-s", flag]))
        assert cfg.fleet_restore_quiet_s == expected
        specs = {s.name: s for s in system_specs(names, 30, 2.0, cfg.controller_overrides())}
        assert specs["fleet-controller-only"].app_args["fleet_restore_quiet_s"] == expected
        assert all("fleet_restore_quiet_s" not in specs[n].app_args for n in ("fleet-serve-router", "fleet-router-only"))
        assert f"fleet_restore_quiet_s={expected} for them" in fleet_note(names, 36, cfg.controller_overrides())
    specs = system_specs(names, 30, 2.0)
    assert all("fleet_restore_quiet_s" not in s.app_args for s in specs)
    for bad in ("-1", "soon"):
        with pytest.raises(SystemExit):
            parse_args(["--fleet-restore-quiet-s", bad])


@pytest.mark.parametrize("flag, setting, key, given, bad", [
    ("--fleet-report-interval-s", "fleet_report_interval_s", "report_interval_s", 1.0, "0"),
    ("--fleet-restore-calm-s", "fleet_restore_calm_s", "fleet_restore_calm_s", 0.0, "-1"),
])
def test_a_controller_setting_reaches_only_the_controller_systems(flag, setting, key, given, bad):
    """--fleet-report-interval-s and --fleet-restore-calm-s set an AppArgs field of the systems that run
    the controller; the baseline keeps the app's; unset, no system gets it; bad values are refused."""
    from ops.bench.systems import fleet_note

    names = ("fleet-serve-router", "fleet-controller-only", "fleet-pressure-router")
    assert getattr(bench_config(parse_args(["--fleet"])), setting) is None
    cfg = bench_config(parse_args(["--fleet", flag, f"{given:g}"]))
    specs = {s.name: s for s in system_specs(names, 30, 2.0, cfg.controller_overrides())}
    assert specs["fleet-controller-only"].app_args[key] == given
    assert specs["fleet-pressure-router"].app_args[key] == given
    assert key not in specs["fleet-serve-router"].app_args
    assert f"{key}={given:g} for them" in fleet_note(names, 36, cfg.controller_overrides())
    assert all(key not in s.app_args for s in system_specs(names, 30, 2.0))
    with pytest.raises(BenchmarkInputError, match=setting):
        bench_config(parse_args(["--fleet", flag, bad]))


def test_the_mean_load_is_a_command_line_setting_checked_by_the_rule():
    from ops.bench import BenchmarkInputError
    from ops.bench.run_all import bench_config, parse_args

    assert bench_config(parse_args([])).calibration.mean_load_fraction == 0.5
    assert bench_config(parse_args(["--fleet", "--mean-load", "0.75"])).calibration.mean_load_fraction == 0.75
    with pytest.raises(BenchmarkInputError, match="mean_load_fraction"):
        bench_config(parse_args(["--mean-load", "1.2"]))


def test_longer_prompts_and_outputs_grow_the_context_to_hold_them():
    default = bench_config(parse_args([]))
    assert (default.prompt_scale, default.prompt_range, default.max_model_len) == (1 / 8, (16, 256), 512)
    cfg = bench_config(parse_args(["--fleet", "--prompt-scale", "0.25", "--prompt-max", "1000"]))
    assert cfg.prompt_scale == 0.25 and cfg.prompt_range == (16, 1000)
    # 1000 prompt + 64 chat template + 32 output tokens = 68.5 blocks of 16 -> 69 blocks
    assert cfg.max_model_len == 69 * 16 and workload_spec(cfg).prompt_max == 1000
    assert bench_config(parse_args(["--prompt-max", "128"])).max_model_len == 512  # never below the default
    out = bench_config(parse_args(["--output-scale", "0.5", "--output-max", "256"]))
    assert (out.output_scale, out.output_range, out.prompt_range) == (0.5, (4, 256), (16, 256))
    assert out.max_model_len == 36 * 16  # 256 + 64 + 256 tokens
    with pytest.raises(BenchmarkInputError, match="max_model_len"):
        BenchConfig(prompt_range=(16, 450))  # + 64 template + 32 output tokens > 512
    assert bench_config(parse_args(["--fleet", "--fleet-router-affinity"])).controller_overrides() == {
        "router_prefix_affinity": True}
    assert bench_config(parse_args(["--fleet", "--fleet-router-slo", "--slo-ttft-s", "1.5"])).controller_overrides() == {
        "router_slo_ttft_s": 1.5}
    shared = bench_config(parse_args(["--fleet", "--no-crosscheck", "--system-prompts", "4", "192"]))
    assert (shared.system_prompts, shared.system_prompt_tokens) == (4, 192)
    assert shared.max_model_len == 34 * 16  # 256 + 192 system + 64 + 32 tokens
    assert "4 system prompts of 192 tokens" in shared.notes()[2]
    with pytest.raises(BenchmarkInputError, match="system_prompts"):
        BenchConfig(system_prompts=2, crosscheck=None)  # a count without a length
    with pytest.raises(BenchmarkInputError, match="no-crosscheck"):
        bench_config(parse_args(["--fleet", "--system-prompts", "4", "192"]))
    with pytest.raises(BenchmarkInputError, match="prompt_scale"):
        bench_config(parse_args(["--prompt-scale", "0"]))
    with pytest.raises(BenchmarkInputError, match="output_range"):
        bench_config(parse_args(["--output-max", "0"]))


def test_the_fleet_probe_keeps_every_replica_saturated():
    from ops.bench.run_all import bench_config, parse_args
    from ops.bench.systems import FLEET_REPLICAS

    single, fleet = bench_config(parse_args([])), bench_config(parse_args(["--fleet"]))
    assert fleet.probe.concurrency == FLEET_REPLICAS * single.probe.concurrency
    assert fleet.probe.num_requests == FLEET_REPLICAS * single.probe.num_requests


def test_cpu_account_counts_each_role_of_the_session(tmp_path):
    """A child titled like Ray's fleet controller burns CPU until a file appears; its seconds land under
    `controller`, the idle parent's near zero under `other`."""
    stop = tmp_path / "stop"
    burner = (f"import pathlib\nwhile not pathlib.Path({str(stop)!r}).exists():\n    sum(range(10000))\n")
    script = ("import subprocess, sys, time\n"
              f"subprocess.Popen([sys.executable, '-c', {burner!r}, 'ray::Fleet' + 'Controller'])\n"  # not in this cmdline
              "time.sleep(120)\n")
    assert role_of("ray::ServeReplica:default:LLMServer") == "engine"
    assert role_of("/usr/bin/python something") == "other"
    with ServerProcess([sys.executable, "-c", script], tmp_path / "log.txt") as server:
        account = CpuAccount(server.proc.pid)
        account.start()
        deadline = time.monotonic() + 30
        spent: dict[str, float] = {}
        while spent.get("controller", 0.0) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)  # polling until the burner has used some CPU, not a timing assumption
            spent = account.stop()
        stop.touch()
    assert spent.get("controller", 0.0) >= 0.3
    assert "other" in spent and spent["other"] < spent["controller"]  # the parent, counted apart
