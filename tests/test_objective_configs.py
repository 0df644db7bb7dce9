"""The typed objective section: one model per objective, beside its class in the objective's file,
keyed on ``name`` (the union built from ``mpp.objectives.base.REGISTRY``), the only place its
defaults live, HPM's base nested (its flat form read too), errors naming the key and the file,
and a saved config that loads back to the same objective."""

import inspect
import json

import pytest
from conftest import write_config

from mpp.build import build_objective
from mpp.config import ConfigError, load_config, save_config
from mpp.objectives import OBJECTIVES
from mpp.objectives.base import REGISTRY, PerPatchObjective
from mpp.objectives.configs import OBJECTIVE_CONFIGS
from mpp.objectives.hpm import HPMConfig, hpm_bases
from mpp.objectives.mae import MAEBase, MAEConfig
from mpp.objectives.mpp import MPPConfig


@pytest.mark.parametrize("name", ["mpp", "mae", "hpm", "simmim"])
def test_each_objective_takes_its_typed_section(name):
    """An objective's section lives in its own file, beside its class (the registry pairs them),
    and its constructor takes the section itself, no keyword argument re-listing its keys."""
    section, cls = REGISTRY[name]
    assert OBJECTIVE_CONFIGS[name] is section and OBJECTIVES[name] is cls
    assert section.__module__ == cls.__module__ == f"mpp.objectives.{name}"
    params = inspect.signature(cls).parameters.values()
    assert not [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    assert "cfg" in inspect.signature(cls).parameters


def test_hpm_wraps_every_registered_per_patch_objective():
    bases = hpm_bases()
    assert set(bases) == {"mae", "mpp", "simmim"}
    assert bases == {n: c for n, (_, c) in REGISTRY.items() if issubclass(c, PerPatchObjective)}


def test_hpm_flat_and_nested_forms_are_one_config():
    flat = HPMConfig.model_validate(
        {"name": "hpm", "base": "mpp", "mask_ratio": 0.4, "bits": 2, "hard_ratio": 0.3}
    )
    nested = HPMConfig.model_validate(
        {"name": "hpm", "base": {"name": "mpp", "mask_ratio": 0.4, "bits": 2}, "hard_ratio": 0.3}
    )
    assert flat == nested and isinstance(flat.base, MPPConfig) and flat.base.bits == 2
    assert flat.base.name == "mpp" and flat.base.mask_ratio == 0.4
    assert isinstance(HPMConfig().base, MAEBase) and not isinstance(HPMConfig().base, MAEConfig)
    # a key set on a saved (nested) config goes to the base too: --set objective.mask_ratio=0.6
    again = HPMConfig.model_validate({**nested.model_dump(), "mask_ratio": 0.6})
    assert again.base.mask_ratio == 0.6


@pytest.mark.parametrize(
    "objective,message",
    [
        ({"name": "mae", "decoder_width": 64}, "objective.decoder_width: unknown key"),
        ({"name": "mae", "mask_ratio": 1.0}, "objective.mask_ratio: Input should be less than 1"),
        (
            {"name": "mpp", "target": "rgb"},
            "objective.target: Input should be 'mean_color', 'downsampled' or 'pixel'",
        ),
        (
            {"name": "hpm", "base": "beit"},
            "objective.base.name: Input should be 'mae', 'mpp' or 'simmim' (got 'beit')",
        ),
        (
            {"name": "simmim", "mask_ratio": 1.0},
            "objective.mask_ratio: Input should be less than 1",
        ),
        (
            {"name": "hpm", "base": "mpp", "bits": 0},  # the flat form: named as written
            "objective.bits: Input should be greater than or equal to 1",
        ),
        (
            {"name": "hpm", "base": {"name": "mpp", "bits": 0}},
            "objective.base.bits: Input should be greater than or equal to 1",
        ),
        (
            {"name": "hpm", "base": "mpp", "norm_pix_loss": True},
            "objective.norm_pix_loss: unknown key",
        ),
        (
            {"name": "hpm", "mask_rati": 0.5},
            "objective.mask_rati: unknown key (did you mean objective.mask_ratio?)",
        ),
        (
            {"name": "hpm", "schedule": "linear"},
            "objective.schedule: Input should be 'easy_to_hard'",
        ),
        (
            {"name": "beit"},
            "objective.name: Input should be 'hpm', 'mae', 'mpp' or 'simmim' (got 'beit')",
        ),
        # checks of several keys, at load time too (they were the constructors')
        (
            {"name": "mpp", "mask_token_prob": 0.7},
            "objective: mask_token_prob + random_token_prob + keep_prob must sum to 1",
        ),
        (
            {"name": "mae", "decoder_dim": 64, "decoder_heads": 5},
            "objective: decoder_dim 64 must be divisible by 4 (sin-cos positions) and by "
            "decoder_heads 5",
        ),
    ],
)
def test_a_bad_objective_key_is_named_with_the_file(tmp_path, digits16, objective, message):
    from conftest import tiny_config

    path = write_config(tmp_path / "c.json", {**tiny_config(digits16), "objective": objective})
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value).startswith(f"{path}: {message}"), str(e.value)


@pytest.mark.parametrize("name", ["mpp_demo", "mae_demo", "hpm_demo", "simmim_demo"])
def test_a_saved_config_builds_the_same_objective(tmp_path, name):
    """config.json of a run (HPM's base nested) loads back to the same section and objective."""
    import torch

    cfg = load_config(name)
    save_config(cfg, tmp_path / "config.json")
    again = load_config(tmp_path / "config.json")
    assert again.objective == cfg.objective
    if name == "hpm_demo":
        assert (
            json.loads((tmp_path / "config.json").read_text())["objective"]["base"]["name"] == "mae"
        )
    torch.manual_seed(0)
    a = build_objective(cfg).state_dict()
    torch.manual_seed(0)
    b = build_objective(again).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
