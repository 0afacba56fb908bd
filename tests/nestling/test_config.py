"""Run configuration: TOML + overrides into typed sections; every bad input ends in an error naming the problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from nestling.config import SimConfig, config_from_dict, load_config
from nestling.errors import ConfigError, DataError, SpecError
from nestling.server.strategies import STRATEGIES, create_strategy


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_a_valid_file_is_read_into_typed_sections_with_overrides_on_top(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[run]
rounds = 3
[data]
dataset = "synthetic"
clients = 6
[model]
arch = "tinycnn"
[method]
name = "nefl-wd"
flex = 1
[train]
lr = 1
milestones = [0.5]
""",
    )
    cfg = load_config(path, {"train.batch_size": 8, "run.seed": None})
    assert isinstance(cfg, SimConfig)
    assert (cfg.run.rounds, cfg.data.dataset, cfg.data.clients, cfg.model.arch) == (
        3,
        "synthetic",
        6,
        "tinycnn",
    )
    assert cfg.method.name == "nefl-wd" and cfg.method.options == {"flex": 1}
    assert cfg.train.lr == 1.0 and isinstance(
        cfg.train.lr, float
    )  # ints are accepted where floats are expected
    assert cfg.train.batch_size == 8 and cfg.run.seed == 0  # a None override leaves the default


def test_defaults_alone_form_a_valid_config() -> None:
    cfg = load_config(None)
    assert cfg.method.name == "nefl-wd" and cfg.data.dataset == "digits" and cfg.run.rounds >= 1


def test_optional_fields_accept_their_type_and_coerce_ints_to_floats() -> None:
    cfg = config_from_dict(
        {"data": {"augment": False, "limit_train": 100}, "run": {"deadline_s": 5}, "train": {"grad_clip": 1}}
    )
    assert cfg.data.augment is False and cfg.data.limit_train == 100
    assert cfg.run.deadline_s == 5.0 and isinstance(cfg.run.deadline_s, float) and cfg.train.grad_clip == 1.0


def test_malformed_toml_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[run\nrounds = ")
    with pytest.raises(ConfigError, match=r"run\.toml is not valid TOML"):
        load_config(path)


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"bogus": {}}, r"unknown config sections \['bogus'\]"),
        ({"train": {"learning_rate": 0.1}}, r"\[train\] unknown keys \['learning_rate'\]"),
        ({"train": {"lr": "fast"}}, r"\[train\] lr must be float"),
        ({"run": {"rounds": True}}, r"\[run\] rounds must be a number"),
        (
            {"data": {"augment": "yes"}},
            r"\[data\] augment must be true or false",
        ),  # optional fields are typed too
        ({"data": {"limit_train": "all"}}, r"\[data\] limit_train must be int"),
        ({"train": "fast"}, r"\[train\] must be a table"),
        ({"run": {"rounds": 0}}, r"\[run\] rounds must be >= 1"),
        ({"train": {"fraction": 0.0}}, r"\[train\] fraction must be in \(0, 1\]"),
        ({"run": {"quorum": 1.5}}, r"\[run\] quorum"),
        ({"run": {"over_selection": 0.5}}, r"\[run\] over_selection"),
        ({"run": {"train_share": 0.0}}, r"\[run\] train_share must be in \(0, 1\]"),
        ({"run": {"train_share": 1.5}}, r"\[run\] train_share must be in \(0, 1\]"),
        ({"data": {"alpha": 0}}, r"\[data\] alpha"),
        ({"run": {"calibration_samples": -1}}, r"\[run\] calibration_samples must be >= 0"),
        (
            {"run": {"bn_statistics": "mode"}},
            r"\[run\] bn_statistics must be one of median, mean, got 'mode'",
        ),
    ],
)
def test_bad_sections_keys_types_and_ranges_name_what_is_wrong(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_dict(data)


def test_unknown_method_lists_the_known_ones(make_ctx) -> None:
    with pytest.raises(ConfigError, match=r"unknown method 'nefl-xd' \(known: .*fedavg.*nefl-wd"):
        create_strategy("nefl-xd", make_ctx())
    assert {"fedavg", "heterofl", "fjord", "depthfl", "scalefl", "nefl-w", "nefl-d", "nefl-wd"} <= set(
        STRATEGIES
    )


def test_unknown_method_option_is_refused_with_the_known_options(make_ctx) -> None:
    with pytest.raises(ConfigError, match=r"nefl-wd has no options \['flux'\] \(known: flex"):
        create_strategy("nefl-wd", make_ctx(options={"flux": 2}))


def test_unknown_model_names_the_model(make_ctx) -> None:
    with pytest.raises(ConfigError, match="unknown model 'resnet9000'"):
        create_strategy("fedavg", make_ctx(arch="resnet9000"))


def test_width_zero_is_an_impossible_spec(make_ctx) -> None:
    with pytest.raises(SpecError, match=r"width must be in \(0, 1\], got 0"):
        create_strategy("fedavg", make_ctx(options={"width": 0.0}))


def test_heterofl_bad_rate_mix_is_explained(make_ctx) -> None:
    with pytest.raises(ConfigError, match="bad HeteroFL rate mix 'z1'"):
        create_strategy("heterofl", make_ctx(options={"mix": "z1"}))


def test_schedule_kind_is_checked_when_the_run_is_built() -> None:
    from nestling.schedule import LrSchedule

    with pytest.raises(ConfigError, match="unknown lr schedule 'sawtooth'"):
        LrSchedule(config_from_dict({"train": {"schedule": "sawtooth"}}).train.schedule)


def test_a_missing_data_directory_is_a_data_error_naming_it(tmp_path: Path) -> None:
    from nestling.simulator.fleetdata import load_fleet_data

    missing = tmp_path / "no-such-cifar"
    cfg = config_from_dict({"data": {"dataset": "cifar10", "root": str(missing)}})
    with pytest.raises(DataError, match="no-such-cifar"):
        load_fleet_data(
            cfg.data.dataset, cfg.data.root, cfg.run.seed, cfg.data.partition, cfg.data.clients, {}
        )


def test_unset_drops_a_key_the_file_sets(tmp_path: Path) -> None:
    """`--unset method.flex`: a key of the file gone (a method option) or back to its default."""
    path = tmp_path / "run.toml"
    path.write_text('[method]\nname = "heterofl"\nflex = 2\n[train]\nlr = 0.5\n')
    cfg = load_config(path, unset=("method.flex", "train.lr"))
    assert "flex" not in cfg.method.options and cfg.train.lr == load_config(None).train.lr
    with pytest.raises(ConfigError, match=r"--unset method.flux: the config file sets no such key"):
        load_config(path, unset=("method.flux",))
