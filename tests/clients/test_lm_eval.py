"""lm-eval's `local-completions` model, batched (a list of prompts per request), run unchanged
against the server on two local tasks (lm_eval_tasks/): its loglikelihoods equal transformers
+ peft on the same weights, its generations equal their greedy decoding, and the ledger bills
each prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from testkit.venvs import client_env, run
from tests.clients.conftest import ADAPTER
from tests.utils.hf_reference import greedy_decode, peft_reference, prompt_log_softmax

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
BATCH, MAX_LENGTH, MAX_GEN_TOKS = 8, 256, 8
EOS_IDS = (2, 4)  # the tiny models' generation_config


@pytest.fixture(scope="module")
def lm_eval(client_bins, clients_server):  # the server starts while pip installs
    return client_bins["lm-eval"].result() / "lm_eval"


@pytest.fixture(scope="module")
def evaluation(lm_eval, new_tenant, tmp_path_factory):
    """One `lm_eval run` over both tasks: (tenant, results, samples by task)."""
    tenant = new_tenant("lm-eval")
    out = tmp_path_factory.mktemp("lm-eval")
    model_args = (f"model={ADAPTER},base_url={tenant.url}/v1/completions,"
                  f"tokenizer={tenant.model_dir},tokenizer_backend=huggingface,"
                  f"max_length={MAX_LENGTH}")  # fmt: skip
    run(
        [lm_eval, "run", "--model", "local-completions", "--model_args", model_args,
         "--tasks", "loraplex_mc", "loraplex_gen", "--include_path", TASKS,
         "--batch_size", str(BATCH), "--log_samples", "--output_path", out],
        timeout=300,
        cwd=TASKS,  # the tasks' data_files are relative to it
        env=client_env(OPENAI_API_KEY=tenant.key, HF_HOME=str(out / "hf")),
    )  # fmt: skip
    (folder,) = [p for p in out.iterdir() if p.is_dir() and p.name != "hf"]
    (results,) = folder.glob("results_*.json")
    samples = {
        task: [json.loads(line) for line in next(folder.glob(f"samples_{task}_*.jsonl")).open()]
        for task in ("loraplex_mc", "loraplex_gen")
    }
    return tenant, json.loads(results.read_text())["results"], samples


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The token ids lm-eval sends for a (context, continuation) pair: trailing spaces move to
    the continuation, the pair is encoded whole and split at the context's length."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    ctx = tokenizer(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx) :]


def test_lm_eval_loglikelihoods_equal_transformers_peft(evaluation):
    tenant, results, samples = evaluation
    tokenizer = AutoTokenizer.from_pretrained(tenant.model_dir)
    peft = peft_reference(tenant.model_dir, {ADAPTER: tenant.adapter_dir})
    correct, prompt_tokens = [], 0
    for sample in samples["loraplex_mc"]:
        choices = []
        for args, ((ll, greedy),) in zip(sample["arguments"].values(), sample["resps"],
                                         strict=True):  # fmt: skip
            ctx, cont = encode_pair(tokenizer, args["arg_0"], args["arg_1"])
            ids = ctx + cont
            rows = prompt_log_softmax(peft, ids, ADAPTER)[len(ctx) - 1 :]  # [len(cont), vocab]
            ref = rows[range(len(cont)), cont]
            assert float(ll) == pytest.approx(float(ref.sum()), abs=1e-5), (sample["doc"], args)
            assert (greedy == "True") == bool((rows.argmax(-1) == ref.new_tensor(cont)).all())
            choices.append(float(ref.sum()))
            prompt_tokens += len(ids)
        correct.append(choices.index(max(choices)) == sample["doc"]["answer"])
    assert results["loraplex_mc"]["acc,none"] == pytest.approx(sum(correct) / len(correct))

    gen = samples["loraplex_gen"]
    contexts = [s["arguments"]["gen_args_0"]["arg_0"] for s in gen]
    prompt_tokens += sum(map(len, tokenizer(contexts, add_special_tokens=False).input_ids))
    usage = tenant.usage()  # one prompt of a list is one billed request
    assert usage["requests"] == sum(len(s["resps"]) for s in samples["loraplex_mc"]) + len(gen)
    assert usage["prompt_tokens"] == prompt_tokens


def test_lm_eval_generations_equal_greedy_decoding(evaluation):
    tenant, results, samples = evaluation
    tokenizer = AutoTokenizer.from_pretrained(tenant.model_dir)
    peft = peft_reference(tenant.model_dir, {ADAPTER: tenant.adapter_dir})
    matches = []
    for sample in samples["loraplex_gen"]:
        args = sample["arguments"]["gen_args_0"]
        assert args["arg_1"]["until"] == ["\n"] and args["arg_1"]["max_gen_toks"] == MAX_GEN_TOKS
        prompt = tokenizer(args["arg_0"], add_special_tokens=False).input_ids
        tokens = greedy_decode(peft, prompt, ADAPTER, MAX_GEN_TOKS)["tokens"]
        ends = [i for i, t in enumerate(tokens) if t in EOS_IDS]
        text = tokenizer.decode(tokens[: ends[0] if ends else None], skip_special_tokens=True)
        assert sample["resps"] == [[text.split("\n")[0]]], sample["doc"]
        matches.append(text.split("\n")[0] == sample["doc"]["target"])
    assert results["loraplex_gen"]["exact_match,none"] == sum(matches) / len(matches)
