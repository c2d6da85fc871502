import keras
import pytest

from tfformer.recipes import language_model, rundir, translation


def test_begin_gives_the_runs_policy_and_leaves_the_global_one(tmp_path):
    keras.config.set_dtype_policy("bfloat16")  # a caller's (the autouse fixture puts float32 back)
    _, _, dtype = rundir.begin(str(tmp_path / "mixed"), mixed_precision=True)
    assert dtype.name == "mixed_bfloat16" and keras.config.dtype_policy().name == "bfloat16"
    _, _, dtype = rundir.begin(str(tmp_path / "plain"), mixed_precision=False)
    assert dtype.name == "float32" and keras.config.dtype_policy().name == "bfloat16"


@pytest.mark.parametrize("caller, mixed_precision", [("float32", True), ("mixed_bfloat16", False)])
def test_recipes_give_the_caller_its_dtype_policy_back(tmp_path, caller, mixed_precision):
    """A recipe that fails reading its data leaves the caller's global policy as it was."""
    keras.config.set_dtype_policy(caller)
    try:
        with pytest.raises(ValueError, match="does not exist"):
            translation.train_translation(str(tmp_path / "translation"), data_file=str(tmp_path / "none.tsv"),
                                          mixed_precision=mixed_precision)
        assert keras.config.dtype_policy().name == caller
        with pytest.raises(ValueError, match="does not exist"):
            language_model.train_lm(str(tmp_path / "lm"), text_files=[str(tmp_path / "none.py")],
                                    mixed_precision=mixed_precision)
        assert keras.config.dtype_policy().name == caller
    finally:
        keras.config.set_dtype_policy("float32")
