"""vLLM side of benchmarks/offline.py; runs under the peer virtualenv's python (never ours).

Protocol (one JSON object per line):
  stdin, first line   {"model", "adapters": [paths], "llm": {vllm.LLM keyword arguments}}
  stdin, then         {"cmd": "run", "prompts": [[ids]], "adapters": [index|null], "max_tokens"}
                      {"cmd": "quit"}
  stdout              REPLY_PREFIX + {"ready": true, "init_s", "vllm"} once the engine is up,
                      then REPLY_PREFIX + {"seconds", "output_tokens", "token_ids"} per run.
vLLM logs to stdout too; the parent keeps only the lines that carry REPLY_PREFIX.
"""

import json
import sys
import time

REPLY_PREFIX = "@@bench@@ "


def reply(obj: dict) -> None:
    sys.stdout.write(REPLY_PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    setup = json.loads(sys.stdin.readline())
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    t0 = time.perf_counter()
    llm = LLM(model=setup["model"], **setup["llm"])
    loras = [LoRARequest(f"a{i:02d}", i + 1, p) for i, p in enumerate(setup["adapters"])]
    reply({"ready": True, "init_s": time.perf_counter() - t0, "vllm": vllm.__version__})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        params = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in cmd["prompts"]]
        lora_reqs = [None if i is None else loras[i] for i in cmd["adapters"]]
        if all(r is None for r in lora_reqs):
            lora_reqs = None
        t = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=lora_reqs, use_tqdm=False)
        seconds = time.perf_counter() - t
        token_ids = [list(o.outputs[0].token_ids) for o in outs]
        reply(
            {"seconds": seconds, "output_tokens": sum(map(len, token_ids)), "token_ids": token_ids}
        )


if __name__ == "__main__":  # vLLM starts its engine core in a child process
    main()
