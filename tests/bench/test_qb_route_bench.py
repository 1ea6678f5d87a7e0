"""bench/qb_route.py --static on this host: the routing op's own launch shape at K3's routing
(E 896, k 16), compiled for sm_90 as the launcher specializes it (16-byte-aligned pointers, E
divisible by 16), keeps a token row in one warp (2 barriers a program, no spill; eight warps over
four rows, the launch before, take 136) and issues fewer SASS instructions a row, which the same
run compiles as the reference. A malformed --launch-shapes is one argparse error."""

import json

import pytest

from tests.bench_scripts import BENCH, load_bench


@pytest.fixture
def qb_route(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # it imports its neighbours as scripts
    return load_bench("qb_route")


def test_own_launch_shape_has_no_barrier_no_spill_and_fewer_instructions(qb_route, tmp_path):
    out = tmp_path / "qb_route.json"
    argv = ["--static", "--shape", "64,896,16,64", "--launch-shapes", "4,8", "--maxnreg", "168",
            "--out", str(out)]
    assert qb_route.main(argv) == 0
    own, eight_warps, capped = json.loads(out.read_text())["rows"]
    assert own["launch"] == [1, 1] and eight_warps["launch"] == [4, 8]
    # One warp's barriers are its layout conversions, not its reductions (each of those cost
    # eight warps two): at least ten times fewer.
    assert own["spill_bytes"] == 0 and 10 * own["barriers"] < eight_warps["barriers"]
    assert own["sass_per_row"] < eight_warps["sass_per_row"]
    # The cap binds (the op's own launch takes more than 168 registers, with the lane top-4
    # picks) and costs no spill.
    assert capped["launch"] == [1, 1] and capped["maxnreg"] == 168
    assert capped["registers"] <= 168 < own["registers"] and capped["spill_bytes"] == 0


@pytest.mark.parametrize("spec", ["3,1", "1", "0,2"])
def test_bad_launch_shapes_name_the_flag(qb_route, spec, capsys):
    with pytest.raises(SystemExit):
        qb_route.main(["--static", "--launch-shapes", spec])
    assert "--launch-shapes" in capsys.readouterr().err
