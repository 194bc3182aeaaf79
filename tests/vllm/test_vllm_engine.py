"""redraft's proposer inside vLLM's engine (the CPU build, `make test-vllm`), on the real default
target exported as the HF folder vLLM loads: greedy float32 output equals vLLM's plain greedy
output token for token, the proposer really proposes (vLLM's own spec-decode counters), and a
bad artifact stops vLLM at start-up with redraft's message."""

import os

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm")

pytestmark = pytest.mark.slow

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
MEMORY = 0.12  # of the machine's memory, per engine (weights + KV cache)
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from redraft.vllm.export import export_target

    return export_target("default", tmp_path_factory.mktemp("vllm") / "smollm2")


@pytest.fixture(scope="module")
def tables(default_target, tmp_path_factory):
    from vllm_helpers import save_test_tables

    return save_test_tables(tmp_path_factory.mktemp("vllm") / "ngrams", default_target)


@pytest.fixture(scope="module")
def prompts(default_target):
    """5 held-out ShareGPT chats and 5 HumanEval prompts, as token ids."""
    from redraft.data.prompts import load_prompts

    chats = [default_target.chat_ids(p) for p in load_prompts("chat", 5)]
    code = [
        default_target.tokenizer(p, add_special_tokens=False)["input_ids"]
        for p in load_prompts("code", 5)
    ]
    return [ids[-400:] for ids in chats + code]  # the prompt's tail is all the test needs


def _generate(llm, prompts):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _llm(model_dir, spec=None):
    return vllm.LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        gpu_memory_utilization=MEMORY,
        max_model_len=1024,
        speculative_config=spec,
        disable_log_stats=False,
        seed=0,
    )


def _counter(llm, name):
    return sum(getattr(m, "value", 0) or 0 for m in llm.get_metrics() if m.name == name)


@pytest.fixture(scope="module")
def plain_outputs(model_dir, prompts):
    llm = _llm(model_dir)
    try:
        return _generate(llm, [p for p in prompts])
    finally:
        del llm


def test_greedy_output_equals_vllm_plain_and_the_proposer_proposes(
    model_dir, tables, prompts, plain_outputs
):
    from redraft.vllm import speculative_config

    llm = _llm(model_dir, speculative_config(5, ngrams=str(tables)))
    # one request at a time (batch 1) and all together (rows join and leave the batch)
    single = [_generate(llm, [p])[0] for p in prompts]
    together = _generate(llm, prompts)
    assert single == plain_outputs
    assert together == plain_outputs
    assert all(len(o) == NEW_TOKENS or o[-1] == 2 for o in plain_outputs)  # real decodes
    drafted = _counter(llm, "vllm:spec_decode_num_draft_tokens")
    accepted = _counter(llm, "vllm:spec_decode_num_accepted_tokens")
    assert drafted > 0 and accepted > 0, (drafted, accepted)


def test_missing_tables_stop_vllm_at_start_with_the_path(model_dir, tmp_path, capfd):
    from redraft.vllm import speculative_config

    missing = tmp_path / "no-such-ngrams"
    with pytest.raises(RuntimeError):  # vLLM: "Engine core initialization failed"
        _llm(model_dir, speculative_config(5, ngrams=str(missing)))
    # the worker's root cause, as vLLM logs it: redraft's message, with the path
    cap = capfd.readouterr()
    err = cap.out + cap.err
    assert "REDRAFT_VLLM_CONFIG: ngrams=" in err and "no-such-ngrams" in err
