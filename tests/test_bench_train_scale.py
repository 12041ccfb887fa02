"""``verbatim bench train-scale``: one step on one process and on a team, the same update, less held per rank."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from verbatim.bench import train_scale
from verbatim.bench.prefixflow_exactness import tiny_llama
from verbatim.cli.app import app
from verbatim.errors import BenchmarkError


@pytest.fixture(scope="module")
def tiny_work(tmp_path_factory) -> train_scale.ScaleWork:
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(tied=True, seed=0).save_pretrained(folder)
    return train_scale.ScaleWork(model=str(folder), groups=2, group_size=2, prompt=6, reply=5, microbatch=2,
                                 threads=1)


def _rank(ranks: int, rank: int, **changes: object) -> dict:
    row = {"ranks": ranks, "rank": rank, "backend": "gloo" if ranks > 1 else "none", "threads": 1, "step_s": 2.0,
           "tokens": 40, "loss": 0.5, "grad_norm": 1.25, "params_mib": 100.0 / ranks, "optimizer_mib": 200.0 / ranks,
           "step_peak_mib": 50.0, "load_peak_mib": 20.0, "root_mib": 20.0 if ranks > 1 else 0.0, "parameters": 1000}
    return row | changes


def test_two_ranks_make_the_update_one_process_makes_and_each_holds_half(tiny_work):
    teams = train_scale.run_bench(tiny_work, [2])
    alone, pair = teams
    assert [r["rank"] for r in alone] == [0] and [r["rank"] for r in pair] == [0, 1]
    assert alone[0]["backend"] == "none" and {r["backend"] for r in pair} == {"gloo"}
    assert all(r["tokens"] == 2 * 2 * 5 for team in teams for r in team)
    for r in pair:
        assert r["loss"] == pytest.approx(alone[0]["loss"], rel=1e-4)
        assert r["optimizer_mib"] == pytest.approx(alone[0]["optimizer_mib"] / 2, rel=0.05)  # AdamW's state, sharded
        assert r["params_mib"] == pytest.approx(alone[0]["params_mib"] / 2, rel=0.05)
    assert all(r["load_peak_mib"] is not None and r["load_peak_mib"] >= 0 for team in teams for r in team)
    assert alone[0]["root_mib"] == 0 and all(r["root_mib"] > 0 for r in pair)  # each rank read its own rows
    table = train_scale.markdown_table(teams)
    assert [line.count("|") for line in table.splitlines()] == [16] * 5  # head, rule, three ranks
    assert "| 1.00x |" in table and "| 0.50x |" in table
    text = train_scale.section_text(teams, tiny_work, "verbatim bench train-scale")
    assert "Measured by `verbatim bench train-scale`" in text and "NCCL was not measured" in text


def test_the_floor_is_what_a_rank_holds_with_its_gradient_shard_and_the_root_gathered_with_its_gradient():
    """One process: 100 parameters + 200 AdamW + 100 gradient; each of two ranks: 50 + 100 + 50 + the root's 10
    gathered with its 10 of gradient (``root_mib``, 20)."""
    assert train_scale.floor(_rank(1, 0)) == 400
    assert train_scale.floor(_rank(2, 0)) == 220
    row = train_scale.markdown_table([[_rank(1, 0)], [_rank(2, 0), _rank(2, 1)]]).splitlines()[3]
    assert row.endswith("| 0.55x | 20 |")


def test_a_team_that_makes_another_update_or_holds_as_much_is_an_error_not_a_table():
    alone = [_rank(1, 0)]
    train_scale.check_scaling([alone, [_rank(2, 0), _rank(2, 1)]])
    with pytest.raises(BenchmarkError, match="2 ranks made another update than one process: grad_norm 0.625"):
        train_scale.check_scaling([alone, [_rank(2, 0), _rank(2, 1, grad_norm=0.625)]])  # averaged, not summed
    with pytest.raises(BenchmarkError, match="2 ranks trained 20 tokens, one process 40"):
        train_scale.check_scaling([alone, [_rank(2, 0, tokens=20), _rank(2, 1)]])
    with pytest.raises(BenchmarkError, match="rank 1 of 2 holds 300 MiB .* no less than one process's 300 MiB"):
        train_scale.check_scaling([alone, [_rank(2, 0), _rank(2, 1, params_mib=100.0, optimizer_mib=200.0)]])


def test_a_rank_that_fails_is_an_error_not_a_table(tmp_path):
    work = train_scale.ScaleWork(model=str(tmp_path / "no-model"), threads=1)
    with pytest.raises(BenchmarkError, match=r"the step on 1 rank\(s\) failed \(rank 0: exit code 1\)"):
        train_scale.run_bench(work, [2])


def test_bad_input_is_one_line_before_any_work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train_scale, "run_bench", lambda *a, **k: pytest.fail("the benchmark ran"))
    result = CliRunner().invoke(app, ["bench", "train-scale", "--write", "missing.md"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--write missing.md: no such file" in lines[0], result.output
    result = CliRunner().invoke(app, ["bench", "train-scale", "--dtype", "fp16"])
    assert result.exit_code == 2 and "--dtype fp16: use fp32 or bf16" in result.output, result.output


def test_prefixflow_on_a_team_is_timed_against_whole_sequences_on_the_same_team(tiny_work, monkeypatch):
    """The teams' runs are train-scale's (tested above); here: what is run, compared and tabled."""
    from verbatim.bench import prefixflow_team

    runs = []

    def run_team(work, ranks):
        runs.append((work.prefixflow, ranks))
        seconds = (4.0 if work.prefixflow else 10.0) * (1 if ranks == 1 else 0.6)
        return [_rank(ranks, r, step_s=seconds + r, grad_norm=1.25 + 1e-7 * work.prefixflow) for r in range(ranks)]

    monkeypatch.setattr(prefixflow_team, "run_team", run_team)
    rows = prefixflow_team.run_bench(tiny_work, [2])
    assert runs == [(False, 1), (True, 1), (False, 2), (True, 2)]  # both paths on each team size
    assert [r["ranks"] for r in rows] == [1, 2] and rows[0]["speedup"] == 10.0 / 4.0
    assert rows[1]["full_s"] == pytest.approx(7.0) and rows[1]["prefixflow_s"] == pytest.approx(3.4)  # slowest rank
    assert rows[1]["of_one_process"] == pytest.approx((7.0 / 3.4) / 2.5)
    assert [line.count("|") for line in prefixflow_team.markdown_table(rows).splitlines()] == [6] * 4

    def another_update(work, ranks):
        return [_rank(ranks, 0, grad_norm=2.0 if work.prefixflow else 1.25)]

    monkeypatch.setattr(prefixflow_team, "run_team", another_update)
    with pytest.raises(BenchmarkError, match="PrefixFlow made another update than whole sequences: gradient norm 2"):
        prefixflow_team.run_bench(tiny_work, [2])
