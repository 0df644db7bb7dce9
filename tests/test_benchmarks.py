"""mpp/tools/benchmarks: the FLOP formula against hand and FlopCounterMode counts, the memory
accounting of the attention suite, and every suite's quick form end to end (no timing asserts)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import run_cli
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import SUITES
from benchmarks.__main__ import main
from benchmarks.attention import saved_bytes
from benchmarks.data import step_rates, workers_needed
from benchmarks.data_timing import bench_pipeline
from benchmarks.zero import model_state_mib
from mpp.models import attention, create_vit
from mpp.objectives import create_objective
from mpp.tools.flops import step_flops, transformer_flops

MACHINE_KEYS = (
    "date_utc",
    "command",
    "cpu_model",
    "cpu_cores",
    "load_avg_1_5_15",
    "load_avg_after",
    "torch",
)


def run_suite(tmp_path, capsys, suite: str, *extra: str) -> dict:
    out = tmp_path / f"{suite}.json"
    assert main([suite, "--quick", "--out", str(out), *extra]) == 0
    printed = capsys.readouterr().out
    assert "|" in printed and str(out) in printed  # a table, and where the JSON went
    result = json.loads(out.read_text())
    assert result["suite"] == suite and result["quick"] is True
    for key in MACHINE_KEYS:
        assert key in result["machine"], key
    assert result["machine"][
        "command"
    ] == f"python -m benchmarks {suite} --quick --out {out}" + "".join(f" {e}" for e in extra)
    return result


# ---- the FLOP formula ---------------------------------------------------------------------------


def test_transformer_flops_by_hand():
    # one block, L=5 tokens, D=8, F=32: qkv 2*5*8*24 + QK^T 2*25*8 + AV 2*25*8 + proj 2*5*8*8 + fc1, fc2 2*5*8*32
    assert transformer_flops(5, 8, 1, 32) == 1920 + 400 + 400 + 640 + 2560 + 2560
    assert transformer_flops(5, 8, 3, 32) == 3 * 8480


def test_plain_vit_step_flops_by_hand():
    vit = create_vit("vit_tiny_patch4_8", embed_dim=8, depth=1, num_heads=2, num_classes=10)
    f = step_flops(vit)
    # patch embed 2 * 4 patches * (3*4*4) * 8 = 3072; block on 1 + 4 tokens = 8480; head 2*8*10 = 160
    assert f.parts == {"encoder": 3072 + 8480, "head": 160}
    assert f.forward == 11712 and f.no_grad == 0 and f.step == 3 * 11712


def _tiny(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    vit = dict(
        depth=2, embed_dim=32, num_heads=2, attn_backend="math"
    )  # math: FlopCounterMode sees its bmm
    small = dict(decoder_dim=16, decoder_depth=1, decoder_heads=2, attn_backend="math")
    if name == "plain":
        return create_vit("vit_tiny_patch4_16", num_classes=10, **vit)
    if name == "mpp":
        return create_objective("mpp", create_vit("vit_tiny_patch4_16", **vit))
    base = "mpp" if name == "hpm-mpp" else "mae"
    encoder = create_vit(
        "vit_tiny_patch4_16", pos_embed="sincos" if base == "mae" else "learned", **vit
    )
    if name == "mae":
        return create_objective("mae", encoder, **small)
    return create_objective("hpm", encoder, base=base, **small)


@pytest.mark.parametrize("name", ["plain", "mpp", "mae", "hpm", "hpm-mpp"])
def test_step_flops_match_flop_counter(name):
    model, B = _tiny(name), 3
    images = torch.randn(B, 3, 16, 16)
    f = step_flops(model)
    if name.startswith("hpm"):
        assert model.num_hard > 0 and f.no_grad > 0, "the teacher runs and is counted forward-only"

    def loss() -> torch.Tensor:
        out = model(images)
        return out.sum() if name == "plain" else out[0]

    with FlopCounterMode(display=False) as fwd:
        loss()
    assert fwd.get_total_flops() == B * f.forward
    with FlopCounterMode(display=False) as train:
        loss().backward()
    # x3 for what is trained, x1 for the teacher; the one gradient never computed is the
    # patch embedding's input gradient (images need none)
    enc = model if name == "plain" else model.encoder
    embed = 2 * enc.num_patches * 3 * 4 * 4 * enc.embed_dim
    assert train.get_total_flops() == B * (f.step - embed)


# ---- the suites' own helpers --------------------------------------------------------------------


def test_attention_memory_is_the_saved_activations():
    """math keeps q*scale, k, v and the (B, H, N, N) probabilities; SDPA q, k, v, its output
    and the (B, H, N) log-sum-exp: linear in N."""
    B, N, H, hd = 1, 64, 2, 8
    q, k, v = (torch.randn(B, N, H, hd, requires_grad=True) for _ in range(3))
    act = B * N * H * hd * 4
    assert saved_bytes(lambda: attention(q, k, v, "math")) == 3 * act + B * H * N * N * 4
    assert saved_bytes(lambda: attention(q, k, v, "sdpa")) == 4 * act + B * H * N * 4


def test_data_sizing():
    assert workers_needed(3000, 400) == 8 and workers_needed(800, 400) == 2
    rates = step_rates(["mine=120.5"], None)
    assert rates["mine"] == 120.5 and any("H100" in k for k in rates)
    with pytest.raises(ValueError, match="LABEL=IPS"):
        step_rates(["120"], None)


def test_zero_model_states_per_rank():
    # Psi fp32 params + grads + Adam moments: 16 Psi bytes, partitioned stage by stage (2 ranks)
    psi = 2**20
    assert [model_state_mib(psi, s, 2) for s in range(4)] == [16.0, 12.0, 10.0, 8.0]


# ---- each suite's quick form, end to end -----------------------------------------------------------


def test_cpu_step_quick(tmp_path, capsys):
    r = run_suite(tmp_path, capsys, "cpu-step")
    assert [row["objective"] for row in r["rows"]] == ["plain", "mpp", "mae", "hpm"]
    for row in r["rows"]:
        for key in (
            "step_s",
            "imgs_per_sec",
            "gflops_per_img",
            "achieved_gflops_per_s",
            "ratio_to_matmul",
            "ratio_to_plain",
        ):
            assert row[key] > 0, (row["objective"], key)
    hpm = next(row for row in r["rows"] if row["objective"] == "hpm")
    assert hpm["teacher_gflops_per_img"] > 0
    assert r["matmul_gflops_per_s"] > 0
    assert {p["part"] for p in r["overheads"]["mpp"]} == {"masking", "corruption", "targets"}
    assert {"teacher forward", "EMA update"} <= {p["part"] for p in r["overheads"]["hpm"]}
    for name in ("plain", "mpp"):
        prof = r["profiles"][name]
        assert prof["top_ops"] and sum(prof["categories_pct"].values()) == pytest.approx(100)
    assert {"mpp_ratio_to_matmul_min", "mpp_ratio_to_matmul", "met", "hpm_vs_mae_met"} <= set(
        r["goal"]
    )
    assert r["hpm_vs_mae"]["flops"] == pytest.approx(
        hpm["gflops_per_img"] / r["rows"][2]["gflops_per_img"]
    )


def test_attention_quick(tmp_path, capsys):
    r = run_suite(tmp_path, capsys, "attention")
    assert r["default_backend"] == "sdpa"
    tokens = r["setting"]["tokens"]
    assert {(row["tokens"], row["backend"]) for row in r["rows"]} == {
        (n, b) for n in tokens for b in ("math", "sdpa")
    }
    mem = {(row["tokens"], row["backend"]): row["mem_mib"] for row in r["rows"]}
    assert mem[(tokens[-1], "math")] > mem[(tokens[-1], "sdpa")]
    # saved bytes are exact, not timed: SDPA's grow exactly linearly
    assert r["memory_growth_exponent"]["sdpa"] == pytest.approx(1.0)
    assert r["memory_growth_exponent"]["math"] > 1.3
    assert all(row["ms"] > 0 and row["time_vs_math"] > 0 for row in r["rows"])
    assert {"default_memory_linear", "default_never_slower_than_math", "met"} <= set(r["goal"])


def test_data_quick(tmp_path, capsys):
    step_json = tmp_path / "cpu-step.json"
    step_json.write_text(
        json.dumps(
            {"setting": {"model": "vit_x"}, "rows": [{"objective": "mpp", "imgs_per_sec": 5.0}]}
        )
    )
    r = run_suite(
        tmp_path, capsys, "data", "--cpu-step-json", str(step_json), "--step-ips", "fast=9999"
    )
    bench = r["pipeline"]
    for key in ("bare_decode_resize_ips", "pipeline_ips", "cost_ratio", "overhead_ratio"):
        assert bench[key] > 0, key
    sizing = {row["step"]: row for row in r["sizing"]}
    assert sizing["fast"]["workers"] == math.ceil(9999 / r["per_worker_ips"])
    assert "mpp vit_x fp32, this CPU (cpu-step)" in sizing
    assert r["bad_data"]["skipped_per_pass"] > 0 and r["bad_data"]["throughput_ratio"] > 0
    assert {"cost_ratio_max", "cost_ratio", "bad_data_ratio", "met"} <= set(r["goal"])


@pytest.mark.slow
def test_zero_quick(tmp_path, capsys):
    r = run_suite(tmp_path, capsys, "zero")
    rows = r["rows"]
    assert [row["stage"] for row in rows] == r["setting"]["stages"] and len(rows) >= 2
    for row in rows:
        assert len(row["rank_peak_mib"]) == 2
        assert all(
            p >= b > 0 for p, b in zip(row["rank_peak_mib"], row["rank_baseline_mib"], strict=True)
        )
        assert row["imgs_per_sec"] > 0 and row["timed_steps"] >= 1
        assert row["model_state_mib"] == pytest.approx(
            model_state_mib(r["setting"]["num_params"], row["stage"])
        )
    assert rows[0]["step_vs_first"] == 1.0


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU"
)
def test_gpu_step_refuses_cleanly_without_a_gpu(tmp_path):
    out = tmp_path / "gpu.json"
    r = run_cli(
        ["python", "-m", "benchmarks", "gpu-step", "--quick", "--out", str(out)],
        timeout=120,
    )
    assert r.returncode == 2
    assert "gpu-step: needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_gpu_step_code_runs_on_the_cpu(tmp_path, capsys):
    """The suite's own code (the shipped configs through DeepSpeed's bf16 engine, FLOPs, goals,
    table) on a tiny model on the CPU, so the first run on a GPU machine does not die on a typo."""
    out = tmp_path / "gpu.json"
    assert main(["gpu-step", "--device", "cpu", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    s = r["setting"]
    assert s["device"] == "cpu" and s["model"] == "vit_tiny_patch16_64"
    # the training path: the recipes' ZeRO stage 0 and the precision it takes on a GPU (fp32
    # weights under bf16 autocast), TF32 untouched
    assert s["precision"] == "bf16-autocast" and s["zero_stage"] == 0 and s["tf32"] is False
    assert "measured" in s["peak_source"] and s["peak_flops"] is None
    assert [row["objective"] for row in r["rows"]] == ["mpp", "mae", "hpm"]
    for row in r["rows"]:
        assert row["step_s"] > 0 and row["mfu"] > 0 and row["peak_mem_gib"] is None
    (g,) = r["goals"]
    assert g["hpm_vs_mae_time"] == pytest.approx(r["rows"][2]["step_s"] / r["rows"][1]["step_s"])
    assert "HPM ÷ MAE time" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_step_times_the_recipes_step_against_the_datasheet_peak(tmp_path):
    out = tmp_path / "gpu.json"
    assert main(["gpu-step", "--quick", "--profile", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    s = r["setting"]
    assert s["precision"] == "bf16-autocast" and s["tf32"] is False
    assert s["peak_flops"] is None or "datasheet" in s["peak_source"]
    for row in r["rows"]:
        # mpp's own: the finite check's one; DeepSpeed's ZeRO optimiser makes its own (named)
        assert row["peak_mem_gib"] > 0 and row["host_syncs"]["own"] <= 1, row["host_syncs"]
        assert row["mfu"] is None or 0 < row["mfu"] < 1
        shares = row["gpu_time"]
        assert shares["matmul"] > 0 and 0.95 < sum(shares.values()) < 1.05, shares


def test_gpu_step_overrides_reach_every_rows_config():
    """``gpu-step --set KEY=VALUE``: the shipped config as pretraining would take the override."""
    from benchmarks.gpu_step import SETTINGS, step_config

    setting = {**SETTINGS["cpu"], "sets": ["deepspeed.zero_optimization.stage=1"]}
    for name in ("mpp", "mae", "hpm"):
        shipped = step_config(name, SETTINGS["cpu"])
        assert shipped.zero_stage == 0 and shipped.train.precision == "bf16-autocast"
        # the precision a GPU takes at the row's stage: DeepSpeed's bf16 at ZeRO-1
        assert step_config(name, setting).zero_stage == 1
        assert step_config(name, setting).train.precision == "bf16"


def test_kernels_are_sorted_by_their_names():
    """What ``gpu-step --profile`` splits the GPU time by (kernel names an H200 printed)."""
    from benchmarks.gpu_step import kernel_kind

    names = {
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT": "matmul",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>": "attention",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80": "attention",
        "void at::native::multi_tensor_apply_kernel<TensorListMetadata<4>>": "optimizer",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "communication",
        "void at::native::vectorized_elementwise_kernel<4, GeluCUDAKernelImpl>": "elementwise",
    }
    assert {name: kernel_kind(name) for name in names} == names


def test_host_engine_ops_stay_flat_in_the_tensor_count_and_under_budget(tmp_path, capsys):
    """``python -m benchmarks host`` on 2 ranks (the real engine, ZeRO and precision as the recipe ships):
    MAE at depth 6 and 12 (180 and 252 parameter tensors). The engine's non-view ops per step (a
    kernel launch each on a GPU) do not grow with the tensor count, the step stays under its
    committed budget, and every phase and source is counted."""
    from benchmarks.host import BUDGET

    r = run_suite(tmp_path, capsys, "host", "--recipes", "mae", "--depths", "6,12")
    d6, d12 = r["rows"]
    assert (d6["depth"], d12["depth"]) == (6, 12) and d12["param_tensors"] - d6[
        "param_tensors"
    ] == 72
    assert d12["zero_stage"] == 0 and d12["precision"] == "bf16-autocast"
    assert d12["engine_kernel_ops_per_step"] <= 1.2 * d6["engine_kernel_ops_per_step"]
    assert d12["ops_per_step"] <= BUDGET["mae"]
    assert d12["ops_per_step"] == sum(p["ops"] for p in d12["phases"].values())
    # the objective grows with depth, the engine's views (flattening the gradients) too
    assert d12["objective_ops_per_step"] > 1.3 * d6["objective_ops_per_step"]
    assert "mpp/parallel/stage0.py:allreduce_gradients" in d12["sources"]
    (goal,) = r["goals"]
    assert goal["met"] is True and goal["engine_growth"] <= 1.2


def test_host_check_catches_a_per_tensor_loop(dist_group, monkeypatch):
    """The same measurement in this process (one rank) with a deliberate per-tensor loop after
    each optimiser step, as an unfused EMA or a per-parameter check would add: its goal fails."""
    import mpp.tools.doctor.engine_step as engine_step
    from benchmarks.host import goals, measure_recipe

    after = engine_step.after_optimizer_step

    def per_tensor_loop(engine, *args):
        after(engine, *args)
        with torch.no_grad():
            for p in engine.module.parameters():
                p.mul_(1.0)

    clean = [measure_recipe("mae", d, [], steps=1, warmup=1) for d in (6, 12)]
    monkeypatch.setattr(engine_step, "after_optimizer_step", per_tensor_loop)
    broken = [measure_recipe("mae", d, [], steps=1, warmup=1) for d in (6, 12)]
    assert goals(clean)[0]["met"] is True, (
        goals(clean),
        [(r["engine_kernel_ops_per_step"], r["sources"], r["phases"]) for r in clean],
    )
    (goal,) = goals(broken)
    assert goal["met"] is False and goal["engine_growth"] > 1.2
    assert broken[1]["phases"]["after_step"]["ops"] >= broken[1]["param_tensors"]


def test_decode_quick_measures_every_worker_path(tmp_path, capsys):
    """``python -m benchmarks decode``: a decode worker's img/s per path, for both JPEG sizes; the worker's
    share under ``data.decode=gpu`` (a header parsed, no pixels) is far cheaper than decoding."""
    r = run_suite(tmp_path, capsys, "decode")
    assert [row["source"] for row in r["rows"]] == ["256px", "500x375"]
    for row in r["rows"]:
        cpu, deferred = row["cpu (PIL, draft)"], row["gpu: worker's share"]
        assert cpu > 0 and row["cpu (PIL, no draft)"] > 0 and deferred > 3 * cpu
    assert r["setting"]["img_size"] == 224


def test_the_gpu_check_dry_run_runs_every_step(tmp_path):
    """``benchmarks/gpu_check.py --dry-run``: each step of the GPU check in its small form on the
    CPU (the shards, gpu-step of MPP and MAE at the runs' batch, a whole eager run of each config
    held against it, the CUDA tests collected, the decode suite), one JSON with the whole runs'
    table; without ``--dry-run`` on a machine without CUDA it says so and exits 2."""
    out = tmp_path / "gc"
    r = run_cli(["python", "benchmarks/gpu_check.py", "--dry-run", "--out", str(out)], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((out / "gpu-check.json").read_text())
    steps = {s["name"]: s for s in summary["steps"]}
    assert list(steps) == [
        "shards",
        "gpu-step 256",
        "runs mae_b16",
        "runs mpp_b16",
        "cuda tests",
        "decode",
    ]
    assert all(s["rc"] == 0 for s in steps.values()) and summary["dry_run"] is True
    shards = steps["shards"]["result"]["setting"]["shards"]
    assert shards["count"] >= 60 and shards["files"] == 4 and shards["share_500px"] > 0.5
    rows = steps["gpu-step 256"]["result"]["rows"]
    assert {row["objective"] for row in rows} == {"mpp", "mae"}
    assert all(row["step_s"] > 0 and "error" not in row for row in rows)
    runs = summary["whole_runs"]
    assert [(row["config"], row["decode"], row["compile"]) for row in runs] == [
        ("mae_b16", "cpu", False),
        ("mpp_b16", "cpu", False),
    ]
    for row in runs:  # each against gpu-step's row of its objective at the same batch
        assert row["rc"] == 0 and row["imgs_per_sec"] > 0 and 0 <= row["data_wait"] <= 1
        assert row["run_over_step"] == row["imgs_per_sec"] / row["step_imgs_per_sec"]
    # only the last run of mae_b16's call ran the monitor and previews and a mid-run checkpoint
    assert runs[0]["extras"] and runs[0]["monitor_records"] > 0 and runs[0]["checkpoints"] == 2
    assert not runs[1]["extras"] and runs[1]["monitor_records"] == 0
    assert runs[1]["checkpoints"] == 1
    assert "tests collected" in steps["cuda tests"]["last_line"]
    assert "| runs mae_b16 | 0 |" in r.stdout and "whole runs against their step alone" in r.stdout
    if not torch.cuda.is_available():
        refused = run_cli(["python", "benchmarks/gpu_check.py", "--out", str(out)], timeout=60)
        assert refused.returncode == 2 and "no CUDA GPU" in refused.stdout


def test_the_gpu_check_on_a_gpu_fits_a_lent_session(tmp_path, monkeypatch):
    """The GPU form's steps: the dry run's, in under 8 minutes whatever their own limits say; every
    whole run of mae_b16 and mpp_b16 (both decodes, eager and compiled) held against gpu-step at
    batch 256 with --compile; the doctor and issue 36's levers no longer run."""
    import tempfile

    from benchmarks import gpu_check

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the scratch folder it makes
    steps = gpu_check.steps(tmp_path / "gc", dry=False)
    assert [s["name"] for s in steps] == [
        "shards",
        "gpu-step 256",
        "runs mae_b16",
        "runs mpp_b16",
        "cuda tests",
        "decode",
    ]
    assert gpu_check.BUDGET_S <= 480 and all(s["limit_s"] <= 180 for s in steps)
    argv = {s["name"]: " ".join(s["argv"]) for s in steps}
    assert "--compile --profile --batch 256" in argv["gpu-step 256"]
    for config in ("mae_b16", "mpp_b16"):
        assert f"--config {config} --decode cpu,gpu --compile false,true" in argv[f"runs {config}"]
        assert f"--step-json {tmp_path / 'gc' / 'gpu-step-256.json'}" in argv[f"runs {config}"]
    assert [s["name"] for s in steps if s["optional"]] == ["cuda tests", "decode"]
    assert "-m mpp doctor" not in " ".join(argv.values()) and "--levers" not in str(argv)


def test_compiled_run_draws_jpegs_of_imagenets_sizes():
    """compiled-run's images: most 500 px on the long side in ImageNet's three usual shapes, some
    smaller, some larger; the same draw for the same seed."""
    from benchmarks.compiled_run import imagenet_sizes

    sizes = imagenet_sizes(15_616)
    assert sizes == imagenet_sizes(15_616) and len(sizes) == 15_616
    share = lambda f: sum(map(f, sizes)) / len(sizes)  # noqa: E731
    assert 0.7 < share(lambda s: max(s) == 500) < 0.85
    assert share(lambda s: s in ((500, 375), (375, 500), (500, 333))) > 0.6
    assert 0.1 < share(lambda s: max(s) < 500) < 0.2 and 0.05 < share(lambda s: max(s) > 500) < 0.12
    assert all(min(s) >= 100 and max(s) <= 1200 for s in sizes)


def test_compiled_run_holds_each_run_against_its_own_step():
    """Eager run against gpu-step's eager row, compiled against compiled, on the attention a run's
    ``auto`` takes (xformers where gpu-step ran it); none at another batch or without a step."""
    from benchmarks.compiled_run import against_step

    def gs(backends):
        rows = [
            {"lever": "shipped", "objective": o, "attention": a, "compiled": c, "imgs_per_sec": v}
            for a in backends
            for o, c, v in (("mae", False, 1000.0), ("mae", True, 1250.0), ("mpp", False, 800.0))
        ]
        return {"setting": {"batch": 256}, "rows": rows}

    def run(compiled, batch=256, ips=1125.0, wait=0.01, objective="mae"):
        return {"objective": objective, "compile": compiled, "batch": batch}, ips, wait

    rows = []
    for spec in (run(False), run(True), run(False, batch=128), run(True, objective="mpp")):
        rows.append(spec[0] | {"imgs_per_sec": spec[1], "data_wait": spec[2]})
    against_step(rows, gs(["sdpa"]))
    assert [r["run_over_step"] for r in rows] == [1.125, 0.9, None, None]
    assert [r["met"] for r in rows] == [True, True, None, None]
    assert rows[0]["step_attention"] == "sdpa"
    rows[0]["data_wait"] = 0.06
    against_step(rows, gs(["sdpa", "xformers"]))
    assert rows[0]["met"] is False and rows[0]["step_attention"] == "xformers"
    against_step(rows, None)
    assert all(r["run_over_step"] is None and r["met"] is None for r in rows)


def test_cli_lists_every_suite():
    r = run_cli(["python", "-m", "benchmarks", "--help"], timeout=120)
    assert r.returncode == 0
    for name in SUITES:
        assert name in r.stdout


def test_monitor_suite_measures_a_monitor_call_and_counts_the_recipes():
    from benchmarks import monitor

    r = monitor.run(quick=True)
    (row,) = r["rows"]
    assert 190 <= row["bank"] <= 200 and row["step_ms"] > 0 and row["monitor_ms"] > 0
    assert row["overhead_pct_200"] == pytest.approx(
        100 * row["monitor_ms"] / (200 * row["step_ms"])
    )
    (recipe,) = r["recipes"]
    # mpp_b16: a bank of 20,000 + 50,000 held out, full-image forwards, against 4,096 x 1,000
    # steps of 105.6 GFLOP per image: about 1 %
    assert recipe["config"] == "mpp_b16" and 0.5 < recipe["overhead_pct_1000"] < 2
    assert recipe["overhead_pct_200"] == pytest.approx(5 * recipe["overhead_pct_1000"])
    assert "at every 1000 %" in monitor.render(r)


def test_preview_suite_measures_the_overhead_of_a_preview():
    from benchmarks import preview

    r = preview.run(quick=True)
    (row,) = r["rows"]
    assert row["step_ms"] > 0 and row["preview_ms"] > 0
    assert row["overhead_pct"] == pytest.approx(100 * row["preview_ms"] / (1000 * row["step_ms"]))


def test_bench_pipeline_reports_consistent_figures():
    result = bench_pipeline(
        num_images=16, img_size=32, width=64, height=48, batch_size=8, repeats=1
    )
    assert result["num_images"] == 16
    assert result["pipeline_ips"] > 0 and result["bare_decode_resize_ips"] > 0
    assert result["cost_ratio"] == pytest.approx(
        result["bare_decode_resize_ips"] / result["pipeline_ips"]
    )
