"""The compiled host kernels are compiled before decoding, not in its first steps."""

import pytest

from redraft.infer.spec import hostjit

KERNELS = (  # the kernels Python calls (helpers such as _rank_bucket compile into them)
    "_tree_nodes",
    "_tree_fill",
    "_ngram_rows",
    "_walk",
    "_feedback",
    "_stats_values",
    "_stats_update",
    "_best_budget",
    "_beam_groups",
    "_plan_beam",
)


def _compiled() -> dict:
    return {name: len(getattr(hostjit, name).signatures) for name in KERNELS}


def test_building_a_decoder_compiles_every_kernel_a_decode_then_uses(tmp_path):
    """After ``warm_host_kernels`` (which building a speculative decoder calls), decoding with
    N-Grammys, the context drafter and a ReDrafter head (auto width and length: its plans),
    plain steps included, at one and at three rows, needs no new signature: nothing compiles
    inside a step."""
    if not hostjit.ENABLED:
        pytest.skip("numba is not installed or REDRAFT_JIT=0")
    from redraft.bench.overhead import _prompts, make_method, tiny_setup
    from redraft.infer.config import SamplingParams
    from redraft.infer.decoder import warm_host_kernels

    warm_host_kernels()
    before = _compiled()
    assert all(before.values()), before  # every kernel has a signature already
    target, tables = tiny_setup(tmp_path)
    for method in ("ngrammys", "context-16", "redrafter", "greedy"):
        dec = make_method(method, target, tables)
        dec.eos = set()
        for B in (1, 3):
            eng = dec.engine(text=False)
            for q in _prompts(target, B):
                eng.add(q, SamplingParams.checked(max_new_tokens=40))
            while eng.has_work:
                eng.step()
    assert _compiled() == before


def test_status_names_what_runs(monkeypatch):
    if hostjit.numba is None:
        assert hostjit.status().startswith("numpy (numba unavailable")
        return
    monkeypatch.setenv("REDRAFT_JIT", "0")
    assert hostjit.status().startswith("numpy (REDRAFT_JIT=0; numba ")
    monkeypatch.setenv("REDRAFT_JIT", "1")
    monkeypatch.setattr(hostjit, "ENABLED", True)
    assert hostjit.status() == f"numba {hostjit.numba.__version__}"
    monkeypatch.setattr(hostjit, "ENABLED", False)
    assert hostjit.status() == "numpy (compiled kernels turned off)"
