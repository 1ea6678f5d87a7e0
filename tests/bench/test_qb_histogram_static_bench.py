"""bench/qb_histogram_static.py on this host: Triton 3.6's tl.histogram, compiled for sm_90,
costs n_bins / 32 POPC a counted element (its warp-ballot lowering), so at the op's 1000 bins
(1024) one element costs 32 POPC and over 20 times the SASS of the op's one relaxed global atomic
(one REDG). --aggregation's blocks leave fewer distinct (expert, bin) pairs the more tokens they
sum (its bins checked against qb_histogram's inside). A misspelt --candidates is one argparse
error."""

import json

import pytest

from tests.bench_scripts import BENCH, load_bench


@pytest.fixture
def qb_histogram_static(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # it imports its neighbours as scripts
    return load_bench("qb_histogram_static")


def test_histogram_cost_grows_with_bins_and_dwarfs_one_atomic(qb_histogram_static, tmp_path):
    out = tmp_path / "qb_histogram_static.json"
    argv = ["--candidates", "atomic,hist 256,hist 1024", "--out", str(out)]
    assert qb_histogram_static.main(argv) == 0
    atomic, hist_256, hist_1024 = json.loads(out.read_text())["rows"]
    assert atomic["redg_per_element"] == 1 and atomic["popc_per_element"] == 0
    for row in (hist_256, hist_1024):
        assert row["popc_per_element"] == row["n_bins"] / 32 and row["redg_per_element"] == 0
        assert row["spill_bytes"] == 0
    assert hist_1024["sass_per_element"] > 20 * atomic["sass_per_element"]
    assert hist_1024["sass_per_element"] > 3 * hist_256["sass_per_element"]


def test_aggregation_leaves_fewer_atomics_for_larger_blocks(qb_histogram_static, tmp_path):
    out = tmp_path / "qb_histogram_static.json"
    argv = ["--candidates", "atomic", "--shape", "512,64", "--routing", "4,256,1000",
            "--aggregation", "--blocks", "8,64,512", "--out", str(out)]
    assert qb_histogram_static.main(argv) == 0
    _, *blocks = json.loads(out.read_text())["rows"]
    assert [row["aggregation_block"] for row in blocks] == [8, 64, 512]
    left = [row["atomics_left"] for row in blocks]
    assert 1 >= left[0] > left[1] > left[2] > 0


def test_unknown_candidate_names_the_flag(qb_histogram_static, capsys):
    with pytest.raises(SystemExit):
        qb_histogram_static.main(["--candidates", "atomic,hist 999"])
    assert "--candidates" in capsys.readouterr().err
