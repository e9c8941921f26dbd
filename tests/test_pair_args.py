import pytest

from mlx_edge0.bench.pair_args import option_value, with_option_value


def test_an_option_is_read_in_either_spelling():
    args = ["--edge0", "/d/e", "--arms=a,b", "--cache", "cold"]
    assert option_value(args, "--edge0") == "/d/e"
    assert option_value(args, "--arms") == "a,b"
    assert option_value(args, "--stock") is None
    assert option_value(["--edge0"], "--edge0") is None  # a name with no value after it
    assert option_value(["--edge0-x", "v"], "--edge0") is None  # another option's prefix


def test_an_option_is_replaced_in_its_own_spelling_in_a_copy():
    args = ["--edge0", "/d/e", "--arms=a,b"]
    assert with_option_value(args, "--edge0", "/d/f") == ["--edge0", "/d/f", "--arms=a,b"]
    assert with_option_value(args, "--arms", "b,a") == ["--edge0", "/d/e", "--arms=b,a"]
    assert args == ["--edge0", "/d/e", "--arms=a,b"]
    with pytest.raises(ValueError, match="give no --stock"):
        with_option_value(args, "--stock", "/d/s")
