import keras

from tfformer.recipes import rundir


def test_begin_sets_the_policy_of_this_run_whatever_the_last_one_set(tmp_path):
    rundir.begin(str(tmp_path / "mixed"), mixed_precision=True)
    assert keras.config.dtype_policy().name == "mixed_bfloat16"
    rundir.begin(str(tmp_path / "plain"), mixed_precision=False)
    assert keras.config.dtype_policy().name == "float32"
