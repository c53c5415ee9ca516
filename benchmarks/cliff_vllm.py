"""vLLM side of `python -m benchmarks.cliff`; runs under the peer virtualenv's python (never ours).

stdin: one JSON job {"model", "adapters": [paths], "trace", "concurrency": [..], "cap_s",
"usable_blocks", "engine": {vllm EngineArgs}}. stdout: REPLY + {"ready", "vllm"} once, then
REPLY + one summary per concurrency (benchmarks/cliff_trace.py's, plus "concurrency"). One engine
(it takes minutes to start), emptied and its prefix cache reset between concurrencies. Tokens
computed come from the `vllm:iteration_tokens_total` histogram (tokens per engine step),
preemptions from `vllm:num_preemptions`, both as differences over a run.
"""

import json
import sys
from pathlib import Path

REPLY = "@@cliff@@ "


def reply(obj: dict) -> None:
    sys.stdout.write(REPLY + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _counters(engine) -> tuple[float, float]:
    tokens = preempted = 0.0
    for m in engine.get_metrics():
        if m.name == "vllm:iteration_tokens_total":
            tokens += m.sum
        elif m.name == "vllm:num_preemptions":
            preempted += m.value
    return tokens, preempted


def main() -> None:
    job = json.loads(sys.stdin.read())
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cliff_trace  # standard library only
    import vllm
    from vllm import EngineArgs, SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.llm_engine import LLMEngine

    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(job["adapters"])]
    engine = LLMEngine.from_engine_args(EngineArgs(model=job["model"], **job["engine"]))
    reply({"ready": True, "vllm": vllm.__version__})

    def add(req: dict) -> None:
        params = SamplingParams(max_tokens=req["max_tokens"], temperature=0.0, ignore_eos=True)
        lora = None if req["adapter"] is None else loras[req["adapter"]]
        engine.add_request(req["id"], {"prompt_token_ids": req["prompt"]}, params,
                           lora_request=lora)  # fmt: skip

    def step():
        return [(o.request_id, len(o.outputs[0].token_ids), o.finished) for o in engine.step()]

    cliff_trace.drive([cliff_trace.warmup(job["trace"])], 1, add, step, job["cap_s"])
    for concurrency in job["concurrency"]:
        before = _counters(engine)
        run = cliff_trace.drive(job["trace"], concurrency, add, step, job["cap_s"])
        after = _counters(engine)
        res = cliff_trace.summarize(run, int(after[0] - before[0]), int(after[1] - before[1]))
        reply({"concurrency": concurrency, **res, "kv_blocks": job["usable_blocks"]})
        # The next concurrency starts clean: nothing running, nothing cached (same prompts).
        engine.abort_request([r["id"] for r in job["trace"]])
        while engine.has_unfinished_requests():
            engine.step()
        engine.reset_prefix_cache()


if __name__ == "__main__":  # vLLM starts its engine core in a child process
    main()
