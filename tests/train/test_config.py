import pathlib

import pytest

from lhc.train import config as config_lib

CONFIG = str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "lm_assoc_recall.py")


def test_load_tiny_and_overrides():
    config = config_lib.load_config(
        CONFIG + ":tiny",
        [
            "--config.num_steps=7",
            "config.optimizer.learning_rate=0.5",
            "model.num_layers=3",
            "mesh_shape=(1,2,-1)",
            "progress_bar=false",
            "data.name=copy",
        ],
    )
    assert config.num_steps == 7
    assert config.optimizer.learning_rate == 0.5 and isinstance(
        config.optimizer.learning_rate, float
    )
    assert config.model.num_layers == 3
    assert config.mesh_shape == (1, 2, -1)
    assert config.progress_bar is False
    assert config.data.name == "copy"
    assert config.is_locked


def test_int_for_float_is_accepted_but_str_for_int_is_not():
    config = config_lib.load_config(CONFIG, ["optimizer.learning_rate=1"])
    assert config.optimizer.learning_rate == 1.0
    with pytest.raises(ValueError, match=r"num_steps.*expected a int"):
        config_lib.load_config(CONFIG, ["num_steps=many"])


def test_unknown_key_names_it_and_suggests():
    with pytest.raises(ValueError, match=r"unknown key 'num_step'.*did you mean num_steps"):
        config_lib.load_config(CONFIG, ["--config.num_step=3"])
    with pytest.raises(ValueError, match=r"unknown key 'learning_rat' in optimizer"):
        config_lib.load_config(CONFIG, ["optimizer.learning_rat=3"])


def test_missing_file_and_bad_arg():
    with pytest.raises(FileNotFoundError, match="no config file at 'configs/nope.py'"):
        config_lib.load_config("configs/nope.py:tiny")
    with pytest.raises(ValueError, match="size must be one of"):
        config_lib.load_config(CONFIG + ":huge")
    with pytest.raises(ValueError, match="config arg key 'bogus'"):
        config_lib.load_config(CONFIG + ":bogus=1")


def test_parse_arg_flags_and_sizes():
    arg = config_lib.parse_arg("small,runlocal", size="tiny", runlocal=False)
    assert arg.size == "small" and arg.runlocal is True
    arg = config_lib.parse_arg("size=tiny,runlocal=False", size="small", runlocal=True)
    assert arg.size == "tiny" and arg.runlocal is False


def test_override_without_value_is_rejected():
    with pytest.raises(ValueError, match="must look like key=value"):
        config_lib.load_config(CONFIG, ["num_steps"])
